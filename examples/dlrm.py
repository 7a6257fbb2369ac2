"""A small DLRM: embedding tables model-parallel (uneven widths per rank), MLPs data-parallel;
the pooled-embedding exchange is a meshcomm.reshard that overlaps the bottom MLP.

    python examples/dlrm.py                       # one process
    mpiexec -n 4 python examples/dlrm.py --check  # 4 ranks, compare with one process

Layouts of the pooled embeddings E (global shape [batch, sum of table widths]):

    features sharded, batch replicated:  Layout(mesh, (None, Blocks("r", widths_per_rank)))
    batch sharded:                       Layout(mesh, ("r", None))

Each rank looks up its own tables for the whole batch (first layout); one reshard turns
that into every rank's batch slice of all features (second layout); the gradient of E goes
back with the reverse reshard. Tables are split into contiguous groups, so the widths per
rank are uneven (and zero on ranks with no table).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import meshcomm as mc  # noqa: E402
from _common import (STATS, allreduce_, base_parser, positive, finish_check, finish_log, maxdiff, report,  # noqa: E402
                     sent_bytes, setup, sync)


def mlp(sizes, g):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g) / a ** 0.5)
            lin.bias.copy_(torch.randn(b, generator=g) * 0.1)
        layers += [lin, torch.nn.ReLU()] if i < len(sizes) - 2 else [lin]
    return torch.nn.Sequential(*layers)


class DLRM(torch.nn.Module):
    """Tables `tables` (indices into widths) live here; world=1 holds every table."""

    def __init__(self, widths, rows, dense, d, tables, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)          # same full weights on every rank
        self.bottom = mlp([dense, 32, d], g)
        all_tables = [torch.randn(rows, w, generator=g) * 0.1 for w in widths]
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(all_tables[t]) for t in tables])
        self.table_ids = list(tables)
        f = 1 + sum(widths) // d                          # feature vectors of width d
        self.top = mlp([d + f * (f - 1) // 2, 32, 1], g)
        self.d = d

    def lookup(self, idx):
        """Pooled embeddings of this rank's tables for the whole batch: [batch, my widths]."""
        b = idx.shape[0]
        cols = [torch.nn.functional.embedding_bag(idx[:, t], self.tables[k], mode="sum")
                for k, t in enumerate(self.table_ids)]
        return torch.cat(cols, dim=1) if cols else torch.zeros(b, 0, device=idx.device)

    def head(self, dense_out, emb):
        """Dot interaction of the bottom output and every width-d chunk of the embeddings."""
        b = dense_out.shape[0]
        feats = torch.cat([dense_out[:, None], emb.view(b, -1, self.d)], dim=1)  # [b, f, d]
        z = feats @ feats.transpose(1, 2)
        i, j = torch.triu_indices(z.shape[1], z.shape[2], offset=1)
        return self.top(torch.cat([dense_out, z[:, i, j]], dim=1)).squeeze(1)


def main():
    p = base_parser(__doc__)
    p.add_argument("--batch", type=positive, default=32, help="global batch")
    p.add_argument("--widths", default="8,16,8,24,16,8", help="table widths (multiples of --d)")
    p.add_argument("--rows", type=positive, default=100, help="rows per table")
    p.add_argument("--d", type=positive, default=8)
    a = p.parse_args()
    rank, world, dev = setup(a.backend, a.log)
    widths = [int(w) for w in a.widths.split(",")]
    if a.batch % world or any(w % a.d for w in widths):
        raise SystemExit("--batch must be divisible by the ranks and every width by --d")
    dense_dim, bag = 8, 3
    groups = np.array_split(np.arange(len(widths)), world)      # contiguous tables per rank
    per_rank = [sum(widths[t] for t in grp) for grp in groups]   # uneven, maybe 0
    mesh = mc.Mesh(list(range(world)), ("r",))
    emb_shape = (a.batch, sum(widths))
    feat_sharded = mc.Layout(mesh, (None, mc.Blocks("r", per_rank)))
    batch_sharded = mc.Layout(mesh, ("r", None))

    cfg = dict(widths=widths, rows=a.rows, dense=dense_dim, d=a.d, seed=a.seed)
    model = DLRM(**cfg, tables=groups[rank].tolist()).to(dev)
    mlps = list(model.bottom.parameters()) + list(model.top.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(a.seed + 1)
    data = [(torch.randn(a.batch, dense_dim, generator=g),
             torch.randint(0, a.rows, (a.batch, len(widths), bag), generator=g),
             torch.randint(0, 2, (a.batch,), generator=g).float()) for _ in range(a.steps)]
    mine = slice(rank * a.batch // world, (rank + 1) * a.batch // world)
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    losses, times, comm_s, comm_b = [], [], [], []
    for step, (dense, idx, y) in enumerate(data):
        STATS.reset()
        sync(dev)
        t0 = time.perf_counter()
        emb_local = model.lookup(idx.to(dev))                       # [batch, my widths]
        # start the exchange, run the bottom MLP while it is in flight
        t_c = time.perf_counter()
        with mc.log.tag("emb.fwd"):
            h = mc.reshard({rank: emb_local.detach()}, feat_sharded, batch_sharded,
                           shape=emb_shape, dtype=emb_local.dtype, async_op=True)
        STATS.seconds += time.perf_counter() - t_c
        dense_out = model.bottom(dense[mine].to(dev))
        with STATS.timed(sent_bytes(emb_shape, emb_local.dtype, feat_sharded, batch_sharded, rank)):
            emb = h.wait()[rank].requires_grad_()                # [my batch, all widths]
        loss = loss_fn(model.head(dense_out, emb), y[mine].to(dev)) / a.batch
        opt.zero_grad()
        loss.backward()
        # embedding gradients go back the reverse way, overlapping the MLP all-reduce
        t_c = time.perf_counter()
        with mc.log.tag("emb.bwd"):
            hg = mc.reshard({rank: emb.grad}, batch_sharded, feat_sharded, shape=emb_shape,
                            dtype=emb.dtype, async_op=True)
        STATS.seconds += time.perf_counter() - t_c
        total = loss.detach().reshape(1)
        with mc.log.tag("dp.grad"):
            allreduce_([q.grad for q in mlps] + [total], mesh, rank)   # data-parallel MLPs
        with STATS.timed(sent_bytes(emb_shape, emb.dtype, batch_sharded, feat_sharded, rank)):
            g_local = hg.wait()[rank]
        if emb_local.requires_grad:                                # ranks without tables skip this
            emb_local.backward(g_local)
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
    report("dlrm", rank, a.batch, times, comm_s, comm_b)
    log_ok = finish_log("dlrm", a, rank, world)
    if a.check:
        ref = DLRM(**cfg, tables=range(len(widths))).to(dev)      # every table in one process
        ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
        diffs = {}
        for step, (dense, idx, y) in enumerate(data):
            loss = loss_fn(ref.head(ref.bottom(dense.to(dev)), ref.lookup(idx.to(dev))), y.to(dev)) / a.batch
            ropt.zero_grad()
            loss.backward()
            diffs[f"loss[{step}]"] = abs(loss.item() - losses[step])
            if step == a.steps - 1:
                rp = dict(ref.named_parameters())
                for n, q in model.named_parameters():
                    if n.startswith("tables."):                    # local table k = global table t
                        want = ref.tables[model.table_ids[int(n.split(".")[1])]].grad
                    else:
                        want = rp[n].grad
                    diffs[f"grad {n}"] = maxdiff(grads[n], want)
            ropt.step()
        finish_check("dlrm", diffs, mesh, rank, a.tol, log_ok)
    sys.exit(0 if log_ok else 1)


if __name__ == "__main__":
    main()
