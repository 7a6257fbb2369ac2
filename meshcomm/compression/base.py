"""What every codec shares: the Encoded tile, the Codec interface, host-array and size-frame helpers."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..arrays import is_torch, kind_of, normalize_dtype, numpy_dtype, to_numpy

__all__ = ["Encoded", "Codec", "frame", "unframe", "SIZE_HEADER_BYTES"]

SIZE_HEADER_BYTES = 8
_EMPTY = np.empty(0, np.uint8)
_EMPTY.flags.writeable = False


def as_dtype(dtype) -> np.dtype:
    """A NumPy dtype from anything `numpy.dtype` takes, torch dtypes and "bfloat16"."""
    return numpy_dtype(normalize_dtype(dtype)[0])


def as_shape(shape) -> tuple[int, ...]:
    s = tuple(int(n) for n in shape)
    if any(n < 0 for n in s):
        raise ValueError(f"shape {s} has a negative dimension")
    return s


def host_array(tile, codec) -> np.ndarray:
    """`tile` as a NumPy array sharing its memory: NumPy as is, CPU torch via .numpy()."""
    try:
        kind = kind_of(tile)
    except TypeError:
        raise TypeError(f"{codec} encodes a NumPy array or a CPU torch.Tensor, "
                        f"got {type(tile).__name__}") from None
    if kind == "torch" and tile.device.type != "cpu":
        raise TypeError(f"{codec} runs on the host: move the tensor on {tile.device} to the CPU first")
    return to_numpy(tile)


def _torch_from(a: np.ndarray):
    import torch
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _u8(buf) -> np.ndarray:
    """Any contiguous buffer (bytes, bytearray, memoryview, array) as 1-d uint8, no copy."""
    if not isinstance(buf, np.ndarray):
        return np.frombuffer(buf, dtype=np.uint8)
    if buf.dtype == np.uint8 and buf.ndim == 1:
        return buf
    if not buf.flags.c_contiguous:
        raise ValueError("a payload must be a contiguous buffer")
    return buf.reshape(-1).view(np.uint8)


@dataclasses.dataclass(frozen=True, eq=False)
class Encoded:
    """An encoded tile: `payload` (1-d uint8, the bytes that travel) and what decoding needs:
    `codec`, `dtype` and `shape` of the tile.

    `payload` may be given as bytes, bytearray, memoryview or any contiguous array (e.g. a
    buffer received over MPI): it is viewed as 1-d uint8 without a copy."""
    payload: np.ndarray
    codec: "Codec"
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.codec, Codec):
            raise TypeError(f"Encoded needs a codec (ZFP or Cast), got {type(self.codec).__name__}")
        object.__setattr__(self, "payload", _u8(self.payload))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "shape", as_shape(self.shape))

    @property
    def nbytes(self) -> int:
        return int(self.payload.size)

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def decode(self, out=None, like=None):
        return self.codec.decode(self, out=out, like=like)

    def __repr__(self) -> str:
        return f"Encoded({self.codec}, {self.dtype.name}{list(self.shape)}, {self.nbytes} B)"


class Codec:
    """The interface of a codec. Subclasses (frozen dataclasses) define `fixed_size`,
    `wire_bytes`, `max_wire_bytes`, `max_abs_error`, `_check_dtype`, `_encode`, `_decode`."""
    __slots__ = ()

    def encode(self, tile) -> Encoded:
        """`tile` (NumPy or CPU torch; made contiguous) as an Encoded."""
        a = host_array(tile, self)
        self._check_dtype(a.dtype)
        payload = _EMPTY if a.size == 0 else self._encode(np.ascontiguousarray(a))
        return Encoded(payload, self, a.dtype, a.shape)

    def decode(self, encoded: Encoded, out=None, like=None):
        """The tile `encoded` holds: written into `out` (same shape and dtype, NumPy or CPU
        torch; returned) if given, else a new array (torch when `like` is a torch tensor)."""
        if not isinstance(encoded, Encoded):
            raise TypeError(f"{self}.decode takes an Encoded, got {type(encoded).__name__}")
        if encoded.codec != self:
            raise ValueError(f"{encoded!r} was encoded by {encoded.codec}, not {self}")
        dst = None
        if out is not None:
            dst = host_array(out, self)
            if dst.shape != encoded.shape or dst.dtype != encoded.dtype:
                raise ValueError(f"out is {dst.dtype}{list(dst.shape)}, the tile is "
                                 f"{encoded.dtype}{list(encoded.shape)}")
            if not dst.flags.writeable:
                raise ValueError(f"out ({dst.dtype}{list(dst.shape)}) is read-only")
        self.check_payload(encoded)
        if math.prod(encoded.shape) == 0:
            res = dst if dst is not None else np.empty(encoded.shape, encoded.dtype)
        else:
            res = self._decode(encoded, dst)
        if out is not None:
            return out
        return _torch_from(res) if is_torch(like) else res

    def tail_bytes(self, head, shape, dtype) -> int:
        """Fixed sizes: the bytes that follow the `wire_bytes` head `head` (1-d uint8) of a
        payload, read from the head: 0 for a tile of finite values; the exact values of a
        tile's NaN/Inf (ZFP) or overflows (casts) otherwise (compression/nonfinite.py)."""
        return 0

    def max_payload_bytes(self, shape, dtype) -> int:
        """An upper bound of the payload's bytes whatever the values (NaN and Inf included);
        `max_wire_bytes` bounds those of finite tiles."""
        return self.max_wire_bytes(shape, dtype)

    def check_payload(self, encoded: Encoded) -> None:
        """ValueError unless the payload has the size this codec gives such a tile: exact for
        fixed sizes (the head, plus the tail the head announces); for data-dependent ones
        whole 64-bit words up to `max_wire_bytes` (or a non-finite section: ZFP)."""
        shape, dt, n = encoded.shape, encoded.dtype, encoded.nbytes
        exact = self.wire_bytes(shape, dt)
        if exact is not None:
            if n >= exact:                      # a tile holding NaN or Inf: a tail after the head
                exact += self.tail_bytes(encoded.payload[:exact], shape, dt)
            if n != exact:
                raise ValueError(f"{self} payload of a {dt.name}{list(shape)} tile has {n} bytes, "
                                 f"expected {exact}")
            return
        limit = self.max_wire_bytes(shape, dt)
        if n > limit or n % 8 or (n == 0 < limit):
            raise ValueError(f"{self} payload of a {dt.name}{list(shape)} tile has {n} bytes, "
                             f"expected a positive multiple of 8 up to {limit}")


def frame(payload) -> np.ndarray:
    """An 8-byte little-endian length, then the payload: how a data-dependent payload
    (tolerance, precision) travels when the receiver cannot read the message's length."""
    p = _u8(payload)
    out = np.empty(SIZE_HEADER_BYTES + p.size, np.uint8)
    out[:SIZE_HEADER_BYTES] = np.frombuffer(np.array([p.size], "<u8").tobytes(), np.uint8)
    out[SIZE_HEADER_BYTES:] = p
    return out


def unframe(buf) -> np.ndarray:
    """The payload of `frame(...)` bytes (a view; trailing bytes of a larger receive ignored)."""
    b = _u8(buf)
    if b.size < SIZE_HEADER_BYTES:
        raise ValueError(f"a framed payload has at least {SIZE_HEADER_BYTES} bytes, got {b.size}")
    n = int(np.frombuffer(b[:SIZE_HEADER_BYTES].tobytes(), "<u8")[0])
    if n > b.size - SIZE_HEADER_BYTES:
        raise ValueError(f"the frame says {n} bytes but only {b.size - SIZE_HEADER_BYTES} follow")
    return b[SIZE_HEADER_BYTES:SIZE_HEADER_BYTES + n]
