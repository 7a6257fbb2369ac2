"""Torch training through meshcomm's collectives: a DDP communication hook and FSDP2 custom
all-gather / reduce-scatter.

    import meshcomm as mc
    from meshcomm.adapters.torch_training import use_meshcomm
    mc.init(backend="torch")            # or "mixed": meshcomm sets up torch.distributed (gloo on CPU)
    ddp = DistributedDataParallel(model)
    use_meshcomm(ddp)                   # bucket all-reduce (avg) through mc.all_reduce
    fully_shard(layer) for each layer; fully_shard(model)
    use_meshcomm(model)                 # every FSDPModule: mc.all_gather / mc.reduce_scatter

`use_meshcomm(module, mesh=None, axes=None, *, backend=None, compression=None)` is the entry
point. `backend` picks meshcomm's backend per call ("mpi", "torch", "mixed"; None: the
context's), `compression` is passed to every collective as is.

* DDP (`DistributedDataParallel`): registers `allreduce_hook` with a `HookState`. The
  hook averages `bucket.buffer()` over the process's group along `axes` of `mesh`
  (default: a 1-d mesh "dp" with one device per process, i.e. the world) with
  `mc.all_reduce(..., op="avg", async_op=True)`, and returns a `torch.futures.Future`
  that a helper thread completes, once meshcomm's Handle is done, with the bucket buffer
  holding the result (what torch's default hooks return). The group must hold the ranks
  of DDP's process group.
* FSDP2 (`fully_shard`, torch >= 2.9): every `FSDPModule` under `module` gets a
  `MeshcommAllGather` and a `MeshcommReduceScatter` (FSDP's `AllGather`/`ReduceScatter`
  interfaces). Default mesh: FSDP's own DeviceMesh (global ranks, its dim names) with the
  shard dim as `axes`, each group along it in its process group's (ascending) rank order,
  as torch's collectives order it. Each call writes into FSDP's preallocated output. With
  `async_op=True` (explicit `unshard(async_op=True)`) the all-gather returns a
  `torch.distributed.Work` whose `wait()` waits for meshcomm and copies the result out;
  otherwise both run to completion before returning None (on CPU FSDP has no streams to
  order them). Reduce ops: SUM, AVG, PRODUCT, MIN, MAX and PREMUL_SUM (its factor applied
  to a copy of the input, then summed).

Device of rank r: r * devices_per_process (its first device). Each process must own exactly
one device of `mesh`, and the group along `axes` of that device must be the torch group's
ranks in the same order (FSDP puts rank i's shard at position i), else ValueError naming
both. Every process calls every collective (meshcomm is SPMD), so a mesh covers the world.
"""
# No `from __future__ import annotations`: DDP compares the hook's annotations with the real
# types (dist.GradBucket, torch.futures.Future[torch.Tensor]) and refuses strings.
import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import collectives, runtime
from .. import compression as codecs
from ..collectives.layouts import group_axes
from ..mesh import Mesh
from .dtensor import mesh_ranks_and_names

__all__ = ["use_meshcomm", "HookState", "allreduce_hook", "MeshcommAllGather", "MeshcommReduceScatter",
           "FSDPComms", "world_mesh", "mesh_of_device_mesh", "reduce_op_name"]


# -- meshes and groups -----------------------------------------------------------------
def _context(what: str):
    ctx = runtime.current()
    if ctx is None:
        raise RuntimeError(f"{what}: call meshcomm.init(backend=...) first (under mpiexec or torchrun)")
    return ctx


def world_mesh(axis: str = "dp") -> Mesh:
    """A 1-d mesh with one device per process (rank r: device r * devices_per_process)."""
    ctx = _context("world_mesh")
    return Mesh([r * ctx.devices_per_process for r in range(ctx.world_size)], (axis,))


def mesh_of_device_mesh(device_mesh) -> Mesh:
    """A torch DeviceMesh as a meshcomm Mesh: same shape and dim names (d0, d1, ... when it
    has none), device r * devices_per_process for global rank r."""
    ctx = _context("mesh_of_device_mesh")
    ranks, names = mesh_ranks_and_names(device_mesh)
    return Mesh(ranks * ctx.devices_per_process, names)


def _group_ranks(mesh: Mesh, axes: tuple[str, ...], what: str) -> list[int]:
    """The ranks, in group order, of this process's group along `axes` of `mesh`."""
    ctx = _context(what)
    own = ctx.ownership.owned(mesh)
    if len(own) != 1:
        raise ValueError(f"{what}: rank {ctx.rank} must own exactly one device of the mesh {mesh}, "
                         f"it owns {list(own)} (device d belongs to rank d // {ctx.devices_per_process})")
    for g in collectives.groups(mesh, axes):
        if own[0] in g:
            return [ctx.ownership.rank_of(d) for d in g]
    raise AssertionError("unreachable: every device of a mesh is in a group")


def _check_group(mesh, axes, group, what: str, ordered: bool) -> None:
    ranks = dist.get_process_group_ranks(group)
    mine = _group_ranks(mesh, axes, what)
    same = mine == list(ranks) if ordered else sorted(mine) == sorted(ranks)
    if not same:
        raise ValueError(f"{what}: the group along axes {axes} of mesh {mesh} holds ranks {mine}, but "
                         f"torch's process group holds ranks {list(ranks)}"
                         + (" (in this order)" if ordered else ""))


def reduce_op_name(op) -> tuple[str, float | None]:
    """A torch ReduceOp (or RedOpType) as meshcomm's op name and, for PREMUL_SUM, its factor."""
    R = dist.ReduceOp
    kind = getattr(op, "op", op)
    if kind == R.PREMUL_SUM:
        return "sum", float(op.factor)
    for k, name in ((R.SUM, "sum"), (R.AVG, "avg"), (R.PRODUCT, "prod"), (R.MIN, "min"), (R.MAX, "max")):
        if kind == k:
            return name, None
    raise ValueError(f"reduce op {op!r} has no meshcomm equivalent (SUM, AVG, PRODUCT, MIN, MAX, PREMUL_SUM)")


# -- completing torch futures / works from meshcomm handles ------------------------------
class _Completer:
    """One daemon thread per process: waits on meshcomm Handles in issue order (meshcomm runs
    them in that order) and completes a torch Future with `then(result)` or the error."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def complete(self, handle, fut: torch.futures.Future, then: Callable) -> torch.futures.Future:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="meshcomm-futures", daemon=True)
                self._thread.start()
        self._q.put((handle, fut, then))
        return fut

    def _loop(self):
        while True:
            handle, fut, then = self._q.get()
            try:
                value = then(handle.wait())
            except BaseException as e:  # noqa: BLE001  any error must reach the waiter, or it hangs
                fut.set_exception(e)
            else:
                fut.set_result(value)


_COMPLETER = _Completer()


class _HandleWork(dist.Work):
    """A torch.distributed Work over a meshcomm Handle: `wait()` waits, then `then(result)`."""

    def __init__(self, handle, then: Callable):
        super().__init__()
        self._handle, self._then, self._done = handle, then, False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._then(self._handle.wait())
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


def _copy_into(out: torch.Tensor) -> Callable:
    def then(res):
        out.copy_(res.reshape(out.shape))
        return out
    return then


# -- DDP --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HookState:
    """What `allreduce_hook` reduces over: the process's group along `axes` of `mesh`
    (default: `world_mesh()` and all its axes), with meshcomm `backend` and `compression`.
    Built after `meshcomm.init`; checks that this process owns one device of the mesh."""

    mesh: Mesh | None = None
    axes: Any = None
    backend: str | None = None
    compression: Any = None

    def __post_init__(self):
        mesh = world_mesh() if self.mesh is None else self.mesh
        axes = group_axes(mesh, mesh.axis_names if self.axes is None else self.axes)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "axes", axes)
        codecs.coerce(self.compression)         # a bad codec is named now, not in backward
        _group_ranks(mesh, axes, "HookState")

    @property
    def ranks(self) -> list[int]:
        """The ranks this process averages with, in group order."""
        return _group_ranks(self.mesh, self.axes, "HookState")


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over the state's group by
    `mc.all_reduce(..., op="avg", async_op=True)`; the future yields the bucket buffer."""
    buf = bucket.buffer()
    h = collectives.all_reduce(buf, state.mesh, state.axes, op="avg", backend=state.backend,
                               async_op=True, compression=state.compression)
    return _COMPLETER.complete(h, torch.futures.Future(), _copy_into(buf))


# -- FSDP2 ------------------------------------------------------------------------------
class _FSDPComm:
    def __init__(self, mesh: Mesh, axes, *, backend: str | None = None, compression=None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a meshcomm.Mesh, got {type(mesh).__name__}")
        self.mesh, self.axes = mesh, group_axes(mesh, axes)
        codecs.coerce(compression)              # a bad codec is named now, not in forward
        self.backend, self.compression = backend, compression
        self._checked: set = set()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check(self, group) -> None:
        if group not in self._checked:
            _check_group(self.mesh, self.axes, group, type(self).__name__, ordered=True)
            self._checked.add(group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh}, axes={self.axes}, backend={self.backend!r})"


class MeshcommAllGather(_FSDPComm, AllGather):
    """FSDP2 all-gather through `mc.all_gather(input, mesh, axes, dim=0)`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 async_op: bool = False):
        self._check(group)
        h = collectives.all_gather(input_tensor, self.mesh, self.axes, dim=0, backend=self.backend,
                                   async_op=True, compression=self.compression)
        return _returned(_HandleWork(h, _copy_into(output_tensor)), async_op)


def _returned(work, async_op: bool):
    """FSDP's contract: the Work when async, else wait and return None."""
    if async_op:
        return work
    work.wait()
    return None


class MeshcommReduceScatter(_FSDPComm, ReduceScatter):
    """FSDP2 reduce-scatter through `mc.reduce_scatter(input, mesh, axes, dim=0, op=...)`."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        self._check(group)
        name, factor = reduce_op_name(op)
        x = input_tensor if factor is None else input_tensor * factor
        h = collectives.reduce_scatter(x, self.mesh, self.axes, dim=0, op=name, backend=self.backend,
                                       async_op=True, compression=self.compression)
        return _returned(_HandleWork(h, _copy_into(output_tensor)), async_op)


@dataclasses.dataclass(frozen=True)
class FSDPComms:
    """What `use_meshcomm` installed on FSDP modules: one comm pair per (mesh, axes)."""

    modules: tuple
    all_gathers: tuple
    reduce_scatters: tuple


def _fsdp_mesh(module, what: str) -> tuple[Mesh, tuple[str, ...]] | None:
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None                                     # no parameters of its own
    info = groups[0].mesh_info
    mesh = mesh_of_device_mesh(info.mesh)
    if info.shard_mesh_dim is None:
        raise ValueError(f"{what}: {type(module).__name__} replicates only (no shard mesh dim)")
    # each group along the shard dim in its process group's order (ascending ranks, as torch's
    # new_group orders them), in which FSDP2's own collectives place the shards
    mesh = Mesh(np.sort(mesh.devices, axis=info.shard_mesh_dim), mesh.axis_names)
    return mesh, (mesh.axis_names[info.shard_mesh_dim],)


def use_meshcomm(module, mesh: Mesh | None = None, axes=None, *, backend: str | None = None,
                 compression=None):
    """Route a DDP model's gradient all-reduce, or every FSDP2 module's all-gather and
    reduce-scatter under `module`, through meshcomm. Returns the `HookState` (DDP) or
    `FSDPComms`. See the module docstring for the defaults of `mesh` and `axes`."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(module, DistributedDataParallel):
        state = HookState(mesh, axes, backend, compression)
        _check_group(state.mesh, state.axes, module.process_group, "use_meshcomm (DDP)", ordered=False)
        module.register_comm_hook(state, allreduce_hook)
        return state
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"use_meshcomm: expected a torch.nn.Module, got {type(module).__name__}")
    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not fsdp:
        raise TypeError(f"use_meshcomm: {type(module).__name__} is neither DistributedDataParallel nor "
                        "(under) a module that fully_shard was applied to")
    comms: dict = {}
    done = []
    for m in fsdp:
        if mesh is not None:
            key = (mesh, group_axes(mesh, mesh.axis_names if axes is None else axes))
        else:
            key = _fsdp_mesh(m, "use_meshcomm")
            if key is None:
                continue
            if axes is not None:
                key = (key[0], group_axes(key[0], axes))
        if key not in comms:
            comms[key] = (MeshcommAllGather(*key, backend=backend, compression=compression),
                          MeshcommReduceScatter(*key, backend=backend, compression=compression))
        ag, rs = comms[key]
        m.set_custom_all_gather(ag)
        m.set_custom_reduce_scatter(rs)
        done.append(m)
    return FSDPComms(tuple(done), tuple(c[0] for c in comms.values()), tuple(c[1] for c in comms.values()))
