"""The fast paths: the hand-written floor of `meshcomm bench run`, the one-copy local path
(aligned tiles JAX adopts, replicas sharing one array), repeated calls that run their
Program without agreeing again, and the planner keeping the best of its candidates."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meshcomm as mc
from meshcomm.backends.local import ALIGN, LocalBackend, aligned_numpy
from meshcomm.tools.bench import floor
from meshcomm.tools.cases import global_array, run_cases

ROOT = Path(__file__).resolve().parent.parent


# -- the floor ------------------------------------------------------------------------------

def _run_floor_in_memory(case, g):
    """Every rank's floor program, its messages matched by (sender, receiver, tag) and
    delivered in memory: {dst device: tile}, and the elements sent."""
    progs = {r: floor.floor_program(case.src, case.dst, case.shape, r) for r in range(8)}
    st = case.src.tiles(case.shape)
    x = mc.shard(g, case.src, seed=3) if case.src.is_partial else \
        {d: g[tuple(slice(a, b) for a, b in st.boxes[d])] for d in case.src.mesh.device_ids}
    sent = {}
    for r, p in progs.items():
        for s, sl, peer, tag in p.sends:
            key = (r, peer, tag)
            assert key not in sent, f"two messages {key}"
            sent[key] = np.ascontiguousarray(x[s][sl])
    out = {}
    for r, p in progs.items():
        tiles = {d: np.zeros(shape, case.dtype) for d, shape in p.out_shapes.items()}
        parts = {}
        for s, ssl, d, dsl, a in p.local:
            parts.setdefault((d, floor._key(dsl)), {})[a] = (dsl, x[s][ssl])
        for d, sl, peer, tag, n, a in p.recvs:
            msg = sent.pop((peer, r, tag))
            assert msg.size == n
            parts.setdefault((d, floor._key(sl)), {})[a] = (sl, msg.reshape(tiles[d][sl].shape))
        for (d, _), adds in parts.items():
            assert sorted(adds) == list(range(p.addends)), "every addend once"
            acc = None
            for a in sorted(adds):
                sl, v = adds[a]
                acc = np.array(v) if acc is None else acc + v
            tiles[d][sl] = acc
        out.update(tiles)
    assert not sent, f"messages nobody receives: {sorted(sent)[:4]}"
    return out, sum(p.wire_elems for p in progs.values()) // 8


@pytest.mark.parametrize("case", [c for c in run_cases(8, 0.05) if not c.dst.is_partial],
                         ids=lambda c: c.name)
def test_floor_delivers_exactly_each_missing_piece(case):
    g = global_array(case.shape, 5, case.dtype)
    out, wire = _run_floor_in_memory(case, g)
    want = case.dst.index_map(case.shape)
    for d in case.dst.mesh.device_ids:
        np.testing.assert_array_equal(out[d], g[want[d]], err_msg=f"{case.name} device {d}")
    # the floor never moves more than meshcomm's plan when neither side reduces or broadcasts
    p = mc.plan(case.shape, case.dtype, case.src, case.dst)
    if not case.src.is_partial:
        assert wire * np.dtype(case.dtype).itemsize <= p.bytes_moved


def test_floor_covers_each_dst_element_once():
    m = mc.Mesh.grid((2, 4), ("x", "y"))
    src, dst = mc.Layout(m, ("x", "y")), mc.Layout(m, (("y", "x"), None))
    shape = (13, 7)
    for r in range(8):
        p = floor.floor_program(src, dst, shape, r)
        for d, tshape in p.out_shapes.items():
            hits = np.zeros(tshape, int)
            for _, _, dd, sl, _ in p.local:
                if dd == d:
                    hits[sl] += 1
            for dd, sl, *_ in p.recvs:
                if dd == d:
                    hits[sl] += 1
            assert (hits == 1).all(), (r, d)


# -- the one-copy local path -------------------------------------------------------------------

def test_aligned_tiles_for_every_dtype():
    for dt in ("float32", "int8", "float64", "bool", "complex64"):
        for shape in ((), (0, 3), (5,), (3, 7, 2)):
            a = aligned_numpy(shape, dt, zero=True)
            assert a.shape == shape and a.dtype == np.dtype(dt)
            assert a.flags.c_contiguous and a.flags.writeable
            assert a.size == 0 or a.ctypes.data % ALIGN == 0
            assert not a.any()


def test_local_share_gives_replicas_one_array_and_same_values():
    m = mc.Mesh.grid((2, 4), ("x", "y"))
    src = mc.Layout(m, ("y", "x"))
    dst = mc.Layout(mc.Mesh.grid((2, 2), ("a", "b"), start=8), ("a",))    # replicated over b
    g = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    x = mc.shard(g, src)
    p = mc.plan(g.shape, g.dtype, src, dst)
    plain = LocalBackend().execute(p, x, like=x[0])
    shared = LocalBackend().execute(p, x, like=x[0], share=True)
    assert plain[8] is not plain[9] and shared[8] is shared[9] and shared[10] is shared[11]
    assert shared[8] is not shared[10]
    for d in plain:
        np.testing.assert_array_equal(plain[d], shared[d])
        # aligned as the source tiles are (a cache line's phase): copies alike on both sides
        assert plain[d].ctypes.data % ALIGN == x[0].ctypes.data % ALIGN


def test_result_tiles_take_the_phase_of_the_source_tiles():
    m = mc.Mesh(np.arange(4), ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None,))
    for phase in (0, 16, 48):
        for n in (1024, 1 << 19):           # malloc'd and pooled result tiles
            raw = np.zeros(4 * n * 4 + 2 * ALIGN, np.uint8)
            off = (phase - raw.ctypes.data) % ALIGN
            g = raw[off:off + 4 * n * 4].view(np.float32)
            g[:] = np.arange(4 * n)
            x = {d: g[d * n:(d + 1) * n] for d in range(4)}
            assert all(v.ctypes.data % ALIGN == phase for v in x.values())
            out = mc.reshard(x, src, dst)
            for d, v in out.items():
                np.testing.assert_array_equal(v, np.arange(4 * n, dtype=np.float32))
                assert v.ctypes.data % ALIGN == phase, (phase, n, d)


def test_local_reduction_in_place_keeps_plan_order_for_every_op():
    m = mc.Mesh.grid((2, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    for op in ("sum", "prod", "min", "max"):
        src = mc.Layout(m, ("y",), partial={"x": op})
        dst = mc.Layout(m, (None,))
        g = rng.integers(-5, 5, size=(6, 3)).astype(np.int64)
        x = mc.shard(g, src, seed=1)
        out = mc.reshard(x, src, dst)
        for d in m.device_ids:
            np.testing.assert_array_equal(out[d], g)


def test_jax_local_path_is_one_copy_and_replicas_share_memory():
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX CPU devices (XLA_FLAGS in conftest.py)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from meshcomm.adapters import reshard_jax
    devs = np.array(jax.devices()[:8])
    g = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    x = jax.device_put(g, NamedSharding(Mesh(devs.reshape(2, 4), ("x", "y")), P("x", "y")))
    dst = NamedSharding(Mesh(devs[4:8].reshape(2, 2), ("a", "b")), P("a", None))   # 2 replicas each
    y = reshard_jax(x, dst)
    np.testing.assert_array_equal(np.asarray(y), g)
    ptr = {s.device.id: s.data.unsafe_buffer_pointer() for s in y.addressable_shards}
    ids = [d.id for d in devs[4:8]]
    assert ptr[ids[0]] == ptr[ids[1]] and ptr[ids[2]] == ptr[ids[3]] and ptr[ids[0]] != ptr[ids[2]]
    assert all(p % ALIGN == 0 for p in ptr.values())
    # mc.reshard of jax.Arrays takes the same path: committed tiles, replicas shared
    tiles = {d.id: s.data for d in devs for s in x.addressable_shards if s.device == d}
    out = mc.reshard(tiles, mc.Layout(mc.Mesh.grid((2, 4), ("x", "y")), ("x", "y")),
                     mc.Layout(mc.Mesh([[4, 5], [6, 7]], ("a", "b")), ("a",)))
    assert out[4].unsafe_buffer_pointer() == out[5].unsafe_buffer_pointer()
    assert out[4].devices() == {devs[4]} and out[5].devices() == {devs[5]}


def test_jax_local_path_adopts_whole_contiguous_src_runs_and_copies_the_rest():
    """A dst tile lying whole in one contiguous run of a src tile is that memory (no copy;
    JAX arrays are immutable), on the other device; other tiles are fresh copies; values
    exact; donating the source afterwards leaves the result intact."""
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX CPU devices (XLA_FLAGS in conftest.py)")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from meshcomm.adapters import reshard_jax
    devs = np.array(jax.devices()[:8])
    g = np.arange(16 * 8 * 4, dtype=np.float32).reshape(16, 8, 4)
    x = jax.device_put(g, NamedSharding(Mesh(devs[:2], ("x",)), P("x")))
    spans = [(s.data.unsafe_buffer_pointer(), s.data.unsafe_buffer_pointer() + s.data.nbytes)
             for s in x.addressable_shards]

    def inside(y):
        return [any(lo <= s.data.unsafe_buffer_pointer() < hi for lo, hi in spans) for s in y.addressable_shards]
    # rows 0-3, 4-7, ... of a (8, 8, 4) src tile: contiguous runs, adopted on devices 4-7
    y = reshard_jax(x, NamedSharding(Mesh(devs[4:8], ("a",)), P("a")))
    np.testing.assert_array_equal(np.asarray(y), g)
    assert all(inside(y)) and {s.device for s in y.addressable_shards} == set(devs[4:8])
    # columns: strided in the src tile, so copied
    z = reshard_jax(x, NamedSharding(Mesh(devs[4:8], ("a",)), P(None, "a")))
    np.testing.assert_array_equal(np.asarray(z), g)
    assert not any(inside(z))
    f = jax.jit(lambda a: a * 2, donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * g)
    np.testing.assert_array_equal(np.asarray(y), g)


def test_bench_jax_part_reports_who_copies_and_exact_results():
    """`meshcomm bench run`'s one-process part: exact results, and the copy columns telling
    the cases meshcomm adopts (1to1: the whole tile) from those both copy (same-allgather)."""
    jax = pytest.importorskip("jax")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX CPU devices (XLA_FLAGS in conftest.py)")
    import types
    from meshcomm.tools.bench.jax_part import run_jax_part
    from meshcomm.tools.bench.run import _format_jax
    cases = [c for c in run_cases(8, 1) if c.name in ("1to1", "same-allgather")]
    rows = run_jax_part(types.SimpleNamespace(repeats=2), cases)
    assert set(rows) == {"1to1", "same-allgather"}
    for name, res in rows.items():
        assert res["jax.device_put"]["exact"] and res["meshcomm-local"]["exact"], name
    assert rows["1to1"]["jax_copies"] and not rows["1to1"]["meshcomm_copies"]
    assert rows["same-allgather"]["jax_copies"] and rows["same-allgather"]["meshcomm_copies"]
    text = "\n".join(_format_jax(rows))
    assert "where both copy" in text and "1 cases" in text


def test_local_program_writes_each_box_of_a_shared_tile_once():
    """The plan to a replicated dst copies each piece to one replica and broadcasts it to
    the others: with `share` they are one array, so each piece is copied once."""
    from meshcomm.backends.local import _program
    m = mc.Mesh.grid((2, 4), ("x", "y"))
    src, dst = mc.Layout(m, (("x", "y"),)), mc.Layout(m, ())
    g = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    p = mc.plan(g.shape, g.dtype, src, dst)
    assert sum(len(t.boxes) * len(t.dsts) for t in p.transfers) > 8
    prog = _program(p, True, False)
    assert len(prog.ops) == 8 and len(prog.slots) == 1
    assert _program(p, True, False) is prog          # worked out once per plan
    x = mc.shard(g, src)
    out = LocalBackend().execute(p, x, like=x[0], share=True)
    assert all(out[d] is out[0] for d in m.device_ids)
    np.testing.assert_array_equal(out[0], g)


# -- repeated calls over MPI ---------------------------------------------------------------------

@pytest.mark.mpi
def test_repeated_calls_run_their_program_without_agreeing_again(tmp_path):
    """4 processes (tests/workers/perf_worker.py): repeated identical calls where every
    process holds a tile construct no Program and agree on nothing after the first; where
    receivers hold none, every call agrees once and runs the same Program; a shape mismatch
    still raises on every process, and the next call works; a repeat in which one process
    passes a tile of another dtype raises on every process, and the next call constructs
    a new Program."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("mpiexec not found")
    env = dict(os.environ, MESHCOMM_TIMEOUT="30", OMP_NUM_THREADS="1")
    r = subprocess.run([str(mpiexec), "-n", "4", sys.executable, str(ROOT / "tests" / "workers" / "perf_worker.py")],
                       capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    import re
    assert sorted(re.findall(r"OK (\d+)", r.stdout)) == ["0", "1", "2", "3"], r.stdout[-3000:]


# -- the planner keeps the best of its candidates ------------------------------------------------

def test_own_cases_never_behind_a_baseline_under_the_cost_model():
    from meshcomm.tools.bench import sim
    from meshcomm.tools.cases import own_cases
    topo = mc.Topology.preset("p3.8xlarge")
    for r in sim.sim_rows(own_cases(), topo, verify=True, progress=False):
        for name, t in r["baselines"].items():
            if t is not None:
                assert r["meshcomm_s"] <= t * (1 + 1e-12), (r["case"], name, r["meshcomm_s"], t)


def test_random_plans_never_behind_send_recv_or_alpa_broadcast():
    """Never behind a baseline plan that keeps the planner's rules: no box fetched over the
    network into a node that already holds it (tests/test_reshard_local.py asserts that rule
    for every plan; where a baseline breaks it, the planner keeps its own plan), and no
    value reduced twice (send_recv's pending sums: more bytes, replicas summed in different
    orders)."""
    from hypothesis import given, settings
    from meshcomm.planners import baselines
    from meshcomm.planners.resharding import _fetches_held, _reduces_again
    from meshcomm.planners.verify import verify
    from strategies import layouts_pair

    @settings(max_examples=40)
    @given(layouts_pair())
    def check(pair):
        shape, src, dst = pair
        for topo in (mc.Topology.preset("flat"), mc.Topology.preset("p3.8xlarge")):
            p = mc.plan(shape, "float32", src, dst, topology=topo)
            verify(p)
            assert p.planner == "meshcomm"
            for make in (baselines.send_recv, baselines.alpa_broadcast):
                b = make(shape, "float32", src, dst, topo)
                if (src.num_addends == 1 and _fetches_held(b, src, shape, topo)) or _reduces_again(b, p):
                    continue
                assert p.simulate(topo) <= b.simulate(topo) * (1 + 1e-12), make.__name__
    check()


def test_4096_device_all_to_all_plans_in_seconds():
    import time
    from meshcomm.tools.bench.plan import alltoall_case
    from meshcomm.planners.verify import verify
    _, n, shape, src, dst = alltoall_case(4096)
    mc.clear_caches()
    c0 = time.process_time()
    p = mc.plan(shape, "float32", src, dst, topology="p3.8xlarge")
    cpu = time.process_time() - c0
    assert cpu < 10, f"{cpu:.1f} s of CPU to plan the 4096-device all-to-all"
    assert len(p.transfers) == n and p.messages == n - 64     # 64 devices sit on their own spot
    verify(p)
