"""Validation of what a caller passes (keys, layouts, tile shapes), and shape/dtype inference.

Pure helpers shared by the one-process path (meshcomm.api) and the distributed runtime
(meshcomm.runtime): every check raises ValueError/TypeError naming the device, dimension or
shape at fault.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from . import arrays
from .layout import Blocks, Layout, normalize_shape

__all__ = ["check_layout", "check_layouts", "check_keys", "check_tile_shapes", "normalize_input",
           "resolve_shape_dtype", "infer_shape", "plain_tile", "check_out_buffer"]


def check_layout(layout, what: str = "layout") -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"{what} must be a meshcomm.Layout, got {type(layout).__name__}")


def check_layouts(src, dst) -> None:
    check_layout(src, "src")
    check_layout(dst, "dst")


def check_keys(shards: Mapping, layout: Layout, what: str) -> None:
    mesh_devs = set(layout.mesh.device_ids)
    for d in shards:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise TypeError(f"shard keys must be device ids (int), got {d!r}")
        if d not in mesh_devs:
            raise ValueError(f"device {d} is not in the {what} mesh {layout.mesh}")


def check_tile_shapes(shapes: Mapping[int, tuple], tiling, what: str, rank: int | None = None) -> None:
    """{device: tile shape} against the boxes a layout gives those devices."""
    who = "" if rank is None else f"rank {rank}: "
    for d, shape in shapes.items():
        box = tiling.boxes[d]
        want = tuple(b - a for a, b in box)
        if tuple(shape) != want:
            raise ValueError(f"{who}the tile for {what} device {d} has shape {tuple(shape)} but the "
                             f"{what} layout gives device {d} the box {list(box)} of shape {want} "
                             f"(global shape {tiling.shape})")


def plain_tile(x):
    """A tile as meshcomm moves it: a NumPy tile in the machine's byte order (a copy where it
    is byte-swapped: a '>f4' tile would travel as raw bytes and be read as '<f4'), a torch
    tensor outside autograd (one that requires grad, a parameter say, detached: the same
    memory; results are data, as torch.distributed's are), anything else as it is."""
    if isinstance(x, np.ndarray):
        return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
    if getattr(x, "requires_grad", False):
        return x.detach()
    return x


def normalize_input(x, src: Layout, owned: tuple[int, ...] | None = None) -> tuple[dict, bool]:
    """{device: tile} from what the user passed; True if it was a bare array."""
    if isinstance(x, Mapping):
        check_keys(x, src, "src")
        if owned is not None:
            extra = [d for d in x if d not in owned]
            if extra:
                raise ValueError(f"this process does not own device(s) {extra} it passed shards for")
        kinds = {arrays.kind_of(v) for v in x.values()}
        if len(kinds) > 1:
            raise TypeError(f"shards mix array kinds {sorted(kinds)}; pass one kind")
        return dict(x), False
    arrays.kind_of(x)
    mine = [d for d in (owned if owned is not None else src.mesh.device_ids) if d in src.mesh]
    if len(mine) != 1:
        raise TypeError(f"a bare array is accepted only when this process owns exactly one src device "
                        f"(it owns {len(mine)}); pass a dict {{device id: tile}}")
    return {mine[0]: x}, True


def resolve_shape_dtype(shards: Mapping[int, Any], src: Layout, shape, dtype):
    """Validate or infer (shape, dtype name, itemsize) from the shards a process holds."""
    dnames = {arrays.dtype_of(v) for v in shards.values()}
    if len(dnames) > 1:
        per = {}
        for d, v in shards.items():
            per.setdefault(arrays.dtype_of(v)[0], d)
        raise TypeError("shards have different dtypes: " +
                        ", ".join(f"device {d}: {n}" for n, d in sorted(per.items())))
    if dtype is not None:
        name, itemsize = arrays.normalize_dtype(dtype)
        if dnames and dnames != {(name, itemsize)}:
            got = next(iter(dnames))[0]
            raise TypeError(f"dtype={name} but the shards have dtype {got}")
    elif dnames:
        name, itemsize = next(iter(dnames))
    else:
        name, itemsize = None, None
    if shape is not None:
        shape = src.check_shape(normalize_shape(shape))
    else:
        shape = infer_shape(src, {d: tuple(v.shape) for d, v in shards.items()})
    return shape, name, itemsize


def infer_shape(layout: Layout, tile_shapes: Mapping[int, tuple[int, ...]], owner=None) -> tuple[int, ...] | None:
    """The global shape implied by some devices' tile shapes, or None when ambiguous.

    A dimension is known when it is unsplit, split by Blocks, or when the tiles cover every
    shard along it; otherwise it is known only if exactly one size gives these tile sizes
    under torch.chunk splitting. Tiles that contradict each other or the layout raise a
    ValueError naming the device (and its process: `owner(device)` -> rank, when given).
    """
    try:
        return _infer_shape(layout, tile_shapes)
    except ValueError as e:
        if owner is None:
            raise
        import re
        m = re.search(r"device (\d+)", str(e))
        if m is None:
            raise
        raise ValueError(f"rank {owner(int(m.group(1)))}: {e}") from None


def _infer_shape(layout: Layout, tile_shapes: Mapping[int, tuple[int, ...]]) -> tuple[int, ...] | None:
    if not tile_shapes:
        return None
    ndims = {}
    for d, s in tile_shapes.items():
        ndims.setdefault(len(s), d)
    if len(ndims) != 1:
        raise ValueError("tiles have different numbers of dimensions: " +
                         ", ".join(f"device {d}: {n}-d" for n, d in sorted(ndims.items())))
    ndim = next(iter(ndims))
    if len(layout.spec) > ndim:
        raise ValueError(f"spec {layout.spec_str()} has {len(layout.spec)} entries but the tiles "
                         f"have {ndim} dimension(s)")
    mesh = layout.mesh
    shape = []
    for dim in range(ndim):
        e = layout.spec[dim] if dim < len(layout.spec) else None
        sizes: dict[int, int] = {}
        first: dict[int, int] = {}
        for d, s in tile_shapes.items():
            si = layout.shard_index(d)
            idx = si[dim] if dim < len(si) else 0
            if idx in sizes and sizes[idx] != s[dim]:
                raise ValueError(f"dimension {dim}: device {d} holds the same shard as device "
                                 f"{first[idx]} but its tile has size {s[dim]} there, not {sizes[idx]}")
            sizes[idx] = s[dim]
            first.setdefault(idx, d)
        if e is None:
            shape.append(sizes[0])
            continue
        if isinstance(e, Blocks):
            for idx, n in sizes.items():
                if n != e.sizes[idx]:
                    raise ValueError(f"dimension {dim}: the tile of device {first[idx]} has size {n} "
                                     f"but {e} gives its shard {idx} size {e.sizes[idx]}")
            shape.append(sum(e.sizes))
            continue
        k = math.prod(mesh.axis_size(a) for a in e)
        if len(sizes) == k:
            _check_chunks(sizes, k, dim, first)
            shape.append(sum(sizes.values()))
            continue
        n = _unique_chunk_total(sizes, k)
        if n is None:
            return None
        shape.append(n)
    return tuple(shape)


def _check_chunks(sizes: Mapping[int, int], k: int, dim: int, first: Mapping[int, int]) -> None:
    """Every shard along a dimension is known: their sizes must be torch.chunk's sizes of
    their sum. If not, the dimension size that most tiles agree with decides whom to blame."""
    n = sum(sizes.values())
    if _chunk_sizes(n, k) == [sizes[i] for i in range(k)]:
        return
    hi = k * (max(sizes.values()) + 1)
    cand = np.arange(hi + 1, dtype=np.int64)
    c = -(-cand // k)
    matches = np.zeros_like(cand)
    for i, s in sizes.items():
        matches += (np.minimum((i + 1) * c, cand) - np.minimum(i * c, cand)) == s
    best = int(len(matches) - 1 - np.argmax(matches[::-1]))     # ties: the largest size
    want = _chunk_sizes(best, k)
    bad = [i for i in range(k) if sizes[i] != want[i]]
    i = bad[0]
    raise ValueError(f"dimension {dim}: the tile of device {first[i]} has size {sizes[i]}, but the "
                     f"other tiles along it fit a dimension of {best} split {k} ways (torch.chunk), "
                     f"which gives shard {i} size {want[i]}; use Blocks for other splits")


def _chunk_sizes(n: int, k: int) -> list[int]:
    c = -(-n // k)
    return [min((i + 1) * c, n) - min(i * c, n) for i in range(k)]


def _unique_chunk_total(sizes: Mapping[int, int], k: int) -> int | None:
    hi = k * (max(sizes.values()) + 1)
    if hi > 50_000_000:
        return None
    n = np.arange(hi + 1, dtype=np.int64)
    c = -(-n // k)
    ok = np.ones_like(n, dtype=bool)
    for i, s in sizes.items():
        got = np.minimum((i + 1) * c, n) - np.minimum(i * c, n)
        ok &= got == s
    cand = np.nonzero(ok)[0]
    return int(cand[0]) if len(cand) == 1 else None


def _bounds(x):
    """(device, first byte, past the last byte) an array's elements can reach, or None (no
    elements, or an array of another kind: a jax.Array is never written into)."""
    if isinstance(x, np.ndarray):
        ptr, dev, strides, item = x.__array_interface__["data"][0], "cpu", x.strides, x.itemsize
    elif arrays.is_torch(x):
        item = x.element_size()
        ptr, dev, strides = x.data_ptr(), str(x.device), tuple(s * item for s in x.stride())
    else:
        return None
    if not all(x.shape):
        return None
    lo = hi = ptr
    for n, st in zip(x.shape, strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return dev, lo, hi + item


def overlaps(a, b) -> bool:
    """Whether two arrays (NumPy or torch, either kind) may share memory: by the bytes their
    strides can reach, as np.may_share_memory does (two halves of one buffer do not)."""
    x, y = _bounds(a), _bounds(b)
    return x is not None and y is not None and x[0] == y[0] and x[1] < y[2] and y[1] < x[2]


def check_out_buffer(v, shape, dtype: str, where: str, kind: str | None = None, of: str = "the result is",
                     inputs=(), taken=None) -> None:
    """An `out=` buffer against the result it takes (`where` names it in the errors): an array
    of its shape and dtype; with `kind` (the tiles' or the result's: "numpy", "torch" or "jax",
    whose results land in NumPy buffers) also a writable C-ordered array of that kind; sharing
    no memory with the call's `inputs` (a reshard reads them while it writes its results) nor
    with the call's other buffers checked before it (`taken`, a list it is added to)."""
    if not (hasattr(v, "shape") and hasattr(v, "dtype")):
        raise TypeError(f"{where} must be an array (NumPy or torch), got {type(v).__name__}")
    got = arrays.dtype_of(v)[0]
    if tuple(v.shape) != tuple(shape) or got != dtype:
        raise ValueError(f"{where} is {tuple(v.shape)} {got}, the result is {tuple(shape)} {dtype}")
    if kind is None:
        return
    if not (v.is_contiguous() if arrays.is_torch(v) else
            isinstance(v, np.ndarray) and v.flags.c_contiguous and v.flags.writeable):
        raise ValueError(f"{where} must be a writable C-contiguous array")
    if arrays.kind_of(v) != ("numpy" if kind == "jax" else kind):
        raise TypeError(f"{where} is {arrays.kind_of(v)}, {of} {kind}")
    if any(overlaps(v, x) for x in inputs):
        raise ValueError(f"{where} shares memory with an input tile: a reshard reads its input while it "
                         "writes results; pass a separate buffer")
    if taken is not None:
        if any(overlaps(v, t) for t in taken):
            raise ValueError(f"{where} shares memory with another out= buffer of the call: each result "
                             "needs a buffer of its own")
        taken.append(v)
