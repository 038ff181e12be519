// cuda_emu.h — the CUDA device language, as much of it as cuda/*.cu uses, for a plain C++20 compiler.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md): g++ compiles the project's kernels
// unchanged with this header forced in front (-include), and every CUDA thread of a block becomes a fiber
// (runtime.cpp). Barriers and warp collectives switch fibers, so a kernel's index math, its barriers, its
// shared-memory use and its launch parameters are exercised for real; what is not emulated is timing,
// memory-model races between unsynchronised threads (fibers run one at a time, in order, between barriers),
// and the exact rounding of nvcc's fused multiply-adds (g++ here contracts nothing; see README "Limits").
//
// Conventions that differ from nvcc and are relied on by runtime.cpp:
//   - `__shared__` becomes `static` (in section emu_shared): blocks of one launch run one after another on one OS thread, and
//     launches are serialised, so one copy per kernel is one copy per running block. Dynamic shared memory
//     (`extern __shared__ T name[];`) is rewritten by gen_kernels.py into a pointer from emu::dyn_smem().
//   - wmma fragments hold the whole 16×16 tile in every lane, which is exact for code that treats fragments
//     as opaque or works on them element by element (ours does). Loads and stores run per lane; mma_sync
//     runs once per warp and checks that the other lanes hold the same fragments (emu::warp_uniform).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef EMU_RACECHECK
#include "racecheck.h"
#endif

#if !defined(__x86_64__)
#error "the CUDA emulator's fiber switch is written for x86-64"
#endif

// ---- qualifiers ------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#ifndef __launch_bounds__  // gen_kernels.py redefines it to read each kernel's bound
#define __launch_bounds__(...)
#endif
// A section of its own lets runtime.cpp refill all static shared memory with NaN bytes before every block,
// as a GPU gives a block shared memory with whatever the last user left there.
// AddressSanitizer leaves globals in named sections unchecked, so an EMU_ASAN build gives up the refill
// to have every shared array bounds-checked instead.
#ifdef EMU_ASAN
#define __shared__ static
#else
#define __shared__ static __attribute__((section("emu_shared")))
#endif
#define __align__(n) __attribute__((aligned(n)))

// ---- built-in vector types and indices ------------------------------------------------------------------
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace emu {
// Implemented in runtime.cpp; valid only inside a kernel launched by the emulator.
const uint3& thread_idx();
const uint3& block_idx();
const uint3& block_dim();
const uint3& grid_dim();
unsigned lane_id();
void* dyn_smem();
int block_barrier(int pred, int* and_out, int* count_out);
// Deposits `v` for this lane and returns every lane's deposit (lanes that have exited read as 0). A warp
// barrier on both sides, so all live lanes must call it, as CUDA requires of a full-mask collective.
void warp_gather(uint64_t v, uint64_t out[32]);
void warp_barrier();
// A computation every lane of a warp must make on identical inputs (wmma::mma_sync): the first lane to
// reach its n-th such call computes it, the others check their inputs are the same bytes and copy the
// result. Exact, 32× cheaper, and it reports a warp whose lanes disagree, which CUDA leaves undefined.
void warp_uniform(const void* in, size_t n_in, void* out, size_t n_out, void (*compute)(const void* in, void* out));
[[noreturn]] void fail(const char* what);
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx())
#define blockDim (emu::block_dim())
#define gridDim (emu::grid_dim())
constexpr int warpSize = 32;

// ---- synchronisation and warp collectives ---------------------------------------------------------------
inline void __syncthreads() { emu::block_barrier(0, nullptr, nullptr); }
inline int __syncthreads_or(int p) { return emu::block_barrier(p != 0, nullptr, nullptr); }
inline int __syncthreads_and(int p) {
    int a = 0;
    emu::block_barrier(p != 0, &a, nullptr);
    return a;
}
inline int __syncthreads_count(int p) {
    int c = 0;
    emu::block_barrier(p != 0, nullptr, &c);
    return c;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) emu::fail("__syncwarp with a partial mask is not emulated");
    emu::warp_barrier();
}
inline unsigned __activemask() { return 0xffffffffu; }

namespace emu {
template <class T>
T shfl_from(unsigned mask, T v, int src_of_lane(int lane, int arg, int width), int arg, int width) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    if (mask != 0xffffffffu) fail("warp shuffles with a partial mask are not emulated");
    if (width <= 0 || width > 32 || (width & (width - 1))) fail("shuffle width must be a power of two ≤ 32");
    uint64_t bits = 0, all[32];
    std::memcpy(&bits, &v, sizeof(T));
    warp_gather(bits, all);
    const int src = src_of_lane((int)lane_id(), arg, width);
    T r;
    std::memcpy(&r, &all[src], sizeof(T));
    return r;
}
// Source lanes as the CUDA programming guide defines them for each shuffle flavour, within width segments.
inline int shfl_idx(int lane, int src, int w) { return (lane & ~(w - 1)) + (src & (w - 1)); }
inline int shfl_xor(int lane, int m, int w) {
    const int s = lane ^ m;
    return (s & ~(w - 1)) == (lane & ~(w - 1)) ? s : lane;
}
inline int shfl_down(int lane, int d, int w) { return ((lane & (w - 1)) + d < w) ? lane + d : lane; }
inline int shfl_up(int lane, int d, int w) { return ((lane & (w - 1)) - d >= 0) ? lane - d : lane; }
}  // namespace emu

template <class T>
T __shfl_sync(unsigned m, T v, int src, int w = 32) { return emu::shfl_from(m, v, emu::shfl_idx, src, w); }
template <class T>
T __shfl_xor_sync(unsigned m, T v, int x, int w = 32) { return emu::shfl_from(m, v, emu::shfl_xor, x, w); }
template <class T>
T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) { return emu::shfl_from(m, v, emu::shfl_down, (int)d, w); }
template <class T>
T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) { return emu::shfl_from(m, v, emu::shfl_up, (int)d, w); }
inline unsigned __ballot_sync(unsigned mask, int p) {
    if (mask != 0xffffffffu) emu::fail("__ballot_sync with a partial mask is not emulated");
    uint64_t all[32];
    emu::warp_gather(p != 0 ? 2 : 1, all);  // 0 marks an exited lane
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (all[i] == 2 ? 1u : 0u) << i;
    return r;
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return !__any_sync(mask, !p); }  // exited lanes vote for neither

// Blocks run one at a time and launches are serialised, so plain read-modify-writes are atomic here. Under
// EMU_RACECHECK they are not checked (atomics do not race), and one on device memory is an acquire.
#ifdef EMU_RACECHECK
#define EMU_ATOMIC emu::race::Quiet emu_quiet_(p)
#define EMU_WARP_WIDE emu::race::WarpWide emu_warp_wide_
#define EMU_FENCE emu::race::fence()
#else
#define EMU_ATOMIC
#define EMU_WARP_WIDE
#define EMU_FENCE
#endif
template <class T>
T atomicAdd(T* p, T v) {
    EMU_ATOMIC;
    T old = *p;
    *p = old + v;
    return old;
}
template <class T>
T atomicMax(T* p, T v) {
    EMU_ATOMIC;
    T old = *p;
    *p = old > v ? old : v;
    return old;
}
template <class T>
T atomicMin(T* p, T v) {
    EMU_ATOMIC;
    T old = *p;
    *p = old < v ? old : v;
    return old;
}
template <class T>
T atomicExch(T* p, T v) {
    EMU_ATOMIC;
    T old = *p;
    *p = v;
    return old;
}
template <class T>
T atomicCAS(T* p, T cmp, T v) {
    EMU_ATOMIC;
    T old = *p;
    if (old == cmp) *p = v;
    return old;
}
inline void __threadfence() { EMU_FENCE; }
inline void __threadfence_block() {}

// ---- loads with cache hints ------------------------------------------------------------------------------
template <class T>
T __ldg(const T* p) { return *p; }
template <class T>
T __ldcg(const T* p) { return *p; }
template <class T>
T __ldcs(const T* p) { return *p; }
template <class T>
T __ldca(const T* p) { return *p; }
template <class T>
T __ldlu(const T* p) { return *p; }
template <class T>
void __stcs(T* p, T v) { *p = v; }
template <class T>
void __stcg(T* p, T v) { *p = v; }

// ---- math ------------------------------------------------------------------------------------------------
// The _rn intrinsics exist to forbid contraction into an FMA; this emulator never contracts (README).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
// CUDA declares these in the global namespace.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline unsigned __float2uint_rn(float x) { return (unsigned)std::nearbyint(x); }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (s & 31));
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)(((((uint64_t)hi << 32) | lo) << (s & 31)) >> 32);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(unsigned x) { return x ? __builtin_clz(x) : 32; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
// CUDA's min/max are overloaded for every arithmetic pair; common_type gives the same promotions.
template <class A, class B>
std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a < (C)b ? (C)a : (C)b;
}
template <class A, class B>
std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return (C)a > (C)b ? (C)a : (C)b;
}

// ---- 16-bit floating types -------------------------------------------------------------------------------
namespace emu {
inline uint16_t f32_to_bf16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint16_t f32_to_f16_rn(float f) {
    const _Float16 h = (_Float16)f;  // IEEE round-to-nearest-even, as __float2half_rn
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
}
inline float f16_to_f32(uint16_t b) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (float)h;
}
}  // namespace emu

struct __nv_bfloat16 {
    uint16_t __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::f32_to_bf16_rn(f)) {}
    operator float() const { return emu::bf16_to_f32(__x); }
};
struct __half {
    uint16_t __x;
    __half() = default;
    __half(float f) : __x(emu::f32_to_f16_rn(f)) {}
    operator float() const { return emu::f16_to_f32(__x); }
};
typedef __half half;
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return (float)h; }

// ---- wmma ------------------------------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// Every lane keeps the whole tile (rows × cols of its role) in f32; inputs were rounded to T when stored.
// `x` and `num_elements` exist so element-wise code (ceiling.cu sums accumulators with them) compiles; it
// then works on the whole tile in every lane, which is the same result for element-wise operations.
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
    static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
    static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
    static constexpr int num_elements = rows * cols;
    float x[num_elements];
};

namespace detail {
// The PTX ISA's requirements on wmma.load/store: 256-bit aligned base, ldm a multiple of 16 bytes.
template <class T>
void check(const T* p, unsigned ldm, const char* what) {
    if (((uintptr_t)p & 31) != 0) emu::fail(what);
    if ((ldm * sizeof(T)) % 16 != 0) emu::fail(what);
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
    for (float& x : f.x) x = v;
}
template <class Use, int M, int N, int K, class T, class L, class P>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const P* p, unsigned ldm) {
    static_assert(!std::is_same_v<Use, accumulator>, "accumulator loads are not emulated");
    static_assert(std::is_same_v<std::remove_cv_t<P>, T>, "pointer type must match the fragment's");
    detail::check(p, ldm, "wmma::load_matrix_sync: base not 32-byte aligned or ldm not a multiple of 16 bytes");
    EMU_WARP_WIDE;  // every lane reads the whole tile: one access of the warp (racecheck.h)
    using F = fragment<Use, M, N, K, T, L>;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = (float)(std::is_same_v<L, row_major> ? p[(size_t)r * ldm + c] : p[r + (size_t)c * ldm]);
}
template <int M, int N, int K, class T>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
    detail::check(p, ldm, "wmma::store_matrix_sync: base not 32-byte aligned or ldm not a multiple of 16 bytes");
    EMU_WARP_WIDE;  // every lane writes the whole tile: one access of the warp (racecheck.h)
    for (int r = 0; r < M; ++r)
        for (int c = 0; c < N; ++c) (layout == mem_row_major ? p[(size_t)r * ldm + c] : p[r + (size_t)c * ldm]) = f.x[r * N + c];
}
template <int M, int N, int K, class TA, class LA, class LB, class TC>
void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
              const fragment<matrix_b, M, N, K, TA, LB>& b, const fragment<accumulator, M, N, K, TC>& c) {
    struct In {
        float a[M * K], b[K * N], c[M * N];
    } in;
    std::memcpy(in.a, a.x, sizeof in.a);
    std::memcpy(in.b, b.x, sizeof in.b);
    std::memcpy(in.c, c.x, sizeof in.c);
    emu::warp_uniform(&in, sizeof in, d.x, sizeof d.x, [](const void* p, void* o) {
        const In& x = *static_cast<const In*>(p);
        float* out = static_cast<float*>(o);
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
                float s = x.c[i * N + j];
                for (int k = 0; k < K; ++k) s += x.a[i * K + k] * x.b[k * N + j];
                out[i * N + j] = s;
            }
    });
}
}  // namespace wmma
}  // namespace nvcuda
