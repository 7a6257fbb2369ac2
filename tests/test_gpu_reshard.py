"""GPU reshards beyond the kernels (`pytest -m gpu`; skipped cleanly without CUDA):

* random local reshards (the generator of the multi-process tests, tests/workers/cases.py:
  uneven splits, Blocks, pending sums, 0-d and empty tensors) on 8 logical devices that all
  live on the one GPU, with torch CUDA tensors (`meshcomm.reshard`, and the packed message path
  of meshcomm.cuda.executor that runs the kernels) and with CuPy arrays (the packed path),
  each compared bit for bit against the same reshard of NumPy arrays;
* two processes sharing the GPU over torch.distributed with gloo (a process group the user
  made; meshcomm stages CUDA tensors through host memory, since gloo's point-to-point calls
  take host memory only): eager reshards, a Program and reshard_many on CUDA tensors;
* `reshard_jax` with JAX on the GPU (a subprocess: JAX and torch each keep their own pool);
* collective Programs (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all), eager
  collectives, out= buffers, async runs and a reshard Program on CUDA tensors of two MPI
  processes sharing the GPU (tests/workers/gpu_programs_worker.py).

The harnesses of the random reshards, the gloo and the MPI Program tests also run on CPU (torch CPU tensors), so it is checked on every
machine.
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
from meshcomm.arrays import numpy_dtype  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
from cases import random_case, random_data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

# dtypes torch and CuPy both compute with on CUDA (uint16/32/64 have no CUDA arithmetic in torch)
GPU_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool"]
TORCH_OF = {"bfloat16": "bfloat16", "bool": "bool"}


def gpu_cases(n, seed):
    """(shape, src, dst, dtype, NumPy array) for n random cases over 8 devices."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        shape, src, dst, _, _ = random_case(rng, 8)
        pending = bool(src.partial or dst.partial)
        choices = [d for d in GPU_DTYPES if not (pending and d == "bool")]
        dtype = str(rng.choice(choices))
        yield shape, src, dst, dtype, random_data(rng, shape, dtype, "numpy")


def to_torch(a: np.ndarray, device):
    if a.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(device)
    return torch.from_numpy(a.copy()).to(device)       # copy: C order, 0-d stays 0-d


def bits(x) -> np.ndarray:
    """The raw bytes of a NumPy array, torch tensor (any device) or CuPy array."""
    if type(x).__module__.startswith("cupy"):
        x = x.get()
    elif isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        x = x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def check(got: dict, want: dict, what) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for d, w in want.items():
        g = got[d]
        assert tuple(g.shape) == tuple(w.shape), (what, d, tuple(g.shape), w.shape)
        assert np.array_equal(bits(g), bits(w)), (what, d)


def run_random(n: int, seed: int, device: str, cupy=None) -> dict:
    """The random cases on `device` (torch tensors; CuPy arrays too when `cupy` is given),
    each against NumPy; returns counts of what ran."""
    from meshcomm.cuda.executor import execute_packed
    ran = dict(cases=0, pending=0, blocks=0, empty=0, cupy=0)
    for i, (shape, src, dst, dtype, x) in enumerate(gpu_cases(n, seed)):
        what = (i, shape, str(src), str(dst), dtype)
        shards = mc.shard(x, src, seed=i)
        want = mc.reshard(shards, src, dst, shape=shape, dtype=x.dtype)
        tiles = {d: to_torch(v, device) for d, v in shards.items()}
        got = mc.reshard(tiles, src, dst, shape=shape, dtype=TORCH_OF.get(dtype, dtype))
        assert all(t.device.type == torch.device(device).type for t in got.values()), what
        check(got, want, ("reshard",) + what)
        p = mc.plan(shape, dtype, src, dst)
        like = to_torch(np.zeros(1, x.dtype), device)
        check(execute_packed(p, tiles, like=like), want, ("packed",) + what)
        if cupy is not None and dtype != "bfloat16":        # CuPy has no bfloat16
            ctiles = {d: cupy.asarray(v.copy()) for d, v in shards.items()}
            out = execute_packed(p, ctiles, like=cupy.zeros(1, dtype=x.dtype))
            assert all(type(t).__module__.startswith("cupy") for t in out.values()), what
            check(out, want, ("cupy",) + what)
            ran["cupy"] += 1
        ran["cases"] += 1
        ran["pending"] += bool(src.partial or dst.partial)
        ran["blocks"] += any(isinstance(s, mc.Blocks) for s in tuple(src.spec) + tuple(dst.spec))
        ran["empty"] += x.size == 0 or x.ndim == 0
    return ran


def test_random_reshards_harness_on_cpu():
    ran = run_random(40, 1, "cpu")
    assert ran["cases"] == 40 and ran["pending"] > 5 and ran["blocks"] > 5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_random_local_reshards_on_the_gpu_bitwise_against_numpy(monkeypatch):
    from meshcomm.cuda import kernels
    monkeypatch.setattr(kernels, "COPY_MIN_BYTES", 0)    # the local backend's kernel copies, every piece
    try:
        import cupy
        from meshcomm import cuda
        cupy = cupy if cuda.available() else None
    except ImportError:
        cupy = None
    ran = run_random(150, 2, "cuda", cupy)
    print("random GPU reshards:", ran)
    assert ran["cases"] == 150 and ran["pending"] > 20 and ran["blocks"] > 20
    if cupy is None:
        pytest.skip(f"CuPy missing: torch CUDA cases passed ({ran}); the CuPy half did not run")
    assert ran["cupy"] > 100


# -- two processes sharing the GPU over torch.distributed with gloo ------------------------------

GLOO_WORKER = textwrap.dedent('''
    import os, sys, numpy as np, torch, torch.distributed as dist
    import meshcomm as mc
    sys.path.insert(0, os.environ["CASES_DIR"])
    from cases import random_case, random_data
    dist.init_process_group("gloo")                    # the user's group: gloo alone
    ctx = mc.init(backend="torch", devices_per_process=4)
    rank = ctx.rank
    DEV = os.environ.get("GPU_TEST_DEVICE", "cuda")     # "cpu": the harness alone, on any machine
    if DEV == "cuda":
        torch.cuda.set_device(0)
    assert ctx._backends["torch"].stage_cuda          # gloo alone: CUDA tensors go through the host

    def mine(d):
        return d // 4 == rank

    def bits(t):
        t = t.detach().cpu().contiguous()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1).view(np.uint8)

    rng = np.random.default_rng(30)
    n_ok = 0
    for i in range(40):
        shape, src, dst, _, _ = random_case(rng, 8)
        pending = bool(src.partial or dst.partial)
        dtype = str(rng.choice(["float32", "float64", "int32", "int64", "bfloat16", "int8", "float16"]))
        x = random_data(rng, shape, dtype, "numpy")
        shards = mc.shard(x, src, seed=i)
        want = mc.reshard(shards, src, dst, backend="local", shape=shape, dtype=x.dtype)
        def cuda(v):
            if dtype == "bfloat16":
                return torch.from_numpy(v.astype(np.float32)).to(torch.bfloat16).to(DEV)
            return torch.from_numpy(v.copy()).to(DEV)
        tiles = {d: cuda(v) for d, v in shards.items() if mine(d)}
        tdt = getattr(torch, dtype)
        got = mc.reshard(tiles, src, dst, shape=shape, dtype=tdt)
        prog = mc.Program.reshard(src, dst, shape=shape, dtype=tdt, device=DEV)
        again = prog(tiles)
        for out in (got, again):
            assert set(out) == {d for d in want if mine(d)}, (i, sorted(out))
            for d, t in out.items():
                expect = np.ascontiguousarray(want[d]).reshape(-1).view(np.uint8)     # NumPy's bytes, bfloat16 too
                assert t.device.type == DEV and np.array_equal(bits(t), expect), (i, d, str(src), str(dst), dtype)
        n_ok += 1
    # many tensors in one batch
    m = mc.Mesh(np.arange(8).reshape(2, 4), ("x", "y"))
    src, dst = mc.Layout(m, ("x", "y")), mc.Layout(m, ("y", None))
    xs = [torch.randn(8 + k, 12, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    tiles = {f"t{k}": {d: v.to(DEV) for d, v in mc.shard(x, src).items() if mine(d)} for k, x in enumerate(xs)}
    outs = mc.reshard_many(tiles, src, dst)
    for k, x in enumerate(xs):
        assert sorted(outs[f"t{k}"]) == [d for d in range(8) if mine(d)]
        for d, t in outs[f"t{k}"].items():
            assert t.device.type == DEV and torch.equal(t.cpu(), mc.shard(x, dst)[d]), d
    print(f"GLOO GPU OK rank {rank} {n_ok} random reshards + reshard_many", flush=True)
    mc.finalize()
    dist.destroy_process_group()
''')


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gloo_processes_share_one_gpu(tmp_path, device="cuda"):
    import socket
    script = tmp_path / "gloo_gpu_worker.py"
    script.write_text(GLOO_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MESHCOMM_TIMEOUT="60",
                   OMP_NUM_THREADS="1", CASES_DIR=str(ROOT / "tests" / "workers"), GPU_TEST_DEVICE=device)
        procs.append(subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=200)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-6000:]
    assert text.count("GLOO GPU OK") == 2, text[-6000:]


def test_gloo_processes_harness_on_cpu(tmp_path):
    """The same two processes on CPU tensors: a process without src tiles that passes a torch
    dtype (eager) or device= (Program) gets torch results; every result exact."""
    test_gloo_processes_share_one_gpu(tmp_path, device="cpu")


# -- collective and reshard Programs of two MPI processes on the one GPU ------------------------

@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_mpi_programs_on_cuda_tensors(device="cuda"):
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    if not Path(mpiexec).exists():
        pytest.skip("mpiexec not found")
    pytest.importorskip("mpi4py")
    # Open MPI (a GPU machine's system MPI) refuses root unless told; MPICH ignores these
    env = dict(os.environ, MESHCOMM_TIMEOUT="60", OMP_NUM_THREADS="1", GPU_TEST_DEVICE=device,
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    worker = ROOT / "tests" / "workers" / "gpu_programs_worker.py"
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, str(worker)], capture_output=True, text=True,
                       timeout=240, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count("PROGRAMS OK") == 2 and "BAD" not in r.stdout, r.stdout[-4000:]


@pytest.mark.mpi
def test_mpi_programs_harness_on_cpu():
    """The same worker on CPU torch tensors: checks the harness on every machine."""
    pytest.importorskip("mpi4py")
    test_mpi_programs_on_cuda_tensors(device="cpu")


# -- reshard_jax with JAX on the GPU ---------------------------------------------------------------

JAX_RESHARD = textwrap.dedent('''
    import sys, numpy as np
    try:
        import jax
        gpus = jax.devices("gpu")
    except Exception as e:
        print("SKIP", type(e).__name__, e); sys.exit(0)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import meshcomm as mc
    from meshcomm.adapters.jax import reshard_jax
    mesh = Mesh(np.array(gpus[:1]).reshape(1, 1), ("x", "y"))
    h = np.arange(37 * 50, dtype=np.float32).reshape(37, 50)
    x = jax.device_put(h, NamedSharding(mesh, P("x", "y")))
    y = reshard_jax(x, NamedSharding(mesh, P(None, ("x", "y"))))
    assert y.sharding.spec == P(None, ("x", "y")) and all(d.platform == "gpu" for d in y.devices()), y.sharding
    assert (np.asarray(y) == h).all()
    # a Layout JAX cannot express: a dict of tiles on the GPU
    m = mc.Mesh([[gpus[0].id]], ("a", "b"))
    tiles = reshard_jax(x, mc.Layout(m, (mc.Blocks("a", [37]), None)))
    (t,) = tiles.values()
    assert list(t.devices())[0].platform == "gpu" and (np.asarray(t) == h).all()
    # a pytree in one batch, bfloat16 and int8 leaves
    import jax.numpy as jnp
    tree = {"w": jax.device_put(jnp.asarray(h, jnp.bfloat16), NamedSharding(mesh, P("x", None))),
            "b": [jax.device_put(np.arange(9, dtype=np.int8), NamedSharding(mesh, P("x")))]}
    out = reshard_jax(tree, NamedSharding(mesh, P()))
    assert out["w"].dtype == jnp.bfloat16 and (np.asarray(out["w"]) == np.asarray(tree["w"])).all()
    assert (np.asarray(out["b"][0]) == np.arange(9)).all()
    print("JAX RESHARD OK", gpus[0].device_kind)
''')


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_reshard_jax_on_the_gpu(tmp_path):
    run_on_jax_gpu(tmp_path, JAX_RESHARD, "JAX RESHARD OK")
