"""Native MPI collective Programs with and without persistent requests, per op and size.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/persistent.py [--sizes 1K,16K,64K,256K] [--calls 200] [--reps 5]

Two Programs per op and size, constructed alike on every process: one as a persistent request
at every size (the tile copied in, `Start`, the result copied out), one as a new non-blocking
call per run (`native_call.PERSISTENT_MAX` and `PERSISTENT_MAX_ALL_TO_ALL` say which a
Program takes: 64 KiB, all_to_all 16 KiB). Each
form runs `--calls` times per loop, the forms taking turns in each of `--reps` rounds after a
polite barrier; the figure is the median over rounds of the slowest process's time per run,
and the ratio non-blocking / persistent (> 1: the persistent request is faster).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.runtime import native_call  # noqa: E402
from meshcomm.tools.common import script_parser  # noqa: E402
from meshcomm.tools.spmd import polite_barrier  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def main(argv=None) -> int:
    ap = script_parser(__doc__, reps=5)
    ap.add_argument("--sizes", default="1K,16K,64K,256K")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    world = MPI.COMM_WORLD
    n = ctx.world_size
    mesh = mc.Mesh(np.arange(n), ("x",))
    shipped = native_call.PERSISTENT_MAX, native_call.PERSISTENT_MAX_ALL_TO_ALL
    rows = []
    for op in OPS:
        for s in args.sizes.split(","):
            nbytes = int(float(s[:-1]) * 1024) if s[-1] in "Kk" else int(s)
            elems = max(nbytes // 4 // n, 1) * n
            x = np.ones(elems, np.float32)
            kw = {"root": 0} if op == "broadcast" else {}
            progs = {}
            for name, cap in (("persistent", 1 << 30), ("non-blocking", 0)):
                native_call.PERSISTENT_MAX = native_call.PERSISTENT_MAX_ALL_TO_ALL = cap
                progs[name] = getattr(mc.Program, op)(mesh, "x", shape=x.shape, dtype=x.dtype, **kw)
            native_call.PERSISTENT_MAX, native_call.PERSISTENT_MAX_ALL_TO_ALL = shipped
            times = {k: [] for k in progs}
            for rnd in range(args.reps + 1):
                for k, p in progs.items():
                    polite_barrier(world)
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        p(x)
                    t = world.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX)
                    if rnd:
                        times[k].append(t)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append((op, s, med["persistent"], med["non-blocking"]))
    mc.finalize()
    if ctx.rank == 0:
        print(f"{n} processes, float32, median of {args.reps} rounds of {args.calls} runs (slowest process)")
        print(f"{'op':15} {'size':>6} {'persistent us':>14} {'non-blocking us':>16} {'ratio':>7}")
        for op, s, p, b in rows:
            print(f"{op:15} {s:>6} {p * 1e6:14.1f} {b * 1e6:16.1f} {b / p:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
