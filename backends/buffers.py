"""Reused host memory for result tiles: a caching allocator, as torch's and XLA's are.

A tile of at least `MIN_BYTES` is a NumPy array over a block this pool handed out; when the
last array viewing the block is gone (the array made over a memoryview of the block is every
view's base; a finalizer on it), the block comes back here, and the next tile of the same
size takes it instead of fresh pages. Fresh pages cost a page fault each on first touch
(and the kernel zeroes them: benchmarks/alloc_reuse.py; where malloc still holds pages freed
just before, the pool gains nothing). The pool keeps at most
MESHCOMM_BUFFER_POOL_MB of idle blocks, the oldest dropped first.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict

import numpy as np

from meshcomm import settings

__all__ = ["take", "empty", "copy", "pooled", "address", "stats", "idle_bytes", "clear"]

ALIGN = 64              # bytes: what XLA's CPU client needs to adopt a NumPy buffer without a copy
MIN_BYTES = 1 << 20     # smaller tiles come from malloc, whose own free lists serve them well

_lock = threading.Lock()
_idle: "OrderedDict[int, tuple[int, np.ndarray]]" = OrderedDict()  # id -> (bytes, block), oldest first
_by_size: dict[int, list[int]] = {}
_held = 0
_seq = 0
stats = {"taken": 0, "reused": 0, "returned": 0, "dropped": 0}


def address(a: np.ndarray) -> int:
    """Where a NumPy array's data starts: by mpi4py's buffer object where MPI is loaded (a C
    call), else `ndarray.ctypes` (a few Python objects per call: at 8 processes on 2 cores,
    about 10x the time, BENCHMARKS 3), and for a strided array."""
    m = sys.modules.get("mpi4py.MPI")
    if m is not None and a.flags.c_contiguous:
        return m.buffer(a).address
    return a.ctypes.data


def _budget() -> int:
    return int(settings.get("BUFFER_POOL_MB") * (1 << 20))


def pooled(nbytes: int) -> int:
    """The pool's budget in bytes where a buffer of `nbytes` comes from it (at least
    MIN_BYTES, pool on), else 0."""
    return _budget() if nbytes >= MIN_BYTES else 0


def empty(n: int, dtype=np.uint8) -> np.ndarray:
    """np.empty(n, dtype), from the pool from MIN_BYTES (a message or result buffer)."""
    dt = np.dtype(dtype)
    budget = pooled(n * dt.itemsize)
    if budget:
        return take(n * dt.itemsize, False, budget=budget).view(dt)
    return np.empty(n, dtype=dt)


def copy(a: np.ndarray) -> np.ndarray:
    """a.copy() (C order), into pool memory from MIN_BYTES."""
    budget = pooled(a.nbytes)
    if not budget:
        return a.copy()
    out = take(a.nbytes, False, budget=budget).view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def take(nbytes: int, zero: bool, phase: int = 0, budget: int | None = None) -> np.ndarray:
    """A 1-d uint8 array of `nbytes` starting `phase` bytes past an ALIGN boundary, zeroed if
    `zero`: a reused block when one of that size is idle, else a new one. Its memory returns
    to the pool when every array over it is gone (kept while the idle blocks fit `budget`,
    default MESHCOMM_BUFFER_POOL_MB)."""
    global _held
    block = None
    with _lock:
        ids = _by_size.get(nbytes)
        if ids:
            block = _idle.pop(ids.pop())[1]
            _held -= nbytes
        stats["taken"] += 1
    if block is None:
        raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
        block = (memoryview(raw), address(raw))         # (the memory, its address)
    else:
        stats["reused"] += 1
    off = (phase - block[1]) % ALIGN
    # an array over a memoryview of the block: every view of it has it as its base (NumPy
    # collapses a view's base only to an array that owns its memory), so it lives while any does
    out = np.frombuffer(block[0][off:off + nbytes], dtype=np.uint8)
    ref = weakref.ref(out, _gone)               # its callback gives the block back
    _live[id(ref)] = (ref, block, nbytes, _budget() if budget is None else budget)
    if zero:
        out[...] = 0
    return out


_live: dict = {}        # id(weakref) -> (the weakref, its block, nbytes, the budget) while viewed


def _gone(ref) -> None:
    """The last array over a block is gone: keep the block for the next tile of its size."""
    global _held, _seq
    _, block, nbytes, budget = _live.pop(id(ref))
    with _lock:
        stats["returned"] += 1
        if nbytes > budget:
            stats["dropped"] += 1
            return
        _seq += 1
        _idle[_seq] = (nbytes, block)
        _by_size.setdefault(nbytes, []).append(_seq)
        _held += nbytes
        while _held > budget:
            k, (n, _) = _idle.popitem(last=False)
            _by_size[n].remove(k)
            _held -= n
            stats["dropped"] += 1


def idle_bytes() -> int:
    return _held


def clear() -> None:
    """Drop every idle block (their memory goes back to malloc)."""
    global _held
    with _lock:
        _idle.clear()
        _by_size.clear()
        _held = 0
