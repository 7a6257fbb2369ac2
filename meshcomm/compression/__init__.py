"""Codecs for compressed collectives: ZFP (fixed rate, tolerance, precision) and bf16/fp16 casts.

    c = ZFP(rate=8)                    # or ZFP(tolerance=1e-3), ZFP(precision=16), Cast("bf16")
    e = c.encode(tile)                 # Encoded: 1-d uint8 payload + codec, dtype, shape
    y = c.decode(e, out=buf)           # or e.decode(); bitwise equal to zfpy's own round trip
    c.wire_bytes(shape, dtype)         # exact payload size (rate, casts); None (tolerance, precision)
    coerce("zfp(rate=8)")              # a compression= argument as a codec, AUTO or None

Shapes. A tile is compressed as an array of its own shape: ZFP takes 1-4 dimensions, so a
tile of more has its leading dimensions merged into one (5-d (a,b,c,d,e) -> (a*b,c,d,e)) and
a 0-d tile becomes 1-d; an empty tile encodes to an empty payload. The payload is ZFP's
stream without its header (`write_header=False`): the receiver knows codec, dtype and shape
from the plan, and `zfpy._decompress(payload, type, shape, mode=...)` gives exactly what
`zfpy.decompress_numpy(zfpy.compress_numpy(tile, mode=...))` gives (tested bit for bit). A
relay forwards `Encoded.payload` unchanged; a receiver wraps the bytes it got (bytes,
bytearray, an MPI buffer) in `Encoded(buf, codec, dtype, shape)` and decodes them.

Sizes. Fixed rate r on a d-dim tile is `ceil(blocks * floor(4**d * r + 0.5) / 64) * 8` bytes
(blocks = prod(ceil(n_i / 4)); ZFP pads its stream to 64-bit words), a cast 2 bytes per
element: `wire_bytes` is exact, so a receiver can post its receive before the data arrives.
Tolerance and precision sizes depend on the data: `wire_bytes` is None, `max_wire_bytes` is
an upper bound (random bits come within 10% of it), and the length must travel with the
payload: either the receive is posted at `max_wire_bytes` and the length read from the
message (MPI `Get_count`), or the sender sends `frame(payload)`: an 8-byte little-endian
length, then the payload (`unframe` splits it). Fixed rates below ZFP's per-block minimum of
sign + exponent bits (1-d float32 below 2.125) raise ValueError: zfpy 1.0.1 overruns its
buffer there.

Errors. ZFP(tolerance=t): |error| <= t wherever t >= 2**-22 max|x| (float32) or 2**-51 max|x|
(float64); below that ZFP is near-lossless and errors are a few ulps of the block's largest
value. Fixed rate and precision give no a-priori bound: `max_abs_error()` is None for them.
Measured on standard normal tiles of 1-4 dims: rate 8 within 2**-3 max|x|, rate 16 within
2**-10 max|x|, 8 more bits at least 16x smaller (the tests check 2**-2, 2**-8 and 16x).
Casts round to nearest even: relative error <= 2**-8 (bf16) or 2**-11 (fp16) in the normal
range, absolute <= half the smallest subnormal step below it; fp16 raises ValueError on
finite values it would turn into Inf. ZFP has no NaN or Inf: a block holding one decodes to
finite values (an Inf gradient is no longer seen after ZFP).

dtypes. ZFP: float32 and float64; its int32/int64 modes are refused (measured with zfpy
1.0.1: even precision=64 or rate=64 change int32 values below 1000 by up to 8). Casts:
float32/float64 are rounded, float16/bfloat16 tiles pass through unchanged. Other dtypes
raise TypeError naming the dtype and the codec. CPU torch tensors are accepted; `decode(...,
like=tensor)` returns torch, `out=` may be a CPU tensor.

Chunks and speed. `chunks(shape, dtype, codec, target_bytes)` cuts a tile along dim 0 on ZFP
block boundaries; chunks encode independently and decode to exactly the whole tile's values
in every mode (ZFP codes each block on its own). For fixed rate, the chunks' payloads
concatenate to the whole tile's payload when every chunk but the last codes a multiple of 64
bits (else each chunk's stream is padded to a word: same values, a few more bytes).
`measure(codec)` gives (encode, decode) GB/s of uncompressed bytes.
"""
from .base import SIZE_HEADER_BYTES, Codec, Encoded, frame, unframe
from .cast import Cast
from .chunking import Chunk, chunk_rows, chunks, measure
from .spec import AUTO, Auto, CodecLike, coerce
from .zfp import ZFP, zfp_shape

__all__ = ["ZFP", "Cast", "Auto", "AUTO", "Codec", "CodecLike", "Encoded", "Chunk", "coerce",
           "decode", "chunks", "chunk_rows", "measure", "frame", "unframe", "zfp_shape",
           "SIZE_HEADER_BYTES"]


def decode(encoded: Encoded, out=None, like=None):
    """`encoded.codec.decode(encoded, out, like)`."""
    return encoded.codec.decode(encoded, out=out, like=like)
