"""meshcomm.compression: bitwise equality with zfpy's own round trip, exact wire sizes, error
bounds, chunked coding, bad inputs, odd shapes and torch CPU tensors."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

zfpy = pytest.importorskip("zfpy")

from meshcomm import compression as C  # noqa: E402
from meshcomm.compression import AUTO, Cast, Encoded, ZFP  # noqa: E402

MODES = [dict(rate=8), dict(rate=16), dict(rate=12.5), dict(tolerance=1e-3), dict(tolerance=0.25),
         dict(precision=10), dict(precision=24)]
SHAPES = [(1,), (7,), (33,), (4, 4), (9, 10), (1, 17), (5, 6, 7), (3, 1, 9), (5, 4, 3, 6),
          (2, 3, 5, 4)]
MERGED = [((2, 3, 4, 5, 6), (6, 4, 5, 6)), ((3, 2, 2, 5, 1, 6), (12, 5, 1, 6))]


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    smooth = np.cumsum(rng.standard_normal(shape), axis=-1) if shape else rng.standard_normal()
    return (smooth + 0.1 * rng.standard_normal(shape)).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _reference(tile, **mode):
    return zfpy.decompress_numpy(zfpy.compress_numpy(tile, **mode))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_round_trip_is_zfpys_own_bit_for_bit(dtype):
    for mode in MODES:
        c = ZFP(**mode)
        for shape in SHAPES:
            a = _data(shape, dtype)
            e = c.encode(a)
            assert e.payload.dtype == np.uint8 and e.payload.ndim == 1
            assert e.payload.tobytes() == zfpy.compress_numpy(a, write_header=False, **mode)
            y = c.decode(e)
            assert y.shape == shape and y.dtype == a.dtype
            np.testing.assert_array_equal(_bits(y), _bits(_reference(a, **mode)), err_msg=f"{c} {shape}")
        for shape, merged in MERGED:
            a = _data(shape, dtype)
            y = c.decode(c.encode(a))
            assert y.shape == shape
            np.testing.assert_array_equal(_bits(y).reshape(merged), _bits(_reference(a.reshape(merged), **mode)))


def test_received_bytes_decode_from_any_buffer_and_into_out():
    a = _data((13, 6), "float32")
    for c in (ZFP(rate=8), ZFP(tolerance=1e-3), ZFP(precision=16), Cast("bf16"), Cast("fp16")):
        e = c.encode(a)
        want = c.decode(e)
        recv = np.zeros(e.nbytes + 3, np.uint8)          # a receive buffer at an odd offset
        recv[3:] = e.payload
        for buf in (e.payload.tobytes(), bytearray(e.payload.tobytes()), memoryview(bytearray(e.payload)),
                    recv[3:], e.payload.copy().view(np.uint8)):
            got = c.decode(Encoded(buf, c, "float32", (13, 6)))
            np.testing.assert_array_equal(_bits(got), _bits(want))
        big = np.full((20, 6), 7.0, np.float32)         # a contiguous slice of a gather buffer
        assert c.decode(e, out=big[4:17]) is not None
        np.testing.assert_array_equal(_bits(big[4:17]), _bits(want))
        assert (big[:4] == 7).all() and (big[17:] == 7).all()
        strided = np.zeros((13, 12), np.float32)[:, ::2]   # a non-contiguous out
        c.decode(e, out=strided)
        np.testing.assert_array_equal(_bits(strided), _bits(want))
        assert C.decode(e).shape == (13, 6) and e.decode().shape == (13, 6)


def test_non_contiguous_tiles_code_like_their_contiguous_copy():
    a = _data((12, 10), "float64")
    for view in (a.T, a[::2], a[:, 1:7], np.asfortranarray(a)):
        for c in (ZFP(rate=8), ZFP(tolerance=1e-2), Cast("bf16")):
            assert c.encode(view).payload.tobytes() == c.encode(np.ascontiguousarray(view)).payload.tobytes()


def test_fixed_rate_wire_bytes_are_exact():
    rng = np.random.default_rng(1)
    rates = (2.125, 2.9, 3, 4, 7.3, 8, 12.25, 16, 31.9, 32, 48, 64)
    checked = 0
    for ndim in (1, 2, 3, 4, 5):
        for _ in range(6):
            shape = tuple(int(n) for n in rng.integers(1, 10 if ndim < 4 else 5, size=ndim))
            for dtype in ("float32", "float64"):
                a = (rng.standard_normal(shape) * 10.0 ** rng.integers(-20, 20)).astype(dtype)
                for r in rates:
                    c = ZFP(rate=r)
                    try:
                        want = c.wire_bytes(shape, dtype)
                    except ValueError:              # below ZFP's minimum: refused, never run
                        assert math.floor(4 ** min(ndim, 4) * r + 0.5) < (9 if dtype == "float32" else 12)
                        continue
                    assert c.encode(a).nbytes == want == c.max_wire_bytes(shape, dtype), (c, shape, dtype)
                    checked += 1
    assert checked > 500
    assert ZFP(rate=8).wire_bytes((9, 10), "float32") == 3 * 3 * 16 * 8 // 8   # 9 blocks of 128 bits
    assert ZFP(rate=8).wire_bytes((0, 5), np.float32) == 0 and ZFP(tolerance=1).wire_bytes((4,), "float32") is None
    for c in (Cast("bf16"), Cast("fp16")):
        for shape in ((), (7,), (3, 5, 2)):
            for dtype in ("float32", "float64", "float16"):
                assert c.encode(_data(shape, dtype)).nbytes == c.wire_bytes(shape, dtype) == 2 * math.prod(shape)


def test_rates_below_zfps_block_minimum_are_refused_before_zfpy_runs():
    with pytest.raises(ValueError, match=r"zfp\(rate=2\) on a 1-d float32 tile is 8 bits .* rate >= 2.125"):
        ZFP(rate=2).encode(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="1-d float64"):
        ZFP(rate=2.5).wire_bytes((8,), "float64")
    assert ZFP(rate=2.125).encode(np.ones(8, np.float32)).nbytes == 8
    assert ZFP(rate=0.5).wire_bytes((4, 4, 4), "float32") == 8      # 3-d: 32 bits per block is fine


def test_data_dependent_sizes_stay_under_max_wire_bytes():
    rng, ratios = np.random.default_rng(2), []
    for dtype, udt in (("float32", np.uint32), ("float64", np.uint64)):
        for shape in ((37,), (9, 7), (5, 6, 7), (5, 5, 6, 3)):
            raw = rng.integers(0, np.iinfo(udt).max, size=shape, dtype=udt, endpoint=True).view(dtype)
            raw = np.where(np.isfinite(raw), raw, 1).astype(dtype)   # random bits: worst case
            for c in (ZFP(tolerance=1e-300 if dtype == "float64" else 1e-40), ZFP(precision=64), ZFP(precision=9)):
                n, bound = c.encode(raw).nbytes, c.max_wire_bytes(shape, dtype)
                assert 0 < n <= bound and n % 8 == 0
                ratios.append(n / bound)
    assert max(ratios) > 0.9                                    # and not loose


def test_frame_carries_a_data_dependent_payload():
    c = ZFP(tolerance=1e-3)
    a = _data((40, 3), "float32")
    e = c.encode(a)
    f = C.frame(e.payload)
    assert f.nbytes == e.nbytes + C.SIZE_HEADER_BYTES
    recv = np.zeros(c.max_wire_bytes(a.shape, a.dtype) + C.SIZE_HEADER_BYTES, np.uint8)
    recv[:f.size] = f                                   # a receive posted at the bound
    got = c.decode(Encoded(C.unframe(bytearray(recv)), c, a.dtype, a.shape))
    np.testing.assert_array_equal(got, c.decode(e))
    with pytest.raises(ValueError, match="frame says"):
        C.unframe(f[:-1])


def test_tolerance_bounds_the_error():
    rng = np.random.default_rng(3)
    for dtype, floor in (("float32", 2.0 ** -22), ("float64", 2.0 ** -51)):
        for shape in ((4096,), (64, 64), (16, 16, 16), (8, 8, 8, 8)):
            for data in (rng.standard_normal(shape), _data(shape, dtype) * 1e3,
                         rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, size=shape)):
                a = data.astype(dtype)
                amax = float(np.abs(a).max())
                for tol in (floor * amax, 1e-6 * amax, 1e-3, 1e-3 * amax, 0.5 * amax):
                    if tol < floor * amax:                   # below the documented floor
                        continue
                    c = ZFP(tolerance=tol)
                    err = float(np.abs(c.decode(c.encode(a)).astype(np.float64) - a).max())
                    assert err <= c.max_abs_error(a) == tol, (dtype, shape, tol, err)


def test_rate_and_precision_have_no_a_priori_bound_but_shrink_the_error():
    assert ZFP(rate=8).max_abs_error() is None and ZFP(precision=8).max_abs_error() is None
    for shape in ((4096,), (64, 64), (16, 16, 16), (8, 8, 8, 8)):
        for dtype in ("float32", "float64"):
            a = np.random.default_rng(4).standard_normal(shape).astype(dtype)
            amax = float(np.abs(a).max())
            errs = [float(np.abs(ZFP(rate=r).decode(ZFP(rate=r).encode(a)) - a).max()) for r in (8, 16, 24)]
            assert errs[0] < 0.25 * amax and errs[1] < 2.0 ** -8 * amax and errs[2] < 2.0 ** -16 * amax
            assert errs[1] < errs[0] / 16 and errs[2] < errs[1] / 16, errs


def test_cast_relative_error_and_pass_through():
    rng = np.random.default_rng(5)
    x = rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-3, 4, size=1 << 16)
    x[:3] = [1 + 2 ** -8 + 2 ** -30, 1 + 2 ** -11 + 2 ** -40, -(1 + 3 * 2 ** -9)]   # near halfway
    for c, rel, tiny in ((Cast("bf16"), 2.0 ** -8, 2.0 ** -126), (Cast("fp16"), 2.0 ** -11, 2.0 ** -14)):
        assert c.relative_error == rel
        for dtype in ("float32", "float64"):
            a = x.astype(dtype)
            y = c.decode(c.encode(a))
            assert y.dtype == a.dtype
            err = np.abs(y.astype(np.float64) - a)
            normal = np.abs(a) >= tiny
            r = err[normal] / np.abs(a[normal].astype(np.float64))
            assert r.max() <= rel and r.max() > rel / 4          # the bound, and not far from it
            assert (err[~normal] <= tiny * rel).all()             # half a subnormal step below it
            assert float(np.abs(y - a).max()) <= c.max_abs_error(a)
    h = x[:100].astype(np.float16)
    for c in (Cast("bf16"), Cast("fp16")):                       # 16-bit floats pass unchanged
        e = c.encode(h)
        assert e.payload.tobytes() == h.tobytes() and not np.shares_memory(e.payload, h)
        np.testing.assert_array_equal(_bits(c.decode(e)), _bits(h))
        assert c.max_abs_error(h) == 0.0
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = x[:100].astype(ml_dtypes.bfloat16)
    assert Cast("fp16").encode(b).payload.tobytes() == b.tobytes()
    np.testing.assert_array_equal(_bits(Cast("fp16").decode(Cast("fp16").encode(b))), _bits(b))


def _nonfinite(shape, dtype, seed, k=3):
    """_data with NaN (one with a payload), +Inf and -Inf at k random positions each."""
    a = _data(shape, dtype, seed)
    rng = np.random.default_rng(seed + 7)
    flat = a.reshape(-1)
    pos = rng.choice(flat.size, size=min(flat.size, 3 * k), replace=False)
    nan = np.array([0x7FC12345 if dtype == "float32" else 0x7FF8000012345678],
                   np.uint32 if dtype == "float32" else np.uint64).view(dtype)[0]
    vals = [np.nan, nan, np.inf, -np.inf]
    for j, p in enumerate(pos):
        flat[p] = vals[j % 4]
    return a


def _block_hits(zshape, mask):
    """Which 4**d blocks (the block grid, C order: ZFP's) of a ZFP-shaped mask hold a True."""
    grid = [-(-n // 4) for n in zshape]
    m = np.pad(mask, [(0, 4 * g - n) for g, n in zip(grid, zshape)])
    return m.reshape([x for g in grid for x in (g, 4)]).any(axis=tuple(range(1, 2 * len(grid), 2)))


def _per_value(zshape, hits):
    """A per-value mask of the blocks `hits` marks."""
    return hits[tuple(np.indices(zshape) // 4)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nan_and_inf_come_back_bit_for_bit_in_every_mode(dtype):
    # ZFP has no NaN or Inf: a NaN came back as -3.97, an Inf as -2.0
    checked = 0
    for mode in MODES:
        c = ZFP(**mode)
        for shape in SHAPES + [s for s, _ in MERGED] + [(8, 8), (64,)]:
            for seed in range(2):
                a = _nonfinite(shape, dtype, seed, k=1 + seed)
                zs = C.zfp_shape(shape)
                az = a.reshape(zs)
                bad = ~np.isfinite(az)
                hits = _block_hits(zs, bad)
                if c.fixed_size:                     # block 0 is marked raw too
                    hits.reshape(-1)[0] = True
                special = _per_value(zs, hits)
                e = c.encode(a)
                y = c.decode(e)
                assert y.shape == shape and y.dtype == a.dtype
                yz = y.reshape(zs)
                # the blocks holding NaN/Inf raw: bit for bit, NaN payloads included
                np.testing.assert_array_equal(_bits(yz[special]), _bits(az[special]), err_msg=f"{c} {shape}")
                # the other blocks: zfpy's own round trip of the tile, bit for bit
                with np.errstate(invalid="ignore", over="ignore"):
                    ref = _reference(az, **mode)
                np.testing.assert_array_equal(_bits(yz[~special]), _bits(ref[~special]), err_msg=f"{c} {shape}")
                if c.tolerance is not None:
                    fin = ~bad
                    assert np.abs(yz[fin].astype(np.float64) - az[fin]).max(initial=0) <= c.tolerance
                raw = int(special.sum()) * a.dtype.itemsize
                if c.fixed_size:                     # the head's size, then the raw values
                    head = c.wire_bytes(shape, dtype)
                    assert e.nbytes == head + raw == head + c.tail_bytes(e.payload[:head], shape, dtype)
                else:
                    assert e.nbytes % 8 == 4
                assert e.nbytes <= c.max_payload_bytes(shape, dtype)
                out = np.full(shape, 5.0, dtype)
                c.decode(e, out=out)
                np.testing.assert_array_equal(_bits(out), _bits(y))
                strided = np.zeros(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]
                c.decode(e, out=strided)
                np.testing.assert_array_equal(_bits(strided), _bits(y))
                checked += 1
    assert checked == len(MODES) * (len(SHAPES) + len(MERGED) + 2) * 2


def test_nonfinite_edge_cases():
    for c in (ZFP(rate=8), ZFP(rate=2.125), ZFP(tolerance=1e-3), ZFP(precision=10)):
        for a in (np.full((5, 6), np.nan, np.float32), np.array(np.inf, np.float32),
                  np.array([-np.inf], np.float32),
                  np.array([1.0, 2.0, 3.0, 4.0, np.nan], np.float32)):
            y = c.decode(c.encode(a))
            np.testing.assert_array_equal(_bits(y), _bits(a), err_msg=f"{c} {a}")
        # the only non-finite value in block 0; in the last, partial block
        for at in (0, 102):
            a = _data((103,), "float32")
            a[at] = -np.inf
            y = c.decode(c.encode(a))
            assert y[at] == -np.inf and np.isfinite(np.delete(y, at)).all()
    # finite values whose sum overflows are finite: the plain stream
    big = np.full(64, 3e38, np.float32)
    assert C.nonfinite.all_finite(big) and not C.nonfinite.all_finite(np.array([1.0, np.nan]))
    assert ZFP(rate=8).encode(big).payload.tobytes() == zfpy.compress_numpy(big, rate=8, write_header=False)


def test_nonfinite_payloads_cut_short_or_damaged_are_refused():
    a = _nonfinite((16, 8), "float32", 0)
    e = ZFP(rate=8).encode(a)
    head = ZFP(rate=8).wire_bytes(a.shape, a.dtype)
    assert e.nbytes > head
    with pytest.raises(ValueError, match=f"tile has {head} bytes, expected {e.nbytes}"):
        ZFP(rate=8).decode(Encoded(e.payload[:head], e.codec, e.dtype, e.shape))
    with pytest.raises(ValueError, match=f"expected {e.nbytes}"):
        ZFP(rate=8).decode(Encoded(e.payload[:-4], e.codec, e.dtype, e.shape))
    t = ZFP(tolerance=1e-3)
    e = t.encode(a)
    bad = e.payload.copy()
    bad[-1] ^= 1                                            # the footer's magic
    with pytest.raises(ValueError, match="no valid non-finite section"):
        t.decode(Encoded(bad, t, e.dtype, e.shape))
    with pytest.raises(ValueError, match="4 mod 8"):
        t.decode(Encoded(e.payload[:20], t, e.dtype, e.shape))
    c = Cast("fp16")
    e = c.encode(np.array([1.0, 7e4, 2.0], np.float32))
    assert e.nbytes == 6 + 2 * 4 and c.tail_bytes(e.payload[:6], (3,), "float32") == 8
    with pytest.raises(ValueError, match="tile has 6 bytes, expected 14"):
        c.decode(Encoded(e.payload[:6], c, "float32", (3,)))


@pytest.mark.parametrize("to", ["bf16", "fp16"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_casts_keep_nan_and_inf_and_send_overflows_exact(to, dtype):
    # fp16 raised on 7e4, bf16 turned 3.4e38 (float32) and 1e39 (float64) into Inf silently
    c = Cast(to)
    over = 7e4 if to == "fp16" else 3.397e38
    a = _nonfinite((40, 7), dtype, 3)
    a[5, 1], a[9, 6], a[0, 3] = over, -over, -2 * over if dtype == "float64" or to == "fp16" else -over
    y = c.decode(c.encode(a))
    bad = ~np.isfinite(a)
    assert (np.isnan(y) == np.isnan(a)).all() and (y[np.isinf(a)] == a[np.isinf(a)]).all()
    big = np.isfinite(a) & (np.abs(a) >= over)
    assert big.sum() == 3 and (y[big] == a[big]).all()             # exact
    fine = ~bad & ~big
    fine.reshape(-1)[0] = False                                     # element 0: marked, exact
    assert y.reshape(-1)[0] == a.reshape(-1)[0]
    rel = np.abs(y[fine].astype(np.float64) - a[fine]) / np.maximum(np.abs(a[fine]), 2.0 ** -126)
    assert rel.max() <= c.relative_error
    e = c.encode(a)
    assert e.nbytes == 2 * a.size + 4 * a.dtype.itemsize <= c.max_payload_bytes(a.shape, dtype)
    out = np.empty((40, 14), dtype)[:, ::2]
    c.decode(e, out=out)
    np.testing.assert_array_equal(_bits(out), _bits(y))
    # finite tiles, NaN and Inf alone: 2 bytes a value, no tail
    f = _data((40, 7), dtype)
    assert c.encode(f).nbytes == 2 * f.size
    n = _nonfinite((40, 7), dtype, 4)
    assert c.encode(n).nbytes == 2 * n.size and np.array_equal(np.isnan(c.decode(c.encode(n))), np.isnan(n))
    # an input NaN whose cast reads as the mark (fp16 keeps a NaN's top payload bits; bf16
    # makes every NaN canonical): still NaN, no tail
    if to == "fp16":
        mark = 0x7C6D
        nan = (np.array([0x7F800000 | (mark & 0x3FF) << 13], np.uint32).view(np.float32) if dtype == "float32"
               else np.array([0x7FF0000000000000 | (mark & 0x3FF) << 42], np.uint64).view(np.float64))
        m = np.concatenate([nan, nan, np.ones(1, dtype)])
        with np.errstate(invalid="ignore"):
            assert int(m.astype(np.float16).view(np.uint16)[0]) == mark
        e = c.encode(m)
        assert e.nbytes == 6 and np.isnan(c.decode(e)[:2]).all() and c.decode(e)[2] == 1.0
    # 0-d
    z = np.array(-over, dtype)
    assert c.decode(c.encode(z)) == z and c.decode(c.encode(z)).shape == ()


@pytest.mark.parametrize("mode", [dict(rate=8), dict(rate=2.25), dict(tolerance=1e-3), dict(precision=12)])
def test_chunks_decode_to_the_whole_tile(mode):
    c = ZFP(**mode)
    for shape in ((103,), (37, 10), (21, 5, 6), (10, 3, 5, 2), (7, 3, 4, 5, 2), (9, 2, 3, 4, 5)):
        a = _data(shape, "float32")
        whole = c.encode(a)
        row_bytes = a[:1].nbytes
        for target in (1, 5 * row_bytes, 3 * a.nbytes):
            parts = C.chunks(shape, "float32", c, target)
            step = C.chunk_rows(shape, c)
            assert step == (4 if len(shape) <= 4 else 4 // math.gcd(math.prod(shape[1:-3]), 4))
            assert parts[0].start == 0 and parts[-1].stop == shape[0]
            assert all(p.stop == q.start and p.start % step == 0 for p, q in zip(parts, parts[1:]))
            assert all(math.prod(p.shape[:-3]) % 4 == 0 for p in parts[:-1] if len(shape) > 4)
            out = np.empty_like(a)
            encs = [c.encode(a[p.index]) for p in parts]
            for p, e in zip(parts, encs):
                assert p.wire_bytes == (e.nbytes if c.fixed_size else None)
                c.decode(e, out=out[p.index])
            np.testing.assert_array_equal(_bits(out), _bits(c.decode(whole)), err_msg=f"{c} {shape} {target}")
            if c.fixed_size:
                zs = C.zfp_shape(shape)
                bits = [math.prod(-(-n // 4) for n in C.zfp_shape(p.shape)) * c.block_bits(zs, "float32")
                        for p in parts[:-1]]
                joined = b"".join(e.payload.tobytes() for e in encs)
                assert (joined == whole.payload.tobytes()) == all(b % 64 == 0 for b in bits), (c, shape, target)
    if mode == dict(rate=2.25):       # 9 bits per 1-d block: chunk streams are padded, values equal
        parts = C.chunks((103,), "float32", c, 16)
        assert len(parts) > 1 and sum(p.wire_bytes for p in parts) > c.wire_bytes((103,), "float32")


def test_chunks_of_casts_empty_and_0d_tiles():
    parts = C.chunks((10, 3), "float32", "bf16", 24)
    assert [(p.start, p.stop) for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert all(p.wire_bytes == 12 for p in parts)
    assert [(p.start, p.stop) for p in C.chunks((10, 3), "float32", None, 48)] == [(0, 4), (4, 8), (8, 10)]
    assert C.chunks((0, 3), "float32", ZFP(rate=8), 64) == (C.Chunk(0, 0, (0, 3), 0),)
    (p,) = C.chunks((), "float64", ZFP(rate=8), 64)
    assert p.index == () and p.wire_bytes == 8
    with pytest.raises(ValueError, match="target_bytes=0"):
        C.chunks((4,), "float32", None, 0)
    with pytest.raises(ValueError, match="not 'auto'"):
        C.chunks((4,), "float32", "auto", 16)


def test_odd_shapes_0d_empty_and_merged():
    for c in (ZFP(rate=8), ZFP(tolerance=1e-3), ZFP(precision=20), Cast("bf16")):
        s = np.float32(3.25) * np.ones((), np.float32)
        y = c.decode(c.encode(s))
        assert y.shape == () and abs(float(y) - 3.25) < 0.1
        if isinstance(c, ZFP):
            assert float(y) == float(_reference(np.array([3.25], np.float32), **{c.mode: getattr(c, c.mode)})[0])
        for shape in ((0,), (3, 0, 2), (0, 2, 3, 4, 5)):
            e = c.encode(np.ones(shape, np.float64))
            assert e.nbytes == 0 and c.decode(e).shape == shape and c.decode(e).dtype == np.float64
    assert C.zfp_shape(()) == (1,) and C.zfp_shape((2, 3, 4, 5, 6, 7)) == (24, 5, 6, 7)


def test_bad_codecs_and_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"rate=-1 must be > 0"):
        ZFP(rate=-1)
    for bad in (dict(rate=0), dict(rate=65), dict(rate=float("nan")), dict(tolerance=0),
                dict(tolerance=float("inf")), dict(precision=0), dict(precision=65), dict(precision=8.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ZFP(**bad)
    with pytest.raises(ValueError, match=r"exactly one of .* \(got none\)"):
        ZFP()
    with pytest.raises(ValueError, match=r"exactly one of .* \(got rate, tolerance\)"):
        ZFP(rate=8, tolerance=1e-3)
    with pytest.raises(TypeError, match="rate must be a number, got str"):
        ZFP(rate="8")
    with pytest.raises(TypeError, match=r"zfp\(rate=8\) cannot encode dtype int8"):
        ZFP(rate=8).encode(np.ones(4, np.int8))
    with pytest.raises(TypeError, match=r"bf16 cannot encode dtype int8"):
        Cast("bf16").encode(np.ones(4, np.int8))
    with pytest.raises(TypeError, match=r"cannot encode dtype int32: it takes float32 and float64 \(ZFP's integer modes are lossy"):
        ZFP(precision=32).encode(np.ones(4, np.int32))
    with pytest.raises(TypeError, match="float16"):
        ZFP(rate=8).wire_bytes((4,), "float16")
    with pytest.raises(ValueError, match=r"unknown compression 'gzip': expected None, 'bf16', 'fp16', 'auto'"):
        C.coerce("gzip")
    with pytest.raises(TypeError, match="got list"):
        C.coerce([8])
    with pytest.raises(TypeError, match=r"zfp\(rate=8\) encodes a NumPy array .* got list"):
        ZFP(rate=8).encode([1.0, 2.0])
    with pytest.raises(ValueError, match=r"Cast\('gzip'\): expected one of bf16, fp16"):
        Cast("gzip")
    e = ZFP(rate=8).encode(np.ones((8, 8), np.float32))
    with pytest.raises(ValueError, match=r"encoded by zfp\(rate=8\), not zfp\(rate=16\)"):
        ZFP(rate=16).decode(e)
    with pytest.raises(ValueError, match=r"payload of a float32\[8, 8\] tile has 63 bytes, expected 64"):
        ZFP(rate=8).decode(Encoded(e.payload[:-1], e.codec, e.dtype, e.shape))
    t = ZFP(tolerance=1e-3).encode(np.ones((8, 8), np.float32))
    with pytest.raises(ValueError, match="positive multiple of 8"):
        ZFP(tolerance=1e-3).decode(Encoded(b"", t.codec, t.dtype, t.shape))
    with pytest.raises(ValueError, match=r"out is float64\[8, 8\], the tile is float32\[8, 8\]"):
        e.decode(out=np.empty((8, 8)))
    ro = np.empty((8, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        e.decode(out=ro)
    with pytest.raises(TypeError, match="Encoded needs a codec .* got str"):
        Encoded(e.payload, "zfp(rate=8)", e.dtype, e.shape)
    with pytest.raises(TypeError, match="max_abs_error needs the tile"):
        Cast("fp16").max_abs_error()
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.shape = (64,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZFP(rate=8).rate = 4


def test_coerce_and_names():
    assert C.coerce(None) is None and C.coerce("auto") is AUTO and str(AUTO) == "auto"
    assert C.coerce("bf16") == Cast("bf16") and C.coerce(" FP16 ") == Cast("fp16") == Cast("float16")
    for c in (ZFP(rate=8), ZFP(rate=12.5), ZFP(tolerance=1e-3), ZFP(tolerance=1e-05), ZFP(precision=16),
              Cast("bf16"), Cast("fp16")):
        assert C.coerce(c) is c and C.coerce(str(c)) == c and hash(C.coerce(str(c))) == hash(c)
    assert [str(c) for c in (ZFP(rate=8), ZFP(rate=np.float32(8)), ZFP(tolerance=1e-3), ZFP(precision=16))] \
        == ["zfp(rate=8)", "zfp(rate=8)", "zfp(tolerance=0.001)", "zfp(precision=16)"]
    assert repr(ZFP(rate=8)) == "ZFP(rate=8)" and repr(Cast("bf16")) == "Cast('bf16')"
    assert ZFP(rate=8).fixed_size and not ZFP(tolerance=1).fixed_size and Cast("fp16").fixed_size
    with pytest.raises(ValueError, match="rate 'x' is not a number"):
        C.coerce("zfp(rate=x)")


def test_measure_gives_throughputs():
    for c in (ZFP(rate=8), "bf16"):
        enc, dec = C.measure(c, nbytes=1 << 16, repeats=2)
        assert 0 < enc < math.inf and 0 < dec < math.inf
    with pytest.raises(ValueError, match="needs a codec"):
        C.measure(None)


def test_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(_data((6, 9), "float32"))
    for c in (ZFP(rate=8), ZFP(tolerance=1e-3), Cast("bf16")):
        e = c.encode(t)
        assert e.payload.tobytes() == c.encode(t.numpy()).payload.tobytes()
        y = c.decode(e, like=t)
        assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and y.shape == t.shape
        np.testing.assert_array_equal(y.numpy(), c.decode(e))
        out = torch.zeros(6, 9)
        assert c.decode(e, out=out) is out and torch.equal(out, y)
        assert c.encode(t.T).payload.tobytes() == c.encode(np.ascontiguousarray(t.numpy().T)).payload.tobytes()
    b = torch.randn(5, 3).to(torch.bfloat16)                  # bf16 passes through, back as torch
    y = Cast("bf16").decode(Cast("bf16").encode(b), like=b)
    assert y.dtype == torch.bfloat16 and torch.equal(y, b)
    with pytest.raises(TypeError, match="int64"):
        ZFP(rate=8).encode(torch.arange(4))
