"""A Program's plan run on the backends: the executor (backends/batch.py `Runner`: a batch of
one) worked out and its groups created at construction; a run of CPU torch tiles on a
host-buffer backend goes over NumPy views of their memory. A compressed plan runs through
backends/compressed.py instead."""
from __future__ import annotations

import numpy as np

from ..backends import compressed
from ..backends.batch import BatchItem, Runner
from .program import part
from .tiles import numpy_views, torch_results

__all__ = ["PlanRun"]


class PlanRun:
    """The executor of one plan for one Program (the module's docstring)."""

    def __init__(self, ctx, be, p, comp, tags, device_kind, deadline):
        self.ctx, self.be, self.plan, self.comp, self.tags, self.device_kind = ctx, be, p, comp, tags, device_kind
        self.runner, self.coll = None, False    # coll: sums over 3+ ranks as the backend's reduce
        if comp is None:
            self.runner = Runner([p], rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=be,
                                 device_kind=device_kind)
            self.runner.prepare(deadline)
            self.coll = self.runner.coll[0]

    def run(self, shards, like, fences, deadline, out=None, seq=0):
        r, tags = self.runner, part(self.tags, seq)
        if r is None:
            return compressed.execute(self.plan, shards, like, rank=self.ctx.rank,
                                      devices_per_process=self.ctx.devices_per_process, backend=self.be,
                                      device_kind=self.device_kind, compression=self.comp, deadline=deadline, out=out,
                                      tags=tags)
        host = None
        if type(like) is not np.ndarray and r.b.wire == "numpy":
            host = numpy_views(shards, like, out)       # CPU torch tiles: no copy (None: on a device, bfloat16)
        item = BatchItem(self.plan, shards, like, out) if host is None else BatchItem(self.plan, *host)
        res, done = r.run([item], tags, deadline, fences)
        return (res[0] if host is None else torch_results(res[0], out)), done
