"""FSDP2 training of a small GPT through meshcomm's all-gather and reduce-scatter, with and without compression.

    mpiexec -n 4 python examples/fsdp.py --check                       # uncompressed and zfp(rate=16)
    mpiexec -n 4 python examples/fsdp.py --compression zfp(rate=8),bf16 --steps 30 --emulate-gbps 0.05

A character-level GPT (token and position embeddings, pre-norm blocks of causal attention
and an MLP, tied output head) learns the repository's own README. Every block and the
root are `fully_shard`ed (torch FSDP2), and `meshcomm.adapters.torch_training.use_meshcomm`
routes every FSDP all-gather (parameters) and reduce-scatter (gradients) through
`mc.all_gather` / `mc.reduce_scatter` with `compression=`. The same model, data and
initial weights train once per codec (`none` first); each run prints the loss per step, the
step time and the bytes rank 0 put on the wire per step (compressed runs: what the
compressed executor sent; uncompressed: (k-1) copies of its shard per all-gather, (k-1)/k of
the gradients per reduce-scatter). `--emulate-gbps G` paces every process's sends at G Gb/s
(MESHCOMM_EMULATE_GBPS, an emulation of a slow network, where compression pays).

`--check`: rank 0 also trains the same model without FSDP on the global batch in one
process; the uncompressed run must match it within --tol (exit 1 otherwise), and for every
codec the example reports how far its loss curve is from the uncompressed one (largest
absolute and relative difference per step). Without a launcher the model trains in one
process (nothing travels, so compression changes nothing there).
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import base_parser, launched_size

import meshcomm as mc

ROOT = Path(__file__).resolve().parent.parent


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for name, w in self.named_parameters():      # GPT-2's initialisation
            if w.dim() == 2:
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight"))
                                else 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(w)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln(x) @ self.tok.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def corpus() -> torch.Tensor:
    """The README's bytes (a real text, 256 symbols), as a token stream."""
    return torch.tensor(list((ROOT / "README.md").read_bytes()), dtype=torch.long)


def batches(a, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step (the same on every process): world * batch sequences."""
    text = corpus()
    g = torch.Generator().manual_seed(a.seed + 1)
    out = []
    for _ in range(a.steps):
        starts = torch.randint(0, len(text) - a.seq - 1, (world * a.batch,), generator=g)
        seqs = torch.stack([text[s:s + a.seq + 1] for s in starts.tolist()])
        out.append((seqs[:, :-1], seqs[:, 1:]))
    return out


def train(model, data, steps, lr, wire=None):
    """(losses, step seconds, bytes sent per step): mean loss over the batch; `wire()` is a
    running count of bytes this process sent."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, times, sent = [], [], []
    for x, y in data[:steps]:
        t0 = time.perf_counter()
        before = wire() if wire else 0
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        sent.append((wire() if wire else 0) - before)
        losses.append(float(loss.detach()))
    return losses, times, sent


class _Counted:
    """An FSDP comm that counts what this process sends before passing the call on: (k-1)
    copies of its shard per all-gather (chain or root-to-all alike), (k-1)/k of the
    gradients per reduce-scatter."""

    def __init__(self, comm, k: int, gather: bool):
        self.comm, self.k, self.gather = comm, k, gather

    def allocate(self, *args, **kw):
        return self.comm.allocate(*args, **kw)

    def __call__(self, output_tensor, input_tensor, *args, **kw):
        n = input_tensor.numel() * input_tensor.element_size()
        LOGICAL[0] += (self.k - 1) * n if self.gather else (self.k - 1) * n // self.k
        return self.comm(output_tensor, input_tensor, *args, **kw)


LOGICAL = [0]


def run_fsdp(a, init_state, data, rank, world, codec):
    """Train the sharded model with meshcomm's collectives under `codec`."""
    from meshcomm.backends.compressed import stats
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from meshcomm.adapters.torch_training import use_meshcomm
    model = _model(a, init_state)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    comms = use_meshcomm(model, backend=a.backend_collectives, compression=codec)
    ag = type("CountedAllGather", (_Counted, AllGather), {})
    rs = type("CountedReduceScatter", (_Counted, ReduceScatter), {})
    for m in comms.modules:
        pg = m._get_fsdp_state()._fsdp_param_groups[0]
        m.set_custom_all_gather(ag(pg._all_gather_comm, world, True))
        m.set_custom_reduce_scatter(rs(pg._reduce_scatter_comm, world, False))
    local = [(x[rank * a.batch:(rank + 1) * a.batch], y[rank * a.batch:(rank + 1) * a.batch]) for x, y in data]
    wire = (lambda: LOGICAL[0]) if codec is None else (lambda: stats["sent_bytes"])
    # the mean of the local means is the global mean (equal local batches): FSDP averages gradients
    return train(model, local, a.steps, a.lr, wire)


def main():
    p = base_parser(__doc__)
    p.set_defaults(steps=20, tol=2e-4)
    p.add_argument("--compression", default="zfp(rate=16)",
                   help="codecs to train with besides none, comma-separated (e.g. zfp(rate=8),bf16)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per process per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emulate-gbps", type=float, default=None,
                   help="pace every process's sends at this many Gb/s (MESHCOMM_EMULATE_GBPS)")
    p.add_argument("--collective-backend", dest="backend_collectives", default="mpi",
                   help="meshcomm backend of the collectives (mpi, torch, mixed)")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    codecs = [None] + [c for c in _split(a.compression) if c.lower() != "none"]
    init_state = copy.deepcopy(GPT(256, a.d, a.layers, a.heads, a.seq).state_dict())
    world = launched_size()
    if world == 1:
        losses, times, _ = train(_model(a, init_state), batches(a, 1), a.steps, a.lr)
        for i, loss in enumerate(losses):
            print(f"step {i} loss {loss:.5f}")
        print(f"[fsdp] one process: {np.median(times) * 1e3:.1f} ms/step (no launcher: nothing travels, "
              "compression changes nothing)")
        return 0
    ctx = mc.init(backend="mixed")       # meshcomm sets up torch.distributed (gloo) for FSDP
    rank = ctx.rank
    data = batches(a, world)
    if a.emulate_gbps:
        os.environ["MESHCOMM_EMULATE_GBPS"] = str(a.emulate_gbps)
    runs = {}
    mesh = mc.Mesh(list(range(world)), ("dp",))
    for codec in codecs:
        losses, times, sent = run_fsdp(a, init_state, data, rank, world, codec)
        losses = list(mc.all_reduce(np.array(losses), mesh, "dp", op="avg"))     # the global batch's mean
        runs[str(codec)] = losses, times, sent
        if rank == 0:
            for i, loss in enumerate(losses):
                print(f"[{codec}] step {i} loss {loss:.5f} {times[i] * 1e3:.0f} ms {sent[i] / 2**20:.2f} MiB sent")
            print(f"[fsdp {codec}] {world} processes: {np.median(times[1:] or times) * 1e3:.1f} ms/step, "
                  f"{np.median(sent) / 2**20:.2f} MiB sent per step by rank 0", flush=True)
    os.environ.pop("MESHCOMM_EMULATE_GBPS", None)
    ok = True
    if rank == 0:
        base = np.array(runs["None"][0])
        for name, (losses, _, _) in runs.items():
            if name == "None":
                continue
            d = np.abs(np.array(losses) - base)
            print(f"[fsdp {name}] loss curve vs uncompressed: max |diff| {d.max():.3g}, "
                  f"max relative {np.max(d / np.abs(base)):.3g}, final {losses[-1]:.4f} vs {base[-1]:.4f}")
        if a.check:
            ref, _, _ = train(_model(a, init_state), data, a.steps, a.lr)
            diff = float(np.max(np.abs(np.array(ref) - base)))
            ok = diff <= a.tol
            print(f"[fsdp] check: uncompressed FSDP vs one process, largest loss difference {diff:.3g} "
                  f"(tolerance {a.tol:g}) {'OK' if ok else 'FAILED'}", flush=True)
    mc.finalize()
    return 0 if ok else 1


def _model(a, init_state):
    m = GPT(256, a.d, a.layers, a.heads, a.seq)
    m.load_state_dict(init_state)
    return m


def _split(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [s for s in out + [cur.strip()] if s]


if __name__ == "__main__":
    sys.exit(main())
