"""SPMD worker: many resharding cases per launch, checked against the single-process result.

Run under a launcher, e.g.::

    mpiexec -n 8 python tests/workers/reshard_worker.py --init mixed --backends mpi,torch,mixed
    torchrun --nproc-per-node 4 tests/workers/reshard_worker.py --init torch --backends torch

Every process draws the same seeded cases; each passes the src tiles it owns (a bare array
or a dict, sometimes none at all), with or without shape=/dtype=, sync or async, and
compares the dst tiles it gets with `meshcomm.reshard(..., backend="local")` on the full
data (bitwise); after them, --op-cases cases whose pending values reduce by prod, min or
max (tests/workers/cases.py: random_op_case). Optional checks: mismatched calls (--checks)
and a peer that never arrives (--timeout-test, with MESHCOMM_TIMEOUT set by the caller).
Each rank prints one line `RESULT {json}` at the end; any failure raises (non-zero exit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import meshcomm as mc                        # noqa: E402
from meshcomm.backends import base, streams  # noqa: E402
from meshcomm.errors import PeerError, PeerTimeoutError  # noqa: E402
from cases import random_case, random_data, random_op_case, same  # noqa: E402


def owned_input(ctx, shards, src, dst, rng_choice_bare):
    mine = {d: shards[d] for d in ctx.owned_devices(src)}
    if len(mine) == 1 and rng_choice_bare and len(ctx.owned_devices(dst)) <= 1:
        return next(iter(mine.values())), True
    return mine, False


def check_result(ctx, got, ref, dst, bare, what):
    owned = ctx.owned_devices(dst)
    if bare and len(owned) <= 1:
        if not owned:
            assert got is None, f"{what}: rank {ctx.rank} owns no dst device but got {type(got)}"
            return
        got = {owned[0]: got}
    assert isinstance(got, dict), f"{what}: expected a dict, got {type(got).__name__}"
    assert sorted(got) == sorted(owned), f"{what}: got devices {sorted(got)}, owns {sorted(owned)}"
    for d in owned:
        if not same(got[d], ref[d]):
            raise AssertionError(f"{what}: rank {ctx.rank} device {d}: got {got[d]!r}\nwant {ref[d]!r}")


def run_cases(ctx, args, backends, stats):
    ndev = ctx.world_size * ctx.devices_per_process
    pending = []
    # the plain cases, then pending prod/min/max ones (stats "ok_op_<backend>")
    todo = [(i, random_case, (args.seed, i), "") for i in range(args.cases)]
    todo += [(i, random_op_case, (args.seed, i, 7), "op_") for i in range(args.op_cases)]
    for i, draw_case, seed, label in todo:
        rng = np.random.default_rng(seed)
        shape, src, dst, dtype, kind = draw_case(rng, ndev)
        if label and src.is_partial:       # op cases whose plan reduces over 3+ processes
            rank_of = lambda d: d // ctx.devices_per_process  # noqa: E731
            p = mc.plan(shape, dtype, src, dst)
            if any(t.kind == "reduce" and len({rank_of(d) for d in t.participants}) >= 3
                   for t in p.transfers):
                stats[f"reduce3_{src.partial_op}"] += 1
        x = random_data(rng, shape, dtype, kind)
        shards = mc.shard(x, src, seed=i)
        ref = mc.reshard(shards, src, dst, backend="local")
        for bname in backends:
            inp, bare = owned_input(ctx, shards, src, dst, rng.random() < 0.5)
            kw = {}
            if rng.random() < 0.3:
                kw = {"shape": shape, "dtype": x.dtype}
            what = f"{label}case {i} [{bname}] {shape} {dtype} {kind}: {src} -> {dst} kw={sorted(kw)}"
            if rng.random() < 0.25:
                h = mc.reshard(inp, src, dst, backend=bname, async_op=True, **kw)
                assert isinstance(h, mc.Handle)
                pending.append((h, ref, dst, bare, what))
                stats["async"] += 1
                if len(pending) >= 3:
                    for h, *rest in reversed(pending):      # any wait order works
                        check_result(ctx, h.wait(), *rest)
                    pending.clear()
            else:
                got = mc.reshard(inp, src, dst, backend=bname, **kw)
                check_result(ctx, got, ref, dst, bare, what)
            stats[f"ok_{label}{bname}"] += 1
            if not ctx.owned_devices(src):
                stats["no_src"] += 1
        if "mpi" in backends and not label and type(x) is np.ndarray:
            run_lean(ctx, shards, ref, shape, x.dtype, src, dst, f"case {i}: {src} -> {dst}", stats)
    for h, *rest in pending:
        check_result(ctx, h.wait(), *rest)


def run_lean(ctx, shards, ref, shape, dtype, src, dst, what, stats):
    """A Program and a repeated eager call over MPI, run on bare NumPy tiles, dicts of them, or
    nothing: their lean run (backends/lean.py) where this process's part allows one. Rank 0 passes a CPU torch tensor
    to one run (the general run beside its peers' lean ones: the same messages)."""
    import torch
    inp, bare = owned_input(ctx, shards, src, dst, True)
    prog = mc.Program.reshard(src, dst, shape=shape, dtype=dtype, backend="mpi")
    other = bare and ctx.rank == 0 and str(dtype) != "bfloat16"    # torch takes no ml_dtypes array
    receiver = not ctx.owned_devices(src)       # passes {} or None: a dict out
    for k in range(3):
        y = prog(torch.from_numpy(inp) if k == 1 and other else None if k == 2 and receiver else inp)
        if k == 1 and other and y is not None:
            y = y.numpy()
        check_result(ctx, y, ref, dst, bare, f"lean Program run {k}, {what}")
    for k in range(3):
        check_result(ctx, mc.reshard(inp, src, dst, backend="mpi"), ref, dst, bare, f"lean eager {k}, {what}")
    mine = {ctx.owned_devices(src)[0]: inp} if bare else inp    # the tile in a dict: a dict out
    for k in range(2):
        check_result(ctx, prog(mine), ref, dst, False, f"lean Program of a dict {k}, {what}")
        check_result(ctx, mc.reshard(mine, src, dst, backend="mpi"), ref, dst, False,
                     f"lean eager of a dict {k}, {what}")
    stats["lean"] += prog._lean is not None and bare
    stats["lean_receiver"] += prog._lean is not None and receiver


def run_agreed_then_failed(ctx, stats, times=4):
    """A construction every process agrees on whose planning then fails (an all_gather along
    a dimension the tiles lack) raises alike on each, and uses its round up: over the store
    (torch) the next construction must not read that round's values. It did: a fast process's
    next Meta replaced its failed one under the same key before a slow one had read it, and
    from then on every construction disagreed or timed out."""
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    mine = ctx.owned_devices(mc.Layout(mesh, ()))
    for i in range(times):
        try:
            mc.Program.all_gather(mesh, "x", shape=(4,), dtype="float32", dim=3)
        except ValueError as e:
            assert "dim=3 is out of range" in str(e), f"rank {ctx.rank}, try {i}: {e}"
        else:
            raise AssertionError(f"rank {ctx.rank}: an all_gather along dim 3 of 1-d tiles constructed")
        prog = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="float32")
        y = prog({d: np.full(3, d, np.float32) for d in mine})
        assert all((v == n * (n - 1) // 2).all() for v in y.values()), (ctx.rank, i, y)
        stats["agreed_then_failed"] += 1


def run_parameters(ctx, stats):
    """torch tensors that require grad (parameters) go in like any tile, and what comes back
    is data outside autograd, as torch.distributed's results are: over MPI a native
    collective called .numpy() on them and raised, and over gloo the results of an
    all_reduce, reduce_scatter or all_to_all_v carried the input's grad_fn."""
    import torch
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    mine = ctx.owned_devices(mc.Layout(mesh, ()))

    def param(*shape, d=0):
        return torch.nn.Parameter(torch.arange(float(np.prod(shape))).reshape(shape) + d)

    def tiles(*shape):
        return {d: param(*shape, d=d) for d in mine}
    total = sum(range(n))
    rows, cols = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, "x"))
    part = mc.Layout(mesh, (None, None), partial={"x": "max"})
    x = torch.arange(float(2 * n * n)).reshape(2 * n, n)
    want = mc.shard(x, cols)
    checks = {
        "all_reduce": (lambda: mc.all_reduce(tiles(3), mesh, "x"),
                       lambda d, v: v.tolist() == [n * k + total for k in range(3)]),
        "all_reduce avg": (lambda: mc.all_reduce(tiles(3), mesh, "x", op="avg"),
                           lambda d, v: v.tolist() == [k + total / n for k in range(3)]),
        "all_gather": (lambda: mc.all_gather(tiles(2), mesh, "x"),
                       lambda d, v: v.tolist() == [float(k + e) for e in range(n) for k in range(2)]),
        "reduce_scatter": (lambda: mc.reduce_scatter(tiles(n), mesh, "x"),
                           lambda d, v: v.tolist() == [float(n * d + total)]),
        "all_to_all": (lambda: mc.all_to_all(tiles(n), mesh, "x"),
                       lambda d, v: v.tolist() == [float(d + e) for e in range(n)]),
        "all_to_all_v": (lambda: mc.all_to_all_v(tiles(n), {d: [1] * n for d in mine}, mesh, "x"),
                         lambda d, v: v.tolist() == [float(d + e) for e in range(n)]),
        "reshard": (lambda: mc.reshard({d: torch.nn.Parameter(t) for d, t in mc.shard(x, rows).items()
                                        if d in mine}, rows, cols),
                    lambda d, v: torch.equal(v, want[d])),
        "reshard max": (lambda: mc.reshard({d: torch.nn.Parameter(x - float(d != 0)) for d in mine}, part, cols),
                        lambda d, v: torch.equal(v, want[d])),
        "reshard_many": (lambda: mc.reshard_many({"w": {d: torch.nn.Parameter(t) for d, t in mc.shard(x, rows).items()
                                                        if d in mine}}, rows, cols)["w"],
                         lambda d, v: torch.equal(v, want[d])),
    }
    for name, (call, right) in checks.items():
        y = call()
        assert isinstance(y, dict), (name, type(y))
        for d, v in y.items():
            assert right(d, v), (ctx.rank, name, d, v)
            assert not v.requires_grad, (ctx.rank, name, d, "a result requires grad")
        stats["parameters"] += 1


def run_bfloat16(ctx, stats):
    """NumPy bfloat16 tiles (ml_dtypes', as JAX's host arrays are) on every backend: over
    torch.distributed a reduction's buffer went through torch.from_numpy, which refuses them
    (TypeError); they now go over as their bits. Values are small integers: exact in bf16."""
    import ml_dtypes
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    mine = ctx.owned_devices(mc.Layout(mesh, ()))
    total = float(sum(range(1, n + 1)))

    def tiles(f):
        return {d: np.asarray(f(d), ml_dtypes.bfloat16) for d in mine}
    checks = [
        (lambda: mc.all_reduce(tiles(lambda d: np.full(3, d + 1.0)), mesh, "x"), lambda d: np.full(3, total)),
        (lambda: mc.all_reduce(tiles(lambda d: np.full(3, d + 1.0)), mesh, "x", op="max"), lambda d: np.full(3, n)),
        (lambda: mc.reduce_scatter(tiles(lambda d: np.arange(float(n))), mesh, "x"), lambda d: np.array([n * d])),
        (lambda: mc.all_gather(tiles(lambda d: np.full(2, d + 1.0)), mesh, "x"),
         lambda d: np.repeat(np.arange(1.0, n + 1), 2)),
        (lambda: mc.reshard(tiles(lambda d: np.ones((2, n))), mc.Layout(mesh, (None, None), partial=("x",)),
                            mc.Layout(mesh, (None, "x"))), lambda d: np.full((2, 1), n)),
    ]
    for call, want in checks:
        for d, v in call().items():
            assert v.dtype == ml_dtypes.bfloat16 and np.array_equal(v.astype(np.float32), want(d)), (ctx.rank, d, v)
        stats["bfloat16"] += 1


def run_check_every(ctx, stats):
    """MESHCOMM_CHECK=every (read when a Program is constructed): every run agrees first. It
    compared each process's own device ids, so every run of every call raised "processes
    disagree on input"."""
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    mine = ctx.owned_devices(mc.Layout(mesh, ()))
    os.environ["MESHCOMM_CHECK"] = "every"
    try:
        prog = mc.Program.all_reduce(mesh, "x", shape=(5,), dtype="int64")    # shapes no earlier call used
        src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, "x"))
        g = np.arange(n * n * 3, dtype=np.float64).reshape(n, 3 * n)
        rows = {d: np.full((d % 3, 2), d, np.int32) for d in mine}
        counts = {d: [d % 3 if j == d else 0 for j in range(n)] for d in mine}
        for _ in range(2):
            for d, v in prog({d: np.full(5, d, np.int64) for d in mine}).items():
                assert (v == sum(range(n))).all(), (ctx.rank, d, v)
            for d, v in mc.all_gather({d: np.full(7, d) for d in mine}, mesh, "x").items():
                assert np.array_equal(v, np.repeat(np.arange(n), 7)), (ctx.rank, d, v)
            out = mc.reshard({d: t for d, t in mc.shard(g, src).items() if d in mine}, src, dst)
            for d, v in out.items():
                assert np.array_equal(v, g[dst.index_map(g.shape)[d]]), (ctx.rank, d)
            for d, v in mc.all_to_all_v(rows, counts, mesh, "x").items():
                assert np.array_equal(v, rows[d]), (ctx.rank, d, v)
            stats["check_every"] += 4
    finally:
        os.environ.pop("MESHCOMM_CHECK")
    # a setting that shapes Programs set on one process only: every process raises in the
    # construction, naming it (MESHCOMM_EMULATE_GBPS made that one run a paced plan while the
    # others created a native call's communicator: all waited out the timeout)
    if ctx.rank == 0:
        os.environ["MESHCOMM_EMULATE_GBPS"] = "100"
    try:
        mc.Program.all_reduce(mesh, "x", shape=(9,), dtype="float32")
        raise AssertionError("a setting that differs on one process was not refused")
    except ValueError as e:
        assert "MESHCOMM_* settings" in str(e) and "rank(s) [0]" in str(e), e
        stats["settings_refused"] += 1
    finally:
        os.environ.pop("MESHCOMM_EMULATE_GBPS", None)


def run_given_up_over_gloo(ctx, args, stats):
    """Over torch (gloo) a wait given up leaves work that may still match a later call (gloo
    cancels nothing; its collectives match by order on one group): the next construction
    raises on every process, naming finalize() and init(), never a wrong value; after them
    calls work again. Returns the context to go on with."""
    if ctx.backend_name != "torch":
        return ctx
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, "x"))
    x = np.arange(2 * n * n, dtype=np.float32).reshape(2 * n, n)
    mine = {d: t for d, t in mc.shard(x, src).items() if d in ctx.owned_devices(src)}
    ones = {d: np.ones(3, np.float32) for d in ctx.owned_devices(src)}
    P = mc.Program.reshard(src, dst, shape=x.shape, dtype=x.dtype)
    Q = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="float32")
    # rank 1 runs Q while the others run P: each raises, and each gave gloo work up
    expect_error(ctx, lambda: Q(ones) if ctx.rank == 1 else P(mine), PeerError, "rank", "Programs apart", stats)
    expect_error(ctx, lambda: mc.all_reduce(ones, mesh, "x"), RuntimeError, "meshcomm.init() again",
                 "a call after gloo work was given up", stats)
    mc.finalize()
    ctx = mc.init(backend="torch", devices_per_process=args.dpp)
    y = mc.all_reduce(ones, mesh, "x")
    assert all((v == n).all() for v in y.values()), (ctx.rank, y)
    stats["given_up_over_gloo"] += 1
    # two all_reduce Programs of the same sizes, run in the other order by half the processes:
    # as gloo's native collectives (matched by order on one group) they completed against each
    # other, wrong sums on every process; as plans their messages carry each Program's tags
    S = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="float32")
    M = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="float32", op="max")
    first = M if ctx.rank >= ctx.world_size // 2 else S
    expect_error(ctx, lambda: first(ones), PeerError, "not in the same call", "Programs swapped", stats)
    mc.finalize()
    ctx = mc.init(backend="torch", devices_per_process=args.dpp)
    stats["swapped_over_gloo"] += 1
    return ctx


def run_old_program(ctx, old, stats):
    """A context's first Program; `old`, the first of the context before (finalized), raises,
    naming why, and reports nothing: it has the same number, and it ran with the new
    context's peers (wrong tiles over gloo) or failed the new one ("failed earlier")."""
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    new = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="float32", op="max")
    if old is None:
        return new
    assert new.id == old.id, (new, old)         # the same number: the case that went wrong
    ones = {d: np.ones(3, np.float32) for d in ctx.owned_devices(mesh)}
    for _ in range(2):
        try:
            old(ones)
            raise AssertionError(f"rank {ctx.rank}: a Program of a finalized context ran")
        except RuntimeError as e:
            assert "before meshcomm.finalize()" in str(e), e
    y = new({d: np.full(3, d, np.float32) for d in ones})
    assert all((v == n - 1).all() for v in y.values()), (ctx.rank, y)
    stats["old_program_refused"] += 1
    return new


def expect_error(ctx, fn, exc, needle, what, stats):
    try:
        fn()
    except exc as e:
        if needle not in str(e):
            raise AssertionError(f"{what}: rank {ctx.rank}: {type(e).__name__} without {needle!r}: {e}")
        stats["mismatch_ok"] += 1
        return e
    raise AssertionError(f"{what}: rank {ctx.rank}: no {exc.__name__} raised")


def run_checks(ctx, backends, stats):
    r, n = ctx.rank, ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    rev = mc.Mesh(np.arange(n)[::-1].copy(), ("x",))
    src, dst = mc.Layout(mesh, ("x",)), mc.Layout(rev, (None, "x"))
    for b in backends:
        # different global shapes
        rows = 3 * n if r == 0 else 2 * n
        x = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        sh = mc.shard(x, src)
        mine = {d: sh[d] for d in ctx.owned_devices(src)}
        expect_error(ctx, lambda: mc.reshard(mine, src, dst, backend=b, shape=x.shape),
                     ValueError, "disagree", f"shape mismatch [{b}]", stats)
        # different dst layouts
        x = np.arange(2 * n * 4, dtype=np.float32).reshape(2 * n, 4)
        sh = mc.shard(x, src)
        mine = {d: sh[d] for d in ctx.owned_devices(src)}
        dst_r = dst if r != 1 else mc.Layout(rev, ("x", None))
        expect_error(ctx, lambda: mc.reshard(mine, src, dst_r, backend=b),
                     ValueError, "disagree on the src/dst layouts", f"layout mismatch [{b}]", stats)
        # different dtypes
        mine_dt = {d: (v.astype(np.float64) if r == 0 else v) for d, v in mine.items()}
        expect_error(ctx, lambda: mc.reshard(mine_dt, src, dst, backend=b),
                     ValueError, "disagree on the dtype", f"dtype mismatch [{b}]", stats)
        # one process passes a tile of the wrong shape: it gets its own error, the others a
        # ValueError naming it
        bad = {d: (v[:-1] if r == 1 else v) for d, v in mine.items()}
        needle = "has shape" if r == 1 else "rank 1"
        expect_error(ctx, lambda: mc.reshard(bad, src, dst, backend=b, shape=x.shape),
                     ValueError, needle, f"bad tile on rank 1 [{b}]", stats)
        # and the context still works afterwards; rank 0 alone holds the src (the others learn
        # shape and dtype from the metadata exchange)
        one = mc.Layout(mc.Mesh([[0]], ("a", "b")), ())
        y = mc.reshard({0: x} if r == 0 else {}, one, dst, backend=b)
        ref = mc.reshard({0: x}, one, dst, backend="local")
        check_result(ctx, y, ref, dst, False, f"after mismatches [{b}]")
        stats["no_src"] += 1
        # processes without src tiles learn shape and dtype in every call (the agreement)
        for k, z in enumerate([x, x + 1, np.arange(5 * n * 4, dtype=np.float32).reshape(5 * n, 4),
                               np.arange(5 * n * 4, dtype=np.int32).reshape(5 * n, 4)]):
            y = mc.reshard({0: z} if r == 0 else {}, one, dst, backend=b)
            ref = mc.reshard({0: z}, one, dst, backend="local")
            check_result(ctx, y, ref, dst, False, f"guess {k} [{b}]")
            stats["no_src_ok"] += 1


def sync():
    """After an error between processes in different calls, they meet before going on (the
    failed construction's Meta is taken back by a message that must arrive first: README)."""
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()


def run_program_checks(ctx, b, stats):
    """Programs (meshcomm.runtime.program): a repeated eager call runs its Program without
    agreeing again; a process that makes another call than the others, passes bad input to a
    run, or runs Programs in another order makes every process raise (never a wrong value),
    and the context goes on working afterwards."""
    r, n = ctx.rank, ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    rev = mc.Mesh(np.arange(n)[::-1].copy(), ("x",))
    src, dst = mc.Layout(mesh, ("x",)), mc.Layout(rev, (None, "x"))
    x32 = np.arange(2 * n * 4, dtype=np.float32).reshape(2 * n, 4)
    sh = mc.shard(x32, src)
    mine = {d: sh[d] for d in ctx.owned_devices(src)}
    ref = mc.reshard(sh, src, dst, backend="local")

    def call(x, what):      # shape= given: tiles of one process do not pin it down
        s = mc.shard(x, src)
        y = mc.reshard({d: s[d] for d in ctx.owned_devices(src)}, src, dst, backend=b, shape=x.shape)
        check_result(ctx, y, mc.reshard(s, src, dst, backend="local"), dst, False, what)

    def establish(what):
        call(x32, what)
        k = ctx.programs
        for i in range(4):
            call(x32, f"{what} {i}")
        assert ctx.programs == k, f"rank {r}: {what}: repeated calls constructed {ctx.programs - k} Programs"

    establish(f"eager repeat [{b}]")
    errors = b == "mpi"         # gloo closes a connection whose given-up work times out (README)
    # rank 0 makes a new call (it constructs) while the others repeat theirs (they run): all raise
    if errors:
        expect_error(ctx, lambda: call(x32.astype(np.int32) if r == 0 else x32, "new call beside a run"),
                     ValueError, "rank", f"construct beside run [{b}]", stats)
        sync()
        establish(f"eager after a mismatch [{b}]")
    # an explicit Program, run many times, with out= buffers and asynchronously
    P = mc.Program.reshard(src, dst, shape=x32.shape, dtype=x32.dtype, backend=b)
    for i in range(3):
        check_result(ctx, P(mine), ref, dst, False, f"Program run {i} [{b}]")
    bufs = {d: np.empty_like(ref[d]) for d in ctx.owned_devices(dst)}
    got = P(mine, out=bufs)
    assert all(got[d] is bufs[d] for d in bufs), f"rank {r}: out= buffers were not used"
    check_result(ctx, got, ref, dst, False, f"Program out= [{b}]")
    hs = [P(mine, async_op=True) for _ in range(3)]
    called = []
    hs[0].add_done_callback(called.append)
    t0 = time.monotonic()
    while not hs[-1].is_completed():    # completes on the context's queue, with no wait()
        assert time.monotonic() - t0 < ctx.timeout, f"rank {r}: an async run never completed without wait()"
        time.sleep(0.001)
    assert all(h.is_completed() for h in hs) and called == [hs[0]], (r, called)
    for h in hs:
        check_result(ctx, h.wait(), ref, dst, False, f"Program async [{b}]")
    # a done callback that raises (a KeyboardInterrupt too) is printed, and one on the queue
    # that waits for a run queued behind it raises: the first ended the queue's thread (every
    # later wait waited forever), the second waited forever
    h1, h2 = P(mine, async_op=True), P(mine, async_op=True)
    seen = []

    def cb(h):
        import threading
        on_queue = threading.current_thread().name.startswith("meshcomm-comm")
        try:
            h2.wait()
            seen.append(not on_queue or h2.is_completed())
        except RuntimeError as e:
            seen.append(on_queue and "wait forever" in str(e))
        raise KeyboardInterrupt("raised by a done callback (expected)")
    h1.add_done_callback(cb)
    for h in (h1, h2, P(mine, async_op=True)):
        check_result(ctx, h.wait(), ref, dst, False, f"Program async after a callback [{b}]")
    assert seen == [True], (r, seen)
    if not errors:
        stats["program_ok"] += 1
        return
    # bad input in a run on rank 1: it raises its own error, the others one naming rank 1
    bad = {d: (v[:-1] if r == 1 else v) for d, v in mine.items()}
    expect_error(ctx, lambda: P(bad), ValueError, "shape" if r == 1 else "rank 1", f"bad run input [{b}]", stats)
    # the Program failed everywhere (its messages may still travel): it runs no more
    expect_error(ctx, lambda: P(mine), RuntimeError, "failed earlier", f"failed Program [{b}]", stats)
    # Programs run in different orders: every process raises
    P1 = mc.Program.reshard(src, dst, shape=x32.shape, dtype=x32.dtype, backend=b)
    P2 = mc.Program.reshard(dst, src, shape=x32.shape, dtype=x32.dtype, backend=b)
    y = P1(mine)
    mine_y = {d: y[d] for d in ctx.owned_devices(dst)}
    expect_error(ctx, lambda: (P2(mine_y) if r == 0 else P1(mine)), ValueError, "rank",
                 f"Programs out of order [{b}]", stats)
    sync()
    P3 = mc.Program.reshard(src, dst, shape=x32.shape, dtype=x32.dtype, backend=b)
    check_result(ctx, P3(mine), ref, dst, False, f"Program after errors [{b}]")
    run_deferred(ctx, b, stats)
    stats["program_ok"] += 1


def run_deferred(ctx, b, stats):
    """The last rank passes a bad out= to a run of a reshard Program: the peers whose part
    ended before its report came (the senders, at least) raise at their next call, here a
    construction (an eager all_reduce never made before): every process raises in it alike
    (or none does, where every peer raised in the run), and the calls after it pair up. The
    peers raised before that construction's agreement once: the last rank, a call ahead, then
    paired each of its all_reduces with their next one (wrong sums on every process)."""
    from mpi4py import MPI
    r, n = ctx.rank, ctx.world_size
    lo = mc.Layout(mc.Mesh(np.arange(n // 2), "a"), ("a",))
    hi = mc.Layout(mc.Mesh(np.arange(n // 2, n), "b"), (None, "b"))
    P = mc.Program.reshard(lo, hi, shape=(n, 6), dtype="float32", backend=b)
    x = {d: t for d, t in mc.shard(np.ones((n, 6), np.float32), lo).items() if d in ctx.owned_devices(lo)}
    out = {d: np.empty((5, 5), np.float32) for d in ctx.owned_devices(hi)} if r == n - 1 else None
    try:
        P(x, out=out)
    except ValueError as e:
        assert ("out=" if r == n - 1 else f"rank {n - 1}") in str(e), f"rank {r}: {e}"
    else:
        assert r != n - 1, "a bad out= was taken"
    sync()
    time.sleep(0.2)                 # the last rank's report reaches every peer
    mesh = mc.Mesh(np.arange(n), ("x",))
    raised = []
    for k in range(3):
        try:
            y = mc.all_reduce(np.full(7, 10.0 ** k + r, np.float32), mesh, "x", backend=b)
        except PeerError as e:
            assert k == 0 and f"rank {n - 1}" in str(e), f"rank {r}, call {k}: {e}"
            raised.append(k)
            continue
        assert (y == n * 10.0 ** k + n * (n - 1) // 2).all(), f"rank {r}, call {k}: a wrong sum {y[0]}"
    everyone = MPI.COMM_WORLD.allgather(raised)
    assert all(e == everyone[0] for e in everyone), f"raised in different calls: {everyone}"
    stats["deferred"] += 1
    stats["deferred_raised"] += len(raised)


def run_timeouts(ctx, backends, stats, timeout):
    """The last rank constructs the Programs but never runs them, nor constructs the next
    ones; the others must raise within the timeout naming it."""
    lag = ctx.world_size - 1
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(np.arange(n), ("x",))
    src, dst = mc.Layout(mesh, ("x",)), mc.Layout(mesh, (None,))
    x = np.arange(4 * n, dtype=np.float32)
    sh = mc.shard(x, src)
    mine = {d: sh[d] for d in ctx.owned_devices(src)}
    from meshcomm.backends.torch_dist import under_mpi_launcher
    alive = under_mpi_launcher()            # under torchrun the last rank has exited already
    progs = {b: mc.Program.reshard(src, dst, shape=x.shape, dtype=x.dtype, backend=b) for b in backends} \
        if alive else {}
    if ctx.rank == lag:
        return
    phases = [("construct", b) for b in backends] + [("run", b) for b in backends if b != "mixed" and alive]
    for phase, b in phases:
        t0 = time.monotonic()
        try:
            if phase == "construct":
                mc.reshard(mine, src, dst, backend=b)
            else:
                progs[b](mine)
        except PeerTimeoutError as e:
            dt = time.monotonic() - t0
            assert lag in e.peers, f"timeout [{phase} {b}]: rank {ctx.rank}: {e} does not name {lag}"
            assert f"{lag}" in str(e)
            assert dt < timeout + 4, f"timeout [{phase} {b}]: raised after {dt:.1f}s (timeout {timeout}s)"
            assert isinstance(e, TimeoutError) and isinstance(e, RuntimeError)
            stats[f"timeout_{phase}_{b}"] = round(dt, 2)
        else:
            raise AssertionError(f"timeout [{phase} {b}]: rank {ctx.rank}: reshard returned "
                                 f"although rank {lag} never called it")


def report(args, result: dict) -> None:
    """Print one RESULT line and, with --out, write it to OUT/rank<r>.json (stdout lines of
    several processes may interleave)."""
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
            f.write(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mixed", help="comma list: init/finalize each in turn")
    ap.add_argument("--backends", default="", help="comma list of reshard(backend=...) values "
                    "(default: the init backend)")
    ap.add_argument("--dpp", type=int, default=1)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--op-cases", type=int, default=8, help="cases with a pending prod/min/max")
    ap.add_argument("--checks", action="store_true")
    ap.add_argument("--timeout-test", action="store_true")
    ap.add_argument("--out", default="", help="a folder for one rank<r>.json result per process")
    ap.add_argument("--reduce", default="auto", help="backends.base.REDUCE_MODE (auto, ordered, collective)")
    args = ap.parse_args()
    base.REDUCE_MODE = args.reduce
    stats: Counter = Counter()
    t0 = time.time()
    inits = args.init.split(",")
    old = None          # a Program of the context before (finalized): it runs no more
    for k, name in enumerate(inits):
        ctx = mc.init(backend=name, devices_per_process=args.dpp)
        old = run_old_program(ctx, old, stats)
        backends = args.backends.split(",") if args.backends else [name]
        run_cases(ctx, args, backends, stats)
        run_agreed_then_failed(ctx, stats)
        run_parameters(ctx, stats)
        run_bfloat16(ctx, stats)
        run_check_every(ctx, stats)
        ctx = run_given_up_over_gloo(ctx, args, stats)
        if args.checks:
            run_checks(ctx, backends, stats)
            for b in backends:
                run_program_checks(ctx, b, stats)
        if args.timeout_test and k == len(inits) - 1:
            # under mpiexec the last rank "never arrives" (it waits in a barrier until the
            # others are done); under torchrun it "dies" (exits at once)
            from meshcomm.backends.torch_dist import under_mpi_launcher
            mpi = under_mpi_launcher()
            if not mpi and ctx.rank == ctx.world_size - 1:
                report(args, {"rank": ctx.rank, "exited_early": True})
                os._exit(0)
            run_timeouts(ctx, backends, stats, ctx.timeout)
            if mpi:
                from mpi4py import MPI
                MPI.COMM_WORLD.Barrier()        # the lagging rank waits here for the others
            stats.update({f"issued_{b}_{p}": c for (b, p), c in base.issued.items()})
            stats["streams_record"] = streams.stats["record"]
            stats["streams_wait_on"] = streams.stats["wait_on"]
            stats["seconds"] = round(time.time() - t0, 1)
            report(args, {"rank": ctx.rank, **stats})
            if not mpi:
                os._exit(0)                 # under torchrun a peer died: its groups are broken
            # leave through a normal exit, not os._exit: MPICH's MPI_Finalize leaves PMI
            # finalize to its exit hook, so after os._exit hydra's proxy sees a PMI socket
            # closed before finalize and SIGKILLs every process of the job still exiting
            # (exit code 9, about 1 launch in 20). meshcomm's finalize frees the process
            # groups (the timed-out ones too); mpi4py finalizes MPI at exit.
            try:
                mc.finalize()
            except PeerTimeoutError as e:   # the staged incident, reported to a process that
                if ctx.world_size - 1 not in e.peers:   # the lagging rank, at finalize
                    raise
            return
        rank = ctx.rank
        mc.finalize()
    stats.update({f"issued_{b}_{p}": c for (b, p), c in base.issued.items()})
    stats["streams_record"] = streams.stats["record"]
    stats["streams_wait_on"] = streams.stats["wait_on"]
    stats["seconds"] = round(time.time() - t0, 1)
    report(args, {"rank": rank, **stats})


if __name__ == "__main__":
    main()
