"""Run under mpiexec -n N: many all_to_all_v cases against a NumPy reference.

Every process derives the same random cases from the seed, runs its own devices' part,
checks it against the reference, and prints one line "A2A OK <rank> <cases>".
argv: backend devices_per_process seed
"""
import sys

import numpy as np

import meshcomm as mc
from meshcomm.alltoall import alltoall_plan, axis_groups


def reference(xs, counts, groups):
    out = {}
    for g in groups:
        for j, f in enumerate(g):
            parts = []
            for i, o in enumerate(g):
                off = int(sum(counts[o][:j]))
                parts.append(xs[o][off:off + counts[o][j]])
            out[f] = np.concatenate(parts)
    return out


def cases(world_devices, seed):
    rng = np.random.default_rng(seed)
    n = world_devices
    meshes = [mc.Mesh(np.arange(n), ("ep",))]
    if n % 2 == 0:
        meshes.append(mc.Mesh(np.arange(n).reshape(2, n // 2), ("dp", "ep")))
        meshes.append(mc.Mesh(np.arange(n)[::-1].reshape(n // 2, 2), ("ep", "dp")))
    topos = [None, mc.Topology(2), mc.Topology(max(1, n // 2))]
    for k in range(18):
        mesh = meshes[k % len(meshes)]
        size = mesh.axis_size("ep")
        hi = [0, 1, 3, 6][k % 4]
        counts = {d: rng.integers(0, hi + 1, size) for d in mesh.device_ids}
        if k % 3 == 0:                       # an empty rank: sends nothing
            counts[mesh.device_ids[k % mesh.size]][:] = 0
        if k % 5 == 1:                       # a rank that receives nothing
            j = k % size
            for d in mesh.device_ids:
                counts[d][j] = 0
        width = (k % 3) + 1
        dtype = [np.float32, np.int64, np.float64][k % 3]
        xs = {d: rng.standard_normal((int(counts[d].sum()), width)).astype(dtype) * 100
              for d in mesh.device_ids}
        yield mesh, counts, xs, topos[(k // 3) % len(topos)], k % 2 == 0, k % 4 == 3


def main():
    backend, dpp, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = mc.runtime.init(backend=backend, devices_per_process=dpp) if hasattr(mc.runtime, "init") \
        else mc.init(backend=backend, devices_per_process=dpp)
    rank, world = ctx.rank, ctx.world_size
    import torch
    ncases = n_two = 0
    for mesh, counts, xs, topo, give_recv, use_torch in cases(world * dpp, seed):
        mine = [d for d in mesh.device_ids if d // dpp == rank]
        groups = axis_groups(mesh, "ep")
        ref = reference(xs, counts, groups)
        recv = {}
        for g in groups:
            for j, f in enumerate(g):
                recv[f] = [int(counts[o][j]) for o in g]
        x0 = xs[mesh.device_ids[0]]
        row_bytes = int(np.prod(x0.shape[1:])) * x0.itemsize
        n_two += sum(p.algorithm == "two_level" for p in alltoall_plan(counts, mesh, "ep", row_bytes, topo).values())
        conv = (lambda v: torch.from_numpy(v)) if use_torch else (lambda v: v)
        x = {d: conv(xs[d]) for d in mine}
        sc = {d: counts[d] for d in mine}
        rc = {d: recv[d] for d in mine} if give_recv else None
        h = mc.all_to_all_v(x, sc, mesh, "ep", recv_counts=rc, topology=topo, async_op=True)
        y = h.wait()
        for d in mine:
            got = y[d].numpy() if use_torch else y[d]
            assert got.dtype == ref[d].dtype and got.shape == ref[d].shape, (d, got.shape, ref[d].shape)
            np.testing.assert_array_equal(got, ref[d], err_msg=f"case {ncases} device {d}")
        # combine: the inverse with counts swapped restores the input
        back = mc.all_to_all_v(y, {d: recv[d] for d in mine}, mesh, "ep",
                               recv_counts={d: counts[d] for d in mine}, topology=topo)
        for d in mine:
            got = back[d].numpy() if use_torch else back[d]
            np.testing.assert_array_equal(got, xs[d], err_msg=f"combine case {ncases} device {d}")
        ncases += 1
    # a bare array in, a bare array out (one device per process)
    if dpp == 1:
        mesh = mc.Mesh(np.arange(world), ("ep",))
        sc = np.arange(world) % 2
        x = np.full((int(sc.sum()), 2), rank, dtype=np.float32)
        y = mc.all_to_all_v(x, sc, mesh, "ep")
        want = np.repeat(np.arange(world), [sc[rank]] * world).astype(np.float32)
        np.testing.assert_array_equal(y[:, 0], want)
        ncases += 1
    # JAX rows (bfloat16), eager and as a Program: results come back as jax.Arrays, exact
    import jax
    import jax.numpy as jnp
    mesh = mc.Mesh(np.arange(world * dpp), ("ep",))
    mine = [d for d in mesh.device_ids if d // dpp == rank]
    counts = {d: (np.arange(mesh.size) + d) % 3 for d in mesh.device_ids}
    xs = {d: (np.arange(int(counts[d].sum()) * 2).reshape(-1, 2) + 100 * d).astype(jnp.bfloat16)
          for d in mesh.device_ids}
    ref = reference(xs, counts, axis_groups(mesh, "ep"))
    bare = dpp == 1
    x = jnp.asarray(xs[mine[0]]) if bare else {d: jnp.asarray(xs[d]) for d in mine}
    sc = counts[mine[0]] if bare else {d: counts[d] for d in mine}
    prog = mc.Program.all_to_all_v(mesh, "ep", rows=(2,), dtype=jnp.bfloat16)
    for y in (mc.all_to_all_v(x, sc, mesh, "ep"), prog(x, sc), prog(x, sc, async_op=True).wait()):
        got = {mine[0]: y} if bare else y
        for d in mine:
            assert isinstance(got[d], jax.Array) and got[d].dtype == jnp.bfloat16, (d, type(got[d]))
            np.testing.assert_array_equal(np.asarray(got[d]), ref[d], err_msg=f"JAX rows device {d}")
        ncases += 1
    # a mesh on some processes only: the others get None and take no part
    sub = mc.Mesh([0, world * dpp - 1], ("ep",))
    mine = [d for d in sub.device_ids if d // dpp == rank]
    y = mc.all_to_all_v({d: np.full((2, 1), d, np.int32) for d in mine}, {d: [1, 1] for d in mine}, sub, "ep")
    if mine:
        for d in mine:
            np.testing.assert_array_equal(y[d][:, 0], list(sub.device_ids))
    else:
        assert y is None
    # wrong recv_counts for a peer's rows: the receiving process gets a ValueError naming
    # its device after the exchange, the others their right result, and nobody hangs
    if world > 1:
        mesh = mc.Mesh(np.arange(world * dpp), ("ep",))
        n = mesh.size
        mine = [d for d in mesh.device_ids if d // dpp == rank]
        victim = n - 1                                   # owned by the last rank
        x = {d: np.full((n, 1), d, np.int64) for d in mine}
        sc = {d: [1] * n for d in mine}
        rc = {d: [1] * n for d in mine}
        if victim in rc:
            rc[victim][0] = 2                            # device 0 (rank 0) sends it 1 row
        try:
            y = mc.all_to_all_v(x, sc, mesh, "ep", recv_counts=rc)
            assert victim not in mine, "no error for wrong recv_counts"
            for d in mine:
                np.testing.assert_array_equal(y[d][:, 0], np.arange(n))
        except ValueError as e:
            assert victim in mine and f"device {victim}" in str(e), e
        # and the next call still works on every process (tags and state stay in step)
        y = mc.all_to_all_v(x, sc, mesh, "ep")
        for d in mine:
            np.testing.assert_array_equal(y[d][:, 0], np.arange(n))
        ncases += 2
    # one rank's bad rows in a call made before (its Program cached): that rank raises its own
    # ValueError (it raised the others' "not in the same call"), the others a PeerError naming it
    if world > 1:
        from meshcomm.errors import PeerError
        mesh = mc.Mesh(np.arange(world * dpp), ("ep",))
        mine = [d for d in mesh.device_ids if d // dpp == rank]
        sc = {d: [1] * mesh.size for d in mine}
        mc.all_to_all_v({d: np.full((mesh.size, 2), d, np.float32) for d in mine}, sc, mesh, "ep")
        bad = world - 1
        x = {d: np.zeros((mesh.size + (rank == bad), 2), np.float32) for d in mine}
        try:
            mc.all_to_all_v(x, sc, mesh, "ep")
            raise AssertionError("bad rows were taken")
        except PeerError as e:
            assert rank != bad and f"rank {bad}" in str(e), e
        except ValueError as e:
            assert rank == bad and "rows" in str(e), e
        if backend == "mpi":        # over gloo, given-up waits ask for a re-init (README)
            y = mc.all_to_all_v({d: np.full((mesh.size, 2), d, np.float32) for d in mine}, sc, mesh, "ep")
            for d in mine:
                np.testing.assert_array_equal(y[d][:, 0], np.arange(mesh.size))
        ncases += 1
    # a device without a process is refused before any communication, naming it
    try:
        mc.all_to_all_v({}, {}, mc.Mesh([0, world * dpp + 3], ("ep",)), "ep")
        raise AssertionError("no error for a device without a process")
    except ValueError as e:
        assert str(world * dpp + 3) in str(e), e
    ncases += 2
    print(f"A2A OK {rank} {ncases} {n_two}", flush=True)


if __name__ == "__main__":
    main()
