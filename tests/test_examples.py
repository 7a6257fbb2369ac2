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
    specs = ["moe --check --steps 2", "dlrm --check --steps 2", "pipelined_gpt --check --steps 2",
             "fsdp --check --steps 2 --layers 1"]
    r, out, codes = run(specs, timeout=120)
    assert r.returncode == 0, out[-4000:]
    assert all(codes[k] == {0: 0} for k in range(4)), out[-4000:]
    for name in ("moe", "dlrm", "gpt", "fsdp uncompressed"):
        assert check_line(out, name)[0][1] == "OK"
    assert re.search(r"\[moe\] [\d,.]+ samples/s \| step .* ms/step, .* KiB/step sent", out)


@pytest.mark.mpi
def test_examples_mpiexec_n4():
    specs = ["moe --check --steps 2", "dlrm --check --steps 2",
             "pipelined_gpt --check --steps 2 --schedule 1f1b",
             "pipelined_gpt --check --steps 2 --schedule eager",
             "moe --check --steps 1 --tol 0",          # the check can fail: float differences > 0
             # 4 tokens for 8 experts: some ranks get none (their backward all-to-alls were
             # skipped by autograd: "not in the same call")
             "moe --check --steps 2 --batch 4 --seq 1 --d 4"]
    r, out, codes = run(specs, nproc=4)
    for k in (0, 1, 2, 3, 5):
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


@pytest.mark.mpi
def test_fsdp_mpiexec_n4_check_log_and_backend(tmp_path):
    """Losses and gradients of the uncompressed run against one process at the default --tol;
    the compressed run reported; every call tagged and as meshcomm.model counts it; --backend
    torch; the check can fail. (Two launches: fsdp.py run twice in one process hangs at its
    second run's first all-gather.)"""
    from meshcomm.tools import log_cmd
    from meshcomm.tools.cli import main as cli
    r, out, codes = run([f"fsdp --check --steps 2 --layers 2 --log {tmp_path / 'mpi'}"], nproc=4, timeout=400)
    assert codes.get(0) == {q: 0 for q in range(4)}, out[-4000:]
    (diff, ok), = check_line(out, "fsdp uncompressed")
    assert ok == "OK" and float(diff) < 1e-4 and "(tolerance 0.0001)" in out      # the README's tolerance
    assert "[uncompressed] step 0 loss" in out and "[None]" not in out
    assert re.search(r"\[fsdp zfp\(rate=16\)\] vs single process: largest loss difference \S+, gradient \S+ "
                     r"\(lossy codec: reported at no tolerance", out)
    assert "all match" in out and "MISMATCH" not in out
    recs = log_cmd.read(tmp_path / "mpi").records
    assert {x["tag"] for x in recs} == {"fsdp.gather", "fsdp.grad", "dp.loss"}
    assert {x["backend"] for x in recs} == {"mpi"}
    assert cli(["log", "compare", str(tmp_path / "mpi"), "--example", "fsdp", "--set", "layers=2"]) == 0
    spec = f"fsdp --check --steps 1 --layers 1 --compression none --backend torch --tol 0 --log {tmp_path / 'torch'}"
    r, out, codes = run([spec], nproc=4, timeout=400)
    assert 1 in codes[0].values() and check_line(out, "fsdp uncompressed")[0][1] == "FAILED", out[-3000:]
    assert {x["backend"] for x in log_cmd.read(tmp_path / "torch").records} == {"torch"}


def test_checks_fail_on_nan_and_on_nothing_compared(monkeypatch):
    """A NaN difference fails a check (Python's max dropped it unless it came first), and
    --steps must be at least 1 (--steps 0 compared nothing and said OK)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from _common import base_parser, worst
    assert worst([0.0, float("nan"), 1.0]) != worst([0.0, float("nan"), 1.0])     # NaN
    assert worst([1e-9, 3.0]) == 3.0 and worst([]) == 0.0
    with pytest.raises(SystemExit):
        base_parser("doc").parse_args(["--steps", "0"])


@pytest.mark.parametrize("name", ["dlrm", "moe", "pipelined_gpt", "fsdp"])
def test_help_says_whole_sentences_once(name, monkeypatch, capsys):
    """The description is the docstring's first paragraph, the epilog its command lines; under
    a launcher only rank 0 prints (--help, a bad flag), every rank exits alike."""
    import ast
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from _common import base_parser
    finally:
        sys.path.remove(str(ROOT / "examples"))
    doc = ast.get_docstring(ast.parse((ROOT / "examples" / f"{name}.py").read_text()))
    first, usage = doc.split("\n\n")[:2]
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"):
        monkeypatch.delenv(var, raising=False)
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("PMI_RANK", rank)
        p = base_parser(doc)
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert (first in out and usage in out) is printed and bool(out) is printed, out
        with pytest.raises(SystemExit) as e:
            p.parse_args(["--bogus"])
        assert e.value.code == 2 and bool(capsys.readouterr().err) is printed
    assert first.rstrip().endswith(".")


def _gpt_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pipelined_gpt_example", ROOT / "examples" / "pipelined_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "examples"))
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


@pytest.mark.mpi
def test_rl_refit_mpiexec_n4():
    """Trainer ranks 0,1 (FSDP) refit the generator on ranks 2,3 (TP 2) after every step with
    one Program.reshard_many run: the generator's tiles equal the trainer's weights bitwise
    for all four methods, its tokens equal a one-process reference's; every refit prints its
    time and GB/s beside the eager batch, the per-tensor loop and mpi4py by hand. A bad
    --tp is refused by every rank, printed once."""
    specs = ["rl_refit --check --steps 2 --repeats 1 --d 32 --layers 1 --new-tokens 3",
             "rl_refit --tp 3"]
    r, out, codes = run(specs, nproc=4, timeout=200)
    assert codes.get(0) == {q: 0 for q in range(4)}, out[-4000:]
    (diff, ok), = check_line(out, "rl_refit")
    assert ok == "OK" and float(diff) <= 1e-4, out[-3000:]
    assert "2 refits: generator tiles bitwise equal to the trainer's for every method, tokens equal: yes" in out
    assert "trainer ranks (0, 1) (FSDP, dim 0), generator ranks (2, 3) (DP 1 x TP 2)" in out
    for k in range(2):
        assert re.search(rf"\[rl_refit\] refit {k}: Program [\d.]+ ms [\d.]+ GB/s \| reshard_many [\d.]+ ms .* \| "
                         r"per-tensor loop [\d.]+ ms .* \| mpi4py by hand [\d.]+ ms [\d.]+ GB/s", out), out[-3000:]
    assert re.search(r"throughput vs mpi4py by hand: Program [\d.]+x \(goal >= 0.95x: (met|NOT met)\), "
                     r"reshard_many [\d.]+x", out)
    assert codes.get(1) == {q: 2 for q in range(4)}, out[-3000:]
    assert out.count("--tp 3 must divide the 2 generator ranks") == 1, out[-3000:]


def test_rl_refit_help(monkeypatch, capsys):
    test_help_says_whole_sentences_once("rl_refit", monkeypatch, capsys)
