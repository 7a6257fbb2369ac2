"""torch DTensor adapter: move a DTensor to a *different* DeviceMesh.

    from torch.distributed.tensor import Shard, Replicate
    from meshcomm.adapters.dtensor import reshard_dtensor
    mc.init(backend="torch")                          # under torchrun or mpiexec
    y = reshard_dtensor(x, other_mesh, [Shard(1), Replicate()])

DTensor's own `redistribute` refuses a different mesh ("Cross device mesh comm not
supported yet"). Here the DeviceMesh and placements on both sides become meshcomm Layouts
(DeviceMesh.mesh holds global ranks; meshcomm device id = rank * devices_per_process, i.e.
the rank itself with one device per process), meshcomm plans and runs the transfer, and
the local result is wrapped with `DTensor.from_local(..., run_check=False)` with the global
shape and a contiguous global stride.

* Every rank of the world calls `reshard_dtensor` (SPMD), with the DTensor it holds on the
  source mesh (ranks outside the source mesh hold DTensor's empty local tensor).
* Ranks outside the target mesh get a DTensor on the target mesh whose local tensor is
  empty (`torch.empty(0)`), which is DTensor's own convention for non-participating ranks
  (see `DTensor.from_local` and `distribute_tensor`).
* Placements: `Shard(d)`, `Replicate()`, `Partial()` (sum only). Several mesh dimensions
  sharding the same tensor dimension follow DTensor's nested `torch.chunk` rule (mesh dim
  order, or the spec's `shard_order`); uneven nested splits become meshcomm `Blocks`.
  `_StridedShard` is not supported.
* The result does not carry autograd history (resharding is a data movement here).

A state dict at once: `reshard_state_dict(sd, device_mesh, placements)` moves every
DTensor of `sd` ({name: DTensor}, e.g. a model's weights) to `device_mesh` in ONE
`meshcomm.reshard_many` call (planned together, one message per pair of processes per stage),
with one placements list for all, a dict {name: placements}, or a callable name ->
placements; it returns {name: DTensor} in `sd`'s order. Every rank passes the same names.

Which rank holds which chunk: the rank at mesh coordinate c (its index in
`DeviceMesh.mesh`, `DeviceMesh.get_coordinate()`) holds chunk c[d] along each mesh dim d
that shards, nested in mesh-dim order. That is torch's own rule
(`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`), which DTensor's
local shapes, `distribute_tensor(..., src_data_rank=None)` and checkpoint offsets follow,
whatever the order of the ranks: on `DeviceMesh("cpu", [2, 0, 3, 1])` rank 2 holds chunk 0.
On a DeviceMesh whose ranks are not ascending along a sharded dimension, torch 2.13's own
collectives over that dimension (`full_tensor()`, `redistribute`, the scatter inside
`distribute_tensor`) order the members by global rank instead, because its process groups
sort their ranks, so they contradict that rule (and `distribute_tensor` misplaces uneven
shards there). Build such DTensors with `DTensor.from_local` or
`distribute_tensor(..., src_data_rank=None)`; this adapter reads and writes chunks by the
coordinate rule on every mesh.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ..handle import Handle
from ..layout import Blocks, Layout, chunk_bounds, normalize_shape
from ..mesh import Mesh

__all__ = ["layout_from_placements", "placements_from_layout", "reshard_dtensor", "reshard_state_dict",
           "nested_chunk_sizes"]

PlacementsArg = Union[Sequence[Placement], Mapping[str, Sequence[Placement]], Callable[[str], Sequence[Placement]]]


def mesh_ranks_and_names(device_mesh) -> tuple[np.ndarray, tuple[str, ...]]:
    ranks = getattr(device_mesh, "mesh", device_mesh)
    if isinstance(ranks, torch.Tensor):
        ranks = ranks.cpu().numpy()
    ranks = np.asarray(ranks, dtype=np.int64)
    names = getattr(device_mesh, "mesh_dim_names", None)
    if not names:
        names = tuple(f"d{i}" for i in range(ranks.ndim))
    return ranks, tuple(names)


def nested_chunk_sizes(n: int, ways: Sequence[int]) -> tuple[int, ...]:
    """Sizes DTensor gives one tensor dimension of size n sharded over mesh dims of sizes
    `ways` (outer first): torch.chunk over the first, then each piece over the next, ..."""
    sizes = [n]
    for k in ways:
        nxt = []
        for s in sizes:
            nxt.extend(b - a for a, b in chunk_bounds(s, k))
        sizes = nxt
    return tuple(sizes)


def _shard_order(placements, shard_order=None) -> dict[int, list[int]]:
    """tensor dim -> mesh dims sharding it, outer first."""
    order: dict[int, list[int]] = {}
    if shard_order:
        for entry in shard_order:
            order[int(entry.tensor_dim)] = [int(m) for m in entry.mesh_dims]
        return order
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            order.setdefault(int(p.dim), []).append(mdim)
    return order


def layout_from_placements(device_mesh, placements: Sequence[Placement], shape, *,
                           devices_per_process: int = 1, shard_order=None) -> Layout:
    """The meshcomm Layout of a DTensor with these placements on `device_mesh`.

    `device_mesh` is a DeviceMesh (or an array of global ranks, for planning without a
    process group). Device id of rank r is r * devices_per_process.
    """
    shape = normalize_shape(shape)
    ranks, names = mesh_ranks_and_names(device_mesh)
    placements = tuple(placements)
    if len(placements) != ranks.ndim:
        raise ValueError(f"{len(placements)} placement(s) {placements} for a {ranks.ndim}-d device "
                         f"mesh of shape {tuple(ranks.shape)}; give one per mesh dimension")
    partial = []
    for mdim, p in enumerate(placements):
        if type(p).__name__ == "_StridedShard":
            raise ValueError(f"mesh dimension {mdim} ({names[mdim]}): _StridedShard is not supported")
        if isinstance(p, Shard):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise ValueError(f"mesh dimension {mdim} ({names[mdim]}): {p} but the tensor has "
                                 f"{len(shape)} dimension(s) (shape {shape})")
        elif isinstance(p, Partial):
            op = str(getattr(p, "reduce_op", "sum"))
            if op != "sum":
                raise ValueError(f"mesh dimension {mdim} ({names[mdim]}): Partial({op!r}) is not "
                                 "supported; only Partial('sum')")
            partial.append(names[mdim])
        elif not isinstance(p, Replicate):
            raise TypeError(f"mesh dimension {mdim} ({names[mdim]}): unsupported placement {p!r}")
    norm = tuple(Shard(p.dim + len(shape)) if isinstance(p, Shard) and p.dim < 0 else p
                 for p in placements)
    order = _shard_order(norm, shard_order)
    spec: list[Any] = [None] * len(shape)
    for tdim, mdims in order.items():
        axes = tuple(names[m] for m in mdims)
        ways = [int(ranks.shape[m]) for m in mdims]
        sizes = nested_chunk_sizes(shape[tdim], ways)
        flat = tuple(b - a for a, b in chunk_bounds(shape[tdim], math.prod(ways)))
        spec[tdim] = axes if sizes == flat else Blocks(axes, sizes)
    mesh = Mesh(ranks * int(devices_per_process), names)
    return Layout(mesh, tuple(spec), partial=tuple(partial))


def placements_from_layout(layout: Layout) -> tuple[Placement, ...]:
    """DTensor placements for a Layout whose splits DTensor can express (one entry per mesh
    axis: Shard, Replicate or Partial). Raises ValueError otherwise."""
    out: list[Placement] = []
    for axis in layout.mesh.axis_names:
        if axis in layout.partial:
            out.append(Partial())
            continue
        found = None
        for dim, e in enumerate(layout.spec):
            axes = () if e is None else (e.axes if isinstance(e, Blocks) else e)
            if axis in axes:
                if isinstance(e, Blocks):
                    raise ValueError(f"dimension {dim} uses explicit Blocks {e}; DTensor placements "
                                     "cannot express it")
                found = Shard(dim)
        out.append(found or Replicate())
    # DTensor applies shardings of one tensor dim in mesh-dim order: that must match the spec.
    for dim, e in enumerate(layout.spec):
        if e is not None and not isinstance(e, Blocks) and len(e) > 1:
            pos = [layout.mesh.axis_names.index(a) for a in e]
            if pos != sorted(pos):
                raise ValueError(f"dimension {dim} is split over {e} (major to minor), which is not "
                                 f"the mesh order {layout.mesh.axis_names}; DTensor cannot express it")
    return tuple(out)


def _ctx_info() -> tuple[Any, int]:
    from .. import runtime
    ctx = runtime.current()
    dpp = int(getattr(ctx, "devices_per_process", 1) or 1) if ctx is not None else 1
    return ctx, dpp


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _world_rank(ctx) -> int:
    import torch.distributed as dist
    if ctx is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("resharding DTensors across processes needs meshcomm.init(backend=...) first")
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    ctx_rank = getattr(ctx, "rank", rank)
    if ctx is not None and ctx_rank != rank:
        raise RuntimeError(f"meshcomm rank {ctx_rank} differs from torch.distributed rank {rank}")
    return rank


def _prepare(dt, device_mesh, placements, dpp, rank):
    """(src Layout, dst Layout, {device: this rank's tile} or {}, global shape) of one DTensor,
    or ValueError/TypeError."""
    if not isinstance(dt, DTensor):
        raise TypeError(f"need a DTensor, got {type(dt).__name__}")
    shape = tuple(dt.shape)
    spec = getattr(dt, "_spec", None)
    order = getattr(spec, "shard_order", None) if spec is not None else None
    src = layout_from_placements(dt.device_mesh, dt.placements, shape, devices_per_process=dpp,
                                 shard_order=order)
    dst = layout_from_placements(device_mesh, placements, shape, devices_per_process=dpp)
    me = rank * dpp
    x = {}
    if me in src.mesh:
        local = dt.to_local().detach()
        want = tuple(b - a for a, b in src.box(me, shape))
        if tuple(local.shape) != want:
            raise ValueError(f"rank {rank}: local tensor of shape {tuple(local.shape)} but placements "
                             f"{tuple(dt.placements)} give it {want} of global shape {shape}")
        x[me] = local.contiguous()
    return src, dst, x, shape


def _wrap(out, me, like, device_mesh, placements, shape, dtype):
    """This rank's dst tile (or DTensor's empty tensor outside the mesh) as a DTensor."""
    if out is None:
        out = {}
    local = out.get(me) if isinstance(out, dict) else out
    if local is None:               # from_local takes shape=() for "not given": a 0-d local says it
        local = torch.empty(0, dtype=dtype, device=like.device) if shape else torch.zeros((), dtype=dtype,
                                                                                          device=like.device)
    return DTensor.from_local(local, device_mesh, tuple(placements), run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def reshard_dtensor(dt: DTensor, device_mesh, placements: Sequence[Placement], *,
                    backend: str | None = None, async_op: bool = False) -> DTensor:
    """Move `dt` to `device_mesh` (any DeviceMesh of the same world, overlapping or not)
    with `placements`. Every rank calls it; see the module docstring for the conventions.
    With `async_op=True` it returns a `meshcomm.Handle` whose `.wait()` gives the DTensor."""
    from .. import api
    from ..runtime.program import checking
    ctx, dpp = _ctx_info()
    with checking("reshard"):                   # the other ranks raise too, naming this one
        if not isinstance(dt, DTensor):
            raise TypeError(f"reshard_dtensor needs a DTensor, got {type(dt).__name__}")
        _check_placements(placements)
        rank = _world_rank(ctx)
        src, dst, x, shape = _prepare(dt, device_mesh, placements, dpp, rank)
    me = rank * dpp
    # Without meshcomm.init (a one-rank world) this process owns every device.
    res = api.reshard(x, src, dst, shape=shape, dtype=dt.dtype, backend=backend, async_op=async_op)
    like = dt.to_local()

    def finish(out):
        return _wrap(out, me, like, device_mesh, placements, shape, dt.dtype)
    if async_op:
        return Handle(lambda: finish(res.wait()), future=res)
    return finish(res)


def _check_placements(pl) -> None:
    if isinstance(pl, Placement) or not isinstance(pl, Sequence):
        raise TypeError(f"placements must be a list of Placements (one per mesh dimension), got {pl!r}")


def _placements_of(placements: PlacementsArg, names) -> dict:
    """{name: placements} from one list for all, a dict by name, or a callable name -> list."""
    if isinstance(placements, Mapping):
        extra = [n for n in placements if n not in names]
        missing = [n for n in names if n not in placements]
        if extra or missing:
            raise ValueError("placements by name must name exactly the state dict's entries: " +
                             (f"no entry {extra[:4]} in the state dict" if extra else "") +
                             ("; " if extra and missing else "") +
                             (f"no placements for {missing[:4]}" if missing else ""))
        return {n: placements[n] for n in names}
    if callable(placements) and not isinstance(placements, (Sequence, Placement)):
        return {n: placements(n) for n in names}
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(f"placements: a list of Placements (one per mesh dimension), a dict {{name: list}} "
                        f"or a callable name -> list, got {type(placements).__name__}")
    return {n: placements for n in names}


def reshard_state_dict(sd: Mapping[str, DTensor], device_mesh, placements: PlacementsArg, *,
                       backend: str | None = None, async_op: bool = False, bucket_mb=None) -> dict:
    """Move every DTensor of `sd` to `device_mesh` in one batch (`meshcomm.reshard_many`).

    `placements`: one list for every entry, a dict {name: list}, or a callable name -> list.
    Returns {name: DTensor} (in `sd`'s order); with `async_op=True` a `meshcomm.Handle`
    whose `.wait()` gives it. Every rank calls it with the same names (SPMD); errors name
    the entry."""
    from .. import api
    from ..runtime.program import checking
    ctx, dpp = _ctx_info()
    items = {}
    with checking("reshard_many"):              # the other ranks raise too, naming this one
        rank = _world_rank(ctx)
        if not isinstance(sd, Mapping):
            raise TypeError(f"reshard_state_dict takes a dict {{name: DTensor}}, got {type(sd).__name__}")
        names = list(sd)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"state dict keys must be str, got {n!r}")
        per = _placements_of(placements, names)
        for n in names:
            try:
                if not isinstance(sd[n], DTensor):
                    raise TypeError(f"need a DTensor, got {type(sd[n]).__name__}")
                pl = per[n]
                _check_placements(pl)
                items[n] = _prepare(sd[n], device_mesh, tuple(pl), dpp, rank) + (tuple(pl),)
            except (ValueError, TypeError) as e:
                raise type(e)(f"state dict entry {n!r}: {e}") from None
    me = rank * dpp
    if not items:
        return Handle(result={}) if async_op else {}
    batch = sorted(items)           # the same batch whatever order each rank built its dict in
    res = api.reshard_many({n: items[n][2] for n in batch if items[n][2]}, {n: items[n][0] for n in batch},
                           {n: items[n][1] for n in batch}, shapes={n: items[n][3] for n in batch},
                           dtypes={n: sd[n].dtype for n in batch}, backend=backend, async_op=async_op,
                           bucket_mb=bucket_mb)

    def finish(out):
        out = out or {}
        return {n: _wrap(out.get(n), me, sd[n].to_local(), device_mesh, items[n][4], items[n][3], sd[n].dtype)
                for n in items}
    if async_op:
        return Handle(lambda: finish(res.wait()), future=res)
    return finish(res)
