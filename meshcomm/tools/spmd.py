"""SPMD helpers shared by `meshcomm bench run`, `make demo` and benchmarks/: timing across MPI
ranks, the exactness check of a resharded result, and launching mpiexec on a module or script.

Every method is timed the same way. A repeat is: a barrier, the call, this rank's elapsed
time, a barrier, the maximum over ranks. Both barriers wait politely (Ibarrier polled with
sched_yield): MPI's blocking barrier spins, and on a host with more ranks than cores (8
processes on 2 cores here) a rank idle in it steals the core a rank still working needs. A
method that leaves some ranks idle (meshcomm sends only to the ranks that need data) would
then be charged for its idle ranks' spinning, which ranks with a core each (a real cluster)
never pay.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

__all__ = ["polite_barrier", "time_once", "time_repeats", "exact", "find_mpiexec", "launch"]


def polite_barrier(comm, timeout: float | None = None) -> None:
    """Ibarrier polled with sched_yield; PeerTimeoutError after `timeout` seconds
    (default MESHCOMM_TIMEOUT) instead of a hang when a rank never arrives."""
    from meshcomm import settings
    from meshcomm.errors import PeerTimeoutError
    req = comm.Ibarrier()
    deadline = time.monotonic() + (settings.get("TIMEOUT") if timeout is None else float(timeout))
    spins = 0
    while not req.Test():
        os.sched_yield()
        spins += 1
        if spins % 1024 == 0 and time.monotonic() > deadline:
            raise PeerTimeoutError(f"rank {comm.Get_rank()}: a benchmark barrier did not complete "
                                   "within MESHCOMM_TIMEOUT: some rank did not arrive or died",
                                   (), "barrier")


def time_once(comm, fn):
    """(seconds of the slowest rank, this rank's result) for one collective call of fn."""
    from mpi4py import MPI
    polite_barrier(comm)
    t0 = time.perf_counter()
    out = fn()
    t = time.perf_counter() - t0
    polite_barrier(comm)
    return comm.allreduce(t, op=MPI.MAX), out


def time_repeats(comm, fn, repeats: int, warmup: int = 1):
    """(median seconds, last result) over `repeats` after `warmup` calls."""
    out, ts = None, []
    for i in range(warmup + repeats):
        t, out = time_once(comm, fn)
        if i >= warmup:
            ts.append(t)
    return statistics.median(ts), out


def exact(comm, dst, shape, g: np.ndarray, y, reassemble: bool = False) -> bool:
    """Whether every rank's result is exact (the same answer on every rank; collective).

    Device d is rank d. `y` is this rank's result: a dict {device: tile}, a bare tile or None.
    Each rank in the dst mesh compares its tile with its box of the global tensor `g` (a
    pending-sum dst is not compared tile by tile). With `reassemble`, rank 0 also gathers
    every tile and compares meshcomm.unshard of them with `g`.
    """
    me = comm.rank
    ok = True
    if me in dst.mesh and not dst.is_partial:
        want = g[dst.index_map(shape)[me]]
        got = y.get(me) if isinstance(y, dict) else y
        got = None if got is None else np.asarray(got)
        ok = got is not None and got.shape == want.shape and np.array_equal(got, want)
    if reassemble:
        import meshcomm as mc
        mine = y if isinstance(y, dict) else ({} if y is None else {me: y})
        tiles = comm.gather({d: np.asarray(v) for d, v in mine.items()}, root=0)
        if me == 0:
            merged = {}
            for t in tiles:
                merged.update(t)
            try:
                ok = ok and np.array_equal(mc.unshard(merged, dst), g)
            except ValueError:
                ok = False
    return bool(comm.allreduce(int(not ok)) == 0)


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python interpreter (the mpich wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    return shutil.which("mpiexec")


def launch(procs: int, argv: list[str], *, timeout: float, capture: bool = False,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `mpiexec -n procs python ARGV...` with this interpreter (e.g. ARGV = ["-m",
    "meshcomm.tools.demo", "--worker"] or [__file__, "--one"]) and wait for it.

    MESHCOMM_TIMEOUT defaults to 120 s and OMP_NUM_THREADS to 1 in the children. Raises
    FileNotFoundError when no mpiexec is found and subprocess.TimeoutExpired after `timeout`
    seconds; with `capture`, stdout and stderr are returned as text.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("no mpiexec next to the Python interpreter or on PATH "
                                "(install the mpich wheel: pip install meshcomm[mpi])")
    env = dict(os.environ if env is None else env)
    env.setdefault("MESHCOMM_TIMEOUT", "120")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [mpiexec, "-n", str(procs), sys.executable, *argv]
    return subprocess.run(cmd, timeout=timeout, env=env, capture_output=capture,
                          text=True if capture else None)
