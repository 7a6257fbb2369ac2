"""The transport's floor for `meshcomm bench run`: a hand-written mpi4py exchange of exactly
the pieces each destination lacks.

For every dst device and every src tile its box meets, the piece (their intersection) is
copied locally when the device's own rank holds it, else received once, from one holder
(the least loaded so far: bytes sent, then device id), as one contiguous message: `Isend`
from the src tile itself when the piece is contiguous there (else from a packed copy),
`Irecv` straight into the dst tile when it is contiguous there (else into a buffer copied
out after the wait), one `Waitall`. No planning at call time (the piece lists are built
once per case, outside the timed call), no metadata check, no broadcast trees: a plan
that sends no more bytes than this can at best reach it; one that broadcasts may beat it.

A pending-sum src (partial) gets every addend of every piece from one holder of that
addend, summed in addend order at the destination (what a hand-written program without a
reduction tree does).
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from meshcomm.planners.boxes import box_size, intersect, local_slices
from meshcomm.reduceops import combine

__all__ = ["Program", "floor_program", "run_floor"]


@dataclasses.dataclass(frozen=True)
class Program:
    """One rank's part of the floor exchange (device d lives on rank d)."""

    out_shapes: dict        # dst device -> tile shape (this rank's dst devices)
    local: tuple            # (src device, src slices, dst device, dst slices, addend)
    sends: tuple            # (src device, src slices, peer rank, tag)
    recvs: tuple            # (dst device, dst slices, peer rank, tag, elements, addend)
    addends: int            # the src's pending-sum addends (1: a plain value)
    op: str                 # how addends combine (the src's partial op)
    zero_fill: tuple        # dst devices with an empty box (allocated, nothing received)
    wire_elems: int         # elements all ranks together put on the wire


def floor_program(src, dst, shape, rank: int) -> Program:
    """The floor exchange of one case for `rank` (the same choices on every rank)."""
    st, dt = src.tiles(shape), dst.tiles(shape)
    k = src.num_addends
    sent = defaultdict(int)             # device -> elements sent so far (holder choice)
    pair_tags = defaultdict(int)        # (sender rank, receiver rank) -> messages so far
    local, sends, recvs = [], [], []
    out_shapes = {}
    wire = 0
    for d in dst.mesh.device_ids:
        dbox = dt.boxes[d]
        if d == rank:
            out_shapes[d] = tuple(b - a for a, b in dbox)
        if box_size(dbox) == 0:
            continue
        for groups in st.classes.values():
            sbox = st.boxes[next(iter(groups.values()))[0]]
            piece = intersect(sbox, dbox)
            if piece is None or box_size(piece) == 0:
                continue
            n = box_size(piece)
            for a, holders in groups.items():
                if d in holders:                # the destination holds it itself
                    h = d
                else:
                    h = min(holders, key=lambda s: (sent[s], s))
                    sent[h] += n
                if h == d:
                    if d == rank:
                        local.append((h, local_slices(piece, st.boxes[h]), d, local_slices(piece, dbox), a))
                    continue
                wire += n
                tag = pair_tags[(h, d)]
                pair_tags[(h, d)] += 1
                if h == rank:
                    sends.append((h, local_slices(piece, st.boxes[h]), d, tag))
                if d == rank:
                    recvs.append((d, local_slices(piece, dbox), h, tag, n, a))
    zero = tuple(d for d in out_shapes if box_size(dt.boxes[d]) == 0)
    return Program(out_shapes, tuple(local), tuple(sends), tuple(recvs), k, src.partial_op, zero, wire)


def run_floor(prog: Program, x: dict, dtype, comm) -> dict:
    """Run one rank's floor exchange on its src tiles `x` ({device: array}); its dst tiles."""
    from mpi4py import MPI
    dtype = np.dtype(dtype)
    plain = prog.addends == 1
    out = {d: (np.empty if plain else np.zeros)(s, dtype) for d, s in prog.out_shapes.items()}
    reqs, copy_out = [], []
    for d, sl, peer, tag, n, a in prog.recvs:
        view = out[d][sl]
        if plain and view.flags.c_contiguous:
            reqs.append(comm.Irecv(view, source=peer, tag=tag))
        else:
            buf = np.empty(n, dtype)
            reqs.append(comm.Irecv(buf, source=peer, tag=tag))
            copy_out.append((d, sl, buf.reshape(view.shape), a))
    for s, sl, peer, tag in prog.sends:
        view = x[s][sl]
        if not view.flags.c_contiguous:
            view = np.ascontiguousarray(view)
        reqs.append(comm.Isend(view, dest=peer, tag=tag))
    parts = []
    for s, ssl, d, dsl, a in prog.local:
        if plain:
            out[d][dsl] = x[s][ssl]
        else:
            parts.append((d, dsl, x[s][ssl], a))
    MPI.Request.Waitall(reqs)
    if plain:
        for d, sl, buf, _ in copy_out:
            out[d][sl] = buf
        return out
    # pending sums: every addend of every piece, combined in addend order
    by_box = defaultdict(dict)
    for d, sl, v, a in parts + copy_out:
        by_box[(d, _key(sl))][a] = (sl, v)
    for (d, _), addends in by_box.items():
        acc = None
        for a in sorted(addends):
            sl, v = addends[a]
            acc = np.array(v) if acc is None else combine(acc, v, prog.op)
        out[d][sl] = acc
    return out


def _key(sl) -> tuple:
    return tuple((s.start, s.stop) for s in sl)
