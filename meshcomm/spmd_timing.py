"""Timing SPMD code across MPI ranks, shared by `meshcomm bench run`, `make demo` and
benchmarks/: every method is timed the same way.

A repeat is: a barrier, the call, this rank's elapsed time, a barrier, the maximum over
ranks. Both barriers wait politely (Ibarrier polled with sched_yield): MPI's blocking
barrier spins, and on a host with more ranks than cores (8 processes on 2 cores here) a
rank idle in it steals the core a rank still working needs. A method that leaves some
ranks idle (meshcomm sends only to the ranks that need data) would then be charged for
its idle ranks' spinning, which ranks with a core each (a real cluster) never pay.
"""
from __future__ import annotations

import os
import statistics
import time

__all__ = ["polite_barrier", "time_once", "time_repeats"]


def polite_barrier(comm, timeout: float | None = None) -> None:
    """Ibarrier polled with sched_yield; PeerTimeoutError after `timeout` seconds
    (default MESHCOMM_TIMEOUT) instead of a hang when a rank never arrives."""
    from .errors import PeerTimeoutError
    from .runtime import _timeout
    req = comm.Ibarrier()
    deadline = time.monotonic() + _timeout(timeout)
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
