"""A Program's plan run on the backends: groups created at construction; a run of host tiles
(NumPy arrays, or CPU torch tensors as NumPy views over their memory) on one host-buffer
backend replays the rank's program worked out then (backends/program.py), any other builds
the Execution over its tiles (backends/base.py), with the Program's tags."""
from __future__ import annotations

import numpy as np

from ..backends import base
from ..backends.compressed import CompressedExecution
from ..backends import program as rank_program
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
        self.fast = None        # the rank program, where a run of host tiles can replay it
        if comp is None:
            dpp = ctx.devices_per_process
            coll = base.collective_reduce_ok(p.dtype, be)
            need = base.groups_needed(p, dpp, coll,
                                      lambda s: be.choose(s.table_op, s.nbytes, len(s.ranks), device_kind), device_kind)
            for b in be.members():
                b.prepare_groups(need.get(b.name, []), deadline)
            if len(be.members()) == 1 and be.wire == "numpy":
                self.fast = base._rank_program(p, ctx.rank, dpp, coll)
                self.specs = base.out_specs(p, ctx.rank, dpp)

    def run(self, shards, like, fences, deadline, out=None, parity=0):
        ctx = self.ctx
        f = self.fast
        if f is not None:
            host = (shards, like, out) if type(like) is np.ndarray else numpy_views(shards, like, out)
            if host is not None and rank_program.fits(f, host[0]):
                # what the Execution would do for these tiles, worked out at construction
                b = self.be.members()[0]
                res = base.result_tiles(self.plan, self.specs, host[1], host[2])
                for _ in rank_program.run(f, host[0], res, b, half(self.tags, parity),
                                          lambda works: b.wait_all(works, deadline), base.issued):
                    pass
                if host[0] is not shards:   # torch tiles: torch results over the same memory
                    res = torch_results(res, out)
                return res, None            # host tiles: nothing for a consumer to wait on
        ex = (base.Execution if self.comp is None else CompressedExecution)(
            self.plan, shards, like, rank=ctx.rank, devices_per_process=ctx.devices_per_process, backend=self.be,
            device_kind=self.device_kind, producer_fences=fences, compression=self.comp, tags=half(self.tags, parity),
            out=out)
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
