"""What the agreement check costs one reshard case, timed as `meshcomm bench run` times it.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/reshard_check_cost.py 1to1 [--rounds 30]

One case of `meshcomm bench run` (meshcomm/tools/cases.py `run_cases`), called with default
settings (the signature check from the third call, compiled from the fourth), the signature
check on the full path (MESHCOMM_FAST_PATH=0), a round of hashes every call
(MESHCOMM_SIGNATURE_CHECK=0) and without a check (MESHCOMM_CHECK=0). The forms take turns
in every round, each with one untimed call before its timed one (a compiled call needs the
call before it to have been the same): per timed call a barrier, the call, the slowest
rank's time; the median of the rounds after four warm-up rounds, in ms.
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
from meshcomm.tools.cases import run_cases  # noqa: E402

FORMS = {"compiled": {}, "signature": {"MESHCOMM_FAST_PATH": "0"}, "hashes": {"MESHCOMM_SIGNATURE_CHECK": "0"},
         "nocheck": {"MESHCOMM_CHECK": "0"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="a case name of `meshcomm bench run` (alpa1, 1to1, ...)")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    ctx = mc.init(backend="mpi")
    case = next((c for c in run_cases(comm.size, 16.0) if c.name == args.case), None)
    if case is None:
        raise SystemExit(f"no case {args.case!r}: {[c.name for c in run_cases(comm.size, 16.0)]}")
    g = np.arange(int(np.prod(case.shape)), dtype=case.dtype).reshape(case.shape)
    sh = mc.shard(g, case.src)
    x = {d: sh[d] for d in ctx.owned_devices(case.src)}
    times = {k: [] for k in FORMS}
    for rnd in range(args.rounds + 4):
        for k, env in FORMS.items():
            os.environ.update(env)
            try:
                mc.reshard(x, case.src, case.dst, shape=case.shape, dtype=case.dtype, backend="mpi")
                comm.Barrier()
                t = time.perf_counter()
                mc.reshard(x, case.src, case.dst, shape=case.shape, dtype=case.dtype, backend="mpi")
                t = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            finally:
                for e in env:
                    os.environ.pop(e, None)
            if rnd >= 4:
                times[k].append(t)
    if comm.rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        cells = "  ".join(f"{k} {v:.2f} ms" for k, v in med.items())
        print(f"{args.case}: {cells}; check share {1 - med['nocheck'] / med['signature']:.0%} (signature) "
              f"{1 - med['nocheck'] / med['hashes']:.0%} (hashes) {1 - med['nocheck'] / med['compiled']:.0%} (compiled)", flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
