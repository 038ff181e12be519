// boa_dynamic.cu — the head-wise BoA sweep with DYNAMIC group grids (design.md §4.3 "With dynamic group
// scales…", §4.2 "dynamic by default"), on the device: every head at once, rows of a head in a wavefront that
// lags by one group. The static-grid sweep is cuda/sweep.cu's boa_block_kernel{,_v2}.
//
// Symbols as in the paper and design.md §4.3: W (weights, [R × n] in sweep order, R = n_heads·d_h, head h
// owning rows h·d_h..(h+1)·d_h), U_col = chol(H_col⁻¹)ᵀ (upper, [n × n]; one shared for W_Q/W_K, one per head
// for W_V), U_row,h (upper, d_h × d_h), F[j, i] = U_row[j, i] / U_row[j, j] (Eq. (12)), groups of g sweep
// columns [k·g, min((k+1)·g, n)) (a trailing partial group allowed), Q, E as in GPTQ.
//
// What it computes (CPU twin: quant::boa::boa_sweep / sweep_heads with DynamicGroups; the row-by-row oracle
// is boa_sweep_rowwise, Alg. 1 l.7–11). Element (i, c) of a head may be quantized once every (j, c') ≤ (i, c)
// has been (BoA is GPTQ over vec(W_h) with U_row ⊗ U_col). A dynamic grid is searched over a whole group from
// the row's current values at the group's first column, so it needs, for all the group's columns, the cross-row
// terms of every row above (those rows must have finished the group) and the row's own GPTQ updates from all
// earlier columns. Hence the unit of work, a JOB, is one row × one group:
//   1. Eq. (12): w_c = W0[i, c] − Σ_{j<i} F[j, i]·δ_{j,c} for the group's columns, δ_{j,c} = w_{j,c} − q_{j,c}
//      (row j's value after its cross-row terms and before its own sweep, minus its quantized value; rows added
//      in ascending j, each product rounded then subtracted, as the CPU twin does);
//   2. x_c = w_c + A[i, c], A = −(the row's own GPTQ trailing updates from its earlier groups, Alg. 2 l.7);
//   3. the grid search of design.md §4.1 on x over the group (MinMax, Mse, or Hessian on the group's diagonal
//      block of H_col in sweep order): quant::quantizer::search_grid ported operation for operation (below);
//   4. GPTQ's column loop over the group (Alg. 2 l.4–6 inside the group): q, e = (x − q)/U_cc, the group's
//      later columns updated; δ_c = w_c − q_c and E written out.
// and after the jobs of a super-step, the TRAILING update of each row that just finished group k (Alg. 2 l.7,
// lazily per group): A[i, c] −= Σ_{c' ∈ group k} E[i, c']·U_col[c', c] for c past the group.
//
// ---------------------------------------------------------------------------------------------------------
// Schedule: the group-lagged wavefront (design.md §4.3: "the lag between consecutive rows becomes one group
// (row j+1 starts a group once row j has finished it), depth d_in + (d_h − 1)·g"). At super-step S row i of
// every head runs the job of group k = S − i (0 ≤ k < n_groups): row i needs the δ of rows j < i over group k
// (written at super-step S − i + j < S) and its own trailing updates from groups < k (applied at super-steps
// < S), so one super-step is one launch of all its jobs (independent: each writes only its own row) followed
// by one launch of their trailing updates. n_groups + d_h − 1 super-steps, each g column steps deep.
//
// Napkin math, 7B q_proj (32 heads × 128 rows × 4096 columns) on the H200 (132 SMs at ~1.98 GHz, ~67 TFLOP/s
// f32, 60 MB L2, 4.3 TB/s measured copy; /work/.library/device/KINDS.md), g = 128 (g = 64):
//   (A) one CTA per head, group-aligned column blocks, rows one after another inside a block (the CPU twin's
//       order): the dependent chain is d_h·n = 524K column steps per head (a quantize, a divide, a broadcast,
//       ≥ 20–50 ns even warp-synchronous) ≈ 10–25 ms, plus the d_h·n/g = 4096 (8192) group searches, each on
//       that chain: one search spread over a CTA still walks 100 shrink steps with a reduction each, ≈ 5–10 µs
//       ⇒ 20–80 ms; 32 of the 132 SMs busy. ⇒ ≈ 30–100 ms.
//   (B) the group-lagged wavefront above: 159 (191) super-steps; at most min(d_h, n_groups) = 32 (64) rows of a
//       head active per super-step (1024 (2048) jobs over 32 heads, ~8 (16) per SM). A job is: the cross-row
//       terms, i·g multiply-adds for row i (≤ 16K); the search; GPTQ inside the group, g²/2 = 8K (2K) updates.
//       The incremental Hessian search (quantizer.rs) walks 100 shrink steps over the g entries (~12
//       instructions per entry per step) and makes ~3.5·g row updates of u = Hv, t = Hm over the path, g wide:
//       ≈ 150K + 230K instructions per job at g = 128 (75K + 57K at g = 64).
//       - v1, one THREAD per job: a lone warp per SM sub-partition issues ≤ 1 instruction per cycle, the loads
//         hit L1: ≈ 200 µs per super-step (70 µs) ⇒ ≈ 32 ms (13 ms).
//       - v2, one WARP per job, lanes over the group's entries (below): per shrink step ~g/32 entries per lane
//         plus ~4.5 (2.3) changed entries, each a short f64 chain and 2–3 shuffles ≈ 200 (100) instructions ⇒
//         ≈ 25 µs (15 µs) per super-step ⇒ ≈ 4 ms (3 ms).
//       - trailing updates: the GPTQ sweep's work, R·n²/2 = 34 G multiply-adds = 69 GFLOP, as rank-g updates of
//         the rows that finished a group; row i of all heads finished the same group at the same super-step, so
//         a shared U_col tile serves 16 rows (one CTA: 16 heads × 64 columns, FFMA from shared memory) ⇒ at
//         ~20 TFLOP/s ≈ 3.5 ms; U traffic Σ_S (active rows' U blocks) ≈ 10 GB over the sweep, L2-assisted,
//         ≈ 2.5 ms, overlapped. Per-head U_col (W_V) gives no reuse between rows (each row its own U block):
//         R·n²/2·4 B = 137 GB ≈ 32 ms.
//       - launches: 2 per super-step (318 (382)), queued without a host synchronization.
//       ⇒ v1 ≈ 35–40 ms (≈ 17 ms), v2 ≈ 8 ms (≈ 6.5 ms) for q/k_proj; W_V +30 ms for either (its trailing).
//   Chosen: (B), v1 first (a direct port, the baseline) and v2 (the fast variant): the depth is n_groups + d_h − 1
//   super-steps instead of d_h·n/g sequential searches, the searches of a super-step run on many SMs, and the
//   trailing updates stay GEMM-shaped for a shared U_col. For a 7B model (32 layers × q, k, v) v2 projects to
//   32 × (2 × 8 + 35) ms ≈ 1.6 s, against the 2-minute goal of issue 19. Next, if a GPU says the trailing update
//   dominates: batch W_V's per-row updates over several super-steps (rank-k·g, U rows reused by k rows).
//
// Rounding: steps 1–4 reproduce the CPU twin operation for operation (IEEE-exact intrinsics, no contraction;
// the search's candidate arithmetic, f32 axpys of u = Hv and f64 accumulators in the CPU's order, ties to the
// first candidate in slot order), so for the same values x a job picks the very grid search_grid picks (the
// Mse score's pow() may differ by an ulp on a GPU: CUDA's pow is not correctly rounded). The trailing updates
// sum in another order than the CPU's block GEMMs, so values differ in the last bits and a code or a search on a
// knife edge may go the other way (tests/parity_boa_dynamic.rs explains every such mismatch).
//
// ---------------------------------------------------------------------------------------------------------
// boa_dyn_step_kernel (v1, BoaDynamicVariant::ThreadPerJob): the jobs of one super-step, one thread each.
//   Launch: grid (⌈n_active/32⌉, n_heads), block 32; thread a of column-block x runs row i = i_lo + 32x + a of
//   head blockIdx.y. No shared memory: the job's working vectors (x, u, t: f32; v, m: i32; Hw: f64, g each) are
//   in a global scratch laid out [g × R] (element j of row r at j·R + r), so the lanes of a warp, consecutive
//   rows, touch consecutive words (what local memory would do, but sized at run time by g).
// boa_dyn_step_kernel_v2 (BoaDynamicVariant::WarpPerJob): the same jobs, one warp each; lane l owns the group's
//   entries l, l + 32, …, kV2Slots·32 − 32 + l (g ≤ 32·kV2Slots = 256) in registers (compile-time slot indices,
//   unrolled). The search's per-entry work is split over the lanes; what the CPU does serially in ascending
//   entry order (the f64 accumulators a, b, μ, γ, β, the sums after a chain reset) is done by every lane in the
//   same order on values broadcast by shuffles, so the scores are the CPU's bits. GPTQ's column loop broadcasts
//   each column's value from its owner lane. Launch: grid (⌈n_active/4⌉, n_heads), block 128 (4 jobs), no
//   shared memory, no scratch.
// boa_dyn_trailing_kernel: A[rows of the super-step, c ≥ c1(k)] −= E·U_col[group k, c]. Launch: grid
//   (⌈n/64⌉, n_active, ⌈n_heads/16⌉) (shared U_col) or (⌈n/64⌉, n_active, n_heads) (per head); block 64 (one
//   column each, up to 16 heads' row i in registers); static smem 10.2 KB: U_col [32 × 64] and E [16 × 32]
//   stages. Column tiles left of the group's end exit at once.
//
// The search is done inside the step kernel, not by search.rs's DynamicSearch (the GPTQ sweep's dynamic
// groups): DynamicSearch searches one group of all rows at once (a candidate table, V·H or Δ·H batched GEMMs
// and a re-score, ~6–10 launches), whereas a super-step here holds min(d_h, n_groups) different groups, one
// per active row, each needing its x only after that row's cross-row terms inside the same job. Routing them
// through DynamicSearch would split every super-step into three kernels (x, search, GPTQ in the group) around
// a multi-group batch and give up the bit-exact search_grid port (its scores are SGEMM/bf16 sums); that
// rework is left open until a GPU says the in-kernel search is the bottleneck.
//
// Any d_h: F, the δ of the rows above and A live in global memory, so no head width is special (unlike the
// static-grid boa_block_kernel's d_h ≤ 128).
//
// Variants measured: correct on an H200 (parity tests, 2026-12-04: tests/parity_boa_dynamic.rs, both step
//   variants); speed not measured yet per kernel (the bench's boa_sweep rows take static grids: sweep.cu), so
//   the estimates above are still predictions. In a 7B-shaped BoA 3-bit run (H200, 2026-12-04, `run --profile`,
//   128 × 2048 tokens, dynamic groups of 128 by default) the sweep phase, all of a block's sweeps together,
//   took 0.66 s per block; the estimate above for q, k and v (v2) is 2 × 8 + 35 ms.
// ptxas (nvcc 13.0 V13.0.88, this build's ptxas_report.txt), registers / stack / spills:
//   boa_dyn_step_kernel (v1)      sm_90a:  96 regs, 0 B stack, no spills;  sm_80:  80 regs, 8 B stack, 8 B spilled
//   boa_dyn_step_kernel_v2        sm_90a: 157 regs, 0 B stack, no spills;  sm_80: 157 regs, 0 B stack, no spills
//   boa_dyn_trailing_kernel       sm_90a:  48 regs, 0 B stack, no spills;  sm_80:  72 regs, 0 B stack, no spills
// v2's 157 registers at 128 threads per CTA allow 3 CTAs (12 warps) per SM of 64K registers: enough for the
// ~8–16 jobs per SM of a 7B super-step (napkin above).
// ---------------------------------------------------------------------------------------------------------

#include <math.h>
#include <stdint.h>

#include "boa_quant.h"

constexpr uint32_t kWarp = 32;
constexpr int kStepThreads = 32;   // v1: jobs per CTA; must match STEP_V1_JOBS in boa_dynamic.rs
constexpr uint32_t kV2Jobs = 4;    // v2: jobs (warps) per CTA; must match STEP_V2_JOBS
constexpr uint32_t kV2Slots = 8;   // v2: entries per lane; g ≤ 32·kV2Slots, must match V2_MAX_G
constexpr int kShrinkSteps = 100;  // quant::quantizer::SHRINK_STEPS
constexpr double kMseNorm = 2.4;   // quant::quantizer::MSE_NORM
constexpr int kTrCols = 64;        // trailing: columns (threads) per CTA; must match TRAILING_COLS
constexpr int kTrHeads = 16;       // trailing: heads sharing one U_col tile per CTA; must match TRAILING_HEADS
constexpr int kTrK = 32;           // trailing: rows of U_col / columns of E staged per step

// Search kinds, as SearchKind in boa_dynamic.rs.
constexpr uint32_t kSearchMinMax = 0;
constexpr uint32_t kSearchMse = 1;
constexpr uint32_t kSearchHessian = 2;

// --- device helpers ---------------------------------------------------------------------------------------
// Each is the Rust expression it ports (src/quant/quantizer.rs, src/quant/boa.rs), rounded the same way: the
// _rn intrinsics keep nvcc from contracting a product and a sum into one FMA (Rust never does).

struct BoaGrid {
    float scale, zero;
};

// w − e·u as Rust's `w -= e * u`.
__device__ __forceinline__ float sub_prod(float w, float e, float u) { return __fsub_rn(w, __fmul_rn(e, u)); }

// ŵ = s·(q − z) (quantizer.rs `dequantize`), as a product that nothing downstream can fuse into.
__device__ __forceinline__ float dequant(float q, float s, float z) { return __fmul_rn(s, __fsub_rn(q, z)); }

// `x.round_ties_even() as i32` for f32: Rust's cast saturates and maps NaN to 0.
__device__ __forceinline__ int32_t round_to_i32(float x) {
    const float r = rintf(x);
    if (r != r) return 0;
    if (r >= 2147483648.0f) return INT32_MAX;
    if (r <= -2147483648.0f) return INT32_MIN;
    return (int32_t)r;
}

// p = 1 − i/100 (quantizer.rs `shrink`) in f64, then `T::from_f64` to f32 (round to nearest).
__device__ __forceinline__ float shrink(int i) {
    const double p = 1.0 - (double)i / (double)kShrinkSteps;
    return (float)p;
}

// quantizer.rs `candidates`: the scale of shrink step p and its one (symmetric) or two (floor, ceil) zeros.
struct Cand {
    float scale;
    float z0, z1;
    int nz;
};
__device__ __forceinline__ Cand candidates(float lo, float hi, float p, float maxq, bool sym) {
    lo = __fmul_rn(p, lo);
    hi = __fmul_rn(p, hi);
    Cand c;
    c.scale = __fdiv_rn(__fsub_rn(hi, lo), maxq);
    if (sym) {
        c.z0 = c.z1 = __fdiv_rn(__fadd_rn(maxq, 1.0f), 2.0f);
        c.nz = 1;
    } else {
        const float z = __fdiv_rn(-lo, c.scale);
        c.z0 = floorf(z);
        c.z1 = ceilf(z);
        c.nz = c.z0 == c.z1 ? 1 : 2;
    }
    return c;
}

// quantizer.rs `range`'s last step: symmetric widening, all-zero → [−1, 1].
__device__ __forceinline__ void finish_range(float& lo, float& hi, bool sym) {
    if (sym) {
        hi = fmaxf(hi, fabsf(lo));
        lo = -hi;
    }
    if (lo == 0.0f && hi == 0.0f) {
        lo = -1.0f;
        hi = 1.0f;
    }
}

// quantizer.rs `minmax_grid`.
__device__ __forceinline__ BoaGrid minmax_grid(float lo, float hi, float maxq, bool sym) {
    BoaGrid gr;
    gr.scale = __fdiv_rn(__fsub_rn(hi, lo), maxq);
    gr.zero = sym ? __fdiv_rn(__fadd_rn(maxq, 1.0f), 2.0f) : rintf(__fdiv_rn(-lo, gr.scale));
    return gr;
}

// |Δ|^2.4 of one entry (quantizer.rs `mse_search`: `(dequantize(quantize(x)) − x).to_f64().abs().powf(2.4)`).
__device__ __forceinline__ double mse_term(float x, float s, float z, float maxq) {
    const float d = __fsub_rn(dequant(boa_quantize(x, s, z, maxq), s, z), x);
    return pow(fabs((double)d), kMseNorm);
}

// A row-strided vector of the v1 scratch: element j at p[j·stride].
template <typename T>
struct Col {
    T* p;
    uint32_t stride;
    __device__ __forceinline__ T& operator[](uint32_t j) const { return p[(size_t)j * stride]; }
};

// --- v1: one thread per job -------------------------------------------------------------------------------

// quantizer.rs `mse_search` on x [len].
__device__ BoaGrid mse_search_v1(Col<float> x, uint32_t len, float maxq, bool sym) {
    float lo = 0.0f, hi = 0.0f;
    for (uint32_t j = 0; j < len; ++j) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    finish_range(lo, hi, sym);
    double best = INFINITY;
    BoaGrid bg = {0.0f, 0.0f};
    for (int i = 0; i < kShrinkSteps; ++i) {
        const Cand c = candidates(lo, hi, shrink(i), maxq, sym);
        for (int zi = 0; zi < c.nz; ++zi) {
            const float z = zi == 0 ? c.z0 : c.z1;
            double err = 0.0;
            for (uint32_t j = 0; j < len; ++j) err = __dadd_rn(err, mse_term(x[j], c.scale, z, maxq));
            if (err < best) {
                best = err;
                bg = {c.scale, z};
            }
        }
    }
    return bg;
}

// quantizer.rs `hessian_search` (pre = None) on x [g] with the group's H block hb[a·ldh + b] (f32): the
// incremental score along the shrink path. Floor chain: v = clamp(round(x/s), −z, maxq − z), u = H v,
// a = vᵀHv, b = vᵀ(Hx); ceil chain (z + 1) through m (entries where the clamps differ), t = H m, γ = mᵀt,
// μ = mᵀu, β = mᵀHx; score = s²a − 2sb (−xᵀHx dropped). Same operations in the same order as the CPU.
__device__ BoaGrid hessian_search_v1(Col<float> x, uint32_t g, const float* __restrict__ hb, uint32_t ldh,
                                     float maxq, bool sym, Col<float> u, Col<float> t, Col<int32_t> v,
                                     Col<int32_t> m, Col<double> hw) {
    float lo = 0.0f, hi = 0.0f;
    for (uint32_t j = 0; j < g; ++j) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    finish_range(lo, hi, sym);
    // Hw: hw[i] = Σ_j x_j·H[j, i], j ascending (the CPU adds rows of H into hw).
    for (uint32_t i = 0; i < g; ++i) {
        double acc = 0.0;
        for (uint32_t j = 0; j < g; ++j)
            acc = __dadd_rn(acc, __dmul_rn((double)x[j], (double)hb[(size_t)j * ldh + i]));
        hw[i] = acc;
    }
    bool have_chain = false;
    float chain_zero = 0.0f;
    double a = 0.0, b = 0.0, gamma = 0.0, mu = 0.0, beta = 0.0;
    double best = INFINITY;
    BoaGrid bg = {0.0f, 0.0f};
    for (int step = 0; step < kShrinkSteps; ++step) {
        const Cand c = candidates(lo, hi, shrink(step), maxq, sym);
        const float inv = __fdiv_rn(1.0f, c.scale);
        const float zero = c.z0;
        const int32_t vlo = (int32_t)(-(double)zero), vhi = (int32_t)(double)__fsub_rn(maxq, zero);
        if (!have_chain || chain_zero != zero) {
            // A new floor zero: the chain from scratch.
            for (uint32_t j = 0; j < g; ++j) {
                const int32_t r = round_to_i32(__fmul_rn(x[j], inv));
                v[j] = r < vlo ? vlo : (r > vhi ? vhi : r);
                m[j] = (r >= vhi || r < vlo) ? 1 : 0;
                u[j] = 0.0f;
                t[j] = 0.0f;
            }
            for (uint32_t j = 0; j < g; ++j) {
                const int32_t vj = v[j];
                if (vj != 0) {
                    const float f = (float)vj;
                    for (uint32_t k = 0; k < g; ++k) u[k] = __fadd_rn(u[k], __fmul_rn(f, hb[(size_t)j * ldh + k]));
                }
            }
            for (uint32_t j = 0; j < g; ++j)
                if (m[j] != 0)
                    for (uint32_t k = 0; k < g; ++k) t[k] = __fadd_rn(t[k], __fmul_rn(1.0f, hb[(size_t)j * ldh + k]));
            a = b = gamma = mu = beta = 0.0;
            for (uint32_t j = 0; j < g; ++j) a = __dadd_rn(a, __dmul_rn((double)v[j], (double)u[j]));
            for (uint32_t j = 0; j < g; ++j) b = __dadd_rn(b, __dmul_rn((double)v[j], hw[j]));
            for (uint32_t j = 0; j < g; ++j) gamma = __dadd_rn(gamma, __dmul_rn((double)m[j], (double)t[j]));
            for (uint32_t j = 0; j < g; ++j) mu = __dadd_rn(mu, __dmul_rn((double)m[j], (double)u[j]));
            for (uint32_t j = 0; j < g; ++j) beta = __dadd_rn(beta, __dmul_rn((double)m[j], hw[j]));
            chain_zero = zero;
            have_chain = true;
        } else {
            for (uint32_t j = 0; j < g; ++j) {
                const int32_t r = round_to_i32(__fmul_rn(x[j], inv));
                const int32_t nv = r < vlo ? vlo : (r > vhi ? vhi : r);
                const int32_t nm = (r >= vhi || r < vlo) ? 1 : 0;
                const double hjj = (double)hb[(size_t)j * ldh + j];
                const int32_t d = nv - v[j];
                if (d != 0) {
                    const double df = (double)d;
                    a = __dadd_rn(a, __dmul_rn(df, __dadd_rn(__dmul_rn(2.0, (double)u[j]), __dmul_rn(df, hjj))));
                    b = __dadd_rn(b, __dmul_rn(df, hw[j]));
                    mu = __dadd_rn(mu, __dmul_rn(df, (double)t[j]));
                    const float f = (float)d;
                    for (uint32_t k = 0; k < g; ++k) u[k] = __fadd_rn(u[k], __fmul_rn(f, hb[(size_t)j * ldh + k]));
                    v[j] = nv;
                }
                const int32_t dm = nm - m[j];
                if (dm != 0) {
                    const double df = (double)dm;
                    mu = __dadd_rn(mu, __dmul_rn(df, (double)u[j]));
                    gamma = __dadd_rn(gamma, __dmul_rn(df, __dadd_rn(__dmul_rn(2.0, (double)t[j]), __dmul_rn(df, hjj))));
                    beta = __dadd_rn(beta, __dmul_rn(df, hw[j]));
                    const float f = (float)dm;
                    for (uint32_t k = 0; k < g; ++k) t[k] = __fadd_rn(t[k], __fmul_rn(f, hb[(size_t)j * ldh + k]));
                    m[j] = nm;
                }
            }
        }
        const double s = (double)c.scale;
        const double score = __dsub_rn(__dmul_rn(__dmul_rn(s, s), a), __dmul_rn(__dmul_rn(2.0, s), b));
        if (score < best) {
            best = score;
            bg = {c.scale, zero};
        }
        if (c.nz == 2) {
            const double sc = __dsub_rn(__dmul_rn(__dmul_rn(s, s), __dadd_rn(__dsub_rn(a, __dmul_rn(2.0, mu)), gamma)),
                                        __dmul_rn(__dmul_rn(2.0, s), __dsub_rn(b, beta)));
            if (sc < best) {
                best = sc;
                bg = {c.scale, c.z1};
            }
        }
    }
    return bg;
}

// The arguments every step kernel shares (kernel-signature order below).
#define BOA_DYN_STEP_ARGS                                                                                      \
    const float *__restrict__ w0,      /* [R × n] W in sweep order, before the sweep                  */      \
        const float *__restrict__ acc, /* [R × n] A = −(own GPTQ trailing updates so far)             */      \
        float *__restrict__ delta,     /* [R × n] δ (the job writes its group, reads rows above)      */      \
        float *__restrict__ q,         /* [R × n] out: Q                                              */      \
        uint8_t *__restrict__ codes,   /* [R × n] out                                                 */      \
        float *__restrict__ scales,    /* [R × n_groups] out                                          */      \
        float *__restrict__ zeros,     /* [R × n_groups] out                                          */      \
        float *__restrict__ e,         /* [R × g] out: E of the job's group (the trailing update's)    */      \
        float *__restrict__ scr_f,     /* v1: [3 × g × R] x, u, t; v2: unused                         */      \
        int32_t *__restrict__ scr_i,   /* v1: [2 × g × R] v, m; v2: unused                            */      \
        double *__restrict__ scr_d,    /* v1: [g × R] Hx; v2: unused                                  */      \
        const float *__restrict__ u_col, /* [n × n] shared, or [n_heads × n × n] per head, upper      */    \
        const uint64_t u_head_stride,  /* 0 (shared U_col) or n²                                      */      \
        const float *__restrict__ h,   /* H_col (damped, sweep order) like u_col; Hessian search only */      \
        const uint64_t h_head_stride,  /* 0 or n²                                                     */      \
        const float *__restrict__ f_row, /* [n_heads × d_h × d_h]: F[j, i] = U_row[j, i]/U_row[j, j]  */    \
        const uint32_t d_h, const uint32_t n, const uint32_t g, const uint32_t n_groups,                      \
        const uint32_t step,     /* super-step S: row i runs group S − i                              */      \
        const uint32_t i_lo,     /* first active row, max(0, S − n_groups + 1)                         */      \
        const uint32_t n_active, /* active rows per head                                               */      \
        const uint32_t search,   /* kSearchMinMax / kSearchMse / kSearchHessian                        */      \
        const uint32_t sym,      /* symmetric grids                                                    */      \
        const float search_maxq, /* 2^b − 1 of the search's spec                                       */      \
        const float maxq         /* 2^b − 1 of the quantizer                                           */

// --- GPU kernels ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kStepThreads) boa_dyn_step_kernel(BOA_DYN_STEP_ARGS) {
    const uint32_t a = blockIdx.x * kStepThreads + threadIdx.x;
    if (a >= n_active) return;
    const uint32_t head = blockIdx.y, i = i_lo + a, k = step - i;
    const uint32_t rows = gridDim.y * d_h, r = head * d_h + i;
    const uint32_t c0 = k * g, len = min(g, n - c0);
    const size_t ro = (size_t)r * n;
    const float* f = f_row + (size_t)head * d_h * d_h;
    const Col<float> x = {scr_f + r, rows};
    // 1–2. Eq. (12) over the group, then the own trailing updates; w waits in δ's slots for q.
    for (uint32_t c = 0; c < len; ++c) {
        const uint32_t col = c0 + c;
        float wv = w0[ro + col];
        for (uint32_t j = 0; j < i; ++j)
            wv = sub_prod(wv, f[(size_t)j * d_h + i], delta[(size_t)(head * d_h + j) * n + col]);
        delta[ro + col] = wv;
        x[c] = __fadd_rn(wv, acc[ro + col]);
    }
    // 3. The group's grid from the current values.
    const bool sy = sym != 0;
    BoaGrid gr;
    if (search == kSearchHessian) {
        const size_t gr_sz = (size_t)g * rows;
        gr = hessian_search_v1(x, len, h + head * h_head_stride + (size_t)c0 * n + c0, n, search_maxq, sy,
                               {scr_f + gr_sz + r, rows}, {scr_f + 2 * gr_sz + r, rows}, {scr_i + r, rows},
                               {scr_i + gr_sz + r, rows}, {scr_d + r, rows});
    } else if (search == kSearchMse) {
        gr = mse_search_v1(x, len, search_maxq, sy);
    } else {
        float lo = 0.0f, hi = 0.0f;
        for (uint32_t j = 0; j < len; ++j) {
            lo = fminf(lo, x[j]);
            hi = fmaxf(hi, x[j]);
        }
        finish_range(lo, hi, sy);
        gr = minmax_grid(lo, hi, search_maxq, sy);
    }
    scales[(size_t)r * n_groups + k] = gr.scale;
    zeros[(size_t)r * n_groups + k] = gr.zero;
    // 4. GPTQ's column loop over the group (Alg. 2 l.4–6).
    const float* uc = u_col + head * u_head_stride;
    for (uint32_t c = 0; c < len; ++c) {
        const uint32_t col = c0 + c;
        const float xv = x[c];
        const float qc = boa_quantize(xv, gr.scale, gr.zero, maxq);
        const float qv = dequant(qc, gr.scale, gr.zero);
        q[ro + col] = qv;
        codes[ro + col] = (uint8_t)qc;
        const float* u_c = uc + (size_t)col * n;
        const float err = __fdiv_rn(__fsub_rn(xv, qv), u_c[col]);
        e[(size_t)r * g + c] = err;
        for (uint32_t c2 = c + 1; c2 < len; ++c2) x[c2] = sub_prod(x[c2], err, u_c[c0 + c2]);
        delta[ro + col] = __fsub_rn(delta[ro + col], qv);
    }
}

// --- v2: one warp per job ---------------------------------------------------------------------------------

// The value of lane `src` of a per-lane register.
template <typename T>
__device__ __forceinline__ T from_lane(T v, uint32_t src) {
    return __shfl_sync(0xffffffffu, v, (int)src);
}

// Min and max over the warp of each lane's (lo, hi): exact in any order.
__device__ __forceinline__ void warp_range(float& lo, float& hi) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
}

// The lowest set lane of a non-empty ballot, removed from it.
__device__ __forceinline__ uint32_t pop_lane(unsigned& todo) {
    const uint32_t l = (uint32_t)(__ffs((int)todo) - 1);
    todo &= todo - 1;
    return l;
}

extern "C" __global__ void __launch_bounds__(kV2Jobs * kWarp) boa_dyn_step_kernel_v2(BOA_DYN_STEP_ARGS) {
    // The Mse search's terms of one candidate, summed by every lane in entry order (the CPU's), [job][entry].
    __shared__ double mse_sh[kV2Jobs][kV2Slots * kWarp];
    const uint32_t lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
    const uint32_t a = blockIdx.x * kV2Jobs + warp;
    if (a >= n_active) return;  // the whole warp: no lane of it is left for the collectives below
    const uint32_t head = blockIdx.y, i = i_lo + a, k = step - i;
    const uint32_t r = head * d_h + i;
    const uint32_t c0 = k * g, len = min(g, n - c0);
    const size_t ro = (size_t)r * n;
    const float* f = f_row + (size_t)head * d_h * d_h;
    // Entry s·32 + lane of the group is slot s of this lane: x_r the row's working values, w_r its
    // cross-updated values (δ = w − q at the end).
    float x_r[kV2Slots], w_r[kV2Slots];
    // 1–2. Eq. (12), rows above in ascending order per column, then the own trailing updates.
#pragma unroll
    for (uint32_t s = 0; s < kV2Slots; ++s) {
        const uint32_t c = s * kWarp + lane;
        float wv = 0.0f, xv = 0.0f;
        if (c < len) {
            const uint32_t col = c0 + c;
            wv = w0[ro + col];
            for (uint32_t j = 0; j < i; ++j)
                wv = sub_prod(wv, f[(size_t)j * d_h + i], delta[(size_t)(head * d_h + j) * n + col]);
            xv = __fadd_rn(wv, acc[ro + col]);
        }
        w_r[s] = wv;
        x_r[s] = xv;
    }
    // 3. The group's grid.
    const bool sy = sym != 0;
    float lo = 0.0f, hi = 0.0f;
#pragma unroll
    for (uint32_t s = 0; s < kV2Slots; ++s)
        if (s * kWarp + lane < len) {
            lo = fminf(lo, x_r[s]);
            hi = fmaxf(hi, x_r[s]);
        }
    warp_range(lo, hi);
    finish_range(lo, hi, sy);
    BoaGrid gr = {0.0f, 0.0f};
    if (search == kSearchMinMax) {
        gr = minmax_grid(lo, hi, search_maxq, sy);
    } else if (search == kSearchMse) {
        double best = INFINITY;
        for (int st = 0; st < kShrinkSteps; ++st) {
            const Cand c = candidates(lo, hi, shrink(st), search_maxq, sy);
            for (int zi = 0; zi < c.nz; ++zi) {
                const float z = zi == 0 ? c.z0 : c.z1;
#pragma unroll
                for (uint32_t s = 0; s < kV2Slots; ++s)
                    if (s * kWarp + lane < len) mse_sh[warp][s * kWarp + lane] = mse_term(x_r[s], c.scale, z, search_maxq);
                __syncwarp();
                double err = 0.0;
                for (uint32_t j = 0; j < len; ++j) err = __dadd_rn(err, mse_sh[warp][j]);
                __syncwarp();  // every lane has read the terms before the next candidate's overwrite them
                if (err < best) {
                    best = err;
                    gr = {c.scale, z};
                }
            }
        }
    } else {
        // quantizer.rs `hessian_search`, lanes over entries; see hessian_search_v1 for the symbols. What the
        // CPU does entry by entry in ascending order, every lane does on the broadcast values of the entry.
        const float* hb = h + head * h_head_stride + (size_t)c0 * n + c0;  // H[c0 + a, c0 + b] at a·n + b
        double hw_r[kV2Slots];
        // Hx: each lane its entries, j ascending (the CPU's order per entry); x_j from its owner lane.
#pragma unroll
        for (uint32_t s = 0; s < kV2Slots; ++s) hw_r[s] = 0.0;
#pragma unroll
        for (uint32_t sj = 0; sj < kV2Slots; ++sj) {
            if (sj * kWarp >= len) break;
            for (uint32_t l = 0; l < kWarp && sj * kWarp + l < len; ++l) {
                const uint32_t j = sj * kWarp + l;
                const double xj = (double)from_lane(x_r[sj], l);
#pragma unroll
                for (uint32_t s = 0; s < kV2Slots; ++s) {
                    const uint32_t ii = s * kWarp + lane;
                    if (ii < len) hw_r[s] = __dadd_rn(hw_r[s], __dmul_rn(xj, (double)hb[(size_t)j * n + ii]));
                }
            }
        }
        int32_t v_r[kV2Slots], m_r[kV2Slots];
        float u_r[kV2Slots], t_r[kV2Slots];
        bool have_chain = false;
        float chain_zero = 0.0f;
        double A = 0.0, B = 0.0, gamma = 0.0, mu = 0.0, beta = 0.0;
        double best = INFINITY;
        for (int st = 0; st < kShrinkSteps; ++st) {
            const Cand c = candidates(lo, hi, shrink(st), search_maxq, sy);
            const float inv = __fdiv_rn(1.0f, c.scale);
            const float zero = c.z0;
            const int32_t vlo = (int32_t)(-(double)zero), vhi = (int32_t)(double)__fsub_rn(search_maxq, zero);
            int32_t nv_r[kV2Slots], nm_r[kV2Slots];
#pragma unroll
            for (uint32_t s = 0; s < kV2Slots; ++s) {
                const int32_t rr = round_to_i32(__fmul_rn(x_r[s], inv));
                const bool in = s * kWarp + lane < len;
                nv_r[s] = in ? (rr < vlo ? vlo : (rr > vhi ? vhi : rr)) : 0;
                nm_r[s] = in && (rr >= vhi || rr < vlo) ? 1 : 0;
            }
            if (!have_chain || chain_zero != zero) {
                // A new floor zero: u = Hv, t = Hm from rows j ascending, then the five sums in entry order.
#pragma unroll
                for (uint32_t s = 0; s < kV2Slots; ++s) {
                    v_r[s] = nv_r[s];
                    m_r[s] = nm_r[s];
                    u_r[s] = 0.0f;
                    t_r[s] = 0.0f;
                }
#pragma unroll
                for (uint32_t sj = 0; sj < kV2Slots; ++sj) {
                    if (sj * kWarp >= len) break;
                    const unsigned any_m = __ballot_sync(0xffffffffu, m_r[sj] != 0);
                    unsigned todo = __ballot_sync(0xffffffffu, v_r[sj] != 0) | any_m;
                    while (todo) {
                        const uint32_t l = pop_lane(todo);
                        const int32_t vj = from_lane(v_r[sj], l);
                        const float* hrow = hb + (size_t)(sj * kWarp + l) * n;
                        const float fv = (float)vj;
                        const bool mj = (any_m >> l) & 1u;
#pragma unroll
                        for (uint32_t s = 0; s < kV2Slots; ++s)
                            if (s * kWarp + lane < len) {
                                const float hv = hrow[s * kWarp + lane];
                                if (vj != 0) u_r[s] = __fadd_rn(u_r[s], __fmul_rn(fv, hv));
                                if (mj) t_r[s] = __fadd_rn(t_r[s], __fmul_rn(1.0f, hv));
                            }
                    }
                }
                A = B = gamma = mu = beta = 0.0;
#pragma unroll
                for (uint32_t sj = 0; sj < kV2Slots; ++sj) {
                    if (sj * kWarp >= len) break;
                    const int32_t vm_mine = v_r[sj] * 2 + m_r[sj];  // v and m (0 or 1) in one broadcast
                    for (uint32_t l = 0; l < kWarp && sj * kWarp + l < len; ++l) {
                        const int32_t vm = from_lane(vm_mine, l);
                        const double mj = (double)(vm & 1), vj = (double)((vm - (vm & 1)) / 2);
                        const double uj = (double)from_lane(u_r[sj], l);
                        const double tj = (double)from_lane(t_r[sj], l);
                        const double hwj = from_lane(hw_r[sj], l);
                        A = __dadd_rn(A, __dmul_rn(vj, uj));
                        B = __dadd_rn(B, __dmul_rn(vj, hwj));
                        gamma = __dadd_rn(gamma, __dmul_rn(mj, tj));
                        mu = __dadd_rn(mu, __dmul_rn(mj, uj));
                        beta = __dadd_rn(beta, __dmul_rn(mj, hwj));
                    }
                }
                chain_zero = zero;
                have_chain = true;
            } else {
                // The entries that changed, in ascending order: per slot a ballot, then its lanes in order.
#pragma unroll
                for (uint32_t sj = 0; sj < kV2Slots; ++sj) {
                    if (sj * kWarp >= len) break;
                    // d = nv − v (|d| ≤ maxq) and dm = nm − m (−1, 0, 1) in one broadcast: 8·d + (dm + 1).
                    const int32_t pk_mine = 8 * (nv_r[sj] - v_r[sj]) + (nm_r[sj] - m_r[sj] + 1);
                    unsigned todo = __ballot_sync(0xffffffffu, pk_mine != 1);
                    while (todo) {
                        const uint32_t l = pop_lane(todo), j = sj * kWarp + l;
                        const int32_t pk = from_lane(pk_mine, l), dmp = pk & 7;
                        const int32_t d = (pk - dmp) / 8, dm = dmp - 1;
                        const float* hrow = hb + (size_t)j * n;
                        const float hjj_f = hrow[j];
                        const double hjj = (double)hjj_f, hwj = from_lane(hw_r[sj], l);
                        const float uj0 = from_lane(u_r[sj], l), tj = from_lane(t_r[sj], l);
                        float uj = uj0;
                        if (d != 0) {
                            const double df = (double)d;
                            A = __dadd_rn(A, __dmul_rn(df, __dadd_rn(__dmul_rn(2.0, (double)uj0), __dmul_rn(df, hjj))));
                            B = __dadd_rn(B, __dmul_rn(df, hwj));
                            mu = __dadd_rn(mu, __dmul_rn(df, (double)tj));
                            const float fd = (float)d;
#pragma unroll
                            for (uint32_t s = 0; s < kV2Slots; ++s)
                                if (s * kWarp + lane < len) u_r[s] = __fadd_rn(u_r[s], __fmul_rn(fd, hrow[s * kWarp + lane]));
                            // The owner's u_j after that update, by the same operation (no broadcast needed).
                            uj = __fadd_rn(uj0, __fmul_rn(fd, hjj_f));
                            if (lane == l) v_r[sj] = nv_r[sj];
                        }
                        if (dm != 0) {
                            const double df = (double)dm;
                            mu = __dadd_rn(mu, __dmul_rn(df, (double)uj));
                            gamma = __dadd_rn(gamma, __dmul_rn(df, __dadd_rn(__dmul_rn(2.0, (double)tj), __dmul_rn(df, hjj))));
                            beta = __dadd_rn(beta, __dmul_rn(df, hwj));
                            const float fm = (float)dm;
#pragma unroll
                            for (uint32_t s = 0; s < kV2Slots; ++s)
                                if (s * kWarp + lane < len) t_r[s] = __fadd_rn(t_r[s], __fmul_rn(fm, hrow[s * kWarp + lane]));
                            if (lane == l) m_r[sj] = nm_r[sj];
                        }
                    }
                }
            }
            const double s = (double)c.scale;
            const double score = __dsub_rn(__dmul_rn(__dmul_rn(s, s), A), __dmul_rn(__dmul_rn(2.0, s), B));
            if (score < best) {
                best = score;
                gr = {c.scale, zero};
            }
            if (c.nz == 2) {
                const double sc = __dsub_rn(__dmul_rn(__dmul_rn(s, s), __dadd_rn(__dsub_rn(A, __dmul_rn(2.0, mu)), gamma)),
                                            __dmul_rn(__dmul_rn(2.0, s), __dsub_rn(B, beta)));
                if (sc < best) {
                    best = sc;
                    gr = {c.scale, c.z1};
                }
            }
        }
    }
    if (lane == 0) {
        scales[(size_t)r * n_groups + k] = gr.scale;
        zeros[(size_t)r * n_groups + k] = gr.zero;
    }
    // 4. GPTQ's column loop over the group: column c's value from its owner lane, every lane the same q and e,
    // each lane updating its later entries (coalesced reads of U_col's row).
    const float* uc = u_col + head * u_head_stride;
#pragma unroll
    for (uint32_t sc = 0; sc < kV2Slots; ++sc) {
        if (sc * kWarp >= len) break;
        for (uint32_t l = 0; l < kWarp && sc * kWarp + l < len; ++l) {
            const uint32_t c = sc * kWarp + l, col = c0 + c;
            const float xv = from_lane(x_r[sc], l);
            const float qc = boa_quantize(xv, gr.scale, gr.zero, maxq);
            const float qv = dequant(qc, gr.scale, gr.zero);
            const float* u_c = uc + (size_t)col * n;
            const float err = __fdiv_rn(__fsub_rn(xv, qv), u_c[col]);
            if (lane == l) {
                q[ro + col] = qv;
                codes[ro + col] = (uint8_t)qc;
                e[(size_t)r * g + c] = err;
                delta[ro + col] = __fsub_rn(w_r[sc], qv);
            }
#pragma unroll
            for (uint32_t s = 0; s < kV2Slots; ++s) {
                const uint32_t c2 = s * kWarp + lane;
                if (c2 > c && c2 < len) x_r[s] = sub_prod(x_r[s], err, u_c[c0 + c2]);
            }
        }
    }
}

// --- trailing update --------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kTrCols)
boa_dyn_trailing_kernel(float* __restrict__ acc,          // [R × n] A: −= E·U_col[group, c] for c ≥ c1
                        const float* __restrict__ e,      // [R × g] E of each row's last group
                        const float* __restrict__ u_col,  // [n × n] shared, or [n_heads × n × n] per head
                        const uint64_t u_head_stride,     // 0 (shared: kTrHeads heads per CTA) or n² (1 per CTA)
                        const uint32_t n_heads, const uint32_t d_h, const uint32_t n, const uint32_t g,
                        const uint32_t step, const uint32_t i_lo) {
    __shared__ float u_sh[kTrK][kTrCols];   // U_col[c0 + kk0 + kk, tile column]
    __shared__ float e_sh[kTrHeads][kTrK];  // E[row of head hh, kk0 + kk]
    const uint32_t i = i_lo + blockIdx.y, k = step - i;
    const uint32_t c0 = k * g, c1 = min(c0 + g, n), len = c1 - c0;
    const uint32_t tile0 = blockIdx.x * kTrCols;
    if (tile0 + kTrCols <= c1) return;  // the whole tile lies inside or left of the group: nothing to update
    const uint32_t hpc = u_head_stride == 0 ? kTrHeads : 1;
    const uint32_t h0 = blockIdx.z * hpc, nh = min(hpc, n_heads - h0);
    const float* uc = u_col + u_head_stride * h0;
    const uint32_t tid = threadIdx.x, col = tile0 + tid;
    float sum[kTrHeads];
#pragma unroll
    for (int hh = 0; hh < kTrHeads; ++hh) sum[hh] = 0.0f;
    for (uint32_t kk0 = 0; kk0 < len; kk0 += kTrK) {
        const uint32_t kn = min((uint32_t)kTrK, len - kk0);
        for (uint32_t kk = 0; kk < kn; ++kk)  // coalesced: a row of U_col per kk
            u_sh[kk][tid] = col < n ? uc[(size_t)(c0 + kk0 + kk) * n + col] : 0.0f;
        for (uint32_t x = tid; x < nh * kn; x += kTrCols) {
            const uint32_t hh = x / kn, kk = x % kn;
            e_sh[hh][kk] = e[(size_t)((h0 + hh) * d_h + i) * g + kk0 + kk];
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < kTrHeads; ++hh)
            if ((uint32_t)hh < nh)
                for (uint32_t kk = 0; kk < kn; ++kk) sum[hh] += e_sh[hh][kk] * u_sh[kk][tid];
        __syncthreads();
    }
    if (col >= c1 && col < n) {
#pragma unroll
        for (int hh = 0; hh < kTrHeads; ++hh)
            if ((uint32_t)hh < nh) acc[(size_t)((h0 + hh) * d_h + i) * n + col] -= sum[hh];
    }
}
