"""The agreement: the one path by which processes agree on a Program (its operation, layouts
or group, backend, shape, dtype, counts, op) or all raise together.

It runs once per Program, at construction (an eager call constructs one on its first call
with given arguments; meshcomm.runtime.program). Each process describes its side as a `Meta`:
ordered fields that must be equal wherever they are known, its local validation error if
any, and a payload that is not compared (tile shapes). `agree` sends it to every process
(`Backend.allgather_obj`: point to point over MPI, naming a peer that does not arrive; the
rendezvous store over torch.distributed), so all of them run `settle` on the same list and
raise the same error: the process whose input was wrong raises its own TypeError or
ValueError, the others a ValueError naming its rank and cause.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any, Callable, Mapping, Sequence

from .. import settings
from ..caches import memo
from ..errors import PeerError
from . import control

__all__ = ["Meta", "agree", "settle", "error_of", "LABELS"]

LABELS = {
    "program": "the Program's number (every process constructs the same Programs in the same order)",
    "op": "the operation", "layouts": "the src/dst layouts", "mesh": "the mesh", "axes": "the mesh axes",
    "backend": "the backend", "shape": "the global shape", "dtype": "the dtype", "kind": "the array kind",
    "devtype": "the device type", "plan": "the plan (Plan.fingerprint)", "rows": "the row shape",
    "reduce_op": "the reduction op", "root": "the root", "dim": "the dimension", "codec": "the compression",
    "tile": "the tile shape", "algorithm": "the algorithm", "counts": "the counts", "params": "the parameters",
    "bucket": "bucket_mb=", "run": "the run's number",
    "names": "the tensor names (a process holding no tile of a tensor knows its name from dicts by name: shapes=, dtypes=)",
    "settings": "the MESHCOMM_* settings that shape a Program (settings.AGREED)",
}


@dataclasses.dataclass
class Meta:
    """What one process says about a Program before any of its data moves."""

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


@memo(maxsize=1024)
def layouts_fp(src, dst) -> str:
    """A fingerprint of a Program's layouts (a field: equal layouts, equal text)."""
    return hashlib.sha1(repr((src, dst)).encode()).hexdigest()[:16]


def group_key(ranks) -> int:
    """A number naming a group of processes, the same on every process."""
    import zlib
    return zlib.crc32(repr(tuple(ranks)).encode()) & 0x3FFFFFFF


def agree(ctx, ranks, counter, nonce: int, meta: Meta, own_error: BaseException | None = None,
          describe: Mapping[str, Callable[[Any, Meta], str]] | None = None, deadline: float | None = None) -> list:
    """The Metas of the processes `ranks` (sorted, this one among them) for their Program
    number `counter`, after `settle` found them in agreement (else raises, on each of them
    alike). Each Meta travels with its group, round and a nonce of its sender's: a Meta of
    another group or a later round waits for it; one of an earlier round, or whose sender
    gave its attempt up (a ("RETRACT", nonce) follows it), is dropped, so an attempt left
    behind by a failure never answers a later agreement."""
    if deadline is None:
        deadline = time.monotonic() + ctx.timeout
    meta = dataclasses.replace(meta, fields=meta.fields + (("settings", settings.agreed()),))
    ch = control.current()
    retracted = ch.retracted if ch is not None else set()
    g = group_key(ranks)
    # the round: the Program's number, and how many attempts at it failed together before
    # (the store keeps a value after its round: a later attempt must not read it)
    counter = (counter, ctx.tries.get((g, counter), 0))

    def accept(r, v):
        if v[0] == "RETRACT":           # its sender gave that attempt up (sent after its Meta)
            retracted.add((r, v[1]))
            return "drop"
        if v[0] != g:
            return "later"
        if (r, v[2]) in retracted or v[1] < counter:
            return "drop"
        return "take" if v[1] == counter else "later"
    try:
        got = ctx.backend.allgather_obj((g, counter, nonce, meta), deadline, tag=(g,) + counter, accept=accept,
                                        ranks=tuple(ranks))
    except BaseException as e:
        # this attempt's Meta may wait at the others: take it back, behind it on its channel
        ctx.backend.retract(("RETRACT", nonce), tag=(g,) + counter, ranks=tuple(ranks))
        if isinstance(e, PeerError) and isinstance(own_error, (ValueError, TypeError)):
            # the others are in another call (a run of this call's cached Program, say): this
            # process raises its own bad input, which is why it is here (they name it), as the
            # same incident to the control channel (the Programs it fails, the Metas to drop)
            for k in ("programs", "retracts", "relayed", "origin", "shared"):
                if hasattr(e, k):
                    setattr(own_error, k, getattr(e, k))
            raise own_error from e
        raise
    if ch is not None:
        ch.poll()
        if (ctx.rank, nonce) in retracted:
            # the others gave this attempt up (they saw it beside a run of theirs, failed, and
            # went on): the Metas it took are of their next attempt, so they go back for it
            ctx.backend.unread(got, (g,) + counter, tuple(ranks))
            pending = ch.pending()          # their report of it, taken
            if isinstance(own_error, (ValueError, TypeError)):
                own_error.shared = True     # its own bad input is why it is here (they name it)
                raise own_error
            if pending is not None:
                raise pending
            e = PeerError(f"rank {ctx.rank}: the others gave this construction up (they were in "
                          "another call)", next(r for r in ranks if r != ctx.rank))
            # they know (their report of it retracted this attempt, to every process): told
            # again, it would fail their next attempt at this same Program number
            e.shared = True
            raise e
    me = list(ranks).index(ctx.rank)
    metas = [meta if i == me else v[3] for i, v in enumerate(got)]
    try:
        settle(metas, me, own_error, describe, ranks=tuple(ranks))
    except Exception as e:
        e.shared = True         # every process of the group raises it now: nothing to tell them
        spent(ctx, ranks, counter[0])
        raise
    return metas


def spent(ctx, ranks, counter: int, after: BaseException | None = None) -> None:
    """The round of Program number `counter` is used up without a Program (its agreement or
    what followed it failed): the next attempt at that number takes a round of its own. Over
    the store a round's values stay under its key: read again, they would answer it. `after`:
    the error of what followed an agreement; a ValueError/TypeError there (planning the agreed
    Metas) is every process's own, so it is not reported (a report would cut a slower peer's
    agreement short, and that peer would not use the round up)."""
    if isinstance(after, (ValueError, TypeError)) and not isinstance(after, PeerError):
        after.shared = True
    g = group_key(ranks)
    ctx.tries[(g, counter)] = ctx.tries.get((g, counter), 0) + 1


def value(metas: Sequence[Meta], name: str, default=None):
    """The agreed value of a field, from any process that knows it."""
    return next((v for v in (m.get(name) for m in metas) if v is not None), default)


def settle(metas: Sequence[Meta], me: int, own_error: BaseException | None,
           describe: Mapping[str, Callable[[Any, Meta], str]] | None = None, ranks=None) -> None:
    """Raise, identically on every process, when any process had a local error or the
    processes disagree on a field. `own_error` is re-raised as is on the process that had it.
    `metas[i]` is rank `ranks[i]`'s (default: rank i)."""
    if own_error is not None:
        raise own_error
    ranks = range(len(metas)) if ranks is None else ranks
    errs = [(ranks[i], m) for i, m in enumerate(metas) if m.err is not None]
    if errs:
        op = errs[0][1].op
        text = f"{op} failed on other process(es): " + "; ".join(f"rank {r}: {m.err[0]}: {m.err[1]}"
                                                                 for r, m in errs[:4])
        if all(m.err[0] in ("PeerError", "PeerTimeoutError") for _, m in errs):
            raise PeerError(text, errs[0][0])       # a failure they heard of (a run's, say)
        raise ValueError(text)
    # this process's fields first, in their order, then any only others have
    for key in dict.fromkeys(k for m in (metas[me], *metas) for k, _ in m.fields):
        groups, first = {}, {}          # value -> its ranks, and the first Meta with it
        for i, m in enumerate(metas):
            v = m.get(key)
            if v is not None:
                groups.setdefault(_hashable(v), []).append(ranks[i])
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

