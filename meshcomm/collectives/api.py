"""The collective entry points: validate names, then run in this process or under the runtime."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .. import arrays, runtime
from ..caches import memo
from ..handle import Handle
from ..planning import plan
from ..runtime.collective_call import Request, build, coded_dims, finish_tiles, run
from ..runtime.collective_input import local_facts, tiles_of
from .layouts import REDUCE_OPS, gather_sizes, group_axes, problem
from .p2p import recv, send

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
           "scatter", "barrier", "send", "recv", "collective_plan"]


def _check_op(op: str, reduce_op) -> str:
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"{op}: op must be one of {', '.join(REDUCE_OPS)}, got {reduce_op!r}")
    return reduce_op


def _check_int(op: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{op}: {name} must be an int, got {v!r}")
    return int(v)


def _check_compression(op: str, compression):
    """The compression= argument as a codec, "auto" or None (ValueError/TypeError naming a bad one)."""
    if compression is None:
        return None
    from .. import compression as codecs
    try:
        return codecs.coerce(compression)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{op}: {e}") from None


_CHECKED = {"all_reduce": ("reduce_op", "compression"), "all_gather": ("dim", "compression"),
            "reduce_scatter": ("dim", "reduce_op", "compression"), "broadcast": ("root",),
            "reduce": ("root", "reduce_op"), "all_to_all": ("split_dim", "concat_dim"),
            "gather": ("root", "dim"), "scatter": ("root", "dim")}


def _request(op: str, mesh, axes, dim=0, root=0, reduce_op="sum", split_dim=0, concat_dim=0,
             compression=None) -> Request:
    """The validated Request of a call (ValueError/TypeError naming a bad argument); the same
    object for the same arguments, so a repeated call finds its compiled form at once."""
    args = (op, mesh, axes, dim, root, reduce_op, split_dim, concat_dim)
    if compression is None:
        try:
            hash(args)
        except TypeError:
            pass
        else:
            return _request_of(*args)
    return _build_request(*args, compression)


@memo(256, typed=True)
def _request_of(*args) -> Request:
    return _build_request(*args)


def _build_request(op, mesh, axes, dim, root, reduce_op, split_dim, concat_dim, compression=None) -> Request:
    ax = group_axes(mesh, axes)
    checked = _CHECKED[op]
    kw = {"compression": _check_compression(op, compression)} if "compression" in checked else {}
    for name, v in (("dim", dim), ("root", root), ("split_dim", split_dim), ("concat_dim", concat_dim)):
        if name in checked:
            kw[name] = _check_int(op, name, v)
    if "reduce_op" in checked:
        kw["reduce_op"] = _check_op(op, reduce_op)
    return Request(op, mesh, ax, **kw)


def _call(req: Request, x, backend, async_op):
    ctx = runtime.current()
    if ctx is not None and backend != "local":
        return run(ctx, req, x, backend=backend, async_op=async_op)
    runtime.no_context(backend, req.op)
    result = _local(req, x)
    return Handle(result=result) if async_op else result


def _problem(req: Request, tile: tuple, tile_shapes):
    """The Problem of a call whose every tile is here: a gather's groups each gather their
    own tiles' sizes (layouts.gather_sizes; they may differ between groups); the rest as
    under a launcher (collective_call.build)."""
    if req.op not in ("all_gather", "gather"):
        return build(req, tile, tile_shapes)
    d = req.dim % len(tile)
    return problem(req.op, req.mesh, req.axes, tile[:d] + (0,) + tile[d + 1:],
                   sizes=gather_sizes(req.mesh, req.axes, d, tile_shapes), dim=req.dim, root=req.root)


def _local(req: Request, x):
    """Without a launcher: every device's tile is here; the plan runs in memory."""
    from ..backends.local import LocalBackend
    owned = tuple(req.mesh.device_ids)
    where = "this process (without meshcomm.init it owns every device" + runtime.init_hint() + ")"
    tiles, bare = tiles_of(req, x, owned, where)
    facts = local_facts(req, tiles)
    if facts["tile"] is None:
        raise ValueError(f"{req.op}: no tile given, so shape and dtype are unknown")
    prob = _problem(req, facts["tile"], {d: tuple(v.shape) for d, v in tiles.items()})
    src_devs = set(prob.src.mesh.device_ids)
    kind = facts["kind"]
    shards = {d: prob.in_tile(np.asarray(v) if kind == "jax" else v)
              for d, v in tiles.items() if d in src_devs}
    p = plan(prob.shape, facts["dtype"][0], prob.src, prob.dst)
    comp = None
    if req.compression is not None:
        from ..backends import codec_cost
        codec_cost.check(req.compression, facts["dtype"][0], facts["devtype"], req.op)
        comp = codec_cost.resolve(req.compression, p, local=True, strip=coded_dims(req, prob))
    if comp is not None:                # the same round trips as under a launcher
        from ..backends.compressed import execute_local
        out = execute_local(p, shards, next(iter(shards.values())), comp)
    else:
        out = LocalBackend().execute(p, shards, like=next(iter(shards.values())))
    res = finish_tiles(req, prob, out, bare, owned)
    if kind == "jax":
        import jax
        if bare:
            return None if res is None else jax.device_put(res, arrays.jax_device(owned[0]))
        return arrays.to_jax_devices(res)
    return res


def all_reduce(x, mesh, axes, op: str = "sum", *, backend=None, async_op: bool = False, compression=None):
    """Every device gets the elementwise `op` (sum, prod, min, max, avg) of its group's tiles.
    `compression`: a codec, "bf16", "fp16", "zfp(...)" or "auto" (README, Compression)."""
    req = _request("all_reduce", mesh, axes, reduce_op=op, compression=compression)
    return _call(req, x, backend, async_op)


def all_gather(x, mesh, axes, dim: int = 0, *, backend=None, async_op: bool = False, compression=None):
    """Every device gets its group's tiles concatenated along `dim` in group order (the tiles'
    sizes along `dim` may differ, within a group and, without a launcher, between groups;
    under a launcher every group must have the same sizes). With `compression`
    each tile is coded once by its owner: every device gets the codec's round trip of every
    tile, its own included."""
    req = _request("all_gather", mesh, axes, dim=dim, compression=compression)
    return _call(req, x, backend, async_op)


def reduce_scatter(x, mesh, axes, dim: int = 0, op: str = "sum", *, backend=None, async_op: bool = False,
                   compression=None):
    """Device i of a group gets chunk i (torch.chunk of `dim`) of the `op` of the group's tiles.
    With `compression` the addends are coded once (one-shot) or the partial sums at every hop
    (ring), as the cost model picks (planners/compressed.py gives both error bounds)."""
    req = _request("reduce_scatter", mesh, axes, dim=dim, reduce_op=op, compression=compression)
    return _call(req, x, backend, async_op)


def broadcast(x, mesh, axes, root: int = 0, *, backend=None, async_op: bool = False):
    """Every device gets the tile of its group's device `root`. Other devices' tiles (or None)
    are checked for shape and dtype; their values are not used."""
    req = _request("broadcast", mesh, axes, root=root)
    return _call(req, x, backend, async_op)


def reduce(x, mesh, axes, root: int = 0, op: str = "sum", *, backend=None, async_op: bool = False):
    """The group's device `root` gets the `op` of the group's tiles; the others get None."""
    req = _request("reduce", mesh, axes, root=root, reduce_op=op)
    return _call(req, x, backend, async_op)


def all_to_all(x, mesh, axes, split_dim: int = 0, concat_dim: int = 0, *, backend=None,
               async_op: bool = False):
    """Device i's tile is split into equal chunks along `split_dim`; chunk j goes to device j of
    the group, which concatenates what it gets along `concat_dim` in group order (uneven rows:
    `all_to_all_v`)."""
    req = _request("all_to_all", mesh, axes, split_dim=split_dim, concat_dim=concat_dim)
    return _call(req, x, backend, async_op)


def gather(x, mesh, axes, root: int = 0, dim: int = 0, *, backend=None, async_op: bool = False):
    """The group's device `root` gets the group's tiles concatenated along `dim`; others None."""
    req = _request("gather", mesh, axes, root=root, dim=dim)
    return _call(req, x, backend, async_op)


def scatter(x, mesh, axes, root: int = 0, dim: int = 0, *, backend=None, async_op: bool = False):
    """Device i of the group gets chunk i (torch.chunk of `dim`) of device `root`'s tile."""
    req = _request("scatter", mesh, axes, root=root, dim=dim)
    return _call(req, x, backend, async_op)


def barrier(mesh, axes=None, *, backend=None, async_op: bool = False):
    """Returns once every process has reached it (an all-reduce of one int per device; under a
    launcher every process calls it). `axes` None: all axes of the mesh."""
    axes = tuple(mesh.axis_names) if axes is None else axes
    ctx = runtime.current()
    devs = mesh.device_ids if ctx is None or backend == "local" else ctx.ownership.owned(mesh)
    x: Any = {d: np.zeros(1, dtype=np.int32) for d in devs}
    h = all_reduce(x, mesh, axes, backend=backend, async_op=async_op)
    if async_op:
        return Handle(lambda: (h.wait(), None)[1])
    return None


def collective_plan(op: str, tile_shape, dtype, mesh, axes, *, sizes=None, dim: int = 0, root: int = 0,
                    reduce_op: str = "sum", split_dim: int = 0, concat_dim: int = 0, topology=None):
    """The Plan a collective runs (printable with `.explain()`, checked by `meshcomm.verify`).
    `sizes` (all_gather, gather): the tiles' sizes along `dim`, one tuple in group order for
    every group, or one tuple per group (layouts.groups order) where they differ."""
    from ..layout import normalize_shape
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
