"""SPMD worker: random collectives on mesh axes checked against NumPy, and the fault matrix.

    mpiexec -n 8 python tests/workers/collectives_worker.py --init mixed --backends mpi,torch,mixed

Every process draws the same seeded cases: a random mesh over the world's devices (some
processes may own none of it), random group axes, an op, dtype, root and dims, uneven
gathers; it computes the NumPy reference from everyone's tiles and passes only its own.
Floats are compared within round-off (the plan's order is fixed, so backends agree
bitwise; NumPy sums in another order), integers exactly. Some calls are async and
several are in flight at once, on different backends. --faults runs the fault matrix: for
each entry point, one rank passes bad input; every rank must raise ValueError/TypeError
naming that rank within seconds, and the next call must succeed.
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
import wide_dtypes                            # noqa: E402
from cases import random_mesh                 # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter")
DTYPES = ("float32", "float64", "int32", "int64")
RED = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max, "avg": np.mean}


def draw(rng, ndev, wide=False):
    mesh = random_mesh(rng, list(range(ndev)))
    names = list(mesh.axis_names)
    k = int(rng.integers(1, len(names) + 1))
    axes = tuple(rng.permutation(names)[:k])
    op = OPS[int(rng.integers(len(OPS)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    red = ["sum", "prod", "min", "max", "avg"][int(rng.integers(5))]
    if red == "avg" and dtype.startswith("int"):
        red = "sum"
    if wide and rng.random() < 0.5:
        dtype = wide_dtypes.WIDE[int(rng.integers(len(wide_dtypes.WIDE)))]
        red = wide_dtypes.reduction_for(dtype, red, rng)
    return mesh, axes, op, dtype, red


def tiles_for(rng, mesh, axes, op, dtype, red, scalars=False):
    groups = mc.collectives.groups(mesh, axes)
    k = len(groups[0])
    nd = int(rng.integers(1, 3))
    if scalars and op in ("all_reduce", "broadcast", "reduce") and rng.random() < 0.3:
        nd = 0                                      # a 0-d tile (a loss, a count)
    shape = [int(rng.integers(1, 5)) for _ in range(nd)]
    dim = int(rng.integers(0, nd)) if nd else 0
    kw = {}
    if op == "all_to_all":
        s, c = int(rng.integers(0, nd)), int(rng.integers(0, nd))
        shape[s] = k * int(rng.integers(1, 3))
        kw = {"split_dim": s, "concat_dim": c}
    if op in ("reduce_scatter", "scatter"):
        shape[dim] = int(rng.integers(0, 2 * k + 2))
        kw = {"dim": dim}
    if op in ("all_gather", "gather"):
        kw = {"dim": dim}
    if op in ("broadcast", "reduce", "gather", "scatter"):
        kw["root"] = int(rng.integers(0, k))
    if op in ("all_reduce", "reduce", "reduce_scatter"):
        kw["op"] = red
    sizes = [int(rng.integers(0, 4)) for _ in range(k)]
    tiles = {}
    for g in groups:
        for i, d in enumerate(g):
            sh = list(shape)
            if op in ("all_gather", "gather"):
                sh[dim] = sizes[i]
            if dtype in wide_dtypes.WIDE:
                v = wide_dtypes.values(rng, sh, dtype, red)
            elif dtype.startswith("int"):
                hi = 3 if red == "prod" else 50
                v = rng.integers(-hi, hi + 1, size=sh).astype(dtype)
            else:
                v = rng.standard_normal(sh).astype(dtype)
            tiles[d] = v
    return tiles, kw


def reference(op, mesh, axes, tiles, kw):
    out = {}
    for g in mc.collectives.groups(mesh, axes):
        xs = [tiles[d] for d in g]
        k = len(g)
        if op in ("all_reduce", "reduce", "reduce_scatter"):
            if xs[0].dtype.name in wide_dtypes.WIDE:
                r = wide_dtypes.reduce(RED[kw["op"]], xs, kw["op"], xs[0].dtype.name)
            else:
                r = RED[kw["op"]](np.stack(xs), axis=0).astype(xs[0].dtype)
            if op == "all_reduce":
                out.update({d: r for d in g})
            elif op == "reduce":
                out[g[kw["root"]]] = r
            else:
                n = r.shape[kw["dim"]]
                c = -(-n // k)
                for i, d in enumerate(g):
                    sl = [slice(None)] * r.ndim
                    sl[kw["dim"]] = slice(min(i * c, n), min((i + 1) * c, n))
                    out[d] = r[tuple(sl)]
        elif op in ("all_gather", "gather"):
            r = np.concatenate(xs, axis=kw["dim"])
            if op == "all_gather":
                out.update({d: r for d in g})
            else:
                out[g[kw["root"]]] = r
        elif op == "broadcast":
            out.update({d: xs[kw["root"]] for d in g})
        elif op == "scatter":
            r = xs[kw["root"]]
            n = r.shape[kw["dim"]]
            c = -(-n // k)
            for i, d in enumerate(g):
                sl = [slice(None)] * r.ndim
                sl[kw["dim"]] = slice(min(i * c, n), min((i + 1) * c, n))
                out[d] = r[tuple(sl)]
        else:
            s, c = kw["split_dim"], kw["concat_dim"]
            for j, d in enumerate(g):
                out[d] = np.concatenate([np.split(x, k, axis=s)[j] for x in xs], axis=c)
    return out


def close(a, b, dtype):
    a = np.asarray(a)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if dtype in wide_dtypes.WIDE:
        return wide_dtypes.close(a, b, dtype)
    if dtype.startswith("int"):
        return np.array_equal(a, b)
    tol = 1e-5 if dtype == "float32" else 1e-12
    return np.allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max(initial=0))) * 8)


def run_cases(ctx, args, backends, stats):
    ndev = ctx.world_size * ctx.devices_per_process
    pending = []
    for i in range(args.start, args.cases):
        rng = np.random.default_rng((args.seed, i))
        mesh, axes, op, dtype, red = draw(rng, ndev, args.wide)
        tiles, kw = tiles_for(rng, mesh, axes, op, dtype, red, scalars=args.wide)
        ref = reference(op, mesh, axes, tiles, kw)
        b = backends[i % len(backends)]
        torch_in = args.wide and rng.random() < 0.3     # torch tiles in, torch tiles out (same on every rank)
        owned = ctx.owned_devices(mesh)
        mine = {d: tiles[d] for d in owned}
        bare = len(owned) == 1 and rng.random() < 0.6
        x = (mine[owned[0]] if bare else mine) if owned else None
        if op in ("broadcast", "scatter") and rng.random() < 0.5:       # non-roots pass None
            roots = {g[kw["root"]] for g in mc.collectives.groups(mesh, axes)}
            if bare and owned[0] not in roots:
                x = None
            elif not bare and owned:
                x = {d: v for d, v in mine.items() if d in roots}
        if torch_in:
            x = wide_dtypes.as_torch(x)
        fn = getattr(mc, op)
        what = f"case {i} [{b}] {op} {dtype} axes={axes} kw={kw} mesh={mesh}"
        asy = rng.random() < 0.4
        h = fn(x, mesh, axes, backend=b, async_op=asy, **kw)
        pending.append((h, asy, ref, owned, bare, what, dtype, torch_in))
        stats[f"{op}_{b}"] += 1
        if len(pending) >= 6 or not asy:        # several async calls in flight at once
            for item in pending:
                check(ctx, *item)
            stats["ok"] += len(pending)
            stats["async"] += sum(1 for p in pending if p[1])
            pending.clear()
    for item in pending:
        check(ctx, *item)
    stats["ok"] += len(pending)



def zero_d(ctx, backends, stats):
    """0-d tiles on a mesh whose device order is not the ranks' (received straight into the
    tile: a 0-d tile indexed by () is a scalar copy, and a receive into it was lost): a
    broadcast from every root, and a reshard repeated so it runs compiled, on each backend."""
    n = ctx.world_size * ctx.devices_per_process
    order = list(np.random.default_rng(5).permutation(n))
    mesh = mc.Mesh(np.array(order).reshape(n, 1), ("x", "y"))
    owned = ctx.owned_devices(mesh)
    for b in backends:
        for root in range(n):
            x = {d: np.array(1000 + d, dtype=np.uint32) for d in owned}
            y = mc.broadcast(x or None, mesh, ("x", "y"), root=root, backend=b)
            for d in owned:
                assert y[d].shape == () and y[d] == 1000 + order[root], \
                    f"zero_d [{b}] broadcast root {root}: rank {ctx.rank} device {d}: {y[d]!r}"
        src = mc.Layout(mc.Mesh(order[:2], ("x",)), ())
        dst = mc.Layout(mc.Mesh(order[::-1][:3], ("x",)), ())
        x = {d: np.array(42.5, dtype=np.float64) for d in ctx.owned_devices(src)}
        for k in range(5):
            y = mc.reshard(x, src, dst, shape=(), dtype="float64", backend=b)
            for d in ctx.owned_devices(dst):
                assert y[d].shape == () and y[d] == 42.5, f"zero_d [{b}] reshard {k}: rank {ctx.rank} device {d}: {y[d]!r}"
    stats["zero_d_ok"] += 1

def check(ctx, h, asy, ref, owned, bare, what, dtype, torch_in=False):
    got = h.wait() if asy else h
    if torch_in:
        got = wide_dtypes.as_numpy(got, what)
    for v in (got.values() if isinstance(got, dict) else [got]):
        assert not isinstance(v, np.generic), f"{what}: rank {ctx.rank}: a NumPy scalar {v!r}, not an array"
    if bare:
        want = ref.get(owned[0])
        if want is None:
            assert got is None, f"{what}: rank {ctx.rank} expected None, got {got!r}"
            return
        assert close(got, want, dtype), f"{what}: rank {ctx.rank}: got {got!r}\nwant {want!r}"
        return
    if not owned:
        assert got is None or got == {}, f"{what}: rank {ctx.rank} owns no device, got {got!r}"
        return
    want_devs = sorted(d for d in owned if d in ref)
    assert sorted(got) == want_devs, f"{what}: rank {ctx.rank}: devices {sorted(got)}, want {want_devs}"
    for d in want_devs:
        assert close(got[d], ref[d], dtype), f"{what}: rank {ctx.rank} device {d}: got {got[d]!r}\nwant {ref[d]!r}"


# -- the fault matrix ----------------------------------------------------------------------

def faults(ctx, backends, stats, limit):
    """For each entry point and backend, one rank (the last) gets bad input; every rank must
    raise within `limit` seconds with a message naming that rank; then a good call works."""
    n = ctx.world_size * ctx.devices_per_process
    bad = ctx.world_size - 1
    mesh = mc.Mesh(np.arange(n), ("x",))
    me = ctx.rank == bad
    dev = ctx.owned_devices(mesh)[0]
    f32 = np.ones((4, 3), np.float32)

    def a2av(kind):
        rows = np.ones((n, 2), np.float32)
        counts = [1] * n
        if me and kind == "dtype":
            rows = rows.astype(np.float64)
        if me and kind == "width":
            rows = np.ones((n, 3), np.float32)
        if me and kind == "counts_len":
            counts = [1] * (n + 1)
        if me and kind == "counts_sum":
            counts = [2] + [1] * (n - 1)
        return lambda b: mc.all_to_all_v(rows, counts, mesh, "x", backend=b)

    def reshard(kind):
        src, dst = mc.Layout(mesh, ("x",)), mc.Layout(mesh, (None,))
        t = np.ones(2, np.float32)
        if me and kind == "endian":
            t = t.astype(">f4")
            return lambda b: ("endian", mc.reshard(t, src, dst, backend=b))
        if me and kind == "size":
            t = np.ones(3, np.float32)
        return lambda b: mc.reshard(t, src, dst, backend=b)

    def coll(op, kind):
        x = f32
        kw = {}
        if me and kind == "dtype":
            x = x.astype(np.float64)
        if me and kind == "shape":
            x = np.ones((5, 3), np.float32)
        if me and kind == "op":
            kw = {"op": "max"}
        if me and kind == "other_op":
            return lambda b: mc.all_gather(x, mesh, "x", backend=b)
        return lambda b: getattr(mc, op)(x, mesh, "x", backend=b, **kw)

    def bad_backend(b):
        return mc.all_reduce(f32, mesh, "x", backend="nccl" if me else b)

    matrix = [("all_to_all_v:dtype", a2av("dtype")), ("all_to_all_v:width", a2av("width")),
              ("all_to_all_v:counts_len", a2av("counts_len")), ("all_to_all_v:counts_sum", a2av("counts_sum")),
              ("reshard:size", reshard("size")),
              ("all_reduce:dtype", coll("all_reduce", "dtype")), ("all_reduce:shape", coll("all_reduce", "shape")),
              ("all_reduce:op", coll("all_reduce", "op")), ("all_reduce:other_op", coll("all_reduce", "other_op")),
              ("broadcast:shape", coll("broadcast", "shape")), ("reduce_scatter:dtype", coll("reduce_scatter", "dtype")),
              ("all_gather:dtype", coll("all_gather", "dtype")), ("backend:nccl", bad_backend)]
    for b in backends:
        for name, fn in matrix:
            t0 = time.monotonic()
            try:
                fn(b)
            except (ValueError, TypeError) as e:
                dt = time.monotonic() - t0
                msg = str(e)
                assert me or f"rank {bad}" in msg or f"rank(s) [{bad}]" in msg or f", {bad}]" in msg, \
                    f"fault {name} [{b}]: rank {ctx.rank}: the error does not name rank {bad}: {msg}"
                assert dt < limit, f"fault {name} [{b}]: rank {ctx.rank} raised after {dt:.1f}s"
                stats["fault_raised"] += 1
                stats["fault_max_s"] = max(stats.get("fault_max_s", 0), round(dt, 2))
            else:
                raise AssertionError(f"fault {name} [{b}]: rank {ctx.rank}: no error")
            y = mc.all_reduce(np.full(3, ctx.rank, np.int64), mesh, "x", backend=b)   # the next call works
            assert np.array_equal(y, np.full(3, sum(range(ctx.world_size)), np.int64)), y
            stats["fault_next_ok"] += 1
        # a byte-swapped tile on one rank: converted, the call is right everywhere
        src, dst = mc.Layout(mesh, ("x",)), mc.Layout(mesh, (None,))
        t = np.full(2, dev, np.float32)
        y = mc.reshard(t.astype(">f4") if me else t, src, dst, backend=b)
        assert np.array_equal(y, np.repeat(np.arange(n, dtype=np.float32), 2)), y
        stats["endian_ok"] += 1


def p2p(ctx, backends, stats):
    """Pairs (0,1), (2,3), ...: the even rank sends then receives, the odd one the reverse;
    then the odd rank expects the wrong dtype: it raises, naming both devices, and the pair
    goes on."""
    me = ctx.rank
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= ctx.world_size:
        return
    for b in backends:
        for n in (0, 5, 300_000):
            x = np.arange(n, dtype=np.float32) + me
            like = np.empty(n, np.float32)
            if me % 2 == 0:
                mc.send(x, peer, backend=b)
                y = mc.recv(peer, like, backend=b)
            else:
                y = mc.recv(peer, like, backend=b)
                mc.send(x, peer, backend=b)
            assert np.array_equal(y, np.arange(n, dtype=np.float32) + peer), (b, n)
            stats["p2p_ok"] += 1
        if me % 2 == 0:
            mc.send(np.zeros(3, np.float64), peer, backend=b)
        else:
            try:
                mc.recv(peer, np.zeros(3, np.float32), backend=b)
            except ValueError as e:
                assert f"device {peer} sent float64 (3,) to device {me}" in str(e), str(e)
                stats["p2p_mismatch_ok"] += 1
            else:
                raise AssertionError("recv accepted a float64 message as float32")
        if me % 2 == 0:
            y = mc.recv(peer, np.zeros(2, np.int64), backend=b)
        else:
            mc.send(np.array([7, 8]), peer, backend=b)
            y = np.array([7, 8])
        assert y.tolist() == [7, 8]


def repeats(ctx, backends, stats):
    """Calls that repeat one every process made before: the hashes decide them, with the
    native call already posted beside the hashes (MPI). Broadcasts whose non-roots pass None
    (they guess the tile). An uneven all_gather whose sizes stay, then change (a confirmed
    guess posted early turns out wrong: every process resets and starts over), then
    alternate (guesses not yet confirmed: no early post, no reset). A bad input on a
    repeated call: every rank raises, naming it; the next call works."""
    from meshcomm.backends.base import issued
    ws, me, bad = ctx.world_size, ctx.rank, ctx.world_size - 1
    mesh = mc.Mesh(np.arange(ws), ("x",))
    total = sum(range(ws))

    def gather(sizes, b, what):
        x = np.full((sizes[me], 2), me, np.int64)
        y = mc.all_gather(x, mesh, "x", backend=b)
        want = np.concatenate([np.full((s, 2), r, np.int64) for r, s in enumerate(sizes)])
        assert np.array_equal(y, want), (b, what, sizes, y)

    for b in backends:
        before = issued[("optimistic_native", "mpi")]
        sig_before = issued[("signature_check", "mpi")]
        compiled_before = issued[("compiled", "mpi")]
        for it in range(5):
            y = mc.all_reduce(np.full((4, 3), me, np.float32), mesh, "x", backend=b)
            assert np.array_equal(y, np.full((4, 3), total, np.float32)), (b, it, y)
            x = np.full((2, 2), me, np.int32)
            y = mc.all_gather(x, mesh, "x", backend=b)
            assert np.array_equal(y, np.repeat(np.arange(ws, dtype=np.int32), 2)[:, None].repeat(2, 1)), y
            y = mc.broadcast(np.arange(6.0) + it if me == 0 else None, mesh, "x", root=0, backend=b)
            assert np.array_equal(y, np.arange(6.0) + it), (b, it, y)
            y = mc.reduce_scatter(np.full(2 * ws, me + it, np.int64), mesh, "x", backend=b)
            assert np.array_equal(y, np.full(2, total + ws * it, np.int64)), (b, it, y)
            stats["repeat_ok"] += 1
        if b == "mpi":
            assert issued[("optimistic_native", "mpi")] > before, "no native call was posted beside the hashes"
            if signature_checks(ctx):       # from the fourth call on (the hashes agreed twice)
                assert issued[("signature_check", "mpi")] >= sig_before + 4 * 2, "no signature check"
                if settings_on("FAST_PATH"):    # the fifth call of each ran compiled (no broadcast
                    # on non-roots: they pass None, which has no compiled form)
                    assert issued[("compiled", "mpi")] >= compiled_before + 3, "no compiled call"
                    stats["compiled"] += issued[("compiled", "mpi")] - compiled_before
        stats["optimistic_native"] += issued[("optimistic_native", "mpi")] - before
        if b == "mpi" and signature_checks(ctx) and settings_on("FAST_PATH"):
            # rank 0 turns the compiled form off: it checks on the full path, beside the
            # others' compiled calls (the same signature check), and the results stay exact
            if me == 0:
                os.environ["MESHCOMM_FAST_PATH"] = "0"
            c0 = issued[("compiled", "mpi")]
            for it in range(3):
                y = mc.all_reduce(np.full((4, 3), me, np.float32), mesh, "x", backend=b)
                assert np.array_equal(y, np.full((4, 3), total, np.float32)), (b, it, y)
            assert issued[("compiled", "mpi")] - c0 == (0 if me == 0 else 3), (me, issued[("compiled", "mpi")] - c0)
            os.environ.pop("MESHCOMM_FAST_PATH", None)
            stats["compiled_mixed_ok"] += 1
        if b == "mpi" and signature_checks(ctx) and settings_on("FAST_PATH"):
            # 80 call signatures over every process (more than a sub-group may keep): each
            # gets its own communicator and runs compiled from its fourth call
            c0 = issued[("compiled", "mpi")]
            for k in range(80):
                for it in range(5):
                    y = mc.all_reduce(np.full(k + 1, me + it, np.int32), mesh, "x", backend=b)
                    assert np.array_equal(y, np.full(k + 1, total + ws * it, np.int32)), (k, it, y)
            assert issued[("compiled", "mpi")] - c0 == 2 * 80, issued[("compiled", "mpi")] - c0
            stats["many_signatures_ok"] += 1
        # c differs from a on the last rank only: the others' tiles still fit the confirmed
        # guess `a`, so they post early while the last rank does not; all must reset
        a = [1 + r % 3 for r in range(ws)]
        c = a[:-1] + [a[-1] + 1]
        resets = issued[("reset", "mpi")]
        for i, sizes in enumerate([a, a, a, c, c]):
            gather(sizes, b, f"sizes change, call {i}")
        if b == "mpi":          # the third call confirmed `a`, the fourth posted it early: wrong
            assert issued[("reset", "mpi")] > resets, "a wrong guess posted early did not reset"
        resets = issued[("reset", "mpi")]
        for i in range(4):
            gather(a if i % 2 else [2 + r % 2 for r in range(ws)], b, f"sizes alternate, call {i}")
        assert issued[("reset", "mpi")] == resets, "alternating sizes reset the communicators"
        stats["repeat_ok"] += 1
        x = np.full((2, 2), me, np.int32)
        t0 = time.monotonic()
        try:
            mc.all_gather(x.astype(np.int64) if me == bad else x, mesh, "x", backend=b)
        except (ValueError, TypeError) as e:
            assert me == bad or f"rank(s) [{bad}]" in str(e) or f", {bad}]" in str(e), str(e)
            stats["repeat_fault_raised"] += 1
            stats["fault_max_s"] = max(stats.get("fault_max_s", 0), round(time.monotonic() - t0, 2))
        else:
            raise AssertionError(f"all_gather [{b}]: rank {me}: an int64 tile on rank {bad} raised nothing")
        y = mc.all_gather(x, mesh, "x", backend=b)
        assert np.array_equal(y, np.repeat(np.arange(ws, dtype=np.int32), 2)[:, None].repeat(2, 1)), y
        stats["repeat_fault_next_ok"] += 1
        # two calls each made before by every process (each with a signature communicator
        # over MPI): the last rank makes the other one; every rank raises in this call
        x = np.full(3, me + 1, np.int64)
        for _ in range(5):
            assert mc.all_reduce(x, mesh, "x", op="sum", backend=b).tolist() == [total + ws] * 3
            assert mc.all_reduce(x, mesh, "x", op="max", backend=b).tolist() == [ws] * 3
        try:
            mc.all_reduce(x, mesh, "x", op="max" if me == bad else "sum", backend=b)
        except ValueError as e:
            assert "disagree" in str(e) and "max" in str(e), str(e)
            stats["repeat_fault_raised"] += 1
        else:
            raise AssertionError(f"all_reduce [{b}]: rank {me}: op max on rank {bad} raised nothing")
        assert mc.all_reduce(x, mesh, "x", op="sum", backend=b).tolist() == [total + ws] * 3
        stats["repeat_fault_next_ok"] += 1


def repeated_ops(ctx, backends, stats):
    """Every op repeated with fresh values each call, NumPy and torch tiles (0-d tiles
    averaged too), over every process and over sub-groups: from the fourth call on they run compiled (over MPI
    the lean form: collective_call.run), and every result stays exact and of the input's kind."""
    import torch
    from meshcomm.backends.base import issued
    ws, me = ctx.world_size, ctx.rank
    mesh = mc.Mesh(np.arange(ws), ("x",))
    total = sum(range(ws))
    for b in backends:
        c0 = issued[("compiled", "mpi")]
        for kind in ("numpy", "torch"):
            def arr(a):
                return torch.from_numpy(np.array(a)) if kind == "torch" else np.array(a)

            def same(y, want, what):
                want = np.asarray(want)
                assert (torch.is_tensor(y) if kind == "torch" else type(y) is np.ndarray), (b, kind, what, type(y))
                got = y.numpy() if kind == "torch" else y
                assert got.shape == want.shape and np.array_equal(got, want), (b, kind, what, got, want)
            for it in range(6):
                v = me * 10 + it
                same(mc.all_reduce(arr(np.float64(v)), mesh, "x", op="avg", backend=b),
                     np.float64(total * 10 / ws + it), "avg 0-d")
                same(mc.all_reduce(arr(np.full(3, v, np.int64)), mesh, "x", op="max", backend=b),
                     np.full(3, (ws - 1) * 10 + it), "max")
                y = mc.reduce(arr(np.full(2, v, np.int32)), mesh, "x", root=1 % ws, backend=b)
                if me == 1 % ws:
                    same(y, np.full(2, total * 10 + ws * it, np.int32), "reduce")
                else:
                    assert y is None, (b, kind, "reduce non-root", y)
                y = mc.gather(arr(np.full((1, 2), v, np.float32)), mesh, "x", root=0, backend=b)
                if me == 0:
                    same(y, np.array([[r * 10 + it] * 2 for r in range(ws)], np.float32), "gather")
                else:
                    assert y is None, (b, kind, "gather non-root", y)
                same(mc.broadcast(arr(np.full(4, v, np.float32)), mesh, "x", root=ws - 1, backend=b),
                     np.full(4, (ws - 1) * 10 + it, np.float32), "broadcast")
                same(mc.scatter(arr(np.arange(2 * ws, dtype=np.int64) + v), mesh, "x", root=0, backend=b),
                     np.arange(2 * me, 2 * me + 2) + it, "scatter")
                same(mc.all_to_all(arr(np.full((ws, 2), v, np.int64)), mesh, "x", backend=b),
                     np.array([[r * 10 + it] * 2 for r in range(ws)]), "all_to_all")
                same(mc.reduce_scatter(arr(np.full(ws, v, np.float64)), mesh, "x", op="avg", backend=b),
                     np.full(1, total * 10 / ws + it), "reduce_scatter avg")
            # no tile passed: non-roots of broadcast and scatter, and the process outside a
            # mesh of the others; they run compiled too (the receive, or the check alone)
            c1 = issued[("compiled", "mpi")]
            part = mc.Mesh(np.arange(max(ws - 1, 1)), ("x",))
            for it in range(6):
                v = me * 10 + it
                same(mc.broadcast(arr(np.full(4, v, np.float32)) if me == ws - 1 else None, mesh, "x",
                                  root=ws - 1, backend=b), np.full(4, (ws - 1) * 10 + it, np.float32), "broadcast from None")
                same(mc.scatter(arr(np.arange(2 * ws, dtype=np.int64) + v) if me == 0 else None, mesh, "x",
                                root=0, backend=b), np.arange(2 * me, 2 * me + 2) + it, "scatter from None")
                y = mc.all_reduce(arr(np.full(2, me + it, np.int64)) if me < part.size else None, part, "x", backend=b)
                if me < part.size:
                    same(y, np.full(2, sum(range(part.size)) + part.size * it), "a mesh without the last process")
                else:
                    assert y is None, (b, kind, "outside the mesh", y)
            if b == "mpi" and signature_checks(ctx) and settings_on("FAST_PATH"):
                assert issued[("compiled", "mpi")] - c1 >= 3 * 2, (b, kind, "no tile", issued[("compiled", "mpi")] - c1)
            # a call repeated (compiled) while the others make another one, where this process's
            # own part completes at once (a rooted op's root or non-root; a member that
            # receives 0 bytes): it must still raise with the others
            one = arr(np.ones((1, 2), np.float32))
            early = [(op, lambda op=op, root=root: getattr(mc, op)(
                        arr(np.ones((ws, 2), np.float32)) if op == "scatter" else one, mesh, "x", root=root, backend=b),
                      root if op in ("broadcast", "scatter") else (root + 1) % ws)
                     for op, root in (("broadcast", ws - 1), ("scatter", 0), ("reduce", 0), ("gather", 0))]
            big = arr(np.ones(16384, np.float32))         # past native_call.SYMMETRIC_MAX: a real broadcast
            early += [("broadcast of 64 KiB", lambda: mc.broadcast(big, mesh, "x", root=0, backend=b), 0),
                      ("all_to_all of 0 bytes", lambda: mc.all_to_all(arr(np.zeros((0, 2), np.float32)), mesh, "x",
                                                                    backend=b), 0),
                      ("reduce_scatter, an empty chunk", lambda: mc.reduce_scatter(arr(np.ones((ws - 1, 2), np.float32)),
                                                                                   mesh, "x", backend=b), ws - 1)]
            for what, call, odd in early:
                for _ in range(5):
                    call()
                try:
                    if me == odd:
                        call()
                    else:
                        mc.all_reduce(arr(np.ones(3, np.float32)), mesh, "x", backend=b)
                except ValueError as e:
                    assert "disagree" in str(e), (b, kind, what, str(e))
                else:
                    raise AssertionError(f"rank {me}: {b} {kind} {what}: no error while the others called all_reduce")
                same(mc.all_reduce(arr(np.full(2, me, np.int64)), mesh, "x", backend=b), np.full(2, total), "after")
            # asynchronous repeats (the lean form on the queue's thread): several in flight,
            # waited in order, then one process's repeated async call against the others' all_reduce
            for it in range(6):
                hs = [(mc.all_reduce(arr(np.full(3, me + it + k, np.int64)), mesh, "x", backend=b, async_op=True),
                       np.full(3, total + ws * (it + k)), f"async all_reduce {k}") for k in range(3)]
                hs.append((mc.all_gather(arr(np.full((1, 2), me + it, np.float32)), mesh, "x", backend=b, async_op=True),
                           np.array([[r + it] * 2 for r in range(ws)], np.float32), "async all_gather"))
                for h, want, what in hs:
                    same(h.wait(), want, what)
            for _ in range(5):
                mc.broadcast(one, mesh, "x", root=0, backend=b, async_op=True).wait()
            h = (mc.broadcast(one, mesh, "x", root=0, backend=b, async_op=True) if me == ws - 1 else
                 mc.all_reduce(arr(np.ones(3, np.float32)), mesh, "x", backend=b, async_op=True))
            try:
                h.wait()
            except ValueError as e:
                assert "disagree" in str(e), (b, kind, "async", str(e))
            else:
                raise AssertionError(f"rank {me}: {b} {kind}: async repeat: no error while the others called all_reduce")
            same(mc.all_reduce(arr(np.full(2, me, np.int64)), mesh, "x", backend=b), np.full(2, total), "after async")
            if ws % 2 == 0:             # sub-groups: rows and columns of a 2 x ws/2 mesh
                grid = mc.Mesh(np.arange(ws).reshape(2, ws // 2), ("a", "b"))
                row, col = divmod(me, ws // 2)
                for it in range(6):
                    same(mc.all_reduce(arr(np.full(3, me + it, np.int64)), grid, "b", backend=b),
                         np.full(3, sum(range(row * ws // 2, (row + 1) * ws // 2)) + ws // 2 * it), "rows")
                    same(mc.all_gather(arr(np.full((1, 2), me + it, np.float32)), grid, "a", backend=b),
                         np.array([[col + it] * 2, [col + ws // 2 + it] * 2], np.float32), "columns")
        if b == "mpi" and signature_checks(ctx) and settings_on("FAST_PATH"):
            # calls 4-6 of each op and kind compiled (the 4th may still check on the full path)
            assert issued[("compiled", "mpi")] - c0 >= 2 * 8 * 2, (b, issued[("compiled", "mpi")] - c0)
        stats["repeated_ops_ok"] += 1


def settings_on(name: str) -> bool:
    from meshcomm import settings
    return bool(settings.get(name))


def signature_checks(ctx) -> bool:
    """Whether repeated calls are checked by signature communicators (the allgather form)."""
    from meshcomm import settings
    from meshcomm.runtime.agreement import check_mode
    return settings.get("SIGNATURE_CHECK") and check_mode(ctx.backend) == "allgather"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mixed")
    ap.add_argument("--backends", default="")
    ap.add_argument("--dpp", type=int, default=1)
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case (to replay one failing case)")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--wide", action="store_true", help="element types beyond float32/64, int32/64 too")
    ap.add_argument("--fault-limit", type=float, default=15.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ctx = mc.init(backend=args.init, devices_per_process=args.dpp)
    backends = args.backends.split(",") if args.backends else [args.init]
    stats: Counter = Counter()
    t0 = time.time()
    run_cases(ctx, args, backends, stats)
    zero_d(ctx, backends, stats)
    if args.faults and args.dpp == 1:
        faults(ctx, backends, stats, args.fault_limit)
        p2p(ctx, backends, stats)
        repeats(ctx, backends, stats)
        repeated_ops(ctx, backends, stats)
    stats["seconds"] = round(time.time() - t0, 1)
    from meshcomm.backends.base import issued
    stats["native"] = sum(v for (b, _), v in issued.items() if b.startswith("native_"))
    result = {"rank": ctx.rank, **stats}
    mc.finalize()
    line = json.dumps(result)
    print("RESULT " + line, flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
            f.write(line)


if __name__ == "__main__":
    main()
