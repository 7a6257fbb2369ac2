"""What Python per call costs a small collective when processes outnumber cores.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/python_cost.py [--calls 200] [--reps 4]

A 1 KiB MPI_Iallreduce polled with sched_yield (as meshcomm polls), after a busy loop of
0, 10, 25 or 50 µs standing for a library's Python per call; then mpi4py's blocking
Allreduce, a meshcomm Program run (`mc.Program.all_reduce`, constructed once before the
loops) and the eager `meshcomm.all_reduce` (its cached Program) with their CPU time per call
and process. Medians over `--reps` loops of `--calls` calls, the slowest rank's wall time
per call. The last lines are meshcomm's CPU per call outside its wait (the backend's polling
wait, `backends.base.wait_polling`, timed by wrapping it), Program and eager: the Python
itself, which grows several-fold when processes share cores (caches shared, refilled after
each switch) beside the same figure at one process per core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    w = MPI.COMM_WORLD
    c = w.Dup()
    x = np.ones(256, np.float32)
    line = mc.Mesh(np.arange(w.size), ("x",))

    def busy(us):
        t = time.perf_counter() + us * 1e-6
        while time.perf_counter() < t:
            pass

    def polled(us):
        def f():
            busy(us)
            y = x.copy()                    # referenced until the request completes
            q = c.Iallreduce(MPI.IN_PLACE, y)
            while not q.Test():
                os.sched_yield()
        return f
    forms = {f"Iallreduce + {us} us of work": polled(us) for us in (0, 10, 25, 50)}
    forms["mpi4py Allreduce"] = lambda: w.Allreduce(MPI.IN_PLACE, x.copy())
    prog = mc.Program.all_reduce(line, "x", shape=x.shape, dtype=x.dtype)      # constructed once
    forms["meshcomm Program all_reduce"] = lambda: prog(x)
    forms["meshcomm eager all_reduce"] = lambda: mc.all_reduce(x, line, "x")
    mine = ("meshcomm Program all_reduce", "meshcomm eager all_reduce")
    from meshcomm.backends import base
    waited = {"cpu": 0.0}
    wait = base.wait_polling

    def timed_wait(*a, **kw):       # CPU spent polling, to take away from the call's own
        c1 = time.thread_time()
        try:
            return wait(*a, **kw)
        finally:
            waited["cpu"] += time.thread_time() - c1
    base.wait_polling = timed_wait
    outside = {k: [] for k in mine}
    wall = {k: [] for k in forms}
    cpu = {k: [] for k in forms}
    for rep in range(args.reps + 1):
        for k, f in forms.items():
            for _ in range(5):
                f()
            w.Barrier()
            waited["cpu"] = 0.0
            t, c0, c1 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(args.calls):
                f()
            t, c0 = (time.perf_counter() - t) / args.calls, (time.process_time() - c0) / args.calls
            c1 = (time.thread_time() - c1 - waited["cpu"]) / args.calls
            if rep:
                wall[k].append(w.allreduce(t, op=MPI.MAX))
                cpu[k].append(w.allreduce(c0) / w.size)
                if k in outside:
                    outside[k].append(w.allreduce(c1) / w.size)
    base.wait_polling = wait
    if w.rank == 0:
        for k in forms:
            print(f"{k:34} wall {statistics.median(wall[k]) * 1e6:7.0f} us/call   "
                  f"cpu {statistics.median(cpu[k]) * 1e6:6.0f} us/call/process", flush=True)
        for k, v in outside.items():
            name = k.replace(" all_reduce", "") + ", outside its wait"
            print(f"{name:34} {'':17}   cpu {statistics.median(v) * 1e6:6.0f} us/call/process", flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
