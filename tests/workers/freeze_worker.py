"""SPMD worker: the last rank freezes (SIGSTOP) at one stage of a call; every other rank must
raise within MESHCOMM_TIMEOUT (+ slack) and never return a wrong value.

    mpiexec -n 4 python tests/workers/freeze_worker.py --init mpi --stage transfer --form program --out DIR

Stages: `agreement` (before it constructs: the others wait in the agreement), `create` (in
the communicator creation of a construction: a native collective Program on a sub-group over
MPI, `new_group` over torch), `transfer` (50 ms into a loop of 16 MiB reshards). Forms: `eager`
(mc.reshard / mc.all_reduce) or `program` (mc.Program). After its stage each survivor makes
one more call over every rank (a survivor whose own part could finish learns of the failure
there). Survivors write OUT/rank<r>.json {seconds, error} and wait for each other's; rank 0
then kills the frozen rank.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import meshcomm as mc
from meshcomm.errors import PeerError, PeerTimeoutError


def freeze():
    os.kill(os.getpid(), signal.SIGSTOP)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", default="mpi")
    ap.add_argument("--stage", required=True, choices=["agreement", "create", "transfer"])
    ap.add_argument("--form", required=True, choices=["eager", "program", "lean"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    # a survivor still here long after its timeout (or one that crashes) prints every
    # thread's stack: the test shows this output when a survivor's result is missing
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(float(os.environ.get("MESHCOMM_TIMEOUT", "3")) + 40, exit=False)
    ctx = mc.init(backend=a.init)
    me, n = ctx.rank, ctx.world_size
    lag = n - 1
    from mpi4py import MPI
    pids = MPI.COMM_WORLD.allgather(os.getpid())
    world = mc.Mesh(np.arange(n), ("x",))
    src, dst = mc.Layout(world, ("x",)), mc.Layout(world, (None, "x"))
    rows = 16 * 1024 * 1024 // 4 // n * n // 1024
    x = np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024)
    sh = mc.shard(x, src)
    mine = {d: sh[d] for d in ctx.owned_devices(src)}
    ref = mc.reshard(sh, src, dst, backend="local")
    grid = mc.Mesh(np.arange(n).reshape(2, n // 2), ("a", "b"))
    tile = {me: np.full(3, float(me))}
    MPI.COMM_WORLD.Barrier()
    t0 = time.monotonic()
    err = None
    try:
        if a.stage == "agreement":
            if me == lag:
                freeze()
            if a.form == "eager":
                mc.reshard(mine, src, dst)
            else:
                mc.Program.reshard(src, dst, shape=x.shape, dtype=x.dtype)
        elif a.stage == "create":
            if me == lag:                       # frozen inside the communicator's creation
                from meshcomm.backends import mpi as mpi_backend
                make = mpi_backend.MPIBackend._create

                def frozen(self, *args, **kw):
                    freeze()
                    return make(self, *args, **kw)
                mpi_backend.MPIBackend._create = frozen
                if "torch" in ctx._backends:
                    import torch.distributed as dist
                    new_group = dist.new_group

                    def frozen_group(*args, **kw):
                        freeze()
                        return new_group(*args, **kw)
                    dist.new_group = frozen_group
            # a collective over the mesh's rows (groups of n/2 ranks): over MPI a communicator
            # of the Program's own per group, over torch a process group per row
            if a.form == "eager":
                mc.all_reduce(tile, grid, "b")
            else:
                mc.Program.all_reduce(grid, "b", shape=(3,), dtype="float64")(tile)
        else:
            prog = mc.Program.reshard(src, dst, shape=x.shape, dtype=x.dtype) if a.form != "eager" else None
            assert a.form != "lean" or prog._lean is not None, "no lean run"
            MPI.COMM_WORLD.Barrier()
            if me == lag:                       # after the barrier: frozen inside it, the last
                threading.Timer(0.05, freeze).start()   # rank could hold a survivor there
            t0 = time.monotonic()
            for _ in range(10000):
                y = prog(mine) if prog is not None else mc.reshard(mine, src, dst)
                for d, v in y.items():          # never a wrong value
                    assert np.array_equal(v, ref[d]), f"rank {me}: wrong value on device {d}"
        # the stage returned here: one more call over every rank must raise
        mc.all_reduce(tile, mc.Mesh(np.arange(n), ("x",)), "x")
    except (PeerTimeoutError, PeerError, ValueError, RuntimeError) as e:
        err = f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    tmp = os.path.join(a.out, f".rank{me}.tmp")
    with open(tmp, "w") as f:
        json.dump({"rank": me, "seconds": round(dt, 2), "error": err}, f)
    os.replace(tmp, os.path.join(a.out, f"rank{me}.json"))     # whole, or not there
    sys.stdout.flush()
    # every survivor waits for the others' results before it leaves: MPICH's launcher ends
    # the whole job as soon as one process exits without MPI_Finalize, so a survivor leaving
    # at once took a slower one (still in its error path) with it
    deadline = time.time() + 60
    while time.time() < deadline and sum(f.endswith(".json") for f in os.listdir(a.out)) < n - 1:
        time.sleep(0.05)
    if me == 0:
        os.kill(pids[lag], signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main()
