"""The distributed runtime: Programs (agreed and planned once, run with nothing but data).

Without `meshcomm.init(...)` there is no context and one process owns every device (under a
launcher of several processes, a call then refuses to run alone unless told: init(backend=
"local") or backend="local"). Under a launcher (`mpiexec`, or `torchrun` for "torch")::

    ctx = meshcomm.init(backend="mpi" | "torch" | "mixed", devices_per_process=1)
    prog = meshcomm.Program.reshard(src, dst, shape=..., dtype=...)   # every process, once
    y = prog(x)                             # SPMD: every process runs it with its own tiles
    y = meshcomm.reshard(x, src, dst)       # an eager call: its cached Program
    meshcomm.finalize()

Device d belongs to rank d // devices_per_process. Construction agrees every field across
the processes (agreement.py) or all raise together; a run validates only this process's
input and sends only data; errors in a run travel on the control channel (control.py); a
missing peer raises PeerTimeoutError within MESHCOMM_TIMEOUT. Asynchronous runs go through
the context's queue thread: all calls of a context communicate one at a time, in call order.
The whole flow: docs/runtime.md.
"""
from .context import (BACKEND_NAMES, Context, check_backend_name, current, finalize, init, init_hint,
                      no_context, resolve_timeout)
from .ownership import Ownership, launcher_world_size

__all__ = ["init", "finalize", "current", "Context", "BACKEND_NAMES", "Ownership",
           "launcher_world_size", "resolve_timeout", "no_context", "init_hint", "check_backend_name"]
