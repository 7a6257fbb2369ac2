"""FSDP2 training of a small GPT through meshcomm's all-gather and reduce-scatter, with and without compression.

    mpiexec -n 4 python examples/fsdp.py --check                       # uncompressed and zfp(rate=16)
    mpiexec -n 4 python examples/fsdp.py --compression 'zfp(rate=8),bf16' --steps 30 --emulate-gbps 0.05
    mpiexec -n 4 python examples/fsdp.py --log logs/fsdp                # then: meshcomm log compare logs/fsdp --example fsdp

A character-level GPT (token and position embeddings, pre-norm blocks of causal attention
and an MLP, tied output head) learns the repository's own README. Every block and the
root are `fully_shard`ed (torch FSDP2), and `meshcomm.adapters.torch_training.use_meshcomm`
routes every FSDP all-gather (parameters) and reduce-scatter (gradients) through
`mc.all_gather` / `mc.reduce_scatter` on meshcomm's --backend (mpi by default; meshcomm.init
runs "mixed" for mpi and mixed, which also sets up the torch.distributed (gloo) FSDP needs,
and "torch" for torch) with `compression=`. The same model, data and initial weights train
once uncompressed, then once per codec; each run prints the loss per step, the step time
and the bytes rank 0 put on the wire per step (compressed runs: what the compressed executor
sent; uncompressed: (k-1) copies of its shard per all-gather, (k-1)/k of the gradients per
reduce-scatter). `--emulate-gbps G` paces every process's sends at G Gb/s
(MESHCOMM_EMULATE_GBPS, an emulation of a slow network, where compression pays).

`--check`: every rank also trains the same model without FSDP on the global batch in one
process; the uncompressed run's losses and its last step's gradients (each rank's shard)
must match it within --tol (exit 1 otherwise). Compressed runs are lossy: for each the
example prints how far its losses and gradients are from the one-process run, and its loss
curve from the uncompressed one, held to no tolerance. `--log DIR` logs every meshcomm call
(tags fsdp.gather, fsdp.grad, dp.loss) and compares them at the end with
meshcomm.model.for_example("fsdp"). Without a launcher the model trains in one process
(nothing travels, so compression changes nothing there).
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

from _common import base_parser, finish_check, finish_log, max_over, maxdiff, positive, setup

import meshcomm as mc
from meshcomm.model.examples import fsdp_codecs

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


def train(model, data, steps, lr, wire=None, mean=None):
    """(losses, step seconds, bytes sent per step): mean loss over the batch (`mean(loss)`:
    over the ranks' batches); `wire()` is a running count of bytes this process sent. The
    last step's gradients stay on the parameters."""
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
        losses.append(mean(loss) if mean else float(loss.detach()))
    return losses, times, sent


class _Counted:
    """An FSDP comm that counts what this process sends before passing the call on, tagged
    for meshcomm.log (fsdp.gather, fsdp.grad): (k-1) copies of its shard per all-gather
    (chain or root-to-all alike), (k-1)/k of the gradients per reduce-scatter."""

    def __init__(self, comm, k: int, gather: bool):
        self.comm, self.k, self.gather = comm, k, gather

    def allocate(self, *args, **kw):
        return self.comm.allocate(*args, **kw)

    def __call__(self, output_tensor, input_tensor, *args, **kw):
        n = input_tensor.numel() * input_tensor.element_size()
        LOGICAL[0] += (self.k - 1) * n if self.gather else (self.k - 1) * n // self.k
        with mc.log.tag("fsdp.gather" if self.gather else "fsdp.grad"):
            return self.comm(output_tensor, input_tensor, *args, **kw)


LOGICAL = [0]


def run_fsdp(a, init_state, data, rank, world, codec, mean):
    """Train the sharded model with meshcomm's collectives under `codec`: (model, train's result)."""
    from meshcomm.backends.compressed import stats
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from meshcomm.adapters.torch_training import use_meshcomm
    model = _model(a, init_state)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    comms = use_meshcomm(model, backend=a.backend, compression=codec)
    ag = type("CountedAllGather", (_Counted, AllGather), {})
    rs = type("CountedReduceScatter", (_Counted, ReduceScatter), {})
    for m in comms.modules:
        pg = m._get_fsdp_state()._fsdp_param_groups[0]
        m.set_custom_all_gather(ag(pg._all_gather_comm, world, True))
        m.set_custom_reduce_scatter(rs(pg._reduce_scatter_comm, world, False))
    local = [(x[rank * a.batch:(rank + 1) * a.batch], y[rank * a.batch:(rank + 1) * a.batch]) for x, y in data]
    wire = (lambda: LOGICAL[0]) if codec is None else (lambda: stats["sent_bytes"])
    # the mean of the local means is the global mean (equal local batches): FSDP averages gradients
    return model, train(model, local, a.steps, a.lr, wire, mean)


def main():
    p = base_parser(__doc__, backend_help="meshcomm backend of FSDP's all-gathers and reduce-scatters: mpi | torch "
                    "| mixed (default mpi)")
    p.set_defaults(steps=20, backend="mpi")
    p.add_argument("--compression", default="zfp(rate=16)",
                   help="codecs to train with besides the uncompressed run, comma-separated, quoted in a "
                        "shell (e.g. 'zfp(rate=8),bf16'); none: only the uncompressed run")
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--d", type=positive, default=128)
    p.add_argument("--heads", type=positive, default=4)
    p.add_argument("--seq", type=positive, default=64)
    p.add_argument("--batch", type=positive, default=4, help="sequences per process per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--emulate-gbps", type=float, default=None,
                   help="pace every process's sends at this many Gb/s (MESHCOMM_EMULATE_GBPS)")
    a = p.parse_args()
    codecs = fsdp_codecs(a.compression)
    try:
        for c in codecs:
            mc.compression.coerce(c)
    except ValueError as e:
        p.error(str(e))
    rank, world, _ = setup("torch" if a.backend == "torch" else "mixed", a.log)
    torch.manual_seed(a.seed)
    init_state = copy.deepcopy(GPT(256, a.d, a.layers, a.heads, a.seq).state_dict())
    data = batches(a, world)
    mesh = mc.Mesh(list(range(world)), ("dp",))
    runs = {}                                       # name -> (model, losses)
    if world == 1:
        model = _model(a, init_state)
        losses, times, _ = train(model, data, a.steps, a.lr)
        runs["uncompressed"] = model, losses
        for i, loss in enumerate(losses):
            print(f"step {i} loss {loss:.5f}")
        print(f"[fsdp] one process: {np.median(times) * 1e3:.1f} ms/step (no launcher: nothing travels, "
              "compression changes nothing)")
    else:
        def mean(loss):                             # the global batch's mean loss
            with mc.log.tag("dp.loss"):
                return float(mc.all_reduce(np.array([float(loss.detach())]), mesh, "dp", op="avg")[0])
        if a.emulate_gbps:
            os.environ["MESHCOMM_EMULATE_GBPS"] = str(a.emulate_gbps)
        for codec in [None] + codecs:
            name = "uncompressed" if codec is None else codec
            model, (losses, times, sent) = run_fsdp(a, init_state, data, rank, world, codec, mean)
            runs[name] = model, losses
            if rank == 0:
                for i, loss in enumerate(losses):
                    print(f"[{name}] step {i} loss {loss:.5f} {times[i] * 1e3:.0f} ms {sent[i] / 2**20:.2f} MiB sent")
                print(f"[fsdp {name}] {world} processes: {np.median(times[1:] or times) * 1e3:.1f} ms/step, "
                      f"{np.median(sent) / 2**20:.2f} MiB sent per step by rank 0", flush=True)
        os.environ.pop("MESHCOMM_EMULATE_GBPS", None)
        if rank == 0:
            base = np.array(runs["uncompressed"][1])
            for name, (_, losses) in runs.items():
                if name == "uncompressed":
                    continue
                d = np.abs(np.array(losses) - base)
                print(f"[fsdp {name}] loss curve vs uncompressed: max |diff| {d.max():.3g}, "
                      f"max relative {np.max(d / np.abs(base)):.3g}, final {losses[-1]:.4f} vs {base[-1]:.4f}")
    log_ok = finish_log("fsdp", a, rank, world)
    try:
        if a.check:
            check(a, init_state, data, runs, mesh, rank, world, log_ok)        # exits
    finally:
        mc.finalize()           # its backend ("mixed" or "torch") is not the one others init
    return 0 if log_ok else 1


def check(a, init_state, data, runs, mesh, rank, world, log_ok):
    """--check (exits): the same model trained in one process on the global batch; the
    uncompressed run's losses and last gradients (this rank's shard) must match it within
    --tol; how far each compressed run is, is printed (held to no tolerance)."""
    ref = _model(a, init_state)
    ref_losses, _, _ = train(ref, data, a.steps, a.lr)
    want = {n: q.grad for n, q in ref.named_parameters()}
    diffs = {}
    for name, (model, losses) in runs.items():
        d = diffs[name] = {f"loss[{i}]": abs(x - y) for i, (x, y) in enumerate(zip(losses, ref_losses))}
        for n, q in model.named_parameters():
            g = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad      # FSDP: this rank's shard
            d[f"grad {n}"] = maxdiff(g, _shard(want[n], rank, world))
    for name, d in diffs.items():
        if name == "uncompressed":
            continue
        with mc.log.tag("check"):
            loss = max_over([v for k, v in d.items() if k.startswith("loss")], mesh, rank)
            grad = max_over([v for k, v in d.items() if k.startswith("grad")], mesh, rank)
        if rank == 0:
            print(f"[fsdp {name}] vs single process: largest loss difference {loss:.3g}, gradient {grad:.3g} "
                  f"(lossy codec: reported at no tolerance; --tol {a.tol:g} holds the uncompressed run)", flush=True)
    finish_check("fsdp uncompressed", diffs["uncompressed"], mesh, rank, a.tol, log_ok)


def _shard(t, rank, world):
    """Rank `rank`'s part of `t` as FSDP2 shards it: torch.chunk on dim 0, empty past the chunks."""
    parts = torch.chunk(t, world, dim=0)
    return parts[rank] if rank < len(parts) else t[:0]


def _model(a, init_state):
    m = GPT(256, a.d, a.layers, a.heads, a.seq)
    m.load_state_dict(init_state)
    return m


if __name__ == "__main__":
    sys.exit(main())
