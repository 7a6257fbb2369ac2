"""MPI requests and communicators for backends/mpi.py, apart from the backend that uses
them: the works a wait polls, a communicator duplication polled to a deadline, and the tag
of a group's creation."""
from __future__ import annotations

import contextlib
import zlib

import numpy as np

from meshcomm.errors import PeerTimeoutError

from .base import Work, wait_polling


_MPI: list = []     # mpi4py's MPI module, imported on first use (this module loads without MPI)


def mpi():
    if not _MPI:
        from mpi4py import MPI
        _MPI.append(MPI)
    return _MPI[0]


class MPIMultiWork(Work):
    """Several requests completing together (a broadcast done as point-to-point sends)."""

    def __init__(self, reqs, buf, op, peers, rank):
        self.reqs, self.buf, self.op, self.peers, self.rank = reqs, buf, op, peers, rank

    def cancel(self) -> None:
        for r in self.reqs:
            with contextlib.suppress(Exception):
                r.Cancel()

    def test(self) -> bool:
        try:
            return mpi().Request.Testall(self.reqs)
        except mpi().Exception as e:
            raise _failed(self, e) from e


class MPIWork(Work):
    __slots__ = ("req", "buf", "op", "peers", "rank")

    def __init__(self, req, buf, op, peers, rank):
        self.req, self.buf, self.op, self.peers, self.rank = req, buf, op, peers, rank

    def cancel(self) -> None:
        if self.op == "recv":
            with contextlib.suppress(Exception):
                self.req.Cancel()

    def test(self) -> bool:
        try:
            return self.req.Test()
        except mpi().Exception as e:
            raise _failed(self, e) from e


def _failed(w, e) -> PeerTimeoutError:
    return PeerTimeoutError(f"rank {w.rank}: {w.op} with peer rank(s) {list(w.peers)} failed: {e}", w.peers, w.op)


def timed_dup(comm, deadline, ranks=None, timeout=None):
    """Comm.Idup polled to `deadline`, unwatched; `ranks`: its members' world ranks."""
    new, req = comm.Idup()
    ranks = tuple(range(comm.Get_size())) if ranks is None else tuple(ranks)
    me = ranks[comm.Get_rank()]
    w = MPIWork(req, None, "communicator duplication", tuple(r for r in ranks if r != me), me)
    wait_polling([w], deadline, me, timeout, watched=False)
    return new


def errors_return(c):      # errors raise as exceptions (not abort)
    return c.Set_errhandler(mpi().ERRORS_RETURN) or c


def group_tag(ranks, tag_ub) -> int:
    """The tag of the group's Comm.Create_group: the set of its ranks as bits (unique) where
    that fits under the tag bound, else a hash of them. MPI tells concurrent creations on
    one parent apart by tag: a member still creating one group and another already creating
    the next overlapping one must not share a tag."""
    bits = sum(1 << r for r in ranks)
    return bits if bits <= tag_ub else zlib.crc32(np.asarray(ranks, np.int64).tobytes()) % (tag_ub + 1)
