"""Per-iteration communication of one rank training a GPT-style transformer under data,
tensor, sequence, pipeline and expert parallelism and ZeRO.

b micro-batch, s sequence, h hidden, V vocab, L layers, n_l the layers on the rank, n_moe
its MoE layers, m micro-batches, t tp, p pp, v virtual chunks, e ep, k top_k, E experts,
C capacity factor, w bytes per activation/parameter element, g per gradient element.

Tensor parallelism ("Megatron-LM: Training Multi-Billion Parameter Language Models Using
Model Parallelism", section 3, figure 4): per layer and micro-batch the g operator
all-reduces b*s*h*w after attention and after the MLP in the forward pass, and the f
operator all-reduces the same in the backward pass: 2 + 2 all-reduces. The vocab-parallel
embedding all-reduces its output (forward) on the first stage; the head's input is an f
operator (one backward all-reduce) on the last stage, and the vocab-parallel cross-entropy
all-reduces three b*s fp32 values (max logit, target logit, sum of exponentials) forward
(Megatron-LM's implementation). Recomputation runs each layer's forward collectives twice.

Sequence parallelism ("Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2): each all-reduce becomes an all-gather and a reduce-scatter of b*s*h*w
(message sizes as nccl-tests counts them: the full buffer), so the bytes on the wire are
equal; the embedding's all-reduce becomes a reduce-scatter (an all-gather backward), the
head's input an all-gather (a reduce-scatter backward). Pipeline messages shrink to
b*(s/t)*h*w (the sequence-parallel shard each rank holds).

Pipeline parallelism ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sections 2.2 and 3.2): every micro-batch crosses each stage boundary once
forward (activation b*s*h*w) and once backward (its gradient), for 1F1B and interleaved
alike; with v chunks per rank a rank owns v chunks, so the crossings through it (and the
traffic) grow v-fold. A rank of stage i sends m activations per chunk not last in the model
and m gradients per chunk not first; it receives the mirror. With tied embeddings the
first and last stages all-reduce the word-embedding gradient (V/t*h*g) once per iteration.

Experts ("GShard: Scaling Giant Models with Conditional Computation and Automatic
Sharding", "Switch Transformers"): per MoE layer and micro-batch an all-to-all dispatches
the tokens to their experts and one combines them back, forward, and the same two run
backward: 4 all-to-alls over the ep group, each rank's send buffer E*ceil(k*C*T/E)*h*w for
T = b*s tokens (b*s/t with sequence parallelism): the fixed expert capacity of GShard.

Data parallelism and ZeRO: `gradients.py`.
"""
from __future__ import annotations

from fractions import Fraction

from .entries import CommEntry
from .gradients import gradient_entries
from .shapes import Parallel, Transformer, cdiv, stage_layers, transformer_units

__all__ = ["transformer_comm", "rank_stage"]

LOSS_BYTES = 4    # the cross-entropy's all-reduces are in fp32


def rank_stage(par: Parallel, rank: int | None) -> int | None:
    """Pipeline stage of `rank` (Megatron-LM's order: tp fastest, then dp, then pp)."""
    if rank is None:
        return None
    if not isinstance(rank, int) or not 0 <= rank < par.world:
        raise ValueError(f"rank {rank!r} is not in 0..{par.world - 1} (world = dp*tp*pp)")
    return rank // (par.dp * par.tp)


def transformer_comm(m: Transformer, par: Parallel, dtype_bytes: int, grad_bytes: int,
                     rank: int | None) -> list[CommEntry]:
    """Entries of one rank (`rank=None`: a rank of an interior pipeline stage, which sends
    and receives both ways and holds no embedding; with pp=1 the only stage)."""
    if par.ep > 1 and not m.experts:
        raise ValueError(f"Parallel.ep={par.ep} needs a Transformer with experts > 0")
    if m.experts % par.ep:
        raise ValueError(f"Transformer.experts={m.experts} must be a multiple of ep={par.ep}")
    stage = rank_stage(par, rank)
    if par.pp == 1:
        stage = 0
    first, last = stage == 0, stage == par.pp - 1
    layers = stage_layers(m, par, stage)
    n_l, n_moe = len(layers), sum(m.is_moe(i) for i in layers)
    b, s, h, mb, t, w = m.micro_batch, m.seq, m.hidden, par.micro_batches, par.tp, dtype_bytes
    fwd = 2 if par.recompute else 1
    out: list[CommEntry] = []

    if t > 1:
        act = b * s * h * w
        if not par.sp:
            out.append(CommEntry("all_reduce", t, act, (2 * n_l * fwd + first) * mb, "tp.fwd"))
            out.append(CommEntry("all_reduce", t, act, (2 * n_l + last) * mb, "tp.bwd"))
        else:
            out.append(CommEntry("all_gather", t, act, (2 * n_l * fwd + last) * mb, "tp.fwd"))
            out.append(CommEntry("reduce_scatter", t, act, (2 * n_l * fwd + first) * mb, "tp.fwd"))
            out.append(CommEntry("all_gather", t, act, (2 * n_l + first) * mb, "tp.bwd"))
            out.append(CommEntry("reduce_scatter", t, act, (2 * n_l + last) * mb, "tp.bwd"))
        if last:
            out.append(CommEntry("all_reduce", t, b * s * LOSS_BYTES, 3 * mb, "tp.loss"))

    if par.pp > 1:
        msg = b * cdiv(s, t) * h * w if par.sp else b * s * h * w
        if stage is None:
            f_send = f_recv = par.virtual
        else:
            chunks = [j * par.pp + stage for j in range(par.virtual)]
            f_send = sum(c < par.pp * par.virtual - 1 for c in chunks)
            f_recv = sum(c > 0 for c in chunks)
        out += [CommEntry("send", 2, msg, f_send * mb, "pp.fwd"), CommEntry("recv", 2, msg, f_recv * mb, "pp.fwd"),
                CommEntry("send", 2, msg, f_recv * mb, "pp.bwd"), CommEntry("recv", 2, msg, f_send * mb, "pp.bwd")]
        if m.tied_embeddings and (first or last):
            out.append(CommEntry("all_reduce", 2, cdiv(m.vocab, t) * h * grad_bytes, 1, "pp.embed"))

    if par.ep > 1 and n_moe:
        tokens = b * cdiv(s, t) if par.sp else b * s
        capacity = Fraction(str(m.capacity_factor)) * m.top_k * tokens / m.experts
        rows = m.experts * -(-capacity.numerator // capacity.denominator)
        msg = rows * h * w
        out.append(CommEntry("all_to_all", par.ep, msg, 2 * n_moe * fwd * mb, "ep.fwd"))
        out.append(CommEntry("all_to_all", par.ep, msg, 2 * n_moe * mb, "ep.bwd"))

    dense, expert = transformer_units(m, par, stage)
    out += gradient_entries(dense, par.dp, par.zero, mb, par.bucket_bytes, w, grad_bytes, "dp")
    out += gradient_entries(expert, par.dp // par.ep, par.zero, mb, par.bucket_bytes, w, grad_bytes, "edp")
    return [e for e in out if e.calls]

