"""A Program's plan run on the backends: the executor (backends/batch.py `Runner`: a batch of
one) worked out and its groups created at construction; a run of CPU torch tiles on a
host-buffer backend goes over NumPy views of their memory. A compressed plan runs through
backends/compressed.py instead."""
from __future__ import annotations

import numpy as np

from ..backends import base, compressed
from ..backends.batch import BatchItem, Runner
from .program import half
from .tiles import numpy_views, torch_results

__all__ = ["PlanRun", "one_backend"]


class PlanRun:
    """The executor of one plan for one Program (the module's docstring)."""

    def __init__(self, ctx, be, p, comp, tags, device_kind, deadline):
        if comp is None:
            be = one_backend(be, p, ctx.devices_per_process, device_kind)
        self.ctx, self.be, self.plan, self.comp, self.tags = ctx, be, p, comp, tags
        self.device_kind = device_kind
        self.runner, self.coll = None, False    # coll: sums over 3+ ranks as the backend's reduce
        if comp is None:
            self.runner = Runner([p], rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=be,
                                 device_kind=device_kind)
            self.runner.prepare(deadline)
            self.coll = self.runner.coll[0]

    def run(self, shards, like, fences, deadline, out=None, parity=0):
        r, tags = self.runner, half(self.tags, parity)
        if r is None:
            return compressed.execute(self.plan, shards, like, rank=self.ctx.rank,
                                      devices_per_process=self.ctx.devices_per_process, backend=self.be,
                                      device_kind=self.device_kind, compression=self.comp, deadline=deadline, out=out)
        host = None
        if type(like) is not np.ndarray and r.b.wire == "numpy":
            host = numpy_views(shards, like, out)       # CPU torch tiles: no copy (None: on a device, bfloat16)
        if host is not None:
            res, done = r.run([BatchItem(self.plan, *host)], tags, deadline, fences)
            return torch_results(res[0], out), done
        res, done = r.run([BatchItem(self.plan, shards, like, out)], tags, deadline, fences)
        return res[0], done


def one_backend(be, p, dpp, device_kind):
    """`mixed` whose tuning table sends every step of plan `p` to one backend: that backend
    (chosen at construction, so a run pays nothing for the mixing; the same choice on every
    process, from the plan's steps of every rank), else `be`."""
    if len(be.members()) < 2:
        return be
    coll = base.collective_reduce_ok(p.dtype, be)
    chosen = {be.choose(s.table_op, s.nbytes, len(s.ranks), device_kind)
              for s in base.all_steps(p, dpp, coll) if s.prim != "local"}
    if len(chosen) == 1:
        only = chosen.pop()
        if base.collective_reduce_ok(p.dtype, only) == coll:
            return only
    return be
