"""The bf16/fp16 cast codec: the simple baseline of compressed collectives (2 bytes per element)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..arrays import numpy_dtype
from .base import Codec, Encoded, as_dtype, as_shape, host_array

__all__ = ["Cast", "CAST_NAMES"]

# name -> (wire dtype, relative rounding bound, absolute bound below the normal range)
_CASTS = {"bf16": ("bfloat16", 2.0 ** -8, 2.0 ** -134), "fp16": ("float16", 2.0 ** -11, 2.0 ** -25)}
CAST_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
_HALF = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, repr=False)
class Cast(Codec):
    """Round float32/float64 tiles to `to` ("bf16" or "fp16") for the wire and back to their
    dtype on decode; float16 and bfloat16 tiles pass through unchanged. fp16 raises
    ValueError on finite values it would turn into Inf (|x| >= 65520)."""
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

    def _encode(self, a: np.ndarray) -> np.ndarray:
        wd = self._wire_dtype(a.dtype)
        if wd == a.dtype:                       # a copy: the payload never aliases the tile
            return a.reshape(-1).view(np.uint8).copy()
        with np.errstate(over="ignore"):
            y = a.astype(wd)
        bits = y.reshape(-1).view(np.uint16)
        if self.to == "fp16" and ((bits & 0x7FFF) == 0x7C00).any():
            bad = np.isinf(y) & np.isfinite(a)
            if bad.any():
                i = tuple(int(k) for k in np.unravel_index(int(np.argmax(bad)), a.shape))
                raise ValueError(f"{self} cannot hold {float(a[i])!r} at index {i} "
                                 "(fp16 overflows at 65520): use bf16 or ZFP")
        return bits.view(np.uint8)

    def _decode(self, e: Encoded, dst: np.ndarray | None) -> np.ndarray:
        src = e.payload.view(self._wire_dtype(e.dtype)).reshape(e.shape)
        if dst is None:
            return src.astype(e.dtype)          # a copy even when the wire dtype is the tile's
        np.copyto(dst, src, casting="unsafe")
        return dst
