"""MPI requests and communicators for backends/mpi.py, apart from the backend that uses
them: the works a wait polls, a communicator duplication polled to a deadline, and the tag
of a group's creation."""
from __future__ import annotations

import contextlib
import zlib

import numpy as np

from meshcomm.errors import NOT_SAME_CALL, PeerError, PeerTimeoutError

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


STAMP_TAG = 1       # a Program's own communicator carries no other point-to-point messages


class Stamps:
    """A rooted native call's run number (its place in the group's call sequence), sent
    beside it on the Program's own communicator, as persistent point-to-point requests, by
    the members whose part ends without the others' (a broadcast's or scatter's root:
    `fan_out`; a gather's or reduce's non-roots) to those who wait for them. Such a member
    can run on alone, its runs matching nothing yet, and a later run of it then completes
    a receiver's pending one: the receiver compares the number with its own (`check`) and
    raises rather than return that data. `ranks`: the communicator's, in its order."""

    def __init__(self, comm, ranks, rank, root, fan_out: bool, what: str):
        i, r = ranks.index(rank), ranks.index(root)
        self.mine = np.zeros(1, np.int64)       # this run's number: sent, or compared
        others = [j for j in range(len(ranks)) if j != i]
        self.what, self.rank = what, rank
        if fan_out == (i == r):                 # its part ends alone: it sends
            to = others if fan_out else [r]
            self.got, self.senders = None, ()
            self.reqs = [comm.Send_init(self.mine, dest=j, tag=STAMP_TAG) for j in to]
        else:
            src = others if not fan_out else [r]
            self.got, self.senders = np.zeros(len(src), np.int64), tuple(ranks[j] for j in src)
            self.reqs = [comm.Recv_init(self.got[n:n + 1], source=j, tag=STAMP_TAG) for n, j in enumerate(src)]

    def post(self, seq: int, call) -> Stamped:
        """Start them, then the call (`call()` gives its Work): both, as one Work."""
        self.mine[0] = seq
        mpi().Prequest.Startall(self.reqs)
        return Stamped(call(), self.reqs, self.got is not None)

    def check(self) -> None:
        """PeerError naming a sender whose number is not this run's (after both completed)."""
        g = self.got
        if g is None or (g == self.mine[0]).all():
            return
        j = int(np.flatnonzero(g != self.mine[0])[0])
        raise out_of_step(self.rank, int(self.mine[0]), self.what, self.senders[j], int(g[j]))


class Trailer:
    """`Stamps` for a persistent call that carries the run number in its own buffers
    (runtime/trailers.py: 8 bytes behind a block, or reduced elements): `write`, the views
    this member sets before the call starts, `read`, those it compares once it completed
    (row j sent by `senders[j]`, or by `senders[0]` alone; None: a member of a reduction,
    the numbers modulo `mod` summed over `scale` members, or with `pair` each number v
    beside `mod - 1 - v` for a max or min); nothing travels beside the call (`post` gives
    the call's Work)."""

    def __init__(self, write, read, senders, rank, what: str, mod: int = 0, scale: int = 1, pair: bool = False):
        self.write, self.senders, self.rank, self.what = write, senders, rank, what
        self.mod, self.scale, self.seq, self.pair = mod, scale, 0, pair
        # set as a scalar where it is one, read as a list: a small array's ops cost microseconds,
        # and each costs several at 8 processes on 2 cores (BENCHMARKS 5)
        self.w1 = write.reshape(-1) if write is not None and write.size == 1 else None
        self.halves = (write[..., 0], write[..., 1]) if pair and write is not None else None
        self.flat = read.reshape(-1) if read is not None else None

    def post(self, seq: int, call):
        self.seq = seq
        if self.write is not None:      # before the call starts: it sends these bytes
            v = seq % self.mod if self.mod else seq
            if self.w1 is not None:
                self.w1[0] = v
            elif self.pair:
                self.halves[0].fill(v)
                self.halves[1].fill(self.mod - 1 - v)
            else:
                self.write.fill(v)
        return call()

    def check(self) -> None:
        if self.flat is None:
            return
        want = self.scale * (self.seq % self.mod) if self.mod else self.seq
        got = self.flat.tolist()
        if self.pair:                   # (max or min of v, of mod - 1 - v): both this run's
            if got == [want, self.mod - 1 - want]:
                return
            raise out_of_step(self.rank, self.seq, self.what, None,
                              int(got[0] if got[0] != want else self.mod - 1 - got[1]))
        if got.count(want) == len(got):
            return
        j = next(i for i, v in enumerate(got) if v != want)
        raise out_of_step(self.rank, self.seq, self.what, self.senders[min(j, len(self.senders) - 1)], int(got[j]))


class Checked:
    """A symmetric native call's run number beside it, where its own buffers do not carry it
    (runtime/trailers.py): each member's (v, M - 1 - v), reduced by max in a persistent
    allreduce started right behind the call on the same communicator, so every member sees
    any other member's number (`check`, once both completed). No copy of the tile."""

    def __init__(self, comm, rank, what: str):
        m = mpi()
        self.nums = np.zeros(2, np.int64)
        self.trailer = Trailer(self.nums, self.nums, (None,), rank, what, mod=1 << 62, pair=True)
        try:
            self.req = comm.Allreduce_init(m.IN_PLACE, self.nums, op=m.MAX)
        except NotImplementedError:     # before MPI-4: a new non-blocking one per run
            self.req = None
        self.comm = comm

    def _start(self):
        if self.req is None:
            return self.comm.Iallreduce(mpi().IN_PLACE, self.nums, op=mpi().MAX)
        self.req.Start()
        return self.req

    def post(self, seq: int, call) -> Stamped:
        return self.trailer.post(seq, lambda: Stamped(call(), [self._start()], False))

    def check(self) -> None:
        self.trailer.check()


def out_of_step(rank, seq, what, sender, got) -> PeerError:
    who = f"rank {sender} sent its part from place {got}" if sender is not None else \
        f"a member sent its part from another place (their numbers reduced: {got})"
    e = PeerError(f"rank {rank} is at place {seq} of its group's call sequence in {what}, and {who}: "
                  f"{NOT_SAME_CALL}", sender)
    e.out_of_step = True        # every Program of the group fails (runtime/program.py)
    return e


class Stamped(Work):
    """A call's Work and its Stamps' requests, tested in turn (MPICH's Testall of a
    persistent collective and point-to-point requests together fails: MPI_ERR_PENDING)."""

    def __init__(self, w, reqs, receives: bool):
        self.w, self.reqs, self.receives = w, reqs, receives
        self.op, self.peers, self.rank = w.op, w.peers, w.rank

    def cancel(self) -> None:         # receives only (as MPIWork; a persistent Ssend cancelled crashed MPICH)
        self.w.cancel()
        for r in self.reqs if self.receives else ():
            with contextlib.suppress(Exception):
                r.Cancel()

    def test(self) -> bool:
        if not self.w.test():
            return False
        try:        # one by one: MPICH's Testall of a persistent allreduce raised MPI_ERR_IN_STATUS
            return all(r.Test() for r in self.reqs)     # with no error in the status (`Checked`)
        except mpi().Exception as e:
            raise _failed(self, e) from e
