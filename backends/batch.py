"""Many tensors' plans run as one: per stage, ONE message between each pair of processes.

`run_batch(items, ...)` takes the plans of a batch (one per tensor, senders chosen for the
whole batch by the planner) and runs this rank's part of all of them together:

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
  the root adds them up in the plan's order of its srcs (bitwise what the step executor
  and the local backend give).

The planner chose what moves; this module only packs, posts and unpacks (backends never
decide what to send).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from . import base
import numpy as np

from meshcomm.planners.boxes import contiguous_in, local_slices

from meshcomm.arrays import is_torch as _is_torch

from meshcomm.caches import memo
from meshcomm.reduceops import combine_

from .base import (TAG_MOD, Run, collective_reduce_ok, empty_wire, from_wire, groups_needed, issue_steps,
                   out_specs, result_tiles, to_wire, torch_of)
from .pack import pack, unpack

__all__ = ["BatchItem", "Runner", "run_batch", "execute", "plan_runner"]


@dataclasses.dataclass
class BatchItem:
    """One tensor of a batch on this rank: its plan, its src tiles, a `like` array (kind,
    dtype, device of new tiles) and optional result buffers."""

    plan: object
    shards: dict
    like: object
    out: dict | None = None


def run_batch(items: Sequence[BatchItem], *, rank: int, devices_per_process: int, backend, tags,
              deadline, bucket_bytes: int | None = None, device_kind: str = "cpu"):
    """This rank's dst tiles of every item ([{device: tile}] in item order)."""
    runner = Runner([it.plan for it in items], rank=rank, devices_per_process=devices_per_process,
                    backend=backend, bucket_bytes=bucket_bytes, device_kind=device_kind)
    return runner.run(items, tags, deadline)


def plan_runner(plan, rank: int, dpp: int, backend, need) -> "Runner | None":
    """The Runner of one plan where it runs there: one backend taking host buffers, and no
    group among `need` (base.groups_needed: collectives on groups, MPI across hosts); None
    where the step executor runs it. From the plan and the backend alone, so every process
    of a run decides alike (the two lay messages out differently)."""
    if len(backend.members()) == 1 and backend.wire == "numpy" and not any(need.values()):
        return Runner([plan], rank=rank, devices_per_process=dpp, backend=backend.members()[0])
    return None


def execute(plan, shards, like, *, rank: int, devices_per_process: int, backend, deadline) -> dict:
    """Run this rank's part of one plan on the executor a Program of it would take
    (`plan_runner`, else the step executor `base.execute`). Tools that compare plans
    (`meshcomm bench run`, the demo) run every plan through it, so the comparison is like
    for like."""
    r = _runner(plan, rank, devices_per_process, backend) if type(like) is np.ndarray else None
    if r is not None:
        return r.run([BatchItem(plan, shards, like)], (0, TAG_MOD), deadline)[0]
    return base.execute(plan, shards, like, rank=rank, devices_per_process=devices_per_process,
                        backend=backend, deadline=deadline)[0]


@memo(maxsize=64)
def _runner(plan, rank, dpp, backend) -> "Runner | None":
    need = groups_needed(plan, dpp, collective_reduce_ok(plan.dtype, backend),
                         lambda s: backend.choose(s.table_op, s.nbytes, len(s.ranks), "cpu"))
    return plan_runner(plan, rank, dpp, backend, need)


class Runner:
    """The coalesced batch of one rank, worked out once (a Program keeps it): per stage and
    bucket, the local steps, and per peer the pieces sent and received with their offsets in
    the one message; a run allocates the dst tiles, packs each piece straight into its
    message, posts, waits and unpacks from the message."""

    def __init__(self, plans, *, rank, devices_per_process, backend, bucket_bytes=None, device_kind="cpu"):
        dpp = self.dpp = devices_per_process
        self.plans, self.rank = plans, rank
        self.b = backend.members()[0] if len(backend.members()) == 1 else \
            backend.choose("send", 1 << 20, 2, device_kind)
        rank_of = lambda d: d // dpp  # noqa: E731
        steps = [issue_steps(p, rank, dpp, False) for p in plans]
        self.nstages = max((st.stage for ss in steps for st in ss), default=-1) + 1
        self.buckets = _buckets([(p, None, None) for p in plans], rank, bucket_bytes)
        self.rounds = []                # per (stage, bucket): (locals, sends, recvs, sizes)
        for k in range(self.nstages):
            for bucket in self.buckets:
                local, sends, recvs, sums = [], {}, {}, []
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
                self.rounds.append((local, _offsets(order(sends)), _offsets(order(recvs)), sums))
        self.out_shapes = [out_specs(p, rank, dpp) for p in plans]
        self.tilings = [(p.src.tiles(p.shape), p.dst.tiles(p.shape)) for p in plans]

    def run(self, items, tags, deadline):
        b, rank, dpp = self.b, self.rank, self.dpp
        outs, runs = [], []
        for it, p, shapes, (st, dt) in zip(items, self.plans, self.out_shapes, self.tilings):
            out = result_tiles(p, shapes, it.like, it.out)
            outs.append(out)
            runs.append(Run(p, it.shards, out, it.like, rank, lambda d: d // dpp, st, dt, None))
        base.issued[("batch", b.name)] += 1
        host = b.wire == "numpy"        # NumPy tiles: pieces sent from and received into them
        tag0, span = tags
        inflight: list = []
        nb_ = len(self.buckets)
        for r, (local, sends, recvs, sums) in enumerate(self.rounds):
            works, fins = [], []
            tag = tag0 + r % span
            for peer, (parts, offs, n, own) in recvs.items():
                if parts:
                    buf = empty_wire(n, b.wire, runs[parts[0][0]].like)
                    works.append(b.irecv(buf, peer, tag))
                    fins.append((buf, parts, offs))
                for part in own:        # a message of its own: straight into its tile where it can
                    i, t, mine, whole, _ = part
                    buf = _run_of(runs[i].out[mine[0][0]], whole) if whole is not None and host else None
                    if buf is None and mine:
                        buf = runs[i]._recv_into(t, [d for d, _ in mine], b.wire)
                    if buf is None:
                        buf = empty_wire(t.nbytes, b.wire, runs[i].like)
                        fins.append((buf, [part], [0]))
                    works.append(b.irecv(buf, peer, tag))
            ready: dict = {}
            for peer, (parts, offs, n, own) in sends.items():
                if parts:
                    works.append(b.isend(self._message(runs, parts, offs, n), peer, tag))
                for part in own:        # a broadcast's piece: made once for every peer
                    v = ready.get(id(part))
                    if v is None:
                        v = ready[id(part)] = self._message(runs, [part], [0], part[1].nbytes)
                    works.append(b.isend(v, peer, tag))
                base.issued[(b.name, "p2p_batched")] += 1
            for i, t, copies in local:  # while the messages travel
                run = runs[i]
                src = (run.shards if t.src_buf == "src" else run.out).get(t.srcs[0])
                if copies is None or type(src) is not np.ndarray:
                    run.local(t)
                    continue
                for ssl, d, dsl in copies:
                    run.out[d][dsl] = src[ssl]
            inflight.append((works, runs, fins, sums))
            if len(inflight) >= 2 or (r + 1) % nb_ == 0:    # two buckets at most; a stage ends
                while inflight and (len(inflight) >= 2 or (r + 1) % nb_ == 0):
                    _finish(b, inflight.pop(0), deadline)
        while inflight:
            _finish(b, inflight.pop(0), deadline)
        return outs

    def _message(self, runs, parts, offs, n):
        """The pieces for one peer packed straight into one buffer of the wire kind (a lone
        contiguous piece is sent from its tile, this rank's own copies of it made box to box)."""
        wire = self.b.wire
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
                return to_wire(v, wire)
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
                view[...] = to_wire(v, wire)
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


def _offsets(by_peer):
    """{peer: (coalesced parts, their byte offsets in that message, its size, the parts sent
    as messages of their own)}, peers sorted; the same split on both sides (plan facts)."""
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
        out[peer] = (parts, offs, n, own)
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
    works, runs, fins, sums = entry
    if works:
        b.wait_all(works, deadline)
    addends: dict = {}
    for buf, parts, offs in fins:
        for (i, t, mine, _, src), off in zip(parts, offs):
            run = runs[i]
            v = from_wire(buf[off:off + t.nbytes], run.like)
            if src is not None:         # an addend of a sum this rank makes
                addends[(i, id(t), src)] = v
            for d, sl in mine:
                unpack(v, run.out[d], sl)
    for i, t in sums:                   # in the plan's order of the addends (bitwise the steps')
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


def _buckets(runs, rank, bucket_bytes):
    """The tensors in consecutive buckets of at most `bucket_bytes` of planned transfers (a
    tensor larger than that is a bucket alone); the same cut on every rank (plans' bytes)."""
    if not bucket_bytes:
        return [list(range(len(runs)))]
    out, cur, size = [], [], 0
    for i, (p, _, _) in enumerate(runs):
        nb = sum(t.nbytes for t in p.transfers if t.kind != "copy")
        if cur and size + nb > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nb
    if cur:
        out.append(cur)
    return out

