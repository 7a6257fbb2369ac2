"""Every .cu in cuda/ compiles with nvcc for sm_80 and sm_90 (skipped where nvcc is absent)."""
from __future__ import annotations

import pytest

from meshcomm.cuda import build

NVCC = build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")


def test_sources_exist():
    names = [p.name for p in build.cuda_sources()]
    assert "pack.cu" in names


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_cu_compiles(arch, tmp_path):
    for src in build.cuda_sources():
        ok, log, _ = build.compile_check(src, arch, NVCC, tmp_path)
        assert ok, f"{src.name} for {arch}:\n{log}"
        assert (tmp_path / f"{src.stem}.{arch}.cubin").stat().st_size > 1000


@needs_nvcc
def test_check_reports_a_broken_source(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k(int* p) { p[0] = undefined_name; }\n')
    ok, log, _ = build.compile_check(bad, "sm_80", NVCC, tmp_path)
    assert not ok and "undefined_name" in log


def test_check_skips_without_nvcc(monkeypatch, capsys):
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert build.main(["--check"]) == 0
    assert "nvcc not found" in capsys.readouterr().out


@needs_nvcc
def test_kernels_issue_16_byte_loads_and_stores(tmp_path):
    """Every kernel has a 16-byte load and store path; the copy kernels have one per
    unit width (16, 8, 4, 2, 1 bytes), and reads go through the read-only path (.nc)."""
    from meshcomm.cuda.kernels import KERNEL_NAMES
    acc = build.global_accesses(build.ptx_of(build.HERE / "pack.cu", "sm_90", NVCC, tmp_path))
    assert set(KERNEL_NAMES) <= set(acc)
    def wide(op):          # 16 bytes: four 32-bit or two 64-bit lanes
        return (".v4." in op and op.endswith("32")) or (".v2." in op and op.endswith("64"))

    for name in KERNEL_NAMES:
        ops = acc[name]
        assert any(wide(o) and o.startswith("ld.global.nc.") for o in ops), (name, sorted(ops))
        assert any(wide(o) and o.startswith("st.global.") for o in ops), (name, sorted(ops))
    for name in ("mc_pack", "mc_unpack"):
        assert {"st.global.v4.u32", "st.global.v2.u32", "st.global.u32", "st.global.u16",
                "st.global.u8"} <= acc[name], sorted(acc[name])


def test_checkout_root_on_sys_path_does_not_hide_nvidias_cuda_namespace(tmp_path):
    """`cuda/` at the repository's top level is a regular package; with the checkout's root on
    sys.path (`python -m pytest` run there) it must not hide NVIDIA's `cuda` namespace package
    (cuda.pathfinder, cuda.bindings: CuPy imports them). A stand-in portion of that namespace
    sits in another sys.path entry; both it and meshcomm.cuda must import."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    site = tmp_path / "site"
    (site / "cuda" / "pathfinder").mkdir(parents=True)          # a namespace portion: no cuda/__init__.py
    (site / "cuda" / "pathfinder" / "__init__.py").write_text("WHERE = 'nvidia'\n")
    code = ("import cuda.pathfinder, meshcomm.cuda; assert cuda.pathfinder.WHERE == 'nvidia'; "
            "assert callable(meshcomm.cuda.pack_cuda); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": f"{root}:{site}"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
