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

For a partial dst (pending sums kept or created) the dst replica groups together hold the
value, split among them as the plan likes. So a node must receive what it lacks only when it
has a member of every group (it could then rebuild the whole value), and a sole holder of an
addend need not send it when some group lies entirely on its node (that group may carry it).
With one group (a dst without pending sums) these are the two rules above.

The time bound is the largest over links of bytes / bandwidth. The simulator moves bytes
no faster than link bandwidth, so no plan simulates faster; nor does any plan's
``max_link_bytes(topology, "nic")`` fall below ``nic`` here.

Several NICs per node (``Topology.nics_per_node``): the NIC entries of ``links`` stay per
node (the node's NICs together must carry those bytes: a plan may pass a piece over NVLink
to whichever GPU's NIC it likes), and ``nic`` is the busiest node's bytes shared evenly over
its NICs (rounded up), a bound on the busiest single NIC; the seconds are the same.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from .boxes import box_size
from .topology import Topology

__all__ = ["LinkBound", "lower_bound_bytes", "lower_bound", "link_bound"]


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
        groups = [set(devs) for devs in dgroups.values()]
        needers = set().union(*groups)
        need_nodes = {node(d) for d in needers}
        group_nodes = [{node(d) for d in g} for g in groups]
        # -- NICs. A node with a member of every dst replica group can rebuild the whole value
        # from what its devices hold, so it must receive what it lacks; a sole holder of an
        # addend keeps it home only if some group lies entirely on its node.
        for n in need_nodes:
            if n not in full_nodes and all(n in gn for gn in group_nodes):
                links[("nic_in", n)] += nb
        for n in sole_nodes:
            if not any(gn == {n} for gn in group_nodes):
                links[("nic_out", n)] += nb
        # -- device links, where everything sits on one node (no route leaves and re-enters it)
        holders = {d for devs in addends.values() for d in devs}
        if len(need_nodes | {node(d) for d in holders}) != 1:
            continue
        addend_sets = [set(devs) for devs in addends.values()]
        full_devs = set.intersection(*addend_sets)
        sole_devs = {next(iter(s)) for s in addend_sets if len(s) == 1}
        for d in needers:
            if d not in full_devs and all(d in g for g in groups):
                links[("dev_in", d)] += nb
        for d in sole_devs:
            if not any(g == {d} for g in groups):
                links[("dev_out", d)] += nb
    links = dict(links)
    return link_bound(links, topo)


def link_bound(links: dict, topology: Topology) -> LinkBound:
    """The LinkBound of per-link forced bytes `links` (NIC entries per node): the busiest
    NIC's share and device link, and the seconds. Forced bytes of different tensors add up,
    so the sum of several tensors' `links` gives the bound of moving them all."""
    node_max = max((v for (k, _), v in links.items() if k.startswith("nic")), default=0)
    nic = -(-node_max // topology.nics_per_node)
    dev = max((v for (k, _), v in links.items() if k.startswith("dev")), default=0)
    seconds = max(node_max / topology.inter_bytes_per_s, dev / topology.intra_bytes_per_s)
    return LinkBound(links, nic, dev, seconds)


def lower_bound(shape, dtype, src, dst, topology: Topology | str | None = None) -> float:
    """Seconds no plan can beat: the busiest link's forced bytes over its bandwidth."""
    from meshcomm.arrays import normalize_dtype
    _, itemsize = normalize_dtype(dtype)
    return lower_bound_bytes(shape, itemsize, src, dst, topology).seconds
