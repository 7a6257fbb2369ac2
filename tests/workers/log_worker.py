"""meshcomm.log under a launcher: NumPy reshards and all_to_all_v logged to DIR/calls, then
(optionally) the DLRM example with --log DIR/dlrm in the same processes.

    mpiexec -n 4 python tests/workers/log_worker.py DIR [--dlrm]

Calls: point-to-point, a broadcast to 3 ranks, ordered and collective (backends.base.
REDUCE_MODE = "collective", int32) reductions over 4 ranks, a reshard whose group leaves
rank 3 out (rank 3 still calls it: its Program's construction agrees over every process), an async reshard under nested tags, and
all_to_all_v with and without recv_counts, an all_reduce and an all_gather on mesh axes.
tests/test_log.py reads the files.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import numpy as np

import meshcomm as mc
from meshcomm.backends import base

ROOT = Path(__file__).resolve().parents[2]


def calls(rank: int, world: int) -> None:
    m = mc.Mesh(list(range(world)), ("x",))
    x = np.arange(64 * 24, dtype=np.float32).reshape(64, 24)
    cases = [
        (mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))),                        # all-to-all-like
        (mc.Layout(mc.Mesh([0], ("a",)), ()), mc.Layout(mc.Mesh([1], ("a",)), ())),   # one send
        (mc.Layout(mc.Mesh([0], ("a",)), ()), mc.Layout(mc.Mesh([1, 2, 3], ("a",)), ())),  # broadcast
        (mc.Layout(m, (), partial=("x",)), mc.Layout(m, ())),                       # ordered sum
        (mc.Layout(mc.Mesh([0, 1], ("a",)), ("a",)), mc.Layout(mc.Mesh([1, 2], ("a",)), (None, "a"))),
    ]
    for k, (src, dst) in enumerate(cases):
        with mc.log.tag(f"case{k}"):
            mc.reshard(mc.shard(x, src), src, dst)
    base.REDUCE_MODE = "collective"     # the backend's reduce (set alike everywhere, before the Program)
    xi = np.arange(64 * 24, dtype=np.int32).reshape(64, 24)
    src, dst = mc.Layout(m, (), partial=("x",)), mc.Layout(mc.Mesh([2], ("a",)), ())
    with mc.log.tag("int"):
        mc.reshard(mc.shard(xi, src), src, dst)
    base.REDUCE_MODE = "auto"
    with mc.log.tag("outer"), mc.log.tag("inner"):
        h = mc.reshard(mc.shard(x, cases[0][0]), cases[0][0], cases[0][1], async_op=True)
    h.wait()
    grid = mc.Mesh(np.arange(world).reshape(2, world // 2), ("x", "y"))
    with mc.log.tag("coll"):
        mc.all_reduce(np.ones((6, 5), np.float32), grid, "y")
        mc.all_gather(np.ones((3, 5), np.float32), grid, "x", dim=0)
    with mc.log.tag("p2p"):
        if rank == 0:
            mc.send(np.arange(6, dtype=np.float32), 1)
        elif rank == 1:
            mc.recv(0, ((6,), "float32"))
    counts = [(rank + j) % 3 for j in range(world)]
    rows = np.full((sum(counts), 5), rank, dtype=np.float64)
    with mc.log.tag("a2a"):
        y = mc.all_to_all_v(rows, counts, m, "x")
        recv = [(i + rank) % 3 for i in range(world)]
        mc.all_to_all_v(y, recv, m, "x", recv_counts=counts)


def main():
    out = Path(sys.argv[1])
    ctx = mc.init(backend="mpi")
    mc.log.start(out / "calls")
    calls(ctx.rank, ctx.world_size)
    mc.log.stop()
    if "--dlrm" in sys.argv:
        sys.argv = [str(ROOT / "examples" / "dlrm.py"), "--steps", "2", "--log", str(out / "dlrm")]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            print(f"DLRM EXIT {ctx.rank} {e.code}", flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
