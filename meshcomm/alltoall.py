"""all_to_all_v: uneven row exchange along one mesh axis (MoE token dispatch and combine).

    # dispatch: device d sends send_counts[d][j] of its rows to the j-th device along "ep"
    y = mc.all_to_all_v(x, send_counts, mesh, "ep")
    # combine: the same call with the counts swapped restores the original rows and order
    x2 = mc.all_to_all_v(y, recv_counts, mesh, "ep")

Rows of the result are what the devices along the axis sent, concatenated in axis order.
The planner (meshcomm.planners.alltoall) decides the message order and routing; this
module validates input, exchanges counts when they are not given, and runs the plan.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Mapping, Sequence

import numpy as np

from . import arrays, runtime, settings
from . import log as _log
from .handle import Handle
from .mesh import Mesh
from .runtime import agreement
from .validate import native_byte_order
from .planners import Topology
from .planners.alltoall import AllToAllPlan, plan_alltoall
from .backends.base import empty_wire, from_wire, to_wire

__all__ = ["all_to_all_v", "axis_groups", "alltoall_plan"]

# Tags of all-to-all messages: a base plus a per-group call counter, so concurrent async
# calls on the same group cannot be confused (processes of a group call in the same order).
_TAG_BASE = 20000
_TAG_SPAN = 4096
_calls: dict[tuple[int, ...], itertools.count] = {}


def axis_groups(mesh: Mesh, axis: str) -> list[tuple[int, ...]]:
    """Device tuples along `axis`, one per combination of the other axes' coordinates."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str):
        raise TypeError(f"axis must be a mesh axis name (str), got {axis!r}")
    a = mesh.axis_index(axis)
    devs = np.moveaxis(mesh.devices, a, -1).reshape(-1, mesh.shape[a])
    return [tuple(int(d) for d in row) for row in devs]


def alltoall_plan(send_counts: Mapping[int, Sequence[int]], mesh: Mesh, axis: str, row_bytes: int = 1,
                  topology=None, algorithm: str = "auto") -> dict[tuple[int, ...], AllToAllPlan]:
    """The plans (one per group along `axis`) for a full {device: send counts} map."""
    out = {}
    for g in axis_groups(mesh, axis):
        out[g] = plan_alltoall(g, [send_counts[d] for d in g], row_bytes, topology, algorithm)
    return out


def _counts(c, device: int, n: int, axis: str) -> tuple[int, ...]:
    if arrays.is_torch(c):
        c = c.tolist()
    from .mesh import as_int
    try:            # dtype=object keeps the values as given (2.5 stays 2.5, True stays True)
        vals = np.asarray(c, dtype=object).reshape(-1).tolist()
    except (TypeError, ValueError):
        raise TypeError(f"counts of device {device} must be a sequence of ints, got {c!r}") from None
    row = tuple(as_int(v, f"count {j} of device {device}") for j, v in enumerate(vals))
    if len(row) != n:
        raise ValueError(f"counts of device {device} have {len(row)} entries but mesh axis {axis!r} "
                         f"has {n} devices")
    if any(v < 0 for v in row):
        raise ValueError(f"counts of device {device} must be non-negative, got {list(row)}")
    return row


def _matrix_rows(c, owned: Sequence[int]):
    """A counts matrix (one row per owned device, in mesh order) as {device: row}."""
    if isinstance(c, Mapping) or len(owned) < 2:
        return c
    if arrays.is_torch(c):
        c = c.tolist()
    try:
        m = np.asarray(c)
    except (TypeError, ValueError):
        return c
    if m.ndim == 2 and m.shape[0] == len(owned):
        return {d: m[k] for k, d in enumerate(owned)}
    raise TypeError(f"counts must be a dict {{device: counts}} or a matrix with one row per device "
                    f"({len(owned)} rows, in mesh order), got shape {m.shape}")


def _per_device(v, owned: Sequence[int], what: str) -> dict[int, Any]:
    if isinstance(v, Mapping):
        extra = [d for d in v if d not in owned]
        if extra:
            raise ValueError(f"{what} given for device(s) {extra} that this process does not own "
                             f"(it owns {list(owned)})")
        return dict(v)
    if len(owned) != 1:
        raise TypeError(f"{what} must be a dict {{device id: value}} when this process owns "
                        f"{len(owned)} devices of the mesh")
    return {owned[0]: v}


def _rows_like(x, n_rows: int):
    """An empty buffer of n_rows rows shaped and typed like x (same device for torch)."""
    shape = (n_rows,) + tuple(x.shape[1:])
    if arrays.is_torch(x):
        import torch
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    return np.empty(shape, dtype=x.dtype)


def _cat(parts, like):
    if not parts:
        return like[:0]
    if len(parts) == 1:
        return parts[0]
    if arrays.is_torch(like):
        import torch
        return torch.cat(parts)
    return np.concatenate(parts)


def all_to_all_v(x, send_counts, mesh: Mesh, axis: str, recv_counts=None, backend: str | None = None,
                 async_op: bool = False, topology=None, algorithm: str = "auto"):
    """Exchange rows along mesh axis `axis`: device i sends send_counts[i][j] rows (taken in
    order from x[i]) to the j-th device along the axis; each device gets the rows sent to
    it, concatenated in axis order of the senders.

    Without a launcher `x`, `send_counts` (and `recv_counts`) are dicts {device: value} for
    every device of `mesh`; under a launcher each process passes its own devices' (or bare
    values when it owns one device). `recv_counts` saves the count exchange; the inverse
    (combine) is the same call with the counts swapped. Counts may also be a matrix with one
    row per device (mesh order). Under a launcher recv_counts are checked against the
    senders' counts with one round of small messages, and a mismatch raises ValueError on the
    receiving process after the exchange (run with the senders' counts, so no peer hangs);
    `MESHCOMM_CHECK=0` trusts them and skips that round (a wrong count is then undefined:
    MPI reports a truncated message or leaves rows unfilled, gloo aborts). NumPy or torch
    rows (any trailing shape). Returns the same structure, or a Handle when `async_op`;
    `topology`/`algorithm` steer the planner.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
    groups = axis_groups(mesh, axis)
    stamp = _log.stamp(async_op) if _log.ON else None
    ctx = runtime.current()
    if ctx is None or backend == "local":
        runtime.no_context(backend, "all_to_all_v")
        return _local(x, send_counts, mesh, axis, recv_counts, async_op, topology, algorithm, groups, stamp)
    # Under a launcher every process validates, then (unless MESHCOMM_CHECK=0) all agree on the
    # call before any row moves: one process's bad input makes every process raise.
    be, err = ctx.resolve_backend(backend)
    args = None
    try:
        if err is not None:
            raise err
        ctx.ownership.check_mesh(mesh)
        owned = list(ctx.ownership.owned(mesh))
        if owned:
            args = _validate(x, send_counts, recv_counts, mesh, axis, owned, groups, f"process {ctx.rank} owns devices {owned}")
    except (ValueError, TypeError) as e:
        err = e
    check = settings.get("CHECK")
    if err is not None and not check:
        raise err
    bare = not isinstance(x, Mapping)
    run = _DistRun(ctx, be, groups, args, Topology.coerce(topology), algorithm, backend, mesh, axis, err, check)
    run.stamp = stamp
    wait = ctx.run(lambda: run.run(bare), async_op)
    return Handle(wait_fn=wait) if async_op else wait()


def _validate(x, send_counts, recv_counts, mesh, axis, owned, groups, where):
    """(xs, scs, rcs, like, row_elems, row_bytes) for the devices this process owns."""
    n = mesh.axis_size(axis)
    xs = _per_device(x, owned, "x")
    scs = _per_device(_matrix_rows(send_counts, owned), owned, "send_counts")
    missing = [d for d in owned if d not in xs or d not in scs]
    if missing:
        raise ValueError(f"x and send_counts need an entry for device(s) {missing[:8]} ({where})")
    kinds = {arrays.kind_of(v) for v in xs.values()}
    if "jax" in kinds or len(kinds) > 1:
        raise TypeError(f"all_to_all_v takes NumPy arrays or torch tensors of one kind, got {sorted(kinds)}")
    xs = {d: native_byte_order(v) for d, v in xs.items()}
    scs = {d: _counts(scs[d], d, n, axis) for d in owned}
    like = xs[owned[0]]
    for d in owned:
        v = xs[d]
        if v.ndim < 1:
            raise ValueError(f"x of device {d} must have a row dimension, got shape {tuple(v.shape)}")
        if sum(scs[d]) != v.shape[0]:
            raise ValueError(f"send counts of device {d} sum to {sum(scs[d])} but x of device {d} has "
                             f"{v.shape[0]} rows")
        if tuple(v.shape[1:]) != tuple(like.shape[1:]) or v.dtype != like.dtype:
            raise ValueError(f"x of device {d} has rows {tuple(v.shape[1:])} {v.dtype}, device {owned[0]} "
                             f"has {tuple(like.shape[1:])} {like.dtype}; all rows must match")
    rcs = None
    if recv_counts is not None:
        rcs = _per_device(_matrix_rows(recv_counts, owned), owned, "recv_counts")
        rcs = {d: _counts(rcs[d], d, n, axis) for d in owned if d in rcs}
        if len(rcs) != len(owned):
            raise ValueError(f"recv_counts needs an entry for every device this process owns {owned}")
        _check_owned_counts(groups, scs, rcs, axis)
    row_elems = int(np.prod(like.shape[1:], dtype=np.int64))
    row_bytes = row_elems * arrays.dtype_of(like)[1]
    return xs, scs, rcs, like, row_elems, row_bytes


def _local(x, send_counts, mesh, axis, recv_counts, async_op, topology, algorithm, groups, stamp=None):
    """Without a launcher: every device's rows are here; run each group's plan in memory."""
    owned = list(mesh.device_ids)
    n = mesh.axis_size(axis)
    bare = not isinstance(x, Mapping)
    xs, scs, rcs, like, row_elems, row_bytes = _validate(
        x, send_counts, recv_counts, mesh, axis, owned, groups,
        "without meshcomm.init this process owns every device" + runtime.init_hint())
    topo = Topology.coerce(topology)
    out = {}
    for g in groups:
        counts = [scs[d] for d in g]
        if rcs is not None:
            for j, f in enumerate(g):
                want = tuple(counts[i][j] for i in range(n))
                if rcs[f] != want:
                    raise ValueError(f"recv_counts of device {f} are {list(rcs[f])} but the senders "
                                     f"along axis {axis!r} send it {list(want)}")
        p = plan_alltoall(g, counts, row_bytes, topo, algorithm)
        out.update(_run_local(p, xs))
    if stamp is not None:           # one process: nothing on the wire (meshcomm.log)
        _log.record_rows(stamp, "all_to_all_v", group=None, backend="local", xs=xs, out=out, like=like)
    result = out[owned[0]] if bare and len(owned) == 1 else out
    return Handle(result=result) if async_op else result


# -- execution --------------------------------------------------------------------------------

def _split(x, counts, origin, devices):
    """{(origin, final): rows} for the non-empty blocks of one device's input."""
    out, off = {}, 0
    for f, c in zip(devices, counts):
        if c:
            out[(origin, f)] = x[off:off + c]
        off += c
    return out


def _assemble(holdings, device, devices, like):
    return _cat([holdings[(o, device)] for o in devices if (o, device) in holdings], like)


def _run_local(p: AllToAllPlan, xs) -> dict[int, Any]:
    """Run a plan in one process: messages move blocks between per-device holdings."""
    hold = {d: _split(xs[d], p.counts[i], d, p.devices) for i, d in enumerate(p.devices)}
    for msg in p.messages:
        for o, f, _ in msg.blocks:
            hold[msg.dst][(o, f)] = hold[msg.src].pop((o, f))
    return {d: _assemble(hold[d], d, p.devices, xs[d]) for d in p.devices}


class _DistRun:
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
        self.hold = {d: _split(xs[d], scs[d], d, p.devices) for p, _ in self.plans
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
                    out[d] = _assemble(self.hold[d], d, p.devices, self.like)
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


def _check_owned_counts(groups, scs, rcs, axis):
    """recv_counts entries whose sender this process owns must equal that sender's send
    counts (a device's count to itself included): checked here, before any communication."""
    for g in groups:
        for j, f in enumerate(g):
            if f not in rcs:
                continue
            for i, o in enumerate(g):
                if o in scs and scs[o][j] != rcs[f][i]:
                    raise ValueError(
                        f"recv_counts of device {f} say {rcs[f][i]} rows from device {o} but the "
                        f"send_counts of device {o} send it {scs[o][j]} (mesh axis {axis!r})")


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
