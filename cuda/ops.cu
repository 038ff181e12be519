// ops.cu — model ops of the Llama block forward (design.md §6 "ops"). For now: RMSNorm.
//
// ---------------------------------------------------------------------------------------------------------
// rms_norm: Y [rows × d] = X [rows × d] / sqrt(mean_j X[r,j]² + eps) ⊙ w [d]           (Llama's RMSNorm)
//   CPU twin: cpu::rms_norm_row (src/backend/cpu.rs); launcher: launch_rms_norm (src/backend/cuda/ops.rs);
//   parity test: parity_rms_norm (tests/parity_ops.rs). All f32, row-major, row stride d; f32 accumulation.
//
// Launch shape (chosen by launch_rms_norm; params in include/boa_ops.h, BoaRmsNormParams):
//   v1 naive         grid ceil(rows/128), block 128, no smem: one thread per row, a direct port of the CPU
//                    twin (sequential sum of squares, then one pass writing y). Uncoalesced: thread t walks
//                    row t, so a warp touches 32 rows d·4 bytes apart. The baseline when v2 drifts.
//   v2 warp per row  grid ceil(rows/4), block 128 (4 warps), no smem: warp w of block b owns row 4b + w.
//                    Lanes stride the row with 16-byte float4 loads when d % 4 == 0 and X, Y, w are 16-byte
//                    aligned (a warp reads 512 contiguous bytes per step), scalar loads otherwise (d = 1001
//                    works, merely slower); sum of squares reduced by __shfl_xor_sync, no shared memory and
//                    no __syncthreads. Pass 2 re-reads the row (from L1/L2: ≤ 16 KB per row at d = 4096).
//
//        block b:   warp 0 → row 4b+0   [lane0 lane1 … lane31 | lane0 lane1 … lane31 | …]  float4 each
//                   warp 1 → row 4b+1   …
//
// Roofline (H200, ~4.8 TB/s HBM; H100 ~3.35 TB/s): memory-bound, 1 read + 1 write of X per call
//   (8·rows·d bytes; w is 4·d bytes and stays in L1/L2), ~3 flop per element. One calibration pass over
//   128×2048 tokens at d = 4096: 8.6 GB → ≈ 1.8 ms on an H200. A single 512×4096 call (16.8 MB) sits in L2
//   and is launch-latency bound (a few µs).
//
// Variants measured: none yet (no GPU run so far); v2 is expected near the HBM roofline for rows ≥ a few
//   thousand, v1 several times slower (uncoalesced). Record each measurement here with card and date.
// ---------------------------------------------------------------------------------------------------------

#include "boa_ops.h"

// --- device helpers ---------------------------------------------------------------------------------------

constexpr int kWarpSize = 32;
constexpr int kRmsNormV1Threads = 128;   // v1: threads (= rows) per block
constexpr int kRmsNormV2Warps = 4;       // v2: warps (= rows) per block
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

__device__ __forceinline__ bool is_aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// --- GPU kernels ------------------------------------------------------------------------------------------

// v1 naive: one thread per row, a line-by-line port of cpu::rms_norm_row.
extern "C" __global__ void __launch_bounds__(kRmsNormV1Threads)
rms_norm_kernel_v1(float* __restrict__ y,        // [rows × d] out, row-major
                   const float* __restrict__ x,  // [rows × d] in, row-major
                   const float* __restrict__ w,  // [d] per-channel weight
                   const BoaRmsNormParams p) {   // rows, d, eps
    const uint32_t row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= p.rows) return;
    const float* x_row = x + (size_t)row * p.d;
    float* y_row = y + (size_t)row * p.d;
    float ss = 0.f;
    for (uint32_t j = 0; j < p.d; ++j) ss += x_row[j] * x_row[j];
    const float r = 1.f / sqrtf(ss / (float)p.d + p.eps);
    for (uint32_t j = 0; j < p.d; ++j) y_row[j] = x_row[j] * r * w[j];
}

// v2: one warp per row, float4 loads when the row allows it.
extern "C" __global__ void __launch_bounds__(kRmsNormV2Warps * kWarpSize)
rms_norm_kernel_v2(float* __restrict__ y,        // [rows × d] out, row-major
                   const float* __restrict__ x,  // [rows × d] in, row-major
                   const float* __restrict__ w,  // [d] per-channel weight
                   const BoaRmsNormParams p) {   // rows, d, eps
    const int lane = threadIdx.x % kWarpSize;
    const uint32_t row = blockIdx.x * kRmsNormV2Warps + threadIdx.x / kWarpSize;
    if (row >= p.rows) return;  // whole warp leaves together: row is warp-uniform
    const float* x_row = x + (size_t)row * p.d;
    float* y_row = y + (size_t)row * p.d;
    // Warp-uniform: every lane sees the same d and base pointers, so the branch never diverges.
    const bool vec4 = (p.d % 4 == 0) && is_aligned16(x) && is_aligned16(y) && is_aligned16(w);

    float ss = 0.f;
    if (vec4) {
        const float4* x_gl = reinterpret_cast<const float4*>(x_row);
        const uint32_t d4 = p.d / 4;
        for (uint32_t j = lane; j < d4; j += kWarpSize) {
            const float4 v = x_gl[j];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (uint32_t j = lane; j < p.d; j += kWarpSize) ss += x_row[j] * x_row[j];
    }
    ss = warp_sum(ss);  // every lane now holds the row's sum of squares
    const float r = rsqrtf(ss / (float)p.d + p.eps);

    if (vec4) {
        const float4* x_gl = reinterpret_cast<const float4*>(x_row);
        const float4* w_gl = reinterpret_cast<const float4*>(w);
        float4* y_gl = reinterpret_cast<float4*>(y_row);
        const uint32_t d4 = p.d / 4;
        for (uint32_t j = lane; j < d4; j += kWarpSize) {
            const float4 v = x_gl[j];
            const float4 g = w_gl[j];
            y_gl[j] = make_float4(v.x * r * g.x, v.y * r * g.y, v.z * r * g.z, v.w * r * g.w);
        }
    } else {
        for (uint32_t j = lane; j < p.d; j += kWarpSize) y_row[j] = x_row[j] * r * w[j];
    }
}
