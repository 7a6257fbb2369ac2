"""Checks that a batch plan is right, without running it (``mc.verify`` of a BatchPlan).

* Every tensor's own plan passes planners.verify (values, shapes, stages, progress).
* The messages carry every tensor transfer exactly once: each part names a transfer of its
  tensor whose route (kind, srcs, dsts, stage, src_buf) is the message's, at an aligned
  offset after the previous part's end; ``nbytes`` is where the last part ends; a reduce
  merges parts of one dtype and op only.
* Order: messages run in (stage, bucket) order, and each tensor's transfers in its plan are
  in the order of the messages that carry them (so a tensor's stage k+1 follows its stage k).
* Memory: no process stages more than ``bucket_bytes`` (per device it owns) in one bucket,
  unless one message alone does (a bucket smaller than one element of a reduce's parts).
* Progress: the per-process programs of messages (each process runs its messages in the
  global order) cannot deadlock under rendezvous semantics.
"""
from __future__ import annotations

from collections import defaultdict

from .schedule import PART_ALIGN, staged_bytes
from .verify import PlanError, check_deadlock_free, verify

__all__ = ["verify_batch"]


def verify_batch(bp, devices_per_process: int = 1, values: bool = True) -> None:
    """Raise PlanError naming the first problem; None for a correct batch plan. `values`:
    also verify every tensor's own plan (the slow part; once per distinct plan)."""
    if len(bp.names) != len(bp.plans) or len(set(bp.names)) != len(bp.names):
        raise PlanError("a batch plan needs one plan per distinct tensor name")
    if values:
        for p in set(bp.plans):
            verify(p, devices_per_process)
    seen: dict[tuple[int, int], int] = {}
    last_pos: dict[int, int] = defaultdict(lambda: -1)
    prev = (-1, -1)
    for i, m in enumerate(bp.transfers):
        where = f"message #{i} ({m.kind} {m.srcs}->{m.dsts}, bucket {m.bucket})"
        if (m.stage, m.bucket) < prev:
            raise PlanError(f"{where}: stage/bucket ({m.stage}, {m.bucket}) after {prev}")
        prev = (m.stage, m.bucket)
        if not m.parts or len(m.parts) != len(m.offsets):
            raise PlanError(f"{where}: needs parts, one offset each")
        end, kinds = 0, set()
        for (tid, xi), off in zip(m.parts, m.offsets):
            if not (0 <= tid < len(bp.plans)) or not (0 <= xi < len(bp.plans[tid].transfers)):
                raise PlanError(f"{where}: part ({tid}, {xi}) names no transfer")
            if (tid, xi) in seen:
                raise PlanError(f"{where}: transfer {xi} of tensor {bp.names[tid]!r} is also in "
                                f"message #{seen[(tid, xi)]}")
            seen[(tid, xi)] = i
            p = bp.plans[tid]
            t = p.transfers[xi]
            if (t.kind, t.srcs, t.dsts, t.stage, t.src_buf) != (m.kind, m.srcs, m.dsts, m.stage, m.src_buf):
                raise PlanError(f"{where}: part ({tid}, {xi}) of tensor {bp.names[tid]!r} has the "
                                f"route {t.kind} {t.srcs}->{t.dsts}")
            if xi <= last_pos[tid]:
                raise PlanError(f"{where}: tensor {bp.names[tid]!r}'s transfers are out of the "
                                f"messages' order")
            last_pos[tid] = xi
            if off % PART_ALIGN or off < end:
                raise PlanError(f"{where}: part at offset {off} is unaligned or overlaps the previous one")
            end = off + t.nbytes
            kinds.add((p.dtype, p.reduce_op))
        if m.nbytes != end:
            raise PlanError(f"{where}: says {m.nbytes} bytes but its parts end at {end}")
        if m.kind == "reduce" and len(kinds) > 1:
            raise PlanError(f"{where}: a reduce merges parts of several dtypes or ops: {sorted(kinds)}")
    for tid, p in enumerate(bp.plans):
        for xi in range(len(p.transfers)):
            if (tid, xi) not in seen:
                raise PlanError(f"transfer {xi} of tensor {bp.names[tid]!r} is in no message")
    staged: dict[tuple[int, int], int] = defaultdict(int)
    count: dict[tuple[int, int], int] = defaultdict(int)
    for m in bp.transfers:
        for d, nb in staged_bytes(m).items():
            key = (d // devices_per_process, m.bucket)
            staged[key] += nb
            count[key] += 1
    for (proc, b), nb in staged.items():
        if nb > bp.bucket_bytes * devices_per_process and count[(proc, b)] > 1:
            raise PlanError(f"process {proc} stages {nb} bytes in bucket {b}, over the bucket's "
                            f"{bp.bucket_bytes}")
    progs: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(bp.transfers):
        for q in sorted({d // devices_per_process for d in m.participants}):
            progs[q].append(i)
    check_deadlock_free(bp.transfers, dict(progs), owner=lambda d: d // devices_per_process)
