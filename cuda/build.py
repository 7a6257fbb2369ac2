"""Ahead-of-time checks of the CUDA sources (the kernels themselves load at run time via CuPy).

    python -m meshcomm.cuda.build --check            # every .cu for sm_80 and sm_90
    python -m meshcomm.cuda.build --check --arch sm_90 --verbose

Compiles each .cu in this folder with nvcc (`-cubin -arch=sm_XX`, into a temporary folder),
prints one line per file and architecture, and exits 1 if any fails. Without nvcc it says so and
exits 0. `build_host_emulator` builds pack.cu as plain C++ (MC_HOST_EMULATION) into a shared
library that runs the kernels' code on the CPU, for tests on machines without a GPU.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["cuda_sources", "find_nvcc", "compile_check", "ptx_of", "global_accesses", "build_host_emulator", "main"]

HERE = Path(__file__).resolve().parent
DEFAULT_ARCHS = ("sm_80", "sm_90")


def cuda_sources() -> list[Path]:
    return sorted(HERE.glob("*.cu"))


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return None


def compile_check(src: Path, arch: str, nvcc: str, outdir: Path, verbose: bool = False,
                  timeout: float = 300) -> tuple[bool, str, float]:
    """Compile `src` to a cubin for `arch`; (ok, compiler output, seconds)."""
    out = outdir / f"{src.stem}.{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Werror=all-warnings", "-o", str(out), str(src)]
    if verbose:
        cmd.insert(1, "-Xptxas=-v")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"nvcc timed out after {timeout} s", time.perf_counter() - t0
    ok = r.returncode == 0 and out.exists() and out.stat().st_size > 0
    return ok, (r.stdout + r.stderr).strip(), time.perf_counter() - t0


def ptx_of(src: Path, arch: str, nvcc: str, outdir: Path, timeout: float = 300) -> str:
    """The PTX nvcc makes of `src` for `arch` (to inspect the loads and stores it issues)."""
    out = Path(outdir) / f"{src.stem}.{arch}.ptx"
    cmd = [nvcc, "--ptx", f"-arch={arch}", "-std=c++17", "-o", str(out), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return out.read_text()


def global_accesses(ptx: str) -> dict[str, set[str]]:
    """{kernel: {"ld.global.nc.v4.u32", "st.global.v4.u32", ...}} from PTX text."""
    import re
    found: dict[str, set[str]] = {}
    kernel = None
    for line in ptx.splitlines():
        m = re.match(r"\.visible \.entry (\w+)\(", line.strip())
        if m:
            kernel = m.group(1)
            found[kernel] = set()
            continue
        m = re.search(r"\b((?:ld|st)\.global[.\w]*)", line)
        if m and kernel:
            found[kernel].add(m.group(1))
    return found


def build_host_emulator(outdir: str | os.PathLike, cxx: str | None = None, timeout: float = 120) -> Path:
    """Build pack.cu as C++ with MC_HOST_EMULATION: a .so whose mc_* functions run the kernels'
    code for every (virtual) thread in turn. Raises RuntimeError when no C++ compiler works."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++/c++/clang++) on PATH")
    src = HERE / "pack.cu"
    lib = Path(outdir) / "mc_pack_host.so"
    cmd = [cxx, "-x", "c++", "-std=c++17", "-O1", "-fPIC", "-shared", "-DMC_HOST_EMULATION",
           "-Wall", "-Wno-unknown-pragmas", "-o", str(lib), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshcomm.cuda.build", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compile every .cu (the only action so far)")
    ap.add_argument("--arch", action="append", help="target, e.g. sm_90 (repeatable; default sm_80 and sm_90)")
    ap.add_argument("--verbose", action="store_true", help="show ptxas resource usage")
    args = ap.parse_args(argv)
    if not args.check:
        ap.print_help()
        return 0
    archs = tuple(args.arch or DEFAULT_ARCHS)
    srcs = cuda_sources()
    nvcc = find_nvcc()
    if nvcc is None:
        print("nvcc not found: skipping the CUDA compile check (install the CUDA toolkit to run it)")
        return 0
    if not srcs:
        print(f"no .cu files in {HERE}")
        return 0
    failures = 0
    with tempfile.TemporaryDirectory(prefix="meshcomm-cuda-") as tmp:
        for src in srcs:
            for arch in archs:
                ok, log, secs = compile_check(src, arch, nvcc, Path(tmp), args.verbose)
                print(f"{'ok  ' if ok else 'FAIL'} {src.name:<16} {arch:<7} {secs:5.1f} s")
                if log and (args.verbose or not ok):
                    print("    " + log.replace("\n", "\n    "))
                failures += not ok
    print(f"{len(srcs) * len(archs) - failures}/{len(srcs) * len(archs)} compiled with {nvcc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
