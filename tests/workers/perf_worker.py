"""SPMD worker for tests/test_perf_paths.py: repeated reshards run their Program without
agreeing again where every process can decide alone, over MPI.

* Every process holds a src tile and passes shape=: the first call constructs a Program
  (one agreement), the repeats construct none and agree on nothing (`ctx.programs` and
  `ctx.attempts` stay).
* Receiving processes hold no src tile: with shape= and dtype= they decide alone too (the
  dtype tells them the kind of array: a torch dtype, torch tensors), so only the first call
  agrees; without, every call agrees first (the metadata exchange), then runs the same
  Program (the flight recorder's runs name one Program number).
* A new shape constructs a new Program; a shape mismatch on one process in a call that
  constructs makes every process raise naming it, and the next call works; torch tensors on the senders, with
  dtype=torch.float32, come back as torch tensors on the receivers.
* CPU torch tiles (one needing grad) with out= torch buffers, a reshard Program and a batch:
  the buffers are filled and returned (they run as NumPy views over the tensors' memory).
Prints "OK <rank>" on success.
"""
from __future__ import annotations

import sys

import numpy as np

import meshcomm as mc
from meshcomm.runtime import control


def programs_run(since: int) -> list[int]:
    """The Program numbers of the runs this process made after flight-recorder entry `since`."""
    return [e["program"] for e in control.RECORDER.records() if e["seq"] > since and e["what"] == "run"]


def main() -> int:
    ctx = mc.init(backend="mpi")
    r, n = ctx.rank, ctx.world_size
    mesh = mc.Mesh(np.arange(n), ("x",))
    g = np.arange(4 * n * 3, dtype=np.float32).reshape(4 * n, 3)
    dst = mc.Layout(mesh, (None, None))                       # every rank gets everything

    # every process holds a tile: it decides alone from the second call on
    every = mc.Layout(mesh, ("x",))
    xe = {r: g[4 * r:4 * (r + 1)]}
    p0, a0 = ctx.programs, ctx.attempts
    y = mc.reshard(xe, every, dst, shape=g.shape)
    assert np.array_equal(y[r], g), r
    assert (ctx.programs - p0, ctx.attempts - a0) == (1, 1), (r, ctx.programs - p0, ctx.attempts - a0)
    seq = control.RECORDER.seq
    for k in range(5):
        y = mc.reshard(xe, every, dst, shape=g.shape)
        assert np.array_equal(y[r], g), (r, k)
    assert (ctx.programs - p0, ctx.attempts - a0) == (1, 1), \
        f"rank {r}: repeated calls constructed {ctx.programs - p0 - 1} Programs, agreed {ctx.attempts - a0 - 1} times"
    assert len(set(programs_run(seq))) == 1 and len(programs_run(seq)) == 5, (r, programs_run(seq))
    # one process's tile of another dtype in a repeat: every process raises (the others ran
    # the cached Program; it could not), and the next call constructs a new Program
    p0, failed_prog = ctx.programs, programs_run(seq)[0]
    try:
        mc.reshard({r: xe[r].astype(np.float64)} if r == 1 else xe, every, dst, shape=g.shape)
    except (ValueError, TypeError) as e:
        assert r == 1 or "rank 1" in str(e) or "[1]" in str(e), (r, e)
    else:
        raise AssertionError(f"rank {r}: no error for one process's float64 tile")
    seq = control.RECORDER.seq
    for k in range(3):
        y = mc.reshard(xe, every, dst, shape=g.shape)
        assert np.array_equal(y[r], g), (r, k)
    runs = programs_run(seq)
    assert len(set(runs)) == 1 and runs[0] != failed_prog and ctx.programs - p0 == 1, (r, runs, failed_prog)

    # rows on ranks 0 and 1 only: with shape= and dtype= the receivers decide alone (one
    # agreement: the construction); without, every call agrees first, then runs the Program
    # of the agreed facts (one Program for all five calls)
    src = mc.Layout(mc.Mesh([0, 1], ("a",)), ("a",))
    x = {d: g[d * 2 * n:(d + 1) * 2 * n] for d in (0, 1) if d == r}
    for kw, agreements in (({"shape": g.shape, "dtype": g.dtype}, 1), ({}, 5)):
        a0, seq = ctx.attempts, control.RECORDER.seq
        for k in range(5):
            y = mc.reshard(x, src, dst, **kw)
            assert np.array_equal(y[r], g), (r, k, kw)
        assert ctx.attempts - a0 == agreements, (r, sorted(kw), ctx.attempts - a0)
        runs = programs_run(seq)
        assert len(runs) == 5 and len(set(runs)) == 1, f"rank {r} {sorted(kw)}: the calls ran Programs {runs}"
    # a new shape: a new Program, run again by the repeats
    g2 = np.arange(6 * n * 3, dtype=np.float32).reshape(6 * n, 3)
    x2 = {d: g2[d * 3 * n:(d + 1) * 3 * n] for d in (0, 1) if d == r}
    seq, before = control.RECORDER.seq, set(programs_run(0))
    for k in range(3):
        y = mc.reshard(x2, src, dst)
        assert np.array_equal(y[r], g2), (r, k)
    runs = programs_run(seq)
    assert len(runs) == 3 and len(set(runs)) == 1 and runs[0] not in before, (r, runs, before)
    # a disagreement at a construction (a call none made before; rank 3 says another shape)
    # raises everywhere, naming rank 3
    bad = (4 * n + (2 if r == 3 else 1), 3)
    try:
        xb = mc.shard(np.zeros(bad, np.float32), src)
        mc.reshard({d: xb[d] for d in (0, 1) if d == r}, src, dst, shape=bad, dtype=g.dtype)
    except ValueError as e:
        assert r == 3 or "[3]" in str(e) or "rank 3" in str(e), (r, e)
    else:
        raise AssertionError(f"rank {r}: no error for a shape mismatch")
    y = mc.reshard(x, src, dst, shape=g.shape, dtype=g.dtype)
    assert np.array_equal(y[r], g), r
    # torch tensors on the senders: the receivers get torch tensors too (the kind is agreed)
    import torch
    xt = {d: torch.from_numpy(v.copy()) for d, v in x.items()}
    p0, a0 = ctx.programs, ctx.attempts
    for _ in range(3):
        y = mc.reshard(xt, src, dst, shape=g.shape, dtype=torch.float32)
        assert isinstance(y[r], torch.Tensor) and np.array_equal(y[r].numpy(), g), (r, type(y[r]))
    assert (ctx.programs - p0, ctx.attempts - a0) == (1, 1), (r, ctx.programs - p0, ctx.attempts - a0)
    # CPU torch tiles run as NumPy views over their memory: out= torch buffers are filled in
    # place and returned, for a reshard and a batch alike, and a tensor that needs grad is read
    # as it is
    every_t = {r: torch.from_numpy(g[4 * r:4 * (r + 1)].copy()).requires_grad_()}
    P = mc.Program.reshard(every, dst, shape=g.shape, dtype=torch.float32)
    B = mc.Program.reshard_many(every, dst, shapes={"a": g.shape, "b": g.shape}, dtypes=torch.float32)
    for k in range(2):
        bufs = {r: torch.full(g.shape, -1.0)}
        y = P(every_t, out=bufs)
        assert y[r] is bufs[r] and np.array_equal(bufs[r].numpy(), g), (r, k)
        many = {n: {r: torch.full(g.shape, -1.0)} for n in ("a", "b")}
        ys = B({"a": every_t, "b": every_t}, out=many)
        for n in ("a", "b"):
            assert ys[n][r] is many[n][r] and np.array_equal(many[n][r].numpy(), g), (r, k, n)
        ys = B({"a": every_t, "b": every_t})
        assert all(type(ys[n][r]) is torch.Tensor and np.array_equal(ys[n][r].numpy(), g) for n in ys), r
    mc.finalize()
    print(f"OK {r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
