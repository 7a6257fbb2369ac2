"""What a check per reshard can cost at best: bare mpi4py, no meshcomm.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/reshard_check.py [--sizes 8M,16M] [--reps 25]

A reshard-shaped exchange (`4to4`: ranks 0-3 each send one piece to rank r+4, as Alpa's
2x2 -> 2x2 cases do; `1to2`: rank 0 sends its tile to ranks 1 and 2) timed alone and with a
check of every rank around it, in the forms a check can take:
`hashes_first` (the round of hash vectors point to point, completed, then the data: what
meshcomm does), `hashes_beside` (the round posted just before the data and completed with
it), `ibarrier_first` and `iallreduce_first` (an `MPI_Ibarrier` or a MIN-`Iallreduce` of the
vector in its place). Every wait polls with `sched_yield`, as meshcomm's do. Ratios are
`none` / form (1.0: the check is free). Medians of the slowest rank, forms interleaved in
each round.
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


def main(argv=None) -> None:
    from mpi4py import MPI
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8M,16M", help="bytes per piece, e.g. 64K,8M")
    ap.add_argument("--patterns", default="4to4,1to2")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args(argv)
    w = MPI.COMM_WORLD
    r, n = w.rank, w.size
    if n < 8:
        raise SystemExit("run with mpiexec -n 8 (or more)")
    hc, dc = w.Dup(), w.Dup()
    vec, rows = np.full(25, r, np.int64), np.empty((n, 25), np.int64)
    red = np.empty(25, np.int64)

    def poll(reqs):
        while not MPI.Request.Testall(reqs):
            os.sched_yield()

    def hashes():
        reqs = [hc.Irecv(rows[p], source=p, tag=7) for p in range(n) if p != r]
        return reqs + [hc.Isend(vec, dest=p, tag=7) for p in range(n) if p != r]

    for pattern in args.patterns.split(","):
        for size in map(parse_size, args.sizes.split(",")):
            if pattern == "4to4":
                sends, recvs = ([r + 4] if r < 4 else []), ([r - 4] if 4 <= r < 8 else [])
            elif pattern == "1to2":
                sends, recvs = ([1, 2] if r == 0 else []), ([0] if r in (1, 2) else [])
            else:
                raise SystemExit(f"unknown pattern {pattern!r}")
            src = np.ones(size // 4, np.float32)
            dst = {p: np.empty(size // 4, np.float32) for p in recvs}

            def data():
                reqs = [dc.Irecv(dst[p], source=p, tag=3) for p in recvs]
                return reqs + [dc.Isend(src, dest=q, tag=3) for q in sends]

            def hashes_beside():
                h = hashes()
                d = data()
                poll(h)
                poll(d)
            forms = {
                "none": lambda: poll(data()),
                "hashes_first": lambda: (poll(hashes()), poll(data())),
                "hashes_beside": hashes_beside,
                "ibarrier_first": lambda: (poll([hc.Ibarrier()]), poll(data())),
                "ibarrier_beside": lambda: poll([hc.Ibarrier()] + data()),
                "iallreduce_first": lambda: (poll([hc.Iallreduce(vec, red, op=MPI.MIN)]), poll(data())),
            }
            ts = {k: [] for k in forms}
            for rep in range(args.reps + 1):
                for k, f in forms.items():
                    poll([w.Ibarrier()])
                    t0 = time.perf_counter()
                    f()
                    t = w.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                    if rep:
                        ts[k].append(t)
            if r == 0:
                med = {k: statistics.median(v) for k, v in ts.items()}
                cells = "  ".join(f"{k} {v * 1e3:.2f} ms ({med['none'] / v:.2f}x)" for k, v in med.items())
                print(f"{pattern} {size >> 10} KiB: {cells}", flush=True)


if __name__ == "__main__":
    main()
