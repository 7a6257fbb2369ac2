"""meshcomm: move sharded tensors between device meshes.

    import meshcomm as mc
    mesh = mc.Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    src = mc.Layout(mesh, ("x", None))
    dst = mc.Layout(mc.Mesh([[8, 9], [10, 11]], ("x", "y")), (None, ("x", "y")))
    y = mc.reshard(mc.shard(x, src), src, dst)
"""
import os as _os

# planners/, backends/ and cuda/ sit at the repository's top level but import as
# meshcomm.planners, meshcomm.backends and meshcomm.cuda. A wheel or an editable install maps
# them (pyproject's package-dir); in a plain checkout (the repository root on sys.path, no
# install) the package's search path is extended with the repository root, which holds them.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "planners", "__init__.py")) \
        and _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _ROOT not in __path__:
    __path__.append(_ROOT)

from .mesh import Mesh  # noqa: E402
from .layout import Blocks, Layout
from . import planners
from .planners import Plan, Transfer, Topology, verify
from .api import plan, reshard, reshard_many, shard, unshard
from .handle import Handle
from .caches import clear_caches
from .runtime import init, finalize
from . import log  # noqa: F401  (meshcomm.log.start / stop / tag)

__version__ = "0.1.0"

__all__ = ["Mesh", "Layout", "Blocks", "Topology", "Plan", "Transfer", "plan", "reshard",
           "shard", "unshard", "verify", "Handle", "planners", "init", "finalize", "clear_caches", "Program",
           "reshard_many"]
from .alltoall import all_to_all_v; __all__ += ["all_to_all_v"]  # noqa: E402,E702
from .planners.bounds import lower_bound; __all__ += ["lower_bound"]  # noqa: E402,E702
from .planning import plan_many; __all__ += ["plan_many"]  # noqa: E402,E702
from .collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather, recv,  # noqa: E402
                          reduce, reduce_scatter, scatter, send)
from . import compression  # noqa: E402,F401
from .runtime.programs import Program  # noqa: E402  (after collectives: its layouts come first)
__all__ += ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather",
            "scatter", "barrier", "send", "recv", "compression"]
