"""meshcomm.model: analytic per-iteration communication of one rank training a transformer
(data, tensor, sequence, pipeline and expert parallelism, ZeRO) or a DLRM.

    from meshcomm import model
    gpt = model.Transformer(hidden=4096, heads=32, layers=32, seq=2048, vocab=50304, micro_batch=1)
    par = model.Parallel(dp=8, tp=8, pp=4, micro_batches=16, sp=True)
    entries = model.comm_per_iteration(gpt, par, dtype_bytes=2)     # [CommEntry]
    print(model.table(entries))
    s = model.summary(entries)        # s.total, s.by_op, s.by_phase, s.by_via, s.by_size
    model.for_example("pipelined_gpt", world=4)   # {rank: [CommEntry]} of examples/pipelined_gpt.py

Each `CommEntry(op, group_size, message_bytes, calls, phase, via, mean)` also carries
`bytes_per_rank` (message_bytes * calls) and `wire_bytes` (with nccl-tests' bus factors).
The formulas and their sources are in the docstrings of `entries` (sizes, bus factors),
`transformer` (tp, sp, pp, ep), `gradients` (dp, ZeRO), `dlrm` and `examples` (what the
four examples issue). Pure Python: no torch, no MPI.
"""
from __future__ import annotations

from .dlrm import dlrm_comm, table_groups
from .entries import (BUS_FACTOR, SIZE_BUCKETS, CommEntry, Summary, Totals, bus_factor, format_bytes,
                      merge, size_bucket, summary, table)
from .examples import EXAMPLES, for_example
from .shapes import DLRM, Parallel, Transformer
from .transformer import rank_stage, transformer_comm

__all__ = ["Transformer", "DLRM", "Parallel", "CommEntry", "Totals", "Summary", "comm_per_iteration",
           "summary", "table", "merge", "for_example", "EXAMPLES", "bus_factor", "BUS_FACTOR",
           "SIZE_BUCKETS", "size_bucket", "format_bytes", "rank_stage", "table_groups"]


def comm_per_iteration(model, parallel: Parallel | None = None, dtype_bytes: int = 2, *,
                       grad_bytes: int | None = None, rank: int | None = None) -> list[CommEntry]:
    """Communication of one rank in one training iteration (all micro-batches and the
    gradient reduction), one entry per (op, message size, phase).

    model: `Transformer` or `DLRM`; parallel: `Parallel` (default: one rank).
    dtype_bytes: bytes per activation and parameter element (2 for bf16/fp16);
    grad_bytes: per gradient element in the data-parallel reduction (default dtype_bytes;
    4 for fp32 gradient reduction).
    rank: which rank (Megatron-LM order: tp fastest, then dp, then pp). None: a
    representative rank: for a transformer one of an interior pipeline stage (it sends and
    receives both ways and holds no embedding; with pp=1 the only stage), for a DLRM the
    mean over ranks."""
    parallel = Parallel() if parallel is None else parallel
    if not isinstance(parallel, Parallel):
        raise TypeError(f"parallel must be a meshcomm.model.Parallel, got {type(parallel).__name__}")
    for name, v in (("dtype_bytes", dtype_bytes), ("grad_bytes", grad_bytes)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    grad_bytes = dtype_bytes if grad_bytes is None else grad_bytes
    if isinstance(model, Transformer):
        return transformer_comm(model, parallel, dtype_bytes, grad_bytes, rank)
    if isinstance(model, DLRM):
        return dlrm_comm(model, parallel, dtype_bytes, grad_bytes, rank)
    raise TypeError(f"model must be a meshcomm.model.Transformer or DLRM, got {type(model).__name__}")
