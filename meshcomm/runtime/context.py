"""The process-wide context: `init`/`finalize`, the backends, and the communication queue.

All calls of a context communicate one at a time, in call order: an asynchronous call runs
on the context's one background thread; a synchronous call first waits for the
asynchronous ones issued before it, then runs on the calling thread. So every process
serializes its calls the same way (call meshcomm from one thread per process).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import gc
import os
import threading
from typing import Any, Mapping

import numpy as np

from .. import log, settings
from ..caches import BoundedDict
from ..handle import QUEUE_THREAD
from . import control
from .ownership import Ownership, launcher_world_size

__all__ = ["init", "finalize", "current", "Context", "BACKEND_NAMES"]

BACKEND_NAMES = ("mpi", "torch", "mixed")
_CTX = None


ALL_BACKENDS = (None, "local") + BACKEND_NAMES


def check_backend_name(backend) -> None:
    """A ValueError for a name that is not a backend at all (e.g. "nccl", which is what the
    torch backend uses on CUDA)."""
    if backend not in ALL_BACKENDS:
        raise ValueError(f"backend must be one of None, 'local', 'mpi', 'torch', 'mixed', got {backend!r} "
                         "(NCCL and gloo run under backend='torch')")


def no_context(backend, what: str) -> None:
    """Checks for a call without a context (one process owns every device): `backend` must
    be None or "local"; under a launcher of several processes a call refuses to run alone
    unless it says so (`backend="local"` on the call, or `meshcomm.init(backend="local")`):
    each process would otherwise compute its own one-process result, silently."""
    check_backend_name(backend)
    if backend not in (None, "local"):
        raise ValueError(f"backend {backend!r} needs meshcomm.init(backend={backend!r}) under a "
                         f"launcher (mpiexec or torchrun); without one, {what} runs in this process")
    hint = init_hint() if backend is None and not _LOCAL else ""
    if hint:                    # "; this process runs under a launcher ...": after "{what}:"
        raise RuntimeError(f"{what}:{hint[1:]}; to run in this process alone, say so: "
                           "meshcomm.init(backend='local'), or backend='local' on the call")


def init_hint() -> str:
    """A sentence for errors of calls without a context that look like SPMD calls (under a
    context: a call given backend="local", which runs in this process alone)."""
    if _CTX is not None:
        return "; backend='local' runs the call in this process alone, so it takes every device's tile"
    n = launcher_world_size()
    if n > 1:
        return (f"; this process runs under a launcher with {n} processes but meshcomm.init() was "
                "not called: call meshcomm.init(backend='mpi'|'torch'|'mixed') first")
    return ""


def current():
    """The active distributed context, or None (single process owns all devices)."""
    return _CTX


def _set(ctx) -> None:
    global _CTX
    _CTX = ctx
    log.set_context(ctx)


def resolve_timeout(timeout) -> float:
    """`timeout` in seconds, or MESHCOMM_TIMEOUT's."""
    if timeout is None:
        return settings.get("TIMEOUT")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    return timeout


_LOCAL = False      # init(backend="local"): this process runs alone, under a launcher too


def init(backend: str = "mpi", devices_per_process: int = 1, timeout: float | None = None) -> "Context":
    """Join the launcher's processes and set the process-wide context (see meshcomm.runtime).
    `backend="local"`: no context; every call runs in this process, which owns every device
    (said explicitly, so that it is allowed under a launcher). Returns None then."""
    global _LOCAL
    if backend == "local":
        if _CTX is not None:
            raise RuntimeError(f"meshcomm is already initialised with backend={_CTX.backend_name!r}; call "
                               "meshcomm.finalize() first")
        _LOCAL = True
        return None
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES} or 'local', got {backend!r}")
    if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, (int, np.integer)) \
            or devices_per_process < 1:
        raise ValueError(f"devices_per_process must be a positive int, got {devices_per_process!r}")
    timeout = resolve_timeout(timeout)
    if _CTX is not None:
        if _CTX.backend_name == backend and _CTX.devices_per_process == devices_per_process:
            return _CTX
        raise RuntimeError(f"meshcomm is already initialised with backend={_CTX.backend_name!r}, "
                           f"devices_per_process={_CTX.devices_per_process}; call "
                           "meshcomm.finalize() first")
    from meshcomm.backends.torch_dist import under_torchrun
    backends: dict[str, Any] = {}
    if backend in ("mpi", "mixed"):
        from meshcomm.backends.mpi import MPIBackend
        mpi = MPIBackend(timeout=timeout)
        if under_torchrun() and mpi.world_size == 1 and int(os.environ["WORLD_SIZE"]) > 1:
            mpi.close()
            raise RuntimeError(f"backend {backend!r} needs MPI: launch with mpiexec (torchrun "
                               "starts no MPI job); under torchrun use backend='torch'")
        backends["mpi"] = mpi
    if backend in ("torch", "mixed"):
        from meshcomm.backends.torch_dist import TorchBackend
        comm = None
        if "mpi" in backends:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        backends["torch"] = TorchBackend.create(timeout, mpi_comm=comm)
    if backend == "mixed":
        from meshcomm.backends.mixed import MixedBackend
        backends["mixed"] = MixedBackend(backends["mpi"], backends["torch"])
    ctx = Context(backend, backends, int(devices_per_process), timeout)
    _set(ctx)
    control.install(ctx.channel)
    if not _EXIT_HOOK:
        atexit.register(_finalize_at_exit)
        _EXIT_HOOK.append(True)
    log.on_init(ctx)        # MESHCOMM_LOG, and the log's clock offset to rank 0 (every rank)
    return ctx


def finalize() -> None:
    """Wait for outstanding work and for every other process to call finalize() too (at most
    MESHCOMM_TIMEOUT; a process a timeout named is not waited for): a failure a peer reported
    by then raises here, as MPI_Finalize is collective. Then free communicators and process
    groups, and clear the context."""
    _finalize(wait=True)


def _finalize(wait: bool) -> None:
    global _LOCAL
    _LOCAL = False
    ctx = _CTX
    if ctx is None:
        return
    try:
        ctx.close(wait)
    finally:
        _set(None)


_EXIT_HOOK: list = []


def _finalize_at_exit() -> None:
    """A context still open at interpreter exit is finalized (its process groups freed while
    the interpreter still runs: gloo's, torn down later with its work done, sometimes
    aborted the process with 'terminate called without an active exception' and a
    non-zero exit status). Not while asynchronous work is still running: that could wait
    for a peer until the timeout; the process then exits as it would have before. Nor does
    it wait for the others to finalize (an exit is not a call): its BYE tells a peer stalled
    on it that it is gone."""
    ctx = _CTX
    if ctx is None or (ctx._last is not None and not ctx._last.done()):
        return
    try:
        _finalize(wait=False)
    except Exception as e:      # noqa: BLE001 - exiting anyway: say so, do not raise
        import sys
        print(f"meshcomm: finalize at exit failed: {type(e).__name__}: {e}", file=sys.stderr)


class Context:
    """One process's view of a launched job: its backends, the devices it owns, and the
    queue every communicating call goes through."""

    def __init__(self, backend_name: str, backends: Mapping[str, Any], devices_per_process: int,
                 timeout: float):
        self.backend_name = backend_name
        self._backends = dict(backends)
        main = self._backends[backend_name]
        self.rank, self.world_size = main.rank, main.world_size
        self.devices_per_process = devices_per_process
        self.ownership = Ownership(self.rank, self.world_size, devices_per_process)
        self.timeout = timeout
        for b in self._backends.values():
            b.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=QUEUE_THREAD)
        self._lock = threading.Lock()       # one communication at a time, in call order
        self._last: concurrent.futures.Future | None = None
        self.eager: dict = {}       # eager call signature -> its Programs (runtime/eager.py)
        self.quick = BoundedDict(1024)  # a bare NumPy collective's arguments as passed -> its lookup's arguments
        self.programs = 0           # Programs this process constructed (a count)
        self.counters: dict = {}    # processes (sorted ranks) -> Programs they constructed together
        self.seq: dict = {}         # processes (sorted ranks) -> [runs of their Programs] (program.seq_cell)
        self.group_programs: dict = {}  # processes (sorted ranks) -> their Programs' numbers (control.Channel.watch)
        self.tries: dict = {}       # (group key, counter) -> attempts that failed together (agreement)
        self.attempts = 0           # agreements this process took part in (their nonces)
        self.p2p: dict = {}         # ("send" | "recv", from device, to device) -> messages so far (collectives/p2p.py)
        self.channel = control.Channel(self.backend, self.rank, self.world_size, timeout)
        self.closed = False         # finalize() closed it: its Programs run no more

    def __repr__(self) -> str:
        return (f"Context(backend={self.backend_name!r}, rank={self.rank}/{self.world_size}, "
                f"devices_per_process={self.devices_per_process})")

    @property
    def backend(self):
        return self._backends[self.backend_name]

    def get_backend(self, name: str | None):
        if name is None:
            return self.backend
        if name not in self._backends:
            raise ValueError(f"backend {name!r} is not available in this context (initialised with "
                             f"backend={self.backend_name!r}; available: {sorted(self._backends)})")
        return self._backends[name]

    def backend_of(self, name):
        """The backend a call asked for (ValueError: an unknown or unavailable name)."""
        check_backend_name(name)
        if name == "local":
            raise ValueError("backend='local' runs in one process; under meshcomm.init every "
                             "process must take part in the same backend")
        return self.get_backend(name)

    def resolve_backend(self, name):
        """(backend, error): `backend_of(name)`, or the context's own backend and the error to
        share through the agreement."""
        try:
            return self.backend_of(name), None
        except ValueError as e:
            return self.backend, e

    def primitives(self, name: str | None = None):
        """A concrete backend (isend/irecv/bcast/reduce/wait_all) for code beside reshard
        (all-to-all). Under "mixed" the tuning table's "alltoall" rule for this world picks it."""
        be = self.get_backend(name)
        if be.name == "mixed":
            be = be.choose("alltoall", 0, self.world_size, "cpu")
        return be

    # -- ownership (kept as methods for callers of the 0.1 API) ----------------------------
    def rank_of(self, device: int) -> int:
        return self.ownership.rank_of(device)

    def owned_devices(self, mesh_or_devices) -> tuple[int, ...]:
        return self.ownership.owned(mesh_or_devices)

    # -- the queue -----------------------------------------------------------------------
    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run `fn` on this context's communication thread, after every call issued before it."""
        def locked():
            with self._lock:
                return fn(*args, **kwargs)
        self._last = self._pool.submit(locked)
        return self._last

    def call(self, fn, *args, **kwargs):
        """Run `fn` now on the calling thread, after the asynchronous work issued before."""
        last = self._last
        if last is not None and not last.done():
            concurrent.futures.wait([last])
        with self._lock:
            return fn(*args, **kwargs)

    def run(self, fn, async_op: bool) -> concurrent.futures.Future:
        """`fn()` through the queue: the Future of its result (done already unless `async_op`)."""
        if async_op:
            return self.submit(fn)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.call(fn))
        return fut

    def close(self, wait: bool = True):
        self.closed = True
        self._pool.shutdown(wait=True)
        try:
            self.channel.goodbye(wait, {r: (self.seq.get(r, [0])[0], self.counters.get(r, 0))
                                        for r in {*self.seq, *self.counters}})   # every peer's BYE, or a failure
            self.channel.raise_pending()     # a peer failed in a run this process finished
        finally:
            control.install(None)
            self.eager.clear()      # the Programs (buffers, works) go before their backends
            gc.collect()
            for name in ("mixed", "torch", "mpi"):     # the reverse of init: mixed wraps both
                if name in self._backends:
                    self._backends[name].close()
            gc.collect()            # gloo's works and groups, while the interpreter still runs
