"""NaN and Inf through the codecs: ZFP blocks holding one travel raw, cast overflows travel exact.

ZFP has no NaN or Inf (a block holding one decodes to finite garbage), and a bf16/fp16 cast
turns finite values beyond its range into Inf. Every codec therefore sends such values
beside its stream, with no byte more for tiles that hold none:

* The check: one pass over the tile (`all_finite`: a sum, finite exactly when every addend
  is; only a non-finite sum, or an overflowing one, looks at the values one by one), or over
  a cast's 16-bit output (`wire_finite`: two max reductions). The payload of a finite tile
  is the plain one (ZFP's stream, bit for bit zfpy's; the cast's 2-byte values).
* ZFP: a block (4**d values) holding a non-finite value is "special": its values are zeroed
  before ZFP codes the tile, so ZFP codes it as an all-zero block, and its values travel
  raw (the tile's dtype) after the stream, in block order, each block's values in C order.
  - Fixed rate: every block is `block_bits` bits at a known offset, and an all-zero block
    is a 0 bit followed by zero padding. A special block is marked by setting its second
    bit (zfpy decodes it as zeros: it skips the padding unread), and block 0 is made
    special whenever any is, so a receiver learns from 2 bits whether a tail follows the
    `wire_bytes` head, and from the marks how long it is (`tail_bytes`). The head's size
    stays `wire_bytes`.
  - Tolerance and precision (the length travels anyway): the special blocks' indices and
    values follow the stream in a section with a 12-byte footer, making the payload's
    length 4 modulo 8 (ZFP's streams are whole 64-bit words), so a plain stream and one
    with a section cannot be confused.
* Casts: NaN and Inf stay NaN and Inf in bf16/fp16. A finite value the cast turns into Inf
  is written as a reserved NaN pattern (`_MARK`) and travels exact after the 2-byte values;
  element 0 is marked too whenever any is, so a receiver reads one element to learn whether
  a tail follows. An input NaN whose cast would be that pattern is sent as the canonical
  quiet NaN.

Non-finite values arrive bit for bit, NaN payloads included (ZFP: raw; casts: NaN payloads
as the cast gives them: bf16 canonical, fp16 keeps the top 10 payload bits), and so do the
finite values sharing a special ZFP block with one (raw: exact).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["all_finite", "wire_finite", "special_blocks", "block_elements", "mark", "marked", "section", "unsection",
           "SECTION_MAGIC", "FOOTER_BYTES"]

SECTION_MAGIC = 0x4E4F4E46          # the footer's last 4 bytes (little-endian)
FOOTER_BYTES = 12                   # <u8 section bytes, <u4 magic


def all_finite(a: np.ndarray) -> bool:
    """Whether every value of the float array `a` is finite: its sum is (IEEE: a NaN or Inf
    addend leaves the sum NaN or Inf); only a non-finite sum (a non-finite value, or finite
    values whose sum overflows) is checked value by value."""
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(np.add.reduce(a, axis=None)):
            return True
    return bool(np.isfinite(a).all())


def wire_finite(bits: np.ndarray, exp: int) -> bool:
    """Whether the 16-bit floats `bits` (1-d uint16; `exp` their exponent mask: 0x7F80 bf16,
    0x7C00 fp16) are all finite: two max reductions, no temporary (a negative NaN or Inf is
    at least 0x8000 | exp as uint16, a positive one at least exp as int16, finite values below)."""
    return int(bits.max()) < (0x8000 | exp) and int(bits.view(np.int16).max()) < exp


def special_blocks(a: np.ndarray) -> np.ndarray:
    """Indices (C order over the block grid, ZFP's order) of the 4**d blocks of the ZFP-shaped
    tile `a` holding a non-finite value."""
    bad = ~np.isfinite(a)
    grid = tuple(-(-n // 4) for n in a.shape)
    pad = [(0, 4 * g - n) for g, n in zip(grid, a.shape)]
    if any(p for _, p in pad):
        bad = np.pad(bad, pad)
    split = [x for g in grid for x in (g, 4)]
    return np.flatnonzero(bad.reshape(split).any(axis=tuple(range(1, 2 * len(grid), 2))))


def block_elements(zshape: tuple[int, ...], blocks: np.ndarray) -> np.ndarray:
    """Flat indices (C order in `zshape`) of the values of `blocks`: block by block, each
    block's values in C order, the part of an edge block outside the tile left out."""
    d = len(zshape)
    grid = tuple(-(-n // 4) for n in zshape)
    coords = np.unravel_index(np.asarray(blocks, np.int64), grid)
    off = np.indices((4,) * d).reshape(d, -1)
    pos = [c[:, None] * 4 + o[None, :] for c, o in zip(coords, off)]
    inside = np.ones(pos[0].shape, bool)
    for p, n in zip(pos, zshape):
        inside &= p < n
    return np.ravel_multi_index(tuple(p[inside] for p in pos), zshape)


def _words(head: np.ndarray) -> np.ndarray:
    return head.view("=u8")              # ZFP's stream: 64-bit words, bit k of word k // 64


def mark(head: np.ndarray, blocks: np.ndarray, block_bits: int) -> None:
    """Set the second bit of each of `blocks` in the fixed-rate stream `head` (writable)."""
    k = np.asarray(blocks, np.uint64) * np.uint64(block_bits) + np.uint64(1)
    np.bitwise_or.at(_words(head), (k >> np.uint64(6)).astype(np.intp), np.uint64(1) << (k & np.uint64(63)))


def marked(head: np.ndarray, nblocks: int, block_bits: int, first_only: bool = False):
    """The marked blocks of a fixed-rate stream (a 0 bit, then a 1 bit): whether block 0 is
    (`first_only`: two bits read), else the indices of all of them."""
    w = _words(head)
    if first_only:
        return nblocks > 0 and int(w[0]) & 3 == 2
    k = np.arange(nblocks, dtype=np.uint64) * np.uint64(block_bits)

    def bit(j):
        return (w[(j >> np.uint64(6)).astype(np.intp)] >> (j & np.uint64(63))) & np.uint64(1)
    return np.flatnonzero((bit(k) == 0) & (bit(k + np.uint64(1)) == 1))


def section(blocks: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """The bytes after a data-dependent stream: <u8 count, <u8 block indices, the raw values,
    zero padding to 8 bytes, then the footer (<u8 bytes before it, <u4 SECTION_MAGIC)."""
    body = np.concatenate([np.array([len(blocks)], "<u8").view(np.uint8),
                           np.asarray(blocks, "<u8").view(np.uint8), raw.reshape(-1).view(np.uint8)])
    n = -(-body.size // 8) * 8
    out = np.zeros(n + FOOTER_BYTES, np.uint8)
    out[:body.size] = body
    out[n:n + 8] = np.array([n], "<u8").view(np.uint8)
    out[n + 8:] = np.array([SECTION_MAGIC], "<u4").view(np.uint8)
    return out


def unsection(payload: np.ndarray, zshape, dtype: np.dtype):
    """(stream, special blocks, element indices, raw values) of a data-dependent payload whose
    length is 4 modulo 8; ValueError naming what does not fit."""
    n = payload.size
    if n < 8 + 8 + FOOTER_BYTES or n % 8 != 4:
        raise ValueError(f"a payload with a non-finite section has 4 mod 8 bytes, at least 28; got {n}")
    foot = payload[n - FOOTER_BYTES:].tobytes()
    body_n = int(np.frombuffer(foot[:8], "<u8")[0])
    magic = int(np.frombuffer(foot[8:], "<u4")[0])
    if magic != SECTION_MAGIC or body_n % 8 or not 8 <= body_n <= n - FOOTER_BYTES - 8:
        raise ValueError(f"the payload's {n} bytes end in no valid non-finite section footer")
    start = n - FOOTER_BYTES - body_n
    body = payload[start:n - FOOTER_BYTES]
    k = int(np.frombuffer(body[:8].tobytes(), "<u8")[0])
    nblocks = math.prod(-(-s // 4) for s in zshape)
    if not 0 < k <= nblocks or 8 + 8 * k > body_n:
        raise ValueError(f"the non-finite section names {k} blocks of {nblocks}")
    blocks = np.frombuffer(body[8:8 + 8 * k].tobytes(), "<u8").astype(np.int64)
    if blocks[-1] >= nblocks or (k > 1 and (np.diff(blocks) <= 0).any()):
        raise ValueError(f"the non-finite section's block indices are not increasing below {nblocks}")
    el = block_elements(tuple(zshape), blocks)
    raw_n = el.size * dtype.itemsize
    if not 0 <= body_n - (8 + 8 * k + raw_n) < 8:
        raise ValueError(f"the non-finite section has {body_n} bytes, {k} blocks of raw values need "
                         f"{8 + 8 * k + raw_n} and padding below 8")
    raw = body[8 + 8 * k:8 + 8 * k + raw_n].view(dtype)
    return payload[:start], blocks, el, raw
