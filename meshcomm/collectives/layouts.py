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

Gathers whose groups have different sizes (`problem(sizes=...)` with one tuple per group,
`gather_sizes`) cannot keep a leading dimension per group: a Layout's blocks along one
dimension are the same for every coordinate of another. Their logical tensor has the
tile's dimensions alone, dim holding every group's gathered result one after the other
(groups in `groups` order): the src splits dim over the outer axes then the group's axes
(Blocks of every tile's size), the dst over the outer axes alone (Blocks of every group's
total), replicated over the group (all_gather) or on the roots' mesh (gather).
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

__all__ = ["OPS", "REDUCE_OPS", "Problem", "group_axes", "groups", "gather_sizes", "problem"]

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


def gather_sizes(mesh: Mesh, axes, dim: int, tile_shapes) -> tuple[tuple[int, ...], ...]:
    """The tiles' sizes along `dim` for a gather: one tuple per group (`groups` order), the
    sizes of its members' tiles in group order. `tile_shapes` maps every device of the mesh
    to its tile's shape; `dim` may count from the end. `problem(sizes=...)` takes the result
    as it is."""
    axes = group_axes(mesh, axes)
    out = []
    for g in groups(mesh, axes):
        row = []
        for d in g:
            try:
                shape = tuple(tile_shapes[d])
            except KeyError:
                raise ValueError(f"gather_sizes: no tile shape for device {d}") from None
            if not -len(shape) <= dim < len(shape):
                raise ValueError(f"gather_sizes: dim={dim} is out of range for device {d}'s tile "
                                 f"of shape {shape}")
            row.append(int(shape[dim]))
        out.append(tuple(row))
    return tuple(out)


def _gather_sizes_arg(sizes, tile: tuple[int, ...], dim: int, gs, op: str):
    """`sizes` as (the sizes every group shares, None) or (None, one tuple per group) when
    the groups' sizes differ."""
    k = len(gs[0])
    if sizes is None:
        return (tile[dim],) * k, None
    sizes = tuple(sizes)
    if sizes and all(isinstance(s, (tuple, list)) for s in sizes):
        per = tuple(tuple(int(x) for x in s) for s in sizes)
        if len(per) != len(gs) or any(len(s) != k for s in per):
            raise ValueError(f"{op}: sizes must hold {len(gs)} group(s) of {k} sizes, got "
                             f"{[list(s) for s in per]}")
        if any(x < 0 for s in per for x in s):
            raise ValueError(f"{op}: sizes must be non-negative, got {[list(s) for s in per]}")
        if all(s == per[0] for s in per):
            return per[0], None
        return None, per
    return tuple(int(x) for x in sizes), None


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
    gather, `sizes` are the tiles' sizes along `dim`: one tuple in group order that every
    group shares, or one such tuple per group in `groups` order, as `gather_sizes` gives;
    `tile[dim]` is then not used)."""
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
        dim = _check_dim(dim, n, "dim", op)
        spec = list(rep)
        spec[dim] = axes
        dst = layout(mesh, lead_spec, spec)
        t = dst.tiles(shape)
        return Problem(shape, src, dst, None,
                       tuple((d, tuple(b - a for a, b in t.boxes[d])[len(lead):]) for d in devices), scale)
    if op in ("all_gather", "gather"):
        dim = _check_dim(dim, n, "dim", op)
        sizes, per_group = _gather_sizes_arg(sizes, tile, dim, groups(mesh, axes), op)
        if per_group is not None:
            return _uneven_gather(op, mesh, axes, tile, dim, root, k, per_group)
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


def _uneven_gather(op: str, mesh: Mesh, axes: tuple[str, ...], tile: tuple[int, ...], dim: int,
                   root: int, k: int, per_group: tuple[tuple[int, ...], ...]) -> Problem:
    """A gather whose groups have different sizes: dim holds every group's result one after
    the other (the module docstring)."""
    other = tuple(a for a in mesh.axis_names if a not in axes)
    totals = tuple(sum(s) for s in per_group)
    shape = tile[:dim] + (sum(totals),) + tile[dim + 1:]
    rep = [None] * len(tile)
    sspec, dspec = list(rep), list(rep)
    sspec[dim] = Blocks(other + axes, tuple(x for s in per_group for x in s))
    dspec[dim] = Blocks(other, totals)
    src = Layout(mesh, tuple(sspec))

    def out(t):
        return tile[:dim] + (t,) + tile[dim + 1:]
    if op == "all_gather":
        dst = Layout(mesh, tuple(dspec))
        return Problem(shape, src, dst, None,
                       tuple((d, out(t)) for g, t in zip(groups(mesh, axes), totals) for d in g))
    root = _check_root(root, k, op)
    rm, _ = _roots_mesh(mesh, axes, root)
    dst = Layout(rm, tuple(dspec))
    return Problem(shape, src, dst, None,
                   tuple((g[root], out(t)) for g, t in zip(groups(mesh, axes), totals)))
