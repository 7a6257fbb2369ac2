"""Baseline planners in meshcomm's own framework, so every comparison is like for like.

Each baseline is a function ``(shape, dtype, src, dst, topology=None)`` returning a
``Plan`` of the same ``Transfer`` kinds (or ``None`` where it does not apply), so the
verifier, ``Plan.link_loads`` and the simulator treat it exactly as a meshcomm plan. All
of them coalesce pieces that share a route into one message, as meshcomm does.

* ``send_recv``: every dst device fetches each piece from the first replica that holds it
  (no balancing); a pending sum is reduced separately for every dst device.
* ``alpa_broadcast``: Alpa's default broadcast strategy: per (dst tile, src tile slice) one
  broadcast from a src replica to every dst replica of the tile, the sender chosen greedily
  as the least-loaded device so far (loads in bytes, per device, in tile order).
* ``allgather_slice``: every dst device receives the whole tensor (one pipelined chain per
  src tile through all dst devices, the traffic of a ring allgather), then keeps its slice
  locally. The plan's dst layout is therefore the replicated layout on the dst mesh.
* ``dtensor_style``: within one mesh only, the per-mesh-dimension collective sequence that
  torch DTensor's ``redistribute`` runs (its greedy transform: clear misaligned nested
  shardings inner to outer, then outer to inner: all-gather, all-reduce, reduce-scatter,
  all-to-all or a local chunk per mesh dimension), each collective in its ring form. The
  result is a ``Steps``: one verified Plan per collective, run one after the other. Layouts
  DTensor cannot express (Blocks, uneven nested splits, non-default nesting order, two
  meshes) give ``None``.

Partial (pending-sum) src layouts are beyond Alpa; its baselines here reduce each piece on
one needer first (a reduce chain) and then broadcast, so that every case has a figure.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from typing import Callable

from .boxes import Box, box_size, intersect, pieces, row_major_range
from .schedule import Plan, Transfer, coalesce, transfer_kind
from .topology import Topology

__all__ = ["send_recv", "alpa_broadcast", "allgather_slice", "dtensor_style", "Steps",
           "BASELINES", "dtensor_transforms", "COLLECTIVE_ALGORITHMS", "AlgoCost", "collective_cost",
           "ring_collective"]


# -- shared machinery -----------------------------------------------------------------------

class _Emitter:
    """Collects (kind, srcs, dsts, stage, src_buf) -> boxes, in first-use order."""

    def __init__(self):
        self.items: dict[tuple, list[Box]] = {}

    def emit(self, srcs, dsts, box: Box, *, reduce: bool = False, stage: int = 0,
             src_buf: str = "src") -> None:
        srcs, dsts = tuple(srcs), tuple(dsts)
        if box_size(box) == 0 or not dsts:
            return
        kind = transfer_kind(srcs, dsts, reduce)
        self.items.setdefault((kind, srcs, dsts, stage, src_buf), []).append(box)

    def transfers(self, itemsize: int) -> tuple[Transfer, ...]:
        return tuple(sorted(coalesce(self.items, itemsize), key=lambda t: t.stage))      # stable: emission order in a stage


def _itemsize(dtype) -> tuple[str, int]:
    from meshcomm.arrays import normalize_dtype
    return normalize_dtype(dtype)


def _check(shape, src, dst):
    from meshcomm.layout import Layout, normalize_shape
    for name, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise TypeError(f"{name} must be a meshcomm.Layout, got {type(lay).__name__}")
    shape = normalize_shape(shape)
    src.check_shape(shape)
    dst.check_shape(shape)
    return shape


def _make_plan(name, shape, dtype, itemsize, src, dst, topo, em: _Emitter, zero_fill=()) -> Plan:
    return Plan(shape=shape, dtype=dtype, itemsize=itemsize, src=src, dst=dst, topology=topo,
                transfers=em.transfers(itemsize), zero_fill=tuple(sorted(zero_fill)), planner=name)


def _work(shape, src, dst):
    """Per piece what must happen: ('deliver', box, holders, needers) or
    ('reduce', box, {addend: holders}, needers); plus the zero-filled dst devices."""
    st, dt = src.tiles(shape), dst.tiles(shape)
    passthrough = src.num_addends == dst.num_addends > 1
    zero_fill = set()
    if dst.num_addends > 1 and not passthrough:
        zero_fill = {d for d, a in dt.addend_of.items() if a != 0 and box_size(dt.boxes[d]) > 0}
    work = []
    for sc, dc, box in pieces(src, dst, shape):
        sg, dg = st.classes[sc], dt.classes[dc]
        if src.num_addends == 1:
            work.append(("deliver", box, sg[0], dg[0]))
        elif passthrough:
            for a in sg:
                work.append(("deliver", box, sg[a], dg[a]))
        else:
            work.append(("reduce", box, sg, dg[0]))
    return work, zero_fill


def _ring_from(root: int, devices, topo: Topology) -> tuple[int, ...]:
    """Receivers of a chain from `root`: grouped by node, the root's node first, then the
    other nodes in ascending order (a ring that enters every node once)."""
    node = topo.node_of
    rn = node(root)
    return tuple(sorted((d for d in devices if d != root), key=lambda d: (node(d) != rn, node(d), d)))


def _reduce_chain(addends: dict, root: int, pick) -> tuple[int, ...]:
    """Contributors of a reduction into `root`: one holder per addend (`pick`), root last
    when it holds an addend itself."""
    contrib = []
    own = None
    for a, devs in addends.items():
        if root in devs:
            own = root
        else:
            contrib.append(pick(devs))
    return tuple(contrib) + ((own,) if own is not None else ())


# -- send_recv ----------------------------------------------------------------------------

def send_recv(shape, dtype, src, dst, topology=None) -> Plan:
    """Every dst device fetches every piece from the first replica holding it."""
    shape = _check(shape, src, dst)
    name, itemsize = _itemsize(dtype)
    topo = Topology.coerce(topology)
    work, zero_fill = _work(shape, src, dst)
    em = _Emitter()
    for w in work:
        if w[0] == "deliver":
            _, box, holders, needers = w
            for d in needers:
                em.emit((d,) if d in holders else (holders[0],), (d,), box)
        else:
            _, box, addends, needers = w
            for d in needers:
                em.emit(_reduce_chain(addends, d, lambda devs: devs[0]), (d,), box, reduce=True)
    return _make_plan("send_recv", shape, name, itemsize, src, dst, topo, em, zero_fill)


# -- alpa_broadcast -----------------------------------------------------------------------

def alpa_broadcast(shape, dtype, src, dst, topology=None) -> Plan:
    """Per piece one broadcast to all its dst replicas from the least-loaded src replica."""
    shape = _check(shape, src, dst)
    name, itemsize = _itemsize(dtype)
    topo = Topology.coerce(topology)
    work, zero_fill = _work(shape, src, dst)
    load: dict[int, int] = defaultdict(int)
    em = _Emitter()

    def least(devs):
        return min(devs, key=lambda d: load[d])       # first of the least loaded, as Alpa

    # Alpa walks dst tiles, then the src tile slices of each
    dt = dst.tiles(shape)
    order = sorted(range(len(work)), key=lambda i: _dst_rank(work[i], dt))
    for i in order:
        w = work[i]
        nb = box_size(w[1]) * itemsize
        if w[0] == "deliver":
            _, box, holders, needers = w
            lacking = [d for d in needers if d not in holders]
            for d in needers:
                if d in holders:
                    em.emit((d,), (d,), box)
            if lacking:
                s = least(holders)
                load[s] += nb
                em.emit((s,), _ring_from(s, lacking, topo), box)
        else:
            _, box, addends, needers = w
            root = needers[0]
            chain = _reduce_chain(addends, root, least)
            for c in chain:
                load[c] += nb
            em.emit(chain, (root,), box, reduce=True)
            if len(needers) > 1:
                em.emit((root,), _ring_from(root, needers, topo), box, stage=1, src_buf="dst")
    return _make_plan("alpa_broadcast", shape, name, itemsize, src, dst, topo, em, zero_fill)


def _dst_rank(w, dt):
    needers = w[3]
    return (dt.shard_of[needers[0]], w[1])


# -- allgather_slice ----------------------------------------------------------------------

def allgather_slice(shape, dtype, src, dst, topology=None) -> Plan:
    """Every dst device gets the whole tensor (chains like a ring allgather), then slices.

    The plan's dst is the replicated layout on dst's mesh: what is moved is the whole
    tensor to every dst device; slicing is local."""
    from meshcomm.layout import Layout
    shape = _check(shape, src, dst)
    full = Layout(dst.mesh, ())
    name, itemsize = _itemsize(dtype)
    topo = Topology.coerce(topology)
    work, _ = _work(shape, src, full)
    everyone = tuple(dst.mesh.device_ids)
    em = _Emitter()
    for w in work:
        if w[0] == "deliver":
            _, box, holders, needers = w
            r = holders[0]
            for d in needers:
                if d in holders:
                    em.emit((d,), (d,), box)
            lacking = [d for d in needers if d not in holders]
            if lacking:
                em.emit((r,), _ring_from(r, lacking, topo), box)
        else:
            _, box, addends, needers = w
            root = min(needers)
            em.emit(_reduce_chain(addends, root, lambda devs: devs[0]), (root,), box, reduce=True)
            rest = [d for d in everyone if d != root]
            if rest:
                em.emit((root,), _ring_from(root, rest, topo), box, stage=1, src_buf="dst")
    return _make_plan("allgather_slice", shape, name, itemsize, src, full, topo, em)


# -- dtensor_style ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Steps:
    """Plans run one after the other (each a collective with its own completion), as
    DTensor's redistribute issues them. Summaries add up over the steps."""

    steps: tuple[Plan, ...]
    planner: str = "dtensor_style"

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(t for p in self.steps for t in p.transfers)

    @property
    def messages(self) -> int:
        return sum(p.messages for p in self.steps)

    @property
    def bytes_moved(self) -> int:
        return sum(p.bytes_moved for p in self.steps)

    def link_loads(self, topology=None) -> dict:
        out: dict = defaultdict(int)
        for p in self.steps:
            for k, v in p.link_loads(topology).items():
                out[k] += v
        return dict(out)

    def max_link_bytes(self, topology=None, level: str = "nic") -> int:
        vals = [v for (k, _), v in self.link_loads(topology).items() if k.startswith(level)]
        return max(vals, default=0)

    def simulate(self, topology=None) -> float:
        return sum(p.simulate(topology) for p in self.steps)

    def verify(self, devices_per_process: int = 1) -> None:
        from .verify import verify
        for p in self.steps:
            verify(p, devices_per_process)

    def summary(self) -> str:
        return f"{len(self.steps)} collective step(s), {self.messages} messages"

    def __str__(self) -> str:
        return f"Steps({self.summary()})"


# DTensor placements per mesh dimension: ("R",), ("S", tensor_dim), ("P",)

def _placements(layout) -> list[tuple] | None:
    """DTensor placements of a layout, or None where DTensor cannot express it."""
    from meshcomm.layout import Blocks
    mesh = layout.mesh
    pl: list[tuple] = [("R",)] * mesh.ndim
    for dim, e in enumerate(layout.spec):
        if e is None:
            continue
        if isinstance(e, Blocks):
            return None
        idx = [mesh.axis_index(a) for a in e]
        if idx != sorted(idx):                       # nesting order other than mesh order
            return None
        for i in idx:
            pl[i] = ("S", dim)
    for a in layout.partial:
        pl[mesh.axis_index(a)] = ("P",)
    return pl


def _layout_of(mesh, pl, ndim: int, shape):
    """The meshcomm Layout of DTensor placements, or None if DTensor's nested chunking of an
    uneven dimension would differ from meshcomm's flat chunking."""
    from meshcomm.layout import Layout
    spec: list = [None] * ndim
    for i, p in enumerate(pl):
        if p[0] == "S":
            spec[p[1]] = (spec[p[1]] or ()) + (mesh.axis_names[i],)
    for dim, axes in enumerate(spec):
        if axes and len(axes) > 1:
            k = math.prod(mesh.axis_size(a) for a in axes)
            if shape[dim] % k:
                return None
    partial = tuple(mesh.axis_names[i] for i, p in enumerate(pl) if p[0] == "P")
    return Layout(mesh, tuple(spec), partial=partial)


def dtensor_transforms(src_pl: list[tuple], dst_pl: list[tuple]) -> list[tuple[int, tuple, tuple]]:
    """DTensor's greedy transform sequence: [(mesh_dim, current, target), ...]."""
    cur = list(src_pl)
    out = []
    n = len(cur)
    if n == 1:
        return [(0, cur[0], dst_pl[0])] if cur[0] != dst_pl[0] else []
    if any(p[0] == "S" for p in cur):
        for i in reversed(range(n)):
            c, t = cur[i], dst_pl[i]
            if t[0] == "S":
                cs = [j for j in range(i) if cur[j] == ("S", t[1])]
                ts = [j for j in range(i) if dst_pl[j] == ("S", t[1])]
                if cs != ts:
                    t = ("R",)
            if c != t:
                out.append((i, c, t))
                cur[i] = t
    for i in range(n):
        if cur[i] != dst_pl[i]:
            out.append((i, cur[i], dst_pl[i]))
            cur[i] = dst_pl[i]
    return out


def dtensor_style(shape, dtype, src, dst, topology=None):
    """DTensor's redistribute as a sequence of collectives (a ``Steps``), or None when the
    meshes differ or a layout is not expressible as DTensor placements."""
    shape = _check(shape, src, dst)
    if src.mesh != dst.mesh:
        return None
    spl, dpl = _placements(src), _placements(dst)
    if spl is None or dpl is None:
        return None
    name, itemsize = _itemsize(dtype)
    topo = Topology.coerce(topology)
    mesh = src.mesh
    ndim = len(shape)
    if _layout_of(mesh, spl, ndim, shape) is None or _layout_of(mesh, dpl, ndim, shape) is None:
        return None
    steps = []
    cur_pl = list(spl)
    cur = src
    for i, c, t in dtensor_transforms(spl, dpl):
        nxt_pl = list(cur_pl)
        nxt_pl[i] = t
        nxt = dst if nxt_pl == dpl else _layout_of(mesh, nxt_pl, ndim, shape)
        if nxt is None:
            return None
        if c == ("R",) and t == ("P",):
            pass
        elif c[0] == "S" and t == ("P",):
            return None                               # DTensor refuses this too
        steps.append(_collective(shape, name, itemsize, cur, nxt, i, c, t, topo))
        cur_pl, cur = nxt_pl, nxt
    if not steps:                                      # nothing to do: local copies
        em = _Emitter()
        ts = src.tiles(shape)
        for d, box in ts.boxes.items():
            em.emit((d,), (d,), box)
        steps.append(_make_plan("dtensor_style", shape, name, itemsize, src, dst, topo, em))
    return Steps(tuple(steps))


def _groups(mesh, i: int) -> list[tuple[int, ...]]:
    """Device groups along mesh dimension i (other coordinates fixed), in order."""
    import numpy as np
    arr = np.moveaxis(np.asarray(mesh.devices), i, -1)
    return [tuple(int(x) for x in row) for row in arr.reshape(-1, arr.shape[-1])]


def _collective(shape, dtype, itemsize, cur, nxt, i, c, t, topo) -> Plan:
    """One DTensor step along mesh dimension i from layout cur to nxt, in ring form."""
    ct, nt = cur.tiles(shape), nxt.tiles(shape)
    em = _Emitter()
    zero_fill = set()
    for g in _groups(cur.mesh, i):
        k = len(g)
        ring = lambda j: tuple(g[(j + s) % k] for s in range(1, k))   # noqa: E731
        if c[0] == "S" and t == ("R",):                  # all-gather: k chains round the ring
            for j, d in enumerate(g):
                em.emit((d,), (d,), ct.boxes[d])
                em.emit((d,), ring(j), ct.boxes[d])
        elif c == ("P",) and t == ("R",):                # all-reduce: reduce-scatter + all-gather
            box = ct.boxes[g[0]]
            n = box_size(box)
            for j, d in enumerate(g):
                for sub in row_major_range(box, n * j // k, n * (j + 1) // k):
                    em.emit(ring(j) + (d,), (d,), sub, reduce=True)
                    em.emit((d,), ring(j), sub, stage=1, src_buf="dst")
        elif c == ("P",) and t[0] == "S":                # reduce-scatter
            for j, d in enumerate(g):
                em.emit(ring(j) + (d,), (d,), nt.boxes[d], reduce=True)
        elif c == ("R",) and t[0] == "S":                # local chunk
            for d in g:
                em.emit((d,), (d,), nt.boxes[d])
        elif c[0] == "S" and t[0] == "S":                # all-to-all
            for a, b in itertools.product(g, g):
                x = intersect(ct.boxes[a], nt.boxes[b])
                if x is not None:
                    em.emit((a,), (b,), x)
        elif c == ("R",) and t == ("P",):                # keep the value on the first, zeros elsewhere
            em.emit((g[0],), (g[0],), nt.boxes[g[0]])
            zero_fill.update(g[1:])
        else:
            raise ValueError(f"no DTensor transform from {c} to {t} on mesh dimension {i}")
    zero_fill = {d for d in zero_fill if box_size(nt.boxes[d]) > 0}
    return _make_plan("dtensor_style", shape, dtype, itemsize, cur, nxt, topo, em, zero_fill)


BASELINES: dict[str, Callable] = {
    "send_recv": send_recv,
    "alpa_broadcast": alpa_broadcast,
    "allgather_slice": allgather_slice,
    "dtensor_style": dtensor_style,
}


# -- collective algorithms: ring and tree, as plans and under the alpha-beta model ----------
#
# A collective on groups of devices (meshcomm.collectives.layouts: every group runs it at
# once, each group's members in group order) by a textbook algorithm: a sequence of steps,
# each member sending at most one message and receiving at most one per step.
#
# * ring: all_gather and reduce_scatter in n-1 steps of one chunk (1/n of the data) to the
#   next member; all_reduce = reduce_scatter then all_gather, 2(n-1) steps.
# * tree (the log-depth forms MPI picks for short messages): all_reduce = a binomial-tree
#   reduce to member 0 then a binomial-tree broadcast, 2*ceil(log2 n) steps of the whole
#   data; all_gather = Bruck's doubling (recursive doubling for powers of two): step s sends
#   min(2^s, n-2^s) chunks to member i-2^s; reduce_scatter = the same steps reversed
#   (recursive halving): step s sends that many chunks of partial sums to member i+2^s.
#
# Alpha-beta time: a step costs the latency of its slowest link class (inter-node if any of
# its messages crosses nodes) plus its busiest link's bytes over that link's bandwidth
# (links as in planners/simulate.py: a device's intra-node link each way, a node's NIC each
# way, shared by every message of the step that crosses it); the steps run one after the
# other. Chunks are the row-major split of the data into n nearly equal parts.

COLLECTIVE_ALGORITHMS = ("ring", "tree")


@dataclasses.dataclass(frozen=True)
class AlgoCost:
    """One collective by one algorithm: steps, bytes all members send together, seconds."""

    op: str
    algorithm: str
    steps: int
    bytes_moved: int
    seconds: float


def _chunks(nelems: int, n: int) -> list[int]:
    return [nelems * (j + 1) // n - nelems * j // n for j in range(n)]


def _ring_steps(op: str, n: int, chunk: list[int]) -> list[list[tuple[int, int, int]]]:
    """Steps of (member, member, elements) messages of one group."""
    gather = [[(i, (i + 1) % n, chunk[(i - s) % n]) for i in range(n)] for s in range(n - 1)]
    scatter = [[(i, (i + 1) % n, chunk[(i - s - 1) % n]) for i in range(n)] for s in range(n - 1)]
    if op == "all_gather":
        return gather
    if op == "reduce_scatter":
        return scatter
    return scatter + gather


def _tree_steps(op: str, n: int, chunk: list[int], total: int) -> list[list[tuple[int, int, int]]]:
    levels = max(0, (n - 1).bit_length())
    if op == "all_reduce":
        up = [[(i, i - (1 << s), total) for i in range(n) if i % (2 << s) == 1 << s]
              for s in range(levels)]
        down = [[(j, i, m) for i, j, m in step] for step in reversed(up)]
        return up + down
    # Bruck: at step s member i holds chunks i .. i+2^s-1 (mod n) and sends the first
    # min(2^s, n-2^s) of them to member i-2^s
    steps = []
    for s in range(levels):
        w = 1 << s
        cnt = min(w, n - w)
        steps.append([(i, (i - w) % n, sum(chunk[(i + c) % n] for c in range(cnt))) for i in range(n)])
    if op == "all_gather":
        return steps
    return [[(j, i, m) for i, j, m in step] for step in reversed(steps)]


def collective_cost(op: str, algorithm: str, groups, nelems: int, itemsize: int,
                    topology=None) -> AlgoCost:
    """`op` (all_reduce, all_gather, reduce_scatter) by `algorithm` (ring, tree) on every
    group of `groups` (tuples of devices in group order) at once, each member holding
    `nelems` elements of `itemsize` bytes (all_gather: its result; the others: its input),
    under the alpha-beta model above."""
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"no {algorithm} algorithm for {op!r}")
    if algorithm not in COLLECTIVE_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; one of {COLLECTIVE_ALGORITHMS}")
    topo = Topology.coerce(topology)
    node = topo.node_of
    groups = [tuple(g) for g in groups]
    n = len(groups[0])
    chunk = _chunks(nelems, n)
    steps = _ring_steps(op, n, chunk) if algorithm == "ring" else _tree_steps(op, n, chunk, nelems)
    seconds, moved = 0.0, 0
    for step in steps:
        load: dict[tuple[str, int], int] = defaultdict(int)
        inter = False
        for g in groups:
            for i, j, m in step:
                u, v = g[i], g[j]
                b = m * itemsize
                moved += b
                if node(u) != node(v):
                    inter = True
                    load[("nic_out", node(u))] += b
                    load[("nic_in", node(v))] += b
                else:
                    load[("dev_out", u)] += b
                    load[("dev_in", v)] += b
        lat = topo.inter_node_latency_s if inter else topo.intra_node_latency_s
        beta = max((b / (topo.inter_bytes_per_s if k.startswith("nic") else topo.intra_bytes_per_s)
                    for (k, _), b in load.items()), default=0.0)
        seconds += lat + beta
    return AlgoCost(op, algorithm, len(steps), moved, seconds)


def ring_collective(op: str, shape, dtype, src, dst, groups, topology=None) -> Plan:
    """The ring algorithm of a collective as a Plan of meshcomm's own transfers (pipelined
    chains, as dtensor_style's collectives), for the layouts meshcomm.collectives.layouts
    gives `op` on `groups`: all_gather one chain per member's tile round the ring;
    reduce_scatter one reduction per member's chunk along the ring ending at that member;
    all_reduce the data split into one part per member, each reduced at its member along
    the ring, then (stage 1) sent on round the ring."""
    shape = _check(shape, src, dst)
    name, itemsize = _itemsize(dtype)
    topo = Topology.coerce(topology)
    st, dt = src.tiles(shape), dst.tiles(shape)
    em = _Emitter()
    for g in groups:
        k = len(g)
        ring = lambda j: tuple(g[(j + s) % k] for s in range(1, k))   # noqa: E731
        for j, d in enumerate(g):
            if op not in ("all_gather", "reduce_scatter", "all_reduce"):
                raise ValueError(f"no ring plan for {op!r}")
            if k == 1:
                em.emit((d,), (d,), dt.boxes[d])
            elif op == "all_gather":
                em.emit((d,), (d,), st.boxes[d])
                em.emit((d,), ring(j), st.boxes[d])
            elif op == "reduce_scatter":
                em.emit(ring(j) + (d,), (d,), dt.boxes[d], reduce=True)
            else:
                box = dt.boxes[g[0]]
                n = box_size(box)
                for sub in row_major_range(box, n * j // k, n * (j + 1) // k):
                    em.emit(ring(j) + (d,), (d,), sub, reduce=True)
                    em.emit((d,), ring(j), sub, stage=1, src_buf="dst")
    return _make_plan("ring", shape, name, itemsize, src, dst, topo, em)
