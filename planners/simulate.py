"""Flow-level cost model: seconds for a plan on a topology.

Links. Every device has an intra-node link each way (NVLink-class, ``intra_node_gbps``) and
every node a NIC each way (``inter_node_gbps``); all full duplex. A hop between two devices
of one node loads the sender's ``dev_out`` and the receiver's ``dev_in``; a hop between
nodes loads the sending node's ``nic_out`` and the receiving node's ``nic_in`` (the same
accounting as ``Plan.link_loads``). Local copies cost nothing. With several NICs per node
(``Topology.nics_per_node``, rails) the hop loads the sender's and the receiver's own NICs
(``Topology.nic_of``), each of ``inter_node_gbps / nics_per_node``.

Flows. Every non-copy transfer is one flow along its route: a send is one hop; a broadcast
or reduction is a pipelined chain (NCCL's ring/chain), all its hops streaming at once, so
its rate is that of its slowest hop. Concurrent flows share link bandwidth max-min fairly
(progressive filling, recomputed whenever a flow starts or ends). A chain that crosses the
same link twice uses it twice.

Latency. A transfer costs each participant one message latency to post (the intra- or
inter-node latency of its slowest hop class); a device posts its transfers one after the
other, in the plan's global order. A chain of h hops adds (h - 1) further hop latencies
of pipeline fill before its bytes flow. So many small messages cost many latencies, and
one coalesced message one.

Compression (`compression=`, planners/compressed.py): a transfer's links carry its payload
(the codec's bytes per byte), and every device that encodes or decodes uses a resource
("cpu", device) of capacity one CPU second per second, so codec and links stream at once
as the chunk pipeline does; one chunk's pass through the other steps adds to the latency.

Order. A device runs its transfers in the plan's global order with non-blocking semantics
inside a stage: it posts all its stage-k transfers once it has finished every transfer it
takes part in of earlier stages; a transfer starts when all its participants have posted
it. The plan ends when the last transfer completes.

Buckets. A plan with a ``bucket_window`` (a batch plan: planners/batch.py) whose transfers
carry a ``bucket`` number keeps at most that many buckets in flight per device: a device
posts a transfer of bucket b only once it has finished every transfer of its own in
buckets up to b - bucket_window.
"""
from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np

from .topology import Topology

__all__ = ["simulate", "SimResult", "simulate_detailed", "max_min_rates", "transfer_resources"]


def transfer_resources(t, topology: Topology) -> dict[tuple[str, int], int]:
    """Links a transfer's route uses, with multiplicity: {("nic_out", node): uses, ...}."""
    node, nic = topology.node_of, topology.nic_of
    use: dict[tuple[str, int], int] = defaultdict(int)
    for u, v in t.hops:
        nu, nv = node(u), node(v)
        if nu != nv:
            use[("nic_out", nic(u))] += 1
            use[("nic_in", nic(v))] += 1
        else:
            use[("dev_out", u)] += 1
            use[("dev_in", v)] += 1
    return dict(use)


def _latencies(t, topology: Topology) -> tuple[float, float]:
    """(post latency, pipeline fill) of a transfer: one latency of its slowest hop class
    per participant, plus one hop latency per further hop of a chain."""
    node = topology.node_of
    lats = [topology.inter_node_latency_s if node(u) != node(v) else topology.intra_node_latency_s
            for u, v in t.hops]
    if not lats:
        return 0.0, 0.0
    post = max(lats)
    return post, sum(lats) - post


def max_min_rates(usage: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    usage[f, r]: how many times flow f crosses resource r (0 if not at all); capacity[r]:
    bytes/s. Every flow's rate rises at the same pace until a resource it uses saturates;
    then it is frozen and the rest go on. Returns rates[f].
    """
    usage = np.asarray(usage)
    f, r = np.nonzero(usage)
    return _max_min_sparse(usage.shape[0], f, r, usage[f, r].astype(float),
                           np.asarray(capacity, dtype=float))


def _max_min_sparse(nf: int, fi: np.ndarray, ri: np.ndarray, cnt: np.ndarray,
                    capacity: np.ndarray) -> np.ndarray:
    """Progressive filling on a sparse usage list: entry k says flow fi[k] crosses resource
    ri[k] cnt[k] times. Each round costs O(entries) and saturates at least one resource."""
    nr = len(capacity)
    rates = np.zeros(nf)
    if nf == 0:
        return rates
    free = np.ones(nf, dtype=bool)
    used = np.zeros(nr)
    uses_any = np.zeros(nf, dtype=bool)
    uses_any[fi] = True
    rates[~uses_any] = np.inf                    # flows on no link are not limited
    free &= uses_any
    while free.any():
        live = free[fi]
        demand = np.bincount(ri[live], weights=cnt[live], minlength=nr)
        act = demand > 0
        head = np.full(nr, np.inf)
        head[act] = (capacity[act] - used[act]) / demand[act]
        delta = max(0.0, float(head.min()))
        rates[free] += delta
        used += delta * demand
        sat = act & (head <= delta * (1 + 1e-12) + 1e-300)
        hit = live & sat[ri]
        if not hit.any():                        # numerical corner: freeze the tightest
            hit = live & (ri == int(np.argmin(head)))
        free[fi[hit]] = False
    return rates


class SimResult:
    """Timeline of one simulation: start/end of every transfer and the makespan."""

    def __init__(self, seconds: float, start: list[float], end: list[float]):
        self.seconds = seconds
        self.start = start
        self.end = end

    def __float__(self) -> float:
        return self.seconds

    def __repr__(self) -> str:
        return f"SimResult({self.seconds:.6g} s, {len(self.end)} transfers)"


def simulate(plan, topology: Topology, compression=None) -> float:
    """Seconds the plan takes on `topology` under the flow-level model (module docstring);
    `compression`: a planners.compressed.CodecCost (the plan run compressed)."""
    return simulate_detailed(plan, topology, compression).seconds


def simulate_detailed(plan, topology: Topology, compression=None) -> SimResult:
    transfers = list(plan.transfers)
    n = len(transfers)
    start = [0.0] * n
    end = [0.0] * n
    if n == 0:
        return SimResult(0.0, start, end)
    intra, inter = topology.intra_bytes_per_s, topology.nic_bytes_per_s

    # static facts per transfer
    res_index: dict[tuple[str, int], int] = {}
    uses: list[dict[int, int]] = []
    post_lat, fill_lat = [], []
    for i, t in enumerate(transfers):
        u, extra = {}, 0.0
        if compression is not None:     # links carry the payload; coding uses ("cpu", device)
            named, extra = compression.usage(plan, i, topology)
        else:
            named = transfer_resources(t, topology) if t.kind != "copy" else {}
        for key, c in named.items():
            u[res_index.setdefault(key, len(res_index))] = c
        uses.append(u)
        p, f = _latencies(t, topology) if t.kind != "copy" else (0.0, 0.0)
        post_lat.append(p)
        fill_lat.append(f + extra)
    cap = np.array([1.0 if k == "cpu" else inter if k.startswith("nic") else intra for k, _ in res_index],
                   dtype=float)

    # per device: its transfers in global order, and unfinished counts per stage
    queue: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(transfers):
        for d in t.participants:
            queue[d].append(i)
    unfinished: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for d, q in queue.items():
        for i in q:
            unfinished[d][transfers[i].stage] += 1
    ptr = {d: 0 for d in queue}
    post_clock = defaultdict(float)
    post_end: list[float] = [0.0] * n
    posted_by = [0] * n
    nparts = [len(t.participants) for t in transfers]

    pending: list[tuple[float, int]] = []     # (data start time, transfer) heap
    active: dict[int, float] = {}             # transfers whose bytes flow now
    done = 0
    now = 0.0

    def earlier_unfinished(d: int, stage: int) -> bool:
        return any(c > 0 for s, c in unfinished[d].items() if s < stage)

    window = getattr(plan, "bucket_window", None)
    buckets = _Buckets(transfers, queue, window) if window else None

    def post(d: int) -> None:
        q = queue[d]
        while ptr[d] < len(q):
            i = q[ptr[d]]
            if earlier_unfinished(d, transfers[i].stage):
                return
            if buckets is not None and buckets.blocked(d, i):
                return
            ptr[d] += 1
            t_end = max(post_clock[d], now) + post_lat[i]
            post_clock[d] = t_end
            post_end[i] = max(post_end[i], t_end)
            posted_by[i] += 1
            if posted_by[i] == nparts[i]:
                heapq.heappush(pending, (post_end[i] + fill_lat[i], i))

    for d in list(queue):
        post(d)

    # usage of every transfer as CSR rows (resource, crossings), for the active-flow arrays
    indptr = np.zeros(n + 1, dtype=np.int64)
    for i, u in enumerate(uses):
        indptr[i + 1] = indptr[i] + len(u)
    res_all = np.fromiter((r for u in uses for r in u), dtype=np.int64, count=int(indptr[-1]))
    cnt_all = np.fromiter((c for u in uses for c in u.values()), dtype=float, count=int(indptr[-1]))
    nbytes = np.array([float(t.nbytes) for t in transfers])
    left = np.zeros(n)
    rate = np.zeros(n)
    active_ids = np.zeros(0, dtype=np.int64)
    dirty = True
    while done < n:
        if dirty:
            active_ids = np.array(sorted(active), dtype=np.int64)
            rate[:] = 0.0
            if len(active_ids):
                lens = indptr[active_ids + 1] - indptr[active_ids]
                fi = np.repeat(np.arange(len(active_ids)), lens)
                starts = np.repeat(indptr[active_ids] - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
                pos = np.arange(int(lens.sum())) + starts
                rate[active_ids] = _max_min_sparse(len(active_ids), fi, res_all[pos], cnt_all[pos], cap)
            dirty = False
        # next event: a flow finishing or a transfer starting
        if len(active_ids):
            r = rate[active_ids]
            lf = left[active_ids]
            with np.errstate(divide="ignore", invalid="ignore"):
                eta = np.where(r > 0, lf / r, np.inf)
            t_fin = now + float(eta.min())
        else:
            t_fin = np.inf
        t_start = pending[0][0] if pending else np.inf
        t_next = min(t_fin, t_start)
        if t_next == np.inf:
            raise RuntimeError("simulation stalled: transfers can never start "
                               "(a plan whose order deadlocks?)")
        dt = t_next - now
        now = t_next
        finished = []
        if len(active_ids):
            left[active_ids] -= rate[active_ids] * dt
            lf = left[active_ids]
            r = rate[active_ids]
            with np.errstate(divide="ignore", invalid="ignore"):
                done_mask = (lf <= 1e-9 * np.maximum(1.0, nbytes[active_ids])) | \
                    ((r > 0) & (now + lf / r <= now * (1 + 1e-12)))
            finished = active_ids[done_mask].tolist()
        while pending and pending[0][0] <= now:
            _, i = heapq.heappop(pending)
            start[i] = now
            if uses[i] and transfers[i].nbytes > 0:
                active[i] = 1.0
                left[i] = nbytes[i]
                dirty = True
            else:
                finished.append(i)
        touched = set()
        for i in finished:
            active.pop(i, None)
            end[i] = now
            done += 1
            dirty = True
            for d in transfers[i].participants:
                unfinished[d][transfers[i].stage] -= 1
                touched.add(d)
            if buckets is not None:
                buckets.finished(i)
        for d in sorted(touched):
            post(d)
    return SimResult(max(end), start, end)


class _Buckets:
    """Per device, its unfinished transfers per bucket, for the bucket window (module
    docstring): a device's buckets rise along its queue (the plan is in bucket order)."""

    def __init__(self, transfers, queue: dict, window: int):
        self.window = window
        self.bucket = [getattr(t, "bucket", 0) for t in transfers]
        self.parts = [t.participants for t in transfers]
        self.count: dict[int, dict[int, int]] = {}
        self.order: dict[int, list[int]] = {}
        self.low: dict[int, int] = {}
        for d, q in queue.items():
            c: dict[int, int] = defaultdict(int)
            for i in q:
                c[self.bucket[i]] += 1
            self.count[d] = c
            self.order[d] = sorted(c)
            self.low[d] = 0

    def blocked(self, d: int, i: int) -> bool:
        order, c = self.order[d], self.count[d]
        k = self.low[d]
        while k < len(order) and c[order[k]] == 0:
            k += 1
        self.low[d] = k
        return k < len(order) and self.bucket[i] - order[k] >= self.window

    def finished(self, i: int) -> None:
        b = self.bucket[i]
        for d in self.parts[i]:
            self.count[d][b] -= 1
