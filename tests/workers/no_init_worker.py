"""Under a launcher without meshcomm.init: every entry point refuses to run alone (each process
would compute its own one-process result); init(backend="local") or backend="local" says so.
Writes `rank<r>.json` into the folder given as its argument (two ranks printing at once can
share one line of mpiexec's output)."""
import json
import os
import sys

import numpy as np

import meshcomm as mc

mesh = mc.Mesh([0, 1, 2, 3], ("x",))
x = {d: np.full(2, float(d)) for d in mesh.device_ids}
src, dst = mc.Layout(mesh, ("x",)), mc.Layout(mesh, ())
calls = {
    "all_reduce": lambda **kw: mc.all_reduce(x, mesh, "x", **kw),
    "reshard": lambda **kw: mc.reshard(mc.shard(np.arange(8.0), src), src, dst, **kw),
    "all_to_all_v": lambda **kw: mc.all_to_all_v(x, {d: [1, 0, 1, 0] for d in mesh.device_ids}, mesh, "x", **kw),
    "Program.all_reduce": lambda **kw: mc.Program.all_reduce(mesh, "x", shape=(2,), dtype="float64", **kw),
}
res = {}
for name, fn in calls.items():
    try:
        fn()
        res[name] = "ran"
    except RuntimeError as e:
        res[name] = "refused" if "meshcomm.init" in str(e) and "launcher with" in str(e) else f"other: {e}"
    res[name + ":local"] = "ran" if fn(backend="local") is not None else "none"
mc.init(backend="local")
res["after_init_local"] = float(mc.all_reduce(x, mesh, "x")[0][0])
mc.finalize()
rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or str(os.getpid())
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
