"""meshcomm.log (records, tags, on/off, wire-byte conservation) and the tools that read it
(summary numbers on a synthetic log, the Chrome trace, the comparison with the model), plus
one launch of 4 processes: NumPy calls and the DLRM example with --log."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshcomm as mc
from meshcomm import log
from meshcomm.backends.base import wire_bytes
from meshcomm.model import for_example
from meshcomm.tools import log_cmd
from meshcomm.tools.cli import main as cli
from meshcomm.tools.log_compare import compare

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def logdir(tmp_path):
    yield tmp_path / "log"
    log.stop()


def test_records_tags_and_off(logdir):
    m = mc.Mesh([0, 1, 2, 3], ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    mc.reshard(mc.shard(x, src), src, dst)              # before start: not logged
    assert not log.ON and log.path() is None
    path = log.start(logdir)
    assert log.ON and path == str(logdir / "rank0.jsonl")
    with log.tag("pp"), log.tag("fwd"):
        mc.reshard(mc.shard(x, src), src, dst)
        with log.tag("inner"):
            h = mc.reshard(mc.shard(x, src), src, dst, async_op=True)
    h.wait()
    mc.all_to_all_v({d: np.ones((4, 3), np.int16) for d in m.device_ids},
                    {d: [1, 0, 2, 1] for d in m.device_ids}, m, "x")
    log.stop()
    mc.reshard(mc.shard(x, src), src, dst)              # after stop: not logged
    head, *recs = _lines(path)
    assert head["header"]["rank"] == 0 and head["header"]["clock_offset"] == 0.0
    assert [r["op"] for r in recs] == ["reshard", "reshard", "all_to_all_v"]
    r0, r1, a = recs
    assert (r0["tag"], r1["tag"], a["tag"]) == ("pp/fwd", "pp/fwd/inner", "")
    assert (r0["async"], r1["async"]) == (False, True)
    assert [r["seq"] for r in recs] == [0, 1, 2] and [r["call"] for r in recs] == [0, 1, 2]
    assert r0["group"] == [0] and r0["backend"] == "local" and r0["shape"] == [8, 12]
    assert r0["logical_bytes"] == r0["in_bytes"] == r0["out_bytes"] == 8 * 12 * 4
    assert r0["sent_bytes"] == r0["recv_bytes"] == 0 and r0["dtype"] == "float32"
    assert r0["t_start"] <= r0["t_run"] <= r0["t_end"]
    assert a["shape"] == [16, 3] and a["logical_bytes"] == 16 * 3 * 2 and a["dtype"] == "int16"
    assert a["ctl_sent_bytes"] == 0


def test_tags_and_start_validate(logdir):
    with pytest.raises(ValueError, match="non-empty str"):
        with log.tag(""):
            pass
    with pytest.raises(ValueError, match="flush_every"):
        log.start(logdir, flush_every=0)
    (logdir.parent / "afile").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        log.start(logdir.parent / "afile")


def test_flush_every(logdir):
    path = log.start(logdir, flush_every=2)
    st = log.stamp()
    for _ in range(3):
        log.record(st, "barrier", [0], backend="local", dtype="uint8", shape=(), logical_bytes=0)
    assert len(_lines(path)) == 3            # header + 2 flushed, 1 buffered
    log.stop()
    assert len(_lines(path)) == 4


def test_env_variable_starts_log(tmp_path):
    code = ("import numpy as np, meshcomm as mc\n"
            "m = mc.Mesh([0, 1], ('x',)); s, d = mc.Layout(m, ('x',)), mc.Layout(m, ())\n"
            "mc.reshard(mc.shard(np.zeros(4), s), s, d)\n")
    env = dict(os.environ, MESHCOMM_LOG=str(tmp_path / "env"))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, timeout=60)
    head, rec = _lines(tmp_path / "env" / "rank0.jsonl")
    assert rec["op"] == "reshard" and rec["logical_bytes"] == 32


def _plans():
    m8 = mc.Mesh(np.arange(8).reshape(2, 4), ("a", "b"))
    m4 = mc.Mesh([8, 9, 10, 11], ("c",))
    pairs = [(mc.Layout(m8, ("a", "b")), mc.Layout(m4, (None, "c"))),
             (mc.Layout(m8, (None, "b"), partial=("a",)), mc.Layout(m8, ("b", None))),
             (mc.Layout(m8, (), partial=("a", "b")), mc.Layout(m4, ())),
             (mc.Layout(mc.Mesh([0], ("z",)), ()), mc.Layout(m8, ())),
             (mc.Layout(m8, (mc.Blocks("b", [1, 5, 0, 2]),)), mc.Layout(m4, ("c",)))]
    for dtype in ("float32", "int32"):
        for src, dst in pairs:
            yield mc.plan((8, 12), dtype, src, dst)


@pytest.mark.parametrize("dpp", [1, 2, 3])
def test_wire_bytes_sent_equal_received(dpp):
    """Summed over ranks, sent == received, for p2p, broadcasts, ordered and backend reduces."""
    prims = set()
    for p in _plans():
        for coll in (False, True):
            ranks = range(12 // dpp + 1)
            per = [wire_bytes(p, r, dpp, coll) for r in ranks]
            assert sum(s for s, _ in per) == sum(r for _, r in per) > 0, (p.src, p.dst, dpp, coll)
            from meshcomm.backends.base import compile_steps
            prims |= {s.prim for r in ranks for s in compile_steps(p, r, dpp, coll)}
    assert {"p2p", "bcast", "gather"} <= prims
    # one send of 8*12*4 bytes from device 0 to device 1: nothing else
    p = mc.plan((8, 12), "float32", mc.Layout(mc.Mesh([0], ("z",)), ()), mc.Layout(mc.Mesh([1], ("z",)), ()))
    assert wire_bytes(p, 0, 1, False) == (384, 0) and wire_bytes(p, 1, 1, False) == (0, 384)
    assert wire_bytes(p, 0, 2, False) == (0, 0)         # both devices on rank 0: a local copy


def _rec(rank, group, call, op, t_start, t_end, size, t_run=None, sent=0, recv=0, tag="", **kw):
    r = {"rank": rank, "seq": call, "call": call, "op": op, "backend": "mpi", "group": list(group),
         "dtype": "float32", "shape": [size // 4], "logical_bytes": size, "sent_bytes": sent,
         "recv_bytes": recv, "in_bytes": size, "out_bytes": size, "t_start": t_start,
         "t_run": t_start if t_run is None else t_run, "t_end": t_end, "tag": tag, "async": False}
    r.update(kw)
    return r


def _synthetic():
    """Two all_reduce calls on ranks 0-3 (1 MiB), one small reshard between ranks 0 and 1."""
    M = 1 << 20
    recs = []
    for call, (t0, ends) in enumerate([(10.0, [10.010, 10.012, 10.011, 10.016]),
                                       (20.0, [20.030, 20.030, 20.031, 20.030])]):
        for r in range(4):
            # rank 3 issues 5 ms late in call 0: not counted in the call's time
            start = t0 + (0.005 if (call == 0 and r == 3) else 0.0)
            recs.append(_rec(r, range(4), call, "all_reduce", start, ends[r], M, tag="dp"))
    # a reshard of 4 KiB: rank 0 sends, rank 1 receives; rank 1 queued (t_run later)
    recs.append(_rec(0, (0, 1), 0, "reshard", 30.0, 30.002, 4096, sent=4096, tag="pp/fwd"))
    recs.append(_rec(1, (0, 1), 0, "reshard", 29.0, 30.003, 4096, t_run=30.001, recv=4096, tag="pp/fwd"))
    return recs


def test_summary_numbers_on_synthetic_log():
    cs = {(c.op, c.call): c for c in log_cmd.calls(_synthetic())}
    c0, c1, rs = cs[("all_reduce", 0)], cs[("all_reduce", 1)], cs[("reshard", 0)]
    assert c0.time == pytest.approx(0.016 - 0.005) and c0.straggler == pytest.approx(0.006)
    assert c1.time == pytest.approx(0.031) and c1.straggler == pytest.approx(0.001)
    assert rs.time == pytest.approx(0.003 - 0.001) and rs.straggler == pytest.approx(0.001)
    assert c0.bus_bytes == pytest.approx(1.5 * (1 << 20))        # 2(n-1)/n with n = 4
    rows = {(r.op, r.bucket): r for r in log_cmd.summary(_synthetic())}
    ar, rr = rows[("all_reduce", "1-16MiB")], rows[("reshard", "<64KiB")]
    assert ar.calls == 2 and ar.bytes == 2 << 20
    assert ar.time == pytest.approx(0.042) and ar.avg_time == pytest.approx(0.021)
    assert ar.algbw == pytest.approx((2 << 20) / 0.042)
    assert ar.busbw == pytest.approx(1.5 * (2 << 20) / 0.042)
    assert ar.straggler == pytest.approx(0.007) and ar.max_straggler == pytest.approx(0.006)
    assert rr.busbw == pytest.approx(4096 / 0.002)               # the busiest rank's wire bytes
    assert log_cmd.small_share(rows.values()) == pytest.approx(0.002 / 0.044)
    by_tag = {r.op: r for r in log_cmd.summary(_synthetic(), by="tag")}
    assert set(by_tag) == {"dp", "fwd"} and by_tag["fwd"].calls == 1
    # the group's own size, not the world's: a 2-rank all_gather in a 4-rank job
    two = [_rec(r, (0, 2), 0, "all_gather", 0.0, 1.0, 1000) for r in (0, 2)]
    assert log_cmd.calls(two)[0].bus_bytes == pytest.approx(500)
    two = [_rec(r, (0, 1, 2, 3), 0, "all_to_all_v", 0.0, 1.0, 1000, group_size=2) for r in range(4)]
    assert log_cmd.calls(two)[0].bus_bytes == pytest.approx(500)
    text = log_cmd.format_summary(log_cmd.summary(_synthetic()))
    assert "all_reduce" in text and "time in messages under 64 KiB: 4.5%" in text


def _write(tmp_path, recs, world):
    d = tmp_path / "synthetic"
    d.mkdir()
    for rank in range(world):
        with open(d / f"rank{rank}.jsonl", "w") as f:
            f.write(json.dumps({"header": {"rank": rank, "world": world, "clock_error": 1e-5}}) + "\n")
            for r in recs:
                if r["rank"] == rank:
                    f.write(json.dumps(r) + "\n")
    return d


def test_trace_is_chrome_json(tmp_path):
    recs = _synthetic()
    recs.append(_rec(0, (0, 1), 1, "reshard", 30.001, 30.004, 4096, tag="overlap"))  # overlaps on rank 0
    d = _write(tmp_path, recs, 4)
    out = tmp_path / "trace.json"
    assert cli(["log", "trace", str(d), "-o", str(out)]) == 0
    tr = json.loads(out.read_text())
    ev = tr["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(recs)
    assert sorted(e["pid"] for e in xs if e["ts"] == 0) == [0, 1, 2]   # microseconds from the first call
    ar = next(e for e in xs if e["args"]["op"] == "all_reduce" and e["pid"] == 3 and e["args"]["call"] == 0)
    assert ar["ts"] == pytest.approx(5e3) and ar["dur"] == pytest.approx(11e3) and ar["name"] == "all_reduce dp"
    rs = next(e for e in xs if e["args"]["op"] == "reshard" and e["pid"] == 1)
    assert rs["ts"] == pytest.approx(19e6) and rs["dur"] == pytest.approx(1.003e6)
    lanes = {e["tid"] for e in xs if e["pid"] == 0 and e["args"]["op"] == "reshard"}
    assert lanes == {0, 1}                                      # the overlapping call moved aside
    assert all({"op", "group", "sent_bytes", "tag"} <= set(e["args"]) for e in xs)


def test_cli_summary_compare_and_errors(tmp_path, capsys):
    d = _write(tmp_path, _synthetic(), 4)
    assert cli(["log", "summary", str(d)]) == 0
    out = capsys.readouterr().out
    assert "10 records from 4 rank(s)" in out and "1-16MiB" in out
    assert cli(["log", "summary", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(["log", "summary", str(empty)]) == 2
    assert cli(["log", "compare", str(d), "--example", "nope"]) == 2
    assert "unknown example" in capsys.readouterr().err
    png = tmp_path / "p.png"
    assert cli(["log", "summary", str(d), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def _model_records(world, steps, **flags):
    """Records as the DLRM example would log them, from the model itself."""
    recs = []
    for rank, entries in for_example("dlrm", world=world, **flags).items():
        seq = 0
        for _ in range(steps):
            for e in entries:
                for _ in range(e.calls):
                    recs.append(_rec(rank, range(world), seq, "reshard", 0.0, 1.0, e.message_bytes,
                                     tag=f"step/{e.phase}", src_ranks=list(range(world))))
                    seq += 1
    return recs


def test_compare_with_model():
    recs = _model_records(4, 3)
    cmp = compare(recs, "dlrm", steps=3, world=4)
    assert cmp.ok and {(r.phase, r.via) for r in cmp.rows} == {("emb.fwd", "reshard"), ("emb.bwd", "reshard"),
                                                               ("dp.grad", "reshard")}
    assert compare(recs, "dlrm", world=4).steps == 3             # inferred
    assert not compare(recs, "dlrm", steps=2, world=4).ok
    extra = recs + [_rec(0, range(4), 99, "reshard", 0.0, 1.0, 8, tag="check")]
    assert compare(extra, "dlrm", steps=3, world=4).excluded == 1
    wrong = [dict(r, in_bytes=r["in_bytes"] + 4) if i == 0 else r for i, r in enumerate(recs)]
    bad = compare(wrong, "dlrm", steps=3, world=4)
    assert not bad.ok and "MISMATCH" in bad.text()
    row = next(r for r in bad.rows if not r.ok)
    assert row.bad_ranks == (0,)
    untagged = recs + [_rec(1, range(4), 99, "reshard", 0.0, 1.0, 8, tag="")]
    assert not compare(untagged, "dlrm", steps=3, world=4).ok    # a call the model lacks


def test_compare_collectives_by_their_nccl_size(tmp_path, capsys):
    """A collective's bytes are its logical_bytes (nccl-tests' size, the model's message_bytes),
    whatever its in_bytes (a native collective logs 0 there): the FSDP example's log."""
    recs, seq = [], 0
    for rank, entries in for_example("fsdp", world=2, layers=1, compression="bf16").items():
        for _ in range(3):
            for e in entries:
                for _ in range(e.calls):
                    recs.append(_rec(rank, range(2), seq, e.op, 0.0, 1.0, e.message_bytes, tag=e.phase,
                                     group_size=2, in_bytes=0, out_bytes=0))
                    seq += 1
    cmp = compare(recs, "fsdp", steps=3, world=2, layers=1, compression="bf16")
    assert cmp.ok, cmp.text()
    assert {(r.phase, r.via) for r in cmp.rows} == {("fsdp.gather", "all_gather"), ("fsdp.grad", "reduce_scatter"),
                                                   ("dp.loss", "all_reduce")}
    assert not compare(recs, "fsdp", steps=3, world=2, layers=1, compression="none").ok   # one run fewer
    d = _write(tmp_path, recs, 2)
    assert cli(["log", "compare", str(d), "--example", "fsdp", "--set", "layers=1", "--set", "compression=bf16"]) == 0
    assert "all match" in capsys.readouterr().out


@pytest.mark.mpi
def test_log_under_mpiexec(tmp_path):
    """4 processes: per call, sent bytes summed over ranks equal received bytes; DLRM's log
    equals the model's calls and bytes; its trace loads as JSON."""
    env = dict(os.environ, MESHCOMM_TIMEOUT="90", OMP_NUM_THREADS="1")
    r = subprocess.run([str(MPIEXEC), "-n", "4", sys.executable, str(ROOT / "tests/workers/log_worker.py"),
                        str(tmp_path), "--dlrm"], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for sub, n_calls in (("calls", 12), ("dlrm", 6)):
        lg = log_cmd.read(tmp_path / sub)
        assert set(lg.headers) == {0, 1, 2, 3}
        assert all(h["world"] == 4 and abs(h["clock_error"]) < 0.05 for h in lg.headers.values())
        cs = log_cmd.calls(lg.records)
        assert len(cs) == n_calls, [(c.op, c.tag, c.group) for c in cs]
        for c in cs:
            assert sorted(x["rank"] for x in c.records) == list(c.group), c
            assert sum(x["sent_bytes"] for x in c.records) == sum(x["recv_bytes"] for x in c.records), c
            assert sum(x.get("ctl_sent_bytes", 0) for x in c.records) == \
                sum(x.get("ctl_recv_bytes", 0) for x in c.records)
            ops = {(x["op"], tuple(x["shape"]) if x["op"] == "reshard" else 0) for x in c.records}
            assert len(ops) == 1 or ops == {("send", 0), ("recv", 0)}, ops      # a message: both ends
            assert all(x["t_start"] <= x["t_run"] <= x["t_end"] for x in c.records)
        if sub == "calls":
            tags = {c.tag: c for c in cs}
            assert tags["case4"].group == (0, 1, 2)                # rank 3 called it, logged nothing
            assert tags["case2"].wire == 3 * 64 * 24 * 4           # root sends to each receiver
            assert tags["outer/inner"].records[0]["async"] is True
            a2a = [c for c in cs if c.op == "all_to_all_v"]
            assert len(a2a) == 2 and all(x["ctl_sent_bytes"] > 0 for x in a2a[0].records)
            assert sum(x["sent_bytes"] for x in a2a[0].records) > 0
            coll = {c.op: c for c in cs if c.tag == "coll"}      # collectives: their op, group size, nccl size
            assert (coll["all_reduce"].n, coll["all_reduce"].size) == (2, 6 * 5 * 4)
            assert (coll["all_gather"].n, coll["all_gather"].size) == (2, 2 * 3 * 5 * 4)
            assert coll["all_reduce"].bus_bytes == 120 and coll["all_gather"].bus_bytes == 60
            # a native call's records carry this rank's tile bytes in and out (they were 0)
            assert all((x["in_bytes"], x["out_bytes"]) == (120, 120) for x in coll["all_reduce"].records)
            assert all((x["in_bytes"], x["out_bytes"]) == (60, 120) for x in coll["all_gather"].records)
            p2p = tags["p2p"]                                    # send/recv are logged (they were not)
            assert (p2p.op, p2p.group, p2p.size) == ("send", (0, 1), 24) and p2p.wire == 24 + 128
        else:
            assert "DLRM EXIT 0 0" in out and "all match" in out, out[-3000:]
            cmp = compare(lg.records, "dlrm", steps=2, world=4)
            assert cmp.ok and sum(r.logged_calls for r in cmp.rows) == 4 * 3 * 2
            tr = log_cmd.trace(lg)
            assert len([e for e in json.loads(json.dumps(tr))["traceEvents"] if e["ph"] == "X"]) == len(lg.records)


def test_summary_reads_flight_recorders(tmp_path, capsys):
    """`meshcomm log summary DIR` on the flight recorders a failed call wrote says each rank's
    last call and who waited for whom (records as meshcomm.runtime.control writes them)."""
    import json as _json
    from meshcomm.tools.cli import main as cli
    rec = lambda r, what, prog, run, state, awaiting: {  # noqa: E731
        "seq": 1, "what": what, "program": prog, "label": "reshard", "run": run, "state": state,
        "awaiting": awaiting, "t_start": 0.0, "t_end": 1.0, "rank": r}
    rows = {0: rec(0, "run", 3, 2, "failed", [1, 2]), 1: rec(1, "construct", 4, 9, "failed", [0]),
            2: rec(2, "run", 3, 2, "failed", [3])}
    for r, e in rows.items():
        (tmp_path / f"flight_rank{r}.jsonl").write_text(_json.dumps(e) + "\n")
    assert cli(["log", "summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 1: constructing Program #4 (reshard): failed, waiting for rank(s) [0]" in out
    assert "ranks 0 and 1 waited for each other in different calls" in out
    assert "rank 2 waited for rank 3, which wrote no record" in out


def test_compare_names_a_set_flag_that_is_not_a_number():
    """`log compare --set micro=x` said only "calls of send (pp.fwd) must be an int"."""
    with pytest.raises(ValueError, match=r"from --set micro=x: not a number"):
        compare([{"rank": 0, "op": "reshard", "tag": ""}], "pipelined_gpt", world=4, micro="x")
