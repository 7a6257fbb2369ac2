"""`plan`: the schedule for one reshard, from the planner, cached by the call's arguments."""
from __future__ import annotations

from . import arrays
from .caches import memo, registry
from .layout import exact_shape, normalize_shape
from .planners import Plan, Topology, plan_reshard
from .validate import check_layouts

__all__ = ["plan"]

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
