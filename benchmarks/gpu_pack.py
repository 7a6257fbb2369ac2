"""Benchmark the CUDA pack / unpack kernels against a device-to-device copy of the same bytes,
and one end-to-end single-process reshard of a 1 GiB tensor on CUDA.

    python benchmarks/gpu_pack.py                       # full run, table on stdout
    python benchmarks/gpu_pack.py --json out.json       # also write every number as JSON
    python benchmarks/gpu_pack.py --quick               # smaller sizes, fewer repeats

Part 1, rows from 64 B to 64 KiB: a tile of R rows x 2L bytes (float32); the message is one
L-byte run per row (half of each row, so the reads are strided), split into `boxes` boxes that
alternate between the two halves, all packed in one launch. Each op is timed with CUDA events
(median of --repeats after --warmup), the device kept busy by a short sleep kernel before each
timed op so host launch overhead stays out of the device time, rotating among --sets buffer sets
so no op reads what the previous one left in L2. Reported: message bytes / time (GB/s, 1e9) and
the ratio to `copy`, a contiguous device-to-device copy of the same number of bytes (torch
copy_, i.e. cudaMemcpyAsync). `slicing` is the torch-slicing path (one copy per box) for
comparison. unpack-add (float32) reads two bytes per byte written; its ratio is still against
the same copy.

Part 2: a float32 tensor of 1 GiB, resharded in one process between two layouts on 8 devices
that all live on this GPU: `meshcomm.reshard` (the local backend: one strided copy per piece),
a Program of the same reshard, the packed message path (meshcomm.cuda.executor: pack kernel,
unpack kernel), torch's own copies of the same boxes into preallocated tiles (the hand-written
baseline: `out[d][box].copy_(tile[box])` for every piece, the slices worked out beforehand)
and a 1 GiB device-to-device copy; wall-clock time per reshard including host work (median of
repeats).

Part 3: host overhead per call of a small reshard (64 x 64 float32 on the same 8 devices): the
mean host time to issue one call, over a loop of --calls calls that the GPU keeps up with, for
a Program, `meshcomm.reshard`, the packed path and the hand-written torch copies.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np


def _need_cuda():
    import torch
    if not torch.cuda.is_available():
        sys.exit("gpu_pack.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    from meshcomm import cuda
    if not cuda.available():
        sys.exit("gpu_pack.py needs CuPy for the kernels (pip install cupy-cuda12x or cupy-cuda13x)")
    return torch


def device_time(torch, fn, n_sets, repeats, warmup, busy_cycles):
    """Median device seconds of fn(i) over `repeats`, cycling i over buffer sets."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    pairs = []
    for i in range(repeats):
        torch.cuda._sleep(busy_cycles)          # keeps the GPU busy while the host queues fn
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i % n_sets)
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def wall_time(torch, fn, repeats, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def row_boxes(rows: int, row_elems: int, boxes: int):
    """`boxes` boxes over the rows, alternating between the left and right half of each row."""
    edges = np.linspace(0, rows, boxes + 1).astype(int)
    out = []
    for i in range(boxes):
        c0 = 0 if i % 2 == 0 else row_elems
        out.append((slice(int(edges[i]), int(edges[i + 1])), slice(c0, c0 + row_elems)))
    return out


def bench_rows(torch, args):
    from meshcomm.backends import pack as P
    from meshcomm.cuda import kernels, pack_cuda, unpack_cuda
    gb = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    results = []
    total = args.total_mib << 20
    rows_list = [64 << k for k in range(11)]          # 64 B .. 64 KiB
    for row_bytes in rows_list:
        if args.quick and row_bytes not in (64, 512, 4096, 65536):
            continue
        row_elems = row_bytes // 4
        rows = max(1, total // row_bytes)
        nbytes = rows * row_bytes
        sets = []
        for _ in range(args.sets):
            tile = torch.randn(rows, 2 * row_elems, device="cuda")
            sets.append(dict(tile=tile, buf=torch.empty(rows * row_elems, device="cuda"),
                             dst=torch.empty_like(tile), a=torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
                             b=torch.empty(nbytes, dtype=torch.uint8, device="cuda")))
        t_copy = device_time(torch, lambda i: sets[i]["b"].copy_(sets[i]["a"]), args.sets, args.repeats,
                             args.warmup, args.busy_cycles)
        for boxes in args.boxes:
            if boxes > rows:
                continue
            sl = row_boxes(rows, row_elems, boxes)
            # correctness of this exact configuration before timing it
            s0 = sets[0]
            pack_cuda(s0["tile"], sl, out=s0["buf"])
            ref = torch.cat([s0["tile"][x].reshape(-1) for x in sl])
            assert torch.equal(s0["buf"], ref), (row_bytes, boxes)
            rec = dict(row_bytes=row_bytes, boxes=boxes, rows=rows, message_bytes=nbytes, copy_s=t_copy)
            for g in [None] + list(args.groups or []):
                key = "pack_s" if g is None else f"pack_g{g}_s"
                rec[key] = device_time(
                    torch, lambda i: pack_cuda(sets[i]["tile"], sl, out=sets[i]["buf"], group=g),
                    args.sets, args.repeats, args.warmup, args.busy_cycles)
            rec["unpack_s"] = device_time(
                torch, lambda i: unpack_cuda(sets[i]["buf"], sets[i]["dst"], sl),
                args.sets, args.repeats, args.warmup, args.busy_cycles)
            rec["unpack_add_s"] = device_time(
                torch, lambda i: unpack_cuda(sets[i]["buf"], sets[i]["dst"], sl, accumulate=True),
                args.sets, args.repeats, args.warmup, args.busy_cycles)
            kernels.ENABLED = False                              # the torch-slicing path
            try:
                rec["slicing_pack_s"] = device_time(
                    torch, lambda i: P.pack(sets[i]["tile"], sl, out=sets[i]["buf"]),
                    args.sets, max(5, args.repeats // 4), 2, args.busy_cycles)
            finally:
                kernels.ENABLED = True
            for k in [k for k in rec if k.endswith("_s")]:
                rec[k.replace("_s", "_GBps")] = gb(nbytes, rec[k])
            rec["pack_vs_copy"] = t_copy / rec["pack_s"]
            rec["unpack_vs_copy"] = t_copy / rec["unpack_s"]
            rec["unpack_add_vs_copy"] = t_copy / rec["unpack_add_s"]
            results.append(rec)
            print(f"{row_bytes:>7} {boxes:>5} {nbytes / 2**20:>7.0f} {rec['copy_GBps']:>8.0f} "
                  f"{rec['pack_GBps']:>8.0f} {rec['pack_vs_copy']:>6.2f} {rec['unpack_GBps']:>8.0f} "
                  f"{rec['unpack_vs_copy']:>6.2f} {rec['unpack_add_GBps']:>8.0f} {rec['unpack_add_vs_copy']:>6.2f} "
                  f"{rec['slicing_pack_GBps']:>8.0f}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return results


def layouts():
    import meshcomm as mc
    src = mc.Layout(mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y")), ("x", "y"))
    dst = mc.Layout(mc.Mesh([[10, 11], [12, 13], [14, 15], [16, 17]], ("a", "b")), (None, ("a", "b")))
    return src, dst


def hand_copies(torch, p, shards):
    """torch's own copies of the plan's boxes: preallocated dst tiles, slices worked out once;
    returns run() -> {dst device: tile}."""
    from meshcomm.planners.boxes import local_slices
    st, dt = p.src.tiles(p.shape), p.dst.tiles(p.shape)
    like = next(iter(shards.values()))
    out = {d: torch.empty(tuple(b - a for a, b in box), dtype=like.dtype, device=like.device)
           for d, box in dt.boxes.items()}
    pieces = []
    for t in p.transfers:
        assert t.kind != "reduce"
        s = t.srcs[0]
        for b in t.boxes:
            for d in t.dsts:
                pieces.append((out[d][local_slices(b, dt.boxes[d])], shards[s][local_slices(b, st.boxes[s])]))

    def run():
        for o, i in pieces:
            o.copy_(i)
        return out
    return run


def bench_reshard(torch, args):
    import meshcomm as mc
    from meshcomm.cuda.executor import execute_packed
    n = 8192 if args.quick else 16384                       # 16384^2 float32 = 1 GiB
    shape = (n, n)
    src, dst = layouts()
    x = torch.randn(shape, device="cuda")
    shards = {d: t.contiguous() for d, t in mc.shard(x, src).items()}
    p = mc.plan(shape, torch.float32, src, dst)
    nbytes = x.numel() * 4
    out = mc.reshard(shards, src, dst)
    assert torch.equal(mc.unshard(out, dst), x)
    out2 = execute_packed(p, shards)
    assert torch.equal(mc.unshard(out2, dst), x)
    prog = mc.Program.reshard(src, dst, shape=shape, dtype=torch.float32)
    assert torch.equal(mc.unshard(prog(shards), dst), x)
    hand = hand_copies(torch, p, shards)
    assert torch.equal(mc.unshard(hand(), dst), x)
    del out, out2
    reps = 3 if args.quick else 10
    a = x.view(-1)
    b = torch.empty_like(a)
    methods = [("reshard", "meshcomm.reshard (local backend)", lambda: mc.reshard(shards, src, dst)),
               ("program", "Program of the same reshard", lambda: prog(shards)),
               ("packed", "packed path (pack+unpack kernels)", lambda: execute_packed(p, shards)),
               ("torch", "torch copies of the same boxes", hand),
               ("copy", "one device-to-device copy", lambda: b.copy_(a))]
    rec = dict(shape=shape, dtype="float32", bytes=nbytes, src=str(src), dst=str(dst), transfers=len(p.transfers),
               pieces=sum(len(t.boxes) * len(t.dsts) for t in p.transfers))
    for key, _, fn in methods:
        rec[f"{key}_s"] = wall_time(torch, fn, reps, 2)
        rec[f"{key}_GBps"] = nbytes / rec[f"{key}_s"] / 1e9
        # the GPU's time alone: the host queues the call behind a sleep kernel, so its own
        # work (one launch per piece) is off the clock
        rec[f"{key}_device_s"] = device_time(torch, lambda i, fn=fn: fn(), 1, reps, 2, 20 * args.busy_cycles)
    print(f"\nreshard {nbytes / 2**30:.2f} GiB float32 {shape}: {src}  ->  {dst}  ({len(p.transfers)} transfers, "
          f"{rec['pieces']} pieces); median of {reps}")
    for key, name, _ in methods:
        print(f"  {name:<36} {rec[key + '_s'] * 1e3:8.2f} ms  {rec[key + '_GBps']:7.0f} GB/s  "
              f"{rec['copy_s'] / rec[key + '_s']:5.2f}x copy   GPU alone {rec[key + '_device_s'] * 1e3:6.2f} ms "
              f"{rec['copy_device_s'] / rec[key + '_device_s']:5.2f}x")
    return rec


def bench_overhead(torch, args):
    """Host microseconds per call of a small reshard (Part 3)."""
    import meshcomm as mc
    from meshcomm.cuda.executor import execute_packed
    src, dst = layouts()
    shape = (64, 64)
    x = torch.randn(shape, device="cuda")
    shards = {d: t.contiguous() for d, t in mc.shard(x, src).items()}
    p = mc.plan(shape, torch.float32, src, dst)
    prog = mc.Program.reshard(src, dst, shape=shape, dtype=torch.float32)
    hand = hand_copies(torch, p, shards)
    methods = [("program", "Program", lambda: prog(shards)),
               ("reshard", "meshcomm.reshard", lambda: mc.reshard(shards, src, dst)),
               ("packed", "packed path", lambda: execute_packed(p, shards)),
               ("torch", "torch copies of the same boxes", hand)]
    rec = dict(shape=shape, pieces=sum(len(t.boxes) * len(t.dsts) for t in p.transfers), calls=args.calls)
    print(f"\nhost time per call, small reshard {shape} float32 ({rec['pieces']} pieces), "
          f"mean of {args.calls} calls, best of 5 loops")
    for key, name, fn in methods:
        assert torch.equal(mc.unshard(fn(), dst), x)
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / args.calls)
        torch.cuda.synchronize()
        rec[f"{key}_us"] = best * 1e6
        print(f"  {name:<32} {best * 1e6:8.1f} us")
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--total-mib", type=int, default=256, help="message size per op (MiB)")
    ap.add_argument("--boxes", type=int, nargs="+", default=[1, 64], help="boxes per message")
    ap.add_argument("--groups", type=int, nargs="*", help="also time these lane-group sizes (1..32)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sets", type=int, default=2, help="buffer sets to rotate through")
    ap.add_argument("--busy-cycles", type=int, default=2_000_000, help="sleep kernel before each timed op")
    ap.add_argument("--skip-reshard", action="store_true")
    ap.add_argument("--calls", type=int, default=2000, help="calls per loop of the host-overhead part")
    args = ap.parse_args(argv)
    if args.quick:
        args.total_mib = min(args.total_mib, 64)
        args.repeats = min(args.repeats, 15)
    torch = _need_cuda()
    import cupy
    props = torch.cuda.get_device_properties(0)
    env = dict(gpu=props.name, sms=props.multi_processor_count, memory_GiB=round(props.total_memory / 2**30, 1),
               torch=torch.__version__, cuda=torch.version.cuda, cupy=cupy.__version__,
               python=platform.python_version(), time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(f"# {env['gpu']} ({env['sms']} SMs, {env['memory_GiB']} GiB), torch {env['torch']} CUDA {env['cuda']}, "
          f"CuPy {env['cupy']}; median of {args.repeats}, GB/s = message bytes / device time")
    print(f"{'row_B':>7} {'boxes':>5} {'MiB':>7} {'copy':>8} {'pack':>8} {'ratio':>6} {'unpack':>8} "
          f"{'ratio':>6} {'add':>8} {'ratio':>6} {'slicing':>8}")
    rows = bench_rows(torch, args)
    reshard = None if args.skip_reshard else bench_reshard(torch, args)
    overhead = bench_overhead(torch, args)
    ok512 = [r["pack_vs_copy"] >= 0.8 and r["unpack_vs_copy"] >= 0.8 for r in rows if r["row_bytes"] >= 512]
    print(f"\npack and unpack at >= 80% of copy for rows >= 512 B: {sum(ok512)}/{len(ok512)} configurations")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=env, args=vars(args), rows=rows, reshard=reshard, overhead=overhead), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
