"""Lower bounds (planners/bounds.py): hand-computed cases and a property test that no plan
(meshcomm's or a baseline's) beats them."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

import meshcomm as mc
from meshcomm.planners.bounds import lower_bound_bytes

from strategies import layouts_pair

P3 = mc.Topology.preset("p3.8xlarge")


def lay(mesh, spec, names=("x", "y"), partial=()):
    return mc.Layout(mc.Mesh(mesh, names), spec, partial=partial)


def test_alpa_case_1_bound():
    src = lay([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", None, None))
    dst = lay([[8, 9, 10, 11], [12, 13, 14, 15]], ("x", None, None))
    b = lower_bound_bytes((1024, 1024, 512), 4, src, dst, P3)
    gib = 2**30
    assert b.nic == gib
    assert b.links[("nic_in", 2)] == b.links[("nic_in", 3)] == gib
    assert b.links[("nic_out", 0)] == b.links[("nic_out", 1)] == gib
    assert b.dev == 0
    assert b.seconds == pytest.approx(gib / 1.25e9)
    assert mc.lower_bound((1024, 1024, 512), "int32", src, dst, "p3.8xlarge") == pytest.approx(gib / 1.25e9)


def test_replicated_holders_force_nothing_out():
    # every element on both src nodes: nothing has a sole holder; each dst node needs half
    src = lay([[0, 1, 2, 3], [4, 5, 6, 7]], (None,))
    dst = lay([[8, 9, 10, 11], [12, 13, 14, 15]], ("x",))
    b = lower_bound_bytes((1000,), 4, src, dst, P3)
    assert b.links == {("nic_in", 2): 2000, ("nic_in", 3): 2000}


def test_partial_src_each_addend_leaves_its_node():
    flat = mc.Topology.preset("flat")
    src = mc.Layout(mc.Mesh([0, 1], ("x",)), (None,), partial=("x",))
    dst = mc.Layout(mc.Mesh([0], ("x",)), (None,))
    b = lower_bound_bytes((10,), 4, src, dst, flat)
    # node 0 needs the sum and lacks addend 1; node 1 alone holds addend 1
    assert b.links == {("nic_in", 0): 40, ("nic_out", 1): 40}


def test_partial_dst_needs_only_one_replica_group():
    flat = mc.Topology.preset("flat")
    src = mc.Layout(mc.Mesh([0], ("x",)), (None,))
    dst = mc.Layout(mc.Mesh([1, 2], ("x",)), (None,), partial=("x",))
    b = lower_bound_bytes((10,), 4, src, dst, flat)
    # one of nodes 1, 2 may take the whole value; node 0 must send it once
    assert b.links == {("nic_out", 0): 40}


def test_device_links_inside_one_node():
    src = lay([[0]], (None,))
    dst = lay([[1, 2]], (None,))
    b = lower_bound_bytes((100,), 4, src, dst, P3)
    assert b.links == {("dev_in", 1): 400, ("dev_in", 2): 400, ("dev_out", 0): 400}
    assert b.nic == 0 and b.dev == 400
    assert b.seconds == pytest.approx(400 / P3.intra_bytes_per_s)


def test_nothing_to_move():
    src = lay([[0, 1]], (None, "y"))
    b = lower_bound_bytes((4, 4), 4, src, src, P3)
    assert b.links == {} and b.seconds == 0.0


def test_bad_input_raises():
    src = lay([[0, 1]], ("y",))
    with pytest.raises(ValueError):
        lower_bound_bytes((4,), 0, src, src, P3)
    with pytest.raises(ValueError):     # a split dimension the tensor does not have
        mc.lower_bound((4,), "int32", lay([[0, 1]], (None, None, "y")), src, P3)


TOPOS = [mc.Topology.preset("flat"), mc.Topology.preset("p3.8xlarge"),
         mc.Topology(2, intra_node_gbps=50.0, inter_node_gbps=20.0, name="t2")]


@settings(max_examples=60, deadline=None)
@given(layouts_pair(max_devices=8, max_size=8), st.sampled_from(TOPOS), st.sampled_from([1, 4]))
def test_no_plan_beats_the_bound(case, topo, itemsize):
    from meshcomm.planners import baselines
    shape, src, dst = case
    b = lower_bound_bytes(shape, itemsize, src, dst, topo)
    dtype = {1: "uint8", 4: "float32"}[itemsize]
    plans = [mc.plan(shape, dtype, src, dst, topology=topo)]
    for name, fn in baselines.BASELINES.items():
        p = fn(shape, dtype, src, dst, topo)
        if p is not None:
            plans.append(p)
    for p in plans:
        loads = p.link_loads(topo)
        for k, v in b.links.items():
            # device-link bounds assume no route leaves a node and re-enters it; meshcomm's
            # plans keep to that, a baseline's reduce-then-fan-out may not (allgather_slice)
            if k[0].startswith("nic") or p.planner == "meshcomm":
                assert loads.get(k, 0) >= v, (p.planner, k, loads.get(k, 0), v)
        assert p.max_link_bytes(topo, "nic") >= b.nic
        assert p.simulate(topo) >= b.seconds * (1 - 1e-9), p.planner
