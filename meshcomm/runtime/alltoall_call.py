"""One all_to_all_v under a launcher: the agreement check, the counts exchange, the plan's stages.

`meshcomm.alltoall` validates the call and runs it in one process; under `meshcomm.init` it
hands it to `DistRun` here through the context's queue. Messages of a stage are posted
(non-blocking) in the plan's global order, then waited for.
"""
from __future__ import annotations

import itertools
import time

import numpy as np

from .. import arrays
from .. import log as _log
from ..planners.alltoall import plan_alltoall
from ..backends.base import empty_wire, from_wire, to_wire
from . import agreement

__all__ = ["DistRun", "split_rows", "assemble", "cat"]

# Tags of all-to-all messages: a base plus a per-group call counter, so concurrent async
# calls on the same group cannot be confused (processes of a group call in the same order).
_TAG_BASE = 20000
_TAG_SPAN = 4096
_calls: dict[tuple[int, ...], itertools.count] = {}


def cat(parts, like):
    if not parts:
        return like[:0]
    if len(parts) == 1:
        return parts[0]
    if arrays.is_torch(like):
        import torch
        return torch.cat(parts)
    return np.concatenate(parts)


def split_rows(x, counts, origin, devices):
    """{(origin, final): rows} for the non-empty blocks of one device's input."""
    out, off = {}, 0
    for f, c in zip(devices, counts):
        if c:
            out[(origin, f)] = x[off:off + c]
        off += c
    return out


def assemble(holdings, device, devices, like):
    return cat([holdings[(o, device)] for o in devices if (o, device) in holdings], like)


class DistRun:
    """One all_to_all_v under a launcher: the agreement check, the counts exchange (if
    needed), then the plan's stages; messages of a stage are posted (non-blocking) in global
    order, then waited for."""

    def __init__(self, ctx, be, groups, args, topo, algorithm, backend, mesh, axis, err, check):
        self.ctx, self.be, self.err, self.check = ctx, be, err, check
        self.mesh, self.axis, self.topo, self.algorithm = mesh, axis, topo, algorithm
        self.dpp = ctx.devices_per_process
        self.timeout = ctx.timeout
        self.keep = []          # send buffers stay alive until their wait
        self.sent_bytes = self.recv_bytes = 0
        self.ctl = [0, 0]       # bytes sent / received by the count exchange
        self.stamp = None       # meshcomm.log's, when logging
        self.args = args
        self.owned = set(args[0]) if args is not None else set()
        if args is not None:
            xs, scs, rcs, like, row_elems, row_bytes = args
            self.like, self.row_elems, self.row_bytes = like, row_elems, row_bytes
            dev = like.device if arrays.is_torch(like) else None
            self.prim = _primitives(ctx, be, int(sum(sum(c) for c in scs.values())) * row_bytes,
                                    "cuda" if dev is not None and dev.type == "cuda" else "cpu")
        # tags are taken now, in the caller's order (the same on every process of a group)
        self.groups = [g for g in groups if self.owned.intersection(g)]
        self.tags = {g: _TAG_BASE + (next(_calls.setdefault(g, itertools.count())) % _TAG_SPAN) * 2
                     for g in self.groups}

    def _agree(self):
        like = self.like if self.args is not None else None
        dt = None if like is None else arrays.dtype_of(like)
        kind = None if like is None else arrays.kind_of(like)
        meta = agreement.Meta("all_to_all_v", (
            ("op", "all_to_all_v"), ("mesh", repr(self.mesh)), ("axes", self.axis),
            ("backend", getattr(self.be, "signature", self.be.name)), ("dtype", dt),
            ("rows", None if like is None else tuple(like.shape[1:])), ("kind", kind)),
            agreement.error_of(self.err))
        out = agreement.exchange(self.ctx.backend, meta, time.monotonic() + self.timeout)
        if out.metas is not None:
            agreement.settle(out.metas, self.ctx.rank, self.err)

    def run(self, bare):
        t_run = time.time() if self.stamp is not None else None
        if self.check:
            self._agree()
        elif self.err is not None:
            raise self.err
        if self.args is None:
            return None
        xs, scs, rcs, _, _, row_bytes = self.args
        topo, algorithm = self.topo, self.algorithm
        self.plans = []
        wrong = []          # (device, recv_counts given, counts the senders send)
        multi_node = topo.devices_per_node > 1
        for g in self.groups:
            tag = self.tags[g]
            mine = [d for d in g if d in self.owned]
            need_matrix = multi_node and algorithm != "pairwise" and \
                len({topo.node_of(d) for d in g}) > 1
            if rcs is not None and not need_matrix and not self.check:
                counts = _partial_matrix(g, scs, rcs)     # trusted: no exchange
                algo = "pairwise"
            else:
                counts = self._exchange_counts(g, mine, scs, tag)    # the full matrix
                algo = algorithm
            p = plan_alltoall(g, counts, row_bytes, topo, algo)
            if rcs is not None:
                wrong.extend((f, rcs[f], p.recv_counts(f)) for f in mine if p.recv_counts(f) != rcs[f])
            self.plans.append((p, tag + 1))
        self.hold = {d: split_rows(xs[d], scs[d], d, p.devices) for p, _ in self.plans
                     for d in p.devices if d in self.owned}
        out = self.finish(bare)
        if self.stamp is not None:
            ranks = sorted({self._owner(d) for g in self.groups for d in g})
            _log.record_rows(self.stamp, "all_to_all_v", group=ranks, backend=self.be.name, xs=xs,
                             out=out if isinstance(out, dict) else {0: out},
                             like=self.like, sent_bytes=self.sent_bytes, recv_bytes=self.recv_bytes,
                             ctl_sent_bytes=self.ctl[0], ctl_recv_bytes=self.ctl[1], t_run=t_run)
        if wrong:
            # raised after the exchange ran with the senders' counts, so no peer waits on us
            f, given, sent = wrong[0]
            raise ValueError(f"recv_counts of device {f} are {list(given)} but the senders along "
                             f"the axis send it {list(sent)}")
        return out

    def _owner(self, d):
        return d // self.dpp

    def _wait(self, works):
        self.prim.wait_all(works, time.monotonic() + self.timeout)
        self.keep.clear()

    def _exchange_counts(self, g, mine, scs, tag):
        """Each owned device sends its whole row to every peer (one small message each)."""
        n = len(g)
        wire = self.prim.wire
        rows = {d: np.asarray(scs[d], dtype=np.int64) for d in mine}
        got = {d: dict() for d in mine}
        works = []
        for r in range(1, n):
            for i, s in enumerate(g):
                t = g[(i + r) % n]
                so, to = s in self.owned, t in self.owned
                if so and to:
                    continue
                if so:
                    self.keep.append(to_wire(rows[s], wire))
                    works.append(self.prim.isend(self.keep[-1], self._owner(t), tag))
                    self.ctl[0] += 8 * n
                elif to:
                    self.ctl[1] += 8 * n
                    buf = empty_wire(8 * n, wire, rows[mine[0]])
                    got[t][s] = buf
                    works.append(self.prim.irecv(buf, self._owner(s), tag))
        self._wait(works)
        known = dict(rows)
        for d in mine:
            known.update({s: from_wire(b, rows[mine[0]]) for s, b in got[d].items()})
        return [tuple(int(v) for v in known[d]) for d in g]

    def _post(self, k):
        works, recvs = [], []
        wire = self.prim.wire
        for p, tag in self.plans:
            for msg in p.stage(k):
                so, to = msg.src in self.owned, msg.dst in self.owned
                if so and to:
                    for o, f, _ in msg.blocks:
                        self.hold[msg.dst][(o, f)] = self.hold[msg.src].pop((o, f))
                elif so:
                    buf = _flat_cat([self.hold[msg.src].pop((o, f)) for o, f, _ in msg.blocks], self.like)
                    self.sent_bytes += msg.rows * self.row_bytes
                    self.keep.append(to_wire(buf, wire))
                    works.append(self.prim.isend(self.keep[-1], self._owner(msg.dst), tag))
                elif to:
                    self.recv_bytes += msg.rows * self.row_bytes
                    buf = empty_wire(msg.rows * self.row_bytes, wire, self.like)
                    works.append(self.prim.irecv(buf, self._owner(msg.src), tag))
                    recvs.append((msg, buf))
        self.prim.flush()
        return works, recvs

    def _complete(self, pending):
        works, recvs = pending
        self._wait(works)
        rest = tuple(self.like.shape[1:])
        for msg, buf in recvs:
            flat = from_wire(buf, self.like)
            off = 0
            for o, f, r in msg.blocks:
                k = r * self.row_elems
                self.hold[msg.dst][(o, f)] = flat[off:off + k].reshape((r,) + rest)
                off += k

    def finish(self, bare):
        nstages = max((p.num_stages for p, _ in self.plans), default=1)
        for k in range(nstages):
            self._complete(self._post(k))
        out = {}
        for p, _ in self.plans:
            for d in p.devices:
                if d in self.owned:
                    out[d] = assemble(self.hold[d], d, p.devices, self.like)
        if bare and len(out) == 1:
            return next(iter(out.values()))
        return out


def _flat_cat(parts, like):
    flat = [v.reshape(-1) for v in parts]
    if len(flat) == 1:
        v = flat[0]
        return v.contiguous() if arrays.is_torch(v) else np.ascontiguousarray(v)
    if arrays.is_torch(like):
        import torch
        return torch.cat(flat)
    return np.concatenate(flat)


def _partial_matrix(g, scs, rcs):
    """Counts with the owned rows and columns filled (enough for pairwise), zeros elsewhere."""
    n = len(g)
    m = [[0] * n for _ in range(n)]
    for i, d in enumerate(g):
        if d in scs:
            m[i] = list(scs[d])
    for j, d in enumerate(g):
        if d in rcs:
            for i in range(n):
                m[i][j] = rcs[d][i]
    return m


def _primitives(ctx, be, nbytes=0, device="cpu"):
    """The concrete backend whose isend/irecv run the exchange ("mixed" picks per size)."""
    return be.choose("send", nbytes, 2, device)
