"""A small GPT trained with pipeline parallelism over stages on different meshes, each stage
with its own tensor-parallel degree; activations and gradients cross meshes by reshard.

    mpiexec -n 4 python examples/pipelined_gpt.py --check               # stages 1,2,1 devices
    mpiexec -n 8 python examples/pipelined_gpt.py --check --schedule eager   # stages 2,4,2

Stage s runs on mesh s (devices of its own, axis "tp") with Megatron tensor parallelism:
attention heads and MLP columns split over "tp", one all-reduce after each block half
(itself a reshard: pending sum over "tp" -> replicated). The last block of a stage skips
its all-reduce: the stage output stays a pending sum, and ONE cross-mesh reshard

    Layout(mesh_s, (), partial=("tp",))  ->  Layout(mesh_{s+1}, ())

sums it and delivers it replicated to the next stage (a layout change and a mesh change in
one plan). Gradients go back replicated -> replicated. Reshards are asynchronous: a stage
sends and keeps computing.

Schedules (`--schedule`): "1f1b" (warm-up of S-s-1 forwards, then one forward one backward)
and "eager" (eager 1F1B: warm-up of 2(S-s-1) forwards, so each activation is sent one
forward earlier than it is needed and its transfer overlaps that forward; more memory).
Every process issues the cross-stage reshards in one global order derived from a timeline
of the schedule (`comm_order`), which is what keeps asynchronous reshards deadlock-free
(meshcomm runs one process's communication in call order).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meshcomm as mc  # noqa: E402
from _common import (STATS, base_parser, positive, finish_check, finish_log, maxdiff, prepare_groups,  # noqa: E402
                     report, sent_bytes, setup, sync)

# -- the model: full weights, and each tensor-parallel rank's slice of them --------------------


def full_weights(vocab, d, layers, seq, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5  # noqa: E731
    w = {"wte": torch.randn(vocab, d, generator=g) * 0.1, "wpe": torch.randn(seq, d, generator=g) * 0.1}
    for l in range(layers):
        w |= {f"l{l}_ln1": torch.ones(d), f"l{l}_qkv": rnd(d, 3 * d), f"l{l}_proj": rnd(d, d),
              f"l{l}_ln2": torch.ones(d), f"l{l}_fc1": rnd(d, 4 * d), f"l{l}_fc2": rnd(4 * d, d)}
    w |= {"lnf": torch.ones(d), "head": rnd(d, vocab)}
    return w


def tp_slice(name, t, r, tp, heads):
    """Rank r's part of a full weight: qkv/fc1 by columns (heads), proj/fc2 by rows."""
    if name.endswith("_qkv"):
        d = t.shape[0]
        return t.view(d, 3, heads, -1).chunk(tp, dim=2)[r].reshape(d, -1)
    if name.endswith("_fc1"):
        return t.chunk(tp, dim=1)[r]
    if name.endswith(("_proj", "_fc2")):
        return t.chunk(tp, dim=0)[r]
    return t                                            # replicated (embeddings, norms, head)


class TP:
    """The tensor-parallel group of a stage; all-reduce = reshard partial -> replicated."""

    def __init__(self, mesh: mc.Mesh | None, rank: int):
        self.mesh, self.rank = mesh, rank
        self.size = mesh.size if mesh is not None else 1
        self.index = mesh.device_ids.index(rank) if mesh is not None else 0

    def allreduce(self, x):
        if self.size == 1:
            return x
        part, repl = mc.Layout(self.mesh, (), partial=("tp",)), mc.Layout(self.mesh, ())
        with STATS.timed(sent_bytes(x.shape, x.dtype, part, repl, self.rank)):
            return mc.reshard({self.rank: x.contiguous()}, part, repl, shape=x.shape, dtype=x.dtype)[self.rank]


class _Copy(torch.autograd.Function):        # Megatron's f: identity, all-reduce the gradient
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        with mc.log.tag("tp.bwd"):
            return ctx.tp.allreduce(g), None


class _Reduce(torch.autograd.Function):      # Megatron's g: all-reduce, identity gradient
    @staticmethod
    def forward(ctx, x, tp):
        with mc.log.tag("tp.fwd"):
            return tp.allreduce(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ToPartial(torch.autograd.Function):   # replicated -> pending sum: rank 0 keeps it
    @staticmethod
    def forward(ctx, x, tp):
        return x if tp.index == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


class Stage(torch.nn.Module):
    """Layers [lo, hi) of the GPT on one tensor-parallel group. The first stage embeds, the
    last applies the head and returns the loss; others return a pending-sum activation."""

    def __init__(self, full, lo, hi, n_layers, heads, tp: TP):
        super().__init__()
        self.first, self.last, self.tp, self.heads = lo == 0, hi == n_layers, tp, heads
        names = [f"l{l}_{k}" for l in range(lo, hi) for k in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")]
        names = (["wte", "wpe"] if self.first else []) + names + (["lnf", "head"] if self.last else [])
        self.w = torch.nn.ParameterDict({n: torch.nn.Parameter(tp_slice(n, full[n], tp.index, tp.size, heads).clone())
                                         for n in names})
        self.layers = list(range(lo, hi))

    def block(self, x, l, fuse_out):
        w, tp = self.w, self.tp
        b, s, d = x.shape
        u = _Copy.apply(F.layer_norm(x, (d,), w[f"l{l}_ln1"]), tp)
        q, k, v = (u @ w[f"l{l}_qkv"]).view(b, s, 3, -1, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + _Reduce.apply(a.transpose(1, 2).reshape(b, s, -1) @ w[f"l{l}_proj"], tp)
        u = _Copy.apply(F.layer_norm(x, (d,), w[f"l{l}_ln2"]), tp)
        m = F.gelu(u @ w[f"l{l}_fc1"]) @ w[f"l{l}_fc2"]
        if fuse_out:       # leave the sum over tp to the cross-mesh reshard
            return _ToPartial.apply(x, tp) + m
        return x + _Reduce.apply(m, tp)

    def forward(self, x, targets=None):
        if self.first:
            x = self.w["wte"][x] + self.w["wpe"][: x.shape[1]]
        for l in self.layers:
            x = self.block(x, l, fuse_out=(l == self.layers[-1] and not self.last))
        if not self.last:
            return x
        logits = F.layer_norm(x, (x.shape[-1],), self.w["lnf"]) @ self.w["head"]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


# -- schedules as data ------------------------------------------------------------------------


def schedule(kind, stage, n_stages, micro):
    """[("F", i) | ("B", i)] for one stage."""
    w = n_stages - stage - 1 if kind == "1f1b" else 2 * (n_stages - stage - 1)
    w = min(w, micro)
    ops = [("F", i) for i in range(w)]
    for i in range(micro - w):
        ops += [("F", w + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - w, micro)]


def comm_order(kind, n_stages, micro):
    """A global order of the cross-stage transfers: ("A", s, i) activation s -> s+1 and
    ("G", s, i) gradient s+1 -> s of microbatch i, sorted by when they are produced in a
    timeline (forward 1, backward 2 time units; an op starts when its stage is free and
    its input has arrived)."""
    progs = [schedule(kind, s, n_stages, micro) for s in range(n_stages)]
    end, pos, free = {}, [0] * n_stages, [0.0] * n_stages
    while any(pos[s] < len(progs[s]) for s in range(n_stages)):
        moved = False
        for s in range(n_stages):
            if pos[s] == len(progs[s]):
                continue
            op, i = progs[s][pos[s]]
            dep = ("F", s - 1, i) if op == "F" and s > 0 else \
                ("B", s + 1, i) if op == "B" and s < n_stages - 1 else None
            if dep is not None and dep not in end:
                continue
            start = max(free[s], end.get(dep, 0.0))
            free[s] = end[(op, s, i)] = start + (1.0 if op == "F" else 2.0)
            pos[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"schedule {kind!r} deadlocks")
    keys = [(end[("F", s, i)], 0, s, i, ("A", s, i)) for s in range(n_stages - 1) for i in range(micro)]
    keys += [(end[("B", s + 1, i)], 1, s, i, ("G", s, i)) for s in range(n_stages - 1) for i in range(micro)]
    return [k[-1] for k in sorted(keys)]


# -- one process's pipeline -------------------------------------------------------------------


class Pipeline:
    def __init__(self, stage_meshes, s, model, rank, kind, micro, act_shape):
        self.meshes, self.s, self.model, self.rank = stage_meshes, s, model, rank
        self.S, self.micro, self.shape = len(stage_meshes), micro, act_shape
        self.prog = schedule(kind, s, self.S, micro)
        # the transfers this stage takes part in, in the global order
        self.order = [c for c in comm_order(kind, self.S, micro) if c[1] in (s, s - 1)]

    def layouts(self, c):
        kind, s, _ = c
        if kind == "A":     # pending sum on stage s -> replicated on stage s+1
            return mc.Layout(self.meshes[s], (), partial=("tp",)), mc.Layout(self.meshes[s + 1], ())
        return mc.Layout(self.meshes[s + 1], ()), mc.Layout(self.meshes[s], ())

    def produces(self, c):
        return (c[0] == "A" and c[1] == self.s) or (c[0] == "G" and c[1] == self.s - 1)

    def issue_until(self, c):
        """Start, in the global order, every transfer up to and including c: the ones this
        stage produces are sent (their tensors exist by construction of the order), the ones
        it consumes are posted as receives."""
        while self.next <= self.order.index(c):
            t = self.order[self.next]
            src, dst = self.layouts(t)
            x = self.outbox.pop(t) if self.produces(t) else None
            with STATS.timed(sent_bytes(self.shape, torch.float32, src, dst, self.rank) if x is not None else 0), \
                    mc.log.tag("pp.fwd" if t[0] == "A" else "pp.bwd"):
                self.handles[t] = mc.reshard({self.rank: x} if x is not None else {}, src, dst,
                                             shape=self.shape, dtype=torch.float32, async_op=True)
            self.next += 1

    def receive(self, c, dev):
        self.issue_until(c)
        with STATS.timed():
            return self.handles.pop(c).wait()[self.rank].to(dev)

    def step(self, tokens, targets, dev):
        """One training step over `micro` microbatches; returns the summed loss (last stage)."""
        self.next, self.handles, self.outbox = 0, {}, {}
        saved, total = {}, 0.0
        first, last, s = self.s == 0, self.s == self.S - 1, self.s
        for op, i in self.prog:
            if op == "F":
                x = tokens[i].to(dev) if first else self.receive(("A", s - 1, i), dev).requires_grad_()
                y = self.model(x, targets[i].to(dev) if last else None)
                saved[i] = (x, y)
                if not last:                       # send as soon as it is produced
                    self.outbox[("A", s, i)] = y.detach()
                    self.issue_until(("A", s, i))
            else:
                x, y = saved.pop(i)
                if last:
                    total += float(y.detach())
                    y.backward()
                else:
                    y.backward(self.receive(("G", s, i), dev))
                if not first:
                    self.outbox[("G", s - 1, i)] = x.grad
                    self.issue_until(("G", s - 1, i))
        for h in self.handles.values():            # sends still in flight
            with STATS.timed():
                h.wait()
        return total


def default_stages(world):
    if world >= 4 and world % 4 == 0:
        q = world // 4
        return [q, 2 * q, q]                       # e.g. 4 -> 1,2,1 and 8 -> 2,4,2
    return [1] * world if world <= 3 else [world // 2, world - world // 2]


def main():
    p = base_parser(__doc__)
    p.add_argument("--schedule", choices=("1f1b", "eager"), default="1f1b")
    p.add_argument("--stages", default=None, help="devices per stage, e.g. 1,2,1 (sum = ranks)")
    p.add_argument("--layers", type=positive, default=6)
    p.add_argument("--micro", type=positive, default=4, help="microbatches per step")
    p.add_argument("--mb", type=positive, default=2, help="sequences per microbatch")
    p.add_argument("--seq", type=positive, default=16)
    p.add_argument("--d", type=positive, default=32)
    p.add_argument("--vocab", type=positive, default=64)
    a = p.parse_args()
    rank, world, dev = setup(a.backend, a.log)
    sizes = [int(v) for v in a.stages.split(",")] if a.stages else default_stages(world)
    heads = 4
    if sum(sizes) != world or any(heads % t for t in sizes) or a.layers < len(sizes):
        raise SystemExit(f"--stages {sizes}: must sum to {world} ranks, each dividing {heads} heads, "
                         f"at most --layers stages")
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    meshes = [mc.Mesh(list(range(b, b + n)), ("tp",)) for b, n in zip(starts, sizes)]
    s = max(k for k in range(len(sizes)) if starts[k] <= rank)
    bounds = [round(k * a.layers / len(sizes)) for k in range(len(sizes) + 1)]
    full = full_weights(a.vocab, a.d, a.layers, a.seq, a.seed)
    model = Stage(full, bounds[s], bounds[s + 1], a.layers, heads, TP(meshes[s], rank)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = Pipeline(meshes, s, model, rank, a.schedule, a.micro, (a.mb, a.seq, a.d))
    # every process creates every group the stages' plans use, in one order (torch needs it)
    shape = (a.mb, a.seq, a.d)
    prepare_groups([mc.plan(shape, "float32", mc.Layout(m, (), partial=("tp",)), mc.Layout(m, ()))
                    for m in meshes if m.size > 1] +
                   [mc.plan(shape, "float32", *pipe.layouts((k, j, 0)))
                    for j in range(len(meshes) - 1) for k in ("A", "G")])
    if rank == 0:
        print(f"stages (devices, TP degree, layers): "
              f"{[(m.device_ids, m.size, (bounds[k], bounds[k + 1])) for k, m in enumerate(meshes)]}, "
              f"schedule {a.schedule}", flush=True)
    g = torch.Generator().manual_seed(a.seed + 1)
    n_tok = a.micro * a.mb * a.seq
    data = [torch.randint(0, a.vocab, (a.micro, a.mb, a.seq + 1), generator=g) for _ in range(a.steps)]
    losses, times, comm_s, comm_b = [], [], [], []
    for step, batch in enumerate(data):
        STATS.reset()
        sync(dev)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = pipe.step(batch[..., :-1], batch[..., 1:], dev) / n_tok
        for q in model.parameters():       # the loss is a sum over tokens: scale to the mean
            q.grad /= n_tok
        if a.check and step == a.steps - 1:
            grads = {n: q.grad.clone() for n, q in model.w.items()}
        opt.step()
        sync(dev)
        times.append(time.perf_counter() - t0)
        comm_s.append(STATS.seconds)
        comm_b.append(STATS.bytes)
        losses.append(loss)
        if s == len(sizes) - 1 and rank == starts[s]:
            print(f"step {step} loss {loss:.6f}", flush=True)
    report(f"gpt {a.schedule}", rank, a.micro * a.mb, times, comm_s, comm_b)
    log_ok = finish_log("pipelined_gpt", a, rank, world)
    if a.check:
        ref = Stage(full, 0, a.layers, a.layers, heads, TP(None, 0)).to(dev)   # whole model, one process
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        diffs = {}
        for step, batch in enumerate(data):
            ropt.zero_grad()
            loss = sum(ref(batch[i, :, :-1].to(dev), batch[i, :, 1:].to(dev)) for i in range(a.micro)) / n_tok
            loss.backward()
            if s == len(sizes) - 1:
                diffs[f"loss[{step}]"] = abs(loss.item() - losses[step])
            if step == a.steps - 1:
                for n, q in model.w.items():
                    want = tp_slice(n, ref.w[n].grad, model.tp.index, model.tp.size, heads)
                    diffs[f"grad {n}"] = maxdiff(grads[n], want)
            ropt.step()
        finish_check("gpt", diffs, mc.Mesh(list(range(world)), ("r",)), rank, a.tol, log_ok)
    sys.exit(0 if log_ok else 1)


if __name__ == "__main__":
    main()
