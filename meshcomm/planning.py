"""`plan`: the schedule for one reshard, from the planner, cached by the call's arguments."""
from __future__ import annotations

from . import arrays
from .caches import memo, registry
from .layout import exact_shape, normalize_shape
from .planners import Plan, Topology, plan_reshard
from .validate import check_layouts

__all__ = ["plan", "plan_many"]

_SEEN = registry(512)       # the call's own arguments -> Plan (one dict lookup when repeated)


def plan(shape, dtype, src, dst, topology: Topology | str | None = None) -> Plan:
    """The schedule that moves a `shape`/`dtype` tensor from `src` to `dst`. Pure,
    deterministic and cached: asking again with equal arguments returns the same Plan."""
    exact = exact_shape(shape)      # a list, or bools/floats equal to ints: no shortcut
    if exact:
        try:
            return _SEEN[(shape, dtype, src, dst, topology)]
        except (KeyError, TypeError):
            pass
    check_layouts(src, dst)
    key = (shape, dtype, src, dst, topology)
    shape = normalize_shape(shape)
    src.check_shape(shape)
    dst.check_shape(shape)
    name, itemsize = arrays.normalize_dtype(dtype)
    p = _cached_plan(shape, name, itemsize, src, dst, Topology.coerce(topology))
    if exact:
        try:
            _SEEN.put(key, p)
        except TypeError:       # an unhashable dtype or topology spelling: no shortcut
            pass
    return p


@memo(maxsize=512)
def _cached_plan(shape, dtype, itemsize, src, dst, topology) -> Plan:
    return plan_reshard(shape, dtype, itemsize, src, dst, topology)


# -- many tensors at once -------------------------------------------------------------------

_SEEN_MANY = registry(64)   # the call's own arguments -> BatchPlan


def plan_many(shapes, dtypes, src, dst, topology: Topology | str | None = None, bucket_mb=None):
    """One schedule that moves a batch of tensors: `shapes` {name: shape}; `dtypes` {name:
    dtype} or one dtype; `src`, `dst` {name: Layout} or one Layout for every name. Senders
    are balanced over the whole batch, everything between the same devices in one bucket
    is one message, and no process stages more than `bucket_mb` MiB per bucket (default:
    planners.batch.default_bucket_bytes). Returns a planners.batch.BatchPlan, read like a
    Plan (explain, simulate, mc.verify). Pure, deterministic and cached."""
    key = _many_key(shapes, dtypes, src, dst, topology, bucket_mb)
    if key is not None:
        hit = _SEEN_MANY.get(key)
        if hit is not None:
            return hit
    from .batch_args import batch_entries
    entries = batch_entries(shapes, dtypes, src, dst)
    p = _cached_batch(entries, Topology.coerce(topology), _bucket_bytes(bucket_mb))
    if key is not None:
        _SEEN_MANY.put(key, p)
    return p


def _bucket_bytes(bucket_mb):
    if bucket_mb is None:
        return None
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(f"bucket_mb must be a number of MiB or None, got {bucket_mb!r}")
    if not bucket_mb > 0 or bucket_mb == float("inf"):
        raise ValueError(f"bucket_mb must be positive and finite, got {bucket_mb!r}")
    return max(1, int(bucket_mb * (1 << 20)))


def _many_key(shapes, dtypes, src, dst, topology, bucket_mb):
    """The arguments as a hashable key, or None where a shortcut would be unsafe (shapes of
    bools or floats, dicts naming other tensors, unhashable values)."""
    from collections.abc import Mapping
    if not isinstance(shapes, Mapping):
        return None
    args = []
    for a in (dtypes, src, dst):
        if isinstance(a, Mapping):
            if len(a) != len(shapes):
                return None
            args.append((True, a))
        else:
            args.append((False, a))
    try:
        rows = []
        for n, shape in shapes.items():
            if not exact_shape(shape):
                return None
            rows.append((n, shape) + tuple(a[n] if is_dict else a for is_dict, a in args))
        key = (tuple(rows), topology, bucket_mb, type(bucket_mb))
        hash(key)
    except (KeyError, TypeError):
        return None
    return key


@memo(maxsize=64)
def _cached_batch(entries, topology, bucket_bytes):
    from .planners.batch import plan_batch
    return plan_batch(entries, topology, bucket_bytes)
