"""Hypothesis strategies for random meshes, layouts and resharding problems.

Shared by the test modules (import as ``from strategies import ...``; ``tests/`` is on
``sys.path`` because pytest puts each test file's folder there). Every strategy draws small
problems so that planning, verifying and running them in one process stays fast.

* ``device_ids(n, pool=32)``      n distinct non-negative ids, often non-consecutive
* ``mesh_shapes(max_devices=16, max_ndim=3)`` a mesh shape, axis sizes mostly 2..4
* ``meshes(max_devices=16, ...)`` a Mesh of 1..3 axes (more with ``max_ndim``)
* ``shapes(ndim, max_size=9)``    a tensor shape, sizes 0..max_size (0 and 1 included)
* ``layouts(mesh, shape, ...)``   a Layout for one tensor over one mesh: each mesh axis is
                                  unused (a replica), splits a dimension (alone or in a tuple,
                                  major to minor, or through Blocks with zero-size blocks
                                  allowed), or is a pending-sum axis
* ``layouts_pair(max_devices=16, ...)`` -> (shape, src, dst): two layouts of one tensor on
                                  meshes whose device sets are disjoint, overlapping or
                                  identical (often permuted)

Example::

    from hypothesis import given
    from strategies import layouts_pair

    @given(layouts_pair(max_devices=8, partial=False))
    def test_something(case):
        shape, src, dst = case
        ...
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

import meshcomm as mc

__all__ = ["device_ids", "mesh_shapes", "meshes", "shapes", "blocks_sizes", "layouts", "layouts_pair",
           "AXIS_NAME_SETS"]

# Axis names are drawn from these sets (one name per mesh dimension, in order).
AXIS_NAME_SETS = (("x", "y", "z", "w"), ("a", "b", "c", "d"), ("dp", "tp", "pp", "ep"))


@st.composite
def device_ids(draw, n: int, pool: int = 32, start_max: int = 64) -> list[int]:
    """n distinct device ids: consecutive from a random start, a shuffled range, or sparse."""
    style = draw(st.sampled_from(["consecutive", "permuted", "sparse"]))
    if style == "consecutive":
        start = draw(st.integers(0, start_max))
        return list(range(start, start + n))
    if style == "permuted":
        start = draw(st.integers(0, start_max))
        return draw(st.permutations(list(range(start, start + n))))
    pool = max(pool, n)
    return draw(st.lists(st.integers(0, pool + start_max), min_size=n, max_size=n, unique=True))


@st.composite
def mesh_shapes(draw, max_devices: int = 16, max_ndim: int = 3) -> tuple[int, ...]:
    """A mesh shape of 1..max_ndim axes, sizes mostly 2..4 (1 sometimes), product <= max_devices."""
    ndim = draw(st.integers(1, max_ndim))
    shape = []
    left = max_devices
    for _ in range(ndim):
        hi = max(1, min(4, left))
        s = 1 if hi == 1 or draw(st.integers(0, 5)) == 0 else draw(st.integers(2, hi))
        shape.append(s)
        left //= s
    return tuple(shape)


@st.composite
def meshes(draw, max_devices: int = 16, max_ndim: int = 3, ids: list[int] | None = None) -> mc.Mesh:
    """A random mesh; `ids` (if given) are the devices to use, in order."""
    shape = draw(mesh_shapes(max_devices, max_ndim))
    n = math.prod(shape)
    if ids is None:
        ids = draw(device_ids(n))
    names = draw(st.sampled_from(AXIS_NAME_SETS))[:len(shape)]
    if len(names) < len(shape):
        names = tuple(f"a{i}" for i in range(len(shape)))
    return mc.Mesh(np.array(ids[:n]).reshape(shape), names)


@st.composite
def shapes(draw, ndim: int, max_size: int = 9) -> tuple[int, ...]:
    """A tensor shape of rank `ndim`; each size is 0 or 1 now and then, else 2..max_size."""
    out = []
    for _ in range(ndim):
        r = draw(st.integers(0, 15))
        out.append(0 if r == 0 else 1 if r == 1 else draw(st.integers(2, max_size)))
    return tuple(out)


@st.composite
def blocks_sizes(draw, n: int, k: int) -> list[int]:
    """k non-negative ints summing to n (zero-size blocks included)."""
    if k == 1:
        return [n]
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=k - 1, max_size=k - 1)))
    bounds = [0] + cuts + [n]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


@st.composite
def layouts(draw, mesh: mc.Mesh, shape: tuple[int, ...], partial: bool = True,
            blocks: bool = True, allow_short_spec: bool = True) -> mc.Layout:
    """A random valid Layout of a `shape` tensor over `mesh`."""
    ndim = len(shape)
    per_dim: list[list[str]] = [[] for _ in range(ndim)]
    partial_axes = []
    for a in draw(st.permutations(list(mesh.axis_names))):
        choices = ["replica"] + (["dim", "dim"] if ndim else []) + (["partial"] if partial else [])
        what = draw(st.sampled_from(choices))
        if what == "dim":
            per_dim[draw(st.integers(0, ndim - 1))].append(a)
        elif what == "partial":
            partial_axes.append(a)
    spec = []
    for dim, axes in enumerate(per_dim):
        if not axes:
            spec.append(None)
            continue
        k = math.prod(mesh.axis_size(a) for a in axes)
        if blocks and draw(st.integers(0, 3)) == 0:
            sizes = draw(blocks_sizes(shape[dim], k))
            spec.append(mc.Blocks(axes[0] if len(axes) == 1 and draw(st.booleans()) else tuple(axes), sizes))
        elif len(axes) == 1 and draw(st.booleans()):
            spec.append(axes[0])
        else:
            spec.append(tuple(axes))
    if allow_short_spec:
        while spec and spec[-1] is None and draw(st.booleans()):
            spec.pop()
    return mc.Layout(mesh, tuple(spec), partial=tuple(partial_axes))


@st.composite
def layouts_pair(draw, max_devices: int = 16, max_ndim: int = 3, max_tensor_ndim: int = 3,
                 max_size: int = 9, partial: bool = True, blocks: bool = True,
                 overlap: str | None = None, min_tensor_ndim: int = 1):
    """(shape, src, dst): one tensor, two layouts on two random meshes.

    `overlap` forces how the device sets relate: "disjoint", "overlapping", "same", or
    None for a random choice. `partial=False` keeps both layouts free of pending sums.
    `min_tensor_ndim=0` lets scalars (shape ()) in now and then.
    """
    tndim = draw(st.integers(min_tensor_ndim, max_tensor_ndim))
    shape = draw(shapes(tndim, max_size))
    src_shape = draw(mesh_shapes(max_devices, max_ndim))
    dst_shape = draw(mesh_shapes(max_devices, max_ndim))
    ns, nd = math.prod(src_shape), math.prod(dst_shape)
    mode = overlap or draw(st.sampled_from(["disjoint", "overlapping", "same"]))
    if mode == "same" and ns != nd:
        mode = "overlapping"
    src_ids = draw(device_ids(ns))
    if mode == "disjoint":
        base = max(src_ids) + 1 + draw(st.integers(0, 8))
        dst_ids = draw(device_ids(nd, start_max=0))
        dst_ids = [base + d for d in dst_ids]
        if draw(st.booleans()):     # dst ids below the src ids sometimes
            lo = min(src_ids)
            if lo >= nd:
                dst_ids = list(range(lo - nd, lo))
    elif mode == "same":
        dst_ids = draw(st.permutations(src_ids))
    else:
        extra = [max(src_ids) + 1 + i for i in range(nd)]
        pool = sorted(set(src_ids) | set(extra))
        dst_ids = draw(st.lists(st.sampled_from(pool), min_size=nd, max_size=nd, unique=True))
        if not set(dst_ids) & set(src_ids):       # make sure they do overlap
            dst_ids[0] = src_ids[0]
            if len(set(dst_ids)) != nd:
                dst_ids = [src_ids[0]] + [d for d in extra][: nd - 1]
    names_s = draw(st.sampled_from(AXIS_NAME_SETS))[:len(src_shape)]
    names_d = draw(st.sampled_from(AXIS_NAME_SETS))[:len(dst_shape)]
    src_mesh = mc.Mesh(np.array(src_ids).reshape(src_shape), names_s)
    dst_mesh = mc.Mesh(np.array(dst_ids).reshape(dst_shape), names_d)
    src = draw(layouts(src_mesh, shape, partial=partial, blocks=blocks))
    dst = draw(layouts(dst_mesh, shape, partial=partial, blocks=blocks))
    return tuple(shape), src, dst
