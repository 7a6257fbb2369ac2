"""A peer that never joins: the last rank never calls meshcomm.init; the others must get a
PeerTimeoutError naming it from init within MESHCOMM_TIMEOUT, for each backend.

    MESHCOMM_TIMEOUT=3 mpiexec -n 4 python -m mpi4py tests/workers/join_worker.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch  # noqa: F401  (imported before timing: the bound is on waiting for the peer, not on import)
from mpi4py import MPI

import meshcomm as mc
from meshcomm.errors import PeerTimeoutError

BACKENDS = ("mpi", "torch", "mixed")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    timeout = float(os.environ["MESHCOMM_TIMEOUT"])
    lag = n - 1
    res = {"rank": rank}
    if rank == lag:
        time.sleep(len(BACKENDS) * (timeout + 2) + 2)   # "never" joins while the others try
    else:
        for b in BACKENDS:
            t0 = time.monotonic()
            try:
                mc.init(backend=b)
            except PeerTimeoutError as e:
                res[b] = {"seconds": round(time.monotonic() - t0, 2), "peers": list(e.peers),
                          "names_lag": str(lag) in str(e)}
            else:
                raise AssertionError(f"rank {rank}: init({b!r}) returned although rank {lag} never joined")
    line = json.dumps(res)
    print("RESULT " + line, flush=True)
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            f.write(line)


if __name__ == "__main__":
    main()
