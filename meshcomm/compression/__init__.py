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
element: `wire_bytes` is exact, so a receiver can post its receive before the data arrives
(a tile holding NaN or Inf adds a tail the head announces: below).
Tolerance and precision sizes depend on the data: `wire_bytes` is None, `max_wire_bytes` is
an upper bound for finite tiles (random bits come within 10% of it; `max_payload_bytes`
for any values), and the length must travel with the payload: either the receive is posted
at `max_payload_bytes` and the length read from the message (MPI `Get_count`), or the sender sends `frame(payload)`: an 8-byte little-endian
length, then the payload (`unframe` splits it). Fixed rates below ZFP's per-block minimum of
sign + exponent bits (1-d float32 below 2.125) raise ValueError: zfpy 1.0.1 overruns its
buffer there.

Errors. ZFP(tolerance=t): |error| <= t wherever t >= 2**-22 max|x| (float32) or 2**-51 max|x|
(float64); below that ZFP is near-lossless and errors are a few ulps of the block's largest
value. Fixed rate and precision give no a-priori bound: `max_abs_error()` is None for them.
Measured on standard normal tiles of 1-4 dims: rate 8 within 2**-3 max|x|, rate 16 within
2**-10 max|x|, 8 more bits at least 16x smaller (the tests check 2**-2, 2**-8 and 16x).
Casts round to nearest even: relative error <= 2**-8 (bf16) or 2**-11 (fp16) in the normal
range, absolute <= half the smallest subnormal step below it.

NaN and Inf arrive exactly, in place, in every codec (nonfinite.py), so a sum with a NaN
addend stays NaN and one with an Inf that Inf (+Inf + -Inf: NaN). ZFP has no NaN or Inf: a
ZFP block (4**d values) holding one travels raw, its finite values too (exact), after the
stream; fixed rate keeps its `wire_bytes` head, block 0 of a tile with such a tail being
marked raw too, and `tail_bytes(head, shape, dtype)` says from the head how many bytes
follow; tolerance and precision append a section (payload length 4 mod 8). A cast keeps NaN
and Inf (NaN payloads: bf16 canonical, fp16 the top 10 bits) and sends exact, after its
2-byte values, the finite values it would turn into Inf (fp16 |x| >= 65520; bf16 |x| >=
3.3961776e38, float32's top sliver and larger float64). Tiles of finite values pay one sum
(ZFP) or two max reductions over the wire bits (casts) and travel as before, byte for byte;
`max_payload_bytes` bounds a payload whatever its values.

dtypes. ZFP: float32 and float64; its int32/int64 modes are refused (measured with zfpy
1.0.1: even precision=64 or rate=64 change int32 values below 1000 by up to 8). Casts:
float32/float64 are rounded, float16/bfloat16 tiles pass through unchanged. Other dtypes
raise TypeError naming the dtype and the codec. CPU torch tensors are accepted; `decode(...,
like=tensor)` returns torch, `out=` may be a CPU tensor.

Chunks and speed. `chunks(shape, dtype, codec, target_bytes)` cuts a tile along dim 0 on ZFP
block boundaries; chunks encode independently and decode to exactly the whole tile's values
in every mode (ZFP codes each block on its own). For fixed rate, the chunks' payloads
concatenate to the whole tile's payload when every chunk but the last codes a multiple of 64
bits (else each chunk's stream is padded to a word: same values, a few more bytes). With
NaN or Inf at fixed rate, each chunk's block 0 travels raw where the chunk has a tail (its
values exact, the whole tile's decoding differs there).
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
