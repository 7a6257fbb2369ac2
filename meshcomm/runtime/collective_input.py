"""A collective's input on one process: its tiles, checked (keys, kinds, shapes, dtypes), and
the facts every process then agrees on (dtype, array kind, device type, tile shape)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .. import arrays
from ..collectives.layouts import groups
from ..validate import native_byte_order

__all__ = ["tiles_of", "local_facts"]

ROOTED = ("broadcast", "scatter")          # only the root's tile carries data
GATHERS = ("all_gather", "gather")         # tiles may differ along `dim`


def tiles_of(req, x, owned: tuple[int, ...], where: str) -> tuple[dict, bool]:
    """{device: tile or None} for the devices of the mesh this process owns, and whether x
    was a bare array. Rooted ops accept None for devices that are not roots."""
    if isinstance(x, Mapping):
        for d in x:
            if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
                raise TypeError(f"{req.op}: keys of x must be device ids (int), got {d!r}")
            if d not in req.mesh:
                raise ValueError(f"{req.op}: device {d} is not in the mesh {req.mesh}")
            if d not in owned:
                raise ValueError(f"{req.op}: x holds a tile for device {d}, which {where} does not own "
                                 f"(it owns {list(owned)})")
        tiles, bare = dict(x), False
    else:
        if len(owned) != 1:
            raise TypeError(f"{req.op}: a bare array is accepted only when {where} owns exactly one "
                            f"device of the mesh (it owns {len(owned)}); pass a dict {{device: tile}}")
        tiles, bare = {owned[0]: x}, True
    roots = _roots(req) if req.op in ROOTED else ()
    missing = [d for d in owned if tiles.get(d) is None and (req.op not in ROOTED or d in roots)]
    if missing:
        raise ValueError(f"{req.op}: x needs a tile for device(s) {missing[:8]} ({where} owns "
                         f"{list(owned)})")
    kinds = {}
    for d, v in tiles.items():
        if v is not None:
            kinds.setdefault(arrays.kind_of(v), d)
    if len(kinds) > 1:
        raise TypeError(f"{req.op}: tiles mix array kinds: " +
                        ", ".join(f"device {d}: {k}" for k, d in kinds.items()))
    tiles = {d: native_byte_order(v) for d, v in tiles.items() if v is not None}
    return tiles, bare


def _roots(req) -> tuple[int, ...]:
    return tuple(g[req.root] for g in groups(req.mesh, req.axes)
                 if 0 <= req.root < len(g))


def local_facts(req, tiles: Mapping[int, Any]) -> dict:
    """dtype, kind, device type and tile shape of this process's tiles (checked alike)."""
    facts: dict = {"dtype": None, "kind": None, "devtype": None, "tile": None}
    first = None
    for d, v in tiles.items():
        dt = arrays.dtype_of(v)
        shape = tuple(v.shape)
        if first is None:
            first = d
            facts["dtype"], facts["tile"] = dt, shape
            facts["kind"] = arrays.kind_of(v)
            from meshcomm.backends import streams
            dev = streams.device_of(v)
            facts["devtype"] = dev.type if dev is not None else "cpu"
            continue
        if dt != facts["dtype"]:
            raise TypeError(f"{req.op}: tiles have different dtypes: device {first}: {facts['dtype'][0]}, "
                            f"device {d}: {dt[0]}")
        if masked(req, shape) != masked(req, facts["tile"]):
            raise ValueError(f"{req.op}: tiles have different shapes: device {first}: {facts['tile']}, "
                             f"device {d}: {shape}")
    if req.op in GATHERS and facts["tile"] is not None:
        n = len(facts["tile"])
        if not -n <= req.dim < n:
            raise ValueError(f"{req.op}: dim={req.dim} is out of range for tiles with {n} dimension(s)")
    if facts["dtype"] is not None and req.reduce_op == "avg" and req.op in ("all_reduce", "reduce", "reduce_scatter"):
        kind = arrays.numpy_dtype(facts["dtype"][0]).kind
        if kind not in "fc" and facts["dtype"][0] != "bfloat16":
            raise TypeError(f"{req.op}: op='avg' needs a floating dtype, got {facts['dtype'][0]} "
                            "(use op='sum' and divide)")
    if facts["dtype"] is not None and facts["dtype"][0] == "bool" and req.op in ("all_reduce", "reduce", "reduce_scatter") \
            and req.reduce_op in ("sum", "prod", "avg"):
        raise TypeError(f"{req.op}: op={req.reduce_op!r} is not defined for bool tiles (use min or max)")
    return facts


def masked(req, shape):
    """The tile shape that must agree: a gather's dimension may differ between devices."""
    if shape is None or req.op not in GATHERS or not shape:
        return shape
    d = req.dim % len(shape)
    return shape[:d] + (-1,) + shape[d + 1:]
