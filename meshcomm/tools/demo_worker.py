"""The per-process side of `make demo` (run as `python -m meshcomm.tools.demo --worker` under
mpiexec), and the table both sides print. Every process owns device = its rank. MPI (mpi4py's
COMM_WORLD) carries the demo's own bookkeeping: barriers around timings, the max over ranks,
the exactness vote, and the allgather-then-slice baseline."""
from __future__ import annotations

import math
import statistics
import time
from collections import Counter

import numpy as np

from meshcomm import notation
from meshcomm.planners.schedule import fmt_bytes

from .cases import Case, global_array
from .common import geomean
from .spmd import exact, time_once

__all__ = ["HEADER", "row", "worker_main"]

HEADER = (f"{'case':<11s} {'shape':<15s} {'src -> dst':<34s} {'backend':<10s} {'time ms':>9s} "
          f"{'moved':>10s} {'GB/s':>7s} {'exact':>6s}")


def row(case: Case, backend: str, seconds: float, moved: int, verdict: str) -> str:
    layouts = f"{notation.format_layout(case.src)} -> {notation.format_layout(case.dst)}"
    bw = moved / seconds / 1e9 if seconds > 0 else float("nan")
    shape = "x".join(map(str, case.shape))
    return (f"{case.name:<11s} {shape:<15s} {layouts:<34s} {backend:<10s} {seconds * 1e3:9.2f} "
            f"{fmt_bytes(moved):>10s} {bw:7.2f} {verdict:>6s}")


def _my_src(case: Case, g: np.ndarray, me: int, seed: int) -> dict:
    import meshcomm as mc
    if me not in case.src.mesh:
        return {}
    if case.src.is_partial:
        return {me: mc.shard(g, case.src, seed=seed)[me]}
    box = case.src.index_map(case.shape)[me]
    return {me: np.ascontiguousarray(g[box])}


def _mpi_allgatherv_then_slice(comm, case: Case, g_tile: dict, me: int):
    """Baseline (--mpi-allgather): MPI Allgatherv of the distinct src tiles over all
    processes, assemble the global tensor everywhere, then each dst device slices its box."""
    from mpi4py import MPI
    st = case.src.tiles(case.shape)
    reps = {devs[0]: st.boxes[devs[0]] for byadd in st.classes.values() for devs in byadd.values()}
    itemsize = np.dtype(case.dtype).itemsize
    counts = [math.prod(b - a for a, b in reps[r]) * itemsize if r in reps else 0
              for r in range(comm.size)]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
    total = int(sum(counts))
    send = g_tile[me].reshape(-1).view(np.uint8) if me in reps else np.empty(0, np.uint8)
    recv = np.empty(total, np.uint8)

    def run():
        comm.Allgatherv([send, MPI.BYTE], [recv, (counts, displs), MPI.BYTE])
        full = np.empty(case.shape, dtype=case.dtype)
        for r, box in reps.items():
            full[tuple(slice(a, b) for a, b in box)] = \
                recv[displs[r]:displs[r] + counts[r]].view(case.dtype).reshape([b - a for a, b in box])
        if me in case.dst.mesh:
            return {me: full[case.dst.index_map(case.shape)[me]].copy()}
        return {}
    moved = sum(total - c for c in counts)
    return run, moved


def _plan_allgather_then_slice(ctx, case: Case, x: dict, me: int):
    """Baseline: the allgather-then-slice plan (meshcomm.planners.baselines: every dst
    device receives the whole tensor along ring-allgather chains, then keeps its box), run
    by the same executor over MPI, so the comparison is like for like."""
    from meshcomm.backends import batch
    from meshcomm.planners.baselines import allgather_slice
    bp = allgather_slice(case.shape, case.dtype, case.src, case.dst)
    be = ctx.get_backend("mpi")
    like = next(iter(x.values())) if x else np.empty(0, dtype=case.dtype)
    box = case.dst.index_map(case.shape).get(me)

    def run():
        out = batch.execute(bp, x, like, rank=ctx.rank, devices_per_process=1, backend=be,
                            deadline=time.monotonic() + ctx.timeout)
        return {d: np.ascontiguousarray(v[box]) for d, v in out.items()}
    return run, bp.bytes_moved


def _split(comm, before: Counter, calls: int) -> str:
    """For mixed: how many primitives each backend issued per call (summed over ranks)."""
    from meshcomm.backends.base import issued
    diff = Counter(issued)
    diff.subtract(before)
    mine = {k: v for k, v in diff.items() if v > 0 and k[0] in ("mpi", "torch")}
    every = comm.gather(mine, root=0)
    if comm.rank != 0:
        return ""
    tot = Counter()
    for d in every:
        for (name, _prim), v in d.items():
            tot[name] += v
    return "  [" + " ".join(f"{n}:{tot[n] // calls}" for n in ("mpi", "torch")) + " ops]"


def worker_main(cases: list[Case], args) -> int:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    me = comm.rank
    import meshcomm as mc
    from meshcomm.backends.base import issued
    backends = [b for b in args.backends.split(",") if b]
    if comm.size != args.procs:
        if me == 0:
            print(f"demo worker: launched with {comm.size} processes but --procs {args.procs}")
        return 2
    ctx = mc.init(backend="mixed", devices_per_process=1)
    if me == 0:
        table = ctx.get_backend("mixed").table.source if "mixed" in backends else ""
        print(f"{comm.size} processes, device d on rank d; backends: {', '.join(backends)}"
              + (f"; mixed uses the tuning table {table} (MESHCOMM_TUNING)" if table else ""),
              flush=True)
        print(HEADER, flush=True)
    labels = [lb for b in backends for lb in ([b] if args.no_program else [b, f"{b} prog"])]
    speedups: dict[str, list[float]] = {lb: [] for lb in labels}
    bad = 0
    for i, case in enumerate(cases):
        g = global_array(case.shape, args.seed + i, case.dtype)
        x = _my_src(case, g, me, args.seed)
        p = mc.plan(case.shape, case.dtype, case.src, case.dst)
        # (label, callable, bytes moved): baselines first, then each backend
        methods = []
        if args.mpi_allgather and not case.src.is_partial:
            run, moved = _mpi_allgatherv_then_slice(comm, case, x, me)
            methods.append(("Allgatherv", run, moved))
        if not args.no_baseline:
            run, moved = _plan_allgather_then_slice(ctx, case, x, me)
            methods.append(("ag+slice", run, moved))
        for b in backends:
            def call(b=b):
                return mc.reshard(x, case.src, case.dst, shape=case.shape, dtype=case.dtype, backend=b)
            methods.append((b, call, p.bytes_moved))
            if not args.no_program:
                # an explicit Program: agreed and planned once here, outside the timed calls
                prog = mc.Program.reshard(case.src, case.dst, shape=case.shape, dtype=case.dtype, backend=b)
                methods.append((f"{b} prog", lambda prog=prog: prog(x), p.bytes_moved))
        # warm-up each method once (checking exactness), then interleave the timed rounds so
        # every method sees the same machine load (the ratios are taken within one round set)
        oks, splits = {}, {}
        for label, fn, _ in methods:
            before = Counter(issued)
            y = fn()
            oks[label] = exact(comm, case.dst, case.shape, g, y or {}, reassemble=True)
            if label == "mixed":
                splits[label] = _split(comm, before, 1)
        times = {label: [] for label, _, _ in methods}
        for _ in range(args.repeats):
            for label, fn, _ in methods:
                times[label].append(time_once(comm, fn)[0])
        med = {label: statistics.median(ts) for label, ts in times.items()}
        base_t = med.get("ag+slice")
        for label, _, moved in methods:
            ok = oks[label]
            bad += not ok
            t = med[label]
            extra = ""
            if label in speedups and base_t is not None:
                extra = f"  {base_t / t:5.2f}x vs ag+slice"
                if case.name.startswith("alpa"):
                    speedups[label].append(base_t / t)
            if me == 0:
                print(row(case, label, t, moved, "yes" if ok else "NO") + extra + splits.get(label, ""),
                      flush=True)
        del g, x
    if me == 0:
        for b, s in speedups.items():
            if s:
                print(f"{b}: geomean speedup over allgather-then-slice (ag+slice) on Alpa's cases: "
                      f"{geomean(s):.2f}x ({len(s)} cases)")
        print("all exact" if not bad else f"{bad} inexact result(s)", flush=True)
    return 1 if bad else 0
