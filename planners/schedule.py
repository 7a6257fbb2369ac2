"""A plan is data: an ordered tuple of transfers plus what the executor needs to run them.

Every transfer moves the same set of global boxes (coalesced into one message) and has a
*route*: the chain of devices the bytes travel along, as a pipelined ring broadcast or
reduction does (NCCL's chain; MPI's large-message algorithms move the same bytes per link).

* ``copy``:   srcs=(d,), dsts=(d,)   same device, src tile -> dst tile, no communication
* ``send``:   srcs=(a,), dsts=(b,)   one message a -> b
* ``bcast``:  srcs=(r,), dsts=(d1, d2, ...)   route r -> d1 -> d2 ..., every dst gets the boxes
* ``reduce``: srcs=(a1, ..., ak), dsts=(r,)   route a1 -> a2 ... -> r, r gets the sum of the
  contributors' tiles (r contributes its own src tile when it is one of the srcs); "sum" is
  ``Plan.reduce_op``, the src layout's partial op (prod, min or max), applied in srcs order

``src_buf`` says which tile senders read: ``"src"`` (the input shard) or ``"dst"`` (a dst
tile filled by an earlier stage: fan-out after a reduction). Transfers of stage k+1 may
read what stage k wrote; within a stage no transfer reads what another writes.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections import Counter, defaultdict

from .boxes import Box, box_size, box_str
from .topology import Topology

__all__ = ["Transfer", "Plan", "KINDS", "transfer_kind", "coalesce", "fmt_bytes"]

KINDS = ("copy", "send", "bcast", "reduce")


@dataclasses.dataclass(frozen=True)
class Transfer:
    kind: str
    srcs: tuple[int, ...]
    dsts: tuple[int, ...]
    boxes: tuple[Box, ...]
    nbytes: int
    stage: int = 0
    src_buf: str = "src"

    @property
    def route(self) -> tuple[int, ...]:
        if self.kind == "reduce":
            return self.srcs if self.srcs[-1] == self.dsts[0] else self.srcs + self.dsts
        if self.kind == "copy":
            return self.srcs
        return self.srcs + self.dsts

    @property
    def hops(self) -> tuple[tuple[int, int], ...]:
        r = self.route
        return tuple(zip(r[:-1], r[1:]))

    @property
    def participants(self) -> tuple[int, ...]:
        seen = dict.fromkeys(self.srcs)
        seen.update(dict.fromkeys(self.dsts))
        return tuple(seen)

    @property
    def root(self) -> int:
        """The device that sends (send/bcast/copy) or receives the result (reduce)."""
        return self.dsts[0] if self.kind == "reduce" else self.srcs[0]

    def __str__(self) -> str:
        arrow = {"copy": "=>", "send": "->", "bcast": "=>>", "reduce": "+>"}[self.kind]
        s = ",".join(map(str, self.srcs))
        d = ",".join(map(str, self.dsts))
        bx = " ".join(box_str(b) for b in self.boxes[:3]) + (" ..." if len(self.boxes) > 3 else "")
        return f"{self.kind:6s} {s} {arrow} {d}  {self.nbytes}B  {bx}"


PART_ALIGN = 16         # bytes: every part of a batch message starts at a multiple of this


def staged_bytes(m: Transfer) -> dict[int, int]:
    """Bytes each device stages for message `m` (planners/batch.py's docstring)."""
    if m.kind == "copy":
        return {}
    out = dict.fromkeys(m.participants, m.nbytes)
    if m.kind == "reduce":
        out[m.dsts[0]] = m.nbytes * len(m.srcs)
    return out


def transfer_kind(srcs: tuple[int, ...], dsts: tuple[int, ...], reduce: bool = False) -> str:
    """The kind a transfer from `srcs` to `dsts` has (see the module docstring)."""
    if reduce:
        return "reduce"
    if len(dsts) == 1:
        return "copy" if srcs == dsts else "send"
    return "bcast"


def coalesce(items: dict, itemsize: int) -> list[Transfer]:
    """{(kind, srcs, dsts, stage, src_buf): [boxes]} -> one Transfer (one message) per key."""
    out = []
    for (kind, srcs, dsts, stage, src_buf), boxes in items.items():
        boxes = tuple(sorted(boxes))
        out.append(Transfer(kind, srcs, dsts, boxes, sum(box_size(b) for b in boxes) * itemsize,
                            stage, src_buf))
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The schedule for resharding one global tensor from `src` to `dst` layouts."""

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    src: object            # meshcomm.Layout
    dst: object            # meshcomm.Layout
    topology: Topology
    transfers: tuple[Transfer, ...]
    zero_fill: tuple[int, ...] = ()     # dst devices whose tile starts as the identity of
                                        # fill_op: zeros for a pending sum (partial dst)
    planner: str = "meshcomm"
    plan_seconds: float = 0.0

    # -- summary figures -------------------------------------------------------------
    @functools.cached_property
    def bytes_moved(self) -> int:
        """Bytes crossing a device boundary (every hop of every route)."""
        return sum(t.nbytes * len(t.hops) for t in self.transfers if t.kind != "copy")

    @functools.cached_property
    def bytes_copied(self) -> int:
        return sum(t.nbytes for t in self.transfers if t.kind == "copy")

    @property
    def messages(self) -> int:
        return sum(1 for t in self.transfers if t.kind != "copy")

    @functools.cached_property
    def counts(self) -> dict[str, int]:
        c = Counter(t.kind for t in self.transfers)
        return {k: c.get(k, 0) for k in KINDS}

    @property
    def devices(self) -> tuple[int, ...]:
        s = set(self.src.mesh.device_ids) | set(self.dst.mesh.device_ids)
        return tuple(sorted(s))

    @property
    def reduce_op(self) -> str:
        """How reduce transfers combine their contributors: the src layout's partial op."""
        return getattr(self.src, "partial_op", "sum")

    @property
    def fill_op(self) -> str:
        """The op whose identity `zero_fill` tiles start as: the dst layout's partial op."""
        return getattr(self.dst, "partial_op", "sum")

    @functools.cached_property
    def fingerprint(self) -> str:
        """A short hash of everything that defines the plan; processes compare it."""
        h = hashlib.sha1(repr((self.shape, self.dtype, self.src, self.dst, self.planner,
                               dataclasses.astuple(self.topology), self.reduce_op,
                               self.fill_op)).encode())
        return h.hexdigest()[:16]

    # -- link loads (bytes) ----------------------------------------------------------
    def link_loads(self, topology: Topology | None = None) -> dict[tuple[str, int], int]:
        """Bytes per directed link: ("nic_out"|"nic_in", node) and ("dev_out"|"dev_in", device).

        Each hop of a route between two nodes loads both NICs; a hop inside a node loads the
        two devices' intra-node links. With several NICs per node the keys are NIC ids
        (``Topology.nic_of``: the node id when a node has one NIC).
        """
        topo = topology or self.topology
        loads: dict[tuple[str, int], int] = defaultdict(int)
        for t in self.transfers:
            if t.kind == "copy":
                continue
            for u, v in t.hops:
                nu, nv = topo.node_of(u), topo.node_of(v)
                if nu != nv:
                    loads[("nic_out", topo.nic_of(u))] += t.nbytes
                    loads[("nic_in", topo.nic_of(v))] += t.nbytes
                else:
                    loads[("dev_out", u)] += t.nbytes
                    loads[("dev_in", v)] += t.nbytes
        return dict(loads)

    def max_link_bytes(self, topology: Topology | None = None, level: str = "nic") -> int:
        loads = self.link_loads(topology)
        vals = [v for (k, _), v in loads.items() if k.startswith(level)]
        return max(vals, default=0)

    # -- cost model ------------------------------------------------------------------
    def simulate(self, topology: Topology | str | None = None, compression=None) -> float:
        """Seconds to run the plan under the cost model (see planners.simulate); compressed
        with `compression` (a planners.compressed.CodecCost) when given."""
        from .simulate import simulate
        return simulate(self, Topology.coerce(topology) if topology is not None else self.topology,
                        compression)

    # -- printing --------------------------------------------------------------------
    def summary(self) -> str:
        c = self.counts
        return (f"{len(self.transfers)} transfers ({c['send']} send, {c['bcast']} bcast, "
                f"{c['reduce']} reduce, {c['copy']} copy), {self.messages} messages, "
                f"{fmt_bytes(self.bytes_moved)} moved, {fmt_bytes(self.bytes_copied)} copied locally")

    def explain(self, limit: int | None = 50, topology: Topology | None = None) -> str:
        topo = topology or self.topology
        lines = [f"plan {self.shape} {self.dtype}: {self.src}  ->  {self.dst}",
                 f"topology {topo}",
                 f"{'#':>4} {'stage':>5} {'kind':6} {'from':>12} {'to':<24} {'bytes':>10}  boxes"]
        shown = self.transfers if limit is None else self.transfers[:limit]
        for i, t in enumerate(shown):
            frm = ",".join(map(str, t.srcs))
            to = ",".join(map(str, t.dsts))
            if len(to) > 24:
                to = to[:21] + "..."
            if len(frm) > 12:
                frm = frm[:9] + "..."
            bx = " ".join(box_str(b) for b in t.boxes[:2]) + (f" +{len(t.boxes) - 2}" if len(t.boxes) > 2 else "")
            buf = "" if t.src_buf == "src" else " (from dst)"
            lines.append(f"{i:>4} {t.stage:>5} {t.kind:6} {frm:>12} {to:<24} {t.nbytes:>10}  {bx}{buf}")
        if limit is not None and len(self.transfers) > limit:
            lines.append(f"  ... {len(self.transfers) - limit} more")
        if self.reduce_op != "sum" and self.counts["reduce"]:
            lines.append(f"reduce transfers take the {self.reduce_op} of their contributors")
        if self.zero_fill:
            fill = "zero-filled" if self.fill_op == "sum" else f"{self.fill_op}-identity-filled"
            lines.append(f"{fill} dst tiles (partial dst): {list(self.zero_fill)}")
        lines.append("total: " + self.summary())
        lines.append(f"busiest link: NIC {fmt_bytes(self.max_link_bytes(topo, 'nic'))}, "
                     f"device {fmt_bytes(self.max_link_bytes(topo, 'dev'))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"Plan({self.shape} {self.dtype}, {self.summary()})"

    __repr__ = __str__


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
