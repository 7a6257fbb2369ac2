"""CPU per call of every collective: a meshcomm Program and the eager call beside mpi4py's blocking call, 1 KiB per process.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/per_op_cpu.py [--calls 500] [--loops 5]

With 2 processes (a core each) the wall time of a loop of tiny calls is the CPU each call
costs, so this shows meshcomm's Python per call op by op: `program` runs a Program
constructed once before the loops (`mc.Program.all_reduce(mesh, "x", shape=, dtype=)` and the
others: agreement and plan at construction, a run validates its input locally, posts and
waits), `eager` the eager call (`mc.all_reduce(x, mesh, "x")`: its cached Program, found by
the call's arguments; non-roots of scatter pass None). The minimum over `--loops` loops of
`--calls` calls, in µs per call, printed by rank 0, with each meshcomm form's ratio to
mpi4py. `all_reduce async` is async_op=True then wait (beside mpi4py's Iallreduce then
Wait): the run goes on the context's queue thread.
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
    P = mc.Program
    f32 = np.float32
    root0 = {"root": 0}
    # op: (eager call, Program constructor with its run, mpi4py's call)
    ops = {
        "all_reduce": (lambda: mc.all_reduce(x, mesh, "x"),
                       (P.all_reduce(mesh, "x", shape=x.shape, dtype=f32), x),
                       lambda: w.Allreduce(MPI.IN_PLACE, x.copy())),
        "all_reduce async": (lambda: mc.all_reduce(x, mesh, "x", async_op=True).wait(),
                             (P.all_reduce(mesh, "x", shape=x.shape, dtype=f32), x, True),
                             _iallreduce(w, MPI, x)),
        "all_gather": (lambda: mc.all_gather(x, mesh, "x"), (P.all_gather(mesh, "x", shape=x.shape, dtype=f32), x),
                       lambda: w.Allgather(x, np.empty(256 * n, f32))),
        "reduce_scatter": (lambda: mc.reduce_scatter(xs, mesh, "x"),
                           (P.reduce_scatter(mesh, "x", shape=xs.shape, dtype=f32), xs),
                           lambda: w.Reduce_scatter_block(xs, np.empty(256, f32))),
        "broadcast": (lambda: mc.broadcast(x, mesh, "x", root=0),
                      (P.broadcast(mesh, "x", shape=x.shape, dtype=f32, **root0), x),
                      lambda: w.Bcast(x.copy(), root=0)),
        "reduce": (lambda: mc.reduce(x, mesh, "x", root=0), (P.reduce(mesh, "x", shape=x.shape, dtype=f32, **root0), x),
                   lambda: w.Reduce(x, np.empty_like(x) if r == 0 else None, root=0)),
        "all_to_all": (lambda: mc.all_to_all(xs, mesh, "x"), (P.all_to_all(mesh, "x", shape=xs.shape, dtype=f32), xs),
                       lambda: w.Alltoall(xs, np.empty_like(xs))),
        "gather": (lambda: mc.gather(x, mesh, "x", root=0), (P.gather(mesh, "x", shape=x.shape, dtype=f32, **root0), x),
                   lambda: w.Gather(x, np.empty(256 * n, f32) if r == 0 else None, root=0)),
        "scatter": (lambda: mc.scatter(xs if r == 0 else None, mesh, "x", root=0),
                    (P.scatter(mesh, "x", shape=xs.shape if r == 0 else None, dtype=f32, **root0),
                     xs if r == 0 else None),
                    lambda: w.Scatter(xs, np.empty(256, f32), root=0)),
    }
    if r == 0:
        print(f"{n} processes, 1 KiB per process; us per call (minimum of {args.loops} loops of {args.calls}); "
              "ratio: meshcomm / mpi4py")
        print(f"{'op':17} {'program us':>11} {'eager us':>9} {'mpi4py us':>10} {'program':>8} {'eager':>7}")
    for name, (eager, prog_arg, direct) in ops.items():
        prog, arg = prog_arg[0], prog_arg[1]
        if len(prog_arg) > 2:
            def program(prog=prog, arg=arg):
                return prog(arg, async_op=True).wait()
        else:
            def program(prog=prog, arg=arg):
                return prog(arg)
        forms = (("program", program), ("eager", eager), ("mpi4py", direct))
        for _ in range(20):
            program()
            eager()
        best = {}
        for label, fn in forms:
            ts = []
            for _ in range(args.loops):
                w.Barrier()
                t = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                ts.append((time.perf_counter() - t) / args.calls * 1e6)
            best[label] = min(ts)
        if r == 0:
            print(f"{name:17} {best['program']:11.1f} {best['eager']:9.1f} {best['mpi4py']:10.1f} "
                  f"{best['program'] / best['mpi4py']:7.2f}x {best['eager'] / best['mpi4py']:6.2f}x", flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
