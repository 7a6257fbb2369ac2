"""Checks that a plan is right, without running it.

* Values: a symbolic execution over the grid of cells cut by every box boundary. Each src
  tile holds its addend (one bit of a mask); transfers move masks; a reduction ORs masks and
  fails if two contributors carry the same addend (a double sum). At the end every dst cell
  must be written exactly once with the full set of addends; for a partial dst, tiles in
  `zero_fill` start as zeros and may be written in parts, and per cell the replica groups
  must agree within a group and together hold every addend exactly once.
  The same masks prove plans of every op (`Plan.reduce_op`: sum, prod, min, max): a reduce
  applies the op once per addend, and zeros stand for the dst op's identity. When the dst's
  op differs from the src's (max -> sum), a group may hold only the fully reduced value or
  the identity (a sum of partial maxima is not the max).
* Shape: kinds, endpoints, byte counts, boxes inside the tiles they read and write, and
  stage order (a transfer reading a dst tile only reads what an earlier stage wrote).
* Progress: the per-process programs (each process runs its transfers in the global order)
  cannot deadlock under rendezvous semantics: every transfer's participants all reach it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Mapping, Sequence

import numpy as np

from .boxes import Box, box_size

__all__ = ["verify", "PlanError", "check_deadlock_free", "programs"]


class PlanError(AssertionError):
    """A plan that would produce a wrong result or could deadlock."""


def _inside(box: Box, tile: Box) -> bool:
    return all(t0 <= a and b <= t1 for (a, b), (t0, t1) in zip(box, tile))


def verify(plan, devices_per_process: int = 1) -> None:
    """Raise PlanError naming the first problem found; return None for a correct plan. A
    batch plan (planners/batch.py) is checked by its own `verify_batch`."""
    batch = getattr(plan, "verify_batch", None)
    if batch is not None:
        return batch(devices_per_process)
    if not all(hasattr(plan, k) for k in ("src", "dst", "shape", "transfers")):
        raise TypeError(f"verify takes a Plan (meshcomm.plan(...)), got {type(plan).__name__}")
    src, dst, shape = plan.src, plan.dst, plan.shape
    st, dt = src.tiles(shape), dst.tiles(shape)
    ndim = len(shape)
    k = src.num_addends
    full = (1 << k) - 1
    big = k > 62
    mdtype = object if big else np.int64

    # the cell grid
    cuts = [set((0, n)) for n in shape]
    for tiling in (st, dt):
        for d in range(ndim):
            for a, b in tiling.dim_bounds[d]:
                cuts[d].update((a, b))
    for t in plan.transfers:
        for box in t.boxes:
            if len(box) != ndim:
                raise PlanError(f"transfer {t} has a box of rank {len(box)} for a rank-{ndim} tensor")
            for d, (a, b) in enumerate(box):
                if not (0 <= a < b <= shape[d]):
                    raise PlanError(f"transfer {t}: box dimension {d} [{a}:{b}) is empty or outside 0..{shape[d]}")
                cuts[d].update((a, b))
    cuts = [np.array(sorted(c)) for c in cuts]

    def cells(box: Box):
        return tuple(slice(int(np.searchsorted(cuts[d], a)), int(np.searchsorted(cuts[d], b)))
                     for d, (a, b) in enumerate(box))

    def grid_shape(box: Box):
        return tuple(s.stop - s.start for s in cells(box))

    def local(box: Box, tile: Box):
        outer, inner = cells(tile), cells(box)
        return tuple(slice(i.start - o.start, i.stop - o.start) for i, o in zip(inner, outer))

    written = {d: np.zeros(grid_shape(box), np.int64) for d, box in dt.boxes.items()}
    wstage = {d: np.full(grid_shape(box), -1, np.int64) for d, box in dt.boxes.items()}
    mask = {d: np.zeros(grid_shape(box), mdtype) for d, box in dt.boxes.items()}

    last_stage = 0
    for i, t in enumerate(plan.transfers):
        where = f"transfer #{i} ({t.kind} {t.srcs}->{t.dsts})"
        if t.kind not in ("copy", "send", "bcast", "reduce"):
            raise PlanError(f"{where}: unknown kind {t.kind!r}")
        if not t.srcs or not t.dsts or not t.boxes:
            raise PlanError(f"{where}: needs sources, destinations and boxes")
        if len(set(t.srcs)) != len(t.srcs) or len(set(t.dsts)) != len(t.dsts):
            raise PlanError(f"{where}: a device is listed twice")
        if t.kind == "copy" and (len(t.srcs) != 1 or t.srcs != t.dsts):
            raise PlanError(f"{where}: a copy stays on one device")
        if t.kind == "send" and (len(t.srcs) != 1 or len(t.dsts) != 1 or t.srcs == t.dsts):
            raise PlanError(f"{where}: a send goes from one device to another")
        if t.kind == "bcast" and (len(t.srcs) != 1 or t.srcs[0] in t.dsts):
            raise PlanError(f"{where}: a bcast has one root that is not among its destinations")
        if t.kind == "reduce" and len(t.dsts) != 1:
            raise PlanError(f"{where}: a reduce has one destination")
        if t.stage < last_stage:
            raise PlanError(f"{where}: stage {t.stage} after stage {last_stage}")
        last_stage = t.stage
        nbytes = sum(box_size(b) for b in t.boxes) * plan.itemsize
        if nbytes != t.nbytes:
            raise PlanError(f"{where}: says {t.nbytes} bytes but its boxes hold {nbytes}")
        if t.src_buf not in ("src", "dst"):
            raise PlanError(f"{where}: src_buf must be 'src' or 'dst', got {t.src_buf!r}")
        for box in t.boxes:
            contents = []
            for s in t.srcs:
                if t.src_buf == "src":
                    if s not in st.boxes or not _inside(box, st.boxes[s]):
                        raise PlanError(f"{where}: device {s} does not hold src box {box}")
                    contents.append(np.full(grid_shape(box), 1 << st.addend_of[s], mdtype))
                else:
                    if s not in dt.boxes or not _inside(box, dt.boxes[s]):
                        raise PlanError(f"{where}: device {s} has no dst tile holding {box}")
                    sl = local(box, dt.boxes[s])
                    if not (written[s][sl] == 1).all() or not (wstage[s][sl] < t.stage).all():
                        raise PlanError(f"{where}: device {s} forwards {box} before an earlier stage wrote it")
                    contents.append(mask[s][sl].copy())
            if t.kind == "reduce":
                acc = np.zeros(grid_shape(box), mdtype)
                for c in contents:
                    if np.any((acc & c) != 0):
                        raise PlanError(f"{where}: an addend is summed twice in box {box}")
                    acc = acc | c
                value = acc
            else:
                value = contents[0]
            for d in t.dsts:
                if d not in dt.boxes or not _inside(box, dt.boxes[d]):
                    raise PlanError(f"{where}: box {box} is outside device {d}'s dst tile")
                sl = local(box, dt.boxes[d])
                if (written[d][sl] != 0).any():
                    raise PlanError(f"{where}: device {d} is written twice in box {box}")
                written[d][sl] = 1
                wstage[d][sl] = t.stage
                mask[d][sl] = value

    zero = set(plan.zero_fill)
    for d, box in dt.boxes.items():
        if box_size(box) == 0:
            continue
        if d in zero:
            # a partial dst tile starts as zeros; transfers may write parts of it (once)
            if dst.num_addends == 1:
                raise PlanError(f"device {d} is zero-filled but the dst holds the full value")
            continue
        if not (written[d] == 1).all():
            raise PlanError(f"device {d}: part of its dst tile {box} is never written")
        if dst.num_addends == 1 and not (mask[d] == full).all():
            raise PlanError(f"device {d}: its dst tile does not hold the sum of all {k} addend(s)")
    if dst.num_addends > 1:
        same_op = k == 1 or src.partial_op == dst.partial_op
        for dc, groups in dt.classes.items():
            devs0 = next(iter(groups.values()))
            if box_size(dt.boxes[devs0[0]]) == 0:
                continue
            acc = np.zeros_like(mask[devs0[0]])
            for g, devs in groups.items():
                ref = mask[devs[0]]
                for d in devs[1:]:
                    if not np.array_equal(mask[d], ref):
                        raise PlanError(f"dst replicas {devs[0]} and {d} of addend group {g} disagree")
                if np.any((acc & ref) != 0):
                    raise PlanError(f"dst shard {dc}: an addend appears in two pending-sum groups")
                if not same_op and not ((ref == 0) | (ref == full)).all():
                    raise PlanError(f"dst shard {dc}: addend group {g} holds a partly reduced "
                                    f"value, but the src's {src.partial_op} differs from the "
                                    f"dst's {dst.partial_op}")
                acc = acc | ref
            if not (acc == full).all():
                raise PlanError(f"dst shard {dc}: the pending sum misses an addend")

    check_deadlock_free(plan.transfers, programs(plan, devices_per_process),
                        owner=lambda d: d // devices_per_process)


def programs(plan, devices_per_process: int = 1) -> dict[int, list[int]]:
    """What each process runs: the indices of its transfers, in the global order."""
    out: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(plan.transfers):
        for p in sorted({d // devices_per_process for d in t.participants}):
            out[p].append(i)
    return dict(out)


def check_deadlock_free(transfers: Sequence, progs: Mapping[int, Sequence[int]],
                        owner: Callable[[int], int] | None = None) -> None:
    """Rendezvous semantics: a transfer completes only when every participating process has
    reached it in its program. Raise PlanError if some program can never finish, or if a
    program skips a transfer it takes part in (a send without its receive)."""
    owner = owner or (lambda d: d)
    parts = {}
    for p, prog in progs.items():
        if len(set(prog)) != len(prog):
            raise PlanError(f"process {p} runs a transfer twice")
        for i in prog:
            parts.setdefault(i, set()).add(p)
    for i, t in enumerate(transfers):
        need = {owner(d) for d in t.participants}
        have = parts.get(i, set())
        if need != have:
            raise PlanError(f"transfer #{i} ({t.kind}) involves processes {sorted(need)} but "
                            f"programs of {sorted(have)} run it (a send without its receive)")
    ptr = {p: 0 for p in progs}
    waiting: dict[int, set] = defaultdict(set)     # transfer -> processes standing at it
    ready = []
    for p, prog in progs.items():
        if prog:
            waiting[prog[0]].add(p)
    for i, ps in waiting.items():
        if ps == parts[i]:
            ready.append(i)
    done = 0
    total = sum(len(v) for v in progs.values())
    while ready:
        i = ready.pop()
        for p in parts[i]:
            done += 1
            ptr[p] += 1
            if ptr[p] < len(progs[p]):
                j = progs[p][ptr[p]]
                waiting[j].add(p)
                if waiting[j] == parts[j]:
                    ready.append(j)
    if done != total:
        stuck = {p: progs[p][ptr[p]] for p in progs if ptr[p] < len(progs[p])}
        raise PlanError(f"deadlock: processes stuck at transfers {stuck}")
