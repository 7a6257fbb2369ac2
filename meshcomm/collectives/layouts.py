"""Collectives as reshards: each collective on mesh axes is one logical tensor moved between
two layouts, so the planner, the verifier and every backend serve it unchanged.

The group of a device is the devices that differ from it only along `axes` (one name or a
tuple, major to minor); its index in the group is row-major over `axes` in that order. The
logical tensor has one leading dimension per mesh axis outside the group (split over that
axis: different groups hold different data), then the tile's own dimensions:

* all_reduce(op):        partial over the group (op)    -> replicated over the group
* reduce(root, op):      partial over the group         -> the roots' mesh
* reduce_scatter(dim):   partial over the group         -> dim split over the group (torch.chunk)
* all_gather(dim):       dim split (Blocks: the tiles' sizes, group order) -> replicated
* gather(root, dim):     dim split (Blocks)             -> the roots' mesh
* broadcast(root):       the roots' mesh                -> replicated over the group
* scatter(root, dim):    the roots' mesh                -> dim split over the group (torch.chunk)
* all_to_all(split_dim, concat_dim): the tiles side by side along concat_dim, split over the
  group -> split_dim split over the group (equal dims: an extra dimension of the group's size)

The roots' mesh holds, for every group, its member at index `root` (a mesh over the other
axes; one device when the group is the whole mesh).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..caches import memo
from ..layout import Blocks, Layout
from ..mesh import Mesh

__all__ = ["OPS", "REDUCE_OPS", "Problem", "group_axes", "groups", "problem"]

OPS = ("all_reduce", "reduce", "reduce_scatter", "all_gather", "gather", "broadcast", "scatter",
       "all_to_all")
REDUCE_OPS = ("sum", "prod", "min", "max", "avg")
_ROOT_AXIS = "_root"


def group_axes(mesh: Mesh, axes) -> tuple[str, ...]:
    """`axes` as a tuple of distinct axis names of `mesh` (ValueError/TypeError naming it)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
    if isinstance(axes, str):
        axes = (axes,)
    try:
        axes = tuple(axes)
    except TypeError:
        raise TypeError(f"axes must be a mesh axis name or a tuple of names, got {axes!r}") from None
    if not axes:
        raise ValueError("axes must name at least one mesh axis")
    for a in axes:
        if not isinstance(a, str):
            raise TypeError(f"axes must be mesh axis names (str), got {a!r}")
        if a not in mesh.axis_names:
            raise ValueError(f"{a!r} is not an axis of mesh {mesh} (axes {list(mesh.axis_names)})")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes {axes} name an axis twice")
    return axes


@memo(maxsize=1024)
def groups(mesh: Mesh, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Every group of `axes`, each a tuple of devices in group order."""
    other = [a for a in mesh.axis_names if a not in axes]
    order = [mesh.axis_index(a) for a in other] + [mesh.axis_index(a) for a in axes]
    k = math.prod(mesh.axis_size(a) for a in axes)
    devs = np.transpose(mesh.devices, order).reshape(-1, k)
    return tuple(tuple(int(d) for d in row) for row in devs)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A collective as a reshard: the global shape, the two layouts, and how a device's tile
    maps to its logical tile (`in_shape`) and back (`out_shape`)."""

    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    in_shape: tuple[int, ...] | None   # the logical src tile (None: the tile with leading 1s)
    out_shapes: tuple              # ((device, the user-visible result tile shape), ...)
    scale: int = 1                  # avg: divide the sum by this

    def out_shape(self, device: int) -> tuple[int, ...]:
        return dict(self.out_shapes)[device]

    def in_tile(self, tile):
        """A device's tile as its tile of the logical tensor (a reshape, no copy when contiguous)."""
        if self.in_shape is not None:
            return tile.reshape(self.in_shape)
        return tile.reshape((1,) * (len(self.shape) - tile.ndim) + tuple(tile.shape))


def _roots_mesh(mesh: Mesh, axes: tuple[str, ...], root: int) -> tuple[Mesh, tuple[str, ...]]:
    other = tuple(a for a in mesh.axis_names if a not in axes)
    gsize = [mesh.axis_size(a) for a in axes]
    coords = np.unravel_index(root, gsize)
    index = [slice(None)] * mesh.ndim
    for a, c in zip(axes, coords):
        index[mesh.axis_index(a)] = int(c)
    devs = mesh.devices[tuple(index)]
    if not other:
        return Mesh(np.asarray(devs).reshape(1), (_ROOT_AXIS,)), ()
    return Mesh(devs, other), other


def _check_dim(dim, ndim: int, what: str, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"{op}: {what} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{op}: {what}={dim} is out of range for tiles with {ndim} dimension(s)")
    return int(dim) % ndim


def _check_root(root, k: int, op: str) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{op}: root must be an int (the index along the group), got {root!r}")
    if not 0 <= root < k:
        raise ValueError(f"{op}: root={root} is not an index of a group of {k} devices")
    return int(root)


@memo(maxsize=1024)
def problem(op: str, mesh: Mesh, axes: tuple[str, ...], tile: tuple[int, ...], *, sizes=None,
            dim: int = 0, root: int = 0, reduce_op: str = "sum", split_dim: int = 0,
            concat_dim: int = 0) -> Problem:
    """The reshard that performs collective `op` on tiles of shape `tile` (for all_gather and
    gather, `sizes` are the tiles' sizes along `dim` in group order)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {OPS}")
    other = tuple(a for a in mesh.axis_names if a not in axes)
    lead = tuple(mesh.axis_size(a) for a in other)
    lead_spec = other
    ones = (1,) * len(lead)
    k = math.prod(mesh.axis_size(a) for a in axes)
    n = len(tile)
    rep = (None,) * n
    devices = mesh.device_ids

    def layout(m, lspec, spec, partial=()):
        return Layout(m, tuple(lspec) + tuple(spec), partial=partial)

    if op in ("all_reduce", "reduce", "reduce_scatter"):
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{op}: op must be one of {REDUCE_OPS}, got {reduce_op!r}")
        pop = "sum" if reduce_op == "avg" else reduce_op
        src = layout(mesh, lead_spec, rep, partial={a: pop for a in axes})
        shape = lead + tile
        scale = k if reduce_op == "avg" else 1
        if op == "all_reduce":
            dst = layout(mesh, lead_spec, rep)
            return Problem(shape, src, dst, None, tuple((d, tile) for d in devices), scale)
        if op == "reduce":
            root = _check_root(root, k, op)
            rm, rspec = _roots_mesh(mesh, axes, root)
            dst = layout(rm, rspec, rep)
            return Problem(shape, src, dst, None, tuple((d, tile) for d in rm.device_ids), scale)
        dim = _check_dim(dim, n, "dim", op) if n else _check_dim(dim, 1, "dim", op)
        spec = list(rep)
        spec[dim] = axes
        dst = layout(mesh, lead_spec, spec)
        t = dst.tiles(shape)
        return Problem(shape, src, dst, None,
                       tuple((d, tuple(b - a for a, b in t.boxes[d])[len(lead):]) for d in devices), scale)
    if op in ("all_gather", "gather"):
        dim = _check_dim(dim, n, "dim", op)
        sizes = tuple(sizes) if sizes is not None else (tile[dim],) * k
        spec = list(rep)
        spec[dim] = Blocks(axes, sizes)
        src = layout(mesh, lead_spec, spec)
        full = tile[:dim] + (sum(sizes),) + tile[dim + 1:]
        shape = lead + full
        if op == "all_gather":
            dst = layout(mesh, lead_spec, rep)
            return Problem(shape, src, dst, None, tuple((d, full) for d in devices))
        root = _check_root(root, k, op)
        rm, rspec = _roots_mesh(mesh, axes, root)
        dst = layout(rm, rspec, rep)
        return Problem(shape, src, dst, None, tuple((d, full) for d in rm.device_ids))
    if op in ("broadcast", "scatter"):
        root = _check_root(root, k, op)
        rm, rspec = _roots_mesh(mesh, axes, root)
        src = layout(rm, rspec, rep)
        shape = lead + tile
        if op == "broadcast":
            dst = layout(mesh, lead_spec, rep)
            return Problem(shape, src, dst, None, tuple((d, tile) for d in devices))
        dim = _check_dim(dim, n, "dim", op)
        spec = list(rep)
        spec[dim] = axes
        dst = layout(mesh, lead_spec, spec)
        t = dst.tiles(shape)
        return Problem(shape, src, dst, None,
                       tuple((d, tuple(b - a for a, b in t.boxes[d])[len(lead):]) for d in devices))
    # all_to_all
    s = _check_dim(split_dim, n, "split_dim", op)
    c = _check_dim(concat_dim, n, "concat_dim", op)
    if tile[s] % k:
        raise ValueError(f"all_to_all: split_dim {s} has size {tile[s]}, not divisible by the group's "
                         f"{k} devices (use all_to_all_v for uneven splits)")
    q = tile[s] // k
    if s != c:
        shape = lead + tile[:c] + (tile[c] * k,) + tile[c + 1:]
        sspec, dspec = list(rep), list(rep)
        sspec[c], dspec[s] = axes, axes
        out = list(shape[len(lead):])
        out[s] = q
        return Problem(shape, layout(mesh, lead_spec, sspec), layout(mesh, lead_spec, dspec),
                       None, tuple((d, tuple(out)) for d in devices))
    # split == concat: the tile as (..., k, q, ...); an extra dimension of size k in front of
    # it holds the senders; the receivers' dimension is split
    shape = lead + tile[:s] + (k, k, q) + tile[s + 1:]
    sspec = list(rep[:s]) + [axes, None, None] + list(rep[s + 1:])
    dspec = list(rep[:s]) + [None, axes, None] + list(rep[s + 1:])
    return Problem(shape, layout(mesh, lead_spec, sspec), layout(mesh, lead_spec, dspec),
                   ones + tile[:s] + (1, k, q) + tile[s + 1:], tuple((d, tile) for d in devices))
