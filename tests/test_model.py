"""meshcomm.model: formulas against hand computations on small shapes, invariants (ZeRO-3 is
1.5x data parallelism on the wire, sequence parallelism equals tensor parallelism, pipeline
bytes scale with micro-batches and with virtual stages), and the examples' descriptions."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from meshcomm import model as M

ROOT = Path(__file__).resolve().parent.parent
H, B, S, V = 64, 2, 16, 128
ACT = B * S * H * 2                                   # one bf16 activation b*s*h


def gpt(**kw):
    return M.Transformer(**{"hidden": H, "heads": 4, "layers": 2, "seq": S, "vocab": V, "micro_batch": B, **kw})


def pick(entries, op=None, phase=None):
    return [e for e in entries if (op is None or e.op == op) and (phase is None or e.phase == phase)]


def wire(entries, prefix=""):
    return sum(e.wire_bytes for e in entries if e.phase.startswith(prefix))


# -- sizes, bus factors, summary ------------------------------------------------------------------

def test_bus_factors_follow_nccl_tests():
    assert M.CommEntry("all_reduce", 4, 1000, 3).wire_bytes == 3 * 1000 * 2 * 3 / 4
    assert M.CommEntry("all_gather", 4, 1000, 1).wire_bytes == 750
    assert M.CommEntry("reduce_scatter", 8, 800, 1).wire_bytes == 700
    assert M.CommEntry("all_to_all", 2, 100, 1).wire_bytes == 50
    assert M.CommEntry("send", 2, 100, 2).wire_bytes == 200
    assert M.CommEntry("recv", 2, 100, 2).wire_bytes == 0
    assert M.CommEntry("all_reduce", 1, 100, 1).wire_bytes == 0
    e = M.CommEntry("all_reduce", 2, 10, 3, "tp.fwd")
    assert (e.bytes_per_rank, e.via) == (30, "all_reduce")
    with pytest.raises(ValueError, match="gossip"):
        M.CommEntry("gossip", 2, 1, 1)
    with pytest.raises(ValueError, match="calls"):
        M.CommEntry("send", 2, 1, -1)


def test_summary_totals_and_size_buckets():
    es = [M.CommEntry("all_reduce", 2, (64 << 10) - 1, 2, "a"), M.CommEntry("all_reduce", 2, 64 << 10, 1, "b"),
          M.CommEntry("send", 2, 1 << 20, 1, "a"), M.CommEntry("all_gather", 4, 16 << 20, 3, "c")]
    s = M.summary(es)
    assert s.total.calls == 7
    assert s.total.bytes == 2 * ((64 << 10) - 1) + (64 << 10) + (1 << 20) + 3 * (16 << 20)
    assert list(s.by_size) == ["<64KiB", "64KiB-1MiB", "1-16MiB", ">=16MiB"]
    assert [t.calls for t in s.by_size.values()] == [2, 1, 1, 3]
    assert s.by_op["all_reduce"].calls == 3 and s.by_phase["a"].bytes == 2 * ((64 << 10) - 1) + (1 << 20)
    assert s.by_size[">=16MiB"].wire_bytes == 3 * (16 << 20) * 3 / 4
    text = M.table(es)
    assert "all_gather" in text and ">=16MiB 3 calls 48 MiB" in text
    assert M.merge(es + es[:1])[0].calls == 4


# -- transformer: hand computations -----------------------------------------------------------------

LAYER = 12 * H * H + 13 * H                          # 49984
EMB = V * H + S * H                                  # word + learned positions
TOTAL = 2 * LAYER + EMB + 2 * H                      # + final layer norm; head tied


def test_parameter_count():
    assert gpt().params == TOTAL == 109312
    assert gpt(tied_embeddings=False).params == TOTAL + V * H


def test_tensor_parallel_megatron_counts():
    es = M.comm_per_iteration(gpt(), M.Parallel(tp=2), 2)
    # forward: 2 per layer + the vocab-parallel embedding; backward: 2 per layer + the head's input
    assert [(e.op, e.group_size, e.message_bytes, e.calls) for e in pick(es, phase="tp.fwd")] == \
        [("all_reduce", 2, ACT, 5)]
    assert [(e.message_bytes, e.calls) for e in pick(es, phase="tp.bwd")] == [(ACT, 5)]
    assert [(e.message_bytes, e.calls) for e in pick(es, phase="tp.loss")] == [(B * S * 4, 3)]
    rec = M.comm_per_iteration(gpt(), M.Parallel(tp=2, recompute=True, micro_batches=3), 2)
    assert pick(rec, phase="tp.fwd")[0].calls == 3 * (2 * 2 * 2 + 1)
    assert pick(rec, phase="tp.bwd")[0].calls == 3 * 5


def test_data_parallel_all_reduce_and_buckets():
    es = M.comm_per_iteration(gpt(), M.Parallel(dp=4), 2)
    assert [(e.op, e.group_size, e.message_bytes, e.calls) for e in es] == [("all_reduce", 4, TOTAL * 2, 1)]
    assert es[0].wire_bytes == TOTAL * 2 * 2 * 3 / 4
    es = M.comm_per_iteration(gpt(), M.Parallel(dp=4, bucket_bytes=100_000), 2, grad_bytes=4)
    assert [(e.message_bytes, e.calls) for e in es] == [(100_000, 4), (TOTAL * 4 - 400_000, 1)]
    # tensor-parallel shards: qkv/fc1 columns and proj/fc2 rows split, row biases and norms replicated
    layer_tp2 = (3 * H // 2) * H + 3 * H // 2 + (H // 2) * H + H + 2 * (2 * H) * H + 2 * H + H + 4 * H
    emb_tp2 = V // 2 * H + S * H
    es = M.comm_per_iteration(gpt(), M.Parallel(dp=2, tp=2), 2)
    assert pick(es, phase="dp.grad")[0].message_bytes == (2 * layer_tp2 + emb_tp2 + 2 * H) * 2


def test_zero_stages():
    dp = M.comm_per_iteration(gpt(), M.Parallel(dp=4), 2)
    z1 = M.comm_per_iteration(gpt(), M.Parallel(dp=4, zero=1), 2)
    z3 = M.comm_per_iteration(gpt(), M.Parallel(dp=4, zero=3), 2)
    assert [(e.op, e.message_bytes) for e in z1] == [("reduce_scatter", TOTAL * 2), ("all_gather", TOTAL * 2)]
    assert wire(z1) == pytest.approx(wire(dp))
    assert wire(z3) == pytest.approx(1.5 * wire(dp))                      # the ZeRO paper's 3 psi vs 2 psi
    units = sorted([LAYER, LAYER, EMB, 2 * H], reverse=True)              # FSDP units: layers, embeddings, norm
    for phase in ("dp.param.fwd", "dp.param.bwd"):
        got = [(e.message_bytes, e.calls) for e in pick(z3, phase=phase)]
        assert got == [(LAYER * 2, 2), (EMB * 2, 1), (2 * H * 2, 1)], phase
    assert sum(e.calls for e in pick(z3, "reduce_scatter")) == len(units)
    z2 = M.comm_per_iteration(gpt(), M.Parallel(dp=4, zero=2, micro_batches=3), 2)
    assert [(e.op, e.calls) for e in z2] == [("reduce_scatter", 3), ("all_gather", 1)]
    z3m = M.comm_per_iteration(gpt(), M.Parallel(dp=4, zero=3, micro_batches=3), 2)
    assert wire(z3m) == pytest.approx(3 * wire(z3))


def test_sequence_parallel_moves_the_same_bytes_as_tensor_parallel():
    for kw in (dict(tp=4), dict(tp=4, pp=2, micro_batches=4), dict(tp=2, recompute=True)):
        tp = M.comm_per_iteration(gpt(), M.Parallel(**kw), 2, rank=0)
        sp = M.comm_per_iteration(gpt(), M.Parallel(sp=True, **kw), 2, rank=0)
        assert wire(sp, "tp.") == pytest.approx(wire(tp, "tp."))
        logical = [sum(e.bytes_per_rank for e in es if e.phase in ("tp.fwd", "tp.bwd")) for es in (sp, tp)]
        assert logical[0] == 2 * logical[1]                        # AG + RS, each the full buffer
        assert {e.op for e in pick(sp, phase="tp.bwd")} == {"all_gather", "reduce_scatter"}
    # the pipeline carries each rank's sequence shard
    sp = M.comm_per_iteration(gpt(), M.Parallel(tp=4, pp=2, sp=True), 2)
    assert pick(sp, "send", "pp.fwd")[0].message_bytes == ACT // 4


def test_pipeline_counts_scale_with_micro_batches_and_virtual_stages():
    m = gpt(layers=8)
    def sends(par, rank=None):
        return {e.phase: e.calls for e in pick(M.comm_per_iteration(m, par, 2, rank=rank), "send")}
    assert sends(M.Parallel(pp=4, micro_batches=4)) == {"pp.fwd": 4, "pp.bwd": 4}
    p8 = M.comm_per_iteration(m, M.Parallel(pp=4, micro_batches=8), 2)
    p4 = M.comm_per_iteration(m, M.Parallel(pp=4, micro_batches=4), 2)
    assert wire(p8, "pp.") == 2 * wire(p4, "pp.") == 2 * 2 * 4 * ACT
    inter = M.Parallel(pp=4, micro_batches=8, schedule="interleaved", virtual=2)
    assert sends(inter) == {"pp.fwd": 16, "pp.bwd": 16}                    # v-fold crossings
    # stage 0 holds chunks 0 and 4 of 8: both send forward, only chunk 4 sends backward
    assert sends(inter, rank=0) == {"pp.fwd": 16, "pp.bwd": 8}
    assert sends(inter, rank=3) == {"pp.fwd": 8, "pp.bwd": 16}
    assert sends(M.Parallel(pp=4, micro_batches=4), rank=0) == {"pp.fwd": 4}
    # tied embeddings: first and last stage all-reduce the word-embedding gradient
    first = M.comm_per_iteration(m, M.Parallel(pp=2), 2, rank=0)
    assert [(e.group_size, e.message_bytes) for e in pick(first, phase="pp.embed")] == [(2, V * H * 2)]
    assert not pick(M.comm_per_iteration(m, M.Parallel(pp=4), 2, rank=1), phase="pp.embed")


def test_rank_order_and_stage_layers():
    par = M.Parallel(dp=2, tp=2, pp=3)
    assert [M.rank_stage(par, r) for r in (0, 3, 4, 7, 8, 11)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="rank 12"):
        M.rank_stage(par, 12)
    from meshcomm.model.shapes import stage_layers
    m = gpt(layers=5)
    assert [stage_layers(m, M.Parallel(pp=2), s) for s in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert stage_layers(gpt(layers=8), M.Parallel(pp=2, schedule="interleaved", virtual=2, micro_batches=2), 1) \
        == [2, 3, 6, 7]


def test_experts_all_to_all():
    m = gpt(experts=4, top_k=2)
    es = M.comm_per_iteration(m, M.Parallel(dp=4, ep=4), 2)
    rows = B * S * 2                                                   # k rows per token, balanced
    a2a = [(e.phase, e.group_size, e.message_bytes, e.calls) for e in pick(es, "all_to_all")]
    assert a2a == [("ep.fwd", 4, rows * H * 2, 4), ("ep.bwd", 4, rows * H * 2, 4)]
    assert not pick(es, phase="edp.grad")                               # dp/ep = 1 rank per expert
    cap = M.comm_per_iteration(gpt(experts=4, top_k=2, capacity_factor=1.25, moe_every=2),
                               M.Parallel(dp=8, ep=4), 2)
    assert [(e.message_bytes, e.calls) for e in pick(cap, "all_to_all")] == [(4 * 20 * H * 2, 2)] * 2
    edp = pick(cap, phase="edp.grad")[0]                               # 1 expert per rank, reduced over 2
    assert (edp.group_size, edp.message_bytes) == (2, (2 * 4 * H * H + 4 * H + H) * 2)


def test_dlrm_embedding_exchange():
    d = M.DLRM(dense=4, bottom=(8, 4), top=(8, 1), tables=(4, 8, 4), batch=8)
    mlp = (4 * 8 + 8 + 8 * 4 + 4) + (14 * 8 + 8 + 8 + 1)               # top reads 4 + 5*4/2 values
    assert d.mlp_params == mlp
    par = M.Parallel(dp=2)
    r0, r1 = (M.comm_per_iteration(d, par, 2, rank=r) for r in (0, 1))
    assert [(e.phase, e.message_bytes) for e in r0] == [("emb.fwd", 8 * 12 * 2), ("emb.bwd", 4 * 16 * 2),
                                                        ("dp.grad", mlp * 2)]
    assert r1[0].message_bytes == 8 * 4 * 2
    avg = M.comm_per_iteration(d, par, 2)
    assert avg[0].mean and avg[0].message_bytes * 2 == r0[0].message_bytes + r1[0].message_bytes
    assert M.table_groups(6, 4) == [[0, 1], [2, 3], [4], [5]]


@pytest.mark.parametrize("bad, match", [
    (lambda: M.Parallel(zero=4), "zero"),
    (lambda: M.Parallel(dp=3, ep=2), "ep=2"),
    (lambda: M.Parallel(virtual=2), "interleaved"),
    (lambda: M.Parallel(pp=4, micro_batches=6, schedule="interleaved", virtual=2), "micro_batches=6"),
    (lambda: M.Transformer(hidden=0, heads=1, layers=1, seq=1, vocab=1), "hidden"),
    (lambda: M.comm_per_iteration(gpt(), M.Parallel(dp=2, ep=2)), "experts"),
    (lambda: M.comm_per_iteration(gpt(), M.Parallel(dp=2), rank=2), "rank 2"),
    (lambda: M.comm_per_iteration(gpt(), M.Parallel(), dtype_bytes=0), "dtype_bytes"),
    (lambda: M.DLRM(dense=1, bottom=(4,), top=(1,), tables=(6,), batch=2), "multiples"),
    (lambda: M.comm_per_iteration(M.DLRM(dense=1, bottom=(4,), top=(1,), tables=(4,), batch=2),
                                  M.Parallel(tp=2)), "tp=2"),
    (lambda: M.for_example("bert"), "bert"),
    (lambda: M.for_example("pipelined_gpt", world=4, stages="1,1"), "must sum to 4"),
])
def test_bad_input_names_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_type_errors():
    with pytest.raises(TypeError, match="micro"):
        M.for_example("moe", micro=3)
    with pytest.raises(TypeError, match="Transformer or DLRM"):
        M.comm_per_iteration("gpt")


# -- the examples ------------------------------------------------------------------------------------

def _argparse_defaults(path: Path) -> dict:
    """--flag: default of every add_argument call with a literal default in an example."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            kw = {k.arg: k.value for k in node.keywords}
            if "default" in kw and isinstance(kw["default"], ast.Constant):
                out[node.args[0].value.lstrip("-").replace("-", "_")] = kw["default"].value
    return out


@pytest.mark.parametrize("name", M.EXAMPLES)
def test_example_defaults_match_the_scripts(name):
    from meshcomm.model.examples import DEFAULTS
    flags = _argparse_defaults(ROOT / "examples" / f"{name}.py")
    mine = {k: v for k, v in DEFAULTS[name].items() if k != "world"}
    assert {k: flags[k] for k in mine} == mine


def test_pipelined_gpt_example():
    ranks = M.for_example("pipelined_gpt", world=4)                    # stages 1,2,1; layers 2,2,2
    a = 2 * 16 * 32 * 4
    got = {r: sorted((e.phase, e.op, e.calls) for e in es) for r, es in ranks.items()}
    assert got[0] == [("pp.bwd", "recv", 4), ("pp.fwd", "send", 4)]
    assert got[1] == got[2] == sorted([("tp.fwd", "all_reduce", 4 * 3), ("tp.bwd", "all_reduce", 4 * 4),
                                       ("pp.fwd", "send", 4), ("pp.fwd", "recv", 4),
                                       ("pp.bwd", "send", 4), ("pp.bwd", "recv", 4)])
    assert got[3] == [("pp.bwd", "send", 4), ("pp.fwd", "recv", 4)]
    assert {e.message_bytes for es in ranks.values() for e in es} == {a}
    assert {e.via for es in ranks.values() for e in es} == {"reshard"}
    # 8 ranks: stages 2,4,2; the last stage's last block all-reduces too
    last = {e.phase: e.calls for e in M.for_example("pipelined_gpt", world=8, micro=2)[7] if e.op == "all_reduce"}
    assert last == {"tp.fwd": 2 * 4, "tp.bwd": 2 * 4}
    assert M.for_example("pipelined_gpt") == {0: []}


def test_dlrm_and_moe_examples():
    dl = M.for_example("dlrm", world=4)                                # widths per rank 24, 32, 16, 8
    assert [dl[r][0].message_bytes for r in range(4)] == [32 * w * 4 for w in (24, 32, 16, 8)]
    assert {dl[r][1].message_bytes for r in range(4)} == {8 * 80 * 4}
    f = 1 + 80 // 8
    mlp = (8 * 32 + 32 + 32 * 8 + 8) + ((8 + f * (f - 1) // 2) * 32 + 32 + 32 + 1)
    assert dl[0][2].message_bytes == (mlp + 1) * 4 and dl[0][2].op == "all_reduce"
    assert [e.phase for e in M.for_example("dlrm")[0]] == ["emb.fwd", "emb.bwd"]   # one rank: no all-reduce
    moe = M.for_example("moe", world=4)[1]
    rows = 4 * 8 * 2
    assert [(e.phase, e.message_bytes, e.mean) for e in moe] == [
        ("ep.counts", 32, False), ("ep.fwd", rows * 32 * 4, False), ("ep.ids", rows * 8, False),
        ("ep.fwd", rows * 32 * 4, True), ("ep.bwd", rows * 32 * 4, False), ("ep.bwd", rows * 32 * 4, True),
        ("dp.grad", (4 * 32 + 4 * 32 * 32 + 32 * 8 + 1) * 4, False)]
    assert M.for_example("moe") == {0: []}


def test_fsdp_example():
    from meshcomm.model.examples import fsdp_codecs
    assert fsdp_codecs("zfp(rate=8),bf16") == ["zfp(rate=8)", "bf16"]
    assert fsdp_codecs("none") == fsdp_codecs("") == [] and fsdp_codecs("None, fp16") == ["fp16"]
    d = 128
    root = 256 * d + 64 * d + 2 * d                                     # tok, pos, final layer norm
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    ranks = M.for_example("fsdp", world=4)                              # 4 layers, zfp(rate=16): 2 runs
    assert set(ranks) == {0, 1, 2, 3} and all(es == ranks[0] for es in ranks.values())
    got = sorted((e.phase, e.op, e.message_bytes, e.calls) for e in ranks[0])
    assert got == sorted([("fsdp.gather", "all_gather", root * 4, 2), ("fsdp.gather", "all_gather", block * 4, 16),
                          ("fsdp.grad", "reduce_scatter", root * 4, 2), ("fsdp.grad", "reduce_scatter", block * 4, 8),
                          ("dp.loss", "all_reduce", 8, 2)])
    # 3 ranks: every dim 0 of 128 rows padded to 129 (FSDP shards ceil(rows/3) rows per rank)
    three = [e for e in M.for_example("fsdp", world=3, compression="none", layers=1)[2] if e.op == "all_gather"]
    assert [(e.message_bytes, e.calls) for e in three] == [(3 * (86 * d + 22 * d + 2 * 43) * 4, 1),
                                                           (3 * (4 * 43 + 128 * d + 128 + 43 * d + 43
                                                                 + 171 * d + 171 + 43 * 4 * d + 43) * 4, 2)]
    runs = {c: M.for_example("fsdp", world=2, compression=c)[0][-1].calls for c in ("none", "bf16", "zfp(rate=8),bf16")}
    assert runs == {"none": 1, "bf16": 2, "zfp(rate=8),bf16": 3}
    assert M.for_example("fsdp") == {0: []}
