"""The resharding planner: two layouts -> pieces -> transfer graph -> senders -> schedule.

1. Pieces. Src tiles partition the tensor, and so do dst tiles; each non-empty
   (src tile, dst tile) intersection is a piece, found per dimension by merging intervals.
2. Graph. A networkx DiGraph src device -> piece -> dst device, edges weighted by bytes
   (``transfer_graph``), used for inspection and drawing; the planner works on its data.
3. Senders. Needers that hold a piece copy it locally; a node that holds it feeds its own
   devices. Every node that lacks a piece gets it once over its NIC, from a holder node
   chosen by an exact min-max flow over NIC out-loads (binary search on the capacity,
   integer max-flow in elements). Fractional splits are realised exactly by cutting pieces
   at row-major element offsets.
4. Primitives. One lacking node: a send (or a bcast into that node's needers). Several:
   unicast from distinct senders where senders are plentiful, else one pipelined chain
   broadcast through the lacking nodes; both are solved and the lower busiest link wins.
5. Partial sums. With the same number of addends (and the same op) on both sides the
   pending sum is kept (addend a goes to dst replica group a); otherwise each value is
   reduced once, along a chain ending at one needer on the node holding most addends, then
   fanned out along the ring onward from that root. A piece needed on several nodes (or by
   several devices of one node) may instead be split into parts reduced at different
   needers (a reduce-scatter; the fan-outs then make an all-gather): both plans are built
   and the cost model keeps the faster. Other ops (prod, min, max: `Plan.reduce_op`) take
   the same routes, but for one: two addends under min or max are not reduced at each
   needer apart (the order decides the sign of a zero), as under sum or prod they may be.
6. Coalescing and order. Everything between the same route in the same stage is one
   message. Transfers get rounds by list scheduling and one deterministic global order.
7. Best of. The plan is simulated beside the baselines' plans for the same layouts
   (send_recv, alpa_broadcast) and the fastest under the cost model is kept, except a
   baseline plan that breaks this planner's rules (a box fetched into a node holding it, a
   value reduced twice).
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Iterable

import networkx as nx

from meshcomm.reduceops import check_dtype

from . import baselines
from .boxes import Box, box_size, pieces, row_major_range
from .schedule import Plan, Transfer, coalesce, transfer_kind
from .topology import Topology

__all__ = ["plan_reshard", "pieces", "transfer_graph"]


def transfer_graph(src, dst, shape, itemsize: int = 1) -> nx.DiGraph:
    """src devices -> pieces -> dst devices, edge weight = bytes of the piece."""
    st, dt = src.tiles(shape), dst.tiles(shape)
    g = nx.DiGraph()
    for sc, dc, box in pieces(src, dst, shape):
        nb = box_size(box) * itemsize
        pnode = ("piece", sc, dc)
        g.add_node(pnode, box=box, nbytes=nb)
        for a, devs in st.classes[sc].items():
            for d in devs:
                g.add_edge(("src", d), pnode, weight=nb, addend=a)
        for b, devs in dt.classes[dc].items():
            for d in devs:
                g.add_edge(pnode, ("dst", d), weight=nb, group=b)
    return g


class _Loads:
    """Bytes (in elements) already placed on each link, for greedy tie-breaking."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.nic_out = defaultdict(int)
        self.nic_in = defaultdict(int)
        self.dev_out = defaultdict(int)
        self.dev_in = defaultdict(int)
        self.reduced_at = defaultdict(int)     # elements reduced onto each node (root choice)
        self.sent = defaultdict(int)           # elements each device sends, on any link

    def add_route(self, route: tuple[int, ...], n: int) -> None:
        node = self.topo.node_of
        for u, v in zip(route[:-1], route[1:]):
            self.sent[u] += n
            if node(u) != node(v):
                self.nic_out[node(u)] += n
                self.nic_in[node(v)] += n
            else:
                self.dev_out[u] += n
                self.dev_in[v] += n


class _Builder:
    def __init__(self, topo: Topology):
        self.topo = topo
        self.loads = _Loads(topo)
        self.items: dict[tuple, list[Box]] = defaultdict(list)

    def emit(self, srcs: tuple[int, ...], dsts: tuple[int, ...], box: Box, *,
             reduce: bool = False, stage: int = 0, src_buf: str = "src") -> None:
        kind = transfer_kind(srcs, dsts, reduce)
        self.items[(kind, srcs, dsts, stage, src_buf)].append(box)
        if kind != "copy":
            n = box_size(box)
            route = srcs if (reduce and srcs[-1] == dsts[0]) else srcs + dsts
            self.loads.add_route(route, n)

    def pick(self, devices: Iterable[int], load: dict) -> int:
        return min(devices, key=lambda d: (load[d], d))

    def chain_order(self, root: int, needers: list[int]) -> tuple[int, ...]:
        """Needers grouped by node: the root's node first, then nodes by rising NIC out-load
        (the last node relays nothing, so the busiest goes last); inside a node round the
        ring onward from the root (chains from different roots then share no link more than
        a ring does)."""
        if len(needers) == 1:
            return (needers[0],)
        node = self.topo.node_of
        by_node = defaultdict(list)
        for d in needers:
            by_node[node(d)].append(d)
        rn = node(root)
        nodes = sorted(by_node, key=lambda n: (n != rn, self.loads.nic_out[n], n))
        ring = 1 << 40
        return tuple(d for n in nodes for d in sorted(by_node[n], key=lambda d: (d - root - 1) % ring))


# Pieces at least this large are split among receiving nodes (reductions) or pending-sum
# groups (partial dst); smaller ones stay whole, since a message costs a latency.
SPLIT_BYTES = 256 * 1024


def plan_reshard(shape: tuple[int, ...], dtype: str, itemsize: int, src, dst,
                 topology: Topology) -> Plan:
    t0 = time.perf_counter()
    st, dt = src.tiles(shape), dst.tiles(shape)
    b = _Builder(topology)
    zero_fill: set[int] = set()
    deliveries: list[tuple[Box, tuple[int, ...], tuple[int, ...]]] = []   # (box, holders, needers)
    reductions = []
    if src.num_addends > 1:
        check_dtype(src.partial_op, dtype)
    if dst.num_addends > 1:
        check_dtype(dst.partial_op, dtype)
    # a pending value passes through unreduced only when both sides reduce it the same way
    passthrough = (src.num_addends == dst.num_addends and src.num_addends > 1
                   and src.partial_op == dst.partial_op)
    split_dst = dst.num_addends > 1 and not passthrough
    if split_dst:
        # a partial dst holds the value as a pending sum: each piece goes to one replica group
        # (or, when large, a part of it to every group); the rest of every tile is zeros (the
        # identity of the dst's op: the plan's fill_op)
        zero_fill = {d for d, box in dt.boxes.items() if box_size(box) > 0}
    for i, (sc, dc, box) in enumerate(pieces(src, dst, shape)):
        sgroups, dgroups = st.classes[sc], dt.classes[dc]
        if passthrough:
            for a in sgroups:
                deliveries.append((box, sgroups[a], dgroups[a]))
            continue
        targets = _split_among_groups(box, dgroups, i, itemsize) if split_dst else [(box, dgroups[0])]
        for part, needers in targets:
            if src.num_addends == 1:
                deliveries.append((part, sgroups[0], needers))
            else:
                reductions.append((part, sgroups, needers))
    def make(split: str) -> Plan:
        rb = _Builder(topology)
        for box, sgroups, needers in reductions:
            _plan_reduction(rb, box, sgroups, needers, itemsize, split)
        return Plan(shape=shape, dtype=dtype, itemsize=itemsize, src=src, dst=dst, topology=topology,
                    transfers=_finish(rb, itemsize), zero_fill=tuple(sorted(zero_fill)))

    if reductions:
        # a partial src not passed through: every piece is a reduction (no deliveries). Each
        # piece is reduced at one root, or split into parts reduced at different roots (a
        # reduce-scatter; the fan-out is then an all-gather): the cost model decides
        p = make("size")
        if any(_splittable(topology, needers) for _, _, needers in reductions):
            p = _fastest([p, make("never"), make("always")], topology)
    else:
        _plan_deliveries(b, deliveries)
        p = Plan(shape=shape, dtype=dtype, itemsize=itemsize, src=src, dst=dst, topology=topology,
                 transfers=_finish(b, itemsize), zero_fill=tuple(sorted(zero_fill)))
    p = _best_of(p, shape, dtype, src, dst, topology)
    return dataclasses.replace(p, plan_seconds=time.perf_counter() - t0)


def _fastest(plans: list[Plan], topology: Topology) -> Plan:
    """The first of the fastest plans under the cost model (plans with the same transfers
    are simulated once); beyond COMPARE_MAX_TRANSFERS the first plan."""
    if any(len(q.transfers) > COMPARE_MAX_TRANSFERS for q in plans):
        return plans[0]
    best, best_s, seen = plans[0], None, set()
    for q in plans:
        if q.transfers in seen:
            continue
        seen.add(q.transfers)
        s = q.simulate(topology)
        if best_s is None or s < best_s:
            best, best_s = q, s
    return best


# Plans of up to this many transfers are compared with the baselines' under the cost model;
# beyond it the simulations would cost more than the planning itself.
COMPARE_MAX_TRANSFERS = 1024


def _best_of(p: Plan, shape, dtype, src, dst, topology: Topology) -> Plan:
    """The fastest under the cost model (planners.simulate) of this plan and the baselines'
    plans that deliver the same layout (send_recv, alpa_broadcast): the flow heuristics
    above can lose a little to a simpler schedule (message latency, pipeline fill), and a
    plan should never lose to a baseline under its own cost model. Ties keep this plan, and
    a baseline plan that fetches a box over the network into a node already holding it is
    not taken (this planner's own rule; for a pending sum a node holding another addend of
    the box does not hold its value, so there the rule does not apply). Nor is one that
    reduces some value more than once (send_recv reduces a pending sum once per dst
    replica), unless it moves no more bytes than this plan and every reduction combines
    two addends by sum or prod: otherwise the extra reductions move more bytes, and the
    replicas would hold the value combined in different orders, so floats could differ
    between them (a + b and b + a are the same bits; (a + b) + c and (b + c) + a may not be,
    nor min(-0.0, 0.0) and min(0.0, -0.0)). This planner reduces every value once and
    copies the result to its replicas."""
    if len(p.transfers) > COMPARE_MAX_TRANSFERS:
        return p
    if src.num_addends > 1 and dst.num_addends > 1 and src.partial_op != dst.partial_op:
        return p                    # the baselines pass addends through whatever the ops
    best, best_s = p, p.simulate(topology)
    for make in (baselines.send_recv, baselines.alpa_broadcast):
        c = make(shape, dtype, src, dst, topology)
        if c is None or len(c.transfers) > COMPARE_MAX_TRANSFERS or \
                (src.num_addends == 1 and _fetches_held(c, src, shape, topology)) or \
                _reduces_again(c, p):
            continue
        s = c.simulate(topology)
        if s < best_s:
            best, best_s = c, s
    return best if best is p else dataclasses.replace(best, planner="meshcomm")


def _reduced_elements(p: Plan) -> int:
    return sum(box_size(b) for t in p.transfers if t.kind == "reduce" for b in t.boxes)


def _reduces_again(c: Plan, p: Plan) -> bool:
    """Whether plan `c` reduces some value more than once where this planner's plan `p`
    (the same layouts) reduces it once, other than by two addends under sum or prod moving
    no more bytes than `p` (then every replica gets the same bits). `p` reduces every value
    a dst needs exactly once and every plan reduces each at least once, so more reduced
    elements in `c` mean a value reduced twice."""
    if _reduced_elements(c) <= _reduced_elements(p):
        return False
    src = p.src
    return not (src.num_addends == 2 and src.partial_op in ("sum", "prod") and c.bytes_moved <= p.bytes_moved)


def _split_among_groups(box: Box, dgroups: dict, index: int, itemsize: int):
    """[(part, needers)]: a large piece split evenly over the pending-sum groups, a small
    one whole to one group (rotating, so groups share the load)."""
    groups = list(dgroups.values())
    k, n = len(groups), box_size(box)
    if n * itemsize < SPLIT_BYTES or n < k:
        return [(box, groups[index % k])]
    return [(sub, groups[j]) for j in range(k)
            for sub in row_major_range(box, n * j // k, n * (j + 1) // k)]


def _fetches_held(p: Plan, src, shape, topology: Topology) -> bool:
    """Whether some hop of `p` brings a box over the network into a node where a src tile
    already holds it (this planner never does: it copies inside the node instead)."""
    node = topology.node_of
    by_node = defaultdict(list)
    for d, box in src.tiles(shape).boxes.items():
        by_node[node(d)].append(box)
    for t in p.transfers:
        if t.kind == "copy" or t.src_buf != "src":
            continue
        for u, v in t.hops:
            if node(u) != node(v) and any(_inside(b, h) for b in t.boxes for h in by_node[node(v)]):
                return True
    return False


def _inside(box: Box, outer: Box) -> bool:
    return all(a >= c and b <= e for (a, b), (c, e) in zip(box, outer))


# -- partial sums ---------------------------------------------------------------------

def _units(topo: Topology, needers: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Where the parts of a split reduction are rooted: the needers' nodes (each part's
    fan-out enters every other node once), or the needers themselves inside one node."""
    node = topo.node_of
    nodes = sorted({node(d) for d in needers})
    if len(nodes) > 1:
        return [tuple(d for d in needers if node(d) == nd) for nd in nodes]
    return [(d,) for d in needers]


def _splittable(topo: Topology, needers: tuple[int, ...]) -> bool:
    return len(_units(topo, needers)) > 1


def _plan_reduction(b: _Builder, box: Box, sgroups: dict[int, tuple[int, ...]],
                    needers: tuple[int, ...], itemsize: int, split: str = "size") -> None:
    """Reduce a piece once and fan it out. A piece needed on several nodes may be split
    among those nodes (inside one node: among the needers), each part reduced onto a
    different one (reduce-scatter, then the fan-out plays allgather), so both directions
    of every link work in both stages. `split`: "size" splits pieces of at least
    SPLIT_BYTES, "always" every piece (of at least one element per part), "never" none."""
    units = _units(b.topo, needers)
    n = box_size(box)
    if len(units) == 1 or split == "never" or (split == "size" and n * itemsize < SPLIT_BYTES):
        _reduce_piece(b, box, sgroups, needers, needers)
        return
    k = min(len(units), n)
    for j in range(k):
        for sub in row_major_range(box, n * j // k, n * (j + 1) // k):
            _reduce_piece(b, sub, sgroups, needers, units[j])


def _reduce_piece(b: _Builder, box: Box, sgroups: dict[int, tuple[int, ...]],
                  needers: tuple[int, ...], candidates: tuple[int, ...]) -> None:
    node = b.topo.node_of
    holder_nodes = defaultdict(set)           # node -> addends held there
    holders = set()
    for a, devs in sgroups.items():
        for d in devs:
            holder_nodes[node(d)].add(a)
            holders.add(d)
    # the root: a needer on the node with most addends, preferring one that holds an addend
    # (balanced on earlier reductions only: counting the stage-1 fan-out would make every
    # piece root on the same node, serialising an all-reduce into gather-then-broadcast)
    root = min(candidates, key=lambda d: (-len(holder_nodes.get(node(d), ())), d not in holders,
                                          b.loads.reduced_at[node(d)], b.loads.dev_in[d], d))
    rn = node(root)
    b.loads.reduced_at[rn] += box_size(box)
    contributors = []
    for a, devs in sgroups.items():
        if root in devs:
            contributors.append(root)
            continue
        local = [d for d in devs if node(d) == rn]
        if local:
            contributors.append(b.pick(local, b.loads.dev_out))
        else:
            contributors.append(min(devs, key=lambda d: (b.loads.nic_out[node(d)], b.loads.dev_out[d], d)))
    # chain: remote nodes first, grouped by node in ring order starting after the root's
    # node (so pieces rooted on different nodes start their chains on different devices
    # and every device receives equally often), the root's node last, the root at the end
    ring = 1 << 40
    chain = sorted(contributors, key=lambda d: (node(d) == rn, d == root, (node(d) - rn - 1) % ring,
                                                (d - root - 1) % ring))
    b.emit(tuple(chain), (root,), box, reduce=True)
    rest = [d for d in needers if d != root]
    if rest:
        # the fan-out runs the same ring onward from the root: its node first, then the other
        # nodes in ring order, so the fan-outs of parts rooted on different devices (an
        # all-gather) load every link equally
        fan = sorted(rest, key=lambda d: (node(d) != rn, (node(d) - rn) % ring, (d - root - 1) % ring))
        b.emit((root,), tuple(fan), box, stage=1, src_buf="dst")


# -- plain deliveries -------------------------------------------------------------------

def _plan_deliveries(b: _Builder, deliveries) -> None:
    node = b.topo.node_of
    groups: dict[tuple, list] = defaultdict(list)   # (holder nodes, lacking nodes) -> pieces
    for box, holders, needers in deliveries:
        if len(holders) == 1 and len(needers) == 1:          # the common fully-sharded case
            b.emit(holders, needers, box)
            continue
        hset = set(holders)
        rest = []
        for d in needers:
            if d in hset:
                b.emit((d,), (d,), box)
            else:
                rest.append(d)
        if not rest:
            continue
        h_by_node = defaultdict(list)
        for h in holders:
            h_by_node[node(h)].append(h)
        r_by_node = defaultdict(list)
        for d in rest:
            r_by_node[node(d)].append(d)
        lacking = {}
        for n, devs in sorted(r_by_node.items()):
            if n in h_by_node:
                _deliver_in_node(b, box, h_by_node[n], devs)
            else:
                lacking[n] = devs
        if not lacking:
            continue
        if len(h_by_node) == 1:
            # one holder node: no sender to choose, one chain through the lacking nodes
            (hs,) = h_by_node.values()
            root = b.pick(hs, b.loads.sent)
            b.emit((root,), b.chain_order(root, [d for devs in lacking.values() for d in devs]), box)
        else:
            key = (tuple(sorted(h_by_node)), tuple(sorted(lacking)))
            groups[key].append((box, dict(h_by_node), lacking))
    if groups:
        _assign_senders(b, groups)


def _deliver_in_node(b: _Builder, box: Box, holders: list[int], needers: list[int]) -> None:
    """Feed needers from holders on the same node: distinct senders where there are enough,
    else the piece is split among the holders and each part broadcast to all needers."""
    hs = sorted(holders, key=lambda d: (b.loads.sent[d], d))
    if len(needers) <= len(hs):
        for d, h in zip(sorted(needers), hs):
            b.emit((h,), (d,), box)
        return
    n = box_size(box)
    k = max(1, min(len(hs), n))
    for i in range(k):
        lo, hi = n * i // k, n * (i + 1) // k
        for sub in row_major_range(box, lo, hi):
            b.emit((hs[i],), b.chain_order(hs[i], needers), sub)


def _assign_senders(b: _Builder, groups: dict[tuple, list]) -> None:
    """Choose sender nodes for every (piece, lacking node) so the busiest NIC carries least.

    A demand is a set of pieces some lacking node(s) need, served by one chain. Demands with
    the same candidate senders are interchangeable in the flow, so they are merged first:
    the flow then has one node per distinct sender set, however many pieces there are.
    """
    base_out = dict(b.loads.nic_out)
    candidates = []
    for mode in ("hybrid", "multicast"):
        merged: dict[tuple, list] = defaultdict(list)   # senders -> [(served, plist)]
        for key, plist in groups.items():
            senders, lacking = key
            if mode == "hybrid" and len(senders) >= len(lacking) > 1:
                for ln in lacking:
                    merged[senders].append(((ln,), plist))
            else:
                merged[senders].append((lacking, plist))
        demands = [(senders, parts, sum(box_size(p[0]) for _, plist in parts for p in plist))
                   for senders, parts in merged.items()]
        flows = _minmax_flow([(s, e) for s, _, e in demands], base_out)
        cost = _mode_cost(demands, flows, base_out, b.loads.nic_in)
        candidates.append((cost, mode == "multicast", demands, flows))
    _, _, demands, flows = min(candidates, key=lambda c: (c[0], c[1]))
    for (senders, parts, elems), flow in zip(demands, flows):
        # cut the concatenated pieces of all merged demands into consecutive element
        # ranges, one per sender, in sender order
        quotas = [(s, flow.get(s, 0)) for s in senders if flow.get(s, 0) > 0]
        qi, left = 0, quotas[0][1]
        for served, plist in parts:
            for box, h_by_node, lacking in plist:
                n = box_size(box)
                needers = [d for ln in served for d in lacking[ln]]
                pos = 0
                while pos < n:
                    s = quotas[qi][0]
                    take = min(left, n - pos)
                    for sub in row_major_range(box, pos, pos + take):
                        root = b.pick(h_by_node[s], b.loads.sent)
                        b.emit((root,), b.chain_order(root, needers), sub)
                    pos += take
                    left -= take
                    if left == 0 and qi + 1 < len(quotas):
                        qi += 1
                        left = quotas[qi][1]


def _minmax_flow(demands, base_out: dict) -> list[dict]:
    """Split every demand (senders, elements) among its senders, minimising the busiest
    sender's base_out + assigned elements.

    Demands with one sender are forced. The rest: binary search on the capacity T with an
    integer max-flow (source -> demand (its elements) -> sender -> sink (T - base)).
    """
    flows: list[dict] = [dict() for _ in demands]
    load = defaultdict(int, base_out)
    free = []
    for i, (senders, elems) in enumerate(demands):
        if len(senders) == 1:
            flows[i][senders[0]] = elems
            load[senders[0]] += elems
        else:
            free.append(i)
    if not free:
        return flows
    senders_all = sorted({s for i in free for s in demands[i][0]})
    total = sum(demands[i][1] for i in free)
    g = nx.DiGraph()
    for i in free:
        g.add_edge("S", ("d", i), capacity=demands[i][1])
        for s in demands[i][0]:
            g.add_edge(("d", i), ("n", s))          # infinite capacity
    for s in senders_all:
        g.add_edge(("n", s), "T", capacity=0)

    def feasible(cap: int):
        for s in senders_all:
            g[("n", s)]["T"]["capacity"] = max(0, cap - load[s])
        value, fd = nx.maximum_flow(g, "S", "T")
        return value >= total, fd

    lo = max(max(load[s] for s in senders_all), -(-(total + sum(load[s] for s in senders_all)) // len(senders_all)))
    hi = max(load[s] for s in senders_all) + total
    ok, best = feasible(lo)
    if not ok:
        ok_hi, best = feasible(hi)
        assert ok_hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok, fd = feasible(mid)
            if ok:
                hi, best = mid, fd
            else:
                lo = mid
    for i in free:
        for (_, s), v in best[("d", i)].items():
            if v > 0:
                flows[i][s] = v
    return flows


def _mode_cost(demands, flows, base_out: dict, base_in: dict) -> tuple[int, int]:
    """(busiest NIC, total NIC bytes) for one candidate: senders' out, lacking nodes' in,
    and relays of chains through several lacking nodes (all but the last relay)."""
    out = defaultdict(int, base_out)
    inn = defaultdict(int, base_in)
    total = 0
    for (senders, parts, _), flow in zip(demands, flows):
        for s, q in flow.items():
            out[s] += q
        for served, plist in parts:
            elems = sum(box_size(p[0]) for p in plist)
            for ln in served:
                inn[ln] += elems
            for ln in served[:-1]:
                out[ln] += elems
            total += elems * len(served)
    return (max(list(out.values()) + list(inn.values()) + [0]), total)


# -- coalescing and order ----------------------------------------------------------------

_KIND_ORDER = {"copy": 0, "reduce": 1, "send": 2, "bcast": 3}


def _finish(b: _Builder, itemsize: int) -> tuple[Transfer, ...]:
    ts = coalesce(b.items, itemsize)
    # list scheduling into rounds: big messages first, each device in one transfer per round
    ts.sort(key=lambda t: (t.stage, -t.nbytes, _KIND_ORDER[t.kind], t.srcs, t.dsts))
    next_free: dict[int, int] = defaultdict(int)
    stage_base = 0
    rounds = []
    cur_stage = None
    for t in ts:
        if t.stage != cur_stage:
            cur_stage = t.stage
            stage_base = max(next_free.values(), default=0)
        parts = t.participants
        r = max([stage_base] + [next_free[p] for p in parts])
        for p in parts:
            next_free[p] = r + 1
        rounds.append(r)
    order = sorted(range(len(ts)), key=lambda i: (ts[i].stage, rounds[i], _KIND_ORDER[ts[i].kind],
                                                   ts[i].srcs, ts[i].dsts))
    return tuple(ts[i] for i in order)
