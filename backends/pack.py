"""Pack boxes of a tile into one contiguous message and unpack them back.

One interface for every device: NumPy and CPU torch use slicing; CUDA tensors (torch CUDA
tensors, CuPy arrays) go to the batched kernels in meshcomm.cuda (one launch for all boxes, on
the current stream) when CuPy is available, else torch slicing. Set meshcomm.cuda.kernels.ENABLED = False to
force slicing. `slices` are local slices into the tile, one tuple per box, in message order.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from meshcomm.reduceops import combine

__all__ = ["message_elems", "pack", "unpack", "uses_kernels"]


def message_elems(slices: Sequence[tuple[slice, ...]]) -> int:
    return sum(math.prod(s.stop - s.start for s in sl) for sl in slices)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _on_cuda(x) -> bool:
    return (_is_torch(x) and x.is_cuda) or _is_cupy(x)


def uses_kernels(tile) -> bool:
    """True when pack/unpack of `tile` run the CUDA kernels (else slicing)."""
    if not _on_cuda(tile):
        return False
    from meshcomm import cuda
    return cuda.available()


def pack(tile, slices: Sequence[tuple[slice, ...]], out=None):
    """Concatenate tile[sl] for each sl (row-major) into a 1-d buffer of tile's dtype."""
    host = type(tile) is np.ndarray     # the common case, without the device checks
    if not host and uses_kernels(tile):
        from meshcomm.cuda import KernelUnsupported, pack_cuda
        try:
            return pack_cuda(tile, slices, out=out)
        except KernelUnsupported:
            pass
    n = message_elems(slices)
    if not host and _is_torch(tile):
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
        if not host and _is_cupy(tile):
            import cupy
            out = cupy.empty(n, dtype=tile.dtype)
        else:
            out = np.empty(n, dtype=tile.dtype)
    off = 0
    for sl in slices:
        v = tile[sl]
        k = v.size
        out[off:off + k].reshape(v.shape)[...] = v
        off += k
    return out


def unpack(buf, tile, slices: Sequence[tuple[slice, ...]], accumulate: bool = False,
           op: str = "sum") -> None:
    """Scatter a packed 1-d buffer back into tile[sl] for each sl; when `accumulate`, combine
    with what is there by `op` (meshcomm.reduceops: the CUDA kernels add; other ops use the
    array library's own elementwise op)."""
    host = type(tile) is np.ndarray and type(buf) is np.ndarray
    if not host and uses_kernels(tile) and _on_cuda(buf) and (not accumulate or op == "sum"):
        from meshcomm.cuda import KernelUnsupported, unpack_cuda
        try:
            unpack_cuda(buf, tile, slices, accumulate=accumulate)
            return
        except KernelUnsupported:
            pass
    off = 0
    for sl in slices:
        dst = tile[sl]
        k = math.prod(s.stop - s.start for s in sl)
        src = buf[off:off + k].reshape(dst.shape) if host or not _is_torch(buf) else buf[off:off + k].view(dst.shape)
        if accumulate and op != "sum":
            tile[sl] = combine(tile[sl], src, op)
        elif accumulate:
            tile[sl] += src
        else:
            tile[sl] = src
        off += k
