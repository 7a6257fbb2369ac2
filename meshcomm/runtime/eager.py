"""Eager calls are cached Programs: the first call with given arguments constructs one
(program.construct), later calls find it by this process's own facts and run it (docs/runtime.md:
when a call agrees again)."""
from __future__ import annotations

import dataclasses

from . import control
from .program import Program, construct

__all__ = ["eager", "lookup", "EAGER_MAX"]

EAGER_MAX = 256     # eager call signatures kept per group of processes


@dataclasses.dataclass
class Entry:
    """An eager call signature's Programs: by this process's own facts, or (`exchange`) by
    the facts agreed on in each call."""

    exchange: bool
    programs: dict
    last: object = None             # the key of the Program this process ran last
    ranks: tuple = ()               # its processes: signatures are evicted per group (`eager`)


def lookup(ctx, sig, local_key, latest: bool = False) -> Program | None:
    """The cached Program of an eager call that every process decided alone, by this
    process's own facts `local_key` (`latest`: the one it ran last, for a process with no facts
    of its own, such as a broadcast's non-root passing None); None: construct (or agree)."""
    ch = control._CHANNEL
    if ch is not None:
        ch.poll()                   # Programs a peer reported failed are constructed again
    entry = ctx.eager.get(sig)
    if entry is None or entry.exchange:
        return None
    key = entry.last if latest else local_key
    prog = entry.programs.get(key)
    if not _runs(prog, ch):
        return None
    entry.last = key
    _used(ctx, sig)
    return prog


def _runs(prog, ch) -> bool:
    """Whether a cached Program runs: it exists and failed neither here nor on a peer."""
    return prog is not None and prog.failed is None and (ch is None or prog.id not in ch.failed)


def _used(ctx, sig) -> None:
    """Signature `sig` was used now: last in the eager cache's order (dropped last)."""
    if next(reversed(ctx.eager)) != sig:
        ctx.eager[sig] = ctx.eager.pop(sig)


def eager(ctx, sig, local_key, complete: bool, label: str, fields, err, extra, build, agreed_key,
          describe=None, ranks=None, agree_always=None) -> Program:
    """The Program of an eager call: found by `local_key` when every process decided alone
    last time, else constructed (or, in exchange mode, looked up after the agreement).
    `fields` may be a function giving them (called only then); `agree_always(metas)`: no
    process can decide alone (an uneven gather's sizes): every call agrees first."""
    # a local error takes part as on a first call (its Meta carries it): where the others
    # construct, all raise in that agreement; where they run, both sides stall on each other
    # in different calls and raise, failing the run's Program
    prog = lookup(ctx, sig, local_key) if err is None else None
    if prog is not None:
        return prog
    ch = control.current()
    if callable(fields):                # worked out only where it is constructed or agreed
        fields = fields()
    extra = dict(extra, complete=complete and err is None)

    def build_or_find(pid, metas, deadline):
        exchange = not all(m.extra.get("complete") for m in metas) or bool(agree_always and agree_always(metas))
        e = ctx.eager.get(sig)
        if e is None or e.exchange != exchange:
            e = ctx.eager[sig] = Entry(exchange, {})
        key = agreed_key(metas) if exchange else local_key
        prog = e.programs.get(key)
        if not _runs(prog, ch):
            prog = build(pid, metas, deadline)
            if len(e.programs) >= 16:
                e.programs.pop(next(iter(e.programs)))
            e.programs[key] = prog
        e.last = key
        return prog
    prog = construct(ctx, label, fields, err, extra, build_or_find, describe, ranks)
    # at most EAGER_MAX signatures per group of processes, the least recently used out: its
    # members make the same calls of it, not of other groups, so they drop the same ones
    group = ctx.eager[sig].ranks = prog.ranks
    _used(ctx, sig)                             # an exchange, agreed on every call, too
    mine = [s for s, entry in ctx.eager.items() if entry.ranks == group]
    if len(mine) > EAGER_MAX:
        del ctx.eager[mine[0]]
    return prog


