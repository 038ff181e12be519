// ops.cu — model ops of the Llama block forward (design.md §6 "ops"): token embedding (scaled for Gemma),
// RMSNorm, RoPE, SwiGLU, GeGLU (Gemma), causal GQA attention (flash-style, sliding windows, d_h ≤ 256), the
// causal softmax probabilities of one sequence, the two small
// helpers of the cuBLAS linear (bias add, f32 → bf16 operand conversion; the GEMM itself is cuBLAS,
// src/backend/cuda/gemm.rs), the padded bf16 operands of many Grams at once (pad_rows_bf16), and R4's online
// block Hadamard transform (block_hadamard).
// Kernels other than rms_norm take their sizes as plain scalar arguments (no params struct: nothing to mirror).
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
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error vs f64 v1 5.0e-7, v2 8.8e-8;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet. v2 is expected near the HBM roofline for rows
//   ≥ a few thousand, v1 several times slower (uncoalesced). Record each measurement here with card and date.
// ---------------------------------------------------------------------------------------------------------

#include "boa_ops.h"

#include <cuda_bf16.h>

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

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

constexpr int kElementwiseThreads = 256;  // rope, swiglu, geglu, bias_add, f32_to_bf16, embed: threads per block
constexpr int kAttnProbsWarps = 4;        // attention_probs: warps (= query rows) per block
constexpr uint32_t kHadamardMaxB = 8192;  // block_hadamard: the longest run (4·b bytes of shared memory, 32 KB)
static_assert(kHadamardMaxB * sizeof(float) <= 48 * 1024, "block_hadamard's run must fit without an opt-in");
constexpr int kAttnThreads = 256;         // causal_attention (flash): threads per CTA, every head dim
constexpr int kAttnTpqNarrow = 4;         // flash, kD ≤ 128: threads sharing one query row (consecutive lanes)
constexpr int kAttnKeysNarrow = 32;       // flash, kD ≤ 128: keys per shared-memory tile
constexpr int kAttnTpqWide = 8;           // flash, kD = 256: threads per query row (halves each one's registers)
constexpr int kAttnKeysWide = 16;         // flash, kD = 256: keys per tile (K and V tiles stay at 32 KB)
constexpr int kAttnV1Threads = 128;       // causal_attention v1: threads (= query rows) per block

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

// ---------------------------------------------------------------------------------------------------------
// rope: rotate-half RoPE in place on X [rows × n_heads·d_h], rows = n_seq·t, token row r at position r % t:
//   (x[i], x[i + d_h/2]) ← (x[i]·cos[p,i] − x[i+d_h/2]·sin[p,i],  x[i+d_h/2]·cos[p,i] + x[i]·sin[p,i]),
//   i < d_h/2, cos/sin [t × d_h/2] row-major (model::llama::RopeTable). An odd d_h leaves the last element as
//   is, like the CPU twin. CPU twin: cpu::rope_head via CpuBackend::rope; launcher: launch_rope; parity test:
//   parity_rope.
// Launch shape: grid min(ceil(pairs/256), 65535·8), block 256, no smem; grid-stride over the
//   rows·n_heads·(d_h/2) rotation pairs, one pair per thread per step. Adjacent threads touch adjacent i, so
//   the two halves of a head are each read and written coalesced.
// Roofline: memory-bound, X read and written once (8 bytes per element) plus the tables (L2-resident:
//   t·d_h·4 bytes). 512×4096 f32 (8 MB) → ≈ 3.5 µs at 4.8 TB/s (H200), i.e. launch-latency bound in practice.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error 2.9e-8 vs f64;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
rope_kernel(float* __restrict__ x,          // [rows × n_heads·d_h] in/out, row-major
            const float* __restrict__ cos_tab,  // [t × d_h/2] row-major
            const float* __restrict__ sin_tab,  // [t × d_h/2] row-major
            const uint32_t rows,            // n_seq·t
            const uint32_t t,               // tokens per sequence (position = row % t)
            const uint32_t n_heads,         // heads per row
            const uint32_t d_h) {           // head dim
    const uint32_t half = d_h / 2;
    const uint64_t pairs = (uint64_t)rows * n_heads * half;
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t idx = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < pairs; idx += stride) {
        const uint32_t i = (uint32_t)(idx % half);
        const uint64_t rh = idx / half;  // row·n_heads + head
        const uint32_t head = (uint32_t)(rh % n_heads);
        const uint32_t row = (uint32_t)(rh / n_heads);
        const uint32_t pos = row % t;
        float* x_head = x + ((uint64_t)row * n_heads + head) * d_h;
        const float c = cos_tab[(uint64_t)pos * half + i];
        const float s = sin_tab[(uint64_t)pos * half + i];
        const float x1 = x_head[i];
        const float x2 = x_head[i + half];
        x_head[i] = x1 * c - x2 * s;
        x_head[i + half] = x2 * c + x1 * s;
    }
}

// ---------------------------------------------------------------------------------------------------------
// swiglu: out[i] = silu(gate[i]) · up[i] = gate[i] / (1 + e^(−gate[i])) · up[i], elementwise over n values.
//   CPU twin: CpuBackend::swiglu (its exp_f32 flushes e^x to 0 below x = −87; expf here, within 2 ulp, gives
//   the same products up to rounding); launcher: launch_swiglu; parity test: parity_swiglu.
// Launch shape: grid min(ceil(n/256), 65535·8), block 256, no smem, grid-stride, one element per thread per
//   step (coalesced 4-byte accesses; float4 would save instructions, not bytes).
// Roofline: memory-bound, 12 bytes per element (2 reads, 1 write). 512 tokens × 11008 (7B d_ff): 67.6 MB →
//   ≈ 14 µs at 4.8 TB/s.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error 9.5e-8 vs f64;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
swiglu_kernel(float* __restrict__ out,         // [n] out
              const float* __restrict__ gate,  // [n]
              const float* __restrict__ up,    // [n]
              const uint64_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = g / (1.f + expf(-g)) * up[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// geglu: out[i] = gelu_tanh(gate[i]) · up[i], gelu_tanh(g) = ½ g (1 + tanh(√(2/π) (g + 0.044715 g³))):
//   transformers' "gelu_pytorch_tanh", Gemma's MLP activation, elementwise over n values.
//   CPU twin: cpu::geglu via Backend::geglu (Rust's f32 tanh, libm's tanhf; tanhf here is within 2 ulp of
//   it, and nvcc may fuse the polynomial's products into FMAs: the products agree up to rounding); launcher:
//   launch_geglu; parity test: parity_geglu.
// Launch shape: grid min(ceil(n/256), 65535·8), block 256, no smem, grid-stride, one element per thread per
//   step, as swiglu.
// Roofline: memory-bound, 12 bytes per element (2 reads, 1 write); tanhf is ~20 instructions, far under the
//   ~100 flop/byte an H200 can spend. Gemma-3-1B (d_ff 6912) on 128 × 2048 tokens: 21.7 GB → ≈ 4.5 ms at
//   4.8 TB/s per calibration pass.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error 3.2e-8 vs f64;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
geglu_kernel(float* __restrict__ out,         // [n] out
             const float* __restrict__ gate,  // [n]
             const float* __restrict__ up,    // [n]
             const uint64_t n) {
    constexpr float kBeta = 0.7978846f;  // √(2/π), the CPU twin's constant
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = 0.5f * g * (1.f + tanhf(kBeta * (g + 0.044715f * g * g * g))) * up[i];
    }
}

// ---------------------------------------------------------------------------------------------------------
// bias_add: Y [m × n] += b [n] broadcast over rows (the bias of the cuBLAS linear, gemm.rs).
// Launch shape: grid min(ceil(m·n/256), 65535·8), block 256, no smem, grid-stride.
// Roofline: memory-bound, 8 bytes per element of Y (b stays in L1/L2); a separate pass because cublasSgemm has
//   no bias epilogue (cublasLt has one; not worth a second library for the calibration forward).
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
bias_add_kernel(float* __restrict__ y,        // [m × n] in/out, row-major
                const float* __restrict__ b,  // [n]
                const uint64_t total,         // m·n
                const uint32_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) y[i] += b[i % n];
}

// ---------------------------------------------------------------------------------------------------------
// f32_to_bf16: out[i] = bf16(in[i]), round to nearest even: the operands of the bf16 linear variant
//   (cublasGemmEx with CUDA_R_16BF inputs, f32 accumulation and output).
// Launch shape: grid min(ceil(n/256), 65535·8), block 256, no smem, grid-stride.
// Roofline: memory-bound, 6 bytes per element.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
f32_to_bf16_kernel(__nv_bfloat16* __restrict__ out,  // [n] out
                   const float* __restrict__ in,     // [n]
                   const uint64_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = __float2bfloat16_rn(in[i]);
}

// ---------------------------------------------------------------------------------------------------------
// pad_rows_bf16: the bf16 operands of many Grams at once. For item i of a table (6 u64 each: X_i's address,
//   its row scales s_i's address or 0, n_i, k_i, off_i, d), out[off_i + r·d + c] = bf16(s_i[r] · X_i[r, c]) for
//   r < n_i (the product rounded once to f32, as scatter_add_rows computes it, then to bf16 as f32_to_bf16
//   does; X_i itself without scales) and 0 for n_i ≤ r < k_i. Zero rows add nothing to XᵀX, so one
//   cublasGemmBatchedEx per common k takes every item padded to it (gemm.rs gram_bf16_many): an MoE block's
//   experts, each on its routed rows, in a few library calls per chunk instead of two launches per expert.
//   CPU twin: the default QuantOps::stat_xxt_rows (host scaling, then stat_xxt); launcher:
//   launch_pad_rows_bf16; parity test: parity_statistics (tests/parity_quant.rs, "many Grams").
// Launch shape: grid (min(ceil(max_i k_i·d_i / 256), 4096), items), block 256, no smem: blockIdx.y is the
//   item, its blocks grid-stride over k_i·d_i elements, adjacent threads on adjacent columns of one row (coalesced).
// Roofline: memory-bound, 6 bytes per element (f32 read, bf16 written; padding rows 2): Qwen3-30B-A3B
//   (d 2048, top-8, 128 experts), a chunk of 8192 tokens: 65536 routed rows · (2048 + 768) ≈ 185 M elements
//   ≈ 1.1 GB ≈ 0.25 ms at 4.8 TB/s, against the 2 × 128 launches and allocations it replaces.
// Variants measured: none yet on a GPU (emulator parity only, 2026-12-06).
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
pad_rows_bf16_kernel(__nv_bfloat16* __restrict__ out,       // Σ_i k_i·d_i out
                     const uint64_t* __restrict__ table) {  // [items × 6]: x, s (0: none), n, k, off, d
    const uint64_t* e = table + 6 * (uint64_t)blockIdx.y;
    const float* x = reinterpret_cast<const float*>(e[0]);
    const float* s = reinterpret_cast<const float*>(e[1]);
    const uint64_t d = e[5], live = e[2] * d, total = e[3] * d;
    __nv_bfloat16* o = out + e[4];
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        float v = 0.0f;
        if (i < live) v = s == nullptr ? x[i] : __fmul_rn(x[i], s[i / d]);
        o[i] = __float2bfloat16_rn(v);
    }
}

// ---------------------------------------------------------------------------------------------------------
// block_hadamard: Y = X · (I ⊗ H_b/√b) for X [runs × b] (each run of b = m·p values times the normalized
//   Hadamard matrix H_b = H_m ⊗ H_p, H_p Sylvester's): QuaRot's online R4 before down_proj (model/online.rs).
//   Row-major, a run as an m × p matrix R: R · (H_m ⊗ H_p) = H_mᵀ (R H_p), so each of R's m rows gets an
//   in-place fast Walsh–Hadamard transform in shared memory (log₂ p butterfly stages), then row a2 of the
//   output is Σ_a H_m[a, a2] · (R H_p)[a, :], times 1/√b. f32 throughout (the CPU twin sums in f64: the
//   butterflies add log₂ p roundings, the dense factor m). CPU twin: ops::hadamard::block_transform_f32 (the
//   default Backend::block_hadamard_t); launcher: launch_block_hadamard; parity test: parity_block_hadamard
//   (tests/parity_ops.rs). b ≤ kHadamardMaxB (shared memory); a larger block runs the GEMM on the dense
//   transform instead (CudaBackend::block_hadamard_t).
// Launch shape: grid runs, block 256, dynamic smem 4·b bytes: one CTA per run; each stage's butterflies are
//   spread over the threads (b/2 pairs), a barrier between stages; the dense step reads the shared run
//   (H_m from global memory, L1/L2-resident) and writes Y once, coalesced.
// Roofline: memory-bound at small m: 8 bytes per element (X read, Y written) and b·(log₂ p + m) flop per run:
//   Llama-2-7B's R4 (11008 = 43 · 256, m = 1 per block of 256) over 2048 tokens: 90 MB ≈ 20 µs at 4.8 TB/s,
//   against the dense GEMM's 2·2048·11008·256 = 11.5 GFLOP (≈ 0.2 ms in f32). With m in the hundreds
//   (Qwen2.5-7B's 1184 = 148 ⊗ 8) the dense step dominates: m flop per element, from shared memory.
// Variants measured: none yet on a GPU (emulator parity only, 2026-12-06).
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
block_hadamard_kernel(float* __restrict__ y,         // [runs × m·p] out
                      const float* __restrict__ x,   // [runs × m·p]
                      const float* __restrict__ hm,  // [m × m] H_m, row-major, entries ±1
                      const uint32_t m,
                      const uint32_t p,              // a power of two
                      const float scale) {           // 1/√(m·p)
    extern __shared__ float bh_smem[];               // [m·p]
    const uint32_t b = m * p;
    const uint64_t base = (uint64_t)blockIdx.x * b;
    for (uint32_t i = threadIdx.x; i < b; i += blockDim.x) bh_smem[i] = x[base + i];
    __syncthreads();
    const uint32_t half = b / 2;
    for (uint32_t h = 1; h < p; h *= 2) {
        for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
            // Pair i: row a = i / (p/2), and within it butterfly group j / h, offset j % h.
            const uint32_t a = i / (p / 2), j = i % (p / 2);
            const uint32_t at = a * p + (j / h) * 2 * h + j % h;
            const float u = bh_smem[at], v = bh_smem[at + h];
            bh_smem[at] = u + v;
            bh_smem[at + h] = u - v;
        }
        __syncthreads();
    }
    for (uint32_t i = threadIdx.x; i < b; i += blockDim.x) {
        const uint32_t a2 = i / p, c = i % p;
        float acc = 0.0f;
        for (uint32_t a = 0; a < m; ++a) acc = fmaf(hm[a * m + a2], bh_smem[a * p + c], acc);
        y[base + i] = acc * scale;
    }
}

// ---------------------------------------------------------------------------------------------------------
// embed: X [rows × d] = table[ids[r], :] · scale for every row r (scale: Gemma's √d, else 1, which is exact):
//   the token embedding gather, so the calibration
//   activations (4 GiB at 7B with 128 × 2048 tokens) are made where they stay instead of crossing PCIe; the
//   table [vocab × d] is uploaded once (0.5 GB at 7B in f32). ids are checked < vocab by the launcher's caller
//   (CudaBackend::try_embed_t). CPU twin: the default Backend::embed_t (a host row copy, times the scale in
//   f32 as model::Model::embed does); launcher: launch_embed; parity test: parity_embed (tests/parity_ops.rs),
//   which must match bit for bit (one f32 product per element on both sides).
// Launch shape: grid min(ceil(rows·d/256), 65535·8), block 256, no smem, grid-stride over output elements:
//   adjacent threads write adjacent columns of one row, so both the table row read and the write coalesce.
// Roofline: memory-bound, 8 bytes per element (table row read, X written) + 4 per row for the id:
//   128 × 2048 tokens × 4096 → 8.6 GB ≈ 1.8 ms at 4.8 TB/s (H200), against ~0.3 s to copy X over PCIe.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: bit for bit;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
embed_kernel(float* __restrict__ x,               // [rows × d] out, row-major
             const float* __restrict__ table,     // [vocab × d] row-major
             const uint32_t* __restrict__ ids,    // [rows], each < vocab
             const uint64_t total,                // rows·d
             const uint32_t d,
             const float scale) {                 // the model's embedding scale (1: none)
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const uint64_t r = i / d;
        x[i] = table[(uint64_t)ids[r] * d + (i - r * d)] * scale;
    }
}

// ---------------------------------------------------------------------------------------------------------
// scatter_add_rows: out[rows[r], c] += y[r, c] · w[r] for every row r of y [n × d] and column c < d: an MoE
//   MLP adding one expert's output rows, weighted by the router, into the tokens routed to it, so neither the
//   block's activations nor the experts' outputs cross PCIe (the host routes: it reads the [m × n_experts]
//   logits and sends n row indices and weights). rows are distinct and < m (CudaBackend::try_scatter_add_rows_t
//   checks both before launching), so no two threads touch one element and no atomics are needed. The product
//   and the sum are rounded separately (__fmul_rn, __fadd_rn: no FMA contraction), as the CPU twin computes
//   them. CPU twin: the default Backend::scatter_add_rows_t; launcher: launch_scatter_add_rows; parity test:
//   parity_scatter_add_rows (tests/parity_ops.rs), bit for bit.
// Launch shape: grid min(ceil(n·d/256), 65535·8), block 256, no smem, grid-stride over y's elements: adjacent
//   threads take adjacent columns of one row, so the y read and the out read-modify-write coalesce.
// Roofline: memory-bound, 12 bytes per element (y read, out read and written) + 8 per row: Qwen3-30B-A3B
//   (d 2048, top-8) over 128 × 2048 tokens adds 2.1 M rows · 2048 → 52 GB ≈ 11 ms per block at 4.8 TB/s,
//   against ~0.7 s per block to copy the same rows over PCIe both ways.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: bit for bit;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kElementwiseThreads)
scatter_add_rows_kernel(float* __restrict__ out,             // [m × d] in/out, row-major
                        const float* __restrict__ y,         // [n × d] row-major
                        const uint32_t* __restrict__ rows,   // [n], distinct, each < m
                        const float* __restrict__ w,         // [n]
                        const uint64_t total,                // n·d
                        const uint32_t d) {
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const uint64_t r = i / d;
        float* o = out + (uint64_t)rows[r] * d + (i - r * d);
        *o = __fadd_rn(*o, __fmul_rn(y[i], w[r]));
    }
}

// ---------------------------------------------------------------------------------------------------------
// attention_probs: the causal softmax probabilities of ONE sequence, every query head:
//   P [h × t × t], P[hd, i, j] = e^(s_ij − max_j' s_ij') / Σ_j' e^(s_ij' − max) for j ≤ i, 0 for j > i,
//   s_ij = Q[i, hd·d_h..] · K[j, kv·d_h..] / √d_h, kv = hd / (h / h_kv) (GQA). Q [t × h·d_h], K [t × h_kv·d_h].
//   CPU twin: cpu::causal_softmax_probs via CpuBackend::attention_probs; launcher: launch_attention_probs;
//   parity test: parity_attention_probs.
// Launch shape: grid (ceil(t/4), h), block 128 (4 warps), no smem: warp w of block (b, hd) owns query row
//   i = 4b + w of head hd. Lane l scores keys j = l, l+32, … ≤ i (the whole q row is read by every lane: a
//   broadcast, L1-resident), so the row takes three passes over P[hd, i, 0..=i], each lane re-reading only
//   what it wrote itself (no barrier needed): (1) raw scaled scores and the lane max → warp max; (2) e^(s −
//   max) and the lane sum → warp sum; (3) multiply by 1/sum. Then zeros for j > i.
// Roofline: the output dominates: h·t²·4 bytes written (plus ~2× that re-read from L2), and h·t²/2·d_h·2 flop.
//   t = 512, h = 32, d_h = 128: 33.5 MB → ≈ 7 µs of writes at 4.8 TB/s, 1.1 GFLOP. This naive v1 reads K
//   uncoalesced (each lane walks its own key row) and does scalar FMAs, so expect it well off both floors; the
//   fused V-statistics kernel (design.md §6) is where speed matters, this is the plain reference path.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error 4.2e-7 vs f64;
//   compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kAttnProbsWarps * kWarpSize)
attention_probs_kernel(float* __restrict__ p,        // [h × t × t] out, row-major
                       const float* __restrict__ q,  // [t × h·d_h] row-major
                       const float* __restrict__ k,  // [t × h_kv·d_h] row-major
                       const uint32_t t,
                       const uint32_t h,
                       const uint32_t h_kv,          // divides h
                       const uint32_t d_h,
                       const float scale) {          // 1/√d_h
    const int lane = threadIdx.x % kWarpSize;
    const uint32_t i = blockIdx.x * kAttnProbsWarps + threadIdx.x / kWarpSize;
    const uint32_t hd = blockIdx.y;
    if (i >= t) return;  // warp-uniform: i is the same for every lane of the warp
    const uint32_t kv = hd / (h / h_kv);
    const float* q_row = q + ((uint64_t)i * h + hd) * d_h;
    float* p_row = p + ((uint64_t)hd * t + i) * t;

    float m = -INFINITY;
    for (uint32_t j = lane; j <= i; j += kWarpSize) {
        const float* k_row = k + ((uint64_t)j * h_kv + kv) * d_h;
        float s = 0.f;
        for (uint32_t c = 0; c < d_h; ++c) s += q_row[c] * k_row[c];
        s *= scale;
        p_row[j] = s;
        m = fmaxf(m, s);
    }
    m = warp_max(m);  // finite: key 0 is always visible, so some lane scored it

    float sum = 0.f;
    for (uint32_t j = lane; j <= i; j += kWarpSize) {
        const float e = expf(p_row[j] - m);
        p_row[j] = e;
        sum += e;
    }
    sum = warp_sum(sum);  // ≥ 1: the max term is e^0
    const float inv = 1.f / sum;
    for (uint32_t j = lane; j <= i; j += kWarpSize) p_row[j] *= inv;
    for (uint32_t j = i + 1 + lane; j < t; j += kWarpSize) p_row[j] = 0.f;
}

// ---------------------------------------------------------------------------------------------------------
// causal_attention v1 (naive): the same function as the flash kernels below (see their header for the math
//   and layouts), as a direct port of the CPU twin: one thread per (sequence, head, query row); pass 1 takes
//   the row max of the scaled scores, pass 2 recomputes each score, accumulates l = Σ e^(s − max) and
//   O[i] += e^(s − max)·V[j] straight in global memory, and pass 3 divides by l. Any d_h, and the same sliding
//   window (keys i − window < j ≤ i). The baseline when the flash kernels drift (style.md rule 4), selected by
//   AttentionVariant::Naive.
// Launch shape: grid (ceil(t/128), h, n_seq), block 128, no smem; threads with i ≥ t return at once.
// Roofline: the flash kernels' 2·n_seq·h·t²·d_h flop plus another half of it (QKᵀ twice), but every score
//   reads a key row per thread (uncoalesced across the warp) and every P·V step a read-modify-write of the
//   output row: expect 10–100× slower than the flash kernels. Correctness only.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error vs f64 5.1e-7 causal,
//   4.0e-7 windowed; compute-sanitizer memcheck: 0 errors); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(kAttnV1Threads)
causal_attention_kernel_v1(float* __restrict__ o,        // [n_seq·t × h·d_h] out, row-major
                           const float* __restrict__ q,  // [n_seq·t × h·d_h] row-major
                           const float* __restrict__ k,  // [n_seq·t × h_kv·d_h] row-major
                           const float* __restrict__ v,  // [n_seq·t × h_kv·d_h] row-major
                           const uint32_t t, const uint32_t h, const uint32_t h_kv, const uint32_t d_h,
                           const uint32_t window,  // keys per query, itself included (≥ 1; t: none)
                           const float scale) {    // 1/√d_h
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    const uint32_t hd = blockIdx.y, s = blockIdx.z;
    if (i >= t) return;
    const uint32_t kv = hd / (h / h_kv);
    const uint64_t kv_gl_stride = (uint64_t)h_kv * d_h;
    const float* q_row = q + (((uint64_t)s * t + i) * h + hd) * d_h;
    float* o_row = o + (((uint64_t)s * t + i) * h + hd) * d_h;
    const float* k_seq = k + (uint64_t)s * t * kv_gl_stride + (uint64_t)kv * d_h;
    const float* v_seq = v + (uint64_t)s * t * kv_gl_stride + (uint64_t)kv * d_h;
    const uint32_t j_lo = i + 1 > window ? i + 1 - window : 0;  // the oldest key the window keeps

    float m = -INFINITY;
    for (uint32_t j = j_lo; j <= i; ++j) {
        const float* k_row = k_seq + j * kv_gl_stride;
        float dot = 0.f;
        for (uint32_t c = 0; c < d_h; ++c) dot += q_row[c] * k_row[c];
        m = fmaxf(m, dot * scale);
    }
    for (uint32_t c = 0; c < d_h; ++c) o_row[c] = 0.f;
    float l = 0.f;
    for (uint32_t j = j_lo; j <= i; ++j) {
        const float* k_row = k_seq + j * kv_gl_stride;
        const float* v_row = v_seq + j * kv_gl_stride;
        float dot = 0.f;
        for (uint32_t c = 0; c < d_h; ++c) dot += q_row[c] * k_row[c];
        const float p = expf(dot * scale - m);
        l += p;
        for (uint32_t c = 0; c < d_h; ++c) o_row[c] += p * v_row[c];
    }
    const float inv = 1.f / l;
    for (uint32_t c = 0; c < d_h; ++c) o_row[c] *= inv;
}

// ---------------------------------------------------------------------------------------------------------
// causal_attention v2 (flash, the default): O = softmax(Q Kᵀ/√d_h + mask) V per (sequence, query head), GQA
//   (query head hd reads KV head hd / (h/h_kv)), without ever storing the probabilities: flash-attention's
//   online softmax (running max m, running sum l, accumulator rescaled by e^(m_old − m_new) when the max
//   grows), all f32. The mask is causal, and with a sliding window (Mistral, Gemma 3's local layers) query i
//   sees only keys i − window < j ≤ i (window keys, itself included; window = t is no window).
//   Q, O [n_seq·t × h·d_h], K, V [n_seq·t × h_kv·d_h], row-major, token i of sequence s in row s·t + i.
//   CPU twin: cpu::attention via CpuBackend::causal_attention / Backend::causal_attention_t (window);
//   launcher: launch_causal_attention; parity tests: parity_causal_attention, parity_windowed_attention.
//   kD ∈ {64, 128, 256} is the padded head dim (d_h ≤ kD, the tail zero); d_h > 256 takes v1 (any d_h) or the
//   CPU (the flash launcher refuses it).
//
// Launch shape: grid (ceil(t/Q), h, n_seq), block 256, static smem 2·kKeys·kD·4 B, where a query row is shared
//   by kTpq threads and Q = 256/kTpq rows per CTA:
//     kD =  64: kTpq 4, Q 64, tiles of 32 keys, 16 KB;
//     kD = 128: kTpq 4, Q 64, tiles of 32 keys, 32 KB;
//     kD = 256: kTpq 8, Q 32, tiles of 16 keys, 32 KB (Gemma 3; 8 threads per row keep q and the output
//               accumulator at 32 + 32 registers per thread, and the half-height tiles keep the static smem
//               under 48 KB).
//   CTA (qt, hd, s) owns query rows qt·Q .. qt·Q+Q−1 of head hd in sequence s; it walks key tiles from the
//   first key its first row's window keeps (key 0 without a window) up to its last query row (the causal
//   mask skips the rest), K and V tiles staged in smem by all 256 threads (coalesced along d_h), then:
//
//        query row r (0..Q−1) ← threads kTpq·r .. kTpq·r+kTpq−1 (consecutive lanes of one warp), thread
//        kTpq·r+g owns the head dims c·kTpq + g (c < kD/kTpq): its slice of q (pre-scaled by 1/√d_h) and of
//        the output accumulator live in registers.
//        scores: each thread dots its q slice with its dims of all the tile's keys, and log2(kTpq)
//        xor-shuffles (1, 2[, 4]) sum the slices, so every thread of the row holds all the tile's scores,
//        bit-identical across the kTpq (fp add is commutative), hence identical m and l with no further
//        exchange.
//        mask: key j > query i, or j ≤ i − window → −∞. Without a window key 0 is in the first tile and
//        visible to every row, so m is finite from the first tile on. With one, a row may see no key of a
//        tile (all older than its window: rows late in the CTA, early tiles): its m stays −∞, and the
//        exponentials are then taken against 0 instead (e^(−∞ − 0) = 0), never −∞ − (−∞). Key i itself is
//        always visible, so l > 0 at the end.
//
//   Rows past t (the last tile) compute on zero queries and are never stored; every thread reaches every
//   barrier and shuffle. Smem reads: lanes kTpq·r+g read K[j][c·kTpq+g], kTpq consecutive words broadcast to
//   the 32/kTpq rows of the warp → conflict-free.
// Roofline: 2·n_seq·h·t²·d_h flop over the causal half (QKᵀ and PV), 4·n_seq·h·t·window·d_h with a window
//   (less the first window's triangle); 7B-sized call (n_seq 8, t 512, h 32, d_h 128): 17 GFLOP → ≈ 0.3 ms at
//   the H200's ~60 TFLOP/s f32 (no tensor cores: this is the f32 reference path); bytes (Q, K, V, O once:
//   4 × 16.8 MB) ≈ 14 µs, so arithmetic-bound. One smem load per FMA caps this version at roughly a third of
//   f32 peak; a tensor-core (bf16 mma) variant is the next step once measured. Gemma-3-1B-like call (n_seq 8,
//   t 2048, h 4, d_h 256, window 512 on the local layers): global 8.6 GFLOP, local 7.5 GFLOP (the window
//   skips the key tiles before it) → ≈ 0.15 ms each at f32 peak, ~0.5 ms at this kernel's third of it.
// Checked without a GPU: profiling/emulate_causal_attention.py replays this thread map, tiling, mask and online
//   softmax in numpy f32 (rel. error ≤ 2.4e-7 vs f64 on six shapes, 2026-11-30; kD ≤ 128, no window); the CPU
//   emulator of the CUDA stack runs the kernels themselves (profiling/emu); CUDA semantics unverified until
//   the H200 run below.
// Variants measured: correct on an H200 (parity tests, 2026-12-04: max rel. error vs f64 2.6e-7 causal,
//   2.0e-7 windowed; compute-sanitizer memcheck: 0 errors); speed not measured yet (≈ 0.3 ms predicted above
//   for the 7B-sized call).
// ---------------------------------------------------------------------------------------------------------
template <int kD, int kTpq, int kKeys>
__device__ __forceinline__ void causal_attention_tile(
    float* __restrict__ o, const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const uint32_t t, const uint32_t h, const uint32_t h_kv, const uint32_t d_h, const uint32_t window,
    const float scale) {
    constexpr int kQueries = kAttnThreads / kTpq;  // query rows per CTA
    constexpr int kSlice = kD / kTpq;              // head dims per thread
    static_assert(kTpq == 4 || kTpq == 8, "the score reduction below shuffles within groups of 4 or 8 lanes");
    __shared__ float k_sh[kKeys][kD];
    __shared__ float v_sh[kKeys][kD];

    const uint32_t s = blockIdx.z, hd = blockIdx.y;
    const uint32_t kv = hd / (h / h_kv);
    const int r = threadIdx.x / kTpq;  // query row within the tile
    const int g = threadIdx.x % kTpq;  // which dim slice of the row
    const uint32_t q0 = blockIdx.x * kQueries;
    const uint32_t i = q0 + r;  // query position in the sequence
    const bool live = i < t;
    const uint64_t q_gl_stride = (uint64_t)h * d_h;    // row stride of Q and O
    const uint64_t kv_gl_stride = (uint64_t)h_kv * d_h;  // row stride of K and V
    const float* k_seq = k + (uint64_t)s * t * kv_gl_stride + (uint64_t)kv * d_h;
    const float* v_seq = v + (uint64_t)s * t * kv_gl_stride + (uint64_t)kv * d_h;

    float q_rg[kSlice], acc[kSlice];
    {
        const float* q_row = q + ((uint64_t)s * t + i) * q_gl_stride + (uint64_t)hd * d_h;
#pragma unroll
        for (int c = 0; c < kSlice; ++c) {
            const uint32_t d = c * kTpq + g;
            q_rg[c] = (live && d < d_h) ? q_row[d] * scale : 0.f;
            acc[c] = 0.f;
        }
    }
    float m = -INFINITY, l = 0.f;

    const uint32_t key_end = min(q0 + kQueries, t);  // keys 0..key_end−1 can be visible to this tile
    // Row q0's window starts earliest (at q0 + 1 − window): the tiles before that one are masked for every row.
    const uint32_t key_begin = q0 + 1 > window ? (q0 + 1 - window) / kKeys * kKeys : 0;
    for (uint32_t j0 = key_begin; j0 < key_end; j0 += kKeys) {
        __syncthreads();  // every thread is done reading the previous tile
        for (int e = threadIdx.x; e < kKeys * kD; e += kAttnThreads) {
            const int jj = e / kD, d = e % kD;
            const uint32_t j = j0 + jj;
            const bool in = j < t && (uint32_t)d < d_h;
            k_sh[jj][d] = in ? k_seq[(uint64_t)j * kv_gl_stride + d] : 0.f;
            v_sh[jj][d] = in ? v_seq[(uint64_t)j * kv_gl_stride + d] : 0.f;
        }
        __syncthreads();

        float sc[kKeys];
        float m_tile = -INFINITY;
#pragma unroll
        for (int jj = 0; jj < kKeys; ++jj) {
            float part = 0.f;
#pragma unroll
            for (int c = 0; c < kSlice; ++c) part += q_rg[c] * k_sh[jj][c * kTpq + g];
#pragma unroll
            for (int off = 1; off < kTpq; off *= 2) part += __shfl_xor_sync(kFullMask, part, off);
            // Causal (also hides keys ≥ t, as i < t or dead) and windowed: j ≤ i, i − j < window.
            const uint32_t j = j0 + jj;
            sc[jj] = (j <= i && i - j < window) ? part : -INFINITY;
            m_tile = fmaxf(m_tile, sc[jj]);
        }
        const float m_new = fmaxf(m, m_tile);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // −∞ only under a window: see the header
        const float corr = expf(m - m_use);                      // 0 while m = −∞
        l *= corr;
#pragma unroll
        for (int c = 0; c < kSlice; ++c) acc[c] *= corr;
#pragma unroll
        for (int jj = 0; jj < kKeys; ++jj) {
            const float pj = expf(sc[jj] - m_use);
            l += pj;
#pragma unroll
            for (int c = 0; c < kSlice; ++c) acc[c] += pj * v_sh[jj][c * kTpq + g];
        }
        m = m_new;
    }

    if (!live) return;  // after the last barrier and shuffle
    const float inv = 1.f / l;
    float* o_row = o + ((uint64_t)s * t + i) * q_gl_stride + (uint64_t)hd * d_h;
#pragma unroll
    for (int c = 0; c < kSlice; ++c) {
        const uint32_t d = c * kTpq + g;
        if (d < d_h) o_row[d] = acc[c] * inv;
    }
}

// Explicit entry points of v2 (flash), one per padded head dim (style.md rule 17): 64 (SmolLM2-135M), 128
// (Llama, Mistral and Qwen 7B) and 256 (Gemma 3 270M–12B). d_h ≤ 64 takes the d64 kernel, 64 < d_h ≤ 128 the
// d128 one, 128 < d_h ≤ 256 the d256 one (the tail dims are zero).
extern "C" __global__ void __launch_bounds__(kAttnThreads)
causal_attention_kernel_d64(float* __restrict__ o,        // [n_seq·t × h·d_h] out, row-major
                            const float* __restrict__ q,  // [n_seq·t × h·d_h] row-major
                            const float* __restrict__ k,  // [n_seq·t × h_kv·d_h] row-major
                            const float* __restrict__ v,  // [n_seq·t × h_kv·d_h] row-major
                            const uint32_t t, const uint32_t h, const uint32_t h_kv, const uint32_t d_h,
                            const uint32_t window,  // keys per query, itself included (≥ 1; t: no window)
                            const float scale) {    // 1/√d_h
    causal_attention_tile<64, kAttnTpqNarrow, kAttnKeysNarrow>(o, q, k, v, t, h, h_kv, d_h, window, scale);
}

extern "C" __global__ void __launch_bounds__(kAttnThreads)
causal_attention_kernel_d128(float* __restrict__ o,        // [n_seq·t × h·d_h] out, row-major
                             const float* __restrict__ q,  // [n_seq·t × h·d_h] row-major
                             const float* __restrict__ k,  // [n_seq·t × h_kv·d_h] row-major
                             const float* __restrict__ v,  // [n_seq·t × h_kv·d_h] row-major
                             const uint32_t t, const uint32_t h, const uint32_t h_kv, const uint32_t d_h,
                             const uint32_t window,  // keys per query, itself included (≥ 1; t: no window)
                             const float scale) {    // 1/√d_h
    causal_attention_tile<128, kAttnTpqNarrow, kAttnKeysNarrow>(o, q, k, v, t, h, h_kv, d_h, window, scale);
}

extern "C" __global__ void __launch_bounds__(kAttnThreads)
causal_attention_kernel_d256(float* __restrict__ o,        // [n_seq·t × h·d_h] out, row-major
                             const float* __restrict__ q,  // [n_seq·t × h·d_h] row-major
                             const float* __restrict__ k,  // [n_seq·t × h_kv·d_h] row-major
                             const float* __restrict__ v,  // [n_seq·t × h_kv·d_h] row-major
                             const uint32_t t, const uint32_t h, const uint32_t h_kv, const uint32_t d_h,
                             const uint32_t window,  // keys per query, itself included (≥ 1; t: no window)
                             const float scale) {    // 1/√d_h
    causal_attention_tile<256, kAttnTpqWide, kAttnKeysWide>(o, q, k, v, t, h, h_kv, d_h, window, scale);
}
