"""Local backend: one process owns every device; transfers are array copies and reductions
(the plan's reduce_op: sum, prod, min or max, in the order of each transfer's srcs)."""
from __future__ import annotations

from typing import Mapping

from meshcomm.planners.boxes import box_size, local_slices
from meshcomm.reduceops import combine_, fill_identity_

__all__ = ["LocalBackend", "alloc_like", "aligned_numpy"]


def alloc_like(like, shape, zero: bool, op: str = "sum"):
    """A new tile of `shape` with `like`'s dtype and device (NumPy or torch); when `zero`,
    filled with the identity of `op` (zeros for a sum)."""
    if type(like).__module__.startswith("torch"):
        import torch
        f = torch.zeros if zero else torch.empty
        t = f(shape, dtype=like.dtype, device=like.device)
    else:
        t = aligned_numpy(shape, like.dtype, zero)
    return fill_identity_(t, op) if zero and op != "sum" else t


ALIGN = 64      # bytes: what XLA's CPU client needs to adopt a NumPy buffer without a copy


def aligned_numpy(shape, dtype, zero: bool = False):
    """np.empty/np.zeros whose data starts on an ALIGN-byte boundary, so that a result
    committed to a JAX CPU device (`jax.device_put`) is adopted rather than copied: the
    local path then copies each piece exactly once, source tile -> destination tile."""
    import math

    import numpy as np
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = (np.zeros if zero else np.empty)(n + ALIGN, dtype=np.uint8)
    off = -raw.ctypes.data % ALIGN
    return raw[off:off + n].view(dt).reshape(shape)


class LocalBackend:
    name = "local"

    def execute(self, plan, shards: Mapping[int, object], like, share: bool = False) -> dict[int, object]:
        """Run `plan` on `shards` ({src device: tile}); return {dst device: tile}. Each piece
        is copied once, straight from its src tile into the dst tile (a reduction writes its
        first addend there and combines the others into it in place). With `share`, dst
        devices holding the same box and addend get one array, written once (for results
        that are immutable, like JAX arrays, which on CPU devices may share memory as
        jax.device_put's own results do)."""
        st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)
        zero, op = set(plan.zero_fill), plan.reduce_op
        out = {}
        for groups in dt.classes.values():
            for devs in groups.values():
                for i, d in enumerate(devs):
                    if share and i:
                        out[d] = out[devs[0]]
                        continue
                    box = dt.boxes[d]
                    shape = tuple(b - a for a, b in box)
                    out[d] = alloc_like(like, shape, zero=d in zero or box_size(box) == 0, op=plan.fill_op)
        for t in plan.transfers:
            if t.src_buf == "src":
                bufs, origin = shards, st.boxes
            else:
                bufs, origin = out, dt.boxes
            dsts = t.dsts
            if share and len(dsts) > 1:
                dsts = list({id(out[d]): d for d in reversed(dsts)}.values())
            for box in t.boxes:
                if t.kind == "reduce":
                    d = t.dsts[0]
                    view = out[d][local_slices(box, dt.boxes[d]) or ...]    # 0-d: a view, not a scalar
                    it = iter(t.srcs)
                    s = next(it)
                    view[...] = bufs[s][local_slices(box, origin[s])]
                    for s in it:
                        combine_(view, bufs[s][local_slices(box, origin[s])], op)
                    continue
                s = t.srcs[0]
                value = bufs[s][local_slices(box, origin[s])]
                for d in dsts:
                    if bufs is out and out[d] is out[s]:
                        continue            # a shared array already holds it
                    out[d][local_slices(box, dt.boxes[d])] = value
        return out
