"""SPMD worker (2 processes, mpiexec): work given up on keeps its buffer until MPI is done
with it (backends.base.abandon, the one path for timeouts and aborted runs).

1. A plan's send given up on. Rank 0 starts a planned 8 MiB transfer to rank 1 (a
   Runner, as a Program's run does) and waits for it past its deadline (a
   PeerTimeoutError), drops every reference to the source array and fills fresh memory.
   Rank 1 only then receives: the bytes must be the source's. (Before abandon, an aborted
   run dropped the send's request with its buffer: MPICH then read freed memory, and the
   receiver failed in process_vm_readv, errno 14.)
2. A receive given up on as a timeout does (no cancel). Rank 0 drops its references and
   fills fresh memory; rank 1 sends only then. The message must land in the kept buffer, the
   fresh arrays stay untouched, and once the work completed the next `abandon` lets it go."""
import gc
import json
import time
import weakref

import numpy as np
from mpi4py import MPI

import meshcomm as mc
from meshcomm.backends import base
from meshcomm.backends.batch import BatchItem, Runner
from meshcomm.errors import PeerTimeoutError

N = 8 << 20
TAG = 7
ctx = mc.init(backend="mpi")
be = ctx.get_backend("mpi")
comm = MPI.COMM_WORLD
assert comm.size == 2, "run with 2 processes"
res = {"rank": comm.rank}


def fresh_memory():
    return [np.full(N, 1, np.uint8) for _ in range(4)]


# 1. a plan's send given up on (its wait timed out)
src = mc.Layout(mc.Mesh(np.array([0]), ("x",)), (None,))
dst = mc.Layout(mc.Mesh(np.array([1]), ("x",)), (None,))
plan = mc.plan((N,), np.uint8, src, dst)
if comm.rank == 0:
    data = np.full(N, 0x5A, np.uint8)
    alive = weakref.ref(data)
    runner = Runner([plan], rank=0, devices_per_process=1, backend=be)
    try:
        runner.run([BatchItem(plan, {0: data}, data)], (0, base.TAG_MOD), time.monotonic() - 1)
    except PeerTimeoutError:
        res["send_timed_out"] = True
    del runner, data
    gc.collect()
    res["send_buffer_kept"] = alive() is not None
    fresh = fresh_memory()
    comm.Barrier()
    comm.Barrier()
    res["fresh_untouched_1"] = all(int(f.min()) == 1 == int(f.max()) for f in fresh)
else:
    comm.Barrier()                  # rank 0 has aborted the plan and refilled its memory
    buf = np.zeros(N, np.uint8)
    req = be.comm.Irecv(buf, source=0, tag=MPI.ANY_TAG)
    deadline = time.monotonic() + 60
    while not req.Test():
        assert time.monotonic() < deadline, "the aborted plan's message never came"
    res["send_intact"] = bool((buf == 0x5A).all())
    comm.Barrier()

# 2. a receive given up on without a cancel, its message arriving afterwards
if comm.rank == 0:
    buf = np.zeros(N, np.uint8)
    kept = weakref.ref(buf)
    w = be.irecv(buf, 1, TAG)
    base.abandon([w])
    res["recv_kept"] = base.ABANDONED[-1] is w
    del w, buf
    gc.collect()
    res["recv_buffer_kept"] = kept() is not None
    fresh = fresh_memory()
    comm.Barrier()
    work = base.ABANDONED[-1]
    deadline = time.monotonic() + 60
    while not work.test():          # MPI progresses here: the late message lands
        assert time.monotonic() < deadline, "the late message never came"
    res["fresh_untouched_2"] = all(int(f.min()) == 1 == int(f.max()) for f in fresh)
    got = kept()
    res["landed_in_kept"] = got is not None and bool((got == 0x5A).all())
    del work, got
    base.abandon([])                # the completed work is let go now
    gc.collect()
    res["released_when_done"] = kept() is None
    comm.Barrier()
else:
    data = np.full(N, 0x5A, np.uint8)
    comm.Barrier()                  # rank 0 has given its receive up and refilled its memory
    be.wait_all([be.isend(data, 0, TAG)], time.monotonic() + 60)
    comm.Barrier()
every = comm.gather(res, root=0)      # one line from rank 0 (printed lines can interleave)
if comm.rank == 0:
    print("RESULT " + json.dumps(every), flush=True)
mc.finalize()
