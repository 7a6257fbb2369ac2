"""What reused memory saves a result tile (backends/buffers.py), one process.

    .venv/bin/python benchmarks/alloc_reuse.py [--reps 15] [--cases alpa1,alpa3,alpa7,same-allgather]

First four 4 MiB tiles written into fresh memory (np.empty each, as a result tile is
allocated; page faults on first touch unless malloc still holds pages freed before) beside
the same tiles in blocks of the pool; then one-process `meshcomm.reshard` of NumPy
tiles (cases of `meshcomm bench run`, ~16 MiB, 8 devices) with MESHCOMM_BUFFER_POOL_MB=0
beside the default, the forms taking turns in every round; medians in ms and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.backends import buffers  # noqa: E402
from meshcomm.tools.cases import global_array, run_cases  # noqa: E402


def _median_ms(ts) -> float:
    return statistics.median(ts) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--cases", default="alpa1,alpa3,alpa7,same-transpose,same-allgather")
    args = ap.parse_args()
    n = 4 << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    t = {"fresh": [], "pool": []}
    for _ in range(args.reps):
        for form in t:
            t0 = time.perf_counter()
            outs = [np.empty(n, np.uint8) if form == "fresh" else buffers.take(n, False) for _ in range(4)]
            for out in outs:
                np.copyto(out, src)
            t[form].append(time.perf_counter() - t0)
            del outs, out
            gc.collect()
    print(f"4 x 4 MiB written: fresh memory {_median_ms(t['fresh']):.2f} ms, reused {_median_ms(t['pool']):.2f} ms "
          f"({statistics.median(t['fresh']) / statistics.median(t['pool']):.2f}x)")
    names = args.cases.split(",")
    for i, case in enumerate(c for c in run_cases(8, 16.0) if c.name in names):
        g = global_array(case.shape, 1000 + i, case.dtype)
        sh = mc.shard(g, case.src)
        t = {"0": [], "default": []}
        for _ in range(args.reps):
            for form in t:
                if form == "0":
                    os.environ["MESHCOMM_BUFFER_POOL_MB"] = "0"
                t0 = time.perf_counter()
                y = mc.reshard(sh, case.src, case.dst)
                t[form].append(time.perf_counter() - t0)
                os.environ.pop("MESHCOMM_BUFFER_POOL_MB", None)
                del y
        print(f"{case.name:16s} fresh tiles {_median_ms(t['0']):6.2f} ms  pool {_median_ms(t['default']):6.2f} ms  "
              f"({statistics.median(t['0']) / statistics.median(t['default']):.2f}x)")


if __name__ == "__main__":
    main()
