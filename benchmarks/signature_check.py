"""What the agreement check costs a repeated call: the signature check beside the round of hashes.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/signature_check.py [--reps 5] [--calls 40]

Per workload, back-to-back loops of `--calls` identical calls, interleaved in each of
`--reps` rounds, median of the rounds (µs per call, the slowest rank's loop):
`mpi4py` (the direct call, where there is one), meshcomm as it runs by default (`compiled`:
a repeated collective runs its compiled form, MESHCOMM_FAST_PATH=1; a reshard has none), with
the signature check on the full path (MESHCOMM_FAST_PATH=0), with a round of hashes every call
(MESHCOMM_SIGNATURE_CHECK=0), and without any check (MESHCOMM_CHECK=0, reshard only: a
collective is always checked). Workloads: all_reduce of 1 KiB and all_gather of 4 MiB over all
processes (one native MPI collective, which is itself the signature check), and a 16 MiB
reshard from a 2x2 mesh of ranks 0-3 to a 2x2 mesh of ranks 4-7 (the check is a barrier
before the data). The settings are read per call, so one launch times them all.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import meshcomm as mc  # noqa: E402

VARIANTS = {"compiled": {"MESHCOMM_FAST_PATH": "1"},
            "signature": {"MESHCOMM_FAST_PATH": "0"}, "hashes": {"MESHCOMM_SIGNATURE_CHECK": "0"},
            "nocheck": {"MESHCOMM_CHECK": "0"}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    ctx = mc.init(backend="mpi")
    n, me = ctx.world_size, ctx.rank
    line = mc.Mesh(np.arange(n), ("x",))
    small = np.ones(256, np.float32)
    big = np.ones((1 << 20) // n, np.float32)
    buf = np.empty(big.size * n, np.float32)
    loads = {
        "all_reduce 1 KiB": {"mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, small.copy()),
                             "meshcomm": lambda: mc.all_reduce(small, line, "x")},
        "all_gather 4 MiB": {"mpi4py": lambda: comm.Allgather(big, buf),
                             "meshcomm": lambda: mc.all_gather(big, line, "x")},
    }
    if n == 8:
        a, b = mc.Mesh(np.arange(4).reshape(2, 2), ("x", "y")), mc.Mesh(np.arange(4, 8).reshape(2, 2), ("x", "y"))
        src, dst = mc.Layout(a, ("x", "y")), mc.Layout(b, ("y", "x"))
        x = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)
        sh = mc.shard(x, src)
        mine = {d: sh[d] for d in ctx.owned_devices(src)}
        loads["reshard 16 MiB 2x2->2x2"] = {
            "meshcomm": lambda: mc.reshard(mine, src, dst, backend="mpi", shape=x.shape, dtype=x.dtype)}

    def timed(fn, env):
        os.environ.update(env)
        try:
            for _ in range(4):          # the signature communicator exists from the fourth call
                fn()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            return comm.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX)
        finally:
            for k in env:
                os.environ.pop(k, None)

    for name, fns in loads.items():
        res: dict = {}
        for _ in range(args.reps):
            if "mpi4py" in fns:
                res.setdefault("mpi4py", []).append(timed(fns["mpi4py"], {}))
            for v, env in VARIANTS.items():
                if v == "nocheck" and not name.startswith("reshard"):
                    continue
                res.setdefault(v, []).append(timed(fns["meshcomm"], env))
        if me == 0:
            med = {k: statistics.median(v) for k, v in res.items()}
            cells = "  ".join(f"{k} {t * 1e6:.0f} us" for k, t in med.items())
            ratio = f"hashes / signature {med['hashes'] / med['signature']:.2f}x"
            ratio += f", signature / compiled {med['signature'] / med['compiled']:.2f}x"
            if "mpi4py" in med:
                ratio += f", mpi4py / compiled {med['mpi4py'] / med['compiled']:.2f}x (>1: meshcomm faster)"
            if "nocheck" in med:
                ratio += f", check share {1 - med['nocheck'] / med['signature']:.0%} (signature) " \
                         f"{1 - med['nocheck'] / med['hashes']:.0%} (hashes)"
            print(f"{name}: {cells}; {ratio}", flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
