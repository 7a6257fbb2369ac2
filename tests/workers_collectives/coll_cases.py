"""Seeded cases of the native collective primitives and their NumPy references.

Every process builds the same `Case`s (inputs of every member of the group); a member issues
its own part (`issue`) and checks what it got against the reference (`check`): exactly for
integers and moved data, to round-off for float sums and products.
"""
from __future__ import annotations

import dataclasses

import numpy as np

REDUCTIONS = ("allreduce", "reduce_scatterv", "reduce")
MOVES = ("allgatherv", "alltoall", "gatherv", "scatterv", "bcast")
PRIMS = REDUCTIONS + MOVES
REDUCE_DTYPES = ("float32", "float64", "int32", "int64")
MOVE_DTYPES = ("uint8", "float64", "int32")
OPS = ("sum", "prod", "min", "max")
_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    prim: str
    group: tuple
    dtype: str
    counts: tuple                      # elements per member (allreduce/reduce/bcast: all equal)
    op: str
    root: int                          # a world rank of the group
    inputs: tuple                      # one NumPy array per member, group order

    def _as(self, a, kind):
        """`a` (NumPy) as the buffer kind a backend takes (torch shares the memory)."""
        if kind == "numpy":
            return a
        import torch
        if self.dtype == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(a)

    def issue(self, backend, rank, kind):
        """Issue this rank's part on `backend` (wire `kind`); returns (work, result buffer)."""
        i, n = self.group.index(rank), len(self.group)
        x = self.inputs[i].copy()
        total = int(sum(self.counts))
        dt = np.float32 if self.dtype == "bfloat16" else self.dtype
        mk = lambda m: self._as(np.zeros(m, dtype=dt), kind)  # noqa: E731
        me_root = rank == self.root
        if self.prim == "allreduce":
            buf = self._as(x, kind)
            return backend.allreduce(buf, self.op, self.group), buf
        if self.prim == "reduce":
            buf = self._as(x, kind)
            return backend.reduce(buf, self.root, self.group, self.op), buf
        if self.prim == "bcast":
            buf = self._as(x if me_root else np.zeros_like(x), kind)
            return backend.bcast(buf, self.root, self.group), buf
        if self.prim == "allgatherv":
            out = mk(total)
            return backend.allgatherv(self._as(x, kind), out, self.counts, self.group), out
        if self.prim == "reduce_scatterv":
            out = mk(self.counts[i])
            return backend.reduce_scatterv(self._as(x, kind), out, self.counts, self.op, self.group), out
        if self.prim == "alltoall":
            out = mk(len(x))
            return backend.alltoall(self._as(x, kind), out, self.group), out
        if self.prim == "gatherv":
            out = mk(total) if me_root else None
            return backend.gatherv(self._as(x, kind), out, self.counts, self.root, self.group), out
        if self.prim == "scatterv":
            out = mk(self.counts[i])
            src = self._as(x, kind) if me_root else None
            return backend.scatterv(src, out, self.counts, self.root, self.group), out
        raise ValueError(self.prim)

    def reference(self, rank):
        """What `rank` must hold afterwards (None: nothing to check)."""
        i, xs, n = self.group.index(rank), self.inputs, len(self.group)
        cuts = np.cumsum((0,) + self.counts)
        red = lambda arrs: _reduce(arrs, self.op)  # noqa: E731
        if self.prim == "allreduce":
            return red(xs)
        if self.prim == "reduce":
            return red(xs) if rank == self.root else None
        if self.prim == "bcast":
            return xs[self.group.index(self.root)]
        if self.prim == "allgatherv":
            return np.concatenate(xs)
        if self.prim == "reduce_scatterv":
            return red([x[cuts[i]:cuts[i + 1]] for x in xs])
        if self.prim == "alltoall":
            b = len(xs[0]) // n
            return np.concatenate([x[i * b:(i + 1) * b] for x in xs])
        if self.prim == "gatherv":
            return np.concatenate(xs) if rank == self.root else None
        if self.prim == "scatterv":
            x = xs[self.group.index(self.root)]
            return x[cuts[i]:cuts[i + 1]]
        raise ValueError(self.prim)

    def check(self, rank, got) -> None:
        ref = self.reference(rank)
        if ref is None:
            return
        if not isinstance(got, np.ndarray):
            got = got.float().numpy() if self.dtype == "bfloat16" else got.numpy()
        assert got.shape == ref.shape, f"{self.name}: rank {rank}: shape {got.shape} != {ref.shape}"
        exact = np.dtype(ref.dtype).kind in "iu" or self.prim in MOVES or self.op in ("min", "max") \
            or self.dtype == "bfloat16"          # bfloat16 inputs are small integers: exact sums
        if exact:
            np.testing.assert_array_equal(got, ref, err_msg=f"{self.name}: rank {rank}")
        else:
            tol = 1e-4 if ref.dtype == np.float32 else 1e-11     # inputs are O(10)
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol, err_msg=f"{self.name}: rank {rank}")


def _reduce(arrs, op):
    acc = arrs[0].copy()
    for a in arrs[1:]:
        acc = _UFUNC[op](acc, a).astype(acc.dtype)
    return acc


def _values(rng, dtype, m, op):
    """Inputs that keep every reduction in range (and bfloat16 sums exact)."""
    if dtype == "bfloat16":                  # products of +-1, +-2 and sums of small ints
        pool = [-2.0, -1.0, 1.0, 2.0] if op == "prod" else np.arange(-8.0, 9.0)
        return rng.choice(pool, m).astype(np.float32)
    if np.dtype(dtype).kind in "iu":
        lo, hi = ((1, 4) if op == "prod" else (-50, 51)) if dtype != "uint8" else (0, 256)
        return rng.integers(lo, hi, m).astype(dtype)
    if op == "prod":
        return rng.uniform(0.5, 1.5, m).astype(dtype)
    return (rng.standard_normal(m) * 10).astype(dtype)


def count_patterns(rng, n):
    """Empty, equal, uneven with an empty member, and uneven of several KiB."""
    uneven = rng.integers(1, 8, n)
    uneven[rng.integers(0, n)] = 0
    return [(0,) * n, (5,) * n, tuple(int(c) for c in uneven),
            tuple(1000 + 37 * j for j in range(n))]


def make_case(rng, prim, group, dtype, counts, op, k) -> Case:
    n = len(group)
    root = group[k % n]
    equal = prim in ("allreduce", "reduce", "bcast")
    if equal:
        counts = (counts[-1],) * n           # the buffer's length on every member
    if prim == "alltoall":
        counts = (counts[-1] * n,) * n       # n blocks of counts[-1]
    if prim in ("allreduce", "reduce", "bcast", "alltoall", "allgatherv", "gatherv"):
        sizes = counts if prim in ("allgatherv", "gatherv") else (counts[0],) * n
    else:                                    # reduce_scatterv, scatterv: the whole buffer
        sizes = (int(sum(counts)),) * n
    inputs = tuple(_values(rng, dtype, s, op) for s in sizes)
    name = f"{prim} {dtype} {op if prim in REDUCTIONS else ''} group {list(group)} root {root} counts {list(counts)}"
    return Case(name, prim, tuple(group), dtype, tuple(int(c) for c in counts), op, root, inputs)


def cases_for_group(seed, group, prims=PRIMS, bf16=False):
    """Every primitive x dtype x count pattern on one group (x the four ops, over the dtypes)."""
    rng = np.random.default_rng([seed, *group])
    out, k = [], 0
    for prim in prims:
        dtypes = list(REDUCE_DTYPES if prim in REDUCTIONS else MOVE_DTYPES)
        if bf16 and prim == "allreduce":
            dtypes.append("bfloat16")
        for d, dtype in enumerate(dtypes):
            for j, counts in enumerate(count_patterns(rng, len(group))):
                op = OPS[(j + d) % 4]        # every op meets every count pattern
                out.append(make_case(rng, prim, group, dtype, counts, op, k))
                k += 1
    return out
