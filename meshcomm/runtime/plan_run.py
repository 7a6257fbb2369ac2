"""The executor of one plan for one Program (reshard and collective kernels that run a plan):
groups made at construction, a run builds the Execution over its tiles with the Program's tags."""
from __future__ import annotations

from ..backends import base
from .program import half

__all__ = ["PlanRun", "one_backend"]


class PlanRun:
    """The executor of one plan for one Program: groups created at construction; a run
    builds the Execution over this run's tiles with the Program's tags."""

    def __init__(self, ctx, be, p, comp, tags, device_kind, deadline):
        if comp is None:
            be = one_backend(be, p, ctx.devices_per_process, device_kind)
        self.ctx, self.be, self.plan, self.comp, self.tags = ctx, be, p, comp, tags
        self.device_kind = device_kind
        if comp is None:
            coll = base.collective_reduce_ok(p.dtype, be)
            need = base.groups_needed(p, ctx.devices_per_process, coll,
                                      lambda s: be.choose(s.table_op, s.nbytes, len(s.ranks), device_kind), device_kind)
            for b in be.members():
                b.prepare_groups(need.get(b.name, []), deadline)

    def run(self, shards, like, fences, deadline, out=None, parity=0):
        ctx = self.ctx
        ex = base.Execution(self.plan, shards, like, rank=ctx.rank, devices_per_process=ctx.devices_per_process,
                            backend=self.be, device_kind=self.device_kind, producer_fences=fences,
                            compression=self.comp, tags=half(self.tags, parity), out=out)
        ex.start()
        return ex.finish(deadline)


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
