"""SPMD worker: compressed collectives and reshards against zfpy's own round trip and the documented error bounds.

    mpiexec -n 4 python tests/workers/compressed_worker.py --init mixed --backends mpi,torch --out DIR

Every process draws the same seeded tiles, computes the reference from everyone's, passes
only its own. Checked: all_gather equals, tile by tile, zfpy.decompress_numpy(
zfpy.compress_numpy(tile)) bit for bit on every device (fixed rate, tolerance, float64,
dim 1, groups of a 2-d mesh, async; eager calls, and Programs run twice); reduce_scatter
one-shot and ring within (k-1)·tolerance plus rounding; all_reduce with bf16 within the
cast's bound; reshard between meshes within the tolerance with identical replicas; the bytes
each process sends (`meshcomm.backends.compressed.stats`); a codec disagreement raises on
every process and the next call works; with --pace, a 1 MiB message at 0.08 Gb/s takes
>= 0.1 s. With --nonfinite, only NaN/Inf through all_gather (bit for bit, every codec) and
all_reduce and reduce_scatter (one-shot and ring: IEEE's sums of non-finite addends).

The reduce algorithm and per-hop compression are module attributes
(`codec_cost.REDUCE_ALGORITHM`, `codec_cost.PER_HOP`) set alike on every process; a Program
takes them at its construction, so the cases that change them construct Programs
(`mc.Program.reduce_scatter(...)`, ...) after setting them: an eager call repeated with the
same arguments would run the Program its first call constructed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import zfpy
from meshcomm.backends import codec_cost
from meshcomm.backends.compressed import stats

import meshcomm as mc
from meshcomm.errors import PeerError
from meshcomm.compression import ZFP

F32_EPS = 2.0 ** -23


def tiles(shape, n, dtype, seed):
    return [np.random.default_rng(seed + q).standard_normal(shape).astype(dtype) for q in range(n)]


def zfp_rt(a, codec):
    kw = {codec.mode: getattr(codec, codec.mode)}
    return zfpy.decompress_numpy(zfpy.compress_numpy(a, **kw))


def mine(ctx, mesh, values):
    """{device: values[device]} for the devices of `mesh` this process owns (bare when one)."""
    own = [d for d in mesh.device_ids if d // ctx.devices_per_process == ctx.rank]
    return own, (values[own[0]] if len(own) == 1 else {d: values[d] for d in own})


def each(res, own):
    return {own[0]: res} if len(own) == 1 else res


def tile_shape(own, x):
    """A Program's `shape`: this process's tile (every tile it owns has the same shape here)."""
    return None if not own else tuple((x if len(own) == 1 else next(iter(x.values()))).shape)


def check_all_gather(ctx, backend, counts):
    n = ctx.world_size * ctx.devices_per_process
    flat = mc.Mesh(list(range(n)), ("x",))
    grid = mc.Mesh(np.arange(n).reshape(2, -1), ("a", "b"))
    cases = [(flat, "x", (37, 13), "float32", ZFP(rate=8), 0), (flat, "x", (37, 13), "float32", ZFP(tolerance=1e-3), 1),
             (flat, "x", (21, 6, 5), "float64", ZFP(rate=16), 0), (grid, "b", (19, 7), "float32", ZFP(rate=12), 0),
             (grid, ("a", "b"), (9,), "float32", ZFP(precision=14), 0)]
    for k, (mesh, axes, shape, dt, codec, dim) in enumerate(cases):
        xs = tiles(shape, n, dt, 100 * k)
        own, x = mine(ctx, mesh, xs)
        sent = stats["sent_bytes"]
        h = mc.all_gather(x, mesh, axes, dim=dim, backend=backend, compression=codec, async_op=k == 1)
        res = each(h.wait() if k == 1 else h, own)
        runs = [res]
        if k in (2, 3):         # the same through a Program, run twice (the second asynchronously)
            prog = mc.Program.all_gather(mesh, axes, shape=tile_shape(own, x), dtype=dt, dim=dim, backend=backend,
                                         compression=codec)
            runs += [each(prog(x), own), each(prog(x, async_op=True).wait(), own)]
            counts["program_runs"] += 2
        for d in own:
            group = next(g for g in mc.collectives.groups(mesh, (axes,) if isinstance(axes, str) else axes) if d in g)
            ref = np.concatenate([zfp_rt(xs[q], codec) for q in group], axis=dim)
            for got in runs:
                assert got[d].dtype == ref.dtype and np.array_equal(got[d], ref), (k, d, codec)
        if k == 0 and ctx.devices_per_process == 1:
            counts["ag_sent"] = stats["sent_bytes"] - sent
            counts["ag_tile_wire"] = codec.wire_bytes(shape, dt)
        counts["all_gather"] += 1


def check_reduce_scatter(ctx, backend, counts):
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(list(range(n)), ("x",))
    for k, algo in enumerate(("oneshot", "ring")):
        codec_cost.REDUCE_ALGORITHM = algo          # taken by the Program constructed next
        t = 1e-3
        xs = tiles((8 * n, 5), n, "float32", 500 + k)
        own, x = mine(ctx, mesh, xs)
        prog = mc.Program.reduce_scatter(mesh, "x", shape=tile_shape(own, x), dtype="float32", backend=backend,
                                         compression=ZFP(tolerance=t))
        res = each(prog(x), own)
        exact = np.sum(np.stack([a.astype(np.float64) for a in xs]), axis=0)
        parts = np.array_split(exact, n)
        for d in own:
            err = np.abs(res[d] - parts[d]).max()
            bound = (n - 1) * t + n * F32_EPS * np.abs(exact).max()
            assert err <= bound, (algo, d, err, bound)
            counts[f"rs_{algo}_err"] = max(counts.get(f"rs_{algo}_err", 0.0), float(err))
        counts["reduce_scatter"] += 1
    codec_cost.REDUCE_ALGORITHM = "auto"
    # all_reduce through bf16: each remote addend and the result rounded once (2**-8 relative)
    xs = tiles((33,), n, "float32", 700)
    own, x = mine(ctx, mesh, xs)
    res = each(mc.all_reduce(x, mesh, "x", backend=backend, compression="bf16"), own)
    exact = np.sum(np.stack(xs).astype(np.float64), axis=0)
    bound = 2.0 ** -8 * (np.sum(np.abs(np.stack(xs)), axis=0) + np.abs(exact)) * 1.01 + 1e-6
    first = None
    for d in own:
        assert (np.abs(res[d] - exact) <= bound).all(), (d, np.abs(res[d] - exact).max())
        first = res[d] if first is None else first
        assert np.array_equal(res[d], first)
    counts["all_reduce"] += 1


def check_reshard(ctx, backend, counts):
    n = ctx.world_size * ctx.devices_per_process
    a = mc.Mesh(list(range(n // 2)), ("x",))
    b = mc.Mesh(np.arange(n // 2, n).reshape(1, -1), ("p", "q"))
    src, dst = mc.Layout(a, ("x", None)), mc.Layout(b, (None, None))       # every dst holds all
    g = np.random.default_rng(900).standard_normal((24, 10)).astype(np.float32)
    shards = mc.shard(g, src)
    own = [d for d in a.device_ids if d // ctx.devices_per_process == ctx.rank]
    t = 1e-4
    out = mc.reshard({d: shards[d] for d in own}, src, dst, backend=backend,
                     compression=ZFP(tolerance=t), shape=g.shape, dtype=g.dtype)
    first = None
    for d, v in out.items():
        assert np.abs(v - g).max() <= t, (d, np.abs(v - g).max())
        first = v if first is None else first
        assert np.array_equal(v, first)             # replicas identical
    counts["reshard"] += 1


def check_disagreement(ctx, backend, counts):
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(list(range(n)), ("x",))
    xs = tiles((16,), n, "float32", 800)
    own, x = mine(ctx, mesh, xs)
    codec = "zfp(rate=8)" if ctx.rank == 0 else "zfp(rate=16)"
    t0 = time.monotonic()
    try:
        mc.all_gather(x, mesh, "x", backend=backend, compression=codec)
    except ValueError as e:
        assert "compression" in str(e), e
        counts["disagree_raised"] += 1
    assert time.monotonic() - t0 < 20
    res = each(mc.all_gather(x, mesh, "x", backend=backend, compression="zfp(rate=8)"), own)
    assert all(v.shape == (16 * n,) for v in res.values())
    # repeated, the call runs the Program its first call constructed: no new one, the same values
    k = ctx.programs
    for _ in range(3):
        again = each(mc.all_gather(x, mesh, "x", backend=backend, compression="zfp(rate=8)"), own)
        assert all(np.array_equal(again[d], res[d]) for d in own)
    assert ctx.programs == k, f"rank {ctx.rank}: repeated compressed calls constructed {ctx.programs - k} Programs"
    counts["repeat_ok"] += 1


def check_run_error(ctx, backend, counts):
    """A local error in a run of a compressed Program (rank 0 passes a tile of the wrong
    shape): rank 0 raises its ValueError, every other process a PeerError naming it, long
    before MESHCOMM_TIMEOUT (their pipelines poll the control channel while idle); the
    Program is failed everywhere, a new one runs. An all_gather (a ring) and a reshard; on
    torch the all_gather only, last (gloo closes a connection whose given-up receive times
    out later: after an error there, finalize and init again, docs/runtime.md)."""
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(list(range(n)), ("x",))
    xs = tiles((64, 8), n, "float32", 700)
    own, x = mine(ctx, mesh, xs)
    src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, None))
    g = np.concatenate(xs)
    make = [lambda: mc.Program.all_gather(mesh, "x", shape=(64, 8), dtype="float32", backend=backend,
                                          compression="zfp(rate=16)"),
            lambda: mc.Program.reshard(src, dst, shape=g.shape, dtype="float32", backend=backend,
                                       compression="zfp(rate=16)")]
    for k, new in enumerate(make if backend == "mpi" else make[:1]):
        arg = (lambda t: t) if k == 0 else (lambda t: t if isinstance(t, dict) else {own[0]: t})
        prog = new()
        prog(arg(x))
        bad = x
        if ctx.rank == 0:
            bad = x[:5] if len(own) == 1 else {**x, own[0]: x[own[0]][:5]}
        t0 = time.monotonic()
        try:
            prog(arg(bad))
        except (ValueError, RuntimeError) as e:
            assert (ctx.rank == 0) != isinstance(e, PeerError), (ctx.rank, e)
            assert ctx.rank == 0 or (e.rank == 0 and "(5, 8)" in str(e)), e
            counts["run_error_raised"] += 1
        assert time.monotonic() - t0 < 10, (ctx.rank, k, time.monotonic() - t0)
        if backend != "mpi":
            continue
        again = each(new()(arg(x)), own) if k == 0 else new()(arg(x))
        assert all(v.shape == ((64 * n, 8) if k == 0 else g.shape) for v in again.values()), k


def check_pacing(ctx, backend, counts):
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(list(range(n)), ("x",))
    src, dst = mc.Layout(mc.Mesh([0], ("s",)), (None,)), mc.Layout(mc.Mesh([n - 1], ("d",)), (None,))
    x = np.ones(1 << 18, np.float32)                  # 1 MiB from device 0 to the last device
    mc.barrier(mesh, backend=backend)
    os.environ["MESHCOMM_EMULATE_GBPS"] = "0.08"
    try:
        t0 = time.time()
        out = mc.reshard({0: x} if ctx.rank == 0 else {}, src, dst, backend=backend, shape=x.shape, dtype=x.dtype)
        t1 = time.time()
    finally:
        os.environ.pop("MESHCOMM_EMULATE_GBPS")
    if ctx.rank == 0:                   # the sender's send completes at the end of its slot
        counts[f"pace_start_{backend}"] = t0
        assert t1 - t0 >= 0.1, t1 - t0
    if n - 1 in out:                    # the test compares the receiver's end with the sender's start
        assert np.array_equal(out[n - 1], x)
        counts[f"pace_end_{backend}"] = t1


def nonfinite_tiles(shape, n, dtype, seed):
    """Standard normal tiles with NaN, +Inf and -Inf at seeded positions (the same on every
    process), some where several tiles are non-finite at once: a sum there is NaN (NaN or
    +Inf + -Inf) or keeps the Inf's sign."""
    xs = tiles(shape, n, dtype, seed)
    rng = np.random.default_rng(seed + 1000)
    pos = rng.choice(int(np.prod(shape)), size=3 * n + 4, replace=False)
    for q in range(n):
        for j, v in enumerate((np.nan, np.inf, -np.inf)):
            xs[q].reshape(-1)[pos[3 * q + j]] = v
    a, b, c, d = pos[3 * n:]
    xs[0].reshape(-1)[a], xs[n - 1].reshape(-1)[a] = np.inf, -np.inf         # NaN
    xs[0].reshape(-1)[b], xs[1].reshape(-1)[b] = np.inf, np.inf              # +Inf
    xs[1].reshape(-1)[c], xs[2].reshape(-1)[c] = -np.inf, np.nan             # NaN
    xs[n - 1].reshape(-1)[d] = -np.inf                                       # -Inf
    return xs


def same_nonfinite(got, want):
    """NaN where `want` is NaN (any payload), the same Inf where it is Inf."""
    nan, inf = np.isnan(want), np.isinf(want)
    return bool((np.isnan(got) == nan).all() and (np.isinf(got) == inf).all() and (got[inf] == want[inf]).all())


def finite_bound(codec, x):
    """What the codec may change a finite value by: the tolerance, a quarter of max|x| for
    rate 8 and precision 14 (within the documented 2**-3 on normal tiles), casts' rounding."""
    if isinstance(codec, ZFP):
        return codec.tolerance if codec.tolerance is not None else 0.25 * np.abs(x[np.isfinite(x)]).max()
    return (2.0 ** -8 if str(codec) == "bf16" else 2.0 ** -11) * np.abs(x)


def check_nonfinite(ctx, backend, counts):
    """NaN, +Inf and -Inf through compressed all_gather (arriving bit for bit, in place, in
    every codec; casts also carry finite values they overflow exact) and all_reduce and
    reduce_scatter, one-shot and ring (a sum with a NaN addend, or +Inf and -Inf, is NaN;
    with Infs of one sign, that Inf)."""
    n = ctx.world_size * ctx.devices_per_process
    mesh = mc.Mesh(list(range(n)), ("x",))
    gathers = [((37, 13), "float32", ZFP(rate=8)), ((37, 13), "float32", ZFP(tolerance=1e-3)),
               ((9, 6, 5), "float64", ZFP(rate=16)), ((37, 13), "float32", ZFP(precision=14)),
               ((37, 13), "float32", "bf16"), ((37, 13), "float64", "fp16"),
               ((37, 13), "float32", ZFP(rate=8), "per-hop"), ((37, 13), "float32", "fp16", "per-hop")]
    for k, (shape, dt, codec, *per_hop) in enumerate(gathers):
        codec_cost.PER_HOP = bool(per_hop)      # relays decode, re-encode (a Program constructed after it)
        xs = nonfinite_tiles(shape, n, dt, 1100 + 10 * k)
        if not isinstance(codec, ZFP):           # finite values the cast overflows, sent exact
            xs[n - 1][1, 2] = 7e4 if codec == "fp16" else 3.4e38
            xs[n - 1][0, 0] = -1e39 if dt == "float64" else -7e4
        own, x = mine(ctx, mesh, xs)
        prog = mc.Program.all_gather(mesh, "x", shape=tile_shape(own, x), dtype=dt, backend=backend,
                                     compression=codec)
        res = each(prog(x), own)
        ref = np.concatenate(xs)
        bad = ~np.isfinite(ref)
        for d in own:
            assert res[d].dtype == ref.dtype and res[d][bad].tobytes() == ref[bad].tobytes(), (k, d, codec)
            err, bound = np.abs(res[d][~bad] - ref[~bad]), finite_bound(codec, ref)
            assert (err <= (bound if np.ndim(bound) == 0 else bound[~bad])).all(), (k, d, codec, err.max())
            if not isinstance(codec, ZFP):
                assert res[d][-shape[0]:][1, 2] == xs[n - 1][1, 2] and res[d][-shape[0]:][0, 0] == xs[n - 1][0, 0]
        counts["nf_all_gather"] += 1
    codec_cost.PER_HOP = False
    for k, (algo, codec) in enumerate([(a, c) for a in ("oneshot", "ring")
                                       for c in (ZFP(rate=8), ZFP(tolerance=1e-3), "bf16")]):
        codec_cost.REDUCE_ALGORITHM = algo
        xs = nonfinite_tiles((8 * n, 5), n, "float32", 1300 + k)
        own, x = mine(ctx, mesh, xs)
        kw = dict(shape=tile_shape(own, x), dtype="float32", backend=backend, compression=codec)
        with np.errstate(invalid="ignore"):
            exact = np.sum(np.stack([a.astype(np.float64) for a in xs]), axis=0)
            ar = each(mc.Program.all_reduce(mesh, "x", **kw)(x), own)
            rs = each(mc.Program.reduce_scatter(mesh, "x", **kw)(x), own)
        parts = np.array_split(exact, n)
        fin = np.isfinite(exact)
        for d in own:
            assert same_nonfinite(ar[d], exact), (algo, codec, d, ar[d][~fin], exact[~fin])
            assert same_nonfinite(rs[d], parts[d]), (algo, codec, d)
            assert np.isfinite(ar[d][fin]).all() and np.isfinite(rs[d][np.isfinite(parts[d])]).all()
        counts["nf_all_reduce"] += 1
    codec_cost.REDUCE_ALGORITHM = "auto"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mpi")
    ap.add_argument("--backends", default="mpi")
    ap.add_argument("--dpp", type=int, default=1)
    ap.add_argument("--pace", action="store_true")
    ap.add_argument("--nonfinite", action="store_true", help="only the NaN/Inf checks")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["MESHCOMM_COMPRESSION_CHUNK"] = "1024"       # several chunks per tile
    ctx = mc.init(backend=args.init, devices_per_process=args.dpp)
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "reshard": 0, "disagree_raised": 0,
              "nf_all_gather": 0, "nf_all_reduce": 0, "program_runs": 0, "run_error_raised": 0,
              "repeat_ok": 0}
    for b in args.backends.split(","):
        if args.nonfinite:
            check_nonfinite(ctx, b, counts)
            continue
        check_all_gather(ctx, b, counts)
        check_reduce_scatter(ctx, b, counts)
        check_reshard(ctx, b, counts)
        check_disagreement(ctx, b, counts)
        if args.pace:
            check_pacing(ctx, b, counts)
    for b in sorted(args.backends.split(","), key=lambda b: b != "mpi"):   # torch's last
        if not args.nonfinite:
            check_run_error(ctx, b, counts)
    counts.update(rank=ctx.rank, stats=dict(stats))
    mc.finalize()
    if args.out:
        with open(os.path.join(args.out, f"rank{counts['rank']}.json"), "w") as f:
            json.dump(counts, f)
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
