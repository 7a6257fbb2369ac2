"""Errors raised by the distributed runtime.

* `PeerTimeoutError`: a peer process did not take part in a communication within the
  timeout (`MESHCOMM_TIMEOUT` seconds), or it died. It names the peer rank(s). It is both a
  `TimeoutError` and a `RuntimeError`, so either `except` clause catches it.
* Processes that disagree on a call (shape, dtype, layouts, backend) get a `ValueError`
  naming the ranks and what they disagree on (see meshcomm.runtime).
* `PeerError`: another process failed in a call this process takes part in (its bad input,
  its timeout), or waits for this process in another call. It names that rank; it is a
  `ValueError`, as a disagreement found at construction is.
"""
from __future__ import annotations

__all__ = ["PeerTimeoutError", "PeerError"]


class PeerTimeoutError(TimeoutError, RuntimeError):
    """A peer process did not arrive (or died) within the timeout.

    `peers` are the ranks waited for, `op` says what was being waited on.
    """

    def __init__(self, message: str, peers=(), op: str = ""):
        super().__init__(message)
        self.peers = tuple(peers)
        self.op = op


# what a PeerError says where processes are in different calls
NOT_SAME_CALL = ("the processes are not in the same call (every process must construct and run the same "
                 "Programs, and make the same eager calls, in the same order)")


class PeerError(ValueError):
    """Another process failed in a call this one takes part in, or is in another call.

    `rank` is that process."""

    relayed = False

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
