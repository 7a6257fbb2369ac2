"""Public entry points: plan, reshard, shard, unshard."""
from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import numpy as np

from . import arrays, runtime
from .caches import clear_caches, memo, registry
from .layout import Layout, normalize_shape
from .planners import Plan, Topology, plan_reshard

__all__ = ["plan", "reshard", "shard", "unshard", "infer_shape", "Handle"]


# -- planning ---------------------------------------------------------------------------

def plan(shape, dtype, src: Layout, dst: Layout, topology: Topology | str | None = None) -> Plan:
    """The schedule that moves a `shape`/`dtype` tensor from `src` to `dst`. Pure,
    deterministic and cached: asking again with equal arguments returns the same Plan."""
    try:                        # the same call again: one dict lookup
        return _SEEN[(shape, dtype, src, dst, topology)]
    except (KeyError, TypeError):
        pass
    _check_layouts(src, dst)
    key = (shape, dtype, src, dst, topology)
    shape = normalize_shape(shape)
    src.check_shape(shape)
    dst.check_shape(shape)
    name, itemsize = arrays.normalize_dtype(dtype)
    p = _cached_plan(shape, name, itemsize, src, dst, Topology.coerce(topology))
    try:
        _SEEN.put(key, p)
    except TypeError:           # an unhashable spelling of the shape (a list): no shortcut
        pass
    return p


_SEEN = registry(512)


def clear_plan_cache() -> None:
    """Forget every cached plan and tiling (kept for old callers: `meshcomm.clear_caches`)."""
    clear_caches()


@memo(maxsize=512)
def _cached_plan(shape, dtype, itemsize, src, dst, topology) -> Plan:
    return plan_reshard(shape, dtype, itemsize, src, dst, topology)


def _check_layouts(src, dst):
    for name, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise TypeError(f"{name} must be a meshcomm.Layout, got {type(lay).__name__}")


# -- shape and dtype inference ------------------------------------------------------------

def infer_shape(layout: Layout, tile_shapes: Mapping[int, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The global shape implied by some devices' tile shapes, or None when ambiguous.

    A dimension is known when it is unsplit, split by Blocks, or when the tiles cover every
    shard along it; otherwise it is known only if exactly one size gives these tile sizes
    under torch.chunk splitting.
    """
    if not tile_shapes:
        return None
    ndims = {len(s) for s in tile_shapes.values()}
    if len(ndims) != 1:
        raise ValueError(f"shards have different ranks: {sorted(ndims)}")
    ndim = ndims.pop()
    if len(layout.spec) > ndim:
        raise ValueError(f"spec {layout.spec_str()} has {len(layout.spec)} entries but the shards "
                         f"have {ndim} dimension(s)")
    mesh = layout.mesh
    shape = []
    for dim in range(ndim):
        e = layout.spec[dim] if dim < len(layout.spec) else None
        sizes = {}
        for d, s in tile_shapes.items():
            si = layout.shard_index(d)
            idx = si[dim] if dim < len(si) else 0
            if idx in sizes and sizes[idx] != s[dim]:
                raise ValueError(f"devices holding the same shard along dimension {dim} have "
                                 f"different sizes {sizes[idx]} and {s[dim]} (device {d})")
            sizes[idx] = s[dim]
        if e is None:
            shape.append(sizes[0])
            continue
        from .layout import Blocks
        if isinstance(e, Blocks):
            for idx, n in sizes.items():
                if n != e.sizes[idx]:
                    raise ValueError(f"dimension {dim}: shard {idx} has size {n} but {e} gives it {e.sizes[idx]}")
            shape.append(sum(e.sizes))
            continue
        k = math.prod(mesh.axis_size(a) for a in e)
        if len(sizes) == k:
            n = sum(sizes.values())
            shape.append(n)
            continue
        n = _unique_chunk_total(sizes, k)
        if n is None:
            return None
        shape.append(n)
    return tuple(shape)


def _unique_chunk_total(sizes: Mapping[int, int], k: int) -> int | None:
    hi = k * (max(sizes.values()) + 1)
    if hi > 50_000_000:
        return None
    n = np.arange(hi + 1, dtype=np.int64)
    c = -(-n // k)
    ok = np.ones_like(n, dtype=bool)
    for i, s in sizes.items():
        got = np.minimum((i + 1) * c, n) - np.minimum(i * c, n)
        ok &= got == s
    cand = np.nonzero(ok)[0]
    return int(cand[0]) if len(cand) == 1 else None


# -- shard / unshard ----------------------------------------------------------------------

def shard(array, layout: Layout, seed: int | None = None) -> dict[int, Any]:
    """Split a global array into the tiles of `layout`: {device: tile}, same array kind.

    For a partial layout the value is split into addends: without a seed the first device
    along the partial axes holds it and the rest hold zeros; with a seed, random addends.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshcomm.Layout, got {type(layout).__name__}")
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
        addends = _split_addends(value, k, rng, kind)
        for a, devs in groups.items():
            for d in devs:
                out[d] = _copy(addends[a], kind) if len(devs) > 1 else addends[a]
    if kind == "jax":
        import jax
        return {d: jax.device_put(v, arrays.jax_device(d)) for d, v in out.items()}
    return {d: out[d] for d in layout.mesh.device_ids}


def _copy(x, kind):
    if kind == "torch":
        return x.clone()
    if kind == "numpy":
        return x.copy()
    return x


def _split_addends(value, k: int, rng, kind: str) -> list:
    if k == 1:
        return [_copy(value, kind)]
    if rng is None:
        zeros = _zeros_like(value, kind)
        return [_copy(value, kind)] + [_copy(zeros, kind) for _ in range(k - 1)]
    parts = []
    rest = _copy(value, kind)
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
    """Assemble the global array from every device's tile (summing pending sums)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a meshcomm.Layout, got {type(layout).__name__}")
    if not isinstance(shards, Mapping):
        raise TypeError(f"shards must be a dict {{device id: array}}, got {type(shards).__name__}")
    _check_keys(shards, layout, "layout")
    missing = [d for d in layout.mesh.device_ids if d not in shards]
    if missing:
        raise ValueError(f"unshard needs every device's tile; missing device(s) {missing[:8]}")
    first = shards[layout.mesh.device_ids[0]]
    kind = arrays.kind_of(first)
    shape = infer_shape(layout, {d: tuple(v.shape) for d, v in shards.items()})
    t = layout.tiles(shape)
    _check_tile_shapes(shards, t, "layout")
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
            if layout.num_addends == 1:
                out[idx] = v
            else:
                out[idx] += v
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.asarray(out)
    return out


def _check_keys(shards, layout, what):
    mesh_devs = set(layout.mesh.device_ids)
    for d in shards:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
            raise TypeError(f"shard keys must be device ids (int), got {d!r}")
        if d not in mesh_devs:
            raise ValueError(f"device {d} is not in the {what} mesh {layout.mesh}")


def _check_tile_shapes(shards, tiling, what):
    for d, v in shards.items():
        box = tiling.boxes[d]
        want = tuple(b - a for a, b in box)
        if tuple(v.shape) != want:
            raise ValueError(f"shard for device {d} has shape {tuple(v.shape)} but the {what} layout "
                             f"gives device {d} the box {list(box)} of shape {want} "
                             f"(global shape {tiling.shape})")


# -- reshard ------------------------------------------------------------------------------

class Handle:
    """What `reshard(..., async_op=True)` returns: `.wait()` gives the result."""

    def __init__(self, wait_fn=None, result=None):
        self._wait_fn = wait_fn
        self._result = result
        self._done = wait_fn is None

    def wait(self):
        if not self._done:
            self._result = self._wait_fn()
            self._done = True
            self._wait_fn = None
        return self._result

    def is_completed(self) -> bool:
        return self._done


def reshard(x, src: Layout, dst: Layout, *, shape=None, dtype=None, backend: str | None = None,
            async_op: bool = False):
    """Move a sharded tensor from layout `src` to layout `dst`.

    `x` is {device id: tile} with the src tiles this process owns (or a bare array when it
    owns exactly one device). Returns the dst tiles this process owns, in the same array kind.
    """
    _check_layouts(src, dst)
    ctx = runtime.current()
    if ctx is not None and backend != "local":
        return ctx.reshard(x, src, dst, shape=shape, dtype=dtype, backend=backend, async_op=async_op)
    if backend not in (None, "local"):
        raise ValueError(f"backend {backend!r} needs meshcomm.init(backend={backend!r}) under a "
                         "launcher (mpiexec or torchrun); without one, reshard runs locally")
    shards, bare = normalize_input(x, src)
    owned_src = list(src.mesh.device_ids)
    missing = [d for d in owned_src if d not in shards]
    if missing:
        raise ValueError(f"without a launcher this process owns every device, so x must hold a "
                         f"tile for each src device; missing device(s) {missing[:8]}")
    result = _reshard_local(shards, src, dst, shape, dtype)
    if bare:
        devs = dst.mesh.device_ids
        if len(devs) != 1:
            raise ValueError("a bare array in gives a bare array out only when the dst mesh has one "
                             f"device; dst mesh has {len(devs)}; pass a dict {{device: tile}}")
        result = result[devs[0]]
    return Handle(result=result) if async_op else result


def normalize_input(x, src: Layout, owned: tuple[int, ...] | None = None) -> tuple[dict, bool]:
    """{device: tile} from what the user passed; True if it was a bare array."""
    if isinstance(x, Mapping):
        _check_keys(x, src, "src")
        if owned is not None:
            extra = [d for d in x if d not in owned]
            if extra:
                raise ValueError(f"this process does not own device(s) {extra} it passed shards for")
        kinds = {arrays.kind_of(v) for v in x.values()}
        if len(kinds) > 1:
            raise TypeError(f"shards mix array kinds {sorted(kinds)}; pass one kind")
        return dict(x), False
    arrays.kind_of(x)
    mine = [d for d in (owned if owned is not None else src.mesh.device_ids) if d in src.mesh]
    if len(mine) != 1:
        raise TypeError(f"a bare array is accepted only when this process owns exactly one src device "
                        f"(it owns {len(mine)}); pass a dict {{device id: tile}}")
    return {mine[0]: x}, True


def resolve_shape_dtype(shards: Mapping[int, Any], src: Layout, shape, dtype):
    """Validate or infer (shape, dtype name, itemsize) from the shards a process holds."""
    dnames = {arrays.dtype_of(v) for v in shards.values()}
    if len(dnames) > 1:
        raise TypeError(f"shards have different dtypes {sorted(n for n, _ in dnames)}")
    if dtype is not None:
        name, itemsize = arrays.normalize_dtype(dtype)
        if dnames and dnames != {(name, itemsize)}:
            got = next(iter(dnames))[0]
            raise TypeError(f"dtype={name} but the shards have dtype {got}")
    elif dnames:
        name, itemsize = next(iter(dnames))
    else:
        name, itemsize = None, None
    if shape is not None:
        shape = src.check_shape(normalize_shape(shape))
    else:
        shape = infer_shape(src, {d: tuple(v.shape) for d, v in shards.items()})
    return shape, name, itemsize


def _reshard_local(shards, src, dst, shape, dtype):
    shape, name, itemsize = resolve_shape_dtype(shards, src, shape, dtype)
    if shape is None:
        raise ValueError("cannot infer the global shape from the shards; pass shape=")
    p = plan(shape, name, src, dst)
    _check_tile_shapes(shards, src.tiles(shape), "src")
    first = next(iter(shards.values()))
    kind = arrays.kind_of(first)
    from .backends.local import LocalBackend
    if kind == "jax":
        np_shards = {d: np.asarray(v) for d, v in shards.items()}
        out = LocalBackend().execute(p, np_shards, like=next(iter(np_shards.values())))
        import jax
        return {d: jax.device_put(v, arrays.jax_device(d)) for d, v in out.items()}
    return LocalBackend().execute(p, shards, like=first)
