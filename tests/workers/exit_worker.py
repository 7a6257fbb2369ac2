"""SPMD worker that leaves without meshcomm.finalize(): collective reduces of integers over
gloo (the torch backend), then the interpreter exits. The process must exit with status 0
(before the context was finalized at exit, gloo's teardown sometimes aborted it).
--plan: every collective as its reshard plan (`native_call.MODE = "plan"`: the reduces run
as gloo reduces of the plan, not as one native call)."""
import sys

import numpy as np

import meshcomm as mc
from meshcomm.runtime import native_call

if "--plan" in sys.argv[1:]:
    native_call.MODE = "plan"           # alike on every process, before any Program
ctx = mc.init(backend="mixed")
mesh = mc.Mesh(np.arange(ctx.world_size), ("x",))
x = np.full(3, ctx.rank + 1, np.int32)
for _ in range(3):
    r = mc.reduce(x, mesh, "x", root=1, backend="torch")
    y = mc.all_reduce(x, mesh, "x", backend="torch")
    assert (y == sum(range(1, ctx.world_size + 1))).all(), y
print(f"RESULT rank {ctx.rank} ok", flush=True)
