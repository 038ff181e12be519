// qgemm.cu — packed low-bit GEMM (design.md §6 "packed low-bit GEMM", §9 GPTQ layout):
//
//   Y [m × N] = X [m × K] · Ŵᵀ,   Ŵ[j, i] = s[g, j]·(q[i, j] − z[g, j]),  g = g_idx[i],
//
// N = d_out, K = d_in, with Ŵ held packed as a GPTQ checkpoint holds it (include/boa_pack.h): qweight u32
// [ceil(K·b/32) × N], column j's codes a bit stream along K, LSB-first, b ∈ {2, 3, 4, 8} (3-bit codes straddle
// words: 32 codes fill 3 words); scales and zeros f32 [n_groups × N] (zeros are the true zero points,
// unpacked on the host: `PackedLinear`); g_idx u32 [K]. The bias, when there is one, is added afterwards by
// bias_add_kernel (cuda/ops.cu), as the cuBLAS linear does.
//
// Activations are f32 (the issue says "A16"; the forward of this codebase keeps f32 activations, so X and Y
// are f32 and every sum is an f32 accumulation).
//
// CPU twin: cpu::packed_linear_f32 (src/backend/cpu.rs; its AVX-512/AVX2 kernels in cpu_qgemm.rs use the same
// zero-point algebra); launchers: src/backend/cuda/qgemm.rs; parity test: tests/parity_qgemm.rs;
// index-math emulation without a GPU: profiling/emulate_qgemm.py.
//
// ---------------------------------------------------------------------------------------------------------
// v2 qgemm_fused (m ≤ 16, decode-like; the default there): dequantize in registers and dot, no Ŵ in memory.
//
//   Launch: grid (ceil(N/128), splits), block 128 (kQgemmThreads), dynamic smem len·MT·4 B (+ len·4 B for
//   g_idx), len = the split's input rows rounded up to a super-row (32 codes). MT ∈ {1, 2, 4, 8, 16} is the
//   token tile (the smallest ≥ m; tokens t ≥ m are zero rows in shared memory, so they cost FMAs, not
//   branches).
//
//   Thread j of column block bx owns output column bx·128 + j: consecutive threads read consecutive words
//   of a qweight row (one 128 B transaction per warp per row, every byte used once). blockIdx.y = split
//   owns the super-rows [split·spb, (split+1)·spb) of K (split-K, so that N = 4096 still fills 132 SMs: 32
//   column blocks × 32 splits). Per super-row a thread loads its b words (the next super-row's are loaded
//   before the current one is used: 2·b words in flight per thread), unpacks the 32 codes and adds
//   x[t, i]·(q − z) into MT register accumulators; at each group boundary it adds s·acc to its MT outputs.
//
//        K (super-rows) ─────────────────────────────►
//        ┌──────────┬──────────┬──────────┬──────────┐   column block bx (128 columns)
//        │ split 0  │ split 1  │ split 2  │ split 3  │   each (bx, split) is one CTA; its partial
//        └──────────┴──────────┴──────────┴──────────┘   Y [m × 128] goes to part[split]
//
//   Split-K reduction, deterministic and in the same launch: every CTA writes its partial Y to
//   part [splits × m × N], fences, and bumps counters[bx]; the CTA that brings the count to `splits` sums
//   the partials in split order 0, 1, … (a fixed order whatever the scheduling) into Y and sets the counter
//   back to 0, so the next call starts from zero without a memset (the CUDA threadFenceReduction pattern).
//   With one split the CTA writes Y directly.
//
//   Unpacking without int→float conversions (I2F issues at a quarter of the FP32 rate on sm_80/sm_90, and at
//   m = 1 there is one per weight): a super-row's 32·b bits are read in windows of C = ⌊23/b⌋ codes (a funnel
//   shift of two words, a compile-time shift); code c of a window sits at bit p = b·c < 23 of the
//   window, so OR-ing its masked bits into the bit pattern of 2^23 gives the float 2^23 + q·2^p exactly
//   (one LOP3), and subtracting kp[c] = 2^23 + z·2^p gives (q − z)·2^p exactly (one FADD; all values are
//   integers below 2^24). The 2^p is undone for free: X is staged into shared memory already multiplied by
//   2^−p (exact, a power of two). So a code costs LOP3 + FADD + MT FFMAs, plus a broadcast LDS.128 per 4
//   codes (MT < 4) or per code (MT ≥ 4); a super-row adds ⌈32/C⌉ funnel shifts. The per-group zero constants
//   kp[0..C) stay in registers (≤ 11). g_idx variant (act-order): each code looks up its group's s and z
//   (coalesced along j, L1/L2-resident) and is scaled by s before the FMAs, so Ŵ is rounded once as on the
//   CPU.
//
//   Roofline (H200, ~4.8 TB/s HBM; issue ~128 thread-instr/clk/SM × 132 SMs × 1.98 GHz ≈ 3.3e13/s):
//   4-bit 4096 × 4096 at m = 1: qweight 8 MiB + f32 scales/zeros (g128: 1 MiB; per channel 32 KiB) + X, Y
//   (16 KiB each) ≈ 9.4 MB → ≈ 2.0 µs at 4.8 TB/s. Instructions: ~3.3 per weight (LOP3, FADD, FFMA, ¼ LDS,
//   ~0.2 funnel/loop) × 16.8 M weights ≈ 5.5e7 → ≈ 1.7 µs of issue, so at m = 1 memory and issue are within
//   20% of each other; 2-bit (twice the weights per byte) is issue-bound, and from m ≈ 4 on every width is
//   (MT FFMAs per weight). The issue's target, 4-bit m = 1 ≥ 70% of the measured copy bandwidth, leaves room
//   for that overlap but not for a second launch: hence the in-kernel split-K reduction.
//
// v1 qgemm_dequant + cuBLAS (any m; the default for m > 16): Ŵ [N × K] f32 = dequantize(qweight), then
//   Y = X·Ŵᵀ by cublasSgemm (src/backend/cuda/gemm.rs). Launch: grid (ceil(N/128), ceil(K/32)), block 128:
//   thread (j, super-row) reads its b words (coalesced along j) and writes Ŵ[j, 32·sr .. 32·sr+32) with
//   boa_dequantize (include/boa_quant.h), the formula the CPU twin's tile dequantization uses. Memory: the
//   packed read plus a 4·N·K write (64 MiB at 4096², ≈ 15 µs at HBM rate) that the SGEMM reads back; at
//   m = 64, 2·m·N·K = 2.1 GFLOP of f32 SGEMM (~50 TFLOP/s) ≈ 45 µs dominates. A bf16 Ŵ with a tensor-core
//   GEMM would halve the write and be ~10× faster in the GEMM, at bf16 rounding of Ŵ (≈ 3e-3): a later variant.
//
// Variants measured (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`): v2 fused, g128,
//   kernel time at m = 1/4/16 and its bandwidth (ceiling.cu's copy ceiling: 3883 GB/s):
//     4096 × 4096   2-bit 0.012/0.017/0.041 ms, 457/310/141 GB/s; 3-bit 0.017/0.016/0.042 ms, 428/456/189
//                   GB/s; 4-bit 0.015/0.016/0.041 ms, 621/605/246 GB/s;
//     11008 × 4096  2-bit 0.018/0.028/0.093 ms, 802/519/162 GB/s; 3-bit 0.019/0.029/0.093 ms, 1059/689/223
//                   GB/s; 4-bit 0.020/0.030/0.092 ms, 1253/849/285 GB/s (32.3% of the copy ceiling at m = 1).
//   Predicted ≈ 2.0 µs for 4-bit 4096 × 4096 at m = 1, measured 0.015 ms; the target above (4-bit m = 1 ≥ 70%
//   of copy) is not met: 32.3% at best. v1 (dequant + cuBLAS) not timed yet. Both correct on an H200 (parity
//   tests, 2026-12-04: max rel. error vs f64 v1 4.0e-7, v2 3.7e-7). Record each measurement here with card
//   and date.
// Size: the 44 kernels (fully unrolled super-rows) make a 6 MB fatbin (2.9 MB of SASS per arch with -lineinfo),
//   embedded in every binary that links the crate; nvcc --compress-mode=size shrinks the sm_90a part to 0.37 MB
//   (measured 2026-11-30, nvcc 13.0), if the .gpu_carry budget gets tight.
// ---------------------------------------------------------------------------------------------------------

#include "boa_pack.h"

// --- device helpers ---------------------------------------------------------------------------------------

constexpr int kQgemmThreads = 128;        // fused: threads (= output columns) per CTA
constexpr int kDequantThreads = 128;      // dequant: threads (= output columns) per CTA
constexpr int kSuperRow = 32;             // codes per super-row (b words hold exactly 32 b-bit codes)
constexpr uint32_t kTwo23Bits = 0x4B000000u;  // bit pattern of 2^23: mantissa bit p of it is worth 2^p
constexpr float kTwo23 = 8388608.0f;

// Codes per unpacking window: code c of a window sits at bit b·c, and b·c + b ≤ 23 keeps it in the mantissa.
template <int BITS>
__device__ __host__ constexpr int codes_per_window() {
    return 23 / BITS;
}

// 2^−p as a float, exactly (0 ≤ p ≤ 126).
__device__ __forceinline__ float exp2_neg(uint32_t p) {
    return __uint_as_float((127u - p) << 23);
}

// The 32 bits of a super-row's stream starting at bit `s` (0 ≤ s < 32·BITS, compile-time after unrolling):
// a funnel shift of the two words it touches, or a plain shift within the last word.
template <int BITS>
__device__ __forceinline__ uint32_t stream_bits(const uint32_t (&wd)[BITS], int s) {
    const int lo = s / 32, sh = s % 32;
    const int hi = lo + 1 < BITS ? lo + 1 : BITS - 1;
    return lo + 1 < BITS ? __funnelshift_r(wd[lo], wd[hi], sh) : (wd[lo] >> sh);
}

// The b words of super-row `sr` of column j (stride n), zero past the last word row kw (a trailing partial
// super-row when K·b is not a multiple of 32·b). Streaming loads: the weights are read exactly once.
template <int BITS>
__device__ __forceinline__ void load_super_row(uint32_t (&wd)[BITS], const uint32_t* __restrict__ qweight,
                                               uint32_t sr, uint32_t kw, uint32_t n, uint32_t j) {
#pragma unroll
    for (int w = 0; w < BITS; ++w) {
        const uint32_t r = sr * BITS + w;
        wd[w] = r < kw ? __ldcs(qweight + (size_t)r * n + j) : 0u;
    }
}

// --- GPU kernels ------------------------------------------------------------------------------------------

// v2 fused: see the header. GIDX = false: contiguous groups of group_sr super-rows (g = sr / group_sr; per
// channel: group_sr ≥ the number of super-rows); GIDX = true: any g_idx (act-order), looked up per code.
template <int BITS, int MT, bool GIDX>
__device__ __forceinline__ void qgemm_fused(float* __restrict__ y,               // [m × n] out
                                            float* __restrict__ part,            // [splits × m × n] partials
                                            uint32_t* __restrict__ counters,     // [gridDim.x], 0 on entry
                                            const float* __restrict__ x,         // [m × k] row-major
                                            const uint32_t* __restrict__ qweight,  // [ceil(k·b/32) × n]
                                            const float* __restrict__ scales,    // [n_groups × n]
                                            const float* __restrict__ zeros,     // [n_groups × n], true zeros
                                            const uint32_t* __restrict__ g_idx,  // [k] (GIDX only)
                                            uint32_t m, uint32_t k, uint32_t n,
                                            uint32_t sr_per_split,  // super-rows per split (blockIdx.y)
                                            uint32_t group_sr) {    // super-rows per group (!GIDX)
    constexpr int C = codes_per_window<BITS>();
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    extern __shared__ float4 smem_f4[];
    float* x_sh = reinterpret_cast<float*>(smem_f4);  // [len × MT], token-minor, pre-scaled by 2^−p

    const uint32_t nsr = (k + kSuperRow - 1) / kSuperRow;
    const uint32_t kw = (uint32_t)boa_pack_words(k, BITS);
    const uint32_t split = blockIdx.y, splits = gridDim.y;
    const uint32_t sr0 = split * sr_per_split;
    const uint32_t sr1 = min(sr0 + sr_per_split, nsr);  // the launcher leaves no split empty
    const uint32_t len = (sr1 - sr0) * kSuperRow;
    const uint32_t k0 = sr0 * kSuperRow;
    uint32_t* g_sh = reinterpret_cast<uint32_t*>(x_sh + (size_t)len * MT);  // [len] (GIDX only)

    // Stage X[:, k0 .. k0+len) as x_sh[r·MT + t] = X[t, k0 + r]·2^−p(r), zero for t ≥ m and k0 + r ≥ k, so
    // padded tokens and the codes past k (zero words, or codes of a partial last word) add exactly 0.
    for (uint32_t e = threadIdx.x; e < len * MT; e += blockDim.x) {
        const uint32_t r = e / MT, t = e % MT, i = k0 + r;
        const uint32_t p = BITS * ((r % kSuperRow) % C);  // k0 is a multiple of 32: r % 32 == i % 32
        x_sh[e] = (t < m && i < k) ? x[(size_t)t * k + i] * exp2_neg(p) : 0.0f;
    }
    if constexpr (GIDX) {
        for (uint32_t r = threadIdx.x; r < len; r += blockDim.x) g_sh[r] = k0 + r < k ? g_idx[k0 + r] : 0u;
    }
    __syncthreads();

    const uint32_t j = blockIdx.x * kQgemmThreads + threadIdx.x;
    float y_acc[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) y_acc[t] = 0.0f;

    if (j < n) {
        float acc[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[t] = 0.0f;
        float kp[C];  // 2^23 + z·2^(b·c): the current group's zero at each window position (!GIDX)
#pragma unroll
        for (int c = 0; c < C; ++c) kp[c] = kTwo23;
        float s_cur = 0.0f;
        uint32_t g_cur = 0xffffffffu;

        uint32_t wd[BITS], nx[BITS] = {};
        load_super_row<BITS>(wd, qweight, sr0, kw, n, j);
        for (uint32_t sr = sr0; sr < sr1; ++sr) {
            if (sr + 1 < sr1) load_super_row<BITS>(nx, qweight, sr + 1, kw, n, j);
            if constexpr (!GIDX) {
                const uint32_t g = sr / group_sr;
                if (g != g_cur) {  // warp-uniform: every lane is at the same super-row
#pragma unroll
                    for (int t = 0; t < MT; ++t) y_acc[t] = fmaf(s_cur, acc[t], y_acc[t]), acc[t] = 0.0f;
                    g_cur = g;
                    s_cur = scales[(size_t)g * n + j];
                    const float z = zeros[(size_t)g * n + j];
#pragma unroll
                    for (int c = 0; c < C; ++c) kp[c] = fmaf(z, (float)(1u << (BITS * c)), kTwo23);
                }
            }
            const float* x_row = x_sh + (size_t)(sr - sr0) * kSuperRow * MT;
            uint32_t v = 0;
            float xq[MT < 4 ? 4 * MT : MT];  // MT < 4: a quad of codes' X; else one code's X
#pragma unroll
            for (int c = 0; c < kSuperRow; ++c) {
                const int cw = c % C;  // position in the window
                if (cw == 0) v = stream_bits<BITS>(wd, BITS * c);
                if constexpr (MT < 4) {
                    if (c % 4 == 0) {
#pragma unroll
                        for (int q = 0; q < MT; ++q) {
                            const float4 x4 = reinterpret_cast<const float4*>(x_row + c * MT)[q];
                            xq[4 * q] = x4.x, xq[4 * q + 1] = x4.y, xq[4 * q + 2] = x4.z, xq[4 * q + 3] = x4.w;
                        }
                    }
                } else {
#pragma unroll
                    for (int q = 0; q < MT / 4; ++q) {
                        const float4 x4 = reinterpret_cast<const float4*>(x_row + c * MT)[q];
                        xq[4 * q] = x4.x, xq[4 * q + 1] = x4.y, xq[4 * q + 2] = x4.z, xq[4 * q + 3] = x4.w;
                    }
                }
                // 2^23 + q·2^p, exactly; minus kp gives (q − z)·2^p, exactly.
                const float f = __uint_as_float(kTwo23Bits | (v & (kMask << (BITS * cw))));
                float d;
                if constexpr (GIDX) {
                    const uint32_t g = g_sh[(sr - sr0) * kSuperRow + c];
                    const float s = scales[(size_t)g * n + j];
                    const float z = zeros[(size_t)g * n + j];
                    d = (f - fmaf(z, (float)(1u << (BITS * cw)), kTwo23)) * s;  // s·(q − z)·2^p: Ŵ rounded once
                } else {
                    d = f - kp[cw];
                }
                const int xo = MT < 4 ? (c % 4) * MT : 0;
#pragma unroll
                for (int t = 0; t < MT; ++t) acc[t] = fmaf(xq[xo + t], d, acc[t]);
            }
#pragma unroll
            for (int w = 0; w < BITS; ++w) wd[w] = nx[w];
        }
        if constexpr (GIDX) {
#pragma unroll
            for (int t = 0; t < MT; ++t) y_acc[t] = acc[t];
        } else {
#pragma unroll
            for (int t = 0; t < MT; ++t) y_acc[t] = fmaf(s_cur, acc[t], y_acc[t]);
        }
    }

    if (splits == 1) {
        if (j < n) {
#pragma unroll
            for (int t = 0; t < MT; ++t)
                if (t < (int)m) y[(size_t)t * n + j] = y_acc[t];
        }
        return;
    }
    if (j < n) {
#pragma unroll
        for (int t = 0; t < MT; ++t)
            if (t < (int)m) part[((size_t)split * m + t) * n + j] = y_acc[t];
    }
    // Make this CTA's partials visible device-wide before it is counted.
    __threadfence();
    __syncthreads();
    // The barrier's OR broadcasts thread 0's verdict: no static shared memory, so the launcher's dynamic
    // budget (up to exactly 48 KiB) is the CTA's whole shared memory and needs no opt-in.
    const int is_last =
        __syncthreads_or(threadIdx.x == 0 && atomicAdd(&counters[blockIdx.x], 1u) == splits - 1);
    if (!is_last) return;
    __threadfence();
    if (j < n) {
        for (uint32_t t = 0; t < m; ++t) {
            float sum = 0.0f;
            // __ldcg: from L2, never from this SM's L1 (the partials were written by other SMs).
            for (uint32_t sp = 0; sp < splits; ++sp) sum += __ldcg(part + ((size_t)sp * m + t) * n + j);
            y[(size_t)t * n + j] = sum;
        }
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0u;  // every CTA of this column block has been counted
}

// v1 dequantize: Ŵ [n × k] f32 row-major (the W layout of the cuBLAS linear) from the packed tensors, any g_idx.
template <int BITS>
__device__ __forceinline__ void qgemm_dequant(float* __restrict__ w_hat,           // [n × k] out
                                              const uint32_t* __restrict__ qweight,  // [ceil(k·b/32) × n]
                                              const float* __restrict__ scales,     // [n_groups × n]
                                              const float* __restrict__ zeros,      // [n_groups × n]
                                              const uint32_t* __restrict__ g_idx,   // [k]
                                              uint32_t k, uint32_t n) {
    constexpr uint32_t kMask = (1u << BITS) - 1u;
    const uint32_t j = blockIdx.x * kDequantThreads + threadIdx.x;
    const uint32_t sr = blockIdx.y;
    if (j >= n) return;
    uint32_t wd[BITS];
    load_super_row<BITS>(wd, qweight, sr, (uint32_t)boa_pack_words(k, BITS), n, j);
    float* w_row = w_hat + (size_t)j * k;
#pragma unroll
    for (int c = 0; c < kSuperRow; ++c) {
        const uint32_t i = sr * kSuperRow + c;
        if (i >= k) break;
        // As boa_unpack_code: code c starts at bit b·c of the super-row and straddles words only for b = 3.
        const int bit = BITS * c, lo = bit / 32, off = bit % 32;
        const int hi = lo + 1 < BITS ? lo + 1 : BITS - 1;
        uint32_t v = wd[lo] >> off;
        if (off + BITS > 32) v |= wd[hi] << (32 - off);
        const uint32_t g = g_idx[i];
        w_row[i] = boa_dequantize((float)(v & kMask), scales[(size_t)g * n + j], zeros[(size_t)g * n + j]);
    }
}

// --- kernel entry points ----------------------------------------------------------------------------------
// Instantiated configurations (style.md rule 17): every bit width GPTQ checkpoints use (2, 3, 4, 8) × token
// tiles 1, 2, 4, 8, 16 (the smallest ≥ m runs, so at most 2× the FMAs m needs) × contiguous groups or g_idx;
// the dequantize kernel once per bit width. The macros only stamp out these extern "C" names: the code is in
// the templates above.

#define BOA_QGEMM_FUSED(BITS, MT)                                                                            \
    extern "C" __global__ void __launch_bounds__(kQgemmThreads) qgemm_fused_kernel_b##BITS##_m##MT(          \
        float* y, float* part, uint32_t* counters, const float* x, const uint32_t* qweight,                  \
        const float* scales, const float* zeros, const uint32_t* g_idx, uint32_t m, uint32_t k, uint32_t n,  \
        uint32_t sr_per_split, uint32_t group_sr) {                                                          \
        qgemm_fused<BITS, MT, false>(y, part, counters, x, qweight, scales, zeros, g_idx, m, k, n,           \
                                     sr_per_split, group_sr);                                                \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(kQgemmThreads) qgemm_fused_gidx_kernel_b##BITS##_m##MT(     \
        float* y, float* part, uint32_t* counters, const float* x, const uint32_t* qweight,                  \
        const float* scales, const float* zeros, const uint32_t* g_idx, uint32_t m, uint32_t k, uint32_t n,  \
        uint32_t sr_per_split, uint32_t group_sr) {                                                          \
        qgemm_fused<BITS, MT, true>(y, part, counters, x, qweight, scales, zeros, g_idx, m, k, n,            \
                                    sr_per_split, group_sr);                                                 \
    }

#define BOA_QGEMM_BITS(BITS)                                                                                 \
    BOA_QGEMM_FUSED(BITS, 1)                                                                                 \
    BOA_QGEMM_FUSED(BITS, 2)                                                                                 \
    BOA_QGEMM_FUSED(BITS, 4)                                                                                 \
    BOA_QGEMM_FUSED(BITS, 8)                                                                                 \
    BOA_QGEMM_FUSED(BITS, 16)                                                                                \
    extern "C" __global__ void __launch_bounds__(kDequantThreads) qgemm_dequant_kernel_b##BITS(              \
        float* w_hat, const uint32_t* qweight, const float* scales, const float* zeros,                      \
        const uint32_t* g_idx, uint32_t k, uint32_t n) {                                                     \
        qgemm_dequant<BITS>(w_hat, qweight, scales, zeros, g_idx, k, n);                                     \
    }

BOA_QGEMM_BITS(2)
BOA_QGEMM_BITS(3)
BOA_QGEMM_BITS(4)
BOA_QGEMM_BITS(8)
