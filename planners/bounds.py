"""Bandwidth lower bounds for one resharding, independent of any plan.

Per NIC (node level), for every element of the tensor:

* in:  a node that needs the element (some dst device on it) and does not hold it (for a
  partial src: lacks some addend) receives at least the element's bytes once;
* out: a node that is the only holder of the element (for a partial src: of one of its
  addends), where another node needs it, sends at least the element's bytes once.

Per device (intra-node links), the same two rules where the element lives on one node only
(every holder and every needer on it): a needer that lacks it receives it once over its
link, a sole holder (of an addend) that another device needs sends it once. This assumes
no plan routes data out of a node and back into the same node.

For a partial dst (pending sums kept or created) any one replica group may take the whole
value, so only a node (device) on which every dst replica sits must receive, and a sole
holder must send only when no dst replica sits on its node (device).

The time bound is the largest over links of bytes / bandwidth. The simulator moves bytes
no faster than link bandwidth, so no plan simulates faster; nor does any plan's
``max_link_bytes(topology, "nic")`` fall below ``nic`` here.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from .boxes import box_size
from .topology import Topology

__all__ = ["LinkBound", "lower_bound_bytes", "lower_bound"]


@dataclasses.dataclass(frozen=True)
class LinkBound:
    """Per directed link the bytes any plan must move over it, and the maxima."""

    links: dict                 # ("nic_in"|"nic_out", node) / ("dev_in"|"dev_out", device) -> bytes
    nic: int                    # largest NIC bound
    dev: int                    # largest intra-node device-link bound
    seconds: float              # max over links of bytes / bandwidth

    @property
    def max(self) -> int:
        return max(self.nic, self.dev)


def lower_bound_bytes(shape, itemsize: int, src, dst, topology: Topology | str | None = None) -> LinkBound:
    """Per-link byte lower bounds for moving a `shape` tensor of `itemsize`-byte elements
    from layout `src` to layout `dst` on `topology`."""
    from .resharding import pieces          # the planner's piece enumeration (pure)
    topo = Topology.coerce(topology)
    from meshcomm.layout import normalize_shape
    shape = normalize_shape(shape)
    src.check_shape(shape)
    dst.check_shape(shape)
    if not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int, got {itemsize!r}")
    node = topo.node_of
    st, dt = src.tiles(shape), dst.tiles(shape)
    dst_partial = dst.num_addends > 1
    links: dict[tuple[str, int], int] = defaultdict(int)
    for sc, dc, box in pieces(src, dst, shape):
        nb = box_size(box) * itemsize
        if nb == 0:
            continue
        addends = st.classes[sc]                 # addend -> devices holding it
        dgroups = dt.classes[dc]                 # dst group -> devices needing it
        addend_nodes = [{node(d) for d in devs} for devs in addends.values()]
        full_nodes = set.intersection(*addend_nodes)          # nodes holding every addend
        sole_nodes = {next(iter(s)) for s in addend_nodes if len(s) == 1}
        needers = [d for devs in dgroups.values() for d in devs]
        need_nodes = {node(d) for d in needers}
        # -- NICs
        if dst_partial:
            if len(need_nodes) == 1:
                (n,) = need_nodes
                if n not in full_nodes:
                    links[("nic_in", n)] += nb
            for n in sole_nodes:
                if n not in need_nodes:
                    links[("nic_out", n)] += nb
        else:
            for n in need_nodes:
                if n not in full_nodes:
                    links[("nic_in", n)] += nb
            for n in sole_nodes:
                if need_nodes - {n}:
                    links[("nic_out", n)] += nb
        # -- device links, where everything sits on one node
        holders = {d for devs in addends.values() for d in devs}
        if len(need_nodes | {node(d) for d in holders}) != 1:
            continue
        addend_sets = [set(devs) for devs in addends.values()]
        full_devs = set.intersection(*addend_sets)
        sole_devs = {next(iter(s)) for s in addend_sets if len(s) == 1}
        if dst_partial:
            if len(needers) == 1 and needers[0] not in full_devs:
                links[("dev_in", needers[0])] += nb
            for d in sole_devs:
                if d not in needers:
                    links[("dev_out", d)] += nb
        else:
            for d in needers:
                if d not in full_devs:
                    links[("dev_in", d)] += nb
            for d in sole_devs:
                if set(needers) - {d}:
                    links[("dev_out", d)] += nb
    links = dict(links)
    nic = max((v for (k, _), v in links.items() if k.startswith("nic")), default=0)
    dev = max((v for (k, _), v in links.items() if k.startswith("dev")), default=0)
    seconds = max(nic / topo.inter_bytes_per_s, dev / topo.intra_bytes_per_s)
    return LinkBound(links, nic, dev, seconds)


def lower_bound(shape, dtype, src, dst, topology: Topology | str | None = None) -> float:
    """Seconds no plan can beat: the busiest link's forced bytes over its bandwidth."""
    from meshcomm.arrays import normalize_dtype
    _, itemsize = normalize_dtype(dtype)
    return lower_bound_bytes(shape, itemsize, src, dst, topology).seconds
