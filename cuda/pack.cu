// meshcomm batched pack / unpack / unpack-add kernels.
//
// Loaded at run time with cupy.RawModule (NVRTC); compiled ahead of time only as a check
// (`python -m meshcomm.cuda.build --check`). No #include: NVRTC needs no header search path.
//
// One launch moves any number of boxes (N-d, arbitrary offsets and byte strides) between one
// tensor and one contiguous buffer. The host (meshcomm/cuda/kernels.py, `plan_boxes`) merges
// contiguous dimensions, splits each box into rows (its innermost contiguous run) and rows into
// segments ("items"), picks per box the widest unit (16, 8, 4, 2 or 1 bytes) that divides the row
// length, both base addresses and every outer stride, and writes
//
//   meta = [ prefix[0..nb] | record[0] | record[1] | ... ]          (int64)
//
// prefix[b] = first item of box b (prefix[nb] = total items); records are MC_REC int64:
//
//   0 tensor byte offset of the box origin     1 buffer byte offset of the box
//   2 row length in units                      3 unit size in bytes (16/8/4/2/1)
//   4 units per item (segment)                 5 items per row
//   6 number of outer dims d (<= MC_MAXD)      7..12  outer sizes, innermost first
//   13..18 outer tensor strides in bytes, innermost first
//
// Work split: threads form groups of G lanes (G a power of two <= 32). Group g takes the items
// [g*per, (g+1)*per), finds its first box by binary search on prefix, decomposes that item once
// (divisions) and then walks its range with an odometer (additions only), so the index cost is
// paid once per group, not per element. The lanes of a group copy one item, unit-strided by G,
// four units in flight per lane. Buffer positions within a box follow item order, so the buffer
// cursor is a running sum.
//
// The core is __host__ __device__ so that the same code runs on the CPU when this file is built
// with MC_HOST_EMULATION (tests/test_pack.py builds it with g++ and checks it against NumPy).

#define MC_MAXD 6
#define MC_REC 20
#define MC_UNROLL 4

typedef long long i64;
typedef unsigned long long u64;

#if defined(MC_HOST_EMULATION) && !defined(__CUDACC__)
// ---- plain C++ build of the same code (a CPU emulator of the kernels) ----
#include <cstring>
#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
static inline unsigned mc_f2u(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float mc_u2f(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
#else
#define mc_f2u(f) __float_as_uint(f)
#define mc_u2f(u) __uint_as_float(u)
#endif

#define MC_HD __host__ __device__ __forceinline__

// ---------------------------------------------------------------- element adders

// bfloat16 <-> float by bits; rounding to nearest even, NaN -> 0x7fc0 (as torch does).
MC_HD float mc_bf2f(unsigned short b) { return mc_u2f(((unsigned)b) << 16); }
MC_HD unsigned short mc_f2bf(float f) {
    unsigned u = mc_f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// IEEE half <-> float: one instruction each on the GPU, bit arithmetic on the host.
MC_HD float mc_h2f(unsigned short h) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    unsigned sign = ((unsigned)h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
    if (e == 0x1f) return mc_u2f(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        if (m == 0) return mc_u2f(sign);
        float v = (float)m * (1.0f / 16777216.0f);          // m * 2^-24
        return sign ? -v : v;
    }
    return mc_u2f(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

MC_HD unsigned short mc_f2h(float f) {
#if defined(__CUDA_ARCH__)
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned x = mc_f2u(f);
    unsigned sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);   // rounds to infinity
    if (a < 0x38800000u) {                                           // half subnormal or zero
        if (a < 0x33000000u) return (unsigned short)sign;
        unsigned e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, s = 126u - e;
        unsigned q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (unsigned short)(sign | q);
    }
    unsigned r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (r >> 13));
#endif
}

struct AddF32 { typedef float T; static MC_HD T add(T a, T b) { return a + b; } };
struct AddF64 { typedef double T; static MC_HD T add(T a, T b) { return a + b; } };
struct AddF16 { typedef unsigned short T; static MC_HD T add(T a, T b) { return mc_f2h(mc_h2f(a) + mc_h2f(b)); } };
struct AddBF16 { typedef unsigned short T; static MC_HD T add(T a, T b) { return mc_f2bf(mc_bf2f(a) + mc_bf2f(b)); } };
// integers wrap around, as NumPy and torch do; computed unsigned to stay defined behaviour
struct AddI8 { typedef unsigned char T; static MC_HD T add(T a, T b) { return (T)(a + b); } };
struct AddI16 { typedef unsigned short T; static MC_HD T add(T a, T b) { return (T)(a + b); } };
struct AddI32 { typedef unsigned int T; static MC_HD T add(T a, T b) { return a + b; } };
struct AddI64 { typedef unsigned long long T; static MC_HD T add(T a, T b) { return a + b; } };
struct AddBool { typedef unsigned char T; static MC_HD T add(T a, T b) { return (T)((a | b) != 0); } };
struct NoAdd { typedef unsigned char T; static MC_HD T add(T a, T) { return a; } };

// ---------------------------------------------------------------- units

template <int W> struct Unit;
template <> struct Unit<16> { typedef uint4 T; };
template <> struct Unit<8> { typedef uint2 T; };
template <> struct Unit<4> { typedef unsigned int T; };
template <> struct Unit<2> { typedef unsigned short T; };
template <> struct Unit<1> { typedef unsigned char T; };

// dst unit += src unit, element by element (W >= sizeof(element) is guaranteed by the host).
template <class A, int W>
MC_HD typename Unit<W>::T unit_add(typename Unit<W>::T d, typename Unit<W>::T s) {
    typedef typename A::T E;
    const int N = W / (int)sizeof(E);
    union U { typename Unit<W>::T u; E e[N > 0 ? N : 1]; };
    U x, y;
    x.u = d;
    y.u = s;
#pragma unroll
    for (int i = 0; i < N; ++i) x.e[i] = A::add(x.e[i], y.e[i]);
    return x.u;
}

// OP: 0 pack (tensor -> buffer), 1 unpack (buffer -> tensor), 2 unpack-add (tensor += buffer).
template <int OP, class A, int W>
MC_HD void copy_units(char* tensor_p, char* buf_p, i64 n, int lane, int G) {
    typedef typename Unit<W>::T T;
    T* __restrict__ dst = (T*)(OP == 0 ? buf_p : tensor_p);
    const T* __restrict__ src = (const T*)(OP == 0 ? tensor_p : buf_p);
    i64 k = lane;
    for (; k + (MC_UNROLL - 1) * (i64)G < n; k += MC_UNROLL * (i64)G) {
        T v[MC_UNROLL];
#pragma unroll
        for (int j = 0; j < MC_UNROLL; ++j) v[j] = src[k + j * (i64)G];
        if (OP == 2) {
#pragma unroll
            for (int j = 0; j < MC_UNROLL; ++j) v[j] = unit_add<A, W>(dst[k + j * (i64)G], v[j]);
        }
#pragma unroll
        for (int j = 0; j < MC_UNROLL; ++j) dst[k + j * (i64)G] = v[j];
    }
    for (; k < n; k += G) {
        T v = src[k];
        if (OP == 2) v = unit_add<A, W>(dst[k], v);
        dst[k] = v;
    }
}

template <int OP, class A>
MC_HD void copy_item(char* tensor_p, char* buf_p, i64 n, int w, int lane, int G) {
    // for unpack-add, units narrower than the element never occur (host guarantees w >= size)
    switch (w) {
    case 16: copy_units<OP, A, 16>(tensor_p, buf_p, n, lane, G); break;
    case 8: copy_units<OP, A, (OP == 2 && sizeof(typename A::T) > 8) ? 16 : 8>(tensor_p, buf_p, n, lane, G); break;
    case 4: copy_units<OP, A, (OP == 2 && sizeof(typename A::T) > 4) ? 8 : 4>(tensor_p, buf_p, n, lane, G); break;
    case 2: copy_units<OP, A, (OP == 2 && sizeof(typename A::T) > 2) ? 4 : 2>(tensor_p, buf_p, n, lane, G); break;
    default: copy_units<OP, A, (OP == 2 && sizeof(typename A::T) > 1) ? 2 : 1>(tensor_p, buf_p, n, lane, G); break;
    }
}

// ---------------------------------------------------------------- the walk

struct BoxState {
    const i64* rec;
    i64 toff, row_units, w, seg_units, nseg, bpos, roff, seg;
    int nd;
    i64 idx[MC_MAXD];
};

MC_HD void box_begin(BoxState& s, const i64* recs, int b, i64 local) {
    const i64* r = recs + (i64)b * MC_REC;
    s.rec = r;
    s.toff = r[0];
    s.row_units = r[2];
    s.w = r[3];
    s.seg_units = r[4];
    s.nseg = r[5];
    s.nd = (int)r[6];
    i64 row = local / s.nseg;
    s.seg = local - row * s.nseg;
    s.bpos = r[1] + (row * s.row_units + s.seg * s.seg_units) * s.w;
    s.roff = 0;
#pragma unroll
    for (int d = 0; d < MC_MAXD; ++d) {          // unrolled: idx[] stays in registers
        if (d < s.nd) {
            i64 n = r[7 + d];
            i64 q = row / n;
            s.idx[d] = row - q * n;
            s.roff += s.idx[d] * r[13 + d];
            row = q;
        } else {
            s.idx[d] = 0;
        }
    }
}

// Advance to the next item of this box; false when the box is exhausted.
MC_HD bool box_next(BoxState& s) {
    if (++s.seg < s.nseg) return true;
    s.seg = 0;
#pragma unroll
    for (int d = 0; d < MC_MAXD; ++d) {
        if (d >= s.nd) return false;
        const i64 st = s.rec[13 + d];
        if (++s.idx[d] < s.rec[7 + d]) {
            s.roff += st;
            return true;
        }
        s.roff -= (s.idx[d] - 1) * st;
        s.idx[d] = 0;
    }
    return false;
}

template <int OP, class A>
MC_HD void run_thread(u64 tensor, u64 buf, const i64* meta, int nb, int G, i64 tid, i64 nthreads) {
    const i64* prefix = meta;
    const i64* recs = meta + nb + 1;
    const i64 total = prefix[nb];
    const int lane = (int)(tid & (G - 1));
    const i64 group = tid / G, ngroups = nthreads / G;
    const i64 per = (total + ngroups - 1) / ngroups;
    i64 it = group * per;
    const i64 end = it + per < total ? it + per : total;
    if (it >= end) return;
    int lo = 0, hi = nb - 1;                      // last box b with prefix[b] <= it
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (prefix[mid] <= it) lo = mid; else hi = mid - 1;
    }
    int b = lo;
    BoxState s;
    box_begin(s, recs, b, it - prefix[b]);
    char* tp = (char*)tensor;
    char* bp = (char*)buf;
    for (;;) {
        i64 rest = s.row_units - s.seg * s.seg_units;
        i64 n = rest < s.seg_units ? rest : s.seg_units;
        copy_item<OP, A>(tp + s.toff + s.roff + s.seg * s.seg_units * s.w, bp + s.bpos, n, (int)s.w, lane, G);
        if (++it >= end) break;
        s.bpos += n * s.w;
        if (!box_next(s)) {
            do { ++b; } while (prefix[b + 1] == prefix[b]);   // skip empty boxes
            box_begin(s, recs, b, 0);
        }
    }
}

// ---------------------------------------------------------------- entry points

#if !defined(MC_HOST_EMULATION) || defined(__CUDACC__)
#define MC_KERNEL(name, OP, A)                                                                   \
    extern "C" __global__ void __launch_bounds__(256) name(u64 tensor, u64 buf, const i64* meta, \
                                                           int nb, int G) {                      \
        run_thread<OP, A>(tensor, buf, meta, nb, G, (i64)blockIdx.x * blockDim.x + threadIdx.x,  \
                          (i64)gridDim.x * blockDim.x);                                          \
    }
#else
#define MC_KERNEL(name, OP, A)                                                                   \
    extern "C" void name(u64 tensor, u64 buf, const i64* meta, int nb, int G, i64 nthreads) {    \
        nthreads = (nthreads + G - 1) / G * G;   /* a launch has whole groups */                 \
        for (i64 t = 0; t < nthreads; ++t) run_thread<OP, A>(tensor, buf, meta, nb, G, t, nthreads); \
    }
#endif

MC_KERNEL(mc_pack, 0, NoAdd)
MC_KERNEL(mc_unpack, 1, NoAdd)
MC_KERNEL(mc_unpack_add_f32, 2, AddF32)
MC_KERNEL(mc_unpack_add_f64, 2, AddF64)
MC_KERNEL(mc_unpack_add_f16, 2, AddF16)
MC_KERNEL(mc_unpack_add_bf16, 2, AddBF16)
MC_KERNEL(mc_unpack_add_i8, 2, AddI8)
MC_KERNEL(mc_unpack_add_i16, 2, AddI16)
MC_KERNEL(mc_unpack_add_i32, 2, AddI32)
MC_KERNEL(mc_unpack_add_i64, 2, AddI64)
MC_KERNEL(mc_unpack_add_bool, 2, AddBool)
