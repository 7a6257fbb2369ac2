"""Collective Programs on mesh axes (see meshcomm.collectives): `Program.all_reduce` and the
others, and the eager collectives (cached Programs).

Construction agrees on the operation, mesh, axes, parameters, backend, dtype, array kind,
device type and tile shapes (a gather's tiles may differ along `dim`: every device's size
travels with the agreement), then decides once, from the tuning table, between ONE native
collective of a backend per group (`NativeKernel`: MPI's or torch.distributed's own call;
over MPI on a communicator the Program owns) and the collective's reshard plan
(`collectives.layouts.problem`, run by the reshard kernel).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

import numpy as np

from .. import arrays, settings
from .. import log as _log
from ..backends import codec_cost

from ..collectives.layouts import gather_sizes, groups, problem
from ..layout import normalize_shape
from ..mesh import Mesh
from ..planning import plan
from ..validate import check_out_buffer
from . import native_call
from .agreement import value
from .collective_input import (GATHERS, ROOTED, Request, check_declared, check_tile, local_facts, masked,  # noqa: F401
                               request, roots_of, tiles_of)
from .context import current, init_hint, no_context
from .local_program import LocalKernel, fill_out
from ..handle import Handle
from .plan_run import PlanRun
from .eager import eager, lookup
from .program import Program, checking, construct, new, outside, tags_of
from .tiles import consume, empty_like, fences_of, host_dtype, plain_torch, torch_unwrap

__all__ = ["Request", "run", "program", "tiles_of", "coded_dims", "build", "finish_tiles"]


def build(req: Request, tile: tuple, tile_shapes: Mapping[int, tuple] | None):
    """The Problem, from the agreed tile shape (and every device's, for a gather: each group
    gathers its own tiles' sizes, which may differ between groups: layouts.gather_sizes)."""
    sizes = None
    if req.op in GATHERS:
        d = req.dim % len(tile)
        if tile_shapes is None:
            sizes = (tile[d],) * len(groups(req.mesh, req.axes)[0])
        else:
            sizes = gather_sizes(req.mesh, req.axes, d, tile_shapes)
        tile = tile[:d] + (0,) + tile[d + 1:]
    return problem(req.op, req.mesh, req.axes, tile, sizes=sizes, dim=req.dim, root=req.root,
                   reduce_op=req.reduce_op, split_dim=req.split_dim, concat_dim=req.concat_dim)


def finish_tiles(req: Request, prob, out: Mapping[int, Any], bare: bool, owned: tuple[int, ...]):
    """The user-visible result: tiles reshaped back, averaged, None/omitted where a device of
    the mesh gets no result (reduce, gather: non-roots)."""
    res = {}
    for d, v in out.items():
        v = v.reshape(prob.out_shape(d))
        if prob.scale != 1:
            v = arrays.divided(v, prob.scale)
        res[d] = v
    if bare:
        return res.get(owned[0]) if owned else None
    return res


def _owned_tiles(ctx, req, x, owned):
    """This process's tiles of the mesh, checked locally."""
    ctx.ownership.check_mesh(req.mesh)
    if owned:
        return tiles_of(req, x, owned, f"rank {ctx.rank}")
    if x is not None and not (isinstance(x, Mapping) and not x):
        raise ValueError(f"{req.op}: rank {ctx.rank} owns no device of the mesh {req.mesh} but passed "
                         "a tile; pass None (or an empty dict)")
    return {}, not isinstance(x, Mapping)


@dataclasses.dataclass(frozen=True)
class Agreed:
    tile: tuple
    shapes: Mapping[int, tuple] | None      # every device's tile shape (gathers), else None
    dtype: tuple
    kind: str | None
    devtype: str


class CollectiveKernel:
    """A collective Program's run: this process's tiles checked against the agreed ones,
    then its native calls (one per group it is in) or its plan."""

    seq = 0             # the run's place in its group's sequence (Program.start sets it): its
                        # communicator (by parity), or its part of the tags

    def __init__(self, ctx, be, req, a: Agreed, prob, pid, deadline):
        self.ctx, self.be, self.req, self.a, self.prob = ctx, be, req, a, prob
        self.owned = ctx.ownership.owned(req.mesh)
        plan_only = req.compression is not None or settings.get("EMULATE_GBPS") is not None
        counter = ctx.counters.get(ctx.ownership.participants(req.mesh), 0) + 1
        nat = None if plan_only else native_call.choose(ctx, be, req, a.dtype, a.tile, a.shapes, a.devtype,
                                                        counter=counter)
        self.native = nat
        # the common run: a bare NumPy tile of this process's one device, of the agreed shape
        # and a native byte order (checked in prepare without the general validation)
        self._bare = None
        if len(self.owned) == 1 and a.kind in (None, "numpy", "torch") and a.devtype == "cpu":
            mine = a.tile if a.shapes is None else a.shapes.get(self.owned[0])
            dt = host_dtype(a.dtype[0])
            if mine is not None and dt is not None:
                self._bare = (self.owned[0], tuple(mine), dt)
        self._takes_none = (len(self.owned) == 1 and req.op in ROOTED
                            and self.owned[0] not in roots_of(req))
        self.posts = ([], [])       # per run parity (native_call.posters)
        self.plan = None
        self._host = fences_of({})          # host tiles: nothing to fence
        self._one = None
        if nat is not None:
            self.posts = native_call.posters(ctx, nat, req, a.dtype, a.tile, a.shapes, a.kind or "numpy", deadline)
            if len(self.posts[0]) == 1:
                self._one = [p[0][1:] for p in self.posts]
        # the lean run (Program.__call__): a bare NumPy tile of this shape and dtype, on one
        # native call (persistent or not): (shape, dtype, its functions per run parity)
        self.lean = None
        if self._one is not None and self._bare is not None and prob.scale == 1 and \
                all(hasattr(post, "lean") for _, post in self._one):
            self.lean = (self._bare[1], self._bare[2], tuple(post.lean for _, post in self._one), torch_unwrap,
                         dict(prob.out_shapes).get(self.owned[0]))
        else:
            self.plan = plan(prob.shape, a.dtype[0], prob.src, prob.dst)
            comp = None if req.compression is None else codec_cost.resolve(
                req.compression, self.plan, backend=be, world=ctx.world_size,
                devices_per_process=ctx.devices_per_process, strip=coded_dims(req, prob))
            self.runner = PlanRun(ctx, be, self.plan, comp, tags_of(pid, be.tag_ub),
                                  a.devtype, deadline)
            self.src_devs = set(prob.src.mesh.device_ids)

    def describe(self) -> str:
        return f"{self.native.prim.name} native" if self.native is not None else "plan"

    def prepare(self, x, out):
        f = self._bare
        if f is not None and out is None and type(x) is np.ndarray and x.shape == f[1] and x.dtype == f[2]:
            return {f[0]: x}, True, "numpy", self._host, None     # one device, its own tile: as agreed
        if x is None and out is None and self._takes_none:       # a broadcast's or scatter's non-root
            return {}, True, self.a.kind or "numpy", self._host, None
        tiles, bare = _owned_tiles(self.ctx, self.req, x, self.owned)
        return self.check(tiles, bare, out)

    def check(self, tiles, bare, out):
        req, a = self.req, self.a
        f = local_facts(req, tiles)
        if f["dtype"] is not None and f["dtype"] != a.dtype:
            raise TypeError(f"{req.op}: rank {self.ctx.rank}'s tiles have dtype {f['dtype'][0]}, the "
                            f"Program's is {a.dtype[0]}")
        if a.kind is not None and f["kind"] is not None and (f["kind"], f["devtype"]) != (a.kind, a.devtype):
            raise TypeError(f"{req.op}: rank {self.ctx.rank}'s tiles are {f['kind']} on {f['devtype']}, the "
                            f"Program was constructed for {a.kind} on {a.devtype}")
        for d, v in tiles.items():
            want = a.shapes.get(d) if a.shapes is not None else a.tile
            if tuple(v.shape) != tuple(want):
                raise ValueError(f"{req.op}: rank {self.ctx.rank}: the tile of device {d} has shape "
                                 f"{tuple(v.shape)}, the Program's is {tuple(want)}")
        kind = f["kind"] or a.kind or "numpy"
        if kind == "jax":
            tiles = {d: np.asarray(v) for d, v in tiles.items()}
        return tiles, bare, kind, fences_of(tiles), self._check_out(out, bare, f["kind"])

    def _check_out(self, out, bare, kind):
        """out= buffers ({device: buffer}, or one buffer where x was bare), checked against
        the result tiles' shapes and dtype (and, with the tiles' `kind`, writable arrays of it);
        the results are copied into them."""
        if out is None:
            return None
        req, prob = self.req, self.prob
        if not isinstance(out, Mapping):
            if not bare:
                raise TypeError(f"{req.op}: out= must be a dict {{device: buffer}} like x")
            out = {self.owned[0]: out}
        shapes, taken = dict(prob.out_shapes), []
        for d, v in out.items():
            if d not in self.owned or d not in shapes:
                raise ValueError(f"{req.op}: out= holds a buffer for device {d}, which gets no result on "
                                 f"rank {self.ctx.rank}")
            check_out_buffer(v, shapes[d], self.a.dtype[0], f"{req.op}: out= buffer of device {d}", kind,
                             taken=taken)
        return dict(out)

    def run(self, st, deadline, stamp=None):
        tiles, bare, kind, fences, out = st
        if self.native is not None:
            res = native_call.run(self.ctx, self.native, self.posts[self.seq & 1], self.req, self.prob, tiles,
                                  self.a.dtype, self.a.tile, deadline, stamp, self.seq)
            return res, None, kind, bare, out
        shards = {d: self.prob.in_tile(v) for d, v in tiles.items() if d in self.src_devs}
        like = next(iter(shards.values())) if shards else empty_like(kind, self.a.dtype[0], self.a.devtype)
        t_run = time.time() if stamp is not None else None
        res, done = self.runner.run(shards, like, fences, deadline, seq=self.seq)
        if stamp is not None:
            req, a = self.req, self.a
            log_as = _log.collective_fields(req.op, len(groups(req.mesh, req.axes)[0]), a.tile,
                                            [s for _, s in self.prob.out_shapes], a.dtype[1])
            _log.record_reshard(stamp, rank=self.ctx.rank, dpp=self.ctx.devices_per_process, backend=self.be.name,
                                plan=self.plan, collective_reduce=self.runner.coll, shards=shards, out=res, t_run=t_run,
                                **log_as)
        return res, done, kind, bare, out

    def finish(self, r):
        res, done, kind, bare, out = r
        if bare and self.native is not None and out is None and kind == "numpy" and self.prob.scale == 1:
            return res.get(self.owned[0]) if self.owned else None     # native results: final shapes
        if done is not None:
            consume(res, done)
        res = finish_tiles(self.req, self.prob, res, bare, self.owned)
        if out is not None:
            got = {self.owned[0]: res} if bare else res
            for d, buf in out.items():
                buf[...] = got[d]
            return out[self.owned[0]] if bare else {d: out.get(d, v) for d, v in got.items()}
        return arrays.as_jax(res, bare, self.owned) if kind == "jax" else res


def _fields(req, be, dt, kind, devtype, tile) -> tuple:
    return (("op", req.op), ("mesh", repr(req.mesh)), ("axes", req.axes), ("params", req.params),
            ("backend", be.signature), ("dtype", dt), ("kind", kind),
            ("devtype", devtype), ("tile", tile), ("codec", codec_cost.agreement_key(req.compression)))


def _agreed(req, metas, kinded=True) -> Agreed:
    shapes = {}
    for m in metas:
        shapes.update(m.extra.get("tiles", {}))
    tile = None
    for m in metas:
        t = m.extra.get("tile")
        if t is not None:
            tile = tuple(t)
            break
    dt = value(metas, "dtype")
    if dt is None or tile is None:
        raise ValueError(f"{req.op}: no process passed a tile, so shape and dtype are unknown")
    return Agreed(tile, shapes if req.op in GATHERS else None, dt,
                  value(metas, "kind", "numpy") if kinded else None, value(metas, "devtype", "cpu"))


def _build(ctx, be, req, kinded=True):
    def make(pid, metas, deadline):
        a = _agreed(req, metas, kinded)
        prob = build(req, a.tile, a.shapes)
        k = CollectiveKernel(ctx, be, req, a, prob, pid, deadline)
        return new(ctx, pid, f"{req.op} over {req.axes} of {req.mesh} {a.tile} {a.dtype[0]}", k, k.plan)
    return make


# a Request's params (dim, root, reduce_op, split_dim, concat_dim) as error messages name them
_PARAMS = {"all_reduce": "op={2}", "reduce": "root={1} op={2}", "reduce_scatter": "dim={0} op={2}",
           "all_gather": "dim={0}", "gather": "root={1} dim={0}", "scatter": "root={1} dim={0}",
           "broadcast": "root={1}", "all_to_all": "split_dim={3} concat_dim={4}"}


def _describe(req):
    return {"mesh": lambda v, m: v, "params": lambda v, m: _PARAMS[req.op].format(*v)}


_PLAIN = frozenset((int, str, type(None)))


def run(ctx, call: tuple, x, *, backend=None, async_op=False, out=None):
    """An eager collective under a launcher, `call` its (op, mesh, axes, {parameter: value}) as
    passed: its cached Program (SPMD: every process calls)."""
    op, mesh, axes, kw = call
    kind = "numpy" if type(x) is np.ndarray else "torch" if plain_torch(x) else None
    bare_np = kind is not None and (backend is None or type(backend) is str)
    # a bare NumPy tile's (or plain CPU torch tensor's) call seen before, found by its own
    # arguments where their equality means equal values (not 0.0 == 0 or True == 1: those go
    # through the checks)
    quick = bare_np and type(mesh) is Mesh and not _log.ON and (type(axes) is str or type(axes) is tuple and all(
        type(a) is str for a in axes)) and _PLAIN.issuperset(map(type, kw.values()))
    key = (op, mesh, axes, *kw.values(), backend, x.dtype, x.shape) if quick else None
    hit = None if key is None else ctx.quick.get(key)
    if hit is not None:
        last = ctx._last        # nothing on the queue's thread: no lock to take for the lookup
        prog = lookup(ctx, *hit) if last is None or last.done() else ctx.call(lookup, ctx, *hit)
        if prog is not None:
            return prog(x, async_op=async_op, out=out)
    req = shared_request(op, mesh, axes, **kw)
    stamp = _log.stamp(async_op) if _log.ON else None
    be, err = ctx.resolve_backend(backend)
    owned = ctx.ownership.owned(req.mesh)
    if bare_np and len(owned) == 1 and err is None:
        # a bare NumPy tile: its Program is found by its own facts (the run checks the rest)
        hit = ("collective", req, be.name), (arrays.dtype_of(x), kind, "cpu", ((owned[0], tuple(x.shape)),))
        prog = ctx.call(lookup, ctx, *hit)
        if prog is not None:            # the lean run where it applies (Program.__call__)
            if key is not None:
                ctx.quick.put(key, hit)
            return prog(x, async_op=async_op, out=out)
    if not owned:                           # no device of the mesh here: nothing to agree or move
        _owned_tiles(ctx, req, x, owned)
        res = None if not isinstance(x, Mapping) else {}
        return Handle(result=res) if async_op else res
    tiles, bare, f = {}, not isinstance(x, Mapping), {"dtype": None, "kind": None, "devtype": None, "tile": None}
    try:
        if err is not None:
            raise err
        tiles, bare = _owned_tiles(ctx, req, x, owned)
        f = local_facts(req, tiles)
        codec_cost.check(req.compression, (f["dtype"] or (None,))[0], f["devtype"], req.op)
    except (ValueError, TypeError) as e:
        err = e
    own_shapes = {d: tuple(v.shape) for d, v in tiles.items()}
    # a process decides alone where it has a tile of every device it owns (a gather of
    # uneven sizes: never, as it does not see another's size change: `_uneven`)
    complete = len(tiles) == len(owned)
    sig = ("collective", req, be.name)
    if err is None and not tiles and req.op in ROOTED and not any(d in roots_of(req) for d in owned):
        # a broadcast's or scatter's non-root passing None: the Program it ran last, where
        # every process decided alone then (a root that changed its facts constructs, and
        # both sides raise "not in the same call")
        prog = ctx.call(lookup, ctx, sig, None, True)
        if prog is not None:
            return prog.start_checked(lambda: prog._kernel.check({}, bare, out), async_op, stamp)
    local_key = (f["dtype"], f["kind"], f["devtype"], tuple(sorted(own_shapes.items()))) if complete else None
    extra = {"tiles": own_shapes, "tile": f["tile"]}

    def fields():
        return _fields(req, be, f["dtype"], f["kind"], f["devtype"], masked(req, f["tile"])) + (
            (("shapes", None),) if req.op not in GATHERS else ())

    def agreed_key(metas):
        a = _agreed(req, metas)
        return (a.tile, None if a.shapes is None else tuple(sorted(a.shapes.items())), a.dtype, a.kind, a.devtype)
    prog = ctx.call(lambda: eager(ctx, sig, local_key, complete, req.op, fields, err, extra, _build(ctx, be, req),
                                  agreed_key, _describe(req), ctx.ownership.participants(req.mesh), _uneven(req)))
    return prog.start_checked(lambda: prog._kernel.check(tiles, bare, out), async_op, stamp)


def _uneven(req):
    """For a gather: whether the agreed tiles' sizes along `dim` differ (then every call of
    the signature agrees first)."""
    if req.op not in GATHERS:
        return None

    def uneven(metas) -> bool:
        return len({t[req.dim % len(t)] for m in metas for t in m.extra.get("tiles", {}).values() if len(t)}) > 1
    return uneven


def shared_request(op: str, mesh, axes, **kw) -> Request:
    """`request` for a call or constructor: a bad argument raises on every process
    (`fail_together`)."""
    with checking(op, lambda: (mesh,)):
        return request(op, mesh, axes, **kw)


def program(req: Request, shape, dtype, backend=None, device="cpu") -> Program:
    """`Program.all_reduce(mesh, axes, shape=, dtype=, ...)` and the others: `shape` is this
    process's tile (None where it owns no device of the mesh, or, for broadcast and scatter,
    is not a root: it learns the root's)."""
    ctx = current()
    with checking(req.op, lambda: (req.mesh,)):
        name, itemsize = arrays.declared_dtype(dtype, f"Program.{req.op}")
        tile = None if shape is None else normalize_shape(shape)
        check_tile(req, tile, (name, itemsize))
        if ctx is None:
            no_context(backend, f"Program.{req.op}")
            return local_collective(req, tile, (name, itemsize))
        be = ctx.backend_of(backend)
        ranks = ctx.ownership.participants(req.mesh)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        codec_cost.check(req.compression, name, device, req.op)
    owned = ctx.ownership.owned(req.mesh)
    if not owned:
        return outside(ctx, f"{req.op} over {req.axes} of {req.mesh}", empty=lambda: None)
    tiles = {d: tile for d in owned} if tile is not None else {}
    fields = _fields(req, be, (name, itemsize), None, device, masked(req, tile))
    extra = {"tiles": tiles, "tile": tile}
    return ctx.call(lambda: construct(ctx, req.op, fields, None, extra, _build(ctx, be, req, kinded=False),
                                      _describe(req), ranks))


def coded_dims(req: Request, prob) -> int:
    """The leading dimensions of the logical tensor a codec leaves out: the group dimensions
    in front of the tiles (so each tile is coded in its own shape)."""
    if req.compression is None:
        return 0
    return len(prob.shape) - len(prob.out_shapes[0][1])


# -- one process (no launcher) ------------------------------------------------------------------

def local_collective(req, tile, dt) -> Program:
    p = None
    if tile is not None:
        prob = build(req, tile, None)
        p = plan(prob.shape, dt[0], prob.src, prob.dst)
    return new(None, 0, f"{req.op} over {req.axes} of {req.mesh}",
               LocalKernel(lambda x: collective_local(req, x, (tile, dt)), "plan", req.op, fill_out), p)


def collective_local(req, x, declared=None):
    """Without a launcher: every device's tile is here; the plan runs in memory
    (`declared`: a Program's (shape, dtype), checked first)."""
    from ..backends.local import LocalBackend
    owned = tuple(req.mesh.device_ids)
    where = "this process (without meshcomm.init it owns every device" + init_hint() + ")"
    tiles, bare = tiles_of(req, x, owned, where)
    if declared is not None:
        check_declared(req, tiles, declared)
    facts = local_facts(req, tiles)
    if facts["tile"] is None:
        raise ValueError(f"{req.op}: no tile given, so shape and dtype are unknown")
    prob = build(req, facts["tile"], {d: tuple(v.shape) for d, v in tiles.items()})
    src_devs = set(prob.src.mesh.device_ids)
    kind = facts["kind"]
    shards = {d: prob.in_tile(np.asarray(v) if kind == "jax" else v)
              for d, v in tiles.items() if d in src_devs}
    p = plan(prob.shape, facts["dtype"][0], prob.src, prob.dst)
    comp = None
    if req.compression is not None:
        codec_cost.check(req.compression, facts["dtype"][0], facts["devtype"], req.op)
        comp = codec_cost.resolve(req.compression, p, local=True, strip=coded_dims(req, prob))
    if comp is not None:                # the same round trips as under a launcher
        from ..backends.compressed import execute_local
        out = execute_local(p, shards, next(iter(shards.values())), comp)
    else:
        out = LocalBackend().execute(p, shards, like=next(iter(shards.values())))
    res = finish_tiles(req, prob, out, bare, owned)
    return arrays.as_jax(res, bare, owned) if kind == "jax" else res
