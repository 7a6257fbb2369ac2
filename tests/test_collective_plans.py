"""Plans of all_reduce, all_gather and reduce_scatter against bandwidth-optimal algorithms:
the bytes a ring moves (2(n-1)/n of the data per member for all_reduce, (n-1)/n for the
others), every value of a pending sum reduced once (replicas agree bit for bit), and the
cost model's choice between one root per piece and a reduce-scatter + all-gather."""
from __future__ import annotations

import numpy as np
import pytest

import meshcomm as mc
from meshcomm.collectives import collective_plan
from meshcomm.collectives.layouts import groups, problem
from meshcomm.planners import baselines

M24 = mc.Mesh(np.arange(8).reshape(2, 4), ("dp", "tp"))
M48 = mc.Mesh(np.arange(32).reshape(4, 8), ("node", "gpu"))

CASES = [(M24, axes, topo) for axes in (("tp",), ("dp",), ("dp", "tp"))
         for topo in ("flat", "dgx-a100", "p3.8xlarge")] + \
        [(M48, axes, "dgx-a100") for axes in (("gpu",), ("node",), ("node", "gpu"))]


def optimal_bytes(op: str, mesh, axes, nbytes: int) -> int:
    """Bytes all members together move in a ring (or any bandwidth-optimal) algorithm, for
    `nbytes` of data per member (all_gather: its result; the others: its input)."""
    k = len(groups(mesh, axes)[0])
    per_member = (2 if op == "all_reduce" else 1) * (k - 1) * nbytes // k
    return per_member * mesh.size


@pytest.mark.parametrize("mesh,axes,topo", CASES, ids=lambda v: str(getattr(v, "shape", v)))
@pytest.mark.parametrize("n", [1024, 1 << 18])
def test_collective_plans_move_what_a_ring_moves(mesh, axes, topo, n):
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        k = len(groups(mesh, axes)[0])
        tile = (n // k,) if op == "all_gather" else (n,)
        p = collective_plan(op, tile, "float32", mesh, axes, topology=topo)
        mc.verify(p)
        assert p.bytes_moved == optimal_bytes(op, mesh, axes, 4 * n), (op, axes, topo, p.bytes_moved)


def test_the_issue_figures_on_a_2x4_mesh():
    got = {op: collective_plan(op, (1024,), "float32", M24, "tp").bytes_moved
           for op in ("all_reduce", "all_gather", "reduce_scatter")}
    assert got == {"all_reduce": 48 << 10, "all_gather": 96 << 10, "reduce_scatter": 24 << 10}
    assert "48.00 KiB moved" in collective_plan("all_reduce", (1024,), "float32", M24, "tp").explain()


@pytest.mark.parametrize("axes", [("tp",), ("dp", "tp")])
@pytest.mark.parametrize("n", [1024, 1 << 16])
def test_all_reduce_replicas_agree_bit_for_bit(axes, n):
    """Each value is reduced once and copied to its replicas: the same bits everywhere (a
    sum of three or more floats in two orders may differ in the last place)."""
    rng = np.random.default_rng(n)
    x = {d: rng.standard_normal(n).astype(np.float32) for d in M24.device_ids}
    out = mc.all_reduce(x, M24, axes)
    for g in groups(M24, axes):
        ref = np.sum([x[d].astype(np.float64) for d in g], axis=0)
        for d in g:
            assert out[d].tobytes() == out[g[0]].tobytes(), (g, d)
            np.testing.assert_allclose(out[d], ref, rtol=1e-5, atol=1e-5)


def test_partial_reshard_reduces_every_value_once():
    """A reshard from a pending sum to replicas on more devices than the addends' holders
    (the general partial path, not a collective): each element reduced once, then copied."""
    src = mc.Layout(M24, ("dp",), partial=("tp",))
    dst = mc.Layout(mc.Mesh(np.arange(8, 16).reshape(2, 4), ("a", "b")), ())
    for topo in ("flat", "p3.8xlarge"):
        p = mc.plan((64, 256), "float32", src, dst, topology=topo)
        mc.verify(p)
        reduced = sum(int(np.prod([b - a for a, b in box])) for t in p.transfers if t.kind == "reduce"
                      for box in t.boxes)
        assert reduced == 64 * 256


@pytest.mark.parametrize("topo", ["flat", "dgx-a100", "p3.8xlarge"])
@pytest.mark.parametrize("n", [1024, 1 << 16, 1 << 20])
def test_all_reduce_at_or_below_one_root_and_ring_under_the_cost_model(topo, n):
    """The planner keeps the faster of one root per piece (reduce then broadcast: what
    alpa_broadcast does) and parts reduced at different roots (a reduce-scatter, then an
    all-gather: the ring of dtensor_style), and its fan-out follows the ring, so neither
    is faster under the cost model."""
    pr = problem("all_reduce", M24, ("tp",), (n,))
    p = mc.plan(pr.shape, "float32", pr.src, pr.dst, topology=topo)
    t = p.simulate(topo)
    one_root = baselines.alpa_broadcast(pr.shape, "float32", pr.src, pr.dst, topo).simulate(topo)
    ring = baselines.dtensor_style(pr.shape, "float32", pr.src, pr.dst, topo).simulate(topo)
    assert t <= one_root * (1 + 1e-9) and t <= ring * (1 + 1e-9), (t, one_root, ring)


def test_two_addends_may_be_reduced_on_both_sides():
    """A pair's all-reduce as two one-hop reductions (each member adds the other's tile:
    a + b and b + a are the same bits) moves what a ring moves in one stage; it is kept."""
    pr = problem("all_reduce", M24, ("dp",), (1 << 18,))
    p = mc.plan(pr.shape, "float32", pr.src, pr.dst, topology="flat")
    assert p.bytes_moved == optimal_bytes("all_reduce", M24, ("dp",), 4 << 18)
    assert {t.stage for t in p.transfers} == {0}


@pytest.mark.parametrize("mesh,axes,topo", CASES, ids=lambda v: str(getattr(v, "shape", v)))
@pytest.mark.parametrize("n", [1024, 1 << 18, 1 << 22])
def test_collective_plans_at_or_below_the_ring_under_the_cost_model(mesh, axes, topo, n):
    """The ring algorithm as a plan of the same transfers (baselines.ring_collective) is
    never faster under the flow model than meshcomm's plan."""
    gs = groups(mesh, axes)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        tile = (n // len(gs[0]),) if op == "all_gather" else (n,)
        pr = problem(op, mesh, axes, tile)
        p = mc.plan(pr.shape, "float32", pr.src, pr.dst, topology=topo)
        ring = baselines.ring_collective(op, pr.shape, "float32", pr.src, pr.dst, gs, topo)
        mc.verify(ring)
        assert ring.bytes_moved == p.bytes_moved, op
        assert p.simulate(topo) <= ring.simulate(topo) * (1 + 1e-9), (op, p.simulate(topo), ring.simulate(topo))
