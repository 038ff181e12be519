// core.cu — the data movement and small arithmetic of the quantization core (design.md §12 "Device
// residency"): everything between a block's statistics and its packed output that is not a GEMM, a factor, a
// search or a sweep, so that none of it goes to the host. Each kernel's CPU twin is the matching
// `QuantOps` method of the CPU backend (src/backend/cpu_quant.rs); the parity tests (tests/parity_quant.rs)
// compare the two on the emulator and on a GPU. Launchers: src/backend/cuda/core.rs.
//
// All are memory-bound elementwise or gather passes over one matrix (or a batch). Launch shapes: 256 threads
// per CTA over the flattened elements (1-D), or 32 × 8 tiles of a [rows × cols] matrix (2-D), grid.z over the
// batch. Roofline (7B layer, f32, H200 ~4.3 TB/s copy): a pass over a 4096² H reads and writes 64 MB each,
// ~30 µs; over an 11008² H (down_proj) 485 MB each, ~0.23 ms; over W [4096 × 11008] 180 MB, ~0.1 ms. The
// per-block total is a few ms, against ~1 s of sweeps and GEMMs.
//
//   diag_kernel            d[b, i] = H_b[i, i]                                         (plan: act-order, damping)
//   permute_sym_kernel     out_b[i, j] = H_b[perm_b[i], perm_b[j]]                     (act-order)
//   set_diag_kernel        H_b[i, i] = v for listed (b, i, v)                           (dead inputs)
//   add_diag_kernel        H_b += a_b·I for listed (b, a_b)                             (damping)
//   finish_sym_kernel      H = f·Σ made exactly symmetric: ½(f·Σ_ij + f·Σ_ji)           (statistics)
//   zero_cols_kernel       W[r, c] = 0 where mask[part(r), c]                           (dead inputs)
//   gather_f32/u8_kernel   out[i, k] = in[row_perm[i], cp[k]] (or the scatter back)     (sweep order)
//   rtn_kernel             codes and Q of W on fixed grids                               (RTN)
//   sub_kernel             a − b                                                         (the report's ΔW)
//   dot_partials_kernel    Σ a∘b per CTA, f64 (a fixed order: deterministic)            (the report)
//   pack_kernel            qweight words from codes (include/boa_pack.h's layout)         (the output)
//   u_row_f_kernel         F[j, i] = U_row[j, i] / U_row[j, j], i > j                    (BoA's Eq. (12))
//
// Variants measured: correct on an H200 (parity tests, 2026-12-04: tests/parity_quant.rs passed); speed not
//   measured yet per kernel, only inside larger timings: quad_forms (report) 7B 3 × 4096 × 11008, a cuBLAS
//   SGEMM plus dot_partials_kernel, 61.288 ms, 48.6 TFLOP/s
//   (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`), and the error report phase of a
//   7B-shaped BoA 3-bit run (H200, 2026-12-04, `run --profile`, 128 × 2048 tokens), 0.21 s per block.
// ---------------------------------------------------------------------------------------------------------

#include <stdint.h>

#include "boa_quant.h"

constexpr int kThreads = 256;
constexpr int kTileX = 32;
constexpr int kTileY = 8;

// --- GPU kernels ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kThreads)
diag_kernel(float* __restrict__ d,             // [batch × n] out
            const float* __restrict__ h,       // [batch × n × n]
            const uint32_t n) {
    const uint32_t i = blockIdx.x * kThreads + threadIdx.x, b = blockIdx.y;
    if (i < n) d[(size_t)b * n + i] = h[(size_t)b * n * n + (size_t)i * n + i];
}

extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
permute_sym_kernel(float* __restrict__ out,         // [batch × n × n]
                   const float* __restrict__ h,     // [batch × n × n]
                   const uint32_t* __restrict__ perm,  // [batch × n]
                   const uint32_t n) {
    const uint32_t j = blockIdx.x * kTileX + threadIdx.x, i = blockIdx.y * kTileY + threadIdx.y;
    const size_t b = blockIdx.z;
    if (i >= n || j >= n) return;
    const uint32_t* p = perm + b * n;
    out[b * n * n + (size_t)i * n + j] = h[b * n * n + (size_t)p[i] * n + p[j]];
}

extern "C" __global__ void __launch_bounds__(kThreads)
set_diag_kernel(float* __restrict__ h,            // [batch × n × n]
                const uint32_t* __restrict__ mat,  // [count]
                const uint32_t* __restrict__ idx,  // [count]
                const float* __restrict__ val,     // [count]
                const uint32_t n, const uint32_t count) {
    const uint32_t e = blockIdx.x * kThreads + threadIdx.x;
    if (e < count) h[(size_t)mat[e] * n * n + (size_t)idx[e] * n + idx[e]] = val[e];
}

extern "C" __global__ void __launch_bounds__(kThreads)
add_diag_kernel(float* __restrict__ h,            // [batch × n × n]
                const uint32_t* __restrict__ mat,  // [count]: the matrices to damp
                const float* __restrict__ amount,  // [count]
                const uint32_t n) {
    const uint32_t i = blockIdx.x * kThreads + threadIdx.x, e = blockIdx.y;
    if (i < n) h[(size_t)mat[e] * n * n + (size_t)i * n + i] += amount[e];
}

// The CPU twin scales every element then averages the two triangles (quant::hessian::finish); f·x rounds the
// same on both, and ½(a + b) is exact but for the sum's rounding.
extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
finish_sym_kernel(float* __restrict__ h,          // [batch × n × n] in: Σ, out: H
                  const uint32_t n, const float f) {
    const uint32_t j = blockIdx.x * kTileX + threadIdx.x, i = blockIdx.y * kTileY + threadIdx.y;
    if (i >= n || j > i) return;
    float* m = h + (size_t)blockIdx.z * n * n;
    if (i == j) {
        m[(size_t)i * n + i] = __fmul_rn(m[(size_t)i * n + i], f);
        return;
    }
    const float v = __fmul_rn(0.5f, __fadd_rn(__fmul_rn(m[(size_t)i * n + j], f), __fmul_rn(m[(size_t)j * n + i], f)));
    m[(size_t)i * n + j] = v;
    m[(size_t)j * n + i] = v;
}

extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
zero_cols_kernel(float* __restrict__ w,            // [rows × n]
                 const uint8_t* __restrict__ mask,  // [parts × n]: 1 = zero this column
                 const uint32_t rows, const uint32_t n, const uint32_t rows_per_part) {
    const uint32_t c = blockIdx.x * kTileX + threadIdx.x, r = blockIdx.y * kTileY + threadIdx.y;
    if (r >= rows || c >= n) return;
    if (mask[(size_t)(r / rows_per_part) * n + c]) w[(size_t)r * n + c] = 0.0f;
}

// out[i, k] = in[row_perm[i], cp[k]] (gather) or out[row_perm[i], cp[k]] = in[i, k] (scatter), cp = the column
// permutation of row i's part. Coalesced on the contiguous side (k); the permuted side is a gather.
template <class T>
__device__ __forceinline__ void gather_impl(T* __restrict__ out, const T* __restrict__ in,
                                            const uint32_t* __restrict__ row_perm,
                                            const uint32_t* __restrict__ col_perm, uint32_t rows, uint32_t n,
                                            uint32_t rows_per_part, uint32_t scatter) {
    const uint32_t k = blockIdx.x * kTileX + threadIdx.x, i = blockIdx.y * kTileY + threadIdx.y;
    if (i >= rows || k >= n) return;
    const uint32_t c = col_perm[(size_t)(i / rows_per_part) * n + k];
    if (scatter)
        out[(size_t)row_perm[i] * n + c] = in[(size_t)i * n + k];
    else
        out[(size_t)i * n + k] = in[(size_t)row_perm[i] * n + c];
}

extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
gather_f32_kernel(float* __restrict__ out, const float* __restrict__ in, const uint32_t* __restrict__ row_perm,
                  const uint32_t* __restrict__ col_perm, const uint32_t rows, const uint32_t n,
                  const uint32_t rows_per_part, const uint32_t scatter) {
    gather_impl(out, in, row_perm, col_perm, rows, n, rows_per_part, scatter);
}

extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
gather_u8_kernel(uint8_t* __restrict__ out, const uint8_t* __restrict__ in, const uint32_t* __restrict__ row_perm,
                 const uint32_t* __restrict__ col_perm, const uint32_t rows, const uint32_t n,
                 const uint32_t rows_per_part, const uint32_t scatter) {
    gather_impl(out, in, row_perm, col_perm, rows, n, rows_per_part, scatter);
}

extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
rtn_kernel(float* __restrict__ q,                    // [rows × n] out: Q
           uint8_t* __restrict__ codes,              // [rows × n] out
           const float* __restrict__ w,              // [rows × n]
           const float* __restrict__ scales,         // [rows × n_groups]
           const float* __restrict__ zeros,          // [rows × n_groups]
           const uint32_t* __restrict__ col_group,   // [n]
           const uint32_t rows, const uint32_t n, const uint32_t n_groups, const float maxq) {
    const uint32_t c = blockIdx.x * kTileX + threadIdx.x, r = blockIdx.y * kTileY + threadIdx.y;
    if (r >= rows || c >= n) return;
    const size_t g = (size_t)r * n_groups + col_group[c], i = (size_t)r * n + c;
    const float v = boa_quantize(w[i], scales[g], zeros[g], maxq);
    codes[i] = (uint8_t)v;
    q[i] = boa_dequantize(v, scales[g], zeros[g]);
}

extern "C" __global__ void __launch_bounds__(kThreads)
sub_kernel(float* __restrict__ out, const float* __restrict__ a, const float* __restrict__ b, const uint64_t len) {
    const uint64_t i = (uint64_t)blockIdx.x * kThreads + threadIdx.x;
    if (i < len) out[i] = __fsub_rn(a[i], b[i]);
}

// partial[blockIdx.x] = Σ over the CTA's elements of a·b, each product in f64, the CTA's elements in a fixed
// order (grid-stride by the CTA count, then a tree over the threads): deterministic for a given grid size.
extern "C" __global__ void __launch_bounds__(kThreads)
dot_partials_kernel(double* __restrict__ partial,  // [gridDim.x]
                    const float* __restrict__ a, const float* __restrict__ b, const uint64_t len) {
    __shared__ double sh[kThreads];
    double s = 0.0;
    for (uint64_t i = (uint64_t)blockIdx.x * kThreads + threadIdx.x; i < len; i += (uint64_t)gridDim.x * kThreads)
        s += (double)a[i] * (double)b[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w /= 2) {
        if ((int)threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

// Word `wi` of output j's code stream (include/boa_pack.h: code i at stream bits [i·b, i·b + b), LSB-first;
// a 3-bit code may straddle two words, so each word gathers the pieces that fall in it).
extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
pack_kernel(uint32_t* __restrict__ qweight,        // [ceil(d_in·b/32) × d_out] out
            const uint8_t* __restrict__ codes,     // [d_out × d_in]
            const uint32_t d_out, const uint32_t d_in, const uint32_t bits) {
    const uint32_t j = blockIdx.x * kTileX + threadIdx.x, wi = blockIdx.y * kTileY + threadIdx.y;
    const uint32_t kw = (d_in * bits + 31) / 32;
    if (j >= d_out || wi >= kw) return;
    const uint64_t lo = (uint64_t)wi * 32, hi = lo + 32;
    uint32_t word = 0;
    for (uint64_t i = lo / bits; i < d_in && i * bits < hi; ++i) {
        const uint32_t q = codes[(size_t)j * d_in + i];
        const int64_t shift = (int64_t)(i * bits) - (int64_t)lo;
        word |= shift >= 0 ? (q << shift) : (q >> (-shift));
    }
    qweight[(size_t)wi * d_out + j] = word;
}

// F[h, j, i] = U_row,h[j, i] / U_row,h[j, j] for i > j, else 0: the factor of Eq. (12), divided as the CPU
// twin divides (one IEEE division).
extern "C" __global__ void __launch_bounds__(kTileX * kTileY)
u_row_f_kernel(float* __restrict__ f,              // [n_heads × d_h × d_h] out
               const float* __restrict__ u_row,    // [n_heads × d_h × d_h], upper
               const uint32_t d_h) {
    const uint32_t i = blockIdx.x * kTileX + threadIdx.x, j = blockIdx.y * kTileY + threadIdx.y;
    if (i >= d_h || j >= d_h) return;
    const size_t o = (size_t)blockIdx.z * d_h * d_h;
    f[o + (size_t)j * d_h + i] = i > j ? __fdiv_rn(u_row[o + (size_t)j * d_h + i], u_row[o + (size_t)j * d_h + j]) : 0.0f;
}
