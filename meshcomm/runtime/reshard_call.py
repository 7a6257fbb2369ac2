"""Reshard Programs under a launcher: `Program.reshard` and the eager `reshard` (a cached one).

Construction agrees on the layouts, backend, shape, dtype, array kind, device type and codec
(runtime/program.py `construct`), plans, creates the plan's groups. A run checks this
process's tiles against the agreed shapes and dtype, then runs the plan with the Program's
tags (runtime/plan_run.py: the executor, backends/batch.py `Runner`).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Mapping

import numpy as np

from .. import arrays
from .. import log as _log
from ..backends import codec_cost
from ..backends.lean import lean
from ..layout import normalize_shape
from ..planning import plan
from ..validate import (check_keys, check_layouts, check_out_buffer, check_tile_shapes, infer_shape, normalize_input,
                        plain_tile, resolve_shape_dtype)

from ..handle import Handle
from .agreement import layouts_fp, value
from .context import current, no_context
from .local_program import local_reshard
from .plan_run import PlanRun
from .eager import eager, lookup
from .program import GENERAL, Program, checking, construct, new, outside, tags_of
from .tiles import check_device, common_run, consume, empty_like, facts_of, fences_of, fit_of

__all__ = ["reshard", "program"]


@dataclasses.dataclass(frozen=True)
class Agreed:
    shape: tuple
    dtype: str
    itemsize: int
    kind: str | None        # None: a Program constructed without tiles (each run's tiles say)
    devtype: str | None


def local_input(ctx, x, src, dst) -> tuple[dict, bool]:
    """This process's src tiles ({device: tile}) and whether x was a bare array, checked
    locally (ValueError/TypeError naming the device)."""
    own = ctx.ownership
    owned_src, owned_dst = own.owned(src), own.owned(dst)
    own.check_mesh(src.mesh, "src")
    own.check_mesh(dst.mesh, "dst")
    if isinstance(x, Mapping):      # tiles of devices other processes own: ignored
        check_keys(x, src, "src")
        x = {d: v for d, v in x.items() if d in owned_src}
    elif x is None:
        x = {}
    shards, bare = normalize_input(x, src, owned=owned_src)
    missing = [d for d in owned_src if d not in shards]
    if missing:
        raise ValueError(f"rank {ctx.rank} owns src device(s) {missing[:8]} but x holds no "
                         f"tile for them (every process passes the src tiles it owns)")
    if bare and len(owned_dst) > 1:
        raise ValueError(f"a bare array in gives a bare array out, but rank {ctx.rank} owns "
                         f"{len(owned_dst)} dst devices {list(owned_dst)}; pass a dict")
    return {d: plain_tile(v) for d, v in shards.items()}, bare


class ReshardKernel:
    """What a reshard Program does per run (runtime/program.py: prepare, run, finish; `lean`:
    its lean run, where there is one)."""

    seq = 0             # the run's place in its group's sequence (Program.start sets it): its part of the tags

    def __init__(self, ctx, be, src, dst, p, agreed: Agreed, comp, tags, deadline):
        self.ctx, self.be, self.src, self.dst, self.p, self.agreed = ctx, be, src, dst, p, agreed
        self.owned_src = ctx.ownership.owned(src)
        self.owned_dst = ctx.ownership.owned(dst)
        tiling = src.tiles(agreed.shape)
        self.want = {d: tuple(b - a for a, b in tiling.boxes[d]) for d in self.owned_src}
        out_tiling = dst.tiles(agreed.shape)
        self.out_shapes = {d: tuple(b - a for a, b in out_tiling.boxes[d]) for d in self.owned_dst}
        self.runner = PlanRun(ctx, be, p, comp, tags, agreed.devtype or "cpu", deadline)
        # the common run (`quick`): host tiles of the agreed shapes and dtype
        self._fit = fit_of(agreed.kind, agreed.devtype, agreed.dtype)
        self._fences = fences_of({})
        self.lean = self._lean(p, agreed, tags)

    def _lean(self, p, a, tags):
        """(src tile shape or None, dtype, per run parity: post, result, backend, raw, unwrap)
        of the lean run (Program.__call__, backends/lean.py): at most one NumPy tile in, bare
        or in a dict (a dict out), at most one out; else None."""
        r = self.runner.runner
        if r is None or a.kind not in ("numpy", None) or a.devtype not in ("cpu", None) or \
                len(self.owned_src) > 1 or len(self.owned_dst) > 1:
            return None
        try:
            dtype = np.dtype(arrays.numpy_dtype(a.dtype))
        except (TypeError, ValueError):
            return None
        dev, specs = (self.owned_src or (None,))[0], r.out_shapes[0]
        fns = lean(r, dev, specs[0] if specs else None, p.fill_op, dtype, tags)
        if fns is None:
            return None
        to_dict = (lambda y: {}) if not specs else (lambda y, d=specs[0][0]: {d: y})

        def unwrap(x):                  # {src device: tile} ({} or None without one): a dict out
            if x is None or type(x) is dict and not x:
                return (None, to_dict) if dev is None else None
            if type(x) is dict and len(x) == 1 and dev in x:
                return x[dev], to_dict
            return None
        return (None if dev is None else self.want[dev]), dtype, fns, unwrap

    def describe(self) -> str:
        return "plan"

    def quick(self, x):
        """The prepared input of a common run (`tiles.common_run`: NumPy arrays or CPU torch
        tensors of the agreed shapes and dtype, one per owned src device), else None. What
        `check` would give, without the general validation; the eager call's fast path takes
        it as its test of "the same call"."""
        got = common_run(x, self.want, self._fit, len(self.owned_dst) <= 1) if self._fit else None
        if got is None:
            return None
        shards, bare, kind = got
        if kind is None:
            return shards, bare, self._fences, self.agreed.kind, self.agreed.devtype, None
        return shards, bare, self._fences, kind, "cpu", None

    def prepare(self, x, out):
        st = self.quick(x) if out is None else None
        if st is not None:
            return st
        shards, bare = local_input(self.ctx, x, self.src, self.dst)
        return self.check(shards, bare, out)

    def check(self, shards, bare, out):
        """This run's tiles against what the Program agreed (this process alone)."""
        a = self.agreed
        for d, v in shards.items():
            if tuple(v.shape) != self.want[d]:
                raise ValueError(f"rank {self.ctx.rank}: src tile of device {d} has shape {tuple(v.shape)}, "
                                 f"the Program's layout gives it {self.want[d]} (global shape {a.shape})")
        dt, kind, devtype = facts_of(shards)
        if dt is not None and dt[0] != a.dtype:
            raise TypeError(f"rank {self.ctx.rank}: src tiles have dtype {dt[0]}, the Program's is {a.dtype}")
        if (a.kind is not None and kind is not None and kind != a.kind) or \
                (a.devtype is not None and devtype is not None and devtype != a.devtype):
            raise TypeError(f"rank {self.ctx.rank}: src tiles are {kind} on {devtype}, the Program was "
                            f"constructed for {a.kind} on {a.devtype}")
        if kind == "jax":
            shards = {d: np.asarray(v) for d, v in shards.items()}
        out = self._check_out(out, shards)
        return shards, bare, fences_of(shards), kind or a.kind, devtype or a.devtype, out

    def _check_out(self, out, shards):
        if out is None:
            return None
        if not isinstance(out, Mapping):
            if len(self.owned_dst) != 1:
                raise TypeError(f"out= must be a dict {{device: buffer}} (rank {self.ctx.rank} owns "
                                f"{len(self.owned_dst)} dst devices)")
            out = {self.owned_dst[0]: out}
        taken = []
        for d, v in out.items():
            if d not in self.out_shapes:
                raise ValueError(f"out= holds a buffer for device {d}, which rank {self.ctx.rank} does not "
                                 f"own in the dst layout (it owns {list(self.owned_dst)})")
            kind = arrays.kind_of(next(iter(shards.values()))) if shards else self.agreed.kind
            check_out_buffer(v, self.out_shapes[d], self.agreed.dtype, f"out= buffer of device {d}", kind,
                             "the tiles are", shards.values(), taken)
        return dict(out)

    def run(self, st, deadline, stamp=None):
        shards, bare, fences, kind, devtype, out = st
        a = self.agreed
        if "torch" in sys.modules:      # if another thread is importing torch, wait for it
            import torch  # noqa: F401
        like = next(iter(shards.values())) if shards else (
            next(iter(out.values())) if out else empty_like(kind or "numpy", a.dtype, devtype))
        t_run = time.time() if stamp is not None else None
        res, done = self.runner.run(shards, like, fences, deadline, out, self.seq)
        if stamp is not None:
            _log.record_reshard(stamp, rank=self.ctx.rank, dpp=self.ctx.devices_per_process, backend=self.be.name,
                                plan=self.p, collective_reduce=self.runner.coll, shards=shards, out=res, t_run=t_run)
        return res, done, kind, bare

    def finish(self, r):
        out, done, kind, bare = r
        if done is not None:
            consume(out, done)
        if kind == "jax":
            out = arrays.to_jax_devices(out)
        if bare:
            return next(iter(out.values())) if out else None
        return out


def _facts(ctx, x, src, dst, shape, dtype, compression):
    """This process's side: (err, shards, bare, shape, (dtype, itemsize), kind, devtype)."""
    err, shards, bare = None, {}, False
    shp = dt = kind = devtype = None
    try:
        shards, bare = local_input(ctx, x, src, dst)
        shp, name, itemsize = resolve_shape_dtype(shards, src, shape, dtype)
        dt = None if name is None else (name, itemsize)
        if shp is not None:
            check_tile_shapes({d: v.shape for d, v in shards.items()}, src.tiles(shp), "src", rank=ctx.rank)
        _, kind, devtype = facts_of(shards)
        if kind is None and dtype is not None:      # no tiles here: a torch dtype says torch, and
            # the device type is the tile holders' (results here land on the current CUDA device)
            kind, devtype = ("torch", None) if type(dtype).__module__.startswith("torch") else ("numpy", "cpu")
        codec_cost.check(compression, name, devtype, "reshard")
    except (ValueError, TypeError) as e:
        err = e
    return err, shards, bare, shp, dt, kind, devtype


def _fields(src, dst, be, shp, dt, kind, devtype, compression) -> tuple:
    return (("op", "reshard"), ("layouts", layouts_fp(src, dst)), ("backend", be.signature),
            ("shape", shp), ("dtype", dt), ("kind", kind), ("devtype", devtype),
            ("codec", codec_cost.agreement_key(compression)))


def agreed_shape(metas, src, dpp, name=None) -> tuple:
    """The global shape every process agreed on (field "shape", or "shape:<name>" of a batch's
    tensor `name`), else inferred from every process's src tiles, which are checked against it
    (a process without tiles learns it)."""
    shape = value(metas, "shape" if name is None else f"shape:{name}")
    if shape is not None:
        return tuple(shape)
    tiles_of = (lambda m: m.extra.get("tiles", {})) if name is None else \
        (lambda m: m.extra.get("tiles", {}).get(name, {}))
    tiles = {}
    for m in metas:
        tiles.update(tiles_of(m))
    shape = infer_shape(src, tiles, owner=lambda d: d // dpp)
    if shape is None:
        raise ValueError(("" if name is None else f"tensor {name!r}: ") + "cannot infer the global shape from the "
                         f"src tiles of all processes (devices {sorted(tiles)[:8]}); pass "
                         + ("shape= to reshard" if name is None else "shapes="))
    for r, m in enumerate(metas):
        check_tile_shapes(tiles_of(m), src.tiles(tuple(shape)), "src", rank=r)
    return tuple(shape)


def _agreed(metas, src, dpp) -> Agreed:
    """Shape and dtype from every process's facts (a process without tiles learns them)."""
    shape = agreed_shape(metas, src, dpp)
    dt = value(metas, "dtype")
    if dt is None:
        raise ValueError("no process holds a src tile, so the dtype is unknown; pass dtype=")
    return Agreed(tuple(shape), dt[0], dt[1], value(metas, "kind", "numpy"), value(metas, "devtype", "cpu"))


def _build(ctx, be, src, dst, compression, kinded=True):
    def build(pid, metas, deadline):
        a = _agreed(metas, src, ctx.devices_per_process)
        if not kinded:          # a Program: what the constructors said, else each run's tiles
            a = dataclasses.replace(a, kind=value(metas, "kind"), devtype=value(metas, "devtype"))
        p = plan(a.shape, a.dtype, src, dst)
        comp = None if compression is None else codec_cost.resolve(
            compression, p, backend=be, world=ctx.world_size, devices_per_process=ctx.devices_per_process)
        k = ReshardKernel(ctx, be, src, dst, p, a, comp, tags_of(pid, be.tag_ub), deadline)
        return new(ctx, pid, f"reshard {src} -> {dst} {a.shape} {a.dtype}", k, p)
    return build


_DESCRIBE = {"layouts": lambda v, m: str(m.extra.get("desc", v))}     # the layouts as error messages name them


class _Desc:
    """"src=... dst=..." for error messages, formatted only when one is written."""

    def __init__(self, src, dst):
        self.src, self.dst = src, dst

    def __str__(self) -> str:
        return f"src={self.src!r} dst={self.dst!r}"

    def __reduce__(self):               # travels in a Meta as the text
        return (str, (str(self),))


def reshard(ctx, x, src, dst, *, shape=None, dtype=None, backend=None, async_op=False, compression=None):
    """The eager reshard: the cached Program of these arguments (constructed on first use)."""
    stamp = _log.stamp(async_op) if _log.ON else None
    ranks = ctx.ownership.participants(src.mesh, dst.mesh)     # api.reshard checked the layouts
    if ctx.rank not in ranks:               # no device of it here: nothing to agree or move
        local_input(ctx, x, src, dst)
        return Handle(result={}) if async_op else {}
    be, err = ctx.resolve_backend(backend)
    shape_kw = None
    if shape is not None:
        try:
            shape_kw = normalize_shape(shape)
        except (ValueError, TypeError):
            shape_kw = repr(shape)
    sig = ("reshard", src, dst, shape_kw, None if dtype is None else str(dtype), be.name,
           codec_cost.agreement_key(compression))
    if err is None:
        # the Program this process ran last for these arguments, where every process decided
        # alone then and x is the common run of it (its tiles' shapes and dtype: the same
        # facts, so the same Program the checks below would find)
        prog = ctx.call(lookup, ctx, sig, None, True)
        if prog is not None and prog._lean is not None and not async_op and stamp is None:
            r = prog._lean(x)           # the Program's lean run: x is its one tile, as agreed
            if r is not GENERAL:
                return r
        st = None if prog is None else prog._kernel.quick(x)
        if st is not None:
            return prog.start(None, async_op, None, stamp, st)
    e2, shards, bare, shp, dt, kind, devtype = _facts(ctx, x, src, dst, shape, dtype, compression)
    err = err or e2
    tiles = tuple(sorted((d, tuple(v.shape)) for d, v in shards.items()))
    complete = shp is not None and dt is not None and kind is not None
    local_key = (shp, dt, kind, devtype, tiles) if complete and err is None else None
    extra = {"tiles": dict(tiles), "desc": _Desc(src, dst)}

    def agreed_key(metas):
        a = _agreed(metas, src, ctx.devices_per_process)
        return (a.shape, a.dtype, a.kind, a.devtype)
    prog = ctx.call(lambda: eager(ctx, sig, local_key, complete, "reshard",
                                  lambda: _fields(src, dst, be, shp, dt, kind, devtype, compression), err, extra,
                                  _build(ctx, be, src, dst, compression), agreed_key, _DESCRIBE, ranks))
    return prog.start_checked(lambda: prog._kernel.check(shards, bare, None), async_op, stamp)


def program(src, dst, shape, dtype, backend, compression, device=None) -> Program:
    """`Program.reshard`: every process constructs it with the same arguments. `device`
    ("cpu" or "cuda", optional): where the tiles are, so that a process holding no src tile
    gets its results there (else each run's tiles say, and such a process gets host arrays)."""
    from .. import compression as codecs
    ctx = current()
    with checking("reshard", lambda: (src.mesh, dst.mesh)):
        check_layouts(src, dst)
        compression = codecs.coerce(compression)
        if shape is None or dtype is None:
            raise TypeError("Program.reshard needs shape= and dtype= (the global shape and element type)")
        shape = src.check_shape(normalize_shape(shape))
        name, itemsize = arrays.normalize_dtype(dtype)
        check_device(device, "the tiles say")
        if ctx is None:
            no_context(backend, "Program.reshard")
            return local_reshard(src, dst, shape, dtype, compression)
        be = ctx.backend_of(backend)
        ctx.ownership.check_mesh(src.mesh, "src")
        ctx.ownership.check_mesh(dst.mesh, "dst")
        codec_cost.check(compression, name, device, "reshard")
        ranks = ctx.ownership.participants(src.mesh, dst.mesh)
    # with device=, a CUDA device or a torch dtype says torch tensors (for a process without tiles)
    kind = "torch" if device == "cuda" or (device is not None and type(dtype).__module__.startswith("torch")) \
        else None
    fields = _fields(src, dst, be, shape, (name, itemsize), kind, device, compression)
    extra = {"desc": f"src={src!r} dst={dst!r}"}
    if ctx.rank not in ranks:
        return outside(ctx, f"reshard {src} -> {dst}")
    return ctx.call(lambda: construct(ctx, "reshard", fields, None, extra, _build(ctx, be, src, dst, compression,
                                                                                   kinded=False), _DESCRIBE, ranks))

