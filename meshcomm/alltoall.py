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

from typing import Any, Mapping, Sequence

import numpy as np

from . import arrays, runtime, settings
from . import log as _log
from .handle import Handle
from .mesh import Mesh
from .planners import Topology
from .planners.alltoall import AllToAllPlan, plan_alltoall
from .runtime.alltoall_call import DistRun, assemble, split_rows
from .validate import native_byte_order

__all__ = ["all_to_all_v", "axis_groups", "alltoall_plan"]

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
    run = DistRun(ctx, be, groups, args, Topology.coerce(topology), algorithm, backend, mesh, axis, err, check)
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

def _run_local(p: AllToAllPlan, xs) -> dict[int, Any]:
    """Run a plan in one process: messages move blocks between per-device holdings."""
    hold = {d: split_rows(xs[d], p.counts[i], d, p.devices) for i, d in enumerate(p.devices)}
    for msg in p.messages:
        for o, f, _ in msg.blocks:
            hold[msg.dst][(o, f)] = hold[msg.src].pop((o, f))
    return {d: assemble(hold[d], d, p.devices, xs[d]) for d in p.devices}


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


