"""`Handle`: what an operation called with `async_op=True` returns; `.wait()` gives its result."""
from __future__ import annotations

__all__ = ["Handle"]


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
            self._result = self._wait_fn()
            self._done = True
            self._wait_fn = None
            for fn in self._callbacks:
                fn(self)
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
            fn(self)
        elif f is None:
            self._callbacks.append(fn)
        else:
            f.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        return f"Handle({'done' if self.is_completed() else 'pending'})"
