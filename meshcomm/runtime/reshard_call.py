"""One distributed reshard, from validation to execution (see meshcomm.runtime).

`reshard` validates locally (catching the error instead of raising it, so every process
learns of it through the agreement check), fences the producers of CUDA inputs, then runs
`PlannedCall.run` through the context's queue: the agreement check (with MPI, the first stage may
start before it completes), the plan, the executor.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Mapping

import numpy as np

from .. import arrays, settings
from ..backends import base, codec_cost, streams
from .. import log as _log
from ..caches import memo
from ..handle import Handle
from ..layout import normalize_shape
from ..planning import plan
from ..validate import (check_keys, check_layouts, check_tile_shapes, infer_shape, native_byte_order,
                        normalize_input, resolve_shape_dtype)
from . import agreement
from .agreement import Meta
from .compiled_reshard import FastReshard, reshard_key

__all__ = ["reshard"]


@dataclasses.dataclass
class Local:
    """What one process knows of the call before talking to the others."""

    err: BaseException | None = None
    shape: tuple | None = None
    dtype: str | None = None
    itemsize: int | None = None
    kind: str | None = None
    devtype: str | None = None


@dataclasses.dataclass
class Agreed:
    shape: tuple
    dtype: str
    itemsize: int
    kind: str
    devtype: str


def reshard(ctx, x, src, dst, *, shape=None, dtype=None, backend=None, async_op=False, compression=None):
    stamp = _log.stamp(async_op) if _log.ON else None
    fk = reshard_key(x, src, dst, shape, dtype, backend) if stamp is None and compression is None else None
    fast = ctx.fast.get(fk) if fk is not None else None
    if fast is not None:
        # a repeated reshard: its compiled form (compiled.FastReshard), which hands the call
        # to the full path whenever it no longer applies (checked on the queue, as it runs)
        bare = fast.bare

        def go():
            return fast.run(ctx, x) or _front(ctx, x, src, dst, shape, dtype, backend, None, None, fk)[0].run()
        result = ctx.run(go, async_op)
    else:
        call, bare = _front(ctx, x, src, dst, shape, dtype, backend, compression, stamp, fk)
        result = ctx.run(call.run, async_op)

    def finish():
        out, done, out_kind = result()
        for d, v in out.items():
            done.wait_on(streams.current_stream(streams.device_of(v)))
            break
        if out_kind == "jax":
            out = arrays.to_jax_devices(out)
        if bare:
            return next(iter(out.values())) if out else None
        return out
    if async_op:
        return Handle(finish)
    return finish()


def _front(ctx, x, src, dst, shape, dtype, backend, compression, stamp, fk):
    """The full path's local part: validation (an error kept to share through the agreement
    check), the producers' fences; (the PlannedCall, whether x was a bare array)."""
    check_layouts(src, dst)
    be, err = ctx.resolve_backend(backend)
    own = ctx.ownership
    owned_src, owned_dst = own.owned(src), own.owned(dst)
    loc, shards, bare = Local(), {}, False
    try:
        if err is not None:
            raise err
        own.check_mesh(src.mesh, "src")
        own.check_mesh(dst.mesh, "dst")
        if isinstance(x, Mapping):      # tiles of devices other processes own: ignored
            check_keys(x, src, "src")
            x = {d: v for d, v in x.items() if d in owned_src}
        shards, bare = normalize_input(x, src, owned=owned_src)
        missing = [d for d in owned_src if d not in shards]
        if missing:
            raise ValueError(f"rank {ctx.rank} owns src device(s) {missing[:8]} but x holds no "
                             f"tile for them (every process passes the src tiles it owns)")
        if bare and len(owned_dst) > 1:
            raise ValueError(f"a bare array in gives a bare array out, but rank {ctx.rank} owns "
                             f"{len(owned_dst)} dst devices {list(owned_dst)}; pass a dict")
        shards = {d: native_byte_order(v) for d, v in shards.items()}
        loc.shape, loc.dtype, loc.itemsize = resolve_shape_dtype(shards, src, shape, dtype)
        if loc.shape is not None:
            check_tile_shapes({d: v.shape for d, v in shards.items()}, src.tiles(loc.shape), "src",
                              rank=ctx.rank)
        if shards:
            first = next(iter(shards.values()))
            loc.kind = arrays.kind_of(first)
            dev = streams.device_of(first)
            loc.devtype = dev.type if dev is not None else "cpu"
        codec_cost.check(compression, loc.dtype, loc.devtype, "reshard")
    except (ValueError, TypeError) as e:
        loc.err = e
    need_exchange = settings.get("CHECK") or shape is None or dtype is None
    if loc.err is not None and not need_exchange:
        raise loc.err
    if loc.kind == "jax":
        shards = {d: np.asarray(v) for d, v in shards.items()}
    fences = {}
    for v in shards.values():
        dev = streams.device_of(v)
        if streams.is_cuda(dev) and dev not in fences:
            fences[dev] = streams.fence_from_current(dev)
    if not fences:
        fences[None] = streams.fence_from_current(None)
    call = PlannedCall(ctx, be, src, dst, shards, shape, dtype, loc, need_exchange, tuple(fences.values()), stamp,
                       compression=compression, fk=fk, bare=bare)
    return call, bare


@dataclasses.dataclass
class PlannedCall:
    ctx: Any
    be: Any
    src: Any
    dst: Any
    shards: dict
    shape_kw: Any
    dtype_kw: Any
    loc: Local
    need_exchange: bool
    fences: tuple
    stamp: Any = None       # meshcomm.log: set when logging (the call's issue time and tag)
    log_as: Any = None      # meshcomm.log: fields overriding the record's (a collective's op)
    compression: Any = None  # the compression= argument, resolved with the plan (backends/codec_cost.py)
    early: Any = None       # (kind, devtype) a process without src tiles started early with
    strip: int = 0          # leading dims the codec leaves out (a collective's group dims)
    fk: Any = None          # the key of the call's compiled form (compiled.reshard_key), or None
    bare: bool = False      # x was a bare array (the compiled form returns one too)

    def run(self):
        t_run = time.time() if self.stamp is not None else None
        if "torch" in sys.modules:      # if another thread is importing torch, wait for it
            import torch  # noqa: F401
        ctx, be, src, dst, shards, loc = self.ctx, self.be, self.src, self.dst, self.shards, self.loc
        deadline = time.monotonic() + ctx.timeout
        run_kw = dict(rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=be,
                      producer_fences=self.fences)
        ex = None
        if self.need_exchange:
            ex, agreed = self._agree(base, run_kw, deadline)
        elif loc.err is not None:
            raise loc.err
        else:
            shape = src.check_shape(normalize_shape(self.shape_kw))
            name, itemsize = arrays.normalize_dtype(self.dtype_kw)
            kind, devtype = loc.kind, loc.devtype
            if kind is None:
                kind = "torch" if type(self.dtype_kw).__module__.startswith("torch") else "numpy"
                devtype = "cpu"
            agreed = Agreed(shape, name, itemsize, kind, devtype)
        return self.complete(ex, agreed, run_kw, deadline, t_run)

    def complete(self, ex, agreed, run_kw, deadline, t_run):
        """After the agreement: the Execution (built now unless `ex` started before it), its
        result; (tiles, fence, array kind)."""
        from meshcomm.backends import compressed as coded
        ctx, be, src, dst, shards = self.ctx, self.be, self.src, self.dst, self.shards
        if ex is None:
            self.early = None
            p = plan(agreed.shape, agreed.dtype, src, dst)
            like = next(iter(shards.values())) if shards else empty_like(agreed.kind, agreed.dtype,
                                                                         agreed.devtype)
            comp = None if self.compression is None else codec_cost.resolve(
                self.compression, p, backend=be, world=ctx.world_size,
                devices_per_process=ctx.devices_per_process, strip=self.strip)
            ex = base.Execution(p, shards, like, device_kind=agreed.devtype or "cpu", compression=comp, **run_kw)
            ex.prepare(deadline)
        wire0 = (coded.stats["sent_bytes"], coded.stats["recv_bytes"])
        out, done = ex.finish(deadline)
        if self.early is not None and self.early != (agreed.kind, agreed.devtype):
            out = {d: _as_kind(v, agreed.kind, agreed.devtype, agreed.dtype) for d, v in out.items()}
        if ex.compression is not None and self.stamp is not None:   # meshcomm.log: the payload's bytes
            self.log_as = dict(self.log_as or {}, sent_bytes=coded.stats["sent_bytes"] - wire0[0],
                               recv_bytes=coded.stats["recv_bytes"] - wire0[1], codec=str(ex.compression))
        if self.stamp is not None:
            _log.record_reshard(self.stamp, rank=ctx.rank, dpp=ctx.devices_per_process, backend=be.name,
                                plan=ex.plan, collective_reduce=ex.coll, shards=shards, out=out,
                                t_run=t_run, **(self.log_as or {}))
        return out, done, agreed.kind

    def _agree(self, base, run_kw, deadline):
        """The agreement check, with the first stage readied before it and started as soon
        as that is safe. Returns (the Execution already started or None, the agreed facts)."""
        ctx, be, src, dst, shards, loc = self.ctx, self.be, self.src, self.dst, self.shards, self.loc
        plan_fp = guess = ex = build = None
        key = (src, dst, getattr(be, "signature", be.name))
        if loc.err is None and loc.shape is not None and loc.dtype is not None:
            p = plan(loc.shape, loc.dtype, src, dst)
            plan_fp = p.fingerprint
            if _optimistic(be) and self.compression is None:
                # Ready the first stage: it starts once the hashes agree, or, when they do
                # not decide, while the metadata travels (undone below on disagreement).
                # A process without src tiles readies its receives too, into host arrays
                # of the kind the last call with these layouts agreed on (else NumPy); the
                # bytes are the same whatever the kind, so `run` converts them if needed.
                if shards:
                    like, dev = next(iter(shards.values())), loc.devtype or "cpu"
                else:
                    g = ctx.agreed.get(key)
                    self.early = (g.kind if g is not None and g.devtype == "cpu" else "numpy", "cpu")
                    like, dev = empty_like(self.early[0], loc.dtype, "cpu"), "cpu"
                build = (p, like, dev)
        elif loc.err is None and _optimistic(be) and key in ctx.agreed and self.compression is None \
                and _fits(ctx.agreed[key], loc, shards, src):
            # Shape or dtype unknown here (no src tile, or tiles that do not pin the shape):
            # guess what the last call with these layouts agreed on.
            g = ctx.agreed[key]
            p = plan(g.shape, g.dtype, src, dst)
            guess = (p.fingerprint, g.kind, g.devtype)
            like = next(iter(shards.values())) if shards else empty_like(g.kind, g.dtype, g.devtype)
            build = (p, like, g.devtype or "cpu")
        if build is not None and not base.groups_ready(build[0], be, ctx.devices_per_process, build[2]):
            build = guess = None
        meta = Meta("reshard", (
            ("op", "reshard"), ("layouts", _layouts_fp(src, dst)),
            ("backend", getattr(be, "signature", be.name)), ("shape", loc.shape),
            ("dtype", None if loc.dtype is None else (loc.dtype, loc.itemsize)),
            ("kind", loc.kind), ("devtype", loc.devtype), ("plan", plan_fp),
            ("codec", codec_cost.agreement_key(self.compression))),
            agreement.error_of(loc.err))
        hashed = None
        if guess is not None:
            # its hashes say what it guessed: if every process agrees with them, the guess was
            # right; any difference (a wrong guess) sends every process to the full exchange
            g = ctx.agreed[key]
            hashed = tuple((k, {"shape": g.shape, "dtype": (g.dtype, g.itemsize), "kind": g.kind,
                                "devtype": g.devtype, "plan": guess[0]}.get(k, v)) for k, v in meta.fields)
        # Every process meets on the same backend. The hashes go first, alone: with MPI over
        # shared memory a small message to a process receiving a large one waits until that
        # receive is done, so hashes sent beside the data would wait for it (measured: the
        # call took up to 2x as long). Only when they do not decide does the first stage
        # start early, while the metadata travels.
        # A call every process agreed on twice before is checked by a barrier on the
        # communicator kept for its signature instead (agreement.Pending.signature_comm).
        pending = agreement.start(ctx.backend, meta, deadline, hashed=hashed, signature=True)
        lazy = pending.signature_comm is not None
        tokens = pending.signature_tokens()     # the barrier goes out before the stage is readied
        if build is not None:
            ex = base.Execution(build[0], shards, build[1], device_kind=build[2], **run_kw)
        early = []
        ready = None
        if ex is not None and lazy:
            # the data starts once every rank it moves between is in this exact call (their
            # messages of the barrier arrived on the signature communicator, where nothing
            # of another call can be); the result waits for the whole barrier
            peers = ex.peers()
            ready = ([w for w in tokens[:ctx.world_size - 1] if w.peers[0] in peers],
                     lambda: (ex.start(), early.append(True)))
        out = pending.hashes(tokens, ready)
        return self.conclude(pending, meta, out, ex, early, guess, hashed, key)

    def conclude(self, pending, meta, out, ex, early, guess, hashed, key):
        """The agreement check from what its hashes or signature barrier gave (`out`): the
        Metas where they did not decide, the errors, the resets; (the Execution if it may
        go on, the agreed facts). A compiled call whose check did not pass continues here."""
        ctx, be, src, dst, shards, loc = self.ctx, self.be, self.src, self.dst, self.shards, self.loc
        lazy = pending.signature_comm is not None
        decided, opt = out is not None and not out.mixed, False
        if out is not None and out.mixed:       # some processes posted a signature check: all reset
            if early:
                _abort(ex)
            ctx.reset_started(["mpi"])
            ex = guess = None
        if ex is not None and not early and not (lazy and out is None):
            ex.start()
            opt = out is None
        if out is None:
            meta.extra.update({"tiles": {d: tuple(v.shape) for d, v in shards.items()}, "opt": opt or bool(early),
                               "guess": guess, "desc": _desc(src, dst), "lazy": lazy})
            out = pending.metas()
        if out.metas is None and hashed is not None:     # the hashes confirmed the guess
            agreed = ctx.agreed[key]
            base.issued[(f"{out.via}_check", be.name)] += 1
        elif out.metas is None:             # the hashes decided: all agree
            agreed = Agreed(tuple(loc.shape), loc.dtype, loc.itemsize, out.value("kind", "numpy"),
                            out.value("devtype", "cpu"))
            base.issued[(f"{out.via}_check", be.name)] += 1
        else:
            try:
                agreement.settle(out.metas, ctx.rank, loc.err, {"layouts": lambda v, m: m.extra.get("desc", v)})
                agreed = _infer(out, src, ctx.rank, ctx.devices_per_process)
            except (ValueError, TypeError):
                started = _started(out.metas)
                if started:                     # every process sees this: all reset together
                    _abort(ex)
                    ctx.reset_started(started)
                raise
            fp = (plan(agreed.shape, agreed.dtype, src, dst).fingerprint, agreed.kind, agreed.devtype)
            if any(m.extra.get("guess") is not None and tuple(m.extra.get("guess")) != fp for m in out.metas) \
                    or any(m.extra.get("lazy") for m in out.metas):
                _abort(ex)                      # a wrong guess or a barrier posted somewhere: all start over
                ctx.reset_started(_started(out.metas))
                ex = None
        if len(ctx.agreed) > 256:
            ctx.agreed.clear()
        ctx.agreed[key] = agreed
        if decided and lazy and ex is not None and self.fk is not None and loc.err is None \
                and self.compression is None and self.stamp is None and settings.get("FAST_PATH"):
            if len(ctx.fast) > 256:
                ctx.fast.clear()
            ctx.fast[self.fk] = FastReshard(self, key, agreed, pending, meta.fields, guess, hashed, ex)
        return ex, agreed


def _started(metas) -> list:
    """The backends to reset after a failed optimistic start: those on which some process
    started its first stage, and MPI where some process posted a signature check."""
    names = [m.get("backend").split(":")[0] for m in metas if m.extra.get("opt")]
    return names + ["mpi"] * any(m.extra.get("lazy") for m in metas)


def _fits(g: Agreed, loc: Local, shards, src) -> bool:
    """Whether this process's own facts allow the guess `g`: the shape and dtype it knows are
    g's, and its tiles are the ones g's shape gives its devices (kind and device too)."""
    if (loc.shape is not None and loc.shape != g.shape) or (loc.dtype is not None and loc.dtype != g.dtype):
        return False
    if shards:
        if (loc.kind, loc.devtype) != (g.kind, g.devtype):
            return False
        boxes = src.tiles(g.shape).boxes
        return all(tuple(v.shape) == tuple(b - a for a, b in boxes[d]) for d, v in shards.items())
    return True


@memo(maxsize=1024)
def _desc(src, dst) -> str:
    """The layouts as a disagreement names them (repr: complete, unlike the short str)."""
    return f"src={src!r} dst={dst!r}"


def _infer(out, src, me, src_dpp) -> Agreed:
    """Shape and dtype from every process's facts (a process without tiles learns them)."""
    metas = out.metas
    tiles = {}
    for m in metas:
        tiles.update(m.extra.get("tiles", {}))
    shape = out.value("shape")
    if shape is None:
        shape = infer_shape(src, tiles, owner=lambda d: d // src_dpp)
    if shape is None:
        raise ValueError("cannot infer the global shape from the src tiles of all processes "
                         f"(devices {sorted(tiles)[:8]}); pass shape= to reshard")
    dt = out.value("dtype")
    if dt is None:
        raise ValueError("no process holds a src tile, so the dtype is unknown; pass dtype=")
    tiling = src.tiles(tuple(shape))
    for r, m in enumerate(metas):
        check_tile_shapes(m.extra.get("tiles", {}), tiling, "src", rank=r)
    return Agreed(tuple(shape), dt[0], dt[1], out.value("kind", "numpy"), out.value("devtype", "cpu"))


def _abort(ex):
    if ex is not None:
        ex.abort()


def _optimistic(be) -> bool:
    """Whether a process may start sending before the agreement confirms the plan (MPI
    only: a disagreement then resets its communicators; MESHCOMM_OPTIMISTIC=0 turns it off)."""
    return be.name == "mpi" and settings.get("OPTIMISTIC")


@memo(maxsize=1024)
def _layouts_fp(src, dst) -> str:
    import hashlib
    return hashlib.sha1(repr((src, dst)).encode()).hexdigest()[:16]


def _as_kind(a, kind, devtype, name):
    """A host tile received early (see `_agree`) as the agreed kind and device (`name`: the
    dtype; bfloat16 and the float8 types reach torch through their bits)."""
    if kind != "torch":
        return a
    import torch
    if isinstance(a, torch.Tensor):
        t = a
    elif a.dtype.kind in "biufc":
        t = torch.from_numpy(a)
    else:
        t = torch.from_numpy(a.view(f"u{a.dtype.itemsize}")).view(getattr(torch, name))
    if devtype == "cuda":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    return t


def empty_like(kind, name, devtype):
    """An empty array of the agreed kind, dtype and device (a process without tiles)."""
    from ..arrays import numpy_dtype
    if kind == "torch":
        import torch
        dev = "cpu"
        if devtype == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        return torch.empty(0, dtype=getattr(torch, name), device=dev)
    return np.empty(0, dtype=numpy_dtype(name))
