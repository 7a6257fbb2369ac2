"""Batch plans: many tensors resharded by one schedule (`plan_batch`, what ``mc.plan_many`` runs).

The data an executor runs:

* ``BatchPlan.names[i]`` is tensor i; ``BatchPlan.plans[i]`` its own ``Plan`` (shape, dtype,
  src, dst, transfers, zero_fill): a complete, verifiable single-tensor plan whose
  transfers are exactly tensor i's share of the batch's messages, in the batch's order.
* ``BatchPlan.transfers`` are ``Message``s, the batch's one global order. A Message is a
  ``Transfer`` (kind, srcs, dsts, stage, src_buf: one route) with ``boxes == ()`` and
  ``parts``: ((tensor index, transfer index), ...), each naming the transfer
  ``plans[tensor].transfers[index]``, whose route is the message's. The message's bytes are
  the parts' bytes one after the other, part k starting at ``offsets[k]`` (a multiple of
  PART_ALIGN bytes; the gaps are padding), each part's bytes its transfer's boxes in order,
  each box's elements in row-major order in that tensor's dtype: what
  ``backends/pack.py`` makes of one transfer. ``nbytes`` is the end of the last part.
* ``bucket``: messages are in (stage, bucket) order; a process keeps at most
  ``bucket_window`` (2) of its buckets in flight: it posts a message of bucket b once its
  messages of buckets up to b - 2 are done. In every bucket each process stages at most
  ``bucket_bytes`` (``staged_bytes``): every participant of a send or broadcast one
  message buffer, a reduce's root one per contributor; copies stage nothing.
* Reduce messages merge only parts of one dtype and op (``plans[t].reduce_op``).

Planning (`plan_batch`): each tensor's pieces (src tile x dst tile intersections, as
planners/resharding.py cuts them) are worked out once per distinct (shape, src, dst): alike
tensors are planned once (``tensor_work``, cached; ``PLANNED`` counts the cache misses). A
tensor with a pending sum to reduce, or a partial dst made from a full value, is planned by
the single-tensor planner and its transfers join the batch as they are. Every other piece
is routed by planners/batch_routes.py with the whole batch's bytes on every NIC at once.
Routes are then cut into chunks and list-scheduled into buckets (`_assemble`: a bucket is
a time slot in which every link carries at most half a bucket), and everything on one
route in one bucket is one message.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import time
from collections import Counter, defaultdict

from meshcomm.caches import memo

from .boxes import box_size, row_major_range
from .resharding import pieces, plan_reshard
from .batch_routes import Router
from .schedule import PART_ALIGN, Plan, Transfer, fmt_bytes, staged_bytes
from .topology import Topology

__all__ = ["Message", "BatchPlan", "plan_batch", "tensor_work", "default_bucket_bytes",
           "PART_ALIGN", "BUCKET_WINDOW", "PLANNED", "staged_bytes"]

BUCKET_WINDOW = 2       # buckets a process has in flight at once
CHUNKS = 2              # chunks of a route per link and bucket (finer packing of buckets)
PLANNED: Counter = Counter()    # "pieces": distinct tensor classes worked out; "fallback": plans
_KIND_ORDER = {"copy": 0, "reduce": 1, "send": 2, "bcast": 3}


@dataclasses.dataclass(frozen=True)
class Message(Transfer):
    """One message of a batch: a route and the tensors' transfers it carries (module
    docstring). ``boxes`` is empty: each part's transfer has its boxes."""

    bucket: int = 0
    parts: tuple[tuple[int, int], ...] = ()
    offsets: tuple[int, ...] = ()

    def __str__(self) -> str:
        arrow = {"copy": "=>", "send": "->", "bcast": "=>>", "reduce": "+>"}[self.kind]
        return (f"{self.kind:6s} {','.join(map(str, self.srcs))} {arrow} {','.join(map(str, self.dsts))}"
                f"  {self.nbytes}B  bucket {self.bucket}, {len(self.parts)} part(s)")


@dataclasses.dataclass(frozen=True, eq=False)
class BatchPlan:
    """The schedule resharding a batch of named tensors (module docstring). Reads like a
    ``Plan``: transfers, explain, simulate, link_loads, summary; ``mc.verify`` checks it."""

    names: tuple
    plans: tuple[Plan, ...]
    transfers: tuple[Message, ...]
    topology: Topology
    bucket_bytes: int
    bucket_window: int = BUCKET_WINDOW
    classes: int = 0                    # distinct (shape, dtype, src, dst) in the batch
    planner: str = "meshcomm-batch"
    plan_seconds: float = 0.0

    # -- per tensor -------------------------------------------------------------------------
    @functools.cached_property
    def index(self) -> dict:
        return {n: i for i, n in enumerate(self.names)}

    def plan_of(self, name) -> Plan:
        return self.plans[self.index[name]]

    # -- figures, as Plan's ----------------------------------------------------------------
    bytes_moved = Plan.bytes_moved
    bytes_copied = Plan.bytes_copied
    messages = Plan.messages
    counts = Plan.counts
    link_loads = Plan.link_loads
    max_link_bytes = Plan.max_link_bytes
    simulate = Plan.simulate
    summary = Plan.summary

    @property
    def nbytes(self) -> int:
        """Bytes of all the tensors."""
        return sum(box_size(tuple((0, n) for n in p.shape)) * p.itemsize for p in self.plans)

    @property
    def devices(self) -> tuple[int, ...]:
        s = set()
        for p in set(self.plans):
            s.update(p.devices)
        return tuple(sorted(s))

    @property
    def buckets(self) -> int:
        return 1 + max((m.bucket for m in self.transfers), default=-1)

    def staged(self) -> dict[tuple[int, int], int]:
        """{(device, bucket): bytes the device stages in that bucket}."""
        out: dict = defaultdict(int)
        for m in self.transfers:
            for d, nb in staged_bytes(m).items():
                out[(d, m.bucket)] += nb
        return dict(out)

    @functools.cached_property
    def fingerprint(self) -> str:
        h = hashlib.sha1(repr((self.names, tuple(p.fingerprint for p in self.plans), self.bucket_bytes,
                               self.bucket_window, dataclasses.astuple(self.topology))).encode())
        return h.hexdigest()[:16]

    def verify(self, devices_per_process: int = 1) -> None:
        from .batch_verify import verify_batch
        verify_batch(self, devices_per_process)

    verify_batch = verify

    def explain(self, limit: int | None = 50, topology: Topology | None = None) -> str:
        topo = topology or self.topology
        lines = [f"batch of {len(self.names)} tensors ({self.classes} distinct), "
                 f"{fmt_bytes(self.nbytes)}; buckets of {fmt_bytes(self.bucket_bytes)} "
                 f"({self.buckets} buckets, {self.bucket_window} in flight per process)",
                 f"topology {topo}",
                 f"{'#':>5} {'stage':>5} {'bucket':>6} {'kind':6} {'from':>12} {'to':<24} {'bytes':>11}  tensors"]
        shown = self.transfers if limit is None else self.transfers[:limit]
        for i, m in enumerate(shown):
            frm = ",".join(map(str, m.srcs))
            to = ",".join(map(str, m.dsts))
            frm = frm if len(frm) <= 12 else frm[:9] + "..."
            to = to if len(to) <= 24 else to[:21] + "..."
            ts = [str(self.names[t]) for t, _ in m.parts[:3]]
            more = f" +{len(m.parts) - 3}" if len(m.parts) > 3 else ""
            buf = "" if m.src_buf == "src" else " (from dst)"
            lines.append(f"{i:>5} {m.stage:>5} {m.bucket:>6} {m.kind:6} {frm:>12} {to:<24} {m.nbytes:>11}  "
                         f"{', '.join(ts)}{more}{buf}")
        if limit is not None and len(self.transfers) > limit:
            lines.append(f"  ... {len(self.transfers) - limit} more")
        lines.append("total: " + self.summary())
        lines.append(f"busiest link: NIC {fmt_bytes(self.max_link_bytes(topo, 'nic'))}, "
                     f"device {fmt_bytes(self.max_link_bytes(topo, 'dev'))}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return f"BatchPlan({len(self.names)} tensors, {self.summary()})"

    __repr__ = __str__


# -- per tensor: its pieces, once per distinct tensor ------------------------------------------

@memo(maxsize=65536)
def tensor_work(shape: tuple, src, dst):
    """((box, holders, needers), ...) of one tensor, or None where it is planned on its own (a
    pending sum to reduce, or a partial dst made from a full value). Cached: alike tensors
    (same shape and layouts) are worked out once."""
    PLANNED["pieces"] += 1
    if src.num_addends > 1 or dst.num_addends > 1:
        if not (src.num_addends == dst.num_addends and src.partial_op == dst.partial_op):
            return None
    st, dt = src.tiles(shape), dst.tiles(shape)
    out = []
    for sc, dc, box in pieces(src, dst, shape):
        sg, dg = st.classes[sc], dt.classes[dc]
        for a in sg:                         # one addend (plain) or one per pending-sum group
            out.append((box, sg[a], dg[a]))
    return tuple(out)


@memo(maxsize=4096)
def _own_plan(shape, dtype, itemsize, src, dst, topology) -> Plan:
    PLANNED["fallback"] += 1
    return plan_reshard(shape, dtype, itemsize, src, dst, topology)


def default_bucket_bytes(topology: Topology) -> int:
    """The bucket the cost model suggests: a chunk (a quarter bucket: half of what a link
    carries per bucket) long enough that its message latency costs little, 256 inter-node
    latencies of one NIC's bandwidth, rounded up to a power of two, the bucket between 4 MiB
    and 1 GiB (512 MiB on dgx-h100, 128 MiB flat, 64 MiB p3.8xlarge). Larger buckets mean
    fewer messages but more memory (two buckets in flight per process) and a longer pipeline
    fill; `meshcomm bench refit --bucket-mb` shows the trade."""
    raw = 2 * CHUNKS * 256 * topology.inter_node_latency_s * topology.nic_bytes_per_s
    return 1 << max(22, min(30, int(raw - 1).bit_length()))


# -- the planner -------------------------------------------------------------------------------

def plan_batch(entries, topology: Topology, bucket_bytes: int | None = None) -> BatchPlan:
    """The BatchPlan of `entries`: (name, shape, dtype name, itemsize, src, dst) per tensor,
    already checked (meshcomm.planning.plan_many checks them)."""
    t0 = time.perf_counter()
    bucket = int(bucket_bytes) if bucket_bytes else default_bucket_bytes(topology)
    itemsizes = [e[3] for e in entries]
    router = Router(topology, itemsizes)
    zero_fill = [()] * len(entries)
    deliveries, own = [], []
    classes = set()
    for tid, (_, shape, dtype, itemsize, src, dst) in enumerate(entries):
        classes.add((shape, dtype, src, dst))
        work = tensor_work(shape, src, dst)
        if work is None:
            p = _own_plan(shape, dtype, itemsize, src, dst, topology)
            zero_fill[tid] = p.zero_fill
            own.append((tid, p))
        else:
            for box, holders, needers in work:
                deliveries.append((tid, box, holders, needers))
    for tid, p in own:              # routes fixed by the tensor's own plan: the flow's base load
        for t in p.transfers:
            extra = (p.dtype, p.reduce_op) if t.kind == "reduce" else None
            for box in t.boxes:
                router.emit(tid, t.srcs, t.dsts, box, kind=t.kind, stage=t.stage,
                            src_buf=t.src_buf, extra=extra)
    router.deliver(deliveries)
    messages, per_tensor = _assemble(router.routes, itemsizes, bucket)
    plans = tuple(Plan(shape=e[1], dtype=e[2], itemsize=e[3], src=e[4], dst=e[5], topology=topology,
                       transfers=tuple(per_tensor[i]), zero_fill=zero_fill[i], planner="meshcomm-batch")
                  for i, e in enumerate(entries))
    return BatchPlan(names=tuple(e[0] for e in entries), plans=plans, transfers=messages,
                     topology=topology, bucket_bytes=bucket, classes=len(classes),
                     plan_seconds=time.perf_counter() - t0)


def _assemble(routes: dict, itemsizes, bucket: int):
    """Routes -> buckets -> messages in global order, and each tensor's transfers.

    A bucket is a time slot: in each, every device receives at most half a bucket and sends
    at most half a bucket (a relay of a chain does both with one buffer; a reduce's root
    receives a buffer per contributor), so it stages at most `bucket` bytes and every link
    is busy about as long. Each route's pieces (tensor order) are cut into chunks of at most
    a quarter bucket (larger pieces split: two chunks fill a link's share, which packs the
    buckets better); routes over the same devices form one unit whose chunks go in turn. Buckets are filled by list scheduling, bucket after
    bucket: a unit's next chunk goes into the current bucket when each of its links has
    room there (first the units whose busiest device has most bytes still to move: the
    critical ones), else it waits for the bucket where its busiest link is free again. So a device's bucket numbers rise along
    its program, and a link never idles while a unit could use it. Stages are placed one
    after the other; copies stage nothing and go into their stage's first bucket."""
    by_stage: dict[int, list] = defaultdict(list)
    for key, lst in routes.items():
        by_stage[key[3]].append((key, lst))
    cur: dict[tuple, int] = {}       # (device, "in"|"out") -> its current bucket
    used: dict[tuple, int] = {}      # bytes over that link in its current bucket
    placed: dict[tuple, dict[int, list]] = {}     # (key, bucket) -> {tensor: [boxes]}
    top = -1
    cap = max(1, bucket // 2)

    def next_free(d, nb: int, t: int) -> int:
        c = cur.get(d)
        if c is None or c < t:
            return t
        return c + 1 if used[d] + nb > cap and used[d] > 0 else c
    for stage in sorted(by_stage):
        base = top + 1
        # routes over the same devices take turns: one scheduling unit
        units: dict = {}
        for key, lst in sorted(by_stage[stage], key=lambda kl: min(t for t, _ in kl[1])):
            kind, srcs, dsts = key[0], key[1], key[2]
            if kind == "copy":
                for tid, sub in lst:
                    placed.setdefault((key, base), {}).setdefault(tid, []).append(sub)
                top = max(top, base)
                continue
            need: dict = defaultdict(int)
            route = srcs if (kind == "reduce" and srcs[-1] == dsts[0]) else srcs + dsts
            for u_, v_ in zip(route[:-1], route[1:]):
                need[(u_, 1)] += 1
                need[(v_, 0)] += 1
            if kind == "reduce":        # the root gathers one buffer per contributor
                need[(dsts[0], 0)] = len(srcs)
            need = tuple(need.items())
            u = units.setdefault(tuple(sorted(set(route))), [len(route), [], 0, 0, None])
            for run, nb in _chunks(kind, srcs, lst, itemsizes, cap // CHUNKS):
                u[1].append((key, need, run, nb))
                u[3] += nb
        ulist = list(units.values())
        devs = list(units)
        remaining: dict = defaultdict(int)         # bytes each device has still to move
        for d_, u in zip(devs, ulist):
            for x in d_:
                remaining[x] += u[3]

        get = remaining.__getitem__

        def prio(r):
            return -max(map(get, devs[r]))
        calendar: dict[int, list] = defaultdict(list)
        calendar[base] = [(prio(r), -u[3], r) for r, u in enumerate(ulist)]
        t = base
        while calendar:
            heap = calendar.pop(t, [])
            heapq.heapify(heap)
            while heap:
                _, _, r = heapq.heappop(heap)
                u = ulist[r]
                width, chunks, i, left, blocker = u
                key, need, run, nb = chunks[i]
                if blocker is not None:
                    b = next_free(blocker[0], nb * blocker[1], t)
                    if b > t:
                        calendar[b].append((prio(r), -left, r))
                        continue
                b = t
                for x, f in need:             # next_free, inlined: the hot loop
                    c = cur.get(x)
                    if c is None or c < t:
                        continue
                    if used[x] + nb * f > cap and used[x] > 0:
                        c += 1
                    if c > b:
                        b, blocker = c, (x, f)
                if b > t:
                    u[4] = blocker
                    calendar[b].append((prio(r), -left, r))
                    continue
                for x, f in need:
                    if cur.get(x) == t:
                        used[x] += nb * f
                    else:
                        cur[x], used[x] = t, nb * f
                top = max(top, t)
                slot = placed.setdefault((key, t), {})
                for tid, sub in run:
                    slot.setdefault(tid, []).append(sub)
                u[2], u[3], u[4] = i + 1, left - nb, None
                for x in devs[r]:
                    remaining[x] -= nb
                if i + 1 < len(chunks):
                    heapq.heappush(heap, (prio(r), -u[3], r))
            t += 1
    order = sorted(placed, key=lambda kb: (kb[0][3], kb[1], _KIND_ORDER[kb[0][0]], kb[0][1], kb[0][2],
                                           kb[0][4], repr(kb[0][5])))
    per_tensor: list[list] = [[] for _ in itemsizes]
    messages = []
    for key, b in order:
        kind, srcs, dsts, stage, src_buf, _ = key
        parts, offsets, end = [], [], 0
        for tid, boxes in sorted(placed[(key, b)].items()):
            boxes = tuple(sorted(boxes))
            nb = sum(box_size(x) for x in boxes) * itemsizes[tid]
            per_tensor[tid].append(Transfer(kind, srcs, dsts, boxes, nb, stage, src_buf))
            start = -(-end // PART_ALIGN) * PART_ALIGN
            parts.append((tid, len(per_tensor[tid]) - 1))
            offsets.append(start)
            end = start + nb
        messages.append(Message(kind, srcs, dsts, (), end, stage, src_buf, b, tuple(parts), tuple(offsets)))
    return tuple(messages), per_tensor


def _chunks(kind, srcs, lst, itemsizes, bucket: int) -> list:
    """A route's (tensor, box) pieces, tensor order, as [([(tensor, box)], bytes)] runs of
    at most `bucket` bytes each, every piece counted with the padding after it (a reduce's
    root gathers one buffer per contributor)."""
    factor = len(srcs) if kind == "reduce" else 1
    out, run, run_nb = [], [], 0
    for tid, box in sorted(lst, key=lambda tb: tb[0]):
        size = itemsizes[tid]
        n = box_size(box)
        cap = max(1, (bucket // factor - PART_ALIGN) // size)
        subs = [box] if kind == "copy" or n <= cap else \
            [sub for lo in range(0, n, cap) for sub in row_major_range(box, lo, min(n, lo + cap))]
        for sub in subs:
            nb = -(-box_size(sub) * size // PART_ALIGN) * PART_ALIGN   # with its padding
            if run and (run_nb + nb) * factor > bucket and kind != "copy":
                out.append((run, run_nb))
                run, run_nb = [], 0
            run.append((tid, sub))
            run_nb += nb
    if run:
        out.append((run, run_nb))
    return out
