"""Every ```python block of the README runs as written: in one process, or under the launcher
an HTML comment before it names (`<!-- run: mpiexec -n 4 -->`; marked `mpi`), with the
environment another names (`<!-- env: XLA_FLAGS=... -->`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def snippets():
    text = (ROOT / "README.md").read_text()
    out = []
    for m in re.finditer(r"((?:<!--.*?-->\n)*)```python\n(.*?)```", text, re.S):
        notes, code = m.group(1), m.group(2)
        run = re.search(r"<!-- run: mpiexec -n (\d+) -->", notes)
        env = dict(kv.split("=", 1) for kv in re.findall(r"<!-- env: (\S+) -->", notes))
        line = text[:m.start(2)].count("\n") + 1
        out.append(pytest.param(code, int(run.group(1)) if run else 0, env, id=f"README.md:{line}",
                                marks=[pytest.mark.mpi] if run else []))
    return out


@pytest.mark.parametrize("code,nprocs,env", snippets())
def test_readme_snippet_runs(code, nprocs, env, tmp_path):
    f = tmp_path / "snippet.py"
    f.write_text(code)
    e = dict(os.environ, MESHCOMM_TIMEOUT="60", **env)
    if nprocs:
        mpiexec = BIN / "mpiexec"
        if not mpiexec.exists():
            pytest.skip("mpiexec not found")
        cmd = [str(mpiexec), "-n", str(nprocs), sys.executable, str(f)]
    else:
        cmd = [sys.executable, str(f)]
    r = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{code}\n--- output ---\n{(r.stdout + r.stderr)[-4000:]}"


def test_there_are_snippets():
    assert len(snippets()) >= 5
