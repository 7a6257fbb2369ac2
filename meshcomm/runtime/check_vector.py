"""The agreement check's vector: a call's fields as a fixed-size row of int64 hashes
(meshcomm.runtime.agreement), equal on two processes exactly when their fields are, and
comparable in one MIN-allreduce or one round of rows."""
from __future__ import annotations

import hashlib

import numpy as np

from ..caches import memo

__all__ = ["CODES", "MAX_FIELDS", "NONE", "vector", "vector_any", "masked_codes", "signature_key", "decided"]

CODES = {"kind": ("numpy", "torch", "jax"), "devtype": ("cpu", "cuda")}
MAX_FIELDS = 12
NONE = int(np.iinfo(np.int64).max)          # "no value" in the check vector (loses every min)


def h62(v) -> int:
    """A hash of repr(v), the same in every process (unlike hash()), in [0, 2**62)."""
    return int.from_bytes(hashlib.blake2b(repr(v).encode(), digest_size=8).digest(), "little") >> 2


@memo(maxsize=1024)
def vector(fields: tuple, eligible: bool) -> np.ndarray:
    """[ineligible, min part of each field, min part of each negated field]: after a
    MIN-allreduce a field agrees on every process that has it when min == max."""
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"an agreement check compares at most {MAX_FIELDS} fields")
    vals = []
    for k, v in fields:
        if v is None:
            vals.append(None)
        elif k in CODES:
            vals.append(CODES[k].index(v) + 1)
        else:
            vals.append(h62((k, v)))
    vals += [None] * (MAX_FIELDS - len(vals))
    lo = [NONE if v is None else v for v in vals]
    neg_hi = [NONE if v is None else -v for v in vals]
    row = np.array([0 if eligible else -1] + lo + neg_hi, dtype=np.int64)
    row.setflags(write=False)           # cached: shared by every call with these fields
    return row


def vector_any(fields: tuple, eligible: bool) -> np.ndarray:
    """`vector`, cached when the fields are hashable."""
    try:
        return vector(fields, eligible)
    except TypeError:
        return vector.__wrapped__(fields, eligible)


def masked_codes(vec: np.ndarray, names) -> np.ndarray:
    """`vec` with the array kind and device type left out (as if unknown)."""
    m = vec.copy()
    for i, k in enumerate(names):
        if k in CODES:
            m[1 + i] = m[1 + MAX_FIELDS + i] = NONE
    return m


def signature_key(p2p, vec: np.ndarray, names) -> np.ndarray:
    """The vector a signature communicator is kept under: this process's own, with the kind
    and device type it does not know (no tiles) taken from the call every process agreed on
    before; where it knows them they must be those (else no communicator is found)."""
    if not any(k in CODES for k in names):
        return vec
    agreed = getattr(p2p, "_agree_codes", {}).get(masked_codes(vec, names).tobytes())
    if agreed is None:
        return vec
    filled = np.where(vec == NONE, agreed, vec)
    return agreed if np.array_equal(filled, agreed) else vec


def decided(out: list) -> bool:
    lo, neg_hi = out[1:1 + MAX_FIELDS], out[1 + MAX_FIELDS:]
    return out[0] >= 0 and all(a == -b or a == NONE for a, b in zip(lo, neg_hi))
