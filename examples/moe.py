"""A transformer MoE layer with experts sharded over ranks; tokens dispatched and combined
with meshcomm.all_to_all_v (uneven counts), forward and backward.

    python examples/moe.py                      # one process, every expert local
    mpiexec -n 4 python examples/moe.py --check # 4 ranks, compare with one process

Each rank holds a slice of the batch (data parallel) and `experts // ranks` experts
(expert parallel). Per step: attention (local) -> gate picks top-k experts per token ->
all_to_all_v sends each token to the ranks of its experts -> experts run -> all_to_all_v
with the counts swapped brings results home -> weighted sum. Gradients of the replicated
weights (attention, gate) are summed over ranks with one coalesced reshard.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meshcomm as mc  # noqa: E402
from _common import (STATS, allreduce_, base_parser, positive, finish_check, finish_log, maxdiff, report,  # noqa: E402
                     setup, sync)


class AllToAll(torch.autograd.Function):
    """Differentiable all_to_all_v for this rank's rows: backward is the inverse exchange
    (the gradient rows go back with send and receive counts swapped)."""

    @staticmethod
    def forward(ctx, x, send, recv, mesh, rank):
        ctx.meta = (send, recv, mesh, rank)
        with mc.log.tag("ep.fwd"):
            return _a2a(x, send, recv, mesh, rank)

    @staticmethod
    def backward(ctx, g):
        send, recv, mesh, rank = ctx.meta
        with mc.log.tag("ep.bwd"):
            return _a2a(g.contiguous(), recv, send, mesh, rank), None, None, None, None


def _a2a(x, send, recv, mesh, rank):
    sent = sum(c for j, c in enumerate(send) if j != rank) * x[0].numel() * x.element_size() if len(x) else 0
    with STATS.timed(sent):
        return mc.all_to_all_v({rank: x}, {rank: send}, mesh, "ep", recv_counts={rank: recv})[rank]


class MoELayer(torch.nn.Module):
    """x + attn(ln1(x)), then + moe(ln2(.)). `rank`/`world` shard the experts; world=1 is the
    single-process reference (no communication)."""

    def __init__(self, d, heads, experts, d_ff, top_k, rank=0, world=1, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)           # same full weights on every rank
        rnd = lambda *s: torch.randn(*s, generator=g) / s[-2] ** 0.5  # noqa: E731
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Parameter(rnd(d, 3 * d)), torch.nn.Parameter(rnd(d, d))
        self.gate = torch.nn.Parameter(rnd(d, experts))
        w1, w2 = rnd(experts, d, d_ff), rnd(experts, d_ff, d)
        self.per_rank = experts // world
        mine = slice(rank * self.per_rank, (rank + 1) * self.per_rank)
        self.w1, self.w2 = torch.nn.Parameter(w1[mine].clone()), torch.nn.Parameter(w2[mine].clone())
        self.heads, self.top_k, self.rank, self.world = heads, top_k, rank, world
        self.mesh = mc.Mesh(list(range(world)), ("ep",))

    def replicated_params(self):
        return [p for n, p in self.named_parameters() if n not in ("w1", "w2")]

    def attention(self, x):
        b, s, d = x.shape
        q, k, v = (x @ self.qkv).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(b, s, d) @ self.proj

    def moe(self, u):
        t, d = u.shape
        probs = torch.softmax(u @ self.gate, dim=-1)
        w, e = probs.topk(self.top_k, dim=-1)                  # [t, k] weights and expert ids
        w = w / w.sum(-1, keepdim=True)
        e, w = e.reshape(-1), w.reshape(-1)
        order = torch.argsort(e, stable=True)                  # group (token, expert) pairs by expert
        tok, e_sorted = order // self.top_k, e[order]
        dest = e_sorted // self.per_rank                       # rank holding the expert
        send = torch.bincount(dest, minlength=self.world).tolist()
        rows = u[tok]
        if self.world > 1:
            # counts first (tiny), then the token rows and their expert ids with known counts
            with mc.log.tag("ep.counts"):
                recv = mc.all_to_all_v({self.rank: torch.tensor(send)[:, None]}, {self.rank: [1] * self.world},
                                       self.mesh, "ep")[self.rank].reshape(-1).tolist()
            rows = AllToAll.apply(rows, send, recv, self.mesh, self.rank)
            with mc.log.tag("ep.ids"):
                eid = _a2a(e_sorted[:, None], send, recv, self.mesh, self.rank).reshape(-1)
        else:
            eid = e_sorted
        # zeros inside the graph: with no token routed here, autograd still runs this rank's
        # backward all-to-alls, which the other ranks make (zeros_like: they waited for it)
        out = rows * 0
        for j in range(self.per_rank):                          # run the local experts
            sel = (eid - self.rank * self.per_rank) == j
            if sel.any():
                out[sel] = F.gelu(rows[sel] @ self.w1[j]) @ self.w2[j]
        if self.world > 1:
            out = AllToAll.apply(out, recv, send, self.mesh, self.rank)   # combine: counts swapped
        return torch.zeros_like(u).index_add(0, tok, out * w[order, None])

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        b, s, d = x.shape
        return x + self.moe(self.ln2(x).reshape(b * s, d)).view(b, s, d)


def main():
    p = base_parser(__doc__)
    p.add_argument("--batch", type=positive, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=positive, default=8)
    p.add_argument("--d", type=positive, default=32)
    p.add_argument("--experts-per-rank", type=positive, default=2)
    p.add_argument("--top-k", type=positive, default=2)
    a = p.parse_args()
    rank, world, dev = setup(a.backend, a.log)
    if a.batch % world:
        raise SystemExit(f"--batch {a.batch} must be divisible by the {world} ranks")
    experts = a.experts_per_rank * world
    if a.top_k > experts:
        raise SystemExit(f"--top-k {a.top_k} is more than the {experts} experts")
    cfg = dict(d=a.d, heads=4, experts=experts, d_ff=2 * a.d, top_k=a.top_k, seed=a.seed)
    model = MoELayer(**cfg, rank=rank, world=world).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(a.seed + 1)
    data = [(torch.randn(a.batch, a.seq, a.d, generator=g), torch.randn(a.batch, a.seq, a.d, generator=g))
            for _ in range(a.steps)]
    mine = slice(rank * a.batch // world, (rank + 1) * a.batch // world)
    losses, times, comm_s, comm_b = [], [], [], []
    for step, (x, y) in enumerate(data):
        STATS.reset()
        sync(dev)
        t0 = time.perf_counter()
        out = model(x[mine].to(dev))
        # each rank's share of the global mean loss; the sum over ranks is the loss
        loss = ((out - y[mine].to(dev)) ** 2).sum() / y.numel()
        opt.zero_grad()
        loss.backward()
        reps = model.replicated_params()
        total = loss.detach().reshape(1)
        with mc.log.tag("dp.grad"):
            allreduce_([q.grad for q in reps] + [total], model.mesh, rank)   # data-parallel grads
        if a.check and step == a.steps - 1:
            grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
        comm_s.append(STATS.seconds)
        comm_b.append(STATS.bytes)
        losses.append(float(total))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    report("moe", rank, a.batch, times, comm_s, comm_b)
    log_ok = finish_log("moe", a, rank, world)
    if a.check:
        ref = MoELayer(**cfg).to(dev)                          # every expert in one process
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        diffs = {}
        for step, (x, y) in enumerate(data):
            loss = ((ref(x.to(dev)) - y.to(dev)) ** 2).sum() / y.numel()
            ropt.zero_grad()
            loss.backward()
            diffs[f"loss[{step}]"] = abs(loss.item() - losses[step])
            if step == a.steps - 1:
                for n, q in ref.named_parameters():
                    want = q.grad[rank * a.experts_per_rank:(rank + 1) * a.experts_per_rank] \
                        if n in ("w1", "w2") else q.grad
                    diffs[f"grad {n}"] = maxdiff(grads[n], want)
            ropt.step()
        finish_check("moe", diffs, model.mesh, rank, a.tol, log_ok)
    sys.exit(0 if log_ok else 1)


if __name__ == "__main__":
    main()
