"""`meshcomm bench`: meshcomm beside the baselines, in one run.

    meshcomm bench sim  [--topology p3.8xlarge] [--json FILE] [--plot FILE.png]
    meshcomm bench refit [--models deepseek-v3] [--experts stacked] [--json FILE]
    meshcomm bench plan [--topology NAME] [--repeats N] [--max-devices 4096] [--json FILE]
    mpiexec -n 8 meshcomm bench run [--size-mb N] [--json FILE]   (or without mpiexec: it launches)

``sim`` (bench/sim.py) is simulated: every case is planned by meshcomm and by each baseline
(meshcomm.planners.baselines), every plan is verified, and the flow-level simulator
(meshcomm.planners.simulate) gives seconds on the topology, beside the bandwidth lower bound
(meshcomm.lower_bound). Cases (meshcomm.tools.cases): Alpa's n-to-m and 1-to-m resharding
cases (meshcomm/data/alpa_resharding_cases.json) and meshcomm's own (uneven, Blocks, partial
sums, 3-d meshes, MoE all-to-all shapes, same-mesh redistributions where DTensor applies).

``refit`` (bench/refit.py) is simulated: whole-model refits of DeepSeek-V3 and Qwen3-235B
planned as one batch (mc.plan_many) beside the policies RL frameworks use, against the
batch's lower bound.

``plan`` (bench/plan.py) is measured: wall-clock planning time from 8 to 4096 devices, cold
(every cache cleared: meshcomm.clear_caches) and cached, median of repeats.

``run`` (bench/run.py, its JAX part bench/jax_part.py) is measured: the cases scaled to 8
local processes, really executed with each meshcomm backend, as a Program constructed once
and as the eager call, beside the hand-written mpi4py exchange (bench/floor.py), the
allgather_slice plan (same executor, MPI), torch DTensor's redistribute on gloo (same-mesh
cases) and, in one process with 8 JAX CPU devices, jax.device_put.
"""
from __future__ import annotations

import argparse

from ..common import positive
from . import plan, refit, run, sim

__all__ = ["add_parser"]

HELP = """\
Benchmarks of meshcomm beside baselines, each figure reproducible by the command that prints it.

  sim    simulated seconds per case for meshcomm, send_recv, alpa_broadcast,
         allgather_slice and dtensor_style, and the bandwidth lower bound
  refit  simulated whole-model refits: batch plan beside RL frameworks' policies
  plan   measured planning time from 8 to 4096 devices, cold and cached
  run    measured: real execution on 8 local processes (Program and eager call) beside
         the hand-written exchange, allgather_slice, DTensor and jax.device_put
"""

RUN_HELP = """\
Really execute resharding cases (Alpa's, scaled to 8 local processes, plus same-mesh cases)
and time every method: with each backend, a Program (mc.Program.reshard, constructed once
per case outside the timed calls: program-mpi/-torch/-mixed) and the eager meshcomm.reshard
(meshcomm-mpi/-torch/-mixed); the hand-written mpi4py exchange of exactly the missing pieces
(floor); meshcomm's plan and the allgather_slice baseline plan run by the shared executor
directly over MPI (meshcomm-plan-mpi, allgather_slice: plan against plan); torch DTensor's
own redistribute on gloo (same-mesh cases); and, in one process with 8 JAX CPU devices,
jax.device_put to the new sharding beside meshcomm. Times are medians over --repeats after
a warm-up (max over ranks per repeat), the methods taking turns within each round. Per case
it reports the hand-written exchange, the Program run, the eager call and their ratios to
the exchange (goals: Program >= 0.95x, eager >= 0.9x).

  mpiexec -n 8 meshcomm bench run [--size-mb N] [--json FILE]    # SPMD, then the JAX part
  meshcomm bench run [--procs 8] ...                              # launches mpiexec itself
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: simulated cases, planning time, real runs",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    s = bsub.add_parser("sim", help="simulate Alpa's and meshcomm's cases for every method")
    s.add_argument("--topology", default="p3.8xlarge", help="topology preset (default p3.8xlarge)")
    s.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    s.add_argument("--plot", metavar="FILE.png", help="bar chart of time per case per method")
    s.add_argument("--only", metavar="NAMES", help="comma-separated substrings of case names")
    s.add_argument("--no-verify", action="store_true", help="skip verifying every plan")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=sim.cmd_sim)
    refit.add_refit_parser(bsub)
    q = bsub.add_parser("plan", help="planning time from 8 to 4096 devices, cold and cached")
    q.add_argument("--topology", default="p3.8xlarge")
    q.add_argument("--repeats", type=positive, default=5, help="cold repeats per case (median)")
    q.add_argument("--max-devices", type=int, default=4096)
    q.add_argument("--json", metavar="FILE")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(func=plan.cmd_plan)
    _add_run_parser(bsub)
    p.set_defaults(func=lambda args: _no_sub(p, args))


def _no_sub(parser, args) -> int:
    parser.print_help()
    return 2


def _add_run_parser(bsub) -> None:
    r = bsub.add_parser("run", help="really execute the cases on 8 local processes (mpiexec)",
                        description=RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--procs", type=int, default=8, help="processes when launching (default 8)")
    r.add_argument("--size-mb", type=float, default=16.0, help="tensor size in MiB (default 16)")
    r.add_argument("--repeats", type=positive, default=5, help="timed repeats after a warm-up (median)")
    r.add_argument("--backends", default="mpi,torch,mixed",
                   help="meshcomm backends to time, each as a Program and as the eager call")
    r.add_argument("--only", metavar="NAMES", help="comma-separated substrings of case names")
    r.add_argument("--no-dtensor", action="store_true", help="skip torch DTensor redistribute")
    r.add_argument("--no-jax", action="store_true", help="skip the one-process jax.device_put part")
    r.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds for each launch")
    r.add_argument("--part", choices=("mpi", "jax"), help=argparse.SUPPRESS)
    r.add_argument("--out", help=argparse.SUPPRESS)
    r.set_defaults(func=run.cmd_run)
