"""`make demo`: reshard Alpa's benchmark cases across 8 local processes with each backend.

    python -m meshcomm.tools.demo                # 8 processes under the venv's mpiexec
    meshcomm demo --procs 8 --mib 16 --backends mpi,torch,mixed --repeats 3
    meshcomm demo --local                        # one process, in-memory local backend

Alpa's cases (meshcomm/data/alpa_resharding_cases.json: 2x4 -> 2x4 meshes of p3.8xlarge
nodes, 2 GiB int32 tensors) are scaled to this machine: "nodes" of 2 devices, so a 2x4 mesh
becomes 2x2 and the two meshes sit on devices 0..3 and 4..7; tensors are ~16 MiB float32.
Every process builds the same seeded global tensor, takes its src tiles, calls
`meshcomm.reshard` (SPMD) and checks its dst tiles against `meshcomm.shard` of the same data
(rank 0 also reassembles the whole result with `meshcomm.unshard`); with each backend it also
runs an explicit Program (`meshcomm.Program.reshard`, constructed once per case: the rows
"<backend> prog"; `--no-program` leaves them out). Per case it prints the
median time (max over processes) of a few rounds after a warm-up (the baseline and the backends
take turns within each round, so all see the same machine load), the plan's bytes moved, the
effective bandwidth (bytes moved / time), and, for comparison, an allgather-then-slice of the
same data ("ag+slice": meshcomm.planners.baselines.allgather_slice, every dst device receives
the whole tensor along ring-allgather chains and keeps its box, run by the same executor over
MPI). `--mpi-allgather` adds MPI's own Allgatherv of the src tiles followed by slicing.

When the distributed backends are not available (or the launch fails), the demo runs the
same cases in one process with the local backend and says so.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

from . import spmd
from .common import UsageError
from .cases import extra_cases, global_array, scaled_alpa_cases
from .demo_worker import HEADER, row, worker_main

__all__ = ["add_parser", "main", "run", "run_local", "distributed_available"]

DEFAULT_BACKENDS = ("mpi", "torch", "mixed")


# -- one process, local backend -----------------------------------------------------------

def run_local(cases, repeats: int, seed: int, program: bool = True) -> int:
    import meshcomm as mc
    print(HEADER)
    bad = 0
    for i, case in enumerate(cases):
        g = global_array(case.shape, seed + i, case.dtype)
        x = mc.shard(g, case.src, seed=seed)
        p = mc.plan(case.shape, case.dtype, case.src, case.dst)
        methods = [("local", lambda: mc.reshard(x, case.src, case.dst, shape=case.shape))]
        if program:
            prog = mc.Program.reshard(case.src, case.dst, shape=case.shape, dtype=case.dtype)
            methods.append(("local prog", lambda prog=prog: prog(x)))
        for label, fn in methods:
            y = fn()                                                    # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                y = fn()
                times.append(time.perf_counter() - t0)
            ok = np.array_equal(mc.unshard(y, case.dst), g)
            bad += not ok
            print(row(case, label, statistics.median(times), p.bytes_moved, "yes" if ok else "NO"),
                  flush=True)
    return 1 if bad else 0


# -- the driver -----------------------------------------------------------------------------

def distributed_available() -> str | None:
    """None when the distributed backends can run, else why not."""
    import meshcomm
    if not hasattr(meshcomm, "init"):
        return "meshcomm.init is not available yet"
    try:
        import meshcomm.backends.mpi  # noqa: F401
    except Exception as e:           # noqa: BLE001 - report any import failure
        return f"meshcomm.backends.mpi does not import ({type(e).__name__}: {e})"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    if spmd.find_mpiexec() is None:
        return "no mpiexec next to the Python interpreter or on PATH"
    return None


def _add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--procs", type=int, default=8, help="processes (= devices), default 8")
    ap.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB, default 16")
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                    help="comma-separated backends to run (default mpi,torch,mixed)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds per case (median; methods interleaved within a round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default all)")
    ap.add_argument("--no-extra", action="store_true", help="only Alpa's cases")
    ap.add_argument("--no-baseline", action="store_true", help="skip the allgather-then-slice row")
    ap.add_argument("--no-program", action="store_true",
                    help="skip the explicit Program rows (each backend is then timed as the eager call only)")
    ap.add_argument("--mpi-allgather", action="store_true",
                    help="also time MPI Allgatherv of the src tiles, then slice (a user's plain version)")
    ap.add_argument("--local", action="store_true", help="one process, local backend")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="reshard Alpa's cases on 8 local processes with each backend",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(func=run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshcomm.tools.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(ap)
    return run(ap.parse_args(argv))


def _launch(args) -> str | None:
    """Run the demo's worker on args.procs processes; None when it succeeded, else why not."""
    argv = ["-m", "meshcomm.tools.demo", "--worker", "--procs", str(args.procs), "--mib",
            str(args.mib), "--backends", args.backends, "--repeats", str(args.repeats), "--seed",
            str(args.seed)]
    if args.cases:
        argv += ["--cases", args.cases]
    for flag in ("no_extra", "no_baseline", "no_program", "mpi_allgather"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    print(f"launching {args.procs} processes: {spmd.find_mpiexec()} -n {args.procs} python -m "
          "meshcomm.tools.demo --worker ...", flush=True)
    try:
        r = spmd.launch(args.procs, argv, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"the {args.procs}-process run did not finish within {args.timeout:g} s"
    return None if r.returncode == 0 else f"the {args.procs}-process run exited with status {r.returncode}"


def run(args) -> int:
    cases = scaled_alpa_cases(args.procs, args.mib) + ([] if args.no_extra else extra_cases(args.procs, args.mib))
    if args.cases:
        want = set(args.cases.split(","))
        unknown = sorted(want - {c.name for c in cases})
        if unknown:
            raise UsageError(f"--cases: unknown case(s) {unknown}; known: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in want]
    bad = sorted(set(args.backends.split(",")) - set(DEFAULT_BACKENDS))
    if bad:
        raise UsageError(f"--backends: unknown backend(s) {bad}; known: {list(DEFAULT_BACKENDS)}")
    if args.worker:
        return worker_main(cases, args)

    print(f"meshcomm demo: {len(cases)} resharding cases from Alpa's benchmark (scaled: 2 devices "
          f"per node, ~{args.mib:g} MiB float32), median of {args.repeats} after a warm-up")
    why = None if not args.local else "--local given"
    if why is None:
        why = distributed_available()
    if why is None:
        why = _launch(args)
        if why is None:
            return 0
        print(f"meshcomm demo: FAILED: {why}", flush=True)
        print("NOTE: the same cases in ONE process with the local backend, for reference; the "
              "distributed backends are NOT exercised below.", flush=True)
        run_local(cases, args.repeats, args.seed, not args.no_program)
        return 1
    print(f"NOTE: running in ONE process with the local backend ({why}); the distributed "
          f"backends are not exercised.", flush=True)
    return run_local(cases, args.repeats, args.seed, not args.no_program)


if __name__ == "__main__":
    sys.exit(main())
