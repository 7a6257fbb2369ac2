"""The agreement check's round of hashes: every rank's small int64 vector to every other rank.

`start(be, vec, tag)` posts it and returns a `Round` to poll; `Round.rows` holds every rank's
vector once it completes (row r from rank r). Over MPI (a backend whose `comm` is an mpi4py
communicator) the round is mpi4py's own Isend/Irecv requests, polled with one `Testall`:
no Python-level work objects per message and per poll (on a host with more processes than
cores, that CPU is taken from the peers moving data). Other backends use their
`isend`/`irecv` works.

A timeout names exactly the ranks whose vectors did not arrive (PeerTimeoutError). The
vectors travel on the backend's data communicator: every rank starts the round before any
data of the call, and MPI keeps messages between two ranks with one tag in order, so the
round never takes a data message of the same tag.
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .base import Work, backoff, timeout_error, wait_polling

__all__ = ["Round", "start"]

class _Peer(Work):
    """A peer's vector, for naming it in a timeout."""

    def __init__(self, peer: int, op: str):
        self.peers, self.op = (peer,), op


class Round:
    def __init__(self, be, rows: np.ndarray, works: Sequence = (), reqs=None, peers=()):
        self.be, self.rows, self.works, self.reqs, self.peers = be, rows, list(works), reqs, tuple(peers)

    def test(self) -> bool:
        if self.reqs is not None:
            from mpi4py import MPI
            return MPI.Request.Testall(self.reqs)
        self.works = [w for w in self.works if not w.test()]
        return not self.works

    def wait(self, deadline: float | None) -> None:
        """Poll until done (yielding the core as every wait does); PeerTimeoutError naming
        the ranks whose vectors are missing at `deadline`. (Napping between polls instead
        was measured slower here: 8 processes on 2 cores, alpa1 8.0 ms against 7.1 ms.)"""
        if self.reqs is None:
            try:
                wait_polling(self.works, deadline, self.be.rank, self.be.timeout)
            except BaseException:
                self.cancel()
                raise
            return
        spins = 0
        while not self.test():
            if deadline is not None and time.monotonic() > deadline:
                missing = self.missing()
                self.cancel()
                raise timeout_error(self.be.rank, missing, self.be.timeout)
            spins += 1
            backoff(spins)

    def missing(self) -> list:
        if self.reqs is None:
            return self.works
        n = len(self.peers)
        return [_Peer(p, "the agreement check") for p, r in zip(self.peers, self.reqs[:n]) if not r.Test()]

    def cancel(self) -> None:
        if self.reqs is not None:
            for r in self.reqs:
                try:
                    r.Cancel()
                except Exception:  # noqa: BLE001 - best effort after a timeout
                    pass
            return
        for w in self.works:
            c = getattr(w, "cancel", None)
            if c is not None:
                c()


def start(be, vec: np.ndarray, tag: int) -> Round:
    """Post the round: `vec` to every other rank, theirs into the rows of a fresh array."""
    me, n = be.rank, be.world_size
    rows = np.empty((n, len(vec)), np.int64)
    rows[me] = vec
    peers = [r for r in range(n) if r != me]
    comm = getattr(be, "comm", None)
    if comm is not None and hasattr(comm, "Irecv") and hasattr(comm, "Isend"):      # mpi4py
        reqs = [comm.Irecv(rows[r], source=r, tag=tag) for r in peers]
        reqs += [comm.Isend(vec, dest=r, tag=tag) for r in peers]
        return Round(be, rows, reqs=reqs, peers=peers)
    works = [be.irecv(rows[r], r, tag) for r in peers] + [be.isend(vec, r, tag) for r in peers]
    for w in works:
        w.op = "the agreement check"
    return Round(be, rows, works)
