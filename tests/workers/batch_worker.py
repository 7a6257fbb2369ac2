"""SPMD worker: random batches of tensors (random layouts, dtypes, pending sums, uneven and
Blocks splits; tests/workers/cases.py) through `mc.reshard_many` and `mc.Program.reshard_many`
on each backend, checked bitwise against the one-process reshard of every tensor.

    mpiexec -n 8 python tests/workers/batch_worker.py --init mixed --backends mpi,torch,mixed --batches 4

Prints `RESULT {json}` per rank; any failure raises (non-zero exit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import meshcomm as mc                              # noqa: E402
from cases import random_case, random_data, same  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mixed")
    ap.add_argument("--backends", default="mpi,torch,mixed")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--size", type=int, default=6, help="tensors per batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="a folder for one rank<r>.json per process")
    a = ap.parse_args()
    ctx = mc.init(backend=a.init)
    ndev = ctx.world_size * ctx.devices_per_process
    stats: Counter = Counter()
    for b in range(a.batches):
        rng = np.random.default_rng((a.seed, b))
        shapes, dtypes, src, dst, full, kinds = {}, {}, {}, {}, {}, {}
        for i in range(a.size):
            shape, s, d, dtype, kind = random_case(rng, ndev)
            if kind not in ("numpy", "torch"):
                kind = "numpy"
            name = f"t{b}_{i}"
            shapes[name], dtypes[name], src[name], dst[name] = shape, dtype, s, d
            full[name] = random_data(rng, shape, dtype, kind)
            kinds[name] = kind
        shards = {n: mc.shard(full[n], src[n], seed=i) for i, n in enumerate(shapes)}
        ref = {n: mc.reshard(shards[n], src[n], dst[n], backend="local") for n in shapes}
        xs = {n: {d: v for d, v in shards[n].items() if d in ctx.owned_devices(src[n])} for n in shapes}
        xs = {n: t for n, t in xs.items() if t}         # a name is left out where this process owns none
        for be in a.backends.split(","):
            for form in ("eager", "program", "eager"):
                if form == "eager":
                    ys = mc.reshard_many(xs, src, dst, shapes=shapes, dtypes=dtypes, backend=be)
                else:
                    # a process without tiles returns the kind the dtype names: torch dtypes for
                    # torch tensors (as Program.reshard takes them)
                    import torch
                    tdt = {n: (getattr(torch, dtypes[n]) if kinds[n] == "torch" else dtypes[n]) for n in shapes}
                    prog = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes=tdt, backend=be)
                    ys = prog(xs)
                assert sorted(ys) == sorted(shapes), (sorted(ys), sorted(shapes))
                for n in shapes:
                    own = ctx.owned_devices(dst[n])
                    assert sorted(ys[n]) == sorted(own), (n, sorted(ys[n]), own)
                    for d in own:
                        if not same(ys[n][d], ref[n][d]):
                            raise AssertionError(f"batch {b} [{be} {form}] tensor {n} {shapes[n]} {dtypes[n]} "
                                                 f"{src[n]} -> {dst[n]}: rank {ctx.rank} device {d} differs")
                stats[f"ok_{be}_{form}"] += 1
    line = json.dumps({"rank": ctx.rank, **stats})
    print("RESULT " + line, flush=True)
    if a.out:
        with open(os.path.join(a.out, f"rank{ctx.rank}.json"), "w") as f:
            f.write(line)
    mc.finalize()


if __name__ == "__main__":
    main()
