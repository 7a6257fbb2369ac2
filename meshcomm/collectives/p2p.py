"""Point-to-point `send` / `recv` between devices (pipeline stages), with a checked header.

The sender sends a small header (dtype, shape) and then the data; the receiver checks the
header against `like` before taking the data, so a shape or dtype mismatch raises a
ValueError naming both devices on the receiving process instead of reinterpreting bytes (the
sender's send completed: as in MPI, it is not told). A send that fails its own checks sends
nothing and takes no message number: the pair's next send is the receiver's next message.
Messages between two devices arrive in the order they were sent: the k-th message of a pair
goes on tags of its own (`_tags`), so a receive given up (timed out) leaves no header or data
that a later receive of the pair could take for its own. Sends and receives run in call order
on the context's queue, asynchronous ones too (as every call does). An asynchronous call is
only posted there and the queue goes on (its Handle waits for it; a receive's data buffer is
sized by `like`, as torch's `irecv`, where the data goes over MPI), so two processes may
exchange both ways in any order of posting and waiting, as with torch's `isend`/`irecv`. An
asynchronous receive whose message has another size than `like` raises as a synchronous one
does (the posted receive is cancelled, the data taken and dropped). Over torch.distributed
(gloo aborts the process on a message larger than its posted receive) a receive waits in the
queue for its header, which gives the size: there, post the sends first, or send
asynchronously first on both sides.
Without a launcher both devices live in this process: `send` leaves a copy in a mailbox that
`recv` takes.
"""
from __future__ import annotations

import collections
import time

import numpy as np

from .. import arrays, log, runtime
from ..handle import Handle
from ..layout import normalize_shape
from ..validate import plain_tile

__all__ = ["send", "recv"]

_TAG0, _SPAN = 256, 512             # the k-th message's (header, data) tags: in the tag slot Programs leave
_MAILBOX: dict = collections.defaultdict(collections.deque)     # (from, to) -> tiles (one process)
_HDR_LEN = 16


def _device(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise TypeError(f"{what} must be a device id (a non-negative int), got {v!r}")
    return int(v)


def _header(x) -> np.ndarray:
    name, itemsize = arrays.dtype_of(x)
    shape = tuple(x.shape)
    if len(shape) > _HDR_LEN - 4:
        raise ValueError(f"send: tiles have at most {_HDR_LEN - 4} dimensions, got {len(shape)}")
    code = np.frombuffer(name.encode()[:16].ljust(16, b"\0"), dtype=np.int64)
    return np.array(list(code) + [itemsize, len(shape)] + list(shape) + [0] * (_HDR_LEN - 4 - len(shape)),
                    dtype=np.int64)


def _tags(ctx, way: str, frm: int, to: int) -> tuple[int, int]:
    """(header tag, data tag) of the pair's next message this way (sender and receiver count alike)."""
    k = ctx.p2p.get((way, frm, to), 0)
    ctx.p2p[(way, frm, to)] = k + 1
    t = _TAG0 + 2 * (k % _SPAN)
    return t, t + 1


def _nbytes(h) -> int:
    """The data's bytes a header announces."""
    return int(np.prod(h[4:4 + int(h[3])], dtype=np.int64)) * int(h[2])


def _describe(h) -> str:
    name = np.asarray(h[:2], dtype=np.int64).tobytes().rstrip(b"\0").decode(errors="replace")
    ndim = int(h[3])
    return f"{name} {tuple(int(v) for v in h[4:4 + ndim])}"


def _record(stamp, op, rank, peer, prim, x, sent: bool) -> None:
    """The log's record of a message of the pair (rank, peer): the header's bytes on the wire too."""
    name, itemsize = arrays.dtype_of(x)
    n = int(np.prod(x.shape, dtype=np.int64)) * itemsize
    wire = n + _HDR_LEN * 8
    log.record(stamp, op, tuple(sorted((rank, peer))), backend=prim.name, dtype=name, shape=tuple(x.shape),
               logical_bytes=n, sent_bytes=wire if sent else 0, recv_bytes=0 if sent else wire,
               in_bytes=n if sent else 0, out_bytes=0 if sent else n, group_size=2)


def _own(ctx, device, what):
    if ctx.ownership.rank_of(device) != ctx.rank:
        raise ValueError(f"{what}: device {device} belongs to rank {ctx.ownership.rank_of(device)}, "
                         f"not to this process (rank {ctx.rank})")


def _default_device(ctx, given, what):
    if given is not None:
        d = _device(given, what)
        if ctx is not None:
            ctx.ownership.check_devices([d], what)
        return d
    if ctx is None:
        raise ValueError(f"{what} is needed without meshcomm.init (this process owns every device)")
    dpp = ctx.devices_per_process
    if dpp != 1:
        raise ValueError(f"{what} is needed: this process owns {dpp} devices")
    return ctx.rank


def send(x, to_device: int, *, from_device: int | None = None, backend=None, async_op: bool = False):
    """Send tile `x` from `from_device` (default: the one device this process owns) to
    `to_device`, whose process calls `recv(from_device, like)`."""
    ctx = runtime.current()
    to_device = _default_device(ctx, to_device, "to_device")
    frm = _default_device(ctx, from_device, "from_device")
    arrays.kind_of(x)
    x = plain_tile(x)
    if ctx is None or backend == "local" or ctx.ownership.rank_of(to_device) == ctx.rank:
        if ctx is None or backend == "local":
            runtime.no_context(backend, "send")
        _MAILBOX[(frm, to_device)].append((_header(x), x.clone() if arrays.is_torch(x) else np.array(x)))
        return Handle(result=None) if async_op else None
    _own(ctx, frm, "send")
    from meshcomm.backends.base import to_wire
    peer = ctx.ownership.rank_of(to_device)
    # a message's concrete backend: be.choose("send", nbytes, 2, "cpu") ("mixed" by size: the
    # header's by its fixed size, the data's by the size the header gives, so both ends pick alike)
    be = ctx.backend_of(backend)
    prim_h = be.choose("send", _HDR_LEN * 8, 2, "cpu")
    prim = be.choose("send", int(np.prod(x.shape, dtype=np.int64)) * arrays.dtype_of(x)[1], 2, "cpu")
    hdr = to_wire(_header(x), prim_h.wire)
    data = to_wire(np.asarray(x) if arrays.kind_of(x) == "jax" else x.reshape(-1), prim.wire)

    t_hdr, t_data = _tags(ctx, "send", frm, to_device)       # after every check: a failed send sends nothing

    stamp = log.stamp(async_op) if log.ON else None

    def post():
        return prim_h.isend(hdr, peer, t_hdr), prim.isend(data, peer, t_data)

    def wait(posted):
        deadline, (wh, wd) = time.monotonic() + ctx.timeout, posted
        prim_h.wait_all([wh], deadline)
        prim.wait_all([wd], deadline)
        if stamp is not None:
            _record(stamp, "send", ctx.rank, peer, prim, x, sent=True)
    if not async_op:
        ctx.run(lambda: wait(post()), False)
        return None
    # posted in call order; the queue goes on at once, so a receive issued after it (the peer
    # sending its own tile back) is not held behind this send's completion
    fut = ctx.run(post, True)
    return Handle(lambda: ctx.run(lambda: wait(fut.result()), False).result(), future=_Posted(fut))


class _Posted:
    """An asynchronous send's or receive's completion for `Handle.is_completed`: posted, and
    its messages (item `at` of what the post returned) are done."""

    def __init__(self, fut, at=None):
        self.fut, self.at = fut, at

    def done(self) -> bool:
        if not self.fut.done():
            return False
        if self.fut.exception() is not None:
            return True
        works = self.fut.result() if self.at is None else self.fut.result()[self.at]
        return all(w.test() for w in works)


def _cancelled(w, deadline) -> bool:
    """Cancel a posted MPI receive of the data that its header says is of another size: True
    if it took no message (cancelled), False if it took one (completed or truncated; waited for
    until `deadline`, then given up: backends.base.abandon)."""
    from meshcomm.backends import base
    from mpi4py import MPI
    req = w.req
    req.Cancel()
    st = MPI.Status()
    try:
        while not req.Test(st):
            if time.monotonic() > deadline:
                base.abandon([w])
                return False
            time.sleep(1e-4)
    except MPI.Exception:
        return False                    # matched the data, and too small for it: taken
    return st.Is_cancelled()


def recv(from_device: int, like, *, to_device: int | None = None, backend=None, async_op: bool = False):
    """Receive the tile `from_device` sends to `to_device` (default: the one device this
    process owns). `like` (an array, or a (shape, dtype) pair) gives the shape, dtype and
    kind expected; a different header raises ValueError naming both devices."""
    ctx = runtime.current()
    from_device = _default_device(ctx, from_device, "from_device")
    to = _default_device(ctx, to_device, "to_device")
    if isinstance(like, tuple) and len(like) == 2 and not hasattr(like, "shape"):
        shape, dtype = like
        if not isinstance(shape, (tuple, list)):
            raise TypeError(f"recv: like=(shape, dtype) needs the shape as a tuple of ints, got {shape!r}")
        like = np.empty(normalize_shape(shape), dtype=arrays.numpy_dtype(arrays.normalize_dtype(dtype)[0]))
    arrays.kind_of(like)
    want = _header(plain_tile(like) if isinstance(like, np.ndarray) else like)

    def check(h, where):
        if not np.array_equal(np.asarray(h), want):
            raise ValueError(f"recv: device {from_device} sent {_describe(np.asarray(h))} to device {to}, "
                             f"which expects {_describe(want)} (from like=){where}")

    if ctx is None or backend == "local" or ctx.ownership.rank_of(from_device) == ctx.rank:
        if ctx is None or backend == "local":
            runtime.no_context(backend, "recv")
        box = _MAILBOX[(from_device, to)]
        if not box:
            raise ValueError(f"recv: nothing was sent from device {from_device} to device {to} in this process")
        h, v = box.popleft()
        check(h, "")
        return Handle(result=v) if async_op else v
    _own(ctx, to, "recv")
    from meshcomm.backends.base import empty_wire, from_wire
    peer = ctx.ownership.rank_of(from_device)
    be = ctx.backend_of(backend)
    prim_h = be.choose("send", _HDR_LEN * 8, 2, "cpu")
    like_np = like if not arrays.is_jax(like) else np.asarray(like)
    t_hdr, t_data = _tags(ctx, "recv", from_device, to)
    stamp = log.stamp(async_op) if log.ON else None

    def take(prim, buf, h):
        check(h, "; the data was received and dropped")
        y = from_wire(buf, like_np).reshape(tuple(like.shape))
        if stamp is not None:
            _record(stamp, "recv", ctx.rank, peer, prim, y, sent=False)
        return y

    def data(h, deadline):
        """Receive the data `h` announces, sized by it (on a mismatch it is dropped: the pair's
        next message is the next one sent)."""
        got = _nbytes(h)
        prim = be.choose("send", got, 2, "cpu")
        buf = empty_wire(got, prim.wire, like_np)
        prim.wait_all([prim.irecv(buf, peer, t_data)], deadline)
        return prim, buf

    def header():
        hbuf = empty_wire(_HDR_LEN * 8, prim_h.wire, np.empty(0, np.int64))
        return hbuf, prim_h.irecv(hbuf, peer, t_hdr)

    def go():
        deadline = time.monotonic() + ctx.timeout
        hbuf, wh = header()
        prim_h.wait_all([wh], deadline)
        h = from_wire(hbuf, np.empty(0, np.int64))
        return take(*data(h, deadline), h)
    want_bytes = _nbytes(want)
    prim = be.choose("send", want_bytes, 2, "cpu") if async_op else None
    if prim is not None and prim.cancels_recv:
        # both messages posted in call order, the data's sized by `like` (as torch's irecv), and
        # the queue goes on: two processes may post their receives first, then their sends. Only
        # where a receive of another size can be taken back (Backend.cancels_recv: MPI); over
        # gloo the receive waits in the queue for its header, which gives the size
        def post():
            hbuf, wh = header()
            buf = empty_wire(want_bytes, prim.wire, like_np)
            return hbuf, buf, (wh, prim.irecv(buf, peer, t_data))

        def finish(posted):
            deadline, (hbuf, buf, (wh, wd)) = time.monotonic() + ctx.timeout, posted
            prim_h.wait_all([wh], deadline)
            h = from_wire(hbuf, np.empty(0, np.int64))
            if np.array_equal(h, want) or _nbytes(h) == want_bytes:
                prim.wait_all([wd], deadline)     # its data (or another tile's of its size: dropped)
                return take(prim, buf, h)
            if _cancelled(wd, deadline):                    # sized for another tile: taken anew and dropped
                return take(*data(h, deadline), h)
            check(h, "")
        posted = ctx.run(post, True)
        fut = _Posted(posted, 2)
        get = lambda: ctx.run(lambda: finish(posted.result()), False).result()    # noqa: E731
    else:
        fut = ctx.run(go, async_op)
        get = fut.result
    if arrays.is_jax(like):
        import jax
        put = lambda: jax.device_put(get(), arrays.jax_device(to))               # noqa: E731
        return Handle(put, future=fut) if async_op else put()
    return Handle(get, future=fut) if async_op else get()
