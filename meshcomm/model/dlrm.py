"""Per-iteration communication of one rank training a DLRM: embedding tables model-parallel
over the dp ranks, MLPs data-parallel.

Source: "Deep Learning Recommendation Model for Personalization and Recommendation Systems"
(section 4, parallelism): each rank looks up its own tables for the whole global batch B and
an all-to-all ("butterfly shuffle") gives every rank its B/n samples of all pooled
embeddings; the backward pass sends the embedding gradients back the same way; the MLP
gradients are all-reduced.

Tables are assigned in contiguous groups, the first T mod n ranks holding one table more
(`numpy.array_split`, as examples/dlrm.py does); rank r holds widths summing to W_r of the
total W. Per micro-batch, with w bytes per element:

    forward all_to_all:  rank r's send buffer B*W_r*w  (mean over ranks: B*W/n*w)
    backward all_to_all: B/n*W*w on every rank
    per iteration: the MLP gradients as in `gradients.py` (all-reduce, or ZeRO)
"""
from __future__ import annotations

from .entries import CommEntry
from .gradients import gradient_entries
from .shapes import DLRM, Parallel, mlp_params

__all__ = ["dlrm_comm", "table_groups"]


def table_groups(n_tables: int, ranks: int) -> list[list[int]]:
    """Table indices per rank: contiguous, the first n_tables % ranks ranks one more."""
    q, r = divmod(n_tables, ranks)
    starts = [k * q + min(k, r) for k in range(ranks + 1)]
    return [list(range(starts[k], starts[k + 1])) for k in range(ranks)]


def dlrm_comm(d: DLRM, par: Parallel, dtype_bytes: int, grad_bytes: int, rank: int | None) -> list[CommEntry]:
    """Entries of `rank` (None: the mean rank; its forward all-to-all is flagged `mean` when
    the tables do not split into equal widths)."""
    if (par.tp, par.pp, par.ep) != (1, 1, 1):
        raise ValueError(f"DLRM: tables are split over the dp ranks; tp, pp and ep must be 1, got "
                         f"tp={par.tp} pp={par.pp} ep={par.ep}")
    n, B, W = par.dp, d.batch, sum(d.tables)
    if B % n:
        raise ValueError(f"DLRM.batch={B} must be divisible by dp={n} (the batch is split over ranks)")
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < n):
        raise ValueError(f"rank {rank!r} is not in 0..{n - 1}")
    out: list[CommEntry] = []
    if n > 1:
        widths = [sum(d.tables[t] for t in g) for g in table_groups(len(d.tables), n)]
        if rank is None:
            fwd, mean = B // n * W, len(set(widths)) > 1
        else:
            fwd, mean = B * widths[rank], False
        m = par.micro_batches
        out += [CommEntry("all_to_all", n, fwd * dtype_bytes, m, "emb.fwd", mean=mean),
                CommEntry("all_to_all", n, B // n * W * dtype_bytes, m, "emb.bwd")]
    f = d.features
    units = [mlp_params((d.dense, *d.bottom)), mlp_params((d.d + f * (f - 1) // 2, *d.top))]
    out += gradient_entries(units, n, par.zero, par.micro_batches, par.bucket_bytes, dtype_bytes, grad_bytes, "dp")
    return out
