"""`Handle`: what an operation called with `async_op=True` returns; `.wait()` gives its result."""
from __future__ import annotations

__all__ = ["Handle"]


class Handle:
    """A pending result. `wait()` blocks until the operation is done and returns its result
    (raising what the operation raised); `is_completed()` says whether it is done."""

    def __init__(self, wait_fn=None, result=None):
        self._wait_fn = wait_fn
        self._result = result
        self._done = wait_fn is None

    def wait(self):
        if not self._done:
            self._result = self._wait_fn()
            self._done = True
            self._wait_fn = None
        return self._result

    def is_completed(self) -> bool:
        return self._done

    def __repr__(self) -> str:
        return f"Handle({'done' if self._done else 'pending'})"
