"""Mesh, Layout and Blocks: construction, immutability, equality, short strings, and index
maps checked against JAX's NamedSharding (even shapes) and torch.chunk (uneven shapes)."""
from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import meshcomm as mc
from strategies import AXIS_NAME_SETS, layouts, mesh_shapes, meshes, shapes


# -- Mesh ---------------------------------------------------------------------------------

def test_mesh_basics():
    m = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    assert m.shape == (2, 4)
    assert m.axis_names == ("x", "y")
    assert m.size == 8 and m.ndim == 2
    assert isinstance(m.devices, np.ndarray)
    assert m.devices.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.axis_size("y") == 4 and m.axis_index("y") == 1
    assert m.coords(6) == (1, 2)
    assert 5 in m and 8 not in m
    with pytest.raises(ValueError):
        m.devices[0, 0] = 9          # read-only view: the mesh cannot change under a layout


def test_mesh_single_axis_name_and_grid():
    m = mc.Mesh([3, 1, 2], "x")
    assert m.axis_names == ("x",) and m.shape == (3,)
    g = mc.Mesh.grid((2, 3), start=4)
    assert g.devices.tolist() == [[4, 5, 6], [7, 8, 9]]
    assert g.axis_names == ("x", "y")
    assert mc.Mesh.grid((2, 2, 2)).axis_names == ("x", "y", "z")


def test_mesh_equality_hash_pickle():
    a = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    b = mc.Mesh(np.array([[0, 1], [2, 3]]), ["x", "y"])
    c = mc.Mesh([[0, 2], [1, 3]], ("x", "y"))
    d = mc.Mesh([[0, 1], [2, 3]], ("a", "b"))
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d and a != "mesh"
    assert len({a, b, c, d}) == 3
    assert pickle.loads(pickle.dumps(a)) == a


def test_mesh_str():
    assert str(mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))) == "2x4[x,y]@0..7"
    assert str(mc.Mesh([8], "x")) == "1[x]@8"
    assert str(mc.Mesh([5, 3, 9], "d")) == "3[d]@5,3,9"
    assert "Mesh(" in repr(mc.Mesh([0, 1], "x"))


def test_meshes_may_share_devices():
    a = mc.Mesh([0, 1, 2, 3], "x")
    b = mc.Mesh([[2, 3], [4, 5]], ("x", "y"))
    src, dst = mc.Layout(a, ("x",)), mc.Layout(b, ("x", "y"))
    x = np.arange(16.0).reshape(4, 4)
    out = mc.reshard(mc.shard(x, src), src, dst)
    assert np.array_equal(mc.unshard(out, dst), x)


# -- Blocks and Layout --------------------------------------------------------------------

def test_blocks_frozen_hashable():
    b = mc.Blocks("x", [3, 5])
    assert b.axes == ("x",) and b.sizes == (3, 5)
    assert b == mc.Blocks(("x",), (3, 5)) and hash(b) == hash(mc.Blocks("x", (3, 5)))
    assert b != mc.Blocks("x", [5, 3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.sizes = (4, 4)
    assert str(b) == "B(x:3/5)"
    assert str(mc.Blocks(("x", "y"), [1, 2, 3, 4])) == "B(x,y:1/2/3/4)"


def test_layout_frozen_hashable_equal():
    m = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    a = mc.Layout(m, ("x", None))
    b = mc.Layout(mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y")), (("x",), None))
    assert a == b and hash(a) == hash(b)
    assert a != mc.Layout(m, (None, "x"))
    assert a == mc.Layout(m, ("x",))                  # a shorter spec leaves the rest replicated
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.spec = (None,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.partial = ("y",)
    p1 = mc.Layout(m, (None, "y"), partial=("x",))
    p2 = mc.Layout(m, (None, "y"), partial={"x": "sum"})
    assert p1 == p2 and hash(p1) == hash(p2) and p1.partial == ("x",)
    assert len({a, b, p1, p2}) == 2
    assert pickle.loads(pickle.dumps(p1)) == p1
    assert mc.Layout(m, "x") == a.__class__(m, ("x",))


EQUIVALENT_SPECS = [
    # (spec, partial) pairs that mean the same layout on a 2x4 mesh (x, y)
    ((("x",), ()), (("x", None), ())),
    (((), ()), ((None, None, None), ())),
    (((), ()), (((), None), ())),
    ((("x",), ()), (((("x",),)), ())),
    ((("x",), ()), ("x", ())),
    (((None, ("x", "y")), ()), ((None, ("x", "y"), None), ())),
    (((None, "y"), ("x",)), ((None, ("y",), None), {"x": "sum"})),
    (((None, "y"), ("x",)), ((None, "y"), "x")),
    (((mc.Blocks("x", [3, 5]),), ()), ((mc.Blocks(("x",), (3, 5)), None), ())),
    (((mc.Blocks("x", [3, 5]), "y"), ()), ((mc.Blocks(("x",), np.array([3, 5])), ("y",)), ())),
    (((None, "y"), {"x": "max"}), ((None, ("y",), None), {"x": "max"})),
]


@pytest.mark.parametrize("one,other", EQUIVALENT_SPECS)
def test_equivalent_layouts_are_equal(one, other):
    """Processes that write one layout differently must agree: equal, equal hashes, equal
    reprs (the runtime's agreement check hashes repr((src, dst))) and equal plan
    fingerprints, also when each plan is made afresh."""
    m = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    a, b = mc.Layout(m, one[0], partial=one[1]), mc.Layout(m, other[0], partial=other[1])
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert repr(a) == repr(b)
    assert eval(repr(a), {"Layout": mc.Layout, "Mesh": mc.Mesh, "Blocks": mc.Blocks}) == a
    assert pickle.loads(pickle.dumps(b)) == a
    dst = mc.Layout(mc.Mesh([8, 9], "z"), ("z",))
    mc.clear_caches()
    fa = mc.plan((8, 4, 2), "float32", a, dst).fingerprint
    mc.clear_caches()
    fb = mc.plan((8, 4, 2), "float32", b, dst).fingerprint
    assert fa == fb
    assert a.index_map((8, 4, 2)) == b.index_map((8, 4, 2))


def test_layouts_on_different_meshes_have_different_reprs():
    """Two 16-device meshes whose short str is the same ("4x4[x,y]@0,1,...,15") are
    different meshes: repr and plan fingerprints must tell them apart."""
    ids = list(range(16))
    ids[5], ids[6] = ids[6], ids[5]
    m1 = mc.Mesh(np.array(ids).reshape(4, 4), ("x", "y"))
    ids[5], ids[6], ids[9], ids[10] = ids[6], ids[5], ids[10], ids[9]
    m2 = mc.Mesh(np.array(ids).reshape(4, 4), ("x", "y"))
    a, b = mc.Layout(m1, ("x",)), mc.Layout(m2, ("x",))
    assert str(a) == str(b) and a != b
    assert repr(a) != repr(b)
    dst = mc.Layout(mc.Mesh([20, 21], "z"), ("z",))
    assert mc.plan((8, 8), "int32", a, dst).fingerprint != mc.plan((8, 8), "int32", b, dst).fingerprint


def test_layouts_that_differ_are_unequal():
    m = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    distinct = [mc.Layout(m, ()), mc.Layout(m, ("x",)), mc.Layout(m, (None, "x")),
                mc.Layout(m, (("x", "y"),)), mc.Layout(m, (("y", "x"),)),
                mc.Layout(m, ("x", "y")), mc.Layout(m, ("y", "x")),
                mc.Layout(m, (mc.Blocks("x", [3, 5]),)), mc.Layout(m, (mc.Blocks("x", [5, 3]),)),
                mc.Layout(m, (), partial=("x",)), mc.Layout(m, (), partial=("y",)),
                mc.Layout(m, (), partial=("x", "y")),
                mc.Layout(m, (), partial={"x": "max"}), mc.Layout(m, (), partial={"x": "min"}),
                mc.Layout(mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("a", "y")), ("a",))]
    assert len(set(distinct)) == len(distinct)
    assert len({repr(l) for l in distinct}) == len(distinct)


def test_trailing_replicated_entries_beyond_the_tensor():
    """Trailing None entries are dropped, so they may outnumber the tensor's dimensions;
    a split dimension the tensor lacks is still refused."""
    m = mc.Mesh([0, 1], "x")
    lay = mc.Layout(m, ("x", None, None))
    assert lay.spec == (("x",),)
    assert lay.index_map((4,)) == {0: (slice(0, 2),), 1: (slice(2, 4),)}
    with pytest.raises(ValueError, match=r"2 entries.*1 dimension"):
        mc.Layout(m, (None, "x", None)).index_map((4,))


def test_layout_str():
    m = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    assert str(mc.Layout(m, ("x", None))) == "2x4[x,y]@0..7 (S(x), R)"
    assert str(mc.Layout(m, (("x", "y"), None))) == "2x4[x,y]@0..7 (S(x,y), R)"
    assert str(mc.Layout(m, (mc.Blocks("x", [3, 5]), None))) == "2x4[x,y]@0..7 (B(x:3/5), R)"
    assert str(mc.Layout(m, (None, "y"), partial=("x",))) == "2x4[x,y]@0..7 (R, S(y)) P(x)"
    assert mc.Layout(m, ("x", None)).spec_str() == "(S(x), R)"


def test_layout_derived_facts():
    m = mc.Mesh(np.arange(8).reshape(2, 2, 2), ("x", "y", "z"))
    lay = mc.Layout(m, (("z", "x"),), partial=("y",))
    assert lay.used_axes == ("z", "x")
    assert lay.replica_axes == ()
    assert lay.num_addends == 2 and lay.is_partial
    assert [lay.addend_index(d) for d in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # z major, x minor: device (x, y, z) holds shard z * 2 + x
    assert [lay.shard_index(d)[0] for d in range(8)] == [0, 2, 0, 2, 1, 3, 1, 3]
    assert mc.Layout(m, ("y",)).replica_axes == ("x", "z")
    assert not mc.Layout(mc.Mesh([0, 1], "x"), (None,), partial=()).is_partial


# -- index maps ---------------------------------------------------------------------------

def _concrete(imap, layout, shape):
    assert set(imap) == set(layout.mesh.device_ids), "index_map must list every device"
    for d, idx in imap.items():
        assert len(idx) == len(shape)
        for s, n in zip(idx, shape):
            assert isinstance(s, slice) and s.step is None
            assert isinstance(s.start, int) and isinstance(s.stop, int), f"device {d}: {idx}"
            assert 0 <= s.start <= s.stop <= n


def test_index_map_concrete_with_empty_shards():
    m = mc.Mesh([0, 1, 2, 3], "x")
    imap = mc.Layout(m, ("x",)).index_map((5, 2))       # chunk 2: [0:2] [2:4] [4:5] [5:5]
    _concrete(imap, mc.Layout(m, ("x",)), (5, 2))
    assert [(s[0].start, s[0].stop) for s in (imap[d] for d in range(4))] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert all(s[1] == slice(0, 2) for s in imap.values())
    imap = mc.Layout(m, (None, "x")).index_map((3, 2))  # chunk 1: two empty shards
    assert [imap[d][1] for d in range(4)] == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    imap = mc.Layout(m, (mc.Blocks("x", [0, 3, 0, 2]),)).index_map((5,))
    assert [imap[d][0] for d in range(4)] == [slice(0, 0), slice(0, 3), slice(3, 3), slice(3, 5)]
    imap = mc.Layout(m, ("x",)).index_map((0,))
    assert all(v == (slice(0, 0),) for v in imap.values())


def _expected_index_map(layout, shape):
    """An independent model of the contract: torch.chunk / Blocks per dimension, axes major
    to minor, unused and partial axes replicated."""
    mesh = layout.mesh
    out = {}
    for d in mesh.device_ids:
        coords = tuple(int(c) for c in np.argwhere(mesh.devices == d)[0])
        idx = []
        for dim, n in enumerate(shape):
            e = layout.spec[dim] if dim < len(layout.spec) else None
            if e is None:
                idx.append(slice(0, n))
                continue
            axes = e.axes if isinstance(e, mc.Blocks) else e
            sizes = [mesh.shape[mesh.axis_names.index(a)] for a in axes]
            i = int(np.ravel_multi_index([coords[mesh.axis_names.index(a)] for a in axes], sizes))
            k = math.prod(sizes)
            if isinstance(e, mc.Blocks):
                start = sum(e.sizes[:i])
                idx.append(slice(start, start + e.sizes[i]))
                continue
            chunks = torch.chunk(torch.arange(n), k) if n else ()
            if i < len(chunks) and len(chunks[i]):
                idx.append(slice(int(chunks[i][0]), int(chunks[i][-1]) + 1))
            else:
                idx.append(slice(n, n))
        out[d] = tuple(idx)
    return out


@settings(max_examples=300)
@given(data=st.data())
def test_index_map_matches_torch_chunk(data):
    mesh = data.draw(meshes(max_devices=16))
    shape = data.draw(st.integers(1, 3).flatmap(lambda n: shapes(n, max_size=11)))
    layout = data.draw(layouts(mesh, shape))
    imap = layout.index_map(shape)
    _concrete(imap, layout, shape)
    assert imap == _expected_index_map(layout, shape), str(layout)
    # the distinct tiles of one replica/addend partition the tensor
    t = layout.tiles(shape)
    cover = np.zeros(shape, np.int64)
    for sc, groups in t.classes.items():
        d = next(iter(groups.values()))[0]
        cover[imap[d]] += 1
    assert (cover == 1).all()


def test_index_map_torch_chunk_examples():
    m = mc.Mesh([[0, 1, 2], [3, 4, 5]], ("x", "y"))
    for n in range(0, 14):
        lay = mc.Layout(m, (("y", "x"),))
        assert lay.index_map((n,)) == _expected_index_map(lay, (n,))
        # y major: device 1 (x=0, y=1) holds shard 1 * 2 + 0 = 2
        c = -(-n // 6)
        assert lay.index_map((n,))[1] == (slice(min(2 * c, n), min(3 * c, n)),)


# -- against JAX's NamedSharding ------------------------------------------------------------

jax = pytest.importorskip("jax")


def _jax_devices():
    devs = {d.id: d for d in jax.devices()}
    if len(devs) < 16:
        pytest.skip("needs 16 JAX CPU devices (XLA_FLAGS is set in tests/conftest.py)")
    return devs


def _jax_index_map(layout, shape):
    """The index map JAX gives for the same mesh (jax devices arranged like the meshcomm
    mesh) and PartitionSpec; partial axes are left out of the spec (replicated)."""
    from jax.sharding import Mesh as JMesh, NamedSharding, PartitionSpec as P
    devs = _jax_devices()
    mesh = layout.mesh
    jmesh = JMesh(np.array([devs[d] for d in mesh.device_ids], dtype=object).reshape(mesh.shape),
                  mesh.axis_names)
    spec = P(*[None if e is None else (e[0] if len(e) == 1 else e) for e in layout.spec])
    raw = NamedSharding(jmesh, spec).devices_indices_map(tuple(shape))
    return {dev.id: tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))
            for dev, idx in raw.items()}


@st.composite
def even_case(draw):
    mshape = draw(mesh_shapes(max_devices=16))
    n = math.prod(mshape)
    ids = draw(st.permutations(list(range(16))))[:n]
    names = draw(st.sampled_from(AXIS_NAME_SETS))[:len(mshape)]
    mesh = mc.Mesh(np.array(ids).reshape(mshape), names)
    tndim = draw(st.integers(1, 3))
    lay = draw(layouts(mesh, (1,) * tndim, blocks=False))
    shape = []
    for dim in range(tndim):
        e = lay.spec[dim] if dim < len(lay.spec) else None
        k = math.prod(mesh.axis_size(a) for a in e) if e else 1
        shape.append(k * draw(st.integers(0 if draw(st.integers(0, 9)) == 0 else 1, 3)))
    return tuple(shape), lay


@settings(max_examples=150)
@given(case=even_case())
def test_index_map_matches_jax_named_sharding(case):
    shape, layout = case
    assert layout.index_map(shape) == _jax_index_map(layout, shape), str(layout)


@pytest.mark.parametrize("spec,shape", [
    (("x", "y"), (4, 8)),
    ((("x", "y"), None), (16, 3)),
    ((("y", "x"), None), (16, 3)),
    ((None, ("y", "x")), (2, 8)),
    (("y",), (12, 5)),
    ((), (6, 6)),
])
def test_index_map_jax_examples(spec, shape):
    # a permuted, non-consecutive device order
    ids = [9, 2, 14, 7, 0, 11, 5, 3]
    layout = mc.Layout(mc.Mesh(np.array(ids).reshape(2, 4), ("x", "y")), spec)
    assert layout.index_map(shape) == _jax_index_map(layout, shape)


def test_jax_rejects_uneven_where_meshcomm_uses_torch_chunk():
    layout = mc.Layout(mc.Mesh([0, 1, 2, 3], "x"), ("x",))
    with pytest.raises(Exception):
        _jax_index_map(layout, (6,))
    assert layout.index_map((6,)) == _expected_index_map(layout, (6,))
