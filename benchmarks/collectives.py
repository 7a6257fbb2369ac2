"""Every collective: meshcomm Programs and eager calls beside mpi4py (and gloo) called directly.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/collectives.py [--sizes 1K,16K,256K,1M,4M,16M]
                                                     [--reps 5] [--calls 1] [--ops all_reduce,...] [--json out.json]

One group: all processes (a 1-d mesh of one device per process). Per op and size, the
implementations are timed interleaved within each round (same machine load for all):
`mpi4py` (the MPI collective on a communicator of the group, blocking), `gloo`
(torch.distributed on the default group), `program[mpi|torch|mixed]` (a meshcomm Program,
`mc.Program.all_reduce(mesh, "x", shape=, dtype=, backend=)` and the others, constructed once
per op and size before the timed calls, then run with nothing but data) and
`eager[mpi|torch|mixed]` (the eager call, `mc.all_reduce(x, mesh, "x", backend=)`: its cached
Program, constructed by the warm-up), `program_out[mpi]` (the Program into a result buffer
made once: `prog(x, out=buf)`; not in the default set). `--calls N`: each measurement is N calls back to back
(the time per call; with 1, one call between barriers, where each process starts together).
The geomean is printed over every op given and over the five the runtime's goal names
(all_reduce, all_gather, reduce_scatter, broadcast, all_to_all). The MPI-based and the gloo-based implementations are
timed in two phases (see PHASES); torch runs one thread per process, as under torchrun. Time
is the median over rounds of the slowest rank (meshcomm.tools.spmd.time_once: polite
barriers). algbw and busbw as nccl-tests defines them (meshcomm.bandwidth): the size is the
buffer for all_reduce, broadcast and reduce, the gathered output for all_gather and gather,
the input for reduce_scatter and scatter, the send buffer for all_to_all. Ratios: mpi4py time
/ meshcomm time, and the fastest direct call's time / meshcomm time (>1: meshcomm faster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import meshcomm as mc                                   # noqa: E402
from meshcomm.bandwidth import algbw_busbw             # noqa: E402
from meshcomm.tools.common import geomean, progress    # noqa: E402
from meshcomm.tools.spmd import time_once              # noqa: E402

# Implementations over MPI and over gloo are timed in separate phases (each interleaved within
# its own rounds): with 8 processes on 2 cores, a gloo call leaves its threads busy for a while
# and slowed whatever ran right after it by up to 7x (measured: the eager meshcomm all_gather over MPI of
# 4 MiB 6.8 ms alone, 45 ms right after gloo), which would charge one implementation for
# another's leftovers.
PHASES = (("mpi4py", "program[mpi]", "eager[mpi]", "program[mixed]", "eager[mixed]", "program_out[mpi]"),
          ("gloo", "program[torch]", "eager[torch]"))
IMPLS = tuple(k for k in PHASES[0] + PHASES[1] if k != "program_out[mpi]")
MESHCOMM = tuple(k for k in PHASES[0] + PHASES[1] if k not in ("mpi4py", "gloo"))
ROOTED = ("broadcast", "reduce", "gather", "scatter")
GOAL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s.rstrip("KMG")) * mult)


def per_rank_elems(op: str, size: int, n: int) -> int:
    """Elements of float32 each rank passes, for nccl-tests' size `size` (bytes)."""
    total = max(size // 4, n)
    if op in ("all_gather", "gather"):
        return max(total // n, 1)
    return (total // n) * n         # divisible by n (reduce_scatter, scatter, all_to_all)


def impls(op, comm, x, n, rank, mesh, chosen):
    """{name: zero-argument callable} for one op and per-rank input x (Programs of the
    `chosen` implementations are constructed here, by every process in the same order)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    t = torch.from_numpy(x)
    k = x.size // n if x.size >= n else 0
    out = {}
    if op == "all_reduce":
        out["mpi4py"] = lambda: comm.Allreduce(MPI.IN_PLACE, x.copy())
        out["gloo"] = lambda: dist.all_reduce(t.clone())
    elif op == "all_gather":
        buf = np.empty(x.size * n, x.dtype)
        tb = torch.empty(x.size * n)
        out["mpi4py"] = lambda: comm.Allgather(x, buf)
        out["gloo"] = lambda: (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(tb, t)
    elif op == "reduce_scatter":
        buf = np.empty(k, x.dtype)
        out["mpi4py"] = lambda: comm.Reduce_scatter_block(x, buf)
        tb = torch.empty(k)
        out["gloo"] = lambda: _reduce_scatter(dist)(tb, t)
    elif op == "broadcast":
        out["mpi4py"] = lambda: comm.Bcast(x.copy(), root=0)
        out["gloo"] = lambda: dist.broadcast(t.clone(), src=0)
    elif op == "reduce":
        out["mpi4py"] = lambda: comm.Reduce(x, np.empty_like(x) if rank == 0 else None, root=0)
        out["gloo"] = lambda: dist.reduce(t.clone(), dst=0)
    elif op == "all_to_all":
        buf = np.empty_like(x)
        out["mpi4py"] = lambda: comm.Alltoall(x, buf)
        tb = torch.empty_like(t)
        out["gloo"] = lambda: dist.all_to_all_single(tb, t)
    elif op == "gather":
        buf = np.empty(x.size * n, x.dtype) if rank == 0 else None
        out["mpi4py"] = lambda: comm.Gather(x, buf, root=0)
        out["gloo"] = lambda: dist.gather(t, [torch.empty_like(t) for _ in range(n)] if rank == 0 else None, dst=0)
    elif op == "scatter":
        buf = np.empty(k, x.dtype)
        out["mpi4py"] = lambda: comm.Scatter(x, buf, root=0)
        tb = torch.empty(k)
        out["gloo"] = lambda: dist.scatter(tb, list(t.chunk(n)) if rank == 0 else None, src=0)
    fn = getattr(mc, op)
    kw = {"root": 0} if op in ROOTED else {}
    for b in ("mpi", "torch", "mixed"):
        if f"program[{b}]" in chosen:
            prog = getattr(mc.Program, op)(mesh, "x", shape=x.shape, dtype=x.dtype, backend=b, **kw)
            out[f"program[{b}]"] = (lambda prog=prog: prog(x))
        if f"program_out[{b}]" in chosen:      # into a buffer of the caller's, made once (out=)
            prog = getattr(mc.Program, op)(mesh, "x", shape=x.shape, dtype=x.dtype, backend=b, **kw)
            y = prog(x)
            out[f"program_out[{b}]"] = (lambda prog=prog, o=None if y is None else np.empty_like(y): prog(x, out=o))
        out[f"eager[{b}]"] = (lambda b=b: fn(x, mesh, "x", backend=b, **kw))
    return out


def back_to_back(f, calls: int):
    def g():
        for _ in range(calls):
            f()
    return g


def supported(name, op):
    return not (name == "gloo" and op == "reduce_scatter" and not _gloo_has_rs())


def _reduce_scatter(dist):
    """torch's equal-block reduce-scatter (`reduce_scatter_single` from torch 2.13)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gloo_has_rs():
    import torch
    import torch.distributed as dist
    try:
        _reduce_scatter(dist)(torch.empty(1), torch.empty(dist.get_world_size()))
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1K,16K,256K,1M,4M,16M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1, help="calls back to back per measurement")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--json", default="")
    ap.add_argument("--impls", default=",".join(IMPLS), help="which implementations to time")
    args = ap.parse_args()
    chosen = args.impls.split(",")
    import torch
    torch.set_num_threads(1)        # as torchrun does with several processes per host
    ctx = mc.init(backend="mixed")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    n, rank = ctx.world_size, ctx.rank
    mesh = mc.Mesh(np.arange(n), ("x",))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = []
    todo = [(op, size) for op in args.ops.split(",") for size in sizes]
    for op, size in progress(todo, desc="collectives", disable=rank != 0):
        x = np.random.default_rng(rank).standard_normal(per_rank_elems(op, size, n)).astype(np.float32)
        fns = {k: v for k, v in impls(op, comm, x, n, rank, mesh, chosen).items()
               if supported(k, op) and k in chosen}
        if args.calls > 1:
            fns = {k: back_to_back(f, args.calls) for k, f in fns.items()}
        times = {k: [] for k in fns}
        for phase in PHASES:                    # each phase interleaved within its rounds
            mine = {k: f for k, f in fns.items() if k in phase}
            for name, f in mine.items():        # warm-up (plans, groups, communicators, first-touch)
                time_once(comm, f)
                time_once(comm, f)
            for _ in range(args.reps):
                for name, f in mine.items():
                    times[name].append(time_once(comm, f)[0])
        med = {k: statistics.median(v) / args.calls for k, v in times.items()}
        direct = min((med[k] for k in ("mpi4py", "gloo") if k in med), default=float("nan"))
        for name, t in med.items():
            algbw, busbw = algbw_busbw(op, size, n, t)
            rows.append({"op": op, "bytes": size, "impl": name, "seconds": t, "algbw": algbw, "busbw": busbw,
                         "vs_mpi4py": med["mpi4py"] / t if "mpi4py" in med else float("nan"),
                         "vs_best_direct": direct / t})
    if rank == 0:
        print(f"{n} processes; ratios: mpi4py time / this time, fastest direct call's time / this time "
              "(> 1: faster than the direct call)")
        print(f"{'op':15} {'size':>6} {'impl':16} {'time us':>10} {'algbw GB/s':>10} {'busbw GB/s':>10} "
              f"{'vs mpi4py':>10} {'vs best direct':>14}")
        for r in rows:
            print(f"{r['op']:15} {fmt(r['bytes']):>6} {r['impl']:16} {r['seconds'] * 1e6:10.1f} {r['algbw']:10.3f} "
                  f"{r['busbw']:10.3f} {r['vs_mpi4py']:9.2f}x {r['vs_best_direct']:13.2f}x")
        against = [("vs_mpi4py", "mpi4py")]
        if any(r["impl"] == "gloo" for r in rows):
            against.append(("vs_best_direct", "the fastest direct call"))
        for impl in MESHCOMM:
            for key, what in against:
                pts = [(r[key], r["op"], r["bytes"]) for r in rows if r["impl"] == impl and r[key] == r[key]]
                for label, keep in (("", lambda p: True), (" (the goal's 5 ops, 1-64 KiB)",
                                                          lambda p: p[1] in GOAL_OPS and p[2] <= 64 << 10),
                                    (" (the goal's 5 ops, 4 MiB and up)", lambda p: p[1] in GOAL_OPS and p[2] >= 4 << 20)):
                    sel = [p for p in pts if keep(p)]
                    if sel and (not label or len(sel) < len(pts)):
                        worst = min(sel)
                        print(f"{impl} against {what}{label}: geomean {geomean([v for v, _, _ in sel]):.2f}x, worst "
                              f"{worst[0]:.2f}x ({worst[1]} {fmt(worst[2])}) over {len(sel)} op/size points")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    mc.finalize()


def fmt(b: int) -> str:
    for unit, k in (("M", 1 << 20), ("K", 1 << 10)):
        if b >= k:
            return f"{b // k}{unit}"
    return str(b)


if __name__ == "__main__":
    main()
