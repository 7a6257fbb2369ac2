"""How the start of a receive buffer within a cache line (its phase: address mod 64) against
the sender's changes a large MPI message between two processes on one host.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/recv_phase.py [--bytes 2097152] [--rounds 40]

Each process sends its buffer to the other and receives into one at each phase (bytes past a
page boundary); median of the rounds, slowest process, in microseconds. Why meshcomm's result
tiles start at their source tiles' phase (backends/local.py `aligned_numpy`).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

PHASES = (0, 16, 64, 128, 592, 1024, 2048, 2064)


def buffer(n: int, phase: int) -> np.ndarray:
    raw = np.empty(n + 8192, np.uint8)
    off = (phase - raw.ctypes.data) % 4096
    b = raw[off:off + n]
    b[...] = 0
    return b


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=2 << 20)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    peer = 1 - comm.rank
    srcs = {p: buffer(args.bytes, p) for p in (0, 16)}
    dsts = {p: buffer(args.bytes, p) for p in PHASES}
    t = {}
    for _ in range(args.rounds):
        for sp, s in srcs.items():
            for dp, d in dsts.items():
                comm.Barrier()
                t0 = time.perf_counter()
                MPI.Request.Waitall([comm.Irecv(d, source=peer, tag=1), comm.Isend(s, dest=peer, tag=1)])
                t.setdefault((sp, dp), []).append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    if comm.rank == 0:
        print(f"{args.bytes} B each way, 2 processes; median us by the receive buffer's bytes past a page")
        print("sender's phase  " + "".join(f"{p:>7d}" for p in PHASES))
        for sp in srcs:
            print(f"{sp:>14d}  " + "".join(f"{np.median(t[(sp, dp)]) * 1e6:7.0f}" for dp in PHASES))


if __name__ == "__main__":
    main()
