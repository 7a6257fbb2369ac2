"""The error figure of benchmarks/compression.py: each codec's error on random and on real model tensors, once and through an 8-way reduce-scatter.

Tensors (float32, flat as FSDP's shards are): standard normal values; the weights and the
gradients of examples/fsdp.py's GPT after 5 Adam steps on the README (gradients of 8
different batches for the reductions). Errors: max and mean of |decoded - x|, absolute and
relative to max|x| (max) or mean|x| (mean). Reduce-scatter: 8 devices in one process
(the compressed path runs the same round trips as under a launcher), one-shot and ring
(`meshcomm.backends.codec_cost.REDUCE_ALGORITHM` set around the call), against the float64
sum.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import meshcomm as mc
from meshcomm.backends import codec_cost

CODECS = ("zfp(rate=8)", "zfp(rate=16)", "zfp(tolerance=1e-3)", "bf16", "fp16")


def model_tensors(k: int = 8):
    """(flat weights, [k flat gradients]) of examples/fsdp.py's GPT after 5 Adam steps."""
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from fsdp import GPT, corpus
    torch.manual_seed(0)
    torch.set_num_threads(1)
    m = GPT(256, 128, 4, 4, 64)
    text = corpus()
    g = torch.Generator().manual_seed(1)

    def batch():
        s = torch.randint(0, len(text) - 65, (8,), generator=g).tolist()
        seqs = torch.stack([text[i:i + 65] for i in s])
        return seqs[:, :-1], seqs[:, 1:]
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(5):
        opt.zero_grad()
        m(*batch()).backward()
        opt.step()
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts]).detach().numpy().astype(np.float32)
    grads = []
    for _ in range(k):
        m.zero_grad()
        m(*batch()).backward()
        grads.append(flat(p.grad for p in m.parameters()))
    return flat(m.parameters()), grads


def stats(err: np.ndarray, x: np.ndarray) -> dict:
    a = np.abs(err)
    return {"max_abs": float(a.max()), "mean_abs": float(a.mean()),
            "max_rel": float(a.max() / np.abs(x).max()), "mean_rel": float(a.mean() / np.abs(x).mean())}


def round_trip(codec: str, x: np.ndarray) -> np.ndarray:
    c = mc.compression.coerce(codec)
    return c.decode(c.encode(x))


def reduce_scatter(codec: str, xs: list[np.ndarray], algo: str) -> np.ndarray:
    n = len(xs)
    m = mc.Mesh(list(range(n)), ("x",))
    size = xs[0].size // n * n
    codec_cost.REDUCE_ALGORITHM = algo
    try:
        out = mc.reduce_scatter({d: xs[d][:size] for d in range(n)}, m, "x", compression=codec)
    finally:
        codec_cost.REDUCE_ALGORITHM = "auto"
    return np.concatenate([out[d] for d in range(n)])


def run() -> dict:
    rng = np.random.default_rng(0)
    normal = [rng.standard_normal(1 << 18).astype(np.float32) for _ in range(8)]
    weights, grads = model_tensors()
    sets = {"normal": (normal[0], normal), "gpt weights": (weights, None), "gpt gradients": (grads[0], grads)}
    rows = []
    for name, (x, many) in sets.items():
        for codec in CODECS:
            try:
                r = {"tensor": name, "codec": codec, "n": int(x.size), "once": stats(round_trip(codec, x) - x, x)}
            except ValueError as e:                 # fp16 overflow and the like
                rows.append({"tensor": name, "codec": codec, "error": str(e)})
                continue
            if many is not None:
                exact = np.sum(np.stack([v[:v.size // 8 * 8].astype(np.float64) for v in many]), axis=0)
                for algo in ("oneshot", "ring"):
                    r[algo] = stats(reduce_scatter(codec, many, algo) - exact, exact)
            rows.append(r)
    print("# error: max |err| (relative to max|x|), mean |err| (relative to mean|x|); 8-way reduce-scatter: "
          "one-shot / ring")
    for r in rows:
        if "error" in r:
            print(f"{r['tensor']:<14s} {r['codec']:<20s} {r['error']}")
            continue
        o = r["once"]
        line = (f"{r['tensor']:<14s} {r['codec']:<20s} once max {o['max_abs']:.2e} ({o['max_rel']:.1e}) "
                f"mean {o['mean_abs']:.2e} ({o['mean_rel']:.1e})")
        if "oneshot" in r:
            line += "".join(f" | {a} max {r[a]['max_abs']:.2e} ({r[a]['max_rel']:.1e}) mean {r[a]['mean_rel']:.1e}"
                            for a in ("oneshot", "ring"))
        print(line, flush=True)
    return {"rows": rows}
