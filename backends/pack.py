"""Pack boxes of a tile into one contiguous message and unpack them back.

One interface for every device: NumPy and CPU torch use slicing; CUDA tensors go to the
batched kernels in meshcomm.cuda when CuPy is available (see cuda/), else torch slicing.
`slices` are local slices into the tile, one tuple per box, in message order.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["message_elems", "pack", "unpack"]


def message_elems(slices: Sequence[tuple[slice, ...]]) -> int:
    return sum(math.prod(s.stop - s.start for s in sl) for sl in slices)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def pack(tile, slices: Sequence[tuple[slice, ...]], out=None):
    """Concatenate tile[sl] for each sl (row-major) into a 1-d buffer of tile's dtype."""
    n = message_elems(slices)
    if _is_torch(tile):
        import torch
        if out is None:
            out = torch.empty(n, dtype=tile.dtype, device=tile.device)
        off = 0
        for sl in slices:
            v = tile[sl]
            k = v.numel()
            out[off:off + k].view(v.shape).copy_(v)
            off += k
        return out
    if out is None:
        out = np.empty(n, dtype=tile.dtype)
    off = 0
    for sl in slices:
        v = tile[sl]
        k = v.size
        out[off:off + k].reshape(v.shape)[...] = v
        off += k
    return out


def unpack(buf, tile, slices: Sequence[tuple[slice, ...]], accumulate: bool = False) -> None:
    """Scatter a packed 1-d buffer back into tile[sl] for each sl; add when `accumulate`."""
    off = 0
    for sl in slices:
        dst = tile[sl]
        k = math.prod(s.stop - s.start for s in sl)
        src = buf[off:off + k].reshape(tuple(dst.shape)) if not _is_torch(buf) else buf[off:off + k].view(dst.shape)
        if accumulate:
            tile[sl] += src
        else:
            tile[sl] = src
        off += k
