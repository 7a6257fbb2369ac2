"""Plumbing shared by the examples: start-up, autograd wrappers, timing, checks.

Every example runs in two ways:
* `python examples/X.py` (no launcher): one process, one device; meshcomm works in memory;
* `mpiexec -n N python examples/X.py`: one process per device; `meshcomm.init` picks the
  backend (MPI on CPU by default, torch.distributed with NCCL when CUDA is there).
Device ids are ranks (devices_per_process=1).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch

import meshcomm as mc

_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE")
_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")


def launched_size() -> int:
    for v in _LAUNCHER_SIZE_VARS:
        if v in os.environ:
            return int(os.environ[v])
    return 1


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher), before any init."""
    for v in _LAUNCHER_RANK_VARS:
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 0


class _Parser(argparse.ArgumentParser):
    """Under a launcher every process parses the same flags: only rank 0 prints (--help, a bad
    flag's message), every process exits the same way."""

    def _print_message(self, message, file=None):
        if launched_rank() == 0:
            super()._print_message(message, file)


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def worst(values) -> float:
    """The largest value, NaN where any is NaN (Python's max drops a NaN unless it comes
    first: a check would pass on a NaN gradient)."""
    values = list(values)
    return float("nan") if any(v != v for v in values) else max(values, default=0.0)


def base_parser(doc: str, backend_help: str = "mpi | torch | mixed (default: torch on GPU, else mpi)"
                ) -> argparse.ArgumentParser:
    """The flags every example takes. The description is the docstring's first paragraph, the
    epilog its second (the command lines that run the example)."""
    paras = doc.strip().split("\n\n")
    p = _Parser(description=paras[0], epilog="examples:\n" + paras[1] if len(paras) > 1 else None,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=positive, default=5, help="training steps (at least 1)")
    p.add_argument("--check", action="store_true",
                   help="compare loss and gradients with a single-process run of the same model")
    p.add_argument("--backend", default=None, help=backend_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed difference in --check")
    p.add_argument("--log", metavar="DIR", default=None,
                   help="log every meshcomm call to DIR/rank<r>.jsonl (meshcomm.log); at the end rank 0 "
                        "prints the log against meshcomm.model (calls and bytes per phase)")
    return p


def setup(backend: str | None, log: str | None = None):
    """(rank, world, torch device). Initialises meshcomm when started by a launcher; with
    `log`, starts meshcomm.log first (init then measures the ranks' clock offsets)."""
    torch.set_num_threads(1)
    if log:
        mc.log.start(log)
    cuda = torch.cuda.is_available()
    world = launched_size()
    rank = 0
    if world > 1:
        # NCCL wants one GPU per rank; with fewer GPUs than ranks use MPI (staged via host)
        nccl_ok = cuda and torch.cuda.device_count() >= world
        ctx = mc.init(backend=backend or ("torch" if nccl_ok else "mpi"), devices_per_process=1)
        rank, world = ctx.rank, ctx.world_size
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    return rank, world, dev


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# -- communication accounting ------------------------------------------------------------------

class CommStats:
    """Seconds spent waiting on communication and bytes this process sent, per step."""

    def __init__(self):
        self.seconds = 0.0
        self.bytes = 0

    @contextmanager
    def timed(self, nbytes: int = 0):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t
            self.bytes += int(nbytes)

    def reset(self):
        self.seconds, self.bytes = 0.0, 0


STATS = CommStats()


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def sent_bytes(shape, dtype, src: mc.Layout, dst: mc.Layout, rank: int) -> int:
    """Bytes device `rank` sends in the reshard plan (plans are cached: this is cheap)."""
    p = mc.plan(shape, dtype, src, dst)
    return sum(t.nbytes for t in p.transfers if t.kind != "copy" and t.srcs[0] == rank
               and any(d != rank for d in t.dsts))


def prepare_groups(plans) -> None:
    """Create, on EVERY process and in the same order, the communicator groups `plans` use.

    meshcomm creates groups lazily when a plan first runs; torch.distributed's new_group
    must then be called by every rank. A pipeline runs each plan only on the ranks of two
    stages, so it creates its groups up front (MPI does not need this; it does no harm)."""
    ctx = mc.runtime.current()
    if ctx is None:
        return
    from meshcomm.backends import base
    be = ctx.backend
    deadline = time.monotonic() + ctx.timeout
    for p in plans:
        coll = base.collective_reduce_ok(p.dtype, be)
        need = base.groups_needed(p, ctx.devices_per_process, coll,
                                  lambda s: be.choose(s.table_op, s.nbytes, len(s.ranks), "cpu"))
        for b in be.members():
            b.prepare_groups(need.get(b.name, []), deadline)


# -- collectives built from reshard ------------------------------------------------------------

def allreduce_(tensors, mesh: mc.Mesh, rank: int) -> None:
    """Sum tensors over every device of `mesh` in place: one coalesced reshard from a
    pending-sum layout (partial over all axes) to a replicated one."""
    if mesh.size == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    part = mc.Layout(mesh, (None,), partial=mesh.axis_names)
    repl = mc.Layout(mesh, (None,))
    with STATS.timed(sent_bytes(flat.shape, flat.dtype, part, repl, rank)):
        out = mc.reshard({rank: flat}, part, repl, shape=flat.shape, dtype=flat.dtype)[rank]
    off = 0
    for t in tensors:
        t.copy_(out[off:off + t.numel()].view_as(t))
        off += t.numel()


def max_over(values: list[float], mesh: mc.Mesh, rank: int) -> float:
    """The largest of every process's values, known on device mesh.device_ids[0]."""
    v = torch.tensor([worst(values)], dtype=torch.float64)
    if mesh.size == 1:
        return float(v)
    src = mc.Layout(mesh, (mesh.axis_names,))                  # one value per device
    dst = mc.Layout(mc.Mesh([mesh.device_ids[0]], ("r",)), (None,))
    out = mc.reshard({rank: v}, src, dst, shape=(mesh.size,), dtype=v.dtype)
    return float(out[mesh.device_ids[0]].max()) if out else float("nan")


class Reshard(torch.autograd.Function):
    """Differentiable meshcomm.reshard of this process's tile (device id = rank): the
    gradient goes back the reverse way (dst layout -> src layout)."""

    @staticmethod
    def forward(ctx, x, src, dst, shape, rank):
        ctx.meta = (src, dst, shape, rank, x.dtype)
        return _reshard(x, src, dst, shape, rank)

    @staticmethod
    def backward(ctx, g):
        src, dst, shape, rank, dtype = ctx.meta
        return _reshard(g.contiguous(), dst, src, shape, rank), None, None, None, None


def _reshard(x, src, dst, shape, rank):
    with STATS.timed(sent_bytes(shape, x.dtype, src, dst, rank)):
        out = mc.reshard({rank: x} if rank in src.mesh else {}, src, dst, shape=shape, dtype=x.dtype)
    return out[rank]


# -- reporting -----------------------------------------------------------------------------------

def report(name: str, rank: int, samples: int, step_times: list[float], comm_s: list[float],
           comm_b: list[int]) -> None:
    if rank != 0 or not step_times:
        return
    if len(step_times) > 1:                      # the first step creates groups and plans
        step_times, comm_s, comm_b = step_times[1:], comm_s[1:], comm_b[1:]
    t = float(np.median(step_times))
    print(f"[{name}] {samples / t:,.1f} samples/s | step {t * 1e3:.1f} ms | comm on rank 0: "
          f"{np.median(comm_s) * 1e3:.1f} ms/step, {np.median(comm_b) / 1024:.1f} KiB/step sent",
          flush=True)


def finish_log(example: str, args, rank: int, world: int) -> bool:
    """With --log: stop the log, wait until every rank has written its file, and on rank 0
    print the logged calls and bytes per phase against meshcomm.model.for_example (the
    example's flags, times --steps). Returns whether they match (True without --log and on
    other ranks). Runs before --check, whose comparison the model does not count."""
    if not args.log:
        return True
    mc.log.stop()
    ctx = mc.runtime.current()
    if ctx is not None:
        ctx.backend.barrier(time.monotonic() + ctx.timeout)
    if rank != 0:
        return True
    from meshcomm.model.examples import DEFAULTS
    from meshcomm.tools.log_cmd import read
    from meshcomm.tools.log_compare import compare
    flags = {k: getattr(args, k) for k in DEFAULTS[example] if k != "world"}
    cmp = compare(read(args.log).records, example, steps=args.steps, world=world, **flags)
    print(cmp.text(), flush=True)
    return cmp.ok


def finish_check(name: str, diffs: dict[str, float], mesh: mc.Mesh, rank: int, tol: float,
                 log_ok: bool = True) -> None:
    """Print the largest difference from the single-process reference; exit 1 beyond tol
    (or when `log_ok` is False: the log did not match the model)."""
    with mc.log.tag("check"):
        everyone = max_over(list(diffs.values()), mesh, rank)
    mine = worst(diffs.values())
    if not mine <= tol:                 # NaN too
        what = next(k for k, v in diffs.items() if not v <= tol)
        print(f"[{name}] rank {rank}: {what} differs by {mine:.3g} > {tol:g}", file=sys.stderr, flush=True)
    if not diffs:
        print(f"[{name}] rank {rank}: nothing was compared", file=sys.stderr, flush=True)
    if rank == 0:
        ok = everyone <= tol
        print(f"[{name}] check: largest difference vs single process {everyone:.3g} "
              f"(tolerance {tol:g}) {'OK' if ok else 'FAILED'}", flush=True)
    sys.exit(0 if diffs and mine <= tol and (rank != 0 or everyone <= tol) and log_ok else 1)


def maxdiff(a, b) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0
