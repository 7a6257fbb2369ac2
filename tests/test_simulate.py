"""The flow-level simulator on hand-computed cases (planners/simulate.py)."""
from __future__ import annotations

import numpy as np
import pytest

import meshcomm as mc
from meshcomm.planners.schedule import Plan, Transfer
from meshcomm.planners.simulate import max_min_rates, simulate, simulate_detailed

GB = 1e9
L = 1e-5          # inter-node latency in these topologies
l = 1e-6          # intra-node latency


def topo(dpn=1, intra_GBps=100.0, inter_GBps=1.0):
    """A topology in bytes/s (GB/s), latencies L between nodes and l inside one."""
    return mc.Topology(dpn, intra_node_gbps=intra_GBps * 8, inter_node_gbps=inter_GBps * 8,
                       intra_node_latency_s=l, inter_node_latency_s=L, name="test")


def box(n):
    return (((0, n),),)


def T(kind, srcs, dsts, nbytes, stage=0, src_buf="src"):
    return Transfer(kind, tuple(srcs), tuple(dsts), box(nbytes), int(nbytes), stage, src_buf)


def plan_of(*transfers, topology=None):
    return Plan(shape=(0,), dtype="uint8", itemsize=1, src=None, dst=None,
                topology=topology or topo(), transfers=tuple(transfers))


def test_one_send_over_a_nic():
    p = plan_of(T("send", [0], [1], 1 * GB))
    assert simulate(p, topo()) == pytest.approx(1.0 + L, rel=1e-12)
    assert p.simulate(topo()) == pytest.approx(1.0 + L, rel=1e-12)


def test_two_flows_share_a_nic_max_min_fair():
    # devices 0 and 1 sit on node 0; both send out of its NIC to nodes 1 and 2.
    # Each gets half the NIC until the 1 GB flow ends (after 2 s); the 2 GB flow then has
    # 1 GB left at full rate: 3 s in all.
    t = topo(dpn=2)
    p = plan_of(T("send", [0], [2], 1 * GB), T("send", [1], [4], 2 * GB))
    r = simulate_detailed(p, t)
    assert r.end[0] == pytest.approx(L + 2.0, rel=1e-9)
    assert r.end[1] == pytest.approx(L + 3.0, rel=1e-9)
    assert r.seconds == pytest.approx(L + 3.0, rel=1e-9)


def test_flows_on_disjoint_nics_run_in_parallel():
    t = topo(dpn=1)
    p = plan_of(T("send", [0], [1], 1 * GB), T("send", [2], [3], 1 * GB))
    assert simulate(p, t) == pytest.approx(1.0 + L, rel=1e-12)


def test_chain_bcast_is_pipelined():
    # 0 -> 1 -> 2 on three nodes: both hops stream at once, 1 GB at 1 GB/s; one post
    # latency plus one hop of pipeline fill.
    p = plan_of(T("bcast", [0], [1, 2], 1 * GB))
    assert simulate(p, topo()) == pytest.approx(1.0 + 2 * L, rel=1e-12)
    # versus two sends from the root, which share its NIC: posted at L and 2L, the root's
    # NIC is busy from L on with 2 GB: 2 s
    q = plan_of(T("send", [0], [1], 1 * GB), T("send", [0], [2], 1 * GB))
    assert simulate(q, topo()) == pytest.approx(2.0 + L, rel=1e-9)


def test_chain_rate_is_its_slowest_hop():
    # chain 0 -> 2 -> 4 (nodes 0, 1, 2) and a send 3 -> 5 (node 1 -> node 2) share node 1's
    # NIC out and node 2's NIC in. The send starts at L, the chain at 2L (one hop of fill);
    # from 2L both get half. The send ends at 2L + 2 (1 - L) = 2; the chain then has L GB
    # left at full rate: 2 + L. (Alone the chain would take 1 + 2L.)
    t = topo(dpn=2)
    p = plan_of(T("bcast", [0], [2, 4], 1 * GB), T("send", [3], [5], 1 * GB))
    r = simulate_detailed(p, t)
    assert r.end[1] == pytest.approx(2.0, rel=1e-9)
    assert r.end[0] == pytest.approx(2.0 + L, rel=1e-9)
    alone = plan_of(T("bcast", [0], [2, 4], 1 * GB))
    assert simulate(alone, t) == pytest.approx(1.0 + 2 * L, rel=1e-9)


def test_reduce_chain_uses_every_hop():
    # reduce 0 + 1 + 2 -> 2 (route 0 -> 1 -> 2) on three nodes: like a chain, 1 s
    p = plan_of(T("reduce", [0, 1, 2], [2], 1 * GB))
    assert simulate(p, topo()) == pytest.approx(1.0 + 2 * L, rel=1e-12)


def test_latency_dominated_small_messages():
    # ten 8-byte sends from device 0: it posts them one after the other (10 latencies);
    # one coalesced 80-byte message costs one latency.
    many = plan_of(*[T("send", [0], [d], 8) for d in range(1, 11)])
    t = simulate(many, topo())
    assert t == pytest.approx(10 * L + 8 / GB, rel=1e-6)
    one = plan_of(T("send", [0], [1], 80))
    assert simulate(one, topo()) == pytest.approx(L + 80 / GB, rel=1e-9)
    assert t > 9 * simulate(one, topo())


def test_intra_vs_inter_node():
    t = topo(dpn=4, intra_GBps=100.0, inter_GBps=1.0)
    intra = plan_of(T("send", [0], [1], 1 * GB))
    inter = plan_of(T("send", [0], [4], 1 * GB))
    assert simulate(intra, t) == pytest.approx(0.01 + l, rel=1e-9)
    assert simulate(inter, t) == pytest.approx(1.0 + L, rel=1e-9)
    # intra-node links are per device: two senders inside a node do not share
    two = plan_of(T("send", [0], [1], 1 * GB), T("send", [2], [3], 1 * GB))
    assert simulate(two, t) == pytest.approx(0.01 + l, rel=1e-9)
    # ... but one receiver's link is shared
    shared = plan_of(T("send", [0], [1], 1 * GB), T("send", [2], [1], 1 * GB))
    assert simulate(shared, t) == pytest.approx(0.02 + l, rel=1e-9)


def test_stages_wait_for_the_participants_previous_stage():
    # stage 0: 0 -> 1 (1 GB). stage 1: 1 forwards to 2 (must wait), 3 -> 4 (need not).
    p = plan_of(T("send", [0], [1], 1 * GB),
                T("send", [1], [2], 1 * GB, stage=1, src_buf="dst"),
                T("send", [3], [4], 1 * GB, stage=1))
    r = simulate_detailed(p, topo())
    assert r.end[0] == pytest.approx(1.0 + L)
    assert r.start[1] == pytest.approx(1.0 + 2 * L)
    assert r.end[1] == pytest.approx(2.0 + 2 * L)
    assert r.end[2] == pytest.approx(1.0 + L)
    assert r.seconds == pytest.approx(2.0 + 2 * L)


def test_copies_are_free_and_empty_plan_is_zero():
    assert simulate(plan_of(), topo()) == 0.0
    p = plan_of(T("copy", [3], [3], 1 * GB))
    assert simulate(p, topo()) == 0.0


def test_max_min_rates_progressive_filling():
    # classic: links A (cap 1) and B (cap 2); f0 uses A and B, f1 uses A, f2 uses B.
    # A is the bottleneck for f0, f1 (0.5 each); f2 gets what B has left: 1.5.
    usage = np.array([[1, 1], [1, 0], [0, 1]])
    r = max_min_rates(usage, np.array([1.0, 2.0]))
    assert r == pytest.approx([0.5, 0.5, 1.5])
    # a flow crossing a link twice counts twice
    r = max_min_rates(np.array([[2]]), np.array([1.0]))
    assert r == pytest.approx([0.5])


def test_planner_plan_on_alpa_case_matches_bandwidth_figure():
    # 1 GiB from one device to one device of another p3.8xlarge node: 1 GiB / 10 Gb/s
    src = mc.Layout(mc.Mesh([[0]], ("x", "y")), (None,))
    dst = mc.Layout(mc.Mesh([[4]], ("x", "y")), (None,))
    p = mc.plan((268435456,), "int32", src, dst, topology="p3.8xlarge")
    t = p.simulate("p3.8xlarge")
    assert t == pytest.approx(2**30 / 1.25e9, rel=1e-3)
