"""Run a script with JAX on the GPU in a process of its own (JAX and torch each keep their own
memory pool, and this suite's conftest pins JAX to the CPU), for the GPU tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_on_jax_gpu(tmp_path, code: str, ok: str) -> None:
    """Run `code`; it prints "SKIP ..." without a JAX GPU (the test skips), else `ok`."""
    script = tmp_path / "jax_gpu_script.py"
    script.write_text(code)
    env = dict(os.environ, JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    if r.stdout.startswith("SKIP"):
        pytest.skip(f"no JAX GPU here: {r.stdout.strip()}")
    assert ok in r.stdout, r.stdout[-3000:]
