"""Public entry points: plan, reshard, shard, unshard (one process, or delegating to the runtime)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import arrays, runtime
from .addends import split_pending
from .handle import Handle
from .layout import Layout
from .planning import plan
from .reduceops import combine
from .compression import coerce
from .runtime.local_program import bare_result, one_process
from .runtime.program import checking
from .runtime.reshard_call import reshard as dist_reshard
from .validate import check_keys, check_layouts, check_tile_shapes, infer_shape

__all__ = ["plan", "reshard", "reshard_many", "shard", "unshard"]


# -- shard / unshard ----------------------------------------------------------------------

def shard(array, layout: Layout, seed: int | None = None) -> dict[int, Any]:
    """Split a global array into the tiles of `layout`: {device: tile}, same array kind.

    For a partial layout the value is split into addends: without a seed the first device
    along the partial axes holds it and the rest hold zeros; with a seed, random addends.
    For a partial prod/min/max the others hold the op's identity, or with a seed random
    values that leave the result unchanged (meshcomm.addends).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshcomm.Layout, got {type(layout).__name__}")
    if arrays.is_barebones_torch(array):
        import torch
        return {d: torch.from_numpy(v) for d, v in shard(array.numpy(), layout, seed).items()}
    kind = arrays.kind_of(array)
    shape = layout.check_shape(tuple(array.shape))
    t = layout.tiles(shape)
    k = layout.num_addends
    rng = np.random.default_rng(seed) if (seed is not None and k > 1) else None
    out = {}
    for sc, groups in t.classes.items():
        box = t.boxes[next(iter(groups.values()))[0]]
        idx = tuple(slice(a, b) for a, b in box)
        value = array[idx] if idx else array          # 0-d: x[()] would give a NumPy scalar
        addends = (_split_addends(value, k, rng, kind) if layout.partial_op == "sum"
                   else split_pending(value, k, layout.partial_op, rng, kind))
        for a, devs in groups.items():
            for d in devs:
                out[d] = arrays.copy(addends[a], kind) if len(devs) > 1 else addends[a]
    if kind == "jax":
        return arrays.to_jax_devices(out)
    return {d: out[d] for d in layout.mesh.device_ids}




def _split_addends(value, k: int, rng, kind: str) -> list:
    if k == 1:
        return [arrays.copy(value, kind)]
    if rng is None:
        zeros = _zeros_like(value, kind)
        return [arrays.copy(value, kind)] + [arrays.copy(zeros, kind) for _ in range(k - 1)]
    parts = []
    rest = arrays.copy(value, kind)
    for _ in range(k - 1):
        r = _random_like(value, rng, kind)
        parts.append(r)
        rest = rest - r
    parts.append(rest)
    if kind == "numpy":                 # 0-d arithmetic gives NumPy scalars; keep arrays
        parts = [np.asarray(p) for p in parts]
    return parts


def _zeros_like(value, kind):
    if kind == "torch":
        import torch
        return torch.zeros_like(value)
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.zeros_like(value)
    return np.zeros_like(value)


def _random_like(value, rng, kind):
    shape = tuple(value.shape)
    if kind == "torch":
        import torch
        if value.dtype.is_floating_point or value.dtype.is_complex:
            r = rng.standard_normal(shape).astype(np.float32)
        elif value.dtype == torch.bool:
            raise ValueError("a partial (pending-sum) layout cannot hold bool values")
        else:
            r = rng.integers(-1000, 1000, size=shape)
        return torch.from_numpy(np.asarray(r)).to(dtype=value.dtype, device=value.device)
    dt = np.dtype(value.dtype)
    if dt.kind in "fc" or dt.name == "bfloat16":
        r = rng.standard_normal(shape).astype(dt)
    elif dt.kind == "b":
        raise ValueError("a partial (pending-sum) layout cannot hold bool values")
    else:
        info = np.iinfo(dt)
        r = rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dt)
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.asarray(r)
    return r


def unshard(shards: Mapping[int, Any], layout: Layout):
    """Assemble the global array from every device's tile (reducing pending values by the
    layout's op, in addend order)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshcomm.Layout, got {type(layout).__name__}")
    if not isinstance(shards, Mapping):
        raise TypeError(f"shards must be a dict {{device id: array}}, got {type(shards).__name__}")
    check_keys(shards, layout, "layout")
    missing = [d for d in layout.mesh.device_ids if d not in shards]
    if missing:
        raise ValueError(f"unshard needs every device's tile; missing device(s) {missing[:8]}")
    first = shards[layout.mesh.device_ids[0]]
    if arrays.is_barebones_torch(first):
        import torch
        return torch.from_numpy(unshard({d: v.numpy() for d, v in shards.items()}, layout))
    kind = arrays.kind_of(first)
    shape = infer_shape(layout, {d: tuple(v.shape) for d, v in shards.items()})
    t = layout.tiles(shape)
    check_tile_shapes({d: v.shape for d, v in shards.items()}, t, "layout")
    if kind == "torch":
        import torch
        out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    else:
        out = np.zeros(shape, dtype=np.asarray(first).dtype)
    for sc, groups in t.classes.items():
        devs0 = next(iter(groups.values()))
        idx = tuple(slice(a, b) for a, b in t.boxes[devs0[0]])
        for a, devs in groups.items():
            v = shards[devs[0]]
            if kind == "jax":
                v = np.asarray(v)
            if layout.num_addends == 1 or (a == 0 and layout.partial_op != "sum"):
                out[idx] = v
            elif layout.partial_op == "sum":
                out[idx] += v
            else:
                out[idx] = combine(out[idx], v, layout.partial_op)
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.asarray(out)
    return out


# -- reshard ------------------------------------------------------------------------------

def reshard(x, src: Layout, dst: Layout, *, shape=None, dtype=None, backend: str | None = None,
            async_op: bool = False, compression=None):
    """Move a sharded tensor from layout `src` to layout `dst`.

    `x` is {device id: tile} with the src tiles this process owns (or a bare array when it
    owns exactly one device). Returns the dst tiles this process owns, in the same array kind.
    `compression` (a codec, "bf16", "fp16", "zfp(rate=8)" or "auto"): every piece is coded
    once by its sender and decoded where it lands (broadcast chains forward the bytes as
    they are); see meshcomm.compression and planners/compressed.py.
    """
    with checking("reshard", lambda: (src.mesh, dst.mesh)):     # every process raises
        check_layouts(src, dst)
        compression = coerce(compression)
    ctx = runtime.current()
    if ctx is not None and backend != "local":
        return dist_reshard(ctx, x, src, dst, shape=shape, dtype=dtype, backend=backend, async_op=async_op,
                            compression=compression)
    runtime.no_context(backend, "reshard")
    result = bare_result(one_process(x, src, dst, shape, dtype, async_op, compression), dst)
    return Handle(result=result) if async_op else result


def reshard_many(xs, src, dst, *, shapes=None, dtypes=None, backend: str | None = None, async_op: bool = False,
                 bucket_mb=None, compression=None):
    """Move many tensors at once (a model's weights, a state dict): `xs[name]` is this
    process's src tiles of tensor `name` (as `reshard` takes them; a name may be left out
    where it owns none). `src`/`dst`: {name: Layout} or one Layout for every name; `shapes`,
    `dtypes`: {name: ...} (or one dtype), inferred from the tiles where unambiguous. Returns
    {name: this process's dst tiles} ({} where it owns none). The batch is planned as one
    (senders balanced over every tensor's bytes) and runs with one message per pair of
    processes per stage and bucket (`bucket_mb`). Under a launcher it is the cached
    `Program.reshard_many` of these arguments."""
    ctx = runtime.current()
    if ctx is not None and backend != "local":
        from .runtime.batch_call import reshard_many as dist
        return dist(ctx, xs, src, dst, shapes=shapes, dtypes=dtypes, backend=backend, async_op=async_op,
                    bucket_mb=bucket_mb, compression=compression)
    runtime.no_context(backend, "reshard_many")
    from .runtime.batch_call import normalize_batch
    if compression is not None:
        raise ValueError("reshard_many does not take compression= yet: reshard the tensors that should be "
                         "compressed with reshard(..., compression=)")
    if not isinstance(xs, Mapping):
        raise TypeError(f"reshard_many takes {{name: src tiles}}, got {type(xs).__name__}")
    names = None if any(isinstance(d, Mapping) for d in (src, dst, shapes, dtypes)) else tuple(xs)
    names, srcs, dsts, shp, dts = normalize_batch(src, dst, shapes, dtypes, names)
    extra = sorted(set(xs) - set(names))
    if extra:
        raise ValueError(f"reshard_many: xs holds tensors {extra[:4]} that are not in the batch")
    out = {}
    for n in names:
        try:
            out[n] = one_process(xs.get(n, {}), srcs[n], dsts[n], shp[n], dts[n])[0]
        except (ValueError, TypeError) as e:
            raise type(e)(f"tensor {n!r}: {e}") from None
    return Handle(result=out) if async_op else out
