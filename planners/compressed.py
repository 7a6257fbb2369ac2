"""Compressed plans: the agreed options, how each transfer's boxes become coded chunks and
messages, the route each message takes, and what it costs (codec time beside link time).

A plan runs compressed (backends/compressed.py) with the same transfers as uncompressed;
what changes is what travels:

* ``copy``, ``send``, ``bcast``: the sender encodes each chunk of its boxes once; a
  broadcast chain's relays forward the compressed bytes as they are (no recompression) and
  decode their own copy. Every dst, the sender's own copy included (a copy transfer, or a
  broadcast from a dst tile), holds the codec's round trip, so replicas agree bit for bit.
  `per_hop` (the point-to-point compression baseline) decodes and re-encodes at every relay
  and codes whole messages (no chunk pipeline).
* ``reduce`` one-shot (`reduce="oneshot"`): every contributor other than the root device
  encodes its chunk once and sends it straight to the root, which decodes and combines in
  the plan's srcs order (its own addend exact). Error: |err| <= sum over the k-1 remote
  contributors of the codec's error on that addend (ZFP(tolerance=t): (k-1) t), plus the
  rounding of the sum itself. Where the plan reduces the same piece at several roots (an
  all-reduce as one reduction per device), every addend is coded, the root's own too, and
  all roots combine in device order: the replicas agree, and the bound is k addends' errors.
* ``reduce`` ring (`reduce="ring"`): along the route srcs[0] -> srcs[1] -> ... -> root; each
  hop decodes the partial sum, adds its own addend and re-encodes. Error: |err| <= sum over
  the k-1 hops of the codec's error on the partial sum S_j it carries (tolerance t: (k-1) t
  too; fixed rate: about 2**-e max|S_j| per hop, and |S_j| grows with j, so the ring's error
  is the larger one). The ring moves each byte over neighbour links only (fewer NIC bytes
  per node when several devices share a node); one-shot needs no chain of codec steps.

Units. A box is coded in its own shape minus `strip` leading dimensions (a collective's
group dimensions, each of size 1 in a box), cut along its first coded dimension on ZFP block
boundaries (`meshcomm.compression.chunks`), so chunks decode to exactly the whole box's
round trip. Consecutive units form messages of about `chunk_bytes` uncompressed bytes.
"""
from __future__ import annotations

import dataclasses
import itertools

from meshcomm.caches import memo
from meshcomm.compression import ZFP, Cast, chunks

from .boxes import Box, box_size
from .topology import Topology

__all__ = [
    "REDUCE_ALGORITHMS",
    "WHOLE",
    "CodecCost",
    "Compression",
    "Unit",
    "chain",
    "hops",
    "messages",
    "wire_ratio",
]

REDUCE_ALGORITHMS = ("oneshot", "ring")
WHOLE = 1 << 62             # chunk size of per-hop compression: whole messages


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a plan runs compressed; every process must hold the same (it is agreed on)."""

    codec: ZFP | Cast
    reduce: str = "oneshot"
    per_hop: bool = False
    chunk_bytes: int = 1 << 18
    strip: int = 0

    def __post_init__(self):
        if not isinstance(self.codec, (ZFP, Cast)):
            raise TypeError(f"Compression needs a codec (ZFP or Cast), got {self.codec!r}")
        if self.reduce not in REDUCE_ALGORITHMS:
            raise ValueError(f"reduce must be one of {REDUCE_ALGORITHMS}, got {self.reduce!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int, got {self.chunk_bytes!r}")

    @property
    def target(self) -> int:
        """Uncompressed bytes per message (whole messages for per-hop compression)."""
        return WHOLE if self.per_hop else self.chunk_bytes

    def __str__(self) -> str:
        hop = " per-hop" if self.per_hop else f" chunk={self.chunk_bytes}"
        return f"{self.codec} reduce={self.reduce}{hop}"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One independently coded piece: its global `box`, the `shape` it is coded as, its
    exact payload size (`wire`; None for data-dependent codecs) and its uncompressed bytes."""

    box: Box
    shape: tuple[int, ...]
    wire: int | None
    nbytes: int


def _coded_shape(box: Box, strip: int) -> tuple[int, int]:
    """(dims dropped, coded shape) of a box: `strip` leading dims when all have size 1."""
    shape = tuple(b - a for a, b in box)
    if strip and all(n == 1 for n in shape[:strip]):
        return strip, shape[strip:]
    return 0, shape


@memo(maxsize=4096)
def messages(plan, index: int, comp: Compression) -> tuple[tuple[Unit, ...], ...]:
    """The messages of transfer `index`: each a tuple of units, in order (the same on every
    process: a function of the plan and the options only)."""
    t = plan.transfers[index]
    units = []
    for box in t.boxes:
        lead, shape = _coded_shape(box, comp.strip)
        for c in chunks(shape, plan.dtype, comp.codec, comp.target):
            sub = box
            if shape:
                lo = box[lead][0]
                sub = box[:lead] + ((lo + c.start, lo + c.stop),) + box[lead + 1:]
            units.append(Unit(sub, c.shape, c.wire_bytes, box_size(sub) * plan.itemsize))
    out, cur, size = [], [], 0
    for u in units:                 # small units share a message up to the target size
        if cur and size + u.nbytes > comp.target:
            out.append(tuple(cur))
            cur, size = [], 0
        cur.append(u)
        size += u.nbytes
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def chain(t, comp: Compression) -> tuple[int, ...]:
    """The devices a transfer's messages visit in order (copy: the device; send/bcast: root
    then dsts; ring reduce: srcs then the root unless it is the last src). One-shot reduces
    have no chain (`hops`)."""
    if t.kind == "reduce":
        return t.srcs if t.srcs[-1] == t.dsts[0] else t.srcs + t.dsts
    return t.srcs + (t.dsts if t.kind != "copy" else ())


def hops(t, comp: Compression) -> tuple[tuple[int, int], ...]:
    """The (from, to) device pairs a transfer's messages cross."""
    if t.kind == "reduce" and comp.reduce == "oneshot":
        r = t.dsts[0]
        return tuple((a, r) for a in t.srcs if a != r)
    c = chain(t, comp)
    return tuple(itertools.pairwise(c))


def wire_ratio(plan, index: int, comp: Compression) -> float:
    """Payload bytes per uncompressed byte of a transfer (data-dependent codecs: their bound)."""
    n = w = 0
    for msg in messages(plan, index, comp):
        for u in msg:
            n += u.nbytes
            w += u.wire if u.wire is not None else comp.codec.max_wire_bytes(u.shape, plan.dtype)
    return w / n if n else 1.0


@memo(maxsize=256)
def replicated_reductions(plan) -> frozenset:
    """The box sets reduced at more than one root (an all-reduce planned as one reduction
    per device): one-shot codes every addend of those, the root's own too, and combines in
    device order, so every replica holds the same values (the ring would not: it is not used)."""
    seen: dict = {}
    for t in plan.transfers:
        if t.kind == "reduce":
            seen[t.boxes] = seen.get(t.boxes, 0) + 1
    return frozenset(b for b, n in seen.items() if n > 1)


@memo(maxsize=256)
def _encoded_boxes(plan, comp: Compression) -> frozenset:
    """(src_buf, device, boxes) a send or bcast encodes: a copy of the same boxes reuses it."""
    return frozenset((t.src_buf, t.srcs[0], t.boxes) for t in plan.transfers if t.kind in ("send", "bcast"))


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """The cost model's view of a compressed plan (planners/simulate.py `compression=`).

    Every transfer is one flow of its uncompressed bytes. Its links carry `wire_ratio` bytes
    per byte; every device that codes is a resource ("cpu", device) of capacity 1 (CPU
    seconds per second), used 1/encode_bps seconds per byte it encodes and 1/decode_bps per
    byte it decodes, so codec and links stream at once (the chunk pipeline) and the slowest
    sets the rate. `encode_bps`/`decode_bps` are one process's throughput while all code at
    once (`meshcomm tune` measures them so). The pipeline's fill (one chunk through every
    step but the slowest; a relay of a chain forwards a chunk only once the decode it is
    busy with ends, one chunk's decode per relay) is added to the transfer's latency."""

    comp: Compression
    encode_bps: float
    decode_bps: float

    def usage(self, plan, index: int, topology: Topology) -> tuple[dict, float]:
        """({resource: uses per uncompressed byte}, extra pipeline fill in seconds)."""
        t, comp = plan.transfers[index], self.comp
        enc, dec = 1.0 / self.encode_bps, 1.0 / self.decode_bps
        ratio = wire_ratio(plan, index, comp)
        use: dict = {}

        def add(key, v):
            use[key] = use.get(key, 0.0) + v
        link_s = []
        for u, v in hops(t, comp):
            nu, nv = topology.node_of(u), topology.node_of(v)
            if nu != nv:
                add(("nic_out", topology.nic_of(u)), ratio)
                add(("nic_in", topology.nic_of(v)), ratio)
                link_s.append(ratio / topology.nic_bytes_per_s)
            else:
                add(("dev_out", u), ratio)
                add(("dev_in", v), ratio)
                link_s.append(ratio / topology.intra_bytes_per_s)
        steps = []                      # seconds per uncompressed byte of each pipeline step
        if t.kind == "copy":
            d = t.srcs[0]
            cached = (t.src_buf, d, t.boxes) in _encoded_boxes(plan, comp)
            add(("cpu", d), dec + (0.0 if cached else enc))
            steps = [dec] if cached else [enc, dec]
        elif t.kind in ("send", "bcast"):
            c = chain(t, comp)
            add(("cpu", c[0]), enc + (dec if t.src_buf == "dst" else 0.0))
            for i, d in enumerate(c[1:]):
                relay = i < len(c) - 2
                add(("cpu", d), dec + (enc if comp.per_hop and relay else 0.0))
            steps = [enc]
            for i, s in enumerate(link_s):   # a relay forwards once the decode it is in ends
                relay = i < len(link_s) - 1
                steps += [s, dec + enc] if comp.per_hop and relay else [s, dec] if relay else [s]
            steps.append(dec)
        elif comp.reduce == "oneshot":
            r = t.dsts[0]
            for a, _ in hops(t, comp):
                add(("cpu", a), enc)
                add(("cpu", r), dec)
            if t.boxes in replicated_reductions(plan) and r in t.srcs:
                add(("cpu", r), enc + dec)  # the root codes its own addend too
            steps = [enc, max(link_s, default=0.0), dec * max(1, len(link_s))]
        else:
            c = chain(t, comp)
            add(("cpu", c[0]), enc)
            for d in c[1:-1]:
                add(("cpu", d), dec + enc)
            add(("cpu", c[-1]), dec)
            steps = [enc]
            for i, s in enumerate(link_s):
                steps += [s, dec + enc] if i < len(link_s) - 1 else [s, dec]
        first = messages(plan, index, comp)[0] if t.nbytes else ()
        chunk = sum(u.nbytes for u in first)
        fill = chunk * (sum(steps) - max(steps, default=0.0))
        return use, fill

