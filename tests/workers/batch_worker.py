"""SPMD worker: random batches of tensors (random layouts, dtypes, pending sums, uneven and
Blocks splits; tests/workers/cases.py) through `mc.reshard_many` and `mc.Program.reshard_many`
on each backend, checked bitwise against the one-process reshard of every tensor.

    mpiexec -n 8 python tests/workers/batch_worker.py --init mixed --backends mpi,torch,mixed --batches 4

Prints `RESULT {json}` per rank; any failure raises (non-zero exit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import meshcomm as mc                              # noqa: E402
from cases import random_case, random_data, same  # noqa: E402


def checks(ctx, stats):
    """Over MPI: bad input to a batch on one process raises on every process, naming it, and
    nothing is computed wrong (each case was a bug: out= was never checked, so a buffer of
    another dtype took the raw bytes; bucket_mb= on one process only was not agreed; a process
    holding no tile with one Layout for all names returned {} and its peers timed out; the
    receivers' array kind followed the call made before, not the senders'; one buffer passed
    as the out= of two tensors took the second's values)."""
    import torch
    from meshcomm.errors import PeerError
    ws, me, bad = ctx.world_size, ctx.rank, ctx.world_size - 1
    mesh = mc.Mesh(np.arange(ws), ("x",))
    src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, "x"))     # every device needs every other
    g = {n: np.arange(ws * ws * 2.0, dtype=np.float32).reshape(2 * ws, ws) + i for i, n in enumerate("ab")}
    xs = {n: {me: mc.shard(g[n], src)[me]} for n in g}
    shapes, want = {n: g[n].shape for n in g}, {n: mc.shard(g[n], dst)[me] for n in g}

    def expect(fn, what, text):
        try:
            fn()
        except PeerError as e:
            assert me != bad and f"rank {bad}" in str(e), (what, e)
        except (ValueError, TypeError) as e:
            assert text in str(e) and (me == bad or f"rank(s) [{bad}]" in str(e)), (what, e)
        else:
            raise AssertionError(f"{what}: rank {me}: no error")
        stats["refused"] += 1
    P = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes="float32", backend="mpi")
    out = {n: {me: np.empty(want[n].shape, np.int32 if me == bad and n == "b" else np.float32)} for n in g}
    expect(lambda: P(xs, out=out), "out= of another dtype", "out= buffer of device")
    P = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes="float32", backend="mpi")
    one = np.empty(want["a"].shape, np.float32)     # the bad rank's: one buffer for both tensors
    tied = {n: {me: one if me == bad else np.empty(want[n].shape, np.float32)} for n in g}
    expect(lambda: P(xs, out=tied), "one out= buffer for two tensors", "another out= buffer")
    expect(lambda: mc.Program.reshard_many(src, dst, shapes=shapes, dtypes="float32", backend="mpi",
                                           bucket_mb=1e-5 if me == bad else None), "bucket_mb= on one process", "bucket_mb=")
    ys = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes="float32", backend="mpi")(xs)
    assert all(np.array_equal(ys[n][me], want[n]) for n in g), me
    # one Layout for all names: a process without tiles does not know them (a clear error), and
    # the kind its results come in follows what the senders pass, whatever ran before
    lo, hi = mc.Mesh(np.arange(ws // 2), ("x",)), mc.Mesh(np.arange(ws // 2, ws), ("x",))
    s2, d2 = mc.Layout(lo, ("x",)), mc.Layout(hi, ("x",))
    h = np.arange(4.0 * ws, dtype=np.float32)
    mine = {"h": {d: t for d, t in mc.shard(h, s2).items() if d == me}} if me < ws // 2 else {}
    try:
        mc.reshard_many(mine, s2, d2, backend="mpi")
        raise AssertionError("names unknown to some processes were not refused")
    except ValueError as e:
        assert "tensor names" in str(e), e
        stats["refused"] += 1
    for conv, cls in ((lambda v: v, np.ndarray), (torch.from_numpy, torch.Tensor), (lambda v: v, np.ndarray)):
        r = mc.reshard_many({n: {d: conv(v) for d, v in t.items()} for n, t in mine.items()}, s2, d2,
                            shapes={"h": h.shape}, dtypes={"h": "float32"}, backend="mpi")
        for d, v in r["h"].items():
            assert isinstance(v, cls) and np.array_equal(np.asarray(v), mc.shard(h, d2)[d]), (me, d, type(v), cls)
        stats["kind_follows"] += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mixed")
    ap.add_argument("--backends", default="mpi,torch,mixed")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--size", type=int, default=6, help="tensors per batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="a folder for one rank<r>.json per process")
    a = ap.parse_args()
    ctx = mc.init(backend=a.init)
    ndev = ctx.world_size * ctx.devices_per_process
    stats: Counter = Counter()
    for b in range(a.batches):
        rng = np.random.default_rng((a.seed, b))
        shapes, dtypes, src, dst, full, kinds = {}, {}, {}, {}, {}, {}
        for i in range(a.size):
            shape, s, d, dtype, kind = random_case(rng, ndev)
            if kind not in ("numpy", "torch"):
                kind = "numpy"
            name = f"t{b}_{i}"
            shapes[name], dtypes[name], src[name], dst[name] = shape, dtype, s, d
            full[name] = random_data(rng, shape, dtype, kind)
            kinds[name] = kind
        shards = {n: mc.shard(full[n], src[n], seed=i) for i, n in enumerate(shapes)}
        ref = {n: mc.reshard(shards[n], src[n], dst[n], backend="local") for n in shapes}
        xs = {n: {d: v for d, v in shards[n].items() if d in ctx.owned_devices(src[n])} for n in shapes}
        xs = {n: t for n, t in xs.items() if t}         # a name is left out where this process owns none
        for be in a.backends.split(","):
            for form in ("eager", "program", "eager"):
                if form == "eager":
                    ys = mc.reshard_many(xs, src, dst, shapes=shapes, dtypes=dtypes, backend=be)
                else:
                    # a process without tiles returns the kind the dtype names: torch dtypes for
                    # torch tensors (as Program.reshard takes them)
                    import torch
                    tdt = {n: (getattr(torch, dtypes[n]) if kinds[n] == "torch" else dtypes[n]) for n in shapes}
                    prog = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes=tdt, backend=be)
                    ys = prog(xs)
                assert sorted(ys) == sorted(shapes), (sorted(ys), sorted(shapes))
                for n in shapes:
                    own = ctx.owned_devices(dst[n])
                    assert sorted(ys[n]) == sorted(own), (n, sorted(ys[n]), own)
                    for d in own:
                        if not same(ys[n][d], ref[n][d]):
                            raise AssertionError(f"batch {b} [{be} {form}] tensor {n} {shapes[n]} {dtypes[n]} "
                                                 f"{src[n]} -> {dst[n]}: rank {ctx.rank} device {d} differs")
                stats[f"ok_{be}_{form}"] += 1
    if "mpi" in a.backends.split(","):
        checks(ctx, stats)
    line = json.dumps({"rank": ctx.rank, **stats})
    print("RESULT " + line, flush=True)
    if a.out:
        with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
            f.write(line)
    mc.finalize()


if __name__ == "__main__":
    main()
