"""Chunks of a tile on ZFP block boundaries (to overlap coding with transfer) and codec throughput."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .. import caches
from .base import as_dtype, as_shape, host_array
from .cast import Cast
from .spec import Auto, coerce
from .zfp import ZFP

__all__ = ["Chunk", "chunks", "chunk_rows", "measure"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows [start, stop) of dim 0 of a tile, the chunk's shape and its exact payload size
    (None for data-dependent codecs and for no codec)."""
    start: int
    stop: int
    shape: tuple[int, ...]
    wire_bytes: int | None

    @property
    def index(self) -> tuple:
        """`tile[chunk.index]` is the chunk (() for a 0-d tile)."""
        return (slice(self.start, self.stop),) if self.shape else ()


def chunk_rows(shape: tuple[int, ...], codec) -> int:
    """The step of chunk boundaries along dim 0: whole ZFP blocks (4 rows of the leading
    dimension ZFP codes, which merges dims 0..n-4 of an n-d tile, n > 4); 1 for casts and none."""
    if not isinstance(codec, ZFP):
        return 1
    if len(shape) <= 4:
        return 4
    return 4 // math.gcd(math.prod(shape[1:-3]), 4)


def chunks(shape, dtype, codec, target_bytes: int) -> tuple[Chunk, ...]:
    """Cut a tile along dim 0 into balanced chunks of about `target_bytes` uncompressed bytes
    (at least one step of `chunk_rows`), on ZFP block boundaries, so each chunk encodes,
    travels and decodes on its own. The decoded chunks equal the whole tile's decoding bit
    for bit in every ZFP mode (ZFP codes blocks independently)."""
    if isinstance(target_bytes, bool) or not isinstance(target_bytes, (int, np.integer)) \
            or target_bytes <= 0:
        raise ValueError(f"chunks: target_bytes={target_bytes!r} must be a positive int")
    codec = coerce(codec)
    if isinstance(codec, Auto):
        raise ValueError("chunks needs a concrete codec or None, not 'auto'")
    return _chunks(as_shape(shape), as_dtype(dtype), codec, int(target_bytes))


@caches.memo(maxsize=512)
def _chunks(shape, dt, codec, target) -> tuple[Chunk, ...]:
    def size(s):
        return None if codec is None else codec.wire_bytes(s, dt)
    if not shape or math.prod(shape) == 0:
        return (Chunk(0, shape[0] if shape else 1, shape, size(shape)),)
    rows, step = shape[0], chunk_rows(shape, codec)
    row_bytes = math.prod(shape[1:]) * dt.itemsize
    per = max(step, target // row_bytes // step * step)
    n = -(-rows // per)
    per = -(-(-(-rows // n)) // step) * step        # ceil(rows / n) up to whole blocks: balanced
    out = []
    for start in range(0, rows, per):
        stop = min(rows, start + per)
        s = (stop - start,) + shape[1:]
        out.append(Chunk(start, stop, s, size(s)))
    return tuple(out)


def measure(codec, nbytes: int = 16 << 20, dtype="float32", repeats: int = 5,
            shape=None, data=None) -> tuple[float, float]:
    """(encode GB/s, decode GB/s) of uncompressed bytes (1e9 B/s), the median of `repeats`
    timed runs after one warm-up, on one core. The tile is `data`, else standard normal
    values (seed 0) of `shape`, else 1-d of `nbytes` (a flat parameter shard); decode writes
    into a preallocated array, as a collective's receive buffer."""
    codec = coerce(codec)
    if not isinstance(codec, (ZFP, Cast)):
        raise ValueError(f"measure needs a codec, got {codec}")
    if data is None:
        dt = as_dtype(dtype)
        shape = as_shape(shape) if shape is not None else (max(1, nbytes // dt.itemsize),)
        data = np.random.default_rng(0).standard_normal(shape).astype(dt)
    a = host_array(data, codec)
    out = np.empty_like(a)
    enc, dec = [], []
    for i in range(max(1, repeats) + 1):
        t0 = time.perf_counter()
        e = codec.encode(a)
        t1 = time.perf_counter()
        codec.decode(e, out=out)
        t2 = time.perf_counter()
        if i:                                   # the first run warms up
            enc.append(t1 - t0)
            dec.append(t2 - t1)
    gb = a.nbytes / 1e9
    return gb / float(np.median(enc)), gb / float(np.median(dec))
