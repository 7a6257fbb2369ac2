"""Multi-process adapter tests: real processes, many cases per launch.

* JAX: `mpiexec -n 4`, JAX multi-process on CPU (jax.distributed.initialize, 2 local devices
  per process), meshcomm.init(devices_per_process=2); random NamedShardings -> random
  NamedShardings, disjoint device sets, different device counts and an uneven Layout, with
  the mpi, torch and mixed backends, and pytrees of arrays moved as one batch
  (tests/workers_adapters/jax_worker.py).
* DTensor: `mpiexec -n 4`, meshcomm.init(backend="torch") (rank, world and master address
  from MPI; the worker runs unchanged under `torchrun --standalone --nproc-per-node 4`,
  whose start-up costs ~40 s more on this machine); DTensors moved
  between different DeviceMeshes with Shard/Replicate/Partial placements, checked against
  torch's own rule for which rank holds which chunk (compute_local_shape_and_global_offset),
  the global tensor and DTensor's own full_tensor() (tests/workers_adapters/dtensor_worker.py),
  including DeviceMeshes whose ranks are not ascending; state dicts of DTensors moved in
  one batch (reshard_state_dict).
* Without a launch: the Layout of every placement on permuted meshes against torch's rule
  for every mesh coordinate.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers_adapters")
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, MESHCOMM_TIMEOUT="90", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ENV.pop("XLA_FLAGS", None)          # the JAX worker sets its own device count


# A free port is picked by binding port 0 and closing it (jax.distributed's coordinator, the
# torch rendezvous); on a machine shared by many test runs another process may take it first.
_PORT_RACE = ("address already in use", "errno 98", "failed to bind", "eaddrinuse")


def _run(cmd, timeout=400):
    for attempt in range(2):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=HERE)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            pytest.fail(f"{' '.join(cmd[:4])} ... did not finish within {timeout}s:\n{out[-3000:]}")
        text = (r.stdout + r.stderr).lower()
        if r.returncode == 0 or attempt or not any(k in text for k in _PORT_RACE):
            return r
    return r


def _oks(tag, text) -> dict[int, int]:
    """{rank: cases} from the workers' "TAG OK <rank> <cases>" reports."""
    return {int(a): int(b) for a, b in re.findall(tag + r" OK (\d+) (\d+)", text)}


def _tail(r):
    err = "\n".join(l for l in r.stderr.splitlines() if "W1122" not in l and "_redistribute" not in l)
    return f"rc={r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{err[-5000:]}"


@pytest.mark.mpi
def test_jax_adapter_multiprocess():
    pytest.importorskip("jax")
    cmd = [os.path.join(BIN, "mpiexec"), "-n", "4", sys.executable,
           os.path.join(WORKERS, "jax_worker.py"), "mpi,torch,mixed", "4", "11"]
    r = _run(cmd)
    assert r.returncode == 0, _tail(r)
    ok = _oks("JAXDIST", r.stdout)        # lines of different ranks may run together
    assert sorted(ok) == [0, 1, 2, 3], _tail(r)
    assert all(n == 4 * 3 + 3 * 5 + 3 + 1 + 1 for n in ok.values()), _tail(r)     # + pytree cases, a collective


@pytest.mark.mpi
def test_dtensor_adapter_multiprocess():
    pytest.importorskip("torch")
    cmd = [os.path.join(BIN, "mpiexec"), "-n", "4", sys.executable,
           os.path.join(WORKERS, "dtensor_worker.py"), "30", "3"]
    r = _run(cmd)
    assert r.returncode == 0, _tail(r)
    ok = _oks("DTENSOR", r.stdout)
    assert sorted(ok) == [0, 1, 2, 3], _tail(r)
    # 45 cases + 3 refused inputs + a 0-d + 6 state dicts, one async, 3 refused, a plain tensor
    assert all(n == 48 + 1 + 6 + 1 + 3 + 1 for n in ok.values()), _tail(r)


def test_dtensor_layout_follows_torch_coordinate_rule():
    """The rank at mesh coordinate c holds what torch's own rule
    (_compute_local_shape_and_global_offset, on plain data: no process group) gives c, on
    meshes whose ranks are in any order; shards even, uneven and nested over several mesh
    dims."""
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from meshcomm.adapters.dtensor import layout_from_placements
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        mshape = [(4,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2)][rng.integers(6)]
        ranks = rng.permutation(12)[:int(np.prod(mshape))].reshape(mshape)
        shape = tuple(int(s) for s in rng.integers(0, 9, size=rng.integers(1, 4)))
        placements = [[Shard(int(rng.integers(len(shape)))), Replicate(), Partial()][rng.integers(3)]
                      for _ in mshape]
        imap = layout_from_placements(ranks, placements, shape).index_map(shape)
        for coord in np.ndindex(*mshape):
            local, offset = _compute_local_shape_and_global_offset(shape, mshape, list(coord), placements)
            box = imap[int(ranks[coord])]
            got = tuple(s.stop - s.start for s in box)
            assert got == tuple(local), (ranks.tolist(), placements, shape, coord, box, local)
            # torch reports offset = size for an empty shard; only non-empty offsets are defined
            assert all(s.start == o for s, o, n in zip(box, offset, local) if n), \
                (ranks.tolist(), placements, shape, coord, box, offset)
            checked += 1
    assert checked > 1000
