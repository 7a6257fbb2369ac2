"""The run number in a persistent native call's own buffers (runtime/trailers.py,
backends/mpi_comm.py Trailer), one process playing every member: what MPI would move is
moved by hand (blocks concatenated, elements reduced), the data comes out without the
numbers, a run's own numbers pass, and another member's raise naming it. The same calls
over real processes: tests/test_collectives.py, cases `ahead-symmetric` and `runs-apart`."""
import numpy as np
import pytest

from meshcomm.errors import PeerError
from meshcomm.runtime.native_call import _Call
from meshcomm.runtime.trailers import trailed, trails

K, N = 4, 6             # members, elements of a block
F32 = np.dtype(np.float32)


def members(c, unit=F32):
    """Each member's (buffers, put, take, Trailer) for call `c`, with its tile put in and
    its number (the run's place, 7) written."""
    out = []
    for r in range(K):
        whole, recv, put, take, tr, kw = trailed(c, unit, unit, tuple(range(K)), r, c.what)
        put(np.full(c.mine, 10.0 * r + 1, unit))
        tr.post(7, lambda: None)
        out.append((whole, recv, take, tr, kw))
    return out


def test_all_gather_and_all_to_all_blocks_carry_each_senders_number():
    ag = _Call("allgatherv", {"counts": (N,) * K}, True, N, K * N, True, True, (K * N,), (N,), 0)
    ms = members(ag)
    assert ms[0][4]["counts"][0] > N                          # each block grew by the number
    for whole, recv, take, tr, _ in ms:
        recv[...] = np.concatenate([m[0] for m in ms])        # MPI's allgather
        tr.check()
        assert np.array_equal(take(), np.repeat(10.0 * np.arange(K) + 1, N).astype(np.float32))
    ms[2][3].post(9, lambda: None)                            # member 2 at another place
    whole, recv, take, tr, _ = ms[0]
    recv[...] = np.concatenate([m[0] for m in ms])
    with pytest.raises(PeerError, match="rank 2 sent its part from place 9") as e:
        tr.check()
    assert e.value.out_of_step and e.value.rank == 2
    a2a = _Call("alltoall", {}, True, K * N, K * N, True, True, (K * N,), (K * N,), 0)
    ms = members(a2a)
    for j, (whole, recv, take, tr, _) in enumerate(ms):
        recv[...] = np.concatenate([m[0].reshape(K, -1)[j] for m in ms])      # MPI's alltoall
        tr.check()
        assert np.array_equal(take(), np.repeat(10.0 * np.arange(K) + 1, N).astype(np.float32))


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reductions_carry_the_number_in_reduced_elements(op):
    red = {"sum": np.sum, "max": np.max, "min": np.min}[op]
    ar = _Call("allreduce", {"op": op}, True, N, None, True, True, (N,), (N,), 0)
    assert trails(ar, F32) and not trails(ar, np.dtype(np.float16))
    ms = members(ar)
    total = red(np.stack([m[0] for m in ms]), axis=0)         # MPI's in-place allreduce
    for whole, _, take, tr, _ in ms:
        whole[...] = total
        tr.check()
        assert np.array_equal(take(), np.full(N, red(10.0 * np.arange(K) + 1), np.float32))
    ms[3][3].post(8, lambda: None)                            # one member a place ahead
    whole = ms[0][0]
    whole[...] = red(np.stack([m[0] for m in ms]), axis=0)
    with pytest.raises(PeerError, match="a member sent its part from another place"):
        ms[0][3].check()
    rs = _Call("reduce_scatterv", {"counts": (N,) * K, "op": op}, True, K * N, N, True, True, (N,), (K * N,), 0)
    ms = members(rs)
    for j, (_, recv, take, tr, _) in enumerate(ms):
        recv[...] = red(np.stack([m[0].reshape(K, -1)[j] for m in ms]), axis=0)     # MPI's reduce_scatter_block
        tr.check()
        assert np.array_equal(take(), np.full(N, red(10.0 * np.arange(K) + 1), np.float32))


def test_unequal_blocks_products_and_16_bit_elements_carry_none():
    assert not trails(_Call("allgatherv", {"counts": (N, N + 1, N, N)}, True, N, 4 * N + 1, True, True,
                            (4 * N + 1,), (N,), 0), F32)
    assert not trails(_Call("allreduce", {"op": "prod"}, True, N, None, True, True, (N,), (N,), 0), F32)
    assert not trails(_Call("alltoall", {}, False, K * N, K * N, True, True, (K * N,), (K * N,), 0),
                      np.dtype(np.uint8))
