"""Local backend: one process owns every device; transfers are array copies and reductions
(the plan's reduce_op: sum, prod, min or max, in the order of each transfer's srcs)."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from meshcomm.backends import buffers
from meshcomm.caches import BoundedDict
from meshcomm.planners.boxes import box_size, contiguous_in, local_slices
from meshcomm.reduceops import combine_, fill_identity_

__all__ = ["LocalBackend", "alloc_like", "aligned_numpy"]


def alloc_like(like, shape, zero: bool, op: str = "sum"):
    """A new tile of `shape` with `like`'s dtype and device (NumPy, torch or CuPy); when `zero`,
    filled with the identity of `op` (zeros for a sum)."""
    mod = type(like).__module__
    if mod.startswith("torch"):
        import torch
        f = torch.zeros if zero else torch.empty
        t = f(shape, dtype=like.dtype, device=like.device)
    elif mod.startswith("cupy"):        # the packed path on CuPy arrays (meshcomm.cuda.executor)
        import cupy
        with cupy.cuda.Device(like.device.id):
            t = (cupy.zeros if zero else cupy.empty)(shape, dtype=like.dtype)
    else:
        t = aligned_numpy(shape, like.dtype, zero, phase_of(like))
    return fill_identity_(t, op) if zero and op != "sum" else t


ALIGN = buffers.ALIGN   # bytes: what XLA's CPU client needs to adopt a NumPy buffer without a copy


def phase_of(tile) -> int:
    """Where a host tile starts past an ALIGN boundary (0 for anything else)."""
    return buffers.address(tile) % ALIGN if type(tile) is np.ndarray else 0


def aligned_numpy(shape, dtype, zero: bool = False, phase: int = 0):
    """np.empty/np.zeros whose data starts `phase` bytes past an ALIGN-byte (cache line)
    boundary: the source tiles' (`phase_of`), so that copies between source and result
    tiles, MPI's between processes included, are aligned alike on both sides (slower into a
    buffer at another phase: BENCHMARKS 3).
    JAX's CPU buffers start on a boundary, so a result committed to a JAX CPU device
    (`jax.device_put`) is adopted rather than copied. From 1 MiB the memory comes from
    backends/buffers.py (reused once every array over it is gone)."""
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    budget = buffers.pooled(n)
    if budget:              # memory written before: no page faults
        return buffers.take(n, zero, phase, budget).view(dt).reshape(shape)
    raw = (np.zeros if zero else np.empty)(n + ALIGN, dtype=np.uint8)
    off = (phase - buffers.address(raw)) % ALIGN
    return raw[off:off + n].view(dt).reshape(shape)


class LocalBackend:
    name = "local"

    def execute(self, plan, shards: Mapping[int, object], like, share: bool = False,
                alias: bool = False) -> dict[int, object]:
        """Run `plan` on `shards` ({src device: tile}); return {dst device: tile}. Each piece
        is copied once, straight from its src tile into the dst tile (a reduction writes its
        first addend there and combines the others into it in place). With `share`, dst
        devices holding the same box and addend get one array, written once (for results
        that are immutable, like JAX arrays, which on CPU devices may share memory as
        jax.device_put's own results do). With `alias` too, a dst tile that is one
        contiguous run of a src tile is that src tile's memory, not a copy (immutable host
        arrays only: JAX CPU devices, where jax.device_put adopts it). What to copy where
        is worked out once per plan (`_program`)."""
        prog = _program(plan, share, alias)
        op = plan.reduce_op
        kcopy = _kernel_copier(like)
        bufs, aliased = [], set()
        for k, (shape, zero, view) in enumerate(prog.slots):
            if view is not None:
                s, where = view
                v = shards[s][where]
                if getattr(v, "flags", None) is not None and v.flags.c_contiguous:
                    bufs.append(v)
                    aliased.add(k)
                    continue
            bufs.append(alloc_like(like, shape, zero=zero, op=plan.fill_op))
        for kind, slot, where, from_out, srcs in prog.ops:
            if slot in aliased:
                continue
            src = bufs if from_out else shards
            if kind == "copy":
                s, sw = srcs[0]
                if kcopy is None or not kcopy(bufs[slot], where, src[s], sw):
                    bufs[slot][where] = src[s][sw]
                continue
            view = bufs[slot][where or ...]         # 0-d: a view, not a scalar
            (s, sw), rest = srcs[0], srcs[1:]
            view[...] = src[s][sw]
            for s, sw in rest:
                combine_(view, src[s][sw], op)
        return {d: bufs[k] for d, k in prog.slot_of.items()}


def _kernel_copier(like):
    """For CUDA tensors with CuPy: meshcomm.cuda's copy_box (a large piece with one contiguous
    side as one pack or unpack launch); else None (torch's copy)."""
    if getattr(getattr(like, "device", None), "type", None) != "cuda" or not type(like).__module__.startswith("torch"):
        return None
    from meshcomm.cuda import kernels
    return kernels.copy_box if kernels.available() else None


@dataclasses.dataclass(frozen=True)
class _LocalProgram:
    """A plan as one process runs it: `slots` are the dst arrays, (shape, zero-filled,
    (src device, slices) when it may be a view of a src tile instead), `slot_of` gives each
    dst device its slot (replicas share one with `share`), and `ops` are (kind, slot,
    slices in the slot, whether the sources are slots rather than src tiles, ((source,
    slices), ...)) in plan order, each (slot, box) written once."""
    slots: tuple
    slot_of: dict
    ops: tuple


_PROGRAMS = BoundedDict(256)


def _program(plan, share: bool, alias: bool) -> _LocalProgram:
    key = (id(plan), share, alias)
    hit = _PROGRAMS.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    prog = _compile(plan, share, alias)
    _PROGRAMS.put(key, (plan, prog))
    return prog


def _compile(plan, share: bool, alias: bool) -> _LocalProgram:
    st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)
    zero = set(plan.zero_fill)
    views = _whole_tile_views(plan, st, dt, zero) if share and alias else {}
    slots, slot_of = [], {}
    for groups in dt.classes.values():
        for devs in groups.values():
            for i, d in enumerate(devs):
                if share and i:
                    slot_of[d] = slot_of[devs[0]]
                    continue
                box = dt.boxes[d]
                view = next((views[e] for e in devs if e in views), None) if share else None
                slot_of[d] = len(slots)
                slots.append((tuple(b - a for a, b in box), d in zero or box_size(box) == 0, view))
    ops, written = [], set()
    for t in plan.transfers:
        from_out = t.src_buf != "src"
        origin = dt.boxes if from_out else st.boxes

        def src_of(s, box):
            return (slot_of[s] if from_out else s), local_slices(box, origin[s])
        for box in t.boxes:
            if t.kind == "reduce":
                d = t.dsts[0]
                ops.append(("reduce", slot_of[d], local_slices(box, dt.boxes[d]), from_out,
                            tuple(src_of(s, box) for s in t.srcs)))
                continue
            s = t.srcs[0]
            for d in t.dsts:
                k = slot_of[d]
                if (k, box) in written or (from_out and slot_of[s] == k):
                    continue            # a shared array already holds it
                written.add((k, box))
                ops.append(("copy", k, local_slices(box, dt.boxes[d]), from_out, (src_of(s, box),)))
    return _LocalProgram(tuple(slots), slot_of, tuple(ops))


def _whole_tile_views(plan, st, dt, zero) -> dict:
    """{dst device: (src device, slices)} for dst tiles lying whole inside a src tile (no
    pending sums on either side: the dst tile's values are then exactly that part of the
    src tile, which `execute` uses in place when it is one contiguous run)."""
    if plan.src.partial or plan.dst.partial:
        return {}
    views = {}
    for d, box in dt.boxes.items():
        if d in zero or box_size(box) == 0:
            continue
        for s, sb in st.boxes.items():
            if all(o <= a and b <= e for (a, b), (o, e) in zip(box, sb)) and contiguous_in(box, sb):
                views[d] = (s, local_slices(box, sb))
                break
    return views

