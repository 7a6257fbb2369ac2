"""Run under `torchrun --nproc-per-node 4` (or mpiexec -n 4): meshcomm.init(backend="torch"),
then move DTensors between DIFFERENT DeviceMeshes (which DTensor's redistribute refuses),
with Shard / Replicate / Partial placements, even and uneven, and check each result against
the global tensor: its local tensor against torch's own rule
(`compute_local_shape_and_global_offset`: the rank at mesh coordinate c holds chunk c) and
an independent nested torch.chunk, and DTensor's own full_tensor() on the new mesh where
torch's collectives can compute it. Ranks outside the new mesh must hold an empty local
tensor. Sources are built with DTensor.from_local from chunks cut by torch's rule (not by
meshcomm). Fixed cases put every DeviceMesh whose ranks are not ascending (1-d and 2-d,
even and uneven shards) on one side or both. State dicts of DTensors move in one batch
(`reshard_state_dict`).

argv: number of random cases, seed. Prints "DTENSOR OK <rank> <cases>" on success."""
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import meshcomm as mc
from meshcomm.adapters.dtensor import layout_from_placements, reshard_dtensor, reshard_state_dict

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
    "perm4": DeviceMesh("cpu", [2, 0, 3, 1], mesh_dim_names=("r",)),
    "perm2x2": DeviceMesh("cpu", [[3, 1], [0, 2]], mesh_dim_names=("u", "v")),
    "tr2x2": DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("c", "d")),
}


def torch_local(g, mesh, placements):
    """The tile torch's own rule gives this rank (DTensor's empty tensor outside the mesh)."""
    if mesh.get_coordinate() is None:
        return g.new_empty(0)
    shape, offset = compute_local_shape_and_global_offset(g.shape, mesh, placements)
    return g[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def make_dtensor(g, mesh, placements, seed):
    """A DTensor holding g: each rank's tile cut by torch's rule (a Partial's addends, which
    torch has no rule for, from meshcomm.shard)."""
    ranks = mesh.mesh.numpy()
    if any(isinstance(p, Partial) for p in placements):
        lay = layout_from_placements(mesh, placements, g.shape)
        tiles = mc.shard(g, lay, seed=seed)
        local = tiles[rank].contiguous() if rank in lay.mesh else g.new_empty(0)
    else:
        local = torch_local(g, mesh, placements).contiguous()
        if mesh.get_coordinate() is not None:       # torch's local split agrees (no messages)
            assert torch.equal(distribute_tensor(g, mesh, placements, src_data_rank=None).to_local(),
                               local), (mesh, placements)
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
        want = torch_local(g, mesh, placements)
        assert tuple(local.shape) == tuple(want.shape) and same(local, want), (what, local, want)
        want = expected_local(g, ranks, placements, coord)
        assert tuple(local.shape) == tuple(want.shape) and same(local, want), what
    if torch_can_gather(g.shape, ranks, placements):
        full = y.full_tensor()
        assert same(full, g), (what, tuple(g.shape), full, g)
        global gathered
        gathered += 1


gathered = 0       # full_tensor() checks made on this rank


def torch_can_gather(shape, ranks, placements):
    """Whether torch 2.13's collectives gather these placements in mesh order. They do not
    follow its own coordinate rule in two cases: a mesh dimension that shards and whose ranks
    are not ascending along it (its process groups order members by global rank), and a
    tensor dimension sharded unevenly over several mesh dims."""
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard) and not (np.diff(ranks, axis=mdim) > 0).all():
            return False
    return not _uneven_nested(shape, ranks, placements)


def _uneven_nested(shape, ranks, placements):
    ways = {}
    for mdim, p in enumerate(placements):
        if isinstance(p, Shard):
            ways.setdefault(p.dim, []).append(ranks.shape[mdim])
    return any(len(w) > 1 and shape[d] % math.prod(w) for d, w in ways.items())


ORDER_CASES = [
    # (src mesh, src placements, dst mesh, dst placements, shape): meshes whose ranks are
    # not ascending, 1-d and 2-d, even and uneven (trailing empty) shards
    ("all4", [Shard(0)], "perm4", [Shard(0)], (8, 3)),
    ("all4", [Shard(0)], "perm4", [Shard(0)], (6, 3)),
    ("perm4", [Shard(1)], "all2x2", [Shard(1), Shard(0)], (5, 7)),
    ("perm4", [Shard(1)], "perm2x2", [Shard(0), Shard(1)], (3, 7)),
    ("perm2x2", [Shard(1), Shard(0)], "perm4", [Shard(0)], (5, 6)),
    ("perm2x2", [Shard(0), Shard(0)], "tr2x2", [Shard(0), Replicate()], (7,)),
    ("tr2x2", [Shard(1), Shard(0)], "perm2x2", [Replicate(), Shard(1)], (4, 4)),
    ("rev2x2", [Shard(0), Shard(1)], "perm4", [Shard(1)], (5, 3)),
    ("odd3", [Shard(0)], "perm4", [Shard(0)], (5, 2)),
    ("perm4", [Shard(0)], "odd3", [Shard(0)], (9,)),
    ("perm4", [Partial()], "perm2x2", [Shard(0), Shard(0)], (6, 2)),
    ("perm2x2", [Shard(1), Partial()], "perm4", [Shard(1)], (2, 7)),
    ("tr2x2", [Shard(0), Shard(1)], "tr2x2", [Shard(1), Shard(0)], (4, 6)),
]


def order_cases():
    for k, (a, pa, b, pb, shape) in enumerate(ORDER_CASES):
        g = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) * 3 - 7
        dt, _ = make_dtensor(g, MESHES[a], pa, seed=100 + k)
        y = reshard_dtensor(dt, MESHES[b], pb)
        check(y, g, MESHES[b], pb, f"order case {k}: {pa} on {MESHES[a].mesh.tolist()} -> {pb} on "
              f"{MESHES[b].mesh.tolist()} shape {shape}")
    return len(ORDER_CASES)


STATE_CASES = [
    # (src mesh, dst mesh, {name: (shape, src placements, dst placements)}): a model's
    # weights in one batch; uneven shards, meshes whose ranks are not ascending, Partial
    ("all4", "perm2x2", {"wte": ((10, 6), [Shard(0)], [Replicate(), Shard(1)]),
                         "qkv": ((6, 18), [Shard(0)], [Replicate(), Shard(1)]),
                         "ln": ((6,), [Shard(0)], [Replicate(), Replicate()]),
                         "fc2": ((7, 5), [Shard(1)], [Shard(0), Shard(1)])}),
    ("lo", "rev2x2", {"a": ((5, 3), [Shard(0)], [Shard(1), Replicate()]),
                      "b": ((4,), [Partial()], [Shard(0), Shard(0)]),
                      "c": ((3, 3, 2), [Replicate()], [Replicate(), Shard(2)])}),
    ("perm4", "hi", {"x": ((9, 2), [Shard(0)], [Shard(0)]), "y": ((2, 9), [Shard(1)], [Replicate()])}),
]


def state_dict_cases():
    """reshard_state_dict: every entry moved in one reshard_many call (one placements list,
    a dict by name, a callable), checked entry by entry as reshard_dtensor's results."""
    done = 0
    for k, (a, b, spec) in enumerate(STATE_CASES):
        g = {n: (torch.arange(math.prod(shp), dtype=torch.int64).reshape(shp) * (k + 2) - 5).to(
            torch.float32 if i % 2 else torch.int64) for i, (n, (shp, _, _)) in enumerate(spec.items())}
        sd = {n: make_dtensor(g[n], MESHES[a], pa, seed=200 + k)[0] for n, (_, pa, _) in spec.items()}
        by_name = {n: pb for n, (_, _, pb) in spec.items()}
        for how, placements in (("dict", by_name), ("callable", by_name.__getitem__)):
            out = reshard_state_dict(sd, MESHES[b], placements)
            assert list(out) == list(sd), (list(out), list(sd))
            for n, y in out.items():
                check(y, g[n], MESHES[b], by_name[n], f"state dict case {k} ({how}) {n}")
            done += 1
    # one placements list for all, asynchronously, a dict whose order differs between ranks
    g = {n: torch.arange(24, dtype=torch.float32).reshape(4, 6) + i for i, n in enumerate("pqr")}
    names = list(g) if rank % 2 else list(reversed(g))
    sd = {n: make_dtensor(g[n], MESHES["hi"], [Shard(1)], 0)[0] for n in names}
    h = reshard_state_dict(sd, MESHES["perm4"], [Shard(0)], async_op=True)
    assert isinstance(h, mc.Handle)
    out = h.wait()
    assert list(out) == names
    for n in names:
        check(out[n], g[n], MESHES["perm4"], [Shard(0)], f"state dict (one list) {n}")
    return done + 1


def state_dict_errors():
    """Bad input names the entry, on every rank (last: a failed agreement followed by another
    of the same Program number can read the failed one's stale metas over the torch store)."""
    done = 0
    g = {n: torch.arange(24, dtype=torch.float32).reshape(4, 6) + i for i, n in enumerate("pqr")}
    sd = {n: make_dtensor(g[n], MESHES["hi"], [Shard(1)], 0)[0] for n in g}
    for bad, err, what in (({"p": [Shard(0)], "q": [Shard(0)], "r": [Shard(5)]}, ValueError, "'r'"),
                           ({"p": [Shard(0)], "q": [Shard(0)]}, ValueError, "['r']"),
                           ([Shard(0), Shard(1)], ValueError, "placement")):
        try:
            reshard_state_dict(sd, MESHES["perm4"], bad)
        except err as e:
            assert what in str(e), (what, str(e))
        else:
            raise AssertionError(f"bad placements {bad} were not refused")
        done += 1
    try:
        reshard_state_dict(dict(sd, t=torch.ones(2)), MESHES["perm4"], [Shard(0)])
    except TypeError as e:
        assert "entry 't'" in str(e) and "DTensor" in str(e), str(e)
    else:
        raise AssertionError("a plain tensor in the state dict was not refused")
    return done + 1


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
    assert isinstance(h, mc.Handle), type(h)
    z = h.wait()
    check(z, g, MESHES["all2x2"], [Shard(0), Shard(0)], "one -> all2x2 (uneven nested)")
    done += 2
    done += order_cases()
    assert gathered >= 10, gathered
    done += state_dict_cases()
    # one rank passes an invalid placement: every rank raises within seconds, naming it
    import time
    bad = dist.get_world_size() - 1
    g = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dt, _ = make_dtensor(g, MESHES["lo"], [Shard(0)], 0)
    # (a plain tensor and a bare placement too: they were checked before the call's shared
    # error path, so the other ranks waited out MESHCOMM_TIMEOUT)
    # (each a call not made before: the others construct, and all raise in that agreement)
    for k, (plain, pl) in enumerate(((False, [Shard(5)]), (True, [Shard(1)]), (False, Shard(1)))):
        g = torch.arange(6 * (4 + k), dtype=torch.float32).reshape(4 + k, 6)
        dt, _ = make_dtensor(g, MESHES["lo"], [Shard(0)], 0)
        x = dt.to_local() if plain else dt
        t0 = time.monotonic()
        try:
            reshard_dtensor(x if rank == bad else dt, MESHES["hi"], pl if rank == bad else [Shard(1)])
        except (ValueError, TypeError) as e:
            assert rank == bad or f"rank {bad}" in str(e), str(e)
            assert time.monotonic() - t0 < 15, time.monotonic() - t0
        else:
            raise AssertionError(f"rank {rank}: an invalid input on rank {bad} was not refused: "
                                 f"{type(x).__name__} {pl}")
        y = reshard_dtensor(dt, MESHES["hi"], [Shard(1)])       # the next call works
        check(y, g, MESHES["hi"], [Shard(1)], "after a refused input")
        done += 1
    # a 0-d DTensor onto a mesh without this rank keeps its global shape (), as torch's does
    z = reshard_dtensor(distribute_tensor(torch.tensor(3.25), MESHES["lo"], [Replicate()]), MESHES["hi"],
                        [Replicate()])
    assert tuple(z.shape) == () and (rank not in MESHES["hi"].mesh.tolist() or z.to_local().item() == 3.25), z
    done += 1
    done += state_dict_errors()
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
