"""meshcomm: move sharded tensors between device meshes.

    import meshcomm as mc
    mesh = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    src = mc.Layout(mesh, ("x", None))
    dst = mc.Layout(mc.Mesh([[8, 9], [10, 11]], ("x", "y")), (None, ("x", "y")))
    y = mc.reshard(mc.shard(x, src), src, dst)
"""
from .mesh import Mesh
from .layout import Blocks, Layout
from . import planners
from .planners import Plan, Transfer, Topology, verify
from .api import plan, reshard, shard, unshard, Handle
from .runtime import init, finalize

__version__ = "0.1.0"

__all__ = ["Mesh", "Layout", "Blocks", "Topology", "Plan", "Transfer", "plan", "reshard",
           "shard", "unshard", "verify", "Handle", "planners", "init", "finalize"]
from .alltoall import all_to_all_v; __all__ += ["all_to_all_v"]  # noqa: E402,E702
from .planners.bounds import lower_bound; __all__ += ["lower_bound"]  # noqa: E402,E702
