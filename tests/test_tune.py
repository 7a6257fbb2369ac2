"""`meshcomm tune`: rule derivation (pure) and a real 4-process sweep under mpiexec."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshcomm.backends import tuning
from meshcomm.tools.tune import (busbw_factor, derive_rules, format_table, parse_bytes, size_label,
                                  sizes_between)

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_parse_bytes_and_sizes():
    assert parse_bytes("1K") == 1024 and parse_bytes("64M") == 64 << 20 and parse_bytes("4096") == 4096
    assert parse_bytes("2KiB") == 2048
    for bad in ("", "x", "1Q", "0", "0.5"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert sizes_between(1024, 8192) == [1024, 2048, 4096, 8192]
    assert sizes_between(1000, 4096) == [1024, 2048, 4096]
    with pytest.raises(ValueError, match="larger"):
        sizes_between(10, 1)
    assert busbw_factor("alltoall", 8) == 7 / 8 and busbw_factor("bcast", 8) == 1.0
    assert [size_label(s) for s in (1000, 1024, 64 << 10, 3 << 30)] == ["1000B", "1K", "64K", "3G"]
    assert all(parse_bytes(size_label(s)) == s for s in (1, 1000, 1024, 3 << 20, 5 << 30))


def _m(op, backend, nbytes, seconds, group=4):
    return {"op": op, "backend": backend, "bytes": nbytes, "group": group, "seconds": seconds}


def test_derive_rules_picks_faster_backend_per_range():
    ms = []
    for s, (tm, tt) in {1024: (1, 2), 2048: (1, 2), 4096: (3, 2), 8192: (3, 2), 16384: (1, 2)}.items():
        ms += [_m("bcast", "mpi", s, tm), _m("bcast", "torch", s, tt)]
    # reduce measured at two group sizes: torch wins for small groups, mpi for large ones
    ms += [_m("reduce", "mpi", 1024, 2, group=2), _m("reduce", "torch", 1024, 1, group=2),
           _m("reduce", "mpi", 1024, 1, group=8), _m("reduce", "torch", 1024, 2, group=8)]
    rules = derive_rules(ms)
    t = tuning.from_dict({"format": tuning.FORMAT, "rules": rules})
    want = {1: "mpi", 1024: "mpi", 2048: "mpi", 2049: "torch", 4096: "torch", 8192: "torch",
            8193: "mpi", 16384: "mpi", 1 << 30: "mpi"}
    for nbytes, b in want.items():
        assert t.lookup("bcast", nbytes, 4, "cpu") == b, nbytes
    assert t.lookup("reduce", 10, 2, "cpu") == "torch"
    assert t.lookup("reduce", 10 << 20, 3, "cpu") == "mpi"
    assert t.lookup("reduce", 10, 64, "cpu") == "mpi"
    assert all(r["device"] == "cpu" for r in rules)
    text = format_table([dict(m, algbw_GBps=1.0, busbw_GBps=1.0) for m in ms], ["mpi", "torch"], 4)
    assert "bcast" in text and "torch" in text.splitlines()[-1] or "mpi" in text.splitlines()[-1]


@pytest.mark.mpi
def test_tune_under_mpiexec(tmp_path):
    out = tmp_path / "table.json"
    env = dict(os.environ, MESHCOMM_TIMEOUT="60", OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", "4", sys.executable, "-m", "meshcomm", "tune", "--sizes", "1K,64K",
           "--trials", "2", "--warmup", "1", "--groups", "3,4", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "busbw" in r.stdout and f"wrote {out}" in r.stdout
    table = tuning.load(out)                                  # validates the format
    d = json.loads(out.read_text())
    ms = d["measurements"]
    got = {(m["op"], m["backend"], m["bytes"], m["group"]) for m in ms}
    for b in ("mpi", "torch"):
        for s in (1024, 65536):
            assert ("send", b, s, 2) in got and ("alltoall", b, s, 4) in got
            for g in (3, 4):
                assert ("bcast", b, s, g) in got and ("reduce", b, s, g) in got
    assert all(m["seconds"] > 0 and len(m["trials"]) == 2 and m["world"] == 4 for m in ms)
    for m in ms:
        assert m["busbw_GBps"] == pytest.approx(m["algbw_GBps"] * busbw_factor(m["op"], m["group"]))
    # the table's lookup names, for each measured point, the faster backend
    by = {}
    for m in ms:
        by.setdefault((m["op"], m["bytes"], m["group"]), {})[m["backend"]] = m["seconds"]
    for (op, s, g), t in by.items():
        best = min(t.items(), key=lambda kv: (kv[1], kv[0]))[0]
        assert table.lookup(op, s, g, "cpu") == best, (op, s, g, t)
    assert table.lookup("bcast", 1024, 4, "cuda") == "torch"     # built-in defaults kept
