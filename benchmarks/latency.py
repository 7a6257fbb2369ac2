"""Small messages: one reshard between two processes beside a bare MPI message.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/latency.py [--reps 300] [--json FILE]

A float32 vector held whole by device 0 (rank 0) goes whole to device 1 (rank 1): the plan
is one send. Methods: `MPI Send/Recv` (blocking mpi4py calls: the floor), `Isend/Irecv
polled` (what meshcomm's executor does, without meshcomm), `Program` (a run of
`mc.Program.reshard(src, dst, shape=, dtype=)`, constructed once per size before the timed
calls: the run validates its input locally, posts, waits) and `eager reshard`
(`mc.reshard(..., shape=, dtype=)`: its cached Program, found by the call's arguments).
Per repeat the slower rank's time; median of --reps after warm-up. The gap between
`Program` and `Isend/Irecv polled` is meshcomm's per-run overhead (input validation, the
executor, the control channel's polls); eager adds the lookup of its Program.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

import meshcomm as mc
from meshcomm.tools.common import script_parser, write_json
from meshcomm.tools.spmd import time_repeats


def main(argv=None):
    args = script_parser(__doc__, reps=300).parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit("run with mpiexec -n 2")
    me = comm.rank
    mc.init(backend="mpi")
    src = mc.Layout(mc.Mesh([[0]], ("x", "y")), (None,))
    dst = mc.Layout(mc.Mesh([[1]], ("x", "y")), (None,))
    rows = []
    for nbytes in (4, 64, 1024, 16384, 262144, 1 << 20):
        n = nbytes // 4
        buf = np.arange(n, dtype=np.float32)
        x = {0: buf} if me == 0 else {}

        def blocking():
            if me == 0:
                comm.Send(buf, dest=1, tag=9)
            else:
                comm.Recv(buf, source=0, tag=9)

        def polled():
            req = comm.Isend(buf, dest=1, tag=9) if me == 0 else comm.Irecv(buf, source=0, tag=9)
            while not req.Test():
                os.sched_yield()

        def reshard():
            return mc.reshard(x, src, dst, shape=(n,), dtype="float32", backend="mpi")
        prog = mc.Program.reshard(src, dst, shape=(n,), dtype="float32", backend="mpi")    # once
        t = {}
        t["MPI Send/Recv"], _ = time_repeats(comm, blocking, args.reps, 20)
        t["Isend/Irecv polled"], _ = time_repeats(comm, polled, args.reps, 20)
        t["Program"], y = time_repeats(comm, lambda: prog(x), args.reps, 20)
        t["eager reshard"], y0 = time_repeats(comm, reshard, args.reps, 20)
        if me == 1:
            assert np.array_equal(y[1], np.arange(n, dtype=np.float32))
            assert np.array_equal(y0[1], np.arange(n, dtype=np.float32))
        rows.append({"bytes": nbytes, **{k: v for k, v in t.items()}})
    if me == 0:
        names = list(rows[0])[1:]
        print(f"one float32 vector, device 0 -> device 1, 2 processes, median of {args.reps} (us)")
        print(f"{'bytes':>8s} " + " ".join(f"{k:>19s}" for k in names) + "  Program / polled  eager / polled")
        for r in rows:
            print(f"{r['bytes']:8d} " + " ".join(f"{r[k] * 1e6:19.1f}" for k in names)
                  + f"  {r['Program'] / r['Isend/Irecv polled']:15.2f}x {r['eager reshard'] / r['Isend/Irecv polled']:14.2f}x")
        if args.json:
            write_json(args.json, rows, say=False)
    mc.finalize()


if __name__ == "__main__":
    main()
