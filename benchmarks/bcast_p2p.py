"""Broadcast inside one host: MPICH's Ibcast vs the root's Isend to each member, and meshcomm's.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/bcast_p2p.py [--reps 15] [--json FILE]

Two parts, 8 processes on this host (m = 7 needs 8, m = 3 needs 4):

* primitives: MPI_Ibcast on a sub-communicator of root + m members vs m Isend/Irecv pairs
  (both polled the way meshcomm polls), message sizes 1 KiB .. 16 MiB, m = 3 and 7: why the
  MPI backend broadcasts point to point inside one host (it always does now; there is no
  switch);
* end to end: a replicated float32 tensor from device 0 to devices 1..m (one broadcast in the
  plan) as a meshcomm Program (`mc.Program.reshard`, constructed once per size before the
  timed calls) and as the eager `meshcomm.reshard`, beside the two primitives moving the same
  bytes in the same run.

Per repeat the slowest rank's time (polite barriers, meshcomm.tools.spmd); median of
--reps after a warm-up; ratios are Ibcast / p2p, and meshcomm / p2p, within the same run.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

import meshcomm as mc
from meshcomm.tools.common import script_parser, write_json
from meshcomm.tools.spmd import time_repeats


def poll(reqs):
    while not MPI.Request.Testall(reqs):
        os.sched_yield()


def primitives(comm, reps):
    me, rows = comm.rank, []
    for m in (3, 7):
        if m >= comm.size:
            continue
        sub = comm.Split(0 if me <= m else MPI.UNDEFINED, me)
        for nbytes in (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24):
            buf = np.ones(nbytes, np.uint8)

            def ibcast():
                if sub != MPI.COMM_NULL:
                    poll([sub.Ibcast(buf, root=0)])

            def fanout():
                if me == 0:
                    poll([comm.Isend(buf, d, 5) for d in range(1, m + 1)])
                elif me <= m:
                    poll([comm.Irecv(buf, 0, 5)])
            n = reps if nbytes >= 1 << 20 else 3 * reps
            t_c, _ = time_repeats(comm, ibcast, n, 2)
            t_p, _ = time_repeats(comm, fanout, n, 2)
            rows.append({"part": "primitive", "members": m, "bytes": nbytes,
                         "collective_s": t_c, "p2p_s": t_p})
        if sub != MPI.COMM_NULL:
            sub.Free()
    return rows


def end_to_end(comm, reps):
    me, rows = comm.rank, []
    for m in (3, 7):
        if m >= comm.size:
            continue
        sub = comm.Split(0 if me <= m else MPI.UNDEFINED, me)
        src = mc.Layout(mc.Mesh([[0]], ("x", "y")), (None,))
        dst = mc.Layout(mc.Mesh([list(range(1, m + 1))], ("x", "y")), (None,))
        for nbytes in (1 << 12, 1 << 20, 1 << 24):
            n = nbytes // 4
            want = np.arange(n, dtype=np.float32)
            x = {0: want} if me == 0 else {}
            buf = want.copy() if me == 0 else np.empty(n, np.float32)
            prog = mc.Program.reshard(src, dst, shape=(n,), dtype="float32", backend="mpi")     # once

            def ibcast():
                if sub != MPI.COMM_NULL:
                    poll([sub.Ibcast(buf, root=0)])

            def fanout():
                if me == 0:
                    poll([comm.Isend(buf, d, 5) for d in range(1, m + 1)])
                elif me <= m:
                    poll([comm.Irecv(buf, 0, 5)])

            def eager():
                return mc.reshard(x, src, dst, shape=(n,), dtype="float32", backend="mpi")
            k = reps if nbytes >= 1 << 20 else 3 * reps
            t = {}
            t["collective_s"], _ = time_repeats(comm, ibcast, k, 2)
            t["p2p_s"], _ = time_repeats(comm, fanout, k, 2)
            t["program_s"], y = time_repeats(comm, lambda: prog(x), k, 2)
            t["eager_s"], y0 = time_repeats(comm, eager, k, 2)
            ok = me not in dst.mesh or (np.array_equal(y[me], want) and np.array_equal(y0[me], want))
            assert comm.allreduce(int(not ok)) == 0, "inexact reshard result"
            rows.append({"part": "reshard", "members": m, "bytes": nbytes, **t})
        if sub != MPI.COMM_NULL:
            sub.Free()
    return rows


def main(argv=None):
    args = script_parser(__doc__, reps=15).parse_args(argv)
    comm = MPI.COMM_WORLD
    mc.init(backend="mpi")
    rows = primitives(comm, args.reps) + end_to_end(comm, args.reps)
    if comm.rank == 0:
        print(f"broadcast inside one host: {comm.size} processes, median of {args.reps} "
              f"(x3 below 1 MiB), per repeat the slowest rank")
        print(f"{'part':10s} {'members':>7s} {'bytes':>9s} {'Ibcast us':>10s} {'p2p us':>10s} {'Ibcast/p2p':>10s} "
              f"{'Program us':>10s} {'eager us':>10s} {'Program/p2p':>11s} {'eager/p2p':>9s}")
        for r in rows:
            line = (f"{r['part']:10s} {r['members']:7d} {r['bytes']:9d} {r['collective_s'] * 1e6:10.1f} "
                    f"{r['p2p_s'] * 1e6:10.1f} {r['collective_s'] / r['p2p_s']:9.2f}x")
            if "program_s" in r:
                line += (f" {r['program_s'] * 1e6:10.1f} {r['eager_s'] * 1e6:10.1f} "
                         f"{r['program_s'] / r['p2p_s']:10.2f}x {r['eager_s'] / r['p2p_s']:8.2f}x")
            print(line)
        if args.json:
            write_json(args.json, rows, say=False)
    mc.finalize()


if __name__ == "__main__":
    main()
