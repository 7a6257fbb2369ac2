"""Run under `mpiexec -n 4`: JAX multi-process on CPU (jax.distributed, 2 local devices per
process, 8 in all) + meshcomm's runtime with devices_per_process=2. Reshards random
NamedShardings (including device sets JAX's device_put across processes cannot take, and
uneven Layouts) with each backend and checks every addressable shard exactly.

argv: backends (comma-separated), number of random cases, seed.
Prints "JAXDIST OK <rank> <cases>" on success."""
import os
import socket
import sys

LOCAL = 2
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL}"
os.environ["JAX_PLATFORMS"] = "cpu"

from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
if comm.rank == 0:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
else:
    port = None
port = comm.bcast(port)

import jax  # noqa: E402
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=comm.size,
                           process_id=comm.rank, initialization_timeout=60)

import math  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh as JMesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshcomm as mc  # noqa: E402
from meshcomm.adapters.jax import meshcomm_id, reshard_jax  # noqa: E402

backends = sys.argv[1].split(",")
ncases = int(sys.argv[2])
seed = int(sys.argv[3])
mc.init(backend="mixed" if len(backends) > 1 else backends[0], devices_per_process=LOCAL)
DEVS = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
N = len(DEVS)
assert N == LOCAL * comm.size
assert all(meshcomm_id(d) // LOCAL == comm.rank for d in jax.local_devices())
FACTORS = {1: [(1,)], 2: [(2,), (1, 2)], 3: [(3,)], 4: [(4,), (2, 2)], 6: [(2, 3), (3, 2)],
           8: [(8,), (2, 4), (2, 2, 2)]}


def random_sharding(rng, shape):
    n = int(rng.choice([k for k in FACTORS if k <= N]))
    devs = [DEVS[i] for i in rng.permutation(N)[:n]]
    mshape = FACTORS[n][rng.integers(len(FACTORS[n]))]
    names = ("a", "b", "c")[:len(mshape)]
    spec = [None] * len(shape)
    for name, k in zip(names, mshape):
        d = int(rng.integers(len(shape) + 1))
        if d == len(shape):
            continue
        cur = () if spec[d] is None else ((spec[d],) if isinstance(spec[d], str) else spec[d])
        ways = math.prod(dict(zip(names, mshape))[a] for a in cur) * k
        if shape[d] % ways == 0:
            new = cur + (name,)
            spec[d] = new[0] if len(new) == 1 else new
    return NamedSharding(JMesh(np.array(devs, dtype=object).reshape(mshape), names), P(*spec))


def make(g, s):
    return jax.make_array_from_callback(g.shape, s, lambda idx: g[idx], dtype=g.dtype)


def check(y, g, s, what):
    assert isinstance(y, jax.Array), what
    assert y.sharding == s, (what, y.sharding, s)
    assert y.shape == g.shape and y.dtype == g.dtype, what
    imap = s.devices_indices_map(g.shape)
    mine = [d for d in s.addressable_devices]
    assert len(y.addressable_shards) == len(mine), what
    for sh in y.addressable_shards:
        assert sh.data.devices() == {sh.device}, what
        np.testing.assert_array_equal(np.asarray(sh.data), g[imap[sh.device]], err_msg=what)



def tree_cases(rng):
    """A pytree of arrays with a tree of targets (random NamedShardings, an uneven Layout, a
    None that leaves its leaf alone) moved as one batch per backend; then a bad target
    named by its leaf on every rank."""
    done = 0
    shapes = {"w": (8, 6), "layers": [(4, 12), (12,)], "skip": (2, 2)}
    want = {"w": np.arange(48, dtype=np.float32).reshape(8, 6),
            "layers": [(np.arange(48) % 7).astype(np.int32).reshape(4, 12), np.linspace(0, 1, 12, dtype=np.float32)],
            "skip": np.ones((2, 2), np.float32)}
    lay = mc.Layout(mc.Mesh([7, 0, 5], "r"), ("r", None))                     # 8 rows over 3
    for b in backends:
        s1 = {"w": random_sharding(rng, shapes["w"]), "layers": [random_sharding(rng, s) for s in shapes["layers"]],
              "skip": random_sharding(rng, shapes["skip"])}
        s2 = {"w": lay, "layers": [random_sharding(rng, s) for s in shapes["layers"]], "skip": None}
        x = {"w": make(want["w"], s1["w"]), "layers": [make(g, s) for g, s in zip(want["layers"], s1["layers"])],
             "skip": make(want["skip"], s1["skip"])}
        y = reshard_jax(x, s2, backend=b)
        assert y["skip"] is x["skip"]
        for g, v, s in zip(want["layers"], y["layers"], s2["layers"]):
            check(v, g, s, f"tree {b}: layers")
        ref = mc.shard(want["w"], lay)
        mine = {d for d in lay.mesh.device_ids if d // LOCAL == comm.rank}
        assert isinstance(y["w"], dict) and set(y["w"]) == mine, (set(y["w"]), mine)
        for d, v in y["w"].items():
            assert v.devices() == {DEVS[d]}
            np.testing.assert_array_equal(np.asarray(v), ref[d])
        done += 1
    x = {"a": make(want["w"], random_sharding(rng, (8, 6)))}
    try:
        reshard_jax(x, {"a": NamedSharding(JMesh(np.array(DEVS[:3], dtype=object), ("k",)), P("k"))})
    except ValueError as e:
        assert "leaf ['a']" in str(e) and "split 3 ways" in str(e), str(e)
    else:
        raise AssertionError("an uneven NamedSharding leaf was not refused")
    return done + 1


def main():
    rng = np.random.default_rng(seed)
    done = 0
    for i in range(ncases):
        shape = tuple(int(v) for v in rng.choice([2, 4, 6, 8, 12], size=rng.integers(1, 4)))
        g = (np.arange(math.prod(shape)) % 997).astype(np.float32 if i % 2 else np.int32).reshape(shape)
        s1, s2 = random_sharding(rng, shape), random_sharding(rng, shape)
        x = make(g, s1)
        for b in backends:
            check(reshard_jax(x, s2, backend=b), g, s2, f"case {i} {b}: {s1} -> {s2}")
            done += 1

    # fixed: devices of processes 0,1 -> devices of processes 2,3 (disjoint), 4 -> 3 devices,
    # and 8 devices -> an uneven Layout (returned as a dict of single-device arrays)
    g = np.arange(12 * 10, dtype=np.float32).reshape(12, 10)
    half = N // 2
    s1 = NamedSharding(JMesh(np.array(DEVS[:half], dtype=object).reshape(2, -1), ("x", "y")), P("x", "y"))
    targets = [NamedSharding(JMesh(np.array(DEVS[half:], dtype=object).reshape(2, -1), ("x", "y")), P("y", None)),
               NamedSharding(JMesh(np.array(DEVS[half:half + 3], dtype=object), ("z",)), P("z", None)),
               NamedSharding(JMesh(np.array([DEVS[-1]], dtype=object), ("one",)), P())]
    x = make(g, s1)
    for b in backends:
        for s2 in targets:
            check(reshard_jax(x, s2, backend=b), g, s2, f"fixed {b}: {s1} -> {s2}")
            done += 1
        h = reshard_jax(x, targets[0], backend=b, async_op=True)      # overlap some compute
        busy = float(np.linalg.norm(np.ones((64, 64)) @ np.ones((64, 64))))
        check(h.wait(), g, targets[0], f"async {b}")
        assert busy > 0
        done += 1
        lay = mc.Layout(mc.Mesh(np.arange(N).reshape(2, -1)[:, ::-1], ("p", "q")), (("p", "q"), None))  # 12 over 8
        out = reshard_jax(x, lay, backend=b)
        ref = mc.shard(g, lay)
        mine = {d for d in lay.mesh.device_ids if d // LOCAL == comm.rank}
        assert isinstance(out, dict) and set(out) == mine, (set(out), mine)
        for d, v in out.items():
            assert v.devices() == {DEVS[d]}
            np.testing.assert_array_equal(np.asarray(v), ref[d])
        done += 1

    done += tree_cases(rng)
    # eager collectives and p2p of jax.Array tiles put their results on this process's own
    # devices (they went on process 0's device, matched by Device.id: 2048 + i here)
    M = mc.Mesh(np.arange(N), ("dp",))
    own = [d for d in range(N) if d // LOCAL == comm.rank]
    y = mc.all_gather({d: jax.device_put(np.full(2, d, np.float32), DEVS[d]) for d in own}, M, "dp")
    for d in own:
        assert y[d].devices() == {DEVS[d]} and y[d].is_fully_addressable, (d, y[d].devices())
        np.testing.assert_array_equal(np.asarray(y[d]), np.repeat(np.arange(N, dtype=np.float32), 2))
    done += 1
    comm.Barrier()
    mc.finalize()
    print(f"JAXDIST OK {comm.rank} {done}", flush=True)
    jax.distributed.shutdown()


try:
    main()
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    comm.Abort(1)
