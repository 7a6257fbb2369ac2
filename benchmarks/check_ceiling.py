"""What an agreement check per call can cost at best: bare mpi4py, no meshcomm.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/check_ceiling.py [--sizes 1K,64K,4M] [--reps 25]

meshcomm checks every collective call (one rank's bad input makes every rank raise, never a
wrong value). This script times, with mpi4py alone, the blocking collective a user would call
directly beside the same collective non-blocking with a check running at the same time on
another communicator, in the two forms meshcomm has: the round of hash vectors point to
point to every rank (meshcomm's default up to 8 processes, which names a missing peer
exactly) and one MIN-allreduce of the vector (the default above 8). Then the same with the
check first and the collective after it. Whatever meshcomm adds in Python comes on top, so
`ceiling` (direct / checked) bounds what meshcomm can reach with a check per call. Times are
medians of the slowest rank, the forms interleaved within each round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(float(s.rstrip("KM")) * mult)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1K,64K,4M")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    data, chk, sync = world.Dup(), world.Dup(), world.Dup()
    n, rank = world.size, world.rank
    vec = np.arange(25, dtype=np.int64)
    vmin = np.empty_like(vec)
    rows = np.empty((n, vec.size), np.int64)
    peers = [p for p in range(n) if p != rank]

    def polite(reqs):
        while not MPI.Request.Testall(reqs):
            os.sched_yield()

    def barrier():
        polite([sync.Ibarrier()])

    def hash_round():
        return [chk.Irecv(rows[p], source=p, tag=5) for p in peers] + [chk.Isend(vec, dest=p, tag=5) for p in peers]

    def min_allreduce():
        return [chk.Iallreduce(vec, vmin, op=MPI.MIN)]

    if rank == 0:
        print(f"{'op':10} {'size':>5} {'direct us':>10} {'+round us':>10} {'+allreduce us':>14} "
              f"{'round,then us':>14} {'ceiling round':>14} {'ceiling allreduce':>18}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        x = np.ones(max(size // 4, n), np.float32)
        work = x.copy()
        part = x[: x.size // n]
        gathered = np.empty(part.size * n, np.float32)
        cases = {
            "allreduce": (lambda: data.Allreduce(MPI.IN_PLACE, work),
                          lambda: data.Iallreduce(MPI.IN_PLACE, work)),
            "allgather": (lambda: data.Allgather(part, gathered),
                          lambda: data.Iallgather(part, gathered)),
            "bcast": (lambda: data.Bcast(work, root=0),
                      lambda: data.Ibcast(work, root=0)),
        }
        for op, (direct, nonblocking) in cases.items():
            forms = {
                "direct": direct,
                "round": lambda nb=nonblocking: polite([nb()] + hash_round()),
                "allreduce": lambda nb=nonblocking: polite([nb()] + min_allreduce()),
                "then": lambda nb=nonblocking: (polite(hash_round()), polite([nb()])),
            }
            times = {k: [] for k in forms}
            for f in forms.values():
                barrier()
                f()
            for _ in range(args.reps):
                for k, f in forms.items():
                    barrier()
                    t0 = time.perf_counter()
                    f()
                    times[k].append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
            if rank == 0:
                print(f"{op:10} {size >> 10:>4}K {med['direct']:10.1f} {med['round']:10.1f} {med['allreduce']:14.1f} "
                      f"{med['then']:14.1f} {med['direct'] / med['round']:13.2f}x {med['direct'] / med['allreduce']:17.2f}x")


if __name__ == "__main__":
    main()
