"""A repeated reshard compiled: the collectives' compiled form (meshcomm.runtime.compiled)
applied to `reshard`.

`reshard_key` names the call (layouts, shape= and dtype=, backend, and each tile's type,
shape and dtype: bare NumPy arrays or CPU torch tensors in native byte order); `FastReshard`
keeps what the full path (reshard_call.PlannedCall) worked out for it: the agreed facts, the
hashes and the signature communicator, the plan, the peers. It skips validation, hashing and
planning, not the check: the same flat barrier goes out on the same communicator, the data
with a peer starts once that peer is in the call, and a check that does not pass continues
exactly as the full path does from there (`PlannedCall.conclude`). Whatever it was built on
that changed sends the call down the full path. MESHCOMM_FAST_PATH=0 turns it off.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from .. import arrays, settings
from ..backends import base, streams
from . import agreement
from .agreement import Meta

__all__ = ["FastReshard", "reshard_key"]


def _tile_key(v):
    t = type(v)
    if t is np.ndarray:
        return (t, v.shape, v.dtype) if v.dtype.isnative else None
    if arrays.is_torch(v) and v.device.type == "cpu":
        return t, tuple(v.shape), v.dtype
    return None


def reshard_key(x, src, dst, shape, dtype, backend):
    """The key of a reshard's compiled form, or None (a tile it does not take, or an
    argument that is not hashable)."""
    if type(x) is dict:
        tiles = []
        for d, v in x.items():
            k = _tile_key(v)
            if k is None:
                return None
            tiles.append((d, k))
        tiles = tuple(tiles)
    else:
        tiles = _tile_key(x)
        if tiles is None:
            return None
    key = ("reshard", src, dst, tuple(shape) if isinstance(shape, list) else shape, dtype, backend, tiles)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class FastReshard:
    """A repeated reshard compiled (MESHCOMM_FAST_PATH): once a call was checked by its
    signature communicator, the next one with the same arguments and the same kind of tiles
    posts the same flat barrier, builds the Execution of the same plan from this call's
    tiles and runs it, gated on the barrier as the full path gates it. Where anything it
    was built on changed (the agreed facts, the settings, the communicators or groups after
    a reset) it does not apply (`run` returns None) and the full path runs."""

    def __init__(self, call, key, agreed, pending, fields, guess, hashed, ex):
        ctx = call.ctx
        # a template of the call: no reference to the user's tiles or their fences
        self.call = dataclasses.replace(call, shards={}, fences=(), stamp=None)
        self.key, self.agreed, self.fields, self.guess, self.hashed = key, agreed, fields, guess, hashed
        self.p2p, self.vec, self.sigvec = pending.p2p, pending.vec, pending.key
        self.signame = ("agree", pending.key.tobytes())
        self.world = tuple(range(ctx.world_size))
        self.plan, self.device_kind = ex.plan, ex.device_kind
        self.peers = ex.peers()
        self.owned = tuple(call.shards)
        self.like = None if call.shards else ex.run.like   # an empty array of the full path's own
        self.bare = call.bare
        self.env = settings.raw(settings.COMPILED_DEPENDS)
        self.on = settings.get("FAST_PATH")

    def run(self, ctx, x):
        """The call's result (as PlannedCall.run returns it), or None where this form does not apply."""
        if not self.on or ctx.agreed.get(self.key) is not self.agreed or settings.raw(settings.COMPILED_DEPENDS) != self.env:
            return None
        p2p, be = self.p2p, self.call.be
        sig = p2p.sig_comm(self.world, self.signame)
        if sig is None or not agreement.inbox_ready(p2p) \
                or not base.groups_ready(self.plan, be, ctx.devices_per_process, self.device_kind):
            return None
        if self.bare:
            shards = {self.owned[0]: x} if self.owned else {}
        else:
            shards = {d: x[d] for d in self.owned}
        call = object.__new__(type(self.call))     # dataclasses.replace, without its checks
        call.__dict__.update(self.call.__dict__, shards=shards, fences=(streams.fence_from_current(None),))
        deadline = time.monotonic() + ctx.timeout
        run_kw = dict(rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=be,
                      producer_fences=call.fences)
        meta = Meta("reshard", self.fields, None)
        pending = agreement.Pending.signed(ctx.backend, p2p, meta, deadline, self.vec, self.sigvec, sig)
        tokens = pending.signature_tokens()
        like = next(iter(shards.values())) if shards else self.like
        ex = base.Execution(self.plan, shards, like, device_kind=self.device_kind, **run_kw)
        early = []
        # as the full path: the data with a peer starts once the peers it moves between are
        # in this exact call; the result waits for the whole barrier
        ready = ([w for w in tokens[:ctx.world_size - 1] if w.peers[0] in self.peers],
                 lambda: (ex.start(), early.append(True)))
        out = pending.hashes(tokens, ready)
        if out is not None and not out.mixed:
            if not early:
                ex.start()
            base.issued[("signature_check", be.name)] += 1
            base.issued[("compiled_reshard", be.name)] += 1
            return call.complete(ex, self.agreed, run_kw, deadline, None)
        # the check did not pass: on, as the full path (this call's tiles and Meta)
        ex, agreed = call.conclude(pending, meta, out, ex, early, self.guess, self.hashed, self.key)
        return call.complete(ex, agreed, run_kw, deadline, None)
