"""Whole-model refit policies other systems use, rebuilt as schedules for the simulator.

Every policy moves the same batch (name, shape, dtype, itemsize, src, dst) and is timed by
planners/simulate.py on the same topology as meshcomm's batch plan, so the figures compare
like for like. Transfers carry bytes and routes; policies that deliver whole tensors and
let receivers keep their slice are not verifiable plans, only timed.

* ``one_sender``: per tensor, one rank sends it (vLLM/SGLang-style weight sync): the
  tensor's first src device gathers the shards it lacks, then broadcasts the whole tensor
  to every dst device as NCCL does, over one ring channel per NIC of a node (channel c a
  chain through every dst device entering each node through rail c, carrying 1/k of the
  bytes); tensors one after another.
* ``gather_broadcast``: the same, every tensor gathered to the first trainer rank of the
  batch and broadcast from it.
* ``per_tensor``: meshcomm's own single-tensor plan (``plan_reshard``), tensors one after
  another.
* ``node_aware``: per tensor, within the M2N-like limits (src and dst meshes of at most 2
  axes, tensors of rank at most 3, no pending sums, at most 16 src shards per dst shard):
  a dst device on a node holding a piece gets it over NVLink from a holder there (spread
  over the holders); the other needers of the piece get it by one chain broadcast from a
  holder on the first needer's rail (same GPU index; spread over replicas piece by piece);
  fixed rules, no balancing over links; tensors outside the limits use ``one_sender``;
  tensors one after another.
* ``striped_buckets`` (verl-like): tensors in order packed into buckets; bucket i belongs
  to trainer rank i mod n, which gathers the bucket's shards it lacks and broadcasts the
  bucket to every generator rank along a chain (bucket i's chain enters the nodes through
  rail i mod k, so concurrent buckets use every NIC, as NCCL's channels would); each rank
  keeps at most two of its buckets in flight, all ranks at once. (Optimistic: a broadcast may start before its bucket's
  gathers end, as if the gathers were pipelined with it.)

Tensors one after another: the sum of their simulated times. Alike tensors (the same shape,
element size and layouts up to renaming whole nodes in order, which no planner decision or
the cost model can tell apart) are timed once (``relabel``).
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np

from .boxes import box_size
from .resharding import pieces, plan_reshard
from .schedule import Transfer, coalesce
from .simulate import simulate
from .topology import Topology

__all__ = ["Schedule", "relabel", "one_sender", "node_aware", "sequential_seconds",
           "striped_buckets", "M2N_LIMITS"]

M2N_LIMITS = {"mesh_axes": 2, "rank": 3, "sources_per_shard": 16}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Transfers in a global order, timed by the simulator (`bucket_window`: as BatchPlan's)."""

    transfers: tuple
    topology: Topology
    bucket_window: int | None = None

    def simulate(self, topology: Topology | None = None) -> float:
        return simulate(self, topology or self.topology)


@dataclasses.dataclass(frozen=True)
class Bucketed(Transfer):
    bucket: int = 0


def _whole(shape) -> tuple:
    return tuple((0, n) for n in shape)


def _ring(root: int, devices, topology: Topology, channel: int = 0) -> tuple:
    """The receivers of a chain from `root`: node by node, the root's node first, then the
    others in ascending order; inside a node from the device on rail `channel` on (so the
    chain enters each node through that rail's NIC), as one of NCCL's ring channels."""
    node, dpn = topology.node_of, topology.devices_per_node
    rn = node(root)
    return tuple(sorted((d for d in devices if d != root),
                        key=lambda d: (node(d) != rn, node(d), (d % dpn - channel) % dpn, d)))


def _broadcast(root: int, devices, nbytes: int, topology: Topology, stage: int, src_buf: str,
               channels: int) -> list:
    """A broadcast of `nbytes` from `root` to `devices` as NCCL runs one: split over
    `channels` ring channels, channel c entering every node through rail c."""
    out = []
    k = max(1, min(channels, nbytes))
    for c in range(k):
        chain = _ring(root, devices, topology, c)
        nb = nbytes * (c + 1) // k - nbytes * c // k
        if chain and nb:
            out.append(Transfer("send" if len(chain) == 1 else "bcast", (root,), chain, (), nb, stage, src_buf))
    return out


def _gather(shape, src, to: int) -> list:
    """Sends bringing every src tile `to` lacks there (one holder per shard and addend)."""
    st = src.tiles(shape)
    out = []
    for groups in st.classes.values():
        for devs in groups.values():
            if to in devs or box_size(st.boxes[devs[0]]) == 0:
                continue
            box = st.boxes[devs[0]]
            out.append((devs[0], box))
    return out


def one_sender(shape, itemsize: int, src, dst, topology: Topology, owner: int | None = None) -> Schedule:
    """One tensor by the one-sender policy (module docstring)."""
    owner = src.mesh.device_ids[0] if owner is None else owner
    items: dict = {}
    for h, box in _gather(shape, src, owner):
        items.setdefault(("send", (h,), (owner,), 0, "src"), []).append(box)
    ts = coalesce(items, itemsize)
    ts += _broadcast(owner, dst.mesh.device_ids, box_size(_whole(shape)) * itemsize, topology, 1, "dst",
                     topology.nics_per_node)
    return Schedule(tuple(ts), topology)


def node_aware(shape, itemsize: int, src, dst, topology: Topology) -> Schedule | None:
    """One tensor by the node-aware per-tensor policy, or None outside the limits."""
    lim = M2N_LIMITS
    if (src.mesh.ndim > lim["mesh_axes"] or dst.mesh.ndim > lim["mesh_axes"] or len(shape) > lim["rank"]
            or src.num_addends > 1 or dst.num_addends > 1):
        return None
    st, dt = src.tiles(shape), dst.tiles(shape)
    per_dst = defaultdict(int)
    ps = pieces(src, dst, shape)
    for _, dc, _ in ps:
        per_dst[dc] += 1
    if max(per_dst.values(), default=0) > lim["sources_per_shard"]:
        return None
    node, nic = topology.node_of, topology.nic_of
    items: dict = {}

    def emit(h, ds, box):
        kind = "copy" if ds == (h,) else "send" if len(ds) == 1 else "bcast"
        items.setdefault((kind, (h,), ds, 0, "src"), []).append(box)
    for k, (sc, dc, box) in enumerate(ps):
        holders = st.classes[sc][0]
        by_node = defaultdict(list)
        for h in holders:
            by_node[node(h)].append(h)
        lacking = []
        for j, d in enumerate(dt.classes[dc][0]):
            if d in holders:
                emit(d, (d,), box)
            elif node(d) in by_node:                # a holder on its node: over NVLink
                near = by_node[node(d)]
                emit(near[j % len(near)], (d,), box)
            else:
                lacking.append(d)
        if lacking:                                 # one sender on the first needer's rail,
            rail = nic(lacking[0]) % topology.nics_per_node     # a chain through the rest
            same = [h for h in holders if nic(h) % topology.nics_per_node == rail] or list(holders)
            root = same[k % len(same)]
            emit(root, _ring(root, lacking, topology), box)
    return Schedule(tuple(coalesce(items, itemsize)), topology)


def relabel(src, dst, topology: Topology, extra: tuple = ()):
    """The two layouts (and the `extra` devices) on devices renumbered so that the nodes
    they use are 0, 1, ... in order, each device keeping its index inside its node (its
    rail): an order-preserving renaming, under which plans and simulated times are the same."""
    from meshcomm.layout import Layout
    from meshcomm.mesh import Mesh
    dpn = topology.devices_per_node
    nodes = sorted({d // dpn for d in src.mesh.device_ids + dst.mesh.device_ids + tuple(extra)})
    rank = {n: i for i, n in enumerate(nodes)}

    def f(d):
        return rank[d // dpn] * dpn + d % dpn

    def move(lay):
        devs = np.vectorize(f)(lay.mesh.devices)
        _, spec, partial = lay.__reduce__()[1]
        return Layout(Mesh(devs, lay.mesh.axis_names), spec, partial)
    return move(src), move(dst), tuple(f(d) for d in extra)


def sequential_seconds(entries, topology: Topology, policy: str, progress=None) -> tuple[float, float]:
    """(simulated seconds, seconds spent making the schedules) of moving `entries` tensor
    after tensor with `policy` ("one_sender", "gather_broadcast", "per_tensor",
    "node_aware"); `progress(n)` is called per tensor."""
    if policy not in ("one_sender", "gather_broadcast", "per_tensor", "node_aware"):
        raise ValueError(f"unknown policy {policy!r}")
    owner0 = (min(d for e in entries for d in e[4].mesh.device_ids),) if policy == "gather_broadcast" else ()
    pairs: dict = {}
    times: dict = {}
    total = making = 0.0
    for name, shape, dtype, itemsize, src, dst in entries:
        if (src, dst) not in pairs:
            pairs[(src, dst)] = relabel(src, dst, topology, owner0)
        key = (shape, itemsize) + pairs[(src, dst)]
        if key not in times:
            t0 = time.perf_counter()
            s, d, extra = key[2], key[3], key[4]
            if policy == "one_sender":
                sched = one_sender(shape, itemsize, s, d, topology)
            elif policy == "gather_broadcast":
                sched = one_sender(shape, itemsize, s, d, topology, owner=extra[0])
            elif policy == "per_tensor":
                sched = plan_reshard(shape, dtype, itemsize, s, d, topology)
            else:
                sched = node_aware(shape, itemsize, s, d, topology) or one_sender(shape, itemsize, s, d, topology)
            making += time.perf_counter() - t0
            times[key] = sched.simulate(topology)
        total += times[key]
        if progress is not None:
            progress(1)
    return total, making


def striped_buckets(entries, topology: Topology, bucket_bytes: int, window: int = 2) -> Schedule:
    """The verl-like policy (module docstring) for the whole batch, as one Schedule."""
    trainers = sorted({d for e in entries for d in e[4].mesh.device_ids})
    gens = sorted({d for e in entries for d in e[5].mesh.device_ids})
    buckets, cur, cur_nb = [], [], 0
    for e in entries:
        nb = box_size(_whole(e[1])) * e[3]
        if cur and cur_nb + nb > bucket_bytes:
            buckets.append((cur, cur_nb))
            cur, cur_nb = [], 0
        cur.append(e)
        cur_nb += nb
    if cur:
        buckets.append((cur, cur_nb))
    out = []
    for i, (members, nb) in enumerate(buckets):
        r = trainers[i % len(trainers)]
        rnd = i // len(trainers)
        per_holder: dict = defaultdict(int)
        for _, shape, _, itemsize, src, _ in members:
            for h, box in _gather(shape, src, r):
                per_holder[h] += box_size(box) * itemsize
        for h, hb in sorted(per_holder.items()):
            out.append(Bucketed("send", (h,), (r,), (), hb, 0, "src", rnd))
        chain = _ring(r, gens, topology, i % topology.nics_per_node)
        if chain:
            out.append(Bucketed("bcast" if len(chain) > 1 else "send", (r,), chain, (), nb, 0, "dst", rnd))
    return Schedule(tuple(sorted(out, key=lambda t: t.bucket)), topology, window)
