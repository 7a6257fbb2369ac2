"""The executor: a Program's plans (one reshard's, or a batch's) run as one: per stage, ONE
message between each pair of processes.

`Runner(plans, ...)` takes the plans (a batch's: one per tensor, senders chosen for the whole
batch by the planner) and runs this rank's part of all of them together:

* Stage k of every plan runs in stage k of the batch (a plan's later stage may read what
  its earlier one wrote; plans are independent of each other).
* Point-to-point steps are coalesced: everything under `OWN_MESSAGE` bytes this rank sends to
  peer q in stage k, over every tensor, is packed into one buffer (tensors in batch order,
  each tensor's transfers in its plan order: the same order on both sides), sent as one
  message, unpacked at q in the same order. A piece of `OWN_MESSAGE` bytes or more is a
  message of its own, behind it in the same order (same tag: MPI and gloo keep a pair's
  order), sent from its tile where it is one contiguous run there and received straight into
  its destination tile where it is one there: a single reshard's plan runs here as a batch
  of one, as fast as a message per transfer. Local steps copy directly, while the messages
  travel.
* Buckets: the tensors are cut into consecutive buckets of at most `bucket_bytes` of
  messages each; a bucket's messages are posted, the next bucket is packed while they
  travel, and at most two buckets are in flight (the extra memory bound).
* Broadcasts are sent from their root to each member, coalesced like sends. A sum across
  processes (a pending-sum src) sends each addend to the root's process like a piece, and
  the root adds them up in the plan's order of its srcs (bitwise what the local backend
  gives). Where the backend runs a broadcast on a group (`Backend.bcast_group`: MPI across
  hosts, NCCL) or a sum as its own reduce (`base.collective_reduce_ok`: integers), that step
  is a collective of the round instead, issued in plan order (the same on every member)
  after the round's receives are posted, before its sends.
* Backends: one, or `mixed`'s choice per message and collective (its tuning table, by
  bytes), made when the Runner is built; a round's works of both are then waited for
  together (`MixedBackend.wait_all` polls both: deadlock-free once everything is issued).

The planner chose what moves; this module only packs, posts and unpacks (backends never
decide what to send).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from meshcomm.arrays import is_torch as _is_torch
from meshcomm.caches import memo
from meshcomm.planners.boxes import contiguous_in, local_slices
from meshcomm.reduceops import combine_

from . import base, streams
from .base import (TAG_MOD, Run, collective_reduce_ok, empty_wire, from_wire, groups_needed, compile_steps,
                   out_specs, result_tiles, to_wire, torch_of)
from .pack import pack, unpack

__all__ = ["BatchItem", "Runner", "execute"]


@dataclasses.dataclass
class BatchItem:
    """One tensor of a batch on this rank: its plan, its src tiles, a `like` array (kind,
    dtype, device of new tiles) and optional result buffers."""

    plan: object
    shards: dict
    like: object
    out: dict | None = None


def execute(plan, shards, like, *, rank: int, devices_per_process: int, backend, deadline) -> dict:
    """Run this rank's part of one plan as a Program of it would (tools that compare plans,
    `meshcomm bench run` and the demo, run every plan through it: like for like)."""
    r = _runner(plan, rank, devices_per_process, backend)
    r.prepare(deadline)
    return r.run([BatchItem(plan, shards, like)], (0, TAG_MOD), deadline)[0][0]


@memo(maxsize=64)
def _runner(plan, rank, dpp, backend) -> "Runner":
    return Runner([plan], rank=rank, devices_per_process=dpp, backend=backend)


class Runner:
    """The executor: the coalesced batch of one rank, worked out once (a Program keeps it):
    per stage and bucket, the local steps, the collectives on groups, and per peer the pieces
    sent and received with their offsets in the one message and the backend carrying it (for
    `mixed`, the tuning table's choice by the message's bytes, made here). A run allocates
    the dst tiles, packs each piece straight into its message, posts, waits and unpacks from
    the message, on the backend's CUDA stream where the tiles are on a device."""

    def __init__(self, plans, *, rank, devices_per_process, backend, bucket_bytes=None, device_kind="cpu"):
        dpp = devices_per_process
        self.plans, self.rank, self.be = plans, rank, backend
        one = len(backend.members()) == 1
        # waits go to the backend itself (mixed: both members' works polled together)
        self.b = b0 = backend.members()[0] if one else backend

        used: dict = {}

        def pick(op, n, k):             # the backend of one message or collective
            if one:
                return b0
            c = backend.choose(op, n, k, device_kind)
            used[c.name] = c
            return c
        rank_of = self.rank_of = lambda d: d // dpp  # noqa: E731
        self.coll = [collective_reduce_ok(p.dtype, backend) for p in plans]
        steps = [compile_steps(p, rank, dpp, c) for p, c in zip(plans, self.coll)]
        self.groups: dict = {}          # {backend name: groups of the collectives}, every process alike
        for p, c in zip(plans, self.coll):
            for name, gs in groups_needed(p, dpp, c, lambda s: backend.choose(s.table_op, s.nbytes, len(s.ranks),
                                                                              device_kind), device_kind).items():
                self.groups.setdefault(name, []).extend(g for g in gs if g not in self.groups.get(name, []))
        self.nstages = max((st.stage for ss in steps for st in ss), default=-1) + 1
        self.buckets = _buckets(plans, bucket_bytes)
        self.rounds = []                # per (stage, bucket): (locals, sends, recvs, sums, collectives)
        for k in range(self.nstages):
            for bucket in self.buckets:
                local, sends, recvs, sums, colls = [], {}, {}, [], []
                for i in bucket:
                    p = plans[i]
                    st_, dt_ = p.src.tiles(p.shape), p.dst.tiles(p.shape)
                    for s in steps[i]:
                        if s.stage != k:
                            continue
                        t = p.transfers[s.index]
                        if s.prim == "local":     # box by box, tile to tile (host tiles)
                            origin = (st_ if t.src_buf == "src" else dt_).boxes[t.srcs[0]]
                            local.append((i, t, None if t.kind == "reduce" else [
                                (local_slices(bx, origin), d, local_slices(bx, dt_.boxes[d]))
                                for d in t.dsts for bx in t.boxes]))
                            continue
                        cb = pick(s.table_op, s.nbytes, len(s.ranks))
                        if s.prim == "reduce" or (s.prim == "bcast" and cb.bcast_group(s.ranks, device_kind)):
                            colls.append((i, s, t, cb))     # in plan order: the same on every member
                            continue
                        key = (i, s.index)
                        if t.kind == "reduce":      # every addend to the root, summed there in order
                            origin = (st_ if t.src_buf == "src" else dt_).boxes
                            for sd in t.srcs:
                                q = rank_of(sd)
                                if q == rank and s.root != rank:
                                    sends.setdefault(s.root, []).append((key, (
                                        i, t, [local_slices(bx, origin[sd]) for bx in t.boxes], [],
                                        _whole(t, origin[sd]), sd)))
                                elif q != rank and s.root == rank:
                                    recvs.setdefault(q, []).append((key, (i, t, [], None, sd)))
                            if s.root == rank:
                                sums.append((i, t))
                            continue
                        mine = [(d, [local_slices(bx, dt_.boxes[d]) for bx in t.boxes])
                                for d in t.dsts if rank_of(d) == rank]
                        if s.root == rank:
                            origin = (st_ if t.src_buf == "src" else dt_).boxes[t.srcs[0]]
                            piece = (i, t, [local_slices(bx, origin) for bx in t.boxes], mine,
                                     _whole(t, origin), t.srcs[0])
                            for peer in s.ranks:
                                if peer != rank:
                                    sends.setdefault(peer, []).append((key, piece))
                        else:
                            whole = _whole(t, dt_.boxes[mine[0][0]]) if len(mine) == 1 else None
                            recvs.setdefault(s.root, []).append((key, (i, t, mine, whole, None)))
                # both sides lay a message out in (tensor, transfer) order: a rank issues its
                # steps by role (a broadcast's before a send's), which its peer may not share
                # (a sort that keeps the addends of one sum in the plan's order of its srcs)
                order = lambda d: {q: [x for _, x in sorted(v, key=lambda e: e[0])] for q, v in d.items()}  # noqa: E731
                self.rounds.append((local, _offsets(order(sends), pick), _offsets(order(recvs), pick), sums, colls))
        self.out_shapes = [out_specs(p, rank, dpp) for p in plans]
        self.tilings = [(p.src.tiles(p.shape), p.dst.tiles(p.shape)) for p in plans]
        if len(used) == 1:              # `mixed` sending all of this rank's part to one backend: waits there
            self.b = next(iter(used.values()))
        self.mixed = tuple(sorted(used)) if len(used) > 1 else ()     # (counted per run: tests, stats)

    def prepare(self, deadline) -> None:
        """Create the groups of this batch's collectives (collectively: every process of the
        Program calls it at construction, in the same order)."""
        for b in self.be.members():
            b.prepare_groups(self.groups.get(b.name, []), deadline)

    def run(self, items, tags, deadline, fences=()):
        """([{dst device: tile}] in item order, a fence the consumer waits on before using
        them, None for NumPy tiles). `fences`: the producers' of the src tiles, waited for on
        the comm stream."""
        if all(type(it.like) is np.ndarray for it in items):   # host tiles: no stream, nothing to fence
            return self._run(items, tags, deadline, None), None
        stream = streams.comm_stream(self.b.name, streams.device_of(items[0].like))
        for f in fences:                # compute -> comm: wait for the producers of the inputs
            f.wait_on(stream)
        with streams.use(stream):
            outs = self._run(items, tags, deadline, stream)
            return outs, streams.record(stream)     # comm -> compute

    def _run(self, items, tags, deadline, stream):
        b, rank, rank_of = self.b, self.rank, self.rank_of
        outs, runs = [], []
        for it, p, shapes, (st, dt) in zip(items, self.plans, self.out_shapes, self.tilings):
            out = result_tiles(p, shapes, it.like, it.out)
            outs.append(out)
            runs.append(Run(p, it.shards, out, it.like, rank, rank_of, st, dt))
        base.issued[("batch", b.name)] += 1
        for name in self.mixed:         # `mixed`: the backends its messages go to
            base.issued[("mixed", name)] += 1
        tag0, span = tags
        inflight: list = []
        nb_ = len(self.buckets)
        for r, (local, sends, recvs, sums, colls) in enumerate(self.rounds):
            works, fins, calls = [], [], []
            tag = tag0 + r % span
            for peer, (parts, offs, n, mb, own) in recvs.items():
                if parts:
                    buf = empty_wire(n, mb.wire, runs[parts[0][0]].like)
                    works.append(mb.irecv(buf, peer, tag))
                    fins.append((buf, parts, offs))
                for part, ob in own:    # a message of its own: straight into its tile where it can
                    i, t, mine, whole, _ = part
                    buf = _run_of(runs[i].out[mine[0][0]], whole) if whole is not None and ob.wire == "numpy" else None
                    if buf is None and mine:
                        buf = runs[i]._recv_into(t, [d for d, _ in mine], ob.wire)
                    if buf is None:
                        buf = empty_wire(t.nbytes, ob.wire, runs[i].like)
                        fins.append((buf, [part], [0]))
                    works.append(ob.irecv(buf, peer, tag))
            for i, s, t, cb in colls:   # a broadcast on a group, a backend's reduce
                w, fin = runs[i].issue(s, t, cb, stream)
                works += w
                if fin is not None:
                    calls.append(fin)
                base.issued[(cb.name, s.prim)] += 1
            ready: dict = {}
            for peer, (parts, offs, n, mb, own) in sends.items():
                if parts:
                    works.append(mb.isend(self._message(runs, parts, offs, n, mb.wire, stream), peer, tag))
                    base.issued[(mb.name, "p2p_batched")] += 1
                for part, ob in own:    # a broadcast's piece: made once for every peer
                    v = ready.get((id(part), ob.wire))
                    if v is None:
                        v = ready[(id(part), ob.wire)] = self._message(runs, [part], [0], part[1].nbytes,
                                                                        ob.wire, stream)
                    works.append(ob.isend(v, peer, tag))
                    base.issued[(ob.name, "p2p")] += 1
            for i, t, copies in local:  # while the messages travel
                run = runs[i]
                src = (run.shards if t.src_buf == "src" else run.out).get(t.srcs[0])
                if copies is None or type(src) is not np.ndarray:
                    run.local(t)
                    continue
                for ssl, d, dsl in copies:
                    run.out[d][dsl] = src[ssl]
            inflight.append((works, runs, fins, sums, calls))
            if len(inflight) >= 2 or (r + 1) % nb_ == 0:    # two buckets at most; a stage ends
                while inflight and (len(inflight) >= 2 or (r + 1) % nb_ == 0):
                    _finish(b, inflight.pop(0), deadline)
        while inflight:
            _finish(b, inflight.pop(0), deadline)
        return outs

    def _message(self, runs, parts, offs, n, wire, stream):
        """The pieces for one peer packed straight into one buffer of the wire kind (a lone
        contiguous piece is sent from its tile, this rank's own copies of it made box to box)."""
        if len(parts) == 1 and offs[0] == 0:
            i, t, slices, mine, whole, dev = parts[0]
            run = runs[i]
            tile = (run.shards if t.src_buf == "src" else run.out)[dev]
            v = _run_of(tile, whole) if whole is not None and wire == "numpy" else None
            if v is not None:
                for d, sl in mine:
                    run.out[d][sl[0]] = tile[slices[0]]
                return v
            v = run._packed(t, dev)
            for d, sl in mine:
                unpack(v, runs[i].out[d], sl)
            if _size(v) % ALIGN == 0 or _size(v) == n:
                return to_wire(v, wire, stream)
        like = runs[parts[0][0]].like
        buf = empty_wire(n, wire, like)
        for (i, t, slices, mine, _, dev), off in zip(parts, offs):
            run = runs[i]
            bufs = run.shards if t.src_buf == "src" else run.out
            tile = bufs[dev]
            m = t.nbytes
            view = buf[off:off + m]
            host = _host_array(tile) if _is_torch(tile) and not _is_torch(view) else None
            if host is not None:            # a CPU tensor into a NumPy message: packed once, in place
                pack(host, slices, out=view.view(host.dtype))
                v = torch_of(view.view(host.dtype)) if mine else None
            elif _is_torch(tile) == _is_torch(view) and (not _is_torch(tile) or tile.device == view.device):
                pack(tile, slices, out=view.view(tile.dtype))
                v = view.view(tile.dtype)
            else:
                v = pack(tile, slices)
                view[...] = to_wire(v, wire, stream)
            for d, sl in mine:
                unpack(v, run.out[d], sl)
        return buf


def _host_array(t):
    """A NumPy view of a CPU tensor (None where there is none: a CUDA tensor, bfloat16)."""
    if t.device.type != "cpu":
        return None
    try:
        return t.detach().numpy()
    except (TypeError, RuntimeError):
        return None


# a piece of at least this many bytes travels as a message of its own (no packing into the
# coalesced message and out of it: two copies of it saved), smaller ones coalesce (a peer's
# only piece is a message of its own whatever its size)
OWN_MESSAGE = 64 << 10


def _offsets(by_peer, pick):
    """{peer: (coalesced parts, their byte offsets in that message, its size, its backend (None
    without parts), the parts sent as messages of their own with theirs)}, peers sorted; the same split and
    choice on both sides (plan facts; `pick(op, bytes, group size)`: the backend)."""
    out = {}
    for peer in sorted(by_peer):
        parts, offs, n = [], [], 0
        lone = len(by_peer[peer]) == 1          # nothing to coalesce it with
        own = [p for p in by_peer[peer] if lone or p[1].nbytes >= OWN_MESSAGE]
        for part in by_peer[peer]:
            if not lone and part[1].nbytes < OWN_MESSAGE:
                parts.append(part)
                offs.append(n)
                n += _padded(part[1].nbytes)
        out[peer] = (parts, offs, n, pick("send", n, 2) if parts else None,
                     [(p, pick("send", p[1].nbytes, 2)) for p in own])
    return out


def _size(v) -> int:
    return int(v.numel()) * v.element_size() if _is_torch(v) else v.nbytes


def _whole(t, origin):
    """The index of transfer `t`'s piece in a C-ordered tile at `origin` where it is one
    contiguous run of it (`+ (...,)`: a view of a 0-d tile too), else None."""
    if len(t.boxes) == 1 and contiguous_in(t.boxes[0], origin):
        return local_slices(t.boxes[0], origin) + (...,)
    return None


def _run_of(tile, whole):
    """The bytes of a NumPy tile's contiguous piece, as a view (None: not a C-ordered array)."""
    if type(tile) is np.ndarray and tile.flags.c_contiguous:
        return tile[whole].reshape(-1).view(np.uint8)
    return None


def _finish(b, entry, deadline):
    works, runs, fins, sums, calls = entry
    if works:
        b.wait_all(works, deadline)
    for fin in calls:                   # the collectives' results into their tiles
        fin()
    addends: dict = {}
    for buf, parts, offs in fins:
        for (i, t, mine, _, src), off in zip(parts, offs):
            run = runs[i]
            v = from_wire(buf[off:off + t.nbytes], run.like)
            if src is not None:         # an addend of a sum this rank makes
                addends[(i, id(t), src)] = v
            for d, sl in mine:
                unpack(v, run.out[d], sl)
    for i, t in sums:                   # in the plan's order of the addends (bitwise the local backend's)
        run, acc = runs[i], None
        for sd in t.srcs:
            v = addends.get((i, id(t), sd))
            if v is None:
                v = run._packed(t, sd, copy=True)
            acc = v if acc is None else combine_(acc, v, run.plan.reduce_op)
        run._unpack_to(t, t.dsts[0], acc)


ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _buckets(plans, bucket_bytes):
    """The tensors in consecutive buckets of at most `bucket_bytes` of planned transfers (a
    tensor larger than that is a bucket alone); the same cut on every rank (plans' bytes)."""
    if not bucket_bytes:
        return [list(range(len(plans)))]
    out, cur, size = [], [], 0
    for i, p in enumerate(plans):
        nb = sum(t.nbytes for t in p.transfers if t.kind != "copy")
        if cur and size + nb > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        out.append(cur)
    return out

