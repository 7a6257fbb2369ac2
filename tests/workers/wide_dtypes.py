"""The element types beyond float32/64 and int32/64 for the random collective cases
(collectives_worker.py --wide): values drawn over each type's whole range where sums and
products wrap alike in any order (integers), the NumPy reference, and the comparison.

int16 and the unsigned types are ones gloo cannot reduce (the torch backend widens them);
uint64 draws values above 2**63, where min and max must order as unsigned.
"""
from __future__ import annotations

import numpy as np

WIDE = ("int8", "uint8", "int16", "uint16", "uint32", "uint64", "float16", "bool", "complex64")


def reduction_for(dtype: str, red: str, rng) -> str:
    """`red`, or one the type defines: bool takes min/max only (meshcomm refuses sum and
    prod of bools), complex numbers have no min/max, avg is for floating types."""
    if dtype == "bool" and red not in ("min", "max"):
        return ("min", "max")[int(rng.integers(2))]
    if dtype.startswith("complex") and red in ("min", "max"):
        return "sum"
    if red == "avg" and not (dtype.startswith("float") or dtype.startswith("complex")):
        return "sum"
    return red


def values(rng, shape, dtype: str, red: str) -> np.ndarray:
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype == "float16":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    if red == "prod" and dtype != "uint64":
        lo, hi = max(info.min, -3), 3                  # products wrap, but keep a few exact
    else:
        lo, hi = info.min, info.max
    return rng.integers(lo, hi, size=shape, dtype=dtype, endpoint=True)


def reduce(fn, xs, red, dtype):
    """fn over the stacked tiles, in the tile's type (integers wrap as the backends do)."""
    a = np.stack(xs)
    if dtype == "bool":
        return (np.all(a, axis=0) if red == "min" else np.any(a, axis=0))
    if dtype == "float16":
        return fn(a.astype(np.float64), axis=0).astype(np.float16)
    if dtype.startswith("uint") or dtype.startswith("int"):
        if red in ("sum", "prod"):
            ufunc = np.add if red == "sum" else np.multiply
            return ufunc.reduce(a, axis=0, dtype=a.dtype)
    return fn(a, axis=0).astype(dtype)


def close(a, b, dtype: str) -> bool:
    if dtype == "float16":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        return np.allclose(a64, b64, rtol=1e-2, atol=1e-2 * max(1.0, float(np.abs(b64).max(initial=0))))
    if dtype.startswith("complex"):
        return np.allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max(initial=0))) * 8)
    return np.array_equal(a, b)


def as_torch(x):
    """The call's input as CPU torch tensors (a bare tile, a dict of them, or None)."""
    import torch                  # (np.ascontiguousarray would make a 0-d tile 1-d)
    if isinstance(x, dict):
        return {d: torch.from_numpy(np.array(v, copy=True)) for d, v in x.items()}
    return None if x is None else torch.from_numpy(np.array(x, copy=True))


def as_numpy(got, what):
    """A result of torch tiles as NumPy, after checking it is torch tensors."""
    import torch
    if got is None:
        return None
    if isinstance(got, dict):
        return {d: as_numpy(v, what) for d, v in got.items()}
    assert isinstance(got, torch.Tensor), f"{what}: torch tiles in, got {type(got).__name__} out"
    return got.numpy()
