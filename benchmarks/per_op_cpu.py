"""CPU per call of every collective, meshcomm beside mpi4py's blocking call, 1 KiB per process.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/per_op_cpu.py [--calls 500] [--loops 5]

With 2 processes (a core each) the wall time of a loop of tiny calls is the CPU each call
costs, so this shows meshcomm's Python per call op by op (its compiled, lean form from the
fourth call; non-roots of scatter pass None). The minimum over `--loops` loops of `--calls`
calls, in µs per call, printed by rank 0. `all_reduce async` is async_op=True then wait
(beside mpi4py's Iallreduce then Wait): the call runs on the context's queue thread.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402


def _iallreduce(w, MPI, x):
    """mpi4py's Iallreduce then Wait, the buffer held here until the wait: the request of an
    IN_PLACE call does not keep it (a temporary freed before the Wait corrupted the heap)."""
    def call():
        buf = x.copy()
        w.Iallreduce(MPI.IN_PLACE, buf).Wait()
    return call


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--loops", type=int, default=5)
    args = ap.parse_args()
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    n, r = ctx.world_size, ctx.rank
    w = MPI.COMM_WORLD
    mesh = mc.Mesh(np.arange(n), ("x",))
    x = np.ones(256, np.float32)
    xs = np.ones(256 * n, np.float32)
    ops = {
        "all_reduce": (lambda: mc.all_reduce(x, mesh, "x"), lambda: w.Allreduce(MPI.IN_PLACE, x.copy())),
        "all_reduce async": (lambda: mc.all_reduce(x, mesh, "x", async_op=True).wait(),
                             _iallreduce(w, MPI, x)),
        "all_gather": (lambda: mc.all_gather(x, mesh, "x"), lambda: w.Allgather(x, np.empty(256 * n, np.float32))),
        "reduce_scatter": (lambda: mc.reduce_scatter(xs, mesh, "x"),
                           lambda: w.Reduce_scatter_block(xs, np.empty(256, np.float32))),
        "broadcast": (lambda: mc.broadcast(x, mesh, "x", root=0), lambda: w.Bcast(x.copy(), root=0)),
        "reduce": (lambda: mc.reduce(x, mesh, "x", root=0),
                   lambda: w.Reduce(x, np.empty_like(x) if r == 0 else None, root=0)),
        "all_to_all": (lambda: mc.all_to_all(xs, mesh, "x"), lambda: w.Alltoall(xs, np.empty_like(xs))),
        "gather": (lambda: mc.gather(x, mesh, "x", root=0),
                   lambda: w.Gather(x, np.empty(256 * n, np.float32) if r == 0 else None, root=0)),
        "scatter": (lambda: mc.scatter(xs if r == 0 else None, mesh, "x", root=0),
                    lambda: w.Scatter(xs, np.empty(256, np.float32), root=0)),
    }
    if r == 0:
        print(f"{'op':17} {'meshcomm us':>12} {'mpi4py us':>10}")
    for name, (mine, direct) in ops.items():
        for _ in range(20):
            mine()
        best = {}
        for label, fn in (("meshcomm", mine), ("mpi4py", direct)):
            ts = []
            for _ in range(args.loops):
                w.Barrier()
                t = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                ts.append((time.perf_counter() - t) / args.calls * 1e6)
            best[label] = min(ts)
        if r == 0:
            print(f"{name:17} {best['meshcomm']:12.1f} {best['mpi4py']:10.1f}")
    mc.finalize()


if __name__ == "__main__":
    main()
