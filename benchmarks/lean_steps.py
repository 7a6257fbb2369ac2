"""What each step of a collective Program's lean run costs, calls back to back, 8 processes.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/lean_steps.py [--ops all_gather,all_reduce,all_to_all]
                                                  [--elems 32] [--calls 200] [--reps 9]

Per op, one Program (`mc.Program.<op>(mesh, "x", shape=(elems,), dtype=float32)`: a
persistent MPI request) and these forms of a run, each `--calls` runs back to back, taking
turns in each of `--reps` rounds after a polite barrier (median of the slowest process's time
per run):

* `request`: the Program's own post, poll and result (runtime/native_call.py `persistent`),
  with nothing around them: copy in, `Start`, `Test` (yielding every 4th miss), copy out;
* `+checks`: the tile's type, shape and dtype, the control channel's state, pending
  asynchronous calls (what the lean run checks before it posts);
* `+lock`: the context lock held around the post and the wait;
* `+sequence`: the group's run counter and the run's parity (which of the two requests);
* `+record`: the run's count and its flight-recorder entry with two timestamps;
* `lean run`: `Program._lean` itself (runtime/program.py `_lean_run`); `prog(x)`: the call.

Figures: each form's speed relative to `request` (request time / form time; 1.00x: no cost).
On a machine with fewer cores than processes every step costs several times its CPU in wall
time (the processes take turns on the cores): BENCHMARKS 5.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.runtime import control  # noqa: E402
from meshcomm.runtime.program import seq_cell  # noqa: E402
from meshcomm.tools.common import script_parser  # noqa: E402
from meshcomm.tools.spmd import polite_barrier  # noqa: E402


def forms(ctx, prog, x):
    """The forms of one run, each a function of no arguments."""
    (post, result, _, _), (post1, result1, _, _) = (p[1].lean for p in prog._kernel._one)
    fns = ((post, result), (post1, result1))
    ch, pid, lock, rec, now = control._CHANNEL, prog.id, ctx._lock, control.RECORDER, time.time
    shape, dtype, yld = x.shape, x.dtype, os.sched_yield
    cell = seq_cell(ctx, prog.ranks)

    def poll(req):
        i = 0
        while not req.Test():
            i += 1
            if not i % 4:
                yld()

    def ok(x):
        return (type(x) is np.ndarray and x.shape == shape and x.dtype == dtype and not ch.errors
                and prog.failed is None and pid not in ch.failed and not ctx.closed
                and (ctx._last is None or ctx._last.done()))

    def request():
        poll(post(x, 0).req)
        return result()

    def checks():
        if ok(x):
            poll(post(x, 0).req)
            return result()

    def locked():
        if ok(x):
            with lock:
                poll(post(x, 0).req)
                return result()

    def sequence():
        if ok(x):
            with lock:
                cell[0] = seq = cell[0] + 1
                p, r = fns[seq & 1]
                poll(p(x, seq).req)
                return r()

    def record():
        if ok(x):
            with lock:
                cell[0] = seq = cell[0] + 1
                p, r = fns[seq & 1]
                prog.runs = runs = prog.runs + 1
                t0 = now()
                poll(p(x, seq).req)
                rec.seq += 1
                rec.ring.append((rec.seq, ("run", pid, prog.label, runs, seq), "done", (), t0, now()))
                return r()
    return {"request": request, "+checks": checks, "+lock": locked, "+sequence": sequence, "+record": record,
            "lean run": lambda: prog._lean(x), "prog(x)": lambda: prog(x)}


def main(argv=None) -> int:
    ap = script_parser(__doc__, reps=9)
    ap.add_argument("--ops", default="all_gather,all_reduce,all_to_all")
    ap.add_argument("--elems", type=int, default=32)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    comm = MPI.COMM_WORLD.Dup()
    mesh = mc.Mesh(np.arange(ctx.world_size), ("x",))
    rows = []

    def timed(f):
        polite_barrier(comm)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            f()
        return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.calls

    if ctx.rank == 0:
        print(f"{ctx.world_size} processes, float32 tiles of {args.elems}, {args.calls} runs back to back, "
              f"median of {args.reps} rounds; speed relative to the bare request")
    for op in args.ops.split(","):
        x = np.ones(args.elems, np.float32)
        prog = getattr(mc.Program, op)(mesh, "x", shape=x.shape, dtype=x.dtype, backend="mpi")
        if prog._lean is None or prog._kernel._one is None:
            raise SystemExit(f"{op}: no lean run of one native call here")
        fns = forms(ctx, prog, x)
        for f in fns.values():
            timed(f)
        times = {k: [] for k in fns}
        for _ in range(args.reps):
            for k, f in fns.items():
                times[k].append(timed(f))
        med = {k: statistics.median(v) for k, v in times.items()}
        if ctx.rank == 0:
            base = med["request"]
            print(f"{op:15} request {base * 1e6:6.1f} us  " +
                  "  ".join(f"{k} {base / v:.2f}x" for k, v in med.items() if k != "request"), flush=True)
            rows.append({"op": op, "seconds": med})
    if ctx.rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    mc.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
