"""Single-process adapter tests: JAX arrays over many CPU devices (XLA_FLAGS is set in
conftest.py), and the DTensor placement translation (no process group needed)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import meshcomm as mc

jax = pytest.importorskip("jax")
from jax.sharding import Mesh as JMesh, NamedSharding, PartitionSpec as P  # noqa: E402

from meshcomm.adapters.jax import (layout_from_sharding, reshard_jax,  # noqa: E402
                                   sharding_from_layout)

NDEV = 8
needs_devices = pytest.mark.skipif(len(jax.devices()) < NDEV,
                                   reason=f"needs {NDEV} JAX CPU devices (XLA_FLAGS in conftest.py)")

FACTORS = {1: [(1,)], 2: [(2,), (1, 2), (2, 1)], 3: [(3,)], 4: [(4,), (2, 2), (1, 4)],
           6: [(6,), (2, 3), (3, 2)], 8: [(8,), (2, 4), (4, 2), (2, 2, 2)]}


def _random_sharding(rng, pool, shape):
    """A random NamedSharding over a random subset of `pool` that divides `shape` evenly."""
    n = int(rng.choice([k for k in FACTORS if k <= len(pool)]))
    devs = list(rng.permutation(pool)[:n])
    mshape = FACTORS[n][rng.integers(len(FACTORS[n]))]
    names = ("a", "b", "c")[:len(mshape)]
    jmesh = JMesh(np.array(devs, dtype=object).reshape(mshape), names)
    spec = [None] * len(shape)
    for name, k in zip(names, mshape):
        choice = rng.integers(len(shape) + 1)
        if choice == len(shape):
            continue                      # replica axis
        used = spec[choice]
        cur = () if used is None else ((used,) if isinstance(used, str) else used)
        ways = math.prod(dict(zip(names, mshape))[a] for a in cur) * k
        if shape[choice] % ways == 0:
            new = cur + (name,)
            spec[choice] = new[0] if len(new) == 1 else new
    return NamedSharding(jmesh, P(*spec))


def _global(shape, dtype=np.float32):
    return (np.arange(math.prod(shape)) % 251).astype(dtype).reshape(shape)


def _check_array(y, want, sharding):
    assert isinstance(y, jax.Array)
    assert y.sharding == sharding
    np.testing.assert_array_equal(np.asarray(y), want)
    imap = sharding.devices_indices_map(want.shape)
    for s in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), want[imap[s.device]])
        assert s.data.devices() == {s.device}


@needs_devices
def test_layout_matches_jax_index_map():
    rng = np.random.default_rng(0)
    devs = jax.devices()[:NDEV]
    for _ in range(40):
        shape = tuple(int(s) for s in rng.choice([2, 4, 6, 8, 12], size=rng.integers(1, 4)))
        s = _random_sharding(rng, devs, shape)
        lay = layout_from_sharding(s, shape)
        jmap = {d.id: idx for d, idx in s.devices_indices_map(shape).items()}
        mmap = lay.index_map(shape)
        assert set(jmap) == set(mmap)
        for d, idx in jmap.items():
            want = tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape))
            got = tuple((sl.start, sl.stop) for sl in mmap[d])
            assert got == want, (s, d)
        assert sharding_from_layout(lay, shape).is_equivalent_to(s, len(shape))


@needs_devices
def test_reshard_random_named_shardings():
    rng = np.random.default_rng(1)
    devs = jax.devices()[:NDEV]
    for i in range(30):
        shape = tuple(int(s) for s in rng.choice([2, 4, 6, 8, 12], size=rng.integers(1, 4)))
        want = _global(shape, np.float32 if i % 2 else np.int32)
        s1 = _random_sharding(rng, devs, shape)
        s2 = _random_sharding(rng, devs, shape)
        x = jax.device_put(want, s1)
        y = reshard_jax(x, s2)
        _check_array(y, want, s2)


@needs_devices
def test_disjoint_and_different_device_counts():
    devs = jax.devices()[:NDEV]
    shape = (12, 8)
    want = _global(shape)
    s1 = NamedSharding(JMesh(np.array(devs[:4], dtype=object).reshape(2, 2), ("x", "y")), P("x", "y"))
    cases = [
        NamedSharding(JMesh(np.array(devs[4:], dtype=object).reshape(2, 2), ("x", "y")), P("y", "x")),
        NamedSharding(JMesh(np.array(devs[5:8], dtype=object), ("z",)), P("z")),
        NamedSharding(JMesh(np.array(devs[2:8], dtype=object).reshape(3, 2), ("p", "q")), P("p", None)),
        NamedSharding(JMesh(np.array([devs[7]], dtype=object), ("one",)), P()),
    ]
    x = jax.device_put(want, s1)
    for s2 in cases:
        _check_array(reshard_jax(x, s2), want, s2)
    h = reshard_jax(x, cases[0], async_op=True)
    assert isinstance(h, mc.Handle)
    _check_array(h.wait(), want, cases[0])


@needs_devices
def test_to_layout_expressible_and_not():
    devs = jax.devices()[:NDEV]
    shape = (10, 6)
    want = _global(shape)
    s1 = NamedSharding(JMesh(np.array(devs[:4], dtype=object).reshape(4), ("x",)), P(None, None))
    x = jax.device_put(want, s1)
    m = mc.Mesh([[4, 5], [6, 7]], ("a", "b"))
    # expressible: a jax.Array with the equivalent NamedSharding comes back
    lay = mc.Layout(m, ("a", "b"))
    y = reshard_jax(x, lay)
    _check_array(y, want, sharding_from_layout(lay, shape))
    # not expressible: Blocks, uneven chunks -> dict of committed single-device arrays
    for lay in [mc.Layout(m, (mc.Blocks("a", [7, 3]), "b")),
                mc.Layout(m, (("a", "b"), None)),                  # 10 split 4 ways
                mc.Layout(mc.Mesh([1, 3, 5, 7], "x"), (None, "x"))]:  # 6 split 4 ways
        out = reshard_jax(x, lay)
        assert isinstance(out, dict) and set(out) == set(lay.mesh.device_ids)
        ref = mc.shard(want, lay)
        for d, v in out.items():
            assert isinstance(v, jax.Array) and v.devices() == {devs[d]}
            np.testing.assert_array_equal(np.asarray(v), ref[d])
        # ... and from that layout back to a NamedSharding
        back = NamedSharding(JMesh(np.array(devs[:2], dtype=object), ("k",)), P("k"))
        z = mc.reshard({d: np.asarray(v) for d, v in out.items()}, lay,
                       layout_from_sharding(back, shape))
        np.testing.assert_array_equal(mc.unshard(z, layout_from_sharding(back, shape)), want)


@needs_devices
def test_partial_unreduced_and_dtypes():
    devs = jax.devices()[:NDEV]
    shape = (4, 8)
    m = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    src = mc.Layout(m, (None, "y"), partial=("x",))
    dst = NamedSharding(JMesh(np.array(devs[4:8], dtype=object), ("z",)), P(None, "z"))
    for dt in (np.float32, np.int16, np.float16, jax.numpy.bfloat16):
        dt = np.dtype(dt)
        want = _global(shape, dt)
        tiles = mc.shard(want, src, seed=3)
        z = mc.reshard(tiles, src, layout_from_sharding(dst, shape))
        arrs = [jax.device_put(z[d.id], d) for d in dst.mesh.devices.flat]
        x = jax.make_array_from_single_device_arrays(shape, dst, arrs)
        y = reshard_jax(x, NamedSharding(JMesh(np.array(devs[:3], dtype=object), ("w",)), P()))
        assert y.dtype == dt
        np.testing.assert_allclose(np.asarray(y, dtype=np.float64), want.astype(np.float64),
                                   rtol=1e-2 if dt.itemsize == 2 else 1e-6)


@needs_devices
def test_errors_name_the_problem():
    devs = jax.devices()[:NDEV]
    m = mc.Mesh([0, 1, 2, 3], "x")
    with pytest.raises(ValueError, match="Blocks"):
        sharding_from_layout(mc.Layout(m, (mc.Blocks("x", [1, 1, 1, 1]),)))
    with pytest.raises(ValueError, match="partial"):
        sharding_from_layout(mc.Layout(m, (None,), partial=("x",)))
    with pytest.raises(ValueError, match="dimension 0 of size 6 is split 4 ways"):
        sharding_from_layout(mc.Layout(m, ("x",)), shape=(6,))
    with pytest.raises(ValueError, match="device.*10000"):
        sharding_from_layout(mc.Layout(mc.Mesh([0, 10000], "x"), ("x",)))
    with pytest.raises(TypeError, match="NamedSharding"):
        layout_from_sharding("nope")
    with pytest.raises(TypeError, match="jax.Array"):
        reshard_jax(np.zeros(4), NamedSharding(JMesh(np.array(devs[:2], dtype=object), ("k",)), P()))
    x = jax.device_put(np.zeros((4,)), NamedSharding(JMesh(np.array(devs[:2], dtype=object), ("k",)), P("k")))
    with pytest.raises(ValueError, match="not JAX devices"):
        reshard_jax(x, mc.Layout(mc.Mesh([0, 99999], "x"), ("x",)))
    # a spec longer than the array (JAX refuses it too), and a tracer inside jax.jit
    with pytest.raises(ValueError, match=r"has 2 entries but the tensor has 1 dimension"):
        reshard_jax(x, NamedSharding(JMesh(np.array(devs[4:8], dtype=object), ("a",)), P("a", None)))
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda a: reshard_jax(a, x.sharding))(x)


@needs_devices
def test_an_explicit_mesh_source_with_unreduced_axes_is_a_pending_sum():
    devs = jax.devices()[:NDEV]
    m = JMesh(np.array(devs[:4], dtype=object), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    s = NamedSharding(m, P(None, None, unreduced={"x"}))
    x = jax.make_array_from_single_device_arrays(
        (8, 6), s, [jax.device_put(np.full((8, 6), i + 1, np.float32), devs[i]) for i in range(4)])
    y = reshard_jax(x, NamedSharding(JMesh(np.array(devs[4:8], dtype=object), ("a",)), P("a")))
    np.testing.assert_array_equal(np.asarray(y), np.full((8, 6), 10, np.float32))


@needs_devices
def test_single_device_source():
    want = _global((6, 4))
    x = jax.device_put(want, jax.devices()[3])
    s2 = NamedSharding(JMesh(np.array(jax.devices()[:6], dtype=object).reshape(3, 2), ("x", "y")), P("x", "y"))
    _check_array(reshard_jax(x, s2), want, s2)


@needs_devices
def test_reshard_pytree_of_arrays():
    """A tree of jax.Arrays (dicts, lists, tuples, None) with a matching tree of targets, a
    prefix of it, or one target for all; host leaves placed as jax.device_put places them;
    None targets leave their subtree alone; Layouts JAX cannot express give dicts."""
    devs = jax.devices()[:NDEV]
    rng = np.random.default_rng(3)
    a = NamedSharding(JMesh(np.array(devs[:4], dtype=object).reshape(2, 2), ("x", "y")), P("x", "y"))
    b = NamedSharding(JMesh(np.array(devs[4:], dtype=object), ("z",)), P("z"))
    c = NamedSharding(JMesh(np.array(devs[2:8], dtype=object).reshape(3, 2), ("p", "q")), P(None, "q"))
    want = {"w": _global((8, 6)), "layers": [{"k": _global((4, 12), np.int32), "v": _global((12,))},
                                             {"k": _global((4, 12), np.int32), "v": _global((12,), np.float16)}],
            "pair": (_global((6, 2)), None)}
    for _ in range(10):
        s1 = {"w": _random_sharding(rng, devs, (8, 6)),
              "layers": [{"k": _random_sharding(rng, devs, (4, 12)), "v": _random_sharding(rng, devs, (12,))}
                         for _ in range(2)],
              "pair": (_random_sharding(rng, devs, (6, 2)), None)}
        s2 = jax.tree_util.tree_map(lambda g: _random_sharding(rng, devs, g.shape), want)
        x = jax.device_put(want, s1)
        y = reshard_jax(x, s2)
        assert jax.tree_util.tree_structure(y) == jax.tree_util.tree_structure(want)
        jax.tree_util.tree_map(_check_array, y, want, s2)
    x = jax.device_put(want, jax.tree_util.tree_map(lambda g: NamedSharding(a.mesh, P()), want))
    # one target for every leaf, and a prefix tree
    one = NamedSharding(b.mesh, P())
    jax.tree_util.tree_map(lambda v, g: _check_array(v, g, one), reshard_jax(x, one), want)
    y = reshard_jax(x, {"w": a, "layers": NamedSharding(c.mesh, P()), "pair": None})
    _check_array(y["w"], want["w"], a)
    for layer, ref in zip(y["layers"], want["layers"]):
        for k in ("k", "v"):
            _check_array(layer[k], ref[k], NamedSharding(c.mesh, P()))
    assert y["pair"][0] is x["pair"][0] and y["pair"][1] is None
    # Layout targets: expressible -> jax.Array, not -> {device: jax.Array}; asynchronously
    lay = mc.Layout(mc.Mesh([1, 3, 5], "r"), ("r", None))          # 8 rows over 3: uneven
    h = reshard_jax({"w": x["w"], "k": x["layers"][0]["k"]},
                    {"w": lay, "k": mc.Layout(mc.Mesh([0, 7], "r"), (None, "r"))}, async_op=True)
    assert isinstance(h, mc.Handle)
    y = h.wait()
    assert isinstance(y["w"], dict) and set(y["w"]) == {1, 3, 5}
    for d, v in y["w"].items():
        assert v.devices() == {devs[d]}
        np.testing.assert_array_equal(np.asarray(v), mc.shard(want["w"], lay)[d])
    _check_array(y["k"], want["layers"][0]["k"],
                 sharding_from_layout(mc.Layout(mc.Mesh([0, 7], "r"), (None, "r")), (4, 12)))
    # host leaves: placed like jax.device_put
    y = reshard_jax({"n": np.arange(8.0), "s": 2.0, "j": x["w"]}, {"n": b, "s": one, "j": c})
    np.testing.assert_array_equal(np.asarray(y["n"]), np.arange(8.0))
    assert y["n"].sharding == b and y["s"].sharding == one and float(y["s"]) == 2.0
    _check_array(y["j"], want["w"], c)


@needs_devices
def test_reshard_pytree_errors_name_the_leaf():
    devs = jax.devices()[:NDEV]
    s = NamedSharding(JMesh(np.array(devs[:4], dtype=object), ("z",)), P("z"))
    x = {"a": jax.device_put(np.zeros((8, 4)), s), "b": [jax.device_put(np.zeros((4,)), s)]}
    with pytest.raises(ValueError, match=r"leaf \['b'\]\[0\].*dimension 0 of size 4 is split 3 ways"):
        reshard_jax(x, {"a": s, "b": [NamedSharding(JMesh(np.array(devs[:3], dtype=object), ("k",)), P("k"))]})
    with pytest.raises(ValueError, match=r"leaf \['b'\]\[0\]: .*2 entries but the tensor has 1"):
        reshard_jax(x, NamedSharding(s.mesh, P(None, "z")))
    with pytest.raises(ValueError, match="does not match the tree of arrays.*prefix"):
        reshard_jax(x, {"a": s, "c": None})
    with pytest.raises(TypeError, match=r"target of leaf \['a'\].*got str"):
        reshard_jax(x, {"a": "P(z)", "b": None})
    with pytest.raises(TypeError, match=r"leaf \['c'\]: str is not a jax.Array"):
        reshard_jax({"c": "text"}, s)
    with pytest.raises(ValueError, match=r"leaf \['a'\].*not JAX devices"):
        reshard_jax({"a": x["a"]}, mc.Layout(mc.Mesh([0, 99999], "x"), ("x",)))
    # nothing moved: a tree of Nones and an empty tree come back as they are
    assert reshard_jax({"a": None}, s) == {"a": None}
    assert reshard_jax([], s) == []


def test_adapters_import_lazily():
    import subprocess
    import sys
    code = ("import sys, meshcomm, meshcomm.adapters as A; "
            "assert 'jax' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules); "
            "A.reshard_jax; assert 'jax' in sys.modules; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# -- DTensor placements <-> Layout (no process group needed) ------------------------------

def _dtensor_local(full, ranks, placements, coord):
    """What DTensor puts on the rank at `coord`: nested torch.chunk in mesh-dim order."""
    import torch
    from torch.distributed.tensor import Shard
    t = full
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            parts = torch.chunk(t, ranks.shape[mdim], dim=p.dim)
            i = coord[mdim]
            if i < len(parts):
                t = parts[i]
            else:
                shp = list(t.shape)
                shp[p.dim] = 0
                t = t.new_empty(shp)
    return t


def test_layout_from_placements_matches_nested_chunk():
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import Partial, Replicate, Shard
    from meshcomm.adapters.dtensor import layout_from_placements, placements_from_layout
    rng = np.random.default_rng(5)
    kinds = [lambda d: Shard(d), lambda d: Replicate(), lambda d: Partial()]
    n_blocks = 0
    for _ in range(200):
        mshape = [(2,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2)][rng.integers(6)]
        ranks = rng.permutation(16)[:math.prod(mshape)].reshape(mshape)
        shape = tuple(int(s) for s in rng.integers(0, 8, size=rng.integers(1, 4)))
        placements = [kinds[rng.integers(3)](int(rng.integers(len(shape)))) for _ in mshape]
        lay = layout_from_placements(ranks, placements, shape)
        n_blocks += any(isinstance(e, mc.Blocks) for e in lay.spec)
        full = torch.arange(math.prod(shape)).reshape(shape)
        imap = lay.index_map(shape)
        for coord in np.ndindex(*mshape):
            want = _dtensor_local(full, ranks, placements, coord)
            got = full[imap[int(ranks[coord])]]
            assert tuple(got.shape) == tuple(want.shape) and torch.equal(got, want), \
                (mshape, shape, placements, coord)
        if not any(isinstance(e, mc.Blocks) for e in lay.spec):
            back = placements_from_layout(lay)
            assert [type(p) for p in back] == [type(p) for p in placements]
    assert n_blocks > 0       # uneven nested splits were exercised


def test_placement_errors():
    pytest.importorskip("torch")
    from torch.distributed.tensor import Partial, Shard
    from meshcomm.adapters.dtensor import layout_from_placements, placements_from_layout
    with pytest.raises(ValueError, match="2 placement"):
        layout_from_placements(np.arange(4), [Shard(0), Shard(0)], (4,))
    with pytest.raises(ValueError, match="Shard\\(dim=3\\)|tensor has 2"):
        layout_from_placements(np.arange(4), [Shard(3)], (4, 4))
    with pytest.raises(ValueError, match="Partial"):
        layout_from_placements(np.arange(4), [Partial("max")], (4,))
    with pytest.raises(ValueError, match="Blocks"):
        placements_from_layout(mc.Layout(mc.Mesh([0, 1], "x"), (mc.Blocks("x", [1, 2]),)))
