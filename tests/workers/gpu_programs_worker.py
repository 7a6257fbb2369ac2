"""Programs and eager collectives on tiles of one device kind, over MPI (2 processes).

GPU_TEST_DEVICE=cuda: torch CUDA tensors on the one GPU both processes share (MPI takes host
memory, so meshcomm stages through it); =cpu: the same on CPU torch tensors (CI's harness
check). Each Program runs three times on new data, and every result is compared bit for bit
against NumPy; prints one "PROGRAMS OK" line per process at the end.
"""
import os
import sys

import numpy as np
import torch

import meshcomm as mc

DEV = os.environ.get("GPU_TEST_DEVICE", "cuda")
ctx = mc.init(backend="mpi", devices_per_process=1)
rank, n = ctx.rank, ctx.world_size
if DEV == "cuda":
    torch.cuda.set_device(0)
mesh = mc.Mesh(list(range(n)), ("x",))
failures = []


def check(name, got, want):
    ok = (isinstance(got, torch.Tensor) and got.device.type == DEV and tuple(got.shape) == want.shape
          and np.array_equal(got.cpu().numpy(), want))
    if not ok:
        failures.append(name)
        print(f"BAD rank {rank} {name}: got {got!r} want {want!r}", flush=True)


def tiles(step, shape, dtype):
    """Every rank's tile for this step (each rank computes them all, keeps its own)."""
    g = np.random.default_rng(100 * step + len(shape))
    return [(g.integers(-50, 50, size=shape)).astype(dtype) for _ in range(n)]


def dev(a):
    return torch.from_numpy(a).to(DEV)


for dtype, tdt in ((np.float32, torch.float32), (np.int64, torch.int64)):
    shape = (6, 5)
    progs = {
        "all_reduce": mc.Program.all_reduce(mesh, "x", shape=shape, dtype=tdt, device=DEV),
        "all_gather": mc.Program.all_gather(mesh, "x", shape=shape, dtype=tdt, dim=1, device=DEV),
        "reduce_scatter": mc.Program.reduce_scatter(mesh, "x", shape=shape, dtype=tdt, device=DEV),
        "broadcast": mc.Program.broadcast(mesh, "x", shape=shape, dtype=tdt, root=1, device=DEV),
        "all_to_all": mc.Program.all_to_all(mesh, "x", shape=shape, dtype=tdt, device=DEV),
    }
    for step in range(3):
        t = tiles(step, shape, dtype)
        want = {
            "all_reduce": sum(t),
            "all_gather": np.concatenate(t, axis=1),
            "reduce_scatter": np.array_split(sum(t), n, axis=0)[rank],
            "broadcast": t[1],
            "all_to_all": np.concatenate([np.array_split(t[r], n, axis=0)[rank] for r in range(n)], axis=0),
        }
        for name, prog in progs.items():
            check(f"Program.{name} {dtype.__name__} run {step}", prog(dev(t[rank])), want[name])
        # the same calls eager (cached Programs after the first)
        check(f"all_reduce eager {step}", mc.all_reduce(dev(t[rank]), mesh, "x"), want["all_reduce"])
        check(f"all_gather eager {step}", mc.all_gather(dev(t[rank]), mesh, "x", dim=1), want["all_gather"])
        # out= buffers on the device are filled and returned
        buf = torch.empty(shape, dtype=tdt, device=DEV)
        got = progs["all_reduce"](dev(t[rank]), out=buf)
        check(f"all_reduce out= {step}", got, want["all_reduce"])
        if got is not buf:
            failures.append("out= not returned")
        h = progs["all_gather"](dev(t[rank]), async_op=True)
        check(f"all_gather async {step}", h.wait(), want["all_gather"])

# a reshard Program on device tiles, repeated: rows -> columns
shape = (10, 7)
src = mc.Layout(mesh, ("x", None))
dst = mc.Layout(mesh, (None, "x"))
prog = mc.Program.reshard(src, dst, shape=shape, dtype=torch.float32, device=DEV)
for step in range(3):
    full = np.random.default_rng(step).standard_normal(shape).astype(np.float32)
    mine = {d: v.to(DEV) for d, v in mc.shard(torch.from_numpy(full), src).items() if d == rank}
    want = mc.shard(full, dst)[rank]
    check(f"Program.reshard run {step}", prog(mine)[rank], want)
    check(f"reshard eager {step}", mc.reshard(mine, src, dst)[rank], want)

# a process holding no src tile gets its results on the tiles' device: the last rank
# receives a batch (and one tensor) that the others hold (an RL refit from a trainer's
# processes to a generator's): eager (the holders' device type, agreed) and as Programs
# (device=, declared)
last = n - 1
src1 = mc.Layout(mc.Mesh(list(range(n - 1)), ("s",)), ("s", None))
dst1 = mc.Layout(mc.Mesh([last], ("g",)), (None, None))
shapes = {"w": (6 * (n - 1), 5), "b": (3 * (n - 1), 2)}
progs = (mc.Program.reshard_many(src1, dst1, shapes=shapes, dtypes=torch.float32, device=DEV),
         mc.Program.reshard(src1, dst1, shape=shapes["w"], dtype=torch.float32, device=DEV))
for step in range(2):
    full = {k: np.random.default_rng(10 + step).standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    xs = {k: {d: v.to(DEV) for d, v in mc.shard(torch.from_numpy(a), src1).items() if d == rank}
          for k, a in full.items()}
    eager_many, prog_many = mc.reshard_many(xs, src1, dst1), progs[0](xs)
    eager_one, prog_one = mc.reshard(xs["w"], src1, dst1, shape=shapes["w"]), progs[1](xs["w"])
    if rank == last:
        for k, a in full.items():
            check(f"reshard_many eager to a receiver {k} {step}", eager_many[k][last], a)
            check(f"Program.reshard_many to a receiver {k} {step}", prog_many[k][last], a)
        check(f"reshard eager to a receiver {step}", eager_one[last], full["w"])
        check(f"Program.reshard to a receiver {step}", prog_one[last], full["w"])

# one process's bad device= raises on every process, in that construction
for make in (lambda d: mc.Program.reshard(src1, dst1, shape=shapes["w"], dtype=torch.float32, device=d),
             lambda d: mc.Program.reshard_many(src1, dst1, shapes=shapes, dtypes=torch.float32, device=d)):
    try:
        make("gpu" if rank == 0 else DEV)
    except ValueError as e:
        ok = str(e).startswith("device must be 'cpu' or 'cuda'") if rank == 0 else "rank 0: ValueError" in str(e)
        if not ok:
            failures.append(f"bad device= raised {e}")
            print(f"BAD rank {rank} bad device=: {e}", flush=True)
    else:
        failures.append("bad device= did not raise")
        print(f"BAD rank {rank} bad device= did not raise", flush=True)

mc.finalize()
if failures:
    sys.exit(1)
print(f"PROGRAMS OK rank {rank} {DEV}", flush=True)
