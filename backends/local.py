"""Local backend: one process owns every device; transfers are array copies and reductions
(the plan's reduce_op: sum, prod, min or max, in the order of each transfer's srcs)."""
from __future__ import annotations

from typing import Mapping

from meshcomm.planners.boxes import box_size, local_slices
from meshcomm.reduceops import combine_, fill_identity_

__all__ = ["LocalBackend", "alloc_like"]


def alloc_like(like, shape, zero: bool, op: str = "sum"):
    """A new tile of `shape` with `like`'s dtype and device (NumPy or torch); when `zero`,
    filled with the identity of `op` (zeros for a sum)."""
    if type(like).__module__.startswith("torch"):
        import torch
        f = torch.zeros if zero else torch.empty
        t = f(shape, dtype=like.dtype, device=like.device)
    else:
        import numpy as np
        t = (np.zeros if zero else np.empty)(shape, dtype=like.dtype)
    return fill_identity_(t, op) if zero and op != "sum" else t


class LocalBackend:
    name = "local"

    def execute(self, plan, shards: Mapping[int, object], like) -> dict[int, object]:
        """Run `plan` on `shards` ({src device: tile}); return {dst device: tile}."""
        st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)
        zero, op = set(plan.zero_fill), plan.reduce_op
        out = {}
        for d, box in dt.boxes.items():
            shape = tuple(b - a for a, b in box)
            out[d] = alloc_like(like, shape, zero=d in zero or box_size(box) == 0, op=plan.fill_op)
        for t in plan.transfers:
            if t.src_buf == "src":
                bufs, origin = shards, st.boxes
            else:
                bufs, origin = out, dt.boxes
            for box in t.boxes:
                if t.kind == "reduce":
                    it = iter(t.srcs)
                    s = next(it)
                    acc = bufs[s][local_slices(box, origin[s])]
                    acc = acc.copy() if hasattr(acc, "copy") else acc.clone()
                    for s in it:
                        acc = combine_(acc, bufs[s][local_slices(box, origin[s])], op)
                    value = acc
                else:
                    s = t.srcs[0]
                    value = bufs[s][local_slices(box, origin[s])]
                for d in t.dsts:
                    out[d][local_slices(box, dt.boxes[d])] = value
        return out
