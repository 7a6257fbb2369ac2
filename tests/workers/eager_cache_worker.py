"""Random eager calls (seeded: the same sequence on every process) over random groups of the
processes, each process passing its own tiles: all_reduce, all_gather, broadcast (non-roots
with tiles or None), reshard; shapes, dtypes and backends drawn per call; Programs kept per
group few (eager.EAGER_MAX lowered alike everywhere), so signatures are dropped and
constructed again all the time. Every result must be exact and nothing may raise: each
process decides alone which Program a call runs, and a group's members must decide alike
whatever else each of them ran.

    mpiexec -n 4 python -m mpi4py tests/workers/eager_cache_worker.py --seeds 1,2 --steps 300
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import zlib

import numpy as np

import meshcomm as mc
from meshcomm.runtime import eager


def run(seed: int, steps: int, backends, stats) -> None:
    ctx = mc.runtime.current()
    n, me = ctx.world_size, ctx.rank
    rng = random.Random(seed)
    groups = [g for k in range(2, n + 1) for g in itertools.combinations(range(n), k)]
    for step in range(steps):
        g, ax = rng.choice(groups), rng.choice("abcde")
        mesh, inside = mc.Mesh(list(g), (ax,)), me in g
        op, be = rng.choice(["all_reduce", "all_gather", "broadcast", "broadcast_none", "reshard"]), rng.choice(backends)
        ln, dt = rng.choice([1, 2, 3, 5]), rng.choice([np.float32, np.int32])
        mine = np.full(ln, me + step, dt) if inside else None
        if op == "all_reduce":
            y, want = mc.all_reduce(mine, mesh, ax, backend=be), np.full(ln, sum(r + step for r in g), dt)
        elif op == "all_gather":
            y, want = mc.all_gather(mine, mesh, ax, backend=be), np.concatenate([np.full(ln, r + step, dt) for r in g])
        elif op.startswith("broadcast"):
            root = rng.randrange(len(g))
            # a root's tile keeps its shape and dtype per signature: where the others pass None
            # and it changes them, every process raises (docs/runtime.md, "not in the same call")
            key = zlib.crc32(repr((g, ax, root, be)).encode())
            ln, dt = 1 + key % 4, (np.float32, np.int32)[key % 2]
            passes = inside and (op == "broadcast" or g[root] == me)
            x = np.full(ln, me + step, dt) if passes else None
            y, want = mc.broadcast(x, mesh, ax, root=root, backend=be), np.full(ln, g[root] + step, dt)
        else:
            src, dst = mc.Layout(mesh, (ax,)), mc.Layout(mesh, (None,))
            want = np.arange(len(g) * ln, dtype=dt) + step
            x = {d: t for d, t in mc.shard(want, src).items() if d == me} if inside else {}
            y = mc.reshard(x, src, dst, backend=be)
            y = y.get(me) if inside else None
        if inside:
            assert y is not None and y.dtype == want.dtype and np.array_equal(y, want), (me, seed, step, op, g, y, want)
            stats["exact"] += 1
        else:
            assert not y, (me, seed, step, op, y)
        stats["calls"] += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--init", default="mpi")
    ap.add_argument("--backends", default="mpi")
    ap.add_argument("--keep", type=int, default=3, help="eager.EAGER_MAX: signatures kept per group")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ctx = mc.init(backend=args.init)
    eager.EAGER_MAX = args.keep       # the same on every process, before any call
    stats = {"exact": 0, "calls": 0}
    for s in args.seeds.split(","):
        run(int(s), args.steps, args.backends.split(","), stats)
    stats["kept"] = len(ctx.eager)
    result = {"rank": ctx.rank, **stats}
    mc.finalize()
    if args.out:
        with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
            f.write(json.dumps(result))


if __name__ == "__main__":
    main()
