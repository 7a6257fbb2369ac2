"""MPI backend (mpi4py): buffer-based Isend/Irecv, Ibcast/Ireduce on cached sub-communicators.

* Messages are raw bytes (any dtype: bfloat16, float16, ...; the executor views packed
  buffers as uint8). Reductions take typed NumPy buffers (integer dtypes, or floats with
  MESHCOMM_REDUCE=collective).
* The backend works on two duplicates of the world communicator (data and metadata), so
  it never matches the user's own MPI traffic. Errors return as exceptions (not abort).
* Sub-communicators for broadcasts/reductions come from `Comm.Create_group` (collective
  over the members only), created in plan order and cached by rank tuple.
* A broadcast whose group sits on one host is the root's Isend to each member (on the
  group's communicator) rather than `Ibcast`: with MPI's shared-memory transport every
  receiver then copies straight from the root's buffer, in parallel, which measured about
  2x faster than MPICH's `Ibcast` from 1 KiB to 16 MiB (BENCHMARKS.md). Likewise integer
  reduces gather to the root there instead of `Ireduce` (3-7x faster here). Across hosts
  MPI's own trees are kept. `MESHCOMM_MPI_COLLECTIVES=native|p2p` forces one way.
* Every wait polls `Test` with a deadline instead of a blocking `Wait`, so a peer that
  never arrives raises `PeerTimeoutError` naming it.
* Threads: meshcomm runs all communication of a context on one background thread; MPI
  must be initialised with at least MPI_THREAD_SERIALIZED (mpi4py asks for MULTIPLE).
* Host buffers only: device data is staged through host memory by the executor (after a
  host sync); a CUDA-aware MPI path is left to the GPU work.
* Native collectives (Iallreduce, Iallgatherv, ... on the same cached communicators):
  backends/mpi_collectives.py.
"""
from __future__ import annotations

import contextlib

import pickle
import time
from typing import Sequence

import numpy as np

from meshcomm.errors import PeerTimeoutError

from . import pacing
from .base import TAG_MOD, Backend, Work, backoff, wait_polling
from .mpi_collectives import MPICollectives

from meshcomm import settings
__all__ = ["MPIBackend"]


def _mpi():
    from mpi4py import MPI
    return MPI


class MPIMultiWork(Work):
    """Several requests completing together (a broadcast done as point-to-point sends)."""

    def __init__(self, reqs, buf, op, peers, rank):
        self.reqs, self.buf, self.op, self.peers, self.rank = reqs, buf, op, peers, rank

    def cancel(self) -> None:
        for r in self.reqs:
            try:
                r.Cancel()
            except Exception:
                pass

    def test(self) -> bool:
        try:
            return _mpi().Request.Testall(self.reqs)
        except _mpi().Exception as e:
            raise PeerTimeoutError(f"rank {self.rank}: {self.op} with peer rank(s) {list(self.peers)} "
                                   f"failed: {e}", self.peers, self.op) from e


class MPIWork(Work):
    __slots__ = ("req", "buf", "op", "peers", "rank")

    def __init__(self, req, buf, op, peers, rank):
        self.req, self.buf, self.op, self.peers, self.rank = req, buf, op, peers, rank

    def cancel(self) -> None:
        if self.op == "recv":
            try:
                self.req.Cancel()
            except Exception:
                pass

    def test(self) -> bool:
        try:
            return self.req.Test()
        except _mpi().Exception as e:
            raise PeerTimeoutError(f"rank {self.rank}: {self.op} with peer rank(s) {list(self.peers)} "
                                   f"failed: {e}", self.peers, self.op) from e


# call signatures with a communicator of their own, per group: every process can hold about
# 2040 communicators (MPICH's context ids), so sub-groups keep fewer; past the cap a new
# signature is checked by a round of hashes every call (measured ~3x slower at 1-256 KiB)
SIG_MAX = 64
SIG_MAX_WORLD = 256
INIT_TAG = 32000     # the tag of the join check on the launcher's communicator
BCAST_TAG = 7        # point-to-point broadcasts, on the group's own communicator
BARRIER_TAG = 8      # the flat barrier of a signature check, on its signature communicator
_EMPTY = np.empty(0, np.uint8)


def _collectives_mode() -> str:
    return settings.get("MPI_COLLECTIVES")


def _dumps(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def timed_allgather(comm, obj, deadline, tag, timeout, what, why):
    """Every rank's `obj` (small, picklable) through point-to-point messages, polled with a
    deadline: ranks that did not send in time are named in the PeerTimeoutError."""
    MPI = _mpi()
    rank, n = comm.Get_rank(), comm.Get_size()
    data = _dumps(obj)
    out = [None] * n
    out[rank] = obj
    sends = [MPIWork(comm.Isend(data, dest=r, tag=tag), data, f"{what} send", (r,), rank)
             for r in range(n) if r != rank]
    pending = [r for r in range(n) if r != rank]
    status = MPI.Status()
    spins = 0
    while pending:
        got = []
        for r in pending:
            if comm.Iprobe(source=r, tag=tag, status=status):
                buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                comm.Recv(buf, source=r, tag=tag)
                out[r] = pickle.loads(buf.tobytes())
                got.append(r)
        if got:
            pending = [r for r in pending if r not in got]
            spins = 0
            continue
        if deadline is not None and time.monotonic() > deadline:
            t = f"{timeout:g}s" if timeout is not None else "the timeout"
            raise PeerTimeoutError(
                f"rank {rank}: peer rank(s) {pending} did not arrive at {what} within {t} "
                f"(MESHCOMM_TIMEOUT): they {why}, or died", pending, what)
        spins += 1
        backoff(spins)
    wait_polling(sends, deadline, rank, timeout)
    return out


def timed_dup(comm, deadline):
    """Comm.Idup polled with a deadline (a blocking Dup would hang on a missing peer)."""
    new, req = comm.Idup()
    w = MPIWork(req, None, "communicator duplication", tuple(range(comm.Get_size())), comm.Get_rank())
    wait_polling([w], deadline)
    return new


class MPIBackend(MPICollectives, Backend):
    name = "mpi"
    wire = "numpy"
    work_cls = MPIWork

    def __init__(self, comm=None, timeout: float | None = None):
        MPI = _mpi()
        base = comm if comm is not None else MPI.COMM_WORLD
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError("meshcomm's MPI backend needs MPI initialised with at least "
                               "MPI_THREAD_SERIALIZED (mpi4py.rc.thread_level); got "
                               f"level {MPI.Query_thread()}")
        self._base = base
        deadline = None if timeout is None else time.monotonic() + timeout
        # who is here? (a peer that never calls init is named, instead of a hang in Dup),
        # and on which host (broadcasts inside one host go point to point, see above)
        self.hosts = timed_allgather(base, MPI.Get_processor_name(), deadline, INIT_TAG, timeout,
                                     "meshcomm.init", "did not call init")
        self.mode = _collectives_mode()
        # every rank on one host: integer reduces gather to the root too (MPICH's Ireduce
        # measured 3-7x slower over shared memory here); the same answer on every rank
        self.gather_reduces = self.mode == "p2p" or (self.mode == "auto" and len(set(self.hosts)) == 1)
        self.comm = timed_dup(base, deadline)
        self.meta = timed_dup(base, deadline)
        self.bcomm = timed_dup(base, deadline)     # point-to-point broadcasts over everyone
        for c in (self.comm, self.meta, self.bcomm):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], object] = {}
        self._retired: list = []         # communicators given up by reset (never freed)
        self._sig: dict = {}             # (ranks, call signature) -> its own communicator
        self._pin = None                 # the communicator `pinned` routes collectives to
        self._meta_seq = 0

    # -- point to point ----------------------------------------------------------------
    def isend(self, buf, peer, tag):
        pace = pacing.pacer(self.rank)
        if pace is not None and pace.crosses(peer):     # MESHCOMM_EMULATE_GBPS (benchmarks)
            comm = self.comm
            return pace.send(lambda: MPIWork(comm.Isend(buf, dest=peer, tag=tag), buf, "send", (peer,), self.rank),
                             buf.nbytes, "send", (peer,))
        req = self.comm.Isend(buf, dest=peer, tag=tag)
        return MPIWork(req, buf, "send", (peer,), self.rank)

    def irecv(self, buf, peer, tag):
        req = self.comm.Irecv(buf, source=peer, tag=tag)
        return MPIWork(req, buf, "recv", (peer,), self.rank)

    # -- collectives on sub-communicators ----------------------------------------------
    def _group(self, ranks):
        if self._pin is not None:
            return self._pin
        if len(ranks) == self.world_size:
            return self.comm
        try:
            return self._groups[ranks]
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: no communicator for ranks {ranks}; "
                               "prepare_groups was not called for this plan") from None

    def bcast_p2p(self, ranks) -> bool:
        """Whether a broadcast over `ranks` goes as point-to-point sends (same answer on
        every member: each sees the same hosts; always under MESHCOMM_EMULATE_GBPS)."""
        if pacing.pacer(self.rank) is not None:
            return True
        if self.mode != "auto":
            return self.mode == "p2p"
        return len({self.hosts[r] for r in ranks}) == 1

    def bcast(self, buf, root, ranks):
        sub = self._group(ranks)
        i = ranks.index(root)
        what = f"bcast in group {list(ranks)}"
        if self.bcast_p2p(ranks):
            if sub is self.comm and self._pin is None:  # the world group: clear of the executor's tags
                sub = self.bcomm
            if self.rank == root:
                pace = pacing.pacer(self.rank)
                if pace is not None:                    # MESHCOMM_EMULATE_GBPS (benchmarks)
                    return self._paced_bcast(pace, sub, buf, i, ranks, what)
                reqs = [sub.Isend(buf, dest=j, tag=BCAST_TAG) for j in range(len(ranks)) if j != i]
                return MPIMultiWork(reqs, buf, what, tuple(r for r in ranks if r != root), self.rank)
            return MPIWork(sub.Irecv(buf, source=i, tag=BCAST_TAG), buf, what, (root,), self.rank)
        req = sub.Ibcast(buf, root=i)
        # in a collective any member may be the one missing: name them all
        others = tuple(r for r in ranks if r != self.rank)
        return MPIWork(req, buf, what, others, self.rank)

    def _paced_bcast(self, pace, sub, buf, i, ranks, what):
        works = []
        for j, r in enumerate(ranks):
            if j == i:
                continue
            send = (lambda j=j: MPIWork(sub.Isend(buf, dest=j, tag=BCAST_TAG), buf, what, (ranks[j],), self.rank))
            works.append(pace.send(send, buf.nbytes, what, (r,)) if pace.crosses(r) else send())
        return pacing.AllOf(works, what, tuple(r for r in ranks if r != ranks[i]))

    def reduce(self, buf, root, ranks, op="sum"):
        MPI = _mpi()
        sub = self._group(ranks)
        mop = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[op]
        i = ranks.index(root)
        if self.rank == root:
            req = sub.Ireduce(MPI.IN_PLACE, buf, op=mop, root=i)
        else:
            req = sub.Ireduce(buf, None, op=mop, root=i)
        others = tuple(r for r in ranks if r != self.rank)
        return MPIWork(req, buf, f"reduce in group {list(ranks)}", others, self.rank)

    def sig_comm(self, ranks, sig, deadline=None, create=False):
        """The communicator of group `ranks` kept for one exact native call (`sig`: op,
        dtype, counts, reduction, root), or None. A native collective posted before its
        agreement has decided goes only there: processes that disagree then post on
        different communicators (or not at all), so mismatched calls never meet (two typed
        calls of different dtypes on one communicator abort inside MPICH). `create`: make
        it now (collective over the group's members, once the call is agreed; at most
        SIG_MAX per group, SIG_MAX_WORLD for all ranks: every member takes part in each of
        its group's creations, so all of them decide alike, whatever other groups each also
        belongs to)."""
        key = (ranks, sig)
        c = self._sig.get(key)
        cap = SIG_MAX_WORLD if len(ranks) == self.world_size else SIG_MAX
        if c is None and create and sum(1 for r, _ in self._sig if r == ranks) < cap:
            c = timed_dup(self.comm if len(ranks) == self.world_size else self._groups[ranks], deadline)
            c.Set_errhandler(_mpi().ERRORS_RETURN)
            self._sig[key] = c
        return c

    def ibarrier_on(self, comm):
        """A barrier over every rank of `comm` (a `sig_comm` of all ranks): the signature check.
        Flat: an empty message to and from every other rank, so it completes one message
        after the last rank arrives (MPI_Ibarrier's rounds each wait for a peer to be
        scheduled: measured slower with more processes than cores, BENCHMARKS.md section 10).
        The receives come first, one per other rank in rank order: each completes once that
        rank is in the same call."""
        works = []
        for r in range(self.world_size):
            if r != self.rank:
                works.append(MPIWork(comm.Irecv(_EMPTY, source=r, tag=BARRIER_TAG), None,
                                     "the signature check", (r,), self.rank))
        for r in range(self.world_size):
            if r != self.rank:
                works.append(MPIWork(comm.Isend(_EMPTY, dest=r, tag=BARRIER_TAG), None,
                                     "the signature check", (r,), self.rank))
        return works

    @contextlib.contextmanager
    def pinned(self, comm):
        """Route the native collectives issued inside to `comm` (a `sig_comm`)."""
        self._pin = comm
        try:
            yield
        finally:
            self._pin = None

    def has_groups(self, groups):
        return all(g in self._groups or len(g) == self.world_size for g in groups)

    def reset(self):
        """After an aborted call (every rank calls this, see meshcomm.runtime): messages of
        the aborted plan, or of a native collective posted before the agreement failed, may
        still be in flight, so move to fresh communicators. The old ones are retired, not
        freed: a freed communicator's context id can be given to the next one while a
        request of the old one is still pending, and its messages would then match the new
        one's (seen: garbage in the next planned all_gather)."""
        MPI = _mpi()
        self._retired.append(self.comm)
        self._retired.append(self.bcomm)
        self._retired.extend(c for c in self._groups.values() if c is not None)
        self._retired.extend(self._sig.values())
        self._groups.clear()
        self._sig.clear()
        self.comm = self._base.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.bcomm = self._base.Dup()
        self.bcomm.Set_errhandler(MPI.ERRORS_RETURN)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]], deadline):
        new = [g for g in groups if g not in self._groups and len(g) < self.world_size]
        if not new:
            return
        mine = [g for g in new if self.rank in g]
        world = self.comm.Get_group()
        for g in mine:                       # every member creates its groups in plan order
            grp = world.Incl(list(g))
            self._groups[g] = self.comm.Create_group(grp, tag=0)
            grp.Free()
        for g in new:
            self._groups.setdefault(g, None)  # non-members remember they are not in it
        world.Free()

    # -- metadata: an allgather of small objects that names missing peers --------------
    def allgather_obj(self, obj, deadline):
        tag = self._meta_seq % TAG_MOD
        self._meta_seq += 1
        return timed_allgather(self.meta, obj, deadline, tag, self.timeout,
                               "the metadata exchange", "did not call reshard")

    def allreduce_min(self, vec, deadline):
        """MPI_Iallreduce(MIN) on the metadata communicator, polled with the deadline. A
        collective cannot tell which member is missing, so a timeout names every other rank."""
        MPI = _mpi()
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        out = np.empty_like(vec)
        req = self.meta.Iallreduce(vec, out, op=MPI.MIN)
        others = tuple(r for r in range(self.world_size) if r != self.rank)
        wait_polling([MPIWork(req, (vec, out), "the metadata check (an allreduce: any of them "
                               "may be the one missing)", others, self.rank)],
                     deadline, self.rank, self.timeout)
        return out

    def close(self):
        for c in list(self._groups.values()) + list(self._sig.values()):
            if c is not None:
                try:
                    c.Free()
                except Exception:
                    pass
        self._groups.clear()
        self._sig.clear()
        for c in (self.comm, self.meta, self.bcomm):
            try:
                c.Free()
            except Exception:
                pass
