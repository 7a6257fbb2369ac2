"""An agreed collective run as ONE native MPI collective (MPI's own allreduce, allgatherv, ...)
where the tuning table names MPI for it, the per-operation mixing of backends that MCR-DL
describes (the table naming torch: the plan, whose messages carry the Program's tags; gloo's
collectives match by order on a group every Program shares).

`choose` decides at a Program's construction, from facts every process agreed on (so all
decide alike), whether a collective can run natively: one device per process in every group,
CPU tiles, the gathered or split dimension the leading one, group order ascending in ranks
where order matters, a dtype the backend's reduction takes. Then `posters` readies, once,
a function per group this process is in that posts that one call (over MPI on a
communicator of the Program's own, so two Programs never meet in one MPI call), and `run`
posts and waits. Otherwise the collective runs as its reshard plan. The tuning table
(`meshcomm tune`, MESHCOMM_TUNING) names the backend per (op, size, group size).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .. import arrays
from ..backends import buffers
from ..backends.base import empty_wire, exact_reduce, from_wire, issued, to_wire
from ..collectives.layouts import groups
from .collective_input import REDUCING
from .tiles import empty_like
from .trailers import trailed, trails

__all__ = ["Native", "choose", "posters", "run", "poster", "typed"]

TABLE_OP = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reduce_scatter",
            "broadcast": "bcast", "reduce": "reduce", "all_to_all": "alltoall", "gather": "gather",
            "scatter": "scatter"}
_ROOTED = ("broadcast", "reduce", "gather", "scatter")
_ORDERED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")

# Programs whose native MPI calls get communicators of their own (two per group: one per run
# parity): every process can hold about 2040 communicators (MPICH's context ids); past this
# many Programs of one group of processes (their count is the same on each of them), a
# collective Program runs its plan
OWN_COMMS_MAX = 512


@dataclasses.dataclass(frozen=True)
class Native:
    prim: object                    # the concrete backend (MPI's)
    all_ranks: tuple                # every group's ranks, sorted (groups are created in this order)
    key: str = ""                   # its count in backends.base.issued: "native_<backend>"

# "auto": native where it applies, else the plan; "plan": always the plan (tests, comparisons)
MODE = "auto"


def choose(ctx, be, req, dt, tile, shapes, devtype, counter=0) -> Native | None:
    if MODE == "plan" or devtype != "cpu" or tile is None:
        return None
    rank_of = ctx.ownership.rank_of
    gs = groups(req.mesh, req.axes)
    k = len(gs[0])
    if k < 2:
        return None
    for g in gs:
        rs = [rank_of(d) for d in g]
        if len(set(rs)) != k or (req.op in _ORDERED and rs != sorted(rs)):
            return None
    nd = len(tile)
    if req.op in ("all_gather", "gather", "reduce_scatter", "scatter") and (nd == 0 or req.dim % nd != 0):
        return None
    if req.op == "all_to_all" and (nd == 0 or req.split_dim % nd != 0 or req.concat_dim % nd != 0):
        return None
    name, itemsize = dt
    nbytes = _nccl_bytes(req, tile, shapes, gs[0], itemsize)
    prim = be.choose(TABLE_OP[req.op], nbytes, k, "cpu")
    if req.op in REDUCING and not exact_reduce(name, prim):
        return None
    if prim.name != "mpi" or counter > OWN_COMMS_MAX:
        # MPI: a communicator of its own per Program, up to a cap. Not gloo's collectives:
        # they match by their order on one group that every Program shares, so two Programs
        # (or two places of one in the call order) of the same sizes completed against each
        # other, a wrong value; the plan's messages carry the Program's own tags (and ran as
        # fast at 4 processes here, broadcasts 4-6% slower: BENCHMARKS 5)
        return None
    return Native(prim, tuple(_ranks(ctx, g) for g in gs), "native_" + prim.name)


def _nccl_bytes(req, tile, shapes, g, itemsize) -> int:
    n = math.prod(tile) * itemsize
    if req.op in ("all_gather", "gather"):
        return sum(math.prod(shapes[d]) for d in g) * itemsize if shapes else n * len(g)
    return n


def _chunks(n: int, k: int) -> list[int]:
    c = -(-n // k)
    return [min((i + 1) * c, n) - min(i * c, n) for i in range(k)]


def wire_bytes(req, k: int, i: int, root: int | None, size: int) -> tuple[int, int]:
    """(sent, received) by member i of a group of k for nccl-tests' size `size`: the bytes an
    ideal algorithm moves (ring for the symmetric ops, direct for the rooted ones); the
    backend's own algorithm may move more. Summed over the group, sent == received."""
    if k < 2:
        return 0, 0
    if req.op == "all_reduce":
        b = 2 * (k - 1) * size // k
        return b, b
    if req.op in ("all_gather", "reduce_scatter", "all_to_all"):
        b = (k - 1) * size // k
        return b, b
    part = size // k if req.op in ("gather", "scatter") else size
    if req.op in ("broadcast", "scatter"):
        return ((k - 1) * part, 0) if i == root else (0, part)
    return (0, (k - 1) * part) if i == root else (part, 0)          # reduce, gather


def posters(ctx, nat: Native, req, dt, tile, shapes, kind, deadline) -> tuple:
    """Per run parity (program.next_seq), [(group, this process's device in it, its poster)]
    for every group this process is in, in the groups' global order (a process in several
    groups takes part in each in that order: the same everywhere, so no deadlock), each on
    a communicator of the Program's own (`MPIBackend.communicator`), the odd runs on a
    second one, so a run never matches one a place apart in the call sequence. A rooted
    call's members whose part ends alone (a broadcast's root) can get further apart: the run's
    number travels in a persistent call's buffers (runtime/trailers.py), else beside a rooted
    one (`MPIBackend.stamps`, backends/mpi_comm.py), and is compared."""
    prim = nat.prim
    rank_of = ctx.ownership.rank_of
    out = ([], [])
    for g in groups(req.mesh, req.axes):
        me = [d for d in g if rank_of(d) == ctx.rank]
        if not me:
            continue
        for posts in out:
            ranks = _ranks(ctx, g)
            comm = prim.communicator(ranks, deadline)

            def stamps(comm=comm, ranks=ranks):     # made only where the number goes beside the call
                what = f"{req.op} in group {list(ranks)}"
                return prim.checked(comm, what) if req.op not in _ROOTED else prim.stamps(
                    comm, ranks, rank_of(g[req.root]), req.op in ("broadcast", "scatter"), what)
            posts.append((g, me[0], persistent(ctx, prim, req, g, me[0], dt, tile, shapes, comm, nat.key, stamps,
                                               kind)))
    return out


def _checked(fin, stamps):
    """`fin` after the run numbers that came beside the call were compared (`Stamps.check`)."""
    if stamps is None:
        return fin

    def checked():
        stamps.check()
        return fin()
    return checked


# largest buffer (bytes) of a native MPI call run as a persistent request: below it, copying
# the tile in and the result out (the run number in the buffers) costs less than posting a
# new request with the number beside it (`Checked`: a small allreduce more); all_to_all's
# copies cost more sooner (BENCHMARKS 5)
PERSISTENT_MAX = 256 << 10
PERSISTENT_MAX_ALL_TO_ALL = 128 << 10


def persistent(ctx, prim, req, g, me, dt, tile, shapes, comm, key, make_stamps, kind):
    """A Program's call as an MPI-4 persistent request over buffers of the Program's own
    (`MPIBackend.bind(bufs=)`): a run copies the tile in, starts it, and copies the result out
    (a torch tile as bytes; a process without a tile gets one of the Program's `kind`).
    Chosen from agreed facts only (every member must: a persistent collective matches no
    non-blocking one); `poster`'s where the buffers would be too large. `make_stamps()`: the
    run numbers beside the call (`Stamps` of a rooted call, `Checked` of a symmetric one),
    made only where they do not travel in it."""
    c = _call(ctx, req, g, me, dt, tile, shapes)
    cap = PERSISTENT_MAX_ALL_TO_ALL if req.op == "all_to_all" else PERSISTENT_MAX
    counted = (key, req.op)
    if c.whole > cap:
        return _leaned(poster(ctx, prim, req, g, me, dt, tile, shapes, kind, comm, make_stamps), prim, me, counted)
    dtype = np.dtype(arrays.numpy_dtype(dt[0]))
    unit = dtype if c.typed else np.dtype(np.uint8)
    ranks = _ranks(ctx, g)
    trail = trails(c, unit)
    if trail:       # the run number in the call's own messages (runtime/trailers.py)
        whole, recv, put, take, stamps, kw = trailed(c, unit, dtype, ranks, ctx.rank,
                                                     f"{req.op} in group {list(ranks)}")
    else:
        stamps = make_stamps()
        whole = np.empty(c.send, unit)
        recv = None if c.recv is None else np.empty(c.recv, unit)
        put, take, kw = None, None, c.kw
    send = whole[:c.send]
    res = send if recv is None else recv
    start = prim.bind(c.what, ranks, comm, bufs=(whole, recv), **kw)
    fill, gets = c.fill and c.send > 0, c.gets
    view = None                         # the result in the request's buffer (no trailer)
    if put is None:
        src = send.view(dtype).reshape(c.mine) if fill else None
        out = view = res.view(dtype).reshape(c.shape) if gets else None

        def put(x):
            src[...] = x

        def take():
            return out.copy()

    def run(x, seq=0):
        # every member runs the persistent request (it matches no other kind of call): a
        # torch tile of a NumPy Program is copied in and out as bytes
        if fill:
            put(x if type(x) is np.ndarray else to_wire(x, "numpy").view(dtype).reshape(c.mine))
        w = start() if stamps is None else stamps.post(seq, start)
        if not gets:
            return [w], _checked(dict, stamps)
        like = x if x is not None or kind != "torch" else empty_like(kind, dt[0], "cpu")
        if like is None or type(like) is np.ndarray:
            return [w], _checked(lambda: {me: take()}, stamps)
        return [w], _checked(lambda: {me: from_wire(take().reshape(-1).view(np.uint8), like).reshape(c.shape)},
                             stamps)

    def post(x, seq, into=None):
        """`run` of a NumPy tile, posted (a Program's lean run): the started request's Work
        (an out= buffer `into` takes a copy of the result)."""
        issued[counted] += 1
        if fill:
            put(x)                      # of the agreed shape and dtype (the lean run checked)
        return start() if stamps is None else stamps.post(seq, start)

    def result(into=None):
        """The lean run's result once its Work is done (copied into out= `into` where given),
        or None where this process gets none."""
        if stamps is not None:
            stamps.check()
        if into is not None and view is not None:
            into[...] = view
            return into
        return take() if gets else None
    run.lean = (post, result, prim, stamps is None or trail)
    return run


def _leaned(post, prim, me, counted):
    """`post` (a non-blocking call, a new one per run) with the lean form a Program's lean
    run takes (a NumPy tile of the agreed shape and dtype): post gives the call's Work (an
    MPI request, tested bare), result the tile once it is done. A call of typed buffers into
    a receive buffer takes the tile as it is, with nothing around it (each layer of Python
    costs: BENCHMARKS 5), and receives into the caller's out= buffer where one is given
    (`post(x, seq, into)`; the lean run checked it)."""
    c, f = post.call
    stamps = post.stamps
    if c.typed and c.recv is not None:
        got = [None, None]              # the result's buffer, and out= where it is the caller's

        def posted_plain(x, seq, into=None):
            issued[counted] += 1
            r = got[0] = (np.empty(c.recv, x.dtype) if into is None else into.reshape(-1)) if c.gets else None
            got[1] = into
            a = x.reshape(-1) if c.fill else None
            return f(a, r) if stamps is None else stamps.post(seq, lambda: f(a, r))

        def result_plain(into=None):
            if stamps is not None:
                stamps.check()
            r, into = got
            got[0] = got[1] = None      # held no longer than the caller holds it (its memory then serves the next run)
            return into if into is not None else None if r is None else r.reshape(c.shape)
        post.lean = (posted_plain, result_plain, prim, stamps is None)
        return post
    fin = [dict]

    def posted(x, seq, into=None):
        issued[counted] += 1
        works, fin[0] = post(x, seq)
        return works[0]

    def result(into=None):
        f, fin[0] = fin[0], dict        # the result held no longer than the caller holds it
        return f().get(me)
    post.lean = (posted, result, prim, stamps is None)
    return post


def run(ctx, nat: Native, posts, req, prob, tiles, dt, tile, deadline, stamp=None, seq=0) -> dict:
    """This process's result tiles (the shapes `prob` gives), after its native calls (run
    `seq` of the group's sequence)."""
    prim = nat.prim
    issued[nat.key, req.op] += 1
    res = {}
    for g, me, post in posts:
        t_run = time.time()
        works, fin = post(tiles.get(me), seq)
        prim.wait_all(works, deadline)
        got = fin()
        res.update(got)
        if stamp is not None:
            x, y = tiles.get(me), got.get(me)
            io = [0 if v is None else math.prod(v.shape) * dt[1] for v in (x, y)]
            _record(stamp, ctx, prim, req, g, me, prob, dt, tile, t_run, io)
    return res


def _record(stamp, ctx, prim, req, g, me, prob, dt, tile, t_run, io):
    """The log's record of one native call; `io`: this device's (in, out) tile bytes."""
    from .. import log
    f = log.collective_fields(req.op, len(g), tile, [s for _, s in prob.out_shapes], dt[1])
    root = req.root if req.op in _ROOTED else None
    sent, recv = wire_bytes(req, len(g), g.index(me), root, f["logical_bytes"])
    ranks = tuple(sorted({ctx.ownership.rank_of(d) for h in groups(req.mesh, req.axes) for d in h}))   # one call
    log.record(stamp, f["op"], ranks, backend=prim.name, dtype=dt[0], shape=f["shape"],
               logical_bytes=f["logical_bytes"], sent_bytes=sent, recv_bytes=recv, t_run=t_run,
               in_bytes=io[0], out_bytes=io[1], group_size=f["group_size"], algorithm="native")


def typed(dtype: np.dtype) -> bool:
    """Whether a native MPI call moves `dtype` as itself rather than as bytes (faster in
    MPICH: BENCHMARKS 5): integers, float32 and float64; not bfloat16, float16 or bool."""
    return dtype.kind in "iu" or dtype in (np.float32, np.float64)


def _flat(v, typed):
    if type(v) is np.ndarray:           # the common case, without conversions
        v = v.reshape(-1)
        return v if typed or v.dtype == np.uint8 else v.view(np.uint8)
    return to_wire(v.reshape(-1).contiguous() if arrays.is_torch(v) else np.ascontiguousarray(v).reshape(-1),
                   "numpy", typed=typed)


def _copy(x):
    if type(x) is np.ndarray and x.nbytes < buffers.MIN_BYTES:
        return x.copy()
    return x.clone() if arrays.is_torch(x) else buffers.copy(x)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One member's native call of a collective Program: `MPIBackend.bind`'s `what` and
    arguments, its buffers in units (elements of the dtype where `typed`, else bytes), what
    goes in and comes out."""

    what: str
    kw: dict
    typed: bool
    send: int               # units of the send buffer (0: none); in place, the result's too
    recv: int | None        # units of the receive buffer; None: in place
    fill: bool              # this member's tile goes in
    gets: bool              # a result comes out here
    shape: tuple            # the result's shape
    mine: tuple             # the tile's shape
    whole: int              # bytes of the largest buffer of any member


def _ranks(ctx, g) -> tuple:
    return tuple(sorted(ctx.ownership.rank_of(d) for d in g))


def _call(ctx, req, g, me, dt, tile, shapes) -> _Call:
    dtype = np.dtype(arrays.numpy_dtype(dt[0]))
    typ = req.op in REDUCING or typed(dtype)
    per = 1 if typ else dtype.itemsize          # units per tile element
    u = dtype.itemsize // per                   # bytes per unit
    k, i, tile = len(g), g.index(me), tuple(tile)
    n, row = math.prod(tile) * per, (math.prod(tile[1:]) if tile else 1) * per
    op = "sum" if req.reduce_op == "avg" else req.reduce_op
    root = ctx.ownership.rank_of(g[req.root]) if req.op in _ROOTED else None
    rooted = ctx.rank == root
    if req.op in ("all_reduce", "reduce", "broadcast"):
        what, kw = {"all_reduce": ("allreduce", {"op": op}), "reduce": ("reduce", {"op": op, "root": root}),
                    "broadcast": ("bcast", {"root": root})}[req.op]
        return _Call(what, kw, typ, n, None, req.op != "broadcast" or rooted, req.op != "reduce" or rooted,
                     tile, tile, n * u)
    if req.op in ("all_gather", "gather"):
        sizes = [shapes[d][0] for d in g]
        counts = tuple(s * row for s in sizes)
        gets = req.op == "all_gather" or rooted
        what, kw = ("allgatherv", {"counts": counts}) if req.op == "all_gather" else \
            ("gatherv", {"counts": counts, "root": root})
        return _Call(what, kw, typ, counts[i], sum(counts) if gets else 0, True, gets,
                     (sum(sizes),) + tile[1:], tuple(shapes[me]), max(sum(counts), n) * u)
    if req.op in ("reduce_scatter", "scatter"):
        sizes = _chunks(tile[0], k)
        counts = tuple(s * row for s in sizes)
        shape = (sizes[i],) + tile[1:]
        if req.op == "reduce_scatter":
            return _Call("reduce_scatterv", {"counts": counts, "op": op}, typ, n, counts[i], True, True,
                         shape, tile, n * u)
        return _Call("scatterv", {"counts": counts, "root": root}, typ, sum(counts) if rooted else 0, counts[i],
                     rooted, True, shape, tile, max(sum(counts), n) * u)
    return _Call("alltoall", {}, typ, n, n, True, True, tile, tile, n * u)      # along the leading dimension


def poster(ctx, prim, req, g, me, dt, tile, shapes, kind, comm=None, make_stamps=None):
    """A function of device `me`'s tile (None where this process has none) and the run's
    number giving (works, fin): its call bound once (`MPIBackend.bind`: group, counts, op, root
    checked; over MPI on `comm`, the Program's own communicator), only buffers made per run.
    The run's number: in buffers of the run's own for an all_reduce (runtime/trailers.py: its
    tile is copied in place anyway), else beside the call (`make_stamps()`: `Stamps` of a
    rooted call, `Checked` of a symmetric one: no copy of the tile)."""
    c = _call(ctx, req, g, me, dt, tile, shapes)
    t, itemsize = c.typed, dt[1]
    ranks, unit = _ranks(ctx, g), np.dtype(arrays.numpy_dtype(dt[0]))
    trail = c.what == "allreduce" and trails(c, unit)
    stamps = None if trail or make_stamps is None else make_stamps()
    f = prim.bind(c.what, ranks, comm, **c.kw)
    what = f"{req.op} in group {list(ranks)}"

    def empty(count, like):             # a buffer of `count` units
        return empty_wire(count * itemsize if t else count, "numpy", like, typed_elems=count if t else None)

    def post(x, seq=0):
        like = x if x is not None else empty_like(kind, dt[0], "cpu")
        if trail:
            whole, _, put, take, tr, _ = trailed(c, unit, None, ranks, ctx.rank, what, fresh=True)
            put(_flat(x, t).reshape(c.mine))
            w = tr.post(seq, lambda: f(whole))           # in place
            if type(like) is np.ndarray:
                return [w], _checked(lambda: {me: take()}, tr)
            return [w], _checked(lambda: {me: from_wire(take().reshape(-1), like, typed=t).reshape(c.shape)}, tr)
        if c.recv is None:              # in place: a copy of the tile, or the root's
            res = _flat(_copy(x), t) if c.fill else empty(c.send, like)
            args = (res,)
        else:
            res = empty(c.recv, like) if c.gets else None
            args = (_flat(x, t) if c.fill else None, res)
        w = f(*args) if stamps is None else stamps.post(seq, lambda: f(*args))
        if not c.gets:
            return [w], _checked(dict, stamps)
        if type(like) is np.ndarray and type(res) is np.ndarray:
            return [w], _checked(lambda: {me: (res if t else res.view(like.dtype)).reshape(c.shape)}, stamps)
        return [w], _checked(lambda: {me: from_wire(res, like, typed=t).reshape(c.shape)}, stamps)
    post.stamps = stamps
    post.call = (c, f)
    return post
