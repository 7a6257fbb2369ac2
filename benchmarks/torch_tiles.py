"""Collective Programs run on CPU torch tensors beside NumPy tiles and mpi4py, calls back to back.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/torch_tiles.py [--calls 50] [--reps 5]

Per case (op and bytes per process), three forms take turns in each of `--reps` rounds, each
a loop of `--calls` calls after a polite barrier: `mpi4py` (the blocking call on a
communicator of its own: `Allreduce(IN_PLACE, copy)` or `Allgather` into a buffer made once),
`numpy` (`prog(x)` of a NumPy tile) and `torch` (`prog(t)` of a CPU torch tensor, `t` over the
same memory), `prog = mc.Program.<op>(mesh, "x", shape=, dtype="float32")` constructed once.
Printed: the slowest process's time per call, median over rounds, and mpi4py's time / each
form's (> 1: faster than mpi4py). Also this process's CPU per call (time.process_time).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.tools.common import script_parser  # noqa: E402
from meshcomm.tools.spmd import polite_barrier  # noqa: E402

CASES = (("all_reduce", 256), ("all_gather", 32), ("all_reduce", 65536), ("all_gather", 8192))


def main(argv=None) -> int:
    ap = script_parser(__doc__, reps=5)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    import torch
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    comm = MPI.COMM_WORLD.Dup()
    n = ctx.world_size
    mesh = mc.Mesh(np.arange(n), ("x",))
    rows = []
    if ctx.rank == 0:
        print(f"{n} processes, float32, {args.calls} calls back to back, median of {args.reps} rounds")
        print(f"{'op':12} {'bytes':>8} {'mpi4py us':>10} {'numpy':>7} {'torch':>7} {'cpu numpy us':>13} {'cpu torch us':>13}")
    for op, elems in CASES:
        a = np.ones(elems, np.float32)
        t = torch.from_numpy(a)
        prog = getattr(mc.Program, op)(mesh, "x", shape=(elems,), dtype="float32")
        buf = np.empty(elems * n, np.float32)
        forms = {"mpi4py": (lambda: comm.Allreduce(MPI.IN_PLACE, a.copy())) if op == "all_reduce"
                 else (lambda: comm.Allgather(a, buf)),
                 "numpy": lambda: prog(a), "torch": lambda: prog(t)}
        wall = {k: [] for k in forms}
        cpu = {k: [] for k in forms}
        for rnd in range(args.reps + 1):
            for k, f in forms.items():
                polite_barrier(comm)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    f()
                c = (time.process_time() - c0) / args.calls
                w = comm.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX)
                if rnd:                 # the first round warms up
                    wall[k].append(w)
                    cpu[k].append(c)
        med = {k: statistics.median(v) for k, v in wall.items()}
        cmed = {k: statistics.median(v) for k, v in cpu.items()}
        if ctx.rank == 0:
            print(f"{op:12} {elems * 4:8d} {med['mpi4py'] * 1e6:10.1f} {med['mpi4py'] / med['numpy']:6.2f}x "
                  f"{med['mpi4py'] / med['torch']:6.2f}x {cmed['numpy'] * 1e6:13.1f} {cmed['torch'] * 1e6:13.1f}",
                  flush=True)
            rows.append({"op": op, "bytes": elems * 4, "seconds": med, "cpu_seconds": cmed})
    if ctx.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    mc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
