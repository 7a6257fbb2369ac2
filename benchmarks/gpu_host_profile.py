"""Where the host time of one small CUDA reshard goes: microseconds per call of a Program,
of `meshcomm.reshard` and of torch's own copies of the same boxes (gpu_pack.py's Part 3 case,
(64, 64) float32, 16 pieces), then cProfile's top functions of the Program's calls.

    python benchmarks/gpu_host_profile.py [--device cuda|cpu] [--calls 2000]

Run it twice in one session with PYTHONPATH pointing at two checkouts to compare them on the
same machine (benchmarks/results/gpu/run6 did, for the runtime before and after Programs).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_pack import hand_copies, layouts  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import torch

    import meshcomm as mc
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    src, dst = layouts()
    shape = (64, 64)
    x = torch.randn(shape, device=args.device)
    shards = {d: t.contiguous() for d, t in mc.shard(x, src).items()}
    p = mc.plan(shape, torch.float32, src, dst)
    prog = mc.Program.reshard(src, dst, shape=shape, dtype=torch.float32)
    methods = [("Program", lambda: prog(shards)), ("meshcomm.reshard", lambda: mc.reshard(shards, src, dst)),
               ("torch copies of the same boxes", hand_copies(torch, p, shards))]
    print(f"meshcomm from {Path(mc.__file__).parent}; {args.device}; mean of {args.calls} calls, best of 5 loops")
    for name, fn in methods:
        assert torch.equal(mc.unshard(fn(), dst), x)
        best = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        sync()
        print(f"  {name:<32} {best * 1e6:8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        prog(shards)
    prof.disable()
    sync()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
