"""Data-parallel gradient and parameter traffic of one rank: plain all-reduce (optionally
bucketed), ZeRO-1/2 and ZeRO-3 (FSDP).

Sources: "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (section 7:
plain data parallelism all-reduces the gradients, 2Ψ per rank as reduce-scatter + all-gather;
stages 1 and 2 reduce-scatter the gradients and all-gather the updated parameters, 2Ψ;
stage 3 all-gathers the parameters in the forward pass and again in the backward pass and
reduce-scatters the gradients, 3Ψ: 1.5x plain data parallelism). "PyTorch FSDP: Experiences
on Scaling Fully Sharded Data Parallel" for the per-unit (per-layer) calls of stage 3.

With P parameters on the rank, g gradient bytes and w parameter bytes per element, n ranks
in the group, m micro-batches per iteration, one iteration issues:

| zero | op (message)                          | calls                          |
| ---- | ------------------------------------- | ------------------------------ |
| 0    | all_reduce (P*g)                      | 1 (gradients accumulated locally over the m micro-batches) |
| 1    | reduce_scatter (P*g), all_gather (P*w) | 1 each (gradients kept whole, reduced once) |
| 2    | reduce_scatter (P*g)                  | m (only the rank's gradient partition is kept) |
|      | all_gather (P*w)                      | 1 (after the optimizer step)   |
| 3    | all_gather (U*w) fwd, all_gather (U*w) bwd, reduce_scatter (U*g) | m per unit of U parameters |

`bucket_bytes` splits a stage-0/1/2 call into full buckets and one remainder (an idealised
flat gradient buffer; real buckets end on parameter boundaries). Stage 3 calls are per unit.
A group of one rank issues nothing.
"""
from __future__ import annotations

from collections import Counter

from .entries import CommEntry

__all__ = ["gradient_entries", "entries_from_sizes"]


def entries_from_sizes(op: str, n: int, sizes: Counter, phase: str, via: str = "",
                       mean: bool = False) -> list[CommEntry]:
    """One entry per distinct message size in `sizes` ({message bytes: calls}), largest first."""
    return [CommEntry(op, n, size, calls, phase, via, mean)
            for size, calls in sorted(sizes.items(), reverse=True) if calls]


def _split(total: int, bucket: int | None) -> Counter:
    if bucket is None or total <= bucket:
        return Counter({total: 1}) if total else Counter()
    full, rem = divmod(total, bucket)
    return Counter({bucket: full, **({rem: 1} if rem else {})})


def gradient_entries(units: list[int], n: int, zero: int, micro_batches: int,
                     bucket_bytes: int | None, param_bytes: int, grad_bytes: int,
                     prefix: str = "dp") -> list[CommEntry]:
    """Entries for parameters in `units` (counts, one per FSDP unit) replicated over a group of
    `n` ranks. Phases: `<prefix>.grad` (gradient reduction), `<prefix>.param` (parameter
    all-gather after the step; stage 3: `.param.fwd` and `.param.bwd`)."""
    total = sum(units)
    if n == 1 or total == 0:
        return []
    m = micro_batches
    if zero == 0:
        return entries_from_sizes("all_reduce", n, _split(total * grad_bytes, bucket_bytes), f"{prefix}.grad")
    if zero in (1, 2):
        rs = _split(total * grad_bytes, bucket_bytes)
        if zero == 2:
            rs = Counter({k: v * m for k, v in rs.items()})
        return (entries_from_sizes("reduce_scatter", n, rs, f"{prefix}.grad")
                + entries_from_sizes("all_gather", n, _split(total * param_bytes, bucket_bytes), f"{prefix}.param"))
    gather = Counter()
    scatter = Counter()
    for u in units:
        if u:
            gather[u * param_bytes] += m
            scatter[u * grad_bytes] += m
    return (entries_from_sizes("all_gather", n, gather, f"{prefix}.param.fwd")
            + entries_from_sizes("all_gather", n, gather, f"{prefix}.param.bwd")
            + entries_from_sizes("reduce_scatter", n, scatter, f"{prefix}.grad"))
