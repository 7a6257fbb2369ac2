"""all_to_all_v: planner properties, single-process exactness, and real mpiexec runs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import meshcomm as mc
from meshcomm.alltoall import axis_groups
from meshcomm.planners.alltoall import check_alltoall, estimate, plan_alltoall

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def reference(xs, counts, groups):
    out = {}
    for g in groups:
        for j, f in enumerate(g):
            parts = []
            for o in g:
                off = int(sum(counts[o][:j]))
                parts.append(xs[o][off:off + counts[o][j]])
            out[f] = np.concatenate(parts)
    return out


def random_case(rng, mesh, axis, hi, width=3, dtype=np.float64):
    n = mesh.axis_size(axis)
    counts = {d: rng.integers(0, hi + 1, n) for d in mesh.device_ids}
    xs = {d: (rng.standard_normal((int(counts[d].sum()), width)) * 100).astype(dtype)
          for d in mesh.device_ids}
    return counts, xs


# -- planner ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,g", [(1, 1), (2, 1), (5, 1), (8, 4), (8, 2), (6, 4), (12, 3)])
@pytest.mark.parametrize("algorithm", ["pairwise", "two_level", "auto"])
def test_plan_delivers_every_block(n, g, algorithm):
    rng = np.random.default_rng(n * 10 + g)
    for _ in range(5):
        counts = rng.integers(0, 4, (n, n)) * (rng.random((n, n)) < 0.7)
        p = plan_alltoall(range(n), counts, 8, mc.Topology(g), algorithm)
        check_alltoall(p)
        assert all(m.src != m.dst and m.rows > 0 for m in p.messages)


def test_pairwise_rounds_are_shifted_permutations():
    n = 6
    p = plan_alltoall(range(n), np.ones((n, n), int), 4, None, "pairwise")
    for r in range(1, n):
        msgs = [m for m in p.messages if m.round == r]
        assert sorted((m.src, m.dst) for m in msgs) == [(i, (i + r) % n) for i in range(n)]


def test_two_level_coalesces_cross_node_messages_and_wins_on_latency():
    n, g = 16, 4
    counts = np.ones((n, n), int)        # tiny messages: latency-bound
    topo = mc.Topology(g, inter_node_latency_s=50e-6)
    pw = plan_alltoall(range(n), counts, 64, topo, "pairwise")
    tl = plan_alltoall(range(n), counts, 64, topo, "two_level")
    cross = lambda p: sum(topo.node_of(m.src) != topo.node_of(m.dst) for m in p.messages)
    assert cross(pw) == n * n - n * g           # one per (device, remote device)
    assert cross(tl) == (n // g) * (n // g - 1)  # one per node pair
    assert tl.estimate_s < pw.estimate_s
    assert plan_alltoall(range(n), counts, 64, topo).algorithm == "two_level"
    # huge rows on a fast NIC: the extra intra-node hops no longer pay off
    big = mc.Topology(g, intra_node_gbps=10, inter_node_gbps=10_000)
    assert plan_alltoall(range(n), counts, 1 << 24, big).algorithm == "pairwise"
    # flat topology: always pairwise
    assert plan_alltoall(range(n), counts, 64, None).algorithm == "pairwise"


def test_estimate_is_alpha_beta():
    topo = mc.Topology(1, inter_node_gbps=8, inter_node_latency_s=1e-3)   # 1 GB/s
    p = plan_alltoall(range(2), [[0, 1000], [0, 0]], 1000, topo, "pairwise")
    assert estimate(p.messages, topo, 1000) == pytest.approx(1e-3 + 1e6 / 1e9)


def test_plan_rejects_bad_counts():
    with pytest.raises(ValueError, match="device 1"):
        plan_alltoall([0, 1], [[1, 1], [1, -1]])
    with pytest.raises(ValueError, match="3 entries"):
        plan_alltoall([0, 1], [[1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="unknown all-to-all algorithm"):
        plan_alltoall([0, 1], [[1, 1], [1, 1]], algorithm="ring")


# -- single process ---------------------------------------------------------------------------

MESHES = [mc.Mesh([0, 1, 2, 3], ("ep",)), mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "ep")),
          mc.Mesh([[7, 3], [5, 1], [0, 2]], ("ep", "dp")), mc.Mesh([9], ("ep",))]


@pytest.mark.parametrize("mi", range(len(MESHES)))
@pytest.mark.parametrize("topo", [None, mc.Topology(2), mc.Topology(4)])
def test_local_matches_reference_both_directions(mi, topo):
    mesh = MESHES[mi]
    rng = np.random.default_rng(mi)
    groups = axis_groups(mesh, "ep")
    for hi in (0, 1, 5):
        counts, xs = random_case(rng, mesh, "ep", hi)
        counts[mesh.device_ids[0]][:] = 0        # an empty rank
        xs[mesh.device_ids[0]] = xs[mesh.device_ids[0]][:0]
        ref = reference(xs, counts, groups)
        y = mc.all_to_all_v(xs, counts, mesh, "ep", topology=topo)
        assert set(y) == set(mesh.device_ids)
        for d in y:
            np.testing.assert_array_equal(y[d], ref[d])
        recv = {f: [int(counts[o][j]) for o in g] for g in groups for j, f in enumerate(g)}
        back = mc.all_to_all_v(y, recv, mesh, "ep", recv_counts=counts, topology=topo)
        for d in back:
            np.testing.assert_array_equal(back[d], xs[d])


def test_local_torch_keeps_kind_and_grad_free_values():
    mesh = MESHES[1]
    rng = np.random.default_rng(7)
    counts, xs = random_case(rng, mesh, "ep", 3, dtype=np.float32)
    ref = reference(xs, counts, axis_groups(mesh, "ep"))
    y = mc.all_to_all_v({d: torch.from_numpy(v) for d, v in xs.items()}, counts, mesh, "ep", async_op=True).wait()
    for d in y:
        assert isinstance(y[d], torch.Tensor) and y[d].dtype == torch.float32
        np.testing.assert_array_equal(y[d].numpy(), ref[d])


def test_local_jax_rows_come_back_as_jax_arrays_on_their_devices():
    jax = pytest.importorskip("jax")
    mesh = MESHES[1]
    rng = np.random.default_rng(11)
    counts, xs = random_case(rng, mesh, "ep", 3, dtype=np.float32)
    ref = reference(xs, counts, axis_groups(mesh, "ep"))
    devs = {d.id: d for d in jax.devices()}
    x = {d: jax.device_put(v, devs[d]) for d, v in xs.items()}
    prog = mc.Program.all_to_all_v(mesh, "ep", rows=(3,), dtype=np.float32)
    for y in (mc.all_to_all_v(x, counts, mesh, "ep"), prog(x, counts)):
        for d in y:
            assert isinstance(y[d], jax.Array) and y[d].devices() == {devs[d]}, (d, y[d])
            np.testing.assert_array_equal(np.asarray(y[d]), ref[d])
    with pytest.raises(TypeError, match=r"one kind .*\['jax', 'numpy'\]"):
        mc.all_to_all_v({**x, 0: xs[0]}, counts, mesh, "ep")


def test_local_counts_as_matrix_and_bare_single_device():
    mesh = MESHES[0]
    rng = np.random.default_rng(3)
    counts, xs = random_case(rng, mesh, "ep", 4)
    mat = np.stack([counts[d] for d in mesh.device_ids])
    ref = reference(xs, counts, axis_groups(mesh, "ep"))
    y = mc.all_to_all_v(xs, mat, mesh, "ep", recv_counts=mat.T)
    for d in y:
        np.testing.assert_array_equal(y[d], ref[d])
    one = mc.Mesh([5], ("ep",))
    x = np.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(mc.all_to_all_v(x, [3], one, "ep"), x)


def test_local_errors_name_the_device():
    mesh = MESHES[0]
    xs = {d: np.zeros((2, 1)) for d in mesh.device_ids}
    counts = {d: [1, 1, 0, 0] for d in mesh.device_ids}
    with pytest.raises(ValueError, match="device 2"):
        mc.all_to_all_v(xs, {**counts, 2: [1, 1, 1, 0]}, mesh, "ep")
    with pytest.raises(ValueError, match="axis 'ep' has 4"):
        mc.all_to_all_v(xs, {**counts, 1: [1, 1]}, mesh, "ep")
    with pytest.raises(ValueError, match="unknown mesh axis"):
        mc.all_to_all_v(xs, counts, mesh, "tp")
    with pytest.raises(ValueError, match="recv_counts of device 2"):
        mc.all_to_all_v(xs, counts, mesh, "ep", recv_counts={d: [1, 1, 1, 1] for d in mesh.device_ids})
    # a device's count to itself is checked too (it is never a message)
    recv = {0: [2, 1, 1, 1], 1: [1, 1, 1, 1], 2: [0, 0, 0, 0], 3: [0, 0, 0, 0]}
    with pytest.raises(ValueError, match="device 0 say 2 rows from device 0"):
        mc.all_to_all_v(xs, counts, mesh, "ep", recv_counts=recv)
    with pytest.raises(ValueError, match=r"missing|device\(s\) \[3\]"):
        mc.all_to_all_v({d: xs[d] for d in (0, 1, 2)}, counts, mesh, "ep")
    with pytest.raises(TypeError):
        mc.all_to_all_v(xs, counts, "not a mesh", "ep")


# -- under a launcher -------------------------------------------------------------------------

def _launcher_ready():
    try:
        import meshcomm.backends.mpi  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"MPI backend not importable: {e}"
    if not hasattr(mc, "init"):
        return "meshcomm.init is not available"
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("backend,nproc,dpp", [("mpi", 4, 1), ("mpi", 2, 2),
                                               pytest.param("torch", 4, 1, marks=pytest.mark.slow)])
def test_alltoall_under_mpiexec(backend, nproc, dpp):
    why = _launcher_ready()
    if why:
        pytest.skip(why)
    env = dict(os.environ, MESHCOMM_TIMEOUT="30", OMP_NUM_THREADS="1")
    cmd = [str(VENV_BIN / "mpiexec"), "-n", str(nproc), sys.executable,
           str(ROOT / "tests" / "workers_alltoall" / "a2a_worker.py"), backend, str(dpp), "1234"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    oks = re.findall(r"A2A OK (\d+) (\d+) (\d+)", r.stdout)      # lines of ranks may interleave
    assert sorted(int(rk) for rk, _, _ in oks) == list(range(nproc)), r.stdout
    assert all(int(n) >= 18 and int(two) > 0 for _, n, two in oks)   # two-level plans ran too


MISSING_PEER = """
import time, numpy as np, meshcomm as mc
from meshcomm.errors import PeerTimeoutError
ctx = mc.init(backend="mpi")
if ctx.rank == 0:
    time.sleep(6)            # never joins the exchange
    print("R0 DONE", flush=True)
else:
    t = time.monotonic()
    try:
        mc.all_to_all_v(np.zeros((1, 2)), [0, 1], mc.Mesh([0, 1], ("ep",)), "ep")
        print("NO ERROR", flush=True)
    except PeerTimeoutError as e:
        print(f"TIMEOUT after {time.monotonic() - t:.1f}s peers={e.peers}: {e}", flush=True)
"""


@pytest.mark.mpi
def test_missing_peer_raises_within_timeout():
    why = _launcher_ready()
    if why:
        pytest.skip(why)
    env = dict(os.environ, MESHCOMM_TIMEOUT="2", OMP_NUM_THREADS="1")
    cmd = [str(VENV_BIN / "mpiexec"), "-n", "2", sys.executable, "-c", MISSING_PEER]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90, env=env, cwd=ROOT)
    m = re.search(r"TIMEOUT after ([\d.]+)s peers=\((\d+),\)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    assert float(m.group(1)) < 5.5 and m.group(2) == "0"


SPLIT_TABLE = {"format": "meshcomm-tuning-v1", "rules": [
    {"op": op, "min_bytes": 0, "max_bytes": 4096, "backend": "torch"} for op in ("send", "alltoall")]}

MIXED_SPLIT = """
import numpy as np, meshcomm as mc
ctx = mc.init(backend="mixed")      # MESHCOMM_TUNING: messages up to 4 KiB on gloo, larger on MPI
r = ctx.rank
mesh = mc.Mesh([0, 1], ("ep",))
# rows of very different volumes per process: each end of a pair must pick the same backend
for big in (0, 1, 600):
    n = [big, 3][r]
    x = np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 1000 * r
    y = mc.all_to_all_v(x, [n // 2, n - n // 2], mesh, "ep")
    other = [big, 3][1 - r]
    want = np.concatenate([(np.arange(other * 2, dtype=np.float64).reshape(other, 2) + 1000 * (1 - r))[
        (other // 2 if r else 0):(other if r else other // 2)] if s != r else x[(n // 2 if r else 0):(n if r else n // 2)]
        for s in (0, 1)])
    assert np.array_equal(y, want), (r, big, y.shape, want.shape)
# a receiver expecting fewer bytes than sent: a ValueError naming both devices, not a wait
if r == 0:
    mc.send(np.arange(1000, dtype=np.float64), 1)       # 8000 B: MPI
else:
    try:
        mc.recv(0, like=((100,), "float64"))            # 800 B, which alone would pick gloo
        raise AssertionError("a recv of the wrong size returned")
    except ValueError as e:
        assert "device 0 sent float64 (1000,)" in str(e), e
print("MIXED SPLIT OK", r, flush=True)
mc.finalize()
"""


@pytest.mark.mpi
def test_mixed_picks_one_backend_per_message_on_both_ends(tmp_path):
    """Under "mixed" with a table that splits messages by size, both ends of every message
    pick alike: all_to_all_v chose by each process's own volume, recv by its like=, so a pair
    could post on MPI and on gloo and wait out the timeout."""
    why = _launcher_ready()
    if why:
        pytest.skip(why)
    import json
    table = tmp_path / "split.json"
    table.write_text(json.dumps(SPLIT_TABLE))
    script = tmp_path / "mixed_split.py"
    script.write_text(MIXED_SPLIT)
    env = dict(os.environ, MESHCOMM_TIMEOUT="20", MESHCOMM_TUNING=str(table), OMP_NUM_THREADS="1")
    r = subprocess.run([str(VENV_BIN / "mpiexec"), "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.count("MIXED SPLIT OK") == 2, r.stdout[-3000:] + r.stderr[-3000:]

