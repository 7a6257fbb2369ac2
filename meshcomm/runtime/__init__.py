"""The distributed runtime: process lifecycle, device ownership, the agreement check, calls.

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
  Over MPI the check first sends a small vector of hashes to every process
  (backends/hash_round.py); where all agree it decides and the first stage starts. Where it
  cannot decide, a process that holds src tiles and knows the plan starts its first stage
  (non-blocking) beside the metadata exchange; if the processes turn out to disagree, all of them drop those messages by moving
  to fresh communicators (collectively) and raise. Only plans whose sub-communicators
  exist already start early; `MESHCOMM_OPTIMISTIC=0` turns this off. A process holding
  no src tile starts early too when the same layouts were resharded before: it guesses
  the shape/dtype agreed last time; a wrong guess anywhere makes every process reset and
  run the call again without guessing. Collectives do the same (collective_call.py): a
  gather hashes the tile sizes agreed last time, and over MPI a repeated native collective
  is posted beside the hashes on a communicator kept for its exact signature, so processes
  that disagree never meet in one MPI call.
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
from .context import (BACKEND_NAMES, Context, check_backend_name, current, finalize, init, init_hint,
                      no_context, resolve_timeout)
from .ownership import Ownership, launcher_world_size

__all__ = ["init", "finalize", "current", "Context", "BACKEND_NAMES", "Ownership",
           "launcher_world_size", "resolve_timeout", "no_context", "init_hint", "check_backend_name"]
