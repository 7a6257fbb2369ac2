"""Every bad input raises ValueError or TypeError with a message that names the offending
axis, dimension, device, shape or name."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import meshcomm as mc
from meshcomm import notation
from meshcomm.api import infer_shape

M22 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
M4 = mc.Mesh([0, 1, 2, 3], "x")


def raises(exc, pattern):
    return pytest.raises(exc, match=pattern)


# -- meshes -------------------------------------------------------------------------------

def test_mesh_duplicate_device_ids():
    with raises(ValueError, r"device 1 appears more than once"):
        mc.Mesh([[0, 1], [1, 2]], ("x", "y"))


def test_mesh_negative_device_ids():
    with raises(ValueError, r"non-negative.*-3"):
        mc.Mesh([0, -3], "x")


def test_mesh_axis_name_arity():
    with raises(ValueError, r"shape \(2, 2\).*2 dimension.*1 axis name.*'x'"):
        mc.Mesh([[0, 1], [2, 3]], ("x",))
    with raises(ValueError, r"1 dimension.*3 axis name"):
        mc.Mesh([0, 1], ("x", "y", "z"))


def test_mesh_duplicate_axis_names():
    with raises(ValueError, r"distinct.*'x'"):
        mc.Mesh([[0, 1], [2, 3]], ("x", "x"))


def test_mesh_bad_devices():
    with raises(ValueError, r"empty"):
        mc.Mesh([], "x")
    with raises(ValueError, r"scalar 3"):
        mc.Mesh(3, ())
    with raises(TypeError, r"integers.*dtype"):
        mc.Mesh(["a", "b"], "x")
    with raises(TypeError, r"axis names.*1"):
        mc.Mesh([0, 1], (1,))


def test_mesh_unknown_device():
    with raises(ValueError, r"device 9 is not in mesh"):
        M22.coords(9)


# -- layouts ------------------------------------------------------------------------------

def test_layout_unknown_axis():
    with raises(ValueError, r"unknown mesh axis 'z'.*\('x', 'y'\)"):
        mc.Layout(M22, ("z",))
    with raises(ValueError, r"unknown mesh axis 'q'"):
        mc.Layout(M22, (None,), partial=("q",))
    with raises(ValueError, r"unknown mesh axis 'w'"):
        mc.Layout(M22, (mc.Blocks("w", [1, 1]),))


def test_layout_axis_used_twice():
    with raises(ValueError, r"axis 'x' is used twice.*dimension 0.*dimension 1"):
        mc.Layout(M22, ("x", "x"))
    with raises(ValueError, r"axis 'y' is used twice.*dimension 0.*dimension 1"):
        mc.Layout(M22, (("x", "y"), "y"))
    with raises(ValueError, r"axis 'x' is used twice.*dimension 0.*partial"):
        mc.Layout(M22, ("x",), partial=("x",))
    with raises(ValueError, r"axis 'y' is used twice.*dimension 1.*partial"):
        mc.Layout(M22, (None, mc.Blocks("y", [1, 1])), partial={"y": "sum"})
    with raises(ValueError, r"axis 'x' is used twice"):
        mc.Layout(M22, (("x", "x"),))


def test_blocks_not_summing_to_dimension():
    lay = mc.Layout(M22, (None, mc.Blocks("x", [3, 5])))
    with raises(ValueError, r"B\(x:3/5\).*dimension 1.*sum to 8.*size 7"):
        lay.index_map((2, 7))
    with raises(ValueError, r"dimension 1.*sum to 8.*size 9"):
        mc.plan((2, 9), "float32", lay, lay)
    with raises(ValueError, r"dimension 1"):
        mc.shard(np.zeros((2, 6)), lay)


def test_blocks_wrong_count():
    with raises(ValueError, r"dimension 0.*\('x',\).*needs 2 sizes.*got 3"):
        mc.Layout(M22, (mc.Blocks("x", [1, 2, 3]),))
    with raises(ValueError, r"dimension 1.*\('x', 'y'\).*needs 4 sizes.*got 2"):
        mc.Layout(M22, (None, mc.Blocks(("x", "y"), [1, 2])))


def test_blocks_bad_sizes():
    with raises(ValueError, r"non-negative.*-1"):
        mc.Blocks("x", [-1, 2])
    with raises(TypeError, r"sizes.*ints"):
        mc.Blocks("x", 5)
    with raises(TypeError, r"axis name.*got 3"):
        mc.Blocks(3, [1])
    with raises(TypeError, r"axis names.*None"):
        mc.Blocks(("x", None), [1, 1])
    with raises(ValueError, r"at least one mesh axis"):
        mc.Blocks((), [1])


def test_spec_longer_than_tensor():
    lay = mc.Layout(M22, ("x", None, "y"))
    with raises(ValueError, r"3 entries.*2 dimension.*\(4, 4\)"):
        lay.index_map((4, 4))
    with raises(ValueError, r"3 entries.*1 dimension"):
        mc.shard(np.zeros(4), lay)
    with raises(ValueError, r"3 entries"):
        mc.plan((4, 4), "float32", lay, mc.Layout(M22, ()))


def test_bad_spec_entries():
    with raises(TypeError, r"dimension 0.*3"):
        mc.Layout(M22, (3,))
    with raises(TypeError, r"dimension 1.*\{'x'\}"):
        mc.Layout(M22, (None, {"x"}))
    with raises(TypeError, r"dimension 0.*axis names.*7"):
        mc.Layout(M22, (("x", 7),))
    with raises(TypeError, r"partial axes.*5"):
        mc.Layout(M22, (), partial=(5,))
    with raises(ValueError, r"'x'.*'sum'.*'max'.*'avg'"):
        mc.Layout(M22, (), partial={"x": "avg"})
    with raises(ValueError, r"one reduction op.*'x': 'max', 'y': 'min'"):
        mc.Layout(M22, (), partial={"x": "max", "y": "min"})


def test_non_layout_arguments():
    lay = mc.Layout(M22, ("x",))
    with raises(TypeError, r"meshcomm.Mesh.*str"):
        mc.Layout("2x2", ("x",))
    with raises(TypeError, r"src must be a meshcomm.Layout.*str"):
        mc.plan((4,), "float32", "2x2:x", lay)
    with raises(TypeError, r"dst must be a meshcomm.Layout.*Mesh"):
        mc.plan((4,), "float32", lay, M22)
    with raises(TypeError, r"src must be a meshcomm.Layout"):
        mc.reshard({}, None, lay)
    with raises(TypeError, r"layout must be a meshcomm.Layout.*tuple"):
        mc.shard(np.zeros(4), ("x",))
    with raises(TypeError, r"layout must be a meshcomm.Layout"):
        mc.unshard({}, M22)


def test_bad_shapes():
    lay = mc.Layout(M22, ("x",))
    with raises(ValueError, r"non-negative.*-1"):
        lay.index_map((-1,))
    with raises(TypeError, r"shape.*ints"):
        mc.plan(4, "float32", lay, lay)


# -- dtypes and topologies ------------------------------------------------------------------

def test_unknown_dtype():
    lay = mc.Layout(M22, ("x",))
    with raises(TypeError, r"unknown dtype 'float17'"):
        mc.plan((4,), "float17", lay, lay)
    with raises(TypeError, r"not a numeric element type"):
        mc.plan((4,), "U3", lay, lay)
    with raises(TypeError, r"not a numeric element type"):
        mc.plan((4,), object, lay, lay)


def test_unknown_topology_preset():
    lay = mc.Layout(M22, ("x",))
    with raises(ValueError, r"unknown topology preset 'p4d'.*p3\.8xlarge"):
        mc.plan((4,), "float32", lay, lay, topology="p4d")
    with raises(ValueError, r"unknown topology preset 'nope'"):
        mc.Topology.preset("nope")
    with raises(TypeError, r"topology must be.*int"):
        mc.plan((4,), "float32", lay, lay, topology=4)
    with raises(ValueError, r"devices_per_node.*0"):
        mc.Topology(devices_per_node=0)
    with raises(ValueError, r"inter_node_gbps.*-1"):
        mc.Topology(inter_node_gbps=-1)


# -- reshard inputs ------------------------------------------------------------------------

SRC = mc.Layout(M22, ("x", "y"))
DST = mc.Layout(mc.Mesh([4, 5], "x"), ("x",))
X = np.arange(20, dtype=np.float64).reshape(4, 5)


def shards():
    return mc.shard(X, SRC)


def test_wrong_shard_shape():
    s = shards()
    s[3] = np.zeros((2, 1))
    with raises(ValueError, r"dimension 1: device 3 holds the same shard as device 1 but its tile has size 1 there, not 2"):
        mc.reshard(s, SRC, DST)
    # with shape= given the check names the device, its shape and the box it should hold
    with raises(ValueError, r"device 3 has shape \(2, 1\).*box.*\(2, 2\).*global shape \(4, 5\)"):
        mc.reshard(s, SRC, DST, shape=(4, 5))
    s = shards()
    with raises(ValueError, r"device 0 has shape \(2, 3\).*\(3, 3\).*global shape \(6, 5\)"):
        mc.reshard(s, SRC, DST, shape=(6, 5))
    with raises(ValueError, r"rank|dimension"):
        mc.reshard({d: v[..., None] if d == 2 else v for d, v in shards().items()}, SRC, DST)


def test_missing_shards():
    s = shards()
    del s[2]
    with raises(ValueError, r"missing device\(s\) \[2\]"):
        mc.reshard(s, SRC, DST)
    out = mc.reshard(shards(), SRC, DST)
    del out[5]
    with raises(ValueError, r"missing device\(s\) \[5\]"):
        mc.unshard(out, DST)


def test_shard_keys_not_in_mesh():
    s = shards()
    s[9] = s[0]
    with raises(ValueError, r"device 9 is not in the src mesh"):
        mc.reshard(s, SRC, DST)
    with raises(ValueError, r"device 0 is not in the layout mesh"):
        mc.unshard({0: X, 4: X}, DST)
    with raises(TypeError, r"device ids.*'a'"):
        mc.reshard({"a": X, **shards()}, SRC, DST)


def test_mixed_dtypes_and_kinds():
    s = shards()
    s[1] = s[1].astype(np.float32)
    with raises(TypeError, r"different dtypes.*float32.*float64"):
        mc.reshard(s, SRC, DST)
    with raises(TypeError, r"dtype=int32.*float64"):
        mc.reshard(shards(), SRC, DST, dtype="int32")
    s = shards()
    s[1] = torch.from_numpy(s[1])
    with raises(TypeError, r"mix array kinds.*numpy.*torch"):
        mc.reshard(s, SRC, DST)
    s = shards()
    s[1] = s[1].tolist()
    with raises(TypeError, r"NumPy array, torch.Tensor or jax.Array.*list"):
        mc.reshard(s, SRC, DST)


def test_bare_array_needs_one_device():
    with raises(TypeError, r"exactly one src device.*owns 4"):
        mc.reshard(X, SRC, DST)
    one = mc.Layout(mc.Mesh([7], "x"), ())
    with raises(ValueError, r"dst mesh has 2"):
        mc.reshard(X, one, DST)


def test_unknown_backend_without_launcher():
    with raises(ValueError, r"backend 'mpi'.*meshcomm.init"):
        mc.reshard(shards(), SRC, DST, backend="mpi")


def test_partial_bool_refused():
    lay = mc.Layout(M22, (), partial=("x",))
    with raises(ValueError, r"bool"):
        mc.shard(np.ones(4, dtype=bool), lay, seed=1)


# -- shape inference -----------------------------------------------------------------------

def test_infer_shape_unambiguous():
    lay = mc.Layout(M4, ("x", None))
    assert infer_shape(lay, {0: (2, 3), 1: (2, 3), 2: (2, 3), 3: (1, 3)}) == (7, 3)
    assert infer_shape(lay, {0: (1, 3), 3: (1, 3)}) == (4, 3)      # only n = 4 gives that
    blocks = mc.Layout(M4, (mc.Blocks("x", [0, 5, 1, 0]),))
    assert infer_shape(blocks, {2: (1,)}) == (6,)
    assert infer_shape(mc.Layout(M4, ()), {1: (3, 2)}) == (3, 2)


@pytest.mark.parametrize("tiles", [
    {0: (2,), 1: (2,)},          # n = 5..8
    {2: (1,)},                   # n = 3 or 5
    {3: (0,)},                   # trailing shard empty: many n
    {0: (3,)},                   # n = 9..12
])
def test_infer_shape_ambiguous(tiles):
    lay = mc.Layout(M4, ("x",))
    assert infer_shape(lay, tiles) is None
    src_shards = {d: np.zeros(s) for d, s in tiles.items()}
    with raises(ValueError, r"cannot infer the global shape.*shape="):
        mc.runtime.local_program.reshard_local(src_shards, lay, mc.Layout(mc.Mesh([9], "x"), ()), None, None)


def test_infer_shape_inconsistent():
    lay = mc.Layout(M22, ("x",))
    with raises(ValueError, r"different numbers of dimensions: device 0: 1-d, device 1: 2-d"):
        infer_shape(lay, {0: (2,), 1: (2, 2)})
    with raises(ValueError, r"dimension 0: device 1 holds the same shard as device 0.*size 3.*not 2"):
        infer_shape(lay, {0: (2,), 1: (3,)})
    with raises(ValueError, r"dimension 0: the tile of device 2 has size 2 but .* gives its shard 1 size 3"):
        infer_shape(mc.Layout(M22, (mc.Blocks("x", [1, 3]),)), {2: (2,)})


# -- CLI notation ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,pattern", [
    ("2x4", r"expected MESH:SPEC"),
    ("2y4:x", r"bad mesh '2y4'"),
    ("2x4:x{3/5", r"bad spec entry 'x\{3/5'"),
    ("2x4:x;color=red", r"bad option 'color=red'"),
    ("2x4:q", r"unknown mesh axis 'q'"),
    ("2x4:x,x", r"axis 'x' is used twice"),
    ("2x4:x{1/2/3}", r"needs 2 sizes"),
    ("2x4(a):a", r"2 dimension.*1 axis name"),
    ("4:x;partial=x", r"axis 'x' is used twice.*partial"),
    ("2x4:x$", r"bad spec entry 'x\$'"),
])
def test_bad_cli_notation(text, pattern):
    with raises(ValueError, pattern):
        notation.parse_layout(text)


def test_bad_cli_shape():
    with raises(ValueError, r"bad shape 'a,b'"):
        notation.parse_shape("a,b")


def test_every_message_names_something():
    """A spot check that messages are specific: no bare 'invalid input'."""
    for f in (lambda: mc.Layout(M22, ("z",)), lambda: mc.Mesh([0, 0], "x"),
              lambda: mc.Layout(M22, ("x", "x"))):
        with pytest.raises((ValueError, TypeError)) as ei:
            f()
        assert re.search(r"'[xz]'|device \d", str(ei.value)), str(ei.value)


# -- numbers that must be integers ---------------------------------------------------------

def test_blocks_sizes_must_be_integers():
    """No silent truncation: 3.5 rows is not 3 rows. Like torch, float sizes are refused
    even when integral; bools are not sizes."""
    with raises(TypeError, r"Blocks size 0 must be an integer, got 3\.5"):
        mc.Blocks("x", [3.5, 4.5])
    with raises(TypeError, r"Blocks size 1 must be an integer, got 4\.0"):
        mc.Blocks("x", [4, 4.0])
    with raises(TypeError, r"Blocks size 0 must be an integer, got True"):
        mc.Blocks("x", [True, 1])
    with raises(TypeError, r"Blocks size 0 must be an integer, got 2\.0"):
        mc.Blocks("x", np.array([2.0, 3.0]))
    with raises(TypeError, r"Blocks size 1 must be an integer, got '2'"):
        mc.Blocks("x", [1, "2"])
    for sizes in (np.array([3, 5], dtype=np.int32), [np.int64(3), 5], torch.tensor([3, 5]), (3, 5)):
        b = mc.Blocks("x", sizes)
        assert b.sizes == (3, 5) and all(type(s) is int for s in b.sizes)


def test_shapes_must_be_integers():
    lay = mc.Layout(M4, ("x",))
    with raises(TypeError, r"shape.*dimension 0.*2\.5"):
        lay.index_map((2.5, 3))
    with raises(TypeError, r"shape.*dimension 1.*4\.0"):
        mc.plan((4, 4.0), "float32", lay, lay)
    with raises(TypeError, r"shape.*dimension 0.*True"):
        lay.index_map((True,))
    assert lay.check_shape((np.int64(4), torch.tensor(2))) == (4, 2)


def test_a_cached_shape_does_not_excuse_bools_or_floats_equal_to_it():
    # True == 1 and 4.0 == 4 hash alike: the caches keyed by a shape as given must not
    # answer for them (this failed, depending on what earlier tests had cached)
    lay = mc.Layout(M4, ("x",))
    lay.index_map((1,))
    lay.index_map((4, 3))
    mc.plan((4, 4), "float32", lay, lay)
    with raises(TypeError, r"shape.*dimension 0.*True"):
        lay.index_map((True,))
    with raises(TypeError, r"shape.*dimension 0.*4\.0"):
        lay.index_map((4.0, 3))
    with raises(TypeError, r"shape.*dimension 1.*4\.0"):
        mc.plan((4, 4.0), "float32", lay, lay)
    with raises(TypeError, r"shape.*dimension 0.*True"):
        mc.plan((True, 4), "float32", lay, lay)
    assert mc.plan(torch.Size([4, 4]), "float32", lay, lay) is mc.plan((4, 4), "float32", lay, lay)


def test_alltoall_counts_must_be_integers():
    m = mc.Mesh([0, 1], "x")
    x = {0: np.zeros((4, 2)), 1: np.zeros((4, 2))}
    with raises(TypeError, r"count 1 of device 0 must be an integer, got 2\.5"):
        mc.all_to_all_v(x, {0: [1, 2.5], 1: [2, 2]}, m, "x")
    with raises(TypeError, r"count 0 of device 1 must be an integer, got 2\.0"):
        mc.all_to_all_v(x, {0: [2, 2], 1: [2.0, 2.0]}, m, "x")
    with raises(TypeError, r"count 0 of device 1 must be an integer, got 2\.0"):
        mc.all_to_all_v(x, {0: [2, 2], 1: np.array([2.0, 2.0])}, m, "x")
    with raises(TypeError, r"count 0 of device 0 must be an integer, got True"):
        mc.all_to_all_v(x, {0: [True, 3], 1: [2, 2]}, m, "x")
    with raises(TypeError, r"count 1 of device 1 must be an integer, got 2\.5"):
        mc.all_to_all_v(x, {0: [2, 2], 1: [2, 2]}, m, "x", recv_counts={0: [2, 2], 1: [2, 2.5]})
    out = mc.all_to_all_v({0: np.arange(8.0).reshape(4, 2), 1: np.arange(8.0, 16).reshape(4, 2)},
                          {0: np.array([1, 3], dtype=np.int32), 1: torch.tensor([2, 2])}, m, "x")
    assert out[0].shape == (3, 2) and out[1].shape == (5, 2)


def test_mesh_ragged_devices():
    with raises(ValueError, r"ragged.*row \[1\] has 1 entr.*row \[0\] has 2"):
        mc.Mesh([[0, 1], [2]], ("x", "y"))
    with raises(ValueError, r"ragged.*row \[1\]\[1\] has 1 entry but row \[1\]\[0\] has 2"):
        mc.Mesh([[[0, 1], [2, 3]], [[4, 5], [6]]], ("x", "y", "z"))
    with raises(ValueError, r"ragged.*row \[1\] is a single id.*row \[0\] has 2"):
        mc.Mesh([[0, 1], 2], ("x", "y"))


def test_mesh_device_ids_must_be_integers():
    with raises(TypeError, r"device ids must be integers.*0\.5 at index \(0,\)"):
        mc.Mesh([0.5, 1], "x")
    with raises(TypeError, r"device ids must be integers.*2\.0 at index \(1, 0\)"):
        mc.Mesh([[0, 1], [2.0, 3]], ("x", "y"))
    with raises(TypeError, r"device ids must be integers.*True at index \(0,\)"):
        mc.Mesh([True, False], "x")
    with raises(TypeError, r"device ids must be integers.*None at index \(1,\)"):
        mc.Mesh([0, None], "x")
    assert mc.Mesh(np.array([3, 1], dtype=np.uint8), "x").device_ids == (3, 1)
    assert mc.Mesh(torch.tensor([[2, 0], [1, 3]]), ("x", "y")).device_ids == (2, 0, 1, 3)


def test_mesh_axis_names_not_a_sequence():
    with raises(TypeError, r"axis names.*None"):
        mc.Mesh([0, 1], None)
    with raises(TypeError, r"axis names.*3"):
        mc.Mesh([0, 1], 3)


# -- the tuning table named by MESHCOMM_TUNING ------------------------------------------------

def test_tuning_path_that_does_not_exist(tmp_path, monkeypatch):
    from meshcomm.backends import tuning
    missing = tmp_path / "nope.json"
    monkeypatch.setenv("MESHCOMM_TUNING", str(missing))
    with raises(ValueError, r"MESHCOMM_TUNING=.*nope\.json.*no such file"):
        tuning.table_from_env()
    monkeypatch.setenv("MESHCOMM_TUNING", str(tmp_path))
    with raises(ValueError, r"MESHCOMM_TUNING=.*is a directory"):
        tuning.table_from_env()
    monkeypatch.setenv("MESHCOMM_TUNING", "")
    assert tuning.table_from_env() == tuning.default_table()


@pytest.mark.parametrize("text,pattern", [
    ("{", r"not valid JSON.*line 1"),
    (b"\xff\xfe{}", r"not valid JSON.*UTF-8"),
    ("[1, 2]", r"a tuning table is a JSON object, got list"),
    ('{"format": "v0", "rules": []}', r"format must be 'meshcomm-tuning-v1', got 'v0'"),
    ('{"format": "meshcomm-tuning-v1", "rules": [{"op": "send", "backend": "nccl"}]}',
     r"rule 0: tuning rule backend must be one of .*got 'nccl'"),
])
def test_tuning_file_that_is_not_a_table(tmp_path, monkeypatch, text, pattern):
    from meshcomm.backends import tuning
    p = tmp_path / "bad.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    monkeypatch.setenv("MESHCOMM_TUNING", str(p))
    with raises(ValueError, r"MESHCOMM_TUNING=.*bad\.json.*is not a tuning table: " + pattern):
        tuning.table_from_env()


def test_mesh_grid_numbers_must_be_integers():
    with raises(TypeError, r"Mesh.grid shape dimension 1 must be an integer, got 2\.5"):
        mc.Mesh.grid((2, 2.5))
    with raises(TypeError, r"Mesh.grid start must be an integer, got 1\.0"):
        mc.Mesh.grid((2,), start=1.0)
    with raises(ValueError, r"Mesh.grid shape.*non-negative.*-2"):
        mc.Mesh.grid((2, -2))
    assert mc.Mesh.grid((np.int64(2), 2), start=np.int32(4)).device_ids == (4, 5, 6, 7)


def test_program_reshard_device_must_be_cpu_or_cuda():
    m = mc.Mesh([0, 1], ("x",))
    with raises(ValueError, r"device must be 'cpu' or 'cuda' \(or None: the tiles say\), got 'gpu'"):
        mc.Program.reshard(mc.Layout(m, ("x",)), mc.Layout(m, (None,)), shape=(4,), dtype="float32", device="gpu")
    prog = mc.Program.reshard(mc.Layout(m, ("x",)), mc.Layout(m, (None,)), shape=(4,), dtype="float32", device="cpu")
    out = prog({0: np.arange(2.0, dtype=np.float32), 1: np.arange(2.0, 4.0, dtype=np.float32)})
    assert (out[1] == np.arange(4.0)).all()
    with raises(ValueError, r"device must be 'cpu' or 'cuda' \(or None: the host\), got 'gpu'"):
        mc.Program.reshard_many(mc.Layout(m, ("x",)), mc.Layout(m, (None,)), shapes={"w": (4,)},
                                dtypes="float32", device="gpu")
    many = mc.Program.reshard_many(mc.Layout(m, ("x",)), mc.Layout(m, (None,)), shapes={"w": (4,)},
                                   dtypes="float32", device="cpu")
    out = many({"w": {0: np.arange(2.0, dtype=np.float32), 1: np.arange(2.0, 4.0, dtype=np.float32)}})
    assert (out["w"][1] == np.arange(4.0)).all()


def test_one_process_programs_check_their_runs_like_a_launchers():
    """Without a launcher a collective Program's run is checked against its shape= and dtype=
    (it ran any tile before), all_to_all_v its rows likewise, and reshard_many names a tensor that is not in its batch (it
    was dropped before); a gather's tiles may still differ along its dim."""
    m = mc.Mesh(np.arange(4), ("x",))
    ar = mc.Program.all_reduce(m, "x", shape=(3,), dtype="float32")
    with pytest.raises(ValueError, match=r"all_reduce: the tile of device 0 has shape \(4,\), the Program's is \(3,\)"):
        ar({d: np.ones(4, np.float32) for d in range(4)})
    with pytest.raises(TypeError, match="the tiles have dtype float64, the Program's is float32"):
        ar({d: np.ones(3) for d in range(4)})
    assert np.array_equal(ar({d: np.full(3, d, np.float32) for d in range(4)})[2], np.full(3, 6.0))
    ag = mc.Program.all_gather(m, "x", shape=(3, 2), dtype="float32")
    tiles = {d: np.full((3 - (d == 1), 2), d, np.float32) for d in range(4)}
    assert ag(tiles)[0].shape == (11, 2)
    with pytest.raises(ValueError, match="may differ along dim 0 only"):
        ag({d: np.ones((3, 3), np.float32) for d in range(4)})
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))
    pm = mc.Program.reshard_many({"a": src}, {"a": dst}, shapes={"a": (8, 8)}, dtypes={"a": "float32"})
    sh = mc.shard(np.ones((8, 8), np.float32), src)
    with pytest.raises(ValueError, match=r"tensors \['b'\] are not in the batch"):
        pm({"a": sh, "b": sh})
    with pytest.raises(TypeError, match="reshard_many takes"):
        pm([sh])
    assert pm({"a": sh})["a"][1].shape == (8, 2)
    with pytest.raises(TypeError, match=r"rows= is the shape of one row .*got 2"):
        mc.Program.all_to_all_v(m, "x", rows=2, dtype="float32")
    with pytest.raises(ValueError, match=r"shape must be non-negative, got \(-2,\)"):
        mc.Program.all_to_all_v(m, "x", rows=(-2,), dtype="float32")
    a2a = mc.Program.all_to_all_v(m, "x", rows=(2,), dtype="float32")
    counts = {d: np.ones(4, np.int64) for d in range(4)}
    with pytest.raises(ValueError, match=r"rows are \(3,\) float32, the Program's are \(2,\) float32"):
        a2a({d: np.ones((4, 3), np.float32) for d in range(4)}, counts)
    assert a2a({d: np.full((4, 2), d, np.float32) for d in range(4)}, counts)[0][:, 0].tolist() == [0, 1, 2, 3]


def test_one_process_programs_take_out_buffers_like_a_launchers():
    """Without a launcher `out=` fills the caller's buffers (it was refused before), checked
    first as a launcher's run checks them; all_to_all_v, whose result shapes are data, says
    it takes none (under a launcher it dropped them)."""
    m = mc.Mesh(np.arange(4), ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))
    p = mc.Program.reshard(src, dst, shape=(8, 8), dtype="float32")
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    sh = mc.shard(x, src)
    out = {0: np.zeros((8, 2), np.float32)}
    y = p(sh, out=out)
    assert y[0] is out[0] and np.array_equal(out[0], x[:, :2]) and np.array_equal(y[3], x[:, 6:])
    assert p(sh, out=out, async_op=True).wait()[0] is out[0]
    with pytest.raises(ValueError, match=r"out= buffer of device 0 is \(8, 3\) float32, the result is \(8, 2\) float32"):
        p(sh, out={0: np.zeros((8, 3), np.float32)})
    with pytest.raises(ValueError, match="device 7, which gets no result"):
        p(sh, out={7: np.zeros((8, 2), np.float32)})
    with pytest.raises(TypeError, match="is numpy, the result is torch"):
        p({d: torch.from_numpy(v.copy()) for d, v in sh.items()}, out={0: np.zeros((8, 2), np.float32)})
    t = {1: torch.zeros(8, 2)}
    assert p({d: torch.from_numpy(v.copy()) for d, v in sh.items()}, out=t)[1] is t[1]
    assert torch.equal(t[1], torch.from_numpy(x[:, 2:4]))
    ar = mc.Program.all_reduce(m, "x", shape=(3,), dtype="float32")
    o = {2: np.empty(3, np.float32)}
    assert ar({d: np.full(3, d, np.float32) for d in range(4)}, out=o)[2] is o[2] and o[2].tolist() == [6.0] * 3
    pm = mc.Program.reshard_many({"a": src}, {"a": dst}, shapes={"a": (8, 8)}, dtypes={"a": "float32"})
    om = {"a": {3: np.zeros((8, 2), np.float32)}}
    assert pm({"a": sh}, out=om)["a"][3] is om["a"][3] and np.array_equal(om["a"][3], x[:, 6:])
    # a non-array buffer (it raised AttributeError), one buffer for two results (the second's
    # values in both: each tensor of a batch, each device of a reshard)
    with pytest.raises(TypeError, match=r"out= buffer of device 2 must be an array \(NumPy or torch\), got list"):
        ar({d: np.full(3, d, np.float32) for d in range(4)}, out={2: [0.0] * 3})
    pm2 = mc.Program.reshard_many(src, dst, shapes={"a": (8, 8), "b": (8, 8)}, dtypes="float32")
    one = np.zeros((8, 2), np.float32)
    with pytest.raises(ValueError, match="'b': out= buffer of device 3 shares memory with another out= buffer"):
        pm2({"a": sh, "b": sh}, out={"a": {3: one}, "b": {3: one}})
    with pytest.raises(ValueError, match="device 1 shares memory with another out= buffer"):
        p(sh, out={0: one, 1: one[:, :]})
    a2a = mc.Program.all_to_all_v(m, "x", rows=(2,), dtype="float32")
    with pytest.raises(TypeError, match="all_to_all_v: out= is not taken"):
        a2a({d: np.ones((4, 2), np.float32) for d in range(4)}, {d: np.ones(4, np.int64) for d in range(4)}, out={})


def test_out_buffers_overlap_by_the_bytes_they_reach():
    """Two halves of one buffer are separate out= buffers; a NumPy view of a torch tensor is
    the tensor's memory (validate.overlaps, for both kinds alike)."""
    from meshcomm.validate import overlaps
    b, t = np.zeros(16, np.float32), torch.zeros(16)
    assert not overlaps(b[:8], b[8:]) and overlaps(b[:8], b[7:])
    assert not overlaps(t[:8], t[8:]) and overlaps(t[:8], t[7:]) and overlaps(t.numpy(), t)
    m = mc.Mesh([0, 1], ("x",))
    p = mc.Program.reshard(mc.Layout(m, ("x",)), mc.Layout(m, (None, "x")), shape=(4, 4), dtype="float32")
    x = torch.arange(16.0).reshape(4, 4)
    flat = torch.zeros(16)
    out = {0: flat[:8].view(4, 2), 1: flat[8:].view(4, 2)}
    y = p({0: x[:2].clone(), 1: x[2:].clone()}, out=out)
    assert y[0] is out[0] and torch.equal(flat.view(2, 4, 2)[1], x[:, 2:])


def test_program_constructors_check_shape_and_dtype_as_the_eager_calls_do():
    # found by an audit: a 0-d gather tile raised ZeroDivisionError, op="avg" on integers
    # truncated silently (the eager call refuses it), dtype=None meant float64
    m = mc.Mesh(np.arange(4), ("x",))
    for op in ("all_gather", "gather"):
        with pytest.raises(ValueError, match="dim=0 is out of range for tiles with 0 dimension"):
            getattr(mc.Program, op)(m, "x", shape=(), dtype="float32")
    with pytest.raises(TypeError, match="op='avg' needs a floating dtype, got int64"):
        mc.Program.all_reduce(m, "x", shape=(4,), dtype="int64", op="avg")
    with pytest.raises(TypeError, match="op='avg' needs a floating dtype, got int32"):
        mc.Program.reduce_scatter(m, "x", shape=(4,), dtype="int32", op="avg")
    with pytest.raises(TypeError, match="op='sum' is not defined for bool tiles"):
        mc.Program.all_reduce(m, "x", shape=(4,), dtype="bool")
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None,))
    for make in (lambda: mc.Program.all_reduce(m, "x", shape=(4,), dtype=None),
                 lambda: mc.Program.all_to_all_v(m, "x", rows=(), dtype=None),
                 lambda: mc.Program.reshard_many({"w": src}, {"w": dst}, shapes={"w": (8,)}, dtypes={"w": None})):
        with pytest.raises(TypeError, match="dtype= is required"):
            make()
    assert mc.Program.all_reduce(m, "x", shape=(4,), dtype="float32", op="avg") is not None
