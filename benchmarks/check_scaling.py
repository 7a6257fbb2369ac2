"""The cost of reshard's metadata check as the number of processes grows.

    .venv/bin/python benchmarks/check_scaling.py [--procs 4,8,16,32] [--reps 40] [--json FILE]

launches `mpiexec -n N` for each N (or run it under `mpiexec -n N` for one row). Every rank
owns one device; a float32 vector of 64 elements per device, sharded over all devices,
moves to the same layout on the devices rotated by one (each rank sends 256 B to its
neighbour: the plan's data is tiny, so the check dominates).

Columns, per N (median of --reps per round, the median of 3 interleaved rounds, slowest
rank per repeat, polite barriers: meshcomm.tools.spmd):
* exchange only: the check's own communication with a realistic blob: `allgather` (every
  rank's pickled blob to every rank, the way that names a missing peer) and `allreduce`
  (one MIN-allreduce of a 15-int64 vector of hashes);
* whole reshard call: `check off` (MESHCOMM_CHECK=0, shape= and dtype= given), and the
  check through each exchange (MESHCOMM_CHECK_EXCHANGE=allgather|allreduce).
On a machine with fewer cores than processes each dependent round of the allreduce waits
for its partner to be scheduled, so this understates what the allreduce saves on hardware
with a core per rank; the message count per rank (2(N-1) against about 2 log2 N) is the
part that does not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def measure(reps: int) -> dict | None:
    import numpy as np
    from mpi4py import MPI

    import meshcomm as mc
    from meshcomm import runtime
    from meshcomm.tools.spmd import time_repeats

    comm = MPI.COMM_WORLD
    n, me = comm.size, comm.rank
    ctx = mc.init(backend="mpi")
    be = ctx.get_backend("mpi")
    src = mc.Layout(mc.Mesh(np.arange(n), ("x",)), ("x",))
    dst = mc.Layout(mc.Mesh(np.roll(np.arange(n), 1), ("x",)), ("x",))
    x = np.arange(n * 64, dtype=np.float32)
    mine = {me: mc.shard(x, src)[me]}
    p = mc.plan(x.shape, "float32", src, dst)
    blob = {"err": None, "layouts": runtime._layouts_fp(src, dst), "desc": f"src={src} dst={dst}",
            "backend": "mpi", "shape": x.shape, "dtype": ("float32", 4), "tiles": {me: (64,)},
            "kind": "numpy", "devtype": "cpu", "plan": p.fingerprint, "opt": True, "guess": None}
    vec = runtime._check_vector(blob)

    methods = {
        "exchange allgather": (None, lambda: be.allgather_obj(blob, time.monotonic() + 60)),
        "exchange allreduce": (None, lambda: be.allreduce_min(vec, time.monotonic() + 60)),
        "check off": (("0", "allgather"), None),
        "check allgather": (("1", "allgather"), None),
        "check allreduce": (("1", "allreduce"), None),
    }

    def call():
        return mc.reshard(mine, src, dst, shape=x.shape, dtype="float32")

    rounds: dict[str, list[float]] = {k: [] for k in methods}
    want = mc.shard(x, dst)
    for _ in range(3):
        for name, (env, fn) in methods.items():
            if env is not None:
                os.environ["MESHCOMM_CHECK"], os.environ["MESHCOMM_CHECK_EXCHANGE"] = env
                fn = call
            t, out = time_repeats(comm, fn, reps, 10)
            rounds[name].append(t)
            if env is not None:
                assert np.array_equal(out[me], want[me]), name
    mc.finalize()
    if me != 0:
        return None
    return {"procs": n, **{k: sorted(v)[1] for k, v in rounds.items()}}


def main(argv=None):
    from meshcomm.tools.common import script_parser
    ap = script_parser(__doc__, reps=40)
    ap.add_argument("--procs", default="4,8,16,32")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        row = measure(args.reps)
        if row is not None:
            print("ROW " + json.dumps(row), flush=True)
        return
    from meshcomm.tools import spmd
    from meshcomm.tools.common import progress, write_json
    rows = []
    for n in progress([int(v) for v in args.procs.split(",")], desc="check scaling", unit="launch"):
        try:
            r = spmd.launch(n, [__file__, "--one", "--reps", str(args.reps)], timeout=1200, capture=True)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        if r.returncode != 0 or not line:
            raise SystemExit(f"mpiexec -n {n} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        rows.append(json.loads(line[0][4:]))
    names = [k for k in rows[0] if k != "procs"]
    print("metadata check, 256 B per rank to its neighbour; median us (slowest rank per repeat)")
    print(f"{'procs':>5s} " + " ".join(f"{k:>19s}" for k in names)
          + "   exchange ag/ar   check cost ag/ar")
    for r in rows:
        ex = r["exchange allgather"] / r["exchange allreduce"]
        cost_ag = r["check allgather"] - r["check off"]
        cost_ar = r["check allreduce"] - r["check off"]
        ratio = f"{cost_ag / cost_ar:15.2f}x" if cost_ar > 0 else f"{'-':>16s}"
        print(f"{r['procs']:5d} " + " ".join(f"{r[k] * 1e6:19.0f}" for k in names) + f"  {ex:14.2f}x {ratio}")
    if args.json:
        write_json(args.json, rows, say=False)


if __name__ == "__main__":
    main()
