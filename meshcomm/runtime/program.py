"""Programs: agreed and planned once, then run with nothing but data (docs/runtime.md).

Construction (every process, same arguments, same order):
  1. validate this process's arguments locally (an error is kept, to be shared);
  2. `agreement.agree`: one allgather of every process's Meta; on an error or a mismatch
     every process raises, naming who differs;
  3. plan (cached), choose native call or plan (the tuning table), create what a run needs
     (groups, a communicator of its own for native MPI calls) within the deadline;
  4. the Program gets the next number: its point-to-point tags are its own
     (`tags`), so two Programs never match each other's messages.
Run (`prog(x)`): validate this process's input against what was agreed (locally), post,
wait. Every wait polls the control channel (runtime/control.py): a peer's error, or a peer
waiting in another call, raises within milliseconds; a missing peer within the timeout. A
run that failed anywhere marks its Program failed on every process (its messages may still
be in flight): the next run raises; eager calls construct a new Program. Eager calls are
cached Programs (runtime/eager.py).
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np

from .. import settings
from .. import log as _log
from ..errors import PeerTimeoutError
from ..handle import Handle
from ..backends import base
from ..backends.base import part
from . import agreement, context, control
from .agreement import Meta

# a lean run polls the control channel every POLL_EVERY + 1 runs (an MPI_Iprobe cost 5-10% of a
# small run's time at 8 processes, calls back to back): a process whose part ends without a
# failed peer (a broadcast's root) raises within that many calls of the peer's report
POLL_EVERY = 15

__all__ = ["Program", "checking", "construct", "fail_together", "tags_of", "part"]

GENERAL = object()        # the lean run declines: the general run takes it


def _into(r, into):
    """A lean run's result in the caller's out= buffer (received there, or copied in)."""
    if r is not into:
        into[...] = r
    return into


def _nothing():
    return None


TAG_SPAN = 1 << 18          # tags per Program: a step's tag is first + index % TAG_SPAN


def tags_of(pid: int, tag_ub: int) -> tuple[int, int]:
    """(first tag, span) of Program `pid`: slot 0 is left to messages outside Programs."""
    span = TAG_SPAN if tag_ub >= (1 << 24) else 2048
    slots = (tag_ub + 1) // span - 1
    return (1 + pid % slots) * span, span


class Program:
    """A communication program with fixed layouts, shapes, dtypes, backend and options: what
    every constructor returns (the public class, with the constructors, is
    meshcomm.runtime.programs.Program). `prog(x)` runs it, sending only data;
    `prog(x, async_op=True)` gives a Handle; `out=` takes result buffers.
    """

    def __init__(self, ctx, pid: int, label: str, kernel, plan=None):
        self.ctx, self.id, self.label, self._kernel, self.plan = ctx, pid, label, kernel, plan
        self.ranks, self.counter = (), 0    # its processes, and its number among their Programs
        self.runs, self.failed = 0, None    # failed: why it runs no more (str)
        self.check_every = settings.get("CHECK") == "every"     # read at construction
        lean = None if self.check_every or ctx is None else getattr(kernel, "lean", None)   # __call__
        self._lean = None if lean is None else self._lean_run(*lean)

    def __repr__(self) -> str:
        return f"Program(#{self.id} {self.label}, runs={self.runs})"

    # -- running --------------------------------------------------------------------------
    def __call__(self, x=None, *more, async_op: bool = False, out=None, recv_counts=None):
        """Run it on this process's input `x` (all_to_all_v: `prog(x, send_counts, recv_counts=None)`)."""
        lean = self._lean
        if lean is not None and not (more or async_op or _log.ON):
            r = lean(x) if out is None else lean(x, into=out)
            if r is not GENERAL:
                return r
        if more or recv_counts is not None:
            x = (x, more[0] if more else None, more[1] if len(more) > 1 else recv_counts)
        return self.start(x, async_op, out, _log.stamp(async_op) if _log.ON else None)

    def start(self, x, async_op, out, stamp, st=None):
        """A run: `st` is the kernel's prepared input where the caller checked it already."""
        ctx, k = self.ctx, self._kernel
        if ctx is not None and ctx.closed:      # not reported: the new context's Programs reuse its number
            raise RuntimeError(f"{self} was made before meshcomm.finalize(): construct it again after init()")
        if ctx is None or type(k) is Outside:       # one process owns every device, or none of it
            res = k.finish(k.run(k.prepare(x, out) if st is None else st, None, stamp))
            return Handle(result=res) if async_op else res
        last = ctx._last                        # after the asynchronous calls issued before (one
        if not async_op and last is not None and not last.done():     # may fail this Program)
            ctx.call(_nothing)
        self.runs += 1
        call = control.Call("run", self.id, self.label, self.runs, next_seq(ctx, self.ranks))
        ch = control._CHANNEL
        try:
            if ch is not None and ch.errors:
                ch.raise_pending()              # a peer's failure: raised naming it
            self._check_runs(ch)
            if st is None:
                st = k.prepare(x, out)
        except Exception as e:
            self._fail(ch, call, e)
            raise
        if async_op:
            fut = ctx.submit(self._go, ch, call, st, stamp)
            return Handle(lambda: k.finish(fut.result()), future=fut)
        with ctx._lock:
            r = self._go(ch, call, st, stamp)
        return k.finish(r)

    def _lean_run(self, shape, dtype, fns, unwrap=None, out_shape=None):
        """The lean run (`__call__`) of a kernel's `lean` (native_call.py, backends/lean.py): a
        bare NumPy tile of `shape` and `dtype` (shape None: no tile; other input by `unwrap(x)`:
        (tile or None, how the result goes back) or None); `fns`, per run parity: (post(tile,
        the run's place in the call sequence), result, primitive, whether the request is tested
        bare). Post, poll until about the wait's first look
        at the control channel (`base.LOOK_S`), take the result; a run not done by then waits
        in the control context. `into`: an out= buffer, taken where it is a NumPy array of
        `out_shape` and `dtype` that can be written in place (C order, writable, apart from the
        tile): the call receives into it, or the result is copied in. Anything else (another
        tile, another out=, a peer's failure pending, this Program failed): GENERAL, the general
        run, which checks and names what is wrong. All it reads is bound once (BENCHMARKS 3)."""
        ctx, pid, label, rec = self.ctx, self.id, self.label, control.RECORDER
        lock, ring, now, look = ctx._lock, rec.ring, time.time, base.LOOK_S
        acquire, release = lock.acquire, lock.release
        polite, every, yld = not base.SPIN, base.EVERY, os.sched_yield
        cell = []                               # the group's run counter (seq_cell), from the first run

        def other(x):                           # not a bare NumPy tile: unwrapped, or GENERAL
            got = None if unwrap is None else unwrap(x)
            if got is None:
                return GENERAL
            x, wrap = got
            r = run(x) if x is not None else run(None, True) if shape is None else GENERAL
            return r if r is GENERAL or wrap is None else wrap(r)

        def run(x, tileless=False, into=None):
            # every step here is paid on each process of every run, and on a shared core
            # each is paid several times over in wall time (BENCHMARKS 5): one function, the
            # lock taken by hand, the run counter a cell, the record a tuple
            if into is not None and (type(into) is not np.ndarray or into.shape != out_shape or
                                     into.dtype != dtype or not into.flags.c_contiguous or
                                     not into.flags.writeable or type(x) is not np.ndarray or
                                     np.may_share_memory(into, x)):
                return GENERAL
            if not tileless:
                if type(x) is not np.ndarray:
                    return other(x)
                if x.shape != shape or x.dtype != dtype:
                    return GENERAL
            last = ctx._last                    # after the asynchronous calls issued before (one
            if last is not None and not last.done():        # may fail this Program)
                ctx.call(_nothing)
            ch = control._CHANNEL
            if ch is None or ch.errors or self.failed is not None or pid in ch.failed or ctx.closed:
                return GENERAL
            if not cell:
                cell.append(seq_cell(ctx, self.ranks))
            acquire()
            try:
                c = cell[0]
                c[0] = seq = c[0] + 1           # next_seq, inline
                post, result, prim, raw = fns[seq & 1]
                self.runs = runs = self.runs + 1
                t0 = now()
                failed = None
                try:
                    w = post(x, seq) if into is None else post(x, seq, into)
                except Exception as e:          # noqa: BLE001 - raised below, in the call's context
                    failed = e
                else:                           # base.quick's loop, inline
                    t, i = w.req.Test if raw else w.test, 0
                    try:
                        while not t():
                            i += 1
                            if polite and not i % every:
                                yld()
                            if not i & 31:
                                if i == 32:
                                    until = time.monotonic() + look
                                elif time.monotonic() > until:
                                    break
                        else:                   # control.leave's record, and its end of an incident
                            rec.seq += 1
                            ring.append((rec.seq, ("run", pid, label, runs, seq), "done", (), t0, now()))
                            if ch.incident:
                                ch.incident = set()
                            if ch.cheap and not runs & POLL_EVERY:
                                ch.poll()       # a peer's report, raised at a later call
                            return result() if into is None else _into(result(into), into)
                    except Exception as e:      # noqa: BLE001 - raised in the wait, named by the Work's test
                        try:
                            w.test()            # a failed request may be inactive now: keep MPI's error then
                        except Exception as named:  # noqa: BLE001
                            e = named
                        failed = e

                def wait():
                    if failed is not None:
                        raise failed
                    prim.wait_all(w.parts(), time.monotonic() + ctx.timeout)
                    return result() if into is None else _into(result(into), into)
                return self._in_call(ch, control.Call("run", pid, label, runs, seq), wait, check=False)
            finally:
                release()
        return run

    def _check_runs(self, ch) -> None:
        """RuntimeError where this Program failed, here or on a peer (its messages may still be
        in flight)."""
        if self.failed is None and ch is not None and self.id in ch.failed:
            self.failed = "a process failed in one of its runs"
        if self.failed is not None:
            raise RuntimeError(f"{self} failed earlier ({self.failed}); its messages may still be in "
                               "flight, so it runs no more: construct a new Program")

    def _go(self, ch, call, st, stamp):
        """The run itself, in the call's control context (on the calling or the queue's thread)."""
        def run():
            self._check_runs(ch)                    # an asynchronous run queued behind a failed one
            if self.check_every:                    # MESHCOMM_CHECK=every: each run agrees (debugging)
                ctx = self.ctx
                ctx.attempts += 1
                agreement.agree(ctx, self.ranks, (self.counter, self.runs), ctx.attempts, Meta(
                    self.label, (("program", self.id), ("run", self.runs))))
            self._kernel.seq = call.seq             # runs one at a time, in call order (ctx._lock)
            return self._kernel.run(st, time.monotonic() + self.ctx.timeout, stamp)
        return self._in_call(ch, call, run)

    def _in_call(self, ch, call, fn, check=True):
        """`fn()` in the call's control context (`control.enter`; `check`: raise what peers
        reported first): an error fails this Program unless `local_only`; peers are told."""
        prev = control.enter(ch, call, check)
        try:
            r = fn()
        except Exception as e:
            if not getattr(e, "local_only", False):
                self.failed = f"run {call.run}: {type(e).__name__}"
            if getattr(e, "out_of_step", False) and ch is not None:     # a peer at another place in
                e.programs = sorted(ch.group_of.get(self.id, {self.id}))  # the sequence: any may be in flight
            control.leave(ch, prev, e)
            raise
        control.leave(ch, prev)
        return r

    def start_checked(self, check, async_op, stamp):
        """A run of input `check()` prepares (its error fails the run here and on every peer)."""
        try:
            st = check()
        except Exception as e:
            self.runs += 1                  # counted as a run, as on its peers (which run it)
            self._fail(control.current(), control.Call("run", self.id, self.label, self.runs,
                                                       next_seq(self.ctx, self.ranks)), e)
            raise
        return self.start(None, async_op, None, stamp, st)

    def _fail(self, ch, call, e) -> None:
        """A run that failed before it communicated: peers are told, and the Program is done."""
        self.failed = f"run {call.run}: {type(e).__name__}"
        if ch is not None:
            prev, ch.call = ch.call, call
            try:
                ch.fail(e)
            finally:
                ch.call = prev

    # -- what it does -----------------------------------------------------------------------
    def explain(self) -> str:
        if self.plan is None:
            return f"{self.label}: one native collective call per group ({self._kernel.describe()})"
        return self.plan.explain()

    def simulate(self, topology=None):
        if self.plan is None:
            raise ValueError(f"{self.label} runs as one native collective call; it has no plan to simulate")
        return self.plan.simulate(topology)


CLASS: list = [Program]      # the class Programs are made of (runtime/programs.py's subclass)


class Outside:
    """The kernel of a Program on a process that owns none of its devices: it takes part in
    no agreement and no run; a run checks that nothing was passed and returns `empty()`."""

    def __init__(self, label, empty):
        self.label, self.empty = label, empty

    def describe(self) -> str:
        return "nothing on this process"

    def prepare(self, x, out=None):
        if x is not None and not (isinstance(x, (dict, tuple)) and not any(
                v for v in (x.values() if isinstance(x, dict) else x[:1]))):
            raise ValueError(f"{self.label}: this process owns no device of it but passed input")
        return None

    def run(self, st, deadline, stamp=None):
        return None

    def finish(self, r):
        return self.empty()


def outside(ctx, label: str, empty=dict) -> "Program":
    """The Program of a process outside it (no agreement, no communication)."""
    return new(ctx, 0, label, Outside(label, empty))


# -- construction --------------------------------------------------------------------------

def construct(ctx, label: str, fields: tuple, err, extra: dict, build: Callable, describe=None, ranks=None):
    """The one construction path, for the processes `ranks` (those owning a device it
    involves; default all): agree on `fields`, then `build(pid, metas, deadline)` -> Program;
    all raise together on a mismatch. `pid`, the same on each: their group and its count."""
    ranks = tuple(range(ctx.world_size)) if ranks is None else tuple(ranks)
    counter = ctx.counters.get(ranks, 0) + 1    # counted once constructed: no gap after a failure
    pid = agreement.group_key((ranks, counter))     # the same on each of them, another for each Program
    ctx.attempts += 1                   # this process's agreements: its Meta's nonce
    err = err or base.stale_error()
    ch = control.current()
    if err is None and ch is not None:  # a peer's failure heard since: all raise it (not this one alone)
        err = ch.pending()
    group = ctx.group_programs.setdefault(ranks, set())
    if ch is not None:
        ch.group_of[pid] = group        # a mismatch found in this construction fails them all
        ch.where[pid] = (ranks, counter)
    with control.entering(ch, control.Call("construct", pid, label, ctx.attempts)):
        deadline = time.monotonic() + ctx.timeout
        cell = seq_cell(ctx, ranks)
        extra = dict(extra, seq=cell[0])
        try:
            metas = agreement.agree(ctx, ranks, counter, ctx.attempts,
                                    Meta(label, fields, agreement.error_of(err), extra), err, describe, deadline)
        except PeerTimeoutError as e:
            # the others did not come: they may be running the group's eager Programs without
            # this process (their part needing none of it, a broadcast's say), runs ahead of it
            # now: those are done for, here and there (audit: a leaf ran its cached broadcast
            # afterwards and got the root's earlier runs). Programs the caller holds run on:
            # their runs wait for the missing process and name it
            if getattr(e, "programs", None) is None:
                e.programs = sorted(p.id for entry in ctx.eager.values() if entry.ranks == ranks
                                    for p in entry.programs.values())
            raise
        # the group's run sequence, the same on each again (a mismatch may have left them apart)
        cell[0] = max(m.extra.get("seq", 0) for m in metas)
        try:
            prog = build(pid, metas, deadline)
        except BaseException as e:              # agreed, not built: its round is used up
            agreement.spent(ctx, ranks, counter, e)
            raise
        if not prog.counter:            # new (an eager call that agrees each time finds its own)
            prog.ranks, prog.counter = ranks, counter
            ctx.programs += 1
        ctx.counters[ranks] = counter
        group.add(prog.id)
        if ch is not None and prog.id != pid:
            ch.group_of.pop(pid, None)
            ch.group_of[prog.id], ch.where[prog.id] = group, ch.where.pop(pid)
        return prog


class checking:
    """`with checking(label, meshes):` around the local checks of a call's arguments: an error
    raises by `fail_together` (a class, not a generator: eager calls enter it every time)."""

    def __init__(self, label: str, meshes: Callable[[], tuple] | None = None):
        self.label, self.meshes = label, meshes

    def __enter__(self):
        return None

    def __exit__(self, et, e, tb):
        if et is not None and issubclass(et, (ValueError, TypeError)):
            fail_together(self.label, e, self.meshes)
        return False


def fail_together(label: str, e: Exception, meshes: Callable[[], tuple] | None = None):
    """Raise `e`, a local error in a call's arguments, after sharing it through the construction
    the others are in (those owning a device of `meshes()`; None: every process, an adapter's
    call), so each raises at once, naming this rank (bad meshes: here alone, the group unknown)."""
    ctx = context.current()
    if ctx is not None:
        try:
            ranks = None if meshes is None else ctx.ownership.participants(*meshes())
        except Exception:               # noqa: BLE001 - bad meshes: the group is unknown
            raise e from None
        if ranks is None or ctx.rank in ranks:
            try:
                ctx.call(construct, ctx, label, (("op", label),), e, {}, None, None, ranks)
            except Exception as other:  # noqa: BLE001 - its own error, or a peer missing
                if other is not e:
                    raise e from other
    raise e


def seq_cell(ctx, ranks) -> list:
    """The group's run counter, a one-item list (`Context.seq`): a lean run keeps it."""
    c = ctx.seq.get(ranks)
    if c is None:
        c = ctx.seq[ranks] = [0]
    return c


def next_seq(ctx, ranks) -> int:
    """The next run's number among the group's Programs' runs (calling thread, call order):
    it picks the run's part of the tags (`part`) or, by its parity, its communicator."""
    c = seq_cell(ctx, ranks)
    c[0] = n = c[0] + 1
    return n


def new(ctx, pid: int, label: str, kernel, plan=None) -> Program:
    """A Program object: of the public class (runtime/programs.py registers it in CLASS)."""
    return CLASS[0](ctx, pid, label, kernel, plan)
