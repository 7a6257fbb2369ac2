"""The event loop of a compressed execution: one process's messages with callbacks and its CPU tasks by priority, for one stage.

Sends and receives are non-blocking; each receive has a callback, run when it completes
(MPI: polled with `test`; torch: gloo's point-to-point works never report completion to
polling, so each stream (peer, tag) of receives is waited for in order on a thread of its
own, and sends are waited for at the end). Between two CPU tasks (encode, decode, add) the
loop polls the network, so chunks move while others are coded. `stats` counts the bytes
this process put on and took off the wire.
"""
from __future__ import annotations

import datetime
import heapq
import queue
import threading
import time
from collections import Counter

import numpy as np

from . import pacing
from .base import timeout_error, to_wire

__all__ = ["Engine", "stats"]

stats: Counter = Counter()      # sent_bytes, recv_bytes, messages, calls (this process)
# Idle polling sleeps early and briefly: chunks take milliseconds to code, and with more
# processes than cores a process that spins or yields while it waits takes CPU time from the
# processes that are coding (measured: up to a third of a compressed all-gather's time).
SPIN, NAP, NAP_MAX = 8, 2e-5, 5e-4


class Engine:
    """One process's event loop for one stage: messages with callbacks, CPU tasks by priority."""

    def __init__(self, backend, rank: int, deadline):
        self.b, self.rank, self.deadline = backend, rank, deadline
        self.pending: list = []         # (work, callback or None), in issue order
        self.tasks: list = []           # heap of (priority, seq, fn)
        self.seq = 0
        self.done: list = []            # completed works the backend waits on at the end
        self.torch = backend is not None and backend.wire == "torch"
        self.pace = pacing.pacer(rank) if self.torch else None
        self.waiters: dict = {}

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
            self.pending.append((w, None))

    def recv(self, nbytes: int, peer: int, tag: int, cb) -> None:
        buf = np.empty(nbytes, np.uint8)
        stats["recv_bytes"] += nbytes
        w = self.b.irecv(to_wire(buf, self.b.wire), peer, tag)
        if self.torch:
            self.b.flush()
            key = (peer, tag)
            if key not in self.waiters:
                self.waiters[key] = _Waiter(self.deadline)
            w = self.waiters[key].watch(w)
        self.pending.append((w, lambda: cb(buf)))

    def run(self) -> None:
        try:
            self._loop()
        finally:
            for w in self.waiters.values():
                w.close()
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
                keep = []
                for w, cb in cur:
                    if w.test():
                        moved = True
                        if not self.torch:
                            self.done.append(w)
                        if cb is not None:
                            cb()
                    else:
                        keep.append((w, cb))
                self.pending = keep + self.pending      # callbacks' new works after the old
            if self.tasks:
                heapq.heappop(self.tasks)[2]()
                spins = 0
                continue
            if moved:
                spins = 0
                continue
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise timeout_error(self.rank, [w for w, _ in self.pending], self.b.timeout)
            spins += 1
            if spins < SPIN:
                continue
            time.sleep(min(NAP_MAX, NAP * spins))      # idle: leave the core to processes coding


class _Waiter:
    """Waits, on a thread of its own, for the torch receives of one stream (peer, tag) in
    order: gloo's point-to-point works never report completion to polling, and a stream's
    messages complete in the order they were posted."""

    def __init__(self, deadline):
        self.deadline = deadline
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def watch(self, w) -> _Watched:
        x = _Watched(w)
        self.q.put(x)
        return x

    def _loop(self) -> None:
        while True:
            x = self.q.get()
            if x is None:
                return
            try:
                if self.deadline is None:
                    x.w.work.wait()
                else:
                    x.w.work.wait(timeout=datetime.timedelta(seconds=max(1e-3, self.deadline - time.monotonic())))
            except Exception as e:      # noqa: BLE001 (gloo: timeouts and closed connections)
                x.error = e
            x.flag = True

    def close(self) -> None:
        self.q.put(None)


class _Watched:
    """A torch receive whose completion a _Waiter reports."""

    def __init__(self, w):
        self.w, self.op, self.peers = w, w.op, w.peers
        self.flag, self.error = False, None

    def test(self) -> bool:
        if self.error is not None:
            raise timeout_error(None, [self.w], None) from self.error
        return self.flag
