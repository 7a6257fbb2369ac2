"""all_to_all_v under a launcher: a Program (agreed once: mesh, axis, backend, row shape,
dtype, array kind), whose runs exchange the counts (they are data) and then the rows.

`meshcomm.alltoall` validates the call and runs it in one process; under `meshcomm.init` the
eager call is the cached Program of its arguments (runtime/eager.py `eager`), and
`Program.all_to_all_v` constructs one explicitly. Each run is a `DistRun`: the count
exchange, then the plan's stages, messages posted (non-blocking) in the plan's global order,
then waited for, all on the Program's own tags.
"""
from __future__ import annotations

import time

import numpy as np

from .. import arrays
from .. import log as _log
from ..planners.alltoall import plan_alltoall
from ..backends.base import empty_wire, from_wire, to_wire
from ..planners import Topology
from .agreement import value
from .alltoall_input import (assemble, axis_groups, cat, check_rows, given, local, split_rows,  # noqa: F401
                             validate_owned)
from .context import current, no_context
from .local_program import LocalKernel, no_out
from ..handle import Handle
from ..layout import normalize_shape
from .eager import eager
from .program import Program, checking, construct, new, outside, part, tags_of

__all__ = ["DistRun", "program", "run", "local", "axis_groups"]


class DistRun:
    """One run of an all_to_all_v Program (the module docstring says how)."""

    def __init__(self, ctx, be, groups, args, topo, algorithm, tags, stamp):
        self.ctx, self.be = ctx, be
        self.topo, self.algorithm = topo, algorithm
        self.dpp = ctx.devices_per_process
        self.timeout = ctx.timeout
        self.keep = []          # send buffers stay alive until their wait
        self.sent_bytes = self.recv_bytes = 0
        self.ctl = [0, 0]       # bytes sent / received by the count exchange
        self.stamp = stamp      # meshcomm.log's, when logging
        self.args, self.owned = args, set()
        if args is not None:
            xs, scs, _, like, row_elems, row_bytes = args
            self.owned, self.like, self.row_elems, self.row_bytes = set(xs), like, row_elems, row_bytes
            dev = like.device if arrays.is_torch(like) else None
            self.devtype = "cuda" if dev is not None and dev.type == "cuda" else "cpu"
            # the concrete backend of the count exchange ("mixed" picks by size): from what
            # every process knows alike (a group's size), as a peer's must be the same
            self.prim = be.choose("send", 8 * max(len(g) for g in groups), 2, self.devtype)
        # two tags per group (counts, rows), from the Program's own tag space
        self.groups = [g for g in groups if self.owned.intersection(g)]
        self.tags = {g: tags[0] + 2 * i for i, g in enumerate(groups) if g in self.groups}

    def run(self, bare):
        t_run = time.time() if self.stamp is not None else None
        if self.args is None:
            return None
        xs, scs, rcs, _, _, row_bytes = self.args
        topo, algorithm = self.topo, self.algorithm
        self.plans = []
        wrong = []          # (device, recv_counts given, counts the senders send)
        for g in self.groups:
            tag = self.tags[g]
            mine = [d for d in g if d in self.owned]
            counts = self._exchange_counts(g, mine, scs, tag)    # the full matrix
            p = plan_alltoall(g, counts, row_bytes, topo, algorithm)
            if rcs is not None:
                wrong.extend((f, rcs[f], p.recv_counts(f)) for f in mine if p.recv_counts(f) != rcs[f])
            # the rows' backend: by the group's largest message, which its members all know now
            big = max(c for row in counts for c in row) * row_bytes
            self.plans.append((p, tag + 1, self.be.choose("send", big, 2, self.devtype)))
        self.hold = {d: split_rows(xs[d], scs[d], d, p.devices) for p, _, _ in self.plans
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
            e = ValueError(f"recv_counts of device {f} are {list(given)} but the senders along "
                           f"the axis send it {list(sent)}")
            e.local_only = True     # every process's exchange completed: only this one raises
            raise e
        return out

    def _owner(self, d):
        return d // self.dpp

    def _wait(self, works):
        self.be.wait_all(works, time.monotonic() + self.timeout)     # "mixed": both backends' works
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
        for p, tag, prim in self.plans:
            wire = prim.wire
            for msg in p.stage(k):
                so, to = msg.src in self.owned, msg.dst in self.owned
                if so and to:
                    for o, f, _ in msg.blocks:
                        self.hold[msg.dst][(o, f)] = self.hold[msg.src].pop((o, f))
                elif so:
                    buf = _flat_cat([self.hold[msg.src].pop((o, f)) for o, f, _ in msg.blocks], self.like)
                    self.sent_bytes += msg.rows * self.row_bytes
                    self.keep.append(to_wire(buf, wire))
                    works.append(prim.isend(self.keep[-1], self._owner(msg.dst), tag))
                elif to:
                    self.recv_bytes += msg.rows * self.row_bytes
                    buf = empty_wire(msg.rows * self.row_bytes, wire, self.like)
                    works.append(prim.irecv(buf, self._owner(msg.src), tag))
                    recvs.append((msg, buf))
        self.be.flush()
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
        nstages = max((p.num_stages for p, _, _ in self.plans), default=1)
        for k in range(nstages):
            self._complete(self._post(k))
        out = {}
        for p, _, _ in self.plans:
            for d in p.devices:
                if d in self.owned:
                    out[d] = assemble(self.hold[d], d, p.devices, self.like)
        if bare and len(out) == 1:
            return next(iter(out.values()))
        return out


def _flat_cat(parts, like):
    """The blocks of one message as one contiguous flat array."""
    flat = [v.reshape(-1) for v in parts]
    if len(flat) == 1:
        v = flat[0]
        return v.contiguous() if arrays.is_torch(v) else np.ascontiguousarray(v)
    return cat(flat, like)


class A2AKernel:
    """An all_to_all_v Program's run: this process's rows checked against the agreed row
    shape and dtype, then a DistRun on the Program's tags."""

    seq = 0             # the run's place in its group's sequence (Program.start sets it): its part of the tags

    def __init__(self, ctx, be, mesh, axis, groups, rows, dtype, topo, algorithm, tags):
        self.ctx, self.be, self.mesh, self.axis, self.groups = ctx, be, mesh, axis, groups
        self.rows, self.dtype, self.topo, self.algorithm, self.tags = rows, dtype, topo, algorithm, tags

    def describe(self) -> str:
        return "count exchange, then the planned row exchange"

    def prepare(self, args, out=None):
        if out is not None:
            raise TypeError(no_out("all_to_all_v"))
        x, send_counts, recv_counts = args
        st = validate_owned(self.ctx, x, send_counts, recv_counts, self.mesh, self.axis, self.groups)
        return self.check(st, x)

    def check(self, a, x):
        if a is not None:
            check_rows(a[3], (self.rows, self.dtype), f"rank {self.ctx.rank}'s ")
        return a, x

    def run(self, st, deadline, stamp=None):
        a, x = st
        r = DistRun(self.ctx, self.be, self.groups, a, self.topo, self.algorithm, part(self.tags, self.seq),
                    stamp).run(not isinstance(x, dict))
        return r if a is None else given(r, x, sorted(a[0]))

    def finish(self, r):
        return r


def _fields(mesh, axis, be, rows, dtype, kind, topo, algorithm):
    return (("op", "all_to_all_v"), ("mesh", repr(mesh)), ("axes", axis),
            ("backend", be.signature), ("dtype", dtype), ("rows", rows), ("kind", kind),
            ("algorithm", f"{algorithm} {topo}"))


def _build(ctx, be, mesh, axis, groups, topo, algorithm):
    def build(pid, metas, deadline):
        rows, dt = value(metas, "rows"), value(metas, "dtype")
        if rows is None:
            raise ValueError("all_to_all_v: no process holds rows, so their shape and dtype are unknown")
        k = A2AKernel(ctx, be, mesh, axis, groups, tuple(rows), dt[0], topo, algorithm,
                      tags_of(pid, be.tag_ub))
        return new(ctx, pid, f"all_to_all_v along {axis!r} of {mesh} rows {tuple(rows)} {dt[0]}", k)
    return build


def run(ctx, x, send_counts, recv_counts, mesh, axis, groups, backend, async_op, topo, algorithm, stamp):
    """The eager all_to_all_v: the cached Program of its arguments, then one run."""
    be, err = ctx.resolve_backend(backend)
    ranks = ctx.ownership.participants(mesh)
    if ctx.rank not in ranks:               # no device of the mesh here: nothing to agree or move
        return Handle(result=None) if async_op else None
    a = None
    try:
        if err is not None:
            raise err
        a = validate_owned(ctx, x, send_counts, recv_counts, mesh, axis, groups)
    except (ValueError, TypeError) as e:
        err = e
    like = a[3] if a is not None else None
    rows = None if like is None else tuple(like.shape[1:])
    dt = None if like is None else arrays.dtype_of(like)
    kind = None if like is None else arrays.kind_of(like)
    sig = ("all_to_all_v", mesh, axis, be.name, repr(topo), algorithm)
    fields = _fields(mesh, axis, be, rows, dt, kind, topo, algorithm)

    def agreed_key(metas):
        return (value(metas, "rows"), value(metas, "dtype"), value(metas, "kind"))
    prog = ctx.call(lambda: eager(ctx, sig, (rows, dt, kind) if a is not None else None, a is not None, "all_to_all_v",
                                  fields, err, {}, _build(ctx, be, mesh, axis, groups, topo, algorithm), agreed_key,
                                  None, ranks))
    return prog.start_checked(lambda: prog._kernel.check(a, x), async_op, stamp)


def program(mesh, axis, rows, dtype, backend, topology, algorithm) -> Program:
    """`Program.all_to_all_v(mesh, axis, rows=, dtype=)`: rows is the trailing shape of a row."""
    ctx = current()
    with checking("all_to_all_v", lambda: (mesh,)):
        groups = axis_groups(mesh, axis)
        name, itemsize = arrays.declared_dtype(dtype, "Program.all_to_all_v")
        if not isinstance(rows, (tuple, list)):
            raise TypeError(f"all_to_all_v: rows= is the shape of one row after the first dimension "
                            f"(a tuple of ints, () for rows of scalars), got {rows!r}")
        rows = normalize_shape(rows)
        topo = Topology.coerce(topology)
        if ctx is None:
            no_context(backend, "Program.all_to_all_v")
            return new(None, 0, f"all_to_all_v along {axis!r}", LocalKernel(
                lambda a: local(a[0], a[1], mesh, axis, a[2], False, topology, algorithm, groups,
                                declared=(rows, name)), "rows", "all_to_all_v"))
        be, ranks = ctx.backend_of(backend), ctx.ownership.participants(mesh)
    if ctx.rank not in ranks:
        return outside(ctx, f"all_to_all_v along {axis!r} of {mesh}", empty=lambda: None)
    fields = _fields(mesh, axis, be, rows, (name, itemsize), None, topo, algorithm)
    return ctx.call(lambda: construct(ctx, "all_to_all_v", fields, None, {},
                                      _build(ctx, be, mesh, axis, groups, topo, algorithm), None, ranks))
