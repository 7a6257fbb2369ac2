"""RL weight refit: trainer ranks train a small GPT (FSDP-style), and after every step one Program.reshard_many run moves its weights into the generator ranks' tensor-parallel layout, where they generate tokens.

    mpiexec -n 4 python examples/rl_refit.py --check                  # trainer 0,1; generator 2,3 (TP 2)
    mpiexec -n 8 python examples/rl_refit.py --check                  # trainer 0-3; generator 4-7 (DP 2 x TP 2)
    mpiexec -n 8 python examples/rl_refit.py --d 256 --layers 4 --repeats 9    # bigger model: refit figures

The first half of the ranks train, the second half generate (RL's trainer/rollout split).
Trainer: a character-level GPT learns the repository's README; every weight is sharded
along dim 0 over the trainer ranks (FSDP2's Shard(0)); each step all-gathers the weights
(`mc.all_gather`), runs forward and backward on its own batch, reduce-scatters the
gradients (`mc.reduce_scatter`) and updates its shards with Adam. Generator: a
DP x TP mesh over the other half (`--tp`, default 2): every weight matrix is split over
"tp" along its output dimension and replicated over "dp"; norms are replicated. Each DP
replica generates `--new-tokens` tokens greedily for its prompts, computing with its
shards: each matmul with the local columns, then an all-gather of the outputs over "tp".

The refit is the point: after each step ONE run of a `Program.reshard_many` (constructed
once, planned as one batch) moves every weight from the trainer layout to the generator
layout. Each refit prints its time and GB/s (model bytes / time, the slowest rank's time,
median of `--repeats` rounds that run every method once in turn) beside three ways to move
the same tensors: the eager
`mc.reshard_many`, a loop of `mc.reshard` (one call per tensor), and a hand-written mpi4py
exchange with one message per pair of processes (what a framework writes by hand: each
trainer packs, for each generator rank, the columns of its rows that rank holds).

`--check`: after every refit the generator's tiles must equal, bitwise, the trainer's
weights (gathered with mpi4py on rank 0 and assembled with `mc.unshard`, independent of the
refit), and so must the other three methods' results; the tokens each DP replica generates
must equal a one-process reference model's with the same weights (full matmuls, no
sharding), and its last logits must be within --tol. Exits 1 otherwise. Runs under
mpiexec with an even number of at least 2 processes (needs mpi4py); CPU only.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import base_parser, launched_size, setup, worst  # noqa: E402

import meshcomm as mc  # noqa: E402
from meshcomm.layout import chunk_bounds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAME = "rl_refit"


# -- the model: a dict of full weights (x @ W, W of shape (in, out)) and one forward -------------

def full_weights(vocab: int, d: int, layers: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) / s[0] ** 0.5  # noqa: E731
    w = {"wte": torch.randn(vocab, d, generator=g) * 0.1, "wpe": torch.randn(seq, d, generator=g) * 0.1}
    for l in range(layers):
        w |= {f"l{l}_ln1": torch.ones(d), f"l{l}_qkv": rnd(d, 3 * d), f"l{l}_proj": rnd(d, d),
              f"l{l}_ln2": torch.ones(d), f"l{l}_fc1": rnd(d, 4 * d), f"l{l}_fc2": rnd(4 * d, d)}
    return w | {"lnf": torch.ones(d), "head": rnd(d, vocab)}


def hidden(w, idx, layers: int, heads: int, mm, embed):
    """The final-norm hidden states (B, L, d). `mm(x, name)` is x @ W[name] (full columns);
    `embed(idx)` the token + position embedding. Causal: position i sees positions <= i."""
    x = embed(idx)
    b, n, d = x.shape
    for l in range(layers):
        h = F.layer_norm(x, (d,), w[f"l{l}_ln1"])
        q, k, v = mm(h, f"l{l}_qkv").view(b, n, 3, heads, d // heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + mm(a.transpose(1, 2).reshape(b, n, d), f"l{l}_proj")
        x = x + mm(F.gelu(mm(F.layer_norm(x, (d,), w[f"l{l}_ln2"]), f"l{l}_fc1")), f"l{l}_fc2")
    return F.layer_norm(x, (d,), w["lnf"])


def full_model(w):
    """(mm, embed, head) of a process holding full weights."""
    return ((lambda x, n: x @ w[n]), (lambda idx: w["wte"][idx] + w["wpe"][: idx.shape[1]]),
            (lambda h: h @ w["head"]))


def generate(w, prompts, new_tokens: int, layers: int, heads: int, model) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding: (the new tokens (B, new_tokens), the last step's logits). The sequence
    lives in a fixed buffer (prompt + new tokens) and the whole buffer runs every step: the
    positions not yet written do not reach earlier ones (causal), and every collective keeps
    one shape."""
    mm, embed, head = model
    b, p = prompts.shape
    buf = torch.zeros(b, p + new_tokens, dtype=torch.long)
    buf[:, :p] = prompts
    logits = None
    for t in range(new_tokens):
        h = hidden(w, buf, layers, heads, mm, embed)
        logits = head(h[:, p + t - 1])
        buf[:, p + t] = logits.argmax(-1)
    return buf[:, p:], logits


# -- layouts: trainer (FSDP over the first half) and generator (DP x TP over the second) ----------

class Meshes:
    def __init__(self, world: int, tp: int):
        self.n_train = world // 2
        self.n_gen = world - self.n_train
        self.tp = tp
        self.dp = self.n_gen // tp
        self.train = mc.Mesh(list(range(self.n_train)), ("fsdp",))
        self.gen = mc.Mesh(np.arange(self.n_train, world).reshape(self.dp, tp), ("dp", "tp"))

    def src(self, t: torch.Tensor) -> mc.Layout:
        return mc.Layout(self.train, ("fsdp",))            # dim 0 chunked over the trainer ranks

    def dst(self, t: torch.Tensor) -> mc.Layout:
        # matrices: output dimension (dim 1) over tp, replicated over dp; vectors replicated
        return mc.Layout(self.gen, (None, "tp") if t.dim() == 2 else ())

    def coord(self, rank: int) -> tuple[int, int] | None:
        """(dp replica, tp index) of a generator rank, None for a trainer."""
        if rank < self.n_train:
            return None
        j, k = divmod(rank - self.n_train, self.tp)
        return j, k


# -- the trainer: FSDP-style with meshcomm's collectives ----------------------------------------

def corpus() -> torch.Tensor:
    return torch.tensor(list((ROOT / "README.md").read_bytes()), dtype=torch.long)


class Trainer:
    def __init__(self, a, full, m: Meshes, rank: int):
        self.a, self.m, self.rank = a, m, rank
        rows = {n: chunk_bounds(t.shape[0], m.n_train)[rank] for n, t in full.items()}  # = torch.chunk
        self.shards = {n: torch.nn.Parameter(t[rows[n][0]:rows[n][1]].clone()) for n, t in full.items()}
        self.opt = torch.optim.Adam(self.shards.values(), lr=a.lr)
        text = corpus()
        g = torch.Generator().manual_seed(a.seed + 1)
        self.batches = []
        for _ in range(a.steps):
            starts = torch.randint(0, len(text) - a.seq - 1, (m.n_train, a.batch), generator=g)[rank]
            seqs = torch.stack([text[s:s + a.seq + 1] for s in starts.tolist()])
            self.batches.append((seqs[:, :-1], seqs[:, 1:]))

    def step(self, k: int, progs: "Collectives") -> float:
        """One step; returns the mean loss over the trainer ranks."""
        a = self.a
        with mc.log.tag("rl.train.gather"):
            full = {n: torch.as_tensor(progs.gather[n](s.detach())).requires_grad_() for n, s in self.shards.items()}
        x, y = self.batches[k]
        h = hidden(full, x, a.layers, a.heads, *full_model(full)[:2])
        loss = F.cross_entropy((h @ full["head"]).flatten(0, 1), y.flatten())
        loss.backward()
        with mc.log.tag("rl.train.grad"):
            for n, s in self.shards.items():
                g = progs.scatter[n](full[n].grad.contiguous())
                s.grad = torch.as_tensor(g).reshape(s.shape) / self.m.n_train
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with mc.log.tag("rl.train.loss"):
            return float(np.asarray(progs.loss(np.array([float(loss.detach())])))[0])

    def tiles(self) -> dict:
        """This trainer's src tiles of every weight, as reshard_many takes them."""
        return {n: {self.rank: s.detach()} for n, s in self.shards.items()}


class Collectives:
    """Every collective Program of the run, constructed by EVERY process in one order (a
    Program's construction is agreed by all processes; a process outside its mesh passes
    shape=None and never runs it). Trainer: per weight an all-gather of its dim-0 shards and
    a reduce-scatter of its gradient over "fsdp", and the loss's mean. Generator: an
    all-gather over "tp" per output width of its matmuls (the last dimension)."""

    def __init__(self, a, m: Meshes, rank: int, shapes: dict):
        f32 = torch.float32
        train = m.coord(rank) is None
        self.gather, self.scatter, self.tp = {}, {}, {}
        for n, s in shapes.items():
            r0, r1 = chunk_bounds(s[0], m.n_train)[rank] if train else (0, 0)
            self.gather[n] = mc.Program.all_gather(m.train, "fsdp", shape=(r1 - r0,) + s[1:] if train else None,
                                                   dtype=f32, dim=0, backend=a.backend)
            self.scatter[n] = mc.Program.reduce_scatter(m.train, "fsdp", shape=s if train else None, dtype=f32,
                                                        dim=0, backend=a.backend)
        self.loss = mc.Program.all_reduce(m.train, "fsdp", shape=(1,) if train else None, dtype=np.float64,
                                          op="avg", backend=a.backend)
        if m.tp > 1:
            b, k = a.prompts // m.dp, None if train else m.coord(rank)[1]
            # activations (B, L, w) for every matrix's output width w but the head's; logits (B, vocab)
            wanted = [(b, a.seq, w) for w in sorted({s[1] for n, s in shapes.items() if len(s) == 2 and n != "head"})]
            for full in wanted + [(b, shapes["head"][1])]:
                c0, c1 = chunk_bounds(full[-1], m.tp)[k] if not train else (0, 0)
                self.tp[full] = mc.Program.all_gather(m.gen, "tp", shape=full[:-1] + (c1 - c0,) if not train else None,
                                                      dtype=f32, dim=len(full) - 1, backend=a.backend)


# -- the refit, four ways ---------------------------------------------------------------------------

class HandWritten:
    """The exchange a framework writes by hand with mpi4py: one message per (trainer,
    generator) pair, holding for every weight the block of the trainer's rows that the
    generator's columns cover (packed in one buffer, unpacked into fresh tiles)."""

    TAG = 4242

    def __init__(self, comm, shapes: dict, m: Meshes, rank: int):
        self.comm, self.m, self.rank, self.shapes = comm, m, rank, shapes
        self.names = list(shapes)
        self.rows = {n: chunk_bounds(s[0], m.n_train) for n, s in shapes.items()}
        self.cols = {n: chunk_bounds(s[1], m.tp) if len(s) == 2 else None for n, s in shapes.items()}
        me = m.coord(rank)
        if me is None:
            self.sends = {g: self._count(rank, m.coord(g)[1]) for g in range(m.n_train, m.n_train + m.n_gen)}
            self.sends = {g: c for g, c in self.sends.items() if c}
        else:
            self.recvs = {t: self._count(t, me[1]) for t in range(m.n_train)}
            self.recvs = {t: c for t, c in self.recvs.items() if c}

    def _box(self, n, t, k):
        (r0, r1), c = self.rows[n][t], self.cols[n]
        c0, c1 = c[k] if c is not None else (0, 1)
        return r0, r1, c0, c1

    def _count(self, t, k) -> int:
        total = 0
        for n, s in self.shapes.items():
            r0, r1, c0, c1 = self._box(n, t, k)
            total += (r1 - r0) * (c1 - c0 if len(s) == 2 else 1)
        return total

    def __call__(self, tiles: dict) -> dict:
        from mpi4py import MPI
        m, reqs = self.m, []
        if m.coord(self.rank) is None:
            bufs = []
            for g in self.sends:
                k = m.coord(g)[1]
                parts = []
                for n in self.names:
                    s = tiles[n][self.rank]
                    if s.dim() == 2:
                        _, _, c0, c1 = self._box(n, self.rank, k)
                        s = s[:, c0:c1]
                    parts.append(s.reshape(-1))
                buf = torch.cat(parts).numpy()
                bufs.append(buf)
                reqs.append(self.comm.Isend([buf, MPI.FLOAT], dest=g, tag=self.TAG))
            MPI.Request.Waitall(reqs)
            return {}
        k = m.coord(self.rank)[1]
        bufs = {t: np.empty(c, np.float32) for t, c in self.recvs.items()}
        reqs = [self.comm.Irecv([b, MPI.FLOAT], source=t, tag=self.TAG) for t, b in bufs.items()]
        out = {}
        for n, s in self.shapes.items():
            c = self.cols[n]
            out[n] = torch.empty((s[0], c[k][1] - c[k][0]) if c is not None else s, dtype=torch.float32)
        MPI.Request.Waitall(reqs)
        for t, b in bufs.items():
            buf, off = torch.from_numpy(b), 0
            for n in self.names:
                r0, r1, c0, c1 = self._box(n, t, k)
                size = (r1 - r0) * (c1 - c0)
                out[n][r0:r1] = buf[off:off + size].view(out[n][r0:r1].shape)
                off += size
        return {n: {self.rank: v} for n, v in out.items()}


def timed(comm, methods: dict, repeats: int) -> tuple[dict, dict]:
    """({method: median seconds}, {method: its last result}): `repeats` rounds, each running
    every method once in turn (so a busy machine slows them alike); a run starts together
    (a barrier) and lasts until the slowest rank is done."""
    ts, out = {k: [] for k in methods}, {}
    for _ in range(repeats):
        for k, fn in methods.items():
            comm.Barrier()
            t0 = time.perf_counter()
            out[k] = fn()
            ts[k].append(comm.allreduce(time.perf_counter() - t0, op=_mpi().MAX))
    return {k: float(np.median(v)) for k, v in ts.items()}, out


def _mpi():
    from mpi4py import MPI
    return MPI


def mine(out: dict, rank: int) -> dict[str, torch.Tensor]:
    """{name: this rank's dst tile} of a refit's result (NumPy or torch)."""
    return {n: torch.as_tensor(t[rank]) for n, t in (out or {}).items() if t and rank in t}


# -- the generator: tensor-parallel compute with the refit tiles -------------------------------------

def tp_model(tiles, m: Meshes, progs: Collectives, shapes: dict):
    """(mm, embed, head) over this rank's tiles: each matmul with the local columns, then an
    all-gather of the outputs over "tp" (the full columns, in order)."""
    def gather(y, width):
        if m.tp == 1:
            return y
        with mc.log.tag("rl.gen.tp"):
            return torch.as_tensor(progs.tp[y.shape[:-1] + (width,)](y.contiguous()))
    return ((lambda x, n: gather(x @ tiles[n], shapes[n][1])),
            (lambda idx: gather(tiles["wte"][idx] + tiles["wpe"][: idx.shape[1]], shapes["wte"][1])),
            (lambda h: gather(h @ tiles["head"], shapes["head"][1])))


def prompts_of(a, replica: int, dp: int) -> torch.Tensor:
    """The prompts of DP replica `replica` (every rank draws all of them the same way)."""
    text = corpus()
    g = torch.Generator().manual_seed(a.seed + 2)
    starts = torch.randint(0, len(text) - a.seq, (a.prompts,), generator=g).tolist()
    allp = torch.stack([text[s:s + a.seq - a.new_tokens] for s in starts])
    return allp[replica::dp]


# -- main -----------------------------------------------------------------------------------------

def parse():
    p = base_parser(__doc__, backend_help="meshcomm backend: mpi | torch | mixed (default mpi)")
    p.set_defaults(steps=3, backend="mpi")
    for act in p._actions:
        if act.dest == "seed":
            act.help = "seed of the initial weights, the training batches and the prompts"
        elif act.dest == "check":
            act.help = ("after every refit: the generator's tiles equal the trainer's weights bitwise (all four "
                        "methods), and the generated tokens equal a one-process reference's")
        elif act.dest == "tol":
            act.help = "largest allowed difference of the last logits from the reference in --check"
        elif act.dest == "log":
            act.help = ("log every meshcomm call to DIR/rank<r>.jsonl (meshcomm.log; tags rl.train.gather, "
                        "rl.train.grad, rl.train.loss, rl.refit, rl.gen.tp); read it with "
                        "`meshcomm log summary DIR --by tag`")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (divide --d)")
    p.add_argument("--seq", type=int, default=32, help="context length (training sequences, prompt + new tokens)")
    p.add_argument("--batch", type=int, default=4, help="sequences per trainer rank per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the trainer")
    p.add_argument("--tp", type=int, default=2, help="generator tensor-parallel degree (divides the generator ranks)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per refit, split over the DP replicas")
    p.add_argument("--new-tokens", type=int, default=6, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per refit, each running every method once (median)")
    p.add_argument("--bucket-mb", type=float, default=None, help="reshard_many's bucket size (default: one bucket)")
    a = p.parse_args()
    world = launched_size()
    problems = []
    if world < 2 or world % 2:
        problems.append(f"needs an even number of processes >= 2 under mpiexec (trainer = first half, generator = "
                        f"second half), got {world}")
    elif a.tp < 1 or (world // 2) % a.tp:
        problems.append(f"--tp {a.tp} must divide the {world // 2} generator ranks")
    elif a.prompts % (world // 2 // a.tp):
        problems.append(f"--prompts {a.prompts} must be a multiple of the generator's DP degree "
                        f"{world // 2 // a.tp} (every replica generates as many)")
    if a.d % a.heads:
        problems.append(f"--heads {a.heads} must divide --d {a.d}")
    if not 0 < a.new_tokens < a.seq:
        problems.append(f"--new-tokens must be between 1 and --seq - 1 ({a.seq - 1})")
    if a.repeats < 1 or a.steps < 1 or a.prompts < 1:
        problems.append("--steps, --repeats and --prompts must be at least 1")
    if problems:
        p.error("; ".join(problems))
    return a


def main():
    a = parse()
    rank, world, _ = setup(a.backend, a.log)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()             # the baseline, barriers and --check's gathers: apart from meshcomm's
    m = Meshes(world, a.tp)
    torch.manual_seed(a.seed)
    full0 = full_weights(256, a.d, a.layers, a.seq, a.seed)
    shapes = {n: tuple(t.shape) for n, t in full0.items()}
    src = {n: m.src(t) for n, t in full0.items()}
    dst = {n: m.dst(t) for n, t in full0.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in full0.values())
    coord = m.coord(rank)
    trainer = Trainer(a, full0, m, rank) if coord is None else None
    del full0
    if rank == 0:
        print(f"[{NAME}] {world} processes: trainer ranks {m.train.device_ids} (FSDP, dim 0), generator ranks "
              f"{m.gen.device_ids} (DP {m.dp} x TP {m.tp}); {len(shapes)} tensors, "
              f"{model_bytes / 2**20:.2f} MiB; backend {a.backend}", flush=True)

    progs = Collectives(a, m, rank, shapes)
    t0 = time.perf_counter()
    with mc.log.tag("rl.refit"):
        prog = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes=torch.float32, backend=a.backend,
                                       bucket_mb=a.bucket_mb)
    t_construct = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    hand = HandWritten(comm, shapes, m, rank)

    def xs():
        return trainer.tiles() if trainer is not None else {}

    methods = {
        "Program": lambda: prog(xs()),
        "reshard_many": lambda: mc.reshard_many(xs(), src, dst, shapes=shapes, dtypes=torch.float32, backend=a.backend,
                                                bucket_mb=a.bucket_mb),
        "per-tensor loop": lambda: {n: mc.reshard(xs().get(n, {}), src[n], dst[n], shape=shapes[n],
                                                  dtype=torch.float32, backend=a.backend) for n in shapes},
        "mpi4py by hand": lambda: hand(xs()),
    }
    with mc.log.tag("rl.refit"):
        for fn in methods.values():         # eager Programs constructed, buffers touched: not timed
            fn()
    if rank == 0:
        print(f"[{NAME}] Program.reshard_many constructed once (agreement + plan of the batch): "
              f"{t_construct * 1e3:.1f} ms; {prog}", flush=True)

    times = {k: [] for k in methods}
    failures, logit_diff, checked = [], 0.0, 0
    for step in range(a.steps):
        if trainer is not None:
            loss = trainer.step(step, progs)
            if rank == 0:
                print(f"step {step} loss {loss:.5f}", flush=True)
        # -- the refit: the run the generator uses, then each method timed on the same weights
        comm.Barrier()
        with mc.log.tag("rl.refit"):
            tiles = mine(prog(xs()), rank)
            med, outs = timed(comm, methods, a.repeats)
            got = {k: mine(v, rank) for k, v in outs.items()}
            for k, t in med.items():
                times[k].append(t)
        if rank == 0:
            line = " | ".join(f"{k} {times[k][-1] * 1e3:.2f} ms {model_bytes / times[k][-1] / 1e9:.3f} GB/s"
                              for k in methods)
            print(f"[{NAME}] refit {step}: {line}", flush=True)
        # -- generation with the refit tiles
        tokens = logits = None
        if coord is not None:
            prompts = prompts_of(a, coord[0], m.dp)
            if len(prompts):
                tokens, logits = generate(tiles, prompts, a.new_tokens, a.layers, a.heads,
                                          tp_model(tiles, m, progs, shapes))
                if coord[1] == 0:
                    text = bytes(tokens[0].tolist()).decode("latin-1")
                    print(f"[{NAME}] step {step} replica {coord[0]}: generated {text!r}", flush=True)
        if a.check:
            f, diff = check(a, comm, m, rank, trainer, src, dst, shapes, tiles, got, tokens, logits, step)
            failures += f
            logit_diff = worst((logit_diff, diff))      # NaN stays
            checked += 1
    summary(a, rank, times, model_bytes)
    ok = True
    if a.check:
        ok = comm.bcast(not failures and logit_diff <= a.tol if rank == 0 else None, root=0)
        if rank == 0:
            for f in failures[:20]:
                print(f"[{NAME}] {f}", file=sys.stderr, flush=True)
            what = "generator tiles bitwise equal to the trainer's for every method, tokens equal: yes" \
                if not failures else f"{len(failures)} failure(s): tiles or tokens differ (above)"
            print(f"[{NAME}] check: largest difference vs single process {logit_diff:.3g} (tolerance {a.tol:g}; "
                  f"{checked} refits: {what}) {'OK' if ok else 'FAILED'}", flush=True)
    if a.log:
        mc.log.stop()
        if rank == 0:
            print(f"[{NAME}] log in {a.log}: meshcomm log summary {a.log} --by tag", flush=True)
    comm.Barrier()
    comm.Free()
    sys.exit(0 if ok else 1)


def summary(a, rank, times, model_bytes):
    """Medians over the refits, and the ratios the refit is held to (throughput: the
    hand-written exchange's time over the method's)."""
    if rank != 0:
        return
    med = {k: float(np.median(v)) for k, v in times.items()}
    hand = med["mpi4py by hand"]
    print(f"[{NAME}] refit over {len(times['Program'])} steps (median of medians): " +
          " | ".join(f"{k} {t * 1e3:.2f} ms {model_bytes / t / 1e9:.3f} GB/s" for k, t in med.items()), flush=True)
    goals = {"Program": 0.95, "reshard_many": 0.9, "per-tensor loop": None}
    print(f"[{NAME}] throughput vs mpi4py by hand: " + ", ".join(
        f"{k} {hand / med[k]:.2f}x" + (f" (goal >= {g}x: {'met' if hand / med[k] >= g else 'NOT met'})" if g else "")
        for k, g in goals.items()), flush=True)


def check(a, comm, m, rank, trainer, src, dst, shapes, tiles, got, tokens, logits, step):
    """--check after one refit: ([failure lines], largest logits difference) on rank 0
    (([], 0.0) elsewhere). Rank 0 gathers the trainer's shards with mpi4py and assembles the
    weights with mc.unshard; every generator rank's tile must be its box of them bitwise,
    for the Program's refit and for every other method's; the tokens must equal a
    one-process reference run with those weights."""
    fails = []
    mine_ok = all(torch.equal(v[n], tiles[n]) for v in got.values() for n in tiles) and \
        all(set(v) == set(tiles) for v in got.values())
    shards = comm.gather(trainer.tiles() if trainer is not None else None, root=0)
    gen = comm.gather((tiles, mine_ok, tokens, logits) if m.coord(rank) is not None else None, root=0)
    if rank != 0:
        return [], 0.0
    full = {}
    for n in shapes:
        parts = {}
        for s in shards:
            if s is not None:
                parts.update({d: v.numpy() for d, v in s[n].items()})
        full[n] = torch.from_numpy(np.ascontiguousarray(mc.unshard(parts, src[n])))
    diff = 0.0
    for g, entry in enumerate(gen):
        if entry is None:
            continue
        t, ok, toks, lg = entry
        if not ok:
            fails.append(f"refit {step}: rank {g}: another method's tiles differ from the Program's")
        for n in shapes:
            want = full[n][dst[n].index_map(shapes[n])[g]]
            if n not in t or not torch.equal(t[n], want):
                fails.append(f"refit {step}: rank {g}: weight {n} differs from the trainer's")
        j, k = m.coord(g)
        prompts = prompts_of(a, j, m.dp)
        if k == 0 and len(prompts):
            ref_tokens, ref_logits = generate(full, prompts, a.new_tokens, a.layers, a.heads, full_model(full))
            if not torch.equal(toks, ref_tokens):
                fails.append(f"refit {step}: replica {j} (rank {g}) generated {toks.tolist()}, the reference "
                             f"{ref_tokens.tolist()}")
            diff = worst((diff, float((lg - ref_logits).abs().max())))
    return fails, diff


if __name__ == "__main__":
    main()
