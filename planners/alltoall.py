"""All-to-all-v planning (MoE token dispatch/combine): who sends which rows where, when.

The input is a counts matrix ``counts[i][j]``: rows device i sends to device j (devices
along one mesh axis, in axis order). A *block* is the rows (origin i -> final j); blocks
never split, they travel whole, possibly through an intermediate device. A plan is a list
of rounds of messages; each message coalesces every block one device forwards to another
in that round into one buffer. Messages of stage k+1 may carry blocks received in stage k.

Two algorithms:

* ``pairwise`` (one stage): round r = 1..n-1, device i sends to device (i + r) mod n.
  Every device sends exactly one message and receives one per round, so no device or link
  is hit by everyone at once (the shifted pattern of MPI's pairwise all-to-all).
* ``two_level`` (three stages) for several devices per node:
  (1) *gather within a node*: the blocks for node k' are collected on the node's port
  device for k' (local index k' mod g); blocks for the own node go straight to their
  final device in the same shifted rounds; (2) *exchange across nodes*: in node round
  s = 1..m-1 node k sends ONE coalesced message to node (k + s) mod m, port to port; (3)
  *scatter within a node*: the receiving port forwards each block to its final device.
  Cross-node messages drop from g*g to 1 per node pair at the price of two intra-node hops.

The choice is made by an alpha-beta estimate (``estimate``): a round costs the slowest of
(a) each intra-node message: alpha_intra + bytes / intra_bw, and (b) each node's NIC per
direction: (#messages) * alpha_inter + bytes / inter_bw (messages leaving a node share its
NIC and pay their latency one after another); rounds run one after another.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .topology import Topology

from meshcomm.caches import memo
__all__ = ["Block", "Message", "AllToAllPlan", "plan_alltoall", "estimate", "check_alltoall", "ALGORITHMS"]

ALGORITHMS = ("auto", "pairwise", "two_level")

Block = tuple[int, int, int]        # (origin device, final device, rows)


@dataclasses.dataclass(frozen=True)
class Message:
    """One coalesced message: `blocks` travel src -> dst, packed in this order."""

    src: int
    dst: int
    blocks: tuple[Block, ...]
    stage: int
    round: int

    @property
    def rows(self) -> int:
        return sum(b[2] for b in self.blocks)

    def __str__(self) -> str:
        bl = " ".join(f"{o}>{f}:{r}" for o, f, r in self.blocks)
        return f"s{self.stage} r{self.round:<3} {self.src:>4} -> {self.dst:<4} {self.rows:>7} rows  [{bl}]"


@dataclasses.dataclass(frozen=True, eq=False)
class AllToAllPlan:
    devices: tuple[int, ...]                 # along the axis, in axis order
    counts: tuple[tuple[int, ...], ...]      # counts[i][j]: rows devices[i] -> devices[j]
    row_bytes: int
    algorithm: str                           # "pairwise" | "two_level"
    messages: tuple[Message, ...]            # global order: by stage, then round
    topology: Topology
    estimate_s: float

    @property
    def n(self) -> int:
        return len(self.devices)

    @property
    def num_stages(self) -> int:
        return 1 + max((m.stage for m in self.messages), default=0)

    def stage(self, k: int) -> tuple[Message, ...]:
        return tuple(m for m in self.messages if m.stage == k)

    def recv_counts(self, device: int) -> tuple[int, ...]:
        j = self.devices.index(device)
        return tuple(self.counts[i][j] for i in range(self.n))

    @property
    def bytes_moved(self) -> int:
        return sum(m.rows for m in self.messages) * self.row_bytes

    def explain(self) -> str:
        lines = [f"all_to_all_v over devices {list(self.devices)} ({self.algorithm}, "
                 f"{len(self.messages)} messages, {self.bytes_moved} B moved, "
                 f"estimate {self.estimate_s * 1e6:.1f} us on {self.topology.name})"]
        lines += [f"  {m}" for m in self.messages]
        return "\n".join(lines)

    def __str__(self) -> str:
        return (f"AllToAllPlan({self.n} devices, {self.algorithm}, {len(self.messages)} messages, "
                f"{self.bytes_moved} B)")

    __repr__ = __str__


# -- algorithms ---------------------------------------------------------------------------

def _pairwise(devices, counts) -> list[Message]:
    n = len(devices)
    out = []
    for r in range(1, n):
        for i in range(n):
            j = (i + r) % n
            if counts[i][j]:
                out.append(Message(devices[i], devices[j], ((devices[i], devices[j], counts[i][j]),), 0, r))
    return out


def _nodes(devices, topo: Topology) -> list[list[int]]:
    """Devices grouped by node, nodes in order of first appearance along the axis."""
    groups: dict[int, list[int]] = {}
    for d in devices:
        groups.setdefault(topo.node_of(d), []).append(d)
    return list(groups.values())


def _two_level(devices, counts, topo: Topology) -> list[Message]:
    idx = {d: i for i, d in enumerate(devices)}
    nodes = _nodes(devices, topo)
    m = len(nodes)

    def port(k, other):            # device of node k that talks to node `other`
        return nodes[k][other % len(nodes[k])]

    def rows(o, f):
        return counts[idx[o]][idx[f]]

    msgs: list[Message] = []
    # stage 0: shifted rounds inside each node; local i -> local (i + r) % g carries the
    # blocks whose final device it is, and those it is the port for.
    for k, nd in enumerate(nodes):
        g = len(nd)
        for r in range(1, g):
            for li, o in enumerate(nd):
                t = nd[(li + r) % g]
                blocks = [(o, t, rows(o, t))] if rows(o, t) else []
                for k2 in range(m):
                    if k2 != k and port(k, k2) == t:
                        blocks += [(o, f, rows(o, f)) for f in nodes[k2] if rows(o, f)]
                if blocks:
                    msgs.append(Message(o, t, tuple(blocks), 0, r))
    # stage 1: node rounds; node k -> node (k + s) % m, port to port, one message.
    for s in range(1, m):
        for k in range(m):
            k2 = (k + s) % m
            blocks = tuple((o, f, rows(o, f)) for o in nodes[k] for f in nodes[k2] if rows(o, f))
            if blocks:
                msgs.append(Message(port(k, k2), port(k2, k), blocks, 1, s))
    # stage 2: scatter from the receiving ports inside each node, shifted rounds.
    for k, nd in enumerate(nodes):
        g = len(nd)
        for r in range(1, g):
            for li, p in enumerate(nd):
                t = nd[(li + r) % g]
                blocks = tuple((o, t, rows(o, t)) for k2 in range(m) if k2 != k and port(k, k2) == p
                               for o in nodes[k2] if rows(o, t))
                if blocks:
                    msgs.append(Message(p, t, blocks, 2, r))
    return msgs


# -- cost model ----------------------------------------------------------------------------

def estimate(messages: Sequence[Message], topo: Topology, row_bytes: int) -> float:
    """Alpha-beta seconds for a message list (see the module docstring)."""
    rounds: dict[tuple[int, int], list[Message]] = {}
    for msg in messages:
        rounds.setdefault((msg.stage, msg.round), []).append(msg)
    total = 0.0
    for msgs in rounds.values():
        worst = 0.0
        nic: dict[tuple[str, int], list[float]] = {}
        for msg in msgs:
            b = msg.rows * row_bytes
            nu, nv = topo.node_of(msg.src), topo.node_of(msg.dst)
            if nu == nv:
                worst = max(worst, topo.intra_node_latency_s + b / topo.intra_bytes_per_s)
            else:
                for key in (("out", nu), ("in", nv)):
                    c = nic.setdefault(key, [0, 0.0])
                    c[0] += 1
                    c[1] += b
        for cnt, b in nic.values():
            worst = max(worst, cnt * topo.inter_node_latency_s + b / topo.inter_bytes_per_s)
        total += worst
    return total


def check_alltoall(plan: AllToAllPlan) -> None:
    """Replay the plan: every message's blocks are on its src when it leaves (received in an
    earlier stage or never moved), no block moves twice in a stage, and every non-empty
    block ends on its final device. Raises ValueError naming the block otherwise."""
    where = {(o, f): o for i, o in enumerate(plan.devices) for j, f in enumerate(plan.devices)
             if plan.counts[i][j]}
    for k in range(plan.num_stages):
        moved = {}
        for msg in plan.stage(k):
            for o, f, r in msg.blocks:
                if (o, f) not in where:
                    raise ValueError(f"message {msg} carries block {o}->{f} that does not exist")
                if (o, f) in moved or where[(o, f)] != msg.src:
                    raise ValueError(f"message {msg} sends block {o}->{f} from device {msg.src} "
                                     f"but it is on device {where[(o, f)]}")
                i, j = plan.devices.index(o), plan.devices.index(f)
                if r != plan.counts[i][j]:
                    raise ValueError(f"block {o}->{f} has {r} rows in {msg}, counts say {plan.counts[i][j]}")
                moved[(o, f)] = msg.dst
        where.update(moved)
    for (o, f), d in where.items():
        if d != f:
            raise ValueError(f"block {o}->{f} ends on device {d}")


# -- entry point -----------------------------------------------------------------------------

def _check_counts(devices, counts) -> tuple[tuple[int, ...], ...]:
    n = len(devices)
    if len(counts) != n:
        raise ValueError(f"counts has {len(counts)} rows but there are {n} devices along the axis")
    out = []
    for i, row in enumerate(counts):
        row = tuple(int(c) for c in row)
        if len(row) != n:
            raise ValueError(f"send counts of device {devices[i]} have {len(row)} entries, "
                             f"expected {n} (one per device along the axis)")
        if any(c < 0 for c in row):
            raise ValueError(f"send counts of device {devices[i]} must be non-negative, got {list(row)}")
        out.append(row)
    return tuple(out)


def plan_alltoall(devices: Sequence[int], counts, row_bytes: int = 1,
                  topology: Topology | None = None, algorithm: str = "auto") -> AllToAllPlan:
    """Plan an all-to-all-v among `devices` (axis order) moving `counts[i][j]` rows i -> j."""
    devices = tuple(int(d) for d in devices)
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices along the axis must be distinct, got {list(devices)}")
    counts = _check_counts(devices, counts)
    topo = Topology.coerce(topology)
    return _plan(devices, counts, int(row_bytes), topo, algorithm)


@memo(maxsize=256)
def _plan(devices, counts, row_bytes, topo, algorithm) -> AllToAllPlan:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-to-all algorithm {algorithm!r}; choose from {ALGORITHMS}")
    cands = {}
    if algorithm in ("auto", "pairwise"):
        cands["pairwise"] = _pairwise(devices, counts)
    multi_node = len(_nodes(devices, topo)) > 1 and topo.devices_per_node > 1
    if algorithm == "two_level" or (algorithm == "auto" and multi_node):
        cands["two_level"] = _two_level(devices, counts, topo)
    costs = {k: estimate(v, topo, row_bytes) for k, v in cands.items()}
    best = min(costs, key=lambda k: (costs[k], k != "pairwise"))
    msgs = tuple(sorted(cands[best], key=lambda m: (m.stage, m.round)))
    return AllToAllPlan(devices, counts, row_bytes, best, msgs, topo, costs[best])
