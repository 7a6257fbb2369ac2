"""Property tests of single-process resharding: random meshes (1-d to 3-d; disjoint,
overlapping and identical device sets; non-consecutive ids), random specs (None, an axis, a
tuple of axes, Blocks with zero-size blocks), uneven shapes with sizes 0 and 1, pending sums
on either side, and several dtypes and array kinds.

For every case: ``unshard(reshard(shard(x)))`` equals x exactly, every dst tile equals
``x[index]`` (non-partial dst), the plan passes ``meshcomm.verify``, results keep the input's
array kind and dtype. A second group of tests breaks good plans on purpose and checks that
the verifier notices.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import meshcomm as mc
from meshcomm.planners import PlanError, check_deadlock_free
from meshcomm.planners.verify import programs
from strategies import layouts_pair

# -- helpers ----------------------------------------------------------------------------

INT_DTYPES = ("int32", "int64")
FLOAT_DTYPES = ("float32", "float64")
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
                "int64": torch.int64, "bfloat16": torch.bfloat16}


def make_array(shape, dtype: str, kind: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    if dtype.startswith("int"):
        a = rng.integers(-1000, 1000, size=shape).astype(dtype)
    else:
        a = rng.standard_normal(shape).astype("float64" if dtype == "bfloat16" else dtype)
    if kind == "numpy":
        return a
    if kind == "torch":
        return torch.from_numpy(np.array(a, copy=True)).to(TORCH_DTYPES[dtype])
    if kind == "jax":
        import jax.numpy as jnp
        return jnp.asarray(a)
    raise AssertionError(kind)


def kind_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, torch.Tensor):
        return "torch"
    import jax
    assert isinstance(x, jax.Array), type(x)
    return "jax"


def assert_same(got, want, what: str):
    assert kind_of(got) == kind_of(want), f"{what}: kind {kind_of(got)} != {kind_of(want)}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{what}: values differ"
    else:
        assert np.array_equal(np.asarray(got), np.asarray(want)), f"{what}: values differ"


def check_case(shape, src, dst, dtype: str, kind: str, seed=None, async_op=False):
    """The whole property for one case."""
    x = make_array(shape, dtype, kind)
    shards = mc.shard(x, src, seed=seed)
    assert set(shards) == set(src.mesh.device_ids)
    for d, v in shards.items():
        assert kind_of(v) == kind, f"shard of device {d} is a {type(v).__name__}"
    if async_op:
        h = mc.reshard(shards, src, dst, async_op=True)
        assert isinstance(h, mc.Handle)
        out = h.wait()
        assert h.is_completed()
        assert h.wait() is out
    else:
        out = mc.reshard(shards, src, dst)
    assert set(out) == set(dst.mesh.device_ids), "reshard must return every dst device's tile"
    imap = dst.index_map(shape)
    for d, v in out.items():
        want_shape = tuple(s.stop - s.start for s in imap[d])
        assert tuple(v.shape) == want_shape, f"dst tile of device {d}"
        if not dst.is_partial:
            assert_same(v, x[imap[d]] if imap[d] else x, f"dst tile of device {d} ({dst})")
    assert_same(mc.unshard(out, dst), x, f"unshard(reshard(shard(x))) for {src} -> {dst}")
    p = mc.plan(shape, x.dtype, src, dst)
    mc.verify(p)
    return p


def needs_integers(src, dst, seed) -> bool:
    """Random addends (a seeded partial src) are summed: exact only for integers."""
    return seed is not None and src.is_partial


# -- the main property --------------------------------------------------------------------

@settings(max_examples=300)
@given(case=layouts_pair(max_devices=16, min_tensor_ndim=0), dtype=st.sampled_from(INT_DTYPES + FLOAT_DTYPES),
       seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_roundtrip_numpy(case, dtype, seed):
    shape, src, dst = case
    if needs_integers(src, dst, seed) and dtype not in INT_DTYPES:
        dtype = "int64"
    check_case(shape, src, dst, dtype, "numpy", seed=seed)


@settings(max_examples=120)
@given(case=layouts_pair(max_devices=12, min_tensor_ndim=0), dtype=st.sampled_from(list(TORCH_DTYPES)),
       seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_roundtrip_torch(case, dtype, seed):
    shape, src, dst = case
    if needs_integers(src, dst, seed) and dtype not in INT_DTYPES:
        dtype = "int32"
    check_case(shape, src, dst, dtype, "torch", seed=seed)


@settings(max_examples=60)
@given(case=layouts_pair(max_devices=8, partial=False),
       overlap=st.sampled_from(["disjoint", "overlapping", "same"]))
def test_roundtrip_no_partial_async(case, overlap):
    shape, src, dst = case
    check_case(shape, src, dst, "float32", "numpy", async_op=True)


@settings(max_examples=40)
@given(case=layouts_pair(max_devices=16, overlap="same"))
def test_roundtrip_same_devices(case):
    shape, src, dst = case
    check_case(shape, src, dst, "int32", "numpy", seed=7)


@settings(max_examples=40)
@given(case=layouts_pair(max_devices=16, max_ndim=4, max_tensor_ndim=4, max_size=6))
def test_roundtrip_4d_meshes_and_tensors(case):
    shape, src, dst = case
    check_case(shape, src, dst, "int64", "numpy", seed=5)


@settings(max_examples=25)
@given(case=layouts_pair(max_devices=64, max_tensor_ndim=2, max_size=20))
def test_roundtrip_up_to_64_devices(case):
    shape, src, dst = case
    check_case(shape, src, dst, "int32", "numpy", seed=9)


@settings(max_examples=12)
@given(case=layouts_pair(max_devices=8, max_tensor_ndim=2, max_size=5),
       dtype=st.sampled_from(["float32", "int32"]))
def test_roundtrip_jax(case, dtype):
    shape, src, dst = case
    check_case(shape, src, dst, dtype, "jax", seed=3 if dtype == "int32" else None)


@settings(max_examples=80)
@given(case=layouts_pair(max_devices=16), dtype=st.sampled_from(["float32", "int64", "bfloat16"]))
def test_verifier_passes_planned(case, dtype):
    """The verifier on plans alone (no data), with larger meshes and several topologies."""
    shape, src, dst = case
    for topo in ("flat", "p3.8xlarge", "dgx-a100"):
        p = mc.plan(shape, dtype, src, dst, topology=topo)
        mc.verify(p)
        assert all(t.nbytes > 0 for t in p.transfers)


@settings(max_examples=60)
@given(case=layouts_pair(max_devices=16), dpp=st.sampled_from([2, 3, 4]))
def test_verifier_passes_with_several_devices_per_process(case, dpp):
    """Under a launcher a process may own several devices (device d -> rank d // dpp); the
    per-process programs must still be complete and deadlock-free."""
    shape, src, dst = case
    mc.verify(mc.plan(shape, "float32", src, dst), devices_per_process=dpp)


def _inside(box, tile):
    return all(t0 <= a and b <= t1 for (a, b), (t0, t1) in zip(box, tile))


@settings(max_examples=100)
@given(case=layouts_pair(max_devices=16, partial=False, overlap="overlapping"),
       topo=st.sampled_from(["flat", "p3.8xlarge"]))
def test_local_data_is_copied_not_received(case, topo):
    """A dst device never receives over a link a box its own src tile already holds."""
    shape, src, dst = case
    p = mc.plan(shape, "float32", src, dst, topology=topo)
    tiles = src.tiles(shape).boxes
    for t in p.transfers:
        if t.kind == "copy":
            continue
        for d in t.dsts:
            for b in t.boxes:
                assert not (d in tiles and _inside(b, tiles[d])), \
                    f"device {d} receives {b}, which it holds\n{p.explain()}"


@settings(max_examples=100)
@given(case=layouts_pair(max_devices=16, partial=False), topo=st.sampled_from(["p3.8xlarge", "dgx-a100"]))
def test_no_network_hop_into_a_node_that_holds_the_box(case, topo):
    """Same-node sources first: no hop crosses into a node that already holds the box."""
    shape, src, dst = case
    p = mc.plan(shape, "float32", src, dst, topology=topo)
    node = p.topology.node_of
    tiles = src.tiles(shape).boxes
    for t in p.transfers:
        if t.kind == "copy" or t.src_buf != "src":
            continue
        for u, v in t.hops:
            if node(u) == node(v):
                continue
            for b in t.boxes:
                holders = [s for s, tile in tiles.items() if node(s) == node(v) and _inside(b, tile)]
                assert not holders, f"hop {u}->{v} brings {b} into node {node(v)}, held by {holders}\n{p.explain()}"


@settings(max_examples=40)
@given(case=layouts_pair(max_devices=16))
def test_plans_are_deterministic(case):
    from meshcomm.planners import plan_reshard
    shape, src, dst = case
    topo = mc.Topology.preset("p3.8xlarge")
    a = plan_reshard(shape, "int32", 4, src, dst, topo)
    b = plan_reshard(shape, "int32", 4, src, dst, topo)
    assert a.transfers == b.transfers and a.zero_fill == b.zero_fill


# -- fixed cases worth naming --------------------------------------------------------------

def _mesh(ids, names=("x", "y")):
    ids = np.asarray(ids)
    return mc.Mesh(ids, names[:ids.ndim])


FIXED = {
    "alpa-case4-scaled": ((16, 8, 4), mc.Layout(_mesh([[0, 1, 2, 3], [4, 5, 6, 7]]), (None, ("x", "y"))),
                          mc.Layout(_mesh([[8, 9, 10, 11], [12, 13, 14, 15]]), (("x", "y"),))),
    "uneven-7-over-4": ((7, 3), mc.Layout(_mesh([0, 1, 2, 3], ("x",)), ("x",)),
                        mc.Layout(_mesh([[4, 5], [6, 7]]), (("y", "x"), None))),
    "blocks-with-zero": ((8, 2), mc.Layout(_mesh([0, 1, 2], ("x",)), (mc.Blocks("x", [0, 8, 0]),)),
                         mc.Layout(_mesh([3, 4], ("x",)), (mc.Blocks("x", [5, 3]),))),
    "partial-to-split": ((4, 6), mc.Layout(_mesh([[0, 1], [2, 3]]), (None, "y"), partial=("x",)),
                         mc.Layout(_mesh([4, 5, 6], ("x",)), ("x",))),
    "partial-to-partial": ((5, 5), mc.Layout(_mesh([[0, 1], [2, 3]]), ("y",), partial={"x": "sum"}),
                           mc.Layout(_mesh([[3, 9], [2, 8]]), (None, "x"), partial=("y",))),
    "split-to-partial": ((6,), mc.Layout(_mesh([0, 1, 2], ("x",)), ("x",)),
                         mc.Layout(_mesh([[2, 1], [0, 5]]), ("y",), partial=("x",))),
    "zero-size-dim": ((0, 5), mc.Layout(_mesh([[0, 1], [2, 3]]), ("x", "y")),
                      mc.Layout(_mesh([1, 7], ("x",)), (None, "x"))),
    "3d-mesh-permuted": ((6, 4, 5), mc.Layout(mc.Mesh(np.array([7, 3, 5, 1, 0, 2, 4, 6]).reshape(2, 2, 2), ("x", "y", "z")),
                                              (("z", "x"), None, "y")),
                         mc.Layout(mc.Mesh(np.array([11, 30, 2, 5]).reshape(2, 2), ("a", "b")), ("b", "a"))),
    "same-layout": ((4, 4), mc.Layout(_mesh([[0, 1], [2, 3]]), ("x", "y")),
                    mc.Layout(_mesh([[0, 1], [2, 3]]), ("x", "y"))),
}


@pytest.mark.parametrize("name", sorted(FIXED))
@pytest.mark.parametrize("kind,dtype", [("numpy", "float32"), ("numpy", "int64"), ("torch", "bfloat16"),
                                        ("torch", "int32")])
def test_fixed_cases(name, kind, dtype):
    shape, src, dst = FIXED[name]
    seed = 11 if dtype.startswith("int") else None
    check_case(shape, src, dst, dtype, kind, seed=seed)


def test_same_layout_is_all_local_copies():
    shape, src, dst = FIXED["same-layout"]
    p = mc.plan(shape, "float32", src, dst)
    assert p.transfers and all(t.kind == "copy" for t in p.transfers)
    assert p.bytes_moved == 0 and p.messages == 0


def test_bare_array_in_and_out():
    src = mc.Layout(_mesh([3], ("x",)), ())
    dst = mc.Layout(_mesh([5], ("x",)), ())
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = mc.reshard(x, src, dst)
    assert isinstance(y, np.ndarray) and np.array_equal(y, x)
    t = torch.arange(6, dtype=torch.int64)
    assert torch.equal(mc.reshard(t, src, dst, shape=(6,), dtype=torch.int64), t)


def test_shape_and_dtype_keywords():
    src = mc.Layout(_mesh([0, 1, 2, 3], ("x",)), ("x",))
    dst = mc.Layout(_mesh([4, 5], ("x",)), ("x",))
    x = np.arange(10, dtype=np.int32)
    shards = mc.shard(x, src)
    out = mc.reshard(shards, src, dst, shape=(10,), dtype="int32")
    assert np.array_equal(mc.unshard(out, dst), x)
    out = mc.reshard(shards, src, dst, shape=[10], dtype=np.int32)
    assert np.array_equal(out[5], x[5:])


def test_jax_outputs_on_their_devices():
    import jax
    if len(jax.devices()) < 16:
        pytest.skip("needs 16 JAX CPU devices (XLA_FLAGS set in conftest.py)")
    src = mc.Layout(_mesh([[0, 1], [2, 3]]), ("x", "y"))
    dst = mc.Layout(_mesh([8, 9, 10], ("x",)), (None, "x"))
    x = jax.numpy.arange(20.0, dtype="float32").reshape(4, 5)
    out = mc.reshard(mc.shard(x, src), src, dst)
    for d, v in out.items():
        assert isinstance(v, jax.Array)
        assert {dev.id for dev in v.devices()} == {d}
    assert np.array_equal(np.asarray(mc.unshard(out, dst)), np.asarray(x))


def test_plan_is_cached_and_deterministic():
    shape, src, dst = FIXED["alpa-case4-scaled"]
    p1 = mc.plan(shape, "int32", src, dst, topology="p3.8xlarge")
    p2 = mc.plan(list(shape), np.int32, src, dst, topology=mc.Topology.preset("p3.8xlarge"))
    assert p1 is p2
    mc.clear_caches()
    p3 = mc.plan(shape, "int32", src, dst, topology="p3.8xlarge")
    assert p3 is not p1 and p3.transfers == p1.transfers


# -- the verifier catches broken plans ------------------------------------------------------

def _broken(plan, transfers):
    return dataclasses.replace(plan, transfers=tuple(transfers))


def _plan(name, dtype="int32", topology=None):
    shape, src, dst = FIXED[name]
    p = mc.plan(shape, dtype, src, dst, topology=topology)
    mc.verify(p)
    return p


NONEMPTY = sorted(n for n in FIXED if mc.plan(FIXED[n][0], "int32", *FIXED[n][1:]).transfers)


@pytest.mark.parametrize("name", NONEMPTY)
def test_verifier_catches_dropped_transfer(name):
    p = _plan(name)
    for i in range(len(p.transfers)):
        ts = list(p.transfers)
        del ts[i]
        with pytest.raises(PlanError, match="never written|misses an addend|does not hold the sum|disagree"):
            mc.verify(_broken(p, ts))


@pytest.mark.parametrize("name", NONEMPTY)
def test_verifier_catches_duplicated_transfer(name):
    p = _plan(name)
    for i in range(len(p.transfers)):
        ts = list(p.transfers)
        ts.insert(i + 1, ts[i])
        with pytest.raises(PlanError, match="written twice"):
            mc.verify(_broken(p, ts))


@settings(max_examples=80)
@given(case=layouts_pair(max_devices=16), data=st.data())
def test_verifier_catches_random_mutations(case, data):
    """Dropping or repeating any transfer of a random plan, or retargeting a message to a
    device that does not need it, is always caught."""
    shape, src, dst = case
    p = mc.plan(shape, "int32", src, dst)
    if not p.transfers:
        return
    i = data.draw(st.integers(0, len(p.transfers) - 1))
    ts = list(p.transfers)
    with pytest.raises(PlanError):
        mc.verify(_broken(p, ts[:i] + ts[i + 1:]))
    with pytest.raises(PlanError):
        mc.verify(_broken(p, ts[:i + 1] + ts[i:]))
    t = ts[i]
    if t.kind in ("send", "bcast"):
        dt = dst.tiles(shape).boxes
        outsiders = [d for d in dst.mesh.device_ids
                     if d not in t.dsts and d not in t.srcs and not all(_inside(b, dt[d]) for b in t.boxes)]
        if outsiders:
            other = data.draw(st.sampled_from(outsiders))
            bad = dataclasses.replace(t, dsts=t.dsts[:-1] + (other,))
            with pytest.raises(PlanError):
                mc.verify(_broken(p, ts[:i] + [bad] + ts[i + 1:]))


def test_verifier_catches_duplicate_addend_in_reduce():
    # 2x2 src mesh: x is the pending-sum axis, y a replica axis, so devices 0 and 1 hold
    # addend 0 and devices 2 and 3 hold addend 1. Swapping the addend-1 contributor of a
    # reduction for a second addend-0 device sums addend 0 twice.
    src = mc.Layout(_mesh([[0, 1], [2, 3]]), (None,), partial=("x",))
    dst = mc.Layout(_mesh([4], ("x",)), (None,))
    p = mc.plan((8,), "int32", src, dst)
    mc.verify(p)
    st_ = src.tiles((8,))
    reduces = [i for i, t in enumerate(p.transfers) if t.kind == "reduce"]
    assert reduces, f"expected a reduce in\n{p.explain()}"
    i = reduces[0]
    t = p.transfers[i]
    addends = [st_.addend_of[s] for s in t.srcs]
    assert sorted(addends) == [0, 1], t
    victim = t.srcs[addends.index(1)]
    other_zero = [d for d in (0, 1) if d not in t.srcs][0]
    bad = dataclasses.replace(t, srcs=tuple(other_zero if s == victim else s for s in t.srcs))
    with pytest.raises(PlanError, match="summed twice"):
        mc.verify(_broken(p, p.transfers[:i] + (bad,) + p.transfers[i + 1:]))


def test_verifier_catches_deadlocking_programs():
    # 0 -> 1 and 1 -> 0: two transfers between the same pair of processes. If process 0 runs
    # them in one order and process 1 in the other, both wait forever (rendezvous).
    src = mc.Layout(_mesh([0, 1], ("x",)), ("x",))
    dst = mc.Layout(_mesh([1, 0], ("x",)), ("x",))
    p = mc.plan((8,), "float32", src, dst)
    mc.verify(p)
    progs = programs(p)
    shared = [i for i in progs[0] if i in progs[1]]
    assert len(shared) >= 2, p.explain()
    check_deadlock_free(p.transfers, progs)           # the real programs are fine
    bad = dict(progs)
    bad[0] = list(reversed(progs[0]))
    with pytest.raises(PlanError, match="deadlock"):
        check_deadlock_free(p.transfers, bad)


def test_verifier_catches_send_without_receive():
    src = mc.Layout(_mesh([0, 1], ("x",)), ("x",))
    dst = mc.Layout(_mesh([1, 0], ("x",)), ("x",))
    p = mc.plan((8,), "float32", src, dst)
    progs = programs(p)
    i = next(i for i, t in enumerate(p.transfers) if t.kind == "send")
    receiver = p.transfers[i].dsts[0]
    bad = {q: [j for j in prog if not (q == receiver and j == i)] for q, prog in progs.items()}
    with pytest.raises(PlanError, match="without its receive"):
        check_deadlock_free(p.transfers, bad)


def test_verifier_catches_wrong_sender_and_bytes_and_stage():
    p = _plan("uneven-7-over-4", dtype="float32")
    i = next(i for i, t in enumerate(p.transfers) if t.kind == "send")
    t = p.transfers[i]
    ts = list(p.transfers)
    # a sender that does not hold the box
    not_holder = next(d for d in p.src.mesh.device_ids if d != t.srcs[0] and d not in t.dsts)
    ts[i] = dataclasses.replace(t, srcs=(not_holder,))
    with pytest.raises(PlanError, match="does not hold"):
        mc.verify(_broken(p, ts))
    # a wrong byte count
    ts[i] = dataclasses.replace(t, nbytes=t.nbytes + 4)
    with pytest.raises(PlanError, match="bytes"):
        mc.verify(_broken(p, ts))
    # stages must not go backwards
    ts = [dataclasses.replace(u, stage=1) for u in p.transfers]
    ts[-1] = dataclasses.replace(ts[-1], stage=0)
    if len(ts) > 1:
        with pytest.raises(PlanError, match="stage"):
            mc.verify(_broken(p, ts))


def test_one_process_program_runs_planned_tiles_directly_and_anything_else_through_the_checks():
    import torch
    src = mc.Layout(mc.Mesh([[0, 1], [2, 3]], ("x", "y")), ("x", "y"))
    dst = mc.Layout(mc.Mesh([4, 5, 6], ("z",)), (None, "z"))
    x = np.arange(35.0, dtype=np.float32).reshape(5, 7)
    prog = mc.Program.reshard(src, dst, shape=(5, 7), dtype="float32")
    shards = mc.shard(x, src)
    assert (mc.unshard(prog(shards), dst) == x).all()
    tshards = {d: torch.from_numpy(v.copy()) for d, v in shards.items()}
    out = prog(tshards)
    assert all(isinstance(v, torch.Tensor) for v in out.values()) and (mc.unshard(out, dst).numpy() == x).all()
    bad = dict(shards)
    bad[0] = bad[0].astype(np.float64)
    with pytest.raises(TypeError, match="float64"):
        prog(bad)
    bad[0] = np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="device 0"):
        prog(bad)
    with pytest.raises(ValueError, match="missing device"):
        prog({d: v for d, v in shards.items() if d != 3})
