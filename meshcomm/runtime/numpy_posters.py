"""Posters of a group's native call for NumPy tiles on MPI, with the least Python per call.

`native_call.poster` works out once what does not depend on the tile; for a NumPy tile on a
backend whose wire is NumPy (MPI) the calls below go further: the group and counts are
validated once (`MPICollectives.*_poster`), and each call only takes its result buffer, views
the tile as the wire wants it (bytes, or typed for reductions; no copy when it is
contiguous) and posts. On 8 processes sharing 2 cores every µs of Python per call costs
several µs of wall time (BENCHMARKS.md section 10), so this is where repeated small
collectives spend it. Anything else (torch tiles, torch's wire, rooted calls) keeps the
general posters.
"""
from __future__ import annotations

import math

import numpy as np

from ..backends import buffers

__all__ = ["numpy_poster"]


def _flat(x):
    """The tile as one contiguous 1-d array (a view when it is contiguous already)."""
    return x.reshape(-1) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1)


def numpy_poster(prim, req, me, dt, tile, shapes, g, ranks, op, chunks):
    """post(x) -> (works, fin) for device `me`'s NumPy tile, or None where it does not apply
    (see the module's docstring). `chunks`: the leading dimension's split for reduce_scatter."""
    if prim.wire != "numpy" or not hasattr(prim, "allgather_poster"):
        return None
    itemsize = dt[1]
    row = math.prod(tile[1:]) if tile else 1
    if req.op == "all_reduce":
        ar = prim.allreduce_poster(op, ranks)

        def post(x):
            buf = buffers.copy(x).reshape(-1)
            return [ar(buf)], lambda: {me: buf.reshape(tile)}
        return post
    if req.op == "all_gather":
        counts = tuple(shapes[d][0] * row * itemsize for d in g)
        shape = (sum(shapes[d][0] for d in g),) + tuple(tile[1:])
        total = sum(counts)
        ag = prim.allgather_poster(counts, ranks)

        def post(x):
            recv = buffers.empty(total)
            w = ag(_flat(x).view(np.uint8), recv)
            return [w], lambda: {me: recv.view(x.dtype).reshape(shape)}
        return post
    if req.op == "reduce_scatter":
        i = g.index(me)
        counts = tuple(s * row for s in chunks)
        shape = (chunks[i],) + tuple(tile[1:])
        n = counts[i]
        rs = prim.reduce_scatter_poster(counts, op, ranks)

        def post(x):
            recv = buffers.empty(n, x.dtype)
            w = rs(_flat(x), recv)
            return [w], lambda: {me: recv.reshape(shape)}
        return post
    if req.op == "all_to_all":
        n = math.prod(tile) * itemsize
        a2a = prim.alltoall_poster(ranks)

        def post(x):
            recv = buffers.empty(n)
            w = a2a(_flat(x).view(np.uint8), recv)
            return [w], lambda: {me: recv.view(x.dtype).reshape(tile)}
        return post
    return None
