"""Bus bandwidth as nccl-tests reports it: busbw = algbw * bus_factor(op, n) for a group of n.

algbw is the bytes of the operation (nccl-tests' size: all_reduce and broadcast/reduce the
buffer; all_gather the gathered output; reduce_scatter the input; all_to_all the send
buffer) over the time. The factor makes busbw comparable with the link's peak bandwidth
(nccl-tests' PERFORMANCE.md). The one table every report uses: `meshcomm tune`, the log
summary, the model, the benchmarks.
"""
from __future__ import annotations

__all__ = ["BUS_FACTORS", "bus_factor", "algbw_busbw"]

BUS_FACTORS = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "bcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "gather": lambda n: 1.0,
    "scatter": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,      # a receive's bytes are its sender's wire bytes
}
_ALIASES = {"all_reduce": "allreduce", "all_gather": "allgather", "all_to_all": "alltoall",
            "broadcast": "bcast"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` (table or API spelling) over a group of `n` ranks."""
    key = _ALIASES.get(op, op)
    if key not in BUS_FACTORS:
        raise ValueError(f"unknown op {op!r}: expected one of {', '.join(BUS_FACTORS)} "
                         f"(or {', '.join(_ALIASES)})")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"group size of {op} must be a positive int, got {n!r}")
    return BUS_FACTORS[key](n)


def algbw_busbw(op: str, nbytes: int, n: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for `nbytes` (nccl-tests' size) moved in `seconds`."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * bus_factor(op, n)
