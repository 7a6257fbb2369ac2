#!/usr/bin/env bash
# The GPU checks in one command, from the repository root of a machine with an NVIDIA GPU:
#
#     bash benchmarks/run_gpu.sh            # outputs under $OUT if set, else out/gpu/
#     QUICK=1 bash benchmarks/run_gpu.sh    # smaller benchmark
#     SKIP_TESTS=1 / SKIP_BENCH=1           # one half only (each half stays under ~5 minutes)
#
# 1. picks a Python whose torch sees CUDA ($PYTHON, .venv/bin/python, python3);
# 2. installs CuPy if it is missing: cupy-cuda12x or cupy-cuda13x by nvidia-smi's CUDA version
#    (from wheels in .whl/ when that folder exists, for machines without network);
# 3. installs meshcomm (editable, no dependencies) if that Python cannot import it, and MPI
#    (mpich, mpi4py) from .whl/ when mpiexec is missing;
# 4. compiles every .cu with nvcc for sm_80 and sm_90 (python -m meshcomm.cuda.build --check);
# 5. runs the GPU tests (pytest -m gpu: tests/test_gpu.py, tests/test_gpu_reshard.py) and the
#    CPU tests of the kernels' code;
# 6. runs the pack/unpack benchmark, the 1 GiB reshard and the host overhead per call of a small
#    reshard (benchmarks/gpu_pack.py), and where the host time of one launch goes
#    (benchmarks/gpu_launch_profile.py).
# Exits non-zero when a step fails. To watch the stream fence matter: the test
# test_without_fence_the_race_shows runs the fenced test's reshard with fence=False
# (python -m pytest -m gpu -k without_fence tests/test_gpu.py; cuda/executor.py's
# UNSAFE_NO_FENCE module attribute drops the fence everywhere)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-out/gpu}
mkdir -p "$OUTDIR"
status=0

PY=""
for c in ${PYTHON:-} .venv/bin/python python3 python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=$c; break
    fi
done
if [ -z "$PY" ]; then
    echo "run_gpu.sh: no Python here has a torch that sees a CUDA GPU" | tee "$OUTDIR/gpu-tests.txt"
    exit 1
fi
echo "python: $(command -v "$PY") ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'))"
nvidia-smi > "$OUTDIR/nvidia-smi.txt" 2>&1 || true
head -n 12 "$OUTDIR/nvidia-smi.txt"

if ! (cd / && "$PY" -c "import cupy") 2>/dev/null; then
    major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
    [ -z "$major" ] && major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
    [ "$major" -ge 13 ] 2>/dev/null && pkg=cupy-cuda13x || pkg=cupy-cuda12x
    echo "installing $pkg"
    if [ -d .whl ]; then
        "$PY" -m pip install -q --no-index --find-links .whl "$pkg" || status=1
    else
        "$PY" -m pip install -q "$pkg" || status=1
    fi
fi
"$PY" -c "import cupy; print('cupy', cupy.__version__)" || { echo "CuPy missing: kernel tests will skip"; status=1; }

# worker scripts run from temporary folders: meshcomm must import from anywhere, not only here
if ! (cd / && "$PY" -c "import meshcomm.cuda, meshcomm.planners, meshcomm.backends") 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
        || { "$PY" -m pip install -q --no-deps --no-build-isolation --target /tmp/meshcomm-site . \
             && export PYTHONPATH=/tmp/meshcomm-site${PYTHONPATH:+:$PYTHONPATH}; }
fi

# MPI for the test of ranks sharing the GPU: from carried wheels (.whl/mpich-*.whl, and
# .whl/mpi4py-*.whl if this Python's mpi4py cannot load an MPI) when mpiexec is missing
bindir=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
if ! command -v mpiexec >/dev/null 2>&1 && [ ! -x "$bindir/mpiexec" ] && ls .whl/mpich-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps .whl/mpich-*.whl || true
fi
if ! "$PY" -c "from mpi4py import MPI" 2>/dev/null && ls .whl/mpi4py-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --force-reinstall .whl/mpi4py-*.whl || true
fi
"$PY" -c "from mpi4py import MPI; print('mpi4py', MPI.Get_library_version().splitlines()[0])" 2>/dev/null \
    || echo "no working mpi4py: the MPI-on-GPU test will skip"

echo "== nvcc compile check"
"$PY" -m meshcomm.cuda.build --check --verbose 2>&1 | tee "$OUTDIR/build.txt" || status=1

echo "== GPU tests"
export MESHCOMM_TIMEOUT=${MESHCOMM_TIMEOUT:-60}
[ -n "${SKIP_TESTS:-}" ] || timeout 330 "$PY" -m pytest -q -rA -p no:cacheprovider --timeout=240 --junitxml="$OUTDIR/gpu-tests.xml" \
    -m "gpu or not slow" tests/test_gpu.py tests/test_gpu_reshard.py tests/test_pack.py tests/test_cuda_compile.py \
    2>&1 | tee "$OUTDIR/gpu-tests.txt" || status=1

echo "== benchmark"
[ -n "${SKIP_BENCH:-}" ] || timeout 300 "$PY" benchmarks/gpu_pack.py ${QUICK:+--quick} --json "$OUTDIR/gpu_pack.json" \
    2>&1 | tee "$OUTDIR/gpu_pack.txt" || status=1

echo "== host time of one kernel launch"
[ -n "${SKIP_BENCH:-}" ] || timeout 120 "$PY" benchmarks/gpu_launch_profile.py 2>&1 | tee "$OUTDIR/launch_profile.txt" || status=1

echo "run_gpu.sh: done, status $status; outputs in $OUTDIR"
exit $status
