"""Real multi-process runs of the distributed backends (mpiexec from the mpich wheel, torchrun).

Each launch runs many seeded random cases (tests/workers/reshard_worker.py) with every
backend and checks each process's dst tiles bitwise against the single-process result;
the 4-process launch also checks mismatched calls and a peer that never arrives, the
torchrun launch a peer that dies. Launches are few and batched: process start-up with
torch costs seconds on 2 cores.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshcomm.backends import tuning

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "reshard_worker.py"
BIN = Path(sys.executable).parent
MPIEXEC = shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
TORCHRUN = shutil.which("torchrun", path=str(BIN)) or shutil.which("torchrun")
TIMEOUT = 5


def alternating_table(path: Path) -> Path:
    """A tuning table that flips between mpi and torch every 16 bytes (and by op), so
    consecutive transfers of a plan keep switching backends."""
    rules = []
    for op, first in (("send", "mpi"), ("bcast", "torch"), ("reduce", "mpi"), ("alltoall", "torch")):
        other = "torch" if first == "mpi" else "mpi"
        for k in range(0, 1024):
            rules.append(tuning.Rule(op=op, backend=first if k % 2 == 0 else other,
                                     min_bytes=16 * k, max_bytes=16 * k + 15))
        rules.append(tuning.Rule(op=op, backend=other, min_bytes=16 * 1024))
    tuning.save(tuning.TuningTable(tuple(rules)), path)
    return path


def launch(cmd: list[str], env: dict, timeout: float, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = cmd + ["--out", str(out)]
    e = dict(os.environ)
    e.update(env)
    e.setdefault("MESHCOMM_TIMEOUT", "60")
    e.setdefault("OMP_NUM_THREADS", "1")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as ex:
        out = (ex.stdout or b"")[-4000:] if isinstance(ex.stdout, bytes) else (ex.stdout or "")[-4000:]
        pytest.fail(f"launch timed out after {timeout}s: {' '.join(cmd)}\n{out}")
    text = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{text[-6000:]}"
    res = [json.loads(f.read_text()) for f in out.glob("rank*.json")]
    return sorted(res, key=lambda r: r["rank"])


def mpiexec(n: int, *args, out: Path, env=None, timeout=240) -> list[dict]:
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    return launch([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), *args],
                  env or {}, timeout, out)


def check_cases(res, n, cases, backends):
    assert [r["rank"] for r in res] == list(range(n)), res
    for r in res:
        for b in backends:
            assert r.get(f"ok_{b}") == cases, (b, r)
    assert sum(r.get("async", 0) for r in res) > 0
    assert sum(r.get("no_src", 0) for r in res) > 0         # processes owning no src device


def test_mpiexec_4_every_backend_mismatch_and_timeout(tmp_path):
    cases = 30
    res = mpiexec(4, "--init", "mixed", "--backends", "mpi,torch,mixed", "--cases", str(cases),
                  "--checks", "--timeout-test", out=tmp_path / "out",
                  env={"MESHCOMM_TIMEOUT": str(TIMEOUT),
                       "MESHCOMM_TUNING": str(alternating_table(tmp_path / "alt.json"))})
    check_cases(res, 4, cases, ("mpi", "torch", "mixed"))
    for r in res:
        # 4 mismatched calls x 3 backends, then on mpi: a call beside a run, bad run input, a
        # failed Program run again, Programs out of order
        assert r["mismatch_ok"] == 4 * 3 + 4, r
        assert r["program_ok"] == 3 and r["no_src_ok"] == 4 * 3, r
        assert r["deferred"] == 1, r    # a failed run's finished peers raise in the next construction, with it
        assert r["parameters"] == 9 and r["bfloat16"] == 5, r    # parameters in, data out; bfloat16 tiles
        assert r["check_every"] == 8 and r["settings_refused"] == 1, r    # MESHCOMM_CHECK=every; one rank's setting
    lag = 3
    phases = ["construct_mpi", "construct_torch", "construct_mixed", "run_mpi", "run_torch"]
    for r in res[:lag]:
        for ph in phases:
            assert 0 <= r[f"timeout_{ph}"] < TIMEOUT + 4, (ph, r)
    assert not any(k.startswith("timeout_") for k in res[lag])
    # mixed really alternated: runs of one plan sent messages over both backends
    assert sum(r.get("issued_mixed_mpi", 0) for r in res) > 0
    assert sum(r.get("issued_mixed_torch", 0) for r in res) > 0
    # the CUDA ordering code ran (as no-ops) on CPU
    assert all(r["streams_record"] > 0 and r["streams_wait_on"] > 0 for r in res[:lag])


def test_mpiexec_8_every_backend(tmp_path):
    cases = 24
    res = mpiexec(8, "--init", "mixed", "--backends", "mpi,torch,mixed", "--cases", str(cases),
                  "--seed", "8", out=tmp_path / "out",
                  env={"MESHCOMM_TUNING": str(alternating_table(tmp_path / "alt.json"))})
    check_cases(res, 8, cases, ("mpi", "torch", "mixed"))
    for r in res:
        assert r.get("issued_batch_mpi", 0) > 0, r      # host tiles over MPI: the batch executor
    assert sum(r.get("lean", 0) for r in res) >= 8, res    # Programs' lean runs (backends/lean.py)
    assert sum(r.get("lean_receiver", 0) for r in res) >= 8, res


def test_mpiexec_two_devices_per_process_and_reinit(tmp_path):
    # init("mpi") -> finalize -> init("torch") (rendezvous derived from MPI) -> init("mixed");
    # failed in about 1 launch of 2 (a rendezvous refused, or a rank missing at a construction)
    # until finalize collected gloo's works and groups (0 of 40 launches since)
    # (MESHCOMM_TIMEOUT 20: gloo's own timeout follows it, and its given-up works close their
    # connections only then; at launch()'s 60 the test waited about 130 s, at 20 about 50 s)
    cases = 16
    res = mpiexec(4, "--init", "mpi,torch,mixed", "--dpp", "2", "--cases", str(cases), "--seed", "2",
                  out=tmp_path / "out", env={"MESHCOMM_TIMEOUT": "20"})
    check_cases(res, 4, cases, ("mpi", "torch", "mixed"))
    assert all(r["old_program_refused"] == 2 for r in res), res    # Programs of a finalized context


def test_torchrun_and_a_peer_that_dies(tmp_path):
    if TORCHRUN is None:
        pytest.skip("torchrun not found")
    cases = 12
    res = launch([TORCHRUN, "--standalone", "--nproc-per-node", "3", str(WORKER), "--init", "torch",
                  "--cases", str(cases), "--seed", "3", "--timeout-test"],
                 {"MESHCOMM_TIMEOUT": str(TIMEOUT)}, 240, tmp_path / "out")
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert res[2] == {"rank": 2, "exited_early": True}
    for r in res[:2]:
        assert r["ok_torch"] == cases
        assert r["agreed_then_failed"] == 4     # constructions that agreed, then failed to plan
        assert r["parameters"] == 9             # tensors that require grad in, data out
        assert r["bfloat16"] == 5               # NumPy bfloat16 tiles over gloo
        assert r["check_every"] == 8 and r["settings_refused"] == 1    # MESHCOMM_CHECK=every; one rank's setting
        assert r["given_up_over_gloo"] == 1     # refused after gloo work was given up, then re-init
        assert r["swapped_over_gloo"] == 1      # Programs in another order raise, never a wrong sum
        assert r["timeout_construct_torch"] < TIMEOUT + 4


# -- in-process checks of the tuning table (no launch) ----------------------------------

def test_tuning_table_lookup_and_validation(tmp_path):
    t = tuning.from_dict({"format": tuning.FORMAT, "rules": [
        {"op": "send", "min_bytes": 0, "max_bytes": 1023, "min_group": 0, "max_group": None, "backend": "torch"},
        {"op": "bcast", "min_bytes": 0, "max_bytes": None, "min_group": 4, "max_group": None, "backend": "torch"},
    ], "measurements": [{"op": "send", "bytes": 8, "backend": "mpi", "seconds": 1e-6}]})
    assert t.lookup("send", 1023, 2) == "torch"
    assert t.lookup("send", 1024, 2) == "mpi"            # no rule: fallback mpi
    assert t.lookup("bcast", 10, 3) == "mpi"
    assert t.lookup("bcast", 10, 4) == "torch"
    p = tmp_path / "t.json"
    tuning.save(t, p)
    assert tuning.load(p).to_dict() == t.to_dict()
    with pytest.raises(ValueError, match="format"):
        tuning.from_dict({"format": "v0", "rules": []})
    with pytest.raises(ValueError, match="rule 0.*backend"):
        tuning.from_dict({"format": tuning.FORMAT, "rules": [{"op": "send", "backend": "nccl"}]})
    with pytest.raises(ValueError, match="unknown key"):
        tuning.from_dict({"format": tuning.FORMAT, "rules": [{"op": "send", "backend": "mpi", "x": 1}]})
    d = tuning.default_table()
    assert d.lookup("send", 1 << 20, 2, "cpu") == "mpi"
    assert d.lookup("bcast", 1 << 20, 8, "cuda") == "torch"


def test_table_from_env(tmp_path, monkeypatch):
    p = alternating_table(tmp_path / "alt.json")
    monkeypatch.setenv("MESHCOMM_TUNING", str(p))
    t = tuning.table_from_env()
    assert t.lookup("send", 0, 2) == "mpi" and t.lookup("send", 16, 2) == "torch"
    monkeypatch.delenv("MESHCOMM_TUNING")
    assert tuning.table_from_env() == tuning.default_table()


def test_init_rejects_bad_arguments_and_errors_are_both_kinds():
    import meshcomm as mc
    from meshcomm.errors import PeerTimeoutError
    with pytest.raises(ValueError, match="backend must be one of"):
        mc.init(backend="nccl")
    with pytest.raises(ValueError, match="devices_per_process"):
        mc.init(backend="mpi", devices_per_process=0)
    with pytest.raises(ValueError, match="timeout"):
        mc.init(backend="mpi", timeout=-1)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got '30'"):
        mc.init(backend="mpi", timeout="30")
    assert mc.runtime.current() is None
    e = PeerTimeoutError("rank 1: peer rank(s) [3] did not arrive", [3], "metadata")
    assert isinstance(e, TimeoutError) and isinstance(e, RuntimeError) and e.peers == (3,)
    mc.finalize()                       # no context: a no-op


def test_a_peer_that_never_joins_init(tmp_path):
    """The last of 4 ranks never calls init: init raises on the others, naming it, with each
    backend (MPI's join check, the torch rendezvous derived from MPI, mixed)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    t = 3
    res = launch([MPIEXEC, "-n", "4", sys.executable, "-m", "mpi4py",
                  str(ROOT / "tests" / "workers" / "join_worker.py")],
                 {"MESHCOMM_TIMEOUT": str(t)}, 120, tmp_path / "out")
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    for r in res[:3]:
        for b in ("mpi", "torch", "mixed"):
            assert r[b]["peers"] == [3] and r[b]["names_lag"], (b, r)
            assert r[b]["seconds"] < t + 4, (b, r)


def test_given_up_work_keeps_its_buffers_until_mpi_is_done():
    """A plan's send whose wait timed out and a receive given up on as a timeout does stay referenced
    (backends.base.abandon): the peer receives the source's bytes though rank 0 dropped the
    array, a late message lands in the kept buffer and not in memory allocated since, and the
    work is let go once it completed (tests/workers/abandon_worker.py says how)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    worker = ROOT / "tests" / "workers" / "abandon_worker.py"
    e = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(worker)], cwd=ROOT,
                       env=e, capture_output=True, text=True, timeout=120)
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-4000:]
    res = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines()
           if line.startswith("RESULT ")][0]
    assert [r["rank"] for r in res] == [0, 1], text[-4000:]
    assert res[1] == {"rank": 1, "send_intact": True}, res
    want = ("send_timed_out", "send_buffer_kept", "fresh_untouched_1", "recv_kept", "recv_buffer_kept",
            "fresh_untouched_2", "landed_in_kept", "released_when_done")
    assert {k: res[0].get(k) for k in want} == dict.fromkeys(want, True), res[0]


@pytest.mark.mpi
def test_no_init_under_a_launcher_refuses_to_run_alone(tmp_path):
    """Under mpiexec without meshcomm.init, a call would give each process its own one-process
    result (all_reduce: 0, 1, 2, 3 summed per process instead of across them): it raises, naming
    init; backend="local" on the call or init(backend="local") runs it alone on purpose."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(ROOT / "tests" / "workers" / "no_init_worker.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert len(res) == 2
    for x in res:
        for name in ("all_reduce", "reshard", "all_to_all_v", "Program.all_reduce"):
            assert x[name] == "refused" and x[name + ":local"] == "ran", x
        assert x["after_init_local"] == 6.0


@pytest.mark.mpi
def test_an_allgather_given_up_keeps_what_came_in(tmp_path):
    """A peer's Meta read during an agreement that then failed (a stall, the deadline) waits for
    the next attempt on its tag (backends/mpi.py timed_allgather): without it, a process whose
    failed construction had read a peer's next attempt waited for that peer until its deadline
    (tests/workers/perf_worker.py failed so in about 1 launch of 20)."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    r = subprocess.run([MPIEXEC, "-n", "3", sys.executable, str(ROOT / "tests" / "workers" / "allgather_worker.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["first"] == [2], res
    assert res["second"] == ["zero again", ["one"], ["two"]], res


FREEZE = [("mpi", st, form) for st in ("agreement", "create", "transfer") for form in ("eager", "program")] + \
    [("torch", "agreement", "program"), ("torch", "transfer", "program"), ("torch", "transfer", "eager"),
     ("mpi", "transfer", "lean")]


@pytest.mark.mpi
@pytest.mark.parametrize("init,stage,form", FREEZE)
def test_a_frozen_peer_at_each_stage(tmp_path, init, stage, form):
    """The last of 4 ranks stops (SIGSTOP) before the agreement, inside a communicator's
    creation, or 50 ms into a loop of 16 MiB reshards: every survivor raises within
    MESHCOMM_TIMEOUT (+ slack), never returning a wrong value (tests/workers/freeze_worker.py).
    "lean": a Program's lean run (backends/lean.py), without the log (which turns it off):
    the flight recorders go to the folder each error names."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    timeout = 3
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, MESHCOMM_TIMEOUT=str(timeout))
    if form != "lean":
        env["MESHCOMM_LOG"] = str(tmp_path / "log")
    r = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(ROOT / "tests" / "workers" / "freeze_worker.py"),
                        "--init", init, "--stage", stage, "--form", form, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    res = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    # the frozen rank writes nothing, unless a launcher resumes it when the survivors leave
    # (Open MPI's does, before rank 0 kills it): then it was stopped past the timeout
    frozen = res.pop(3, None)
    assert sorted(res) == [0, 1, 2], (res, r.stdout[-4000:], r.stderr[-8000:])
    assert frozen is None or frozen["seconds"] >= timeout, frozen
    for r in res.values():
        assert r["error"] is not None, r
        assert r["seconds"] < timeout + 10, r
    if form == "lean":                  # the lagging rank named, the lean run's peers tested one by one
        def names_3(err):               # "rank 3", or 3 among the peers a wait still awaited
            return "rank 3" in err or any("3" in m.split(", ") for m in re.findall(r"rank\(s\) \[([0-9, ]+)\]", err))
        assert all(names_3(r["error"]) for r in res.values()), [r["error"] for r in res.values()]
        return
    # the flight recorder of each survivor says what it waited for when it failed
    flights = {p.name for p in (tmp_path / "log").glob("flight_rank*.jsonl")}
    assert {"flight_rank0.jsonl", "flight_rank1.jsonl", "flight_rank2.jsonl"} <= flights, flights


@pytest.mark.mpi
def test_collective_programs_take_out_buffers(tmp_path):
    """Collective Programs copy their results into out= buffers and return them."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    code = '''
import numpy as np, meshcomm as mc
ctx = mc.init("mpi")
mesh = mc.Mesh(np.arange(ctx.world_size), "x")
P = mc.Program.all_reduce(mesh, "x", shape=(4,), dtype="float32")
buf = np.zeros(4, np.float32)
r = P(np.ones(4, np.float32), out=buf)
assert r is buf and (buf == ctx.world_size).all(), buf
G = mc.Program.all_gather(mesh, "x", shape=(2,), dtype="float32")
b2 = {ctx.rank: np.zeros(2 * ctx.world_size, np.float32)}
r = G({ctx.rank: np.full(2, ctx.rank, np.float32)}, out=b2)
assert r[ctx.rank] is b2[ctx.rank] and (b2[ctx.rank] == np.repeat(np.arange(ctx.world_size), 2)).all()
try:
    P(np.ones(4, np.float32), out=np.zeros(3, np.float32))
except ValueError as e:
    assert "out= buffer" in str(e)
else:
    raise AssertionError("a wrong out= buffer was taken")
print("OK", flush=True)
mc.finalize()
'''
    f = tmp_path / "out_buffers.py"
    f.write_text(code)
    r = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(f)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MESHCOMM_TIMEOUT="20"))
    assert r.returncode == 0 and r.stdout.count("OK") == 2, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.mpi
def test_mpiexec_8_random_batches_every_backend(tmp_path):
    """reshard_many and Program.reshard_many on random batches (layouts, dtypes, pending sums,
    uneven and Blocks splits, NumPy and torch tiles) exact on 8 processes, every backend."""
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([MPIEXEC, "-n", "8", sys.executable, str(ROOT / "tests" / "workers" / "batch_worker.py"),
                        "--init", "mixed", "--backends", "mpi,torch,mixed", "--batches", "3", "--seed", "30",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=400, env=dict(os.environ, MESHCOMM_TIMEOUT="60"))
    res = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert r.returncode == 0 and len(res) == 8, r.stdout[-3000:] + r.stderr[-3000:]
    for x in res:
        for be in ("mpi", "torch", "mixed"):
            assert x[f"ok_{be}_eager"] == 6 and x[f"ok_{be}_program"] == 3, x
        assert x["refused"] == 4 and x["kind_follows"] == 3, x   # batch_worker.checks
