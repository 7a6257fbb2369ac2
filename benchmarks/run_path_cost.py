"""Where the time of a small collective Program run goes, layer by layer, against MPI alone.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/run_path_cost.py [--elems 32] [--calls 400]

A 1-d mesh of one device per process, an all_gather of `--elems` float32 per process, loops
of `--calls` calls (5 rounds, median; wall = the slowest rank, CPU = this process's
time.process_time averaged over the processes):

* `blocking`: mpi4py's `Allgather` (MPICH's blocking call, in C);
* `persistent`: `Allgather_init` once, then copy in, `Start`, `Test` with a sched_yield after
  each miss (meshcomm's policy with more processes than cores), copy out: the least a run
  that can honour a timeout does;
* `kernel_only`: the Program's bound post (the same persistent request) and the backend's
  wait_all;
* `kernel_run`: the kernel's prepare, run and finish (input check, result assembly);
* `program`: `prog(x)`, the whole run (the call record, the control channel, the lock).

With P processes on C cores, wall time is about P/C times the CPU per process per call: every
microsecond of Python per run costs that many on an oversubscribed host.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elems", type=int, default=32)
    ap.add_argument("--calls", type=int, default=400)
    args = ap.parse_args(argv)
    import meshcomm as mc
    from mpi4py import MPI
    mc.init(backend="mpi")
    c = MPI.COMM_WORLD.Dup()
    n, r = c.Get_size(), c.Get_rank()
    x = np.ones(args.elems, np.float32)
    send, recv = np.empty_like(x), np.empty(args.elems * n, np.float32)
    req = c.Allgather_init(send, recv)

    def persistent():
        np.copyto(send, x)
        req.Start()
        while not req.Test():
            os.sched_yield()
        return recv.copy()

    prog = mc.Program.all_gather(mc.Mesh(list(range(n)), ("x",)), "x", shape=x.shape, dtype="float32")
    k = prog._kernel
    me, post = k._one[0]
    prim = k.native.prim

    def kernel_only():
        works, fin = post(x)
        prim.wait_all(works, time.monotonic() + 100)
        return fin()

    def kernel_run():
        return k.finish(k.run(k.prepare(x, None), time.monotonic() + 100))

    forms = dict(blocking=lambda: c.Allgather(x, recv), persistent=persistent, kernel_only=kernel_only,
                 kernel_run=kernel_run, program=lambda: prog(x))
    if r == 0:
        print(f"{n} processes, {os.cpu_count()} cores, all_gather of {args.elems * 4} B per process")
    for name, f in forms.items():
        f()
        walls, cpus = [], []
        for _ in range(5):
            c.Barrier()
            t0, p0 = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                f()
            cpus.append(c.allreduce((time.process_time() - p0) / args.calls, op=MPI.SUM) / n)
            walls.append(c.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX))
        if r == 0:
            print(f"{name:<12} wall {statistics.median(walls) * 1e6:7.1f} us   CPU per process "
                  f"{statistics.median(cpus) * 1e6:6.1f} us", flush=True)
    req.Free()
    mc.finalize()


if __name__ == "__main__":
    main()
