"""Reduction ops of pending (partial) values: names, identities and elementwise combining.

A partial layout's op says how the devices' tiles make the logical value: "sum", "prod",
"min" or "max" of the tiles (``Layout(mesh, spec, partial={"x": "max"})``). Executors
combine tiles with `combine_` in the plan's order of contributors, so every backend gives
the same bits; tiles that hold no contribution start as the op's `identity`.

Leaf module (any layer may import it): NumPy, CuPy (through NumPy's ufuncs) and torch
arrays passed in; it imports nothing else from meshcomm. bool tiles follow the ufuncs:
sum and max are logical or, prod and min logical and.
"""
from __future__ import annotations

import numpy as np

__all__ = ["PARTIAL_OPS", "check_op", "check_dtype", "identity", "combine", "combine_",
           "fill_identity_"]

PARTIAL_OPS = ("sum", "prod", "min", "max")

_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def check_op(op, axis=None) -> str:
    """`op` if it is a partial op name, else ValueError (naming `axis` when given)."""
    if isinstance(op, str) and op in _UFUNC:
        return op
    where = f" over axis {axis!r}" if axis is not None else ""
    hint = " ('avg' is a collective's op: sum, then divide)" if op == "avg" else ""
    raise ValueError(f"partial reduction{where} must be one of "
                     f"{', '.join(map(repr, PARTIAL_OPS))}, got {op!r}{hint}")


def check_dtype(op: str, dtype_name: str) -> None:
    """ValueError when `op` has no meaning for the element type (min/max of complex)."""
    if op in ("min", "max") and dtype_name.startswith("complex"):
        raise ValueError(f"a partial {op!r} needs ordered values; dtype {dtype_name} is complex")


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def identity(op: str, dtype):
    """The value that leaves any x unchanged under `op`, for a NumPy or torch dtype: 0, 1,
    the largest value (min) or the smallest (max): +-inf for floats that have it, else the
    float type's finite extreme; iinfo for integers; True/False for bool."""
    if op == "sum":
        return 0
    if op == "prod":
        return 1
    hi = op == "min"
    torch_dtype = type(dtype).__module__.startswith("torch")
    if torch_dtype:
        import torch
        if dtype == torch.bool:
            return hi
        if dtype.is_floating_point:
            if torch.tensor(float("inf")).to(dtype).float().isinf():
                return float("inf") if hi else float("-inf")
            info = torch.finfo(dtype)
            return info.max if hi else info.min
        info = torch.iinfo(dtype)
        return info.max if hi else info.min
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return hi
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return dt.type(info.max if hi else info.min)
    inf = np.array(np.inf if hi else -np.inf).astype(dt)
    if np.isinf(inf.astype(np.float64)):
        return inf[()]
    import ml_dtypes                    # a float type without inf (float8 e4m3fn, ...)
    info = ml_dtypes.finfo(dt)
    return dt.type(info.max if hi else info.min)


_BAREBONES = frozenset({"torch.uint16", "torch.uint32", "torch.uint64"})


def _via_numpy(a) -> bool:
    """A CPU torch tensor of a type torch stores but does not add or compare (uint16/32/64):
    combined through NumPy views of the same memory."""
    return str(a.dtype) in _BAREBONES and a.device.type == "cpu"


def _np(v):
    return v.numpy() if _is_torch(v) else v


def combine(a, b, op: str):
    """op(a, b) elementwise, as a new array."""
    if _is_torch(a) and _via_numpy(a):
        import torch
        return torch.from_numpy(_UFUNC[op](a.numpy(), _np(b)))
    if _is_torch(a):
        import torch
        return {"sum": torch.add, "prod": torch.mul, "min": torch.minimum,
                "max": torch.maximum}[op](a, b)
    return _UFUNC[op](a, b)


def combine_(acc, v, op: str):
    """acc = op(acc, v) in place where acc is an array (a NumPy scalar gets a new one);
    returns acc. acc may be a view into a tile."""
    if _is_torch(acc) and _via_numpy(acc):
        _UFUNC[op](acc.numpy(), _np(v), out=acc.numpy())
        return acc
    if _is_torch(acc):
        if op == "sum":
            return acc.add_(v)
        if op == "prod":
            return acc.mul_(v)
        import torch
        return (torch.minimum if op == "min" else torch.maximum)(acc, v, out=acc)
    if isinstance(acc, np.generic):
        return _UFUNC[op](acc, v)
    return _UFUNC[op](acc, v, out=acc)


def fill_identity_(tile, op: str):
    """Set every element of `tile` to the identity of `op`; returns tile."""
    value = identity(op, tile.dtype)
    if _is_torch(tile):
        return tile.fill_(value)
    tile[...] = value
    return tile
