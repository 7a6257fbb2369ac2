"""Collective Programs over torch (gloo) against torch.distributed's own calls.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/gloo_plan.py [--sizes 1K,4M] [--reps 7]

Over torch.distributed a collective Program runs its plan (point-to-point messages on the
Program's own tags): gloo's native collectives match by their order on one group that every
Program shares, so two Programs out of step could complete against each other
(runtime/native_call.py `choose`). Per op and size (each process's tile): torch's blocking call
on the default group (`all_reduce`, `all_gather_single`, `broadcast`) and the Program's
run, loops of 10 calls between barriers, median of `--reps`; ratio = torch time / Program time
(> 1: the Program is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def size_of(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
    return int(s.rstrip("KM")) * mult


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1K,4M")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist
    import meshcomm as mc
    ctx = mc.init(backend="torch")
    n, r = ctx.world_size, ctx.rank
    mesh = mc.Mesh(np.arange(n), ("x",))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def timed(f):
        f()
        ts = []
        for _ in range(args.reps):
            dist.barrier()
            t = time.perf_counter()
            for _ in range(10):
                f()
            ts.append((time.perf_counter() - t) / 10)
        return statistics.median(ts)
    if r == 0:
        print(f"{n} processes, torch {torch.__version__} (gloo); ms per call; ratio = torch / Program")
    for size in [size_of(s) for s in args.sizes.split(",")]:
        e = size // 4
        x, t = np.ones(e, np.float32), torch.ones(e)
        out = torch.empty(e * n)
        direct = {"all_reduce": lambda: dist.all_reduce(t),
                  "all_gather": lambda: gather(out, t),
                  "broadcast": lambda: dist.broadcast(t, src=0)}
        for op, f in direct.items():
            prog = getattr(mc.Program, op)(mesh, "x", shape=(e,), dtype="float32")
            a, b = timed(f), timed(lambda: prog(x))
            if r == 0:
                print(f"{op:<11} {size:>9} B  torch {a * 1e3:8.2f}  Program {b * 1e3:8.2f}  ratio {a / b:5.2f}x",
                      flush=True)
    mc.finalize()


if __name__ == "__main__":
    main()
