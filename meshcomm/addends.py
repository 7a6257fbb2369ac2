"""Splitting a value into the tiles of a partial layout whose op is prod, min or max.

`meshcomm.shard` splits a pending sum itself (random addends); this covers the other ops,
for NumPy, torch and JAX values alike. Without a seed the first contributor holds the value
and the others the op's identity. With one, every contributor gets random values that do
not change the result, and which contributor holds the value itself is drawn per element:

* max: the others hold min(value, r) (never above the value); min: max(value, r);
* prod: the others hold random signs (+1 or -1) and the holder the value times their
  product, so the product is the value again exactly, in any order (multiplying by -1 is
  exact for real floats, and wraps back for unsigned integers; complex values come back
  equal, a zero part perhaps with the other sign); bool contributors hold True.
"""
from __future__ import annotations

import numpy as np

from . import arrays
from .reduceops import check_dtype, identity

__all__ = ["split_pending"]


def split_pending(value, k: int, op: str, rng, kind: str) -> list:
    """k contributions whose `op` is `value`; `rng` a NumPy Generator or None (no seed)."""
    check_dtype(op, str(value.dtype).removeprefix("torch."))
    xp = _namespace(kind)
    if rng is None:
        ident = _full_like(value, identity(op, value.dtype), kind)
        return [arrays.copy(value, kind)] + [arrays.copy(ident, kind) for _ in range(k - 1)]
    shape = tuple(value.shape)
    holder = rng.integers(0, k, size=shape)
    is_bool = _is_bool(value)
    if op == "prod":
        if is_bool:
            signs = [_full_like(value, True, kind) for _ in range(k)]
        else:
            one = _full_like(value, 1, kind)
            signs = []
            for _ in range(k):
                f = _cast(_from_numpy(rng.integers(0, 2, size=shape), kind, value), value)
                signs.append(one - f - f)             # 1 or -1 (unsigned: wraps to the max)
        with np.errstate(over="ignore"):    # 0-d NumPy scalars warn where arrays wrap
            total = signs[0]
            for s in signs[1:]:
                total = total * s
            parts = [xp.where(_from_numpy(holder == j, kind, value), value * total * signs[j],
                              signs[j]) for j in range(k)]
    else:
        bound = xp.minimum if op == "max" else xp.maximum
        parts = [xp.where(_from_numpy(holder == j, kind, value), value,
                          bound(value, _random_of(value, rng, kind, is_bool)))
                 for j in range(k)]
    if kind == "numpy":                 # 0-d arithmetic gives NumPy scalars; keep arrays
        parts = [np.asarray(p, dtype=value.dtype) for p in parts]
    return parts


def _namespace(kind):
    if kind == "torch":
        import torch
        return torch
    if kind == "jax":
        import jax.numpy as jnp
        return jnp
    return np


def _is_bool(value) -> bool:
    return str(value.dtype).removeprefix("torch.") == "bool"




def _full_like(value, fill, kind):
    if kind == "torch":
        import torch
        return torch.full_like(value, fill)
    return _namespace(kind).full_like(value, fill)


def _from_numpy(a, kind, like):
    a = np.asarray(a)
    if kind == "torch":
        import torch
        return torch.from_numpy(np.array(a, copy=True)).to(device=like.device)  # 0-d stays 0-d
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.asarray(a)
    return a


def _cast(x, like):
    if type(x).__module__.startswith("torch"):
        return x.to(like.dtype)
    return x.astype(like.dtype)


def _random_of(value, rng, kind, is_bool: bool):
    """Random values of `value`'s dtype (small integers, normal floats, fair bools)."""
    shape = tuple(value.shape)
    if is_bool:
        r = rng.random(shape) < 0.5
    elif _is_float(value):
        r = rng.standard_normal(shape).astype(np.float32)
    else:
        lo = max(int(identity("max", value.dtype)), -1000)
        hi = min(int(identity("min", value.dtype)), 1000)
        r = rng.integers(lo, hi, size=shape)
    return _cast(_from_numpy(r, kind, value), value)


def _is_float(value) -> bool:
    dt = value.dtype
    if type(dt).__module__.startswith("torch"):
        return dt.is_floating_point or dt.is_complex
    dt = np.dtype(dt)
    return dt.kind in "fc" or dt.kind == "V"      # ml_dtypes floats (bfloat16, float8) are "V"
