"""`meshcomm tune --codecs`: each codec's encode and decode throughput with every process coding at once (the cost model's input).

Every rank codes the same 4 MiB of float32 normal values at the same time (after a
barrier), for about half a second per codec and direction, and counts bytes over elapsed
time, so the figure is what one process gets while all of them code: on 8 processes
sharing 2 cores, a quarter of one core's. The table's "codecs" list keeps, per codec, the
median over ranks as {"op": "codec", "codec": str(codec), "encode_GBps", "decode_GBps",
"world", "bytes"} (GB/s of uncompressed bytes), which `meshcomm.backends.codec_cost.speed`
reads.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from meshcomm.compression import coerce

__all__ = ["DEFAULT", "format_codecs", "measure_codecs", "parse_codecs"]

DEFAULT = "zfp(rate=8),zfp(rate=16),bf16"


def parse_codecs(text: str) -> list:
    """'zfp(rate=8),bf16' -> [ZFP(rate=8), Cast('bf16')]; '' or 'none' -> []."""
    if not text or text.strip().lower() == "none":
        return []
    out, depth, cur = [], 0, ""
    for ch in text:                    # commas inside zfp(...) never occur, but be safe
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [coerce(s.strip()) for s in out if s.strip()]


def _throughput(codec, data, seconds: float) -> tuple[float, float]:
    """(encode, decode) GB/s over repeated runs lasting about `seconds` in total each: total
    bytes over total time, so time slices lost to other processes count (a median of short
    runs would not see them)."""
    out = np.empty_like(data)
    e = codec.encode(data)                      # warm-up, and the payload to decode
    res = []
    for step in (lambda: codec.encode(data), lambda: codec.decode(e, out=out)):
        n, t0 = 0, time.perf_counter()
        while True:
            step()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        res.append(n * data.nbytes / dt / 1e9)
    return res[0], res[1]


def measure_codecs(backend, codecs, nbytes: int = 4 << 20, seconds: float = 0.5, timeout: float = 300.0) -> list[dict]:
    """Every rank measures every codec at once; returns the table entries (on every rank)."""
    world = backend.world_size
    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    mine = []
    for c in codecs:
        backend.barrier(time.monotonic() + timeout)
        mine.append(_throughput(c, data, seconds))
    every = backend.allgather_obj(mine, time.monotonic() + timeout)
    out = []
    for i, c in enumerate(codecs):
        enc = statistics.median(r[i][0] for r in every)
        dec = statistics.median(r[i][1] for r in every)
        out.append({"op": "codec", "codec": str(c), "encode_GBps": enc, "decode_GBps": dec,
                    "world": world, "bytes": nbytes})
    return out


def format_codecs(entries: list[dict]) -> str:
    lines = [f"# codecs: GB/s of uncompressed bytes per process, all {entries[0]['world']} coding at once"
             if entries else "# codecs: none measured"]
    for e in entries:
        lines.append(f"{e['codec']:<20s} encode {e['encode_GBps']:8.3f}  decode {e['decode_GBps']:8.3f}")
    return "\n".join(lines)
