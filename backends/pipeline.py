"""The event loop of a compressed execution: one process's messages with callbacks and its CPU tasks by priority, for one stage.

Sends and receives are non-blocking; each receive has a callback, run when it completes
(MPI: polled with `test`; torch: gloo's point-to-point works never report completion to
polling, so each receive is waited for on the backend's waiter threads, and sends are
waited for at the end). Between two CPU tasks (encode, decode, add) the
loop polls the network, so chunks move while others are coded; idle, it polls the control
channel too (`base.watch`), so a peer's error ends the stage here within milliseconds, as
in every other wait. `stats` counts the bytes this process put on and took off the wire.
"""
from __future__ import annotations

import heapq
import time
from collections import Counter

import numpy as np

from . import pacing
from . import base
from .base import timeout_error, to_wire

__all__ = ["Engine", "stats"]

stats: Counter = Counter()      # sent_bytes, recv_bytes, messages, calls (this process)
# Idle polling sleeps early and briefly: chunks take milliseconds to code, and with more
# processes than cores a process that spins or yields while it waits takes CPU time from the
# processes that are coding.
SPIN, NAP, NAP_MAX = 8, 2e-5, 5e-4


class Engine:
    """One process's event loop for one stage: messages with callbacks, CPU tasks by priority."""

    def __init__(self, backend, rank: int, deadline):
        self.b, self.rank, self.deadline = backend, rank, deadline
        self.pending: list = []         # (work, callback or None, (peer, tag) of a receive), in issue order
        self.tasks: list = []           # heap of (priority, seq, fn)
        self.seq = 0
        self.done: list = []            # completed works the backend waits on at the end
        self.torch = backend is not None and backend.wire == "torch"
        self.pace = pacing.pacer(rank) if self.torch else None

    def task(self, prio: tuple, fn) -> None:
        heapq.heappush(self.tasks, (prio, self.seq, fn))
        self.seq += 1

    def send(self, buf: np.ndarray, peer: int, tag: int) -> None:
        w = self.b.isend(to_wire(buf, self.b.wire), peer, tag)
        stats["sent_bytes"] += buf.nbytes
        stats["messages"] += 1
        if self.torch:                  # waited for at the end of the stage
            self.b.flush()
            self.done.append(w)
        else:
            self.pending.append((w, None, None))

    def recv(self, nbytes: int, peer: int, tag: int, cb) -> None:
        buf = np.empty(nbytes, np.uint8)
        stats["recv_bytes"] += nbytes
        w = self.b.irecv(to_wire(buf, self.b.wire), peer, tag)
        if self.torch:                  # its blocking wait on the backend's waiter threads
            ((_, done),) = self.b.wait_async([w], self.deadline)
            w = _Waited(w, done)
        self.pending.append((w, lambda: cb(buf), (peer, tag)))

    def run(self) -> None:
        self._loop()
        if self.done:
            self.b.wait_all(self.done, self.deadline)   # sends; errors of completed works

    def _loop(self) -> None:
        spins = 0
        while self.pending or self.tasks:
            moved = False
            if self.pace is not None:
                self.pace.pump()
            if self.pending:
                if not self.torch:
                    self.b.flush()
                cur, self.pending = self.pending, []
                keep, behind = [], set()
                for w, cb, stream in cur:
                    # a stream's callbacks run in the order of its receives (a later one may
                    # be seen done first: torch's waiter threads report in any order)
                    if stream not in behind and w.test():
                        moved = True
                        if not self.torch:
                            self.done.append(w)
                        if cb is not None:
                            cb()
                    else:
                        keep.append((w, cb, stream))
                        if stream is not None:
                            behind.add(stream)
                self.pending = keep + self.pending      # callbacks' new works after the old
            if self.tasks:
                heapq.heappop(self.tasks)[2]()
                spins = 0
                continue
            if moved:
                spins = 0
                continue
            works = [w for w, _, _ in self.pending]
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise timeout_error(self.rank, works, self.b.timeout)
            base.watch(works, self.deadline)        # a peer's error, or a peer in another call
            spins += 1
            if spins < SPIN:
                continue
            time.sleep(min(NAP_MAX, NAP * spins))      # idle: leave the core to processes coding


class _Waited:
    """A torch receive whose blocking wait runs on the backend's waiter threads
    (`TorchBackend.wait_async`, the one mechanism of every gloo wait)."""

    def __init__(self, w, done):
        self.w, self.op, self.peers, self.done = w, w.op, w.peers, done

    def test(self) -> bool:
        if not self.done.done():
            return False
        self.done.result()              # its PeerTimeoutError, naming the peer
        return True
