"""The rank program (backends/program.py): what it decides ahead for each rank of a plan;
a kernel's common run (runtime/program.py common_run).

Its results are checked bitwise across real processes in tests/test_distributed.py (odd
ranks step by step beside even ranks running programs); here, what it works out."""
from __future__ import annotations

import numpy as np
import pytest

import meshcomm as mc
from meshcomm import Layout, Mesh
from meshcomm.backends import base, program
from meshcomm.planners.boxes import contiguous_in, local_slices


def test_contiguous_in_says_what_numpy_says():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        nd = int(rng.integers(1, 5))
        shape = tuple(int(rng.integers(1, 5)) for _ in range(nd))
        origin = tuple((0, n) for n in shape)
        box = []
        for n in shape:
            a = int(rng.integers(0, n))
            box.append((a, int(rng.integers(a + 1, n + 1))))
        tile = np.empty(shape, np.int8)
        view = tile[local_slices(tuple(box), origin)]
        assert contiguous_in(tuple(box), origin) == view.flags.c_contiguous, (shape, box)


def _program(shape, src, dst, rank, dpp=1):
    p = mc.plan(shape, "float32", src, dst)
    return p, base._rank_program(p, rank, dpp, base.collective_reduce_ok("float32"))


def test_all_to_all_receives_into_the_tile_and_sends_views():
    m = Mesh.grid((2, 4), ("x", "y"))
    src = Layout(m, (None, ("x", "y"), None))
    dst = Layout(m, (("x", "y"), None, None))
    for r in range(8):
        _, prog = _program((8, 64, 16), src, dst, r)
        assert len(prog.stages) == 1
        st = prog.stages[0]
        assert len(st.recvs) == 7 and all(d is not None and not into for _, _, _, d, into in st.recvs)
        assert len(st.sends) == 7 and all(src.whole is not None for _, _, src, _ in st.sends)
        assert len(st.copies) == 1 and not st.bcasts
        assert {peer for peer, *_ in st.recvs} == {peer for peer, *_ in st.sends} == set(range(8)) - {r}
        assert prog.src_shapes == ((r, (8, 8, 16)),)


def test_pieces_that_are_not_one_run_are_staged_and_broadcasts_kept_in_plan_order():
    a = Mesh([0, 1], ("x",))
    b = Mesh([2, 3], ("x",))
    rows, cols = ("x", None), (None, "x")

    def parts(src, dst, rank, what):
        prog = _program((8, 8), Layout(a, src), Layout(b, dst), rank)[1]
        return [m for st in prog.stages for m in getattr(st, what)]
    # rows -> columns: each piece is strided in its src tile (packed once), one run of the dst tile
    assert all(src.whole is None for _, _, src, _ in parts(rows, cols, 0, "sends"))
    recvs = parts(rows, cols, 2, "recvs")
    assert len(recvs) == 2 and all(d is not None and not into for _, _, _, d, into in recvs)
    # columns -> rows: a view of the src tile, staged and unpacked at the dst
    assert all(src.whole is not None for _, _, src, _ in parts(cols, rows, 1, "sends"))
    recvs = parts(cols, rows, 3, "recvs")
    assert len(recvs) == 2 and all(d is None and len(into) == 1 for _, _, _, d, into in recvs)
    assert parts(cols, rows, 0, "recvs") == []           # rank 0 holds a src tile only
    # one device to all four: a broadcast, the root's message a view of its tile
    one = Layout(Mesh([0], ("x",)), ())
    rep = Layout(Mesh([0, 1, 2, 3], ("x",)), ())
    plan, root = _program((64,), one, rep, 0)
    steps = base.issue_steps(plan, 0, 1, False)
    assert [s.prim for s in steps] == ["bcast", "local"]
    (bc,) = root.stages[0].bcasts
    assert bc[4].whole is not None and len(root.stages[0].copies) == 1   # a view; its own replica a copy
    (member,) = _program((64,), one, rep, 2)[1].stages[0].bcasts
    assert member[4] is None and member[6] is not None      # received straight into its tile


def test_reductions_take_the_general_path():
    m = Mesh.grid((2, 2), ("x", "y"))
    src = Layout(m, (None,), partial=("x",))
    dst = Layout(m, ("y",))
    p = mc.plan((16,), "float32", src, dst)
    assert any(t.kind == "reduce" for t in p.transfers)
    assert any(base._rank_program(p, r, 1, False) is None for r in range(4))


def test_fits_takes_c_ordered_numpy_tiles_of_the_planned_shape_only():
    m = Mesh([0, 1], ("x",))
    _, prog = _program((8, 6), Layout(m, ("x",)), Layout(m, (None, "x")), 0)
    good = np.zeros((4, 6), np.float32)
    assert program.fits(prog, {0: good})
    assert not program.fits(prog, {0: np.zeros((6, 4), np.float32).T})     # not C order
    assert not program.fits(prog, {0: np.zeros((4, 5), np.float32)})
    assert not program.fits(prog, {})
    torch = pytest.importorskip("torch")
    assert not program.fits(prog, {0: torch.zeros(4, 6)})



def test_common_run_takes_exact_host_tiles_only():
    """A kernel's fast check (runtime/program.py common_run, the eager call's test of "the
    same call" too): anything it refuses is checked in full, so it must refuse every tile
    the full check would treat differently."""
    from meshcomm.runtime.tiles import common_run, fit_of
    fit = fit_of("numpy", "cpu", "float32")
    want = {3: (4, 6)}
    t = np.zeros((4, 6), np.float32)
    assert common_run(t, want, fit, True) == ({3: t}, True, "numpy")
    assert common_run({3: t}, want, fit, True)[1:] == (False, "numpy")
    assert common_run(t, want, fit, False) is None                      # owns several dst devices
    assert common_run({2: t}, want, fit, True) is None                  # another device
    assert common_run({3: t, 4: t}, want, fit, True) is None
    assert common_run({3: t.astype(np.float64)}, want, fit, True) is None
    assert common_run({3: t.astype(">f4")}, want, fit, True) is None    # byte-swapped: full check
    assert common_run({3: np.zeros((6, 4), np.float32)}, want, fit, True) is None
    assert common_run(None, want, fit, True) is None and common_run({}, want, fit, True) is None
    assert common_run(None, {}, fit, True) == ({}, False, None) == common_run({}, {}, fit, True)
    assert common_run([t], want, fit, True) is None
    assert fit_of("numpy", "cuda", "float32") == {} and fit_of("jax", "cpu", "float32") == {}
    torch = pytest.importorskip("torch")
    assert common_run({3: torch.zeros(4, 6)}, want, fit, True) is None  # a NumPy Program
    tt = torch.zeros(4, 6)
    for f in (fit_of("torch", "cpu", "float32"), fit_of(None, None, "float32")):
        assert common_run(tt, want, f, True) == ({3: tt}, True, "torch")
        assert common_run({3: tt.double()}, want, f, True) is None
        assert common_run({3: torch.nn.Parameter(tt)}, want, f, True) is None
    assert common_run({3: t}, want, fit_of("torch", "cpu", "float32"), True) is None
    assert common_run({3: t}, want, fit_of(None, None, "float32"), True)[2] == "numpy"
