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
