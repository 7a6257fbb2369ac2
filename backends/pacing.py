"""Link emulation for benchmarks: a per-process token bucket pacing sends between emulated nodes.

`MESHCOMM_EMULATE_GBPS=g` makes every process send at most g Gb/s to processes on other
emulated nodes (`MESHCOMM_EMULATE_NODE_SIZE` consecutive ranks per node, 1 by default:
every process its own node). It is an emulation of a slow network for benchmarks (what
compression is for), not a network model: each message of n bytes gets the next free slot
of n * 8 / g seconds on its sender's bucket (no burst), and is handed to MPI / gloo at the
end of its slot, so its receiver sees it no earlier than a g Gb/s link would deliver it.
Messages inside a node, and everything with the variable unset (the default), go out at
once as before.

What is paced: point-to-point sends (`isend`) of the MPI and torch backends, and MPI
broadcasts done as the root's sends to each member (emulation turns every MPI broadcast
into those); a torch broadcast's root waits for its slot (k-1 messages) before issuing
it. Native collectives (MPI_Ireduce of integers, the backends' allreduce/allgatherv/...)
are not paced.
"""
from __future__ import annotations

import collections
import time

from meshcomm import settings

from .base import Work

__all__ = ["AllOf", "Paced", "Pacer", "pacer"]


class Pacer:
    """One process's token bucket: `bytes_per_s` out of the process, to other nodes."""

    def __init__(self, gbps: float, rank: int, node_size: int):
        self.bytes_per_s = gbps * 1e9 / 8
        self.node_size = node_size
        self.node = rank // node_size
        self.free = 0.0         # when the bucket's current backlog has been sent
        self.queue: collections.deque = collections.deque()    # Paced sends not issued yet

    def crosses(self, peer: int) -> bool:
        """Whether a message to world rank `peer` leaves this process's emulated node."""
        return peer // self.node_size != self.node

    def release(self, nbytes: int) -> float:
        """The monotonic time at which a message of `nbytes` issued now has been sent."""
        start = max(time.monotonic(), self.free)
        self.free = start + nbytes / self.bytes_per_s
        return self.free

    def send(self, issue, nbytes: int, op: str, peers: tuple[int, ...]) -> Paced:
        """A Paced send of `nbytes` (issue() hands it to the backend and returns its Work)."""
        w = Paced(self, issue, self.release(nbytes), op, peers)
        self.queue.append(w)
        return w

    def pump(self) -> None:
        """Issue, in the order they were made, the sends whose time has come (messages to a
        peer on one tag must reach the backend in order)."""
        now = time.monotonic()
        while self.queue and (self.queue[0].release <= now or self.queue[0].cancelled):
            w = self.queue.popleft()
            if not w.cancelled:
                w.inner = w.issue()


_PACERS: dict = {}


def pacer(rank: int) -> Pacer | None:
    """This process's Pacer under MESHCOMM_EMULATE_GBPS, else None (read on every call)."""
    g = settings.get("EMULATE_GBPS")
    if g is None:
        return None
    key = (g, settings.get("EMULATE_NODE_SIZE"), rank)
    p = _PACERS.get(key)
    if p is None:
        _PACERS.clear()
        p = _PACERS[key] = Pacer(g, rank, key[1])
    return p


class Paced(Work):
    """A send handed to the backend (`issue()`, returning its Work) at `release`, in order
    with the process's other paced sends: polling issues it once its time has come;
    `force()` sleeps until then (for a backend that waits by blocking, not polling)."""

    def __init__(self, owner: Pacer, issue, release: float, op: str, peers: tuple[int, ...]):
        self.owner, self.issue, self.release, self.op, self.peers = owner, issue, release, op, peers
        self.inner: Work | None = None
        self.cancelled = False

    @property
    def lingers(self) -> bool:
        return self.inner is not None and self.inner.lingers

    @property
    def work(self):
        """The backend's own handle once issued (torch waits on it), else None."""
        return getattr(self.inner, "work", None) if self.inner is not None else None

    def force(self) -> None:
        if self.inner is None and not self.cancelled:
            time.sleep(max(0.0, self.release - time.monotonic()))
            self.owner.pump()

    def test(self) -> bool:
        if self.inner is None:
            if self.cancelled:
                return True
            self.owner.pump()
            if self.inner is None:
                return False
        return self.inner.test()

    def cancel(self) -> None:
        if self.inner is None:
            self.cancelled = True
            return
        c = getattr(self.inner, "cancel", None)
        if c is not None:
            c()


class AllOf(Work):
    """Several works completing together (a paced point-to-point broadcast)."""

    def __init__(self, works, op: str, peers: tuple[int, ...]):
        self.works, self.op, self.peers = list(works), op, peers

    @property
    def lingers(self) -> bool:
        return any(w.lingers for w in self.works)

    def test(self) -> bool:
        self.works = [w for w in self.works if not w.test()]
        return not self.works

    def cancel(self) -> None:
        for w in self.works:
            c = getattr(w, "cancel", None)
            if c is not None:
                c()
