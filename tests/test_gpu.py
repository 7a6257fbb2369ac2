"""GPU tests (`make test-gpu`, i.e. `pytest -m gpu`): skipped cleanly without CUDA.

* the CUDA kernels are exact against the CPU path on random boxes and dtypes (outputs poisoned
  first), unpack-add included, for torch CUDA tensors and CuPy arrays (needs CuPy);
* the single-process reshard with CUDA torch tensors (local backend, and the packed message
  path of meshcomm.cuda.executor, which runs the kernels when CuPy is there);
* the stream fence: a producer writes the tensor after a long kernel (torch.cuda._sleep) and an
  async reshard must still see the final values; with the fence removed (fence=False, or
  meshcomm.cuda.executor.UNSAFE_NO_FENCE = True) the same run reads stale values, which the last test shows;
* the MPI backend with two processes sharing the one GPU (host staging), when mpiexec is there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import meshcomm as mc  # noqa: E402
from jax_gpu import run_on_jax_gpu  # noqa: E402
from meshcomm.backends.pack import message_elems, pack, unpack, uses_kernels  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

ROOT = Path(__file__).resolve().parents[1]
DEV = "cuda"
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.float16, torch.bfloat16, torch.int32,
          torch.float32, torch.int64, torch.float64, torch.bool, torch.complex64]
ADD_DTYPES = [torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.int32, torch.float32,
              torch.int64, torch.float64, torch.bool, torch.complex64]


@pytest.fixture
def cupy():
    cp = pytest.importorskip("cupy")
    from meshcomm import cuda
    if not cuda.available():
        pytest.skip("CuPy is installed but sees no CUDA device")
    return cp


def rand(rng, shape, dtype, device=DEV):
    if dtype == torch.bool:
        x = torch.from_numpy(rng.integers(0, 2, size=shape).astype(bool))
    elif dtype.is_complex:
        x = torch.from_numpy((rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64))
    elif dtype.is_floating_point:
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
    else:
        info = torch.iinfo(dtype)
        x = torch.from_numpy(rng.integers(info.min, info.max, size=shape, endpoint=True)).to(dtype)
    return x.to(device)


def bits(x):
    x = x.detach().contiguous().cpu()
    return x.numpy() if x.dtype == torch.bool else x.view(torch.uint8).numpy()


def same(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and bool((bits(a) == bits(b)).all())


def boxes(rng, shape, max_boxes=8):
    import itertools
    cuts = []
    for n in shape:
        k = int(rng.integers(0, min(n, 3) + 1))
        inner = sorted(rng.choice(np.arange(1, n), size=min(k, n - 1), replace=False).tolist()) if n > 1 else []
        cuts.append([0] + inner + [n])
    cells = list(itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]))
    rng.shuffle(cells)
    take = cells[:int(rng.integers(1, min(len(cells), max_boxes) + 1))]
    return [tuple(slice(a, b) for a, b in c) for c in take]


def tiles(rng, dtype, case):
    """A contiguous tile, a strided view into a bigger tensor, and a transposed view."""
    ndim = 1 + case % 6
    shape = tuple(int(rng.integers(1, 9)) for _ in range(ndim))
    if case % 5 == 0:                               # long rows: 16-byte units, unrolled loop
        shape = shape[:-1] + (int(rng.integers(300, 3000)),)
    yield rand(rng, shape, dtype)
    big = rand(rng, tuple(n + 2 for n in shape), dtype)
    yield big[tuple(slice(1, 1 + n) for n in shape)]
    if ndim >= 2:
        yield rand(rng, tuple(reversed(shape)), dtype).permute(*reversed(range(ndim)))


# -- kernels exact vs the CPU path ----------------------------------------------------------------

def test_kernels_pack_unpack_exact(cupy):
    from meshcomm.cuda import pack_cuda, unpack_cuda
    rng = np.random.default_rng(10)
    for case in range(60):
        dtype = DTYPES[case % len(DTYPES)]
        for tile in tiles(rng, dtype, case):
            sl = boxes(rng, tuple(tile.shape))
            want = pack(tile.cpu(), sl)
            for off in (0, 1):                     # a buffer one element in: narrower units
                store = rand(rng, (message_elems(sl) + 1,), dtype)     # poisoned
                buf = store[off:off + message_elems(sl)]
                got = pack_cuda(tile, sl, out=buf)
                assert got is buf and same(buf.cpu(), want), (case, dtype, tuple(tile.shape), tile.stride(), sl)
            back = rand(rng, tuple(tile.shape), dtype)                 # poisoned
            expect = back.cpu().clone()
            unpack(want, expect, sl)
            unpack_cuda(want.to(DEV), back, sl)
            assert same(back.cpu(), expect), (case, dtype, tuple(tile.shape), sl)


def test_kernels_unpack_add_exact(cupy):
    from meshcomm.cuda import unpack_cuda
    rng = np.random.default_rng(11)
    for case in range(40):
        dtype = ADD_DTYPES[case % len(ADD_DTYPES)]
        for tile in tiles(rng, dtype, case):
            sl = boxes(rng, tuple(tile.shape))
            addend = rand(rng, (message_elems(sl),), dtype)
            expect = tile.cpu().clone()
            unpack(addend.cpu(), expect, sl, accumulate=True)
            unpack_cuda(addend, tile, sl, accumulate=True)
            assert same(tile.cpu(), expect), (case, dtype, tuple(tile.shape), sl)


def test_kernels_row_lengths_and_alignment(cupy):
    """Rows from 1 B to 64 KiB at every start offset mod 16 B: all unit widths."""
    from meshcomm.cuda import pack_cuda, unpack_cuda
    from meshcomm.cuda.kernels import plan_boxes
    rng = np.random.default_rng(12)
    widths = set()
    for row in [1, 3, 16, 64, 100, 512, 4096, 65536]:
        for off in (0, 1, 2, 4, 8, 12, 15):
            t = rand(rng, (9, row + 32), torch.uint8)
            sl = [(slice(1, 8), slice(off, off + row))]
            got = pack_cuda(t, sl)
            assert same(got.cpu(), t.cpu()[sl[0]].reshape(-1)), (row, off)
            back = torch.zeros_like(t)
            unpack_cuda(got, back, sl)
            assert same(back.cpu()[sl[0]], t.cpu()[sl[0]])
            p = plan_boxes(t.shape, (t.stride(0), 1), 1, t.data_ptr(), got.data_ptr(), sl)
            widths.update(p.units)
    assert widths == {1, 2, 4, 8, 16}


def test_kernels_cupy_arrays_and_dlpack(cupy):
    from meshcomm.cuda import pack_cuda, unpack_cuda
    rng = np.random.default_rng(13)
    for dtype in ["int8", "float16", "float32", "int64", "float64"]:
        h = rng.standard_normal((5, 6, 7)).astype(dtype) if dtype.startswith("f") else \
            rng.integers(-100, 100, size=(5, 6, 7)).astype(dtype)
        a = cupy.asarray(h)
        sl = [(slice(1, 3), slice(0, 6), slice(2, 7)), (slice(3, 5), slice(1, 2), slice(0, 7))]
        buf = pack_cuda(a, sl)
        assert isinstance(buf, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(buf), pack(h, sl))
        # via the shared interface, and a read through DLPack from torch
        np.testing.assert_array_equal(cupy.asnumpy(pack(a, sl)), pack(h, sl))
        b = cupy.zeros_like(a)
        unpack_cuda(buf, b, sl)
        ref = np.zeros_like(h)
        unpack(pack(h, sl), ref, sl)
        np.testing.assert_array_equal(cupy.asnumpy(b), ref)


def test_shared_interface_dispatches_to_kernels(cupy):
    rng = np.random.default_rng(14)
    t = rand(rng, (64, 48), torch.float32)
    assert uses_kernels(t)
    sl = [(slice(0, 32), slice(8, 40)), (slice(40, 64), slice(0, 48))]
    buf = pack(t, sl)
    assert buf.is_cuda and same(buf.cpu(), pack(t.cpu(), sl))
    z = torch.zeros_like(t)
    unpack(buf, z, sl)
    unpack(buf, z, sl, accumulate=True)
    ref = torch.zeros(64, 48)
    unpack(buf.cpu(), ref, sl)
    unpack(buf.cpu(), ref, sl, accumulate=True)
    assert same(z.cpu(), ref)


def test_copy_kernels_take_any_element_type(cupy):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch has no float8")
    t = torch.arange(64, dtype=torch.float32, device=DEV).reshape(8, 8).to(torch.float8_e4m3fn)
    sl = [(slice(0, 4), slice(2, 6))]
    buf = pack(t, sl)                                  # copy kernels take any 1-byte type
    z = torch.zeros_like(t)
    unpack(buf, z, sl)
    assert same(z.cpu()[sl[0]], t.cpu()[sl[0]])


# -- single-process reshard on CUDA ----------------------------------------------------------------

def _layout_cases():
    m1 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    m2 = mc.Mesh([[4, 5, 6]], ("a", "b"))
    m4 = mc.Mesh([[4, 5], [6, 7], [8, 9]], ("a", "b"))
    L = mc.Layout
    return [
        ((37, 130), L(m1, ("x", "y")), L(m2, ("b", None))),
        ((37, 130), L(m1, (None, "y"), partial=("x",)), L(m2, (None, "b"))),
        ((12, 80, 3), L(m1, ("x", None, None)), L(m4, (None, None, None))),
        ((12, 80), L(m1, (None, None), partial=("x", "y")), L(m4, (None, "b"))),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_local_reshard_cuda_tensors(dtype):
    from meshcomm.backends.local import LocalBackend
    from meshcomm.cuda.executor import execute_packed
    rng = np.random.default_rng(15)
    for shape, src, dst in _layout_cases():
        x = rand(rng, shape, dtype, device="cpu")
        cpu = mc.shard(x, src, seed=3)
        gpu = {d: v.to(DEV) for d, v in cpu.items()}
        want = mc.reshard(cpu, src, dst)
        got = mc.reshard(gpu, src, dst)
        assert set(got) == set(want)
        for d in want:
            assert got[d].is_cuda and same(got[d].cpu(), want[d]), (src, dst, d)
        p = mc.plan(shape, dtype, src, dst)
        packed = execute_packed(p, gpu)
        ref = LocalBackend().execute(p, cpu, like=x)
        for d in ref:
            assert packed[d].is_cuda and same(packed[d].cpu(), ref[d]), (src, dst, d)
        y = mc.unshard(got, dst)
        assert y.is_cuda and same(y.cpu(), mc.unshard(want, dst))


# -- the stream fence -----------------------------------------------------------------------------

SLEEP_CYCLES = int(os.environ.get("MESHCOMM_TEST_SLEEP_CYCLES", 2_000_000_000))   # ~1 s at 2 GHz


def _fence_run(fence: bool):
    """Tiles hold `old`; the producer stream sleeps, then writes `new` into them; an async
    packed reshard is issued right after (without blocking the host). Returns (result, new,
    host seconds to issue the reshard, seconds until everything finished)."""
    import time

    from meshcomm.cuda.executor import execute_packed
    m1 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    m2 = mc.Mesh([[4, 5, 6]], ("a", "b"))
    src, dst = mc.Layout(m1, ("x", "y")), mc.Layout(m2, (None, "b"))
    shape = (2048, 1024)
    old = torch.zeros(shape, device=DEV)
    new = torch.arange(np.prod(shape), dtype=torch.float32, device=DEV).reshape(shape)
    shards = mc.shard(old, src)
    new_shards = mc.shard(new, src)
    p = mc.plan(shape, torch.float32, src, dst)
    execute_packed(p, shards)                        # warm-up: kernels compiled, descriptors cached
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        t0 = time.perf_counter()
        torch.cuda._sleep(SLEEP_CYCLES)              # a long kernel ...
        for d, t in shards.items():
            t.copy_(new_shards[d])                   # ... then the producer writes the values
        h = execute_packed(p, shards, async_op=True, fence=fence)
        issued = time.perf_counter() - t0
        out = h.wait()                               # the producer stream waits for comm
    torch.cuda.synchronize()
    return mc.unshard(out, dst), new, issued, time.perf_counter() - t0


def test_fence_orders_async_reshard_after_producer():
    got, new, issued, total = _fence_run(fence=True)
    assert same(got.cpu(), new.cpu())
    assert issued < 0.25 * total, (issued, total)    # the host did not wait for the producer


def test_async_reshard_public_api_sees_producer_writes():
    """The public API on one process: issued on the producer's stream, it sees the writes."""
    m1 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    m2 = mc.Mesh([[4, 5, 6]], ("a", "b"))
    src, dst = mc.Layout(m1, ("x", "y")), mc.Layout(m2, (None, "b"))
    shape = (1024, 512)
    new = torch.randn(shape, device=DEV)
    shards = mc.shard(torch.zeros(shape, device=DEV), src)
    new_shards = mc.shard(new, src)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        for d, t in shards.items():
            t.copy_(new_shards[d])
        h = mc.reshard(shards, src, dst, async_op=True)
        out = h.wait()
    torch.cuda.synchronize()
    assert same(mc.unshard(out, dst).cpu(), new.cpu())


def test_without_fence_the_race_shows():
    """Demonstrates why the fence exists: without it the communication stream packs the tiles
    while the producer still sleeps, so the result holds the old values (zeros). If this test
    fails, the race did not show on this run (raise MESHCOMM_TEST_SLEEP_CYCLES)."""
    got, new, _, _ = _fence_run(fence=False)
    assert not same(got.cpu(), new.cpu())
    assert float(got.abs().sum()) < float(new.abs().sum())


# -- MPI processes sharing the one GPU -----------------------------------------------------------

WORKER = textwrap.dedent('''
    import sys, numpy as np, torch, meshcomm as mc
    from meshcomm.backends.pack import uses_kernels
    ctx = mc.init(backend="mpi", devices_per_process=1)
    rank = ctx.rank
    torch.cuda.set_device(0)
    m1 = mc.Mesh([0, 1], ("x",)); m2 = mc.Mesh([[0], [1]], ("a", "b"))
    cases = [((1030, 70), mc.Layout(m1, ("x", None)), mc.Layout(m2, (None, "a"))),
             ((64, 96), mc.Layout(m1, (None, None), partial=("x",)), mc.Layout(m2, ("a", None))),
             ((33, 8, 5), mc.Layout(m1, (None, "x", None)), mc.Layout(m2, ("a", None, "b")))]
    for shape, src, dst in cases:
        g = torch.Generator().manual_seed(7)
        full = torch.randn(shape, generator=g)
        mine = {d: v.cuda() for d, v in mc.shard(full, src, seed=5).items() if d == rank}
        want = mc.shard(mc.unshard(mc.shard(full, src, seed=5), src), dst)[rank]
        tile = mine[rank]
        final = tile.clone()
        tile.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)                 # producer: long kernel, then the write
        tile.copy_(final)
        h = mc.reshard(mine, src, dst, async_op=True)
        out = h.wait()[rank]
        ok = out.is_cuda and torch.allclose(out.cpu(), want, rtol=1e-6, atol=1e-6)
        print(f"GPU MPI {'OK' if ok else 'BAD'} rank {rank} {shape} kernels={uses_kernels(out)}", flush=True)
        if not ok:
            sys.exit(1)
    mc.finalize()
''')


@pytest.mark.mpi
def test_mpi_processes_share_one_gpu(tmp_path):
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        pytest.skip("mpiexec not found")
    pytest.importorskip("mpi4py")
    script = tmp_path / "gpu_mpi_worker.py"
    script.write_text(WORKER)
    # Open MPI (a GPU machine's system MPI, say) refuses root unless told, and its shared-memory
    # single copy fails in some containers; MPICH ignores these variables
    env = dict(os.environ, MESHCOMM_TIMEOUT="60", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert sum(line.startswith("GPU MPI OK") for line in r.stdout.splitlines()) == 6, r.stdout


JAX_SCRIPT = textwrap.dedent('''
    import sys, numpy as np
    try:
        import jax, cupy
        gpus = jax.devices("gpu")
    except Exception as e:
        print("SKIP", type(e).__name__, e); sys.exit(0)
    from meshcomm.cuda import pack_cuda
    h = np.arange(6 * 40 * 12, dtype=np.float32).reshape(6, 40, 12)
    x = jax.device_put(h, gpus[0])
    sl = [(slice(1, 4), slice(0, 40), slice(4, 12)), (slice(4, 6), slice(3, 9), slice(0, 12))]
    buf = pack_cuda(x, sl)                         # read through DLPack, no copy
    want = np.concatenate([h[s].ravel() for s in sl])
    assert isinstance(buf, cupy.ndarray) and (cupy.asnumpy(buf) == want).all()
    print("JAX OK")
''')


def test_jax_gpu_arrays_reach_the_kernels_through_dlpack(cupy, tmp_path):
    run_on_jax_gpu(tmp_path, JAX_SCRIPT, "JAX OK")
