"""Shared test set-up.

* JAX runs on CPU with 16 host devices: XLA_FLAGS is set here, before anything imports jax
  (pytest imports conftest.py before the test modules). A test that needs the devices
  checks ``len(jax.devices()) >= 16``.
* Hypothesis profiles: "default" (random examples, no deadline) and "ci" (derandomized,
  same examples every run). "ci" is loaded where the environment sets CI (as CI services
  do); HYPOTHESIS_PROFILE=NAME picks one either way.
* A test that launches mpiexec (or mpirun, torchrun) must be marked `@pytest.mark.mpi`, so
  that `make test-fast` (-m "not slow and not mpi") starts no processes of a launcher: an
  unmarked test that tries gets a RuntimeError naming the mark.
* ``tests/strategies.py`` holds the shared strategies (random meshes and layout pairs).
"""
from __future__ import annotations

import os
import subprocess
import sys

_FLAG = "--xla_force_host_platform_device_count=16"
if "jax" in sys.modules:    # pragma: no cover - only when a plugin imported jax first
    import warnings
    warnings.warn("jax was imported before tests/conftest.py; XLA_FLAGS may not take effect")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "default"))

LAUNCHERS = ("mpiexec", "mpirun", "torchrun")


class _NoLauncher(subprocess.Popen):
    """subprocess.Popen for tests not marked `mpi`: refuses to start a launcher."""

    def __init__(self, args, *a, **kw):
        if not isinstance(args, (str, bytes, os.PathLike)):
            args = list(args)
        first = os.fsdecode(args if isinstance(args, (str, bytes, os.PathLike)) else args[0] if args else "")
        first = (first.split() or [""])[0] if isinstance(args, str) else first   # a shell command line
        if os.path.basename(first).startswith(LAUNCHERS):
            raise RuntimeError(f"this test launches {first}: mark it @pytest.mark.mpi")
        super().__init__(args, *a, **kw)


@pytest.fixture(autouse=True)
def _launchers_need_the_mpi_mark(request, monkeypatch):
    if request.node.get_closest_marker("mpi") is None:
        monkeypatch.setattr(subprocess, "Popen", _NoLauncher)
