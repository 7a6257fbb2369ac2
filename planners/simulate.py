"""Cost model: seconds for a plan on a topology.

First-order model: every directed link (a node's NIC each way, a device's intra-node link
each way) carries its bytes at its bandwidth; links run in parallel; the busiest decides,
plus one latency per round of messages a device takes part in.
"""
from __future__ import annotations

from collections import defaultdict

from .topology import Topology


def simulate(plan, topology: Topology) -> float:
    loads = plan.link_loads(topology)
    t_bw = 0.0
    for (kind, _), nbytes in loads.items():
        bw = topology.inter_bytes_per_s if kind.startswith("nic") else topology.intra_bytes_per_s
        t_bw = max(t_bw, nbytes / bw)
    per_dev = defaultdict(int)
    lat = 0.0
    for t in plan.transfers:
        if t.kind == "copy":
            continue
        cross = any(topology.node_of(u) != topology.node_of(v) for u, v in t.hops)
        l = topology.inter_node_latency_s if cross else topology.intra_node_latency_s
        for d in t.participants:
            per_dev[d] += 1
        lat = max(lat, l)
    return t_bw + lat * max(per_dev.values(), default=0)
