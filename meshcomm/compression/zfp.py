"""The ZFP codec (zfpy): fixed rate, absolute tolerance or precision, headerless payloads."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import nonfinite
from .base import Codec, Encoded, as_dtype, as_shape

__all__ = ["ZFP", "zfp_shape"]

_MODES = ("rate", "tolerance", "precision")
_MIN_BITS = {"float32": 1 + 8, "float64": 1 + 11}      # sign + exponent: one block's minimum


def zfp_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ZFP codes a tile as: 0-d -> (1,), more than 4 dims merged into the leading one."""
    if len(shape) == 0:
        return (1,)
    if len(shape) > 4:
        return (math.prod(shape[:-3]),) + tuple(shape[-3:])
    return tuple(shape)


def _blocks(zshape) -> int:
    return math.prod(-(-n // 4) for n in zshape)


def _number(v, what: str) -> float | int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"ZFP {what} must be a number, got {type(v).__name__} {v!r}")
    return int(v) if isinstance(v, (int, np.integer)) else float(v)


def _fmt(v) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(float(v))


def _zfpy():
    try:
        import zfpy
    except ImportError:
        raise ImportError("ZFP compression needs zfpy: pip install 'meshcomm[compression]'") from None
    return zfpy


@dataclasses.dataclass(frozen=True, repr=False)
class ZFP(Codec):
    """ZFP with exactly one mode: `rate` (bits per value, 0 < rate <= 64: fixed, exact size),
    `tolerance` (absolute error bound, finite, > 0) or `precision` (bit planes, int 1..64).
    Encodes float32 and float64 tiles."""
    rate: float | None = None
    tolerance: float | None = None
    precision: int | None = None

    def __post_init__(self):
        given = [m for m in _MODES if getattr(self, m) is not None]
        if len(given) != 1:
            raise ValueError("ZFP takes exactly one of rate=, tolerance=, precision= "
                             f"(got {', '.join(given) or 'none'})")
        m = given[0]
        v = _number(getattr(self, m), m)
        if m == "rate" and not 0 < v <= 64:
            raise ValueError(f"ZFP rate={v!r} must be > 0 and <= 64 (bits per value)")
        if m == "tolerance" and not 0 < v < math.inf:
            raise ValueError(f"ZFP tolerance={v!r} must be a finite number > 0 (absolute error)")
        if m == "precision":
            if not float(v).is_integer() or not 1 <= v <= 64:
                raise ValueError(f"ZFP precision={v!r} must be an int from 1 to 64 (bit planes)")
            v = int(v)
        object.__setattr__(self, m, v)

    @property
    def mode(self) -> str:
        """"rate", "tolerance" or "precision"."""
        return next(m for m in _MODES if getattr(self, m) is not None)

    @property
    def fixed_size(self) -> bool:
        """Whether the payload's size depends only on shape and dtype (fixed rate)."""
        return self.rate is not None

    def __str__(self) -> str:
        return f"zfp({self.mode}={_fmt(getattr(self, self.mode))})"

    def __repr__(self) -> str:
        return f"ZFP({self.mode}={_fmt(getattr(self, self.mode))})"

    def _kw(self) -> dict:
        return {self.mode: getattr(self, self.mode)}

    def _check_dtype(self, dtype) -> None:
        dt = np.dtype(dtype)
        if dt.name in _MIN_BITS:
            return
        why = (" (ZFP's integer modes are lossy: zfpy 1.0.1 changes int32 values by up to 8 even "
               "at precision=64)") if dt.name in ("int32", "int64") else ""
        raise TypeError(f"{self} cannot encode dtype {dt.name}: it takes float32 and float64{why}")

    def block_bits(self, zshape, dtype) -> int:
        """Bits of one fixed-rate block of a tile coded as `zshape`. Refuses rates below ZFP's
        sign + exponent minimum, where zfpy 1.0.1 writes past its buffer instead of raising
        the rate (1-d float32 needs rate >= 2.125, 1-d float64 2.875, 2-d float32 0.53)."""
        dt = as_dtype(dtype)
        n = 4 ** len(zshape)
        bits = math.floor(n * self.rate + 0.5)
        need = _MIN_BITS[dt.name]
        if bits < need:
            raise ValueError(f"{self} on a {len(zshape)}-d {dt.name} tile is {bits} bits per "
                             f"block of {n} values, below ZFP's minimum of {need}: "
                             f"use rate >= {(need - 0.5) / n:g} for such tiles")
        return bits

    def wire_bytes(self, shape, dtype) -> int | None:
        """Exact payload bytes of a tile in fixed-rate mode; None in the data-dependent modes
        (see `max_wire_bytes`)."""
        shape, dt = as_shape(shape), as_dtype(dtype)
        self._check_dtype(dt)
        if self.rate is None:
            return None
        if math.prod(shape) == 0:
            return 0
        zs = zfp_shape(shape)
        return -(-_blocks(zs) * self.block_bits(zs, dt) // 64) * 8

    def max_wire_bytes(self, shape, dtype) -> int:
        """An upper bound of the payload's bytes, exact for fixed rate. Otherwise ZFP's own
        bound without its header: per block sign + exponent, then per bit plane one bit per
        value plus group-test bits (random bit patterns come within 10% of it)."""
        exact = self.wire_bytes(shape, dtype)
        if exact is not None:
            return exact
        shape, dt = as_shape(shape), as_dtype(dtype)
        if math.prod(shape) == 0:
            return 0
        zs = zfp_shape(shape)
        n, planes = 4 ** len(zs), 8 * dt.itemsize
        if self.precision is not None:
            planes = min(planes, self.precision)
        return -(-_blocks(zs) * (_MIN_BITS[dt.name] + n - 1 + n * planes) // 64) * 8

    def max_abs_error(self, tile=None) -> float | None:
        """The a-priori bound of |decoded - tile|: the tolerance (it holds when the tolerance
        is at least 2**-22 max|x| for float32, 2**-51 max|x| for float64); None for fixed
        rate and precision, which bound the size, not the error."""
        return self.tolerance

    def max_payload_bytes(self, shape, dtype) -> int:
        """An upper bound of the payload's bytes whatever the values: `max_wire_bytes` plus,
        for a tile holding NaN or Inf, every value raw (and, in the data-dependent modes, the
        non-finite section's block indices and footer)."""
        shape, dt = as_shape(shape), as_dtype(dtype)
        n = self.max_wire_bytes(shape, dt)
        if math.prod(shape) == 0:
            return n
        raw = math.prod(shape) * dt.itemsize
        if self.rate is not None:
            return n + raw
        body = 8 + 8 * _blocks(zfp_shape(shape)) + raw
        return n + -(-body // 8) * 8 + nonfinite.FOOTER_BYTES

    def tail_bytes(self, head, shape, dtype) -> int:
        """Fixed rate: the bytes following the `wire_bytes` head `head` (1-d uint8): 0 unless
        the head's block 0 is marked (the tile held NaN or Inf), else the raw values of the
        marked blocks. 0 in the data-dependent modes (their payload is whole)."""
        if self.rate is None or head.size < 8 or int(head[:8].view("=u8")[0]) & 3 != 2:
            return 0                            # block 0's first two bits: no tail
        shape, dt = as_shape(shape), as_dtype(dtype)
        zs = zfp_shape(shape)
        bits, nb = self.block_bits(zs, dt), _blocks(zs)
        if not nonfinite.marked(head, nb, bits, first_only=True):
            return 0
        return nonfinite.block_elements(zs, nonfinite.marked(head, nb, bits)).size * dt.itemsize

    def check_payload(self, encoded: Encoded) -> None:
        if self.rate is not None or encoded.nbytes % 8 != 4:
            return super().check_payload(encoded)
        limit = self.max_payload_bytes(encoded.shape, encoded.dtype)
        if encoded.nbytes > limit:
            raise ValueError(f"{self} payload of a {encoded.dtype.name}{list(encoded.shape)} tile has "
                             f"{encoded.nbytes} bytes, expected at most {limit}")
        nonfinite.unsection(encoded.payload, zfp_shape(encoded.shape), encoded.dtype)

    def _encode(self, a: np.ndarray) -> np.ndarray:
        zfpy = _zfpy()
        a = a.reshape(zfp_shape(a.shape))
        if self.rate is not None:
            self.block_bits(a.shape, a.dtype)
        if nonfinite.all_finite(a):
            return np.frombuffer(zfpy.compress_numpy(a, write_header=False, **self._kw()), np.uint8)
        # blocks holding NaN or Inf: zeroed for ZFP, their values raw after the stream
        blocks = nonfinite.special_blocks(a)
        if self.rate is not None and blocks[0] != 0:
            blocks = np.concatenate([[0], blocks])          # block 0 marked: "a tail follows"
        el = nonfinite.block_elements(a.shape, blocks)
        raw = a.reshape(-1)[el]
        z = a.copy()
        z.reshape(-1)[el] = 0
        head = np.frombuffer(bytearray(zfpy.compress_numpy(z, write_header=False, **self._kw())), np.uint8)
        if self.rate is None:
            return np.concatenate([head, nonfinite.section(blocks, raw)])
        nonfinite.mark(head, blocks, self.block_bits(a.shape, a.dtype))
        return np.concatenate([head, raw.view(np.uint8)])

    def _decode(self, e: Encoded, dst: np.ndarray | None) -> np.ndarray:
        zfpy = _zfpy()
        zs = zfp_shape(e.shape)
        payload, fix = e.payload, None
        if self.rate is not None:
            n = self.wire_bytes(e.shape, e.dtype)
            if payload.size > n:                # check_payload: the marks account for the tail
                head = payload[:n]
                blocks = nonfinite.marked(head, _blocks(zs), self.block_bits(zs, e.dtype))
                el = nonfinite.block_elements(zs, blocks)
                fix = (el, payload[n:n + el.size * e.dtype.itemsize].view(e.dtype))
                payload = head
        elif payload.size % 8 == 4:
            payload, _, el, raw = nonfinite.unsection(payload, zs, e.dtype)
            fix = (el, raw)
        direct = dst is not None and dst.flags.c_contiguous
        res = zfpy._decompress(payload, zfpy.dtype_to_ztype(e.dtype), list(zs),
                               out=dst.reshape(zs) if direct else None, **self._kw())
        if direct:
            res = dst
        if fix is not None:                     # the special blocks' values, raw
            res.reshape(-1)[fix[0]] = fix[1]
        if direct:
            return dst
        res = res.reshape(e.shape)
        if dst is not None:
            np.copyto(dst, res)
            return dst
        return res
