"""all_to_all_v's input on one process (rows and counts, checked) and its one-process path."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import arrays
from .. import log as _log
from ..handle import Handle
from ..mesh import Mesh
from ..planners import Topology
from ..planners.alltoall import AllToAllPlan, plan_alltoall
from ..validate import plain_tile
from .context import init_hint

__all__ = ["axis_groups", "validate_owned", "local", "check_rows", "given", "split_rows", "assemble", "cat"]


def assemble(holdings, device, devices, like):
    return cat([holdings[(o, device)] for o in devices if (o, device) in holdings], like)


def split_rows(x, counts, origin, devices):
    """{(origin, final): rows} for the non-empty blocks of one device's input."""
    out, off = {}, 0
    for f, c in zip(devices, counts):
        if c:
            out[(origin, f)] = x[off:off + c]
        off += c
    return out


def cat(parts, like):
    if not parts:
        return like[:0]
    if len(parts) == 1:
        return parts[0]
    if arrays.is_torch(like):
        import torch
        return torch.cat(parts)
    return np.concatenate(parts)


def axis_groups(mesh: Mesh, axis: str) -> list[tuple[int, ...]]:
    """Device tuples along `axis`, one per combination of the other axes' coordinates."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
    if not isinstance(axis, str):
        raise TypeError(f"axis must be a mesh axis name (str), got {axis!r}")
    a = mesh.axis_index(axis)
    devs = np.moveaxis(mesh.devices, a, -1).reshape(-1, mesh.shape[a])
    return [tuple(int(d) for d in row) for row in devs]


def _counts(c, device: int, n: int, axis: str) -> tuple[int, ...]:
    if arrays.is_torch(c):
        c = c.tolist()
    from ..mesh import as_int
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


def validate_owned(ctx, x, send_counts, recv_counts, mesh, axis, groups):
    """This process's validated arguments (None where it owns no device of the mesh)."""
    ctx.ownership.check_mesh(mesh)
    owned = list(ctx.ownership.owned(mesh))
    if not owned:
        return None
    return _validate(x, send_counts, recv_counts, mesh, axis, owned, groups,
                     f"process {ctx.rank} owns devices {owned}")


def _validate(x, send_counts, recv_counts, mesh, axis, owned, groups, where):
    """(xs, scs, rcs, like, row_elems, row_bytes) for the devices this process owns."""
    n = mesh.axis_size(axis)
    xs = _per_device(x, owned, "x")
    scs = _per_device(_matrix_rows(send_counts, owned), owned, "send_counts")
    missing = [d for d in owned if d not in xs or d not in scs]
    if missing:
        raise ValueError(f"x and send_counts need an entry for device(s) {missing[:8]} ({where})")
    kinds = {arrays.kind_of(v) for v in xs.values()}
    if len(kinds) > 1:
        raise TypeError(f"all_to_all_v takes rows of one kind (NumPy, torch or JAX), got {sorted(kinds)}")
    host = kinds == {"jax"}         # JAX rows travel as host arrays; `given` puts results back
    xs = {d: plain_tile(arrays.to_numpy(v) if host else v) for d, v in xs.items()}
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


def is_jax_input(x) -> bool:
    """Whether the caller's rows are JAX arrays (then results go back as JAX arrays)."""
    v = next(iter(x.values()), None) if isinstance(x, Mapping) else x
    return arrays.is_jax(v)


def given(result, x, owned):
    """A result in the kind of the caller's rows `x`: JAX arrays on their devices for JAX rows."""
    return arrays.as_jax(result, not isinstance(result, dict), owned) if is_jax_input(x) else result


def check_rows(like, declared, who: str = "") -> None:
    """Rows (`like`: one process's tile) against a Program's (row shape, dtype name)."""
    rows, dtype = declared
    if tuple(like.shape[1:]) != tuple(rows) or arrays.dtype_of(like)[0] != dtype:
        raise ValueError(f"all_to_all_v: {who}rows are {tuple(like.shape[1:])} {arrays.dtype_of(like)[0]}, "
                         f"the Program's are {tuple(rows)} {dtype}")


def local(x, send_counts, mesh, axis, recv_counts, async_op, topology, algorithm, groups, stamp=None,
          declared=None):
    """Without a launcher: every device's rows are here; run each group's plan in memory
    (`declared`: a Program's (row shape, dtype name), checked first)."""
    owned = list(mesh.device_ids)
    n = mesh.axis_size(axis)
    bare = not isinstance(x, Mapping)
    xs, scs, rcs, like, row_elems, row_bytes = _validate(
        x, send_counts, recv_counts, mesh, axis, owned, groups,
        "without meshcomm.init this process owns every device" + init_hint())
    if declared is not None:
        for v in xs.values():
            check_rows(v, declared)
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
    result = given(out[owned[0]] if bare and len(owned) == 1 else out, x, owned)
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


