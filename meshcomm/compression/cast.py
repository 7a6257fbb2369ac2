"""The bf16/fp16 cast codec: the simple baseline of compressed collectives (2 bytes per element)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..arrays import numpy_dtype
from . import nonfinite
from .base import Codec, Encoded, as_dtype, as_shape, host_array

__all__ = ["Cast", "CAST_NAMES"]

# name -> (wire dtype, relative rounding bound, absolute bound below the normal range)
_CASTS = {"bf16": ("bfloat16", 2.0 ** -8, 2.0 ** -134), "fp16": ("float16", 2.0 ** -11, 2.0 ** -25)}
CAST_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
_HALF = ("bfloat16", "float16")
# the wire's exponent bits (NaN and Inf have them all set), its canonical quiet NaN, and the
# NaN pattern reserved to mark a value sent exact after the 2-byte values (nonfinite.py)
_EXP = {"bf16": 0x7F80, "fp16": 0x7C00}
_QNAN = {"bf16": 0x7FC0, "fp16": 0x7E00}
_MARK = {"bf16": 0x7F8D, "fp16": 0x7C6D}


@dataclasses.dataclass(frozen=True, repr=False)
class Cast(Codec):
    """Round float32/float64 tiles to `to` ("bf16" or "fp16") for the wire and back to their
    dtype on decode; float16 and bfloat16 tiles pass through unchanged. NaN and Inf stay
    NaN and Inf; finite values the cast would turn into Inf (fp16: |x| >= 65520; bf16:
    |x| >= 3.3961776e38, float32's top sliver and float64's large values) travel exact
    after the 2-byte values (`tail_bytes`)."""
    to: str

    def __post_init__(self):
        name = CAST_NAMES.get(self.to) if isinstance(self.to, str) else None
        if name is None:
            raise ValueError(f"Cast({self.to!r}): expected one of {', '.join(_CASTS)}")
        object.__setattr__(self, "to", name)

    fixed_size = True

    @property
    def relative_error(self) -> float:
        """Round-to-nearest-even bound of |decoded - x| / |x| in the normal range."""
        return _CASTS[self.to][1]

    def __str__(self) -> str:
        return self.to

    def __repr__(self) -> str:
        return f"Cast({self.to!r})"

    def _check_dtype(self, dtype) -> None:
        dt = np.dtype(dtype)
        if dt.name not in ("float32", "float64") + _HALF:
            raise TypeError(f"{self} cannot encode dtype {dt.name}: it takes float32 and float64 "
                            "(float16 and bfloat16 pass through)")

    def wire_bytes(self, shape, dtype) -> int:
        """Exact payload bytes: 2 per element."""
        self._check_dtype(as_dtype(dtype))
        return 2 * math.prod(as_shape(shape))

    max_wire_bytes = wire_bytes

    def max_abs_error(self, tile=None) -> float:
        """The bound of |decoded - tile| for this tile: relative_error * max|tile|, or half
        the smallest subnormal step if that is larger; 0 for tiles that pass through."""
        if tile is None:
            raise TypeError(f"{self}.max_abs_error needs the tile: its bound is relative "
                            f"({self.relative_error:g} |x|)")
        a = host_array(tile, self)
        if a.dtype.name in _HALF or a.size == 0:
            return 0.0
        return max(self.relative_error * float(np.max(np.abs(a))), _CASTS[self.to][2])

    def _wire_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype if dtype.name in _HALF else numpy_dtype(_CASTS[self.to][0])

    def max_payload_bytes(self, shape, dtype) -> int:
        """An upper bound of the payload's bytes whatever the values: 2 per element, plus,
        where values overflow the wire dtype, every value exact."""
        dt = as_dtype(dtype)
        n = self.wire_bytes(shape, dt)
        return n if dt.name in _HALF else n + math.prod(as_shape(shape)) * dt.itemsize

    def tail_bytes(self, head, shape, dtype) -> int:
        """The bytes after the 2-per-element head: 0 unless its element 0 is the reserved
        mark (a value overflowed the wire dtype), else the exact values of the marked elements."""
        mark = _MARK[self.to]
        if head.size < 2 or int(head[:2].view(np.uint16)[0]) != mark:
            return 0
        dt = as_dtype(dtype)
        if dt.name in _HALF:                    # passed through: no mark
            return 0
        return int(np.count_nonzero(head.view(np.uint16) == mark)) * dt.itemsize

    def _encode(self, a: np.ndarray) -> np.ndarray:
        wd = self._wire_dtype(a.dtype)
        if wd == a.dtype:                       # a copy: the payload never aliases the tile
            return a.reshape(-1).view(np.uint8).copy()
        with np.errstate(over="ignore", invalid="ignore"):
            y = a.astype(wd)
        bits = y.reshape(-1).view(np.uint16)
        exp = _EXP[self.to]
        if nonfinite.wire_finite(bits, exp):     # no NaN or Inf on the wire
            return bits.view(np.uint8)
        # NaN and Inf stay; NaN written as the mark becomes the canonical NaN; finite values
        # the cast made Inf are marked and travel exact after the 2-byte values
        mark = _MARK[self.to]
        bits[bits == mark] = _QNAN[self.to]
        flat = a.reshape(-1)
        over = np.flatnonzero(((bits & np.uint16(0x7FFF)) == exp) & np.isfinite(flat))
        if over.size == 0:
            return bits.view(np.uint8)
        if over[0] != 0:
            over = np.concatenate([[0], over])       # element 0 marked: "a tail follows"
        raw = flat[over]
        bits[over] = mark
        return np.concatenate([bits.view(np.uint8), raw.view(np.uint8)])

    def _decode(self, e: Encoded, dst: np.ndarray | None) -> np.ndarray:
        n = 2 * math.prod(e.shape)
        head = e.payload[:n]
        src = head.view(self._wire_dtype(e.dtype)).reshape(e.shape)
        tail = e.payload.size > n               # check_payload: the marks account for it
        with np.errstate(invalid="ignore"):     # the marks are signalling NaNs
            if dst is None:
                dst = src.astype(e.dtype)       # a copy even when the wire dtype is the tile's
            else:
                np.copyto(dst, src, casting="unsafe")
        if tail:
            vals = e.payload[n:].view(e.dtype)
            if dst.ndim == 0:
                dst[...] = vals[0]
            else:
                at = np.flatnonzero(head.view(np.uint16) == _MARK[self.to])
                dst[np.unravel_index(at, e.shape)] = vals
        return dst
