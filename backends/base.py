"""The shared executor: a Plan -> this process's part of it, over a small primitive interface.

Every distributed backend implements `Backend`: non-blocking `isend`/`irecv(buf, peer, tag)`,
`bcast(buf, root, ranks)` and `reduce(buf, root, ranks, op)` (op into the root), each returning
a `Work`; `wait_all(works, deadline)`; `barrier`; a small object `allgather_obj` for
metadata; and `prepare_groups(groups, deadline)`. Beside the executor, the native
collectives (`allreduce`, `allgatherv`, `reduce_scatterv`, `alltoall`, `gatherv`, `scatterv`,
`ibarrier`) run one MPI or torch.distributed collective on a cached group (mixing them across
backends: the rule in backends/mixed.py).

How a process runs a plan: backends/batch.py's `Runner`, the one executor (a plan's
transfers coalesced per peer and stage); this module gives it the steps (`compile_steps`:
this rank's part of each transfer, `Step.prim` local, p2p, bcast, gather or reduce), the
groups its collectives need, a run's tiles (`Run`) and the wire buffers.

* Device d lives on rank `rank_of(d)`. A transfer whose devices all live on this rank runs
  as local array copies/sums (no communication).
* A reduce combines (`Plan.reduce_op`: sum, prod, min or max; meshcomm.reduceops) the
  contributors in the plan's order of `srcs` (bitwise the same as the local backend): each
  contributing rank sends its tiles to the root rank, which adds them up in order. For
  integer dtypes (exact in any order) a reduce over 3+ ranks uses the backend's `reduce`
  instead, unless the backend finds gathering faster (MPI with every rank on one host, where
  MPICH's Ireduce is slower); `REDUCE_MODE = "collective"` uses the collective
  for integers and float32/float64 (not bitwise reproducible), `ordered` never.
* Groups: torch's `new_group` must be called by every rank in the same order, MPI's
  `Create_group` by the members in the same order. `groups_needed(plan, ...)` lists the
  groups of every collective in the plan (all of them, not only this rank's) in plan order;
  every rank calls `prepare_groups` with that list for each backend when it constructs the
  Program, so the missing groups are created in the same order everywhere.
* Deadlines: every wait polls with a deadline (`MESHCOMM_TIMEOUT` after the call started)
  and raises `PeerTimeoutError` naming the peer ranks it waited for. A run given up (its
  deadline, a peer's error) leaves its works to `abandon`, which keeps their buffers until
  MPI is done.
* CUDA: packing, unpacking and communication run on the backend's stream
  (backends/streams.py); an MPI-bound device buffer is synchronised and staged through the
  host. On CPU the same calls are no-ops.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from typing import Callable, Mapping, Sequence

import numpy as np

from meshcomm.arrays import is_torch as _is_torch, to_numpy
from meshcomm.caches import memo
from meshcomm.errors import PeerTimeoutError
from meshcomm.planners.boxes import box_size, local_slices
from meshcomm.reduceops import combine_

from . import buffers, streams
from .local import alloc_like
from .pack import pack, unpack

__all__ = ["Work", "Backend", "Step", "compile_steps", "wire_bytes", "groups_needed", "wait_polling", "poll_peers",
           "backoff", "abandon", "finish_all", "ABANDONED", "STALE", "stale_error", "issued", "to_wire", "torch_of",
           "empty_wire", "from_wire", "TAG_MOD", "SLOTS", "part"]

TAG_MOD = 32768   # the MPI standard guarantees tags up to 32767

issued: Counter = Counter()     # (backend name, primitive) -> operations issued (tests, stats)


# -- works and waiting ----------------------------------------------------------------------

class Work:
    """A non-blocking operation in flight. `peers`: the ranks it waits for; `op`: a label."""

    op: str = ""
    peers: tuple[int, ...] = ()
    lingers = False     # given up, it may still match a later call of its backend (STALE)

    def test(self) -> bool:
        raise NotImplementedError

    def parts(self) -> list:
        """The works a stalled wait tests one by one (naming the peers it still awaits)."""
        return [self]


SPIN, YIELD, SLEEP_MAX = 2000, 4000, 2e-4
EVERY = 4           # polls per yield of the core, from SPIN polls on
QUICK = 32          # tests of a lone work before the loop (no clock, no control channel)
LOOK_S = 0.001      # with a test_all, how often a wait tests its works one by one
SPIN_FREE = 2000    # polls before the first yield where this host has a core per process


def set_local_processes(k: int) -> None:
    """The polling policy for `k` processes on this host (each backend's init calls it): with
    more processes than cores, a wait yields the core from its first misses, once every EVERY
    polls (a spinning rank steals the core its peer needs; yielding after every miss was
    slower still: BENCHMARKS 5); with a core each, it polls SPIN_FREE times first (MPI
    progresses only inside its calls: yielding between them slows it down)."""
    global SPIN
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    SPIN = 0 if k > cores else SPIN_FREE


def backoff(spins: int) -> None:
    """Politeness while polling: poll SPIN times, then yield the core, then sleep briefly
    (a long sleep would delay this process's own progress)."""
    if spins < SPIN:
        return
    if spins < YIELD:
        if not spins % EVERY:
            os.sched_yield()
        return
    time.sleep(min(SLEEP_MAX, 1e-5 * (spins - YIELD + 1)))


# Works given up on (a timeout, an aborted plan, a failed agreement) stay referenced here until
# they complete: MPI may still write into their buffers (a peer can arrive late, a receive
# already matched cannot be cancelled, nor can a collective), and dropping the last reference
# to an mpi4py request frees it while active and releases its buffer: MPI would then write
# into freed memory (heap corruption, seen as a crash in malloc much later).
ABANDONED: list = []
# The labels of works given up that may still match a later call of their backend: gloo
# cancels nothing, and its native collectives match by order on one group, so such a work
# could complete a later call with this one's data. While any is listed no Program is made
# (runtime/program.py `construct`): finalize() and init() again (it empties then).
STALE: list = []


def stale_error() -> RuntimeError | None:
    """The error of a construction while STALE lists works, else None."""
    if not STALE:
        return None
    return RuntimeError(f"work given up in an earlier failure ({', '.join(sorted(set(STALE)))}) may still "
                        "match a later call over torch.distributed (gloo cancels nothing): call "
                        "meshcomm.finalize() and meshcomm.init() again")


def abandon(works: Sequence, cancel: bool = False) -> None:
    """The one way to give works up: try to cancel them if `cancel` (receives; best effort),
    then keep them in ABANDONED. Works given up before that have completed by now (a
    cancelled receive completes, a late peer's message arrives) are let go here."""
    if cancel:
        for w in works:
            c = getattr(w, "cancel", None)
            if c is not None:
                try:
                    c()
                except Exception:  # noqa: BLE001 - best effort: the work stays kept either way
                    pass
    keep = []
    for w in ABANDONED:
        try:
            done = w.test()
        except Exception:  # noqa: BLE001 - a failed work stays kept: nothing says MPI let go
            done = False
        if not done:
            keep.append(w)
    ABANDONED[:] = keep
    ABANDONED.extend(works)
    STALE.extend(w.op for w in works if getattr(w, "lingers", False))


def timeout_error(rank, works: Sequence[Work], timeout: float | None) -> PeerTimeoutError:
    abandon(works)
    peers = sorted({p for w in works for p in w.peers})
    ops = sorted({w.op for w in works})
    t = f"{timeout:g}s" if timeout is not None else "the timeout"
    who = f"rank {rank}: " if rank is not None else ""
    return PeerTimeoutError(
        f"{who}{', '.join(ops)} with peer rank(s) {peers} did not complete within {t} "
        f"(MESHCOMM_TIMEOUT); peer rank(s) {peers} did not arrive or died", peers, ", ".join(ops))


SLOTS = 64      # parts of a Program's tag space, taken by its runs in turn (`part`)


def part(tags, seq: int) -> tuple:
    """The part of a Program's tag space `tags` (first, span) that its run at place `seq` of
    its group's call sequence uses: a process whose part of runs ends alone (a pure sender)
    must be SLOTS calls apart from its receivers before one of its messages can match theirs."""
    span = tags[1] // SLOTS
    return tags[0] + (seq % SLOTS) * span, span


# The runtime's control channel (meshcomm.runtime.control.Channel.watch), polled by every
# wait: watch(peers, deadline) may raise a peer's error. None without a context.
WATCH: Callable | None = None


def quick(test, polite: bool | None = None) -> bool:
    """Whether `test()` turns true within QUICK polls, yielding the core every EVERY polls
    where `polite` (default: where processes outnumber cores, as `backoff` does): a wait's
    tight loop, without the clock or the control channel."""
    if polite is None:
        polite = not SPIN
    for i in range(1, QUICK + 1):
        if test():
            return True
        if polite and not i % EVERY:
            os.sched_yield()
    return False


def wait_polling(works: Sequence[Work], deadline: float | None, rank=None, timeout=None, watched=True,
                 test_all=None) -> None:
    """The one poll/deadline loop: every wait of every backend ends here (or polls `watch`).
    Unwatched (a communicator's creation), only the deadline ends it: a member already past
    its part of a collective creation is not "in another call". `test_all()`: whether every
    work is done, in one call (MPI's Testall: one pass of its progress engine for all of
    them), polled in rounds of QUICK (`quick`); the works are tested one by one only every
    LOOK_S (the deadline, the control channel and the peers still awaited), the first time
    LOOK_S into the wait (the control channel's poll is an MPI_Iprobe, where MPICH may yield
    the core: a short wait would pay a turn of the other processes for it), or where
    `test_all` raises (the works name what failed)."""
    if test_all is None and len(works) == 1:
        test_all = works[0].test
    pending = list(works)
    spins = 0
    look = time.monotonic() + LOOK_S if test_all is not None else 0.0
    while pending:
        if test_all is not None and (not spins or time.monotonic() < look):
            try:
                if spins < YIELD:
                    if quick(test_all, spins >= SPIN):
                        return
                    spins += QUICK
                else:
                    if test_all():
                        return
                    spins += 1
                    backoff(spins)
            except Exception:  # noqa: BLE001 - the works' own tests below name the failure
                test_all = None
            continue
        still = [w for w in pending if not w.test()]
        if len(still) < len(pending):
            spins = 0
        pending = still
        if not pending:
            return
        if deadline is not None and time.monotonic() > deadline:
            raise timeout_error(rank, pending, timeout)
        if watched:
            watch(pending, deadline)
        look = time.monotonic() + LOOK_S
        spins += 1
        backoff(spins)


# How long past the deadline the waiting thread lets the waiter threads' own timeouts (gloo's,
# which say what failed) come first before it raises itself: no wait outlives its deadline
# by more, whatever a blocking wait inside a library does.
GRACE_S = 1.0


def wait_threads(be, polled, waits, deadline) -> None:
    """The wait of the backends whose works block (torch's gloo point-to-point): `waits`
    [(work, Future of its blocking wait)] complete on waiter threads while this thread tests
    the `polled` works (MPI progresses only inside MPI calls: mixed.py) and watches the
    control channel (WATCH) with what is still pending, so a peer's error
    raises here within milliseconds and a stalled wait names exactly the peers it waits for.
    A waiter's error raises as it comes; past the deadline (+GRACE_S for the waiters) a
    PeerTimeoutError names what is still pending."""
    spins = 0
    while polled or waits:
        polled = [w for w in polled if not w.test()]
        waits = [(w, f) for w, f in waits if not f.done() or f.result()]
        if not (polled or waits):
            return
        if deadline is not None:
            late = time.monotonic() - deadline
            if late > 0 and (polled or late > GRACE_S):
                raise timeout_error(be.rank, polled + [w for w, _ in waits], be.timeout)
        watch(polled + [w for w, _ in waits], deadline)
        if polled:
            spins += 1
            backoff(spins)
        else:
            time.sleep(2e-4)            # the waiters block in C++: nothing here to poll fast


def finish_all(works) -> None:
    """Run the `finish` of each work that has one, once they are done (native collectives'
    unpadding, a staged receive's copy to its device: torch_dist.py, torch_collectives.py)."""
    for w in works:
        finish = getattr(w, "finish", None)
        if finish is not None:
            finish()


def watch(pending: Sequence[Work], deadline) -> None:
    """Poll the control channel from a wait (gives the works up when it raises)."""
    w = WATCH
    if w is None:
        return
    try:
        w(pending, deadline)
    except BaseException:
        abandon(pending, cancel=True)
        raise


class Waiting:
    """A peer an exchange still waits for, as the control channel's watch takes it."""

    __slots__ = ("peers",)

    def __init__(self, r):
        self.peers = (r,)


def poll_peers(pending, take, deadline, late, nap=backoff) -> None:
    """The wait of an exchange of small objects (`timed_allgather`, the store's allgather):
    `take(pending)` gives the peers heard from now, until none is pending; past the deadline
    `late(pending)` gives the PeerTimeoutError to raise; meanwhile the control channel is
    watched with the peers still awaited, and `nap(spins)` leaves the core."""
    spins = 0
    while pending:
        got = take(pending)
        if got:
            pending = [r for r in pending if r not in got]
            spins = 0
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise late(pending)
        if WATCH is not None:           # a peer's error, or a peer in another call
            WATCH([Waiting(r) for r in pending], deadline)
        spins += 1
        nap(spins)


# -- the primitive interface -------------------------------------------------------------

class Backend:
    """What every distributed backend implements. Ranks are global (world) ranks; `ranks`
    of a collective are sorted ascending and include the root."""

    name = "?"
    wire = "numpy"          # buffers the primitives take: "numpy" (host) or "torch"
    reduce_dtypes: tuple | None = None  # dtypes its reductions compute exactly (None: every one)
    rank = 0
    world_size = 1
    timeout: float | None = None
    tag_ub = 1 << 29            # the largest tag a message may carry (MPI: the communicator's TAG_UB)
    # a receive posted ahead for a message of another size can be taken back (MPI: cancelled,
    # or truncated with an error); gloo aborts the process on a message larger than its receive
    # ("Received data size doesn't match expected size", pair.cc), so it cannot
    cancels_recv = False
    gather_reduces = False      # a reduce over 3+ ranks gathers to the root (MPI inside one host)
    hosts: list | None = None   # each rank's host, where the backend knows them (MPI)

    @property
    def signature(self) -> str:
        """What a construction agrees on of the backend: its name (mixed: and its table)."""
        return self.name

    def isend(self, buf, peer: int, tag: int) -> Work: raise NotImplementedError
    def irecv(self, buf, peer: int, tag: int) -> Work: raise NotImplementedError
    def bcast(self, buf, root: int, ranks: tuple[int, ...]) -> Work: raise NotImplementedError
    def reduce(self, buf, root: int, ranks: tuple[int, ...], op: str = "sum") -> Work: raise NotImplementedError
    def allgather_obj(self, obj, deadline: float | None, tag: int | None = None, accept=None,
                      ranks=None) -> list:
        """The small picklable `obj` of every rank of `ranks` (sorted, holding this rank;
        default all), in that order, within the deadline. `tag`: the round (default: a
        per-backend counter); `accept(rank, obj)` -> "take" | "drop" (stale) | "later"."""
        raise NotImplementedError

    # -- native collectives: ONE collective call of the backend on the group `ranks` --------
    # Only members call them, in the same order on every member. The group comes from the
    # cache `prepare_groups` filled (collectively, beforehand). Buffers are 1-d contiguous
    # arrays of the backend's `wire` kind; counts are elements of the buffer's dtype, one per
    # member in group order (backends/collectives.py checks them). Each returns a Work that
    # `wait_all` polls against the deadline; results are valid once it completes.

    def allreduce(self, buf, op: str, ranks: tuple[int, ...]) -> Work:
        """buf = op over the members' buf, in place on every member (op: sum, prod, min,
        max; avg is not native: the caller sums and divides)."""
        raise NotImplementedError

    def allgatherv(self, sendbuf, recvbuf, counts, ranks: tuple[int, ...]) -> Work:
        """recvbuf (sum(counts) elements, on every member) = the members' sendbufs (member i
        gives counts[i] elements) laid end to end in group order."""
        raise NotImplementedError

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op: str, ranks: tuple[int, ...]) -> Work:
        """sendbuf (sum(counts) elements) is cut into blocks of `counts`; member i's recvbuf
        (counts[i] elements) = op over the members of their block i."""
        raise NotImplementedError

    def alltoall(self, sendbuf, recvbuf, ranks: tuple[int, ...]) -> Work:
        """Equal blocks: sendbuf and recvbuf hold n blocks of len/n elements (n members);
        block j of member i's sendbuf becomes block i of member j's recvbuf."""
        raise NotImplementedError

    def gatherv(self, sendbuf, recvbuf, counts, root: int, ranks: tuple[int, ...]) -> Work:
        """The root's recvbuf (sum(counts) elements) = the members' sendbufs (counts[i]
        elements) in group order; recvbuf is ignored (may be None) on the other members."""
        raise NotImplementedError

    def scatterv(self, sendbuf, recvbuf, counts, root: int, ranks: tuple[int, ...]) -> Work:
        """Member i's recvbuf (counts[i] elements) = block i of the root's sendbuf
        (sum(counts) elements, blocks end to end); sendbuf is ignored (may be None) elsewhere."""
        raise NotImplementedError

    def ibarrier(self, ranks: tuple[int, ...]) -> Work:
        """A barrier over the group, non-blocking: completes once every member entered it."""
        raise NotImplementedError

    world_group = None          # the whole world's group (MPI: its communicator; torch: None)

    def _group(self, ranks):
        """The group of `ranks` (sorted world ranks) that `prepare_groups` made, or the world's."""
        if len(ranks) == self.world_size:
            return self.world_group
        try:
            return self._groups[ranks]
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: no {self.name} group for ranks {ranks}; "
                               "prepare_groups was not called for this plan") from None

    def barrier(self, deadline: float | None) -> None:
        self.allgather_obj(None, deadline)

    def bcast_group(self, ranks: tuple[int, ...], device_kind: str = "cpu") -> bool:
        """Whether a broadcast over `ranks` runs on a group (else point to point from the root)."""
        return True

    def prepare_groups(self, groups: Sequence[tuple[int, ...]], deadline: float | None) -> None:
        """Create (collectively, in this order) the groups not cached yet, within `deadline`."""

    # -- the control channel: small messages beside the data (meshcomm.runtime.control) ------
    def unread(self, objs, tag, ranks) -> None:
        """Put `allgather_obj`'s answers back for the next one on `tag` (an attempt that took
        them was void); nothing to do where reading leaves them (the torch store)."""

    def ctl_send(self, peer: int, data: bytes) -> None: raise NotImplementedError
    def ctl_poll(self) -> list: raise NotImplementedError

    def flush(self) -> None:
        """Issue any operations the backend batches (torch: batch_isend_irecv)."""

    def wait_all(self, works: Sequence[Work], deadline: float | None) -> None:
        self.flush()
        wait_polling(works, deadline, self.rank, self.timeout)

    def choose(self, op: str, nbytes: int, group_size: int, device: str) -> "Backend":
        """The concrete backend for one operation (mixed overrides this)."""
        return self

    def members(self) -> tuple["Backend", ...]:
        """The concrete backends this one may choose."""
        return (self,)

    def close(self) -> None:
        pass


# -- wire buffers ---------------------------------------------------------------------------

def _as_bytes(a):
    if _is_torch(a):
        import torch
        if a.numel() == 0:              # an empty tensor may have stride 0: no view of it
            return torch.empty(0, dtype=torch.uint8, device=a.device)
        return a.reshape(-1).view(torch.uint8)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def torch_of(b):
    """A NumPy buffer as a torch tensor over the same memory. A read-only buffer (a
    jax.Array's host view, say) is only ever sent from, so torch's warning about tensors
    over read-only memory is not shown to the user. bfloat16 (ml_dtypes', JAX's), which
    torch.from_numpy refuses, goes over as its bits."""
    import torch
    if b.dtype.name == "bfloat16":
        return torch_of(b.view(np.int16)).view(torch.bfloat16)
    if b.flags.writeable:
        return torch.from_numpy(b)
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(b)


def to_wire(a, wire: str, stream=None, typed: bool = False):
    """A packed 1-d array as the buffer a backend sends: raw bytes (any dtype, bfloat16
    included) unless `typed` (reductions). A CUDA tensor bound for a host backend is
    synchronised (host sync) and staged through host memory."""
    b = a if typed else _as_bytes(a)
    if wire == "numpy":
        if _is_torch(b):
            if b.device.type != "cpu":
                streams.host_sync(stream)
                b = b.cpu()
            return b.numpy()
        return b
    if not _is_torch(b):
        return torch_of(b)
    return b


def empty_wire(nbytes: int, wire: str, like, typed_elems: int | None = None):
    if wire == "numpy":
        if typed_elems is not None:
            return buffers.empty(typed_elems, _np_dtype(like))
        return buffers.empty(nbytes)
    import torch
    dev = like.device if _is_torch(like) else "cpu"
    if typed_elems is not None:
        dt = like.dtype if _is_torch(like) else torch_of(np.empty(0, like.dtype)).dtype
        return torch.empty(typed_elems, dtype=dt, device=dev)
    return torch.empty(nbytes, dtype=torch.uint8, device=dev)


def _np_dtype(like):
    if _is_torch(like):
        import torch
        return torch.empty(0, dtype=like.dtype).numpy().dtype
    return like.dtype


def from_wire(b, like, typed: bool = False):
    """A received buffer as a 1-d array of `like`'s kind, dtype and device."""
    if _is_torch(like):
        import torch
        if not _is_torch(b):
            b = torch_of(b)
        if b.device != like.device:
            b = b.to(like.device)
        if typed:
            return b
        if b.numel() == 0:              # torch gives an empty NumPy array stride 0: no view of it
            return torch.empty(0, dtype=like.dtype, device=like.device)
        return b.view(like.dtype)
    if _is_torch(b):
        b = to_numpy(b)
    return b if typed else b.view(like.dtype)


# -- a rank's program -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """This rank's part of transfer `index`.

    prim: "local" (no communication), "p2p" (2 ranks: send/recv), "bcast" (3+ ranks),
    "gather" (an ordered reduce: contributors send to the root rank, which sums in plan
    order) or "reduce" (the backend's reduce over 3+ ranks). `ranks` are the ranks taking
    part, sorted; `root` the sending rank (reduce: the receiving rank).
    """

    index: int
    stage: int
    prim: str
    root: int
    ranks: tuple[int, ...]
    nbytes: int

    @property
    def table_op(self) -> str:
        return {"p2p": "send", "bcast": "bcast", "gather": "reduce", "reduce": "reduce"}.get(self.prim, "")


# How sums over 3+ ranks run: "auto" (the backend's reduce for integers, except MPI on one
# host, where the root gathers; floats in plan order), "collective" (the backend's reduce for
# integers and float32/64: order not fixed), "ordered" (always gathered, added in plan order).
# Tests set it, the same on every process before any Program is constructed.
REDUCE_MODE = "auto"


def exact_reduce(dtype: str, backend: "Backend | None") -> bool:
    """Whether `backend`'s own reductions of `dtype` are exact (its `reduce_dtypes`)."""
    ok = None if backend is None else backend.reduce_dtypes
    return ok is None or dtype in ok


def collective_reduce_ok(dtype: str, backend: "Backend | None" = None) -> bool:
    """Whether a reduce over 3+ ranks uses the backend's collective reduce (else the root
    gathers and adds in plan order). auto: integers, except where the backend reports its
    collective reduce slower than gathering (`gather_reduces`: MPI inside one host). Every op
    (sum, prod, min, max) is exact in any order on integers. Float min/max are not: a NaN
    or a 0.0/-0.0 tie gives an order-dependent result (MPI's MIN/MAX keep or drop a NaN
    by its position), so floats of every op use the collective only with
    REDUCE_MODE = "collective". Never a dtype the backend does not reduce exactly
    (`exact_reduce`)."""
    mode = REDUCE_MODE
    if mode == "ordered" or not exact_reduce(dtype, backend):
        return False
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return False
    if mode == "collective":
        return kind in "iu" or dtype in ("float32", "float64")
    return kind in "iu" and not (backend is not None and backend.gather_reduces)


def _step_for(i, t, rank_of, collective_reduce: bool) -> Step:
    if t.kind == "reduce":
        root = rank_of(t.dsts[0])
        ranks = {rank_of(s) for s in t.srcs} | {root}
        if len(ranks) == 1:
            prim = "local"
        elif collective_reduce and len(ranks) >= 3:
            prim = "reduce"
        else:
            prim = "gather"
    else:
        root = rank_of(t.srcs[0])
        ranks = {root} | {rank_of(d) for d in t.dsts}
        prim = "local" if len(ranks) == 1 else ("p2p" if len(ranks) == 2 else "bcast")
    return Step(i, t.stage, prim, root, tuple(sorted(ranks)), t.nbytes)


@memo(maxsize=256)
def all_steps(plan, devices_per_process: int, collective_reduce: bool) -> tuple[Step, ...]:
    rank_of = lambda d: d // devices_per_process  # noqa: E731
    return tuple(_step_for(i, t, rank_of, collective_reduce) for i, t in enumerate(plan.transfers))


@memo(maxsize=256)
def compile_steps(plan, rank: int, devices_per_process: int, collective_reduce: bool) -> tuple[Step, ...]:
    """The steps `rank` takes part in, in global order."""
    return tuple(s for s in all_steps(plan, devices_per_process, collective_reduce) if rank in s.ranks)


@memo(maxsize=256)
def wire_bytes(plan, rank: int, devices_per_process: int, collective_reduce: bool) -> tuple[int, int]:
    """(sent, received): bytes `rank` puts on / takes off the wire in its steps of `plan`, by
    meshcomm.log's convention (summed over ranks, sent == received): p2p and bcast, the
    root sends nbytes to each other member; gather, each contributor sends nbytes per src
    device it holds; reduce, each non-root member sends nbytes; receivers count what is
    sent to them; local steps count nothing."""
    sent = recv = 0
    for s in compile_steps(plan, rank, devices_per_process, collective_reduce):
        if s.prim == "local":
            continue
        if s.prim == "gather":
            srcs = [d // devices_per_process for d in plan.transfers[s.index].srcs]
            if rank == s.root:
                recv += s.nbytes * sum(1 for q in srcs if q != rank)
            else:
                sent += s.nbytes * srcs.count(rank)
        elif s.prim == "reduce":
            if rank == s.root:
                recv += s.nbytes * (len(s.ranks) - 1)
            else:
                sent += s.nbytes
        elif rank == s.root:                # p2p, bcast
            sent += s.nbytes * (len(s.ranks) - 1)
        else:
            recv += s.nbytes
    return sent, recv


def groups_needed(plan, devices_per_process: int, collective_reduce: bool,
                  choose: Callable[[Step], "Backend"], device_kind: str = "cpu") -> dict[str, list[tuple[int, ...]]]:
    """{backend name: [rank tuples of every collective in the plan that runs on a group, in
    plan order]} (the same on every rank: it depends on the plan only). Broadcasts a
    backend sends point to point need none (`Backend.bcast_group`)."""
    out: dict[str, list] = {}
    for s in all_steps(plan, devices_per_process, collective_reduce):
        if s.prim in ("bcast", "reduce"):
            b = choose(s)
            if s.prim == "bcast" and not b.bcast_group(s.ranks, device_kind):
                continue
            lst = out.setdefault(b.name, [])
            if s.ranks not in lst:
                lst.append(s.ranks)
    return out


# -- a run's tiles (the executor: backends/batch.py) ------------------------------------------

@memo(maxsize=256)
def out_specs(plan, rank: int, devices_per_process: int) -> tuple:
    """(dst device, tile shape, starts as fill_op's identity) of each dst tile `rank` owns."""
    zero = set(plan.zero_fill)
    return tuple((d, tuple(b - a for a, b in box), d in zero or box_size(box) == 0)
                 for d, box in plan.dst.tiles(plan.shape).boxes.items() if d // devices_per_process == rank)


def result_tiles(plan, specs, like, out=None) -> dict:
    """A run's dst tiles: the caller's buffers where `out` has them (a Program's out=), else new."""
    res = {}
    for d, shape, zero in specs:
        if out is not None and d in out:
            res[d] = out[d]
            if zero:
                out[d][...] = alloc_like(like, shape, zero=True, op=plan.fill_op)
        else:
            res[d] = alloc_like(like, shape, zero=zero, op=plan.fill_op)
    return res


class Run:
    """One run's tiles of one plan (backends/batch.py `Runner`): packing, unpacking, the
    local steps and the collective ones."""

    def __init__(self, plan, shards, out, like, rank, rank_of, st, dt):
        self.plan, self.shards, self.out, self.like = plan, shards, out, like
        self.rank, self.rank_of, self.st, self.dt = rank, rank_of, st, dt

    def _src(self, t):
        return (self.shards, self.st.boxes) if t.src_buf == "src" else (self.out, self.dt.boxes)

    def _packed(self, t, s, copy=False):
        """The boxes of device s's tile as one 1-d message. Without `copy`, a single box
        that is contiguous in the tile is returned as a view (no packing copy)."""
        bufs, origin = self._src(t)
        if s not in bufs:
            raise ValueError(f"rank {self.rank} owns src device {s} but was given no tile for it")
        slices = [local_slices(b, origin[s]) for b in t.boxes]
        if not copy and len(slices) == 1:
            v = _contiguous_view(bufs[s], slices[0])
            if v is not None:
                return v
        return pack(bufs[s], slices)

    def _recv_into(self, t, mine, wire):
        """A receive buffer that IS the dst tile's memory, when one owned dst device gets the
        message as one contiguous box of its tile (no unpacking copy); else None."""
        if len(mine) != 1 or len(t.boxes) != 1:
            return None
        tile = self.out[mine[0]]
        if wire == "numpy" and _is_torch(tile) and tile.device.type != "cpu":
            return None                             # host staging needs its own buffer
        v = _contiguous_view(tile, local_slices(t.boxes[0], self.dt.boxes[mine[0]]))
        if v is None:
            return None
        return to_wire(v, wire)

    def _unpack_to(self, t, d, value):
        unpack(value, self.out[d], [local_slices(b, self.dt.boxes[d]) for b in t.boxes])

    def local(self, t):
        if t.kind == "reduce":
            acc = None
            for s in t.srcs:
                v = self._packed(t, s, copy=True)
                acc = v if acc is None else combine_(acc, v, self.plan.reduce_op)
            self._unpack_to(t, t.dsts[0], acc)
            return
        bufs, origin = self._src(t)
        src = bufs.get(t.srcs[0])
        if type(src) is np.ndarray:         # host tiles: each box copied once, tile to tile
            sls = [local_slices(b, origin[t.srcs[0]]) for b in t.boxes]
            for d in t.dsts:
                out, box = self.out[d], self.dt.boxes[d]
                for b, sl in zip(t.boxes, sls):
                    out[local_slices(b, box)] = src[sl]
            return
        v = self._packed(t, t.srcs[0])
        for d in t.dsts:
            self._unpack_to(t, d, v)

    def issue(self, s: Step, t, b: Backend, stream):
        """A collective step, a broadcast on a group or the backend's reduce (order-free
        dtypes): (its works, a function unpacking its result once they are done, or None)."""
        me = self.rank
        if s.prim == "bcast":
            mine = [d for d in t.dsts if self.rank_of(d) == me]
            if me == s.root:
                v = self._packed(t, t.srcs[0])
                for d in mine:
                    self._unpack_to(t, d, v)
                return [b.bcast(to_wire(v, b.wire, stream), s.root, s.ranks)], None
            direct = self._recv_into(t, mine, b.wire)
            if direct is not None:
                return [b.bcast(direct, s.root, s.ranks)], None
            buf = empty_wire(s.nbytes, b.wire, self.like)

            def fin():
                v = from_wire(buf, self.like)
                for d in mine:
                    self._unpack_to(t, d, v)
            return [b.bcast(buf, s.root, s.ranks)], fin
        op, acc = self.plan.reduce_op, None
        for src in t.srcs:
            if self.rank_of(src) == me:
                v = self._packed(t, src, copy=True)
                acc = v if acc is None else combine_(acc, v, op)
        if acc is None:                     # a root rank without contributors: the identity
            acc = alloc_like(self.like, (s.nbytes // self.plan.itemsize,), zero=True, op=op)
        w = to_wire(acc, b.wire, stream, typed=True)
        if me != s.root:
            return [b.reduce(w, s.root, s.ranks, op)], None
        return [b.reduce(w, s.root, s.ranks, op)], lambda: self._unpack_to(t, t.dsts[0], from_wire(w, self.like, typed=True))


def _contiguous_view(tile, sl):
    """tile[sl] as a 1-d view when that region is contiguous in memory, else None."""
    v = tile[sl + (...,)]       # a view of a 0-d tile too (by () NumPy gives a scalar copy)
    if _is_torch(v):
        return v.reshape(-1) if v.is_contiguous() else None
    if isinstance(v, np.ndarray) and v.flags.c_contiguous:
        return v.reshape(-1)
    return None
