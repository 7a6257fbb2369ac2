"""Many tensors' plans run as one: per stage, ONE message between each pair of processes.

`run_batch(items, ...)` takes the plans of a batch (one per tensor, senders chosen for the
whole batch by the planner) and runs this rank's part of all of them together:

* Stage k of every plan runs in stage k of the batch (a plan's later stage may read what
  its earlier one wrote; plans are independent of each other).
* Point-to-point steps are coalesced: everything this rank sends to peer q in stage k, over
  every tensor, is packed into one buffer (tensors in batch order, each tensor's transfers in
  its plan order: the same order on both sides), sent as one message, unpacked at q in the
  same order. Local steps copy directly.
* Buckets: the tensors are cut into consecutive buckets of at most `bucket_bytes` of
  messages each; a bucket's messages are posted, the next bucket is packed while they
  travel, and at most two buckets are in flight (the extra memory bound).
* A batch whose plans use broadcasts or reductions among 3+ processes (collective groups)
  runs each tensor's plan through the step executor instead, one after another (same tags
  space, each tensor's steps offset), which every process decides alike from the plans.

The planner chose what moves; this module only packs, posts and unpacks (backends never
decide what to send).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from . import base
from .base import Execution, empty_wire, from_wire, issue_steps, to_wire

__all__ = ["BatchItem", "coalescable", "run_batch"]


@dataclasses.dataclass
class BatchItem:
    """One tensor of a batch on this rank: its plan, its src tiles, a `like` array (kind,
    dtype, device of new tiles) and optional result buffers."""

    plan: object
    shards: dict
    like: object
    out: dict | None = None


def coalescable(plans: Sequence, dpp: int) -> bool:
    """Whether every step of every plan is local, a send, or a broadcast (which the batch
    sends from its root to each member, coalesced per peer): no reduction across processes
    (decided from the plans alone, so every process decides alike)."""
    for p in plans:
        for t in p.transfers:
            if t.kind == "reduce" and len({d // dpp for d in t.participants}) > 1:
                return False
    return True


def run_batch(items: Sequence[BatchItem], *, rank: int, devices_per_process: int, backend, tags,
              deadline, bucket_bytes: int | None = None, device_kind: str = "cpu", fences=()):
    """This rank's dst tiles of every item ([{device: tile}] in item order)."""
    dpp = devices_per_process
    if not coalescable([it.plan for it in items], dpp):
        outs = []
        t0, span = tags
        per = max(1, span // max(1, len(items)))
        for i, it in enumerate(items):          # one plan after another, tags of its own
            ex = Execution(it.plan, it.shards, it.like, rank=rank, devices_per_process=dpp, backend=backend,
                           device_kind=device_kind, producer_fences=fences, tags=(t0 + i * per, per), out=it.out)
            ex.start()
            outs.append(ex.finish(deadline)[0])
        return outs
    b = backend.members()[0] if len(backend.members()) == 1 else backend.choose("send", 1 << 20, 2, device_kind)
    runs, outs = [], []
    rank_of = lambda d: d // dpp  # noqa: E731
    for it in items:
        p = it.plan
        ex = Execution(p, it.shards, it.like, rank=rank, devices_per_process=dpp, backend=backend,
                       device_kind=device_kind, producer_fences=fences, out=it.out)
        runs.append((p, ex.run, issue_steps(p, rank, dpp, False)))
        outs.append(ex.out)
    nstages = max((s.stage for _, _, steps in runs for s in steps), default=-1) + 1
    buckets = _buckets(runs, rank, bucket_bytes)
    tag0, span = tags
    inflight: list = []
    for k in range(nstages):
        for bi, bucket in enumerate(buckets):
            sends: dict = {}                    # peer -> [packed piece, ...]
            recvs: dict = {}                    # peer -> [(run, transfer, nbytes, my dsts)]
            for ri in bucket:
                p, run, steps = runs[ri]
                for s in steps:
                    if s.stage != k:
                        continue
                    t = p.transfers[s.index]
                    if s.prim == "local":
                        run.local(t)
                        continue
                    mine = [d for d in t.dsts if rank_of(d) == rank]
                    if s.root == rank:              # a send, or a broadcast from here to each member
                        v = run._packed(t, t.srcs[0])
                        for d in mine:
                            run._unpack_to(t, d, v)
                        for peer in s.ranks:
                            if peer != rank:
                                sends.setdefault(peer, []).append(v)
                    else:
                        recvs.setdefault(s.root, []).append((run, t, s.nbytes, mine))
            # pieces start on ALIGN-byte boundaries in a message (mixed dtypes view cleanly)
            works, fins = [], []
            tag = tag0 + (k * len(buckets) + bi) % span
            for peer, parts in sorted(recvs.items()):
                n = sum(_padded(nb) for _, _, nb, _ in parts)
                buf = empty_wire(n, b.wire, parts[0][0].like)
                works.append(b.irecv(buf, peer, tag))
                fins.append((buf, parts))
            for peer, parts in sorted(sends.items()):
                works.append(b.isend(_cat(parts, b.wire), peer, tag))
                base.issued[(b.name, "p2p_batched")] += 1
            inflight.append((works, fins))
            if len(inflight) >= 2:              # at most two buckets in flight
                _finish(b, inflight.pop(0), deadline)
        while inflight:                         # a stage ends before the next reads its results
            _finish(b, inflight.pop(0), deadline)
    return outs


def _finish(b, entry, deadline):
    works, fins = entry
    b.wait_all(works, deadline)
    for buf, parts in fins:
        off = 0
        for run, t, nb, mine in parts:
            v = from_wire(buf[off:off + nb], run.like)
            for d in mine:
                run._unpack_to(t, d, v)
            off += _padded(nb)


ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _cat(parts, wire):
    """The pieces (of any tensors' kinds) as one byte message of the backend's wire kind, each
    padded to ALIGN bytes."""
    flat = [to_wire(p, wire) for p in parts]
    size = (lambda f: int(f.numel())) if wire == "torch" else (lambda f: f.size)
    if len(flat) == 1 and size(flat[0]) % ALIGN == 0:
        return flat[0]
    if wire == "torch":
        import torch
        out = torch.empty(sum(_padded(size(f)) for f in flat), dtype=torch.uint8, device=flat[0].device)
    else:
        import numpy as np
        out = np.empty(sum(_padded(size(f)) for f in flat), np.uint8)
    off = 0
    for f in flat:
        n = size(f)
        out[off:off + n] = f
        off += _padded(n)
    return out


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

