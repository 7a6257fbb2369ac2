"""Unit tests of the agreement and of a run's error paths (runtime/agreement.py, control.py),
in one process: two control channels joined by an in-memory pipe stand in for two processes
(the real ones run under mpiexec in tests/test_distributed.py)."""
from __future__ import annotations

import time

import pytest

from meshcomm.errors import PeerError, PeerTimeoutError
from meshcomm.runtime import agreement, control
from meshcomm.runtime.agreement import Meta
from meshcomm.runtime.program import tags_of


class Pipe:
    """A backend's control channel between ranks of one process: ctl_send appends to the
    peer's inbox, ctl_poll drains this rank's."""

    boxes: dict = {}

    def __init__(self, rank):
        self.rank = rank
        Pipe.boxes[rank] = []

    def ctl_send(self, peer, data):
        Pipe.boxes[peer].append((self.rank, data))

    def ctl_poll(self):
        out, Pipe.boxes[self.rank] = Pipe.boxes[self.rank], []
        return out


class W:
    """A pending work, as a wait hands it to the channel's watch."""

    def __init__(self, *peers):
        self.peers = peers


def channels(n=2, timeout=4.0):
    Pipe.boxes = {}
    return [control.Channel(Pipe(r), r, n, timeout) for r in range(n)]


def test_settle_names_who_differs_and_whose_input_failed():
    a = Meta("reshard", (("op", "reshard"), ("dtype", ("float32", 4))))
    b = Meta("reshard", (("op", "reshard"), ("dtype", ("int32", 4))))
    with pytest.raises(ValueError, match=r"disagree on the dtype: rank\(s\) \[0, 2\]: float32; rank\(s\) \[1\]: int32"):
        agreement.settle([a, b, a], 0, None)
    bad = Meta("reshard", (("op", "reshard"),), ("TypeError", "tile of device 3 is int8"))
    with pytest.raises(ValueError, match="rank 1: TypeError: tile of device 3 is int8"):
        agreement.settle([a, bad], 0, None)
    own = TypeError("mine")
    with pytest.raises(TypeError, match="mine"):
        agreement.settle([a, bad], 1, own)
    agreement.settle([a, a], 0, None)                       # agreement: no error


def test_a_peers_error_in_this_run_raises_at_once_naming_it():
    c0, c1 = channels()
    run = control.Call("run", 7, "reshard", 3)
    c0.call = c1.call = run
    c1.fail(ValueError("rank 1: src tile of device 1 has shape (1, 4)"))
    with pytest.raises(PeerError, match=r"rank 1 failed in run 3 of Program #7.*shape \(1, 4\)") as e:
        c0.watch([W(1)], None)
    assert e.value.rank == 1 and isinstance(e.value, ValueError)
    assert 7 in c0.failed and 7 in c1.failed                # the Program runs no more, anywhere


def test_a_peers_failure_in_another_call_waits_for_the_stall_or_the_next_call():
    c0, c1 = channels()
    c1.call = control.Call("run", 9, "all_reduce", 1)
    c1.fail(PeerTimeoutError("rank 1: recv with peer rank(s) [2] did not complete", (2,), "recv"))
    c0.call = control.Call("run", 8, "reshard", 5)
    c0.watch([W(2)], None)                                  # not waiting for rank 1: goes on
    c0.call = None
    with pytest.raises(PeerTimeoutError, match="rank 1 failed in run 1 of Program #9") as e:
        c0.raise_pending()                                  # its next meshcomm call
    assert e.value.peers == (2,)


def test_two_ranks_waiting_for_each_other_in_different_calls_raise():
    c0, c1 = channels(timeout=0.8)                          # stall after 0.1 s
    c0.call = control.Call("construct", 5, "reshard", 11)
    c1.call = control.Call("run", 4, "reshard", 2)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="not in the same call"):
        while time.monotonic() - t0 < 5:
            c1.watch([W(0)], None)
            c0.watch([W(1)], None)
            time.sleep(0.003)
    assert time.monotonic() - t0 < 1.0


def test_a_ring_of_three_waiting_in_different_calls_raises_on_each():
    # rank 0 waits for 1, 1 for 2, 2 for 0, each in a call of its own: a cycle none leaves.
    # The first to see it raises naming the ring; its report reaches the others (its ERROR
    # fails their runs' Programs), so every rank raises within about a second
    cs = channels(3, timeout=0.8)                           # stall after 0.1 s
    prev = [control.enter(c, control.Call("run", 10 + r, "all_reduce", 1, 4)) for r, c in enumerate(cs)]
    raised, t0 = {}, time.monotonic()
    while len(raised) < 3 and time.monotonic() - t0 < 5:
        for r, c in enumerate(cs):
            if r not in raised:
                try:
                    c.watch([W((r + 1) % 3)], None)
                except PeerError as e:
                    raised[r] = e
                    control.leave(c, prev[r], e)            # as a run's error path does
        time.sleep(0.003)
    assert sorted(raised) == [0, 1, 2] and time.monotonic() - t0 < 2.0
    assert "rank 2 is in run 1 of Program #12 (all_reduce) and waits for rank 0, which is in run 1 of " \
           "Program #10 (all_reduce) and waits for rank 1, which is in run 1 of Program #11 (all_reduce) " \
           "and waits for rank 2: " in str(raised[2]) and "not in the same call" in str(raised[2])
    assert raised[2].rank == 0 and all(f"rank 2 failed in run 1 of Program #12" in str(raised[r]) for r in (0, 1))
    assert all({10, 11, 12} <= c.failed for c in cs)         # every call of the ring runs no more


def test_a_ring_with_a_wait_inside_one_call_is_no_mismatch():
    # ranks 0 and 1 in one call (0 waits for 1: its part may be on its way), 1 waits for 2 in
    # another call, 2 for 0: not every link crosses calls, so nobody raises before the timeout
    cs = channels(3, timeout=0.8)
    cs[0].call = cs[1].call = control.Call("run", 10, "reshard", 1, 4)
    cs[2].call = control.Call("run", 12, "reshard", 1, 4)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.5:
        for r, c in enumerate(cs):
            c.watch([W((r + 1) % 3)], None)
        time.sleep(0.003)


def test_slow_peers_in_the_same_call_are_not_a_mismatch():
    c0, c1 = channels(timeout=0.8)
    c0.call = c1.call = control.Call("run", 4, "reshard", 2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.4:
        c0.watch([W(1)], None)
        c1.watch([W(0)], None)
        time.sleep(0.003)


def test_a_status_read_after_its_call_ended_is_no_mismatch():
    """A peer's STATUS from a call it has left, read only later (a long compressed run reads
    the channel when idle), is taken back by its CLEAR: found by benchmarks/compression.py,
    where rank 0 read rank 7's STATUS of a run two calls back and raised "not in the same call"."""
    c0, c1 = channels(timeout=0.8)                          # stall after 0.1 s
    first, later = control.Call("run", 4, "reduce_scatter", 1, 1), control.Call("run", 6, "reduce_scatter", 1, 3)
    prev = control.enter(c1, first)
    t0 = time.monotonic()
    while not Pipe.boxes[0]:                                # rank 1 stalls on rank 0 and tells it
        c1.watch([W(0)], None)
        time.sleep(0.003)
        assert time.monotonic() - t0 < 1
    control.leave(c1, prev)                                 # its run completes; rank 0 read nothing
    prev = control.enter(c0, later)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.4:                      # rank 0 waits for rank 1 in a later call
        c0.watch([W(1)], None)
        time.sleep(0.003)
    control.leave(c0, prev)
    assert 1 not in c0.status


def test_one_incident_raises_once():
    c0, c1, c2 = channels(3)
    run = control.Call("run", 2, "reshard", 1)
    c1.call = c2.call = run
    c1.fail(ValueError("bad input"))
    c2.fail(PeerError("rank 1 failed", 1))                  # relayed: nothing more is sent
    c0.call = None
    with pytest.raises(PeerError, match="rank 1 failed in run 1 of Program #2"):
        c0.raise_pending()
    c0.raise_pending()                                      # nothing left


def test_a_relay_that_comes_first_names_the_origin_and_hides_nothing():
    # rank 1 fails in a run; rank 2, in that run too, relays it; rank 0 is elsewhere (its part
    # of the run ended at once: now in a construction) and waits for rank 1. The relay reaches
    # rank 0 before rank 1's own report (Open MPI delivered them so): rank 0 must still raise,
    # naming rank 1, once its wait stalls; and a process that hears a relay first names the
    # origin, not the relaying process
    c0, c1, c2, c3 = channels(4, timeout=0.8)
    run = control.Call("run", 5, "all_reduce", 7, 12)
    c1.call = c2.call = c3.call = run
    c0.call = control.Call("construct", 9, "all_reduce", 3)
    boxes = Pipe.boxes
    c1.fail(ValueError("bad tile"))                         # its own report, to every process
    own = {r: boxes[r][:] for r in (0, 3)}                  # held back: rank 2's arrives
    for r in (0, 3):
        boxes[r].clear()
    with pytest.raises(PeerError) as first:
        c2.raise_pending()
    c2.fail(first.value)                                    # the relay, to every process
    boxes[0].extend(own[0])                                 # behind the relay at rank 0
    with pytest.raises(PeerError, match="rank 1 failed in run 7") as relayed:
        c3.raise_pending()                                  # the relay alone reached rank 3
    assert relayed.value.rank == 1 and "ValueError: bad tile" in str(relayed.value)
    c0.watch([W(1)], None)                                  # not stalled yet: nothing raised
    time.sleep(control.stall_after(0.8) + 0.01)
    c0._next = 0.0
    with pytest.raises(PeerError, match="rank 1 failed in run 7") as late:
        c0.watch([W(1)], None)
    assert late.value.rank == 1


def test_a_construction_that_failed_takes_its_meta_back():
    c0, c1 = channels()
    c1.call = control.Call("construct", 3, "reshard", 17)
    c1.fail(PeerTimeoutError("rank 1: peer rank(s) [2] did not arrive", (2,), "metadata"))
    c0.poll()
    assert (1, 17) in c0.retracted


def test_a_relay_carries_the_metas_its_origin_took_back():
    # rank 3's construction (nonce 17) fails beside the others' run; rank 0 hears of it first
    # and relays it; rank 2 raises on the relay and constructs again before rank 3's own report
    # arrives: the relay must already say that rank 3's Meta answers no later agreement (else
    # rank 2 takes the stale Meta, its error included, for its next attempt at that Program)
    c0, c1, c2, c3 = channels(4)
    run = control.Call("run", 5, "all_reduce", 7, 12)
    c0.call = c1.call = c2.call = run
    c3.call = control.Call("construct", 5, "all_reduce", 17)
    boxes = Pipe.boxes
    c3.fail(ValueError("backend must be one of ..."))        # its own report, with its Meta
    own = boxes[2][:]                                        # held back at rank 2
    boxes[2].clear()
    with pytest.raises(PeerError) as first:
        c0.raise_pending()
    c0.fail(first.value)                                     # the relay, to every process
    with pytest.raises(PeerError, match="rank 3 failed"):
        c2.raise_pending()
    assert (3, 17) in c2.retracted
    boxes[2].extend(own)


def test_programs_have_their_own_tags():
    seen = set()
    for pid in range(1, 2000):
        first, span = tags_of(pid, (1 << 29) - 1)
        assert first >= span and first + span - 1 <= (1 << 29) - 1
        assert first not in seen
        seen.add(first)
    assert tags_of(1, 32767)[0] + tags_of(1, 32767)[1] - 1 <= 32767


def test_two_slow_ranks_in_the_same_construction_are_not_a_mismatch():
    """Each construction's Call carries its own process's nonce: the same construction on two
    processes is still the same call."""
    c0, c1 = channels(timeout=0.8)
    c0.call = control.Call("construct", 5, "reshard", 11)
    c1.call = control.Call("construct", 5, "reshard", 17)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.4:
        c0.watch([W(1)], None)
        c1.watch([W(0)], None)
        time.sleep(0.003)


def test_a_blocking_wait_that_ignores_its_deadline_still_raises_past_it():
    """A waiter thread stuck inside a library's wait (past the timeout it was given: a fault
    no real peer can be made to produce on demand) does not hold the waiting thread: the
    one wait loop raises PeerTimeoutError naming the peer GRACE_S after the deadline, and a
    waiter's own error raises as it comes."""
    import concurrent.futures
    import threading

    from meshcomm.backends import base

    class Be:
        rank, timeout = 0, 0.2

    class W(base.Work):
        op, peers = "recv", (3,)

        def test(self):
            return False
    stuck = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        fut = pool.submit(stuck.wait, 30)
        t0 = time.monotonic()
        with pytest.raises(PeerTimeoutError) as e:
            base.wait_threads(Be(), [], [(W(), fut)], t0 + 0.2)
        assert 0.2 + base.GRACE_S <= time.monotonic() - t0 < 0.2 + base.GRACE_S + 2
        assert "peer rank(s) [3]" in str(e.value)
        stuck.set()

        def fails():
            raise PeerTimeoutError("rank 0: recv with peer rank(s) [1] failed: closed", (1,), "recv")
        with pytest.raises(PeerTimeoutError, match=r"\[1\] failed"):
            base.wait_threads(Be(), [], [(W(), pool.submit(fails))], time.monotonic() + 5)
    finally:
        stuck.set()
        pool.shutdown()
        base.ABANDONED.clear()


@pytest.mark.parametrize("inactive", [False, True])
def test_a_lean_run_whose_request_fails_raises_never_returns(monkeypatch, inactive):
    """The lean run polls the MPI request's own Test bare. An error there raises as the
    Work's test names it, or, where the failed request is inactive afterwards (its test
    then reports it done), as MPI gave it: never a result. It fails the Program and
    reaches the peer."""
    import threading

    import numpy as np

    from meshcomm.backends import base
    from meshcomm.runtime.program import Program

    class Req:
        def Test(self):
            raise RuntimeError("MPI_ERR_OTHER")

    class Work:
        req, peers, op = Req(), (1,), "allreduce"

        def test(self):
            if inactive:
                return True
            raise PeerTimeoutError("rank 0: allreduce with peer rank(s) [1] failed", (1,), "allreduce")

    class Prim:
        @staticmethod
        def wait_all(works, deadline):
            base.wait_polling(works, deadline)

    class Ctx:
        seq, _lock, _last, timeout, closed = {}, threading.Lock(), None, 4.0, False

    class Kernel:
        fns = (lambda x, seq: Work(), lambda: np.zeros(3, np.float32), Prim, True)
        lean = ((3,), np.dtype(np.float32), (fns, fns))

    chs = channels()
    monkeypatch.setattr(control, "_CHANNEL", chs[0])
    prog = Program(Ctx(), 7, "all_reduce", Kernel())
    prog.ranks = (0, 1)
    with pytest.raises(RuntimeError if inactive else PeerTimeoutError,
                       match="MPI_ERR_OTHER" if inactive else "peer rank"):
        prog(np.ones(3, np.float32))
    assert prog.failed is not None
    chs[1].poll()
    assert chs[1].errors and 7 in chs[1].failed
