"""Process-wide state: which backend this process runs under and which devices it owns.

Without `meshcomm.init(...)` there is no context and one process owns every device.
Under a launcher (`mpiexec`, or `torchrun` for the torch backend)::

    ctx = meshcomm.init(backend="mpi" | "torch" | "mixed", devices_per_process=1)
    y = meshcomm.reshard(x, src, dst)       # SPMD: every process calls it with its own tiles
    meshcomm.finalize()

* Device d belongs to rank d // devices_per_process (`ctx.owned_devices(mesh)`).
* "mpi" needs mpiexec; "torch" runs under torchrun or mpiexec (rank, world size and
  MASTER_ADDR/MASTER_PORT then come from MPI); "mixed" needs mpiexec and runs both, picking
  one per transfer from the tuning table (`MESHCOMM_TUNING`). Under "mixed",
  `reshard(..., backend="mpi" | "torch")` forces one of them.
* Every process passes the src tiles it owns (a dict, or a bare array when it owns one src
  device); entries for devices other processes own are ignored, so SPMD code may pass
  `meshcomm.shard(x, src)` whole. It gets back the dst tiles it owns.
* `reshard` validates locally, then (by default) all processes exchange a little metadata:
  their shape/dtype/tile shapes (a process holding no src tile learns shape and dtype this
  way), the array kind, the backend, and fingerprints of the layouts and of the plan
  (`Plan.fingerprint`). Processes that disagree, or a process whose input is invalid, make
  every process raise the same `ValueError` (`TypeError` on the faulty one) naming the
  ranks. Above 8 processes (or with MESHCOMM_CHECK_EXCHANGE=allreduce) the exchange is
  first one MIN-allreduce of hashes of these fields (O(log N) messages per process instead
  of 2(N-1)); when every process knows shape and dtype and all agree, that decides. Else
  (disagreement, an error, a shape to infer) every process sees so in the same reduced
  vector and runs the allgather, which names who differs. A timeout in the allreduce names
  all other ranks: a collective cannot tell which one is missing.
  Set `MESHCOMM_CHECK=0` to skip the exchange when both `shape=` and `dtype=` are
  given (pass them on every process or on none; a process without src tiles then gets
  torch tensors when `dtype` is a torch dtype, NumPy arrays otherwise).
  With the MPI backend a process that holds src tiles and knows the plan starts its first
  stage (non-blocking) before the exchange completes, so the check costs no extra round
  trip; if the processes turn out to disagree, all of them drop those messages by moving
  to fresh communicators (collectively) and raise. Only plans whose sub-communicators
  exist already start early; `MESHCOMM_OPTIMISTIC=0` turns this off. A process holding
  no src tile starts early too when the same layouts were resharded before: it guesses
  the shape/dtype agreed last time; a wrong guess anywhere makes every process reset and
  run the call again without guessing.
* Timeouts: a peer that never calls `init` makes `init` raise `PeerTimeoutError` on the
  others within `MESHCOMM_TIMEOUT` (under MPI it is named; under torchrun the rendezvous
  error names the group). A peer that does not arrive (or dies) makes `reshard` raise
  `meshcomm.errors.PeerTimeoutError` naming it, within `MESHCOMM_TIMEOUT` seconds
  (default 300; `init(timeout=...)` overrides) of the call starting to communicate. After
  such an error the context should be finalized.
* Asynchronous use: `reshard(..., async_op=True)` returns a `meshcomm.Handle`; its
  communication runs on the context's background thread while the caller computes. All
  calls of a context communicate one at a time, in call order (a synchronous call first
  waits for the asynchronous ones issued before it, then runs on the calling thread), so
  every process serializes them the same way. Call reshard from one thread per process.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import threading
import time
from typing import Any, Mapping

import numpy as np

__all__ = ["init", "finalize", "current", "Context", "BACKEND_NAMES"]

BACKEND_NAMES = ("mpi", "torch", "mixed")
_CTX = None


def current():
    """The active distributed context, or None (single process owns all devices)."""
    return _CTX


def _set(ctx) -> None:
    global _CTX
    _CTX = ctx


def _timeout(timeout) -> float:
    if timeout is None:
        v = os.environ.get("MESHCOMM_TIMEOUT")
        try:
            timeout = float(v) if v else 300.0
        except ValueError:
            raise ValueError(f"MESHCOMM_TIMEOUT must be a number of seconds, got {v!r}") from None
    timeout = float(timeout)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    return timeout


def init(backend: str = "mpi", devices_per_process: int = 1, timeout: float | None = None) -> "Context":
    """Join the launcher's processes and set the process-wide context (see module doc)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, (int, np.integer)) \
            or devices_per_process < 1:
        raise ValueError(f"devices_per_process must be a positive int, got {devices_per_process!r}")
    timeout = _timeout(timeout)
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
    return ctx


def finalize() -> None:
    """Wait for outstanding work, free communicators/process groups, clear the context."""
    ctx = _CTX
    if ctx is None:
        return
    try:
        ctx.close()
    finally:
        _set(None)


class Context:
    """One process's view of a launched job; `meshcomm.reshard` delegates to `reshard`."""

    def __init__(self, backend_name: str, backends: Mapping[str, Any], devices_per_process: int,
                 timeout: float):
        self.backend_name = backend_name
        self._backends = dict(backends)
        main = self._backends[backend_name]
        self.rank, self.world_size = main.rank, main.world_size
        self.devices_per_process = devices_per_process
        self.timeout = timeout
        for b in self._backends.values():
            b.timeout = timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshcomm-comm")
        self._lock = threading.Lock()       # one communication at a time, in call order
        self._last: concurrent.futures.Future | None = None
        self._agreed: dict = {}     # (src, dst, backend) -> last agreed (shape, dtype, kind, device)

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

    def primitives(self, name: str | None = None):
        """A concrete backend (isend/irecv/bcast/reduce/wait_all) for code beside reshard
        (all-to-all). Under "mixed" the tuning table's "alltoall" rule for this world picks it."""
        be = self.get_backend(name)
        if be.name == "mixed":
            be = be.choose("alltoall", 0, self.world_size, "cpu")
        return be

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run `fn` on this context's communication thread, after every reshard issued before
        it (use it for other communication, so that tags and order never interleave)."""
        def locked():
            with self._lock:
                return fn(*args, **kwargs)
        self._last = self._pool.submit(locked)
        return self._last

    def _call(self, fn, *args, **kwargs):
        """Run `fn` now on the calling thread, after the asynchronous work issued before
        (a synchronous call skips the hand-off to the communication thread)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])
        with self._lock:
            return fn(*args, **kwargs)

    # -- ownership ---------------------------------------------------------------------
    def rank_of(self, device: int) -> int:
        return int(device) // self.devices_per_process

    def owned_devices(self, mesh_or_devices) -> tuple[int, ...]:
        """The devices of a Mesh, Layout or iterable of ids that this process owns."""
        from .layout import Layout
        from .mesh import Mesh
        if isinstance(mesh_or_devices, Layout):
            mesh_or_devices = mesh_or_devices.mesh
        if isinstance(mesh_or_devices, Mesh):
            return _owned(mesh_or_devices, self.rank, self.devices_per_process)
        devs = [int(d) for d in mesh_or_devices]
        return tuple(d for d in devs if self.rank_of(d) == self.rank)

    def _check_owners(self, layout, what):
        n = self.world_size * self.devices_per_process
        bad = [d for d in layout.mesh.device_ids if d >= n]
        if bad:
            raise ValueError(f"{what} mesh device(s) {bad[:8]} have no process: with {self.world_size} "
                             f"processes and devices_per_process={self.devices_per_process}, device d "
                             f"belongs to rank d // {self.devices_per_process}, so ids must be < {n}")

    # -- reshard -----------------------------------------------------------------------
    def reshard(self, x, src, dst, *, shape=None, dtype=None, backend=None, async_op=False):
        from . import api, arrays
        from .api import Handle
        from meshcomm.backends import streams
        api._check_layouts(src, dst)
        be = self.get_backend(backend)
        check = os.environ.get("MESHCOMM_CHECK", "1") != "0"
        owned_src, owned_dst = self.owned_devices(src), self.owned_devices(dst)
        err, shards, bare, kind = None, {}, False, None
        local_shape, name, itemsize, devtype = None, None, None, None
        try:
            self._check_owners(src, "src")
            self._check_owners(dst, "dst")
            if isinstance(x, Mapping):      # tiles of devices other processes own: ignored
                api._check_keys(x, src, "src")
                x = {d: v for d, v in x.items() if d in owned_src}
            shards, bare = api.normalize_input(x, src, owned=owned_src)
            missing = [d for d in owned_src if d not in shards]
            if missing:
                raise ValueError(f"rank {self.rank} owns src device(s) {missing[:8]} but x holds no "
                                 f"tile for them (every process passes the src tiles it owns)")
            if bare and len(owned_dst) > 1:
                raise ValueError(f"a bare array in gives a bare array out, but rank {self.rank} owns "
                                 f"{len(owned_dst)} dst devices {list(owned_dst)}; pass a dict")
            local_shape, name, itemsize = api.resolve_shape_dtype(shards, src, shape, dtype)
            if local_shape is not None:
                api._check_tile_shapes(shards, src.tiles(local_shape), "src")
            if shards:
                first = next(iter(shards.values()))
                kind = arrays.kind_of(first)
                dev = streams.device_of(first)
                devtype = dev.type if dev is not None else "cpu"
        except (ValueError, TypeError) as e:
            err = e
        need_exchange = check or shape is None or dtype is None
        if err is not None and not need_exchange:
            raise err
        if kind == "jax":
            shards = {d: np.asarray(v) for d, v in shards.items()}
        fences = {}
        for v in shards.values():
            dev = streams.device_of(v)
            if streams.is_cuda(dev) and dev not in fences:
                fences[dev] = streams.fence_from_current(dev)
        if not fences:
            fences[None] = streams.fence_from_current(None)
        job = dict(be=be, src=src, dst=dst, shards=shards, shape_kw=shape, dtype_kw=dtype,
                   local=(err, local_shape, name, itemsize, kind, devtype),
                   need_exchange=need_exchange, fences=tuple(fences.values()))
        if async_op:
            fut = self.submit(self._run, **job)
            result = fut.result
        else:
            res = self._call(self._run, **job)
            result = lambda: res  # noqa: E731

        def finish():
            out, done, out_kind = result()
            for d, v in out.items():
                done.wait_on(streams.current_stream(streams.device_of(v)))
                break
            if out_kind == "jax":
                import jax
                out = {d: jax.device_put(v, arrays.jax_device(d)) for d, v in out.items()}
            if bare:
                return next(iter(out.values())) if out else None
            return out
        if async_op:
            return Handle(finish)
        return finish()

    def _run(self, be, src, dst, shards, shape_kw, dtype_kw, local, need_exchange, fences):
        from . import api, arrays
        from meshcomm.backends import base
        if "torch" in sys.modules:      # if another thread is importing torch, wait for it
            import torch  # noqa: F401
        err, shape, name, itemsize, kind, devtype = local
        deadline = time.monotonic() + self.timeout
        ex = None
        run_kw = dict(rank=self.rank, devices_per_process=self.devices_per_process, backend=be,
                      producer_fences=fences)
        if need_exchange:
            plan_fp = guess = None
            opt = False
            key = (src, dst, getattr(be, "signature", be.name))
            if err is None and shape is not None and name is not None:
                p = api.plan(shape, name, src, dst)
                plan_fp = p.fingerprint
                if _optimistic(be) and shards:
                    # Start the first stage now, before the exchange confirms the plan (its
                    # messages travel while the metadata does); undone below on disagreement.
                    ex = base.Execution(p, shards, next(iter(shards.values())),
                                        device_kind=devtype or "cpu", **run_kw)
            elif err is None and not shards and _optimistic(be) and key in self._agreed:
                # No src tile here: guess what the last call with these layouts agreed on.
                g = self._agreed[key]
                if (shape is None or shape == g[0]) and (name is None or name == g[1]):
                    p = api.plan(g[0], g[1], src, dst)
                    guess = (p.fingerprint, g[3], g[4])
                    ex = base.Execution(p, {}, _empty_like(g[3], g[1], g[4]),
                                        device_kind=g[4] or "cpu", **run_kw)
            if ex is not None:
                if ex.groups_ready():
                    ex.start()
                    opt = True
                else:
                    ex, guess = None, None
            blob = {"err": None if err is None else (type(err).__name__, str(err)),
                    "layouts": _layouts_fp(src, dst), "desc": None,
                    "backend": getattr(be, "signature", be.name), "shape": shape,
                    "dtype": None if name is None else (name, itemsize),
                    "tiles": {d: tuple(v.shape) for d, v in shards.items()},
                    "kind": kind, "devtype": devtype, "plan": plan_fp, "opt": opt, "guess": guess}
            agreed_fast = None
            if _check_exchange(be) == "allreduce":
                # one small allreduce; None when it cannot decide (a rank lacks the shape or
                # dtype, or has an error) or the ranks disagree: then the allgather below runs
                # on every rank (all see the same reduced vector) and names who and what
                agreed_fast = _agree_collective(be.allreduce_min(_check_vector(blob), deadline), blob)
            if agreed_fast is not None:
                shape, name, itemsize, kind, devtype = agreed_fast
                base.issued[("allreduce_check", be.name)] += 1
            else:
                blob["desc"] = f"src={src} dst={dst}"     # read only when layouts disagree
                blobs = be.allgather_obj(blob, deadline)
                try:
                    if err is not None:
                        raise err
                    shape, name, itemsize, kind, devtype = _agree(blobs, src, self.rank)
                except (ValueError, TypeError):
                    if any(b["opt"] for b in blobs):     # every rank sees this: all reset together
                        self._reset(be, ex)
                    raise
                agreed = (api.plan(shape, name, src, dst).fingerprint, kind, devtype)
                if any(b["guess"] is not None and tuple(b["guess"]) != agreed for b in blobs):
                    self._reset(be, ex)                   # a wrong guess somewhere: all start over
                    ex = None
            if len(self._agreed) > 256:
                self._agreed.clear()
            self._agreed[key] = (shape, name, itemsize, kind, devtype)
        else:
            shape = src.check_shape(api.normalize_shape(shape_kw))
            name, itemsize = arrays.normalize_dtype(dtype_kw)
            if kind is None:
                kind = "torch" if type(dtype_kw).__module__.startswith("torch") else "numpy"
                devtype = "cpu"
        if ex is None:
            p = api.plan(shape, name, src, dst)
            like = next(iter(shards.values())) if shards else _empty_like(kind, name, devtype)
            ex = base.Execution(p, shards, like, device_kind=devtype or "cpu", **run_kw)
            ex.prepare(deadline)
        out, done = ex.finish(deadline)
        return out, done, kind

    def _reset(self, be, ex):
        if ex is not None:
            ex.abort()
        be.reset()
        from meshcomm.backends import base
        base.issued[("reset", be.name)] += 1

    def close(self):
        self._pool.shutdown(wait=True)
        for name in ("mixed", "torch", "mpi"):
            b = self._backends.get(name)
            if b is not None:
                b.close()


@functools.lru_cache(maxsize=1024)
def _owned(mesh, rank: int, dpp: int) -> tuple[int, ...]:
    return tuple(d for d in mesh.device_ids if d // dpp == rank)


def _optimistic(be) -> bool:
    """Whether a process may start sending before the metadata exchange confirms the plan
    (MPI only: a disagreement then resets its communicators; MESHCOMM_OPTIMISTIC=0 turns
    it off)."""
    return be.name == "mpi" and os.environ.get("MESHCOMM_OPTIMISTIC", "1") != "0"


def _check_exchange(be) -> str:
    """How the metadata check travels: "allgather" (every rank's blob to every rank: names a
    missing peer exactly, O(world) messages per rank) or "allreduce" (a min-allreduce of
    hashes: O(log world); a timeout can only name the group). MESHCOMM_CHECK_EXCHANGE=
    auto|allgather|allreduce; auto takes allreduce above 8 processes."""
    mode = os.environ.get("MESHCOMM_CHECK_EXCHANGE", "auto")
    if mode not in ("auto", "allgather", "allreduce"):
        raise ValueError(f"MESHCOMM_CHECK_EXCHANGE must be auto, allgather or allreduce, got {mode!r}")
    if mode == "auto":
        return "allreduce" if be.world_size > 8 else "allgather"
    return mode


_NONE = int(np.iinfo(np.int64).max)         # "no value" in the check vector (loses every min)
_CHECKED = ("layouts", "backend", "shape", "dtype", "plan", "kind", "devtype")
_CODES = {"kind": ("numpy", "torch", "jax"), "devtype": ("cpu", "cuda")}


def _h62(v) -> int:
    """A hash of repr(v), the same in every process (unlike hash()), in [0, 2**62)."""
    import hashlib
    return int.from_bytes(hashlib.blake2b(repr(v).encode(), digest_size=8).digest(), "little") >> 2


def _check_vector(blob) -> np.ndarray:
    """[ineligible, min part of each field, min part of each negated field]: after a
    MIN-allreduce, a field agrees on every rank that has it when min == max."""
    eligible = blob["err"] is None and all(blob[k] is not None for k in ("shape", "dtype", "plan"))
    return _check_row(tuple(blob[k] for k in _CHECKED), eligible)


@functools.lru_cache(maxsize=1024)
def _check_row(fields, eligible: bool) -> np.ndarray:
    vals = []
    for k, v in zip(_CHECKED, fields):
        if v is None:
            vals.append(None)
        elif k in _CODES:
            vals.append(_CODES[k].index(v) + 1)
        else:
            vals.append(_h62(v))
    lo = [_NONE if v is None else v for v in vals]
    neg_hi = [_NONE if v is None else -v for v in vals]
    row = np.array([0 if eligible else -1] + lo + neg_hi, dtype=np.int64)
    row.setflags(write=False)           # cached: shared by every call with these fields
    return row


def _agree_collective(out, blob):
    """(shape, dtype name, itemsize, kind, devtype) when every rank could decide and all
    agree, else None (the caller falls back to the allgather, which names who disagrees)."""
    n = len(_CHECKED)
    out = out.tolist()                  # Python ints: faster than NumPy on 15 elements
    lo, neg_hi = out[1:1 + n], out[1 + n:]
    # min == max where some rank has the field; _NONE where none has it (kind/devtype only)
    if out[0] != 0 or any(a != -b and a != _NONE for a, b in zip(lo, neg_hi)):
        return None
    k, d = lo[_CHECKED.index("kind")], lo[_CHECKED.index("devtype")]
    kind = _CODES["kind"][k - 1] if k != _NONE else "numpy"
    devtype = _CODES["devtype"][d - 1] if d != _NONE else "cpu"
    name, itemsize = blob["dtype"]
    return tuple(blob["shape"]), name, itemsize, kind, devtype


@functools.lru_cache(maxsize=1024)
def _layouts_fp(src, dst) -> str:
    import hashlib
    return hashlib.sha1(repr((src, dst)).encode()).hexdigest()[:16]


def _empty_like(kind, name, devtype):
    from .arrays import numpy_dtype
    if kind == "torch":
        import torch
        dev = "cpu"
        if devtype == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        return torch.empty(0, dtype=getattr(torch, name), device=dev)
    return np.empty(0, dtype=numpy_dtype(name))


def _ranks_str(groups: Mapping[Any, list[int]], fmt=str) -> str:
    return "; ".join(f"rank(s) {ranks}: {fmt(v)}" for v, ranks in groups.items())


def _group_by(blobs, key):
    out: dict = {}
    for r, b in enumerate(blobs):
        v = b[key]
        if v is not None:
            out.setdefault(v if not isinstance(v, list) else tuple(v), []).append(r)
    return out


def _agree(blobs, src, me):
    """Every process runs this on the same gathered blobs, so all raise the same error."""
    from . import api
    errs = [(r, b["err"]) for r, b in enumerate(blobs) if b["err"] is not None]
    if errs:
        raise ValueError("reshard failed on other process(es): " +
                         "; ".join(f"rank {r}: {t}: {m}" for r, (t, m) in errs[:4]))
    for key, what in (("layouts", "the src/dst layouts"), ("backend", "the backend"),
                      ("shape", "the global shape"), ("dtype", "the dtype"),
                      ("kind", "the array kind"), ("devtype", "the device type"),
                      ("plan", "the plan (Plan.fingerprint)")):
        g = _group_by(blobs, key)
        if len(g) > 1:
            if key == "layouts":
                desc = {v: blobs[rs[0]]["desc"] for v, rs in g.items()}
                detail = _ranks_str(g, lambda v: desc[v])
            else:
                detail = _ranks_str(g)
            raise ValueError(f"processes disagree on {what}: {detail}")
    shapes = _group_by(blobs, "shape")
    dtypes = _group_by(blobs, "dtype")
    kinds = _group_by(blobs, "kind")
    devtypes = _group_by(blobs, "devtype")
    tiles = {}
    for b in blobs:
        tiles.update(b["tiles"])
    shape = next(iter(shapes)) if shapes else api.infer_shape(src, tiles)
    if shape is None:
        raise ValueError("cannot infer the global shape from the src tiles of all processes "
                         f"(devices {sorted(tiles)[:8]}); pass shape= to reshard")
    if not dtypes:
        raise ValueError("no process holds a src tile, so the dtype is unknown; pass dtype=")
    name, itemsize = next(iter(dtypes))
    tiling = src.tiles(tuple(shape))
    for r, b in enumerate(blobs):
        for d, s in b["tiles"].items():
            want = tuple(e - a for a, e in tiling.boxes[d])
            if tuple(s) != want:
                raise ValueError(f"rank {r}: the tile for src device {d} has shape {tuple(s)} but the "
                                 f"src layout gives device {d} the box {list(tiling.boxes[d])} of shape "
                                 f"{want} (global shape {tuple(shape)})")
    kind = next(iter(kinds)) if kinds else "numpy"
    devtype = next(iter(devtypes)) if devtypes else "cpu"
    return tuple(shape), name, itemsize, kind, devtype
