"""Seeded random resharding cases, the same on every process (used by the worker scripts).

`random_case(rng, ndev)` -> (shape, src, dst, dtype name, array kind): meshes of 1..3 axes
over device ids < ndev (disjoint, overlapping or the same device sets, permuted), specs
with plain, tuple (major-minor) and Blocks (zero-size blocks allowed) splits, pending sums,
and NumPy or torch data of many dtypes (bfloat16 and float16 included).
"""
from __future__ import annotations

import numpy as np

import meshcomm as mc
from meshcomm.arrays import is_torch, numpy_dtype

NP_DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16", "uint8", "int8", "bool", "int16", "uint16",
             "uint32", "uint64"]
TORCH_DTYPES = ["float32", "bfloat16", "int64", "float16", "int32", "int16"]
AXES = ("x", "y", "z")


def _mesh_shape(rng, n):
    ndim = int(rng.integers(1, 4))
    shape = []
    left = n
    for _ in range(ndim):
        hi = min(4, left)
        if hi < 1:
            break
        s = int(rng.integers(1, hi + 1))
        shape.append(s)
        left //= s
    return tuple(shape) or (1,)


def random_mesh(rng, ids_pool):
    shape = _mesh_shape(rng, len(ids_pool))
    k = int(np.prod(shape))
    ids = rng.choice(np.array(ids_pool), size=k, replace=False)
    return mc.Mesh(ids.reshape(shape), AXES[:len(shape)])


def _blocks(rng, n, k):
    cuts = np.sort(rng.integers(0, n + 1, size=k - 1)) if k > 1 else np.array([], dtype=int)
    edges = np.concatenate([[0], cuts, [n]])
    return [int(b - a) for a, b in zip(edges[:-1], edges[1:])]


def random_layout(rng, mesh, shape, partial_ok=True):
    spec = [[] for _ in shape]
    partial = []
    blocks_dims = set()
    for a in mesh.axis_names:
        r = rng.random()
        if r < 0.2:
            continue                                    # replica axis
        if r < 0.32 and partial_ok:
            partial.append(a)
            continue
        if shape:
            spec[int(rng.integers(0, len(shape)))].append(a)
    out = []
    for dim, axes in enumerate(spec):
        if not axes:
            out.append(None)
        elif rng.random() < 0.3:
            k = int(np.prod([mesh.axis_size(a) for a in axes]))
            out.append(mc.Blocks(tuple(axes), _blocks(rng, shape[dim], k)))
            blocks_dims.add(dim)
        else:
            out.append(tuple(axes) if len(axes) > 1 else axes[0])
    return mc.Layout(mesh, tuple(out), partial=tuple(partial))


def random_case(rng, ndev, max_size=9):
    tndim = int(rng.integers(1, 4))
    shape = tuple(int(s) for s in rng.integers(1, max_size + 1, size=tndim))
    if rng.random() < 0.05:
        shape = shape[:-1] + (0,)
    elif rng.random() < 0.05:
        shape = ()                                      # a 0-d tensor: every layout replicates it
    pool = list(range(ndev))
    src_mesh = random_mesh(rng, pool)
    mode = rng.choice(["disjoint", "overlapping", "same"])
    if mode == "same":
        dst_mesh = mc.Mesh(rng.permutation(src_mesh.devices.reshape(-1)).reshape(src_mesh.shape),
                           src_mesh.axis_names)
    elif mode == "disjoint" and len(set(pool) - set(src_mesh.device_ids)) >= 1:
        dst_mesh = random_mesh(rng, sorted(set(pool) - set(src_mesh.device_ids)))
    else:
        dst_mesh = random_mesh(rng, pool)
    kind = "torch" if rng.random() < 0.35 else "numpy"
    dtype = str(rng.choice(TORCH_DTYPES if kind == "torch" else NP_DTYPES))
    partial_ok = dtype != "bool"
    src = random_layout(rng, src_mesh, shape, partial_ok)
    dst = random_layout(rng, dst_mesh, shape, partial_ok)
    return shape, src, dst, dtype, kind


def random_data(rng, shape, dtype, kind):
    dt = numpy_dtype(dtype)
    if dt.kind == "f" or dtype == "bfloat16":
        x = rng.standard_normal(shape).astype(np.float32).astype(dt)
    elif dt.kind == "b":
        x = rng.random(shape) < 0.5
    else:
        info = np.iinfo(dt)
        x = rng.integers(max(info.min, -100), min(info.max, 100), size=shape).astype(dt)
    if kind == "torch":
        import torch
        if dtype == "bfloat16":
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x).reshape(shape))     # ascontiguousarray makes 0-d 1-d
    return x


def same(a, b) -> bool:
    """Equal values, same kind, dtype and shape."""
    if type(a) is not type(b) or tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if is_torch(a):
        import torch
        return bool(torch.equal(a, b))
    return bool(np.array_equal(a, b))


PARTIAL_OPS = ("prod", "min", "max")


def with_op(layout, op: str):
    """`layout` with its partial axes (if any) reducing by `op`."""
    if not layout.partial:
        return layout
    return mc.Layout(layout.mesh, layout.spec, partial=dict.fromkeys(layout.partial, op))


def random_op_case(rng, ndev, max_size=9):
    """Like `random_case`, with a pending prod/min/max src (redrawn until it has a partial
    axis: a few tries) and a dst that is plain or pending under the same op or any other
    (sum included); bool data too. Seeded shards of these ops are exact in any order."""
    shape, src, dst, dtype, kind = random_case(rng, ndev, max_size)
    for _ in range(8):
        if src.partial:
            break
        src = random_layout(rng, random_mesh(rng, list(range(ndev))), shape)
    op = str(rng.choice(PARTIAL_OPS))
    dst_op = op if rng.random() < 0.5 else str(rng.choice(PARTIAL_OPS + ("sum",)))
    if kind == "numpy" and rng.random() < 0.15:
        dtype = "bool"
    if dtype == "bool" and dst_op == "sum":
        dst_op = op
    return shape, with_op(src, op), with_op(dst, dst_op), dtype, kind
