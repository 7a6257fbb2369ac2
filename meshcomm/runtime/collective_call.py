"""One collective on mesh axes (see meshcomm.collectives), from validation to execution.

The same path as a reshard: every process validates its own tiles (keeping the error to
share), all agree on the call (operation, mesh, axes, parameters, dtype, tile shapes) through
`agreement`, then the collective runs as the reshard `collectives.layouts.problem` gives,
with the plan executed by the backend. Tile sizes along a gathered dimension travel with the
agreement, so uneven all_gather/gather cost no extra round.

Repeated calls: every process keeps what the last call with the same arguments agreed on
(`Agreed`, in `ctx.agreed`). A gather, or a process without a tile, hashes that instead of
what it cannot know alone (the other tiles' sizes); all hashes equal decides, so a repeated
uneven all_gather costs the round of hashes and no metadata exchange. Over MPI the native
call is posted beside the hashes (the optimistic start) on a communicator of its own exact
signature (backends/mpi.py `sig_comm`), and its result is released only once the hashes
agree; where they do not, every process learns so from the same Metas, gives the posted
call up and moves to fresh communicators before raising or running the call again.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping

import numpy as np

from .. import arrays, settings
from .. import log as _log
from ..backends import base, codec_cost
from ..collectives.layouts import groups, problem
from ..handle import Handle
from . import agreement, native_call
from .collective_input import GATHERS, masked, local_facts, tiles_of
from .compiled import Fast, fast_key
from .agreement import Meta
from .reshard_call import Local, PlannedCall

__all__ = ["Request", "run", "tiles_of", "coded_dims"]



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


def build(req: Request, tile: tuple, tile_shapes: Mapping[int, tuple] | None):
    """The Problem, from the agreed tile shape (and every device's, for a gather)."""
    sizes = None
    if req.op in GATHERS:
        d = req.dim % len(tile)
        per_group = []
        for g in groups(req.mesh, req.axes):
            if tile_shapes is None:
                per_group.append((tile[d],) * len(g))
            else:
                per_group.append(tuple(tile_shapes[m][d] for m in g))
        sizes = per_group[0]
        for g, s in zip(groups(req.mesh, req.axes), per_group):
            if s != sizes:
                raise ValueError(f"{req.op}: the tiles' sizes along dim {d} must be the same in every "
                                 f"group of axes {req.axes}: group {groups(req.mesh, req.axes)[0]} has "
                                 f"{list(sizes)}, group {g} has {list(s)}")
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


def run(ctx, req: Request, x, *, backend=None, async_op=False):
    """A collective under a launcher: every process calls this with its own tiles (SPMD)."""
    stamp = _log.stamp(async_op) if _log.ON else None
    fk = fast_key(req, backend, x) if stamp is None else None
    fast = ctx.fast.get(fk) if fk is not None else None
    if fast is not None and not async_op:
        # a blocking repeated call of a host tile: its compiled form with the least Python
        # between the user and MPI (the full path below wherever it does not apply)
        r = ctx.call(fast.run, ctx, x)
        if r is not None:
            return r[0]
        fast = None
    from meshcomm.backends import streams
    if fast is not None:
        # asynchronous: the same form on the queue's thread, where everything issued before
        # has run (a one-element list: the finished result tile), or the full path
        def go():
            r = fast.run(ctx, x)
            return [r[0]] if r is not None else _State.of(ctx, req, x, backend, None, fk).go()
        result = ctx.run(go, async_op)
    else:
        result = ctx.run(_State.of(ctx, req, x, backend, stamp, fk).go, async_op)

    def finish():
        out = result()
        if type(out) is list:
            return out[0]
        res, done, kind, prob, bare, owned = out
        for v in res.values():
            if done is not None:
                done.wait_on(streams.current_stream(streams.device_of(v)))
            break
        res = finish_tiles(req, prob, res, bare, owned)
        if kind == "jax":
            import jax
            if bare:
                return None if res is None else jax.device_put(res, arrays.jax_device(owned[0]))
            res = arrays.to_jax_devices(res)
        return res
    if async_op:
        return Handle(finish)
    return finish()


@dataclasses.dataclass
class _State:
    """One call on the full path: this process's validated tiles and facts (an error kept, to
    be shared through the agreement), and what it will hash."""

    ctx: Any
    req: Request
    be: Any
    err: BaseException | None
    tiles: dict
    bare: bool
    owned: tuple
    facts: dict
    fence: Any
    stamp: Any
    fk: Any                 # the key of the call's compiled form (`Fast`), None if it cannot have one

    @classmethod
    def of(cls, ctx, req: Request, x, backend, stamp, fk) -> "_State":
        from meshcomm.backends import streams
        be, err = ctx.resolve_backend(backend)
        own = ctx.ownership
        owned = own.owned(req.mesh)
        tiles, bare, facts = {}, not isinstance(x, Mapping), {"dtype": None, "kind": None, "devtype": None, "tile": None}
        try:
            if err is not None:
                raise err
            own.check_mesh(req.mesh)
            if owned:
                tiles, bare = tiles_of(req, x, owned, f"rank {ctx.rank}")
                facts = local_facts(req, tiles)
                codec_cost.check(req.compression, (facts["dtype"] or (None,))[0], facts["devtype"], req.op)
            elif x is not None and not (isinstance(x, Mapping) and not x):
                raise ValueError(f"{req.op}: rank {ctx.rank} owns no device of the mesh {req.mesh} but passed "
                                 "a tile; pass None (or an empty dict)")
        except (ValueError, TypeError) as e:
            err = e
        if facts["kind"] == "jax":
            tiles = {d: np.asarray(v) for d, v in tiles.items()}
        fence = streams.fence_from_current(None)
        for v in tiles.values():
            dev = streams.device_of(v)
            if streams.is_cuda(dev):
                fence = streams.fence_from_current(dev)
                break
        return cls(ctx, req, be, err, tiles, bare, owned, facts, fence, stamp, fk)

    def go(self):
        ctx, req, be, err, tiles, facts, stamp = (self.ctx, self.req, self.be, self.err, self.tiles,
                                                  self.facts, self.stamp)
        deadline = time.monotonic() + ctx.timeout
        own_shapes = {d: tuple(v.shape) for d, v in tiles.items()}
        key = _key(req, be)
        guess = _guess(ctx, key, req, err, facts, own_shapes)
        # Always agreed (MESHCOMM_CHECK does not apply): a process without a tile of the mesh
        # still takes part in creating the plan's groups, so it must learn shape and dtype.
        meta = Meta(req.op, _fields(req, be, facts["dtype"], facts["kind"], facts["devtype"],
                                    masked(req, facts["tile"]), None),
                    agreement.error_of(err), {"tiles": own_shapes})
        known = req.op not in GATHERS and facts["tile"] is not None
        # What this process hashes: its own facts, or (a gather, or no tile here) what the last
        # call with these arguments agreed on; all hashes equal means every process's own
        # tiles fit that, so it is this call's truth too.
        hashed = None if known or guess is None else _fields(
            req, be, guess.dtype, guess.kind, guess.devtype, masked(req, guess.tile), guess.shapes_key)
        f = guess if hashed is not None else (Agreed(facts["tile"], None, facts["dtype"], facts["kind"],
                                                      facts["devtype"]) if known else None)
        # plan_only: compressed calls, and every call under link emulation (which paces the
        # executor's sends only), run as their plans
        plan_only = req.compression is not None or settings.get("EMULATE_GBPS") is not None
        early = f is not None and err is None and not plan_only and settings.get("OPTIMISTIC") \
            and (hashed is None or guess.streak > 0)
        pending = agreement.start(ctx.backend, meta, deadline, eligible=f is not None, hashed=hashed,
                                  signature=early)
        sig = pending.signature_comm
        posted = nat = None
        tokens = []
        if early:
            # The optimistic start: the native call goes out beside the check (on a
            # communicator of its own call signature); its result is used only once the check
            # agrees. A guess the hashes have not confirmed before (shapes that change from
            # call to call) waits for them: a wrong guess then costs the metadata round, not a
            # reset. A call over every process with a signature communicator goes there: its
            # completion is then the check (nothing else is sent).
            nat = native_call.choose(ctx, be, req, f.dtype, f.tile, f.shapes, f.devtype)
            if nat is not None:
                world = sig is not None and nat.prim is pending.p2p and \
                    nat.all_ranks == (tuple(range(ctx.world_size)),) and \
                    native_call.self_checking(nat.prim, req, groups(req.mesh, req.axes)[0], f.dtype, f.tile, f.shapes)
                posted = native_call.start(ctx, nat, req, tiles, f.dtype, f.tile, f.shapes, f.kind,
                                           comm=sig if world else None)
                if world and posted is not None:
                    tokens = posted.works
        out = pending.hashes(tokens)
        res = self.conclude(pending, meta, out, f, hashed, posted, nat, key, plan_only, deadline)
        if out is not None and out.via == "signature" and posted is not None and self.fk is not None \
                and stamp is None and self.bare and len(self.owned) <= 1 and (posted.me is None) == (not self.owned):
            # one tile of this process's one device, or none passed (a non-root, or no device
            # of the mesh here: the compiled form then posts the receive, or the check alone)
            if len(ctx.fast) > 256:
                ctx.fast.clear()
            g = ctx.agreed.get(key)
            ctx.fast[self.fk] = Fast(self, key, g, f if hashed is None else g, hashed, meta.fields, pending,
                                     posted, nat, bool(tokens), res[3])
        return res

    def conclude(self, pending, meta, out, f, hashed, posted, nat, key, plan_only, deadline):
        """The call after its check: the posted native call's result where every process
        agreed, else the full exchange (raising together, or resetting and running again)."""
        ctx, req, be, err, tiles, facts, stamp = (self.ctx, self.req, self.be, self.err, self.tiles,
                                                  self.facts, self.stamp)
        if out is not None and out.mixed:       # some processes posted a signature check: all reset
            if posted is not None:
                posted.abandon()
            ctx.reset_started(["mpi"])
            posted = None
        if out is not None:                     # every process agrees with f
            base.issued[(f"{out.via}_check", be.name)] += 1
            agreed = dataclasses.replace(f, streak=f.streak + 1) if hashed is not None else Agreed(
                f.tile, None, f.dtype, out.value("kind", "numpy"), out.value("devtype", "cpu"))
            if posted is not None:
                prob = build(req, agreed.tile, agreed.shapes)
                res = posted.finish(ctx, nat, req, prob, agreed.dtype, agreed.tile, deadline, stamp)
                _remember(ctx, key, agreed)
                return res, None, agreed.kind, prob, self.bare, self.owned
        else:
            meta.extra["opt"] = (posted is not None and bool(posted.works)) or pending.signature_comm is not None
            out = pending.metas()
            if posted is not None:
                posted.abandon()
            try:
                agreement.settle(out.metas, ctx.rank, err,
                                 {"mesh": lambda v, m: v, "params": lambda v, m: _params_str(req.op, v)})
            finally:                            # every process sees the same Metas: all reset
                if any(m.extra.get("opt") for m in out.metas):
                    ctx.reset_started(["mpi"])
            shapes = None
            if req.op in GATHERS:
                shapes = {}
                for m in out.metas:
                    shapes.update(m.extra.get("tiles", {}))
            tile = facts["tile"] if facts["tile"] is not None else _any_tile(out.metas)
            dt = out.value("dtype")
            if dt is None:
                raise ValueError(f"{req.op}: no process passed a tile, so shape and dtype are unknown")
            agreed = Agreed(tile, shapes, dt, out.value("kind", "numpy"), out.value("devtype", "cpu"))
        tile, shapes, dt, kind, devtype = agreed.tile, agreed.shapes, agreed.dtype, agreed.kind, agreed.devtype
        prob = build(req, tile, shapes)
        _remember(ctx, key, agreed)
        nat = None if plan_only else native_call.choose(ctx, be, req, dt, tile, shapes, devtype)
        if nat is not None:         # one native collective of the backend the table names
            res = native_call.run(ctx, nat, req, prob, tiles, dt, tile, shapes, deadline, kind, stamp)
            return res, None, kind, prob, self.bare, self.owned
        src_devs = set(prob.src.mesh.device_ids)
        shards = {d: prob.in_tile(v) for d, v in tiles.items() if d in src_devs}
        loc = Local(kind=kind, devtype=devtype)
        log_as = None if stamp is None else _log.collective_fields(
            req.op, len(groups(req.mesh, req.axes)[0]), tile, [s for _, s in prob.out_shapes], dt[1])
        call = PlannedCall(ctx, be, prob.src, prob.dst, shards, prob.shape, dt[0], loc, False, (self.fence,),
                           stamp, log_as, compression=req.compression, strip=coded_dims(req, prob))
        res, done, _ = call.run()
        return res, done, kind, prob, self.bare, self.owned


@dataclasses.dataclass(frozen=True)
class Agreed:
    """The facts of a collective every process agreed on (kept per call signature in
    `ctx.agreed`, so a repeated call can be decided by the hashes alone)."""

    tile: tuple | None
    shapes: Mapping[int, tuple] | None      # every device's tile shape (gathers), else None
    dtype: tuple
    kind: str
    devtype: str
    streak: int = 0                         # calls since that the hashes confirmed it as a guess

    @property
    def shapes_key(self):
        return None if self.shapes is None else tuple(sorted(self.shapes.items()))


def _key(req: Request, be):
    """The call's signature in `ctx.agreed` (None when an argument is not hashable)."""
    k = ("collective", req, getattr(be, "signature", be.name))
    try:
        hash(k)
    except TypeError:
        return None
    return k


def _fields(req: Request, be, dt, kind, devtype, tile, shapes_key) -> tuple:
    return (("op", req.op), ("mesh", repr(req.mesh)), ("axes", req.axes), ("params", req.params),
            ("backend", getattr(be, "signature", be.name)), ("dtype", dt), ("kind", kind),
            ("devtype", devtype), ("tile", tile), ("codec", codec_cost.agreement_key(req.compression))) + \
        ((("shapes", shapes_key),) if req.op in GATHERS else ())


def _guess(ctx, key, req: Request, err, facts: Mapping, own_shapes: Mapping) -> Agreed | None:
    """What the last call with this signature agreed on, where this process's own facts fit
    it (dtype, kind, device type, each own tile's shape); else None."""
    g = ctx.agreed.get(key) if key is not None and err is None else None
    if g is None:
        return None
    if facts["dtype"] is not None and (facts["dtype"], facts["kind"], facts["devtype"]) != (g.dtype, g.kind, g.devtype):
        return None
    for d, shape in own_shapes.items():
        want = g.shapes.get(d) if g.shapes is not None else g.tile
        if want is None or tuple(want) != shape:
            return None
    return g


def _remember(ctx, key, agreed: Agreed) -> None:
    if key is None:
        return
    if len(ctx.agreed) > 256:
        ctx.agreed.clear()
    ctx.agreed[key] = agreed


def coded_dims(req: Request, prob) -> int:
    """The leading dimensions of the logical tensor a codec leaves out: the group dimensions
    in front of the tiles (so each tile is coded in its own shape)."""
    if req.compression is None:
        return 0
    return len(prob.shape) - len(prob.out_shapes[0][1])


def _any_tile(metas):
    """The tile shape from a process that has one (rooted ops: the root's)."""
    for m in metas:
        for t in m.extra.get("tiles", {}).values():
            return tuple(t)
    return None


def _params_str(op: str, v) -> str:
    dim, root, reduce_op, split_dim, concat_dim = v
    if op in ("all_reduce",):
        return f"op={reduce_op}"
    if op == "reduce":
        return f"root={root} op={reduce_op}"
    if op == "reduce_scatter":
        return f"dim={dim} op={reduce_op}"
    if op in ("all_gather",):
        return f"dim={dim}"
    if op in ("gather", "scatter"):
        return f"root={root} dim={dim}"
    if op == "broadcast":
        return f"root={root}"
    return f"split_dim={split_dim} concat_dim={concat_dim}"
