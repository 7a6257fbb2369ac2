"""JAX adapter: reshard a `jax.Array` with a `NamedSharding` to another sharding or Layout.

    from jax.sharding import NamedSharding, PartitionSpec as P
    from meshcomm.adapters.jax import reshard_jax
    y = reshard_jax(x, NamedSharding(other_mesh, P(None, "x")))   # any device set, any count
    y.sharding                                                       # the new NamedSharding

meshcomm device ids are JAX device ids (`jax.Device.id`) in one process. Across processes
(`jax.distributed.initialize`) JAX numbers process p's devices p*2048 + i on CPU, so meshcomm
uses the device's position in `jax.devices()` sorted by (process, id), which equals
`Device.id` in one process and gives process p the ids p*k .. p*k+k-1 when every process has
k local devices: exactly meshcomm's ownership rule with `init(devices_per_process=k)`
(`meshcomm_id(device)`, `jax_device_by_id(i)` convert). `reshard_jax` reads the shards of
`x` this process can address, runs `meshcomm.reshard` (in memory in one process, or SPMD
across processes after `meshcomm.init(...)`), and assembles the result with
`jax.make_array_from_single_device_arrays`. Unlike `jax.device_put`, the source and target
device sets may differ in size and overlap arbitrarily.

When the target is a Layout JAX cannot express (Blocks, an uneven split, a pending sum),
`reshard_jax` returns a dict {device id: jax.Array} with the tiles this process owns, each
committed to its device.

Pytrees, as `jax.device_put` takes them: `reshard_jax(params, shardings)` (a tree of targets
matching the tree, a prefix of it, or one target for every leaf; `None` leaves a subtree
alone) moves every jax.Array leaf in ONE batch (`meshcomm.reshard_many`). Host leaves (NumPy
arrays, scalars) are placed as `jax.device_put` places them (the same value on every
process); other leaves raise TypeError. Errors name the leaf (`['layers'][0]['w']`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..arrays import jax_table
from ..caches import memo
from ..layout import Blocks, Layout, normalize_shape
from ..mesh import Mesh

__all__ = ["layout_from_sharding", "sharding_from_layout", "reshard_jax", "jax_device_by_id",
           "meshcomm_id"]

_HOST = (np.ndarray, np.generic, bool, int, float, complex)     # host leaves (jax.device_put places them)
_TARGETS = (jax.sharding.Sharding, Layout)                         # a target of a leaf


def _mesh_from_jax(jmesh) -> Mesh:
    devs = getattr(jmesh, "devices", None)
    if devs is None or not isinstance(devs, np.ndarray):
        raise TypeError(f"need a concrete jax.sharding.Mesh (with devices), got {type(jmesh).__name__}")
    pos = _positions()
    ids = np.vectorize(lambda d: pos[d], otypes=[np.int64])(devs)
    return Mesh(ids, tuple(jmesh.axis_names))


def layout_from_sharding(sharding, shape=None) -> Layout:
    """The meshcomm Layout equal to a JAX `NamedSharding`.

    PartitionSpec entries map one to one (None, an axis name, a tuple of axis names, major
    to minor); mesh axes the spec leaves unused are replicas; `unreduced` axes become
    `partial` (pending sums). With `shape` given, it is checked against the sharding.
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(f"layout_from_sharding needs a jax.sharding.NamedSharding, got "
                        f"{type(sharding).__name__}")
    if shape is not None:
        shape = normalize_shape(shape)
    return _layout_of(sharding, shape, _devices_key())


@memo(maxsize=256)
def _layout_of(sharding, shape, devices) -> Layout:
    """layout_from_sharding's work, cached (`devices`: the JAX devices it was read under)."""
    mesh = _mesh_from_jax(sharding.mesh)
    spec = []
    entries = tuple(getattr(sharding.spec, "partitions", sharding.spec))   # without unreduced/reduced
    if shape is not None and len(entries) > len(shape):
        raise ValueError(f"sharding {sharding.spec} has {len(entries)} entries but the tensor has "
                         f"{len(shape)} dimension(s) (shape {shape})")
    for dim, e in enumerate(entries):
        if e is PartitionSpec.UNCONSTRAINED:
            raise ValueError(f"dimension {dim} of {sharding.spec} is UNCONSTRAINED; meshcomm needs "
                             "a concrete sharding")
        spec.append(e)
    partial = tuple(sorted(getattr(sharding.spec, "unreduced", ()) or ()))
    layout = Layout(mesh, tuple(spec), partial=partial)
    if shape is not None:
        layout.check_shape(shape)
        _check_even(layout, shape, what="sharding")
    return layout


def _uneven_dims(layout: Layout, shape) -> list[tuple[int, int, int]]:
    out = []
    for dim, e in enumerate(layout.spec):
        if e is None or isinstance(e, Blocks):
            continue
        k = math.prod(layout.mesh.axis_size(a) for a in e)
        if shape[dim] % k:
            out.append((dim, shape[dim], k))
    return out


def _check_even(layout, shape, what):
    bad = _uneven_dims(layout, shape)
    if bad:
        dim, n, k = bad[0]
        raise ValueError(f"{what}: dimension {dim} of size {n} is split {k} ways, which JAX "
                         "cannot express (NamedSharding needs even splits)")


def _devices_key() -> tuple:
    return tuple(jax.devices())


def _ordered(devices: tuple) -> tuple:
    return tuple(jax_table(devices).values())


def _positions() -> dict:
    return _positions_of(_devices_key())


@memo(maxsize=8)
def _positions_of(devices: tuple) -> dict:
    return {d: i for i, d in enumerate(_ordered(devices))}


def meshcomm_id(device) -> int:
    """The meshcomm device id of a `jax.Device` (see the module docstring)."""
    try:
        return _positions()[device]
    except KeyError:
        raise ValueError(f"{device} is not one of jax.devices()") from None


def jax_device_by_id(device_id: int):
    """The `jax.Device` with this meshcomm id (across all processes), or ValueError."""
    table = _device_table()
    try:
        return table[int(device_id)]
    except KeyError:
        raise ValueError(f"device {device_id} is not a JAX device; JAX device ids are "
                         f"{sorted(table)[:16]}{' ...' if len(table) > 16 else ''}") from None


def _device_table() -> dict[int, Any]:
    return jax_table(_devices_key())


def expressible(layout: Layout, shape=None) -> str | None:
    """None when JAX can express `layout` (for `shape`, if given), else the reason."""
    for dim, e in enumerate(layout.spec):
        if isinstance(e, Blocks):
            return f"dimension {dim} uses explicit Blocks {e}"
    if layout.is_partial:
        return f"the layout is partial (pending sum over {', '.join(layout.partial)})"
    if shape is not None:
        bad = _uneven_dims(layout, normalize_shape(shape))
        if bad:
            dim, n, k = bad[0]
            return f"dimension {dim} of size {n} is split {k} ways (uneven)"
    table = _device_table()
    missing = [d for d in layout.mesh.device_ids if d not in table]
    if missing:
        return f"device(s) {missing[:8]} are not JAX devices"
    return None


def sharding_from_layout(layout: Layout, shape=None) -> NamedSharding:
    """The JAX `NamedSharding` equal to a meshcomm Layout.

    Raises ValueError for what JAX cannot express: Blocks, pending sums (partial), uneven
    splits (when `shape` is given), or device ids that are not JAX devices.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"sharding_from_layout needs a meshcomm.Layout, got {type(layout).__name__}")
    why = expressible(layout, shape)
    if why is not None:
        raise ValueError(f"JAX cannot express layout {layout}: {why}")
    table = _device_table()
    devs = np.vectorize(lambda i: table[int(i)], otypes=[object])(layout.mesh.devices)
    jmesh = jax.sharding.Mesh(devs, layout.mesh.axis_names)
    spec = []
    for e in layout.spec:
        if e is None:
            spec.append(None)
        elif len(e) == 1:
            spec.append(e[0])
        else:
            spec.append(tuple(e))
    return NamedSharding(jmesh, PartitionSpec(*spec))


def _local_shards(x) -> dict[int, Any]:
    pos = _positions()
    return {pos[s.device]: s.data for s in x.addressable_shards}


def _owned_devices(layouts) -> set[int] | None:
    """Device ids (of these layouts) this process owns under meshcomm's runtime, or None."""
    from .. import runtime
    ctx = runtime.current()
    if ctx is None:
        return None
    out = set()
    for lay in layouts:
        out.update(ctx.owned_devices(lay))
    return out


def _prepare(x, dst):
    """(src layout, dst layout, dst sharding, this process's shards, shape), validated."""
    if not isinstance(x, jax.Array):
        raise TypeError(f"reshard_jax needs a jax.Array, got {type(x).__name__}")
    if isinstance(x, jax.core.Tracer):
        raise TypeError("reshard_jax moves concrete arrays between processes and cannot be traced: "
                        "call it outside jax.jit (inside, jax.lax.with_sharding_constraint)")
    src_sharding = x.sharding
    if isinstance(src_sharding, jax.sharding.SingleDeviceSharding):
        (d,) = tuple(src_sharding.device_set)
        src = Layout(Mesh([meshcomm_id(d)], ("_single",)), ())
    elif isinstance(src_sharding, NamedSharding):
        src = layout_from_sharding(src_sharding, x.shape)
    else:
        raise TypeError(f"reshard_jax needs x with a NamedSharding (or a single device), got "
                        f"{type(src_sharding).__name__}")
    shape = tuple(x.shape)
    if isinstance(dst, NamedSharding):
        dst_sharding = dst
        dst_layout = layout_from_sharding(dst, shape)
    elif isinstance(dst, Layout):
        dst_layout = dst
        dst_layout.check_shape(shape)
        dst_sharding = None if expressible(dst, shape) else sharding_from_layout(dst, shape)
        table = _device_table()
        missing = [d for d in dst.mesh.device_ids if d not in table]
        if missing:
            raise ValueError(f"dst layout device(s) {missing[:8]} are not JAX devices")
    else:
        raise TypeError(f"dst must be a NamedSharding or a meshcomm.Layout, got {type(dst).__name__}")

    shards = _local_shards(x)
    owned = _owned_devices((src, dst_layout))
    if owned is not None:
        extra = [d for d in shards if d not in owned]
        if extra:
            raise ValueError(f"this process addresses JAX device(s) {sorted(extra)} (meshcomm ids) "
                             f"that meshcomm's runtime gives to other ranks (device d belongs to rank "
                             f"d // devices_per_process); it owns {sorted(owned)}")
        dst_addressable = {meshcomm_id(d) for d in getattr(dst_sharding, "addressable_devices", ())} \
            if dst_sharding is not None else None
        mine_dst = {d for d in dst_layout.mesh.device_ids if d in owned}
        if dst_addressable is not None and dst_addressable != mine_dst:
            raise ValueError(f"this process addresses dst device(s) {sorted(dst_addressable)} but "
                             f"meshcomm gives it {sorted(mine_dst)}; JAX processes and meshcomm ranks "
                             "must agree (process p = rank p, devices_per_process = local devices)")
    return src, dst_layout, dst_sharding, shards, shape


def reshard_jax(x, dst, *, backend: str | None = None, async_op: bool = False):
    """Reshard `x` (a jax.Array with a NamedSharding, or a pytree of them) to `dst`: a
    `NamedSharding` or a meshcomm `Layout` (for a pytree, a tree of them as `jax.device_put`
    takes). Returns a jax.Array with sharding `dst` (or `sharding_from_layout(dst)`), or where
    JAX cannot express the Layout a dict {device id: jax.Array} of this process's tiles; a
    pytree comes back with the same structure, every leaf moved in one batch.

    Under a launcher every process calls it with its own array (tree of the same structure);
    meshcomm device d belongs to rank d // devices_per_process, and the JAX devices a process
    addresses must be the ones meshcomm gives it."""
    if isinstance(x, jax.Array) and isinstance(dst, _TARGETS):
        return _reshard_one(x, dst, backend, async_op)
    if isinstance(x, _HOST):        # a bare host value is not resharded (jax.device_put places it)
        from ..runtime.program import checking
        with checking("reshard"):               # the other ranks raise too, naming this one
            raise TypeError(f"reshard_jax needs a jax.Array or a pytree of them, got {type(x).__name__}")
    return _reshard_tree(x, dst, backend, async_op)


def _reshard_one(x, dst, backend, async_op):
    """One jax.Array to one NamedSharding or Layout."""
    from .. import api, runtime
    from ..runtime.program import checking
    with checking("reshard"):                   # the other ranks raise too, naming this one
        src, dst_layout, dst_sharding, shards, shape = _prepare(x, dst)
    finish = functools.partial(_assemble, shape=shape, dtype=x.dtype, dst=dst_layout, dst_sharding=dst_sharding)
    if runtime.current() is None:
        runtime.no_context(backend, "reshard_jax")
        # One process: JAX tiles in, host tiles out (one copy per piece), committed in one batch
        from ..runtime.local_program import one_process
        out, _ = one_process(shards, src, dst_layout, shape, x.dtype, async_op, commit=False)
        return api.Handle(result=finish(out)) if async_op else finish(out)
    # Under a launcher they go as NumPy views (zero-copy on CPU) and come back as NumPy tiles.
    np_shards = {d: np.asarray(v) for d, v in shards.items()}
    res = api.reshard(np_shards, src, dst_layout, shape=shape, dtype=x.dtype, backend=backend,
                      async_op=async_op)
    if async_op:
        return api.Handle(lambda: finish(res.wait()), future=res)
    return finish(res)


def _assemble(out, *, shape, dtype, dst, dst_sharding):
    """meshcomm's tiles -> one jax.Array with `dst_sharding` (or, without one, a dict of
    committed single-device arrays). Host tiles for a NamedSharding go in one batched
    transfer (`jax.make_array_from_callback`); JAX adopts aligned host memory on CPU."""
    if out is None:
        out = {}
    if dst_sharding is not None and out and not any(isinstance(v, jax.Array) for v in out.values()):
        mine = {meshcomm_id(d) for d in dst_sharding.addressable_devices}
        if mine - set(out):
            raise ValueError(f"dst device(s) {sorted(mine - set(out))[:8]} are addressable by this process "
                             "but meshcomm did not give them a tile (device ownership differs between JAX "
                             "and meshcomm)")
        boxes = dst.tiles(shape).boxes
        by_index = {tuple(boxes[d]): v for d, v in out.items()}

        def tile(index):
            key = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
            return by_index[key]
        return jax.make_array_from_callback(shape, dst_sharding, tile, dtype=dtype)
    tiles = {}
    put = {}
    for d, v in out.items():
        dev = jax_device_by_id(d)
        if isinstance(v, jax.Array) and v.devices() == {dev}:
            tiles[d] = v
        else:
            put[d] = (np.asarray(v), dev)
    if put:
        keys = list(put)
        tiles.update(zip(keys, jax.device_put([put[d][0] for d in keys], [put[d][1] for d in keys])))
    if dst_sharding is None:
        return tiles
    arrays = []
    for dev in _addressable_in_order(dst_sharding):
        i = meshcomm_id(dev)
        if i not in tiles:
            raise ValueError(f"dst device {i} is addressable by this process but meshcomm did "
                             "not give it a tile (device ownership differs between JAX and meshcomm)")
        arrays.append(tiles[i])
    return jax.make_array_from_single_device_arrays(shape, dst_sharding, arrays, dtype=dtype)


def _addressable_in_order(sharding: NamedSharding):
    addressable = sharding.addressable_devices
    return [d for d in sharding.mesh.devices.flat if d in addressable]


# -- pytrees: every leaf in one batch -----------------------------------------------------------

def _flatten(x, dst) -> tuple[list, list, list, Any]:
    """(leaf names, leaves, their targets, rebuild(new leaves) -> tree): `dst` is one target,
    or a tree of targets matching `x` or a prefix of it (jax.device_put's rule)."""
    tu, is_t = jax.tree_util, (lambda v: v is None or isinstance(v, _TARGETS))
    t_paths, t_def = tu.tree_flatten_with_path(dst, is_leaf=is_t)
    for path, t in t_paths:
        if not is_t(t):
            raise TypeError(f"target of leaf {tu.keystr(path)}: a NamedSharding, a meshcomm.Layout or None, "
                            f"got {type(t).__name__}")
    try:
        subs = t_def.flatten_up_to(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the shardings tree does not match the tree of arrays (it must be the same tree or "
                         f"a prefix of it, as jax.device_put takes): {e}") from None
    names, leaves, targets, defs = [], [], [], []
    for (tpath, t), sub in zip(t_paths, subs):
        sub_paths, sub_def = tu.tree_flatten_with_path(sub)
        defs.append((sub_def, len(sub_paths)))
        names += [tu.keystr(tuple(tpath) + tuple(p)) or "<root>" for p, _ in sub_paths]
        leaves += [leaf for _, leaf in sub_paths]
        targets += [t] * len(sub_paths)

    starts = np.cumsum([0] + [n for _, n in defs]).tolist()

    def rebuild(new):
        return tu.tree_unflatten(t_def, [tu.tree_unflatten(d, new[i:i + n]) for (d, n), i in zip(defs, starts)])
    return names, leaves, targets, rebuild


def _host_leaf(leaf, dst):
    """A host value placed on `dst` as jax.device_put places it (this process's part)."""
    arr = np.asarray(leaf)
    arr = arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)
    if isinstance(dst, NamedSharding):
        layout_from_sharding(dst, arr.shape)                # validates, naming what is wrong
    else:
        dst = sharding_from_layout(dst, arr.shape)
    return jax.make_array_from_callback(arr.shape, dst, lambda idx: arr[idx], dtype=arr.dtype)


def _reshard_tree(x, dst, backend, async_op):
    """Every jax.Array leaf of the pytree `x` to its target, as one batch."""
    from .. import api, runtime
    from ..runtime.program import checking
    moved = {}          # name -> (leaf index, src, dst layout, dst sharding, shards, shape, dtype)
    with checking("reshard_many"):              # the other ranks raise too, naming this one
        names, leaves, targets, rebuild = _flatten(x, dst)
        out = list(leaves)
        for i, (name, leaf, t) in enumerate(zip(names, leaves, targets)):
            try:
                if t is not None and isinstance(leaf, jax.Array):
                    moved[name] = (i, *_prepare(leaf, t), leaf.dtype)
                elif t is not None and isinstance(leaf, _HOST):
                    out[i] = _host_leaf(leaf, t)
                elif t is not None:
                    raise TypeError(f"{type(leaf).__name__} is not a jax.Array or a host array (jax.device_put "
                                    "refuses it too)")
            except (ValueError, TypeError) as e:
                raise type(e)(f"leaf {name}: {e}") from None

    def finish(results):
        for name, (i, _, lay, sharding, _, shape, dtype) in moved.items():
            try:
                out[i] = _assemble(results.get(name), shape=shape, dtype=dtype, dst=lay, dst_sharding=sharding)
            except ValueError as e:
                raise ValueError(f"leaf {name}: {e}") from None
        return rebuild(out)

    if runtime.current() is None:
        runtime.no_context(backend, "reshard_jax")
        from ..runtime.local_program import one_process
        results = {}
        for name, (_, src, lay, _, shards, shape, dtype) in moved.items():
            try:
                results[name] = one_process(shards, src, lay, shape, dtype, commit=False)[0]
            except (ValueError, TypeError) as e:
                raise type(e)(f"leaf {name}: {e}") from None
        return api.Handle(result=finish(results)) if async_op else finish(results)
    if not moved:
        return api.Handle(result=rebuild(out)) if async_op else rebuild(out)
    res = api.reshard_many({n: {d: np.asarray(v) for d, v in m[4].items()} for n, m in moved.items()},
                           {n: m[1] for n, m in moved.items()}, {n: m[2] for n, m in moved.items()},
                           shapes={n: m[5] for n, m in moved.items()}, dtypes={n: m[6] for n, m in moved.items()},
                           backend=backend, async_op=async_op)
    return api.Handle(lambda: finish(res.wait()), future=res) if async_op else finish(res)
