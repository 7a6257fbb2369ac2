"""`meshcomm bench refit` (meshcomm/tools/bench/refit.py): the model cases, the policies it
simulates beside meshcomm's batch plan (planners/batch_baselines.py), its table and JSON.
Quick: a few layers of each model."""
from __future__ import annotations

import json
import math

import pytest

import meshcomm as mc
from meshcomm.batch_args import batch_entries
from meshcomm.planners import batch_baselines as bb
from meshcomm.planners.batch_bound import batch_lower_bound
from meshcomm.tools.refit_cases import model_tensors, refit_case

H100 = mc.Topology.preset("dgx-h100")


def test_model_tensors_follow_the_configs():
    ds = {t.name: t for t in model_tensors("deepseek-v3", "separate")}
    assert len(ds) == 45337                         # 61 x 9 + 3 x 3 + 58 x (4 + 256 x 3) + 3
    assert len(model_tensors("deepseek-v3", "stacked")) == 967
    assert ds["model.layers.0.self_attn.q_b_proj"].shape == (128 * (128 + 64), 1536)
    assert ds["model.layers.5.mlp.experts.17.down_proj"].shape == (7168, 2048)
    assert ds["model.layers.1.mlp.down_proj"].shape == (7168, 18432)
    assert "model.layers.3.mlp.down_proj" not in ds       # layer 3 is MoE
    st = {t.name: t for t in model_tensors("deepseek-v3", "stacked")}
    assert st["model.layers.3.mlp.experts.gate_proj"].shape == (256, 2048, 7168)
    qw = model_tensors("qwen3-235b-a22b", "separate")
    assert len(qw) == 94 * (8 + 1 + 128 * 3) + 3
    total = sum(math.prod(t.shape) for t in model_tensors("deepseek-v3", "stacked"))
    assert 6.6e11 < total < 6.8e11                  # DeepSeek-V3's 671B parameters
    with pytest.raises(ValueError, match="separate"):
        model_tensors("deepseek-v3", "fused")


def test_refit_layouts():
    c = refit_case("deepseek-v3", "tp4-pp8-ep16->tp8-dp16", "separate", colocated=True, layers=4)
    assert c.devices == 512
    e = c.src["model.layers.3.mlp.experts.33.gate_proj"]
    assert e.mesh.size == 4 and e.spec == (("tp",),)               # on one ep rank, split over tp
    g = c.dst["model.layers.3.mlp.experts.33.gate_proj"]
    assert g.mesh.size == 16 and max(g.mesh.device_ids) < 128       # dp replicas of one tp rank
    o = c.dst["model.layers.0.self_attn.o_proj"]
    assert o.spec == (None, ("tp",))
    d = refit_case("deepseek-v3", "pp16-ep16->dp8-tp32", "stacked", colocated=False)
    assert d.devices == 512 and min(d.dst["lm_head"].mesh.device_ids) == 256


def test_relabel_keeps_plans_and_times():
    c = refit_case("qwen3-235b-a22b", "pp16-ep16->dp8-tp32", "separate", layers=2)
    name = "model.layers.1.mlp.experts.77.up_proj"
    src, dst = c.src[name], c.dst[name]
    s2, d2, _ = bb.relabel(src, dst, H100)
    assert max(s2.mesh.device_ids + d2.mesh.device_ids) < max(src.mesh.device_ids + dst.mesh.device_ids)
    a = mc.plan(c.shapes[name], "bfloat16", src, dst, topology=H100)
    b = mc.plan(c.shapes[name], "bfloat16", s2, d2, topology=H100)
    assert a.simulate(H100) == pytest.approx(b.simulate(H100), rel=1e-12)
    assert len(a.transfers) == len(b.transfers)


def test_sequential_policies_add_tensor_times():
    src = mc.Layout(mc.Mesh([[0, 1], [2, 3]], ("ep", "tp")), ("ep", "tp"))
    dst = mc.Layout(mc.Mesh([[8, 9], [16, 17]], ("dp", "tp")), (None, "tp"))
    one = batch_entries({"a": (64, 64)}, "float32", src, dst)
    two = batch_entries({"a": (64, 64), "b": (64, 64)}, "float32", src, dst)
    for policy in ("one_sender", "gather_broadcast", "per_tensor", "node_aware"):
        s1, _ = bb.sequential_seconds(one, H100, policy)
        s2, _ = bb.sequential_seconds(two, H100, policy)
        assert s2 == pytest.approx(2 * s1) and s1 > 0, policy
    with pytest.raises(ValueError, match="unknown policy"):
        bb.sequential_seconds(one, H100, "nonsense")
    # outside the M2N-like limits (a 3-axis mesh) node_aware falls back to one sender
    m3 = mc.Layout(mc.Mesh([[[0, 1], [2, 3]]], ("a", "b", "c")), ("b",))
    assert bb.node_aware((8, 8), 4, m3, dst, H100) is None


def test_refit_row_meshcomm_near_the_bound_and_ahead():
    from meshcomm.tools.bench.refit import format_refit_table, refit_row
    case = refit_case("deepseek-v3", "pp16-ep16->dp8-tp32", "stacked", colocated=False, layers=6)
    row = refit_row(case, H100)
    pol = row["policies"]
    lb = row["lower_bound_s"]
    assert lb == batch_lower_bound(batch_entries(case.shapes, case.dtype, case.src, case.dst), H100).seconds
    for name, v in pol.items():
        assert v["seconds"] >= lb * (1 - 1e-9), name
    assert pol["meshcomm"]["over_bound"] < 1.25
    assert row["speedup"]["one_sender"] >= 2 and row["speedup"]["per_tensor"] > 1
    assert row["speedup"]["node_aware"] > 1
    text = format_refit_table([row])
    assert "verl-like" in text and "lower bound" in text and "x bound" in text


def test_cli_refit_writes_json(tmp_path, capsys):
    from meshcomm.tools.cli import main
    out = tmp_path / "refit.json"
    rc = main(["bench", "refit", "--models", "qwen3-235b-a22b", "--setups", "tp4-pp8-ep16->tp8-dp16",
               "--experts", "stacked", "--placement", "colocated", "--layers", "2", "--quiet",
               "--policies", "meshcomm,one_sender,striped_buckets", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert set(row["policies"]) == {"meshcomm", "one_sender", "striped_buckets"}
    assert "first 2 layers" in row["case"]
    assert "meshcomm batch plan" in capsys.readouterr().out
    assert main(["bench", "refit", "--models", "nope", "--quiet"]) == 2
    assert main(["bench", "refit", "--policies", "nope", "--quiet"]) == 2
