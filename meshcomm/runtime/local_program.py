"""Programs without a launcher: one process owns every device, so nothing is agreed and the
plan runs in memory (backends/local.py). The same Program API as under `meshcomm.init`; the
eager calls without a context use the functions here too."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .. import arrays
from .. import log as _log
from ..planning import plan
from ..validate import check_out_buffer, check_tile_shapes, normalize_input, resolve_shape_dtype
from .context import init_hint
from .program import new
from .tiles import host_dtype

__all__ = ["one_process", "bare_result", "reshard_local", "local_reshard", "LocalKernel", "fill_out", "no_out"]


class LocalKernel:
    """A Program's kernel in one process: `fn(x)` per run; `out=` buffers are filled from its
    results (`fill`: fill_out, per tensor for a batch; None where a result's shape is data)."""

    def __init__(self, fn, what, label, fill=None):
        self.fn, self.what, self.label, self.fill = fn, what, label, fill

    def describe(self) -> str:
        return self.what

    def prepare(self, x, out=None):
        if out is not None and self.fill is None:
            raise TypeError(no_out(self.label))
        return x, out

    def run(self, st, deadline, stamp=None):
        x, out = st
        res = self.fn(x)
        return res if out is None else self.fill(res, out, self.label)

    def finish(self, r):
        return r


def no_out(what: str) -> str:
    return f"{what}: out= is not taken here (its results' shapes follow each run's counts)"


def fill_out(res, out, what: str, copy: bool = True, taken=None):
    """A one-process run's results copied into the caller's `out=` buffers ({device: buffer},
    or one buffer where the result is one array), each checked first as a launcher's run
    checks them (device, shape, dtype, kind, writable C order); the results with those
    buffers in their place (`copy=False`: only the checks)."""
    bare = not isinstance(res, Mapping)
    if bare != (not isinstance(out, Mapping)):
        raise TypeError(f"{what}: out= must be " + ("one array, like the result" if bare else
                                                     "a dict {device: buffer}, like the result"))
    res_d, out_d = ({None: res}, {None: out}) if bare else (res, out)
    taken = [] if taken is None else taken
    for d, v in out_d.items():
        where = "out=" if bare else f"out= buffer of device {d}"
        if d not in res_d or res_d[d] is None:
            raise ValueError(f"{what}: out= holds a buffer for device {d}, which gets no result")
        r = res_d[d]
        check_out_buffer(v, r.shape, arrays.dtype_of(r)[0], f"{what}: {where}", arrays.kind_of(r), taken=taken)
    if not copy:                        # checked only (a batch checks every tensor's first)
        return res
    for d, v in out_d.items():
        if arrays.is_torch(v):
            v.copy_(res_d[d])
        else:
            np.copyto(v, np.asarray(res_d[d]))
    return out if bare else {**res, **out}


def local_reshard(src, dst, shape, dtype, compression):
    name = arrays.normalize_dtype(dtype)[0]
    p = plan(shape, name, src, dst)

    def general(x):
        return bare_result(one_process(x, src, dst, shape, dtype, compression=compression), dst)
    run = general if compression is not None else _planned(p, name, general)
    label = f"reshard {src} -> {dst} {shape}"
    return new(None, 0, label, LocalKernel(run, "plan", "reshard", fill_out), p)


def _planned(p, name: str, general):
    """A run of the planned reshard: a dict of NumPy arrays (native byte order) or torch
    tensors, one of the planned shape and dtype per src device, goes straight to the local
    backend; anything else (a bare array, JAX arrays, a wrong tile, the log on) takes the
    general path, with its errors."""
    from ..backends.local import LocalBackend
    want = {d: tuple(b - a for a, b in box) for d, box in p.src.tiles(p.shape).boxes.items()}
    np_dt = host_dtype(name)
    torch_dt = None                         # resolved at the first torch run

    def run(x):
        nonlocal torch_dt
        if type(x) is not dict or len(x) != len(want) or _log.ON:
            return general(x)
        first = next(iter(x.values()))
        if type(first) is np.ndarray:
            ok = np_dt is not None and all(type(v) is np.ndarray and v.dtype == np_dt and want.get(d) == v.shape
                                          for d, v in x.items())
        elif arrays.is_torch(first):
            torch_dt = torch_dt or _torch_dtype(name)
            ok = all(arrays.is_torch(v) and v.dtype == torch_dt and want.get(d) == tuple(v.shape)
                     and v.device == first.device for d, v in x.items())
        else:
            ok = False
        return LocalBackend().execute(p, x, like=first) if ok else general(x)
    return run


def _torch_dtype(name: str):
    import torch
    return getattr(torch, name, None)


def bare_result(res, dst):
    """A one-process reshard's (result, bare) as the caller gets it: the one dst tile where
    a bare array came in (the dst mesh must have one device), else the dict."""
    out, bare = res
    if bare:
        devs = dst.mesh.device_ids
        if len(devs) != 1:
            raise ValueError("a bare array in gives a bare array out only when the dst mesh has one "
                             f"device; dst mesh has {len(devs)}; pass a dict {{device: tile}}")
        return out[devs[0]]
    return out


def one_process(x, src, dst, shape, dtype, async_op=False, compression=None, commit=True):
    """reshard without a launcher: (the dst tiles, whether x was a bare array). With
    `commit=False`, JAX tiles come back as host arrays for the caller to commit."""
    stamp = _log.stamp(async_op) if _log.ON else None
    shards, bare = normalize_input(x, src)
    owned_src = list(src.mesh.device_ids)
    missing = [d for d in owned_src if d not in shards]
    if missing:
        raise ValueError(f"without meshcomm.init this process owns every device, so x must hold a "
                         f"tile for each src device; missing device(s) {missing[:8]}{init_hint()}")
    return reshard_local(shards, src, dst, shape, dtype, stamp, compression, commit), bare


def reshard_local(shards, src, dst, shape, dtype, stamp=None, compression=None, commit=True):
    shape, name, itemsize = resolve_shape_dtype(shards, src, shape, dtype)
    if shape is None:
        raise ValueError("cannot infer the global shape from the shards; pass shape=")
    p = plan(shape, name, src, dst)
    check_tile_shapes({d: v.shape for d, v in shards.items()}, src.tiles(shape), "src")
    first = next(iter(shards.values()))
    kind = arrays.kind_of(first)
    from ..backends.local import LocalBackend
    comp = None
    if compression is not None:
        from ..backends import codec_cost
        dev = getattr(first, "device", None)
        codec_cost.check(compression, name, getattr(dev, "type", "cpu") if kind == "torch" else "cpu", "reshard")
        comp = codec_cost.resolve(compression, p, local=True)
    if comp is not None:                # the same round trips as under a launcher
        from ..backends.compressed import execute_local
        host = {d: np.asarray(v) for d, v in shards.items()} if kind == "jax" else shards
        out = execute_local(p, host, next(iter(host.values())), comp)
    elif kind == "jax":
        # one copy per piece into 64-byte-aligned NumPy tiles, which jax.device_put adopts
        # on CPU devices without a copy (alias: every tile is on one); replicas share one
        # (JAX arrays are immutable)
        np_shards = {d: np.asarray(v) for d, v in shards.items()}
        out = LocalBackend().execute(p, np_shards, like=next(iter(np_shards.values())), share=True,
                                     alias=all(d.platform == "cpu" for v in shards.values() for d in v.devices()))
    else:
        out = LocalBackend().execute(p, shards, like=first)
    if kind == "jax" and commit:
        out = arrays.to_jax_devices(out)
    if stamp is not None:       # one process: nothing on the wire (meshcomm.log)
        _log.record_reshard(stamp, rank=None, dpp=None, backend="local", plan=p, collective_reduce=False,
                            shards=shards, out=out)
    return out
