"""Golden-file tests of printed plans: ``plan.explain(limit=None)`` for a few representative
cases, compared with ``tests/golden/<case>.txt``.

The files pin the planner's choices (senders, primitives, order, byte counts). When a planner
change is intended, regenerate them and review the diff before committing:

    UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
    git diff tests/golden/

Every case is also run through the verifier, so a golden file never pins a wrong plan.
"""
from __future__ import annotations

import difflib
import json
import os
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

import meshcomm as mc

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN", "") not in ("", "0")


def _spec(entries):
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def _alpa(case_no: int):
    data = json.loads(resources.files("meshcomm").joinpath("data/alpa_resharding_cases.json").read_text())
    c = next(c for c in data["n_to_m"] if c["case"] == case_no)
    src = mc.Layout(mc.Mesh(c["src_mesh"], ("x", "y")), _spec(c["src_spec"]))
    dst = mc.Layout(mc.Mesh(c["dst_mesh"], ("x", "y")), _spec(c["dst_spec"]))
    return tuple(c["shape"]), "int32", src, dst, data["topology"]


def _cases():
    m = lambda ids, names=("x", "y"): mc.Mesh(np.asarray(ids), names[:np.asarray(ids).ndim])  # noqa: E731
    return {
        # Alpa case 3: dim 1 split over nodes -> dim 0 split over nodes (broadcasts inside nodes)
        "alpa_case3_p3": _alpa(3),
        # Alpa case 4: dim 1 over all 8 GPUs -> dim 0 over all 8 GPUs (all-to-all of sends)
        "alpa_case4_p3": _alpa(4),
        # one GPU to a 2x2 mesh on two nodes (Alpa's 1-to-m suite, scaled)
        "one_to_m_p3": ((1 << 20,), "float32", mc.Layout(m([0], ("x",)), (None,)),
                        mc.Layout(m([[4, 5], [8, 9]]), (None,)), "p3.8xlarge"),
        # pending sum over x on a 2x2 mesh -> rows split over 4 new devices
        "partial_sum": ((8, 6), "int32", mc.Layout(m([[0, 1], [2, 3]]), (None, "y"), partial=("x",)),
                        mc.Layout(m([4, 5, 6, 7], ("x",)), ("x",)), "flat"),
        # explicit uneven Blocks (a zero-size block included) -> torch.chunk split
        "blocks": ((10, 4), "float64", mc.Layout(m([0, 1, 2, 3], ("x",)), (mc.Blocks("x", [1, 0, 6, 3]),)),
                   mc.Layout(m([[4, 5], [6, 7]]), ("y", "x")), "flat"),
        # src and dst meshes share devices 2..5; uneven split of 7 rows
        "overlapping": ((7, 8), "float32", mc.Layout(m([[0, 1, 2], [3, 4, 5]]), (("x", "y"), None)),
                        mc.Layout(m([[2, 3], [4, 5], [6, 7]]), ("x", "y")), "dgx-a100"),
        # all_reduce over y on a 2x4 mesh (meshcomm.collectives' layouts): 4 KiB per member,
        # one root per group (reduce, then a broadcast round the ring); 4 MiB, a reduce-
        # scatter (part j reduced at member j), then an all-gather round the ring
        "all_reduce_4k": ((2, 1024), "float32", mc.Layout(m([[0, 1, 2, 3], [4, 5, 6, 7]]), ("x", None),
                                                          partial=("y",)),
                          mc.Layout(m([[0, 1, 2, 3], [4, 5, 6, 7]]), ("x", None)), "flat"),
        "all_reduce_4m": ((2, 1 << 20), "float32", mc.Layout(m([[0, 1, 2, 3], [4, 5, 6, 7]]), ("x", None),
                                                             partial=("y",)),
                          mc.Layout(m([[0, 1, 2, 3], [4, 5, 6, 7]]), ("x", None)), "flat"),
    }


CASES = _cases()


def render(name: str) -> str:
    shape, dtype, src, dst, topo = CASES[name]
    p = mc.plan(shape, dtype, src, dst, topology=topo)
    mc.verify(p)
    return p.explain(limit=None) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan(name):
    path = GOLDEN / f"{name}.txt"
    got = render(name)
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
        return
    if not path.exists():
        pytest.fail(f"{path} is missing; create it with UPDATE_GOLDEN=1 pytest tests/test_golden.py")
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True),
                                            f"golden/{name}.txt", "planned now"))
        pytest.fail(f"plan for {name!r} differs from its golden file. If the change is intended, "
                    f"run `UPDATE_GOLDEN=1 pytest tests/test_golden.py` and review the diff.\n{diff}")


def test_golden_files_have_no_strays():
    """Every golden file belongs to a case (a renamed case leaves no stale file behind)."""
    stray = sorted(p.stem for p in GOLDEN.glob("*.txt")) if GOLDEN.exists() else []
    assert set(stray) <= set(CASES), f"golden files without a case: {sorted(set(stray) - set(CASES))}"


def test_explain_is_deterministic():
    for name in CASES:
        mc.clear_caches()
        a = render(name)
        mc.clear_caches()
        assert render(name) == a
