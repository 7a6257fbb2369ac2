"""Mixed backend: MPI and torch.distributed side by side, one chosen per transfer.

The choice comes from a tuning table keyed by operation, message bytes and group size
(backends/tuning.py; `MESHCOMM_TUNING=path` or the built-in default). Mixing cannot
deadlock: the executor runs transfers in the plan's global order and, before switching
from one backend to another, waits for everything the previous one has in flight (a
fence), so only one backend ever has work outstanding (see backends/base.py).
Metadata exchanges go through MPI. `meshcomm.backends.base.issued` counts the operations
each backend issued.
"""
from __future__ import annotations

import hashlib
import json

from . import tuning
from .base import Backend

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
        self.signature = "mixed:" + hashlib.sha1(rules.encode()).hexdigest()[:12]
        self.rank, self.world_size, self.timeout = mpi.rank, mpi.world_size, mpi.timeout
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

    def allgather_obj(self, obj, deadline):
        return self.mpi.allgather_obj(obj, deadline)

    def allreduce_min(self, vec, deadline):
        return self.mpi.allreduce_min(vec, deadline)

    def close(self):
        pass            # the context closes the two members
