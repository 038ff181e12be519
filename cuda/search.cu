// search.cu — the static scale search of design.md §4.1 on the device, every part of it: the candidate table
// from W, the Hessian-weighted score of every candidate as GEMMs (two variants, v1 F32 and v2 Bf16Rescore;
// SearchVariant in search.rs), MinMax and Mse, and the chosen grids written into the [rows × n_groups] grids.
// Nothing goes through the host: QuantOps::search_grids and the dynamic-group searches of the GPTQ sweep queue
// these kernels and cuBLAS calls on the backend's stream and return (no download, no synchronization).
//
// CPU twin (the oracle): quant::quantizer (search_candidates for the table, search_grids_rows for the Hessian
//   search, minmax_grid, mse_search), through backend::cpu_quant's search_grids. Parity test:
//   tests/parity_search.rs (the table bit for bit; grids identical but for near-ties of the score, counted and
//   bounded).
//
// ---------------------------------------------------------------------------------------------------------
// Problem layout (search.rs `Batch`). One call searches B = parts·gc problems of R rows × L columns at once:
//   problem b = p·gc + kk is group k0 + kk (columns [(k0 + kk)·g, … + L)) of the rows of part p. Its rows are
//   rows t = b·R + r (r < R) of a gathered W [B·R × L] (search_gather_w_kernel; the dynamic sweep's gathered
//   group is already this layout with B = 1), its H block [L × L] is block b of a stack [B × L × L]
//   (search_gather_h_kernel: H_f[idx_x[a], idx_x[c]] for the group's columns a, c, f = the part's matrix and x
//   its row of the uploaded indices), and
//   its grids go to row p·R + r, column k0 + kk of the output grids [rows × ng] (search_write_grids_kernel).
//   Every per-candidate buffer of a batch of kb candidate slots is problem-major: row q = (b·kb + k)·R + r
//   holds slot c0 + k of row t = b·R + r, so problem b's rows are one [kb·R × L] matrix, and one
//   strided-batched GEMM over the B problems (stride L² in H) multiplies each by its own H block.
//
// search_candidates_kernel: the candidate table of every row t, in slot order (i = 0..99 shrink steps, then
//   floor before ceil zero): scale, 1/scale and zero of slot i·slots + kz (slots = 1 symmetric, 2 asymmetric;
//   NaN zero, scale and 1/scale 1.0 for an absent ceil slot), with the CPU's f32 arithmetic operation for
//   operation: range [min(w,0), max(w,0)] (fminf/fmaxf ignore NaN as Rust's f32::min/max do; symmetric
//   hi = max(hi, |lo|), lo = −hi; all-zero → [−1, 1]), p = (float)(1 − i/100) (an f64 quotient and difference
//   rounded once to f32, as `T::from_f64(shrink(i))`), s = (p·hi − p·lo)/maxq, z = −p·lo/s, floor and ceil
//   (symmetric z = (maxq + 1)/2), 1/s as `T::ONE / scale`: every product, quotient and difference through
//   __fmul_rn / __fdiv_rn / __fsub_rn (never contracted into an FMA), so the table is the CPU's bit for bit.
//   It also resets the row's running best (+inf, −1) and v2's list (kTop × (+inf, −1)): no upload per call.
//   Launch: one warp per row (8 rows per 256-thread CTA, grid-stride), lanes stride the row for the range
//   (warp min/max by xor-shuffle), then stride the 100 steps. Roofline: reads 4 B per element, writes 12 B
//   per slot: 4096 × 4096 at 200 slots ≈ 74 MB ≈ 17 µs at 4.3 TB/s.
//
// search_gather_w_kernel / search_gather_h_kernel: the problems' W rows and H blocks (above). One warp per
//   output row (8 per CTA, grid-stride), lanes stride its L columns (W: coalesced reads; H: row idx[a] of H_f
//   at columns idx[c], scattered within the row when idx is a permutation). Roofline: 8 B per element;
//   W is rows·n ≈ 64 MB at 4096² ≈ 15 µs; the H stack parts·n·g (GPTQ: n·g ≤ n²).
//
// v1 (F32): score = Δ H Δᵀ − wᵀHw = s²·vᵀHv − 2s·vᵀ(Hw), with v = clamp(round(w·(1/s)), −z, maxq − z) the
//   integer vector of the candidate (small integers, exact in f32). HW = W·H once per problem (cuBLAS SGEMM,
//   strided-batched), then per batch of kb slots:
//   search_v_kernel    V = the candidates' integer vectors (problem-major, above);
//   cuBLAS SGEMM       P = V·H (f32, CUBLAS_DEFAULT_MATH: no TF32), strided-batched over the problems;
//   search_score_kernel per row: a = Σ_j P·V, b = Σ_j V·HW in f64 (the CPU twin also keeps f64 a, b over f32
//                      u = Hv), score = s²a − 2sb; the running best (score, slot) of the row, updated only
//                      on a strictly smaller score, in slot order across batches: ties go to the first
//                      candidate in the CPU's order.
//   The scores differ from the CPU's incremental ones only in summation order, so near-ties (within f32
//   rounding of wᵀHw) may pick another grid of (almost) equal error.
//   search_v_kernel: one warp per (slot, row) pair q (8 per CTA, grid-stride over B·kb·R pairs), lanes stride
//   the L columns; x·inv is one rounded product as the CPU's `(x * inv).round_to_i32()`; rint(NaN) → 0 as the
//   CPU's saturating `as i32`; an absent slot (NaN zero) writes zeros, never scored.
//   search_score_kernel: one warp per row t (8 rows per 256-thread CTA, grid ⌈B·R/8⌉); the warp walks the kb
//   slots in order, lanes stride the L columns (coalesced 128 B reads of P, V and HW), a warp xor-shuffle
//   reduces a and b in f64, and every lane keeps the same running best, written back by lane 0.
//   Roofline, v1 (asymmetric: 200 slots; f32 FFMA, H200 ~60 TFLOP/s): the GEMMs are 200 · 2·rows·n·L flop
//   (per channel L = n: 7B q/k/v/o_proj (4096 × 4096) 27.5 TFLOP ≈ 0.46 s each; gate/up 74 TFLOP ≈ 1.2 s;
//   down_proj 199 TFLOP ≈ 3.3 s: ~7.6 s per layer; with groups of 128, L = 128, 32–86× less). GEMM-bound.
//
// v2 (Bf16Rescore, the default): score Δ H Δᵀ itself rather than s²·vᵀHv − 2s·vᵀHw. The latter drops wᵀHw,
//   100–1000× larger than Δ H Δᵀ at 2–4 bits, so bf16 operands (u = 2⁻⁹) on it would leave errors ~1e-3·wᵀHw,
//   larger than the differences between candidates (catastrophic cancellation). With Δ = ŵ − w the bf16
//   rounding of Δ and H is relative to Δ H Δᵀ itself (~2⁻⁸; ≤ 9e-3 seen in the emulation). Per call: the H
//   stack → bf16 once (ops.cu f32_to_bf16); per batch of kb slots:
//     search_delta_bf16_kernel  D bf16, D = fl(fl(s·v) − w);
//     cublasGemmStridedBatchedEx P = D·H (bf16 operands, f32 accumulate and output, tensor cores);
//     search_approx_kernel      per row: approx = Σ P·D (f32), folded into the row's kTop = 4 best;
//   then per batch of the kTop ranks (the exact re-score, f32 throughout):
//     search_delta_f32_kernel   D of the listed slots; cuBLAS SGEMM (strided-batched) P = D·H;
//     search_rescore_kernel     per row: Σ P·D in f64, the least (score, slot) of the row's list.
//   The result is the exact minimum over the row's 4 best approximate candidates; profiling/
//   emulate_search_bf16.py (numpy, realistic W and H, n = 512–2048, 2–4 bits, seeds 1 and 2) found the optimum
//   at rank 0 in 278 and rank 1 in 2 of 280 rows, so v2 chose the optimum in all (v1: also all). Without the
//   re-score (approximate argmin) those 2 rows were 1.1e-3 and 4.6e-4 above the optimum.
//   Roofline (H200, bf16 dense 989 TFLOP/s, ~60% reachable by cuBLAS at these shapes): the approximate GEMMs
//   are v1's 460 TFLOP per 7B layer (per channel) at ~600 TFLOP/s ≈ 0.77 s (asymmetric; 0.38 s symmetric,
//   100 slots), the re-score 4/200 of v1's f32 work ≈ 9 TFLOP ≈ 0.15 s, the elementwise kernels ~6 B per
//   element per slot ≈ 120 GB ≈ 25 ms: ~0.5–0.9 s per layer against v1's ~7.6 s. With groups of 128 the GEMMs
//   shrink by n/128 and the elementwise passes (the same bytes) bound it: ~25–50 ms per layer. Next: fuse the
//   Σ P·D into a GEMM epilogue (P never written: −4 B per element per slot) and re-score with split-bf16 GEMMs
//   instead of SGEMM.
//
// search_write_grids_kernel: the best slot of every row t → (scale, zero) from the table into the grids at
//   (p·R + r, k0 + kk); a row without one (no finite score: NaN weights) gets (0, 0), Grid::default() as the
//   CPU search leaves it. One thread per row (256 per CTA, grid-stride); O(rows) bytes.
//
// search_minmax_kernel (ScaleSearch::MinMax): the min-max grid of every row t (minmax_grid: s = (hi − lo)/maxq,
//   z = round_half_even(−lo/s), symmetric (maxq + 1)/2) written straight into the grids. One warp per row.
//   Roofline: one read of W, ~15 µs at 4096².
// search_mse_kernel (ScaleSearch::Mse): every candidate of the row scored Σ_j |ŵ_j − w_j|^2.4 in f64 with the
//   quantizer's own rounding (q = clamp(rint(w/s) + z, 0, maxq), ŵ = s·(q − z), w/s a true quotient as
//   `quantize` computes it), the least error winning, the first slot among equal ones. One warp per row, each
//   lane scores slots lane, lane + 32, … over the row's columns in column order (so each candidate's sum
//   rounds in the CPU's order; only CUDA's pow, ≤ 2 ulp, differs from the host's libm), then a warp argmin by
//   (error, slot). Roofline: slots·rows·L double pows (~100 FP64 instructions each): 200 slots of 4096² ≈
//   3.4e9 pows ≈ 10–50 ms on an H200's ~34 TFLOP/s FP64; Mse is no default search.
//
// Variants measured (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`), 3-bit
//   asymmetric per channel, Hessian search, TFLOP/s in the GEMM form: 4096 × 4096 v1 564.963 ms (48.9 TFLOP/s;
//   predicted ≈ 0.46 s), v2 66.156 ms (423.8 TFLOP/s; ~600 TFLOP/s predicted for its bf16 GEMMs), 0 rows
//   differ from v1; through QuantOps::search_grids (v2 in use) 65.76 ms wall. 11008 × 4096: v1 1477.967 ms
//   (predicted ≈ 1.2 s), v2 179.315 ms, 2 rows ≠ v1. 4096 × 11008: v1 4031.031 ms (predicted ≈ 3.3 s), v2
//   415.849 ms (487 TFLOP/s), 0 rows ≠ v1. Correct on an H200 (parity tests, 2026-12-04: tests/parity_search.rs
//   passed).
// ptxas (nvcc 13.0, sm_90a / sm_80), 0 spills, 0 stack, no smem: search_gather_w 19 / 18 registers;
//   search_gather_h 25 / 20; search_candidates 48 / 46; search_v 32 / 32; search_score 40 / 40;
//   search_delta_bf16 32 / 32; search_delta_f32 32 / 32; search_approx 32 / 32; search_rescore 32 / 32;
//   search_write_grids 21 / 16; search_minmax 25 / 23; search_mse 48 / 46.
// ---------------------------------------------------------------------------------------------------------

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;  // every kernel here: threads per CTA; must match SEARCH_THREADS in search.rs
constexpr int kWarpsPerCta = kThreads / kWarpSize;
constexpr int kTop = 4;  // v2: approximate best slots re-scored per row; must match SEARCH_TOP in search.rs
constexpr uint32_t kShrinkSteps = 100;  // must match quant::quantizer::SHRINK_STEPS

// --- device helpers ---------------------------------------------------------------------------------------

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ void store_as(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_as(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x % kWarpSize; }
__device__ __forceinline__ uint32_t warp_global() { return blockIdx.x * kWarpsPerCta + threadIdx.x / kWarpSize; }
__device__ __forceinline__ uint32_t warps_total() { return gridDim.x * kWarpsPerCta; }

// The search range of a row (quantizer.rs `range`), the same in every lane of the warp. min and max are
// associative (NaN ignored by fminf/fmaxf as by Rust's f32::min/max), so the lanes' order does not matter.
__device__ __forceinline__ void row_range(const float* __restrict__ w_gl, const uint32_t L, const bool sym,
                                          float* lo_out, float* hi_out) {
    float lo = 0.0f, hi = 0.0f;
    for (uint32_t j = lane_id(); j < L; j += kWarpSize) {
        const float x = w_gl[j];
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (sym) {
        hi = fmaxf(hi, fabsf(lo));
        lo = -hi;
    }
    if (lo == 0.0f && hi == 0.0f) {
        lo = -1.0f;
        hi = 1.0f;
    }
    *lo_out = lo;
    *hi_out = hi;
}

// Candidate slot kz (0 floor, 1 ceil) of shrink step i (quantizer.rs `candidates`): false when absent (the
// ceil slot of a step where floor = ceil). p = (float)(1 − i/100): the f64 quotient and difference are IEEE
// operations on the device (no contraction possible), rounded once to f32 as `T::from_f64(shrink(i))`.
__device__ __forceinline__ bool candidate(const float lo, const float hi, const uint32_t i, const uint32_t kz,
                                          const float maxq, const bool sym, float* scale, float* zero) {
    const float p = (float)(1.0 - (double)i / (double)kShrinkSteps);
    const float l = __fmul_rn(p, lo);
    const float h = __fmul_rn(p, hi);
    const float s = __fdiv_rn(__fsub_rn(h, l), maxq);
    *scale = s;
    if (sym) {
        *zero = __fdiv_rn(__fadd_rn(maxq, 1.0f), 2.0f);
        return kz == 0;
    }
    const float z = __fdiv_rn(-l, s);
    const float zf = floorf(z), zc = ceilf(z);
    *zero = kz == 0 ? zf : zc;
    return kz == 0 || zf != zc;
}

// Where row t of a batch goes in the grids [rows × ng]: row p·R + r, column k0 + kk of problem b = p·gc + kk.
__device__ __forceinline__ size_t grid_index(const uint32_t t, const uint32_t R, const uint32_t gc,
                                             const uint32_t k0, const uint32_t ng) {
    const uint32_t b = t / R, r = t % R;
    const uint32_t p = b / gc, kk = b % gc;
    return ((size_t)p * R + r) * ng + k0 + kk;
}

// The integer vector entry v_j = clamp(rint(x·inv), −z, maxq − z) of a present slot.
__device__ __forceinline__ float cand_v(const float x, const float inv, const float z, const float maxq) {
    float rho = rintf(__fmul_rn(x, inv));
    if (isnan(rho)) rho = 0.0f;
    return fminf(fmaxf(rho, -z), maxq - z);
}

// v2's Δ of one candidate: D[j] = fl(fl(s·v_j) − w_j). fl(s·v) is the quantizer's dequantized ŵ = s·(q − z)
// (q − z = v exactly), so D is ŵ − w with one more rounding (the subtraction, ≤ 2⁻²⁴ relative), far under the
// bf16 rounding of the approximate pass. An absent slot (NaN zero, or !present) writes zeros, never scored.
template <typename T>
__device__ __forceinline__ void delta_row(T* __restrict__ d_gl, const float* __restrict__ w_gl, const float s,
                                          const float inv, const float z, const uint32_t L, const float maxq) {
    for (uint32_t j = lane_id(); j < L; j += kWarpSize) {
        float dj = 0.0f;
        if (!isnan(z)) {
            const float x = w_gl[j];
            dj = __fsub_rn(__fmul_rn(s, cand_v(x, inv, z, maxq)), x);
        }
        store_as(d_gl + j, dj);
    }
}

// Decodes a (slot, row) pair q = (b·kb + k)·R + r of a batch into (k, t = b·R + r).
__device__ __forceinline__ void pair_of(const uint32_t q, const uint32_t R, const uint32_t kb, uint32_t* k,
                                        uint32_t* t) {
    const uint32_t b = q / (kb * R);
    const uint32_t rem = q % (kb * R);
    *k = rem / R;
    *t = b * R + rem % R;
}

// --- gathers and the candidate table ----------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kThreads)
search_gather_w_kernel(float* __restrict__ out,      // [B·R × L] the problems' rows
                       const float* __restrict__ w,  // [rows × n]
                       const uint32_t n,
                       const uint32_t g,             // group width (column stride between groups)
                       const uint32_t R,             // rows per problem (per part)
                       const uint32_t L,             // columns per problem (≤ g)
                       const uint32_t gc,            // groups per part in this batch
                       const uint32_t k0,            // first group of the batch
                       const uint32_t rows_out) {    // B·R
    for (uint32_t t = warp_global(); t < rows_out; t += warps_total()) {
        const uint32_t b = t / R, r = t % R;
        const uint32_t p = b / gc, kk = b % gc;
        const float* src = w + ((size_t)p * R + r) * n + (size_t)(k0 + kk) * g;
        float* dst = out + (size_t)t * L;
        for (uint32_t j = lane_id(); j < L; j += kWarpSize) dst[j] = src[j];
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_gather_h_kernel(float* __restrict__ out,             // [parts·gc × L × L] the problems' H blocks
                       const float* __restrict__ h,         // [batch × n × n] the Hessians
                       const uint32_t* __restrict__ idx,    // [n_idx × n] column indices
                       const uint32_t* __restrict__ f_of,   // [parts] matrix of each part (< batch)
                       const uint32_t* __restrict__ x_of,   // [parts] its row of idx (< n_idx)
                       const uint32_t n,
                       const uint32_t g,
                       const uint32_t L,
                       const uint32_t gc,
                       const uint32_t k0,
                       const uint32_t rows_out) {           // parts·gc·L
    for (uint32_t t = warp_global(); t < rows_out; t += warps_total()) {
        const uint32_t b = t / L, a = t % L;
        const uint32_t p = b / gc, kk = b % gc;
        const uint32_t f = f_of[p];
        const uint32_t* ix = idx + (size_t)x_of[p] * n + (size_t)(k0 + kk) * g;
        const float* src = h + (size_t)f * n * n + (size_t)ix[a] * n;
        float* dst = out + (size_t)t * L;
        for (uint32_t c = lane_id(); c < L; c += kWarpSize) dst[c] = src[ix[c]];
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_candidates_kernel(float* __restrict__ cand_scale,   // [rows × n_slots] out
                         float* __restrict__ cand_inv,     // [rows × n_slots] out: 1/scale
                         float* __restrict__ cand_zero,    // [rows × n_slots] out: NaN = absent slot
                         double* __restrict__ best_score,  // [rows] out: +inf
                         int32_t* __restrict__ best_slot,  // [rows] out: −1
                         float* __restrict__ top_score,    // [rows × kTop] out: +inf
                         int32_t* __restrict__ top_slot,   // [rows × kTop] out: −1
                         const float* __restrict__ w,      // [rows × L]
                         const uint32_t rows,
                         const uint32_t L,
                         const float maxq,
                         const uint32_t sym) {
    const uint32_t slots = sym ? 1 : 2;
    const uint32_t n_slots = kShrinkSteps * slots;
    for (uint32_t t = warp_global(); t < rows; t += warps_total()) {
        float lo, hi;
        row_range(w + (size_t)t * L, L, sym != 0, &lo, &hi);
        for (uint32_t s = lane_id(); s < n_slots; s += kWarpSize) {
            float scale, zero;
            const bool present = candidate(lo, hi, s / slots, s % slots, maxq, sym != 0, &scale, &zero);
            const size_t c = (size_t)t * n_slots + s;
            cand_scale[c] = present ? scale : 1.0f;
            cand_inv[c] = present ? __fdiv_rn(1.0f, scale) : 1.0f;
            cand_zero[c] = present ? zero : NAN;
        }
        if (lane_id() == 0) {
            best_score[t] = INFINITY;
            best_slot[t] = -1;
        }
        if (lane_id() < kTop) {
            top_score[(size_t)t * kTop + lane_id()] = INFINITY;
            top_slot[(size_t)t * kTop + lane_id()] = -1;
        }
    }
}

// --- v1 (F32) kernels -------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kThreads)
search_v_kernel(float* __restrict__ v,                // [B·kb·R × L] out: candidate integer vectors
                const float* __restrict__ w,          // [B·R × L]
                const float* __restrict__ cand_inv,   // [B·R × n_slots]
                const float* __restrict__ cand_zero,  // [B·R × n_slots] NaN = absent slot
                const uint32_t R,
                const uint32_t L,
                const uint32_t n_slots,
                const uint32_t c0,                    // first slot of this batch
                const uint32_t k_batch,               // slots in this batch (c0 + k_batch ≤ n_slots)
                const uint32_t pairs,                 // B·k_batch·R
                const float maxq) {
    for (uint32_t q = warp_global(); q < pairs; q += warps_total()) {
        uint32_t k, t;
        pair_of(q, R, k_batch, &k, &t);
        const size_t c = (size_t)t * n_slots + c0 + k;
        const float z = cand_zero[c];
        const float inv = cand_inv[c];
        const float* w_gl = w + (size_t)t * L;
        float* v_gl = v + (size_t)q * L;
        for (uint32_t j = lane_id(); j < L; j += kWarpSize) v_gl[j] = isnan(z) ? 0.0f : cand_v(w_gl[j], inv, z, maxq);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_score_kernel(double* __restrict__ best_score,       // [B·R] in/out: best score so far
                    int32_t* __restrict__ best_slot,       // [B·R] in/out: its slot
                    const float* __restrict__ p,           // [B·kb·R × L] P = V·H
                    const float* __restrict__ v,           // [B·kb·R × L] V (search_v_kernel)
                    const float* __restrict__ hw,          // [B·R × L] HW = W·H
                    const float* __restrict__ cand_scale,  // [B·R × n_slots]
                    const float* __restrict__ cand_zero,   // [B·R × n_slots] NaN = absent slot
                    const uint32_t rows,                   // B·R
                    const uint32_t R,
                    const uint32_t L,
                    const uint32_t n_slots,
                    const uint32_t c0,
                    const uint32_t k_batch) {
    const uint32_t lane = lane_id();
    const uint32_t t = warp_global();
    if (t >= rows) return;  // whole warps leave together: the shuffles below see full warps
    const uint32_t b = t / R, r = t % R;
    double best = best_score[t];
    int32_t slot = best_slot[t];
    const float* hw_gl = hw + (size_t)t * L;
    for (uint32_t k = 0; k < k_batch; ++k) {
        const size_t c = (size_t)t * n_slots + c0 + k;
        const float z = cand_zero[c];
        if (isnan(z)) continue;  // absent slot (uniform across the warp)
        const size_t row_gl = (((size_t)b * k_batch + k) * R + r) * L;
        double a = 0.0, bb = 0.0;
        for (uint32_t j = lane; j < L; j += kWarpSize) {
            const double vj = (double)v[row_gl + j];
            a += (double)p[row_gl + j] * vj;  // exact products (24 + 24 bits); the sums round as the CPU's
            bb += (double)hw_gl[j] * vj;
        }
        a = warp_sum(a);
        bb = warp_sum(bb);
        const double s = (double)cand_scale[c];
        // s·s·a − 2·s·b rounded as the CPU's `s * s * a - 2.0 * s * b` (no contraction).
        const double score = __dsub_rn(__dmul_rn(__dmul_rn(s, s), a), __dmul_rn(__dmul_rn(2.0, s), bb));
        if (score < best) {  // strict: the first of equal scores (slot order) wins; NaN never does
            best = score;
            slot = (int32_t)(c0 + k);
        }
    }
    if (lane == 0) {
        best_score[t] = best;
        best_slot[t] = slot;
    }
}

// --- v2 (Bf16Rescore) kernels -----------------------------------------------------------------------------
// search_delta_bf16_kernel: D (bf16) of slot c0 + k of every row (problem-major), the operand of the
//   approximate GEMM P = D·H (cublasGemmStridedBatchedEx, bf16 D and H, f32 accumulate and output).
// search_delta_f32_kernel: D (f32) of the slot at rank c0 + k of row t's approximate best list
//   (top_slot[t·kTop + c0 + k]; −1 = none: zeros), the operand of the exact re-score SGEMM P = D·H.
//   Both: one warp per (slot, row) pair (8 per CTA, grid-stride), lanes stride the L columns; bandwidth-bound
//   (read W row, write D: 6–8 B per element, ~1 ms per slot pass of a 4096 × 11008 matrix at 4.3 TB/s,
//   against ~9 ms of bf16 GEMM per slot at 600 TFLOP/s when L = n).

extern "C" __global__ void __launch_bounds__(kThreads)
search_delta_bf16_kernel(__nv_bfloat16* __restrict__ d,        // [B·kb·R × L] out
                         const float* __restrict__ w,          // [B·R × L]
                         const float* __restrict__ cand_scale, // [B·R × n_slots]
                         const float* __restrict__ cand_inv,   // [B·R × n_slots]
                         const float* __restrict__ cand_zero,  // [B·R × n_slots] NaN = absent slot
                         const uint32_t R,
                         const uint32_t L,
                         const uint32_t n_slots,
                         const uint32_t c0,                    // first slot of this batch
                         const uint32_t k_batch,               // c0 + k_batch ≤ n_slots
                         const uint32_t pairs,                 // B·k_batch·R
                         const float maxq) {
    for (uint32_t q = warp_global(); q < pairs; q += warps_total()) {
        uint32_t k, t;
        pair_of(q, R, k_batch, &k, &t);
        const size_t c = (size_t)t * n_slots + c0 + k;
        delta_row(d + (size_t)q * L, w + (size_t)t * L, cand_scale[c], cand_inv[c], cand_zero[c], L, maxq);
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_delta_f32_kernel(float* __restrict__ d,                 // [B·kb·R × L] out: f32 Δ of each rank
                        const float* __restrict__ w,           // [B·R × L]
                        const float* __restrict__ cand_scale,  // [B·R × n_slots]
                        const float* __restrict__ cand_inv,    // [B·R × n_slots]
                        const float* __restrict__ cand_zero,   // [B·R × n_slots] NaN = absent slot
                        const int32_t* __restrict__ top_slot,  // [B·R × kTop] slots, −1 = none
                        const uint32_t R,
                        const uint32_t L,
                        const uint32_t n_slots,
                        const uint32_t c0,                     // first rank of this batch
                        const uint32_t k_batch,                // c0 + k_batch ≤ kTop
                        const uint32_t pairs,                  // B·k_batch·R
                        const float maxq) {
    for (uint32_t q = warp_global(); q < pairs; q += warps_total()) {
        uint32_t k, t;
        pair_of(q, R, k_batch, &k, &t);
        const int32_t s = top_slot[(size_t)t * kTop + c0 + k];
        const bool present = s >= 0 && (uint32_t)s < n_slots;
        const size_t c = (size_t)t * n_slots + (present ? (uint32_t)s : 0);
        delta_row(d + (size_t)q * L, w + (size_t)t * L, present ? cand_scale[c] : 0.0f,
                  present ? cand_inv[c] : 0.0f, present ? cand_zero[c] : NAN, L, maxq);
    }
}

// search_approx_kernel: approx = Σ_j P·D (= D H Δᵀ up to bf16 rounding of D and H: ~2⁻⁸ relative, not
//   amplified by wᵀHw as v1's dropped-constant score would be) of slots c0..c0 + k_batch, folded into each
//   row's list of the kTop least approximate scores (ascending; strictly smaller enters, so of equal scores
//   the earlier slot stays). Lists carry across batches (search_candidates_kernel resets them).
//   Launch: one warp per row (8 rows per 256-thread CTA, grid ⌈B·R/8⌉), lanes stride the L columns
//   (coalesced reads of P and D), a f32 xor-shuffle sum (the approximate score needs no f64), every lane keeps
//   the same list in registers (kTop constant, unrolled: no local memory), lane 0 writes it back.
//   Roofline: reads 6 B per element per slot (P f32 + D bf16): 200 slots of 4096 × 11008 ≈ 54 GB ≈ 13 ms at
//   4.3 TB/s, against ~0.3 s of bf16 GEMM for the same slots per channel.
extern "C" __global__ void __launch_bounds__(kThreads)
search_approx_kernel(float* __restrict__ top_score,        // [B·R × kTop] in/out, ascending (+inf = empty)
                     int32_t* __restrict__ top_slot,       // [B·R × kTop] in/out (−1 = empty)
                     const float* __restrict__ p,          // [B·kb·R × L] P = D·H
                     const __nv_bfloat16* __restrict__ d,  // [B·kb·R × L] D (search_delta_bf16_kernel)
                     const float* __restrict__ cand_zero,  // [B·R × n_slots] NaN = absent slot
                     const uint32_t rows,                  // B·R
                     const uint32_t R,
                     const uint32_t L,
                     const uint32_t n_slots,
                     const uint32_t c0,
                     const uint32_t k_batch) {
    const uint32_t lane = lane_id();
    const uint32_t t = warp_global();
    if (t >= rows) return;  // whole warps leave together: the shuffles below see full warps
    const uint32_t b = t / R, r = t % R;
    float ts[kTop];
    int32_t tc[kTop];
#pragma unroll
    for (int i = 0; i < kTop; ++i) {
        ts[i] = top_score[(size_t)t * kTop + i];
        tc[i] = top_slot[(size_t)t * kTop + i];
    }
    for (uint32_t k = 0; k < k_batch; ++k) {
        if (isnan(cand_zero[(size_t)t * n_slots + c0 + k])) continue;  // absent slot (uniform across the warp)
        const size_t row_gl = (((size_t)b * k_batch + k) * R + r) * L;
        float a = 0.0f;
        for (uint32_t j = lane; j < L; j += kWarpSize) a = fmaf(p[row_gl + j], __bfloat162float(d[row_gl + j]), a);
        float sc = warp_sum(a);
        if (sc < ts[kTop - 1]) {  // NaN never enters
            int32_t cs = (int32_t)(c0 + k);
            // Bubble the new entry in from the front: constant indices keep ts/tc in registers.
#pragma unroll
            for (int i = 0; i < kTop; ++i) {
                if (sc < ts[i]) {
                    const float t_s = ts[i];
                    const int32_t t_c = tc[i];
                    ts[i] = sc;
                    tc[i] = cs;
                    sc = t_s;
                    cs = t_c;
                }
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < kTop; ++i) {
            top_score[(size_t)t * kTop + i] = ts[i];
            top_slot[(size_t)t * kTop + i] = tc[i];
        }
    }
}

// search_rescore_kernel: the exact score Δ H Δᵀ = Σ_j P·D in f64 (P = D·H from an f32 SGEMM over f32 D: ~2⁻²⁴
//   relative, no cancellation) of ranks c0..c0 + k_batch of each row's list, folded into the row's best
//   (score, slot): the least score wins, and of equal scores the lower slot, the CPU's first-in-order tie-break
//   among the re-scored slots (the ranks are not in slot order, hence the explicit comparison).
//   Launch: as search_score_kernel (one warp per row, 8 rows per 256-thread CTA, grid ⌈B·R/8⌉); reads 8 B per
//   element per rank: kTop = 4 ranks of 4096 × 11008 ≈ 1.4 GB ≈ 0.3 ms, beside ~30 ms of SGEMM per channel.
extern "C" __global__ void __launch_bounds__(kThreads)
search_rescore_kernel(double* __restrict__ best_score,       // [B·R] in/out: best exact score
                      int32_t* __restrict__ best_slot,       // [B·R] in/out: its slot
                      const float* __restrict__ p,           // [B·kb·R × L] P = D·H
                      const float* __restrict__ d,           // [B·kb·R × L] D (search_delta_f32_kernel)
                      const int32_t* __restrict__ top_slot,  // [B·R × kTop] slots, −1 = none
                      const uint32_t rows,                   // B·R
                      const uint32_t R,
                      const uint32_t L,
                      const uint32_t c0,                     // first rank of this batch
                      const uint32_t k_batch) {              // c0 + k_batch ≤ kTop
    const uint32_t lane = lane_id();
    const uint32_t t = warp_global();
    if (t >= rows) return;  // whole warps leave together
    const uint32_t b = t / R, r = t % R;
    double best = best_score[t];
    int32_t slot = best_slot[t];
    for (uint32_t k = 0; k < k_batch; ++k) {
        const int32_t c = top_slot[(size_t)t * kTop + c0 + k];
        if (c < 0) continue;  // a row with fewer than kTop finite scores (uniform across the warp)
        const size_t row_gl = (((size_t)b * k_batch + k) * R + r) * L;
        double e = 0.0;
        for (uint32_t j = lane; j < L; j += kWarpSize) e += (double)p[row_gl + j] * (double)d[row_gl + j];
        e = warp_sum(e);
        if (e < best || (e == best && c < slot)) {  // NaN never wins
            best = e;
            slot = c;
        }
    }
    if (lane == 0) {
        best_score[t] = best;
        best_slot[t] = slot;
    }
}

// --- the grids --------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kThreads)
search_write_grids_kernel(float* __restrict__ scale_out,          // [rows_total × ng] in/out: column k0 + kk
                          float* __restrict__ zero_out,           // [rows_total × ng]
                          const float* __restrict__ cand_scale,   // [B·R × n_slots]
                          const float* __restrict__ cand_zero,    // [B·R × n_slots]
                          const int32_t* __restrict__ best_slot,  // [B·R] −1 = none
                          const uint32_t rows,                    // B·R
                          const uint32_t R,
                          const uint32_t n_slots,
                          const uint32_t gc,
                          const uint32_t k0,
                          const uint32_t ng) {
    for (uint32_t t = blockIdx.x * kThreads + threadIdx.x; t < rows; t += gridDim.x * kThreads) {
        const int32_t s = best_slot[t];
        const bool ok = s >= 0 && (uint32_t)s < n_slots;
        const size_t c = (size_t)t * n_slots + (ok ? (uint32_t)s : 0);
        const size_t o = grid_index(t, R, gc, k0, ng);
        scale_out[o] = ok ? cand_scale[c] : 0.0f;
        zero_out[o] = ok ? cand_zero[c] : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_minmax_kernel(float* __restrict__ scale_out,  // [rows_total × ng] in/out: column k0 + kk
                     float* __restrict__ zero_out,   // [rows_total × ng]
                     const float* __restrict__ w,    // [B·R × L]
                     const uint32_t rows,            // B·R
                     const uint32_t R,
                     const uint32_t L,
                     const uint32_t gc,
                     const uint32_t k0,
                     const uint32_t ng,
                     const float maxq,
                     const uint32_t sym) {
    for (uint32_t t = warp_global(); t < rows; t += warps_total()) {
        float lo, hi;
        row_range(w + (size_t)t * L, L, sym != 0, &lo, &hi);
        if (lane_id() == 0) {
            const float s = __fdiv_rn(__fsub_rn(hi, lo), maxq);
            const float z = sym ? __fdiv_rn(__fadd_rn(maxq, 1.0f), 2.0f) : rintf(__fdiv_rn(-lo, s));
            const size_t o = grid_index(t, R, gc, k0, ng);
            scale_out[o] = s;
            zero_out[o] = z;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kThreads)
search_mse_kernel(float* __restrict__ scale_out,  // [rows_total × ng] in/out: column k0 + kk
                  float* __restrict__ zero_out,   // [rows_total × ng]
                  const float* __restrict__ w,    // [B·R × L]
                  const uint32_t rows,            // B·R
                  const uint32_t R,
                  const uint32_t L,
                  const uint32_t gc,
                  const uint32_t k0,
                  const uint32_t ng,
                  const float maxq,
                  const uint32_t sym,
                  const double norm) {            // quant::quantizer::MSE_NORM
    const uint32_t slots = sym ? 1 : 2;
    const uint32_t n_slots = kShrinkSteps * slots;
    for (uint32_t t = warp_global(); t < rows; t += warps_total()) {
        const float* w_gl = w + (size_t)t * L;
        float lo, hi;
        row_range(w_gl, L, sym != 0, &lo, &hi);
        double best = INFINITY;
        int32_t slot = -1;
        for (uint32_t s = lane_id(); s < n_slots; s += kWarpSize) {
            float scale, zero;
            if (!candidate(lo, hi, s / slots, s % slots, maxq, sym != 0, &scale, &zero)) continue;
            double err = 0.0;
            for (uint32_t j = 0; j < L; ++j) {  // column order: the CPU's summation order
                const float x = w_gl[j];
                const float q = fminf(fmaxf(__fadd_rn(rintf(__fdiv_rn(x, scale)), zero), 0.0f), maxq);
                const float dq = __fsub_rn(__fmul_rn(scale, __fsub_rn(q, zero)), x);
                err = __dadd_rn(err, pow(fabs((double)dq), norm));
            }
            if (err < best) {  // lanes walk their slots in order: the lane's first least error stays
                best = err;
                slot = (int32_t)s;
            }
        }
        // Warp argmin by (error, slot): the least error, and of equal errors the first slot (the CPU's strict
        // less in slot order). A NaN or infinite error never entered a lane's best.
#pragma unroll
        for (int o = kWarpSize / 2; o > 0; o >>= 1) {
            const double ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int32_t os = __shfl_xor_sync(0xffffffffu, slot, o);
            if (os >= 0 && (slot < 0 || ob < best || (ob == best && os < slot))) {
                best = ob;
                slot = os;
            }
        }
        if (lane_id() == 0) {
            const size_t o = grid_index(t, R, gc, k0, ng);
            float scale = 0.0f, zero = 0.0f;  // Grid::default() when no candidate has a finite error
            if (slot >= 0) candidate(lo, hi, (uint32_t)slot / slots, (uint32_t)slot % slots, maxq, sym != 0, &scale, &zero);
            scale_out[o] = scale;
            zero_out[o] = zero;
        }
    }
}
