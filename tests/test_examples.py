"""The examples train for real and match a single-process run (their --check mode).

One launch per process count runs several examples (start-up with torch costs seconds).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "workers_alltoall" / "run_examples.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def run(specs, nproc=None, timeout=240):
    env = dict(os.environ, MESHCOMM_TIMEOUT="90", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(RUNNER), *specs]
    if nproc is not None:
        cmd = [str(MPIEXEC), "-n", str(nproc)] + cmd
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    out = r.stdout + r.stderr
    codes = {}
    for k, rank, code in re.findall(r"RESULT (\d+) (\d+) (-?\d+)", r.stdout):
        codes.setdefault(int(k), {})[int(rank)] = int(code)
    return r, out, codes


def check_line(out, name):
    m = re.findall(rf"\[{name}\] check: largest difference vs single process (\S+) .*? (OK|FAILED)", out)
    assert m, f"no check line for {name}:\n{out[-3000:]}"
    return m


def test_examples_single_process():
    specs = ["moe --check --steps 2", "dlrm --check --steps 2", "pipelined_gpt --check --steps 2"]
    r, out, codes = run(specs, timeout=120)
    assert r.returncode == 0, out[-4000:]
    assert all(codes[k] == {0: 0} for k in range(3)), out[-4000:]
    for name in ("moe", "dlrm", "gpt"):
        assert check_line(out, name)[0][1] == "OK"
    assert re.search(r"\[moe\] [\d,.]+ samples/s \| step .* ms/step, .* KiB/step sent", out)


@pytest.mark.mpi
def test_examples_mpiexec_n4():
    specs = ["moe --check --steps 2", "dlrm --check --steps 2",
             "pipelined_gpt --check --steps 2 --schedule 1f1b",
             "pipelined_gpt --check --steps 2 --schedule eager",
             "moe --check --steps 1 --tol 0"]          # the check can fail: float differences > 0
    r, out, codes = run(specs, nproc=4)
    for k in range(4):
        assert codes.get(k) == {q: 0 for q in range(4)}, f"example {specs[k]}: {codes.get(k)}\n{out[-4000:]}"
    assert 1 in codes[4].values(), out[-3000:]
    for name in ("moe", "dlrm", "gpt"):
        diff, ok = check_line(out, name)[0]
        assert ok == "OK" and float(diff) < 1e-4
    assert "stages (devices, TP degree, layers): [((0,), 1, (0, 2)), ((1, 2), 2, (2, 4)), ((3,), 1, (4, 6))]" in out
    # DLRM sends real bytes between ranks; the summary line reports them
    kib = re.findall(r"\[dlrm\] .* ([\d.]+) KiB/step sent", out)
    assert kib and float(kib[0]) > 0


@pytest.mark.mpi
def test_pipelined_gpt_mpiexec_n8():
    specs = ["pipelined_gpt --check --steps 2 --schedule eager",
             "pipelined_gpt --check --steps 1 --schedule 1f1b --micro 3",
             "dlrm --check --steps 1"]                   # 6 tables on 8 ranks: two hold none
    r, out, codes = run(specs, nproc=8)
    for k in range(3):
        assert codes.get(k) == {q: 0 for q in range(8)}, f"{specs[k]}: {codes.get(k)}\n{out[-4000:]}"
    assert "((2, 3, 4, 5), 4, (2, 4))" in out            # a TP=4 stage between two TP=2 stages
    assert all(ok == "OK" for _, ok in check_line(out, "gpt"))
    assert check_line(out, "dlrm")[0][1] == "OK"


def _gpt_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pipelined_gpt_example", ROOT / "examples" / "pipelined_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "examples"))
    env = os.environ.get("MESHCOMM_CHECK")
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "examples"))
        if env is None:
            os.environ.pop("MESHCOMM_CHECK", None)
    return mod


@pytest.mark.parametrize("kind", ["1f1b", "eager"])
@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 4), (3, 4), (4, 2), (4, 8)])
def test_pipeline_schedules_are_complete_and_ordered(kind, stages, micro):
    g = _gpt_module()
    for s in range(stages):
        ops = g.schedule(kind, s, stages, micro)
        assert sorted(ops) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(micro))
        warm = next(k for k, op in enumerate(ops) if op[0] == "B")     # forwards before the first backward
        base = stages - s - 1
        assert warm == min(micro, (base if kind == "1f1b" else 2 * base) + 1)
    order = g.comm_order(kind, stages, micro)
    assert len(order) == len(set(order)) == 2 * (stages - 1) * micro
    # a stage produces its transfers in its own program order
    for s in range(stages - 1):
        acts = [c for c in order if c[0] == "A" and c[1] == s]
        assert [c[2] for c in acts] == list(range(micro))


@pytest.mark.mpi
@pytest.mark.slow
def test_examples_torch_backend_n4():
    """The same checks over torch.distributed (gloo): the pipeline creates its groups up front."""
    specs = ["pipelined_gpt --check --steps 1 --backend torch", "moe --check --steps 1 --backend torch",
             "dlrm --check --steps 1 --backend torch"]
    r, out, codes = run(specs, nproc=4)
    for k in range(3):
        assert codes.get(k) == {q: 0 for q in range(4)}, f"{specs[k]}: {codes.get(k)}\n{out[-4000:]}"
