"""A repeated collective compiled: the form a call takes once every process made it, with
the same arguments, often enough to have a signature communicator (meshcomm.runtime.agreement).

`fast_key` names the call (its Request, backend and tile type, shape and dtype); `Fast` keeps
what the full path (collective_call) worked out for it: the agreed facts, the hashes, the
native call and group, the Problem. Nothing here decides anything the full path would not:
the same native call goes on the same communicator under the same signature check, and
whatever does not fit hands the call back to the full path. MESHCOMM_FAST_PATH=0 turns it off.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from .. import arrays, settings
from ..backends import base
from . import agreement, native_call
from .agreement import Meta

__all__ = ["Fast", "fast_key"]


def fast_key(req, backend, x):
    """The key of a repeated call's compiled form: the arguments and the tile's type, shape
    and dtype (a bare NumPy array or CPU torch tensor in native byte order; None where the
    process passes no tile: a non-root of broadcast/scatter, or no device of the mesh), or None."""
    if x is None:
        return req, backend, None
    t = type(x)
    if t is np.ndarray:
        if not x.dtype.isnative:
            return None
        return req, backend, t, x.shape, x.dtype
    if arrays.is_torch(x) and x.device.type == "cpu":
        return req, backend, t, tuple(x.shape), x.dtype
    return None


class Fast:
    """A repeated collective compiled (MESHCOMM_FAST_PATH): once a call was checked by its
    signature communicator, the next call with the same arguments and the same kind of tile
    skips validation, hashing and choosing: it posts the same native call on the same
    communicator and waits for the same signature check (agreement.Pending.signed). Where
    anything it was built on changed (the agreed facts, the settings, the communicator after
    a reset) it does not apply and the full path runs; where the check does not pass it
    continues as the full path does from there (same exchange, same errors, same resets)."""

    def __init__(self, st, key, agreed, f, hashed, fields, pending, posted, nat, world_call, prob):
        st = dataclasses.replace(st, tiles={}, fence=None)     # no reference to the user's tile
        self.st, self.key, self.agreed, self.f, self.hashed, self.fields = st, key, agreed, f, hashed, fields
        self.p2p, self.vec, self.sigvec = pending.p2p, pending.vec, pending.key
        self.signame = ("agree", pending.key.tobytes())
        self.world = tuple(range(st.ctx.world_size))
        self.nat, self.world_call, self.prob = nat, world_call, prob
        self.group, self.me = posted.group, posted.me
        self.env = settings.raw(settings.COMPILED_DEPENDS)
        self.on = settings.get("FAST_PATH")
        self.out_shape = dict(prob.out_shapes).get(self.me)      # None: no result here (reduce, gather)
        self.scale = prob.scale
        self.post = None if self.me is None else native_call.poster(
            st.ctx, nat.prim, st.req, self.group, self.me, self.f.dtype, self.f.tile, self.f.shapes, self.f.kind)
        # counted as the full check and Posted.finish count theirs
        self.counts = (("signature_check", st.be.name), ("compiled", nat.prim.name),
                       ("native_" + nat.prim.name, st.req.op), ("optimistic_native", nat.prim.name))

    def run(self, ctx, x):
        """(the result tile,) as the user gets it (`finish_tiles`' work done here), or None
        where this form does not apply. Run where everything issued before has run (the
        caller's thread after waiting for the queue, or the queue's thread). The call is
        posted from the kept poster on its signature communicator; when the check passes
        within its first polls nothing else is built."""
        if not self.on or ctx.agreed.get(self.key) is not self.agreed or settings.raw(settings.COMPILED_DEPENDS) != self.env:
            return None
        p2p, st, f, req, nat = self.p2p, self.st, self.f, self.st.req, self.nat
        sig = p2p.sig_comm(self.world, self.signame)
        if sig is None or not agreement.inbox_ready(p2p):
            return None
        comm = sig if self.world_call or self.me is None else native_call.sig_comm_of(
            ctx, nat.prim, req, self.group, f.dtype, f.tile, f.shapes, None, create=False)
        if comm is None:
            return None
        prim = nat.prim
        if self.post is None:           # no device of the mesh here: the check alone
            works, fin = [], dict
        else:
            prim._pin = comm
            try:
                works, fin = self.post(x)
            finally:
                prim._pin = None
        # over every process the call's completion is the check; else a barrier over every
        # process on the signature communicator is
        tokens = works if self.world_call else p2p.ibarrier_on(sig)
        grace = agreement.quick_signed(p2p, tokens, ctx.timeout)
        if grace is True:
            if not self.world_call:
                prim.wait_all(works, time.monotonic() + ctx.timeout)
            issued = base.issued
            for k in self.counts:
                issued[k] += 1
            v = fin().get(self.me)
            if v is None:
                return (None,)
            v = v.reshape(self.out_shape)
            return (v if self.scale == 1 else arrays.divided(v, self.scale),)
        # a peer's hashes or the grace ran out: the full check, from where it is
        posted = native_call.Posted(self.group, self.me, works, fin, time.time())
        deadline = time.monotonic() + ctx.timeout
        tiles = {} if x is None else {self.me: x}
        meta = Meta(req.op, self.fields, None, {"tiles": {d: tuple(v.shape) for d, v in tiles.items()}})
        pending = agreement.Pending.signed(ctx.backend, p2p, meta, deadline, self.vec, self.sigvec, sig,
                                           counted=True, grace=grace)
        out = pending.hashes(tokens)
        from .collective_call import finish_tiles
        if out is not None and not out.mixed:
            base.issued[("signature_check", st.be.name)] += 1
            base.issued[("compiled", nat.prim.name)] += 1
            res = posted.finish(ctx, self.nat, req, self.prob, f.dtype, f.tile, deadline)
            return (finish_tiles(req, self.prob, res, True, st.owned),)
        # the check did not pass: on, as the full path (this call's own tile and Meta)
        from ..backends import streams
        st = dataclasses.replace(st, tiles=tiles, fence=streams.fence_from_current(None), fk=None)
        res = st.conclude(pending, meta, out, f, self.hashed, posted, self.nat, self.key, False, deadline)
        return (finish_tiles(req, res[3], res[0], res[4], res[5]),)
