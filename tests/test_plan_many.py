"""mc.plan_many: one schedule for a batch of tensors (planners/batch.py).

Random batches (random layouts, uneven and Blocks splits, pending sums, dtypes, topologies
with several NICs, tiny buckets) are verified by mc.verify and executed message by message
by a reference executor that follows the BatchPlan contract (pack each part's boxes at its
offset, unpack in the same order), the result checked against the tensors; plus the batch
bound, coalescing, alike tensors planned once, the bucket bound, balancing over the batch,
NICs (rails) and the errors of bad input.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import meshcomm as mc
from meshcomm.batch_args import batch_entries
from meshcomm.planners import batch as pb
from meshcomm.planners.batch_bound import batch_lower_bound
from meshcomm.planners.boxes import local_slices
from meshcomm.planners.verify import PlanError
from meshcomm.reduceops import combine_
from strategies import layouts_pair

TOPOS = [mc.Topology.preset("flat"), mc.Topology(2, intra_node_gbps=50.0, inter_node_gbps=20.0, name="t2"),
         mc.Topology(4, intra_node_gbps=400.0, inter_node_gbps=100.0, name="t4x2", nics_per_node=2)]
DTYPES = ["float32", "int32", "float64", "int8", "uint16", "float16", "complex64"]


# -- a reference executor of the BatchPlan contract -------------------------------------------

def _tile(tiles, d):
    return tiles[d]


def run_batch(bp, xs: dict, seed: int = 0) -> dict:
    """Run `bp` in one process, message by message, on the global arrays `xs`; return
    {name: {dst device: tile}}."""
    src_tiles, out = [], []
    for name, p in zip(bp.names, bp.plans):
        src_tiles.append(mc.shard(xs[name], p.src, seed=seed))
        dt = p.dst.tiles(p.shape)
        zero = set(p.zero_fill)
        tiles = {}
        for d, box in dt.boxes.items():
            shape = tuple(b - a for a, b in box)
            if d in zero:
                from meshcomm.reduceops import identity
                tiles[d] = np.full(shape, identity(p.fill_op, np.dtype(p.dtype)), dtype=p.dtype)
            else:
                tiles[d] = np.full(shape, 99, dtype=p.dtype)     # garbage the plan overwrites
        out.append(tiles)

    def source(tid, t, s):
        p = bp.plans[tid]
        if t.src_buf == "src":
            return src_tiles[tid][s], p.src.tiles(p.shape).boxes[s]
        return out[tid][s], p.dst.tiles(p.shape).boxes[s]

    def pack(tid, t, s) -> bytes:
        tile, origin = source(tid, t, s)
        return b"".join(np.ascontiguousarray(tile[local_slices(b, origin)]).tobytes() for b in t.boxes)

    def unpack(tid, t, d, data: bytes) -> None:
        p = bp.plans[tid]
        origin = p.dst.tiles(p.shape).boxes[d]
        pos = 0
        for b in t.boxes:
            sl = local_slices(b, origin)
            view = out[tid][d][sl]
            n = view.size * p.itemsize
            out[tid][d][sl] = np.frombuffer(data[pos:pos + n], dtype=p.dtype).reshape(view.shape)
            pos += n

    for m in bp.transfers:
        parts = [(tid, bp.plans[tid].transfers[xi]) for tid, xi in m.parts]
        if m.kind == "reduce":
            bufs = []
            for s in m.srcs:                    # each contributor packs the whole message
                buf = bytearray(m.nbytes)
                for (tid, t), off in zip(parts, m.offsets):
                    data = pack(tid, t, s)
                    buf[off:off + len(data)] = data
                bufs.append(buf)
            for (tid, t), off in zip(parts, m.offsets):
                p = bp.plans[tid]
                acc = None
                for buf in bufs:                # combined in srcs order, per part's dtype
                    v = np.frombuffer(bytes(buf[off:off + t.nbytes]), dtype=p.dtype).copy()
                    acc = v if acc is None else combine_(acc, v, p.reduce_op)
                unpack(tid, t, m.dsts[0], acc.tobytes())
            continue
        buf = bytearray(m.nbytes)               # the root packs every part at its offset
        for (tid, t), off in zip(parts, m.offsets):
            data = pack(tid, t, m.srcs[0])
            assert len(data) == t.nbytes
            buf[off:off + len(data)] = data
        for d in m.dsts:                        # every receiver unpacks in the same order
            for (tid, t), off in zip(parts, m.offsets):
                unpack(tid, t, d, bytes(buf[off:off + t.nbytes]))
    return {name: out[i] for i, name in enumerate(bp.names)}


def check_values(bp, xs, result) -> None:
    for name, p in zip(bp.names, bp.plans):
        got = mc.unshard(result[name], p.dst)
        want = xs[name]
        if np.dtype(p.dtype).kind in "fc":
            tol = 2e-2 if np.dtype(p.dtype).itemsize == 2 else 1e-5    # float16: random addends round
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=str(name))
        else:
            np.testing.assert_array_equal(got, want, err_msg=str(name))


def global_array(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "fc":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


# -- random batches -------------------------------------------------------------------------------

@st.composite
def batches(draw):
    n = draw(st.integers(1, 4))
    shapes, src, dst, dtypes = {}, {}, {}, {}
    for i in range(n):
        shape, s, d = draw(layouts_pair(max_devices=8, max_size=7))
        name = f"t{i}"
        shapes[name], src[name], dst[name] = shape, s, d
        dtypes[name] = draw(st.sampled_from(DTYPES))
    if draw(st.booleans()):             # a copy of an earlier tensor: alike, planned once
        shapes["same"], src["same"], dst["same"] = shapes["t0"], src["t0"], dst["t0"]
        dtypes["same"] = dtypes["t0"]
    bucket = draw(st.sampled_from([None, 64 / 2 ** 20, 300 / 2 ** 20]))
    return shapes, dtypes, src, dst, draw(st.sampled_from(TOPOS)), bucket


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(0, 3))
def test_random_batches_verify_run_and_respect_the_bound(case, seed):
    shapes, dtypes, src, dst, topo, bucket = case
    p = mc.plan_many(shapes, dtypes, src, dst, topology=topo, bucket_mb=bucket)
    mc.verify(p)
    xs = {n: global_array(shapes[n], dtypes[n], seed) for n in shapes}
    check_values(p, xs, run_batch(p, xs, seed=seed))
    lb = batch_lower_bound(batch_entries(shapes, dtypes, src, dst), topo)
    assert p.simulate(topo) >= lb.seconds * (1 - 1e-9)
    assert p.max_link_bytes(topo, "nic") >= lb.nic


def test_a_batch_of_every_kind_runs():
    """Uneven, Blocks, a pending sum passed through, one reduced, a partial dst, several
    dtypes, one Layout for many names and one dtype for some."""
    m1 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    m2 = mc.Mesh([4, 5, 6], "z")
    shapes = {"uneven": (7, 5), "blocks": (9, 4), "partial": (6, 6), "reduced": (5, 8), "pdst": (8, 3),
              "scalar": (), "flags": (6, 2)}
    src = {"uneven": mc.Layout(m1, ("x", "y")), "blocks": mc.Layout(m1, (mc.Blocks("x", [2, 7]),)),
           "partial": mc.Layout(m1, ("x",), partial=("y",)), "reduced": mc.Layout(m1, (None, "y"), partial=("x",)),
           "pdst": mc.Layout(m1, ("y",)), "scalar": mc.Layout(m1, ()), "flags": mc.Layout(m1, ("y", "x"))}
    m3 = mc.Mesh([[4, 5]], ("a", "b"))
    dst = {"uneven": mc.Layout(m2, (None, "z")), "blocks": mc.Layout(m2, (mc.Blocks("z", [3, 0, 6]),)),
           "partial": mc.Layout(mc.Mesh([[2, 3], [4, 5]], ("u", "v")), ("u",), partial=("v",)),
           "reduced": mc.Layout(m2, ("z",)), "pdst": mc.Layout(m3, ("b",), partial=("a",)),
           "scalar": mc.Layout(m2, ()), "flags": mc.Layout(m2, ())}
    dtypes = {"uneven": "float32", "blocks": "int16", "partial": "int64", "reduced": "float64",
              "pdst": "int32", "scalar": "complex64", "flags": "bool"}
    topo = mc.Topology(2, name="t2", nics_per_node=2)
    p = mc.plan_many(shapes, dtypes, src, dst, topology=topo, bucket_mb=100 / 2 ** 20)
    mc.verify(p)
    assert p.buckets > 1
    xs = {n: global_array(shapes[n], dtypes[n], 1) for n in shapes}
    check_values(p, xs, run_batch(p, xs, seed=5))
    assert "scalar" in p.explain(limit=None)
    # the per-tensor plans are plans in their own right: the local backend runs them
    from meshcomm.backends.local import LocalBackend
    for name in ("uneven", "reduced"):
        q = p.plan_of(name)
        out = LocalBackend().execute(q, mc.shard(xs[name], q.src, seed=2), like=xs[name])
        np.testing.assert_allclose(mc.unshard(out, q.dst), xs[name], rtol=1e-6)


# -- coalescing, alike tensors, buckets -------------------------------------------------------------

def _pairs():
    a = mc.Mesh([0, 1, 2, 3], "x")
    b = mc.Mesh([4, 5, 6, 7], "x")
    return mc.Layout(a, ("x",)), mc.Layout(b, ("x",))


def test_one_message_per_pair_per_bucket():
    src, dst = _pairs()
    shapes = {f"w{i}": (8, 3 + i % 3) for i in range(40)}
    p = mc.plan_many(shapes, "float32", src, dst, topology="flat")
    assert p.buckets == 1
    assert len(p.transfers) == 4                        # one per (i, i + 4)
    assert sorted((m.srcs, m.dsts) for m in p.transfers) == [((i,), (i + 4,)) for i in range(4)]
    assert all(len(m.parts) == 40 for m in p.transfers)
    seen = [(m.kind, m.srcs, m.dsts, m.stage, m.src_buf, m.bucket) for m in p.transfers]
    assert len(seen) == len(set(seen))


def test_broadcast_groups_merge_across_tensors():
    src = mc.Layout(mc.Mesh([0], "x"), ())
    dst = mc.Layout(mc.Mesh([1, 2, 3], "y"), ())                 # every tensor to all three
    shapes = {f"b{i}": (5, i + 1) for i in range(12)}
    p = mc.plan_many(shapes, "int32", src, dst, topology="flat")
    assert len(p.transfers) == 1 and p.transfers[0].kind == "bcast"
    assert len(p.transfers[0].parts) == 12


def test_alike_tensors_are_planned_once():
    mc.clear_caches()
    src, dst = _pairs()
    other = mc.Layout(mc.Mesh([4, 5, 6, 7], "x"), (None, "x"))
    shapes = {f"w{i}": (8, 8) for i in range(50)}
    shapes["odd"] = (8, 8)
    before = pb.PLANNED["pieces"]
    p = mc.plan_many(shapes, "float32", src, {**dict.fromkeys(shapes, dst), "odd": other}, topology="flat")
    assert pb.PLANNED["pieces"] - before == 2
    assert p.classes == 2
    mc.verify(p)
    # cached: the same call gives the same plan, planned again after clear_caches
    assert mc.plan_many(shapes, "float32", src, {**dict.fromkeys(shapes, dst), "odd": other}, topology="flat") is p
    mc.clear_caches()
    assert mc.plan_many(shapes, "float32", src, {**dict.fromkeys(shapes, dst), "odd": other}, topology="flat") is not p


def test_buckets_bound_what_a_process_stages():
    src, dst = _pairs()
    shapes = {f"w{i}": (64, 16) for i in range(10)}          # 4 KiB per tensor, 1 KiB per piece
    p = mc.plan_many(shapes, "float32", src, dst, topology="flat", bucket_mb=2048 / 2 ** 20)
    assert p.bucket_bytes == 2048
    assert p.buckets >= 10 * 4096 / 4 // 2048               # every device moves 10 KiB
    staged = p.staged()
    assert max(staged.values()) <= 2048
    mc.verify(p)
    buckets = [m.bucket for m in p.transfers]
    assert buckets == sorted(buckets)
    # a piece larger than a bucket is cut into runs that fit
    big = mc.plan_many({"big": (256, 16)}, "float32", src, dst, topology="flat", bucket_mb=2048 / 2 ** 20)
    assert max(big.staged().values()) <= 2048 and big.buckets > 1
    mc.verify(big)
    # the verifier catches a bucket over the bound
    bad = dataclasses.replace(p, transfers=tuple(dataclasses.replace(m, bucket=0) for m in p.transfers))
    with pytest.raises(PlanError, match="over the bucket"):
        mc.verify(bad)


def test_window_of_two_buckets_in_the_simulator():
    src, dst = _pairs()
    shapes = {f"w{i}": (64, 16) for i in range(10)}
    p = mc.plan_many(shapes, "float32", src, dst, topology="flat", bucket_mb=2048 / 2 ** 20)
    free = dataclasses.replace(p, bucket_window=None)
    assert p.simulate() >= free.simulate() * (1 - 1e-12)
    from meshcomm.planners.simulate import simulate_detailed
    r = simulate_detailed(p, p.topology)
    for d in range(8):                  # no device starts bucket b + 2 before bucket b ended
        mine = [(m.bucket, r.start[i], r.end[i]) for i, m in enumerate(p.transfers) if d in m.participants]
        for b, s, _ in mine:
            assert all(e <= s + 1e-15 for b2, _, e in mine if b2 <= b - 2)


def test_verify_catches_a_broken_batch():
    src, dst = _pairs()
    p = mc.plan_many({"a": (8, 4), "b": (8, 4)}, "float32", src, dst, topology="flat")
    m = p.transfers[0]
    lost = dataclasses.replace(m, parts=m.parts[:1], offsets=m.offsets[:1], nbytes=p.plan_of("a").transfers[0].nbytes)
    with pytest.raises(PlanError, match="in no message"):
        mc.verify(dataclasses.replace(p, transfers=(lost,) + p.transfers[1:]))
    shifted = dataclasses.replace(m, offsets=(m.offsets[0], m.offsets[1] + 1), nbytes=m.nbytes + 1)
    with pytest.raises(PlanError, match="unaligned"):
        mc.verify(dataclasses.replace(p, transfers=(shifted,) + p.transfers[1:]))


# -- balancing over the batch, NICs -------------------------------------------------------------------

def test_senders_are_balanced_over_the_whole_batch():
    """Tensor a is held on nodes 0 and 1, tensor b on node 0 only; both go to node 2. Planned
    one by one, a goes at best half from each node, so node 0 sends b and at least half of
    a; planned as one batch, a goes from node 1 and the busiest NIC carries less."""
    topo = mc.Topology(1, name="flat1")
    a_src = mc.Layout(mc.Mesh([0, 1], "r"), ())
    b_src = mc.Layout(mc.Mesh([0], "r"), ())
    dst = mc.Layout(mc.Mesh([2], "d"), ())
    shapes = {"a": (1024,), "b": (1024,)}
    p = mc.plan_many(shapes, "float32", {"a": a_src, "b": b_src}, dst, topology=topo)
    mc.verify(p)
    one_by_one = max(mc.plan(shapes["a"], "float32", a_src, dst, topology=topo).link_loads(topo).get(("nic_out", 0), 0)
                     + mc.plan(shapes["b"], "float32", b_src, dst, topology=topo).link_loads(topo).get(("nic_out", 0), 0),
                     0)
    loads = p.link_loads(topo)
    assert loads[("nic_out", 0)] == 4096 and loads[("nic_out", 1)] == 4096
    assert one_by_one >= 4096 + 2048 > max(v for (k, _), v in loads.items() if k == "nic_out")


def test_one_nic_per_gpu():
    topo = mc.Topology(8, intra_node_gbps=8 * 900.0, inter_node_gbps=8 * 400.0, name="rails", nics_per_node=8)
    assert mc.Topology.preset("dgx-h100").nics_per_node == 8
    assert topo.nic_of(11) == 8 + 3 and topo.nic_bytes_per_s == 50e9
    with pytest.raises(ValueError, match="nics_per_node"):
        mc.Topology(8, nics_per_node=3)
    # a node's GPUs all hold a tensor that every GPU of the next node needs: each sends
    # over its own NIC, an eighth each; the bound says the same
    src = mc.Layout(mc.Mesh(list(range(8)), "x"), ())
    dst = mc.Layout(mc.Mesh(list(range(8, 16)), "x"), ())
    shapes = {f"t{i}": (1 << 24,) for i in range(8)}
    p = mc.plan_many(shapes, "float32", src, dst, topology=topo)
    mc.verify(p)
    total = 8 * 4 << 24
    lb = batch_lower_bound(batch_entries(shapes, "float32", src, dst), topo)
    assert lb.nic == total // 8
    assert p.max_link_bytes(topo, "nic") <= total // 8 * 1.01
    assert p.simulate(topo) <= lb.seconds * 1.3
    one_nic = dataclasses.replace(topo, nics_per_node=1)
    assert p.simulate(one_nic) < p.simulate(topo)       # the same bytes, one NIC of 8x the bandwidth each way
    # a single message between two nodes runs at one NIC's bandwidth
    q = mc.plan((1 << 20,), "uint8", mc.Layout(mc.Mesh([3], "x"), ()), mc.Layout(mc.Mesh([13], "x"), ()), topology=topo)
    assert q.link_loads(topo) == {("nic_out", 3): 1 << 20, ("nic_in", 8 + 5): 1 << 20}
    assert q.simulate(topo) == pytest.approx((1 << 20) / 50e9 + topo.inter_node_latency_s, rel=1e-6)


# -- bad input ----------------------------------------------------------------------------------------

def test_bad_input_names_the_tensor():
    src, dst = _pairs()
    shapes = {"a": (8, 4), "b": (8, 4)}
    with pytest.raises(ValueError, match="no entry for tensor 'b'"):
        mc.plan_many(shapes, {"a": "float32"}, src, dst)
    with pytest.raises(ValueError, match="tensor 'c', which shapes does not name"):
        mc.plan_many(shapes, "float32", {"a": src, "b": src, "c": src}, dst)
    with pytest.raises(ValueError, match="dst has no entry for tensor 'a'"):
        mc.plan_many(shapes, "float32", src, {"b": dst})
    with pytest.raises(TypeError, match="tensor 'b': src must be a meshcomm.Layout"):
        mc.plan_many(shapes, "float32", {"a": src, "b": "x"}, dst)
    with pytest.raises(TypeError, match="src must be a meshcomm.Layout or a dict"):
        mc.plan_many(shapes, "float32", "x", dst)
    with pytest.raises(ValueError, match="tensor 'b'.*Blocks"):
        mc.plan_many(shapes, "float32", {"a": src, "b": mc.Layout(src.mesh, (mc.Blocks("x", [1, 1, 1, 1]),))}, dst)
    with pytest.raises(ValueError, match="tensor 'a'.*1 dimension"):
        mc.plan_many({"a": (8,), "b": (8, 4)}, "float32", mc.Layout(src.mesh, (None, None, "x")), dst)
    with pytest.raises(TypeError, match="tensor 'b': unknown dtype"):
        mc.plan_many(shapes, {"a": "float32", "b": "nonsense"}, src, dst)
    with pytest.raises(TypeError, match="tensor 'a'.*shape"):
        mc.plan_many({"a": 3.5}, "float32", src, dst)
    with pytest.raises(TypeError, match="shapes must be a dict"):
        mc.plan_many([(8, 4)], "float32", src, dst)
    with pytest.raises(ValueError, match="bucket_mb"):
        mc.plan_many(shapes, "float32", src, dst, bucket_mb=0)
    with pytest.raises(TypeError, match="bucket_mb"):
        mc.plan_many(shapes, "float32", src, dst, bucket_mb="big")
    with pytest.raises(TypeError, match="dtypes must be"):
        mc.plan_many(shapes, None, src, dst)
    pmin = mc.Layout(src.mesh, (), partial={"x": "max"})
    with pytest.raises(ValueError, match="tensor 'a'.*complex"):
        mc.plan_many({"a": (4,)}, "complex64", pmin, dst)
    # a cached good call does not let a bad one through: a shape of floats equal to ints
    mc.plan_many({"a": (8, 4)}, "float32", src, dst)
    with pytest.raises(TypeError, match="tensor 'a'"):
        mc.plan_many({"a": (8.0, 4)}, "float32", src, dst)
    assert len(mc.plan_many({}, "float32", src, dst).transfers) == 0


_SAME_EVERYWHERE = """
import hashlib, meshcomm as mc
L = lambda devs: mc.Layout(mc.Mesh(devs, "r"), ())
holders = [[0, 1], [1, 2], [2, 0], [0, 1, 2], [1, 3], [3, 0]]     # overlapping sender sets: a max-flow
shapes = {f"t{i}": (1000 + 17 * i,) for i in range(len(holders))}
p = mc.plan_many(shapes, "float32", {f"t{i}": L(h) for i, h in enumerate(holders)}, L([5]), topology="flat")
print(hashlib.sha1(repr([(m.srcs, m.dsts, m.parts) for m in p.transfers] + [q.transfers for q in p.plans]).encode()).hexdigest())
"""


def test_every_process_plans_the_same_batch():
    """Processes hash strings differently (PYTHONHASHSEED): the plan must not depend on it
    (the flow over sender NICs once did, through networkx's sets of string-labelled nodes)."""
    root = Path(__file__).resolve().parent.parent
    digests = set()
    for seed in ("1", "6"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(root))
        r = subprocess.run([sys.executable, "-c", _SAME_EVERYWHERE], capture_output=True, text=True, env=env,
                           cwd=root, timeout=300)
        assert r.returncode == 0, r.stderr
        digests.add(r.stdout.strip())
    assert len(digests) == 1
