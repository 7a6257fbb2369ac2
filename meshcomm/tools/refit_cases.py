"""Whole-model refit cases (trainer layout -> generator layout) for `meshcomm bench refit`.

The models are the package data meshcomm/data/refit_models.json (published configs of
DeepSeek-V3 and Qwen3-235B-A22B with the tensor shapes they imply, bf16). `refit_case`
turns one model and one parallel setup into plan_many's dicts {name: shape}, {name: Layout}.

Tensors: every layer's attention, dense MLP or MoE tensors and the embedding, final norm and
LM head; routed experts either as separate tensors (``experts.E.gate_proj`` ...) or stacked
per layer (``experts.gate_proj`` of shape [experts, ...]).

Sharding (the usual Megatron/vLLM rules): column-parallel projections (q/k/v, q_b, kv_b,
gate, up) split dim 0 over tp, row-parallel ones (o, down) dim 1, embedding and LM head the
vocabulary (dim 0); q_a/kv_a projections, norms and the router are replicated. The trainer
puts layer l on pipeline stage l * pp // layers (embedding on the first, norm and head on
the last); a stage's tensors are replicated over its ep ranks, and routed expert e lives on
ep rank e * ep // experts of its stage (tensor-parallel inside the expert over the trainer's
tp, if any). The generator (dp x tp, devices dp-major) splits experts over its tp ranks
(expert parallel inside each replica) and replicates everything over dp.

Setups: ``pp16-ep16 -> dp8-tp32`` (256 + 256 GPUs) and ``tp4-pp8-ep16 -> tp8-dp16`` (512 +
128 GPUs); colocated (the generator on the trainer's first GPUs) or disjoint (the generator
on the next GPUs).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import operator
from importlib import resources

import numpy as np

from meshcomm.layout import Layout
from meshcomm.mesh import Mesh

__all__ = ["load_models", "model_tensors", "Setup", "SETUPS", "refit_case", "RefitCase"]

COL = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def load_models() -> dict:
    text = resources.files("meshcomm").joinpath("data/refit_models.json").read_text()
    return json.loads(text)


def _dim(expr: str, cfg: dict) -> int:
    """A size written as arithmetic of config fields ("num_attention_heads*v_head_dim")."""
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.Name):
            return int(cfg[n.id])
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        raise ValueError(f"unsupported size expression {expr!r}")
    return ev(ast.parse(expr, mode="eval"))


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    layer: int          # -1: embedding (first stage); 1 << 30: final norm, LM head (last stage)
    role: str           # "col" | "row" | "rep" | "vocab"
    expert: int = -1    # routed expert index, or -1
    stacked: bool = False


def model_tensors(model: str, experts: str = "stacked", layers: int | None = None) -> list[Tensor]:
    """Every tensor of `model` in layer order; `experts`: "separate" or "stacked"; `layers`:
    only the first that many layers (a quick look)."""
    if experts not in ("separate", "stacked"):
        raise ValueError(f"experts must be 'separate' or 'stacked', got {experts!r}")
    cfg = load_models()[model]
    shp = lambda dims: tuple(_dim(d, cfg) for d in dims)            # noqa: E731
    groups = cfg["per_layer_tensors"]
    n_exp = int(cfg.get("n_routed_experts", cfg.get("num_experts")))
    dense_k = int(cfg.get("first_k_dense_replace", 0))
    out = [Tensor("model.embed_tokens", shp(cfg["other_tensors"]["embed_tokens"]), -1, "vocab")]
    n_layers = int(cfg["num_hidden_layers"]) if layers is None else min(layers, int(cfg["num_hidden_layers"]))
    for layer in range(n_layers):
        pre = f"model.layers.{layer}"
        for name, dims in groups["attention"].items():
            role = "col" if name in COL else "row" if name in ROW else "rep"
            out.append(Tensor(f"{pre}.self_attn.{name}", shp(dims), layer, role))
        if layer < dense_k:
            for name, dims in next(v for k, v in groups.items() if k.startswith("dense")).items():
                out.append(Tensor(f"{pre}.mlp.{name}", shp(dims), layer, "col" if name in COL else "row"))
            continue
        moe = next(v for k, v in groups.items() if k.startswith("moe"))
        for key, dims in moe.items():
            names = key.split(" ")[0]
            base, _, projs = names.rpartition(".")
            projs = projs.split("/")
            for proj in projs:
                role = "col" if proj in COL else "row" if proj in ROW else "rep"
                if base == "experts.E":
                    if experts == "stacked":
                        out.append(Tensor(f"{pre}.mlp.experts.{proj}", (n_exp,) + shp(dims), layer, role,
                                          stacked=True))
                    else:
                        out += [Tensor(f"{pre}.mlp.experts.{e}.{proj}", shp(dims), layer, role, e)
                                for e in range(n_exp)]
                else:
                    full = f"{pre}.mlp.{base}.{proj}" if base else f"{pre}.mlp.{proj}"
                    out.append(Tensor(full, shp(dims), layer, role))
    for name in ("norm", "lm_head"):
        dims = cfg["other_tensors"][name]
        out.append(Tensor(f"model.{name}" if name == "norm" else name, shp(dims), 1 << 30,
                          "rep" if name == "norm" else "vocab"))
    return out


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    pp: int
    ep: int
    tp: int             # trainer
    gen_dp: int
    gen_tp: int

    @property
    def trainer_size(self) -> int:
        return self.pp * self.ep * self.tp

    @property
    def generator_size(self) -> int:
        return self.gen_dp * self.gen_tp


SETUPS = {
    "pp16-ep16->dp8-tp32": Setup("pp16-ep16->dp8-tp32", pp=16, ep=16, tp=1, gen_dp=8, gen_tp=32),
    "tp4-pp8-ep16->tp8-dp16": Setup("tp4-pp8-ep16->tp8-dp16", pp=8, ep=16, tp=4, gen_dp=16, gen_tp=8),
}


@dataclasses.dataclass(frozen=True)
class RefitCase:
    name: str
    shapes: dict
    src: dict
    dst: dict
    dtype: str
    devices: int        # GPUs in all
    tensors: int

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes.values()) * 2


def _spec(role: str, tp_axis: str | None, ndim: int, stacked: bool = False):
    lead = (None,) if stacked else ()
    if tp_axis is None or role == "rep":
        return lead
    if role in ("col", "vocab"):
        return lead + (tp_axis,)
    return lead + (None, tp_axis) if ndim >= 2 else lead


def refit_case(model: str, setup: str, experts: str = "stacked", colocated: bool = False,
               layers: int | None = None) -> RefitCase:
    """plan_many's arguments for refitting `model` from the trainer to the generator of `setup`
    (`layers`: only the first that many, spread over all the pipeline stages)."""
    s = SETUPS[setup]
    tensors = model_tensors(model, experts, layers)
    used = n_layers_all(model) if layers is None else min(layers, n_layers_all(model))
    tdev = np.arange(s.trainer_size).reshape(s.pp, s.ep, s.tp)
    gbase = 0 if colocated else s.trainer_size
    gdev = gbase + np.arange(s.generator_size).reshape(s.gen_dp, s.gen_tp)
    gmesh = Mesh(gdev, ("dp", "tp"))
    n_exp = max([t.shape[0] for t in tensors if t.stacked] + [t.expert + 1 for t in tensors])
    stage_mesh, expert_mesh, gen_expert = {}, {}, {}
    t_tp = "tp" if s.tp > 1 else None

    def stage_of(layer: int) -> int:
        return 0 if layer < 0 else s.pp - 1 if layer >= used else layer * s.pp // used

    def smesh(st: int) -> Mesh:
        if st not in stage_mesh:
            stage_mesh[st] = Mesh(tdev[st], ("ep", "tp")) if s.tp > 1 else Mesh(tdev[st, :, 0], ("ep",))
        return stage_mesh[st]

    shapes, src, dst = {}, {}, {}
    cache: dict = {}

    def layout(mesh, spec):
        key = (mesh, spec)
        if key not in cache:
            cache[key] = Layout(mesh, spec)
        return cache[key]
    for t in tensors:
        st = stage_of(t.layer)
        shapes[t.name] = t.shape
        if t.stacked:
            src[t.name] = layout(smesh(st), ("ep",) + _spec(t.role, t_tp, 2))
            dst[t.name] = layout(gmesh, ("tp",))
        elif t.expert >= 0:
            er = t.expert * s.ep // n_exp
            if (st, er) not in expert_mesh:
                expert_mesh[(st, er)] = Mesh(tdev[st, er], ("tp",))
            src[t.name] = layout(expert_mesh[(st, er)], _spec(t.role, t_tp, 2))
            gr = t.expert * s.gen_tp // n_exp
            if gr not in gen_expert:
                gen_expert[gr] = Mesh(gdev[:, gr], ("dp",))
            dst[t.name] = layout(gen_expert[gr], ())
        else:
            src[t.name] = layout(smesh(st), _spec(t.role, t_tp, len(t.shape)))
            dst[t.name] = layout(gmesh, _spec(t.role, "tp", len(t.shape)))
    where = "colocated" if colocated else "disjoint"
    devices = max(s.trainer_size, gbase + s.generator_size)
    part = "" if used == n_layers_all(model) else f" (first {used} layers)"
    return RefitCase(f"{model} {setup} {experts} {where}{part}", shapes, src, dst, "bfloat16", devices,
                     len(shapes))


def n_layers_all(model: str) -> int:
    return int(load_models()[model]["num_hidden_layers"])
