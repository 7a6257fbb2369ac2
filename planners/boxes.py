"""Pure helpers on boxes: ((start, stop), ...) per tensor dimension, stop exclusive."""
from __future__ import annotations

import itertools
from typing import Sequence

Box = tuple[tuple[int, int], ...]

__all__ = ["Box", "box_size", "box_empty", "intersect", "box_str", "row_major_range",
           "local_slices", "contiguous_in", "interval_pairs"]


def box_size(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def box_empty(box: Box) -> bool:
    return any(b <= a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_str(box: Box) -> str:
    return "[" + ",".join(f"{a}:{b}" for a, b in box) + "]"


def local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices of `box` (global coordinates) inside a tile whose global box is `origin`."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def contiguous_in(box: Box, origin: Box) -> bool:
    """Whether `box` is one contiguous run of a C-ordered tile whose box is `origin`: single
    indices up to some dimension, any range there, and whole dimensions after it (what
    NumPy's c_contiguous flag says of that view of the tile)."""
    dims = list(zip(box, origin))
    for i, ((a, b), _) in enumerate(dims):
        if b - a != 1:
            return all(x == y for x, y in dims[i + 1:])
    return True


def row_major_range(box: Box, start: int, stop: int) -> list[Box]:
    """Boxes covering elements [start, stop) of `box` in row-major order (at most 2*ndim-1)."""
    if stop <= start:
        return []
    dims = [b - a for a, b in box]
    if not dims:
        return [box]
    out: list[Box] = []
    _range(box, dims, 0, start, stop, out)
    return out


def _range(box: Box, dims: list[int], d: int, start: int, stop: int, out: list[Box]) -> None:
    # elements per index of dimension d
    inner = 1
    for n in dims[d + 1:]:
        inner *= n
    if start == 0 and stop == dims[d] * inner:
        out.append(box)
        return
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    lo = box[d][0]
    if d == len(dims) - 1:          # innermost: inner == 1
        out.append(box[:d] + ((lo + start, lo + stop),) + box[d + 1:])
        return
    if i0 == i1:                    # within one slab of dimension d
        sub = box[:d] + ((lo + i0, lo + i0 + 1),) + box[d + 1:]
        _range(sub, dims, d + 1, r0, r1, out)
        return
    if r0:
        sub = box[:d] + ((lo + i0, lo + i0 + 1),) + box[d + 1:]
        _range(sub, dims, d + 1, r0, inner, out)
        i0 += 1
    if i1 > i0:
        out.append(box[:d] + ((lo + i0, lo + i1),) + box[d + 1:])
    if r1:
        sub = box[:d] + ((lo + i1, lo + i1 + 1),) + box[d + 1:]
        _range(sub, dims, d + 1, 0, r1, out)


def interval_pairs(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int, tuple[int, int]]]:
    """Non-empty overlaps of two partitions of one dimension: (i, j, (lo, hi)).

    Both are lists of intervals indexed by shard number; they need not be sorted (Blocks
    are, chunks are), and may contain empty intervals, which overlap nothing.
    """
    ai = sorted((iv, i) for i, iv in enumerate(a) if iv[1] > iv[0])
    bj = sorted((iv, j) for j, iv in enumerate(b) if iv[1] > iv[0])
    out, p, q = [], 0, 0
    while p < len(ai) and q < len(bj):
        (a0, a1), i = ai[p]
        (b0, b1), j = bj[q]
        lo, hi = max(a0, b0), min(a1, b1)
        if hi > lo:
            out.append((i, j, (lo, hi)))
        if a1 <= b1:
            p += 1
        else:
            q += 1
    return out


def pieces(src, dst, shape) -> list[tuple[tuple[int, ...], tuple[int, ...], Box]]:
    """(src shard class, dst shard class, global box) for every non-empty intersection."""
    st, dt = src.tiles(shape), dst.tiles(shape)
    per_dim = [interval_pairs(st.dim_bounds[i], dt.dim_bounds[i]) for i in range(len(shape))]
    out = []
    for combo in itertools.product(*per_dim):
        out.append((tuple(c[0] for c in combo), tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
    return out
