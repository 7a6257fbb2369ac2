"""torch.distributed's native collectives (TorchBackend's allreduce, allgatherv, ... ibarrier):
one `async_op=True` call on the group's cached process group, returned as a polled Work.

What gloo (torch 2.13, CPU) takes, found by running each call, and what is built here:

* all_reduce and reduce: sum, prod, min, max on float16, bfloat16, float32, float64,
  int8, uint8, int32, int64 and bool. gloo refuses int16, uint16, uint32 and uint64 ("Invalid
  scalar type", and an async failure can break the process group for the calls after it),
  so those are reduced in a wider integer (`widened`): int16 and uint16 in int32, uint32 in
  int64, each narrowed back when the work completes (integer sums and products wrap modulo
  2^bits either way, min and max fit); uint64 as int64's bits, with the sign bit flipped
  for min and max so the order is the unsigned one.
* allgatherv: equal counts are `all_gather_single` (`all_gather_into_tensor` before torch
  2.13). gloo's `all_gather` refuses
  uneven tensors ("invalid tensor size"), so uneven counts pad every block to the largest
  count, gather n such blocks, and copy them out into recvbuf when the work completes.
* reduce_scatterv: `all_reduce` of a copy of the input, then block i copied out when the
  work completes. gloo's own `reduce_scatter` takes uneven blocks but returns a work whose
  `is_completed()` never turns True (only a blocking `wait` ends it), so it cannot be
  polled against a deadline nor waited for beside MPI work (MixedBackend.wait_all). The
  all-reduce moves 2(n-1)/n of the buffer per rank where a reduce-scatter needs (n-1)/n.
* alltoall: `all_to_all_single` (equal blocks).
* gatherv / scatterv: equal counts are `gather` / `scatter` into / from views of the
  buffer. gloo's gather and scatter refuse uneven tensors (the root fails alone and the
  others hang), so uneven counts are one `all_to_all_single` whose only non-empty splits
  go to (gather) or come from (scatter) the root: exact sizes, no padding.
* barrier: `barrier(group, async_op=True)`. reduce: TorchBackend.reduce.

A Work completes when torch's work does (`is_completed`); a work that completed with an
error raises PeerTimeoutError from `test` (the polled path), as `TorchBackend.wait_all`
does from `wait`. NCCL (CUDA tensors) takes the same calls.
"""
from __future__ import annotations

from meshcomm.errors import PeerTimeoutError

from .base import Work
from .collectives import check_alltoall, check_group, check_op, check_v, displs, others

__all__ = ["TorchCollectives", "CollWork", "widened"]


class CollWork(Work):
    """A torch work plus an optional `post` run once when it completed (unpadding)."""

    __slots__ = ("work", "op", "peers", "buf", "post", "rank")
    lingers = True

    def __init__(self, op, peers, buf, work, rank, post=None):
        self.op, self.peers, self.buf, self.work, self.rank, self.post = op, peers, buf, work, rank, post

    def test(self) -> bool:
        if not self.work.is_completed():
            return False
        self.finish()
        return True

    def finish(self) -> None:
        """Raise the work's error, else run `post` (once). Called after completion."""
        try:
            self.work.wait()                # returns at once when done; raises its error
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise PeerTimeoutError(f"rank {self.rank}: {self.op} with peer rank(s) {list(self.peers)} "
                                   f"failed: {why}", self.peers, self.op) from e
        post, self.post = self.post, None
        if post is not None:
            post()


_WIDER: dict = {}       # torch dtype gloo cannot reduce -> the wider one it is reduced in


def widened(buf, op: str):
    """(the buffer gloo reduces, a function writing its result back into `buf`, or None):
    `buf` itself where gloo takes its dtype, else a wider integer copy (module docstring)."""
    import torch
    if not _WIDER:
        _WIDER.update({torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64,
                       torch.uint64: torch.int64})
    wide = _WIDER.get(buf.dtype)
    if wide is None:
        return buf, None
    if buf.dtype != torch.uint64:
        w = buf.to(wide)
        return w, lambda: buf.copy_(w.to(buf.dtype))
    w = buf.view(torch.int64)           # uint64: the same bits; min/max on sign-flipped bits
    if op not in ("min", "max"):
        return w, None
    w = w ^ (-2 ** 63)

    def back():
        buf.view(torch.int64).copy_(w ^ (-2 ** 63))
    return w, back


def _views(buf, counts):
    """buf cut into 1-d views of `counts` elements."""
    return [buf[a:a + c] for a, c in zip(displs(counts), counts)]


class TorchCollectives:
    """Mixed into TorchBackend: needs `dist`, `rank`, `flush()`, `_group(ranks)`."""

    def _rop(self, op):
        R = self.dist.ReduceOp
        return {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}[check_op(op)]

    def _issue(self, what, ranks, bufs, call, post=None):
        self.flush()                        # queued point-to-point first: keep the order
        return CollWork(f"{what} in group {list(ranks)}", others(ranks, self.rank), bufs,
                        call(self._group(ranks)), self.rank, post)

    def _all_gather(self, out, inp, group, async_op):
        f = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        return f(out, inp, group=group, async_op=async_op)

    def allreduce(self, buf, op, ranks):
        ranks = check_group(self.rank, ranks, "allreduce")
        rop = self._rop(op)
        w, back = widened(buf, op)
        return self._issue("allreduce", ranks, (buf, w), lambda g: self.dist.all_reduce(
            w, op=rop, group=g, async_op=True), back)

    def allgatherv(self, sendbuf, recvbuf, counts, ranks):
        import torch
        ranks, counts, _ = check_v("allgatherv", self.rank, sendbuf, recvbuf, counts, ranks)
        m = max(counts)
        if min(counts) == m:
            return self._issue("allgatherv", ranks, (sendbuf, recvbuf), lambda g: self._all_gather(
                recvbuf, sendbuf, group=g, async_op=True))
        padded_in = torch.empty(m, dtype=sendbuf.dtype, device=sendbuf.device)
        padded_in[:len(sendbuf)] = sendbuf
        padded_out = torch.empty(m * len(ranks), dtype=recvbuf.dtype, device=recvbuf.device)

        def post():
            for i, (a, c) in enumerate(zip(displs(counts), counts)):
                recvbuf[a:a + c] = padded_out[i * m:i * m + c]
        return self._issue("allgatherv", ranks, (padded_in, padded_out, recvbuf),
                           lambda g: self._all_gather(padded_out, padded_in, group=g, async_op=True), post)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, ranks):
        ranks, counts, _ = check_v("reduce_scatterv", self.rank, sendbuf, recvbuf, counts, ranks)
        rop, acc = self._rop(op), sendbuf.clone()
        a, c = displs(counts)[ranks.index(self.rank)], counts[ranks.index(self.rank)]
        w, back = widened(acc, op)

        def post():
            if back is not None:
                back()
            recvbuf.copy_(acc[a:a + c])
        return self._issue("reduce_scatterv", ranks, (acc, w, recvbuf), lambda g: self.dist.all_reduce(
            w, op=rop, group=g, async_op=True), post)

    def alltoall(self, sendbuf, recvbuf, ranks):
        ranks = check_alltoall(self.rank, sendbuf, recvbuf, ranks)
        return self._issue("alltoall", ranks, (sendbuf, recvbuf), lambda g: self.dist.all_to_all_single(
            recvbuf, sendbuf, group=g, async_op=True))

    def _rooted_a2a(self, what, sendbuf, recvbuf, counts, i, ranks, gather: bool):
        """gatherv/scatterv of uneven counts as one all_to_all_single with the root's splits."""
        rooted = self.rank == ranks[i]
        mine = [counts[ranks.index(self.rank)] if j == i else 0 for j in range(len(ranks))]   # to/from the root
        every = list(counts) if rooted else [0] * len(ranks)
        if gather:
            ins, outs, inp, out = mine, every, sendbuf, (recvbuf if rooted else sendbuf.new_empty(0))
        else:
            ins, outs, inp, out = every, mine, (sendbuf if rooted else recvbuf.new_empty(0)), recvbuf
        return self._issue(what, ranks, (sendbuf, recvbuf), lambda g: self.dist.all_to_all_single(
            out, inp, output_split_sizes=outs, input_split_sizes=ins, group=g, async_op=True))

    def gatherv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks, counts, i = check_v("gatherv", self.rank, sendbuf, recvbuf, counts, ranks, root)
        if min(counts) != max(counts):
            return self._rooted_a2a("gatherv", sendbuf, recvbuf, counts, i, ranks, gather=True)
        lst = _views(recvbuf, counts) if self.rank == root else None
        return self._issue("gatherv", ranks, (sendbuf, recvbuf), lambda g: self.dist.gather(
            sendbuf, lst, dst=root, group=g, async_op=True))

    def scatterv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks, counts, i = check_v("scatterv", self.rank, sendbuf, recvbuf, counts, ranks, root)
        if min(counts) != max(counts):
            return self._rooted_a2a("scatterv", sendbuf, recvbuf, counts, i, ranks, gather=False)
        lst = _views(sendbuf, counts) if self.rank == root else None
        return self._issue("scatterv", ranks, (sendbuf, recvbuf), lambda g: self.dist.scatter(
            recvbuf, lst, src=root, group=g, async_op=True))

    def ibarrier(self, ranks):
        ranks = check_group(self.rank, ranks, "barrier")
        return self._issue("barrier", ranks, None, lambda g: self.dist.barrier(group=g, async_op=True))
