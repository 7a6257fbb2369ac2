"""CPU per call of a small reshard and reshard_many: a Program beside the eager call, 2 processes.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/eager_cpu.py [--calls 300] [--reps 7]

The eager call finds the Program it ran last with the same arguments and runs it where its
tiles are that Program's common run (`kernel.quick`); this measures what the eager call costs
beyond the Program's own run. Forms, each a loop of `--calls` calls, taking turns in each of
`--reps` rounds (after a warm-up): a reshard of a (4n, 4n) float32 tensor from rows to columns
(`shape=` given; NumPy tiles, and torch tiles), and reshard_many of 16 such tensors (torch
tiles, `shapes=` given), each as `mc.Program...` constructed once and as the eager call. Per
loop: this process's CPU (time.process_time) / calls, averaged over the processes; the
median over rounds, and each eager form's ratio to its Program per round (median).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshcomm as mc  # noqa: E402
from meshcomm.tools.common import script_parser  # noqa: E402


def main(argv=None) -> int:
    ap = script_parser(__doc__, reps=7)
    ap.add_argument("--calls", type=int, default=300, help="calls per timed loop (default 300)")
    args = ap.parse_args(argv)
    import torch
    from mpi4py import MPI
    ctx = mc.init(backend="mpi")
    n, me, world = ctx.world_size, ctx.rank, MPI.COMM_WORLD
    m = mc.Mesh(np.arange(n), ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))
    shape = (4 * n, 4 * n)
    x = {me: np.ones((4, 4 * n), np.float32)}
    xt = {me: torch.ones(4, 4 * n)}
    names = [f"w{i}" for i in range(16)]
    xs = {k: xt for k in names}
    shapes = dict.fromkeys(names, shape)
    p_np = mc.Program.reshard(src, dst, shape=shape, dtype="float32")
    p_t = mc.Program.reshard(src, dst, shape=shape, dtype=torch.float32)
    p_many = mc.Program.reshard_many(src, dst, shapes=shapes, dtypes=torch.float32)
    forms = {
        "reshard numpy program": lambda: p_np(x),
        "reshard numpy eager": lambda: mc.reshard(x, src, dst, shape=shape, dtype="float32"),
        "reshard torch program": lambda: p_t(xt),
        "reshard torch eager": lambda: mc.reshard(xt, src, dst, shape=shape, dtype=torch.float32),
        "reshard_many program": lambda: p_many(xs),
        "reshard_many eager": lambda: mc.reshard_many(xs, src, dst, shapes=shapes, dtypes=torch.float32),
    }
    for f in forms.values():
        f()
    cpu = {k: [] for k in forms}
    for rnd in range(args.reps + 1):
        for k, f in forms.items():
            world.Barrier()
            c0 = time.process_time()
            for _ in range(args.calls):
                f()
            c = world.allreduce((time.process_time() - c0) / args.calls) / n
            if rnd:
                cpu[k].append(c)
    mc.finalize()
    if me != 0:
        return 0
    print(f"{n} processes, {args.calls} calls per loop, median of {args.reps} rounds (CPU per call and process)")
    for k, v in cpu.items():
        line = f"{k:<24} {statistics.median(v) * 1e6:8.1f} us"
        if k.endswith("eager"):
            prog = cpu[k.replace("eager", "program")]
            line += f"   eager / program {statistics.median(a / b for a, b in zip(v, prog)):.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
