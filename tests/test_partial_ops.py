"""Pending reductions other than sum: layouts whose partial axes reduce by prod, min or max.

Random meshes and layout pairs (tests/strategies.py) get random ops on both sides; every
executor path of one process (the local backend, the shared executor's local steps, the
packed-message path of meshcomm.cuda on CPU) must give the same bits, and unshard must give
the data back. The verifier proves every plan and refuses forged ones. One mpiexec launch
runs op cases over MPI and torch with the backends' collective reduce forced.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import meshcomm as mc
from meshcomm.arrays import numpy_dtype
from meshcomm.planners.boxes import box_size
from meshcomm.backends.base import Backend
from meshcomm.backends.batch import execute
from meshcomm.backends.local import LocalBackend
from meshcomm.backends.pack import unpack
from meshcomm.cuda.executor import execute_packed
from meshcomm.planners import PlanError
from meshcomm.reduceops import PARTIAL_OPS, combine, identity
from strategies import layouts_pair

OPS = ("prod", "min", "max")
NP_DTYPES = ("int32", "int64", "uint8", "int8", "float32", "float64", "float16", "bfloat16", "bool", "int16",
             "uint16", "uint32", "uint64")
TORCH_DTYPES = {"float32": torch.float32, "int32": torch.int32, "int64": torch.int64,
                "uint8": torch.uint8, "bfloat16": torch.bfloat16, "bool": torch.bool, "int16": torch.int16,
                "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64}
UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def with_op(layout, op):
    if not layout.partial:
        return layout
    return mc.Layout(layout.mesh, layout.spec, partial=dict.fromkeys(layout.partial, op))


def make_array(shape, dtype, kind, seed=0):
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    if dt.kind == "b":
        a = rng.random(shape) < 0.5
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(max(info.min, -100), min(info.max, 100), size=shape).astype(dt)
    else:
        a = (rng.standard_normal(shape) * 4).astype(np.float32).astype(dt)
    a = np.asarray(a, dtype=dt)                 # shape (): an array, not a NumPy scalar
    if kind == "torch":
        if dtype == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(a, copy=True))     # (ascontiguousarray makes 0-d 1-d)
    return a


def same(a, b) -> bool:
    if type(a) is not type(b) or tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return a.tobytes() == b.tobytes()        # bitwise (NaN-free data; -0.0 counts)


def every_executor(plan, shards, like):
    """{path name: dst tiles} from the three single-process paths."""
    big = 1 << 30
    out = {"local": LocalBackend().execute(plan, shards, like),
           "packed": execute_packed(plan, shards, like)}
    out["shared"] = execute(plan, shards, like, rank=0, devices_per_process=big, backend=Backend(), deadline=None)
    return out


def check(shape, src, dst, dtype, kind, seed):
    x = make_array(shape, dtype, kind, seed=seed or 0)
    shards = mc.shard(x, src, seed=seed)
    assert same(mc.unshard(shards, src), x), f"unshard(shard(x)) for {src}"
    p = mc.plan(shape, x.dtype, src, dst)
    mc.verify(p)
    mc.verify(p, devices_per_process=2)
    assert p.reduce_op == src.partial_op and p.fill_op == dst.partial_op
    results = every_executor(p, shards, x)
    ref = results["local"]
    for name, got in results.items():
        for d in dst.mesh.device_ids:
            assert same(got[d], ref[d]), f"{name} differs from local on device {d}: {src} -> {dst}"
    imap = dst.index_map(shape)
    if not dst.is_partial:
        for d, v in ref.items():
            assert same(v, x[imap[d]] if imap[d] else x), f"dst tile of device {d}: {src} -> {dst}"
    assert same(mc.unshard(ref, dst), x), f"unshard(reshard(shard(x))) for {src} -> {dst}"
    return p


# -- random cases -------------------------------------------------------------------------

@settings(max_examples=150)
@given(case=layouts_pair(max_devices=12, min_tensor_ndim=0), op=st.sampled_from(OPS),
       dst_op=st.sampled_from(PARTIAL_OPS + ("same",)), dtype=st.sampled_from(NP_DTYPES),
       seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_random_numpy(case, op, dst_op, dtype, seed):
    shape, src, dst = case
    dst_op = op if dst_op == "same" or (dtype == "bool" and dst_op == "sum") else dst_op
    check(shape, with_op(src, op), with_op(dst, dst_op), dtype, "numpy", seed)


@settings(max_examples=60)
@given(case=layouts_pair(max_devices=8, min_tensor_ndim=0), op=st.sampled_from(OPS),
       dst_op=st.sampled_from(PARTIAL_OPS), dtype=st.sampled_from(list(TORCH_DTYPES)),
       seed=st.one_of(st.none(), st.integers(0, 2**16)))
def test_random_torch(case, op, dst_op, dtype, seed):
    shape, src, dst = case
    dst_op = op if dtype == "bool" and dst_op == "sum" else dst_op
    check(shape, with_op(src, op), with_op(dst, dst_op), dtype, "torch", seed)


@settings(max_examples=60)
@given(case=layouts_pair(max_devices=12), op=st.sampled_from(OPS))
def test_same_routes_as_a_sum(case, op):
    # the op is the executor's business: a plan keeps the routes of the pending-sum plan
    # (the dst's op matters only where it differs from the src's: then nothing passes
    # through unreduced)
    # except one thing: two addends under sum or prod may be reduced at each needer (either
    # order gives the same bits), under min or max not (min(0., -0.) and min(-0., 0.) differ)
    shape, src, dst = case
    plain = mc.plan(shape, "int32", src, dst)
    other = mc.plan(shape, "int32", with_op(src, op), with_op(dst, op))
    if (other.transfers, other.zero_fill) != (plain.transfers, plain.zero_fill):
        assert src.num_addends == 2 and op in ("min", "max"), (op, plain.explain(), other.explain())
        assert _reduced(other) < _reduced(plain), (op, plain.explain(), other.explain())
    if src.is_partial:
        assert other.fingerprint != plain.fingerprint
        assert other.reduce_op == op and plain.reduce_op == "sum"


def _reduced(p) -> int:
    return sum(box_size(b) for t in p.transfers if t.kind == "reduce" for b in t.boxes)


# -- fixed cases: the op really is applied, in the plan's order ---------------------------

def _three_to_one(op, dtype="float32"):
    src = mc.Layout(mc.Mesh([0, 1, 2], ("x",)), (None,), partial={"x": op})
    dst = mc.Layout(mc.Mesh([3], ("x",)), (None,))
    rng = np.random.default_rng(1)
    shards = {d: (rng.standard_normal(7) * 3).astype(dtype) for d in (0, 1, 2)}
    return src, dst, shards


@pytest.mark.parametrize("op", PARTIAL_OPS)
def test_three_addends_reduce_in_plan_order(op):
    src, dst, shards = _three_to_one(op)
    p = mc.plan((7,), "float32", src, dst)
    (t,) = [t for t in p.transfers if t.kind == "reduce"]
    want = functools.reduce(UFUNC[op], [shards[s] for s in t.srcs])
    for name, got in every_executor(p, shards, shards[0]).items():
        assert got[3].tobytes() == want.tobytes(), name
    got = mc.reshard({d: torch.from_numpy(v) for d, v in shards.items()}, src, dst)
    assert got[3].numpy().tobytes() == want.tobytes()
    if op != "sum":
        assert "reduce transfers take the " + op in p.explain()


@pytest.mark.parametrize("op", OPS)
def test_partial_dst_starts_as_the_identity(op):
    # a plain src into a pending dst: one group gets the value, the others the identity
    mesh = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    src = mc.Layout(mc.Mesh([4], ("x",)), ("x",))
    dst = mc.Layout(mesh, ("y",), partial={"x": op})
    x = np.arange(10, 18, dtype=np.int16)           # none of them an identity
    p = mc.plan(x.shape, x.dtype, src, dst)
    assert p.zero_fill and p.fill_op == op
    assert f"{op}-identity-filled" in p.explain()
    out = mc.reshard(mc.shard(x, src), src, dst)
    ident = identity(op, np.int16)
    for box in ({0, 2}, {1, 3}):
        vals = np.stack([out[d] for d in sorted(box)])
        assert ((vals == ident).sum(axis=0) == 1).all(), vals   # one holder per element
    assert same(mc.unshard(out, dst), x)


def test_max_to_sum_reduces_before_splitting():
    # pending max over x -> pending sum over x (same number of addends): passing addends
    # through would make a sum of maxima; the plan reduces instead
    mesh = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    src = mc.Layout(mesh, ("y",), partial={"x": "max"})
    dst = mc.Layout(mesh, ("y",), partial={"x": "sum"})
    p = mc.plan((6,), "float64", src, dst)
    assert p.counts["reduce"] > 0 and p.zero_fill
    x = np.linspace(-3, 3, 6)
    out = mc.reshard(mc.shard(x, src, seed=3), src, dst)
    assert same(mc.unshard(out, dst), x)
    keep = mc.plan((6,), "float64", src, with_op(dst, "max"))
    assert keep.counts["reduce"] == 0                 # same op: addends pass through


# -- the verifier ------------------------------------------------------------------------

def test_verifier_refuses_a_passthrough_across_ops():
    mesh = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    src = mc.Layout(mesh, ("y",), partial={"x": "max"})
    dst = mc.Layout(mesh, ("y",), partial={"x": "max"})
    p = mc.plan((6,), "float32", src, dst)
    mc.verify(p)
    forged = dataclasses.replace(p, dst=with_op(dst, "sum"))
    with pytest.raises(PlanError, match="partly reduced.*max.*sum"):
        mc.verify(forged)


def test_verifier_still_refuses_a_double_addend_for_idempotent_ops():
    src, dst, _ = _three_to_one("max")
    p = mc.plan((7,), "float32", src, dst)
    i = next(i for i, t in enumerate(p.transfers) if t.kind == "reduce")
    t = p.transfers[i]
    bad = dataclasses.replace(t, srcs=(t.srcs[0],) + t.srcs[:1] + t.srcs[2:])
    with pytest.raises(PlanError):
        mc.verify(dataclasses.replace(p, transfers=p.transfers[:i] + (bad,) + p.transfers[i + 1:]))


# -- layouts, ops and dtypes ---------------------------------------------------------------

def test_layout_ops_equality_hash_str_pickle():
    import pickle
    mesh = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    a = mc.Layout(mesh, ("y",), partial={"x": "max"})
    assert a.partial == ("x",) and a.partial_op == "max"
    assert str(a).endswith("P(x;max)") and "max" in repr(a)
    assert pickle.loads(pickle.dumps(a)) == a
    s = mc.Layout(mesh, ("y",), partial=("x",))
    assert s == mc.Layout(mesh, ("y",), partial={"x": "sum"}) and hash(s) == hash(mc.Layout(mesh, ("y",), partial="x"))
    assert str(s).endswith("P(x)") and s.partial_op == "sum"
    assert a != s and a != mc.Layout(mesh, ("y",), partial={"x": "min"})
    assert mc.Layout(mesh, (), partial={"x": "prod", "y": "prod"}).partial_op == "prod"
    assert mc.Layout(mesh, (), partial={}).partial_op == "sum"
    with pytest.raises(ValueError, match="one reduction op.*'x': 'max'.*'y': 'sum'"):
        mc.Layout(mesh, (), partial={"x": "max", "y": "sum"})
    with pytest.raises(ValueError, match="'y'.*'avg'.*sum, then divide"):
        mc.Layout(mesh, (), partial={"y": "avg"})


def test_complex_min_max_refused_prod_allowed():
    mesh = mc.Mesh([0, 1], ("x",))
    src = mc.Layout(mesh, (), partial={"x": "max"})
    with pytest.raises(ValueError, match="'max'.*complex64"):
        mc.plan((3,), "complex64", src, mc.Layout(mesh, ()))
    with pytest.raises(ValueError, match="complex"):
        mc.shard(np.ones(3, np.complex64), src)
    prod = with_op(src, "prod")
    x = np.array([1 + 2j, -3j, 0.5], np.complex64)
    out = mc.reshard(mc.shard(x, prod, seed=4), prod, mc.Layout(mesh, ()))
    # equal values (complex products by -1 may flip the sign of a zero part)
    assert np.array_equal(out[0], x) and np.array_equal(out[1], x)


def test_identities():
    import ml_dtypes
    assert identity("min", np.float32) == np.inf and identity("max", np.float16) == -np.inf
    assert identity("max", np.int8) == -128 and identity("min", np.uint16) == 65535
    assert identity("min", np.bool_) is True and identity("max", np.bool_) is False
    assert identity("prod", np.int64) == 1 and identity("sum", np.float64) == 0
    assert identity("max", ml_dtypes.bfloat16) == -np.inf
    assert identity("min", ml_dtypes.float8_e4m3fn) == 448       # no inf: the largest finite
    assert identity("min", torch.float32) == math.inf and identity("max", torch.int32) == -2**31
    assert identity("min", torch.float8_e4m3fn) == 448 and identity("max", torch.bool) is False


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("op", PARTIAL_OPS)
def test_unpack_combines_by_op(kind, op):
    tile = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    buf = np.array([3, -1, 7, 0, 2, 2], np.float32)
    sl = [(slice(0, 2), slice(1, 3)), (slice(2, 3), slice(0, 2))]
    want = tile.copy()
    want[0:2, 1:3] = UFUNC[op](want[0:2, 1:3], buf[:4].reshape(2, 2))
    want[2:3, 0:2] = UFUNC[op](want[2:3, 0:2], buf[4:].reshape(1, 2))
    if kind == "torch":
        tile, buf = torch.from_numpy(tile), torch.from_numpy(buf)
    unpack(buf, tile, sl, accumulate=True, op=op)
    assert np.array_equal(np.asarray(tile), want)
    assert np.array_equal(np.asarray(combine(tile, tile, op)), UFUNC[op](want, want))


@pytest.mark.parametrize("op", OPS)
def test_seeded_shards_hide_the_value(op):
    # with a seed the other contributors hold random values that leave the result alone, and
    # which device holds the value itself varies by element
    mesh = mc.Mesh([[0, 1, 2], [3, 4, 5]], ("x", "y"))
    lay = mc.Layout(mesh, (None,), partial={"x": op, "y": op})
    for dtype in ("float32", "int16", "uint8", "bool"):
        x = make_array((200,), dtype, "numpy", seed=5)
        sh = mc.shard(x, lay, seed=9)
        assert same(mc.unshard(sh, lay), x)
        held = np.stack([sh[d] == x for d in mesh.device_ids])
        if dtype != "bool":
            assert (held.sum(axis=1) < 200).all(), f"{op} {dtype}: some device holds x unchanged"
            assert len({int(np.argmax(held[:, i])) for i in range(200)}) > 1
        plain = mc.shard(x, lay)
        assert same(plain[0], x)
        assert all((plain[d] == identity(op, x.dtype)).all() for d in mesh.device_ids[1:])


# -- real processes -------------------------------------------------------------------------

@pytest.mark.mpi
def test_mpiexec_op_cases_through_collective_reduces(tmp_path):
    # MPI's Ireduce and gloo's reduce with PROD/MIN/MAX (native collectives, and floats too:
    # seeded prod/min/max splits are exact in any order), checked bitwise against local
    from test_distributed import mpiexec
    cases = 30
    # (--reduce collective: backends.base.REDUCE_MODE, so MPI reduces collectively inside
    # one host too)
    res = mpiexec(4, "--init", "mixed", "--backends", "mpi,torch", "--cases", "0",
                  "--op-cases", str(cases), "--seed", "3", "--reduce", "collective", out=tmp_path / "out")
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    for r in res:
        assert r["ok_op_mpi"] == cases and r["ok_op_torch"] == cases, r
        assert r.get("issued_mpi_reduce", 0) > 0 and r.get("issued_torch_reduce", 0) > 0, r
    for op in OPS:
        assert res[0].get(f"reduce3_{op}", 0) > 0, (op, res[0])
