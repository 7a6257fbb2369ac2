"""Shared test set-up.

* JAX runs on CPU with 16 host devices: XLA_FLAGS is set here, before anything imports jax
  (pytest imports conftest.py before the test modules). A test that needs the devices
  checks ``len(jax.devices()) >= 16``.
* Hypothesis profiles: "default" (random examples, no deadline) and "ci" (derandomized,
  same examples every run). Pick one with HYPOTHESIS_PROFILE=ci.
* ``tests/strategies.py`` holds the shared strategies (random meshes and layout pairs).
"""
from __future__ import annotations

import os
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

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "default", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
