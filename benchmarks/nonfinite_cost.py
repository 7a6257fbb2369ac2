"""What the NaN/Inf handling of the codecs costs on finite data, relative to encode and decode.

    .venv/bin/python benchmarks/nonfinite_cost.py [--sizes 256K,16M] [--reps 15] [--json FILE]

One process, float32 (and float64 for ZFP) standard normal tiles, 1-d (a flat parameter
shard; 256 KiB is the default message of a compressed collective, MESHCOMM_COMPRESSION_CHUNK).
Per codec and size, interleaved in every repeat (same machine load), medians over repeats
(times), and medians over repeats of each repeat's ratio (ratios: the load drifts between
repeats, less within one):

* encode: `codec.encode(tile)` as the collectives call it (the check included);
* check: the check alone, as encode runs it (ZFP: `nonfinite.all_finite`, one sum over the
  tile; casts: `nonfinite.wire_finite`, two max reductions over the cast's 16-bit output);
* before: `codec.encode(tile)` without the NaN/Inf handling (ZFP: the check replaced by
  `True`; casts: the encode as it was, fp16's overflow check included);
* decode: `codec.decode(e, out=buf)`, and tail: `codec.tail_bytes(head, ...)`, what the
  receiver adds per unit (two bits of ZFP's block 0, or the cast's element 0).

Printed: check / encode (the figure the design aims to keep at a few percent), encode /
before - 1 (the same, end to end: noisier, a difference of two timings), tail / decode.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshcomm.compression import ZFP, Cast, nonfinite  # noqa: E402
from meshcomm.compression.cast import _EXP  # noqa: E402

CODECS = [("float32", ZFP(rate=8)), ("float32", ZFP(rate=16)), ("float32", ZFP(tolerance=1e-3)),
          ("float32", ZFP(precision=16)), ("float64", ZFP(rate=16)), ("float32", Cast("bf16")),
          ("float32", Cast("fp16"))]


TAIL_LOOP = 100         # tail_bytes takes about a microsecond: timed over this many calls


def parse_size(s: str) -> int:
    s = s.strip().upper()
    return int(float(s.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1))


def _cast_encode_before(self, a):
    """Cast._encode before the NaN/Inf handling: the cast, and fp16's overflow check."""
    y = a.astype(self._wire_dtype(a.dtype))
    bits = y.reshape(-1).view(np.uint16)
    if self.to == "fp16" and ((bits & 0x7FFF) == 0x7C00).any() and (np.isinf(y) & np.isfinite(a)).any():
        raise ValueError("fp16 overflow")
    return bits.view(np.uint8)


def _no_check(a):
    return True


class Without:
    """The encode without the NaN/Inf handling, the rest (Codec.encode's wrapper) the same."""

    def __init__(self, codec):
        self.codec = codec
        self.obj, self.name, self.new = ((nonfinite, "all_finite", _no_check) if isinstance(codec, ZFP)
                                         else (Cast, "_encode", _cast_encode_before))

    def __enter__(self):
        self.old = getattr(self.obj, self.name)
        setattr(self.obj, self.name, self.new)

    def __exit__(self, *exc):
        setattr(self.obj, self.name, self.old)


def steps(codec, a: np.ndarray) -> dict:
    """The timed functions of one case, and the context each runs in (None: as is)."""
    e = codec.encode(a)
    out = np.empty_like(a)
    if isinstance(codec, ZFP):
        head = e.payload[:codec.wire_bytes(a.shape, a.dtype) or e.nbytes]
        check = (lambda: nonfinite.all_finite(a))
    else:
        bits = a.astype(codec._wire_dtype(a.dtype)).view(np.uint16)
        exp = _EXP[codec.to]
        head = e.payload
        check = (lambda: nonfinite.wire_finite(bits, exp))
    return {"encode": (lambda: codec.encode(a), None), "check": (check, None),
            "before": (lambda: codec.encode(a), Without(codec)),
            "decode": (lambda: codec.decode(e, out=out), None),
            "tail": (lambda: [codec.tail_bytes(head, a.shape, a.dtype) for _ in range(TAIL_LOOP)], None)}


def run(sizes, reps: int) -> list[dict]:
    rows = []
    for size in sizes:
        for dtype, codec in CODECS:
            a = np.random.default_rng(0).standard_normal(size // np.dtype(dtype).itemsize).astype(dtype)
            fns = steps(codec, a)
            times = {k: [] for k in fns}
            n = reps if size <= 1 << 20 else max(3, reps // 3)
            swapped = ["before", "encode"] + [k for k in fns if k not in ("before", "encode")]
            for i in range(n + 1):          # the first round warms up
                for k in (list(fns) if i % 2 else swapped):     # encode, before: either first
                    f, ctx = fns[k]
                    if ctx is not None:
                        ctx.__enter__()
                    try:
                        with np.errstate(all="ignore"):
                            t0 = time.perf_counter()
                            f()
                            t = time.perf_counter() - t0
                    finally:
                        if ctx is not None:
                            ctx.__exit__()
                    if i:
                        times[k].append(t / TAIL_LOOP if k == "tail" else t)
            med = {k: statistics.median(v) for k, v in times.items()}

            def paired(x, y):               # the median of one round's ratios: the load drifts
                return statistics.median(p / q for p, q in zip(times[x], times[y]))
            rows.append({"codec": str(codec), "dtype": dtype, "bytes": size, "reps": n, "seconds": med,
                         "check_over_encode": paired("check", "encode"),
                         "encode_over_before": paired("encode", "before") - 1,
                         "tail_over_decode": paired("tail", "decode")})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256K,16M")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = run([parse_size(s) for s in a.sizes.split(",")], a.reps)
    print("# finite tiles, 1 process; medians: encode and decode ms; check/encode; encode/before - 1; tail/decode")
    for r in rows:
        s = r["seconds"]
        size = f"{r['bytes'] >> 20}M" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10}K"
        print(f"{r['codec']:<20s} {r['dtype']:<8s} {size:>4s} | encode {s['encode'] * 1e3:8.3f} ms  "
              f"check {s['check'] * 1e3:7.3f} ms  = {r['check_over_encode']:6.2%}  | end to end "
              f"{r['encode_over_before']:+6.2%} | decode {s['decode'] * 1e3:8.3f} ms  tail "
              f"{s['tail'] * 1e6:5.1f} us = {r['tail_over_decode']:6.2%}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
