"""SPMD worker that leaves without meshcomm.finalize(): collective reduces of integers over
gloo (the torch backend), then the interpreter exits. The process must exit with status 0
(before the context was finalized at exit, gloo's teardown sometimes aborted it).
--plan: every collective as its reshard plan (`native_call.MODE = "plan"`: the reduces run
as gloo reduces of the plan, not as one native call).
--early: the last rank leaves after one run of an all_reduce Program (over MPI) that the
others run again: its exit says BYE, so they raise PeerError naming it within seconds
instead of waiting out MESHCOMM_TIMEOUT."""
import sys
import time

import numpy as np

import meshcomm as mc
from meshcomm.errors import PeerError
from meshcomm.runtime import native_call

if "--plan" in sys.argv[1:]:
    native_call.MODE = "plan"           # alike on every process, before any Program
ctx = mc.init(backend="mixed")
mesh = mc.Mesh(np.arange(ctx.world_size), ("x",))
if "--early" in sys.argv[1:]:
    prog = mc.Program.all_reduce(mesh, "x", shape=(3,), dtype="int32", backend="mpi")
    assert prog(np.ones(3, np.int32))[0] == ctx.world_size
    last = ctx.world_size - 1
    if ctx.rank != last:
        t0 = time.monotonic()
        try:
            prog(np.ones(3, np.int32))
            raise AssertionError("a run without the last rank returned")
        except PeerError as e:          # its own, or relayed by the first to find it
            assert f"rank {last}, which called finalize() (or exited)" in str(e), e
        assert time.monotonic() - t0 < 5, time.monotonic() - t0
    print(f"RESULT rank {ctx.rank} ok", flush=True)
    sys.exit(0)
x = np.full(3, ctx.rank + 1, np.int32)
for _ in range(3):
    r = mc.reduce(x, mesh, "x", root=1, backend="torch")
    y = mc.all_reduce(x, mesh, "x", backend="torch")
    assert (y == sum(range(1, ctx.world_size + 1))).all(), y
print(f"RESULT rank {ctx.rank} ok", flush=True)
