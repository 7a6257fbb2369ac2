"""SPMD worker: the native collective primitives of a backend, checked against NumPy.

Run under mpiexec (4 processes; torch's process group is set up through MPI)::

    mpiexec -n 4 python tests/workers_collectives/coll_worker.py --init mpi --backends mpi --timeout-test
    mpiexec -n 4 python tests/workers_collectives/coll_worker.py --init mixed --backends torch,mixed --timeout-test

Phases, each on every backend named:
* cases: every primitive x dtype x count pattern (empty, equal, uneven with an empty
  member, several KiB) on groups one after another (the world, pairs, threes, overlapping),
  issued together per group and waited for at once; bad arguments raise ValueError.
* interleave (mixed): ops on overlapping groups spread over MPI and torch by an
  alternating tuning table, all issued in one order, then waited for at once; again,
  waiting for each backend's works separately, in an order that differs between ranks.
* timeouts (--timeout-test; MESHCOMM_TIMEOUT=5): the last rank skips the calls; the others
  must raise PeerTimeoutError naming it within the timeout.
Each rank writes OUT/rank<r>.json; any failure raises (non-zero exit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import meshcomm as mc                                  # noqa: E402
from meshcomm.backends import tuning                   # noqa: E402
from meshcomm.backends.mixed import MixedBackend       # noqa: E402
from meshcomm.errors import PeerTimeoutError           # noqa: E402
from coll_cases import PRIMS, cases_for_group, make_case  # noqa: E402

LONG = 120.0        # deadline of the phases that must succeed (MESHCOMM_TIMEOUT may be 5)


def groups_of(world):
    w = tuple(range(world))
    return [w, (0, 1), (2, 3), (0, 1, 2), (1, 2, 3), (1, 3), (0, 3), (0, 1, 3)]


def prepare(b, groups):
    deadline = time.monotonic() + LONG
    for m in b.members():
        m.prepare_groups(groups, deadline)


def kind_of(b):
    return "numpy" if b.name == "mixed" else b.wire


def run_cases(b, rank, world, seed, stats):
    for group in groups_of(world):
        if rank not in group:
            continue
        cases = cases_for_group(seed, group, bf16=b.name == "torch")
        issued = [(c, *c.issue(b, rank, kind_of(b))) for c in cases]
        b.wait_all([w for _, w, _ in issued], time.monotonic() + LONG)
        for c, _, out in issued:
            c.check(rank, out)
        stats[f"cases_{b.name}"] += len(cases)
        b.wait_all([b.ibarrier(group)], time.monotonic() + LONG)
        stats[f"barriers_{b.name}"] += 1


def bad_arguments(b, rank, world, stats):
    """Errors raised before anything is issued, naming the value."""
    x = np.ones(4, dtype=np.float32)
    if b.wire == "torch":
        import torch
        x = torch.from_numpy(x)
    w = tuple(range(world))
    other = (rank + 1) % world
    checks = [
        (lambda: b.allreduce(x, "avg", w), "avg"),
        (lambda: b.allgatherv(x, x, [4] * (world - 1), w), "counts"),
        (lambda: b.allreduce(x, "sum", tuple(r for r in w if r != rank)), f"rank {rank}"),
        (lambda: b.allreduce(x, "sum", (other, rank) if other > rank else (rank, other)), "sorted"),
        (lambda: b.gatherv(x, x, [4] * world, world + 3, w), f"root rank {world + 3}"),
        (lambda: b.alltoall(x[:3], x[:3], w), "equal blocks"),
    ]
    for fn, text in checks:
        try:
            fn()
        except ValueError as e:
            assert text in str(e), (text, str(e))
            stats[f"bad_args_{b.name}"] += 1
        else:
            raise AssertionError(f"{b.name}: no ValueError for {text}")


def alternating() -> tuning.TuningTable:
    """MPI and torch alternate every 64 bytes, for every op."""
    rules = []
    for op in tuning.OPS:
        for k in range(256):
            rules.append(tuning.Rule(op=op, backend="mpi" if k % 2 == 0 else "torch",
                                     min_bytes=64 * k, max_bytes=64 * k + 63))
    return tuning.TuningTable(tuple(rules))


TABLE_OP = {"allreduce": "allreduce", "reduce": "reduce", "bcast": "bcast", "allgatherv": "allgather",
            "reduce_scatterv": "reduce_scatter", "alltoall": "alltoall", "gatherv": "gather", "scatterv": "scatter"}


def interleave(ctx, rank, world, seed, stats, nops=32):
    mixed = MixedBackend(ctx.get_backend("mpi"), ctx.get_backend("torch"), alternating())
    rng = np.random.default_rng([seed, 99])
    groups = groups_of(world)
    cases = []
    for k in range(nops):
        prim = PRIMS[k % len(PRIMS)]
        group = groups[rng.integers(0, len(groups))]  # the world, pairs, threes: overlapping
        dtype = ["float64", "int32", "int64"][k % 3]
        counts = tuple(int(c) for c in rng.integers(0, 24, len(group)))
        cases.append(make_case(rng, prim, group, dtype, counts, "sum", k))
    for rnd, how in enumerate(("mixed", "per-backend")):
        mine = [c for c in cases if rank in c.group]
        issued = []
        for c in mine:          # each on the member the table names (as a Program chooses at construction)
            member = mixed.choose(TABLE_OP[c.prim], sum(c.counts) * np.dtype(c.dtype).itemsize, len(c.group), "cpu")
            issued.append((c, *c.issue(member, rank, member.wire)))
        works = [w for _, w, _ in issued]
        if how == "mixed":
            mixed.wait_all(works, time.monotonic() + LONG)
        else:                   # any order of waits, once everything is issued
            by = {"mpi": [w for w in works if not hasattr(w, "work")],
                  "torch": [w for w in works if hasattr(w, "work")]}
            order = ("torch", "mpi") if rank % 2 == 0 else ("mpi", "torch")
            for name in order:
                getattr(mixed, name).wait_all(by[name], time.monotonic() + LONG)
        for c, _, out in issued:
            c.check(rank, out)
        used = [hasattr(w, "work") for w in works]          # True: a torch work
        stats[f"interleave_{how}"] = len(issued)
        stats[f"interleave_{how}_torch"] = sum(hasattr(w, "work") for w in works)
        stats[f"interleave_{how}_switches"] = sum(a != b for a, b in zip(used, used[1:]))


def run_timeouts(ctx, backends, rank, world, stats):
    """The last rank skips every call; the others must raise naming it within the timeout."""
    lag, timeout = world - 1, ctx.timeout
    w = tuple(range(world))
    three = tuple(range(1, world))
    f = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731

    def tensor(a, b):
        if b.wire != "torch":
            return a
        import torch
        return torch.from_numpy(a)
    tests = []              # (label, backend, issue): every test waits on the world
    for name in backends:
        b = ctx.get_backend(name)
        if name == "mixed":     # one op of each backend in flight at once
            tests.append(("mixed", b, lambda b=b: [b.mpi.alltoall(f(4 * world), f(4 * world), w)] + (
                [b.torch.ibarrier((0, 1, 3))] if rank in (0, 1) else [])))
        else:
            tests.append((name, b, lambda b=b: [b.allreduce(tensor(f(8), b), "sum", w)] + (
                [b.reduce_scatterv(tensor(f(9), b), tensor(f(3), b), [3, 3, 3], "max", three)]
                if rank in three else [])))
    if rank == lag:
        return
    for label, b, issue in tests:
        t0 = time.monotonic()
        works = issue()
        try:
            b.wait_all(works, t0 + timeout)
        except PeerTimeoutError as e:
            dt = time.monotonic() - t0
            assert lag in e.peers, f"timeout [{label}]: rank {rank}: {e} does not name {lag}"
            assert dt < timeout + 4, f"timeout [{label}]: raised after {dt:.1f}s (timeout {timeout}s)"
            stats[f"timeout_{label}"] = round(dt, 2)
        else:
            raise AssertionError(f"timeout [{label}]: rank {rank}: completed without rank {lag}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mpi")
    ap.add_argument("--backends", default="mpi")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-test", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.time()
    ctx = mc.init(backend=args.init)
    rank, world = ctx.rank, ctx.world_size
    assert world == 4, "the groups are written for 4 processes"
    stats: Counter = Counter()
    names = args.backends.split(",")
    for name in names:
        prepare(ctx.get_backend(name), groups_of(world))
    for name in names:
        if name != "mixed":
            b = ctx.get_backend(name)
            bad_arguments(b, rank, world, stats)
            run_cases(b, rank, world, args.seed, stats)
    if "mixed" in names:
        interleave(ctx, rank, world, args.seed, stats)
    if args.timeout_test:
        run_timeouts(ctx, names, rank, world, stats)
    from mpi4py import MPI
    MPI.COMM_WORLD.Barrier()                # the lagging rank waits here for the others
    stats["seconds"] = round(time.time() - t0, 1)
    line = json.dumps({"rank": rank, **stats})
    print("RESULT " + line, flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
            fh.write(line)
    # a normal exit, even after timeouts (requests the lagging rank never matched are still
    # pending): MPICH sends its launcher PMI finalize from an exit hook, so a process leaving
    # by os._exit closes its PMI socket unannounced and hydra SIGKILLs every process still
    # exiting (exit code 9, now and then)
    mc.finalize()


if __name__ == "__main__":
    main()
