"""The shapes the communication model reads: `Transformer`, `DLRM` and `Parallel` (frozen
dataclasses, checked on construction), and the parameter counts of one rank.

Parameter counts (GPT layout of "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism"; h hidden, f ffn, V vocab, t tensor-parallel degree, every
split rounded up, i.e. the largest shard of a `torch.chunk` split):

    layer:  qkv h*3h/t + 3h/t (column-parallel)  proj h/t*h + h (row-parallel, bias replicated)
            fc1 h*f/t + f/t (column)  fc2 f/t*h + h (row)  two layer norms 4h (replicated)
            = 12h^2 + 13h for f = 4h and t = 1
    MoE layer: the MLP becomes experts/ep experts of that MLP, plus a router h*experts
    first stage: word embedding V/t*h (vocab-parallel), learned positions seq*h
    last stage: final layer norm 2h; the head V/t*h (a copy of the word embedding when tied
                and pp > 1, a parameter of its own when not tied)
"""
from __future__ import annotations

import dataclasses

__all__ = ["Transformer", "DLRM", "Parallel", "cdiv", "stage_layers", "transformer_units", "mlp_params"]

SCHEDULES = ("1f1b", "interleaved")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(obj, *names):
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A GPT-style decoder. `micro_batch` sequences of `seq` tokens per micro-batch;
    `ffn` defaults to 4*hidden. MoE: `experts` > 0 makes every `moe_every`-th layer
    (layers i with (i+1) % moe_every == 0) a mixture of `experts` MLPs, each token routed to
    `top_k` of them, with expert capacity `capacity_factor` (1.0: no padding when balanced).
    `tied_embeddings`: the head reuses the word embedding; `position_embeddings`: learned
    positions (seq*h parameters; False for rotary)."""
    hidden: int
    heads: int
    layers: int
    seq: int
    vocab: int
    micro_batch: int = 1
    ffn: int | None = None
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float = 1.0
    tied_embeddings: bool = True
    position_embeddings: bool = True

    def __post_init__(self):
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden if isinstance(self.hidden, int) else None)
        _positive(self, "hidden", "heads", "layers", "seq", "vocab", "micro_batch", "ffn", "top_k", "moe_every")
        if not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"Transformer.experts must be an int >= 0, got {self.experts!r}")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"Transformer.top_k={self.top_k} exceeds experts={self.experts}")
        if not self.capacity_factor > 0:
            raise ValueError(f"Transformer.capacity_factor must be > 0, got {self.capacity_factor!r}")

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def params(self) -> int:
        """Parameters of the whole model (t = 1, one copy of tied embeddings)."""
        dense, expert = zip(*(_layer_params(self, 1, 1, self.is_moe(i)) for i in range(self.layers)))
        emb = self.vocab * self.hidden + (self.seq * self.hidden if self.position_embeddings else 0)
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return sum(dense) + self.experts * sum(expert) + emb + head + 2 * self.hidden


@dataclasses.dataclass(frozen=True)
class DLRM:
    """"Deep Learning Recommendation Model for Personalization and Recommendation Systems"
    with dot interaction. `dense` input features -> bottom MLP of sizes `bottom` (its last
    size d is the feature-vector width); embedding `tables` of the given widths (multiples of
    d: a table of width k*d gives k feature vectors), pooled per sample; the top MLP of sizes
    `top` reads d + f(f-1)/2 values, f = 1 + sum(tables)/d. `batch`: global samples per
    micro-batch."""
    dense: int
    bottom: tuple
    top: tuple
    tables: tuple
    batch: int

    def __post_init__(self):
        for name in ("bottom", "top", "tables"):
            v = tuple(getattr(self, name))
            object.__setattr__(self, name, v)
            if not v or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v):
                raise ValueError(f"DLRM.{name} must be a non-empty sequence of positive ints, got {v!r}")
        _positive(self, "dense", "batch")
        bad = [w for w in self.tables if w % self.d]
        if bad:
            raise ValueError(f"DLRM.tables widths {bad} are not multiples of the feature width "
                             f"d={self.d} (bottom[-1])")

    @property
    def d(self) -> int:
        return self.bottom[-1]

    @property
    def features(self) -> int:
        return 1 + sum(self.tables) // self.d

    @property
    def mlp_params(self) -> int:
        f = self.features
        return mlp_params((self.dense, *self.bottom)) + mlp_params((self.d + f * (f - 1) // 2, *self.top))


def mlp_params(sizes) -> int:
    """Weights and biases of dense layers sizes[0] -> sizes[1] -> ..."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Parallel degrees and options. world = dp*tp*pp ranks, ranked as Megatron-LM does:
    tp fastest, then dp, then pp (rank = stage*dp*tp + d*tp + t). `ep` splits the experts
    over ep ranks of each data-parallel group (ep divides dp; expert gradients are reduced
    over the dp/ep ranks holding the same experts). `zero` 0..3: ZeRO stage of the
    data-parallel optimizer (3 = FSDP). `sp`: sequence parallelism beside tp. `schedule`
    "1f1b" or "interleaved" with `virtual` model chunks per rank (Megatron-LM requires
    micro_batches % pp == 0 for it). `micro_batches` per iteration (pipeline micro-batches,
    or gradient-accumulation steps without pp). `bucket_bytes`: data-parallel gradients
    reduced in buckets of that size (None: one call). `recompute`: full activation
    recomputation (each layer's forward runs again in the backward pass)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    virtual: int = 1
    micro_batches: int = 1
    bucket_bytes: int | None = None
    recompute: bool = False

    def __post_init__(self):
        _positive(self, "dp", "tp", "pp", "ep", "virtual", "micro_batches")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Parallel.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Parallel.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "1f1b" and self.virtual != 1:
            raise ValueError(f"Parallel.virtual={self.virtual} needs schedule='interleaved'")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ValueError(f"interleaved schedule: micro_batches={self.micro_batches} must be a "
                             f"multiple of pp={self.pp}")
        if self.dp % self.ep:
            raise ValueError(f"Parallel.ep={self.ep} must divide dp={self.dp}")
        if self.bucket_bytes is not None:
            _positive(self, "bucket_bytes")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def stage_layers(m: Transformer, par: Parallel, stage: int | None) -> list[int]:
    """Global indices of the layers on pipeline stage `stage`: the model is cut into pp*virtual
    chunks of ceil(layers / (pp*virtual)) layers, chunk c on stage c % pp. `None`: a
    representative interior stage (the first virtual*chunk layer indices)."""
    n = cdiv(m.layers, par.pp * par.virtual)
    if stage is None:
        return list(range(min(m.layers, par.virtual * n)))
    chunks = [j * par.pp + stage for j in range(par.virtual)]
    return [i for c in chunks for i in range(c * n, min((c + 1) * n, m.layers))]


def _layer_params(m: Transformer, tp: int, ep: int, moe: bool) -> tuple[int, int]:
    """(dense parameters, parameters of ONE local expert) of a layer on one tensor-parallel rank;
    the layer holds experts/ep local experts."""
    h, f = m.hidden, m.ffn
    qkv = cdiv(3 * h, tp)
    attn = qkv * h + qkv + cdiv(h, tp) * h + h
    mlp = 2 * cdiv(f, tp) * h + cdiv(f, tp) + h
    if moe:
        return attn + 4 * h + h * m.experts, mlp
    return attn + 4 * h + mlp, 0


def transformer_units(m: Transformer, par: Parallel, stage: int | None) -> tuple[list[int], list[int]]:
    """Parameter counts on one rank of `stage`, as FSDP units: (dense units: one per layer, one
    for the embeddings on the first stage and one for the final norm and head on the last;
    expert units: the local experts of each MoE layer)."""
    first = stage == 0 or par.pp == 1
    last = stage == par.pp - 1 or par.pp == 1
    dense, expert = [], []
    local_experts = m.experts // par.ep if m.experts else 0
    for i in stage_layers(m, par, None if par.pp > 1 and stage is None else (stage or 0)):
        d, e = _layer_params(m, par.tp, par.ep, m.is_moe(i))
        dense.append(d)
        if m.is_moe(i):
            expert.append(local_experts * e)
    word = cdiv(m.vocab, par.tp) * m.hidden
    if first:
        dense.append(word + (m.seq * m.hidden if m.position_embeddings else 0))
    if last:
        head = word if (not m.tied_embeddings or par.pp > 1) else 0
        dense.append(2 * m.hidden + head)
    return dense, expert
