"""What the communication model returns: one `CommEntry` per kind of call, bus factors, and
`summary` (totals per op, per phase, per meshcomm call and per message-size bucket).

Sizes follow nccl-tests' PERFORMANCE.md ("size" of a collective, and its bus bandwidth):

| op             | message_bytes (one call)                 | bus factor (n = group size) |
| -------------- | ---------------------------------------- | --------------------------- |
| all_reduce     | the buffer reduced                       | 2(n-1)/n                    |
| all_gather     | the gathered (output) buffer, all ranks' | (n-1)/n                     |
| reduce_scatter | the (input) buffer before scattering     | (n-1)/n                     |
| all_to_all     | this rank's send buffer (all peers')     | (n-1)/n                     |
| broadcast      | the buffer                               | 1                           |
| reduce         | the buffer                               | 1                           |
| send           | the message this rank sends              | 1                           |
| recv           | the message this rank receives           | 0 (its bytes are the sender's wire bytes) |

`bytes_per_rank = message_bytes * calls` (logical bytes) and `wire_bytes = bus factor *
bytes_per_rank`: what one rank sends on its links when the collective runs as a ring (for
all_reduce, all_gather, reduce_scatter and all_to_all that is also what it receives).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from ..bandwidth import BUS_FACTORS, bus_factor

__all__ = ["CommEntry", "BUS_FACTOR", "bus_factor", "SIZE_BUCKETS", "size_bucket", "Totals",
           "Summary", "summary", "merge", "format_bytes", "table"]

# the one table (meshcomm.bandwidth), under the API's names as the model's entries use them
BUS_FACTOR = {op: BUS_FACTORS[key] for op, key in (
    ("all_reduce", "allreduce"), ("all_gather", "allgather"), ("reduce_scatter", "reduce_scatter"),
    ("all_to_all", "alltoall"), ("broadcast", "bcast"), ("reduce", "reduce"), ("send", "send"),
    ("recv", "recv"))}


@dataclasses.dataclass(frozen=True)
class CommEntry:
    """`calls` calls of `op` per iteration on one rank, each moving `message_bytes`.

    phase: which part of training issues them ("tp.fwd", "pp.bwd", "dp.grad", ...).
    via: the meshcomm call that performs them ("all_reduce", "reshard", "all_to_all_v", ...);
      by default the op's own name.
    mean: True when the figure is the mean over the group's ranks rather than this rank's own
      (all-to-all-v whose counts depend on the data; DLRM tables split unevenly and no rank
      asked for): then the sum over ranks is exact, and each rank's only when balanced.
    bytes_per_rank, wire_bytes: derived (module docstring)."""
    op: str
    group_size: int
    message_bytes: int
    calls: int
    phase: str = ""
    via: str = ""
    mean: bool = False
    bytes_per_rank: int = dataclasses.field(init=False)
    wire_bytes: float = dataclasses.field(init=False)

    def __post_init__(self):
        for name in ("message_bytes", "calls"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} of {self.op} ({self.phase}) must be an int >= 0, got {v!r}")
        f = bus_factor(self.op, self.group_size)
        object.__setattr__(self, "via", self.via or self.op)
        object.__setattr__(self, "bytes_per_rank", self.message_bytes * self.calls)
        object.__setattr__(self, "wire_bytes", f * self.message_bytes * self.calls)

    def __str__(self) -> str:
        return (f"{self.phase or '-'}: {self.calls} x {self.op}({format_bytes(self.message_bytes)}, "
                f"n={self.group_size})")


def merge(entries: Iterable[CommEntry]) -> list[CommEntry]:
    """Entries equal but for `calls` summed into one, in first-seen order."""
    calls: dict = {}
    for e in entries:
        key = (e.op, e.group_size, e.message_bytes, e.phase, e.via, e.mean)
        calls[key] = calls.get(key, 0) + e.calls
    return [CommEntry(op, n, size, c, phase, via, mean) for (op, n, size, phase, via, mean), c in calls.items()]


# message-size buckets: (label, lower bound inclusive, upper bound exclusive)
SIZE_BUCKETS = (("<64KiB", 0, 64 << 10), ("64KiB-1MiB", 64 << 10, 1 << 20),
                ("1-16MiB", 1 << 20, 16 << 20), (">=16MiB", 16 << 20, math.inf))


def size_bucket(message_bytes: int, buckets=SIZE_BUCKETS) -> str:
    """Label of the bucket holding a message of `message_bytes`."""
    for label, lo, hi in buckets:
        if lo <= message_bytes < hi:
            return label
    raise ValueError(f"message of {message_bytes} bytes falls in no bucket of {buckets}")


@dataclasses.dataclass(frozen=True)
class Totals:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0

    def __add__(self, e: "Totals") -> "Totals":
        return Totals(self.calls + e.calls, self.bytes + e.bytes, self.wire_bytes + e.wire_bytes)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Totals of a list of entries: overall, and grouped by op, phase, via and message size
    (every bucket of `SIZE_BUCKETS` present, in order, empty ones at zero)."""
    total: Totals
    by_op: dict
    by_phase: dict
    by_via: dict
    by_size: dict


def summary(entries: Iterable[CommEntry], buckets=SIZE_BUCKETS) -> Summary:
    entries = list(entries)
    groups = {"op": {}, "phase": {}, "via": {}, "size": {label: Totals() for label, _, _ in buckets}}
    total = Totals()
    for e in entries:
        t = Totals(e.calls, e.bytes_per_rank, e.wire_bytes)
        total += t
        for key, val in (("op", e.op), ("phase", e.phase), ("via", e.via),
                         ("size", size_bucket(e.message_bytes, buckets))):
            groups[key][val] = groups[key].get(val, Totals()) + t
    return Summary(total, groups["op"], groups["phase"], groups["via"], groups["size"])


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; exact small values stay integers ('512 B')."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(entries: Iterable[CommEntry]) -> str:
    """The entries as an aligned text table, then the totals per message-size bucket. The
    "via" column is left out where every entry's via is its op."""
    entries = list(entries)
    via = any(e.via != e.op for e in entries)
    rows = [("phase", "op", "via", "group", "calls", "message", "bytes/rank", "wire/rank")]
    rows += [(e.phase or "-", e.op, e.via, str(e.group_size), str(e.calls),
              format_bytes(e.message_bytes), ("~" if e.mean else "") + format_bytes(e.bytes_per_rank),
              format_bytes(e.wire_bytes))
             for e in entries]
    s = summary(entries)
    rows.append(("total", "", "", "", str(s.total.calls), "", format_bytes(s.total.bytes),
                 format_bytes(s.total.wire_bytes)))
    if not via:
        rows = [r[:2] + r[3:] for r in rows]
    left = 3 if via else 2                      # text columns, aligned left
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append("by message size: " + ", ".join(
        f"{label} {t.calls} call{'' if t.calls == 1 else 's'} {format_bytes(t.bytes)}"
        for label, t in s.by_size.items()))
    if any(e.mean for e in entries):
        lines.append("~ mean over the group's ranks (depends on the data); the sum over ranks is exact")
    return "\n".join(lines)
