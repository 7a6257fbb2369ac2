"""The communication of one training step of each example in examples/, rank by rank, as the
examples issue it: `for_example(name, world=N, **flags)` -> {rank: [CommEntry]}.

Keyword arguments are the example's command-line flags (dashes as underscores, same
defaults) and `world`, the number of ranks it is launched on. Every tensor crossing ranks is
float32 (4 bytes) unless said otherwise. `via` names the meshcomm call each entry is made of;
`calls` counts that call on the rank (every rank that takes part in a call makes it, so a
cross-mesh reshard is counted on its senders as `send` and on its receivers as `recv`);
`message_bytes` is the op's size as `entries.py` defines it, which for every reshard and
all_to_all_v here is the bytes of the tile the rank passes to the call (the tile it gets back
where it passes none, as receivers of a cross-mesh reshard do); for a collective (fsdp.py's)
it is nccl-tests' size, what meshcomm.log records as its logical_bytes. Not counted: the
`--check` comparison after training (one small reshard) and meshcomm's own metadata and count
exchanges.

Checked by running the examples under mpiexec with meshcomm.reshard and all_to_all_v wrapped
to record each call's tiles (GPT on 4 and 8 ranks, both schedules, --stages 2,2, --layers 7;
DLRM on 3 and 4 ranks; MoE on 4; FSDP with meshcomm.log on 3 and 4, --layers 2 and 4, with
and without --compression): every rank's calls and sizes equal these, the MoE entries
flagged `mean` in their sum over ranks.

pipelined_gpt.py (stages of sizes t_0..t_{S-1} on meshes of their own, stage s holds
layers [round(s*L/S), round((s+1)*L/S)), n_s of them; a = mb*seq*d*4):
| phase  | op         | via     | calls per step on a rank of stage s            | message |
| tp.fwd | all_reduce | reshard | micro*(2*n_s - 1), micro*2*n_s on the last stage (*) | a |
| tp.bwd | all_reduce | reshard | micro*2*n_s (the two f operators per block); none when t_s = 1 | a |
| pp.fwd | send / recv | reshard | micro, to stage s+1 / from stage s-1 (pending sum over tp -> replicated) | a |
| pp.bwd | send / recv | reshard | micro, to stage s-1 / from stage s+1 (replicated -> replicated) | a |
(*) a stage's last block leaves its sum over tp to the cross-stage reshard; no tp calls when t_s = 1.
Both schedules (1f1b, eager) issue the same calls.

dlrm.py (n ranks, global batch B, table widths W_r per rank as `dlrm.table_groups`):
| emb.fwd | all_to_all | reshard | 1 (features sharded -> batch sharded, global B x W) | B*W_r*4 |
| emb.bwd | all_to_all | reshard | 1 (the reverse) | B/n*W*4 |
| dp.grad | all_reduce | reshard | 1 when n > 1 (bottom and top MLP gradients + the loss) | (MLP params + 1)*4 |
With one rank the two reshards still run (a group of one).

moe.py (n ranks, T = batch/n*seq tokens per rank, k = top_k, E = experts_per_rank*n):
| ep.counts | all_to_all | all_to_all_v | 1 (int64 send counts, one row per peer) | n*8 |
| ep.fwd    | all_to_all | all_to_all_v | 1 dispatch of the token rows | T*k*d*4 |
| ep.ids    | all_to_all | all_to_all_v | 1 (int64 expert id of each row) | T*k*8 |
| ep.fwd    | all_to_all | all_to_all_v | 1 combine (mean: rows received depend on routing) | T*k*d*4 |
| ep.bwd    | all_to_all | all_to_all_v | 1 combine gradient, 1 dispatch gradient (mean) | T*k*d*4 |
| dp.grad   | all_reduce | reshard | 1 (layer norms, qkv, proj, gate gradients + the loss) | (4d + 4d^2 + d*E + 1)*4 |
A rank sends exactly k rows per token it holds, so its dispatch, ids and combine-gradient
bytes are exact; what it sends back (combine, dispatch gradient) is what it received, exact
only summed over ranks. With one rank nothing is communicated.

fsdp.py (n ranks; torch FSDP2 with `fully_shard` on each of the L blocks and on the root,
its all-gathers and reduce-scatters through meshcomm's collectives). It trains once per run:
uncompressed, then once per codec of --compression (`fsdp_codecs`); R runs. FSDP pads each
parameter's dim 0 to a multiple of n, so a module's shard is P = sum over its parameters of
ceil(rows/n) * cols elements (the root: token embedding 256 x d, positions seq x d, final
layer norm; a block: two layer norms, qkv, proj, fc, out with biases). The collectives'
message_bytes are nccl-tests' sizes (entries.py), n*P*4 for both:
| fsdp.gather | all_gather     | all_gather     | R per module and pass: the root once (it keeps its parameters for backward), each block twice (forward, backward) | n*P*4 |
| fsdp.grad   | reduce_scatter | reduce_scatter | R per module (its gradients) | n*P*4 |
| dp.loss     | all_reduce     | all_reduce     | R (the step's loss, float64, averaged over ranks) | 8 |
With one rank the model trains without FSDP: nothing is communicated. --heads and --batch do
not change the volumes.
"""
from __future__ import annotations

from .dlrm import table_groups
from .entries import CommEntry
from .shapes import DLRM

__all__ = ["for_example", "EXAMPLES", "gpt_stages", "fsdp_codecs"]

F32, I64, F64 = 4, 8, 8

DEFAULTS = {
    "pipelined_gpt": dict(world=1, stages=None, schedule="1f1b", layers=6, micro=4, mb=2, seq=16, d=32, vocab=64),
    "dlrm": dict(world=1, batch=32, widths="8,16,8,24,16,8", rows=100, d=8),
    "moe": dict(world=1, batch=16, seq=8, d=32, experts_per_rank=2, top_k=2),
    "fsdp": dict(world=1, layers=4, d=128, heads=4, seq=64, batch=4, compression="zfp(rate=16)"),
}
EXAMPLES = tuple(DEFAULTS)
GPT_HEADS = 4


def _ints(v, what: str) -> list[int]:
    vals = [int(x) for x in v.split(",")] if isinstance(v, str) else [int(x) for x in v]
    if not vals or min(vals) < 0:
        raise ValueError(f"{what} must be non-negative integers, got {v!r}")
    return vals


def gpt_stages(world: int, stages=None) -> list[int]:
    """Devices per stage, as the example picks them (its `default_stages` when not given)."""
    if stages is not None:
        return _ints(stages, "stages")
    if world >= 4 and world % 4 == 0:
        q = world // 4
        return [q, 2 * q, q]
    return [1] * world if world <= 3 else [world // 2, world - world // 2]


def _gpt(world, stages, schedule, layers, micro, mb, seq, d, vocab):
    sizes = gpt_stages(world, stages)
    if sum(sizes) != world or any(t < 1 or GPT_HEADS % t for t in sizes) or layers < len(sizes):
        raise ValueError(f"stages {sizes}: must sum to {world} ranks, each dividing {GPT_HEADS} heads, "
                         f"at most layers={layers} stages")
    if schedule not in ("1f1b", "eager"):
        raise ValueError(f"schedule must be '1f1b' or 'eager', got {schedule!r}")
    S = len(sizes)
    bounds = [round(k * layers / S) for k in range(S + 1)]
    a = mb * seq * d * F32
    out = {}
    for s, t in enumerate(sizes):
        n, last = bounds[s + 1] - bounds[s], s == S - 1
        es = []
        if t > 1:
            es += [CommEntry("all_reduce", t, a, micro * (2 * n - (0 if last else 1)), "tp.fwd", "reshard"),
                   CommEntry("all_reduce", t, a, micro * 2 * n, "tp.bwd", "reshard")]
        if s < S - 1:
            es += [CommEntry("send", t + sizes[s + 1], a, micro, "pp.fwd", "reshard"),
                   CommEntry("recv", t + sizes[s + 1], a, micro, "pp.bwd", "reshard")]
        if s > 0:
            es += [CommEntry("recv", sizes[s - 1] + t, a, micro, "pp.fwd", "reshard"),
                   CommEntry("send", sizes[s - 1] + t, a, micro, "pp.bwd", "reshard")]
        for r in range(sum(sizes[:s]), sum(sizes[:s + 1])):
            out[r] = list(es)
    return out


def _dlrm(world, batch, widths, rows, d):
    widths = _ints(widths, "widths")
    if batch % world or any(w % d for w in widths):
        raise ValueError(f"batch={batch} must be divisible by the {world} ranks and every width "
                         f"of {widths} by d={d}")
    model = DLRM(dense=8, bottom=(32, d), top=(32, 1), tables=tuple(widths), batch=batch)
    W = sum(widths)
    out = {}
    for r, grp in enumerate(table_groups(len(widths), world)):
        es = [CommEntry("all_to_all", world, batch * sum(widths[t] for t in grp) * F32, 1, "emb.fwd", "reshard"),
              CommEntry("all_to_all", world, batch // world * W * F32, 1, "emb.bwd", "reshard")]
        if world > 1:
            es.append(CommEntry("all_reduce", world, (model.mlp_params + 1) * F32, 1, "dp.grad", "reshard"))
        out[r] = es
    return out


def _moe(world, batch, seq, d, experts_per_rank, top_k):
    experts = experts_per_rank * world
    if batch % world or not 1 <= top_k <= experts:
        raise ValueError(f"batch={batch} must be divisible by the {world} ranks and top_k={top_k} "
                         f"in 1..{experts} experts")
    if world == 1:
        return {0: []}
    rows = batch // world * seq * top_k
    v = "all_to_all_v"
    es = [CommEntry("all_to_all", world, world * I64, 1, "ep.counts", v),
          CommEntry("all_to_all", world, rows * d * F32, 1, "ep.fwd", v),
          CommEntry("all_to_all", world, rows * I64, 1, "ep.ids", v),
          CommEntry("all_to_all", world, rows * d * F32, 1, "ep.fwd", v, mean=True),
          CommEntry("all_to_all", world, rows * d * F32, 1, "ep.bwd", v),
          CommEntry("all_to_all", world, rows * d * F32, 1, "ep.bwd", v, mean=True),
          CommEntry("all_reduce", world, (4 * d + 4 * d * d + d * experts + 1) * F32, 1, "dp.grad", "reshard")]
    return {r: list(es) for r in range(world)}


def fsdp_codecs(text: str) -> list[str]:
    """fsdp.py's --compression: the codecs it trains with besides the uncompressed run, split
    at the commas outside parentheses, "none" left out: "zfp(rate=8),bf16" -> ["zfp(rate=8)", "bf16"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [c for c in out + [cur.strip()] if c and c.lower() != "none"]


FSDP_VOCAB = 256


def _fsdp(world, layers, d, heads, seq, batch, compression):
    if d % heads or min(layers, seq, batch) < 0:
        raise ValueError(f"d={d} must be divisible by heads={heads}; layers, seq, batch non-negative")
    if world == 1:
        return {0: []}
    runs = 1 + len(fsdp_codecs(compression))

    def shard(params):                            # FSDP's padded shard of a module, elements
        return sum(-(-rows // world) * cols for rows, cols in params)
    root = shard([(FSDP_VOCAB, d), (seq, d), (d, 1), (d, 1)])
    block = shard([(d, 1)] * 4 + [(3 * d, d), (3 * d, 1), (d, d), (d, 1), (4 * d, d), (4 * d, 1), (d, 4 * d), (d, 1)])
    es = [CommEntry("all_gather", world, world * root * F32, runs, "fsdp.gather"),
          CommEntry("all_gather", world, world * block * F32, 2 * layers * runs, "fsdp.gather"),
          CommEntry("reduce_scatter", world, world * root * F32, runs, "fsdp.grad"),
          CommEntry("reduce_scatter", world, world * block * F32, layers * runs, "fsdp.grad"),
          CommEntry("all_reduce", world, F64, runs, "dp.loss")]
    return {r: list(es) for r in range(world)}


_BUILD = {"pipelined_gpt": _gpt, "dlrm": _dlrm, "moe": _moe, "fsdp": _fsdp}


def for_example(name: str, **args) -> dict[int, list[CommEntry]]:
    """{rank: entries} of one training step of examples/<name>.py launched on `world` ranks
    with the given flags (module docstring)."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown example {name!r}: expected one of {', '.join(EXAMPLES)}")
    unknown = set(args) - set(DEFAULTS[name])
    if unknown:
        raise TypeError(f"{name}: unknown argument(s) {sorted(unknown)}; expected {sorted(DEFAULTS[name])}")
    kw = {**DEFAULTS[name], **args}
    if not isinstance(kw["world"], int) or kw["world"] < 1:
        raise ValueError(f"world must be a positive int, got {kw['world']!r}")
    return _BUILD[name](**kw)

