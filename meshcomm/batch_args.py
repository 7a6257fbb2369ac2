"""Checks of the dict arguments of the many-tensor calls (plan_many, reshard_many).

`batch_entries(shapes, dtypes, src, dst)` turns {name: shape}, {name: dtype} or one dtype,
{name: Layout} or one Layout into one checked entry per tensor, in the order of `shapes`:
(name, shape, dtype name, itemsize, src, dst). Every error is a ValueError or TypeError
naming the tensor and what is wrong with it (a name missing from a dict, a name no other
dict has, a shape a layout does not fit, a dtype that is no element type).
"""
from __future__ import annotations

from typing import Mapping

from . import arrays
from .layout import Layout, exact_shape, normalize_shape
from .reduceops import check_dtype

__all__ = ["batch_entries", "per_name"]


def per_name(arg, names: list, what: str, single: type | None) -> dict:
    """{name: value} from a dict keyed by the same names as `shapes`, or one value for every
    name (`single`: the type a single value must have; None: anything but a dict)."""
    if isinstance(arg, Mapping):
        known = set(names)
        for n in arg:
            if n not in known:
                raise ValueError(f"{what} has an entry for tensor {n!r}, which shapes does not name")
        for n in names:
            if n not in arg:
                raise ValueError(f"{what} has no entry for tensor {n!r} (it names {len(arg)} of "
                                 f"the {len(names)} tensors in shapes)")
        return dict(arg)
    if single is not None and not isinstance(arg, single):
        raise TypeError(f"{what} must be a meshcomm.Layout or a dict {{tensor name: Layout}}, "
                        f"got {type(arg).__name__}")
    return dict.fromkeys(names, arg)


def batch_entries(shapes, dtypes, src, dst) -> tuple[tuple, ...]:
    """One checked (name, shape, dtype name, itemsize, src, dst) per tensor (module docstring)."""
    if not isinstance(shapes, Mapping):
        raise TypeError(f"shapes must be a dict {{tensor name: shape}}, got {type(shapes).__name__}")
    names = list(shapes)
    if dtypes is None:
        raise TypeError("dtypes must be a dtype or a dict {tensor name: dtype}, got None")
    dts = per_name(dtypes, names, "dtypes", None)
    srcs = per_name(src, names, "src", Layout)
    dsts = per_name(dst, names, "dst", Layout)
    out = []
    seen: set = set()       # (shape, dtype, src, dst) already checked: alike tensors repeat them
    for n in names:
        try:
            shape = shapes[n]
            s, d, dtype = srcs[n], dsts[n], dts[n]
            try:
                key = (shape, dtype, s, d) if exact_shape(shape) else None
                done = key in seen
            except TypeError:           # an unhashable dtype spelling
                key, done = None, False
            if not done:
                shape = normalize_shape(shape)
                for what, lay in (("src", s), ("dst", d)):
                    if not isinstance(lay, Layout):
                        raise TypeError(f"{what} must be a meshcomm.Layout, got {type(lay).__name__}")
                    lay.check_shape(shape)
            name, itemsize = arrays.normalize_dtype(dtype)
            if not done:
                if s.num_addends > 1:
                    check_dtype(s.partial_op, name)
                if d.num_addends > 1:
                    check_dtype(d.partial_op, name)
                if key is not None:
                    seen.add(key)
        except (TypeError, ValueError) as e:
            raise type(e)(f"tensor {n!r}: {e}") from None
        out.append((n, shape, name, itemsize, s, d))
    return tuple(out)
