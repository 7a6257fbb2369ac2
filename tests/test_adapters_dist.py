"""Multi-process adapter tests: real processes, many cases per launch.

* JAX: `mpiexec -n 4`, JAX multi-process on CPU (jax.distributed.initialize, 2 local devices
  per process), meshcomm.init(devices_per_process=2); random NamedShardings -> random
  NamedShardings, disjoint device sets, different device counts and an uneven Layout, with
  the mpi, torch and mixed backends (tests/workers_adapters/jax_worker.py).
* DTensor: `mpiexec -n 4`, meshcomm.init(backend="torch") (rank, world and master address
  from MPI; the worker runs unchanged under `torchrun --standalone --nproc-per-node 4`,
  whose start-up costs ~40 s more on this machine); DTensors moved
  between different DeviceMeshes with Shard/Replicate/Partial placements, checked against
  the global tensor and DTensor's own full_tensor() (tests/workers_adapters/dtensor_worker.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

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
    assert all(n == 4 * 3 + 3 * 5 for n in ok.values()), _tail(r)


@pytest.mark.mpi
def test_dtensor_adapter_multiprocess():
    pytest.importorskip("torch")
    cmd = [os.path.join(BIN, "mpiexec"), "-n", "4", sys.executable,
           os.path.join(WORKERS, "dtensor_worker.py"), "30", "3"]
    r = _run(cmd)
    assert r.returncode == 0, _tail(r)
    ok = _oks("DTENSOR", r.stdout)
    assert sorted(ok) == [0, 1, 2, 3], _tail(r)
    assert all(n == 32 for n in ok.values()), _tail(r)
