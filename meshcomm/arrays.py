"""Array kinds meshcomm accepts (NumPy, torch, JAX) and dtype normalisation."""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .caches import memo

__all__ = ["kind_of", "normalize_dtype", "dtype_of", "to_numpy", "is_torch", "is_jax", "copy", "divided"]


def is_torch(x) -> bool:
    if type(x) is np.ndarray:           # the common case, on hot paths: no module lookup
        return False
    t = sys.modules.get("torch")
    return t is not None and isinstance(x, getattr(t, "Tensor", ()))  # torch may be mid-import in another thread


def copy(x, kind: str | None = None):
    """A copy of a NumPy array or torch tensor (jax.Arrays are immutable: returned as is)."""
    kind = kind or kind_of(x)
    if kind == "torch":
        return x.clone()
    if kind == "numpy":
        return x.copy()
    return x


def divided(v, k):
    """`v / k` (an average's last step): torch's own division for a tensor; for NumPy an
    array of `v`'s dtype (a 0-d array divided gives a NumPy scalar: keep it an array)."""
    if is_torch(v):
        return v / k
    return np.asarray(v / k).astype(v.dtype, copy=False)


def is_barebones_torch(x) -> bool:
    """A CPU torch tensor of uint16, uint32 or uint64: torch stores and copies them but
    cannot add or compare them, so array arithmetic on them goes through NumPy views."""
    return is_torch(x) and str(x.dtype) in ("torch.uint16", "torch.uint32", "torch.uint64") \
        and x.device.type == "cpu"


def is_jax(x) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, getattr(jax, "Array", ()))


def kind_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_torch(x):
        return "torch"
    if is_jax(x):
        return "jax"
    if isinstance(x, np.generic):
        return "numpy"
    raise TypeError(f"expected a NumPy array, torch.Tensor or jax.Array, got {type(x).__name__}")


_TORCH_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float": "float32",
                "double": "float64", "bool": "bool"}


_DTYPES: dict = {}


def declared_dtype(dtype: Any, what: str) -> tuple[str, int]:
    """`normalize_dtype` of a Program constructor's dtype= (None is not a dtype there:
    NumPy would read it as float64)."""
    if dtype is None:
        raise TypeError(f"{what}: dtype= is required (the tiles' element type), got None")
    return normalize_dtype(dtype)


def normalize_dtype(dtype: Any) -> tuple[str, int]:
    """(canonical name, itemsize) for anything numpy.dtype accepts, torch dtypes and
    bfloat16/float8 names (via ml_dtypes when installed). Cached per hashable dtype."""
    try:
        return _DTYPES[(type(dtype), dtype)]
    except (KeyError, TypeError):
        pass
    out = _normalize_dtype(dtype)
    try:
        if len(_DTYPES) < 256:
            _DTYPES[(type(dtype), dtype)] = out
    except TypeError:
        pass
    return out


def _normalize_dtype(dtype: Any) -> tuple[str, int]:
    t = sys.modules.get("torch")
    if t is not None and isinstance(dtype, getattr(t, "dtype", ())):
        name = str(dtype).removeprefix("torch.")
        name = _TORCH_NAMES.get(name, name)
        itemsize = t.empty((), dtype=dtype).element_size()
        return name, itemsize
    try:
        dt = np.dtype(dtype)
    except TypeError:
        if isinstance(dtype, str):
            try:
                import ml_dtypes
                dt = np.dtype(getattr(ml_dtypes, dtype))
            except (ImportError, AttributeError):
                raise TypeError(f"unknown dtype {dtype!r}") from None
        else:
            raise TypeError(f"unknown dtype {dtype!r}") from None
    if dt.kind in "OUSM" or dt.fields is not None or (dt.kind == "V" and not _is_ml_dtype(dt)):
        raise TypeError(f"dtype {dt} is not a numeric element type")
    return dt.name, dt.itemsize


def _is_ml_dtype(dt: np.dtype) -> bool:
    """bfloat16, float8_* and friends: NumPy reports them as kind 'V' (ml_dtypes)."""
    try:
        import ml_dtypes
    except ImportError:
        return False
    t = getattr(ml_dtypes, dt.name, None)
    return t is not None and np.dtype(t) == dt


def numpy_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))


def dtype_of(x) -> tuple[str, int]:
    return normalize_dtype(x.dtype)


def to_numpy(x) -> np.ndarray:
    k = kind_of(x)
    if k == "numpy":
        return np.asarray(x)
    if k == "torch":
        return x.detach().cpu().numpy() if x.dtype.is_floating_point is False or str(x.dtype) != "torch.bfloat16" \
            else x.detach().cpu().view(dtype=__import__("torch").int16).numpy().view(numpy_dtype("bfloat16"))
    return np.asarray(x)


@memo(maxsize=8)
def jax_table(devices: tuple) -> dict:
    """meshcomm device id -> jax.Device: its position in `jax.devices()` ordered by (process,
    id): `Device.id` in one process; under jax.distributed process p's k devices get
    p*k .. p*k+k-1, as meshcomm's ownership gives them (adapters/jax.py)."""
    return dict(enumerate(sorted(devices, key=lambda d: (d.process_index, d.id))))


def jax_device(device_id: int):
    """The jax.Device of a meshcomm device id (else this process's first: one process with
    fewer JAX devices than the mesh has, every tile on its one device)."""
    import jax
    d = jax_table(tuple(jax.devices())).get(device_id)
    return d if d is not None else jax.local_devices()[0]


def as_jax(res, bare: bool, owned):
    """Host results as JAX arrays on their devices: {device id: array} on each device's JAX
    device, a bare one (`bare`) on the device of `owned[0]`, None as None."""
    if not bare:
        return to_jax_devices(res)
    import jax
    return None if res is None else jax.device_put(res, jax_device(owned[0]))


def to_jax_devices(tiles: dict) -> dict:
    """{device id: host array} -> {device id: jax.Array committed to that JAX device}, in one
    batched `jax.device_put` (on CPU, 64-byte-aligned NumPy arrays are adopted, not copied)."""
    if not tiles:
        return {}
    import jax
    by_id = jax_table(tuple(jax.devices()))
    first = jax.local_devices()[0]
    keys = list(tiles)
    put = jax.device_put([tiles[d] for d in keys], [by_id.get(d, first) for d in keys])
    return dict(zip(keys, put))
