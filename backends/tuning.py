"""The tuning table `mixed` reads and `meshcomm tune` writes.

Format (JSON)::

    {"format": "meshcomm-tuning-v1",
     "rules": [{"op": "send" | "bcast" | "reduce" | "alltoall" | "allreduce" | "allgather"
                      | "reduce_scatter" | "gather" | "scatter",
                "min_bytes": int, "max_bytes": int | null,
                "min_group": int, "max_group": int | null,
                "backend": "mpi" | "torch"}, ...],
     "measurements": [...]}

A rule matches an operation when `op` is equal, `min_bytes <= nbytes <= max_bytes` and
`min_group <= group_size <= max_group` (both bounds inclusive; null means unbounded). A
rule may also carry `"device": "cpu" | "cuda"` to match only tensors on that device kind
(absent: any). The first matching rule wins; with no match the backend is "mpi".
`group_size` counts processes: 2 for send/recv, the group of a collective (the world for
all_to_all_v's exchange). `nbytes` is nccl-tests' size of the operation, the same on every
member: the buffer (send, bcast, reduce, allreduce; alltoall: one member's send buffer) or
the whole concatenation (allgather's output, reduce_scatter's input, gather's and scatter's
root buffer). bcast and reduce rules serve both a plan's transfers and the native
collectives; the other collectives are the backends' native calls (backends/base.py).
`measurements` is free-form data kept for reference (the tune suite puts its timings there).
`bus_factor(op, n)` is nccl-tests' busbw / algbw, the one table every report uses.

Which table is used: the file named by the environment variable `MESHCOMM_TUNING`, else
`default_table()` (MPI for CPU tensors, whose shared-memory transport beats gloo's TCP on
one node at every size; torch, i.e. NCCL, for CUDA tensors, which MPI would stage through
the host).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

from meshcomm.caches import memo
__all__ = ["FORMAT", "OPS", "BACKEND_NAMES", "Rule", "TuningTable", "load", "from_dict",
           "default_table", "table_from_env", "save", "FALLBACK", "BUS_FACTORS", "bus_factor"]

FORMAT = "meshcomm-tuning-v1"
OPS = ("send", "bcast", "reduce", "alltoall", "allreduce", "allgather", "reduce_scatter",
       "gather", "scatter")
BACKEND_NAMES = ("mpi", "torch")
DEVICES = ("cpu", "cuda")
FALLBACK = "mpi"

# nccl-tests' bus factors: the one table (meshcomm.bandwidth), re-exported for the tuning suite
from meshcomm.bandwidth import BUS_FACTORS, bus_factor  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Rule:
    op: str
    backend: str
    min_bytes: int = 0
    max_bytes: int | None = None
    min_group: int = 0
    max_group: int | None = None
    device: str | None = None

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"tuning rule op must be one of {OPS}, got {self.op!r}")
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"tuning rule backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        if self.device is not None and self.device not in DEVICES:
            raise ValueError(f"tuning rule device must be one of {DEVICES} or absent, got {self.device!r}")
        for name in ("min_bytes", "min_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"tuning rule {name} must be a non-negative int, got {v!r}")
        for name in ("max_bytes", "max_group"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"tuning rule {name} must be a non-negative int or null, got {v!r}")

    def matches(self, op: str, nbytes: int, group_size: int, device: str | None = None) -> bool:
        return (op == self.op
                and self.min_bytes <= nbytes and (self.max_bytes is None or nbytes <= self.max_bytes)
                and self.min_group <= group_size and (self.max_group is None or group_size <= self.max_group)
                and (self.device is None or device is None or device == self.device))

    def to_dict(self) -> dict:
        d = {"op": self.op, "min_bytes": self.min_bytes, "max_bytes": self.max_bytes,
             "min_group": self.min_group, "max_group": self.max_group, "backend": self.backend}
        if self.device is not None:
            d["device"] = self.device
        return d


@dataclasses.dataclass(frozen=True)
class TuningTable:
    rules: tuple[Rule, ...]
    measurements: tuple = dataclasses.field(default=(), compare=False)
    source: str = dataclasses.field(default="<built-in default>", compare=False)

    def lookup(self, op: str, nbytes: int, group_size: int, device: str | None = None) -> str:
        """The backend name for one operation: the first matching rule's, else "mpi"."""
        return _lookup(self, op, int(nbytes), int(group_size), device)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "rules": [r.to_dict() for r in self.rules],
                "measurements": list(self.measurements)}


@memo(maxsize=4096)
def _lookup(table: TuningTable, op: str, nbytes: int, group_size: int, device) -> str:
    for r in table.rules:
        if r.matches(op, nbytes, group_size, device):
            return r.backend
    return FALLBACK


_RULE_KEYS = {"op", "min_bytes", "max_bytes", "min_group", "max_group", "backend", "device"}


def from_dict(d: Mapping[str, Any], source: str = "<dict>") -> TuningTable:
    if not isinstance(d, Mapping):
        raise ValueError(f"{source}: a tuning table is a JSON object, got {type(d).__name__}")
    if d.get("format") != FORMAT:
        raise ValueError(f"{source}: format must be {FORMAT!r}, got {d.get('format')!r}")
    rules = d.get("rules")
    if not isinstance(rules, Sequence) or isinstance(rules, (str, bytes)):
        raise ValueError(f"{source}: 'rules' must be a list")
    out = []
    for i, r in enumerate(rules):
        if not isinstance(r, Mapping):
            raise ValueError(f"{source}: rule {i} must be an object, got {r!r}")
        extra = set(r) - _RULE_KEYS
        if extra:
            raise ValueError(f"{source}: rule {i} has unknown key(s) {sorted(extra)}")
        if "op" not in r or "backend" not in r:
            raise ValueError(f"{source}: rule {i} needs 'op' and 'backend'")
        try:
            out.append(Rule(**r))       # its keys checked above; absent ones take Rule's defaults
        except ValueError as e:
            raise ValueError(f"{source}: rule {i}: {e}") from None
    meas = d.get("measurements", [])
    if not isinstance(meas, Sequence) or isinstance(meas, (str, bytes)):
        raise ValueError(f"{source}: 'measurements' must be a list")
    return TuningTable(tuple(out), tuple(meas), source)


def load(path: str | os.PathLike, *, label: str | None = None) -> TuningTable:
    """The table in a JSON file. ValueError when it is not one, its message starting with
    `label` (default: the path); OSError when the file cannot be read."""
    label = label or str(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{label}: not valid JSON (UTF-8 text): {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{label}: not valid JSON: {e}") from None
    return dataclasses.replace(from_dict(d, label), source=str(path))


def save(table: TuningTable, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(table.to_dict(), f, indent=1)
        f.write("\n")


def default_table() -> TuningTable:
    rules = [Rule(op=op, backend="torch", device="cuda") for op in OPS]
    rules += [Rule(op=op, backend="mpi") for op in OPS]
    return TuningTable(tuple(rules))


def table_from_env() -> TuningTable:
    """The table named by MESHCOMM_TUNING, else the built-in default. A path that cannot be
    read, or a file that is not a table, is a ValueError naming the variable and the path."""
    from meshcomm import settings
    path = settings.get("TUNING")
    if not path:
        return default_table()
    where = f"{settings.SETTINGS['TUNING'].var}={path!r}"
    try:
        return load(path, label=f"{where} is not a tuning table")
    except OSError as e:
        raise ValueError(f"{where}: cannot read the tuning table: {(e.strerror or str(e)).lower()} "
                         "(a file written by `meshcomm tune`; unset the variable for the built-in "
                         "table)") from None
