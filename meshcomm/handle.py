"""`Handle`: what an operation called with `async_op=True` returns; `.wait()` gives its result."""
from __future__ import annotations

import sys
import threading
import traceback

__all__ = ["Handle"]

QUEUE_THREAD = "meshcomm-comm"      # the context's queue (runtime/context.py): callbacks run there


def _called(fn, h) -> None:
    """`fn(h)` as a done callback: what it raises is printed, not raised (as
    concurrent.futures does for an Exception; a BaseException such as KeyboardInterrupt
    ended the queue's thread, and every later wait waited forever)."""
    try:
        fn(h)
    except BaseException:  # noqa: BLE001 - nothing here to raise it into
        print(f"meshcomm: a done callback {fn!r} raised:", file=sys.stderr)
        traceback.print_exc()


class Handle:
    """A pending result. `wait()` blocks until the operation is done and returns its result
    (raising what the operation raised); `is_completed()` says whether it is done, without
    waiting; `add_done_callback(fn)` calls `fn(handle)` once it is. `future`: what the
    operation runs as (the context queue's Future, or the Handle this one finishes)."""

    def __init__(self, wait_fn=None, result=None, future=None):
        self._wait_fn, self._result, self._future = wait_fn, result, future
        self._done = wait_fn is None
        self._callbacks: list = []

    def wait(self):
        if not self._done:
            if not self.is_completed() and threading.current_thread().name.startswith(QUEUE_THREAD):
                raise RuntimeError("a done callback waits for an operation that is not done: it runs on the "
                                   "queue that would run that operation, so it would wait forever")
            self._result = self._wait_fn()
            self._done = True
            self._wait_fn = None
            for fn in self._callbacks:
                _called(fn, self)
        return self._result

    def is_completed(self) -> bool:
        f = self._future
        if self._done or f is None:
            return self._done
        return f.is_completed() if isinstance(f, Handle) else f.done()

    def add_done_callback(self, fn) -> None:
        """`fn(self)` once the operation is done: now if it is, else on the thread that
        completes it (the context's queue) or, with nothing running it, at `wait()`."""
        f = self._future
        if self._done:
            _called(fn, self)
        elif f is None or not hasattr(f, "add_done_callback"):     # nothing runs it (an asynchronous
            self._callbacks.append(fn)                              # send once posted): at wait()
        else:
            f.add_done_callback(lambda _: _called(fn, self))

    def __repr__(self) -> str:
        return f"Handle({'done' if self.is_completed() else 'pending'})"
