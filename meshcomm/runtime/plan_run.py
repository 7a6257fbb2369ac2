"""A Program's plan run on the backends: groups created at construction; a run of host tiles
(NumPy arrays, or CPU torch tensors as NumPy views over their memory) on one host-buffer
backend, of a plan that needs no group (every plan on one host), goes to the
batch executor worked out then (backends/batch.py `Runner`: a batch of one), any other
builds the step executor over its tiles (backends/base.py `Execution`), with the Program's
tags."""
from __future__ import annotations

import numpy as np

from .. import arrays
from ..backends import base
from ..backends.base import from_wire, to_wire
from ..backends.batch import BatchItem, plan_runner
from ..backends.compressed import CompressedExecution
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
        self.fast = None        # the batch executor of this one plan, for runs of host tiles
        if comp is None:
            dpp = ctx.devices_per_process
            coll = base.collective_reduce_ok(p.dtype, be)
            need = base.groups_needed(p, dpp, coll,
                                      lambda s: be.choose(s.table_op, s.nbytes, len(s.ranks), device_kind), device_kind)
            for b in be.members():
                b.prepare_groups(need.get(b.name, []), deadline)
            # device tiles agreed on (eager calls, device="cuda"): the steps, which stage each
            # message through the host
            if device_kind == "cpu":
                self.fast = plan_runner(p, ctx.rank, dpp, be, need)

    def run(self, shards, like, fences, deadline, out=None, parity=0):
        ctx = self.ctx
        f = self.fast
        if f is not None:
            host = (shards, like, out) if type(like) is np.ndarray else numpy_views(shards, like, out)
            if host is None:                # bfloat16, or on a device where no process said: host copies
                return self._staged(shards, like, out, fences, half(self.tags, parity), deadline), None
            res = f.run([BatchItem(self.plan, *host)], half(self.tags, parity), deadline)[0]
            if host[0] is not shards:       # torch tiles: torch results over the same memory
                res = torch_results(res, out)
            return res, None                # host tiles: nothing for a consumer to wait on
        ex = (base.Execution if self.comp is None else CompressedExecution)(
            self.plan, shards, like, rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=self.be,
            device_kind=self.device_kind, producer_fences=fences, compression=self.comp, tags=half(self.tags, parity),
            out=out)
        ex.start()
        return ex.finish(deadline)

    def _staged(self, shards, like, out, fences, tags, deadline) -> dict:
        """A run of torch tiles NumPy cannot view, on the batch executor like every other run
        of this Program (each process's messages must match its peers', whatever its tiles):
        host copies in (after the producers' streams: `fences`), results back to the tiles'
        device (and into `out=`)."""
        for f in fences:
            f.synchronize()
        dt = np.dtype(arrays.numpy_dtype(self.plan.dtype))
        host = {d: to_wire(v, "numpy").view(dt).reshape(tuple(v.shape)) for d, v in shards.items()}
        res = self.fast.run([BatchItem(self.plan, host, np.empty(0, dt))], tags, deadline)[0]
        back = {d: from_wire(v.reshape(-1).view(np.uint8), like).reshape(v.shape) for d, v in res.items()}
        for d, v in (out or {}).items():
            v.copy_(back[d])
            back[d] = v
        return back


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
