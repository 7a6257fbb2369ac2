"""The control channel: run errors reach every peer, stalled waits find out what each runs,
and a flight recorder keeps the last calls of this process.

Runs send only data (meshcomm.runtime.program), so a failure in one process must reach the
others some other way. Every backend carries small control messages beside its data
(`Backend.ctl_send` / `ctl_poll`: a communicator of their own over MPI, the rendezvous store
over torch.distributed). These travel:

* ERROR (rank, call, text, error type): a process whose run or construction failed tells
  every other process. A process waiting in any call raises `PeerError` naming the sender
  (or `PeerTimeoutError` when the sender timed out); a process not in a call raises at its
  next meshcomm call or at `finalize()`.
* STATUS (rank, call, peers it waits for): a wait that made no progress for `stall_after()`
  seconds tells every process what it is in. A process at one end of a cycle of waits in
  which each waits for the next, and the next is in another call (another Program, another
  run of it, or a construction), raises `PeerError`: they are not in the same call, and none
  can go on (two processes waiting for each other, or three or more in a ring). When that
  call is over, CLEAR (rank, call) takes the STATUS back: a peer that reads the channel
  only later (a long compressed run reads it when idle) must not take it for the present.
* Timeouts stay local: a wait past its deadline raises `PeerTimeoutError` and sends ERROR.
* BYE (rank, counts): it is in `finalize()` (or exits); a wait stalled on it in a call it
  never made raises `PeerError`; `finalize()` waits for every BYE, so a failure raises there.

Every backend wait polls `watch` (installed in backends.base.WATCH at init): at most every
`POLL_S` seconds it reads the channel, so a healthy run pays one clock read per poll.

The flight recorder (runtime/recorder.py) is written when a call fails.
"""
from __future__ import annotations

import contextlib
import pickle
import time
import typing

from ..backends import base
from ..errors import NOT_SAME_CALL, PeerError, PeerTimeoutError
from .recorder import RECORDER, Recorder, dump

__all__ = ["Call", "Channel", "RECORDER", "current", "entering", "dump"]

POLL_S = 0.002          # seconds between looks at the control channel while waiting


class Call(typing.NamedTuple):
    """What a process is in: `what` ("construct" or "run"), the Program's number and label,
    the run's number (for a construction: the nonce its Meta travels with), and for a run its
    number among the runs of its group's Programs (`Context.seq`)."""

    what: str
    program: int
    label: str
    run: int = 0
    seq: int = 0

    @property
    def key(self) -> tuple:
        """The call itself, the same on every process (a construction's nonce is its own): a
        run at another place in its group's sequence is another call (a process skipped one)."""
        return (self.what, self.program, self.run, self.seq) if self.what == "run" else (self.what, self.program, 0, 0)

    def __str__(self) -> str:
        if self.what == "construct":
            return f"the construction of Program #{self.program} ({self.label})"
        return f"run {self.run} of Program #{self.program} ({self.label})"




class Channel:
    """This process's end of the control channel over a backend (`ctl_send`/`ctl_poll`)."""

    def __init__(self, backend, rank: int, world: int, timeout: float):
        self.be, self.rank, self.world, self.timeout = backend, rank, world, timeout
        # a poll is an MPI_Iprobe over MPI (after every call, a lean run's every 16th:
        # program.POLL_EVERY), a round trip to the rendezvous store over torch (only where a
        # call waits, and as an eager call starts)
        self.cheap = getattr(backend, "name", None) in ("mpi", "mixed")
        self.call: Call | None = None        # what this process is in now
        self.entry: list | None = None       # its flight-recorder entry
        self.errors: list = []               # ERRORs received, not raised yet
        self.status: dict = {}               # rank -> its last STATUS (call, peers)
        self.failed: set = set()             # Program numbers failed here or reported failed (run no more)
        self.seen: set = set()               # those whose failure was raised or counted here (`_known`)
        self.group_of: dict = {}             # Program number -> its group's Program numbers (program.construct)
        self.retracted: set = set()          # (rank, nonce): Metas their senders gave up on
        self.handled: set = set()            # (rank, call): peers' failures raised for already
        self.mine: set = set()               # calls this process failed in (peers' errors in them: known)
        self.incident: set = set()           # Programs of its last failure, until a call of its succeeds
        self.bye: dict = {}                  # rank -> its BYE's counts: it makes no more calls (`_skipped`)
        self.where: dict = {}                # Program number -> (its processes, its count among their Programs)
        self.gone: set = set()               # peers a timeout named: finalize() does not wait for them
        self._next = 0.0
        self._stall_sent: float | None = None
        self._stall_peers: set = set()       # the peers told this call's STATUS (CLEAR at its end)
        self._wait_start: float | None = None

    # -- sending ---------------------------------------------------------------------------
    def _send(self, peers, msg) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for p in peers:
            if p != self.rank:
                try:
                    self.be.ctl_send(p, data)
                except Exception:  # noqa: BLE001 - a dead peer's channel: nothing more to tell it
                    pass

    def fail(self, err: BaseException) -> None:
        """Tell every other process that this process's current call failed with `err`; the
        Programs it names (`err.programs`, default: the call's) are failed everywhere: their
        messages may still be in flight, so no process runs them again."""
        call = self.call
        if self.entry is not None:
            Recorder.done(self.entry, "failed")
        if isinstance(err, PeerTimeoutError):
            self.gone.update(err.peers)
        if getattr(err, "local_only", False):
            return                          # raised after a run that completed everywhere
        programs = getattr(err, "programs", None)
        if programs is None:
            programs = [call.program] if call is not None and call.what == "run" else []
        self.failed.update(programs)
        self.seen.update(programs)
        if base.STALE:                      # work given up may match a run of any Program
            self.failed.update(self.group_of)
            self.seen.update(self.group_of)
        if call is not None:
            self.mine.add(call.key)
        self.incident = set(programs)
        # peers' reports of this same incident, come in before it ended here: raised for now
        self.errors[:] = [m for m in self.errors if not self._known(m[1], m[2], m[6])]
        if getattr(err, "shared", False):
            return                          # every process raises it in this same agreement
        # a peer's error relayed here is passed on too (flagged `info`), as that peer's (its
        # `origin`): a process waiting in this call only for this one (a relay of a plan)
        # learns it from nobody else, and one that hears the relay first names the origin
        info = getattr(err, "relayed", False)
        if info and call is None:
            return
        who, text, kind, peers = getattr(err, "origin", None) or (
            self.rank, f"{type(err).__name__}: {err}",
            "timeout" if isinstance(err, PeerTimeoutError) else type(err).__name__, list(getattr(err, "peers", ())))
        # Metas to drop: this process's own (its construction failed) and a peer's that it
        # found in a construction beside this run (the others must not take it either)
        retract = list(getattr(err, "retracts", ()))
        if call is not None and call.what == "construct":
            retract.append((self.rank, call.run))
        self._send(range(self.world), ("ERROR", who, call, text, kind, peers, list(programs), retract, info))

    # -- receiving -------------------------------------------------------------------------
    def poll(self) -> None:
        waiting = []                            # peers' STATUS naming this process: checked last
        for src, data in self.be.ctl_poll():
            msg = pickle.loads(data)
            if msg[0] == "ERROR":
                call = msg[2]
                known = self._known(msg[1], call, msg[6])
                self.retracted.update(tuple(r) for r in msg[7])
                # a relayed report counts only in the run it was relayed from (the origin's own
                # report reaches everyone else; a construction's key is the same for a later
                # attempt at it, so a relayed report of one is only a retraction). One that
                # does not count fails no Program here either: else the origin's own report,
                # come in behind it, would look known and be dropped too
                counts = not known and (not msg[8] or (call is not None and call.what == "run" and
                                                       self.call is not None and call.key == self.call.key))
                if counts:
                    self.errors.append(msg)
                if counts or not msg[8]:
                    self.seen.update(msg[6])
                # a relay fails its Programs too: two processes that found each other in
                # different calls at once each raise the other's report, so no report of
                # theirs is an origin's, and the others ran a failed Program on (the processes
                # whose part ended constructed no new one beside those that did: they waited out
                # the timeout in every later call, or paired calls apart)
                self.failed.update(msg[6])
                if msg[4] == "timeout":
                    self.gone.update(msg[5])
            elif msg[0] == "BYE":
                self.bye[msg[1]] = msg[2]
            elif msg[0] == "STATUS":
                self.status[msg[1]] = (msg[2], tuple(msg[3]), time.monotonic())
                if self.rank in msg[3]:
                    waiting.append((msg[1], msg[2]))
            elif msg[0] == "CLEAR" and msg[1] in self.status and self.status[msg[1]][0] == msg[2]:
                del self.status[msg[1]]         # that peer is past the call it reported
        for p, call in waiting:                 # after the reports come in with them (one incident)
            self._out_of_step(p, call)

    def _out_of_step(self, p, call) -> None:
        """Peer `p` waits for this process in run `call`, at a place of the group's call
        sequence where this process made another run (found in the flight recorder): its
        part there ended alone (a pure sender's, a broadcast's root), and it went on. Every
        process is told, this one raises at its next call, and every Program of the group
        fails everywhere: the waiting run would otherwise wait out the timeout, or match a
        later run of this one. (Not for a waiting construction: the processes that ran on
        then raise in different calls, and later calls pair apart: docs/runtime.md.)"""
        group = self.group_of.get(call.program) if call is not None and call.what == "run" else None
        if not group or call.program in self.failed:       # unknown, or known here already
            return
        mine = self.call
        if mine is not None and mine.what == "run" and mine.seq == call.seq:
            return      # this process is at that place too, in another call: the stalled waits pair up
        for entry in RECORDER.ring:
            c = entry[1]
            if c[0] != "run" or c[4] != call.seq or c[1] not in group:
                continue
            if c[1] == call.program and c[3] == call.run:
                return                      # the same run: its messages are on their way
            programs = sorted(group)
            self.failed.update(programs)
            self.seen.update(programs)
            text = (f"at place {call.seq} of their group's call sequence rank {self.rank} made {Call(*c)} "
                    f"and rank {p} waits in {call}: {NOT_SAME_CALL}")
            self.errors.append(("ERROR", p, call, text, "out of step", [p], programs, [], False))
            self._send(range(self.world), ("ERROR", self.rank, call, text, "out of step", [], programs, [], False))
            return

    def _known(self, who, call, programs) -> bool:
        """Whether a peer's report is known here already (one incident, several reports): its
        failure raised for here, a call this process failed in too, a run of a Program failed
        here, or a failure of Programs this process's own last failure failed, before any call
        of its succeeded since (the peer's side of the same incident: a construction beside
        the run this process failed in, say)."""
        return call is not None and ((who, call.key) in self.handled or call.key in self.mine or (
            call.what == "run" and call.program in self.seen and call != self.call)
            or not self.incident.isdisjoint(programs))

    def raise_pending(self, now=None) -> None:
        """Raise the first error a peer reported (at a call's start, at finalize; in a wait,
        `now(msg)` picks the ones that concern it)."""
        e = self.pending(now)
        if e is not None:
            raise e

    def pending(self, now=None) -> BaseException | None:
        """The first error a peer reported and not raised yet (taken: the list is cleared),
        else None (a construction brings it into its agreement: program.construct)."""
        self.poll()
        errs = self.errors if now is None else [m for m in self.errors if now(m)]
        if not errs:
            return None
        _, who, call, text, kind, peers, _, retracts, _ = errs[0]
        self.errors.clear()
        where = f" in {call}" if call is not None else ""
        mine = f" (this process: {self.call})" if self.call is not None and self.call != call else ""
        msg = f"rank {who} failed{where}{mine}: {text}"
        e = PeerTimeoutError(msg, tuple(peers) or (who,), str(call)) if kind == "timeout" else PeerError(msg, who)
        # a relay of it carries the Metas its origin took back: it may reach a process before
        # the origin's own report does, and that process may construct again in between
        e.relayed, e.origin, e.retracts = True, (who, text, kind, list(peers)), list(retracts)
        return e

    def goodbye(self, wait: bool, counts: dict) -> None:
        """BYE to every other process, with `counts` (its groups -> (runs, Programs)); with
        `wait`, until each said BYE (not those a timeout named), a reported failure or not:
        each peer's BYE is its last message, so the channel is drained (a later context's
        channel may get this one's freed communicator again, and read what was left on it:
        a stale BYE made a finalize() return before a peer's error). Not the wait of a call
        (`watch`: this is no call, and a peer's error raises after, `raise_pending`)."""
        self._send(range(self.world), ("BYE", self.rank, counts))
        deadline = time.monotonic() + self.timeout
        while wait:
            self.poll()
            missing = set(range(self.world)) - self.bye.keys() - self.gone - {self.rank}
            if not missing:
                return
            if time.monotonic() > deadline:
                raise self.pending() or PeerTimeoutError(
                    f"finalize(): rank(s) {sorted(missing)} did not call finalize() within MESHCOMM_TIMEOUT "
                    f"({self.timeout:g} s)", sorted(missing), "finalize()")
            time.sleep(POLL_S)

    def _skipped(self, p, call) -> bool:
        """Whether peer `p`, gone (its BYE), never made `call` (one that did may still have its
        part on its way: a broadcast's tree)."""
        w = self.where.get(call.program)
        if w is None:
            return False
        runs, built = self.bye[p].get(w[0], (0, 0))
        return runs < call.seq if call.what == "run" else built < w[1]

    def watch(self, pending, deadline) -> None:
        """Called by every backend wait between polls with its pending works (it acts at
        most every POLL_S seconds): raise a peer's error, detect two processes waiting for
        each other in different calls, tell the peers waited for what this process is in
        once it stalls."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + POLL_S
        peers = {p for w in pending for p in w.peers}
        call = self.call
        if self._wait_start is None:
            self._wait_start = now
        stalled = now - self._wait_start >= stall_after(self.timeout)
        # a peer's failure in this very call raises at once; in another call, once this wait
        # stalls on that peer (it may have done its part here before it failed) or the failure
        # failed this run's Program (a ring of waits: it runs nowhere again), else at the next call
        self.raise_pending(lambda m: (m[2] is not None and call is not None and m[2].key == call.key)
                           or (stalled and (m[1] in peers or (call is not None and call.what == "run"
                                                                 and call.program in m[6]))))
        if call is None:
            return
        if self.entry is not None:
            Recorder.waiting(self.entry, peers)     # the peers it still waits for, now
        if not stalled:
            return
        left = [p for p in sorted(peers) if p in self.bye and self._skipped(p, call)]
        if left:                            # it makes no more calls: its part here never comes
            e = PeerError(f"rank {self.rank} is in {call} and waits for rank {left[0]}, which called "
                          f"finalize() (or exited) without taking part in it: {NOT_SAME_CALL}", left[0])
            e.programs = sorted(self.group_of.get(call.program, ())) or None
            raise e
        cycle = self._cycle(call, peers)
        if cycle:
            links = [(r, self.status[r][0]) for r in cycle]
            # every Program of the calls' groups is done for: a call that one process made
            # alone (its part ended at once) may have left messages of any of them in
            # flight, and its peers do not know which
            programs = {c.program for _, c in links if c.what == "run"}
            if call.what == "run":
                programs.add(call.program)
            for c in [call] + [c for _, c in links]:
                programs.update(self.group_of.get(c.program, ()))
            self.failed.update(programs)
            self.seen.update(programs)
            self.handled.update((r, c.key) for r, c in links)
            retracts = [(r, c.run) for r, c in links if c.what == "construct"]   # answer no later agreement
            self.retracted.update(retracts)
            text = "".join(f" and waits for rank {r}, which is in {c}" for r, c in links)
            e = PeerError(f"rank {self.rank} is in {call}{text} and waits for rank {self.rank}: {NOT_SAME_CALL}",
                          cycle[0])
            e.retracts, e.programs = retracts, sorted(programs)
            raise e
        if self._stall_sent is None or now - self._stall_sent > 1.0:
            self._stall_sent = now
            self._stall_peers = set(range(self.world))     # every process: a cycle's links
            self._send(self._stall_peers, ("STATUS", self.rank, call, list(peers)))

    def _cycle(self, call, peers) -> list:
        """The shortest cycle of waits from this process back to it in which each process waits
        for the next and the next is in another call (the STATUS every other one sent since
        this wait began): its ranks after this one, else []. Neither can go on. A wait for a
        peer in the same call is no link: that peer's part may be on its way."""
        now = {p: st[:2] for p, st in self.status.items() if st[2] >= self._wait_start}
        now[self.rank] = (call, tuple(peers))
        parent, frontier = {self.rank: None}, [self.rank]
        while frontier:
            later = []
            for u in frontier:
                for v in sorted(now[u][1]):
                    if v not in now or now[v][0].key == now[u][0].key:
                        continue
                    if v == self.rank:
                        path = [u]
                        while parent[path[-1]] is not None:
                            path.append(parent[path[-1]])
                        return path[-2::-1]
                    if v not in parent:
                        parent[v] = u
                        later.append(v)
            frontier = later
        return []


def stall_after(timeout: float) -> float:
    """Seconds without progress after which a wait tells its peers what it is in."""
    return min(0.5, timeout / 8)


_CHANNEL: Channel | None = None


def current() -> Channel | None:
    return _CHANNEL


def install(ch: Channel | None) -> None:
    """Make `ch` the channel every backend wait polls (None: no context)."""
    global _CHANNEL
    _CHANNEL = ch
    base.WATCH = ch.watch if ch is not None else None
    base.STALE.clear()              # a new context: the old one's given-up works are its own


@contextlib.contextmanager
def entering(ch: Channel | None, call: Call):
    """`with entering(ch, call):` around a construction: raises what peers reported first;
    records the call; on an error tells every peer and dumps the recorder (`enter`/`leave`
    without the context manager: a Program's run)."""
    prev = enter(ch, call)
    try:
        yield
    except BaseException as e:
        leave(ch, prev, e)
        raise
    leave(ch, prev)


def enter(ch: Channel | None, call: Call, check: bool = True):
    """This process is in `call` now: what it was in before (for `leave`). `check`: raise
    what peers reported first (a lean run looked before it posted)."""
    if ch is None:
        return None
    if check and ch.errors:
        ch.raise_pending()
    prev = (ch.call, ch.entry, ch._wait_start, ch._stall_sent, ch._stall_peers)
    ch.call = call
    ch.entry = RECORDER.start(call)
    ch._wait_start = ch._stall_sent = None
    ch._stall_peers = set()
    return prev


def leave(ch: Channel | None, prev, ev=None) -> None:
    """The call is over (`ev`: the error it raised): on an error every peer is told and the
    recorder dumped."""
    if ch is None:
        return
    try:
        if ch._stall_peers:             # the STATUS it sent in this call holds no more
            ch._send(ch._stall_peers, ("CLEAR", ch.rank, ch.call))
        if isinstance(ev, Exception):
            ch.fail(ev)
            path = dump(ch.rank)
            if path is not None and isinstance(ev, (PeerError, PeerTimeoutError)) \
                    and "flight recorder" not in str(ev):
                ev.args = (f"{ev.args[0] if ev.args else ev} [flight recorder: {path}]",) + ev.args[1:]
        else:
            RECORDER.done(ch.entry)
            if ch.incident:
                ch.incident = set()         # a call succeeded: a later report is news
            if ch.cheap:
                ch.poll()                   # a peer's failure reported by now: raised at the next call
    finally:
        ch.call, ch.entry, ch._wait_start, ch._stall_sent, ch._stall_peers = prev
