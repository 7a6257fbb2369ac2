"""Argument checks shared by the native collective primitives of every backend.

The native collectives (`Backend.allreduce`, `allgatherv`, `reduce_scatterv`, `alltoall`,
`gatherv`, `scatterv`, `reduce`, `ibarrier`; see backends/base.py) run ONE collective call
of a backend on a group of world ranks. Their buffers are 1-d and contiguous: NumPy arrays
for MPI, torch tensors for torch.distributed. Counts are numbers of elements of the
buffer's dtype (bytes for the executor's uint8 wire), one per member in group order.

Leaf module: imports nothing from meshcomm but meshcomm.reduceops.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from meshcomm.reduceops import PARTIAL_OPS

__all__ = ["REDUCE_OPS", "check_op", "check_group", "check_counts", "check_len", "check_alltoall", "check_v",
           "displs", "member", "others"]

REDUCE_OPS = PARTIAL_OPS        # sum, prod, min, max: native in MPI and gloo alike


def check_op(op) -> str:
    """`op` if it is a native reduction (sum, prod, min, max), else ValueError. avg is not
    native in gloo's or MPI's reductions: the caller sums and divides."""
    if isinstance(op, str) and op in REDUCE_OPS:
        return op
    hint = " (avg is not a native reduction: reduce with 'sum' and divide)" if op == "avg" else ""
    raise ValueError(f"reduction op must be one of {', '.join(REDUCE_OPS)}, got {op!r}{hint}")


def check_group(rank: int, ranks: Sequence[int], what: str) -> tuple[int, ...]:
    """`ranks` as a tuple after checking it is sorted, distinct and holds `rank`."""
    ranks = tuple(int(r) for r in ranks)
    if not ranks or list(ranks) != sorted(set(ranks)):
        raise ValueError(f"{what}: ranks must be a sorted tuple of distinct world ranks, got {ranks}")
    if rank not in ranks:
        raise ValueError(f"{what}: rank {rank} is not in the group {list(ranks)} (only members call it)")
    return ranks


def member(ranks: tuple[int, ...], root: int, what: str) -> int:
    """The index of world rank `root` in the group `ranks` (ValueError when it is not in it)."""
    try:
        return ranks.index(root)
    except ValueError:
        raise ValueError(f"{what}: root rank {root} is not in the group {list(ranks)}") from None


def check_counts(counts: Sequence[int], ranks: tuple[int, ...], what: str) -> tuple[int, ...]:
    """`counts` as a tuple of non-negative ints, one per member of `ranks`."""
    out = tuple(int(c) for c in counts)
    if len(out) != len(ranks) or any(c < 0 for c in out):
        raise ValueError(f"{what}: counts must be {len(ranks)} non-negative ints (one per rank of "
                         f"group {list(ranks)}), got {list(counts)}")
    return out


def check_len(buf, n: int, what: str, name: str) -> None:
    """ValueError unless `buf` is a 1-d buffer of exactly `n` elements."""
    shape = tuple(buf.shape)
    if len(shape) != 1 or shape[0] != n:
        raise ValueError(f"{what}: {name} must be a 1-d buffer of {n} elements, got shape {shape}")


def check_v(what: str, rank: int, sendbuf, recvbuf, counts, ranks, root=None) -> tuple:
    """(ranks, counts, the root's index or None) of a v-collective (allgatherv, gatherv: each
    member's block in, every block out; reduce_scatterv, scatterv: every block in, each
    member's out; gatherv and scatterv: the whole side at the root only), after checking the
    group, the counts and both buffers' lengths."""
    ranks = check_group(rank, ranks, what)
    counts = check_counts(counts, ranks, what)
    i = None if root is None else member(ranks, root, what)
    mine, whole = ("sendbuf", sendbuf), ("recvbuf", recvbuf)
    if what not in ("allgatherv", "gatherv"):
        mine, whole = whole, mine
    check_len(mine[1], counts[ranks.index(rank)], what, mine[0])
    if root is None or rank == root:
        check_len(whole[1], sum(counts), what, whole[0])
    return ranks, counts, i


def displs(counts: Sequence[int]) -> tuple[int, ...]:
    """Offsets of the blocks of `counts` laid end to end."""
    return tuple(itertools.accumulate(counts, initial=0))[:-1]


def others(ranks: Sequence[int], rank: int) -> tuple[int, ...]:
    """The members other than `rank`: in a collective any of them may be the one missing."""
    return tuple(r for r in ranks if r != rank)


def check_alltoall(rank: int, sendbuf, recvbuf, ranks) -> tuple[int, ...]:
    """The group, after checking that sendbuf splits into equal blocks and recvbuf matches."""
    ranks = check_group(rank, ranks, "alltoall")
    n = len(sendbuf)
    if n % len(ranks):
        raise ValueError(f"alltoall: sendbuf of {n} elements does not split into "
                         f"{len(ranks)} equal blocks (group {list(ranks)})")
    check_len(recvbuf, n, "alltoall", "recvbuf")
    return ranks
