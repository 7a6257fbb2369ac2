"""`meshcomm.Program`: the public class, with its constructors (every process constructs with
the same arguments; see meshcomm/runtime/program.py for what a Program is and docs/runtime.md
for how it runs)."""
from __future__ import annotations

from . import alltoall_call, batch_call, collective_call, program, reshard_call

__all__ = ["Program"]


class Program(program.Program):
    """A communication program with fixed layouts, shapes, dtypes, backend and options.

    Construct it on every process with the same arguments (`Program.reshard`,
    `Program.all_reduce`, ...): that agrees and plans once. `prog(x)` runs it, sending only
    data; `prog(x, async_op=True)` gives a Handle; `out=` takes result buffers.
    """

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def reshard(cls, src, dst, *, shape, dtype, backend=None, compression=None, device=None) -> "Program":
        """`device` ("cpu" or "cuda"): where the tiles live, for a process that holds none."""
        return reshard_call.program(src, dst, shape, dtype, backend, compression, device)

    @classmethod
    def reshard_many(cls, src, dst, *, shapes, dtypes, backend=None, bucket_mb=None, compression=None,
                     device=None):
        """`device` ("cpu" or "cuda"): where the tiles live, for a process that holds none."""
        return batch_call.program(src, dst, shapes, dtypes, backend, bucket_mb, compression, device)

    @classmethod
    def all_to_all_v(cls, mesh, axis, *, rows=(), dtype, backend=None, topology=None, algorithm="auto"):
        """Runs take (x, send_counts, recv_counts=None): counts are data, exchanged per run."""
        return alltoall_call.program(mesh, axis, rows, dtype, backend, topology, algorithm)

    # collectives: `shape` is this process's tile (None where it owns no device of the mesh,
    # or is not the root of a broadcast/scatter); `device` "cpu" or "cuda"
    @classmethod
    def all_reduce(cls, mesh, axes, *, shape, dtype, op="sum", backend=None, compression=None, device="cpu"):
        return _collective("all_reduce", mesh, axes, shape, dtype, backend, device, reduce_op=op,
                           compression=compression)

    @classmethod
    def all_gather(cls, mesh, axes, *, shape, dtype, dim=0, backend=None, compression=None, device="cpu"):
        return _collective("all_gather", mesh, axes, shape, dtype, backend, device, dim=dim, compression=compression)

    @classmethod
    def reduce_scatter(cls, mesh, axes, *, shape, dtype, dim=0, op="sum", backend=None, compression=None,
                       device="cpu"):
        return _collective("reduce_scatter", mesh, axes, shape, dtype, backend, device, dim=dim, reduce_op=op,
                           compression=compression)

    @classmethod
    def broadcast(cls, mesh, axes, *, shape, dtype, root=0, backend=None, device="cpu"):
        return _collective("broadcast", mesh, axes, shape, dtype, backend, device, root=root)

    @classmethod
    def reduce(cls, mesh, axes, *, shape, dtype, root=0, op="sum", backend=None, device="cpu"):
        return _collective("reduce", mesh, axes, shape, dtype, backend, device, root=root, reduce_op=op)

    @classmethod
    def all_to_all(cls, mesh, axes, *, shape, dtype, split_dim=0, concat_dim=0, backend=None, device="cpu"):
        return _collective("all_to_all", mesh, axes, shape, dtype, backend, device, split_dim=split_dim,
                           concat_dim=concat_dim)

    @classmethod
    def gather(cls, mesh, axes, *, shape, dtype, root=0, dim=0, backend=None, device="cpu"):
        return _collective("gather", mesh, axes, shape, dtype, backend, device, root=root, dim=dim)

    @classmethod
    def scatter(cls, mesh, axes, *, shape, dtype, root=0, dim=0, backend=None, device="cpu"):
        return _collective("scatter", mesh, axes, shape, dtype, backend, device, root=root, dim=dim)


program.CLASS[0] = Program


def _collective(op, mesh, axes, shape, dtype, backend, device, **kw):
    return collective_call.program(collective_call.shared_request(op, mesh, axes, **kw), shape, dtype, backend,
                                   device)
