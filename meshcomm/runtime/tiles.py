"""A run's tiles, as the kernels see them: their facts (dtype, kind, device type), the fences
between compute and communication, the common run a kernel checks without the general
validation (`fit_of`, `common_run`), CPU torch tensors as NumPy views (`numpy_views`)."""
from __future__ import annotations

import sys

import numpy as np

from .. import arrays
from ..backends import streams

__all__ = ["check_device", "empty_like", "fences_of", "fit_of", "common_run", "numpy_views", "torch_results", "host_dtype", "facts_of", "consume"]


def empty_like(kind, name, devtype):
    """An empty array of the agreed kind, dtype and device (a process without tiles)."""
    if kind == "torch":
        import torch
        dev = torch.device("cuda", torch.cuda.current_device()) if devtype == "cuda" else "cpu"
        return torch.empty(0, dtype=getattr(torch, name), device=dev)
    return np.empty(0, dtype=arrays.numpy_dtype(name))


def check_device(device, none_means: str) -> None:
    """A constructor's device=: "cpu", "cuda" or None (ValueError otherwise)."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or None: {none_means}), got {device!r}")


def fences_of(tiles) -> tuple:
    """compute -> comm: one fence per CUDA device of the inputs (a no-op on the host)."""
    fences = {}
    for v in tiles.values():
        dev = streams.device_of(v)
        if streams.is_cuda(dev) and dev not in fences:
            fences[dev] = streams.fence_from_current(dev)
    if not fences:
        fences[None] = streams.fence_from_current(None)
    return tuple(fences.values())


def fit_of(kind, devtype, dtype: str) -> dict:
    """What a kernel's common run takes, for a Program of this array kind (None: each run's
    tiles say), device type and dtype: {array class: dtype} of host tiles, NumPy arrays in
    native byte order and CPU torch tensors ({}: every run checked in full)."""
    if devtype not in (None, "cpu"):
        return {}
    fit = {}
    if kind in (None, "numpy"):
        dt = host_dtype(dtype)
        if dt is not None:
            fit[np.ndarray] = dt
    if kind == "torch" or (kind is None and "torch" in sys.modules):
        import torch
        dt = getattr(torch, dtype, None)
        if isinstance(dt, torch.dtype):
            fit[torch.Tensor] = dt
    return fit


def common_run(x, want: dict, fit: dict, bare_ok: bool):
    """(tiles {device: tile}, bare, kind) where `x` is a common run: one tile per owned
    device, all of one class in `fit` with its dtype and the shape `want` gives (a bare one
    where it owns one and `bare_ok`; None or {} where it owns none: kind None), else None
    (the run is checked in full)."""
    if x is None or (type(x) is dict and not x):
        return None if want else ({}, False, None)
    bare = type(x) is not dict
    if bare:
        if len(want) != 1 or not bare_ok:
            return None
        x = {next(iter(want)): x}
    cls = type(next(iter(x.values())))
    dt = fit.get(cls)
    if dt is None or len(x) != len(want) or not all(
            type(v) is cls and v.shape == want.get(d) and v.dtype == dt for d, v in x.items()):
        return None
    if cls is np.ndarray:
        return (x if bare else dict(x)), bare, "numpy"
    return ((x if bare else dict(x)), bare, "torch") if all(v.device.type == "cpu" for v in x.values()) else None


def numpy_views(shards, like, out):
    """(tiles, like, out=) of CPU torch tensors as NumPy views over their memory (no copy), or
    None where one is not a tensor NumPy can view (on a device, bfloat16, a conjugate view)."""
    if not arrays.is_torch(like):
        return None
    try:
        return ({d: v.detach().numpy() for d, v in shards.items()}, like.detach().numpy(),
                None if out is None else {d: v.detach().numpy() for d, v in out.items()})
    except (TypeError, RuntimeError):
        return None


def torch_results(res, out) -> dict:
    """A run's results over NumPy views (`numpy_views`) as torch tensors: the caller's `out=`
    buffers where it gave them, else tensors over the result memory (no copy)."""
    import torch
    return {d: out[d] if out is not None and d in out else torch.from_numpy(v) for d, v in res.items()}


def host_dtype(name: str):
    """The NumPy dtype, in native byte order, that a host tile of an agreed dtype has on a
    kernel's fast check (a bare NumPy run), or None where NumPy has no such dtype."""
    try:
        return np.dtype(arrays.numpy_dtype(name)).newbyteorder("=")
    except TypeError:
        return None


def facts_of(tiles) -> tuple:
    """(dtype (name, itemsize), kind, device type) of a process's tiles, or Nones."""
    if not tiles:
        return None, None, None
    first = next(iter(tiles.values()))
    dev = streams.device_of(first)
    return arrays.dtype_of(first), arrays.kind_of(first), dev.type if dev is not None else "cpu"


def consume(out, done):
    """comm -> compute: the consumer's stream waits for the communication stream."""
    for v in out.values():
        done.wait_on(streams.current_stream(streams.device_of(v)))
        break


def plain_torch(x) -> bool:
    """Whether `x` is a plain (not a subclass) contiguous CPU torch tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and type(x) is torch.Tensor and x.device.type == "cpu" and x.is_contiguous()


def torch_unwrap(x):
    """A lean run's other input (program.Program._lean_run): a plain CPU torch tensor, as a
    NumPy view of its memory and how its result goes back (a torch tensor over the result),
    else None (the general run takes it)."""
    if not plain_torch(x):
        return None
    try:
        v = x.detach().numpy()
    except (TypeError, RuntimeError):           # bfloat16, a conjugate or negative view
        return None
    return v, _from_numpy


def _from_numpy(y):
    return None if y is None else sys.modules["torch"].from_numpy(y)
