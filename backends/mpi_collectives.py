"""MPI's native collectives (MPIBackend's allreduce, allgatherv, ... ibarrier): one mpi4py
non-blocking collective on the group's cached communicator, returned as a polled Work.

Each primitive is the MPI call of the same name (Iallreduce, Iallgatherv, Ireduce_scatter,
Ialltoall, Igatherv, Iscatterv, Ibarrier; reduce is MPIBackend.reduce's Ireduce), or its
equal-count form where every member's count is the same (Iallgather, Ireduce_scatter_block):
MPICH picks other algorithms for those, measured up to 1.3x faster on 8 processes at 256 KiB
(an all-gather). Not for gathers and scatters: MPICH's Igather and Iscatter (a tree) were
up to 2x slower than the v forms (linear) from 256 KiB on 8 processes here.
mpi4py
takes the MPI datatype from the NumPy dtype (uint8 bytes, int32/64, float32/64, ...):
counts are elements. bfloat16 has no MPI datatype (a NumPy array of ml_dtypes' bfloat16 is
refused by mpi4py with a TypeError); reduce it on torch. Unlike broadcasts and reduces of a
plan (backends/mpi.py), nothing here is turned into point-to-point messages on one host:
these are what `meshcomm tune` measures as "the MPI collective".
"""
from __future__ import annotations

from .collectives import check_alltoall, check_counts, check_group, check_len, check_op, displs, member, others

__all__ = ["MPICollectives", "mpi_op"]


_OPS: dict = {}
_DESC: dict = {}        # (what, group, rank) -> (the work's description, the other members)


def _v_spec(counts):
    """None where every member's count is the same (the equal-count MPI call applies), else
    (counts, displacements) for the v form."""
    return None if counts.count(counts[0]) == len(counts) else (counts, displs(counts))


def _iallgather(comm, sendbuf, recvbuf, spec):
    return comm.Iallgather(sendbuf, recvbuf) if spec is None else comm.Iallgatherv(sendbuf, [recvbuf, spec])


def _ireduce_scatter(comm, sendbuf, recvbuf, spec, mop):
    if spec is None:
        return comm.Ireduce_scatter_block(sendbuf, recvbuf, op=mop)
    return comm.Ireduce_scatter(sendbuf, recvbuf, recvcounts=list(spec[0]), op=mop)


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
    `work_cls` (MPIWork)."""

    def _desc(self, what, ranks):
        key = (what, ranks, self.rank)
        desc = _DESC.get(key)
        if desc is None:
            if len(_DESC) > 4096:
                _DESC.clear()
            desc = _DESC[key] = (f"{what} in group {list(ranks)}", others(ranks, self.rank))
        return desc

    def _work(self, req, bufs, what, ranks):
        desc = self._desc(what, ranks)
        return self.work_cls(req, bufs, desc[0], desc[1], self.rank)

    def allreduce(self, buf, op, ranks):
        ranks = check_group(self.rank, ranks, "allreduce")
        mop = mpi_op(op)
        req = self._group(ranks).Iallreduce(_OPS["in_place"], buf, op=mop)
        return self._work(req, buf, "allreduce", ranks)

    def allgatherv(self, sendbuf, recvbuf, counts, ranks):
        ranks = check_group(self.rank, ranks, "allgatherv")
        counts = check_counts(counts, ranks, "allgatherv")
        check_len(sendbuf, counts[ranks.index(self.rank)], "allgatherv", "sendbuf")
        check_len(recvbuf, sum(counts), "allgatherv", "recvbuf")
        req = _iallgather(self._group(ranks), sendbuf, recvbuf, _v_spec(counts))
        return self._work(req, (sendbuf, recvbuf), "allgatherv", ranks)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, ranks):
        ranks = check_group(self.rank, ranks, "reduce_scatterv")
        counts = check_counts(counts, ranks, "reduce_scatterv")
        check_len(sendbuf, sum(counts), "reduce_scatterv", "sendbuf")
        check_len(recvbuf, counts[ranks.index(self.rank)], "reduce_scatterv", "recvbuf")
        req = _ireduce_scatter(self._group(ranks), sendbuf, recvbuf, _v_spec(counts), mpi_op(op))
        return self._work(req, (sendbuf, recvbuf), "reduce_scatterv", ranks)

    def alltoall(self, sendbuf, recvbuf, ranks):
        ranks = check_alltoall(self.rank, sendbuf, recvbuf, ranks)
        req = self._group(ranks).Ialltoall(sendbuf, recvbuf)
        return self._work(req, (sendbuf, recvbuf), "alltoall", ranks)

    def gatherv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks = check_group(self.rank, ranks, "gatherv")
        counts = check_counts(counts, ranks, "gatherv")
        i = member(ranks, root, "gatherv")
        check_len(sendbuf, counts[ranks.index(self.rank)], "gatherv", "sendbuf")
        spec = None
        if self.rank == root:
            check_len(recvbuf, sum(counts), "gatherv", "recvbuf")
            spec = [recvbuf, (counts, displs(counts))]
        req = self._group(ranks).Igatherv(sendbuf, spec, root=i)
        return self._work(req, (sendbuf, recvbuf), "gatherv", ranks)

    def scatterv(self, sendbuf, recvbuf, counts, root, ranks):
        ranks = check_group(self.rank, ranks, "scatterv")
        counts = check_counts(counts, ranks, "scatterv")
        i = member(ranks, root, "scatterv")
        check_len(recvbuf, counts[ranks.index(self.rank)], "scatterv", "recvbuf")
        spec = None
        if self.rank == root:
            check_len(sendbuf, sum(counts), "scatterv", "sendbuf")
            spec = [sendbuf, (counts, displs(counts))]
        req = self._group(ranks).Iscatterv(spec, recvbuf, root=i)
        return self._work(req, (sendbuf, recvbuf), "scatterv", ranks)

    def ibarrier(self, ranks):
        ranks = check_group(self.rank, ranks, "barrier")
        return self._work(self._group(ranks).Ibarrier(), None, "barrier", ranks)
