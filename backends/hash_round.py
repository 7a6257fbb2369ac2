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

from .base import Work, abandon, backoff, timeout_error, wait_polling

__all__ = ["Round", "start"]

class _Peer(Work):
    """A peer's vector, for naming it in a timeout."""

    def __init__(self, peer: int, op: str):
        self.peers, self.op = (peer,), op

    def test(self) -> bool:
        return True         # nothing in flight: the round's requests are kept by the round


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
        """Give the round up: cancel its receives (best effort) and keep it, buffers and all,
        until MPI lets go of them (base.abandon)."""
        if self.reqs is None:
            abandon(self.works, cancel=True)
            return
        for r in self.reqs:
            try:
                r.Cancel()
            except Exception:  # noqa: BLE001 - best effort after a timeout
                pass
        abandon([self])


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


class Inbox:
    """Every peer's agreement vectors over MPI, each stamped with the number of the check it
    belongs to (`seq`, counted alike on every rank): one receive per peer always posted, so
    a vector is taken whenever it arrives, whichever check this rank is in.

    A full round (`InboxRound`) sends this rank's vector and waits for every peer's vector
    of the same seq. A lazy check (meshcomm.runtime.agreement) sends nothing unless a peer's
    vector of its seq arrives or its grace runs out. Vectors of an older seq are stale (a
    peer that waited past its grace in a check the others settled without a round) and are
    dropped; a newer one waits for its check. Messages of one peer on one tag arrive in
    order (MPI), so the receive always takes that peer's next vector."""

    def __init__(self, be, tag: int, width: int):
        self.be, self.comm, self.tag, self.width = be, be.comm, tag, width
        self.peers = [r for r in range(be.world_size) if r != be.rank]
        self.bufs = [np.empty(width + 1, np.int64) for _ in self.peers]
        self.reqs = [self.comm.Irecv(b, source=p, tag=tag) for b, p in zip(self.bufs, self.peers)]
        self.got: list[dict] = [{} for _ in self.peers]     # per peer: seq -> vector
        self.sending: list = []                               # (request, buffer) of our vectors

    def poll(self) -> None:
        from mpi4py import MPI
        done = MPI.Request.Testsome(self.reqs)
        for i in done or ():
            b = self.bufs[i]
            self.got[i][int(b[0])] = b[1:].copy()
            self.reqs[i] = self.comm.Irecv(b, source=self.peers[i], tag=self.tag)
        if self.sending and MPI.Request.Testall([r for r, _ in self.sending]):
            self.sending = []

    def send(self, seq: int, vec: np.ndarray) -> None:
        msg = np.empty(self.width + 1, np.int64)
        msg[0], msg[1:] = seq, vec
        self.sending += [(self.comm.Isend(msg, dest=p, tag=self.tag), msg) for p in self.peers]

    def any_at(self, seq: int) -> bool:
        return any(seq in g for g in self.got)

    def complete(self, seq: int) -> bool:
        return all(seq in g for g in self.got)

    def rows(self, seq: int, own: np.ndarray) -> np.ndarray:
        rows = np.empty((self.be.world_size, self.width), np.int64)
        rows[self.be.rank] = own
        for p, g in zip(self.peers, self.got):
            rows[p] = g[seq]
        return rows

    def settle(self, seq: int) -> None:
        """Check `seq` is over here: drop its vectors and every older one."""
        if not any(self.got):
            return
        for g in self.got:
            for s in [s for s in g if s <= seq]:
                del g[s]

    def missing(self, seq: int) -> list:
        return [_Peer(p, "the agreement check") for p, g in zip(self.peers, self.got) if seq not in g]

    def close(self) -> None:
        """The communicator is being retired (a reset): give up the receives."""
        for r in self.reqs:
            try:
                r.Cancel()
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.reqs = []


class InboxRound:
    """A full round through an Inbox, with Round's interface (`test`, `wait`, `rows`)."""

    def __init__(self, inbox: Inbox, seq: int, vec: np.ndarray):
        self.inbox, self.seq, self.vec, self.be = inbox, seq, vec, inbox.be
        inbox.send(seq, vec)
        self.rows = None

    def test(self) -> bool:
        if self.rows is not None:
            return True
        self.inbox.poll()
        if self.inbox.complete(self.seq):
            self.rows = self.inbox.rows(self.seq, self.vec)
            self.inbox.settle(self.seq)
            return True
        return False

    def wait(self, deadline: float | None) -> None:
        spins = 0
        while not self.test():
            if deadline is not None and time.monotonic() > deadline:
                raise timeout_error(self.be.rank, self.inbox.missing(self.seq), self.be.timeout)
            spins += 1
            backoff(spins)


def inbox_of(be, tag: int, width: int) -> "Inbox | None":
    """The Inbox of an MPI backend's current data communicator (a new one after a reset);
    None for a backend that is not mpi4py's."""
    comm = getattr(be, "comm", None)
    if comm is None or not (hasattr(comm, "Irecv") and hasattr(comm, "Isend")):
        return None
    box = getattr(be, "_inbox", None)
    if box is None or box.comm is not comm:
        if box is not None:
            box.close()
        box = be._inbox = Inbox(be, tag, width)
    return box
