"""The flight recorder: the last 256 calls of this process (sequence number, call, state,
peers awaited, times) in a ring (`RECORDER`, fed by runtime/control.py); `dump()` writes it
as JSON lines when a call fails (to MESHCOMM_LOG's folder, else a temporary folder named in
the error), for `meshcomm log summary DIR` to say who waited for whom.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
import time

__all__ = ["Recorder", "RECORDER", "dump"]


class Recorder:
    """The flight recorder: a ring of the last `size` calls (always on; a call costs one short
    list, one append and two field updates: BENCHMARKS 5)."""

    def __init__(self, size: int = 256):
        self.ring: collections.deque = collections.deque(maxlen=size)
        self.seq = 0

    def start(self, call: Call) -> list:
        self.seq += 1
        e = [self.seq, call, "posted", (), time.time(), None]
        self.ring.append(e)
        return e

    @staticmethod
    def waiting(e: list, peers) -> None:
        e[2], e[3] = "waiting", sorted(peers)

    @staticmethod
    def done(e: list, state: str = "done") -> None:
        e[2], e[5] = state, time.time()
        if state == "done":
            e[3] = ()

    def records(self):
        """The ring as dicts (a Program's quick lean run keeps its Call as a plain tuple)."""
        return [{"seq": seq, "what": c[0], "program": c[1], "label": c[2], "run": c[3], "state": st,
                 "awaiting": list(aw), "t_start": t0, "t_end": t1} for seq, c, st, aw, t0, t1 in self.ring]


RECORDER = Recorder()


def dump(rank: int) -> str | None:
    """Write the flight recorder to `<dir>/flight_rank<r>.jsonl` (MESHCOMM_LOG's folder, else
    a temporary one); the path, or None where it could not be written."""
    from .. import settings
    folder = settings.get("LOG") or os.path.join(tempfile.gettempdir(), f"meshcomm-flight-{os.getppid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"flight_rank{rank}.jsonl")
        with open(path, "w") as f:
            for r in RECORDER.records():
                f.write(json.dumps(dict(r, rank=rank)) + "\n")
        return path
    except OSError:
        return None
