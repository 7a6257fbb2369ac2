"""Every MESHCOMM_* environment variable: its type, its one default, and its meaning.

Code reads a setting with `settings.get("TIMEOUT")` (the name without the prefix); the value
is read from the environment on each call, so tests and launchers may change it between
calls. A malformed value raises a ValueError naming the variable. The README's table of
environment variables is `markdown_table()` (a test keeps the two equal).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

__all__ = ["Setting", "SETTINGS", "get", "markdown_table"]


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str                      # without the MESHCOMM_ prefix
    parse: Callable[[str], Any]
    default: Any
    doc: str
    shown_default: str = ""        # the README's default column when str(default) would mislead

    @property
    def var(self) -> str:
        return "MESHCOMM_" + self.name


def _bool(v: str) -> bool:
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 0 or 1")


def _positive_float(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise ValueError("expected a positive number")
    return x


def _int(v: str) -> int:
    return int(v)


def _positive_int(v: str) -> int:
    x = int(v)
    if x < 1:
        raise ValueError("expected a positive integer")
    return x


def _str(v: str) -> str:
    return v


def _choice(*options: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return v
    parse.options = options
    return parse


_ALL = (
    Setting("TIMEOUT", _positive_float, 300.0,
            "seconds a process waits for a peer before `PeerTimeoutError` naming it (every entry point; `init(timeout=...)` overrides)",
            "300"),
    Setting("CHECK", _choice("construct", "every"), "construct",
            "when processes agree: `construct` (once per Program, at its construction; an eager call constructs one on its first call with given arguments) or `every` (every run agrees in full as well: debugging a mismatch)"),
    Setting("TUNING", _str, None,
            "path of a `meshcomm tune` table that `mixed` reads (a missing file is an error naming this variable)",
            "built-in"),
    Setting("BUFFER_POOL_MB", _int, 512,
            "MiB of idle host memory kept for result tiles of 1 MiB or more (backends/buffers.py): a tile's memory is reused once every array over it is gone, instead of fresh pages that fault on first touch; `0`: every tile in fresh memory"),
    Setting("LOG", _str, None,
            "a folder: log every communicating call to `rank<r>.jsonl` there (`meshcomm.log`; read with `meshcomm log summary`); read when meshcomm is imported and at `meshcomm.init`",
            "off"),
    Setting("EMULATE_GBPS", _positive_float, None,
            "benchmarks only, an emulation of a slow network: every process sends at most this many Gb/s to processes on other emulated nodes (a token bucket in the MPI and torch backends' sends; MPI broadcasts go point to point; native collectives are not paced). backends/pacing.py",
            "off"),
    Setting("EMULATE_NODE_SIZE", _positive_int, 1,
            "consecutive ranks per emulated node under `MESHCOMM_EMULATE_GBPS` (1: every process its own node)"),
    Setting("COMPRESSION_CHUNK", _positive_int, 262144,
            "uncompressed bytes per message of a compressed collective or reshard (chunks on ZFP block boundaries, so coding and transfer overlap)"),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}
AGREED = ("CHECK", "EMULATE_GBPS", "EMULATE_NODE_SIZE", "COMPRESSION_CHUNK")   # a Program's: the same everywhere


def get(name: str):
    """The value of MESHCOMM_<name>: parsed from the environment, or its default. Read on
    every call (a test or a user may change the environment between calls); the parse of
    each value seen is kept."""
    s = SETTINGS[name]
    text = os.environ.get(s.var)
    if text is None or text == "":
        return s.default
    hit = _PARSED.get((name, text))
    if hit is not None:
        return hit[0]
    try:
        value = s.parse(text.strip().lower() if s.parse is _bool else text.strip())
    except ValueError as e:
        raise ValueError(f"{s.var}={text!r} is not valid: {e}") from None
    if len(_PARSED) > 4096:
        _PARSED.clear()
    _PARSED[(name, text)] = (value,)
    return value


_PARSED: dict = {}      # (name, raw value) -> (parsed value,): pure, so never stale


def markdown_table() -> str:
    """The README's table of environment variables."""
    lines = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for s in _ALL:
        default = s.shown_default or str(s.default)
        lines.append(f"| `{s.var}` | {default} | {s.doc} |")
    return "\n".join(lines)


def agreed() -> tuple:
    """The settings that shape a Program (`AGREED`: how runs agree, native call or paced plan,
    chunks), as (name, value): every construction agrees on them, so a process launched with
    another value raises there, naming it, instead of running another Program."""
    return tuple((n, get(n)) for n in AGREED)
