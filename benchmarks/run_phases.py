"""Where a short reshard Program's time goes against the hand-written exchange (the `bench
run` floor): the time to its first wait (allocation, posting, local copies) and the wait.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/run_phases.py [--case same-moe-a2a] [--reps 21]

Rows, alternating per repeat, median per process in ms: `program` (a Program of the case over
MPI: its lean run where it has one, its first wait marked when the lean run has posted), `floor` (the exchange of meshcomm/tools/bench/floor.py, written out here with its
Waitall timed), `floor+poll` (the same, waiting in a Python Testall loop that yields the core
between tests, as meshcomm's waits do) and `floor+N us` (the same with N microseconds of CPU
spent between its receives and its sends: Python a Program spends before its first wait).
With 8 processes on 2 cores, CPU spent before posting delays every peer's wait: BENCHMARKS 3.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import meshcomm as mc
from meshcomm.tools import spmd
from meshcomm.tools.bench import floor
from meshcomm.tools.cases import global_array, run_cases


def floor_run(fl, x, dtype, comm, marks, poll=False, spin_s=0.0):
    """One floor exchange (floor.run_floor for plain values), marking when its wait starts."""
    t0 = time.perf_counter()
    out = {d: np.empty(sh, dtype) for d, sh in fl.out_shapes.items()}
    reqs, copy_out = [], []
    for d, sl, peer, tag, n, _ in fl.recvs:
        view = out[d][sl]
        if view.flags.c_contiguous:
            reqs.append(comm.Irecv(view, source=peer, tag=tag))
        else:
            buf = np.empty(n, dtype)
            reqs.append(comm.Irecv(buf, source=peer, tag=tag))
            copy_out.append((d, sl, buf.reshape(view.shape)))
    end = time.thread_time() + spin_s
    while time.thread_time() < end:     # CPU as a Program's Python spends it
        pass
    for s, sl, peer, tag in fl.sends:
        reqs.append(comm.Isend(np.ascontiguousarray(x[s][sl]), dest=peer, tag=tag))
    for s, ssl, d, dsl, _ in fl.local:
        out[d][dsl] = x[s][ssl]
    marks["posted"] = time.perf_counter() - t0
    if poll:
        while not MPI.Request.Testall(reqs):
            os.sched_yield()
    else:
        MPI.Request.Waitall(reqs)
    for d, sl, buf in copy_out:
        out[d][sl] = buf
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="same-moe-a2a")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--spin-us", default="20,50", help="CPU microseconds added before the floor's sends")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    me = comm.rank
    ctx = mc.init(backend="mpi")
    case = next(c for c in run_cases(comm.size, 16.0) if c.name == args.case)
    if case.src.is_partial or case.dst.is_partial:
        raise SystemExit(f"{case.name}: a pending sum has no floor exchange")
    g = global_array(case.shape, 1, case.dtype)
    x = {me: np.ascontiguousarray(g[case.src.index_map(case.shape)[me]])} if me in case.src.mesh else {}
    marks: dict = {}
    from meshcomm.runtime import reshard_call
    lean = reshard_call.lean

    def timed_lean(*a, **kw):           # the lean run (backends/lean.py) posted: mark it
        def timed(post):
            def posted(x):
                w = post(x)
                marks.setdefault("posted", time.perf_counter() - marks["t0"])
                return w
            return posted
        fns = lean(*a, **kw)
        return None if fns is None else tuple((timed(f[0]),) + tuple(f[1:]) for f in fns)
    reshard_call.lean = timed_lean
    prog = mc.Program.reshard(case.src, case.dst, shape=case.shape, dtype=case.dtype, backend="mpi")
    reshard_call.lean = lean
    be, fl, dtype = ctx.get_backend("mpi"), floor.floor_program(case.src, case.dst, case.shape, me), np.dtype(case.dtype)
    wait_all = type(be).wait_all

    def timed_wait(self, works, deadline):      # the Program's first wait starts: mark it
        marks.setdefault("posted", time.perf_counter() - marks["t0"])
        return wait_all(self, works, deadline)
    type(be).wait_all = timed_wait
    methods = [("program", lambda: prog(x)),
               ("floor", lambda: floor_run(fl, x, dtype, be.comm, marks)),
               ("floor+poll", lambda: floor_run(fl, x, dtype, be.comm, marks, poll=True))]
    methods += [(f"floor+{us} us", lambda s=float(us) * 1e-6: floor_run(fl, x, dtype, be.comm, marks, spin_s=s))
                for us in args.spin_us.split(",") if us]
    got = {n: [] for n, _ in methods}
    for i in range(args.reps + 1):
        k = i % len(methods)
        for name, fn in methods[k:] + methods[:k]:
            spmd.polite_barrier(comm)
            marks.clear()
            marks["t0"] = t0 = time.perf_counter()
            fn()
            if i:
                got[name].append((marks["posted"], time.perf_counter() - t0))
            spmd.polite_barrier(comm)
    type(be).wait_all = wait_all
    rows = comm.gather(got, root=0)
    if me == 0:
        print(f"{case.name}: {comm.size} processes, median of {args.reps} per process, ms "
              "(wall time to its first wait, and in all): the median over processes (the slowest)")
        for name, _ in methods:
            pre = [statistics.median(a for a, _ in r[name]) * 1e3 for r in rows]
            tot = [statistics.median(b for _, b in r[name]) * 1e3 for r in rows]
            print(f"  {name:14s} to wait {statistics.median(pre):.3f} (max {max(pre):.3f})  "
                  f"total {statistics.median(tot):.3f} (max {max(tot):.3f})")
    mc.finalize()


if __name__ == "__main__":
    main()
