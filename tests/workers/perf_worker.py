"""SPMD worker for tests/test_perf_paths.py: the agreement check's hash round over MPI.

Repeated identical calls must be decided by the hashes alone (counter "hash_check"), with
a receiving process that holds no src tile but passes shape= and dtype= (it posts its
receives before the check completes); a shape mismatch on one process must still make
every process raise naming the disagreement, after which the next call works.
Prints "OK <rank>" on success.
"""
from __future__ import annotations

import sys

import numpy as np

import meshcomm as mc
from meshcomm.backends import base


def decided_so_far() -> int:
    """Calls decided without the metadata exchange: by the round of hashes, or (a call every
    process agreed on twice before) by its signature communicator."""
    return base.issued[("hash_check", "mpi")] + base.issued[("signature_check", "mpi")]


def main() -> int:
    ctx = mc.init(backend="mpi")
    r, n = ctx.rank, ctx.world_size
    mesh = mc.Mesh(np.arange(n), ("x",))
    g = np.arange(4 * n * 3, dtype=np.float32).reshape(4 * n, 3)
    src = mc.Layout(mc.Mesh([0, 1], ("a",)), ("a",))          # rows on ranks 0 and 1 only
    dst = mc.Layout(mesh, (None, None))                       # every rank gets everything
    x = {d: g[d * 2 * n:(d + 1) * 2 * n] for d in (0, 1) if d == r}
    before = decided_so_far()
    for k in range(5):
        y = mc.reshard(x, src, dst, shape=g.shape, dtype=g.dtype)
        assert np.array_equal(y[r], g), (r, k)
    decided = decided_so_far() - before
    assert decided == 5, f"rank {r}: {decided} of 5 repeated calls decided by hashes"
    # without shape= and dtype=, ranks without tiles (and rank 0, whose tile does not pin the
    # row count) guess what the last call with these layouts agreed on; the hashes of the
    # guesses decide while they are right
    before = decided_so_far()
    for k in range(3):
        y = mc.reshard(x, src, dst)
        assert np.array_equal(y[r], g), (r, k)
    decided = decided_so_far() - before
    assert decided == 3, f"rank {r}: {decided} of 3 calls without shape= decided by hashes"
    # a new shape: the guesses are wrong, so the metadata is exchanged and every process
    # starts over; the result is right, and the calls after it are decided by hashes again
    g2 = np.arange(6 * n * 3, dtype=np.float32).reshape(6 * n, 3)
    x2 = {d: g2[d * 3 * n:(d + 1) * 3 * n] for d in (0, 1) if d == r}
    for k in range(3):
        before = decided_so_far()
        y = mc.reshard(x2, src, dst)
        assert np.array_equal(y[r], g2), (r, k)
        assert decided_so_far() - before == (k > 0), (r, k)
    # a disagreement (rank 3 says another shape) still raises everywhere
    bad = (4 * n + (1 if r == 3 else 0), 3)
    try:
        mc.reshard(x if r != 3 else {}, src, dst, shape=bad, dtype=g.dtype)
    except ValueError as e:
        assert "disagree" in str(e) or "rank 3" in str(e) or r == 3, (r, e)
    else:
        raise AssertionError(f"rank {r}: no error for a shape mismatch")
    y = mc.reshard(x, src, dst, shape=g.shape, dtype=g.dtype)
    assert np.array_equal(y[r], g), r
    # torch tensors on the senders: the receivers' early NumPy buffers come back as torch
    import torch
    xt = {d: torch.from_numpy(v.copy()) for d, v in x.items()}
    y = mc.reshard(xt, src, dst, shape=g.shape, dtype=torch.float32)
    assert isinstance(y[r], torch.Tensor) and np.array_equal(y[r].numpy(), g), (r, type(y[r]))
    mc.finalize()
    print(f"OK {r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
