"""The agreement check: one path by which every entry point makes all processes agree on a
call (operation, layouts or group, backend, shape, dtype, counts, op) or all raise together.

Each process describes its call as a `Meta`: ordered fields that must be equal wherever they
are known, its local validation error if any, and a payload that is not compared (tile
shapes, counts). `exchange` sends it to every process:

* `allgather` (default up to 8 processes): every Meta reaches every process, so all of them
  run `settle` on the same list and raise the same error (the process whose input was wrong
  raises its own TypeError/ValueError; the others a ValueError naming its rank and cause).
  A missing peer is named exactly. Over MPI it starts with a round of hashes: every process
  sends the fixed-size vector of hashes described below (200 bytes) to every other one,
  point to point, into receives posted beforehand (no pickling, no probing). Where every
  process could decide and all vectors agree, that decides (a repeated call, the common
  case); otherwise every process sees so in the same vectors and the Metas follow.
  `start` posts that round without waiting, so a caller may start its data first
  (reshard's first stage) and wait for both together.
  Over MPI a call whose hashes every process agreed on twice before is checked by its
  signature communicator instead (`Pending.signature_comm`): a barrier there, or the call's
  own all_reduce, all_gather, reduce_scatter or all_to_all over every process (not a rooted
  call: its root, or a non-root, completes once its own message is out), completes only if
  every process made exactly this call; a process still waiting after
  MESHCOMM_SIGNATURE_GRACE, or seeing a peer's hashes of this check, sends its own, so a disagreement is decided by the same round. The
  vectors carry the check's number and arrive in an always-posted inbox
  (backends/hash_round.py `Inbox`).
* `allreduce` (above 8 processes, or MESHCOMM_CHECK_EXCHANGE=allreduce): first one
  MIN-allreduce of a vector of hashes, O(log N) messages per process. Where every process
  could decide (no local error, nothing to infer) and all agree, that decides. Otherwise
  every process sees so in the same reduced vector and runs the allgather, which names who
  differs. A timeout in the allreduce can only name the group.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import settings
from ..caches import memo
from .check_vector import CODES, NONE, decided, masked_codes, signature_key, vector_any

__all__ = ["Meta", "Outcome", "Pending", "start", "exchange", "settle", "check_mode", "error_of", "raise_together", "LABELS",
           "quick_signed", "inbox_ready"]

LABELS = {
    "op": "the operation", "layouts": "the src/dst layouts", "mesh": "the mesh", "axes": "the mesh axes",
    "backend": "the backend", "shape": "the global shape", "dtype": "the dtype", "kind": "the array kind",
    "devtype": "the device type", "plan": "the plan (Plan.fingerprint)", "rows": "the row shape",
    "reduce_op": "the reduction op", "root": "the root", "dim": "the dimension", "codec": "the compression",
    "tile": "the tile shape", "algorithm": "the algorithm", "counts": "the counts",
}


@dataclasses.dataclass
class Meta:
    """What one process says about a call before any of its data moves."""

    op: str
    fields: tuple[tuple[str, Any], ...]     # (name, value) in the order disagreements are reported
    err: tuple[str, str] | None = None      # (exception type name, message) of a local error
    extra: dict = dataclasses.field(default_factory=dict)   # per-process payload, not compared

    def get(self, name: str):
        for k, v in self.fields:
            if k == name:
                return v
        return None


def error_of(e: BaseException | None) -> tuple[str, str] | None:
    return None if e is None else (type(e).__name__, str(e))


def check_mode(be) -> str:
    mode = settings.get("CHECK_EXCHANGE")
    if mode == "auto":
        return "allreduce" if be.world_size > 8 else "allgather"
    return mode


@dataclasses.dataclass
class Outcome:
    """What `exchange` learnt: every process's Meta (`metas`, after the allgather), or only
    that all agree (`metas` None: the hashes decided; `reduced` is their minimum)."""

    fields: tuple
    metas: list | None = None
    reduced: list | None = None
    via: str = "allgather"      # what decided: "allgather" (the Metas), "allreduce", "hash" or "signature"
    mixed: bool = False         # the hashes agreed, but some processes had posted a signature
                                # check the others did not: every process resets MPI's communicators

    def value(self, name: str, default=None):
        """The agreed value of a field: from any process that knows it (a process without
        tiles learns kind/devtype this way)."""
        if self.metas is not None:
            for m in self.metas:
                v = m.get(name)
                if v is not None:
                    return v
            return default
        own = dict(self.fields).get(name)
        if own is not None:
            return own
        if name in CODES:
            i = [k for k, _ in self.fields].index(name)
            c = self.reduced[1 + i]
            return default if c == NONE else CODES[name][c - 1]
        return default


def exchange(be, meta: Meta, deadline: float | None, eligible: bool = True) -> Outcome:
    """Send `meta` to every process. A call where every process is `eligible` (no error,
    nothing left to infer: every field but the coded ones known) and all agree is decided
    by the hashes alone (one allreduce, or over MPI's allgather one round of fixed-size
    vectors); otherwise the allgather of the Metas runs everywhere."""
    return start(be, meta, deadline, eligible).finish()


HASH_TAG = 32766    # the hash round's tag on the data communicator (see Pending)


class Pending:
    """An exchange in flight (`start`); `finish()` waits for it and returns the Outcome.

    The hash round of the allgather form (backends/hash_round.py) travels on the p2p
    backend's own (data) communicator, posted before any data of the call. `meta.extra`
    may still be filled in until `finish` (the Metas are sent only there, when the hashes
    do not decide)."""

    def __init__(self, be, meta: Meta, deadline: float | None, eligible: bool, hashed=None,
                 signature: bool = False):
        self.be, self.meta, self.deadline = be, meta, deadline
        self.mode = check_mode(be)
        fields = meta.fields if hashed is None else hashed
        ok = eligible and meta.err is None and all(v is not None for k, v in fields if k not in CODES)
        self.vec = vector_any(fields, ok)
        self.round, self.p2p, self.box, self.sig, self.key, self.grace = None, None, None, None, None, None
        if self.mode == "allgather":
            self.p2p = next((b for b in be.members() if b.wire == "numpy"), None)
        if self.p2p is not None and be.world_size > 1:
            from ..backends import hash_round
            self.box = hash_round.inbox_of(self.p2p, HASH_TAG, len(self.vec))
            if self.box is None:
                self.round = hash_round.start(self.p2p, self.vec, HASH_TAG)
                return
            self.seq = self.p2p._agree_seq = getattr(self.p2p, "_agree_seq", 0) + 1
            if signature and ok and settings.get("SIGNATURE_CHECK"):
                self.key = signature_key(self.p2p, self.vec, [k for k, _ in fields])
                self.sig = self.p2p.sig_comm(tuple(range(be.world_size)), ("agree", self.key.tobytes()))
            if self.sig is None:
                self.round = hash_round.InboxRound(self.box, self.seq, self.vec)

    @classmethod
    def signed(cls, be, p2p, meta: Meta, deadline: float | None, vec: np.ndarray, key: np.ndarray, sig,
               counted: bool = False, grace: float | None = None) -> "Pending":
        """The check of a repeated call on its known signature communicator `sig` (a compiled
        call, meshcomm.runtime.compiled `Fast`): what `start` would build for it, from
        the vectors it computed then (`vec`, `key`); the inbox must be current (`inbox_ready`).
        `counted`, `grace`: `quick_signed` numbered this check and waited until `grace`."""
        self = cls.__new__(cls)
        self.be, self.meta, self.deadline, self.mode = be, meta, deadline, "allgather"
        self.vec, self.p2p, self.box, self.sig, self.key, self.round = vec, p2p, p2p._inbox, sig, key, None
        self.seq = p2p._agree_seq if counted else _count(p2p)
        self.grace = grace
        return self

    @property
    def signature_comm(self):
        """The MPI communicator kept for exactly this call (every process agreed on these
        arguments twice before), or None: the call is checked by a round of hashes. With it,
        the caller posts on it what completes only if every process made this call (a
        barrier, or the call's own native collective over all processes where
        native_call.self_checking says it is its own check) and passes those works to
        `hashes`."""
        return self.sig

    def signature_tokens(self) -> list:
        """With a signature communicator: the barrier on it, posted now (pass it to `hashes`),
        so the check travels while the caller readies its data; else []."""
        return self.p2p.ibarrier_on(self.sig) if self.sig is not None else []

    def hashes(self, tokens=(), ready=None) -> Outcome | None:
        """Wait for the hashes (the allreduce, or the round of vectors), or with a signature
        communicator for `tokens` (see `signature_comm`); the Outcome when they decide, else
        None (every process gets None together: `metas` must follow)."""
        meta = self.meta
        if self.mode == "allreduce":
            out = self.be.allreduce_min(self.vec, self.deadline).tolist()
            return Outcome(meta.fields, None, out, "allreduce") if decided(out) else None
        if self.sig is not None:
            return self._by_signature(list(tokens) or self.p2p.ibarrier_on(self.sig), ready)
        if self.round is not None:
            self.round.wait(self.deadline)
            rows = self.round.rows
            out = rows.min(axis=0).tolist()
            if not decided(out):
                return None
            oc = Outcome(meta.fields, None, out, "hash", mixed=bool(rows[:, 0].max() == 1))
            if self.box is not None and not (rows[:, 0] != 0).any():
                self._remember(np.asarray(out, np.int64))
            return oc
        return None

    def _remember(self, out: np.ndarray) -> None:
        """Every process could decide and all agreed (`out`: the reduced vector, the same
        everywhere): the second time, keep a communicator for it (collective over all
        processes; every process sees the same rows, so all decide alike, and the backend
        caps how many it keeps). A process without tiles does not know the array kind and
        device type: it takes them from `out` next time (`signature_key`)."""
        key = out.tobytes()
        seen = self.p2p.__dict__.setdefault("_agree_seen", {})
        codes = self.p2p.__dict__.setdefault("_agree_codes", {})
        if len(seen) >= 4096:
            seen.clear()
            codes.clear()
        codes[masked_codes(out, [k for k, _ in self.meta.fields]).tobytes()] = out
        if key in seen:
            self.p2p.sig_comm(tuple(range(self.be.world_size)), ("agree", key), self.deadline, create=True)
        else:
            seen[key] = True

    def _by_signature(self, tokens, ready=None) -> Outcome | None:
        """Wait until `tokens` complete (every process is in this exact call). A process
        still waiting after the grace, or that sees a peer's hashes of this check, sends its
        own (marked: sent from a signature check); once every process's hashes are in, a
        disagreement returns None on every process, in this call. Nothing else is sent.
        `ready`: (some of the tokens, a function) called once those complete, if they do
        before all of them (a reshard starts its data with the peers already in the call)."""
        from ..backends.base import abandon, backoff, timeout_error
        box, seq, meta = self.box, self.seq, self.meta
        vec, grace = None, self.grace
        sent = agreed = False
        spins = 0
        test = _tester(tokens)
        gate = None if ready is None else _tester(ready[0])
        while True:
            # the tokens are polled alone most of the time: MPI moves the data only inside
            # its calls, and with more processes than cores every bit of Python between
            # them slows the whole group
            if test(_QUICK):
                box.settle(seq)
                return Outcome(meta.fields, None, self.key.tolist(), "signature")
            if gate is not None and gate(1):
                gate = None
                ready[1]()
            box.poll()
            if grace is None:
                grace = time.monotonic() + settings.get("SIGNATURE_GRACE")
            if not sent and (box.any_at(seq) or time.monotonic() > grace):
                vec = self.key.copy()
                vec[0] = 1
                box.send(seq, vec)
                sent = True
            if sent and not agreed and box.complete(seq):
                rows = box.rows(seq, vec)
                box.settle(seq)
                out = rows.min(axis=0).tolist()
                if not decided(out):
                    abandon(tokens)
                    return None
                if not (rows == rows[0]).all():     # some process checks by hashes alone
                    abandon(tokens)
                    return Outcome(meta.fields, None, out, "hash", mixed=True)
                agreed = True                       # a late peer: the tokens will complete
            if self.deadline is not None and time.monotonic() > self.deadline:
                abandon(tokens)
                late = box.missing(seq) if sent and not agreed else tokens
                raise timeout_error(self.be.rank, late, self.be.timeout)
            spins += 1
            backoff(spins)

    def metas(self) -> Outcome:
        """Every process's Meta (the allgather), after `hashes` returned None."""
        return Outcome(self.meta.fields, self.be.allgather_obj(self.meta, self.deadline))

    def finish(self) -> Outcome:
        return self.hashes() or self.metas()


def _count(p2p) -> int:
    p2p._agree_seq += 1
    return p2p._agree_seq


def _requests(works) -> list | None:
    """The MPI requests behind `works` (MPIWork, MPIMultiWork), or None if some work has none."""
    reqs = []
    for w in works:
        r = getattr(w, "req", None)
        if r is not None:
            reqs.append(r)
        elif getattr(w, "reqs", None) is not None:
            reqs.extend(w.reqs)         # MPIMultiWork: a broadcast as point-to-point messages
        else:
            return None
    return reqs


@memo(1)
def _testall():
    from mpi4py import MPI
    return MPI.Request.Testall


def quick_signed(p2p, works, timeout: float | None):
    """A signature check's happy path, with nothing built: number the check (as
    `Pending.signed` does) and poll `works` (on the signature communicator) as
    `Pending.hashes` does, while no peer's hashes of this check arrive and its grace (at
    most `timeout`) lasts. True, with the check settled, when they completed; else the
    grace's end (a time): the check goes on as `Pending.signed(..., counted=True,
    grace=that)`, from the same number."""
    seq = _count(p2p)
    test = _tester(works)
    box = p2p._inbox
    grace = None
    while not test(_QUICK):
        box.poll()
        if grace is None:
            g = settings.get("SIGNATURE_GRACE")
            grace = time.monotonic() + (g if timeout is None else min(g, timeout))
        if box.any_at(seq) or time.monotonic() > grace:
            return grace
    box.settle(seq)
    return True


def inbox_ready(p2p) -> bool:
    """Whether `p2p`'s inbox of agreement vectors is there for its current communicator."""
    box = getattr(p2p, "_inbox", None)
    return box is not None and box.comm is p2p.comm


def start(be, meta: Meta, deadline: float | None, eligible: bool = True, hashed=None,
          signature: bool = False) -> Pending:
    """Begin `exchange` without waiting: post the hash round where there is one. `hashed`:
    the fields to hash instead of `meta.fields` (a process that guesses values it does
    not know: the hashes decide only if every process agrees with the guess; its Meta,
    sent when they do not, keeps the fields it really knows). `signature`: the caller can
    use a signature communicator (`Pending.signature_comm`) where one exists."""
    return Pending(be, meta, deadline, eligible, hashed, signature)


def settle(metas: Sequence[Meta], me: int, own_error: BaseException | None,
           describe: Mapping[str, Callable[[Any, Meta], str]] | None = None) -> None:
    """Raise, identically on every process, when any process had a local error or the
    processes disagree on a field. `own_error` is re-raised as is on the process that had it."""
    if own_error is not None:
        raise own_error
    errs = [(r, m) for r, m in enumerate(metas) if m.err is not None]
    if errs:
        op = metas[errs[0][0]].op
        raise ValueError(f"{op} failed on other process(es): " +
                         "; ".join(f"rank {r}: {m.err[0]}: {m.err[1]}" for r, m in errs[:4]))
    names = [k for k, _ in metas[me].fields]
    for m in metas:
        for k, _ in m.fields:
            if k not in names:
                names.append(k)
    for key in names:
        groups: dict = {}
        first: dict = {}
        for r, m in enumerate(metas):
            v = m.get(key)
            if v is not None:
                groups.setdefault(_hashable(v), []).append(r)
                first.setdefault(_hashable(v), m)
        if len(groups) > 1:
            fmt = (describe or {}).get(key)
            detail = "; ".join(f"rank(s) {rs}: {fmt(v, first[v]) if fmt else _show(v)}"
                               for v, rs in groups.items())
            raise ValueError(f"processes disagree on {LABELS.get(key, key)}: {detail}")


def _show(v) -> str:
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int):
        return v[0]                         # (dtype name, itemsize)
    return str(v)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


_QUICK = 16     # polls of a signature check's tokens between looks at the inbox and the clock


def _tester(works):
    """test(n): whether every work is done, polling up to n times (yielding the core between
    polls, as every wait does). MPI requests are tested in one Testall call."""
    reqs = _requests(works)
    if reqs is not None:
        testall, yield_ = _testall(), os.sched_yield

        def test(n):
            for _ in range(n):
                if testall(reqs):
                    return True
                yield_()
            return False
        return test
    pending = list(works)

    def test(n):
        nonlocal pending
        pending = [w for w in pending if not w.test()]
        return not pending
    return test


def raise_together(ctx, op: str, err: BaseException):
    """A local error found before a call could even be formed (an adapter's bad placement):
    this process takes part in the agreement exchange the others are in, so every process
    raises at once (the others a ValueError naming this rank) instead of waiting out the
    timeout. Raises `err` here."""
    import time
    meta = Meta(op, (("op", op),), error_of(err))

    def go():
        out = exchange(ctx.backend, meta, time.monotonic() + ctx.timeout, eligible=False)
        settle(out.metas, ctx.rank, err)
    ctx.run(go, False)()
    raise err
