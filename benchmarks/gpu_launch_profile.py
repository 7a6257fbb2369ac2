"""Where the host time of one kernel launch goes (a CUDA GPU and CuPy needed):

    python benchmarks/gpu_launch_profile.py [--calls 2000]

Times `pack_cuda` of one 1 MiB box (what the local backend's `copy_box` launches per large
piece) and torch's `copy_` of the same box, host microseconds per call (the GPU keeps up), then
prints cProfile's top functions for the pack launches.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    import torch

    from meshcomm.cuda import kernels
    src = torch.randn(1024, 512, device="cuda")          # 2 MiB; the box is half of each row
    dst = torch.empty(1024, 256, device="cuda")
    box = (slice(0, 1024), slice(128, 384))
    out = dst.view(-1)

    def pack():
        kernels.pack_cuda(src, [box], out=out)

    def copy():
        dst.copy_(src[box])

    def piece():
        kernels.copy_box(dst, (slice(0, 1024), slice(0, 256)), src, box)
    for name, fn in [("pack_cuda", pack), ("copy_box", piece), ("torch copy_", copy)]:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.calls)
            torch.cuda.synchronize()
        print(f"{name:<12} {best * 1e6:7.1f} us per call (host, best of 5 loops of {args.calls})")
    assert torch.equal(dst, src[box])
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        pack()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
