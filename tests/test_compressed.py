"""Compressed collectives and reshards: one process against zfpy's round trip and the error
bounds, the message layout and the cost model; two short launches (4 processes on mpi and
torch in one, 2 processes x 2 devices in the other) through tests/workers/compressed_worker.py."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
from meshcomm.backends import codec_cost
from meshcomm.backends.pacing import Pacer
from meshcomm.planners.compressed import (
    CodecCost,
    Compression,
    hops,
    messages,
    wire_ratio,
)
from meshcomm.planners.topology import Topology

import meshcomm as mc
from meshcomm.collectives import collective_plan
from meshcomm.compression import ZFP, Cast, zfp_shape

zfpy = pytest.importorskip("zfpy")
WORKER = Path(__file__).parent / "workers" / "compressed_worker.py"


def _rt(a, **kw):
    """zfpy's own round trip (a tile of more than 4 dims as meshcomm codes it: leading dims merged)."""
    return zfpy.decompress_numpy(zfpy.compress_numpy(a.reshape(zfp_shape(a.shape)), **kw)).reshape(a.shape)


def _tiles(mesh, shape, dtype="float32", seed=0):
    return {d: np.random.default_rng(seed + d).standard_normal(shape).astype(dtype) for d in mesh.device_ids}


@pytest.mark.parametrize("shape,dim,codec,kw", [
    ((37, 13), 0, "zfp(rate=8)", {"rate": 8}),
    ((37, 13), 1, ZFP(tolerance=1e-3), {"tolerance": 1e-3}),
    ((9, 6, 5), 2, ZFP(precision=12), {"precision": 12}),
    ((3, 2, 4, 5, 6), 0, ZFP(rate=16), {"rate": 16}),
])
def test_all_gather_is_the_per_tile_round_trip(monkeypatch, shape, dim, codec, kw):
    monkeypatch.setenv("MESHCOMM_COMPRESSION_CHUNK", "512")       # several chunks per tile
    mesh = mc.Mesh(np.arange(6).reshape(2, 3), ("a", "b"))
    xs = _tiles(mesh, shape)
    out = mc.all_gather(xs, mesh, "b", dim=dim, compression=codec)
    for g in mc.collectives.groups(mesh, ("b",)):
        ref = np.concatenate([_rt(xs[d], **kw) for d in g], axis=dim)
        for d in g:
            assert np.array_equal(out[d], ref), d


def test_reduce_scatter_errors_within_the_documented_bounds(monkeypatch):
    mesh = mc.Mesh(list(range(8)), ("x",))
    xs = _tiles(mesh, (64, 9), seed=3)
    exact = np.sum(np.stack(list(xs.values())).astype(np.float64), axis=0)
    t = 1e-3
    errs = {}
    for algo in ("oneshot", "ring"):
        monkeypatch.setattr(codec_cost, "REDUCE_ALGORITHM", algo)
        out = mc.reduce_scatter(xs, mesh, "x", compression=ZFP(tolerance=t))
        got = np.concatenate([out[d] for d in mesh.device_ids])
        errs[algo] = np.abs(got - exact).max()
        assert errs[algo] <= 7 * t + 8 * 2.0 ** -23 * np.abs(exact).max(), (algo, errs[algo])
        assert errs[algo] > 0                                       # it did compress
    # fixed rate: the ring recodes growing partial sums, one-shot each addend once
    monkeypatch.setattr(codec_cost, "REDUCE_ALGORITHM", "oneshot")
    one = np.concatenate(list(mc.reduce_scatter(xs, mesh, "x", compression="zfp(rate=12)").values()))
    monkeypatch.setattr(codec_cost, "REDUCE_ALGORITHM", "ring")
    ring = np.concatenate(list(mc.reduce_scatter(xs, mesh, "x", compression="zfp(rate=12)").values()))
    assert np.abs(one - exact).max() < np.abs(ring - exact).max()


def test_all_reduce_replicas_agree():
    mesh = mc.Mesh(list(range(4)), ("x",))
    xs = _tiles(mesh, (33,), seed=7)
    exact = np.sum(np.stack(list(xs.values())).astype(np.float64), axis=0)
    for codec in ("bf16", ZFP(tolerance=1e-3)):
        out = mc.all_reduce(xs, mesh, "x", compression=codec)
        assert all(np.array_equal(out[0], out[d]) for d in mesh.device_ids), codec
        assert np.abs(out[0] - exact).max() <= 4 * 2.0 ** -8 * np.abs(exact).max() + 4e-3



@pytest.mark.parametrize("codec", ["bf16", "fp16", ZFP(rate=16)])
def test_zero_d_tiles(codec):
    # a 0-d tile indexed by () is a scalar copy: decoding into it was lost (a TypeError)
    mesh = mc.Mesh(list(range(4)), ("x",))
    out = mc.all_reduce({d: np.array(1.5 + d, np.float32) for d in range(4)}, mesh, "x", compression=codec)
    assert all(type(v) is np.ndarray and v.shape == () and v == 12.0 for v in out.values()), out
    src, dst = mc.Layout(mc.Mesh([0, 1], ("x",)), ()), mc.Layout(mc.Mesh([2, 3, 1], ("x",)), ())
    out = mc.reshard({0: np.array(2.5, np.float32), 1: np.array(2.5, np.float32)}, src, dst, compression=codec)
    assert all(v.shape == () and v == 2.5 for v in out.values()), out

def test_reshard_within_tolerance_and_replicas_agree():
    a, b = mc.Mesh([0, 1, 2], ("x",)), mc.Mesh([[3, 4], [5, 6]], ("p", "q"))
    g = np.random.default_rng(1).standard_normal((30, 12)).astype(np.float64)
    src, dst = mc.Layout(a, ("x", None)), mc.Layout(b, (None, "q"))
    out = mc.reshard(mc.shard(g, src), src, dst, compression=ZFP(tolerance=1e-6))
    assert np.abs(mc.unshard(out, dst) - g).max() <= 1e-6
    assert np.array_equal(out[3], out[5]) and np.array_equal(out[4], out[6])
    assert not np.array_equal(mc.unshard(out, dst), g)
    out = mc.reshard(mc.shard(g.astype(np.float32), src), src, dst, compression="bf16")
    assert np.allclose(mc.unshard(out, dst), g, rtol=2.0 ** -8, atol=0)


def _with_nonfinite(xs, seed):
    """NaN, +Inf, -Inf in every tile; at some positions in several (sums NaN or Inf)."""
    rng = np.random.default_rng(seed)
    n, size = len(xs), next(iter(xs.values())).size
    pos = rng.choice(size, 3 * n + 3, replace=False)
    for q, d in enumerate(sorted(xs)):
        for j, v in enumerate((np.nan, np.inf, -np.inf)):
            xs[d].reshape(-1)[pos[3 * q + j]] = v
    a, b, c = pos[3 * n:]
    first, last = min(xs), max(xs)
    xs[first].reshape(-1)[a], xs[last].reshape(-1)[a] = np.inf, -np.inf        # NaN
    xs[first].reshape(-1)[b], xs[last].reshape(-1)[b] = np.inf, np.inf         # +Inf
    xs[last].reshape(-1)[c] = np.nan
    return xs


def _same_nonfinite(got, want):
    nan, inf = np.isnan(want), np.isinf(want)
    return (np.isnan(got) == nan).all() and (np.isinf(got) == inf).all() and (got[inf] == want[inf]).all()


@pytest.mark.parametrize("codec", [ZFP(rate=8), ZFP(tolerance=1e-3), ZFP(precision=12), "bf16", "fp16"])
def test_nan_and_inf_through_collectives_and_reshard(monkeypatch, codec):
    # ZFP gave a NaN back as -3.97 and an Inf as -2.0; bf16/fp16 turned overflows into Inf
    monkeypatch.setenv("MESHCOMM_COMPRESSION_CHUNK", "512")       # several chunks per tile
    mesh = mc.Mesh(list(range(4)), ("x",))
    xs = _with_nonfinite(_tiles(mesh, (40, 9), seed=11), 5)
    if not isinstance(codec, ZFP):                                  # finite, beyond fp16 / bf16
        xs[2][3, 3], xs[2][7, 1] = 7e4, -3.4e38
    out = mc.all_gather(xs, mesh, "x", compression=codec)
    ref = np.concatenate([xs[d] for d in range(4)])
    bad = ~np.isfinite(ref)
    for d in range(4):
        assert _bits_equal(out[d][bad], ref[bad]), (codec, d)
        assert np.isfinite(out[d][~bad]).all()
        assert np.array_equal(out[d], out[0], equal_nan=True)
    if not isinstance(codec, ZFP):
        assert out[0][87, 1] == np.float32(-3.4e38)                 # exact, not -Inf
        assert out[0][83, 3] == 7e4 if codec == "fp16" else abs(out[0][83, 3] - 7e4) <= 2.0 ** -8 * 7e4
    with np.errstate(invalid="ignore"):
        exact = np.sum(np.stack([xs[d].astype(np.float64) for d in range(4)]), axis=0)
    for algo in ("oneshot", "ring"):
        monkeypatch.setattr(codec_cost, "REDUCE_ALGORITHM", algo)
        with np.errstate(invalid="ignore"):
            ar = mc.all_reduce(xs, mesh, "x", compression=codec)
            rs = mc.reduce_scatter(xs, mesh, "x", compression=codec)
        for d in range(4):
            assert _same_nonfinite(ar[d], exact), (algo, codec, d)
        assert _same_nonfinite(np.concatenate([rs[d] for d in range(4)]), exact), (algo, codec)
    src, dst = mc.Layout(mesh, ("x", None)), mc.Layout(mc.Mesh([[4, 5], [6, 7]], ("p", "q")), (None, "q"))
    g = ref
    out = mc.reshard(mc.shard(g, src), src, dst, compression=codec)
    got = mc.unshard(out, dst)
    assert _bits_equal(got[bad], g[bad]) and np.isfinite(got[~bad]).all(), codec


def _bits_equal(a, b):
    """Bit for bit, except NaN payloads where a cast makes them canonical (bf16)."""
    return a.tobytes() == b.tobytes() or (np.array_equal(a, b, equal_nan=True)
                                          and (np.signbit(a) == np.signbit(b)).all())


def test_bad_codecs_and_dtypes_are_named():
    mesh = mc.Mesh([0, 1], ("x",))
    with pytest.raises(ValueError, match="all_gather: unknown compression 'zstd'"):
        mc.all_gather({0: np.ones(4), 1: np.ones(4)}, mesh, "x", compression="zstd")
    with pytest.raises(TypeError, match="int32"):
        mc.all_gather({d: np.ones(4, np.int32) for d in (0, 1)}, mesh, "x", compression="zfp(rate=8)")
    xs = {d: np.ones(4, np.float32) for d in (0, 1)}
    assert np.array_equal(mc.all_reduce(xs, mesh, "x", compression="auto")[0], np.full(4, 2.0))


def test_messages_cut_on_block_boundaries_and_sum_to_the_tile():
    mesh = mc.Mesh(list(range(4)), ("x",))
    p = collective_plan("all_gather", (101, 16), "float32", mesh, "x")
    comp = Compression(ZFP(rate=8), chunk_bytes=1024)
    i = next(i for i, t in enumerate(p.transfers) if t.kind == "bcast")
    msgs = messages(p, i, comp)
    units = [u for m in msgs for u in m]
    assert len(msgs) > 3 and all(u.box[0][0] % 4 == 0 for u in units)
    assert sum(u.wire for u in units) == ZFP(rate=8).wire_bytes((101, 16), "float32")
    assert abs(wire_ratio(p, i, comp) - 8 / 32) < 0.02
    assert len(hops(p.transfers[i], comp)) == 3


def test_cost_model_prices_codec_and_link():
    mesh = mc.Mesh(list(range(8)), ("x",))
    p = collective_plan("all_gather", (1 << 19,), "float32", mesh, "x")       # 16 MiB gathered
    comp = Compression(ZFP(rate=8))
    cost = CodecCost(comp, 0.05e9, 0.05e9)
    slow, fast = Topology(1, inter_node_gbps=0.05), Topology(1, inter_node_gbps=10.0)
    # codec bound: 2 MiB encoded and 16 MiB decoded per process at 0.05 GB/s
    assert p.simulate(fast, compression=cost) == pytest.approx((2 + 16) * 2 ** 20 / 0.05e9, rel=0.05)
    assert p.simulate(slow, compression=cost) < p.simulate(slow) / 3
    assert p.simulate(fast, compression=cost) > 10 * p.simulate(fast)
    per_hop = CodecCost(Compression(ZFP(rate=8), per_hop=True), 0.05e9, 0.05e9)
    assert p.simulate(slow, compression=per_hop) > 1.3 * p.simulate(slow, compression=cost)
    rs = collective_plan("reduce_scatter", (1 << 19,), "float32", mesh, "x")
    ring = CodecCost(Compression(ZFP(rate=8), reduce="ring"), 0.05e9, 0.05e9)
    one = CodecCost(Compression(ZFP(rate=8), reduce="oneshot"), 0.05e9, 0.05e9)
    assert rs.simulate(slow, compression=one) <= rs.simulate(slow, compression=ring)


def test_auto_compresses_only_where_the_model_says_it_pays(monkeypatch):
    mesh = mc.Mesh(list(range(8)), ("x",))
    p = collective_plan("all_gather", (1 << 19,), "float32", mesh, "x")
    assert codec_cost.resolve("auto", p, world=8) is None                   # shared memory: never
    monkeypatch.setenv("MESHCOMM_EMULATE_GBPS", "0.05")
    got = codec_cost.resolve("auto", p, world=8)
    assert got is not None and got.codec in codec_cost.AUTO_CANDIDATES
    assert codec_cost.resolve("auto", p, world=8, local=True) is None       # nothing travels
    assert codec_cost.resolve(Cast("fp16"), p, world=8).codec == Cast("fp16")


def test_pacer_spaces_messages():
    pace = Pacer(0.08, rank=0, node_size=2)
    assert not pace.crosses(1) and pace.crosses(2)
    t0 = time.monotonic()
    first, second = pace.release(1 << 20), pace.release(1 << 20)
    assert first - t0 >= 0.1 and second - first == pytest.approx((1 << 20) * 8 / 0.08e9)


def _launch(tmp_path, n, *args):
    from test_distributed import MPIEXEC, launch
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    return launch([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(WORKER), *args],
                  {"MESHCOMM_TIMEOUT": "30"}, 300, tmp_path)


@pytest.mark.mpi
def test_mpiexec_4_mpi_and_torch(tmp_path):
    res = _launch(tmp_path, 4, "--init", "mixed", "--backends", "mpi,torch", "--pace")
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    for r in res:
        assert (r["all_gather"], r["reduce_scatter"], r["all_reduce"], r["reshard"]) == (10, 4, 2, 2)
        assert r["disagree_raised"] == 2                  # every process raised, on both backends
        assert r["program_runs"] == 2 * 2 * 2 and r["repeat_ok"] == 2     # Programs; repeats construct none
        # a local error in a compressed run: every process raised within 10 s (TIMEOUT 30):
        # over MPI an all_gather's and a reshard's, then new Programs ran; on torch one, last
        assert r["run_error_raised"] == 3, r
    # each tile crosses 3 hops (a chain through the other processes), at the exact fixed-rate size
    assert sum(r["ag_sent"] for r in res) == 3 * 4 * res[0]["ag_tile_wire"]
    for b in ("mpi", "torch"):
        assert res[3][f"pace_end_{b}"] - res[0][f"pace_start_{b}"] >= 0.1, b


@pytest.mark.mpi
def test_mpiexec_2_processes_2_devices_each(tmp_path):
    res = _launch(tmp_path, 2, "--init", "mpi", "--dpp", "2", "--backends", "mpi")
    assert [(r["all_gather"], r["reduce_scatter"], r["disagree_raised"], r["program_runs"], r["repeat_ok"],
             r["run_error_raised"]) for r in res] == [(5, 2, 1, 4, 1, 2)] * 2


@pytest.mark.mpi
def test_mpiexec_4_nan_and_inf(tmp_path):
    # NaN and Inf came back finite (a NaN as -3.97, an Inf as -2.0) through ZFP
    res = _launch(tmp_path, 4, "--init", "mixed", "--backends", "mpi,torch", "--nonfinite")
    assert [r["rank"] for r in res] == [0, 1, 2, 3]
    assert all((r["nf_all_gather"], r["nf_all_reduce"]) == (16, 12) for r in res), res
    # 2 processes x 2 devices: hops in memory and over the network in one chain
    res = _launch(tmp_path / "dpp", 2, "--init", "mpi", "--dpp", "2", "--backends", "mpi", "--nonfinite")
    assert [(r["nf_all_gather"], r["nf_all_reduce"]) for r in res] == [(8, 6)] * 2
