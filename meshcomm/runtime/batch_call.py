"""Many tensors at once: `Program.reshard_many` and the eager `reshard_many` (a cached one).

A batch is dicts keyed by tensor name: `src`/`dst` ({name: Layout} or one Layout for every
name), `shapes`, `dtypes` ({name: dtype} or one). Construction agrees on all of it once and
plans the batch (`planning.plan_many`: senders balanced over every tensor's bytes at once);
a run checks this process's tiles of every tensor, then runs every tensor's plan together
(backends/batch.py: one message per pair of processes per stage and bucket).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping

import numpy as np

from .. import arrays
from .. import log as _log
from ..backends import batch as batch_exec
from ..layout import Layout, normalize_shape
from ..planning import plan_many
from ..validate import check_layouts, check_out_buffer, check_tile_shapes, resolve_shape_dtype
from .agreement import layouts_fp, value
from ..handle import Handle
from .context import current, no_context
from .local_program import LocalKernel, fill_out, one_process
from .eager import eager, lookup
from .program import Program, checking, construct, new, outside, part, tags_of
from .tiles import check_device, common_run, empty_like, facts_of, fit_of, numpy_views, torch_results
from .reshard_call import agreed_shape, local_input

__all__ = ["program", "reshard_many", "normalize_batch"]


def normalize_batch(src, dst, shapes, dtypes, names=None) -> tuple:
    """(names, {name: src}, {name: dst}, {name: shape or None}, {name: dtype or None}) with
    ValueError/TypeError naming the tensor and what is wrong."""
    given = [d for d in (src, dst, shapes, dtypes) if isinstance(d, Mapping)]
    if names is None:
        if not given:
            raise TypeError("reshard_many needs the tensor names: pass src, dst, shapes or dtypes as a dict "
                            "keyed by name")
        names = tuple(given[0])
    names = tuple(names)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"tensor names must be str, got {n!r}")
    for what, d in (("src", src), ("dst", dst), ("shapes", shapes), ("dtypes", dtypes)):
        if isinstance(d, Mapping) and set(d) != set(names):
            extra, missing = sorted(set(d) - set(names)), sorted(set(names) - set(d))
            raise ValueError(f"{what} names differ from the batch's: " +
                             (f"{what} has {extra[:4]} the others do not" if extra else "") +
                             ("; " if extra and missing else "") +
                             (f"{what} lacks {missing[:4]}" if missing else ""))

    def each(d):            # {name: value}, from a dict or one value for every name
        return {n: d[n] if isinstance(d, Mapping) else d for n in names}
    srcs, dsts = each(src), each(dst)
    for what, layouts in (("src", srcs), ("dst", dsts)):
        for n, v in layouts.items():
            if not isinstance(v, Layout):
                raise TypeError(f"tensor {n!r}: {what} must be a meshcomm.Layout, got {type(v).__name__}")
    for n in names:
        try:
            check_layouts(srcs[n], dsts[n])
        except (ValueError, TypeError) as e:
            raise type(e)(f"tensor {n!r}: {e}") from None
    shp = each(shapes)
    for n in names:
        if shp[n] is not None:
            try:
                shp[n] = srcs[n].check_shape(normalize_shape(shp[n]))
            except (ValueError, TypeError) as e:
                raise type(e)(f"tensor {n!r}: {e}") from None
    dts = each(dtypes)
    return names, srcs, dsts, shp, dts


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    src: Layout
    dst: Layout
    shape: tuple
    dtype: str
    kind: str | None
    devtype: str | None


class BatchKernel:
    """A batch Program's run (runtime/program.py: prepare, run, finish)."""

    seq = 0             # the run's place in its group's sequence (Program.start sets it): its part of the tags

    def __init__(self, ctx, be, tensors: list[Tensor], plans, bucket_bytes, pid, deadline):
        self.ctx, self.be, self.tensors, self.plans = ctx, be, tensors, plans
        self.bucket_bytes, self.tags = bucket_bytes, tags_of(pid, be.tag_ub)
        own = ctx.ownership
        self.want = {}
        self._host = []         # per tensor, what `quick` takes: (name, want, fit, bare ok)
        for t in tensors:
            tiling = t.src.tiles(t.shape)
            want = self.want[t.name] = {d: tuple(b - a for a, b in tiling.boxes[d]) for d in own.owned(t.src)}
            self._host.append((t.name, want, fit_of(t.kind, t.devtype, t.dtype), len(own.owned(t.dst)) <= 1))
        # the agreed device type (the same on every process): mixed's choice per message by it
        kind = "cuda" if any(t.devtype == "cuda" for t in tensors) else "cpu"
        self.runner = batch_exec.Runner(plans, rank=ctx.rank, devices_per_process=ctx.devices_per_process,
                                        backend=be, bucket_bytes=bucket_bytes, device_kind=kind)
        self.runner.prepare(deadline)

    def describe(self) -> str:
        return f"{len(self.tensors)} tensors, one message per pair of processes per stage"

    def quick(self, xs):
        """{name: (tiles, kind)} where every tensor's tiles are a common run
        (`tiles.common_run`): `prepare` without the general validation (the eager call's
        test of "the same call"), else None."""
        if type(xs) is not dict or any(n not in self.want for n in xs):
            return None
        got = {}
        for name, want, fit, bare_ok in self._host:
            tiles = common_run(xs.get(name), want, fit, bare_ok) if fit else None
            if tiles is None:
                return None
            got[name] = (tiles[0], tiles[2])
        return got

    def prepare(self, xs, out):
        got = self.quick(xs)
        if got is None:
            xs = batch_input(xs, {t.name for t in self.tensors})
            got = {}
            for t in self.tensors:
                shards, _ = local_input(self.ctx, xs.get(t.name, {}), t.src, t.dst)
                got[t.name] = (self._check(t, shards), None)
        return got, self._check_out(out, got)

    def _check_out(self, out, got):
        """out= ({name: {device: buffer}}) against every tensor's result tiles here, before
        anything is posted (`check_out_buffer`: shape, dtype, a writable array of the tiles' kind,
        not an input tile)."""
        if out is None:
            return None
        out, taken = batch_input(out, self.want), []
        for t in self.tensors:
            o, shards = out.get(t.name), got[t.name][0]
            if o is None:
                continue
            if not isinstance(o, Mapping):
                raise TypeError(f"tensor {t.name!r}: out= takes {{device: buffer}}, got {type(o).__name__}")
            boxes, owned = t.dst.tiles(t.shape).boxes, self.ctx.ownership.owned(t.dst)
            kind = facts_of(shards)[1] or t.kind or "numpy"
            for d, v in o.items():
                where = f"tensor {t.name!r}: out= buffer of device {d}"
                if d not in owned:
                    raise ValueError(f"{where}: rank {self.ctx.rank} owns no such dst device ({list(owned)})")
                check_out_buffer(v, tuple(b - a for a, b in boxes[d]), t.dtype, where, kind, "the tiles are",
                                 shards.values(), taken)
        return out

    def _check(self, t: Tensor, shards):
        want = self.want[t.name]
        for d, v in shards.items():
            if tuple(v.shape) != want[d]:
                raise ValueError(f"tensor {t.name!r}: rank {self.ctx.rank}'s src tile of device {d} has shape "
                                 f"{tuple(v.shape)}, the Program's layout gives it {want[d]} (shape {t.shape})")
        dt, kind, _ = facts_of(shards)
        if len(shards) > 1:
            dts = {arrays.dtype_of(v)[0] for v in shards.values()}
            if len(dts) > 1:
                raise TypeError(f"tensor {t.name!r}: rank {self.ctx.rank}'s tiles have different dtypes "
                                f"{sorted(dts)}")
        if dt is not None and dt[0] != t.dtype:
            raise TypeError(f"tensor {t.name!r}: rank {self.ctx.rank}'s tiles have dtype {dt[0]}, "
                            f"the Program's is {t.dtype}")
        if kind == "jax":
            shards = {d: np.asarray(v) for d, v in shards.items()}
        return shards

    def run(self, st, deadline, stamp=None):
        got, out = st
        ctx = self.ctx
        items, kinds, views = [], [], []
        for i, (t, p) in enumerate(zip(self.tensors, self.plans)):
            shards, kind = got[t.name]     # the kind where the common run found it
            kind = kind or facts_of(shards)[1] or t.kind or "numpy"
            like = next(iter(shards.values())) if shards else empty_like(kind if kind != "jax" else "numpy",
                                                                          t.dtype, t.devtype or "cpu")
            o = None if out is None else out.get(t.name)
            v = numpy_views(shards, like, o) if kind == "torch" and self.be.wire == "numpy" else None
            if v is not None:               # CPU torch tiles travel as NumPy views (no copy)
                views.append((i, o))
                shards, like, o = v
            items.append(batch_exec.BatchItem(p, shards, like, o))
            kinds.append(kind)
        t_run = time.time() if stamp is not None else None
        res, _ = self.runner.run(items, part(self.tags, self.seq), deadline)     # worked out at construction
        for i, o in views:                  # torch tiles: torch results over the same memory
            res[i] = torch_results(res[i], o)
        if stamp is not None:
            for t, p, it, r, c in zip(self.tensors, self.plans, items, res, self.runner.coll):
                _log.record_reshard(stamp, rank=ctx.rank, dpp=ctx.devices_per_process, backend=self.be.name,
                                    plan=p, collective_reduce=c, shards=it.shards, out=r, t_run=t_run)
        return res, kinds

    def finish(self, r):
        res, kinds = r
        return {t.name: (arrays.to_jax_devices(tiles) if kind == "jax" else tiles)
                for t, tiles, kind in zip(self.tensors, res, kinds)}


def batch_input(xs, names) -> Mapping:
    """A batch run's input {name: tiles} checked against the batch's `names` (None: no tiles)."""
    if xs is None:
        return {}
    if not isinstance(xs, Mapping):
        raise TypeError(f"reshard_many takes {{name: this process's src tiles}}, got {type(xs).__name__}")
    extra = sorted(set(xs) - set(names), key=str)
    if extra:
        raise ValueError(f"reshard_many: tensors {extra[:4]} are not in the batch")
    return xs


def _build(ctx, be, names, srcs, dsts, bucket_mb):
    def make(pid, metas, deadline):
        tensors = []
        for n in names:
            shape = agreed_shape(metas, srcs[n], ctx.devices_per_process, n)
            dt = value(metas, f"dtype:{n}")
            if dt is None:
                raise ValueError(f"tensor {n!r}: no process holds a src tile, so its dtype is unknown; pass dtypes=")
            # the device type the tiles' holders (or the constructors' device=) gave: where a
            # process holding no src tile of it gets its results
            tensors.append(Tensor(n, srcs[n], dsts[n], tuple(shape), dt[0], value(metas, f"kind:{n}"),
                                  value(metas, f"devtype:{n}") or "cpu"))
        # planned as one batch (senders balanced over every tensor's bytes at once): each a
        # complete single-tensor plan, run together
        bp = plan_many({t.name: t.shape for t in tensors}, {t.name: t.dtype for t in tensors},
                       {t.name: t.src for t in tensors}, {t.name: t.dst for t in tensors}, bucket_mb=bucket_mb)
        plans = [bp.plan_of(t.name) for t in tensors]
        bucket = None if bucket_mb is None else int(bucket_mb * (1 << 20))
        k = BatchKernel(ctx, be, tensors, plans, bucket, pid, deadline)
        total = sum(p.bytes_moved for p in plans)
        return new(ctx, pid, f"reshard_many of {len(names)} tensors ({total / 2**20:.1f} MiB moved)", k)
    return make


def _fields(names, srcs, dsts, be, shp, dts, kinds, devtypes, bucket_mb) -> tuple:
    f = [("op", "reshard_many"), ("names", names),
         ("layouts", layouts_fp(tuple(srcs[n] for n in names), tuple(dsts[n] for n in names))),
         ("backend", be.signature), ("bucket", "default" if bucket_mb is None else bucket_mb)]
    for n in names:
        f += [(f"shape:{n}", shp.get(n)), (f"dtype:{n}", dts.get(n)), (f"kind:{n}", kinds.get(n)),
              (f"devtype:{n}", devtypes.get(n))]
    return tuple(f)


def _meshes(src, dst) -> list:
    """The meshes of a batch's layouts (one Layout, or {name: Layout}, each)."""
    return [lay.mesh for v in (src, dst) for lay in (v.values() if isinstance(v, Mapping) else (v,))]


def _check_compression(compression):
    if compression is not None:
        raise ValueError("reshard_many does not take compression= yet: reshard the tensors that should be "
                         "compressed with reshard(..., compression=)")


def program(src, dst, shapes, dtypes, backend, bucket_mb, compression, device=None) -> Program:
    """`Program.reshard_many(src, dst, shapes=, dtypes=)`: every process constructs it. `device`
    ("cpu" or "cuda", optional): where the tiles are, so that a process holding no src tile of
    a tensor gets its results there (else on the host)."""
    ctx = current()
    with checking("reshard_many", lambda: _meshes(src, dst)):
        _check_compression(compression)
        check_device(device, "the host")
        if shapes is None or dtypes is None:
            raise TypeError("Program.reshard_many needs shapes= and dtypes= (a dict by tensor name; one dtype "
                            "for all)")
        names, srcs, dsts, shp, dts = normalize_batch(src, dst, shapes, dtypes)
        # a torch dtype names the kind of the tiles a process without src tiles gets back
        kinds = {n: ("torch" if device == "cuda" or type(d).__module__.startswith("torch") else None)
                 for n, d in dts.items()}
        dts = {n: arrays.declared_dtype(d, f"Program.reshard_many: tensor {n!r}") for n, d in dts.items()}
        if ctx is not None:
            be, ranks = ctx.backend_of(backend), ctx.ownership.participants(*_meshes(srcs, dsts))
    if ctx is None:
        no_context(backend, "Program.reshard_many")

        def run(xs):
            xs = batch_input(xs, names)
            return {n: (one_process(xs.get(n, {}), srcs[n], dsts[n], shp[n], dts[n][0])[0] if srcs[n].mesh.device_ids
                        else {}) for n in names}

        def fill(res, out, what):
            out, taken = batch_input(out, names), []
            for n, o in out.items():        # every tensor's buffers checked before any is written
                fill_out(res[n], o, f"{what} {n!r}", copy=False, taken=taken)
            return {**res, **{n: fill_out(res[n], o, f"{what} {n!r}") for n, o in out.items()}}
        return new(None, 0, f"reshard_many of {len(names)} tensors", LocalKernel(run, "plans", "reshard_many", fill))
    fields = _fields(names, srcs, dsts, be, shp, dts, kinds, dict.fromkeys(names, device), bucket_mb)
    if ctx.rank not in ranks:
        return outside(ctx, f"reshard_many of {len(names)} tensors", empty=lambda: {n: {} for n in names})
    return ctx.call(lambda: construct(ctx, "reshard_many", fields, None, {}, _build(ctx, be, names, srcs, dsts,
                                                                                   bucket_mb), None, ranks))


def reshard_many(ctx, xs, src, dst, *, shapes=None, dtypes=None, backend=None, async_op=False, bucket_mb=None,
                 compression=None):
    """The eager batch: the cached Program of these arguments, then one run."""
    stamp = _log.stamp(async_op) if _log.ON else None
    with checking("reshard_many", lambda: _meshes(src, dst)):
        _check_compression(compression)
        if not isinstance(xs, Mapping):
            raise TypeError(f"reshard_many takes {{name: this process's src tiles}}, got {type(xs).__name__}")
        names = None if any(isinstance(d, Mapping) for d in (src, dst, shapes, dtypes)) else tuple(sorted(xs))
        names, srcs, dsts, shp, dts = normalize_batch(src, dst, shapes, dtypes, names)
        # the layouts as given: a process holding no tile (no names of its own) takes part too
        ranks = ctx.ownership.participants(*_meshes(src, dst))
    if ctx.rank not in ranks:               # no device of the batch here: nothing to agree or move
        res = {n: {} for n in names}
        return Handle(result=res) if async_op else res
    be, err = ctx.resolve_backend(backend)
    sig = ("reshard_many", names, layouts_fp(tuple(srcs[n] for n in names), tuple(dsts[n] for n in names)),
           repr(shapes) if not isinstance(shapes, Mapping) else tuple(sorted(map(str, shapes.items()))),
           repr(dtypes), be.name, bucket_mb)
    if err is None:                         # as reshard's fast path (reshard_call.reshard)
        prog = ctx.call(lookup, ctx, sig, None, True)
        got = None if prog is None else prog._kernel.quick(xs)
        if got is not None:
            return prog.start(None, async_op, None, stamp, (got, None))
    got, facts, tiles = {}, {}, {}
    try:
        if err is not None:
            raise err
        extra = sorted(set(xs) - set(names))
        if extra:
            raise ValueError(f"reshard_many: xs holds tensors {extra[:4]} that are not in the batch")
        for n in names:
            try:
                shards, _ = local_input(ctx, xs.get(n, {}), srcs[n], dsts[n])
                s, name, itemsize = resolve_shape_dtype(shards, srcs[n], shp[n], dts[n])
                if s is not None:
                    check_tile_shapes({d: v.shape for d, v in shards.items()}, srcs[n].tiles(s), "src", rank=ctx.rank)
            except (ValueError, TypeError) as e:
                raise type(e)(f"tensor {n!r}: {e}") from None
            got[n] = shards
            _, kind, devtype = facts_of(shards)
            if kind is None and type(dts[n]).__module__.startswith("torch"):
                kind = "torch"          # a torch dtype names the kind, as Program.reshard_many's
            facts[n] = (s, None if name is None else (name, itemsize), kind, devtype)
            tiles[n] = {d: tuple(v.shape) for d, v in shards.items()}
    except (ValueError, TypeError) as e:
        err = e
    # a process decides alone where it knows every tensor's shape and dtype, and the kind of the
    # results it gets (a receiver without tiles learns the senders' from the agreement)
    complete = err is None and all(f[0] is not None and f[1] is not None and (
        f[2] is not None or not ctx.ownership.owned(dsts[n])) for n, f in facts.items())
    local_key = (tuple(sorted((n, f) for n, f in facts.items())), tuple(sorted((n, tuple(sorted(t.items())))
                                                                              for n, t in tiles.items()))) \
        if complete else None
    fields = lambda: _fields(names, srcs, dsts, be, {n: f[0] for n, f in facts.items()},  # noqa: E731
                             {n: f[1] for n, f in facts.items()}, {n: f[2] for n, f in facts.items()},
                             {n: f[3] for n, f in facts.items()}, bucket_mb)

    def agreed_key(metas):
        return tuple((n, value(metas, f"shape:{n}"), value(metas, f"dtype:{n}"), value(metas, f"kind:{n}"))
                     for n in names) + \
            tuple(sorted((n, tuple(sorted(m.extra.get("tiles", {}).get(n, {}).items())))
                         for m in metas for n in names))
    prog = ctx.call(lambda: eager(ctx, sig, local_key, complete, "reshard_many", fields, err, {"tiles": tiles},
                                  _build(ctx, be, names, srcs, dsts, bucket_mb), agreed_key, None, ranks))
    k = prog._kernel
    return prog.start_checked(lambda: ({t.name: (k._check(t, got.get(t.name, {})), None) for t in k.tensors}, None),
                              async_op, stamp)
