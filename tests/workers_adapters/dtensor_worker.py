"""Run under `torchrun --nproc-per-node 4` (or mpiexec -n 4): meshcomm.init(backend="torch"),
then move DTensors between DIFFERENT DeviceMeshes (which DTensor's redistribute refuses),
with Shard / Replicate / Partial placements, even and uneven, and check each result against
the global tensor, both its local tensor (DTensor's nested torch.chunk) and DTensor's own
full_tensor() on the new mesh. Ranks outside the new mesh must hold an empty local tensor.

argv: number of random cases, seed. Prints "DTENSOR OK <rank> <cases>" on success."""
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import meshcomm as mc
from meshcomm.adapters.dtensor import layout_from_placements, reshard_dtensor

ncases = int(sys.argv[1])
seed = int(sys.argv[2])
ctx = mc.init(backend="torch")
rank, world = dist.get_rank(), dist.get_world_size()
assert ctx.rank == rank and world == 4


def expected_local(full, ranks, placements, coord):
    t = full
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            parts = torch.chunk(t, ranks.shape[mdim], dim=p.dim)
            i = coord[mdim]
            if i < len(parts):
                t = parts[i]
            else:
                shp = list(t.shape)
                shp[p.dim] = 0
                t = t.new_empty(shp)
    return t


# every rank creates every mesh, in the same order (DeviceMesh creation is collective)
MESHES = {
    "all2x2": DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("a", "b")),
    "all4": DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=("w",)),
    "lo": DeviceMesh("cpu", [0, 1], mesh_dim_names=("l",)),
    "hi": DeviceMesh("cpu", [2, 3], mesh_dim_names=("h",)),
    "odd3": DeviceMesh("cpu", [3, 1, 2], mesh_dim_names=("o",)),
    "rev2x2": DeviceMesh("cpu", [[3, 2], [1, 0]], mesh_dim_names=("p", "q")),
    "one": DeviceMesh("cpu", [2], mesh_dim_names=("s",)),
}


def make_dtensor(g, mesh, placements, seed):
    """A DTensor holding g: each rank's local tile (addends of a Partial from meshcomm.shard)."""
    ranks = mesh.mesh.numpy()
    lay = layout_from_placements(mesh, placements, g.shape)
    tiles = mc.shard(g, lay, seed=seed)
    local = tiles[rank].contiguous() if rank in lay.mesh else g.new_empty(0)
    stride = tuple(int(s) for s in torch.empty(g.shape).stride()) if g.dim() else ()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=g.shape, stride=stride), ranks


def random_placements(rng, ndim_mesh, ndim, partial_ok):
    out = []
    for _ in range(ndim_mesh):
        r = rng.integers(5 if partial_ok else 4)
        out.append(Replicate() if r == 0 else Partial() if r == 4 else Shard(int(rng.integers(ndim))))
    return out


def check(y, g, mesh, placements, what, exact=True):
    same = (lambda a, b: torch.equal(a, b)) if exact else \
        (lambda a, b: a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-4))
    assert isinstance(y, DTensor), what
    assert y.device_mesh is mesh or y.device_mesh == mesh, what
    assert tuple(y.placements) == tuple(placements), (what, y.placements)
    assert tuple(y.shape) == tuple(g.shape) and y.dtype == g.dtype, what
    ranks = mesh.mesh.numpy()
    where = np.argwhere(ranks == rank)
    if len(where) == 0:
        assert y.to_local().numel() == 0, what            # DTensor's non-participating convention
        return
    coord = tuple(int(c) for c in where[0])
    local = y.to_local()
    if not any(isinstance(p, Partial) for p in placements):
        want = expected_local(g, ranks, placements, coord)
        assert tuple(local.shape) == tuple(want.shape) and same(local, want), what
    flat = ranks.reshape(-1)
    if not _uneven_nested(g.shape, ranks, placements) and (np.diff(flat) > 0).all():
        # DTensor's own collectives on the new mesh agree. torch 2.13's collectives are not
        # consistent with its own mesh-coordinate rule (compute_local_shape_and_global_offset)
        # in two cases, even for DTensors made by distribute_tensor: a mesh whose ranks are not
        # ascending (they gather in process-group rank order), and a dimension sharded
        # unevenly over several mesh dims. Those cases check the local tensors only.
        full = y.full_tensor()
        assert same(full, g), (what, tuple(g.shape), full, g)


def _uneven_nested(shape, ranks, placements):
    ways = {}
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            ways.setdefault(p.dim, []).append(ranks.shape[mdim])
    return any(len(w) > 1 and shape[d] % math.prod(w) for d, w in ways.items())


def main():
    rng = np.random.default_rng(seed)
    names = list(MESHES)
    done = 0
    # DTensor itself refuses this (the reason the adapter exists)
    g = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dt, _ = make_dtensor(g, MESHES["lo"], [Shard(0)], 0)
    try:
        dt.redistribute(MESHES["hi"], [Shard(1)])
        refused = False
    except (NotImplementedError, RuntimeError, ValueError, AssertionError):
        refused = True
    assert refused, "DTensor redistribute across meshes unexpectedly worked"
    for i in range(ncases):
        m1, m2 = MESHES[names[rng.integers(len(names))]], MESHES[names[rng.integers(len(names))]]
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(v) for v in rng.integers(1, 8, size=ndim))
        dtype = [torch.float32, torch.int32, torch.int64][i % 3]
        g = torch.from_numpy(np.random.default_rng(i).integers(-50, 50, size=shape)).to(dtype)
        p1 = random_placements(rng, m1.ndim, ndim, partial_ok=True)
        p2 = random_placements(rng, m2.ndim, ndim, partial_ok=True)
        dt, _ = make_dtensor(g, m1, p1, seed=i)
        y = reshard_dtensor(dt, m2, p2)
        # float addends of a Partial source (random, from meshcomm.shard) sum with rounding
        exact = not (dtype.is_floating_point and any(isinstance(p, Partial) for p in p1))
        check(y, g, m2, p2, f"case {i}: {p1} on {m1.mesh.tolist()} -> {p2} on {m2.mesh.tolist()}", exact)
        done += 1
    # fixed: a 2x2 sharded bf16 tensor onto the disjoint one-rank mesh and back to all four
    g = torch.randn(6, 10, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    dt, _ = make_dtensor(g, MESHES["lo"], [Shard(1)], 0)
    y = reshard_dtensor(dt, MESHES["one"], [Replicate()])
    check(y, g, MESHES["one"], [Replicate()], "lo -> one")
    h = reshard_dtensor(y, MESHES["all2x2"], [Shard(0), Shard(0)], async_op=True)
    z = h.wait()
    check(z, g, MESHES["all2x2"], [Shard(0), Shard(0)], "one -> all2x2 (uneven nested)")
    done += 2
    dist.barrier()
    print(f"DTENSOR OK {rank} {done}", flush=True)
    mc.finalize()


try:
    main()
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
