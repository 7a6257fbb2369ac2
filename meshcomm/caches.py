"""The one cache mechanism: bounded memo caches that `meshcomm.clear_caches()` empties.

    @caches.memo(maxsize=512)
    def tiling(layout, shape): ...

`memo` is `functools.lru_cache` registered in one list; `registry()` gives a plain dict
cache (for lookups keyed by something other than a function's arguments) registered the
same way. Every layer (planner, backends, runtime) uses these two, so one call clears all.
"""
from __future__ import annotations

import functools
from typing import Callable

__all__ = ["memo", "registry", "BoundedDict", "clear_caches"]

_CACHES: list = []


def memo(maxsize: int | None = 1024, typed: bool = False) -> Callable:
    """`functools.lru_cache(maxsize, typed)`, registered with `clear_caches`."""
    def deco(fn):
        cached = functools.lru_cache(maxsize=maxsize, typed=typed)(fn)
        _CACHES.append(cached)
        return cached
    return deco


class BoundedDict(dict):
    """A dict cache that empties itself when it reaches `maxsize` entries (cheap to look up:
    a plain dict get on hot paths), registered with `clear_caches`."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def put(self, key, value):
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value

    def cache_clear(self) -> None:
        self.clear()


def registry(maxsize: int = 1024) -> BoundedDict:
    d = BoundedDict(maxsize)
    _CACHES.append(d)
    return d


def clear_caches() -> None:
    """Empty every cache meshcomm keeps: plans, tilings, layouts checked against shapes,
    the batch executors of bare plans, the agreement check's vectors, tuning lookups, owned devices."""
    for c in _CACHES:
        c.cache_clear()
