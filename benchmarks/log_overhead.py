"""What meshcomm.log costs: a 1 MiB reshard at 8 processes with the log on and off.

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/log_overhead.py [--reps 30] [--rounds 8] [--json FILE]

A float32 (512, 512) tensor goes from rows split over 8 devices to columns split over them
(every rank sends 1/64 of the tensor to each other rank). With the log open, calls
alternate on and off in pairs (on, off / off, on) by setting `meshcomm.log.ON`, the one
switch every call checks; each call is timed alone (the slowest rank's time between polite
barriers, meshcomm.tools.spmd). Figures: the ratio of the medians of the --rounds x --reps
calls of each mode, and the median of the per-pair ratios. Beside them, the logging work
alone (stamp and record of one such reshard, its share of the JSON writes included), timed
without communication, as a share of the call's time.
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

import meshcomm as mc
from meshcomm import log
from meshcomm.tools.common import script_parser, write_json
from meshcomm.tools.spmd import time_once, time_repeats


def logging_work(p, shards, out, d, n=2000) -> float:
    """Seconds of stamp + record_reshard for one call, writes included (every rank: starting
    the log is collective)."""
    ctx = mc.runtime.current()
    log.start(d)
    t = time.perf_counter()
    for _ in range(n):
        st = log.stamp()
        log.record_reshard(st, rank=ctx.rank, dpp=1, backend="mpi", plan=p, collective_reduce=False,
                           shards=shards, out=out, t_run=st[0])
    t = (time.perf_counter() - t) / n
    log.stop()
    return t


def main(argv=None):
    ap = script_parser(__doc__, reps=30)
    ap.add_argument("--rounds", type=int, default=8, help="rounds of --reps on/off pairs (default 8)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    me, n = comm.rank, comm.size
    mc.init(backend="mpi")
    mesh = mc.Mesh(list(range(n)), ("x",))
    src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mesh, (None, "x"))
    g = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    x = {me: mc.shard(g, src)[me]}

    def call():
        return mc.reshard(x, src, dst)
    d = tempfile.mkdtemp() if me == 0 else None
    d = comm.bcast(d, root=0)
    time_repeats(comm, call, 5, 5)                  # warm: plan, groups, caches
    on, off = [], []
    log.start(d)                                    # collective: clock offset with rank 0
    for k in range(args.rounds * args.reps):
        for mode in ((True, False) if k % 2 == 0 else (False, True)):
            log.ON = mode                           # the one switch every call checks
            t, y = time_once(comm, call)
            (on if mode else off).append(t)
    log.stop()
    ratios = [a / b for a, b in zip(on, off)]
    work = logging_work(mc.plan(g.shape, g.dtype, src, dst), x, y, d)
    if me == 0:
        shutil.rmtree(d, ignore_errors=True)
        t_off = statistics.median(off)
        row = {"procs": n, "bytes": g.nbytes, "calls_per_mode": len(on),
               "median_off_s": t_off, "median_on_s": statistics.median(on),
               "ratio_of_medians": statistics.median(on) / t_off, "median_pair_ratio": statistics.median(ratios),
               "log_work_s": work, "log_work_share": work / t_off}
        print(f"1 MiB reshard, {n} processes, {len(on)} calls with the log on, {len(off)} off (interleaved)")
        print(f"  log off: {row['median_off_s'] * 1e3:.3f} ms   log on: {row['median_on_s'] * 1e3:.3f} ms   "
              f"on/off: {row['ratio_of_medians']:.4f} (median of pair ratios {row['median_pair_ratio']:.4f})")
        print(f"  logging work per call: {work * 1e6:.1f} us = {row['log_work_share']:.2%} of the call")
        if args.json:
            write_json(args.json, row)
    mc.finalize()


if __name__ == "__main__":
    main()
