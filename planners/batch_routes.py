"""Routes for a whole batch of deliveries at once, every NIC counted (planners/batch.py's core).

A delivery is (tensor, box, holders, needers): every needer must get the box, any holder may
send it. The rules are the single-tensor planner's (planners/resharding.py), with two
changes: the loads and the sender choice count bytes of every tensor of the batch at once
(so the busiest link is minimised over the whole batch, not tensor by tensor), and they
count each NIC (``Topology.nic_of``: rails) rather than each node.

1. A needer that holds the box copies it. Needers on a node that has a holder get it over
   NVLink from a holder there (distinct holders where there are enough, else the box is
   split among the holders and each part broadcast along the node's needers).
2. Every other node (a *lacking* node) gets the box once over a NIC. A sender is a NIC of a
   holder device. Deliveries with the same candidate sender NICs and lacking nodes form one
   demand; demands with the same candidate senders are merged, and an exact min-max flow
   (binary search on the capacity, integer max-flow in bytes) splits the merged bytes among
   the candidate NICs, on top of the loads every forced route (one candidate NIC) puts on
   them. The bytes are then cut, in delivery order, into one consecutive run per sender NIC,
   so a box is cut only where one sender's share ends.
3. A sender serves its lacking nodes by one pipelined chain (multicast), or, where there are
   at least as many candidate NICs as lacking nodes, by unicasts from different NICs
   (hybrid); both are solved, and the one with the lower busiest NIC (then fewer bytes) is
   kept for the batch. A chain enters each lacking node once, at the needer whose NIC has
   received least, leaves it at the needer whose NIC has sent least, and visits the lacking
   nodes in rising NIC out-load order (the last node relays nothing).

Emitted routes are (kind, srcs, dsts, stage, src_buf) -> [(tensor, box), ...], as
``Transfer``s have them.
"""
from __future__ import annotations

from collections import defaultdict

import networkx as nx

from .boxes import Box, box_size, row_major_range
from .schedule import transfer_kind
from .topology import Topology

__all__ = ["Router", "CHAIN_REUSE_BYTES"]

# A chain is made afresh (with the loads of the moment) once this many bytes went along the
# last one made for the same needers; smaller pieces share it, and so one message.
CHAIN_REUSE_BYTES = 64 << 20


class Router:
    """Collects routes and the bytes they put on every link (NIC ids, devices)."""

    def __init__(self, topology: Topology, itemsizes):
        self.topo = topology
        self.itemsize = itemsizes                   # tensor index -> bytes per element
        self.routes: dict[tuple, list] = {}         # route key -> [(tensor, box)], emission order
        self.nic_out = defaultdict(int)
        self.nic_in = defaultdict(int)
        self.dev_out = defaultdict(int)
        self.dev_in = defaultdict(int)
        self.sent = defaultdict(int)
        self.reuse: dict = {}                       # (root, needers) -> [chain, bytes along it]
        self.classes: dict = {}                     # (holders, needers) -> classify's answer
        self.links: dict = {}                       # route -> [(load table, key)] per hop
        self.lacking_keys: dict = {}                # id(needers by node) -> (it, its key)

    # -- emission and loads -----------------------------------------------------------------
    def emit(self, tid: int, srcs: tuple, dsts: tuple, box: Box, *, kind: str | None = None,
             stage: int = 0, src_buf: str = "src", extra=None) -> None:
        kind = kind or transfer_kind(srcs, dsts)
        key = (kind, srcs, dsts, stage, src_buf, extra)
        lst = self.routes.get(key)
        if lst is None:
            lst = self.routes[key] = []
        lst.append((tid, box))
        if kind != "copy":
            route = srcs if (kind == "reduce" and srcs[-1] == dsts[0]) else srcs + dsts
            self.add_route(route, box_size(box) * self.itemsize[tid])

    def add_route(self, route: tuple, nb: int) -> None:
        links = self.links.get(route)
        if links is None:               # the loads a route's hops put, worked out once per route
            dpn, nics = self.topo.devices_per_node, self.topo.nics_per_node
            links = []
            for u, v in zip(route[:-1], route[1:]):
                links.append((self.sent, u))
                nu, lu = divmod(u, dpn)
                nv, lv = divmod(v, dpn)
                if nu != nv:
                    links += [(self.nic_out, nu * nics + lu % nics), (self.nic_in, nv * nics + lv % nics)]
                else:
                    links += [(self.dev_out, u), (self.dev_in, v)]
            self.links[route] = links
        for table, key in links:
            table[key] += nb

    # -- chains ------------------------------------------------------------------------------
    def chain(self, root: int, by_node: dict, nb: int = 0) -> tuple:
        """The needers of lacking nodes {node: [needers]} in chain order (module docstring).
        Small pieces from one root reuse the chain last made for the same needers until
        CHAIN_REUSE_BYTES have gone along it, so that they travel in one message."""
        nkey = self.lacking_keys.get(id(by_node))
        if nkey is None or nkey[0] is not by_node:
            nkey = (by_node, tuple((n, tuple(devs)) for n, devs in by_node.items()))
            self.lacking_keys[id(by_node)] = nkey
        key = (root, nkey[1])
        hit = self.reuse.get(key)
        if hit is not None and hit[1] + nb <= CHAIN_REUSE_BYTES:
            hit[1] += nb
            return hit[0]
        c = self.make_chain(by_node)
        self.reuse[key] = [c, nb]
        return c

    def make_chain(self, by_node: dict) -> tuple:
        dpn, nics = self.topo.devices_per_node, self.topo.nics_per_node
        nic_in, nic_out = self.nic_in, self.nic_out
        parts = []
        for n, devs in by_node.items():
            if len(devs) == 1:
                d = devs[0]
                parts.append((nic_out.get(n * nics + d % dpn % nics, 0), n, devs))
                continue
            base = n * nics
            entry = min(devs, key=lambda d: (nic_in.get(base + d % dpn % nics, 0), d))
            rest = [d for d in devs if d != entry]
            exit_ = min(rest, key=lambda d: (nic_out.get(base + d % dpn % nics, 0), d))
            mid = sorted(d for d in rest if d != exit_)
            parts.append((nic_out.get(base + exit_ % dpn % nics, 0), n, [entry, *mid, exit_]))
        parts.sort()
        return tuple(d for _, _, devs in parts for d in devs)

    def node_chain(self, root: int, needers: list) -> tuple:
        """Needers on one node, fed from `root` on that node: least-received first."""
        return tuple(sorted(needers, key=lambda d: (self.dev_in[d], d)))

    # -- deliveries ----------------------------------------------------------------------------
    def classify(self, holders: tuple, needers: tuple):
        """(copies, [(node holders, node needers)], lacking {node: needers}, {NIC: holders})
        of one (holders, needers) pair; cached, since alike tensors repeat them."""
        key = (holders, needers)
        hit = self.classes.get(key)
        if hit is not None:
            return hit
        node, nic = self.topo.node_of, self.topo.nic_of
        hset = set(holders)
        copies = tuple(d for d in needers if d in hset)
        r_by_node: dict[int, list] = defaultdict(list)
        for d in needers:
            if d not in hset:
                r_by_node[node(d)].append(d)
        h_by_node: dict[int, list] = defaultdict(list)
        for h in holders:
            h_by_node[node(h)].append(h)
        local, lacking = [], {}
        for n, devs in sorted(r_by_node.items()):
            if n in h_by_node:
                local.append((h_by_node[n], devs))
            else:
                lacking[n] = devs
        h_by_nic: dict[int, list] = defaultdict(list)
        for h in holders:
            h_by_nic[nic(h)].append(h)
        out = (copies, local, lacking, dict(h_by_nic), (tuple(sorted(h_by_nic)), tuple(lacking)))
        self.classes[key] = out
        return out

    def deliver(self, deliveries) -> None:
        """Route every (tensor, box, holders, needers) of the batch (module docstring)."""
        groups: dict[tuple, list] = defaultdict(list)
        forced = []
        for tid, box, holders, needers in deliveries:
            if len(holders) == 1 and len(needers) == 1:     # fully sharded: nothing to choose
                h, d = holders[0], needers[0]
                self.emit(tid, (h,), (d,), box)
                continue
            copies, local, lacking, h_by_nic, gkey = self.classify(holders, needers)
            for d in copies:
                self.emit(tid, (d,), (d,), box)
            for hs, devs in local:
                self.in_node(tid, box, hs, devs)
            if not lacking:
                continue
            if len(h_by_nic) == 1:
                forced.append((tid, box, h_by_nic, lacking))
            else:
                groups[gkey].append((tid, box, h_by_nic, lacking))
        for tid, box, h_by_nic, lacking in forced:
            (hs,) = h_by_nic.values()
            root = min(hs, key=lambda d: (self.sent[d], d))
            self.emit(tid, (root,), self.chain(root, lacking, box_size(box) * self.itemsize[tid]), box)
        if groups:
            self.assign_senders(groups)

    def in_node(self, tid: int, box: Box, holders: list, needers: list) -> None:
        hs = sorted(holders, key=lambda d: (self.sent[d], d))
        if len(needers) <= len(hs):
            for d, h in zip(sorted(needers), hs):
                self.emit(tid, (h,), (d,), box)
            return
        n = box_size(box)
        k = max(1, min(len(hs), n))
        for i in range(k):
            for sub in row_major_range(box, n * i // k, n * (i + 1) // k):
                self.emit(tid, (hs[i],), self.node_chain(hs[i], needers), sub)

    def assign_senders(self, groups: dict) -> None:
        base_out = dict(self.nic_out)
        candidates = []
        for mode in ("hybrid", "multicast"):
            merged: dict[tuple, list] = defaultdict(list)   # sender NICs -> [(served, plist)]
            for (senders, lacking), plist in groups.items():
                if mode == "hybrid" and len(senders) >= len(lacking) > 1:
                    for ln in lacking:
                        merged[senders].append(((ln,), plist))
                else:
                    merged[senders].append((lacking, plist))
            demands = []
            for senders, parts in merged.items():
                nb = sum(box_size(p[1]) * self.itemsize[p[0]] for _, plist in parts for p in plist)
                demands.append((senders, parts, nb))
            flows = minmax_flow([(s, nb) for s, _, nb in demands], base_out)
            cost = self.mode_cost(demands, flows, base_out)
            candidates.append((cost, mode == "multicast", demands, flows))
        # ties go to multicast: as many bytes on the busiest NIC, fewer messages
        _, _, demands, flows = min(candidates, key=lambda c: (c[0], not c[1]))
        for (senders, parts, _), flow in zip(demands, flows):
            quotas = [[s, flow.get(s, 0)] for s in senders if flow.get(s, 0) > 0]
            # pieces grouped by who needs them, so each sender's run reaches few needer sets
            work = []
            for served, plist in parts:
                for tid, box, h_by_nic, lacking in plist:
                    sub = lacking if len(served) == len(lacking) else {ln: lacking[ln] for ln in served}
                    work.append((tuple(d for ln in served for d in lacking[ln]), len(work), tid, box,
                                 h_by_nic, sub))
            work.sort(key=lambda w: w[:2])
            qi = 0
            for _, _, tid, box, h_by_nic, sub_lacking in work:
                size = self.itemsize[tid]
                n = box_size(box)
                pos = 0
                while pos < n:
                    s, left = quotas[qi]
                    take = min(n - pos, max(1, -(-left // size)))
                    if qi == len(quotas) - 1:
                        take = n - pos
                    root = min(h_by_nic[s], key=lambda d: (self.sent[d], d))
                    for sub in row_major_range(box, pos, pos + take):
                        self.emit(tid, (root,), self.chain(root, sub_lacking, box_size(sub) * size), sub)
                    pos += take
                    quotas[qi][1] = left - take * size
                    if quotas[qi][1] <= 0 and qi + 1 < len(quotas):
                        qi += 1

    def mode_cost(self, demands, flows, base_out: dict) -> tuple[int, int]:
        """(busiest NIC, total NIC bytes) of one candidate: senders' out, the lacking nodes'
        in and the relays of chains (each lacking node but the last relays once). A lacking
        node's NICs share its bytes (the chain picks the least loaded needer)."""
        out = defaultdict(int, base_out)
        inn = defaultdict(int)
        for k, v in self.nic_in.items():
            inn[self.topo.node_of_nic(k)] += v
        node_out = defaultdict(int)
        for k, v in base_out.items():
            node_out[self.topo.node_of_nic(k)] += v
        total = 0
        nics = self.topo.nics_per_node
        for (senders, parts, _), flow in zip(demands, flows):
            for s, q in flow.items():
                out[s] += q
            for served, plist in parts:
                nb = sum(box_size(p[1]) * self.itemsize[p[0]] for p in plist)
                for ln in served:
                    inn[ln] += nb
                for ln in served[:-1]:
                    node_out[ln] += nb
                total += nb * len(served)
        worst = max([0] + list(out.values()) + [-(-v // nics) for v in inn.values()]
                    + [-(-v // nics) for v in node_out.values()])
        return worst, total


def minmax_flow(demands, base_out: dict) -> list[dict]:
    """Split every demand (sender NICs, bytes) among its senders, minimising the busiest
    sender's base_out + assigned bytes. Demands with one sender are forced. The rest fall
    into independent groups (demands linked by shared senders); a group of one demand is
    water-filled, a larger one solved by binary search on the capacity T with an integer
    max-flow (source -> demand (its bytes) -> sender -> sink (T - base))."""
    flows: list[dict] = [dict() for _ in demands]
    load = defaultdict(int, base_out)
    free = []
    for i, (senders, nb) in enumerate(demands):
        if len(senders) == 1:
            flows[i][senders[0]] = nb
            load[senders[0]] += nb
        else:
            free.append(i)
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for i in free:
        s0 = find(demands[i][0][0])
        for s in demands[i][0][1:]:
            r = find(s)
            if r != s0:
                parent[r] = s0
    comps: dict = defaultdict(list)
    for i in free:
        comps[find(demands[i][0][0])].append(i)
    for members in comps.values():
        if len(members) == 1:
            i = members[0]
            flows[i] = water_fill(demands[i][0], demands[i][1], load)
            for s, v in flows[i].items():
                load[s] += v
        else:
            for i, f in zip(members, _flow_search([demands[i] for i in members], load)):
                flows[i] = f
    return flows


def water_fill(senders, nb: int, load: dict) -> dict:
    """`nb` bytes over `senders` so that the busiest ends least loaded: each gets T - load
    (none below zero), the shares summing exactly to nb."""
    order = sorted(senders, key=lambda s: (load[s], s))
    acc, k = 0, len(order)
    for j in range(1, len(order) + 1):     # level T between order[j-1] and order[j]
        acc += load[order[j - 1]]
        t = (nb + acc) / j
        if j == len(order) or t <= load[order[j]]:
            k = j
            break
    level = (nb + sum(load[s] for s in order[:k])) // k
    share = {s: max(0, level - load[s]) for s in order[:k]}
    rest = nb - sum(share.values())
    for s in order[:k]:
        if rest <= 0:
            break
        share[s] += 1
        rest -= 1
    return {s: v for s, v in share.items() if v > 0}


def _flow_search(demands, load) -> list[dict]:
    # integer node labels only: networkx keeps sets of nodes, and ints hash the same in every
    # process (strings do not), so every process finds the same flow
    senders_all = sorted({s for senders, _ in demands for s in senders})
    total = sum(nb for _, nb in demands)
    S, T, nd = 0, 1, len(demands)
    node = {s: 2 + nd + k for k, s in enumerate(senders_all)}
    g = nx.DiGraph()
    for i, (senders, nb) in enumerate(demands):
        g.add_edge(S, 2 + i, capacity=nb)
        for s in senders:
            g.add_edge(2 + i, node[s])
    for s in senders_all:
        g.add_edge(node[s], T, capacity=0)

    def feasible(cap: int):
        for s in senders_all:
            g[node[s]][T]["capacity"] = max(0, cap - load[s])
        value, fd = nx.maximum_flow(g, S, T)
        return value >= total, fd

    base = sum(load[s] for s in senders_all)
    lo = max(max(load[s] for s in senders_all), -(-(total + base) // len(senders_all)))
    hi = max(load[s] for s in senders_all) + total
    ok, best = feasible(lo)
    if not ok:
        ok_hi, best = feasible(hi)
        assert ok_hi
        # bytes are large: stop within 1/4096 of the capacity
        while hi - lo > max(1, hi // 4096):
            mid = (lo + hi) // 2
            ok, fd = feasible(mid)
            if ok:
                hi, best = mid, fd
            else:
                lo = mid
    back = {v: s for s, v in node.items()}
    out = []
    for i in range(len(demands)):
        out.append({back[x]: v for x, v in best[2 + i].items() if v > 0})
    for f in out:
        for s, v in f.items():
            load[s] += v
    return out
