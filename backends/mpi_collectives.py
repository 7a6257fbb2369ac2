"""MPI's native collectives (MPIBackend's allreduce, allgatherv, ... ibarrier): one mpi4py
non-blocking collective on the group's cached communicator, returned as a polled Work.

Each primitive is the MPI call of the same name (Iallreduce, Iallgatherv, Ireduce_scatter,
Ialltoall, Igatherv, Iscatterv, Ibarrier; reduce is MPIBackend.reduce's Ireduce), or its
equal-count form where every member's count is the same (Iallgather, Ireduce_scatter_block):
MPICH picks other, faster algorithms for those. Not for gathers and scatters: MPICH's Igather
and Iscatter (a tree) were slower than the v forms (linear) from 256 KiB. mpi4py takes the MPI
datatype from the NumPy dtype (uint8 bytes, int32/64, float32/64, ...): counts are elements.
bfloat16 has no MPI datatype (mpi4py refuses ml_dtypes' bfloat16 with a TypeError); reduce it
on torch. Unlike broadcasts and reduces of a plan (backends/mpi.py), nothing here is turned
into point-to-point messages on one host: these are what `meshcomm tune` measures as "the MPI
collective".
"""
from __future__ import annotations

from .collectives import check_alltoall, check_counts, check_group, check_op, check_v, displs, member, others

__all__ = ["MPICollectives", "mpi_op"]


_OPS: dict = {}


def mpi_op(op: str):
    if not _OPS:
        from mpi4py import MPI
        _OPS.update(sum=MPI.SUM, prod=MPI.PROD, min=MPI.MIN, max=MPI.MAX, in_place=MPI.IN_PLACE)
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        return _OPS[check_op(op)]


class MPICollectives:
    """Mixed into MPIBackend: needs `rank`, `_group(ranks)` (the cached communicator) and
    `work_cls` (MPIWork). `bind` checks a call's group, counts and op once and gives the
    function that posts it (a Program keeps it, on a communicator of its own); the methods
    below are bind-and-post."""

    def bind(self, what, ranks, comm=None, counts=None, op=None, root=None, bufs=None):
        """A function (send, recv=None) -> Work posting the native collective `what`
        ("allreduce" (in place on send), "allgatherv", "reduce_scatterv", "alltoall",
        "gatherv", "scatterv", "bcast" (in place), "reduce" (in place), "barrier") over
        `ranks` on `comm` (default: the group's communicator), with its counts (elements,
        group order), op and root. With `bufs=(send, recv)`: an MPI-4 persistent request
        over those buffers, made once (`Allreduce_init`, ...); the function takes no
        arguments, starts it and gives its Work (the same object every time; a new Work per
        start where the MPI library predates MPI-4 and has no `_init` calls)."""
        ranks = check_group(self.rank, ranks, what)
        comm = self._group(ranks) if comm is None else comm
        vspec = spec = None             # (counts, displacements); spec: None where the counts are equal
        if counts is not None:
            counts = check_counts(counts, ranks, what)
            vspec = (counts, displs(counts))
            spec = None if counts.count(counts[0]) == len(counts) else vspec
        mop = mpi_op(op) if op is not None else None
        i = member(ranks, root, what) if root is not None else None
        rooted = self.rank == root
        inp = mpi_op("in_place")
        # (MPI call, its arguments from (send, recv)): Iname non-blocking, Name_init persistent
        if what == "allreduce":
            name, args = "Allreduce", lambda s, r: ((inp, s), {"op": mop})
        elif what == "allgatherv" and spec is None:
            name, args = "Allgather", lambda s, r: ((s, r), {})
        elif what == "allgatherv":
            name, args = "Allgatherv", lambda s, r: ((s, [r, spec]), {})
        elif what == "reduce_scatterv" and spec is None:
            name, args = "Reduce_scatter_block", lambda s, r: ((s, r), {"op": mop})
        elif what == "reduce_scatterv":
            name, args = "Reduce_scatter", lambda s, r: ((s, r), {"recvcounts": list(counts), "op": mop})
        elif what == "alltoall":
            name, args = "Alltoall", lambda s, r: ((s, r), {})
        elif what == "gatherv":
            name, args = "Gatherv", lambda s, r: ((s, [r, vspec] if rooted else None), {"root": i})
        elif what == "scatterv":
            name, args = "Scatterv", lambda s, r: (([s, vspec] if rooted else None, r), {"root": i})
        elif what == "bcast":
            name, args = "Bcast", lambda s, r: ((s,), {"root": i})
        elif what == "reduce":
            name, args = "Reduce", lambda s, r: (((inp, s) if rooted else (s, None)), {"op": mop, "root": i})
        elif what == "barrier":
            name, args = "Barrier", lambda s, r: ((), {})
        else:
            raise ValueError(f"no native MPI collective {what!r}")
        desc, peers, me, w = f"{what} in group {list(ranks)}", others(ranks, self.rank), self.rank, self.work_cls
        call = getattr(comm, "I" + name[0].lower() + name[1:])
        if bufs is not None:
            a, kw = args(*bufs)
            try:
                req = getattr(comm, name + "_init")(*a, **kw)
            except NotImplementedError:
                # an MPI before MPI-4 (Open MPI 4, say) has no persistent collectives: the
                # non-blocking call over the same buffers, posted at each start
                return lambda: w(call(*a, **kw), bufs, desc, peers, me)
            self._persistent.append(req)
            work = w(req, bufs, desc, peers, me)

            def start():
                req.Start()
                return work
            return start

        def post(s=None, r=None):
            a, kw = args(s, r)
            return w(call(*a, **kw), (s, r), desc, peers, me)
        return post

    def allreduce(self, buf, op, ranks):
        return self.bind("allreduce", ranks, op=op)(buf)

    def allgatherv(self, sendbuf, recvbuf, counts, ranks):
        ranks, counts, _ = check_v("allgatherv", self.rank, sendbuf, recvbuf, counts, ranks)
        return self.bind("allgatherv", ranks, counts=counts)(sendbuf, recvbuf)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, ranks):
        ranks, counts, _ = check_v("reduce_scatterv", self.rank, sendbuf, recvbuf, counts, ranks)
        return self.bind("reduce_scatterv", ranks, counts=counts, op=op)(sendbuf, recvbuf)

    def alltoall(self, sendbuf, recvbuf, ranks):
        ranks = check_alltoall(self.rank, sendbuf, recvbuf, ranks)
        return self.bind("alltoall", ranks)(sendbuf, recvbuf)

    def gatherv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks, counts, _ = check_v("gatherv", self.rank, sendbuf, recvbuf, counts, ranks, root)
        return self.bind("gatherv", ranks, counts=counts, root=root)(sendbuf, recvbuf)

    def scatterv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks, counts, _ = check_v("scatterv", self.rank, sendbuf, recvbuf, counts, ranks, root)
        return self.bind("scatterv", ranks, counts=counts, root=root)(sendbuf, recvbuf)

    def ibarrier(self, ranks):
        return self.bind("barrier", ranks)(None)
