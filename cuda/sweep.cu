// sweep.cu — the lazy-batched rounding sweeps (design.md §4.2 GPTQ, §4.3 BoA; §6 "lazy-batched rounding",
// "BoA sweep"), static grids (one (scale, zero) per row and group, fixed before the sweep).
//
// Symbols as in the paper: W (weights, [rows × n], sweep order), U = U_col = chol(H⁻¹)ᵀ upper [n × n],
// Q (dequantized result), E (scaled errors of the current column block), block bounds i1/i2 as in gptq.py.
// Rounding matches the CPU twins operation for operation inside a block (quantize/dequantize from
// include/boa_quant.h; w −= e·u as a rounded product then a rounded difference, like Rust's non-fused
// `x -= err * uu`); the trailing GEMMs sum in a different order, so near-ties may round differently.
//
// ---------------------------------------------------------------------------------------------------------
// gptq_block_kernel: one column block [i1, i2) (i2 − i1 ≤ 128) of the GPTQ sweep (Alg. 2 l.3–6 inside the
//   block). CPU twin: quant::gptq::gptq_block_sweep (static grids); launcher: launch_gptq_sweep
//   (backend/cuda/sweep.rs); parity test: parity_gptq_sweep.
//   Launch: grid ceil(rows/32), block 32 (one warp, one thread per row), static smem 18.6 KB: the block's W
//   columns staged column-major w_sh[c][row] (a warp reads one column in one conflict-free access), the
//   codes beside them. U[c, c..i2] is read from global memory with a warp-uniform address (one broadcast
//   transaction, L1-resident). After column c is quantized w_sh[c] holds Q, written out coalesced at the end;
//   E goes out as [bw × rows] (coalesced: a warp writes one column of E per step).
//
// gptq_block_kernel_v2 (sweep.rs GptqBlockVariant::Split, the default): the same block, same CPU twin and
//   parity test, bit-identical codes. Why: v1 measured 37.7 ms for 4096 × 4096 (H200), ~9 µs per column
//   step, against ~0.2 µs predicted; with one warp per CTA and 4096 rows, an SM holds one warp, so each step's
//   127 dependent-latency smem/L1 round trips (the row update reads U from global memory) are not hidden.
//   v2: a CTA of 32 rows × kG2Parts = 4 warps; warp p owns the block columns c ≡ p (mod 4) and alone updates
//   and quantizes them, so an element's updates stay in column order; one barrier per step publishes the
//   step's E column (e_sh). The block's U [bw × bw] is staged in shared memory (64 KB: the update's U reads
//   become broadcasts from smem), the owner reloads (scale, zero) only when the column's group changes.
//   Launch: grid ceil(rows/32), block 128, 104 448 B dynamic smem (opted in at load; 2 CTAs per SM on sm_90's
//   228 KB, 1 on sm_80's 164 KB; a device that refuses the opt-in runs v1).
//   Estimate (4096 × 4096): per step the owner's quantize + divide (~150 cycles), a 4-warp barrier (~40) and
//   ≤ 32 unrolled smem updates per warp (~150) ≈ 350 cycles; 128 steps + the 80 KB staging ≈ 50K cycles ≈
//   25 µs per block, 32 blocks ≈ 1 ms, plus the trailing GEMMs (~1.5 ms at cuBLAS's f32 rate): ~2.5–3 ms
//   against v1's 37.7 ms. Not yet measured on a GPU.
// sweep_trailing_gemm_kernel: W[:, i2:] −= E[:, i1:i2] · U[i1:i2, i2:] (the lazy batch, one GEMM), batched
//   over z (BoA's per-head U_col). C [rows × ncol] (ldc) −= Eᵀ · B, Eᵀ given as [k × rows] (lda), B [k × ncol]
//   (ldb). Launch: grid (ceil(ncol/64), ceil(rows/64), batch), block 256, 8 KB smem: 64×64 output tile, 4×4
//   per thread, 16-deep k stages; f32 FFMA (tf32 tensor cores would move codes off the CPU oracle).
//   This is trailing variant v1 (sweep.rs TrailingVariant::Ffma), the naive baseline and the fallback when
//   cuBLAS cannot be opened; v2, the default, is the same update as a cuBLAS SGEMM (strided-batched over heads
//   for a per-head U_col; f32, CUBLAS_DEFAULT_MATH so no TF32), mapped by sweep.rs trailing_cublas_config.
//
// boa_block_kernel: one column block [i1, i2) (≤ 32 columns) of the head-wise BoA sweep for every head at
//   once, rows of a head in a WAVEFRONT (design.md §4.3): at step s thread i (row i of head blockIdx.x)
//   quantizes block column c = s − i, so row i reaches column c exactly one step after row i − 1 did, and
//   all d_h rows run together: d_h + bw − 1 steps per block instead of d_h·bw. Row i at column c first takes
//   the cross-row term of Eq. (12) (Prop. 3.1) from the rows above,
//       cross = Σ_{j<i} F[j, i]·δ_{j,c},   F[j, i] = U_row[j, i] / U_row[j, j],
//       δ_{j,c} = (row j's value at c after the cross-row updates, before its own GPTQ updates) − q_{j,c}
//               = W0[j, c] − cross_{j,c} − q_{j,c}        (W0: the weights before the sweep),
//   then quantizes v = W[i, c] − cross (W holds the row's own GPTQ updates), e = (v − q)/U_col[c, c] and
//   updates its own later block columns. The trailing update of every row is the GEMM above (U_col shared:
//   one GEMM over all n_heads·d_h rows; per head: batched over heads).
//   CPU twin: quant::boa::boa_sweep (row by row; bit-identical order-independence is design.md §4.3's
//   "any order within the grid's partial order"); launcher: launch_boa_sweep; parity test: parity_boa_sweep.
//   Launch: grid n_heads, block 128 (d_h ≤ 128; threads ≥ d_h only join the barriers), static smem 41 KB:
//   w_sh[c][i] (stride 130: in the wavefront, thread i touches column s − i, and an even stride keeps those
//   addresses in distinct banks), δ_sh[c][j] (stride 129: read at (s − i, j), written at (s − i, i)), the
//   U_col block, the codes. One barrier per step. This is BoA block variant v1 (sweep.rs BoaBlockVariant::W32).
//
// boa_block_kernel_d256: the same kernel (one template, boa_block_impl) for heads of 129–256 rows (Gemma 3's
//   d_h = 256): block 256 threads (thread i = row i), column blocks of 16 so the static smem stays under 48 KB
//   (w_sh [16][258] 16.1 KB, δ_sh [16][257] 16.1 KB, U_col block 1.1 KB, codes 4 KB: 37.3 KB); the even W
//   stride 258 keeps the wavefront's addresses in distinct banks as 130 does. Whatever BoaBlockVariant is
//   selected, a head wider than 128 runs this kernel (v2's 128-column tiles of 256 rows would need 420 KB).
//   Depth: 16 + 255 = 271 barrier steps per 16-column block, n/16·271 ≈ 17·n in all against v1's
//   n/32·159 ≈ 5·n at d_h = 128: the wavefront's fill (d_h − 1 steps per block) dominates at this width.
//   Gemma-3-1B's q_proj (4 heads × 256 rows, n = 1152): 72 blocks × 271 = 19.5K steps, ~10–20 ms at v1's
//   per-step estimate (the cross-row dot has up to 255 terms), plus 71 trailing GEMMs of k = 16.
//
// boa_block_kernel_v2 (BoaBlockVariant::W128): the same wavefront over a 128-column block, so a 4096-wide
//   projection takes 32 block launches of d_h + 127 = 255 steps (Σ 8.2K barrier steps) instead of 128 of 159
//   (20.4K), and the trailing GEMMs get k = 128 (4× less W traffic). Same CPU twin and parity test (both
//   variants); the host emulation of both schedules is parity_quant.rs boa_wavefront_emulated.
//   Launch: grid n_heads, block 128, 210 KB DYNAMIC smem (opted in at load; sm_90's 227 KB per block, so
//   1 CTA per SM; devices with less shared memory fall back to v1): w_sh [128][130] 65 KB, δ_sh [128][129]
//   64.5 KB, the U_col block [128][128] 64 KB, col_group of the block 0.5 KB, codes [128][128] 16 KB.
//   Why all in smem: every step reads U_col[c, c..] with a different row c = s − i per lane, uncoalesced from
//   global (32 lines per warp load, ~127 loads per step); the W and δ tiles are rewritten every step. Registers
//   cannot hold them: a lane's column index s − i is a run-time value (local memory).
//   Changes against v1, besides the width: (a) U_col's row stride is 128, not bw + 1: lane i reads
//   u_sh[s − i][s − i + 1 + k], bank (s − i + 1 + k) mod 32 with stride ≡ 0 mod 32, all 32 distinct (v1's
//   stride 33 is 2-way); (b) the block's col_group is staged in smem and the step's global reads (scale,
//   zero, W0: one L2 round trip) are issued before the cross-row dot, so they hide behind it; in v1 they sit
//   on the chain after the dot, col_group → scale as two dependent round trips (~0.5 µs a step); (c) the
//   cross-row dot keeps four partial sums (term j into sum j mod 4), so its dependent FMA chain is i/4 long,
//   not i (a different summation order than v1: rounding-level, ties only), and thread i's column of F
//   (≤ 127 floats, the same at every step) lives in registers: 210 KB of smem leaves ~30 KB of the SM's 256 KB
//   to L1, less than a head's 64 KB of F, so v1's per-term F loads would be L2 round trips here (~250 cycles
//   per 4 terms, ~8K cycles per step).
//   Estimate, 32 heads × 128 rows × 4096 columns: per step the slowest lane (row 127 while it is active) does
//   the cross dot (127 terms: F from registers, δ from smem, 4 independent FMA chains ≈ 150–250 cycles) plus
//   ≤ 127 own-row updates (LDS, LDS, FMUL, FADD, STS each, independent: ~2–3 cycles issue each ≈ 250–400
//   cycles), a divide and the quantizer (~60), the barrier (~40): Σ over the 255 steps of the busiest lane
//   ≈ 48.5K loop iterations ≈ 0.15–0.25 M cycles per block ≈ 0.08–0.13 ms at 1.9 GHz, × 32 blocks ≈ 2.5–4 ms;
//   plus 31 trailing GEMMs with k = 128 (the GPTQ shape: ~1.5 ms at cuBLAS's f32 rate) ⇒ 4–6 ms against
//   v1's 10–22 ms. The widening costs work too: the own-row updates inside a block grow with bw
//   (n·(bw − 1)/2 per row: 65K → 260K), which is why (b) and (c) come with it.
//
// Roofline (7B q_proj, 4096 × 4096): the sweeps are latency-bound (design.md §6): GPTQ has n/128 = 32 block
//   launches of 128 dependent column steps each (~0.1–0.2 µs per step: a divide, a rint, a 128-wide row
//   update from smem) plus 31 trailing GEMMs of 4096 × 128 × (n − i2): rows·n²/2 multiply-adds = 67 GFLOP in
//   all, compute-bound at k = 128 (~32 flop per byte of C traffic): ~1.5 ms at cuBLAS's f32 rate
//   (~45 TFLOP/s), ~3–4 ms for v1 → target ≤ 5 ms. BoA: n/32 = 128 blocks × (d_h + 31) = 159 steps with a
//   barrier and a ≤ 128-long cross-row dot each → ~20K steps, ~10–40 ms at first; its 127 trailing GEMMs
//   have k = 32 (8 flop per byte): bound by W's read + write, Σ 8·rows·(n − i2) B ≈ 8.6 GB ≈ 2 ms at the
//   copy rate for either variant. v2 above widens the block to 128 columns to bring it toward the ≤ 2× GPTQ
//   goal (estimate there).
//
// Variants measured (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`), static
//   grids: gptq_sweep 4096 × 4096 cuBLAS trailing 37.653 ms, FFMA v1 38.978 ms (predicted ≤ 5 ms, the
//   target); 4096 × 11008 cuBLAS 111.201 ms, FFMA 123.831 ms. boa_sweep 32 × 128 × 4096: B32 v1 cuBLAS
//   96.263 ms, FFMA 99.168 ms (predicted 10–22 ms); B128 v2 cuBLAS 72.477 ms, FFMA 74.067 ms (predicted 4–6 ms;
//   goal ≤ 10 ms). The cuBLAS and FFMA trailing rows are close; where the rest of the time goes is not yet
//   profiled. Correct on an H200 (parity tests, 2026-12-04).
//   profiling/quant_core_notes.md has the predictions.
// ptxas (nvcc 13.0, sm_90a / sm_80), 0 spills: gptq_block 40 / 40 regs, 21 KB smem; sweep_trailing_gemm
//   57 / 58 regs, 8 KB; boa_block 51 / 44 regs, 41 KB; boa_block_v2 160 / 255 regs (F's column in
//   registers; 0 B stack), 210 KB dynamic (sm_80 builds it but cannot launch it: 163 KB per block).
// ---------------------------------------------------------------------------------------------------------

#include <stdint.h>

#include "boa_quant.h"

constexpr int kWarpSize = 32;
constexpr int kGptqRows = 32;     // gptq_block: rows (threads) per CTA
constexpr int kGptqMaxBw = 128;   // gptq_block: widest column block; must match GPTQ_MAX_BLOCK in sweep.rs
// gptq_block_kernel_v2: kG2Rows rows per CTA, each row's block columns split over kG2Parts warps; dynamic
// shared memory, byte offsets (multiples of 16).
constexpr uint32_t kG2Rows = 32;
constexpr uint32_t kG2Parts = 4;
constexpr uint32_t kG2Threads = kG2Rows * kG2Parts;
constexpr uint32_t kG2Stride = kG2Rows + 1;   // odd: a warp's column access hits 32 banks
constexpr uint32_t kG2CStride = kG2Rows + 4;
constexpr uint32_t kG2UOff = 0;                                        // float [kGptqMaxBw][kGptqMaxBw]
constexpr uint32_t kG2WOff = kG2UOff + kGptqMaxBw * kGptqMaxBw * 4;    // float [kGptqMaxBw][kG2Stride]
constexpr uint32_t kG2EOff = kG2WOff + kGptqMaxBw * kG2Stride * 4;     // float [kGptqMaxBw][kG2Stride]
constexpr uint32_t kG2GOff = kG2EOff + kGptqMaxBw * kG2Stride * 4;     // uint32 [kGptqMaxBw]
constexpr uint32_t kG2COff = kG2GOff + kGptqMaxBw * 4;                 // uint8 [kGptqMaxBw][kG2CStride]
constexpr uint32_t kG2SmemBytes = kG2COff + kGptqMaxBw * kG2CStride;   // must match GPTQ_V2_SMEM_BYTES
static_assert(kG2SmemBytes == 104448, "sweep.rs GPTQ_V2_SMEM_BYTES");
static_assert(kG2WOff % 16 == 0 && kG2EOff % 16 == 0 && kG2GOff % 16 == 0 && kG2COff % 16 == 0, "smem offsets");
constexpr int kGemmTile = 64;
constexpr int kGemmK = 16;
constexpr int kGemmThreads = 256;
constexpr int kBoaMaxDh = 128;    // boa_block, boa_block_v2: must match BOA_NARROW_DH in sweep.rs
constexpr int kBoaBw = 32;        // boa_block: column block width; must match BOA_BLOCK in sweep.rs
constexpr int kBoaWideDh = 256;   // boa_block_kernel_d256: must match BOA_MAX_DH in sweep.rs
constexpr int kBoaWideBw = 16;    // boa_block_kernel_d256: column block width; must match BOA_BLOCK_WIDE
constexpr int kBoaWStride = kBoaMaxDh + 2;
constexpr int kBoaDStride = kBoaMaxDh + 1;
constexpr int kBoa2Bw = 128;      // boa_block_v2: column block width; must match BOA_BLOCK_V2 in sweep.rs
constexpr int kBoa2UStride = kBoa2Bw;  // ≡ 0 mod 32: conflict-free wavefront reads of U_col (header, (a))
// boa_block_v2's dynamic shared memory, byte offsets (each a multiple of 16).
constexpr uint32_t kBoa2WOff = 0;                                            // float [kBoa2Bw][kBoaWStride]
constexpr uint32_t kBoa2DOff = kBoa2WOff + kBoa2Bw * kBoaWStride * 4;        // float [kBoa2Bw][kBoaDStride]
constexpr uint32_t kBoa2UOff = kBoa2DOff + kBoa2Bw * kBoaDStride * 4;        // float [kBoa2Bw][kBoa2UStride]
constexpr uint32_t kBoa2GOff = kBoa2UOff + kBoa2Bw * kBoa2UStride * 4;       // uint32 [kBoa2Bw]
constexpr uint32_t kBoa2COff = kBoa2GOff + kBoa2Bw * 4;                      // uint8 [kBoa2Bw][kBoaMaxDh]
constexpr uint32_t kBoa2SmemBytes = kBoa2COff + kBoa2Bw * kBoaMaxDh;         // must match BOA_V2_SMEM_BYTES
static_assert(kBoa2SmemBytes == 215040, "sweep.rs BOA_V2_SMEM_BYTES");
static_assert(kBoa2DOff % 16 == 0 && kBoa2UOff % 16 == 0 && kBoa2GOff % 16 == 0 && kBoa2COff % 16 == 0,
              "smem offsets");

// --- device helpers ---------------------------------------------------------------------------------------

// w − e·u rounded as Rust's `w -= e * u` (no fused multiply-add), so the CPU twin's rounding is reproduced.
__device__ __forceinline__ float sub_prod(float w, float e, float u) { return __fsub_rn(w, __fmul_rn(e, u)); }

// --- GPU kernels ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kGptqRows)
gptq_block_kernel(float* __restrict__ w,               // [rows × n] in: W (after earlier blocks' updates)
                  float* __restrict__ q,               // [rows × n] out: Q of block columns
                  uint8_t* __restrict__ codes,         // [rows × n] out: integer codes of block columns
                  float* __restrict__ e,               // [bw × rows] out: E of the block, column-major
                  const float* __restrict__ u,         // [n × n] U_col, upper
                  const float* __restrict__ scales,    // [rows × n_groups]
                  const float* __restrict__ zeros,     // [rows × n_groups]
                  const uint32_t* __restrict__ col_group,  // [n] group of each sweep column
                  float* __restrict__ loss,            // [rows] in/out: += Σ e² over the block's columns
                  const uint32_t rows, const uint32_t n, const uint32_t n_groups, const uint32_t i1,
                  const uint32_t i2, const float maxq) {
    __shared__ float w_sh[kGptqMaxBw][kGptqRows + 1];
    __shared__ uint8_t c_sh[kGptqMaxBw][kGptqRows + 4];
    const uint32_t lane = threadIdx.x, r0 = blockIdx.x * kGptqRows;
    const uint32_t bw = i2 - i1;
    // Coalesced: lanes walk along a row's block columns.
    for (uint32_t rr = 0; rr < kGptqRows && r0 + rr < rows; ++rr)
        for (uint32_t c = lane; c < bw; c += kWarpSize) w_sh[c][rr] = w[(size_t)(r0 + rr) * n + i1 + c];
    __syncwarp();
    const uint32_t r = r0 + lane;
    if (r < rows) {
        float loss_r = 0.0f;  // the report's tr(ΔW H ΔWᵀ) is Σ e² (src/ops/mat.rs `Swept::loss`)
        for (uint32_t c = 0; c < bw; ++c) {
            const uint32_t col = i1 + c;
            const uint32_t g = col_group[col];
            const float s = scales[(size_t)r * n_groups + g], z = zeros[(size_t)r * n_groups + g];
            const float wc = w_sh[c][lane];
            const float qc = boa_quantize(wc, s, z, maxq);     // Alg. 2 l.4
            const float qv = boa_dequantize(qc, s, z);
            const float* u_row = u + (size_t)col * n;
            const float err = (wc - qv) / u_row[col];           // Alg. 2 l.5
            e[(size_t)c * rows + r] = err;
            for (uint32_t c2 = c + 1; c2 < bw; ++c2)            // Alg. 2 l.6 inside the block
                w_sh[c2][lane] = sub_prod(w_sh[c2][lane], err, u_row[i1 + c2]);
            w_sh[c][lane] = qv;
            c_sh[c][lane] = (uint8_t)qc;
            loss_r += err * err;
        }
        loss[r] += loss_r;
    }
    __syncwarp();
    for (uint32_t rr = 0; rr < kGptqRows && r0 + rr < rows; ++rr)
        for (uint32_t c = lane; c < bw; c += kWarpSize) {
            q[(size_t)(r0 + rr) * n + i1 + c] = w_sh[c][rr];
            codes[(size_t)(r0 + rr) * n + i1 + c] = c_sh[c][rr];
        }
}

// gptq_block_kernel_v2 (GptqBlockVariant::Split): the same block as gptq_block_kernel, with each row's
// column updates split over kG2Parts warps and the block's U in shared memory. Part p owns the block columns
// c ≡ p (mod kG2Parts): it alone updates them and, at step c = its column, quantizes them, so every element
// still sees its updates in column order (bit-identical to v1 and the CPU twin). One barrier per step hands
// the step's E column to the other parts (e_sh).
__device__ __forceinline__ uint32_t first_owned(uint32_t c, uint32_t part) {
    return c + ((part + kG2Parts - c % kG2Parts) % kG2Parts);
}

extern "C" __global__ void __launch_bounds__(kG2Threads, 2)
gptq_block_kernel_v2(float* __restrict__ w, float* __restrict__ q, uint8_t* __restrict__ codes,
                     float* __restrict__ e, const float* __restrict__ u, const float* __restrict__ scales,
                     const float* __restrict__ zeros, const uint32_t* __restrict__ col_group,
                     float* __restrict__ loss, const uint32_t rows, const uint32_t n, const uint32_t n_groups,
                     const uint32_t i1, const uint32_t i2, const float maxq) {
    extern __shared__ __align__(16) unsigned char g2_smem[];
    float* u_sh = reinterpret_cast<float*>(g2_smem + kG2UOff);          // [bw][kGptqMaxBw]: U[i1 + c][i1 + c2]
    float* w_sh = reinterpret_cast<float*>(g2_smem + kG2WOff);          // [bw][kG2Stride]: column c, row lane
    float* e_sh = reinterpret_cast<float*>(g2_smem + kG2EOff);          // [bw][kG2Stride]
    uint32_t* cg_sh = reinterpret_cast<uint32_t*>(g2_smem + kG2GOff);   // [bw]
    uint8_t* c_sh = g2_smem + kG2COff;                                   // [bw][kG2CStride]
    const uint32_t t = threadIdx.x, lane = t % kWarpSize, part = t / kWarpSize;
    const uint32_t r0 = blockIdx.x * kG2Rows, bw = i2 - i1;
    const uint32_t live_rows = min(kG2Rows, rows - r0);
    for (uint32_t i = t; i < bw * bw; i += kG2Threads) {
        const uint32_t c = i / bw, c2 = i % bw;
        u_sh[c * kGptqMaxBw + c2] = u[(size_t)(i1 + c) * n + i1 + c2];
    }
    for (uint32_t i = t; i < live_rows * bw; i += kG2Threads) {
        const uint32_t rr = i / bw, c = i % bw;
        w_sh[c * kG2Stride + rr] = w[(size_t)(r0 + rr) * n + i1 + c];
    }
    for (uint32_t c = t; c < bw; c += kG2Threads) cg_sh[c] = col_group[i1 + c];
    __syncthreads();
    const uint32_t r = r0 + lane;
    const bool live = lane < live_rows;
    uint32_t g_cur = 0xffffffffu;  // the owner's grid, reloaded only when the column's group changes
    float s = 0.0f, z = 0.0f;
    for (uint32_t c = 0; c < bw; ++c) {
        if (c % kG2Parts == part && live) {  // warp-uniform owner test
            const uint32_t g = cg_sh[c];
            if (g != g_cur) {
                g_cur = g;
                s = scales[(size_t)r * n_groups + g];
                z = zeros[(size_t)r * n_groups + g];
            }
            const float wc = w_sh[c * kG2Stride + lane];
            const float qc = boa_quantize(wc, s, z, maxq);        // Alg. 2 l.4
            const float qv = boa_dequantize(qc, s, z);
            const float err = (wc - qv) / u_sh[c * kGptqMaxBw + c];  // Alg. 2 l.5
            e_sh[c * kG2Stride + lane] = err;
            w_sh[c * kG2Stride + lane] = qv;
            c_sh[c * kG2CStride + lane] = (uint8_t)qc;
        }
        __syncthreads();
        if (live) {  // Alg. 2 l.6 inside the block, this part's columns
            const float err = e_sh[c * kG2Stride + lane];
            const float* u_row = u_sh + c * kGptqMaxBw;
#pragma unroll 4
            for (uint32_t c2 = first_owned(c + 1, part); c2 < bw; c2 += kG2Parts)
                w_sh[c2 * kG2Stride + lane] = sub_prod(w_sh[c2 * kG2Stride + lane], err, u_row[c2]);
        }
    }
    __syncthreads();
    if (part == 0 && live) {  // Σ e² in column order, as v1 sums it
        float loss_r = 0.0f;
        for (uint32_t c = 0; c < bw; ++c) {
            const float err = e_sh[c * kG2Stride + lane];
            loss_r += err * err;
        }
        loss[r] += loss_r;
    }
    if (live)
        for (uint32_t c = part; c < bw; c += kG2Parts) e[(size_t)c * rows + r] = e_sh[c * kG2Stride + lane];
    for (uint32_t i = t; i < live_rows * bw; i += kG2Threads) {
        const uint32_t rr = i / bw, c = i % bw;
        q[(size_t)(r0 + rr) * n + i1 + c] = w_sh[c * kG2Stride + rr];
        codes[(size_t)(r0 + rr) * n + i1 + c] = c_sh[c * kG2CStride + rr];
    }
}

extern "C" __global__ void __launch_bounds__(kGemmThreads)
sweep_trailing_gemm_kernel(float* __restrict__ c,        // [rows × ncol], row stride ldc: C −= Eᵀ·B
                           const float* __restrict__ et,  // [k × rows], row stride lda (E transposed)
                           const float* __restrict__ b,   // [k × ncol], row stride ldb
                           const uint32_t rows, const uint32_t ncol, const uint32_t k, const uint32_t ldc,
                           const uint32_t lda, const uint32_t ldb,
                           const uint64_t c_bs, const uint64_t a_bs, const uint64_t b_bs) {  // per-z offsets
    __shared__ float a_sh[kGemmK][kGemmTile];
    __shared__ float b_sh[kGemmK][kGemmTile];
    c += c_bs * blockIdx.z;
    et += a_bs * blockIdx.z;
    b += b_bs * blockIdx.z;
    const uint32_t r0 = blockIdx.y * kGemmTile, c0 = blockIdx.x * kGemmTile;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // thread owns rows ty + 16a, cols tx + 16b
    float acc[4][4] = {};
    for (uint32_t k0 = 0; k0 < k; k0 += kGemmK) {
        for (int e = threadIdx.x; e < kGemmK * kGemmTile; e += kGemmThreads) {
            const int kk = e / kGemmTile, x = e % kGemmTile;
            const bool kin = k0 + kk < k;
            a_sh[kk][x] = (kin && r0 + x < rows) ? et[(size_t)(k0 + kk) * lda + r0 + x] : 0.f;
            b_sh[kk][x] = (kin && c0 + x < ncol) ? b[(size_t)(k0 + kk) * ldb + c0 + x] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kGemmK; ++kk) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = a_sh[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) bv[j] = b_sh[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t r = r0 + ty + 16 * i, col = c0 + tx + 16 * j;
            if (r < rows && col < ncol) c[(size_t)r * ldc + col] -= acc[i][j];
        }
}

// boa_block_kernel's body for heads of up to kDh rows (= threads) and column blocks of kBw: the one code of
// both its instantiations (style.md: one copy, variants by template).
template <int kDh, int kBw>
__device__ __forceinline__ void boa_block_impl(
    float* __restrict__ w,              // [n_heads·d_h × n] in: W with earlier blocks' own updates
    const float* __restrict__ w0,       // [n_heads·d_h × n] the weights before the sweep
    float* __restrict__ q,              // [n_heads·d_h × n] out: Q of block columns
    uint8_t* __restrict__ codes,        // [n_heads·d_h × n] out
    float* __restrict__ e,              // [bw × n_heads·d_h] out: E of the block, column-major
    const float* __restrict__ u_col,    // [n × n] shared, or [n_heads × n × n] per head
    const uint64_t u_head_stride,       // 0 (shared U_col) or n² (per head)
    const float* __restrict__ f_row,    // [n_heads × d_h × d_h]: F[j, i] = U_row[j, i]/U_row[j, j]
    const float* __restrict__ scales,   // [n_heads·d_h × n_groups]
    const float* __restrict__ zeros,    // [n_heads·d_h × n_groups]
    const uint32_t* __restrict__ col_group,  // [n]
    const uint32_t d_h, const uint32_t n, const uint32_t n_groups, const uint32_t i1,
    const uint32_t i2, const float maxq) {  // i2 − i1 ≤ kBw, d_h ≤ kDh = blockDim.x
    __shared__ float w_sh[kBw][kDh + 2];   // own-updated W of the block; Q once quantized (even stride: header)
    __shared__ float dl_sh[kBw][kDh + 1];  // δ_{j,c}
    __shared__ float u_sh[kBw][kBw + 1];   // U_col[i1.., i1..] block
    __shared__ uint8_t c_sh[kBw][kDh];
    const uint32_t head = blockIdx.x, tid = threadIdx.x, bw = i2 - i1;
    const uint32_t rows_total = gridDim.x * d_h, row0 = head * d_h;
    const float* uc = u_col + u_head_stride * head;
    const float* f = f_row + (size_t)head * d_h * d_h;
    for (uint32_t x = tid; x < d_h * bw; x += blockDim.x) {
        const uint32_t i = x / bw, c = x % bw;
        w_sh[c][i] = w[(size_t)(row0 + i) * n + i1 + c];
    }
    for (uint32_t x = tid; x < bw * bw; x += blockDim.x) {
        const uint32_t a = x / bw, b = x % bw;
        u_sh[a][b] = uc[(size_t)(i1 + a) * n + i1 + b];
    }
    __syncthreads();
    const uint32_t i = tid;
    for (uint32_t s = 0; s + 1 < bw + d_h; ++s) {
        const int c = (int)s - (int)i;
        if (i < d_h && c >= 0 && c < (int)bw) {
            float cross = 0.f;  // Eq. (12), the rows above at this column
            for (uint32_t j = 0; j < i; ++j) cross += f[(size_t)j * d_h + i] * dl_sh[c][j];
            const uint32_t col = i1 + c, r = row0 + i;
            const uint32_t g = col_group[col];
            const float sc = scales[(size_t)r * n_groups + g], z = zeros[(size_t)r * n_groups + g];
            const float v = w_sh[c][i] - cross;
            const float qc = boa_quantize(v, sc, z, maxq);
            const float qv = boa_dequantize(qc, sc, z);
            const float err = (v - qv) / u_sh[c][c];
            e[(size_t)c * rows_total + r] = err;
            dl_sh[c][i] = (w0[(size_t)r * n + col] - cross) - qv;
            for (uint32_t c2 = c + 1; c2 < bw; ++c2) w_sh[c2][i] = sub_prod(w_sh[c2][i], err, u_sh[c][c2]);
            w_sh[c][i] = qv;
            c_sh[c][i] = (uint8_t)qc;
        }
        __syncthreads();
    }
    for (uint32_t x = tid; x < d_h * bw; x += blockDim.x) {
        const uint32_t ii = x / bw, c = x % bw;
        q[(size_t)(row0 + ii) * n + i1 + c] = w_sh[c][ii];
        codes[(size_t)(row0 + ii) * n + i1 + c] = c_sh[c][ii];
    }
}


extern "C" __global__ void __launch_bounds__(kBoaMaxDh)
boa_block_kernel(float* __restrict__ w, const float* __restrict__ w0, float* __restrict__ q,
                 uint8_t* __restrict__ codes, float* __restrict__ e, const float* __restrict__ u_col,
                 const uint64_t u_head_stride, const float* __restrict__ f_row, const float* __restrict__ scales,
                 const float* __restrict__ zeros, const uint32_t* __restrict__ col_group, const uint32_t d_h,
                 const uint32_t n, const uint32_t n_groups, const uint32_t i1, const uint32_t i2,
                 const float maxq) {  // arguments as boa_block_impl's; d_h ≤ 128, i2 − i1 ≤ 32
    boa_block_impl<kBoaMaxDh, kBoaBw>(w, w0, q, codes, e, u_col, u_head_stride, f_row, scales, zeros, col_group,
                                      d_h, n, n_groups, i1, i2, maxq);
}

extern "C" __global__ void __launch_bounds__(kBoaWideDh)
boa_block_kernel_d256(float* __restrict__ w, const float* __restrict__ w0, float* __restrict__ q,
                      uint8_t* __restrict__ codes, float* __restrict__ e, const float* __restrict__ u_col,
                      const uint64_t u_head_stride, const float* __restrict__ f_row,
                      const float* __restrict__ scales, const float* __restrict__ zeros,
                      const uint32_t* __restrict__ col_group, const uint32_t d_h, const uint32_t n,
                      const uint32_t n_groups, const uint32_t i1, const uint32_t i2,
                      const float maxq) {  // arguments as boa_block_impl's; 128 < d_h ≤ 256, i2 − i1 ≤ 16
    boa_block_impl<kBoaWideDh, kBoaWideBw>(w, w0, q, codes, e, u_col, u_head_stride, f_row, scales, zeros,
                                           col_group, d_h, n, n_groups, i1, i2, maxq);
}

extern "C" __global__ void __launch_bounds__(kBoaMaxDh, 1)
boa_block_kernel_v2(float* __restrict__ w,              // [n_heads·d_h × n] in: W after earlier blocks' updates
                    const float* __restrict__ w0,       // [n_heads·d_h × n] the weights before the sweep
                    float* __restrict__ q,              // [n_heads·d_h × n] out: Q of block columns
                    uint8_t* __restrict__ codes,        // [n_heads·d_h × n] out
                    float* __restrict__ e,              // [bw × n_heads·d_h] out: E of the block, col-major
                    const float* __restrict__ u_col,    // [n × n] shared, or [n_heads × n × n] per head
                    const uint64_t u_head_stride,       // 0 (shared U_col) or n² (per head)
                    const float* __restrict__ f_row,    // [n_heads × d_h × d_h]: F = U_row[j,i]/U_row[j,j]
                    const float* __restrict__ scales,   // [n_heads·d_h × n_groups]
                    const float* __restrict__ zeros,    // [n_heads·d_h × n_groups]
                    const uint32_t* __restrict__ col_group,  // [n]
                    const uint32_t d_h, const uint32_t n, const uint32_t n_groups, const uint32_t i1,
                    const uint32_t i2, const float maxq) {  // i2 − i1 ≤ kBoa2Bw, d_h ≤ kBoaMaxDh = blockDim.x
    extern __shared__ __align__(16) unsigned char boa2_smem[];  // kBoa2SmemBytes, opted in by the launcher
    float(*w_sh)[kBoaWStride] = reinterpret_cast<float(*)[kBoaWStride]>(boa2_smem + kBoa2WOff);
    float(*dl_sh)[kBoaDStride] = reinterpret_cast<float(*)[kBoaDStride]>(boa2_smem + kBoa2DOff);
    float(*u_sh)[kBoa2UStride] = reinterpret_cast<float(*)[kBoa2UStride]>(boa2_smem + kBoa2UOff);
    uint32_t* g_sh = reinterpret_cast<uint32_t*>(boa2_smem + kBoa2GOff);
    uint8_t(*c_sh)[kBoaMaxDh] = reinterpret_cast<uint8_t(*)[kBoaMaxDh]>(boa2_smem + kBoa2COff);
    const uint32_t head = blockIdx.x, tid = threadIdx.x, bw = i2 - i1;
    const uint32_t rows_total = gridDim.x * d_h, row0 = head * d_h;
    const float* uc = u_col + u_head_stride * head;
    const float* f = f_row + (size_t)head * d_h * d_h;
    // Coalesced: consecutive threads walk along a row of W (resp. U_col) inside the block.
    for (uint32_t x = tid; x < d_h * bw; x += blockDim.x) {
        const uint32_t i = x / bw, c = x % bw;
        w_sh[c][i] = w[(size_t)(row0 + i) * n + i1 + c];
    }
    for (uint32_t x = tid; x < bw * bw; x += blockDim.x) {
        const uint32_t a = x / bw, b = x % bw;
        u_sh[a][b] = uc[(size_t)(i1 + a) * n + i1 + b];
    }
    for (uint32_t c = tid; c < bw; c += blockDim.x) g_sh[c] = col_group[i1 + c];
    __syncthreads();
    const uint32_t i = tid, r = row0 + i;
    // Column i of F in registers (header, (c)): F[j, i] is the same at every step of the row. Compile-time
    // indices only (unrolled, early exits), so the array stays in registers; lanes read one coalesced row of F
    // per j. Threads i ≥ d_h load nothing (their column would run past the head's F).
    const uint32_t i_f = i < d_h ? i : 0;
    float f_reg[kBoaMaxDh];
#pragma unroll
    for (uint32_t j = 0; j < kBoaMaxDh; ++j) f_reg[j] = j < i_f ? f[(size_t)j * d_h + i] : 0.f;
    for (uint32_t s = 0; s + 1 < bw + d_h; ++s) {
        const int c = (int)s - (int)i;
        if (i < d_h && c >= 0 && c < (int)bw) {
            const uint32_t col = i1 + c;
            // Off the chain: issued before the dot, used after it (header, (b)).
            const uint32_t g = g_sh[c];
            const float sc = scales[(size_t)r * n_groups + g], z = zeros[(size_t)r * n_groups + g];
            const float w0v = w0[(size_t)r * n + col];
            // Eq. (12), the rows above at this column, term j into partial sum j mod 4 (header, (c)).
            const float* dl = dl_sh[c];
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (uint32_t j = 0; j < kBoaMaxDh; ++j) {
                if (j >= i) break;
                acc[j % 4] = fmaf(f_reg[j], dl[j], acc[j % 4]);
            }
            const float cross = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            const float v = w_sh[c][i] - cross;
            const float qc = boa_quantize(v, sc, z, maxq);
            const float qv = boa_dequantize(qc, sc, z);
            const float* u_c = u_sh[c];
            const float err = (v - qv) / u_c[c];
            e[(size_t)c * rows_total + r] = err;
            dl_sh[c][i] = (w0v - cross) - qv;
            for (uint32_t c2 = c + 1; c2 < bw; ++c2) w_sh[c2][i] = sub_prod(w_sh[c2][i], err, u_c[c2]);
            w_sh[c][i] = qv;
            c_sh[c][i] = (uint8_t)qc;
        }
        __syncthreads();
    }
    for (uint32_t x = tid; x < d_h * bw; x += blockDim.x) {
        const uint32_t ii = x / bw, c = x % bw;
        q[(size_t)(row0 + ii) * n + i1 + c] = w_sh[c][ii];
        codes[(size_t)(row0 + ii) * n + i1 + c] = c_sh[c][ii];
    }
}

// ---------------------------------------------------------------------------------------------------------
// gather_cols_kernel: out [rows × len] = W[:, c0 : c0 + len] of W [rows × n] — the current weights of one
//   group, copied out for the host's dynamic grid search (sweep.rs launch_gptq_sweep_dynamic) when the sweep
//   reaches the group's first column.
// Launch shape: grid (⌈len/32⌉, ⌈rows/8⌉), block (32, 8): a warp reads 32 consecutive columns of one row.
// Roofline: 8 B per element; a 4096-row, 128-column group is 4 MB ≈ 1 µs of bandwidth: launch-bound, and the
//   download plus host search that follow dominate.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
gather_cols_kernel(float* __restrict__ out,      // [rows × len]
                   const float* __restrict__ w,  // [rows × n]
                   const uint32_t rows, const uint32_t n, const uint32_t c0, const uint32_t len) {
    const uint32_t j = blockIdx.x * 32 + threadIdx.x;
    const uint32_t r = blockIdx.y * 8 + threadIdx.y;
    if (r < rows && j < len && c0 + j < n) out[(size_t)r * len + j] = w[(size_t)r * n + c0 + j];
}
