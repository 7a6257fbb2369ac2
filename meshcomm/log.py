"""meshcomm's communication log: one JSON-lines record per communicating call, per rank.

    import meshcomm as mc
    mc.log.start("logs/run1")            # or MESHCOMM_LOG=logs/run1 in the environment
    with mc.log.tag("pp.fwd"):           # nestable: the record's tag is "outer/inner"
        y = mc.reshard(x, src, dst)
    mc.log.stop()                        # also done at exit
    # meshcomm log summary logs/run1;  meshcomm log trace logs/run1 -o trace.json

Each rank writes `DIR/rank<r>.jsonl` (r: the launcher's rank, 0 without a launcher). The
first line is `{"header": {...}}` (rank, world, clock_offset, clock_error, pid); every other
line is one call, written when the call's communication finished:

| field | meaning |
| --- | --- |
| op | "reshard", "all_to_all_v", or the collective's name |
| backend | "local" (one process), "mpi", "torch" or "mixed" |
| group | the ranks taking part (sorted); a rank outside it writes no record |
| call | this rank's number of the call among its calls with exactly this group: records of one call on different ranks share (group, call) |
| seq | this rank's number of the call among all its logged calls |
| src_ranks, dst_ranks | (reshard) the ranks owning the src / dst mesh's devices |
| dtype, shape, logical_bytes | the logical tensor: a reshard's global tensor; all_to_all_v: this rank's rows (its send buffer) |
| in_bytes, out_bytes | bytes of the tiles this rank passed to the call / got back |
| sent_bytes, recv_bytes | bytes this rank put on / took off the wire in this call (below) |
| ctl_sent_bytes, ctl_recv_bytes | (all_to_all_v) its count exchange, not in sent/recv_bytes |
| group_size | (collectives) the size of one group along the axes: the bus factor's n; their logical_bytes is nccl-tests' size (`collective_fields`) |
| t_start, t_run, t_end | seconds on the shared clock: when the caller issued the call; when it began to run on this rank (after the calls issued before it here: later than t_start for a queued `async_op` call); when this rank's part of it finished (async calls: on the communication thread, before the handle's wait returns) |
| tag | the `tag()` names around the call, joined with "/" ("" outside any) |
| async | whether the call was issued with async_op=True |

Why `call` counts per group: ranks outside a group never make its calls (a pipeline stage's
tensor-parallel all-reduces), so a per-rank sequence would not line up; the ranks of one
group make its calls in one order, as meshcomm requires for them not to deadlock.

Wire bytes of a reshard (`backends.base.wire_bytes`, from this rank's steps of the plan):
a point-to-point step counts nbytes sent by its root and received by the other rank; a
broadcast counts nbytes per receiver sent by the root (what the one-host broadcast does; a
tree broadcast forwards through members, but is counted the same way) and nbytes received by
each receiver; an ordered reduce counts, per contributing rank, nbytes per src device it
holds sent, all received by the root; a backend reduce nbytes sent per non-root member, all
received by the root. Copies inside a rank, the one-process path, and the agreement check's
metadata are not counted. So, summed over the ranks of a call, sent equals received exactly.

Shared clock: `time.time()` plus this rank's offset to rank 0's clock, measured once when the
log starts under a launcher (inside `meshcomm.init`, or in `start()` called after init, which
every rank must then call): 8 ping-pongs with rank 0 over the context's backend; the one with
the shortest round trip gives offset = t0 - (t1 + t2) / 2 (t1, t2: this rank's send and
receive, t0: rank 0's reply), exact to within half that round trip (the header's
clock_error; tens of microseconds over shared memory). Drift during a long run is not
corrected.

Cost: with logging off a call checks `log.ON` once. With it on, records are kept in memory
and written every `flush_every` records, at `stop()` and at exit; nothing synchronises ranks.

Collectives run as reshards (meshcomm/runtime/collective_call.py) and are logged the same
way under their own op. Code that issues other calls: at issue, on the caller's thread,
`stamp = log.stamp(async_op) if log.ON else None`; when this rank's part is done,
`if stamp is not None: log.record(stamp, op, group, backend=..., dtype=..., shape=...,
logical_bytes=..., sent_bytes=..., recv_bytes=..., in_bytes=..., out_bytes=...)`.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import threading
import time

from . import settings
from .caches import memo

__all__ = ["ON", "start", "stop", "tag", "stamp", "record", "path", "record_reshard",
           "record_rows", "collective_fields", "clock_sync", "on_init"]

ON = False                  # the one attribute every call checks
FLUSH_EVERY = 1000
_TAG = 32700                # clock ping-pong tags (nothing else is in flight meanwhile)
_lock = threading.Lock()
_tags = threading.local()
_S = None                   # the open log's state
_ENCODER = json.JSONEncoder(separators=(",", ":"),      # NumPy scalars and arrays as plain values
                            default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))


class _State:
    def __init__(self, directory, rank, flush_every):
        self.dir, self.rank, self.flush_every = directory, rank, flush_every
        self.world, self.offset, self.error = 1, 0.0, 0.0
        self.buf: list = []
        self.seq = 0
        self.calls: dict = {}
        self.file = None

    @property
    def path(self) -> str:
        return os.path.join(self.dir, f"rank{self.rank}.jsonl")

    def write(self) -> None:
        if self.file is None:
            os.makedirs(self.dir, exist_ok=True)
            self.file = open(self.path, "w")
            head = {"rank": self.rank, "world": self.world, "clock_offset": self.offset,
                    "clock_error": self.error, "pid": os.getpid(), "version": 1}
            self.file.write(json.dumps({"header": head}) + "\n")
        if self.buf:
            enc = _ENCODER.encode
            self.file.write("".join(enc(r) + "\n" for r in self.buf))
            self.buf.clear()
        self.file.flush()


def _launcher_rank() -> int:
    for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 0


_CONTEXT: list = [None]     # the context of meshcomm.init (runtime.context sets it)


def set_context(ctx) -> None:
    """Called by meshcomm.init and finalize: the context a log started later syncs clocks with."""
    _CONTEXT[0] = ctx


def _current_context():
    return _CONTEXT[0]


def start(directory, flush_every: int = FLUSH_EVERY) -> str:
    """Log every call of this process to `directory`/rank<r>.jsonl (created; a previous file
    of this rank is replaced); returns that path. Under `meshcomm.init` every rank must call
    it (it measures the clock offset with rank 0); called before init, init measures it."""
    global ON, _S
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"log directory must be a path, got {directory!r}")
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise ValueError(f"flush_every must be a positive int, got {flush_every!r}")
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"log directory {directory!r} exists and is not a directory")
    stop()
    ctx = _current_context()
    s = _State(directory, ctx.rank if ctx is not None else _launcher_rank(), flush_every)
    os.makedirs(directory, exist_ok=True)
    if ctx is not None:
        s.world = ctx.world_size
        s.offset, s.error = ctx.call(clock_sync, ctx)
    _S, ON = s, True
    return s.path


def stop() -> None:
    """Write what is buffered and close the file; calls are no longer logged."""
    global ON, _S
    with _lock:
        s, _S, ON = _S, None, False
        if s is not None:
            s.write()
            s.file.close()


def path() -> str | None:
    """This rank's log file, or None when not logging."""
    s = _S
    return None if s is None else s.path


@contextlib.contextmanager
def tag(name: str):
    """Name the calls made inside the block (this thread); nested tags join with "/". Tags
    work whether or not logging is on. Calls are tagged when issued, so an async call
    keeps the tag it was issued under."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a log tag must be a non-empty str, got {name!r}")
    prev = getattr(_tags, "joined", "")
    _tags.joined = f"{prev}/{name}" if prev else name
    try:
        yield
    finally:
        _tags.joined = prev


def stamp(async_op: bool = False) -> tuple:
    """What a call notes when it is issued (on the caller's thread, only when `ON`):
    (issue time, the current tag, async_op). Pass it to `record` when the call is done."""
    return (time.time(), getattr(_tags, "joined", ""), bool(async_op))


def record(stamp: tuple, op: str, group, *, backend: str, dtype, shape, logical_bytes: int,
           sent_bytes: int = 0, recv_bytes: int = 0, in_bytes: int = 0, out_bytes: int = 0,
           t_run: float | None = None, **extra) -> None:
    """Log one call (fields: the module docstring); t_end is now. `group`: the ranks taking
    part, ints (None: this process alone). Thread-safe; records keep the order calls finish
    in. Records are kept as dicts and turned into JSON when written."""
    t_end = time.time()
    with _lock:
        s = _S
        if s is None:               # stopped meanwhile
            return
        group = (s.rank,) if group is None else tuple(group)
        k = s.calls.get(group, 0)
        s.calls[group] = k + 1
        off = s.offset
        rec = {"rank": s.rank, "seq": s.seq, "call": k, "op": op, "backend": backend,
               "group": group, "dtype": str(dtype), "shape": shape,
               "logical_bytes": int(logical_bytes), "sent_bytes": int(sent_bytes),
               "recv_bytes": int(recv_bytes), "in_bytes": int(in_bytes), "out_bytes": int(out_bytes),
               "t_start": stamp[0] + off, "t_run": (stamp[0] if t_run is None else t_run) + off,
               "t_end": t_end + off, "tag": stamp[1], "async": stamp[2]}
        if extra:
            rec.update(extra)
        s.seq += 1
        s.buf.append(rec)
        if len(s.buf) >= s.flush_every:
            s.write()


def _tile_bytes(tiles, itemsize: int) -> int:
    return sum(math.prod(v.shape) for v in tiles.values()) * itemsize


@memo(maxsize=256)
def _reshard_facts(plan, rank: int, dpp: int, collective_reduce: bool) -> dict | None:
    """What every record of this plan on this rank shares (None: the rank takes no part)."""
    from .backends.base import wire_bytes
    src_ranks = tuple(sorted({d // dpp for d in plan.src.mesh.device_ids}))
    dst_ranks = tuple(sorted({d // dpp for d in plan.dst.mesh.device_ids}))
    group = tuple(sorted(set(src_ranks) | set(dst_ranks)))
    if rank not in group:
        return None
    sent, recv = wire_bytes(plan, rank, dpp, collective_reduce)
    return dict(op="reshard", group=group, dtype=plan.dtype, shape=tuple(plan.shape),
                logical_bytes=math.prod(plan.shape) * plan.itemsize, sent_bytes=sent, recv_bytes=recv,
                src_ranks=src_ranks, dst_ranks=dst_ranks)


def record_reshard(stamp, *, rank: int | None, dpp: int | None, backend: str, plan,
                   collective_reduce: bool, shards, out, **fields) -> None:
    """Log one reshard from its plan: wire bytes from this rank's steps (module docstring).
    `dpp` None: the one-process path (this process alone, nothing on the wire). `fields`
    override the record's (a collective run as a reshard passes its op, group, size...)."""
    if dpp is None:
        s = _S
        me = (s.rank if s is not None else 0,)
        facts = dict(op="reshard", group=me, dtype=plan.dtype, shape=tuple(plan.shape),
                     logical_bytes=math.prod(plan.shape) * plan.itemsize, src_ranks=me, dst_ranks=me)
    else:
        facts = _reshard_facts(plan, rank, dpp, collective_reduce)
        if facts is None:
            return
    rec = dict(facts, backend=backend, in_bytes=_tile_bytes(shards, plan.itemsize),
               out_bytes=_tile_bytes(out, plan.itemsize))
    rec.update(fields)
    record(stamp, **rec)


def collective_fields(op: str, group_size: int, tile, out_shapes, itemsize: int) -> dict:
    """The fields a collective run as a reshard gives `record_reshard`: its op, the size of
    one of its groups (the bus factor's n) and nccl-tests' size, the larger of the tile passed
    and the largest tile returned (all_gather, gather: the gathered output; reduce_scatter,
    scatter: the input; the others: the buffer); shape: the tile passed."""
    out = max((math.prod(s) for s in out_shapes), default=0)
    return {"op": op, "group_size": int(group_size), "shape": tuple(tile),
            "logical_bytes": max(math.prod(tile), out) * itemsize}


def record_rows(stamp, op: str, *, group, backend: str, xs, out, like, sent_bytes=0, recv_bytes=0,
                ctl_sent_bytes=0, ctl_recv_bytes=0, t_run=None) -> None:
    """Log a row exchange (all_to_all_v): `xs`/`out` {device: rows} passed / got back;
    shape and logical_bytes are this rank's rows (its send buffer)."""
    from .arrays import dtype_of
    name, itemsize = dtype_of(like)
    rows = sum(int(v.shape[0]) for v in xs.values())
    shape = (rows,) + tuple(like.shape[1:])
    nbytes = math.prod(shape) * itemsize
    record(stamp, op, group, backend=backend, dtype=name, shape=shape, logical_bytes=nbytes,
           sent_bytes=sent_bytes, recv_bytes=recv_bytes, in_bytes=nbytes,
           out_bytes=_tile_bytes(out, itemsize), t_run=t_run, ctl_sent_bytes=ctl_sent_bytes,
           ctl_recv_bytes=ctl_recv_bytes)


def clock_sync(ctx, rounds: int = 8) -> tuple[float, float]:
    """(offset to add to time.time() to read rank 0's clock, its error bound): ping-pongs
    with rank 0 over the context's backend (module docstring). Collective: every rank."""
    import numpy as np
    from .backends.base import empty_wire, from_wire, to_wire
    if ctx.world_size == 1:
        return 0.0, 0.0
    be = ctx.primitives()
    deadline = time.monotonic() + ctx.timeout
    like = np.empty(0, np.float64)
    if ctx.rank == 0:
        for r in range(1, ctx.world_size):
            for _ in range(rounds):
                buf = empty_wire(8, be.wire, like)
                be.wait_all([be.irecv(buf, r, _TAG)], deadline)
                be.wait_all([be.isend(to_wire(np.array([time.time()]), be.wire), r, _TAG + 1)], deadline)
        return 0.0, 0.0
    best = (math.inf, 0.0)
    ping = to_wire(np.zeros(1), be.wire)
    for _ in range(rounds):
        buf = empty_wire(8, be.wire, like)
        t1 = time.time()
        be.wait_all([be.isend(ping, 0, _TAG), be.irecv(buf, 0, _TAG + 1)], deadline)
        t2 = time.time()
        t0 = float(from_wire(buf, like)[0])
        if t2 - t1 < best[0]:
            best = (t2 - t1, t0 - (t1 + t2) / 2)
    return best[1], best[0] / 2


def on_init(ctx) -> None:
    """Called by `meshcomm.init` on every rank: starts the log MESHCOMM_LOG names (if not
    started), and measures the clock offset of a log started before init."""
    global ON, _S
    s = _S
    if s is None:
        d = settings.get("LOG")
        if not d:
            return
        s = _State(d, ctx.rank, FLUSH_EVERY)
    s.rank, s.world = ctx.rank, ctx.world_size
    s.offset, s.error = clock_sync(ctx)
    _S, ON = s, True


def _from_env() -> None:
    """MESHCOMM_LOG set when meshcomm is imported: log from the first call."""
    global ON, _S
    d = settings.get("LOG")
    if d:
        _S, ON = _State(d, _launcher_rank(), FLUSH_EVERY), True


_from_env()
atexit.register(stop)
