"""torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors (same code).

* Point-to-point messages are queued as `P2POp`s and issued together with
  `batch_isend_irecv` when the executor waits (or before a collective, keeping the order).
* Broadcasts and reductions run on groups from `new_group`, cached by rank tuple.
  `new_group` must be called by every rank of the world in the same order, members or not:
  the executor calls `prepare_groups` on every rank with the groups of the whole plan, in
  plan order (see backends/base.py).
* Metadata (`allgather_obj`) goes through the c10d store: each rank sets a key and waits
  for the others' with a deadline, so a missing peer is named.
* Timeouts: the process group is created with timeout=MESHCOMM_TIMEOUT, and each wait
  passes the time left; a failure or timeout raises `PeerTimeoutError` naming the peer.
* Initialisation (`TorchBackend.create`): an existing default process group is reused;
  under torchrun, env:// rendezvous; under mpiexec, rank and world size come from MPI and
  rank 0 picks a free port and broadcasts MASTER_ADDR/MASTER_PORT.
* Native collectives (all_reduce, all_gather_single, ... with async_op=True on the cached
  groups; what gloo lacks is built from what it has): backends/torch_collectives.py.
* CUDA tensors on a process group without a CUDA backend (one the user made with gloo alone,
  e.g. several processes sharing one GPU, where NCCL refuses): point-to-point messages and
  reductions go through host copies (`stage_cuda`), as MPI's do: a send copies to the host on
  the current stream (the communication stream, after the packing), a receive lands in host
  memory and is copied to its tensor when waited for.
"""
from __future__ import annotations

import datetime
import functools
import os
import pickle
import socket
import time
from typing import Sequence

from meshcomm.errors import PeerTimeoutError

from . import pacing
from . import base as _base
from .base import Backend, Work
from .torch_collectives import CollWork, TorchCollectives, widened

__all__ = ["TorchBackend", "under_mpi_launcher", "under_torchrun"]


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def under_mpi_launcher() -> bool:
    return any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                         "PMIX_RANK", "MPI_LOCALRANKID", "HYDI_CONTROL_FD"))


_DERIVED: list = []     # non-empty once we set MASTER_ADDR/PORT from MPI ourselves
_INITS: list = []       # process groups this process created: each under its own store prefix


def _td(seconds):
    return datetime.timedelta(seconds=max(0.001, seconds))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _TorchWork(Work):
    __slots__ = ("work", "op", "peers", "buf")
    lingers = True

    def __init__(self, op, peers, buf, work=None):
        self.op, self.peers, self.buf, self.work = op, peers, buf, work

    def test(self) -> bool:
        return self.work is not None and self.work.is_completed()


class _Staged(_TorchWork):
    """A receive into a CUDA tensor through host memory (`stage_cuda`): copied to the
    tensor once waited for (`finish`, as the native collectives' unpadding is)."""
    __slots__ = ("device_buf",)

    def __init__(self, op, peers, host, device_buf):
        super().__init__(op, peers, host)
        self.device_buf = device_buf

    def finish(self) -> None:
        self.device_buf.copy_(self.buf)


def _cuda_backend(dist) -> str | None:
    """The name of the default process group's backend for CUDA tensors ("nccl", "gloo", ...),
    from its configuration ("gloo", "nccl", "cpu:gloo,cuda:nccl"); None without one."""
    try:
        name = str(dist.get_backend()).lower()
    except Exception:
        return None
    if ":" not in name:
        return name if name != "gloo" else None
    return dict(p.split(":", 1) for p in name.split(",") if ":" in p).get("cuda")


def _to_device(back, host, dev) -> None:
    if back is not None:
        back()
    dev.copy_(host)


class TorchBackend(TorchCollectives, Backend):
    name = "torch"
    wire = "torch"

    def __init__(self, rank: int, world_size: int, timeout: float | None, owns_pg: bool):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.owns_pg = owns_pg
        self.store = dist.distributed_c10d._get_default_store()
        self._groups: dict[tuple[int, ...], object] = {}
        self._batch: list = []          # (P2POp, _TorchWork) not issued yet
        self._meta_seq = 0
        self._ctl_read = 0             # control messages read from the store
        self._waiter = None            # threads that block in gloo's waits (wait_all)
        # gloo's point-to-point calls take host memory only: CUDA tensors go through host copies
        # where no CUDA backend (NCCL) is configured (module docstring)
        self.stage_cuda = _cuda_backend(dist) in (None, "gloo")
        _base.set_local_processes(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))

    @classmethod
    def create(cls, timeout: float | None, mpi_comm=None) -> "TorchBackend":
        """Join (or create) the default process group; see the module docstring."""
        import torch
        import torch.distributed as dist
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), timeout, owns_pg=False)
        if under_torchrun():
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        elif mpi_comm is not None or under_mpi_launcher():
            if mpi_comm is None:
                from mpi4py import MPI
                mpi_comm = MPI.COMM_WORLD
            from .mpi import INIT_TAG, timed_allgather
            rank, world = mpi_comm.Get_rank(), mpi_comm.Get_size()
            deadline = None if timeout is None else time.monotonic() + timeout
            hosts = timed_allgather(mpi_comm, socket.gethostname(), deadline, INIT_TAG + 1, timeout,
                                    "meshcomm.init", "did not call init")
            if rank == 0:
                user = not _DERIVED and "MASTER_ADDR" in os.environ   # the user chose them
                addr = os.environ["MASTER_ADDR"] if user else (
                    "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname()))
                port = int(os.environ["MASTER_PORT"]) if user and "MASTER_PORT" in os.environ \
                    else _free_port()      # a fresh store each time (re-init after finalize)
                info = (addr, port)
            else:
                info = None
            addr, port = timed_allgather(mpi_comm, info, deadline, INIT_TAG + 2, timeout,
                                         "meshcomm.init", "did not call init")[0]
            local = [i for i, h in enumerate(hosts) if h == hosts[rank]].index(rank)
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                              LOCAL_WORLD_SIZE=str(hosts.count(hosts[rank])))
            _DERIVED.append(True)
        else:                                   # no launcher: a world of one
            rank, world = 0, 1
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        backend = "gloo"
        if torch.cuda.is_available():
            backend = "cpu:gloo,cuda:nccl"
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local % torch.cuda.device_count())
        kw = {} if timeout is None else {"timeout": _td(timeout)}
        try:
            # torchrun's store outlives a process group, and a new one's rendezvous would read
            # the old one's addresses there (re-init after finalize): a prefix per init
            store = next(dist.rendezvous("env://", rank=rank, world_size=world, **kw))[0]
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"meshcomm/{len(_INITS)}", store),
                                    rank=rank, world_size=world, **kw)
            _INITS.append(True)
        except Exception as e:
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise
            t = f"{timeout:g}s" if timeout is not None else "the timeout"
            others = [r for r in range(world) if r != rank]
            raise PeerTimeoutError(
                f"rank {rank}: torch.distributed rendezvous did not complete within {t} "
                f"(MESHCOMM_TIMEOUT): a peer among ranks {others} did not call init, or died: "
                f"{str(e).splitlines()[0]}", others, "init") from e
        return cls(rank, world, timeout, owns_pg=True)

    # -- point to point (batched) --------------------------------------------------------
    def _host(self, buf):
        """`buf`, or its host copy when CUDA tensors are staged (the copy runs on the current
        stream, after the work queued there, and the host waits for it)."""
        return buf.cpu() if self.stage_cuda and buf.device.type == "cuda" else buf

    def isend(self, buf, peer, tag):
        buf = self._host(buf)
        pace = pacing.pacer(self.rank)
        if pace is not None and pace.crosses(peer):     # MESHCOMM_EMULATE_GBPS (benchmarks)
            return pace.send(lambda: _TorchWork("send", (peer,), buf, self.dist.isend(buf, peer, tag=tag)),
                             buf.numel() * buf.element_size(), "send", (peer,))
        w = _TorchWork("send", (peer,), buf)
        self._batch.append((self.dist.P2POp(self.dist.isend, buf, peer, tag=tag), w))
        return w

    def irecv(self, buf, peer, tag):
        if self.stage_cuda and buf.device.type == "cuda":
            w = _Staged("recv", (peer,), buf.new_empty(buf.shape, device="cpu"), buf)
            buf = w.buf
        else:
            w = _TorchWork("recv", (peer,), buf)
        self._batch.append((self.dist.P2POp(self.dist.irecv, buf, peer, tag=tag), w))
        return w

    def flush(self):
        if not self._batch:
            return
        ops = [op for op, _ in self._batch]
        works = self.dist.batch_isend_irecv(ops)
        if len(works) == len(self._batch):
            for (_, w), work in zip(self._batch, works):
                w.work = work
        else:                               # coalesced into one work (NCCL)
            for _, w in self._batch:
                w.work = works[-1] if works else None
        self._batch.clear()

    # -- collectives -------------------------------------------------------------------
    # gloo (host tensors): a plan's broadcasts (the executor passes their tag) go point to
    # point from the root, and integer reduces gather to the root (collective_reduce_ok), so
    # a plan needs no process group: a Program of some processes is constructed by those
    # alone. A native broadcast (no tag) runs on its group.
    gather_reduces = True
    reduce_dtypes = ("float32", "float64", "int32", "int64", "int8", "uint8", "int16", "bfloat16", "float16")

    def bcast_group(self, ranks, device_kind="cpu") -> bool:
        return device_kind == "cuda" and not self.stage_cuda

    def bcast(self, buf, root, ranks):
        self.flush()
        pace = pacing.pacer(self.rank)
        if pace is not None and self.rank == root:      # the root waits for its slot (k-1 messages)
            n = buf.numel() * buf.element_size() * sum(1 for r in ranks if pace.crosses(r))
            time.sleep(max(0.0, pace.release(n) - time.monotonic()))
        work = self.dist.broadcast(buf, src=root, group=self._group(ranks), async_op=True)
        # in a collective any member may be the one missing: name them all
        others = tuple(r for r in ranks if r != self.rank)
        return _TorchWork(f"bcast in group {list(ranks)}", others, buf, work)

    def reduce(self, buf, root, ranks, op="sum"):
        self.flush()
        R = self.dist.ReduceOp
        rop = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}[op]
        dev, buf = buf, self._host(buf)
        w, back = widened(buf, op)
        work = self.dist.reduce(w, dst=root, op=rop, group=self._group(ranks), async_op=True)
        post = back if self.rank == root else None
        if buf is not dev and self.rank == root:        # staged: the result back to the device
            post = functools.partial(_to_device, back, buf, dev)
        return CollWork(f"reduce in group {list(ranks)}", tuple(r for r in ranks if r != self.rank), (buf, w),
                        work, self.rank, post)

    def prepare_groups(self, groups: Sequence[tuple[int, ...]], deadline):
        # Called by EVERY rank with the same list, in the same order: new_group is collective
        # over the whole world, members or not. Programs on host tensors need no group (a
        # plan's broadcasts go point to point, integer reduces gather, native collectives on
        # sub-groups run as plans: runtime/native_call.py), so only device tensors (NCCL) and
        # direct users of the primitives get here; a Program of some processes on device
        # tensors must then be constructed by every process (see docs/runtime.md).
        for g in groups:
            if g in self._groups or len(g) == self.world_size:
                continue
            kw = {}
            if deadline is not None:
                kw["timeout"] = _td(max(deadline - time.monotonic(), 1e-3))
            self._groups[g] = self.dist.new_group(list(g), **kw)

    def wait_all(self, works, deadline, polled=()):
        """Blocking waits (gloo's point-to-point works say they are done only once waited
        for), one waiter thread per work, while this thread tests the `polled` works (mixed:
        MPI's, which progress only inside MPI calls) and polls the control channel
        (backends.base.WATCH) with the works still pending: a peer's error raises here
        within milliseconds, and a stalled wait names exactly the peers it still waits for."""
        self.flush()
        for w in works:
            if isinstance(w, pacing.Paced):
                w.force()                       # a paced send not issued yet: wait for its slot
        live = [w for w in works if w.work is not None]
        if _base.WATCH is None and not polled:
            for w in live:
                self._wait_one(w, deadline)
        elif live or polled:
            _base.wait_threads(self, list(polled), self.wait_async(live, deadline), deadline)
        _base.finish_all(live)

    def wait_async(self, works, deadline):
        """[(work, Future of its blocking wait)]: one waiter thread each; the Future raises
        the work's PeerTimeoutError."""
        self.flush()
        if self._waiter is None:
            import concurrent.futures
            self._waiter = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="meshcomm-torch-wait")
        return [(w, self._waiter.submit(self._wait_one, w, deadline)) for w in works if w.work is not None]

    def _wait_one(self, w, deadline):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0 and not w.work.is_completed():
            raise self._timeout(w, None)
        try:
            if left is None:
                w.work.wait()
            else:
                w.work.wait(timeout=_td(max(left, 1e-3)))
        except Exception as e:              # gloo: timeouts and closed connections
            raise self._timeout(w, e) from e

    def _timeout(self, w, e):
        t = f"{self.timeout:g}s" if self.timeout is not None else "the timeout"
        why = f": {str(e).splitlines()[0] if str(e) else type(e).__name__}" if e is not None else ""
        if e is not None and "time" not in why.lower():     # failed, not timed out: say what failed
            return PeerTimeoutError(f"rank {self.rank}: {w.op} with peer rank(s) {list(w.peers)} failed{why}",
                                    w.peers, w.op)
        return PeerTimeoutError(
            f"rank {self.rank}: {w.op} with peer rank(s) {list(w.peers)} did not complete within "
            f"{t} (MESHCOMM_TIMEOUT); peer rank(s) {list(w.peers)} did not arrive or died{why}",
            w.peers, w.op)

    # -- metadata through the store --------------------------------------------------------
    def allgather_obj(self, obj, deadline, tag=None, accept=None, ranks=None):
        """Through the store: this rank's value of round `tag` under its own key, the others'
        read (a value `accept` calls "drop" or "later" is waited past: the next write
        replaces it)."""
        if tag is None:
            tag = self._meta_seq
            self._meta_seq += 1
        tag = "/".join(map(str, tag)) if isinstance(tag, tuple) else tag
        key = lambda r, s=tag: f"meshcomm/meta/{s}/{r}"  # noqa: E731
        self.store.set(key(self.rank), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        out = {self.rank: obj}

        def take(pending):
            try:
                ready = [r for r in pending if self.store.check([key(r)])]
            except Exception:           # the store itself is gone: its host (rank 0) died
                raise late(pending) from None
            got = []
            if ready:
                for r, v in zip(ready, self.store.multi_get([key(r) for r in ready])):
                    v = pickle.loads(bytes(v))
                    if accept is None or accept(r, v) == "take":
                        out[r] = v
                        got.append(r)
            return got

        def late(pending):
            t = f"{self.timeout:g}s" if self.timeout is not None else "the timeout"
            return PeerTimeoutError(
                f"rank {self.rank}: peer rank(s) {pending} did not arrive at the agreement of a Program "
                f"within {t} (MESHCOMM_TIMEOUT): they did not construct the same Program, or died",
                pending, "metadata")
        _base.poll_peers([r for r in ranks if r != self.rank], take, deadline, late,
                         nap=lambda spins: time.sleep(min(0.002, 1e-5 * spins)))
        return [out[r] for r in ranks]

    def retract(self, obj, tag, ranks=None) -> None:
        """Overwrite this rank's value of round `tag` (its last Meta there) with `obj`."""
        tag = "/".join(map(str, tag)) if isinstance(tag, tuple) else tag
        self.store.set(f"meshcomm/meta/{tag}/{self.rank}", pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    # -- the control channel (meshcomm.runtime.control), through the store ---------------
    def ctl_send(self, peer, data: bytes) -> None:
        n = self.store.add(f"meshcomm/ctl/{peer}/n", 1)
        self.store.set(f"meshcomm/ctl/{peer}/{n}", data)

    def ctl_poll(self) -> list:
        n = self.store.add(f"meshcomm/ctl/{self.rank}/n", 0)
        out = []
        while self._ctl_read < n:
            self._ctl_read += 1
            out.append((None, bytes(self.store.get(f"meshcomm/ctl/{self.rank}/{self._ctl_read}"))))
        return out

    def close(self):
        self._groups.clear()
        self.store = None
        if self._waiter is not None:
            self._waiter.shutdown(wait=True)
            self._waiter = None
        if self.owns_pg and self.dist.is_initialized():
            self.dist.destroy_process_group()
