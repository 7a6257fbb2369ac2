"""The package's shape: imports run one way with no cycle, the library never reaches the
tools or their optional dependencies, every module says what it is for, settings are
one table, and the package imports from a checkout without installing."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import networkx as nx
import pytest

import meshcomm
from meshcomm import settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"meshcomm": ROOT / "meshcomm", "meshcomm.planners": ROOT / "planners",
                "meshcomm.backends": ROOT / "backends", "meshcomm.cuda": ROOT / "cuda"}
# modules allowed past ~400 lines, and why
LONG_OK = {
    "meshcomm.backends.base": "the executor: one rank's program, its steps and wire buffers in one place",
    "meshcomm.planners.baselines": "the comparison planners (send/recv, broadcast, Alpa's) side by side",
    "meshcomm.planners.resharding": "the planner's core: pieces, senders, primitives, partial sums, order",
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, d in PACKAGE_DIRS.items():
        for p in d.rglob("*.py"):
            rel = p.relative_to(d).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            name = ".".join([pkg] + parts)
            if pkg == "meshcomm" and parts and parts[0] in ("planners", "backends", "cuda"):
                continue
            out[name] = p
    return out


MODULES = modules()


def _imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:          # statements at module level, inside if/try blocks too
        flat, todo = [], list(tree.body)
        while todo:
            n = todo.pop()
            if isinstance(n, (ast.If, ast.Try)):
                todo.extend(n.body + n.orelse + getattr(n, "finalbody", []) +
                            [s for h in getattr(n, "handlers", []) for s in h.body])
            else:
                flat.append(n)
        nodes = flat
    found = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                parts = base.split(".")
                mod = ".".join(parts[:len(parts) - (n.level - 1)])
                mod = f"{mod}.{n.module}" if n.module else mod
            else:
                mod = n.module
            for a in n.names:
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in MODULES else mod)
    return found


def graph(top_level_only: bool) -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for m in _imports(name, path, top_level_only):
            if m in MODULES and m != name:
                g.add_edge(name, m)
    return g


def test_no_import_cycle():
    """None, counting the imports inside functions too (an import deferred to call time to
    get around a cycle is still one)."""
    cycles = list(nx.simple_cycles(graph(top_level_only=False)))
    assert not cycles, f"import cycles: {cycles[:5]}"


def _reaches(prefix_from, forbidden, allow=()):
    bad = []
    for name, path in MODULES.items():
        if not name.startswith(prefix_from) or name in allow:
            continue
        for m in _imports(name, path, top_level_only=False):
            if any(m == f or m.startswith(f + ".") for f in forbidden):
                bad.append((name, m))
    return bad


def test_layers_run_one_way():
    assert not _reaches("meshcomm.planners", ("meshcomm.backends", "meshcomm.runtime", "meshcomm.api",
                                              "meshcomm.collectives", "meshcomm.tools"))
    assert not _reaches("meshcomm.backends", ("meshcomm.runtime", "meshcomm.api", "meshcomm.collectives",
                                              "meshcomm.alltoall", "meshcomm.tools"))
    library = [n for n in MODULES if not n.startswith("meshcomm.tools") and n != "meshcomm.__main__"]
    bad = [(n, m) for n in library for m in _imports(n, MODULES[n], top_level_only=False)
           if m.split(".")[0] in ("tqdm", "matplotlib") or m.startswith("meshcomm.tools")]
    assert not bad, bad


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                bad += [(name, n.module, a.name) for a in n.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, f"private names imported from other modules: {bad}"


def test_every_module_says_what_it_is_for_and_is_short():
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree)
        assert doc and doc.splitlines()[0].strip(), f"{name} has no docstring saying what it is for"
        n = len(path.read_text().splitlines())
        if n > 450:
            assert name in LONG_OK, f"{name} has {n} lines; split it or say why in LONG_OK"


def test_core_imports_without_optional_tools():
    code = ("import sys\nfor m in ('tqdm', 'matplotlib', 'torch', 'jax', 'mpi4py', 'zfpy'): sys.modules[m] = None\n"
            "import meshcomm, meshcomm.collectives, meshcomm.model, meshcomm.compression\n"
            "import meshcomm as mc\n"
            "m = mc.Mesh([0, 1], 'x'); p = mc.plan((4,), 'float32', mc.Layout(m, ('x',)), mc.Layout(m, ()))\n"
            "print(len(p.transfers))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr


def test_imports_from_the_repository_root_without_installing():
    # -S: no site processing, so no editable-install finder; only the checkout and NumPy's folder
    site = sysconfig.get_paths()["purelib"]
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}]; sys.path.append({site!r})\n"
            "import meshcomm\n"
            f"assert meshcomm.planners.__file__.startswith({str(ROOT / 'planners')!r}), meshcomm.planners.__file__\n"
            "import meshcomm.backends.base, meshcomm.cuda, meshcomm.collectives\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_settings_are_one_table_and_the_readme_shows_it():
    readme = (ROOT / "README.md").read_text()
    assert settings.markdown_table() in readme, "README's environment table is not settings.markdown_table()"
    used = set()
    for name, path in MODULES.items():
        used.update(re.findall(r"MESHCOMM_([A-Z_]+)", path.read_text()))
    unknown = used - set(settings.SETTINGS)
    assert not unknown, f"MESHCOMM_ variables with no Setting: {sorted(unknown)}"


def test_settings_read_once_typed(monkeypatch):
    monkeypatch.setenv("MESHCOMM_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="MESHCOMM_TIMEOUT='abc' is not valid"):
        settings.get("TIMEOUT")
    monkeypatch.setenv("MESHCOMM_CHECK", "every")
    assert settings.get("CHECK") == "every"
    monkeypatch.setenv("MESHCOMM_CHECK", "0")
    with pytest.raises(ValueError, match="MESHCOMM_CHECK='0' is not valid: expected one of construct, every"):
        settings.get("CHECK")
    monkeypatch.delenv("MESHCOMM_TIMEOUT")
    assert settings.get("TIMEOUT") == 300.0
    assert len(settings.SETTINGS) <= 8, sorted(settings.SETTINGS)


def test_clear_caches_empties_every_cache():
    import meshcomm as mc
    m = mc.Mesh([0, 1], "x")
    mc.plan((4,), "float32", mc.Layout(m, ("x",)), mc.Layout(m, ()))
    from meshcomm import caches
    assert any(len(c) if isinstance(c, dict) else c.cache_info().currsize for c in caches._CACHES)
    mc.clear_caches()
    assert not any(len(c) if isinstance(c, dict) else c.cache_info().currsize for c in caches._CACHES)


def test_one_cache_mechanism():
    bad = []
    for name, path in MODULES.items():
        text = path.read_text()
        if re.search(r"functools\.(lru_cache|cache)\b", text) and name != "meshcomm.caches":
            bad.append(name)
    assert not bad, f"caches outside meshcomm.caches: {bad}"



# -- packaging and test hygiene ------------------------------------------------------------------

def test_every_package_directory_is_in_the_packages_configuration():
    """setuptools warns ("Package 'meshcomm.data' is absent from the `packages` configuration")
    about a folder of package data it was not told is a package."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for pkg, d in PACKAGE_DIRS.items():
        for sub in [d] + [p for p in d.rglob("*") if p.is_dir() and "__pycache__" not in p.parts]:
            if any(f.suffix in (".py", ".json", ".cu", ".cuh") for f in sub.iterdir() if f.is_file()):
                found.add(".".join([pkg, *sub.relative_to(d).parts]))
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"


def test_ci_loads_the_derandomized_hypothesis_profile():
    """(Recent Hypothesis derandomizes on CI by itself; the profile is loaded by name anyway.)"""
    code = ("import conftest; from hypothesis import settings as s; print(getattr(s, 'get_current_profile_name', "
            "lambda: s._current_profile)(), s().derandomize)")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    for extra, want in (({}, "default False"), ({"CI": "true"}, "ci True"),
                        ({"CI": "true", "HYPOTHESIS_PROFILE": "default"}, "default")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=ROOT / "tests", env={**env, **extra})
        assert r.stdout.strip().startswith(want), (extra, r.stdout, r.stderr[-2000:])


def test_a_test_without_the_mpi_mark_cannot_launch_mpiexec():
    for cmd in ([str(Path(sys.executable).parent / "mpiexec"), "-n", "2", "true"], "mpirun -n 2 true",
                [Path("/usr/bin/torchrun")]):
        with pytest.raises(RuntimeError, match="mark it @pytest.mark.mpi"):
            subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, timeout=60)
    assert subprocess.run([sys.executable, "-c", "pass"], timeout=60).returncode == 0


_ = os
