"""Mixed backend: MPI and torch.distributed side by side, one chosen per message.

The choice comes from a tuning table keyed by operation, message bytes and group size
(backends/tuning.py; `MESHCOMM_TUNING=path` or the built-in default), made when a Program
is constructed: the executor (backends/batch.py) picks a backend per message and per
collective, issues a round's works on both, then waits for them together (`wait_all`).
Metadata exchanges go through MPI. `meshcomm.backends.base.issued` counts the operations
each backend issued.

Native collectives (allreduce, allgatherv, ...; backends/base.py) go to the backend the
table names for (op, nccl-tests size, group size). Both backends may have work in flight
at once, which is safe under one rule, found by running it: a process must never
block on one backend's work (nor poll only that backend's) while it holds unfinished work
of the other that a peer may wait for before issuing its own part. MPI's non-blocking
collectives progress only inside MPI calls of every member (an Iallreduce of 1 KiB too): a
rank blocked in torch's `wait` starves them, and if a peer waits for that MPI work before
issuing the torch operation, both sit until the timeout. Deadlock-free ways: a fence
(one backend in flight at a time); or issue everything on every rank first, then wait
in any order; or wait with `MixedBackend.wait_all`, which polls every work of both backends
together. (gloo's `reduce_scatter` work never reports completion to polling, so torch's
reduce_scatterv is an all-reduce; see backends/torch_collectives.py.)
"""
from __future__ import annotations

import hashlib
import json

from . import tuning
from .base import Backend, finish_all, torch_of, wait_polling, wait_threads

__all__ = ["MixedBackend"]


class MixedBackend(Backend):
    name = "mixed"

    def __init__(self, mpi, torch, table: tuning.TuningTable | None = None):
        self.mpi, self.torch = mpi, torch
        self.by_name = {"mpi": mpi, "torch": torch}
        self.table = table if table is not None else tuning.table_from_env()
        rules = json.dumps(self.table.to_dict()["rules"], sort_keys=True)
        # processes compare this (runtime's metadata check): they must share one table, since
        # the choice decides which groups torch's new_group creates, collectively
        self._signature = "mixed:" + hashlib.sha1(rules.encode()).hexdigest()[:12]
        self.rank, self.world_size, self.timeout = mpi.rank, mpi.world_size, mpi.timeout
        # a plan's reduction may run on either backend: what both compute exactly
        self.reduce_dtypes = tuple(d for d in mpi.reduce_dtypes if d in torch.reduce_dtypes)
        if torch.rank != mpi.rank or torch.world_size != mpi.world_size:
            raise RuntimeError(f"MPI rank {mpi.rank}/{mpi.world_size} and torch.distributed rank "
                               f"{torch.rank}/{torch.world_size} differ; mixed needs the same ranks")

    def choose(self, op, nbytes, group_size, device):
        return self.by_name[self.table.lookup(op, nbytes, group_size, device)]

    def members(self):
        return (self.mpi, self.torch)

    @property
    def gather_reduces(self) -> bool:
        return self.mpi.gather_reduces

    @property
    def hosts(self):
        return self.mpi.hosts

    @property
    def signature(self) -> str:
        return self._signature

    # -- native collectives: each goes to the backend the table names for (op, bytes, group) --
    # The size is nccl-tests' (the same on every member, so they all choose alike): the
    # buffer (allreduce, bcast, reduce, alltoall's send buffer) or the whole concatenation
    # (allgather, reduce_scatter, gather, scatter). CPU buffers are viewed, not copied, as
    # the chosen backend's kind; the result lands in the caller's buffers.
    def _pick(self, op, nbytes, ranks, *bufs):
        b = self.choose(op, nbytes, len(ranks), _device(bufs))
        return b, [_as_wire(x, b) for x in bufs]

    def allreduce(self, buf, op, ranks):
        b, (x,) = self._pick("allreduce", _nbytes(buf), ranks, buf)
        return b.allreduce(x, op, ranks)

    def bcast(self, buf, root, ranks):
        b, (x,) = self._pick("bcast", _nbytes(buf), ranks, buf)
        return b.bcast(x, root, ranks)

    def reduce(self, buf, root, ranks, op="sum"):
        b, (x,) = self._pick("reduce", _nbytes(buf), ranks, buf)
        return b.reduce(x, root, ranks, op)

    def allgatherv(self, sendbuf, recvbuf, counts, ranks):
        b, (s, r) = self._pick("allgather", _total(counts, sendbuf), ranks, sendbuf, recvbuf)
        return b.allgatherv(s, r, counts, ranks)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, ranks):
        b, (s, r) = self._pick("reduce_scatter", _total(counts, sendbuf), ranks, sendbuf, recvbuf)
        return b.reduce_scatterv(s, r, counts, op, ranks)

    def alltoall(self, sendbuf, recvbuf, ranks):
        b, (s, r) = self._pick("alltoall", _nbytes(sendbuf), ranks, sendbuf, recvbuf)
        return b.alltoall(s, r, ranks)

    def gatherv(self, sendbuf, recvbuf, counts, root, ranks):
        b, (s, r) = self._pick("gather", _total(counts, sendbuf), ranks, sendbuf, recvbuf)
        return b.gatherv(s, r, counts, root, ranks)

    def scatterv(self, sendbuf, recvbuf, counts, root, ranks):
        b, (s, r) = self._pick("scatter", _total(counts, recvbuf), ranks, sendbuf, recvbuf)
        return b.scatterv(s, r, counts, root, ranks)

    def ibarrier(self, ranks):
        return self.mpi.ibarrier(ranks)

    def flush(self):
        self.torch.flush()

    def wait_all(self, works, deadline):
        """Polls the MPI works (MPI progresses only inside MPI calls, so a blocking torch wait
        would stall MPI work a peer may be waiting for) while torch's block on its waiter
        thread (backends/torch_dist.py), then raises the first error of either."""
        self.flush()
        tw = [w for w in works if hasattr(w, "work")]
        mw = [w for w in works if not hasattr(w, "work")]
        if not tw:
            return wait_polling(mw, deadline, self.rank, self.timeout)
        wait_threads(self, mw, self.torch.wait_async(tw, deadline), deadline)
        finish_all(tw)

    def allgather_obj(self, obj, deadline, tag=None, accept=None, ranks=None):
        return self.mpi.allgather_obj(obj, deadline, tag, accept, ranks)

    def retract(self, obj, tag, ranks=None):
        self.mpi.retract(obj, tag, ranks)

    def unread(self, objs, tag, ranks):
        self.mpi.unread(objs, tag, ranks)

    def ctl_send(self, peer, data):
        self.mpi.ctl_send(peer, data)

    def ctl_poll(self):
        return self.mpi.ctl_poll()

    def close(self):
        pass            # the context closes the two members


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _device(bufs) -> str:
    return "cuda" if any(_is_torch(x) and x.device.type == "cuda" for x in bufs) else "cpu"


def _itemsize(x) -> int:
    return x.element_size() if _is_torch(x) else x.itemsize


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if _is_torch(x) else x.nbytes


def _total(counts, like) -> int:
    return sum(int(c) for c in counts) * _itemsize(like)


def _as_wire(x, b):
    """`x` viewed (no copy) as the kind backend `b` takes: a NumPy array for MPI, a torch
    tensor for torch. None stays None."""
    if x is None or _is_torch(x) == (b.wire == "torch"):
        return x
    if b.wire == "torch":
        return torch_of(x)
    if x.device.type != "cpu":
        raise TypeError(f"mixed chose {b.name} for a {x.device.type} tensor, which it cannot "
                        "take without a copy; the tuning table should route device tensors to torch")
    try:
        return x.numpy()
    except TypeError as e:
        raise TypeError(f"mixed chose {b.name} for a {x.dtype} tensor, which NumPy (and MPI) "
                        f"cannot represent; route it to torch in the tuning table: {e}") from None
