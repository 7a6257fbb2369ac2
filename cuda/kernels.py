"""Batched pack / unpack / unpack-add on CUDA: host side of cuda/pack.cu.

`pack_cuda(tile, slices, out=None)` and `unpack_cuda(buf, tile, slices, accumulate=False)` have
the signatures of meshcomm.backends.pack's pack/unpack and take torch CUDA tensors or CuPy arrays
(any object with `__dlpack__` is read through `cupy.from_dlpack`, without a copy). Torch tensors
are passed to the kernels by data pointer (no copy; this also covers bfloat16, which CuPy has no
dtype for) and the kernels run on torch's current stream; CuPy arrays run on CuPy's current
stream. One launch moves every box.

`plan_boxes` turns (tile geometry, addresses, slices) into the descriptor array the kernels read;
it is plain NumPy, so the CPU tests check it, and the kernel code itself through a g++ build of
pack.cu (see cuda/build.py, `build_host_emulator`).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from meshcomm.caches import memo
__all__ = ["available", "pack_cuda", "unpack_cuda", "copy_box", "plan_boxes", "BoxPlan", "KernelUnsupported",
           "SOURCE", "KERNEL_NAMES", "ADD_KERNELS", "add_kernel_for"]

SOURCE = Path(__file__).with_name("pack.cu")
MAXD = 6            # outer (row) dimensions a record holds; MC_MAXD in pack.cu
REC = 20            # int64 per record; MC_REC in pack.cu
UNROLL = 4          # MC_UNROLL in pack.cu
SEG_PER_LANE = 16   # units a lane copies per item, at most
BLOCK = 256

# element type -> unpack-add kernel suffix (complex adds as pairs of its real type)
ADD_KERNELS = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "complex64": "f32", "complex128": "f64",
    "int8": "i8", "uint8": "i8", "int16": "i16", "uint16": "i16",
    "int32": "i32", "uint32": "i32", "int64": "i64", "uint64": "i64", "bool": "bool",
}
KERNEL_NAMES = ("mc_pack", "mc_unpack") + tuple(sorted({f"mc_unpack_add_{s}" for s in ADD_KERNELS.values()}))


class KernelUnsupported(NotImplementedError):
    """The kernels do not handle this case (the caller falls back to slicing)."""


def add_kernel_for(dtype_name: str) -> str:
    try:
        return "mc_unpack_add_" + ADD_KERNELS[dtype_name]
    except KeyError:
        raise KernelUnsupported(f"no unpack-add kernel for dtype {dtype_name}") from None


# -- descriptors ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BoxPlan:
    """Descriptor array for one launch (see the layout comment at the top of pack.cu)."""
    meta: np.ndarray        # int64: prefix[nb+1] then nb records of REC
    nb: int                 # non-empty boxes
    group: int              # lanes per group (power of two <= 32)
    total_items: int
    nbytes: int             # message bytes
    units: tuple[int, ...]  # unit width per box (bytes), for reports and tests

    def blocks(self, max_blocks: int) -> int:
        want = -(-self.total_items * self.group // BLOCK)
        return max(1, min(want, max_blocks))


def _norm_slices(slices, shape) -> list[tuple[tuple[int, int], ...]]:
    out = []
    for i, sl in enumerate(slices):
        sl = tuple(sl)
        if len(sl) != len(shape):
            raise ValueError(f"box {i} has {len(sl)} slice(s) but the tile has {len(shape)} "
                             f"dimension(s) (shape {tuple(shape)})")
        box = []
        for d, (s, n) in enumerate(zip(sl, shape)):
            if not isinstance(s, slice):
                raise TypeError(f"box {i}, dimension {d}: expected a slice, got {type(s).__name__}")
            if s.step not in (None, 1):
                raise ValueError(f"box {i}, dimension {d}: step {s.step} is not supported")
            a = 0 if s.start is None else int(s.start)
            b = n if s.stop is None else int(s.stop)
            if not (0 <= a <= n and 0 <= b <= n):
                raise ValueError(f"box {i}, dimension {d}: slice {a}:{b} is outside the tile's "
                                 f"size {n} (shape {tuple(shape)})")
            box.append((a, max(a, b)))
        out.append(tuple(box))
    return out


def _pow2_divisor(*xs: int) -> int:
    w = 16
    while w > 1 and any(x % w for x in xs):
        w >>= 1
    return w


def plan_boxes(shape, strides, itemsize: int, tensor_addr: int, buf_addr: int,
               slices: Sequence[tuple[slice, ...]], *, group: int | None = None) -> BoxPlan:
    """Descriptors for moving `slices` of a tile (`shape`, byte `strides`) at `tensor_addr`
    to/from a contiguous buffer at `buf_addr`, boxes in the given order.

    Raises KernelUnsupported when a box needs more than MAXD outer dimensions or the
    addresses are not aligned to the element size.
    """
    shape = tuple(int(n) for n in shape)
    strides = tuple(int(s) for s in strides)
    if tensor_addr % itemsize or buf_addr % itemsize:
        raise KernelUnsupported("tile or buffer address is not aligned to the element size")
    boxes = _norm_slices(slices, shape)
    recs, units = [], []
    boff = 0
    for box in boxes:
        sizes = [b - a for a, b in box]
        nel = math.prod(sizes)
        if nel == 0:
            continue
        toff = sum(a * s for (a, _), s in zip(box, strides))
        dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
        merged: list[list[int]] = []            # innermost first
        for n, s in reversed(dims):
            if merged and s == merged[-1][0] * merged[-1][1]:
                merged[-1][0] *= n
            else:
                merged.append([n, s])
        if merged and merged[0][1] == itemsize:
            row_bytes = merged[0][0] * itemsize
            outer = merged[1:]
        else:
            row_bytes = itemsize
            outer = merged
        if len(outer) > MAXD:
            raise KernelUnsupported(f"a box needs {len(outer)} strided dimensions; the kernels take {MAXD}")
        w = _pow2_divisor(row_bytes, tensor_addr + toff, buf_addr + boff, *(s for _, s in outer))
        recs.append((toff, boff, row_bytes // w, w, outer, nel * itemsize))
        units.append(w)
        boff += nel * itemsize
    if group is None:
        if recs:
            big = max(recs, key=lambda r: r[5])
            g = max(1, big[2] // UNROLL)
            group = min(32, 1 << (g.bit_length() - 1))
        else:
            group = 32
    if group not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"group must be a power of two from 1 to 32, got {group}")
    seg_units = group * SEG_PER_LANE
    nb = len(recs)
    meta = np.zeros(nb + 1 + nb * REC, dtype=np.int64)
    items = 0
    for i, (toff, bo, row_units, w, outer, _) in enumerate(recs):
        nseg = -(-row_units // seg_units)
        nrows = math.prod(n for n, _ in outer)
        meta[i] = items
        r = nb + 1 + i * REC
        meta[r:r + 7] = (toff, bo, row_units, w, seg_units, nseg, len(outer))
        for d, (n, s) in enumerate(outer):
            meta[r + 7 + d] = n
            meta[r + 13 + d] = s
        items += nrows * nseg
    meta[nb] = items
    return BoxPlan(meta, nb, group, items, boff, tuple(units))


# -- CuPy side --------------------------------------------------------------------------------

_LOCK = threading.Lock()
_MODULES: dict[int, dict] = {}
_META_CACHE: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_META_CACHE_SIZE = 256
_AVAILABLE: bool | None = None


def _cupy():
    import cupy  # noqa: PLC0415 - lazy: CuPy is optional
    return cupy


ENABLED = True          # False: CUDA tensors are packed with torch slicing (tests, comparisons)


def available() -> bool:
    """True when CuPy imports and sees a CUDA device (and `ENABLED`: False packs with torch slicing)."""
    global _AVAILABLE
    if not ENABLED:
        return False
    if _AVAILABLE is None:
        try:
            cp = _cupy()
            _AVAILABLE = cp.cuda.runtime.getDeviceCount() > 0
        except Exception:       # ImportError, CUDARuntimeError without a driver, ...
            _AVAILABLE = False
    return _AVAILABLE


def _functions(device: int) -> dict:
    """The compiled module's kernels on `device` (compiled once per device, then cached). A
    compile failure is reported once (a warning) and raises KernelUnsupported, so the shared
    pack/unpack fall back to slicing; pack_cuda/unpack_cuda callers see the error."""
    with _LOCK:
        fns = _MODULES.get(device)
        if fns is None:
            cp = _cupy()
            try:
                with cp.cuda.Device(device):
                    mod = cp.RawModule(code=SOURCE.read_text(), options=("--std=c++17",))
                    fns = {name: mod.get_function(name) for name in KERNEL_NAMES}
            except Exception as e:          # CompileException, driver errors
                import warnings
                warnings.warn(f"meshcomm CUDA kernels unavailable on device {device}: {e}", RuntimeWarning)
                fns = e
            _MODULES[device] = fns
        if isinstance(fns, Exception):
            raise KernelUnsupported(f"the CUDA kernels failed to load on device {device}: {fns}") from fns
        return fns


@memo(maxsize=None)
def _sm_count(device: int) -> int:
    cp = _cupy()
    return cp.cuda.Device(device).attributes["MultiProcessorCount"]


_RESIDENT: dict = {}


def _resident_blocks(device: int, name: str, fn) -> int:
    """Blocks of BLOCK threads that fit on the device at once (one wave): each group walks a
    contiguous share of the items, so a single full wave leaves no tail."""
    key = (device, name)
    n = _RESIDENT.get(key)
    if n is None:
        try:
            regs = int(fn.num_regs)
        except Exception:           # attribute missing in some CuPy versions
            regs = 80
        per_warp = -(-max(regs, 1) * 32 // 256) * 256            # allocation unit: 256 registers
        warps = min(65536 // per_warp, 64)
        per_sm = max(1, min(warps // (BLOCK // 32), 2048 // BLOCK))
        n = _RESIDENT[key] = _sm_count(device) * per_sm
    return n


@dataclasses.dataclass
class _Arr:
    obj: object           # what the caller passed
    kind: str             # "torch" | "cupy"
    addr: int
    shape: tuple
    strides: tuple        # bytes
    itemsize: int
    dtype: str
    device: int
    contiguous: bool
    nbytes: int


def _arr(x, what: str) -> _Arr:
    mod = type(x).__module__
    if mod.startswith("torch"):
        if not x.is_cuda:
            raise TypeError(f"{what} is a CPU torch tensor; the CUDA kernels need a CUDA tensor")
        e = x.element_size()
        return _Arr(x, "torch", x.data_ptr(), tuple(x.shape), tuple(s * e for s in x.stride()), e,
                    str(x.dtype).removeprefix("torch."), x.device.index, x.is_contiguous(), x.numel() * e)
    cp = _cupy()
    if not isinstance(x, cp.ndarray):
        if hasattr(x, "__dlpack__"):
            x = cp.from_dlpack(x)
        else:
            raise TypeError(f"{what}: expected a torch CUDA tensor, a CuPy array or a DLPack "
                            f"array, got {type(x).__name__}")
    return _Arr(x, "cupy", x.data.ptr, tuple(x.shape), tuple(x.strides), x.itemsize, x.dtype.name,
                x.device.id, x.flags.c_contiguous, x.nbytes)


_STREAMS: dict = {}     # (torch stream handle, device) -> CuPy's wrapper of it, made once


def _stream(a: _Arr):
    cp = _cupy()
    if a.kind == "torch":
        import torch
        key = (torch.cuda.current_stream(a.device).cuda_stream, a.device)
        s = _STREAMS.get(key)
        if s is None:
            if len(_STREAMS) > 256:
                _STREAMS.clear()
            import warnings
            with warnings.catch_warnings():     # CuPy 14 deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                s = _STREAMS[key] = cp.cuda.ExternalStream(*key)
        return s
    return cp.cuda.get_current_stream()


def _upload(cp, meta: np.ndarray, stream):
    """Copy descriptors to the device on `stream` without blocking the host: staged through
    pinned memory (a pageable copy may wait for the stream, which can sit behind a fence).
    The device array is allocated on this stream, so CuPy's pool hands its memory to another
    allocation on this stream only, ordered after the kernels that read it. Returns
    (device array, pinned staging, event after the copy)."""
    pinned = cp.cuda.alloc_pinned_memory(meta.nbytes)
    host = np.frombuffer(pinned, dtype=np.int64, count=meta.size)
    host[:] = meta
    dev = cp.empty(meta.size, dtype=np.int64)
    dev.set(host, stream=stream)
    return dev, pinned, stream.record()


def _launch(name: str, tile: _Arr, buf_addr: int, slices, group):
    cp = _cupy()
    stream = _stream(tile)
    key = (tile.device, stream.ptr, tile.shape, tile.strides, tile.itemsize, tile.addr % 16,
           buf_addr % 16, group, tuple(tuple((s.start, s.stop, s.step) for s in sl) for sl in slices))
    with cp.cuda.Device(tile.device), stream:
        with _LOCK:
            hit = _META_CACHE.get(key)
            if hit is not None:
                _META_CACHE.move_to_end(key)
        if hit is None:
            # relative addresses: only their residues mod 16 matter, and they are in the key
            plan = plan_boxes(tile.shape, tile.strides, tile.itemsize, tile.addr % 16,
                              buf_addr % 16, slices, group=group)
            hit = (plan, *_upload(cp, plan.meta, stream)) if plan.nb else (plan, None, None, None)
            evicted = []
            with _LOCK:
                _META_CACHE[key] = hit
                while len(_META_CACHE) > _META_CACHE_SIZE:
                    evicted.append(_META_CACHE.popitem(last=False)[1])
            for old in evicted:             # its pinned staging may be reused once dropped
                if old[3] is not None:
                    old[3].synchronize()
        plan, meta_d = hit[0], hit[1]
        if plan.nb == 0:
            return plan
        fn = _functions(tile.device)[name]
        blocks = plan.blocks(_resident_blocks(tile.device, name, fn))
        fn((blocks,), (BLOCK,), (np.uint64(tile.addr), np.uint64(buf_addr), meta_d,
                                 np.int32(plan.nb), np.int32(plan.group)))
    return plan


def _message_bytes(slices, shape, itemsize) -> int:
    return sum(math.prod(b - a for a, b in box) for box in _norm_slices(slices, shape)) * itemsize


def pack_cuda(tile, slices: Sequence[tuple[slice, ...]], out=None, *, group: int | None = None):
    """Concatenate tile[sl] for each sl (row-major) into a 1-d buffer of tile's dtype, in one
    kernel launch on the current stream. Returns `out` (allocated when None)."""
    t = _arr(tile, "tile")
    slices = [tuple(sl) for sl in slices]
    nbytes = _message_bytes(slices, t.shape, t.itemsize)
    n = nbytes // t.itemsize
    if out is None:
        if t.kind == "torch":
            import torch
            out = torch.empty(n, dtype=tile.dtype, device=tile.device)
        else:
            out = _cupy().empty(n, dtype=t.obj.dtype)
    o = _arr(out, "out")
    _check_buffer(o, t, nbytes, "out")
    _launch("mc_pack", t, o.addr, slices, group)
    return out


def unpack_cuda(buf, tile, slices: Sequence[tuple[slice, ...]], accumulate: bool = False, *,
                group: int | None = None) -> None:
    """Scatter a packed buffer into tile[sl] for each sl, in one launch; add when `accumulate`."""
    t = _arr(tile, "tile")
    slices = [tuple(sl) for sl in slices]
    nbytes = _message_bytes(slices, t.shape, t.itemsize)
    b = _arr(buf, "buf")
    _check_buffer(b, t, nbytes, "buf")
    name = add_kernel_for(t.dtype) if accumulate else "mc_unpack"
    _launch(name, t, b.addr, slices, group)


COPY_MIN_BYTES = 1 << 20     # smaller pieces: torch's copy costs less host time than a launch here


def copy_box(dst, dsl, src, ssl) -> bool:
    """`dst[dsl] = src[ssl]` (torch CUDA tensors of one dtype; dsl, ssl tuples of slices with
    explicit bounds, as planners.boxes.local_slices gives) with ONE pack launch when the
    destination box is contiguous in `dst`, or one unpack launch when the source box is
    contiguous in `src` (the kernels run near copy speed on strided rows, where torch's
    elementwise copy does not). Returns False, having done nothing, for a piece under
    COPY_MIN_BYTES, with both boxes strided, or one the kernels do not take (the caller copies)."""
    if dst.dim() == 0 or math.prod(sl.stop - sl.start for sl in dsl) * dst.element_size() < max(COPY_MIN_BYTES, 1) \
            or dst.dtype != src.dtype or not available():
        return False
    d = dst[dsl]
    try:
        if d.is_contiguous():
            pack_cuda(src, [ssl], out=d.view(-1))
            return True
        s = src[ssl]
        if s.is_contiguous():
            unpack_cuda(s.view(-1), dst, [dsl])
            return True
    except KernelUnsupported:
        pass
    return False


def _check_buffer(b: _Arr, t: _Arr, nbytes: int, what: str) -> None:
    if b.device != t.device:
        raise ValueError(f"{what} is on device {b.device} but the tile is on device {t.device}")
    if b.nbytes < nbytes:
        raise ValueError(f"{what} holds {b.nbytes} bytes but the boxes need {nbytes}")
    if not b.contiguous:
        raise KernelUnsupported(f"{what} is not contiguous")
    if b.itemsize != t.itemsize and b.dtype != "uint8":
        raise KernelUnsupported(f"{what} has dtype {b.dtype} but the tile has {t.dtype}")
