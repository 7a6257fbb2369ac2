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

from typing import Mapping, Sequence

from . import runtime
from . import log as _log
from .mesh import Mesh
from .planners import Topology
from .planners.alltoall import AllToAllPlan, plan_alltoall
from .runtime.alltoall_call import axis_groups, local, run
from .runtime.program import checking

__all__ = ["all_to_all_v", "axis_groups", "alltoall_plan"]

def alltoall_plan(send_counts: Mapping[int, Sequence[int]], mesh: Mesh, axis: str, row_bytes: int = 1,
                  topology=None, algorithm: str = "auto") -> dict[tuple[int, ...], AllToAllPlan]:
    """The plans (one per group along `axis`) for a full {device: send counts} map."""
    out = {}
    for g in axis_groups(mesh, axis):
        out[g] = plan_alltoall(g, [send_counts[d] for d in g], row_bytes, topology, algorithm)
    return out


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
    senders' counts (the counts travel with every run: they are data), and a mismatch raises
    ValueError on the receiving process after the exchange (run with the senders' counts, so
    no peer hangs). `Program.all_to_all_v` agrees on everything else once. NumPy, torch or JAX
    rows (any trailing shape). Returns the same structure, or a Handle when `async_op`;
    `topology`/`algorithm` steer the planner.
    """
    with checking("all_to_all_v", lambda: (mesh,)):      # every process raises
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
        groups = axis_groups(mesh, axis)
        topo = Topology.coerce(topology)
    stamp = _log.stamp(async_op) if _log.ON else None
    ctx = runtime.current()
    if ctx is None or backend == "local":
        runtime.no_context(backend, "all_to_all_v")
        return local(x, send_counts, mesh, axis, recv_counts, async_op, topology, algorithm, groups, stamp)
    return run(ctx, x, send_counts, recv_counts, mesh, axis, groups, backend, async_op, topo, algorithm, stamp)
