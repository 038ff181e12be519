// search.cu — the Hessian-weighted static scale search (design.md §4.1) as GEMMs, two variants (v1 F32, v2
// Bf16Rescore; SearchVariant in search.rs). v1: for every candidate grid
// (shrink step i, zero choice) of every row, score = Δ H Δᵀ − wᵀHw = s²·vᵀHv − 2s·vᵀ(Hw), with
// v = clamp(round(w·(1/s)), −z, maxq − z) the integer vector of the candidate (small integers, exact in f32).
//
// Host flow (CudaBackend::try_search_grids, backend/cuda/search.rs): the candidate table (scale, 1/scale, zero per row
// and slot, the order of quant::quantizer::search_candidates, computed on the host by that very function so
// the candidate set is the CPU's bit for bit) is uploaded; HW = W·H once (cuBLAS SGEMM); then per batch of K
// candidate slots:
//   search_v_kernel    V [K × rows × n] = the candidates' integer vectors;
//   cuBLAS SGEMM       P = V·H  [K·rows × n] (f32, CUBLAS_DEFAULT_MATH: no TF32);
//   search_score_kernel per row: a = Σ_j P·V, b = Σ_j V·HW in f64 (the CPU twin also keeps f64 a, b over f32
//                      u = Hv), score = s²a − 2sb; the running best (score, slot) of the row, updated only
//                      on a strictly smaller score, in slot order across batches: ties go to the first
//                      candidate in the CPU's order.
// CPU twin: quant::quantizer::search_grids_rows (incremental: u = Hv updated entry by entry along the shrink
//   path); the scores differ only in summation order, so near-ties (within f32 rounding) may pick another grid
//   of (almost) equal error. Parity test: parity_search_grids (tests/parity_quant.rs).
//
// ---------------------------------------------------------------------------------------------------------
// v1 kernels:
// search_v_kernel: V[k, r, j] = clamp(rint(W[r, j] · inv[r, c0 + k]), −z, maxq − z), z = zero[r, c0 + k]
//   (a NaN zero marks an absent slot: the ceil zero where floor = ceil; its V is written as 0 and never
//   scored). rint(NaN) → 0 as the CPU's saturating `as i32` does. x·inv is one rounded product, as the CPU's
//   `(x * inv).round_to_i32()`.
//   Launch: 256 threads, grid min(K·rows, 2²⁰) striding over the (slot, row) pairs t = k·rows + r (K·rows <
//   2³², checked by the launcher); each CTA writes row t of V, threads striding its n columns.
//
// search_score_kernel: one warp per row (8 rows per 256-thread CTA, grid ⌈rows/8⌉); the warp walks the K
//   slots of the batch in order, lanes stride the n columns (coalesced 128 B reads of P, V and HW), a warp
//   xor-shuffle reduces a and b in f64, and every lane keeps the same running best, written back by lane 0.
//   best_score / best_slot carry the best across batches (the host initialises them to +inf / −1).
//
// Roofline, v1 (asymmetric: 200 slots; f32 FFMA, H200 ~60 TFLOP/s): the GEMMs are 200 · 2·rows·n² flop:
//   7B q/k/v/o_proj (4096 × 4096) 27.5 TFLOP ≈ 0.46 s each; gate/up (11008 × 4096) 74 TFLOP ≈ 1.2 s; down_proj
//   (4096 × 11008) 199 TFLOP ≈ 3.3 s → ~460 TFLOP ≈ 7.6 s per layer, ~4 min per 7B model: GEMM-bound (bytes per
//   slot ≈ 5 passes over rows·n f32 ≈ 336 MB at 4096², 67 GB per matrix ≈ 14 ms at 4.8 TB/s). That is far
//   more arithmetic than the CPU twin's incremental search (~3.5 H-row axpys per entry: ~rows·n²·7 flop, 50×
//   fewer), so the GEMM form wins only through the matrix units.
//
// v2 (Bf16Rescore, the default): score Δ H Δᵀ itself rather than s²·vᵀHv − 2s·vᵀHw. The latter drops wᵀHw,
//   100–1000× larger than Δ H Δᵀ at 2–4 bits, so bf16 operands (u = 2⁻⁹) on it would leave errors ~1e-3·wᵀHw,
//   larger than the differences between candidates (catastrophic cancellation). With Δ = ŵ − w the bf16
//   rounding of Δ and H is relative to Δ H Δᵀ itself (~2⁻⁸; ≤ 9e-3 seen in the emulation). Per call:
//   H → bf16 once (ops.cu f32_to_bf16); per batch of K slots:
//     search_delta_bf16_kernel  D [K × rows × n] bf16, D = fl(fl(s·v) − w);
//     cublasGemmEx              P = D·H  (bf16 operands, f32 accumulate and output, tensor cores);
//     search_approx_kernel      per row: approx = Σ P·D (f32), folded into the row's kTop = 4 best;
//   then per batch of the kTop ranks (the exact re-score, f32 throughout):
//     search_delta_f32_kernel   D of the listed slots; cuBLAS SGEMM P = D·H;
//     search_rescore_kernel     per row: Σ P·D in f64, the least (score, slot) of the row's list.
//   The result is the exact minimum over the row's 4 best approximate candidates; profiling/
//   emulate_search_bf16.py (numpy, realistic W and H, n = 512–2048, 2–4 bits, seeds 1 and 2) found the optimum
//   at rank 0 in 278 and rank 1 in 2 of 280 rows, so v2 chose the optimum in all (v1: also all). Without the
//   re-score (approximate argmin) those 2 rows were 1.1e-3 and 4.6e-4 above the optimum.
//   Roofline (H200, bf16 dense 989 TFLOP/s, ~60% reachable by cuBLAS at these shapes): the approximate GEMMs
//   are v1's 460 TFLOP per 7B layer at ~600 TFLOP/s ≈ 0.77 s (asymmetric; 0.38 s symmetric, 100 slots), the
//   re-score 4/200 of v1's f32 work ≈ 9 TFLOP ≈ 0.15 s, the elementwise kernels ~6 B per element per slot
//   ≈ 120 GB ≈ 25 ms: ~0.5–0.9 s per layer against v1's ~7.6 s. Next: fuse the Σ P·D into a GEMM epilogue
//   (P never written: −4 B per element per slot) and re-score with split-bf16 GEMMs instead of SGEMM.
// Variants measured: none yet (no GPU run so far).
// ptxas (nvcc 13.0, sm_90a / sm_80), 0 spills, 0 stack, no smem: search_v 25 / 25 registers; search_score
//   32 / 32; search_delta_bf16 25 / 25; search_delta_f32 28 / 28; search_approx 32 / 32; search_rescore 32 / 32.
// ---------------------------------------------------------------------------------------------------------

#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

constexpr int kWarpSize = 32;
constexpr int kVThreads = 256;      // search_v: threads per CTA; must match SEARCH_V_THREADS in search.rs
constexpr int kScoreThreads = 256;  // search_score: threads per CTA; must match SEARCH_SCORE_THREADS
constexpr int kScoreRowsPerCta = kScoreThreads / kWarpSize;
constexpr int kTop = 4;  // v2: approximate best slots re-scored per row; must match SEARCH_TOP in search.rs

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

// v2's Δ of candidate slot c of row r: D[j] = fl(fl(s·v_j) − w_j), v as search_v_kernel. fl(s·v) is the
// quantizer's dequantized ŵ = s·(q − z) (q − z = v exactly), so D is ŵ − w with one more rounding (the
// subtraction, ≤ 2⁻²⁴ relative), far under the bf16 rounding of the approximate pass. Slot c < 0 or a NaN
// zero (absent slot) writes zeros, never scored.
template <typename T>
__device__ __forceinline__ void delta_row(T* __restrict__ d_gl,            // [n] out
                                          const float* __restrict__ w_gl,  // [n]
                                          const float* __restrict__ cand_scale,
                                          const float* __restrict__ cand_inv,
                                          const float* __restrict__ cand_zero,
                                          const size_t c_gl,  // r·n_slots + c, valid when c ≥ 0
                                          const bool present,
                                          const uint32_t n,
                                          const float maxq) {
    const float z = present ? cand_zero[c_gl] : NAN;
    const float s = present ? cand_scale[c_gl] : 0.0f;
    const float inv = present ? cand_inv[c_gl] : 0.0f;
    for (uint32_t j = threadIdx.x; j < n; j += kVThreads) {
        float dj = 0.0f;
        if (!isnan(z)) {
            const float x = w_gl[j];
            float rho = rintf(__fmul_rn(x, inv));
            if (isnan(rho)) rho = 0.0f;
            const float v = fminf(fmaxf(rho, -z), maxq - z);
            dj = __fsub_rn(__fmul_rn(s, v), x);
        }
        store_as(d_gl + j, dj);
    }
}

// --- GPU kernels ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kVThreads)
search_v_kernel(float* __restrict__ v,                // [k_batch × rows × n] out: candidate integer vectors
                const float* __restrict__ w,          // [rows × n] row-major
                const float* __restrict__ cand_inv,   // [rows × n_slots] 1/scale of each candidate slot
                const float* __restrict__ cand_zero,  // [rows × n_slots] zero; NaN = absent slot
                const uint32_t rows,
                const uint32_t n,
                const uint32_t n_slots,               // slots per row (SHRINK_STEPS · 1 or 2)
                const uint32_t c0,                    // first slot of this batch
                const uint32_t k_batch,               // slots in this batch (c0 + k_batch ≤ n_slots)
                const float maxq) {
    // One CTA per (slot, row) pair t = k·rows + r (grid-stride): the candidate is loaded once, the threads
    // stride the row's n columns (coalesced), no 64-bit division per element.
    const uint32_t pairs = k_batch * rows;
    for (uint32_t t = blockIdx.x; t < pairs; t += gridDim.x) {
        const uint32_t r = t % rows;
        const uint32_t k = t / rows;
        const size_t c_gl = (size_t)r * n_slots + c0 + k;
        const float z = cand_zero[c_gl];
        const float inv = cand_inv[c_gl];
        const float* w_gl = w + (size_t)r * n;
        float* v_gl = v + (size_t)t * n;
        for (uint32_t j = threadIdx.x; j < n; j += kVThreads) {
            float q = 0.0f;
            if (!isnan(z)) {
                float rho = rintf(__fmul_rn(w_gl[j], inv));
                if (isnan(rho)) rho = 0.0f;
                q = fminf(fmaxf(rho, -z), maxq - z);
            }
            v_gl[j] = q;
        }
    }
}

extern "C" __global__ void __launch_bounds__(kScoreThreads)
search_score_kernel(double* __restrict__ best_score,    // [rows] in/out: best score so far (+inf at start)
                    int32_t* __restrict__ best_slot,    // [rows] in/out: its slot (−1 at start)
                    const float* __restrict__ p,        // [k_batch × rows × n] P = V·H
                    const float* __restrict__ v,        // [k_batch × rows × n] V (search_v_kernel)
                    const float* __restrict__ hw,       // [rows × n] HW = W·H
                    const float* __restrict__ cand_scale,  // [rows × n_slots]
                    const float* __restrict__ cand_zero,   // [rows × n_slots] NaN = absent slot
                    const uint32_t rows,
                    const uint32_t n,
                    const uint32_t n_slots,
                    const uint32_t c0,
                    const uint32_t k_batch) {
    const uint32_t lane = threadIdx.x % kWarpSize;
    const uint32_t r = blockIdx.x * kScoreRowsPerCta + threadIdx.x / kWarpSize;
    if (r >= rows) return;  // whole warps leave together: the shuffles below see full warps
    double best = best_score[r];
    int32_t slot = best_slot[r];
    const float* hw_gl = hw + (size_t)r * n;
    for (uint32_t k = 0; k < k_batch; ++k) {
        const size_t c_gl = (size_t)r * n_slots + c0 + k;
        const float z = cand_zero[c_gl];
        if (isnan(z)) continue;  // absent slot (uniform across the warp)
        const size_t row_gl = ((size_t)k * rows + r) * n;
        double a = 0.0, b = 0.0;
        for (uint32_t j = lane; j < n; j += kWarpSize) {
            const double vj = (double)v[row_gl + j];
            a += (double)p[row_gl + j] * vj;  // exact products (24 + 24 bits); the sums round as the CPU's
            b += (double)hw_gl[j] * vj;
        }
        a = warp_sum(a);
        b = warp_sum(b);
        const double s = (double)cand_scale[c_gl];
        // s·s·a − 2·s·b rounded as the CPU's `s * s * a - 2.0 * s * b` (no contraction).
        const double score = __dsub_rn(__dmul_rn(__dmul_rn(s, s), a), __dmul_rn(__dmul_rn(2.0, s), b));
        if (score < best) {  // strict: the first of equal scores (slot order) wins; NaN never does
            best = score;
            slot = (int32_t)(c0 + k);
        }
    }
    if (lane == 0) {
        best_score[r] = best;
        best_slot[r] = slot;
    }
}

// --- v2 (Bf16Rescore) kernels --------------------------------------------------------------------------------
// search_delta_bf16_kernel: D[k, r, :] (bf16) of slot c0 + k of every row, the operand of the approximate GEMM
//   P = D·H (cublasGemmEx, bf16 D and H, f32 accumulate and output). Same launch shape as search_v_kernel.
// search_delta_f32_kernel: D[k, r, :] (f32) of the slot at rank c0 + k of row r's approximate best list
//   (top_slot[r·kTop + c0 + k]; −1 = none: zeros), the operand of the exact re-score SGEMM P = D·H.
//   Both: 256 threads, grid min(K·rows, 2²⁰) striding over the (slot, row) pairs; bandwidth-bound (read W
//   row, write D: 6–8 B per element, ~1 ms per slot pass of a 4096 × 11008 matrix at 4.8 TB/s, against ~9 ms
//   of bf16 GEMM per slot at 600 TFLOP/s).

extern "C" __global__ void __launch_bounds__(kVThreads)
search_delta_bf16_kernel(__nv_bfloat16* __restrict__ d,  // [k_batch × rows × n] out: bf16 Δ of each slot
                         const float* __restrict__ w,          // [rows × n] row-major
                         const float* __restrict__ cand_scale, // [rows × n_slots]
                         const float* __restrict__ cand_inv,   // [rows × n_slots]
                         const float* __restrict__ cand_zero,  // [rows × n_slots] NaN = absent slot
                         const uint32_t rows,
                         const uint32_t n,
                         const uint32_t n_slots,
                         const uint32_t c0,                    // first slot of this batch
                         const uint32_t k_batch,               // c0 + k_batch ≤ n_slots
                         const float maxq) {
    const uint32_t pairs = k_batch * rows;
    for (uint32_t t = blockIdx.x; t < pairs; t += gridDim.x) {
        const uint32_t r = t % rows;
        const uint32_t k = t / rows;
        delta_row(d + (size_t)t * n, w + (size_t)r * n, cand_scale, cand_inv, cand_zero,
                  (size_t)r * n_slots + c0 + k, true, n, maxq);
    }
}

extern "C" __global__ void __launch_bounds__(kVThreads)
search_delta_f32_kernel(float* __restrict__ d,                 // [k_batch × rows × n] out: f32 Δ of each rank
                        const float* __restrict__ w,           // [rows × n] row-major
                        const float* __restrict__ cand_scale,  // [rows × n_slots]
                        const float* __restrict__ cand_inv,    // [rows × n_slots]
                        const float* __restrict__ cand_zero,   // [rows × n_slots] NaN = absent slot
                        const int32_t* __restrict__ top_slot,  // [rows × kTop] slots, −1 = none
                        const uint32_t rows,
                        const uint32_t n,
                        const uint32_t n_slots,
                        const uint32_t c0,                     // first rank of this batch
                        const uint32_t k_batch,                // c0 + k_batch ≤ kTop
                        const float maxq) {
    const uint32_t pairs = k_batch * rows;
    for (uint32_t t = blockIdx.x; t < pairs; t += gridDim.x) {
        const uint32_t r = t % rows;
        const uint32_t k = t / rows;
        const int32_t c = top_slot[(size_t)r * kTop + c0 + k];
        const bool present = c >= 0 && (uint32_t)c < n_slots;
        delta_row(d + (size_t)t * n, w + (size_t)r * n, cand_scale, cand_inv, cand_zero,
                  present ? (size_t)r * n_slots + (uint32_t)c : 0, present, n, maxq);
    }
}

// search_approx_kernel: approx = Σ_j P·D (= D H Δᵀ up to bf16 rounding of D and H: ~2⁻⁸ relative, not
//   amplified by wᵀHw as v1's dropped-constant score would be) of slots c0..c0 + k_batch, folded into each
//   row's list of the kTop least approximate scores (ascending; strictly smaller enters, so of equal scores
//   the earlier slot stays). Lists carry across batches (the host initialises them to +inf / −1).
//   Launch: one warp per row (8 rows per 256-thread CTA, grid ⌈rows/8⌉), lanes stride the n columns
//   (coalesced reads of P and D), a f32 xor-shuffle sum (the approximate score needs no f64), every lane keeps
//   the same list in registers (kTop constant, unrolled: no local memory), lane 0 writes it back.
//   Roofline: reads 6 B per element per slot (P f32 + D bf16): 200 slots of 4096 × 11008 ≈ 54 GB ≈ 11 ms at
//   4.8 TB/s, against ~0.3 s of bf16 GEMM for the same slots.
extern "C" __global__ void __launch_bounds__(kScoreThreads)
search_approx_kernel(float* __restrict__ top_score,        // [rows × kTop] in/out, ascending (+inf = empty)
                     int32_t* __restrict__ top_slot,       // [rows × kTop] in/out (−1 = empty)
                     const float* __restrict__ p,          // [k_batch × rows × n] P = D·H
                     const __nv_bfloat16* __restrict__ d,  // [k_batch × rows × n] D (search_delta_bf16_kernel)
                     const float* __restrict__ cand_zero,  // [rows × n_slots] NaN = absent slot
                     const uint32_t rows,
                     const uint32_t n,
                     const uint32_t n_slots,
                     const uint32_t c0,
                     const uint32_t k_batch) {
    const uint32_t lane = threadIdx.x % kWarpSize;
    const uint32_t r = blockIdx.x * kScoreRowsPerCta + threadIdx.x / kWarpSize;
    if (r >= rows) return;  // whole warps leave together: the shuffles below see full warps
    float ts[kTop];
    int32_t tc[kTop];
#pragma unroll
    for (int i = 0; i < kTop; ++i) {
        ts[i] = top_score[(size_t)r * kTop + i];
        tc[i] = top_slot[(size_t)r * kTop + i];
    }
    for (uint32_t k = 0; k < k_batch; ++k) {
        if (isnan(cand_zero[(size_t)r * n_slots + c0 + k])) continue;  // absent slot (uniform across the warp)
        const size_t row_gl = ((size_t)k * rows + r) * n;
        float a = 0.0f;
        for (uint32_t j = lane; j < n; j += kWarpSize) a = fmaf(p[row_gl + j], __bfloat162float(d[row_gl + j]), a);
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
            top_score[(size_t)r * kTop + i] = ts[i];
            top_slot[(size_t)r * kTop + i] = tc[i];
        }
    }
}

// search_rescore_kernel: the exact score Δ H Δᵀ = Σ_j P·D in f64 (P = D·H from an f32 SGEMM over f32 D: ~2⁻²⁴
//   relative, no cancellation) of ranks c0..c0 + k_batch of each row's list, folded into the row's best
//   (score, slot): the least score wins, and of equal scores the lower slot, the CPU's first-in-order tie-break
//   among the re-scored slots (the ranks are not in slot order, hence the explicit comparison).
//   Launch: as search_score_kernel (one warp per row, 8 rows per 256-thread CTA, grid ⌈rows/8⌉); reads 8 B per
//   element per rank: kTop = 4 ranks of 4096 × 11008 ≈ 1.4 GB ≈ 0.3 ms, beside ~30 ms of SGEMM.
extern "C" __global__ void __launch_bounds__(kScoreThreads)
search_rescore_kernel(double* __restrict__ best_score,       // [rows] in/out: best exact score (+inf at start)
                      int32_t* __restrict__ best_slot,       // [rows] in/out: its slot (−1 at start)
                      const float* __restrict__ p,           // [k_batch × rows × n] P = D·H
                      const float* __restrict__ d,           // [k_batch × rows × n] D (search_delta_f32_kernel)
                      const int32_t* __restrict__ top_slot,  // [rows × kTop] slots, −1 = none
                      const uint32_t rows,
                      const uint32_t n,
                      const uint32_t c0,                     // first rank of this batch
                      const uint32_t k_batch) {              // c0 + k_batch ≤ kTop
    const uint32_t lane = threadIdx.x % kWarpSize;
    const uint32_t r = blockIdx.x * kScoreRowsPerCta + threadIdx.x / kWarpSize;
    if (r >= rows) return;  // whole warps leave together
    double best = best_score[r];
    int32_t slot = best_slot[r];
    for (uint32_t k = 0; k < k_batch; ++k) {
        const int32_t c = top_slot[(size_t)r * kTop + c0 + k];
        if (c < 0) continue;  // a row with fewer than kTop finite scores (uniform across the warp)
        const size_t row_gl = ((size_t)k * rows + r) * n;
        double e = 0.0;
        for (uint32_t j = lane; j < n; j += kWarpSize) e += (double)p[row_gl + j] * (double)d[row_gl + j];
        e = warp_sum(e);
        if (e < best || (e == best && c < slot)) {  // NaN never wins
            best = e;
            slot = c;
        }
    }
    if (lane == 0) {
        best_score[r] = best;
        best_slot[r] = slot;
    }
}
