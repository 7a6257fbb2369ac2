"""The collective entry points: validate names, then run in this process or under the runtime."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .. import runtime
from ..handle import Handle
from ..planning import plan
from ..runtime.collective_call import collective_local, run, shared_request as _request
from ..runtime.local_program import fill_out
from .layouts import group_axes
from .p2p import recv, send

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
           "scatter", "barrier", "send", "recv", "collective_plan"]


def _call(op: str, mesh, axes, kw: dict, x, backend, async_op, out=None):
    """`out`: buffers for the results ({device: buffer}, or one where x is bare), checked and
    filled as a Program's run fills them."""
    ctx = runtime.current()
    if ctx is not None and backend != "local":
        return run(ctx, (op, mesh, axes, kw), x, backend=backend, async_op=async_op, out=out)
    req = _request(op, mesh, axes, **kw)
    runtime.no_context(backend, req.op)
    result = collective_local(req, x)
    if out is not None:
        result = fill_out(result, out, req.op)
    return Handle(result=result) if async_op else result


def all_reduce(x, mesh, axes, op: str = "sum", *, backend=None, async_op: bool = False, compression=None,
               out=None):
    """Every device gets the elementwise `op` (sum, prod, min, max, avg) of its group's tiles.
    `compression`: a codec, "bf16", "fp16", "zfp(...)" or "auto" (README, Compression)."""
    return _call("all_reduce", mesh, axes, dict(reduce_op=op, compression=compression), x, backend, async_op, out)


def all_gather(x, mesh, axes, dim: int = 0, *, backend=None, async_op: bool = False, compression=None,
               out=None):
    """Every device gets its group's tiles concatenated along `dim` in group order (the tiles'
    sizes along `dim` may differ, within a group and between groups). With `compression`
    each tile is coded once by its owner: every device gets the codec's round trip of every
    tile, its own included."""
    return _call("all_gather", mesh, axes, dict(dim=dim, compression=compression), x, backend, async_op, out)


def reduce_scatter(x, mesh, axes, dim: int = 0, op: str = "sum", *, backend=None, async_op: bool = False,
                   compression=None, out=None):
    """Device i of a group gets chunk i (torch.chunk of `dim`) of the `op` of the group's tiles.
    With `compression` the addends are coded once (one-shot) or the partial sums at every hop
    (ring), as the cost model picks (planners/compressed.py gives both error bounds)."""
    return _call("reduce_scatter", mesh, axes, dict(dim=dim, reduce_op=op, compression=compression), x, backend, async_op, out)


def broadcast(x, mesh, axes, root: int = 0, *, backend=None, async_op: bool = False,
              out=None):
    """Every device gets the tile of its group's device `root`. Other devices' tiles (or None)
    are checked for shape and dtype; their values are not used. Where they pass None, they
    run the call's last Program: a root whose tile changed shape or dtype then makes every
    process raise "not in the same call" (the next call agrees first)."""
    return _call("broadcast", mesh, axes, dict(root=root), x, backend, async_op, out)


def reduce(x, mesh, axes, root: int = 0, op: str = "sum", *, backend=None, async_op: bool = False,
           out=None):
    """The group's device `root` gets the `op` of the group's tiles; the others get None."""
    return _call("reduce", mesh, axes, dict(root=root, reduce_op=op), x, backend, async_op, out)


def all_to_all(x, mesh, axes, split_dim: int = 0, concat_dim: int = 0, *, backend=None,
               async_op: bool = False, out=None):
    """Device i's tile is split into equal chunks along `split_dim`; chunk j goes to device j of
    the group, which concatenates what it gets along `concat_dim` in group order (uneven rows:
    `all_to_all_v`)."""
    return _call("all_to_all", mesh, axes, dict(split_dim=split_dim, concat_dim=concat_dim), x, backend, async_op, out)


def gather(x, mesh, axes, root: int = 0, dim: int = 0, *, backend=None, async_op: bool = False,
           out=None):
    """The group's device `root` gets the group's tiles concatenated along `dim`; others None."""
    return _call("gather", mesh, axes, dict(root=root, dim=dim), x, backend, async_op, out)


def scatter(x, mesh, axes, root: int = 0, dim: int = 0, *, backend=None, async_op: bool = False,
            out=None):
    """Device i of the group gets chunk i (torch.chunk of `dim`) of device `root`'s tile."""
    return _call("scatter", mesh, axes, dict(root=root, dim=dim), x, backend, async_op, out)


def barrier(mesh, axes=None, *, backend=None, async_op: bool = False):
    """Returns once every process has reached it (an all-reduce of one int per device; under a
    launcher every process calls it). `axes` None: all axes of the mesh."""
    axes = tuple(mesh.axis_names) if axes is None else axes
    ctx = runtime.current()
    devs = mesh.device_ids if ctx is None or backend == "local" else ctx.ownership.owned(mesh)
    x: Any = {d: np.zeros(1, dtype=np.int32) for d in devs}
    h = all_reduce(x, mesh, axes, backend=backend, async_op=async_op)
    if async_op:
        return Handle(lambda: (h.wait(), None)[1], future=h)
    return None


def collective_plan(op: str, tile_shape, dtype, mesh, axes, *, sizes=None, dim: int = 0, root: int = 0,
                    reduce_op: str = "sum", split_dim: int = 0, concat_dim: int = 0, topology=None):
    """The Plan a collective runs (printable with `.explain()`, checked by `meshcomm.verify`).
    `sizes` (all_gather, gather): the tiles' sizes along `dim`, one tuple in group order for
    every group, or one tuple per group (layouts.groups order) where they differ."""
    from ..layout import normalize_shape
    from .layouts import problem
    axes = group_axes(mesh, axes)
    tile = normalize_shape(tile_shape)
    if sizes is not None:
        d = dim % len(tile)
        tile = tile[:d] + (0,) + tile[d + 1:]
        sizes = tuple(tuple(int(x) for x in s) if isinstance(s, (tuple, list)) else int(s) for s in sizes)
    prob = problem(op, mesh, axes, tile, sizes=sizes, dim=dim, root=root, reduce_op=reduce_op,
                   split_dim=split_dim, concat_dim=concat_dim)
    return plan(prob.shape, dtype, prob.src, prob.dst, topology)


_ = Mapping
