#!/usr/bin/env bash
# Wheels that a GPU machine without network needs for benchmarks/run_gpu.sh, fetched here
# into .whl/ (git-ignored): MPI (mpich, mpi4py) for the test of ranks sharing the GPU, and
# CuPy for CUDA 12 and 13 (run_gpu.sh installs whichever the driver wants, when the machine
# has no CuPy of its own). Its torch, numpy and networkx are the machine's.
#
#     bash benchmarks/fetch_gpu_wheels.sh [PYTHON_VERSION]     # default 3.12
#
# then carry .whl/ with the working tree and run `bash benchmarks/run_gpu.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
mkdir -p .whl
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
    plats+=(--platform "$p")
done
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${plats[@]}" -d .whl "$@"
}
fetch "mpich==5.0.2" "mpi4py==4.1.2"
# CuPy is large (~100 MB each); only when asked, since the lent machines carry cupy-cuda13x
if [ -n "${WITH_CUPY:-}" ]; then
    fetch cupy-cuda12x cupy-cuda13x fastrlock
fi
ls -la .whl
