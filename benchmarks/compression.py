"""Compressed all-gather and reduce-scatter: against uncompressed and point-to-point compression, the crossover link speed, and the error.

    mpiexec -n 8 .venv/bin/python benchmarks/compression.py sizes      [--sizes 4M,16M,64M] [--rates 8,16]
    mpiexec -n 8 .venv/bin/python benchmarks/compression.py crossover  [--size 4M] [--rate 8]
                                                                       [--gbps 0.01,0.02,...,10]
    .venv/bin/python benchmarks/compression.py error                   (one process)

Every figure uses 8 processes of one host by default, one device each, float32 tiles, the
group being the whole world (nccl-tests' sizes: the gathered output of all_gather, the input
of reduce_scatter). The link is emulated (MESHCOMM_EMULATE_GBPS: every process sends at most
g Gb/s to the others; backends/pacing.py); the uncompressed baseline runs as its plan
(`meshcomm.runtime.native_call.MODE = "plan"`, so every message is paced). Every
implementation is a Program (`mc.Program.all_gather` / `reduce_scatter`), constructed once per
op, size, implementation and link speed, with the link's setting in place (construction
resolves the codec and the reduce algorithm), and run under the same emulated link.
Implementations, interleaved in every round (same machine load): `none`, `zfp(rate=r)`
(compressed: each chunk coded once, pipelined; reduce-scatter one-shot or ring as the cost
model picks) and `per-hop` (`meshcomm.backends.codec_cost.PER_HOP = True` while its Program
is constructed: whole messages decoded and re-encoded at every hop, the point-to-point
compression baseline). Time: median over rounds of the slowest rank.

* sizes: the table at g = (one process's ZFP rate-8 encode throughput, measured first with
  every process coding at once) / 8, and without emulation; the cost model's times beside.
* crossover: speedup of zfp(rate=r) over none at each g; the measured crossover (log-linear
  between the two points around speedup 1) and the model's (bisection on g), for all_gather
  and reduce_scatter.
* error: max and mean error, absolute and relative to max|x|, of each codec on standard
  normal tiles and on the tensors of a small GPT (examples/fsdp.py's, after a few Adam
  steps: weights, gradients), for a single round trip and for an 8-way reduce-scatter (both
  algorithms) computed in one process.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import meshcomm as mc
from meshcomm.tools.common import progress

GBPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def parse_size(s: str) -> int:
    s = s.strip().upper()
    return int(float(s.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1))


def label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


class Bench:
    """This rank's tiles, the timed calls, and the cost model of the same calls."""

    def __init__(self, ctx, reps: int):
        from meshcomm.tools.codec_tune import measure_codecs
        self.ctx, self.reps = ctx, reps
        self.rank, self.n = ctx.rank, ctx.world_size
        self.mesh = mc.Mesh(list(range(self.n)), ("x",))
        self.comm = ctx.get_backend("mpi").comm
        self.measure_codecs = measure_codecs
        self.speeds = {}
        self.programs = {}
        from meshcomm.runtime import native_call
        native_call.MODE = "plan"           # every message through the paced executor (every process)

    def sample(self, codec: str, seconds: float = 0.2) -> None:
        """Measure (encode, decode) bytes/s of one process while all code at once, now."""
        e = self.measure_codecs(self.ctx.get_backend("mpi"), [mc.compression.coerce(codec)], seconds=seconds)[0]
        self.speeds.setdefault(codec, []).append((e["encode_GBps"] * 1e9, e["decode_GBps"] * 1e9))

    def codec_speed(self, codec: str) -> tuple[float, float]:
        """The median of the samples so far (the machine's load drifts: every round takes one)."""
        if codec not in self.speeds:
            self.sample(codec, 0.5)
        s = self.speeds[codec]
        return statistics.median(e for e, _ in s), statistics.median(d for _, d in s)

    def tile(self, op: str, size: int) -> np.ndarray:
        elems = size // 4 // self.n if op == "all_gather" else size // 4 // self.n * self.n
        return np.random.default_rng(self.rank).standard_normal(elems).astype(np.float32)

    def program(self, op: str, x, impl: str, gbps):
        """The Program of `impl` ("none", a codec, or "per-hop:" + codec) for `op` on a link of
        `gbps` (None: not emulated), constructed on first use by every process alike, with
        the link and PER_HOP set as it runs (construction resolves the codec's algorithm)."""
        from meshcomm.backends import codec_cost
        key = (op, x.shape, impl, gbps)
        prog = self.programs.get(key)
        if prog is None:
            codec = None if impl == "none" else impl.split(":")[-1]
            ctor = mc.Program.all_gather if op == "all_gather" else mc.Program.reduce_scatter
            codec_cost.PER_HOP = impl.startswith("per-hop:")
            try:
                with _link(gbps):
                    prog = self.programs[key] = ctor(self.mesh, "x", shape=x.shape, dtype=x.dtype, compression=codec)
            finally:
                codec_cost.PER_HOP = False
        return prog

    def call(self, op: str, x, impl: str, gbps):
        """One timed run (seconds of the slowest rank) of `impl` on a link of `gbps`."""
        from meshcomm.tools.spmd import time_once
        prog = self.program(op, x, impl, gbps)
        with _link(gbps):
            t, _ = time_once(self.comm, lambda: prog(x))
        return t

    def warm(self, op: str, size: int, impls, gbps) -> None:
        """Construct the Programs (plan, codec and reduce algorithm) before timing, as a
        training loop's second step finds them constructed."""
        x = self.tile(op, size)
        for i in impls:
            self.program(op, x, i, gbps)

    def times(self, op: str, size: int, impls, gbps, reps=None) -> dict:
        x = self.tile(op, size)
        self.warm(op, size, impls, gbps)
        out = {i: [] for i in impls}
        for _ in range(reps or self.reps):
            for c in {i.split(":")[-1] for i in impls if i != "none"}:
                self.sample(c)
            for i in impls:
                out[i].append(self.call(op, x, i, gbps))
        return {i: statistics.median(ts) for i, ts in out.items()}

    # -- the cost model of the same calls ------------------------------------------------
    def plan(self, op: str, size: int):
        from meshcomm.collectives import collective_plan
        elems = size // 4 // self.n if op == "all_gather" else size // 4 // self.n * self.n
        return collective_plan(op, (elems,), "float32", self.mesh, "x")

    def model(self, op: str, size: int, impl: str, gbps) -> float:
        from meshcomm.backends.codec_cost import LOCAL_GBPS, choose_reduce
        from meshcomm.planners.compressed import CodecCost, Compression
        p = self.plan(op, size)
        topo = mc.Topology(1, intra_node_gbps=LOCAL_GBPS, inter_node_gbps=gbps or LOCAL_GBPS,
                           intra_node_latency_s=5e-6, inter_node_latency_s=20e-6)
        if impl == "none":
            return p.simulate(topo)
        codec = mc.compression.coerce(impl.split(":")[-1])
        comp = Compression(codec, per_hop=impl.startswith("per-hop:"), chunk_bytes=mc.settings.get("COMPRESSION_CHUNK"))
        with _link(gbps):
            comp = choose_reduce(p, comp, topo, self.n)
        enc, dec = self.codec_speed(str(codec))
        return p.simulate(topo, compression=CodecCost(comp, enc, dec))


class _link:
    """MESHCOMM_EMULATE_GBPS set to `gbps` (None: unset) inside the block, then as before."""

    def __init__(self, gbps):
        self.gbps = gbps

    def __enter__(self):
        self.old = os.environ.get("MESHCOMM_EMULATE_GBPS")
        os.environ["MESHCOMM_EMULATE_GBPS"] = str(self.gbps) if self.gbps else ""

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("MESHCOMM_EMULATE_GBPS", None)
        else:
            os.environ["MESHCOMM_EMULATE_GBPS"] = self.old


def cmd_sizes(a, b: Bench) -> dict:
    rates = [int(r) for r in a.rates.split(",")]
    enc8, _ = b.codec_speed("zfp(rate=8)")
    g_codec = round(enc8 * 8 / 1e9 / 8, 4)                 # Gb/s: 8x slower than one process's encode
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    impls = ["none"] + [f"zfp(rate={r})" for r in rates] + [f"per-hop:zfp(rate={r})" for r in rates]
    rows = []
    cases = [(op, s, g) for g in (g_codec, None) for s in sizes for op in ("all_gather", "reduce_scatter")]
    bar = progress(total=len(cases), disable=b.rank != 0, desc="sizes", file=sys.stderr)
    for op, s, g in cases:
        bar.set_postfix_str(f"{op} {label(s)} {g or 'native'}", refresh=False)
        t = b.times(op, s, impls, g, reps=1 if s >= 64 << 20 else None)
        rows.append({"op": op, "bytes": s, "gbps": g, "measured": t})
        bar.update(1)
    bar.close()
    for r in rows:                              # the model, with the codec speed of the whole run
        r["model"] = {i: b.model(r["op"], r["bytes"], i, r["gbps"]) for i in impls}
    if b.rank == 0:
        print(f"# {b.n} processes; link {g_codec} Gb/s = (ZFP rate-8 encode {enc8 / 1e9:.3f} GB/s per process, "
              "all coding) / 8, then not emulated; seconds (model); speedups of zfp over none and over per-hop")
        for r in rows:
            t, m = r["measured"], r["model"]
            line = f"{r['op']:<15s} {label(r['bytes']):>4s} {r['gbps'] or 'native'!s:>7s} | none {t['none']:7.3f} ({m['none']:6.3f})"
            for rate in rates:
                z, h = t[f"zfp(rate={rate})"], t[f"per-hop:zfp(rate={rate})"]
                line += (f" | r{rate} {z:7.3f} ({m[f'zfp(rate={rate})']:6.3f}) per-hop {h:7.3f} "
                         f"({m[f'per-hop:zfp(rate={rate})']:6.3f}) x{t['none'] / z:5.2f} x{h / z:5.2f}")
            print(line, flush=True)
    return {"gbps_codec": g_codec, "encode_GBps": enc8 / 1e9, "rows": rows}


def _crossing(xs, ys) -> float | None:
    """The x where y crosses 1 going up in x (y = speedup falls with x), log-linear."""
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if (y0 - 1) * (y1 - 1) <= 0 and y0 != y1:
            f = math.log(y0) / (math.log(y0) - math.log(y1))
            return math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
    return None


def cmd_crossover(a, b: Bench) -> dict:
    gs = [float(g) for g in a.gbps.split(",")]
    size, codec = parse_size(a.size), f"zfp(rate={a.rate})"
    b.codec_speed(codec)
    out = {}
    bar = progress(total=2 * len(gs), disable=b.rank != 0, desc="crossover", file=sys.stderr)
    for op in ("all_gather", "reduce_scatter"):
        speed, secs = [], []
        for g in gs:
            bar.set_postfix_str(f"{op} {g} Gb/s", refresh=False)
            t = b.times(op, size, ["none", codec], g)
            secs.append(t)
            speed.append(t["none"] / t[codec])
            bar.update(1)
        out[op] = {"gbps": gs, "seconds": secs, "speedup": speed}
    bar.close()
    for op, r in out.items():                   # the model, with the codec speed of the whole run
        model = [b.model(op, size, "none", g) / b.model(op, size, codec, g) for g in gs]
        lo, hi = 1e-4, 1e3                     # the model's crossover by bisection on log g
        def f(g, op=op):
            return b.model(op, size, "none", g) / b.model(op, size, codec, g) - 1
        xm = None
        if f(lo) > 0 > f(hi):
            for _ in range(40):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
            xm = math.sqrt(lo * hi)
        r.update(model_speedup=model, crossover=_crossing(gs, r["speedup"]), model_crossover=xm)
    if b.rank == 0:
        enc, dec = b.codec_speed(codec)
        print(f"# {b.n} processes, {label(size)}, {codec}: speedup over none (model); codec {enc / 1e9:.3f}/"
              f"{dec / 1e9:.3f} GB/s encode/decode per process, all coding")
        print("Gb/s          " + " ".join(f"{g:>11g}" for g in gs))
        for op, r in out.items():
            print(f"{op:<14s}" + " ".join(f"{s:5.2f}({m:4.2f})" for s, m in zip(r["speedup"], r["model_speedup"])))
            c, m = r["crossover"], r["model_crossover"]
            err = f"{abs(m - c) / c:.0%}" if c and m else "n/a"
            print(f"  crossover: measured {c and round(c, 3)} Gb/s, model {m and round(m, 3)} Gb/s (off by {err})",
                  flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("figure", choices=("sizes", "crossover", "error"))
    ap.add_argument("--sizes", default="4M,16M,64M")
    ap.add_argument("--rates", default="8,16")
    ap.add_argument("--size", default="4M")
    ap.add_argument("--rate", type=int, default=8)
    ap.add_argument("--gbps", default=",".join(str(g) for g in GBPS))
    ap.add_argument("--reps", type=int, default=3, help="rounds per point (sizes: 64 MiB and up 1)")
    ap.add_argument("--json", default="", help="write the figure's numbers here (rank 0)")
    a = ap.parse_args()
    if a.figure == "error":
        from compression_error import run as error_run
        res = error_run()
        rank = 0
    else:
        ctx = mc.init(backend="mpi")
        b = Bench(ctx, a.reps)
        t0 = time.perf_counter()
        res = (cmd_sizes if a.figure == "sizes" else cmd_crossover)(a, b)
        rank = ctx.rank
        if rank == 0:
            print(f"# {time.perf_counter() - t0:.0f} s", flush=True)
        mc.finalize()
    if a.json and rank == 0:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
