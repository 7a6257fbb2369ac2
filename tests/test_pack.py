"""pack / unpack on CPU (NumPy and torch), and the CUDA kernels' code run on the CPU.

The kernels in cuda/pack.cu are __host__ __device__; built with g++ and MC_HOST_EMULATION they
run every (virtual) thread of a launch in turn, on the same descriptors `plan_boxes` makes for
the GPU. That checks the descriptor builder, the box walk and the unit-width choice exactly,
without a GPU. tests/test_gpu.py runs the same kernels on a GPU.
"""
from __future__ import annotations

import ctypes
import itertools
import math

import numpy as np
import pytest
import torch

from meshcomm.backends.pack import message_elems, pack, unpack, uses_kernels
from meshcomm.cuda import KernelUnsupported, plan_boxes
from meshcomm.cuda.build import build_host_emulator
from meshcomm.cuda.kernels import ADD_KERNELS, KERNEL_NAMES, MAXD

NP_DTYPES = ["int8", "int16", "float16", "float32", "int64", "float64"]
TORCH_DTYPES = [torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.float32, torch.int64,
                torch.float64]


# -- helpers --------------------------------------------------------------------------------

def disjoint_boxes(rng, shape, max_boxes=6):
    """Random disjoint boxes of a tile (cells of a random grid), in random order, as slices."""
    cuts = []
    for n in shape:
        k = int(rng.integers(0, min(n, 3) + 1))
        inner = sorted(rng.choice(np.arange(1, n), size=min(k, n - 1), replace=False).tolist()) if n > 1 else []
        cuts.append([0] + inner + [n])
    cells = list(itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]))
    rng.shuffle(cells)
    take = cells[:int(rng.integers(1, min(len(cells), max_boxes) + 1))]
    return [tuple(slice(a, b) for a, b in cell) for cell in take]


def random_shape(rng, ndim):
    return tuple(int(rng.integers(1, 7)) for _ in range(ndim))


def np_random(rng, shape, dtype):
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    if dt.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dt)


def torch_random(rng, shape, dtype):
    if dtype.is_floating_point:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, size=shape).astype(bool))
    info = torch.iinfo(dtype)
    return torch.from_numpy(rng.integers(info.min, info.max, size=shape, endpoint=True)).to(dtype)


def reference_pack(tile, slices):
    if isinstance(tile, torch.Tensor):
        return torch.cat([tile[sl].reshape(-1) for sl in slices])
    return np.concatenate([tile[sl].ravel() for sl in slices])


def same(a, b) -> bool:
    """Bitwise equality (NaN-safe, -0.0 distinct)."""
    if isinstance(a, torch.Tensor):
        a = a.contiguous().view(torch.uint8).numpy() if a.dtype != torch.bool else a.numpy()
        b = b.contiguous().view(torch.uint8).numpy() if b.dtype != torch.bool else b.numpy()
        return a.shape == b.shape and bool((a == b).all())
    return a.shape == b.shape and a.tobytes() == b.tobytes()


# -- the CPU path -------------------------------------------------------------------------------

@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_cpu_pack_unpack_roundtrip(lib):
    rng = np.random.default_rng(0)
    dtypes = NP_DTYPES if lib == "numpy" else TORCH_DTYPES
    for case in range(70):
        ndim = 1 + case % 5
        dtype = dtypes[case % len(dtypes)]
        shape = random_shape(rng, ndim)
        tile = np_random(rng, shape, dtype) if lib == "numpy" else torch_random(rng, shape, dtype)
        slices = disjoint_boxes(rng, shape)
        buf = pack(tile, slices)
        assert same(buf, reference_pack(tile, slices)), (case, shape, slices)
        assert buf.shape[0] == message_elems(slices)
        # round trip into a poisoned tile: boxes get the values back, the rest stays poisoned
        poison = np_random(rng, shape, dtype) if lib == "numpy" else torch_random(rng, shape, dtype)
        back = poison.copy() if lib == "numpy" else poison.clone()
        unpack(buf, back, slices)
        expect = poison.copy() if lib == "numpy" else poison.clone()
        for sl in slices:
            expect[sl] = tile[sl]
        assert same(back, expect), (case, shape, slices)
        # into a given out buffer
        out = (np.empty if lib == "numpy" else lambda n, dtype: torch.empty(n, dtype=dtype))(buf.shape[0], dtype=buf.dtype)
        assert pack(tile, slices, out=out) is out and same(out, buf)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_cpu_unpack_accumulate(lib):
    rng = np.random.default_rng(1)
    dtypes = NP_DTYPES if lib == "numpy" else TORCH_DTYPES
    for case in range(40):
        dtype = dtypes[case % len(dtypes)]
        shape = random_shape(rng, 1 + case % 4)
        slices = disjoint_boxes(rng, shape)
        mk = (lambda: np_random(rng, shape, dtype)) if lib == "numpy" else (lambda: torch_random(rng, shape, dtype))
        a, b = mk(), mk()
        buf = pack(b, slices)
        got = a.copy() if lib == "numpy" else a.clone()
        unpack(buf, got, slices, accumulate=True)
        expect = a.copy() if lib == "numpy" else a.clone()
        for sl in slices:
            expect[sl] = expect[sl] + b[sl]
        assert same(got, expect), (case, dtype, shape, slices)


def test_cpu_never_uses_kernels():
    assert not uses_kernels(np.zeros(3))
    assert not uses_kernels(torch.zeros(3))


# -- descriptors ------------------------------------------------------------------------------

def test_plan_merges_contiguous_dims_and_picks_wide_units():
    a = np.zeros((8, 16, 32), np.float32)
    p = plan_boxes(a.shape, a.strides, 4, 0, 0, [(slice(0, 8), slice(0, 16), slice(0, 32))])
    rec = p.meta[p.nb + 1:]
    assert p.nb == 1 and rec[2] * rec[3] == a.nbytes and rec[6] == 0      # one row, no outer dims
    assert p.units == (16,)
    # a column band: rows of 8 floats (32 B) with a 128 B stride; 16-byte units
    p = plan_boxes(a.shape, a.strides, 4, 0, 0, [(slice(2, 4), slice(0, 16), slice(8, 16))])
    rec = p.meta[p.nb + 1:]
    assert (rec[0], rec[2], rec[3], rec[6], rec[7], rec[13]) == ((2 * 16 * 32 + 8) * 4, 2, 16, 1, 32, 128)
    # misaligned start (one float in): 4-byte units
    p = plan_boxes(a.shape, a.strides, 4, 0, 0, [(slice(0, 1), slice(0, 16), slice(1, 9))])
    assert p.units == (4,)
    # the buffer address matters too
    p = plan_boxes(a.shape, a.strides, 4, 0, 8, [(slice(0, 1), slice(0, 16), slice(0, 8))])
    assert p.units == (8,)


def test_plan_empty_boxes_and_offsets():
    a = np.zeros((4, 5), np.int16)
    sl = [(slice(0, 2), slice(0, 5)), (slice(1, 1), slice(0, 5)), (slice(2, 4), slice(1, 3))]
    p = plan_boxes(a.shape, a.strides, 2, 0, 0, sl)
    assert p.nb == 2 and p.nbytes == (10 + 4) * 2
    assert p.meta[p.nb + 1 + 20 + 1] == 20            # second record's buffer offset (bytes)


def test_plan_rejects_bad_slices_and_too_many_dims():
    a = np.zeros((4, 5))
    with pytest.raises(ValueError, match="box 0, dimension 1"):
        plan_boxes(a.shape, a.strides, 8, 0, 0, [(slice(0, 2), slice(0, 9))])
    with pytest.raises(ValueError, match="box 1 has 1 slice"):
        plan_boxes(a.shape, a.strides, 8, 0, 0, [(slice(0, 2), slice(0, 2)), (slice(0, 1),)])
    with pytest.raises(ValueError, match="step"):
        plan_boxes(a.shape, a.strides, 8, 0, 0, [(slice(0, 4, 2), slice(0, 2))])
    with pytest.raises(KernelUnsupported):
        plan_boxes(a.shape, a.strides, 8, 4, 0, [(slice(0, 2), slice(0, 2))])
    # every other element along each of 8 dimensions: 8 strided dimensions > MAXD
    v = np.zeros((4,) * 8)[(slice(None, None, 2),) * 8]
    with pytest.raises(KernelUnsupported, match="strided dimensions"):
        plan_boxes(v.shape, v.strides, 8, 0, 0, [tuple(slice(0, 2) for _ in range(8))])
    assert MAXD == 6


def test_kernel_table_covers_dtypes():
    for name in ADD_KERNELS.values():
        assert f"mc_unpack_add_{name}" in KERNEL_NAMES


# -- the kernels' code on the CPU ---------------------------------------------------------------

@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    try:
        path = build_host_emulator(tmp_path_factory.mktemp("emu"))
    except RuntimeError as e:
        pytest.skip(f"no host build of pack.cu: {e}")
    lib = ctypes.CDLL(str(path))
    for name in KERNEL_NAMES:
        getattr(lib, name).argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int64]
        getattr(lib, name).restype = None
    return lib


def _geom(x):
    if isinstance(x, torch.Tensor):
        e = x.element_size()
        return x.data_ptr(), tuple(x.shape), tuple(s * e for s in x.stride()), e, str(x.dtype).removeprefix("torch.")
    return x.ctypes.data, x.shape, x.strides, x.itemsize, x.dtype.name


def emu_run(lib, name, tile, buf, slices, group=None, nthreads=256):
    taddr, shape, strides, e, _ = _geom(tile)
    baddr = _geom(buf)[0]
    p = plan_boxes(shape, strides, e, taddr, baddr, slices, group=group)
    if p.nb:
        meta = np.ascontiguousarray(p.meta)
        getattr(lib, name)(taddr, baddr, meta.ctypes.data, p.nb, p.group, nthreads)
    return p


def _views(rng, base_shape, make):
    """A tile and strided views of bigger arrays (and misaligned starts)."""
    big = make(tuple(n + 3 for n in base_shape))
    yield make(base_shape)
    yield big[tuple(slice(1, 1 + n) for n in base_shape)]                  # offset, strided
    if len(base_shape) >= 2:
        t = make(tuple(reversed(base_shape)))
        yield t.T if isinstance(t, np.ndarray) else t.permute(*reversed(range(t.ndim)))


def _kernel_cases(seed, n):
    rng = np.random.default_rng(seed)
    dtypes = [("np", d) for d in NP_DTYPES + ["bool", "uint8", "int32", "complex64"]] + [("torch", d) for d in TORCH_DTYPES]
    for case in range(n):
        src, dtype = dtypes[case % len(dtypes)]
        ndim = 1 + case % 5
        shape = random_shape(rng, ndim)
        if case % 7 == 0:                                   # long rows: many units per lane
            shape = shape[:-1] + (int(rng.integers(200, 700)),)
        make = (lambda s, d=dtype: np_random(rng, s, d)) if src == "np" else (lambda s, d=dtype: torch_random(rng, s, d))
        for tile in _views(rng, shape, make):
            yield case, rng, tile, disjoint_boxes(rng, shape, max_boxes=8)


def _poison_like(rng, n, tile):
    if isinstance(tile, torch.Tensor):
        return torch_random(rng, (n,), tile.dtype)
    return np_random(rng, (n,), tile.dtype)


def test_kernel_code_pack_unpack_exact(emu):
    for case, rng, tile, slices in _kernel_cases(2, 60):
        n = message_elems(slices)
        expect = reference_pack(tile, slices)
        group = [None, 1, 4, 32][case % 4]
        nthreads = [32, 96, 256, 1024][case % 4]
        # pack into a buffer at an offset of one element: exercises narrower units
        for off in (0, 1):
            store = _poison_like(rng, n + 1, tile)
            buf = store[off:off + n]
            p = emu_run(emu, "mc_pack", tile, buf, slices, group, nthreads)
            assert same(buf, expect), (case, tuple(tile.shape), slices, p.units, off)
        # unpack into a poisoned copy of the tile
        back = (tile.copy() if isinstance(tile, np.ndarray) else tile.clone())
        poison = (np_random(rng, tuple(tile.shape), tile.dtype) if isinstance(tile, np.ndarray)
                  else torch_random(rng, tuple(tile.shape), tile.dtype))
        back[...] = poison
        emu_run(emu, "mc_unpack", back, expect, slices, group, nthreads)
        want = poison.copy() if isinstance(poison, np.ndarray) else poison.clone()
        unpack(expect, want, slices)
        assert same(back, want), (case, tuple(tile.shape), slices)


def test_kernel_code_unpack_add_exact(emu):
    from meshcomm.cuda.kernels import add_kernel_for
    for case, rng, tile, slices in _kernel_cases(3, 60):
        dname = _geom(tile)[4]
        addend = reference_pack((np_random(rng, tuple(tile.shape), tile.dtype) if isinstance(tile, np.ndarray)
                                 else torch_random(rng, tuple(tile.shape), tile.dtype)), slices)
        want = tile.copy() if isinstance(tile, np.ndarray) else tile.clone()
        unpack(addend, want, slices, accumulate=True)
        emu_run(emu, add_kernel_for(dname), tile, addend, slices, [None, 2, 8, 32][case % 4], 128)
        assert same(tile, want), (case, dname, tuple(tile.shape), slices)


def test_kernel_code_half_rounding(emu):
    """float16 / bfloat16 sums round like torch (float sum, round to nearest even), including
    subnormals, overflow to infinity and exact ties."""
    from meshcomm.cuda.kernels import add_kernel_for
    rng = np.random.default_rng(4)
    for dtype in (torch.float16, torch.bfloat16):
        bits = torch.from_numpy(rng.integers(0, 1 << 16, size=4096, dtype=np.int64).astype(np.int16))
        a = bits.view(dtype)
        b = torch.from_numpy(rng.integers(0, 1 << 16, size=4096, dtype=np.int64).astype(np.int16)).view(dtype)
        keep = ~(a.isnan() | b.isnan() | (a + b).isnan())
        a, b = a[keep].contiguous(), b[keep].contiguous()
        got = a.clone()
        emu_run(emu, add_kernel_for(str(dtype).removeprefix("torch.")), got, b, [(slice(0, a.numel()),)])
        assert same(got, a + b), dtype


def test_kernel_code_many_boxes_one_launch(emu):
    """Hundreds of small boxes of a 4-d tile in one launch, rows of 1..9 elements."""
    rng = np.random.default_rng(5)
    tile = np_random(rng, (6, 5, 7, 9), "float32")
    slices = [tuple(slice(a, b) for a, b in cell) for cell in itertools.product(
        [(0, 2), (2, 3), (3, 6)], [(0, 1), (1, 5)], [(0, 3), (3, 7)], [(0, 4), (4, 5), (5, 9)])]
    rng.shuffle(slices)
    slices = slices * 1
    buf = np.full(message_elems(slices), np.nan, np.float32)
    p = emu_run(emu, "mc_pack", tile, buf, slices, nthreads=512)
    assert p.nb == len(slices) and same(buf, reference_pack(tile, slices))
    assert math.prod(tile.shape) == buf.size


# -- the message path: a plan run through pack / unpack ---------------------------------------

def _executor_cases():
    import meshcomm as mc
    m1 = mc.Mesh([[0, 1], [2, 3]], ("x", "y"))
    m2 = mc.Mesh([[4, 5, 6]], ("a", "b"))
    m3 = mc.Mesh([0, 1, 2, 3, 4, 5], ("z",))
    m4 = mc.Mesh([[4, 5], [6, 7], [8, 9]], ("a", "b"))
    L = mc.Layout
    return [
        ((7, 10), L(m1, ("x", "y")), L(m2, ("b", None))),
        ((7, 10), L(m1, (None, "y"), partial=("x",)), L(m2, (None, "b"))),
        ((7, 10), L(m1, ("x", None)), L(m3, (None, "z"))),
        ((7, 10, 3), L(m3, ("z", None, None)), L(m1, (None, ("x", "y"), None))),
        ((1200, 200), L(m1, ("x", None)), L(m4, (None, None))),     # bcast (small ones go as sends now)
        ((12, 8), L(m1, (None, "y"), partial=("x",)), L(m4, ("a", None))),            # reduce, then send from dst
        ((12, 8), L(m1, (None, None), partial=("x", "y")), L(m4, (None, "b"))),       # reduce, bcast from dst
    ]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_packed_executor_matches_local_backend(lib):
    import collections

    import meshcomm as mc
    from meshcomm.backends.local import LocalBackend
    from meshcomm.cuda.executor import execute_packed
    kinds = collections.Counter()
    rng = np.random.default_rng(6)
    for shape, src, dst in _executor_cases():
        x = rng.standard_normal(shape).astype(np.float32)
        if lib == "torch":
            x = torch.from_numpy(x)
        shards = mc.shard(x, src, seed=1)
        p = mc.plan(shape, "float32", src, dst)
        kinds.update((t.kind, t.src_buf) for t in p.transfers)
        want = LocalBackend().execute(p, shards, like=x)
        got = execute_packed(p, shards)
        assert set(got) == set(want)
        for d in want:
            assert same(got[d], want[d]), (src, dst, d)
        h = execute_packed(p, shards, async_op=True)
        assert all(same(h.wait()[d], want[d]) for d in want)
    assert {("bcast", "src"), ("bcast", "dst"), ("reduce", "src"), ("send", "dst"), ("copy", "src")} <= set(kinds)

