"""The lean run of a reshard Program (runtime/program.py `Program._lean_run`): its common run,
at most one NumPy tile in and at most one out over MPI, posted from a list worked out once.

The executor (backends/batch.py `Runner`) runs any plan: per run it builds a `Run` of the
tiles, walks its rounds, and tells pieces, collectives and sums apart. Where a plan is one
round of point-to-point messages and local copies (no collective, no sum, no second stage),
this rank's run is the same every time: these messages from these slices of the tile, into
those of the result. `lean` posts exactly the messages the Runner posts, in its order on each
pair (a peer on the general run matches them), with none of the walking: each microsecond of
Python costs several at 8 processes on 2 cores (BENCHMARKS 3).
"""
from __future__ import annotations

import numpy as np

from . import base, buffers, pacing
from .local import alloc_like
from .mpi_comm import MPIMultiWork, MPIWork
from .pack import pack, unpack

__all__ = ["lean"]


class Posted(MPIMultiWork):
    """A lean run's requests, tested together (one Testall); a stalled wait tests them one by
    one (`parts`), naming the peers it still awaits."""

    def __init__(self, reqs, who, peers, rank):
        super().__init__(reqs, None, "reshard", peers, rank)
        self.who = who

    def parts(self) -> list:
        return [MPIWork(r, None, op, (q,), self.rank) for r, (op, q) in zip(self.reqs, self.who)]


def lean(runner, src_dev, spec, fill_op, dtype, tags):
    """(post, result, backend, False) per run parity for Program._lean_run, or None where this
    rank's part is not one round of messages and copies over MPI. `src_dev`: the one src
    device (None: none here); `spec`: the one dst tile (device, shape, starts as the
    identity) or None; `tags`: the Program's (a run's round takes the first of its part,
    program.part: computed here alike)."""
    b = runner.b
    if len(runner.rounds) != 1 or runner.mixed or b.name != "mpi" or pacing.pacer(runner.rank) is not None:
        return None
    local, sends, recvs, sums, colls = runner.rounds[0]
    if sums or colls or any(c is None or t.src_buf != "src" or t.srcs[0] != src_dev for _, t, c in local):
        return None
    if any(p[1].src_buf != "src" or p[5] != src_dev for _, (parts, _, _, _, own) in sends.items()
           for p in parts + [q for q, _ in own]):
        return None
    if any(p[4] is not None for _, (parts, _, _, _, own) in recvs.items() for p in parts + [q for q, _ in own]):
        return None
    if spec is None and (local or any(p[3] for _, (parts, _, _, _, own) in sends.items()
                                      for p in parts + [q for q, _ in own])):
        return None
    # what a run does, in the Runner's order: receives (per peer: the coalesced message, then
    # the pieces of their own), sends likewise, then the local copies
    rx = []         # (peer, whole view index or None, bytes, [(offset, slices of the result)])
    for peer, (parts, offs, n, _, own) in recvs.items():
        if parts:
            rx.append((peer, None, n, [(o, p[1].nbytes, s) for p, o in zip(parts, offs) for _, s in p[2]]))
        for p, _ in own:
            rx.append((peer, p[3], p[1].nbytes, [] if p[3] is not None else [(0, p[1].nbytes, s) for _, s in p[2]]))
    tx = []         # (peer, piece key, bytes, [(offset, bytes, src slices, [dst slices])], whole)
    for peer, (parts, offs, n, _, own) in sends.items():
        if parts:
            tx.append((peer, ("c", peer), n, [(o, p[1].nbytes, p[2], [s for _, s in p[3]])
                                              for p, o in zip(parts, offs)], None))
        for p, _ in own:
            tx.append((peer, ("o", id(p)), p[1].nbytes, [(0, p[1].nbytes, p[2], [s for _, s in p[3]])], p[4]))
    if spec is None and rx:
        return None
    copies = [(ssl, dsl) for _, _, c in local for ssl, _, dsl in c]
    who = [("recv", r[0]) for r in rx] + [("send", t[0]) for t in tx]
    peers = tuple(sorted({q for _, q in who}))
    Isend, Irecv, rank, u8 = b.comm.Isend, b.comm.Irecv, runner.rank, np.uint8
    counted, none = ("batch", b.name), np.empty(0, dtype)     # none: a process without a src tile
    first, span, slots = tags[0], tags[1] // base.SLOTS, base.SLOTS

    state = [None, ()]      # this run's result tile, and its received buffers to unpack

    def post(x, seq):
        base.issued[counted] += 1
        tag = first + (seq % slots) * span      # base.part(tags, seq)[0]
        if x is not None and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        out = None if spec is None else alloc_like(none if x is None else x, spec[1], spec[2], fill_op)
        reqs, later = [], []
        try:
            for peer, whole, n, into in rx:
                if whole is not None:
                    buf = out[whole].reshape(-1).view(u8)
                else:
                    buf = buffers.empty(n)
                    later.append((buf, into))
                reqs.append(Irecv(buf, source=peer, tag=tag))
            made = {}
            for peer, key, n, parts, whole in tx:
                buf = made.get(key)
                if buf is None:
                    if whole is not None:
                        buf = x[whole].reshape(-1).view(u8)
                        _, _, slices, dsls = parts[0]
                        for sl in dsls:
                            out[sl[0]] = x[slices[0]]
                    else:
                        buf = buffers.empty(n)
                        for off, m, slices, dsls in parts:
                            v = pack(x, slices, out=buf[off:off + m].view(x.dtype))
                            for sl in dsls:
                                unpack(v, out, sl)
                    made[key] = buf
                reqs.append(Isend(buf, dest=peer, tag=tag))
        except BaseException:     # what was posted stays referenced until MPI is done with it
            base.abandon(Posted(reqs, who, peers, rank).parts(), cancel=True)
            raise
        for ssl, dsl in copies:
            out[dsl] = x[ssl]
        state[0], state[1] = out, later
        return Posted(reqs, who, peers, rank)

    def result():
        out, later = state
        for buf, into in later:
            for off, n, sl in into:
                unpack(buf[off:off + n].view(dtype), out, sl)
        state[0], state[1] = None, ()
        return out
    fns = (post, result, b, False)
    return fns, fns           # the same for either parity: the tag comes from the run's place

