"""Mixed backend: MPI and torch.distributed side by side, one chosen per message.

The choice comes from a tuning table keyed by operation, message bytes and group size
(backends/tuning.py; `MESHCOMM_TUNING=path` or the built-in default), made when a Program
is constructed: the executor (backends/batch.py) picks a backend per message and per
collective, issues a round's works on both, then waits for them together (`wait_all`).
Metadata exchanges go through MPI. `meshcomm.backends.base.issued` counts the operations
each backend issued.

Both backends may have work in flight at once, which is safe under one rule, found by
running it: a process must never block on one backend's work (nor poll only that backend's)
while it holds unfinished work of the other that a peer may wait for before issuing its own
part. MPI's non-blocking calls progress only inside MPI calls of every member (an Iallreduce
of 1 KiB too): a rank blocked in torch's `wait` starves them, and if a peer waits for that
MPI work before issuing its torch operation, both sit until the timeout. Deadlock-free ways:
a fence (one backend in flight at a time); or issue everything on every rank first, then
wait in any order; or wait with `MixedBackend.wait_all`, which polls every work of both
backends together. (Each caller asks `choose` for the member to issue on: the executor per
message and step, a native collective's Program at construction.)
"""
from __future__ import annotations

import hashlib
import json

from . import pacing, tuning
from .base import Backend, wait_polling

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

    def flush(self):
        self.torch.flush()

    def wait_all(self, works, deadline):
        """Torch's works block on waiter threads while this thread polls the MPI works (MPI
        progresses only inside MPI calls, so a blocking torch wait would stall MPI work a peer
        may be waiting for); the first error of either raises. A paced send is issued first
        (`force`): then it is the one or the other."""
        self.flush()
        for w in works:
            if isinstance(w, pacing.Paced):
                w.force()
        tw, mw = [], []
        for w in works:
            (tw if hasattr(w, "work") and not (isinstance(w, pacing.Paced) and w.work is None) else mw).append(w)
        if not tw:
            return wait_polling(mw, deadline, self.rank, self.timeout)
        self.torch.wait_all(tw, deadline, polled=mw)

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

