"""Collectives on mesh axes: all_reduce, all_gather, reduce_scatter, broadcast, reduce,
all_to_all, gather, scatter, barrier, and point-to-point send/recv.

    mesh = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"))
    y = mc.all_reduce(x, mesh, "tp")                 # sum over the 4 devices of each row
    w = mc.all_gather(shard, mesh, "dp", dim=0)      # uneven tiles allowed

The group of a device is the devices that differ from it only along `axes` (one axis name
or a tuple, major to minor); `root` is an index along the group. Input as in
`all_to_all_v`: under a launcher each process passes its own tile (a bare array when it owns
one device of the mesh, else {device: tile}; None on a process owning no device of it);
without a launcher a dict with every device's tile. NumPy, torch or jax.Array in, the same
kind out. Every process calls every collective (SPMD) and gets the tiles of the devices it
owns; devices that get no result (reduce, gather: non-roots) get None (bare) or are left out
of the dict. Each call is compiled to a reshard (meshcomm.collectives.layouts) and runs
through the same agreement check, planner, verifier and backends; `collective_plan` shows the
plan. `backend=None|"mpi"|"torch"|"mixed"`; `async_op=True` returns a `meshcomm.Handle`.
"""
from __future__ import annotations

from .api import (all_gather, all_reduce, all_to_all, barrier, broadcast, collective_plan, gather, recv,
                  reduce, reduce_scatter, scatter, send)
from .layouts import groups

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
           "scatter", "barrier", "send", "recv", "collective_plan", "groups"]
