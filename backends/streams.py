"""CUDA ordering for the backends, with the same calls doing nothing on CPU.

The rules (DESIGN "Backends"):

* each backend issues its work on its own stream: `comm_stream(backend, device)`;
* the stream that produced a tensor is fenced before communication reads it:
  `fence_from_current(device)` on the producer's thread, then `fence.wait_on(comm)`;
* the consumer waits before it uses a result: `fence = record(comm)` when the work is
  done, `fence.wait_on(current_stream(device))` on the consumer's thread;
* before a device pointer reaches a call that is not stream-aware (MPI here), the host
  waits: `host_sync(stream)`.

On CPU tensors (and NumPy arrays) every stream is None and every fence is a no-op, so
the executor runs exactly the same ordering code on CPU and GPU. `stats` counts the calls
(tests check that the ordering code ran).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter

from meshcomm.arrays import is_torch

__all__ = ["Fence", "device_of", "is_cuda", "current_stream", "comm_stream", "use",
           "fence_from_current", "record", "host_sync", "stats"]

stats: Counter = Counter()
_lock = threading.Lock()
_streams: dict = {}


def device_of(x):
    """The torch device of a tensor, or None for anything else (NumPy, JAX: host data)."""
    return x.device if is_torch(x) else None


def is_cuda(device) -> bool:
    return device is not None and getattr(device, "type", None) == "cuda"


def current_stream(device):
    if not is_cuda(device):
        return None
    import torch
    return torch.cuda.current_stream(device)


def comm_stream(backend: str, device):
    """The stream `backend` issues on for `device` (created once, cached); None on CPU."""
    if not is_cuda(device):
        return None
    import torch
    key = (backend, device.index if device.index is not None else torch.cuda.current_device())
    with _lock:
        s = _streams.get(key)
        if s is None:
            s = _streams[key] = torch.cuda.Stream(device=torch.device("cuda", key[1]))
    return s


_NO_STREAM = contextlib.nullcontext()   # reusable: it keeps no state


def use(stream):
    """Make `stream` current on this thread (no-op for None: CPU tiles, on every step of
    every call, so without a generator's cost)."""
    stats["use"] += 1
    if stream is None:
        return _NO_STREAM
    return _use_cuda(stream)


@contextlib.contextmanager
def _use_cuda(stream):
    import torch
    with torch.cuda.stream(stream):
        yield


@dataclasses.dataclass(frozen=True)
class Fence:
    """A point in a stream's work (a CUDA event), or nothing on CPU."""

    event: object = None

    def wait_on(self, stream) -> None:
        """Make `stream` wait for the fenced work (GPU side, the host does not block)."""
        stats["wait_on"] += 1
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)


def record(stream) -> Fence:
    """A fence after everything issued so far on `stream`."""
    stats["record"] += 1
    if stream is None:
        return Fence()
    import torch
    ev = torch.cuda.Event()
    ev.record(stream)
    return Fence(ev)


def fence_from_current(device) -> Fence:
    """A fence on the calling thread's current stream of `device` (the producer)."""
    return record(current_stream(device))


def host_sync(stream) -> None:
    """Wait on the host for `stream` (before a pointer goes to a non-stream-aware call)."""
    stats["host_sync"] += 1
    if stream is not None:
        stream.synchronize()
