"""A collective call as validated (`Request`), and its input on one process: its tiles, checked
(keys, kinds, shapes, dtypes), and the facts every process then agrees on (dtype, array kind,
device type, tile shape)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from .. import arrays
from ..caches import memo
from ..collectives.layouts import REDUCE_OPS, group_axes, groups
from ..validate import plain_tile

__all__ = ["Request", "request", "tiles_of", "local_facts", "check_declared"]

ROOTED = ("broadcast", "scatter")          # only the root's tile carries data
GATHERS = ("all_gather", "gather")         # tiles may differ along `dim`
REDUCING = ("all_reduce", "reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Request:
    """A collective call as the user made it (validated names, not yet its tiles)."""

    op: str
    mesh: Any
    axes: tuple
    dim: int = 0
    root: int = 0
    reduce_op: str = "sum"
    split_dim: int = 0
    concat_dim: int = 0
    compression: Any = None         # the compression= argument (all_gather, reduce_scatter, all_reduce)
    _hash: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        # computed once: a repeated call looks its compiled form up by it
        h = self._hash
        if h is None:
            h = hash((self.op, self.mesh, self.axes, self.params, self.compression))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def params(self) -> tuple:
        return (self.dim, self.root, self.reduce_op, self.split_dim, self.concat_dim)


# -- the arguments, validated --------------------------------------------------------------------

def _check_int(op: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {v!r}")
    return int(v)


_CHECKED = {"all_reduce": ("reduce_op", "compression"), "all_gather": ("dim", "compression"),
            "reduce_scatter": ("dim", "reduce_op", "compression"), "broadcast": ("root",),
            "reduce": ("root", "reduce_op"), "all_to_all": ("split_dim", "concat_dim"),
            "gather": ("root", "dim"), "scatter": ("root", "dim")}


def request(op: str, mesh, axes, dim=0, root=0, reduce_op="sum", split_dim=0, concat_dim=0,
             compression=None) -> Request:
    """The validated Request of a call (ValueError/TypeError naming a bad argument); the same
    object for the same arguments, so a repeated call finds its compiled form at once."""
    args = (op, mesh, axes, dim, root, reduce_op, split_dim, concat_dim)
    if compression is None:
        try:
            return _request_of(*args)
        except TypeError:               # unhashable arguments (or a bad one: raised again below)
            pass
    return _build_request(*args, compression)


@memo(256, typed=True)
def _request_of(*args) -> Request:
    return _build_request(*args)


def _build_request(op, mesh, axes, dim, root, reduce_op, split_dim, concat_dim, compression=None) -> Request:
    ax = group_axes(mesh, axes)
    checked, kw = _CHECKED[op], {}
    if "compression" in checked and compression is not None:      # a codec or "auto"
        from .. import compression as codecs
        try:
            kw["compression"] = codecs.coerce(compression)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{op}: {e}") from None
    for name, v in (("dim", dim), ("root", root), ("split_dim", split_dim), ("concat_dim", concat_dim)):
        if name in checked:
            kw[name] = _check_int(op, name, v)
    if "reduce_op" in checked:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{op}: op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
        kw["reduce_op"] = reduce_op
    return Request(op, mesh, ax, **kw)


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
    roots = roots_of(req) if req.op in ROOTED else ()
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
    tiles = {d: plain_tile(v) for d, v in tiles.items() if v is not None}
    return tiles, bare


def roots_of(req) -> tuple[int, ...]:
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
    check_tile(req, facts["tile"], facts["dtype"])
    return facts


def check_tile(req, tile, dt) -> None:
    """The checks of a tile's shape and dtype against the call (`tile`, `dt`: None where
    unknown), for the eager call's tiles and a Program's declared shape= and dtype= alike."""
    if req.op in GATHERS and tile is not None:
        n = len(tile)
        if not -n <= req.dim < n:
            raise ValueError(f"{req.op}: dim={req.dim} is out of range for tiles with {n} dimension(s)")
    if dt is not None and req.op in REDUCING:
        if req.reduce_op == "avg" and arrays.numpy_dtype(dt[0]).kind not in "fc" and dt[0] != "bfloat16":
            raise TypeError(f"{req.op}: op='avg' needs a floating dtype, got {dt[0]} (use op='sum' and divide)")
        if dt[0] == "bool" and req.reduce_op in ("sum", "prod", "avg"):
            raise TypeError(f"{req.op}: op={req.reduce_op!r} is not defined for bool tiles (use min or max)")


def masked(req, shape):
    """The tile shape that must agree: a gather's dimension may differ between devices."""
    if shape is None or req.op not in GATHERS or not shape:
        return shape
    d = req.dim % len(shape)
    return shape[:d] + (-1,) + shape[d + 1:]


def check_declared(req, tiles, declared) -> None:
    """A one-process Program's tiles against its shape= and dtype= (as a launcher's run checks
    them; a gather's tiles may differ along `dim`)."""
    (tile, dtype), f = declared, local_facts(req, tiles)
    if f["dtype"] is not None and f["dtype"][0] != dtype[0]:
        raise TypeError(f"{req.op}: the tiles have dtype {f['dtype'][0]}, the Program's is {dtype[0]}")
    k = req.dim % len(tile) if tile and req.op in GATHERS else None
    for d, v in tiles.items():
        if v is not None and tile is not None and (v.ndim != len(tile) or any(
                a != b for i, (a, b) in enumerate(zip(v.shape, tile)) if i != k)):
            raise ValueError(f"{req.op}: the tile of device {d} has shape {tuple(v.shape)}, the Program's is "
                             f"{tuple(tile)}" + ("" if k is None else f" (tiles may differ along dim {req.dim} only)"))
