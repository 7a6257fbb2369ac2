"""A persistent native call's run number in its own buffers (native_call.persistent).

A member whose part of a call ends alone (a broadcast's root, a gather's non-root) can run
on: its later runs then match the others' pending ones, and two places apart in the group's
call sequence a symmetric call (all_reduce, ...) pairs with them too, one communicator per
parity. So each member writes the run's place (`Context.seq`) into the call's own buffers,
and each member that receives compares it with its own (backends/mpi_comm.py `Trailer`),
raising instead of returning another run's data:

* blocks that are moved (broadcast, gather, scatter, all_gather, all_to_all of equal blocks
  of a typed dtype): 8 bytes behind each block;
* reductions (reduce, all_reduce, reduce_scatter of equal blocks; 4- or 8-byte elements):
  one more element per block holding the number modulo what sums exactly (a sum: the
  reader compares k times its own), or two, (v, M - v), for max and min (the reader
  compares both: any member's other number shows in one of them).

An all_reduce that is not persistent (above native_call.PERSISTENT_MAX, or of torch tiles)
carries it the same way, in buffers of the run's own (`trailed(fresh=True)`: its tile is
copied into its in-place buffer anyway). Every other call sends it beside the call
(backends/mpi_comm.py): rooted ones from the members whose part ends alone (`Stamps`),
symmetric ones (the larger or torch all_gather, reduce_scatter and all_to_all; 16-bit
elements, products, unequal blocks) as a small allreduce (max) behind the call (`Checked`):
copying a large tile into blocks with numbers and out again ran at half the speed here.
"""
from __future__ import annotations

import numpy as np

from ..backends import buffers
from ..backends.mpi_comm import Trailer

__all__ = ["trails", "trailed"]

_REDUCING = ("reduce", "allreduce", "reduce_scatterv")
_EQUAL = ("gatherv", "scatterv", "allgatherv", "reduce_scatterv")


def trails(c, unit) -> bool:
    """Whether native_call's persistent call `c` (a `_Call`) of `unit` elements carries its
    run number in its own buffers (`trailed`)."""
    if c.what in _EQUAL and len(set(c.kw["counts"])) != 1:
        return False
    if c.what in _REDUCING:
        return c.kw["op"] in ("sum", "max", "min") and unit.itemsize >= 4
    return c.what == "bcast" or (c.typed and c.what in _EQUAL + ("alltoall",))


def trailed(c, unit, dtype, ranks, rank, what, fresh=False):
    """Buffers for `c` with the run number in them: (send buffer, receive buffer or None,
    put(x), take(), its Trailer, the call's arguments). `fresh`: one run's buffers, from the
    pool of result buffers (an all_reduce that is not persistent: take() gives a view)."""
    k = len(ranks)

    def put_into(dst):
        return lambda x: dst.__setitem__(Ellipsis, x)
    if c.what in _REDUCING:
        sums = c.kw["op"] == "sum"
        t = 1 if sums else 2
        bits = np.finfo(unit).nmant + 1 if unit.kind == "f" else 8 * unit.itemsize - (unit.kind == "i")
        mod = (1 << bits) // k if sums else 1 << bits
        kw = dict(mod=mod, scale=k) if sums else dict(mod=mod, pair=True)
        if c.what == "reduce_scatterv":         # one more element (two) behind each block
            n = c.kw["counts"][0]
            whole, recv = np.empty(k * (n + t), unit), np.empty(n + t, unit)
            blocks = whole.reshape(k, n + t)[:, :n]
            out = recv[:n].reshape(c.shape)
            tr = Trailer(whole.reshape(k, n + t)[:, n:], recv[n:], (None,), rank, what, **kw)
            return (whole, recv, lambda x: blocks.__setitem__(Ellipsis, x.reshape(k, -1)), out.copy, tr,
                    dict(c.kw, counts=(n + t,) * k))
        whole = (buffers.empty if fresh else np.empty)(c.send + t, unit)   # in place: each adds its number
        tail = whole[c.send:]
        tr = Trailer(tail, tail if c.gets else None, (None,), rank, what, **kw)
        out = whole[:c.send].reshape(c.shape)
        return whole, None, put_into(whole[:c.send].reshape(c.mine)), (lambda: out) if fresh else out.copy, tr, c.kw
    t, us = -(-8 // unit.itemsize), unit.itemsize     # units of the number behind each block

    def tail(a, n):                         # int64 view of the 8 bytes after n units of each row
        return a.view(np.uint8).reshape(-1, (n + t) * us)[:, n * us:n * us + 8].view(np.int64)
    if c.what == "bcast":               # in place: the root writes, the others compare
        whole = np.empty(c.send + t, unit)
        mark = tail(whole, c.send)
        tr = Trailer(mark if c.fill else None, None if c.fill else mark, (c.kw["root"],), rank, what)
        return (whole, None, put_into(whole[:c.send].view(dtype).reshape(c.mine)),
                whole[:c.send].view(dtype).reshape(c.shape).copy, tr, c.kw)
    if c.what == "alltoall":            # every member writes each block, compares each
        n = c.send // k
        whole, recv = np.empty(k * (n + t), unit), np.empty(k * (n + t), unit)
        blocks, rows = whole.reshape(k, n + t)[:, :n], recv.reshape(k, n + t)[:, :n]
        tr = Trailer(tail(whole, n), tail(recv, n), ranks, rank, what)
        return (whole, recv, lambda x: blocks.__setitem__(Ellipsis, x.reshape(k, -1)),
                lambda: rows.copy().reshape(c.shape), tr, c.kw)
    n = c.kw["counts"][0]
    kw = dict(c.kw, counts=(n + t,) * k)
    if c.what in ("gatherv", "allgatherv"):     # every member writes, the receivers compare each block
        whole = np.empty(n + t, unit)
        recv = np.empty(k * (n + t) if c.gets else 0, unit)
        rows = recv.reshape(k, n + t)[:, :n] if c.gets else None
        tr = Trailer(tail(whole, n), tail(recv, n) if c.gets else None, ranks, rank, what)
        return whole, recv, put_into(whole[:n].reshape(c.mine)), lambda: rows.copy().reshape(c.shape), tr, kw
    whole = np.empty(k * (n + t) if c.fill else 0, unit)          # scatterv: the root writes each
    blocks = whole.reshape(k, n + t)[:, :n] if c.fill else None
    recv = np.empty(n + t, unit)
    tr = Trailer(tail(whole, n) if c.fill else None, tail(recv, n), (c.kw["root"],), rank, what)
    return whole, recv, lambda x: blocks.__setitem__(Ellipsis, x.reshape(k, -1)), recv[:n].reshape(c.shape).copy, tr, kw
