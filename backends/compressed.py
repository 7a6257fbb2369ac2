"""The compressed executor: a plan's transfers carried as coded chunks through a pipeline (encode, wire, decode overlap).

`execute(..., compression=Compression(...))` runs a compressed Program's plan (instead of
the batch executor); `execute_local` is the same for one process owning every device. What
each transfer kind does with the codec, and the error it adds, is in planners/compressed.py;
this module moves the bytes:

* Every transfer is cut into messages of coded units (`planners.compressed.messages`), the
  same on every process. Messages travel along the transfer's hops; a hop between devices
  of one process hands the payload over in memory (it is still encoded and decoded, so
  results do not depend on which process owns which device).
* One event loop per process and stage: non-blocking sends and receives with a callback
  each, and CPU tasks (encode, decode, add) run one at a time by priority (relays that
  feed the next hop first, then a chain's first encodes, then final decodes), polling the
  network between tasks. So chunk k+1 encodes while chunk k is on the wire and chunk k-1
  is decoded at the far end, and a relay forwards a chunk as soon as it arrives.
* Fixed-size codecs (ZFP rate, casts): the receiver knows every payload's size and posts
  all receives at once. A unit holding NaN or Inf (ZFP) or values its cast overflows is
  the head of that size plus a tail of exact values (meshcomm/compression/nonfinite.py):
  the heads travel as always, the message's tails after it on tag + 1, and the receiver,
  reading from the heads that tails follow and how long they are (`codec.tail_bytes`),
  receives them in message order; a tile of finite values sends nothing more.
  Data-dependent codecs (tolerance, precision): each message is preceded by a small header
  of its units' sizes (tag + 1), and its payload is received once the header is in.
* Tags: each hop between two processes in a stage gets its own even tag, in plan order,
  so messages of different hops never match each other; messages of one hop match in order.

`stats` (backends/pipeline.py, the event loop) counts what this process put on and took off
the wire (payloads and headers).
"""
from __future__ import annotations

import numpy as np
from meshcomm.planners.boxes import box_size, local_slices
from meshcomm.planners.compressed import (
    Compression,
    chain,
    hops,
    messages,
    replicated_reductions,
)

from meshcomm.arrays import numpy_dtype
from meshcomm.compression import Encoded
from meshcomm.compression.base import host_array
from meshcomm.reduceops import combine_

from . import streams
from .base import TAG_MOD, out_specs, result_tiles
from .local import alloc_like
from .pipeline import Engine, stats

__all__ = ["execute", "execute_local", "stats"]

# task priorities, smallest first: feeding a next hop, a chain's first encode, the rest
RELAY, START, FINAL = (0, 0), (1, 0), (2, 0)


def execute(plan, shards, like, *, rank: int, devices_per_process: int, backend, device_kind: str,
            compression: Compression, deadline, out=None, tags=(0, TAG_MOD)):
    """This rank's part of `plan` compressed: ({dst device: tile} this rank owns, a fence the
    consumer waits on before using them). `tags`: (first, span) of the run's own tags (a
    Program's), so no other call's message can match its messages."""
    dpp = devices_per_process
    res = result_tiles(plan, out_specs(plan, rank, dpp), like, out)
    b = backend.choose("send", compression.chunk_bytes, 2, device_kind)
    _Program(plan, compression, shards, res, rank, lambda d: d // dpp, b, deadline,
             plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape), tags).run()
    return res, streams.record(streams.comm_stream("local", streams.device_of(like)))


def execute_local(plan, shards, like, comp: Compression) -> dict:
    """Run `plan` compressed in this process, which owns every device: {dst device: tile}."""
    st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)
    zero = set(plan.zero_fill)
    out = {d: alloc_like(like, tuple(b - a for a, b in box), zero=d in zero or box_size(box) == 0,
                         op=plan.fill_op) for d, box in dt.boxes.items()}
    _Program(plan, comp, shards, out, 0, lambda d: 0, None, None, st, dt).run()
    return out


class _Program:
    """This process's part of a compressed plan, stage by stage."""

    def __init__(self, plan, comp: Compression, shards, out, rank, rank_of, backend, deadline, st, dt,
                 tags=(0, TAG_MOD)):
        self.plan, self.comp, self.codec, self.first, self.span = plan, comp, comp.codec, tags[0], tags[1]
        self.rank, self.rank_of, self.backend, self.deadline = rank, rank_of, backend, deadline
        self.st, self.dt = st, dt
        self.dtype = numpy_dtype(plan.dtype)
        self.src = {d: host_array(v, self.codec) for d, v in shards.items()}
        self.dst = {d: host_array(v, self.codec) for d, v in out.items()}
        self.fixed = self.codec.fixed_size
        self.op = plan.reduce_op
        self.world = 1 if backend is None else backend.world_size

    def run(self) -> None:
        stats["calls"] += 1
        by_stage: dict = {}
        for i, t in enumerate(self.plan.transfers):
            by_stage.setdefault(t.stage, []).append(i)
        for stage in sorted(by_stage):
            idx = by_stage[stage]
            self.tags = self._tags(idx)
            self.cache: dict = {}
            self.msgs: dict = {}
            self.after: list = []
            self.eng = Engine(self.backend, self.rank, self.deadline)
            for i in idx:
                self._setup(i)
            self.eng.run()
            for f in self.after:
                f()

    def _tags(self, idx) -> dict:
        tags, n = {}, 0
        for i in idx:
            t = self.plan.transfers[i]
            if t.kind == "copy":
                continue
            for u, v in hops(t, self.comp):
                if self.rank_of(u) != self.rank_of(v):
                    tags[(i, u, v)] = self.first + (2 * n) % self.span    # and + 1: a message's tails
                    n += 1
        return tags

    def _mine(self, d: int) -> bool:
        return self.rank_of(d) == self.rank

    # -- reading, coding, writing units ----------------------------------------------------
    def _read(self, t, dev: int, unit):
        bufs, origin = (self.src, self.st.boxes) if t.src_buf == "src" else (self.dst, self.dt.boxes)
        if dev not in bufs:
            raise ValueError(f"rank {self.rank} owns src device {dev} but was given no tile for it")
        return bufs[dev][local_slices(unit.box, origin[dev])].reshape(unit.shape)

    def _encode(self, t, dev: int, msg, cached: bool = True) -> list:
        parts = []
        for u in msg:
            key = (t.src_buf, dev, u.box)
            p = self.cache.get(key) if cached else None
            if p is None:
                p = self.codec.encode(self._read(t, dev, u)).payload
                if cached:
                    self.cache[key] = p
            parts.append(p)
        return parts

    def _decode(self, part, unit) -> np.ndarray:
        return self.codec.decode(Encoded(part, self.codec, self.dtype, unit.shape))

    def _target(self, dev: int, unit):
        # `+ (...,)`: a view of a 0-d tile too (indexed by () NumPy gives a scalar copy)
        return self.dst[dev][local_slices(unit.box, self.dt.boxes[dev]) + (...,)]

    def _decode_into(self, dev: int, msg, parts) -> None:
        for u, p in zip(msg, parts):
            tgt = self._target(dev, u)
            if tgt.flags.c_contiguous:
                self.codec.decode(Encoded(p, self.codec, self.dtype, u.shape), out=tgt.reshape(u.shape))
            else:
                tgt[...] = self._decode(p, u).reshape(tgt.shape)

    def _write(self, dev: int, unit, values) -> None:
        tgt = self._target(dev, unit)
        tgt[...] = values.reshape(tgt.shape)

    # -- moving messages along hops ----------------------------------------------------------
    def _deliver(self, i: int, u: int, v: int, m: int, parts, arrive) -> None:
        """Message m of transfer i from device u to device v: in memory when v is this
        process's (`arrive(m, parts)`), else over the network."""
        if self._mine(v):
            arrive(m, parts)
            return
        tag, peer = self.tags[(i, u, v)], self.rank_of(v)
        if not self.fixed:
            self.eng.send(np.array([p.size for p in parts], "<i8").view(np.uint8), peer, tag + 1)
        tails = None
        if self.fixed:                      # heads of the fixed size; tails (NaN, Inf) after
            wire = [x.wire for x in self.msgs[i][m]]
            if any(p.size > w for p, w in zip(parts, wire)):
                tails = [p[w:] for p, w in zip(parts, wire)]
                parts = [p[:w] for p, w in zip(parts, wire)]
        self.eng.send(parts[0] if len(parts) == 1 else np.concatenate(parts), peer, tag)
        if tails is not None:
            self.eng.send(np.concatenate(tails), peer, tag + 1)

    def _listen(self, i: int, u: int, v: int, msgs, arrive) -> None:
        """Post the receives of every message of hop u -> v (v is this process's)."""
        if self._mine(u):
            return
        tag, peer = self.tags[(i, u, v)], self.rank_of(u)

        def split(buf, sizes):
            return np.split(buf, np.cumsum(sizes[:-1]))
        heads: dict = {}
        nxt = [0]
        if self.fixed:
            # a message's tails (NaN, Inf) follow on tag + 1: their receives are posted in
            # message order, and messages arrive in order (a relay forwards them as they come,
            # and the next hop's receives match in order)
            done: dict = {}
            nxt.append(0)

            def flush():
                while nxt[1] in done:
                    k = nxt[1]
                    nxt[1] += 1
                    arrive(k, done.pop(k))

            def with_tails(k, parts, tails, buf):
                done[k] = [np.concatenate([p, t]) for p, t in zip(parts, split(buf, tails))]
                flush()

            def on_fixed(m, parts):
                heads[m] = parts
                while nxt[0] in heads:
                    k = nxt[0]
                    nxt[0] += 1
                    got = heads.pop(k)
                    tails = [self.codec.tail_bytes(p, x.shape, self.dtype) for p, x in zip(got, msgs[k])]
                    if any(tails):
                        self.eng.recv(sum(tails), peer, tag + 1,
                                      lambda b, k=k, g=got, t=tails: with_tails(k, g, t, b))
                    else:
                        done[k] = got
                flush()
            for m, msg in enumerate(msgs):
                sizes = [x.wire for x in msg]
                self.eng.recv(sum(sizes), peer, tag, lambda buf, m=m, s=sizes: on_fixed(m, split(buf, s)))
            return

        def on_head(m, buf):            # payload receives are posted in message order
            heads[m] = [int(x) for x in buf.view("<i8")]
            while nxt[0] in heads:
                k = nxt[0]
                s = heads.pop(k)
                self.eng.recv(sum(s), peer, tag, lambda b, k=k, s=s: arrive(k, split(b, s)))
                nxt[0] += 1
        for m, msg in enumerate(msgs):
            self.eng.recv(8 * len(msg), peer, tag + 1, lambda buf, m=m: on_head(m, buf))

    # -- transfers ---------------------------------------------------------------------------
    def _setup(self, i: int) -> None:
        t, comp, eng = self.plan.transfers[i], self.comp, self.eng
        msgs = self.msgs[i] = messages(self.plan, i, comp)
        if t.kind == "copy":
            d = t.srcs[0]
            if self._mine(d):
                for msg in msgs:
                    eng.task(FINAL, lambda msg=msg: self._decode_into(d, msg, self._encode(t, d, msg)))
        elif t.kind in ("send", "bcast") or comp.reduce == "ring":
            self._setup_chain(i, t, chain(t, comp), msgs)
        else:
            self._setup_oneshot(i, t, msgs)

    def _setup_chain(self, i, t, c, msgs) -> None:
        for pos, dev in enumerate(c):
            if not self._mine(dev):
                continue
            if pos > 0:
                self._listen(i, c[pos - 1], dev, msgs, self._arrival(i, t, c, pos, msgs))
                continue
            nxt, after = self._next(i, t, c, 0, msgs)
            for m, msg in enumerate(msgs):
                self.eng.task(START, lambda m=m, msg=msg, dev=dev, nxt=nxt, after=after:
                              self._chain_start(i, t, m, msg, dev, nxt, after))

    def _arrival(self, i, t, c, pos: int, msgs):
        """The function receiving messages at chain position `pos`."""
        return (self._ring_arrival if t.kind == "reduce" else self._bcast_arrival)(i, t, c, pos, msgs)

    def _next(self, i, t, c, pos: int, msgs):
        """(the device after chain position `pos`, or None; its arrival function where it is this process's)."""
        nxt = c[pos + 1] if pos + 1 < len(c) else None
        return nxt, (self._arrival(i, t, c, pos + 1, msgs) if nxt is not None and self._mine(nxt) else None)

    def _chain_start(self, i, t, m, msg, dev, nxt, after) -> None:
        if t.kind == "reduce":
            if nxt is None:                 # a reduction of the root's own addend alone
                for u in msg:
                    self._write(dev, u, self._read(t, dev, u))
                return
            parts = self._encode(t, dev, msg, cached=False)
        else:
            parts = self._encode(t, dev, msg)
            if t.src_buf == "dst":          # the sender keeps what the others get
                self.after.append(lambda: self._decode_into(dev, msg, parts))
        self._deliver(i, dev, nxt, m, parts, after)

    def _bcast_arrival(self, i, t, c, pos, msgs):
        dev, (nxt, after) = c[pos], self._next(i, t, c, pos, msgs)

        def arrive(m, parts):
            msg = msgs[m]
            if not self.comp.per_hop:
                if nxt is not None:         # forward the compressed bytes as they are
                    self._deliver(i, dev, nxt, m, parts, after)
                self.eng.task(FINAL, lambda: self._decode_into(dev, msg, parts))
                return

            def relay():                    # point-to-point compression: decode, re-encode
                self._decode_into(dev, msg, parts)
                if nxt is not None:
                    again = [self.codec.encode(self._target(dev, u).reshape(u.shape)).payload for u in msg]
                    self._deliver(i, dev, nxt, m, again, after)
            self.eng.task(RELAY if nxt is not None else FINAL, relay)
        return arrive

    def _ring_arrival(self, i, t, c, pos, msgs):
        dev, (nxt, after) = c[pos], self._next(i, t, c, pos, msgs)
        own = dev in t.srcs

        def arrive(m, parts):
            msg = msgs[m]

            def step():                     # decode the partial sum, add, re-encode or keep
                vals = []
                for u, p in zip(msg, parts):
                    v = self._decode(p, u)
                    if own:
                        v = combine_(v, self._read(t, dev, u), self.op)
                    vals.append(v)
                if nxt is None:
                    for u, v in zip(msg, vals):
                        self._write(dev, u, v)
                    return
                self._deliver(i, dev, nxt, m, [self.codec.encode(v).payload for v in vals], after)
            self.eng.task(RELAY if nxt is not None else FINAL, step)
        return arrive

    def _setup_oneshot(self, i, t, msgs) -> None:
        eng, r = self.eng, t.dsts[0]
        # an all-reduce planned as one reduction per device: every root codes its own addend
        # too and all combine in device order, so the replicas hold the same values
        same = t.boxes in replicated_reductions(self.plan)
        order = tuple(sorted(t.srcs)) if same else t.srcs
        remote = [a for a in t.srcs if a != r or same]
        got = [{} for _ in msgs]

        def combine(m):
            msg = msgs[m]
            for j, u in enumerate(msg):
                acc = None
                for s in order:             # the plan's order; the root's own addend exact
                    coded = s in got[m]
                    v = got[m][s][j] if coded else self._read(t, r, u)
                    acc = (v if coded else v.copy()) if acc is None else combine_(acc, v, self.op)
                self._write(r, u, acc)
            got[m].clear()

        def arrive_from(a):
            def arrive(m, parts):
                def dec():
                    got[m][a] = [self._decode(p, u) for u, p in zip(msgs[m], parts)]
                    if len(got[m]) == len(remote):
                        combine(m)
                eng.task(FINAL, dec)
            return arrive
        # every process encodes for the roots after it first (rotated), so each root's
        # addends arrive spread over the stage and no root decodes all of them at the end
        turn = (START[0], (self.rank_of(r) - self.rank) % max(1, self.world))
        for a in remote:
            if self._mine(a):
                for m, msg in enumerate(msgs):
                    eng.task(turn, lambda a=a, m=m, msg=msg: self._deliver(
                        i, a, r, m, self._encode(t, a, msg), arrive_from(a) if self._mine(r) else None))
            if self._mine(r):
                self._listen(i, a, r, msgs, arrive_from(a))
        if self._mine(r) and not remote:
            for m in range(len(msgs)):
                eng.task(FINAL, lambda m=m: combine(m))
