"""Run a plan in one process along the message path, stream-ordered on CUDA.

For every transfer the boxes of the sending tile are packed into one contiguous message (one
kernel launch on CUDA), then unpacked into each receiving tile; a reduction packs each
contributor and adds the messages in the contributors' order (unpack-add), exactly as the local
backend sums (a plan whose reduce_op is prod, min or max combines with the array library's op
instead of the kernel). This is the data path of the distributed backends without the wire,
and the single-process path for CUDA tensors that exercises the kernels.

Stream order on CUDA (DESIGN.md, Backends; backends/streams.py): the work runs on a communication
stream of its own. Before it starts, that stream waits on an event recorded on the caller's
(producer's) current stream, so packing sees everything queued before the call; when it ends it
records an event the consumer stream waits on before using the results (`Handle.wait()`, or at
once when not async).
`fence=False`, or UNSAFE_NO_FENCE = True, drops the first fence: it exists to show the race
it prevents (tests/test_gpu.py), never for use.
"""
from __future__ import annotations

from typing import Mapping

from meshcomm.backends import streams
from meshcomm.backends.local import alloc_like
from meshcomm.backends.pack import message_elems, pack, unpack
from meshcomm.planners.boxes import box_size, local_slices

__all__ = ["execute_packed"]


# True drops the CUDA stream fences: only to show that the fence test fails without them
UNSAFE_NO_FENCE = False


def execute_packed(plan, shards: Mapping[int, object], like=None, *, async_op: bool = False,
                   fence: bool = True, stream=None):
    """Run `plan` on `shards` ({src device: tile}) through packed messages; return {dst device:
    tile}, or a meshcomm Handle when `async_op` (its wait() orders the caller's stream after the
    work and returns the tiles). On CUDA the work runs on `stream` (default: the "packed"
    communication stream of backends/streams.py); on CPU every fence is a no-op."""
    from meshcomm.handle import Handle
    if like is None:
        like = next(iter(shards.values()))
    st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)
    zero = set(plan.zero_fill)
    out = {}
    for d, box in dt.boxes.items():
        out[d] = alloc_like(like, tuple(b - a for a, b in box), zero=d in zero or box_size(box) == 0,
                            op=plan.fill_op)
    if UNSAFE_NO_FENCE:
        fence = False
    device = streams.device_of(like)
    comm = stream if stream is not None else streams.comm_stream("packed", device)
    if fence:
        streams.fence_from_current(device).wait_on(comm)     # compute -> comm
    if comm is not None:
        for t in list(shards.values()) + list(out.values()):
            if streams.is_cuda(streams.device_of(t)):
                t.record_stream(comm)            # the allocator must not reuse them early
    with streams.use(comm):
        for t in plan.transfers:
            bufs, origin = (shards, st.boxes) if t.src_buf == "src" else (out, dt.boxes)
            s0 = t.srcs[0]
            msg = pack(bufs[s0], [local_slices(b, origin[s0]) for b in t.boxes])
            if t.kind == "reduce":
                whole = [(slice(0, message_elems([local_slices(b, origin[s0]) for b in t.boxes])),)]
                for s in t.srcs[1:]:
                    part = pack(bufs[s], [local_slices(b, origin[s]) for b in t.boxes])
                    unpack(part, msg, whole, accumulate=True, op=plan.reduce_op)
            for d in t.dsts:
                unpack(msg, out[d], [local_slices(b, dt.boxes[d]) for b in t.boxes])
    done = streams.record(comm)

    def wait():
        done.wait_on(streams.current_stream(device))             # comm -> consumer
        return out

    return Handle(wait_fn=wait) if async_op else wait()
