"""The executor with and without rank programs, beside the hand-written floor.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/rank_program.py [--cases same-moe-a2a,alpa4] [--reps 9]

Cases of `meshcomm bench run` (meshcomm/tools/cases.py `run_cases`, 16 MiB). Per case, timed
in turns as `bench run` times them (a barrier, the call, the slowest rank's time; the
median of --reps rounds after a warm-up): the plan run by the executor directly from its
rank program (backends/program.py, the default) and step by step (MESHCOMM_RANK_PROGRAM=0),
`meshcomm.reshard` (default settings: compiled, checked) both ways, and the floor (the
hand-written mpi4py exchange, meshcomm/tools/bench/floor.py). Every result is checked
exact. Prints ms per call and the step-by-step / program ratios (> 1: the program is faster).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.backends import base  # noqa: E402
from meshcomm.tools import spmd  # noqa: E402
from meshcomm.tools.bench import floor  # noqa: E402
from meshcomm.tools.bench.run import time_interleaved  # noqa: E402
from meshcomm.tools.cases import global_array, run_cases  # noqa: E402
from meshcomm.tools.common import script_parser, write_json  # noqa: E402

DEFAULT_CASES = "alpa1,alpa4,uneven,blocks,same-transpose,same-moe-a2a,same-allgather"


def steps(fn):
    """fn with MESHCOMM_RANK_PROGRAM=0 set around it."""
    def run():
        os.environ["MESHCOMM_RANK_PROGRAM"] = "0"
        try:
            return fn()
        finally:
            del os.environ["MESHCOMM_RANK_PROGRAM"]
    return run


def main():
    ap = script_parser(__doc__, 9)
    ap.add_argument("--cases", default=DEFAULT_CASES, help="comma list of `bench run` case names")
    args = ap.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    me = comm.rank
    ctx = mc.init(backend="mpi", devices_per_process=1)
    be = ctx.get_backend("mpi")
    names = args.cases.split(",")
    cases = [c for c in run_cases(comm.size, 16.0) if c.name in names]
    if len(cases) != len(names):
        raise SystemExit(f"unknown case(s) {sorted(set(names) - {c.name for c in cases})}")
    rows = []
    for i, case in enumerate(cases):
        g = global_array(case.shape, 1000 + i, case.dtype)
        sh = mc.shard(g, case.src, seed=7)
        x = {d: np.ascontiguousarray(sh[d]) for d in ctx.owned_devices(case.src)}
        p = mc.plan(case.shape, case.dtype, case.src, case.dst)
        like = next(iter(x.values())) if x else np.empty(0, dtype=case.dtype)

        def plan():
            return base.execute(p, x, like, rank=me, devices_per_process=1, backend=be,
                                deadline=time.monotonic() + ctx.timeout)[0]

        def reshard():
            return mc.reshard(x, case.src, case.dst, shape=case.shape, dtype=case.dtype, backend="mpi")
        methods = [("plan", plan), ("plan:steps", steps(plan)), ("reshard", reshard),
                   ("reshard:steps", steps(reshard))]
        if not case.dst.is_partial:
            prog = floor.floor_program(case.src, case.dst, case.shape, me)
            methods.append(("floor", lambda: floor.run_floor(prog, x, case.dtype, be.comm)))
        res = time_interleaved(comm, methods, args.reps, warmup=1)
        exact = all(spmd.exact(comm, case.dst, case.shape, g, res[n][1]) for n, _ in methods)
        if me == 0:
            ms = {n: res[n][0] * 1e3 for n, _ in methods}
            row = {"case": case.name, "ms": ms, "exact": exact,
                   "plan_gain": ms["plan:steps"] / ms["plan"], "reshard_gain": ms["reshard:steps"] / ms["reshard"]}
            rows.append(row)
            cells = "  ".join(f"{n} {v:6.2f}" for n, v in ms.items())
            print(f"{case.name:15} {cells}  | steps/program: plan {row['plan_gain']:.2f}x reshard "
                  f"{row['reshard_gain']:.2f}x{'' if exact else '  INEXACT'}", flush=True)
    if me == 0 and rows:
        gm = lambda k: float(np.exp(np.mean([np.log(r[k]) for r in rows])))  # noqa: E731
        print(f"geomean steps/program: plan {gm('plan_gain'):.2f}x, reshard {gm('reshard_gain'):.2f}x "
              f"({len(rows)} cases, {args.reps} rounds)")
        if args.json:
            write_json(args.json, {"rows": rows})
    mc.finalize()


if __name__ == "__main__":
    main()
