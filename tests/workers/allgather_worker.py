"""3 ranks, real MPI: an allgather of small objects given up at its deadline keeps what came in.

Rank 0 runs `timed_allgather` over ranks 0-2 on one tag; rank 1's object arrives, rank 2's
does not before the deadline (PeerTimeoutError naming rank 2). Rank 2 then sends, and rank 0's
next attempt on that tag must find rank 1's object waiting (it is not sent again) beside rank
2's. Writes `rank<r>.json` into the folder given as its argument."""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from meshcomm.backends.mpi import _dumps, timed_allgather
from meshcomm.errors import PeerTimeoutError

comm = MPI.COMM_WORLD.Dup()
r = comm.Get_rank()
TAG = 7
res = {"rank": r}
if r == 0:
    stash = {}
    time.sleep(0.2)                                 # rank 1's object is here by now
    try:
        timed_allgather(comm, "zero", time.monotonic() + 0.5, TAG, 0.5, "the test", "are late", stash=stash)
        res["first"] = "no error"
    except PeerTimeoutError as e:
        res["first"] = list(e.peers)
    comm.Barrier()                                  # rank 2 sends now
    try:
        res["second"] = timed_allgather(comm, "zero again", time.monotonic() + 5, TAG, 5, "the test", "are late",
                                        stash=stash)
    except PeerTimeoutError as e:
        res["second"] = f"timeout: {list(e.peers)}"
else:
    if r == 1:
        comm.Send(_dumps(("one",)), dest=0, tag=TAG)
    comm.Barrier()
    if r == 2:
        comm.Send(_dumps(("two",)), dest=0, tag=TAG)
    for _ in range(2):                              # rank 0's sends of both attempts
        st = MPI.Status()
        comm.Probe(source=0, tag=TAG, status=st)
        comm.Recv(np.empty(st.Get_count(MPI.BYTE), np.uint8), source=0, tag=TAG)
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(res, f)
