// hessian.cu — Hessian statistics of the quantization core (design.md §4.2–4.3, §6 "Hessian accumulation").
//
// ---------------------------------------------------------------------------------------------------------
// hessian_xxt: H [d × d] += Xᵀ X, X [m × d] (one token per row, row stride ld), batched over blockIdx.z with
//   element offsets x_bs (into X) and h_bs (into H). One launch covers:
//     - GPTQ's H = Σ x xᵀ (ld = d, batch 1),
//     - the per-head covariances Σ_t k_{t,h} k_{t,h}ᵀ of post-RoPE Q or K (ld = n_heads·d_h, x_bs = d_h,
//       h_bs = d_h², batch n_heads),
//     - the Gram (A_h X)ᵀ(A_h X) of v_col below.
//   CPU twin: quant::hessian::hessian_xxt (cpu_quant.rs); launcher: launch_hessian_xxt (backend/cuda/hessian.rs);
//   parity test: parity_xxt_accumulate / parity_head_covariance (tests/parity_quant.rs).
//
// Launch shapes:
//   v1 f32 tiled     grid (ceil(d/16), ceil(d/16), batch), block 16×16: the textbook shared-memory SGEMM tile
//                    over 16 tokens at a time, every output element, f32 FFMA. The exact baseline.
//   v2 bf16 wmma     grid (T(T+1)/2, 1, batch) with T = ceil(d/64), block 128 (4 warps): only the tiles of the
//                    upper triangle (tile row ≤ tile column); each 64×64 output tile is 2×2 warps of 32×32,
//                    each warp 2×2 wmma 16×16×16 bf16 fragments with f32 accumulators. X is read as f32,
//                    rounded to bf16 on the way into shared memory (32 tokens × 64 columns per operand per
//                    stage); off-diagonal tiles are added to both H[i, j] and the mirror H[j, i].
//
//        tiles of H (T = 4):   [0 1 2 3]      block b ↦ (ti, tj) row by row through the upper triangle;
//                              [. 4 5 6]      the '.' tiles are written by the mirror of their transpose.
//                              [. . 7 8]
//                              [. . . 9]
//
// Roofline (H200: ~990 TFLOP/s dense bf16, ~4.8 TB/s): XᵀX over N = 128×2048 tokens at d = 4096 is
//   N·d²  = 4.4 TFLOP (half of it with the triangle) → ≈ 2.2 ms of tensor-core time, while reading X costs
//   N·d·4 B = 4.3 GB → ≈ 0.9 ms (each X tile is read by T/2 tile columns, mostly from L2). Compute-bound at
//   the tensor-core rate only with a deeper pipeline than v2 has (no cp.async, one stage): expect v2 well
//   under the ceiling; the bench reports the fraction.
//
// Variants measured: v1 and v2 correct on an H200 (parity tests, 2026-12-04: max rel. error vs f64, XᵀX v1
//   3.4e-7, v2 and cuBLAS ≤ 3.3e-3; head covariances v1 1.5e-7, bf16 ≤ 2.2e-3); their speed not measured yet.
//   The default Gram is neither kernel but cuBLAS bf16 (XxtVariant::Cublas, gemm.rs gram_bf16), timed
//   (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`) at m = 2048:
//   stat_xxt d = 4096 0.161 ms, 427.6 TFLOP/s; d = 11008 0.873 ms, 568.4 TFLOP/s; stat_head_cov, 32 heads of
//   d_h = 128, 0.053 ms, 40.7 TFLOP/s. The roofline above assumes ~990 TFLOP/s; the full Grams reached
//   427.6–568.4 (ceiling.cu's mma.sync ceiling: 650.35 TFLOP/s). Record each measurement here with card and date.
// ptxas (nvcc 13.0, sm_90a / sm_80), 0 spills everywhere: v1 32 regs, 2.2 KB smem; v2 117 / 118 regs (the
//   (128, 4) launch bound; without the min-blocks hint ptxas spilled 4 B on sm_90a), 26 KB smem.
// ---------------------------------------------------------------------------------------------------------
// v_col: per query head h, G_h [d × d] = (A_h X)ᵀ (A_h X), A_h = causal softmax(Q_h K_hᵀ/√d_h) [t × t],
//   X [t × d], Q [t × h·d_h], K [t × h_kv·d_h] (query head h reads KV head h / (h/h_kv)), d_h ≤ 256. With a
//   sliding window (Mistral, Gemma 3's local layers) A_h keeps only keys i − window < j ≤ i of query i: the
//   stats sum over those, attn_x masks the rest and skips the key tiles before its first row's window. Each
//   attn_x variant has two instantiations by the head dim its tiles hold (kDh): 128 (the Llama family) and 256
//   (attn_x_kernel_v1_d256, attn_x_kernel_v2[_bf16]_d256: Gemma 3), in dynamic smem. Three kernels:
//     softmax_stats_kernel  grid ceil(t·h/4), block 128: one warp per (head, query row): the row's max and
//                           Σ exp(s − max) over the causal (windowed) keys (scores recomputed, never stored);
//     attn_x_kernel_v1      grid (ceil(d/64), ceil(t/32)), block 256, 44.3 KB dynamic smem (76.3 KB at kDh =
//                           256, opted in at load): Y = A_h X for one head,
//                           flash-attention style: per 32-key tile the 32×32 probabilities are formed in shared
//                           memory from the stats and multiplied into the 32×64 output tile, f32 FFMA; A_h never
//                           reaches global memory (only Y [t × d], one head at a time). The exact baseline.
//     attn_x_kernel_v2      grid (ceil(d/256), ceil(t/64)) (heaviest causal row tile first), block 256 (8 warps),
//                           93.5 KB dynamic smem (opted in at load; 2 CTAs per SM; 125.5 KB at kDh = 256, one
//                           CTA per SM): per 64-key tile j ≤ i,
//                           S = Q_i K_jᵀ on tensor cores (fp16 operands, f32 accumulate) → f32 smem → P =
//                           exp(S/√d_h − m_i)/l_i masked, bf16 smem → acc[64 × 256] += P X_j (bf16 X, f32
//                           accumulate in registers). smem: Q 17 KB + K 17 KB (fp16, d_h padded to 128; 33 KB
//                           each at 256) + S 17 KB + P 9 KB + X 33 KB (bf16) + stats; the output tile is staged through the
//                           same bytes for a guarded store. One copy of the tile, no cp.async pipeline: the
//                           second CTA on the SM hides the staging.
//     hessian_xxt           the Gram of Y into G_h.
//   CPU twin: cpu_quant.rs v_col_covariance (attention probabilities, then faer GEMMs); launcher:
//   launch_v_col (backend/cuda/hessian.rs); parity test: parity_v_col_covariance.
//
// Roofline (7B, one sequence t = 2048, d = 4096, 32 heads): A_h X is t²·d (causal: half) = 17 GFLOP per head,
//   the Gram t·d² = 34 GFLOP per head → ≈ 1.6 TFLOP per sequence, 210 TFLOP for 128 sequences per layer.
//   At tensor-core rate ≈ 0.2 s per layer. attn_x v1 is f32 FFMA (~60 TFLOP/s on an H200) and recomputes the
//   scores once per 64-column tile (d/64 × t²·d_h/2 = twice A_h X): 51 GFLOP per head per sequence, ~140 TFLOP
//   of FFMA per 7B layer, seconds per layer.
//   attn_x v2 per head per sequence (t = 2048, d = 4096, d_h = 128): 528 causal 64×64 tiles × 16 column tiles
//   × (scores 2·64·64·128 + P·X 2·64·64·256) = 26.6 GFLOP executed for 17.2 useful (the diagonal tiles and
//   the scores, recomputed per 256 columns, are the overhead), 109 TFLOP per 7B layer: 0.11 s at the dense
//   bf16 peak (~990 TFLOP/s). Bytes: each CTA stage reads X 64 KB + K 32 KB of f32 (L2-resident: X is 32 MB per
//   sequence), 0.83 GB per head, 3.4 TB per layer ≈ 0.35 s at ~10 TB/s of L2: v2 is bound by the L2 → smem
//   staging, not the tensor cores; expect ~25–35% of the bf16 ceiling (the bench reports it). Next steps if
//   it matters: X converted to bf16 once per sequence (half the dominant bytes, 16-byte cp.async), a
//   double-buffered cp.async pipeline, mma.sync with P kept in registers (no S/P round trip through smem).
//   Gemma-3-1B-like layer (t = 2048, d = 1152, 4 query heads over 1 KV head, d_h = 256; 128 sequences): the
//   Gram t·d² = 2.7 GFLOP per head and sequence dominates A_h X's t²·d/2 = 2.4 GFLOP; a local layer (window 512)
//   cuts A_h X to ≈ t·512·d = 1.2 GFLOP (its key tiles before the window are skipped). ≈ 2.6 TFLOP per global
//   layer → a few ms at the tensor-core rate.
//   Variants measured (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`), t = 2048,
//   d = 4096, d_h = 128, one head per launch: attn_x v1 5.158 ms, 3.435 TFLOP/s (0.5% of ceiling.cu's
//   650.35 TFLOP/s mma.sync ceiling); v2 0.417 ms, 42.514 TFLOP/s (6.5%; predicted ~25–35% above). stat_v_col
//   on v2 + the cuBLAS Gram (4 of 32 heads): 7.148 ms wall per call. In a 7B-shaped BoA 3-bit run (H200,
//   2026-12-04, `run --profile`, 128 × 2048 tokens) V's per-head H_col took 6.58 s per block on the v2 path,
//   against ≈ 0.2 s per layer at the tensor-core rate above; v3 (attn_probs_bf16 below) took 0.73–0.79 s.
//   Correct on an H200 (parity tests, 2026-12-04: v_col max rel. error 3.2e-7 f32, ≤ 3.0e-3 bf16).
// ptxas (nvcc 13.0, sm_90a / sm_80), 0 spills: softmax_stats 32 / 40 regs, 4 KB smem; attn_x v1 64 / 48 regs
//   (both kDh), 44.3 / 76.3 KB dynamic smem; attn_x v2 128 / 128 regs (the (256, 2) launch bound's cap), 93.5 /
//   125.5 KB dynamic smem.
// ---------------------------------------------------------------------------------------------------------

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

// --- device helpers ---------------------------------------------------------------------------------------

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

constexpr int kXxtV1Tile = 16;      // v1: output tile edge = tokens per stage
constexpr int kXxtV2Tile = 64;      // v2: output tile edge
constexpr int kXxtV2K = 32;         // v2: tokens per shared-memory stage
constexpr int kXxtV2Threads = 128;  // v2: 4 warps, 2×2 of 32×32
constexpr int kXxtV2Pad = 8;        // bf16 elements of row padding (keeps wmma's 32-byte alignment, spreads banks)
constexpr int kXxtV2CPad = 4;       // f32 padding of the accumulator staging tile

constexpr int kStatsWarps = 4;      // softmax_stats: warps (= query rows) per block
constexpr int kMaxDh = 256;         // largest head dimension the attention kernels take (Gemma 3)
constexpr int kNarrowDh = 128;      // attn_x: head dims ≤ this take the narrow instantiation (smaller smem)
constexpr int kAxRows = 32;         // attn_x: query rows per block
constexpr int kAxKeys = 32;         // attn_x: keys per stage
constexpr int kAxCols = 64;         // attn_x: columns of X / Y per block
constexpr int kAxThreads = 256;

// attn_x v2 (bf16 wmma). Rows × keys × columns per CTA = 64 × 64 × 256: the score tile Q_i K_jᵀ costs
// 64·64·d_h MACs per key tile against 64·64·256 for P·X, so recomputing the scores for each of the d/256 column
// tiles adds d_h/256 = ½ of the useful work (v1, 64 columns: 2×).
constexpr int kAx2Rows = 64;        // query rows per CTA (= keys per stage, so only the last key tile is diagonal)
constexpr int kAx2Keys = 64;        // keys per stage
constexpr int kAx2Cols = 256;       // columns of X / Y per CTA (= threads: one column per thread when staging)
constexpr int kAx2Threads = 256;    // 8 warps
constexpr int kAx2SLd = kAx2Keys + 4;      // f32 row stride of the score tile
constexpr int kAx2PLd = kAx2Keys + 8;      // bf16 row stride of the probability tile
constexpr int kAx2XLd = kAx2Cols + 8;      // bf16 row stride of the X tile
constexpr int kAx2YLd = kAx2Cols + 4;      // f32 row stride of the output staging tile (aliases the others)
// attn_x v2's dynamic shared memory for head dims padded to kDh (128 or 256): byte offsets, every one a multiple
// of 32 B (wmma's pointer alignment).
template <int kDh>
struct Ax2Layout {
    static constexpr int kQkLd = kDh + 8;  // fp16 row stride of q_sh / k_sh (16 B pad: rows start 4 banks apart)
    static constexpr int kQOff = 0;
    static constexpr int kKOff = kQOff + kAx2Rows * kQkLd * 2;
    static constexpr int kSOff = kKOff + kAx2Keys * kQkLd * 2;
    static constexpr int kPOff = kSOff + kAx2Rows * kAx2SLd * 4;
    static constexpr int kXOff = kPOff + kAx2Rows * kAx2PLd * 2;
    static constexpr int kStatOff = kXOff + kAx2Keys * kAx2XLd * 2;
    static constexpr int kBytes = kStatOff + 2 * kAx2Rows * 4;
    static_assert(kKOff % 32 == 0 && kSOff % 32 == 0 && kPOff % 32 == 0 && kXOff % 32 == 0 && kStatOff % 32 == 0,
                  "wmma needs 32-byte aligned tile bases");
    static_assert(kAx2Rows * kAx2YLd * 4 <= kBytes, "the output staging tile must fit the aliased buffers");
};
// 95 744 B: two CTAs fit an SM (228 KB); 128 512 B at kDh = 256: one per SM (sm_80: 163 KB per block).
static_assert(Ax2Layout<kNarrowDh>::kBytes == 95744, "hessian.rs AX2_SMEM_BYTES");
static_assert(Ax2Layout<kMaxDh>::kBytes == 128512, "hessian.rs AX2_SMEM_BYTES_WIDE");

// attn_x v1's dynamic shared memory (f32): q [kAxRows][kDh], k [kAxKeys][kDh + 1], p [kAxRows][kAxKeys + 1],
// x [kAxKeys][kAxCols]. 45 312 B at kDh = 128 (no opt-in needed), 78 080 B at 256.
template <int kDh>
struct Ax1Layout {
    static constexpr int kQOff = 0;  // in floats
    static constexpr int kKOff = kQOff + kAxRows * kDh;
    static constexpr int kPOff = kKOff + kAxKeys * (kDh + 1);
    static constexpr int kXOff = kPOff + kAxRows * (kAxKeys + 1);
    static constexpr int kBytes = (kXOff + kAxKeys * kAxCols) * 4;
};
static_assert(Ax1Layout<kNarrowDh>::kBytes == 45312, "hessian.rs AX1_SMEM_BYTES");
static_assert(Ax1Layout<kMaxDh>::kBytes == 78080, "hessian.rs AX1_SMEM_BYTES_WIDE");
static_assert(kAx2Rows == kAx2Keys, "the causal loop bound assumes aligned query and key tiles");
static_assert(kAx2Cols == kAx2Threads, "X staging maps one column per thread");
static_assert(kAx2Threads == 8 * kWarpSize, "the warp tiling below is for 8 warps");

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o /= 2) v += __shfl_xor_sync(kFullMask, v, o);
    return v;
}

// (ti, tj), ti ≤ tj, of the b-th tile of the upper triangle of a T×T tile grid, row by row.
__device__ __forceinline__ void upper_tile(uint32_t b, uint32_t T, uint32_t& ti, uint32_t& tj) {
    ti = 0;
    while (b >= T - ti) {
        b -= T - ti;
        ++ti;
    }
    tj = ti + b;
}

// --- GPU kernels ------------------------------------------------------------------------------------------

// v1: f32 shared-memory tiles, every element of H (a direct GEMM; exact up to f32 summation order).
extern "C" __global__ void __launch_bounds__(kXxtV1Tile * kXxtV1Tile)
hessian_xxt_kernel_v1(float* __restrict__ h,        // [batch × d × d] accumulated (+=), row-major
                      const float* __restrict__ x,  // [m × ld] row-major; batch z reads columns x_bs·z ..
                      const uint32_t m,             // tokens
                      const uint32_t d,             // columns per batch entry (H is d × d)
                      const uint32_t ld,            // row stride of X, ≥ d
                      const uint64_t x_bs,          // element offset of batch entry z in X, per z
                      const uint64_t h_bs) {        // element offset of batch entry z in H, per z
    __shared__ float a_sh[kXxtV1Tile][kXxtV1Tile + 1];  // [token][row i]
    __shared__ float b_sh[kXxtV1Tile][kXxtV1Tile + 1];  // [token][col j]
    x += x_bs * blockIdx.z;
    h += h_bs * blockIdx.z;
    const uint32_t tx = threadIdx.x, ty = threadIdx.y;
    const uint32_t i0 = blockIdx.y * kXxtV1Tile, j0 = blockIdx.x * kXxtV1Tile;
    float acc = 0.f;
    for (uint32_t k0 = 0; k0 < m; k0 += kXxtV1Tile) {
        const uint32_t k = k0 + ty;
        a_sh[ty][tx] = (k < m && i0 + tx < d) ? x[(size_t)k * ld + i0 + tx] : 0.f;
        b_sh[ty][tx] = (k < m && j0 + tx < d) ? x[(size_t)k * ld + j0 + tx] : 0.f;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kXxtV1Tile; ++kk) acc += a_sh[kk][ty] * b_sh[kk][tx];
        __syncthreads();
    }
    const uint32_t i = i0 + ty, j = j0 + tx;
    if (i < d && j < d) h[(size_t)i * d + j] += acc;
}

// v2: bf16 tensor cores (wmma m16n16k16, f32 accumulate), upper-triangle tiles only, mirrored on the way out.
extern "C" __global__ void __launch_bounds__(kXxtV2Threads, 4)  // the min-blocks hint avoids a 4-byte spill ptxas makes on sm_90a without it
hessian_xxt_kernel_v2(float* __restrict__ h,        // [batch × d × d] accumulated (+=), row-major
                      const float* __restrict__ x,  // [m × ld] row-major f32 (rounded to bf16 on load)
                      const uint32_t m, const uint32_t d, const uint32_t ld, const uint64_t x_bs,
                      const uint64_t h_bs) {        // as v1
    using namespace nvcuda;
    constexpr int kLd = kXxtV2Tile + kXxtV2Pad;
    constexpr int kCLd = kXxtV2Tile + kXxtV2CPad;
    __shared__ __align__(32) __nv_bfloat16 a_sh[kXxtV2K][kLd];  // [token][i − i0]: A = Xᵀ tile, col-major
    __shared__ __align__(32) __nv_bfloat16 b_sh[kXxtV2K][kLd];  // [token][j − j0]: B = X tile, row-major
    __shared__ __align__(32) float c_sh[kXxtV2Tile][kCLd];      // accumulator staging for the guarded store
    x += x_bs * blockIdx.z;
    h += h_bs * blockIdx.z;
    const uint32_t T = (d + kXxtV2Tile - 1) / kXxtV2Tile;
    uint32_t ti, tj;
    upper_tile(blockIdx.x, T, ti, tj);
    const uint32_t i0 = ti * kXxtV2Tile, j0 = tj * kXxtV2Tile;
    const int warp = threadIdx.x / kWarpSize;
    const int wr = (warp / 2) * 32, wc = (warp % 2) * 32;  // this warp's 32×32 sub-tile

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b) wmma::fill_fragment(acc[a][b], 0.f);

    for (uint32_t k0 = 0; k0 < m; k0 += kXxtV2K) {
        // 32 tokens × 64 columns per operand: each thread converts 16 + 16 elements; a warp reads 128
        // contiguous bytes of one token row per step.
        for (int e = threadIdx.x; e < kXxtV2K * kXxtV2Tile; e += kXxtV2Threads) {
            const int kk = e / kXxtV2Tile, c = e % kXxtV2Tile;
            const uint32_t k = k0 + kk;
            const bool kin = k < m;
            const float va = (kin && i0 + c < d) ? x[(size_t)k * ld + i0 + c] : 0.f;
            const float vb = (kin && j0 + c < d) ? x[(size_t)k * ld + j0 + c] : 0.f;
            a_sh[kk][c] = __float2bfloat16_rn(va);
            b_sh[kk][c] = __float2bfloat16_rn(vb);
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kXxtV2K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
#pragma unroll
            for (int a = 0; a < 2; ++a) wmma::load_matrix_sync(fa[a], &a_sh[kk][wr + 16 * a], kLd);
#pragma unroll
            for (int b = 0; b < 2; ++b) wmma::load_matrix_sync(fb[b], &b_sh[kk][wc + 16 * b], kLd);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int b = 0; b < 2; ++b) wmma::mma_sync(acc[a][b], fa[a], fb[b], acc[a][b]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 2; ++b)
            wmma::store_matrix_sync(&c_sh[wr + 16 * a][wc + 16 * b], acc[a][b], kCLd, wmma::mem_row_major);
    __syncthreads();
    const bool mirror = ti != tj;
    for (int e = threadIdx.x; e < kXxtV2Tile * kXxtV2Tile; e += kXxtV2Threads) {
        const int r = e / kXxtV2Tile, c = e % kXxtV2Tile;
        const uint32_t i = i0 + r, j = j0 + c;
        if (i >= d || j >= d) continue;
        const float v = c_sh[r][c];
        h[(size_t)i * d + j] += v;
        // The transposed store is uncoalesced (stride d); it is 1/m of the arithmetic, so it stays simple.
        if (mirror) h[(size_t)j * d + i] += v;
    }
}

// One warp per (head, query row i): stats[head·t + i] = (max_j s_ij, Σ_j exp(s_ij − max)), i − window < j ≤ i,
// s_ij = q_i·k_j / √d_h.
extern "C" __global__ void __launch_bounds__(kStatsWarps * kWarpSize)
softmax_stats_kernel(float2* __restrict__ stats,    // [h × t] (row max, Σ exp) out
                     const float* __restrict__ q,   // [t × h·d_h] post-RoPE queries
                     const float* __restrict__ k,   // [t × h_kv·d_h] post-RoPE keys
                     const uint32_t t, const uint32_t n_heads, const uint32_t n_kv,
                     const uint32_t d_h,            // ≤ kMaxDh
                     const uint32_t window) {       // keys per query, itself included (≥ 1; t: none)
    __shared__ float q_sh[kStatsWarps][kMaxDh];
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const uint32_t row = blockIdx.x * kStatsWarps + warp;  // = head·t + i
    if (row >= n_heads * t) return;                         // warp-uniform
    const uint32_t head = row / t, i = row % t;
    const uint32_t kvh = head / (n_heads / n_kv);
    const float* q_row = q + (size_t)i * n_heads * d_h + head * d_h;
    for (uint32_t c = lane; c < d_h; c += kWarpSize) q_sh[warp][c] = q_row[c];
    __syncwarp();
    const float scale = rsqrtf((float)d_h);
    float mx = -INFINITY, sum = 0.f;
    const uint32_t j_lo = i + 1 > window ? i + 1 - window : 0;  // the oldest key the window keeps
    for (uint32_t j = j_lo + lane; j <= i; j += kWarpSize) {
        const float* k_row = k + (size_t)j * n_kv * d_h + kvh * d_h;
        float s = 0.f;
        for (uint32_t c = 0; c < d_h; ++c) s += q_sh[warp][c] * k_row[c];
        s *= scale;
        const float nm = fmaxf(mx, s);
        sum = sum * __expf(mx - nm) + __expf(s - nm);
        mx = nm;
    }
    const float gm = warp_max(mx);
    sum = (mx == -INFINITY) ? 0.f : sum * __expf(mx - gm);
    sum = warp_sum(sum);
    if (lane == 0) stats[row] = make_float2(gm, sum);
}

// v1: Y [t × d] = A_h X for one query head, A_h formed a 32×32 tile at a time from the scores and the stats,
// all in f32 FFMA (the exact baseline). kDh: the head dim the shared-memory tiles hold (d_h ≤ kDh).
template <int kDh>
__device__ __forceinline__ void
attn_x_v1_impl(float* __restrict__ y,             // [t × d] out
               const float* __restrict__ x,       // [t × d] block input
               const float* __restrict__ q,       // [t × h·d_h]
               const float* __restrict__ k,       // [t × h_kv·d_h]
               const float2* __restrict__ stats,  // [h × t] from softmax_stats_kernel
               const uint32_t head, const uint32_t t, const uint32_t n_heads, const uint32_t n_kv,
               const uint32_t d_h, const uint32_t d,
               const uint32_t window) {           // keys per query, itself included (≥ 1; t: none)
    using L = Ax1Layout<kDh>;
    extern __shared__ __align__(16) float ax1_smem[];  // L::kBytes, opted in by the launcher past 48 KB
    auto q_sh = reinterpret_cast<float (*)[kDh]>(ax1_smem + L::kQOff);           // query rows (broadcast reads)
    auto k_sh = reinterpret_cast<float (*)[kDh + 1]>(ax1_smem + L::kKOff);       // key tile, padded: lane = key
                                                                                 // reads distinct banks
    auto p_sh = reinterpret_cast<float (*)[kAxKeys + 1]>(ax1_smem + L::kPOff);   // probabilities of the tile
    auto x_sh = reinterpret_cast<float (*)[kAxCols]>(ax1_smem + L::kXOff);       // X rows of the key tile
    if (d_h > kDh) return;  // the launcher refuses this; never index past q_sh's row
    const uint32_t kvh = head / (n_heads / n_kv);
    const uint32_t c0 = blockIdx.x * kAxCols, i0 = blockIdx.y * kAxRows;
    const int tid = threadIdx.x;
    const float scale = rsqrtf((float)d_h);
    for (int e = tid; e < kAxRows * (int)d_h; e += kAxThreads) {
        const int r = e / d_h, c = e % d_h;
        q_sh[r][c] = (i0 + r < t) ? q[(size_t)(i0 + r) * n_heads * d_h + head * d_h + c] : 0.f;
    }
    // Thread owns output row r_out, columns c_out + 8·u (u < 8): a warp covers 4 rows × 64 columns.
    const int r_out = tid / 8, c_out = tid % 8;
    float acc[kAxCols / 8];
#pragma unroll
    for (int u = 0; u < kAxCols / 8; ++u) acc[u] = 0.f;
    const uint32_t i_last = min(i0 + kAxRows, t) - 1;  // causal: keys beyond the last query row add nothing
    // Row i0's window starts earliest (at i0 + 1 − window): the key tiles before that one are masked for all.
    const uint32_t j_begin = i0 + 1 > window ? (i0 + 1 - window) / kAxKeys * kAxKeys : 0;
    for (uint32_t j0 = j_begin; j0 <= i_last; j0 += kAxKeys) {
        __syncthreads();  // previous tile fully consumed (and q_sh written, first time round)
        for (int e = tid; e < kAxKeys * (int)d_h; e += kAxThreads) {
            const int r = e / d_h, c = e % d_h;
            k_sh[r][c] = (j0 + r < t) ? k[(size_t)(j0 + r) * n_kv * d_h + kvh * d_h + c] : 0.f;
        }
        for (int e = tid; e < kAxKeys * kAxCols; e += kAxThreads) {
            const int r = e / kAxCols, c = e % kAxCols;
            x_sh[r][c] = (j0 + r < t && c0 + c < d) ? x[(size_t)(j0 + r) * d + c0 + c] : 0.f;
        }
        __syncthreads();
        for (int e = tid; e < kAxRows * kAxKeys; e += kAxThreads) {
            const int r = e / kAxKeys, jj = e % kAxKeys;  // warp: one query row, 32 keys
            const uint32_t i = i0 + r, j = j0 + jj;
            float p = 0.f;
            if (i < t && j <= i && i - j < window) {
                float s = 0.f;
                for (uint32_t c = 0; c < d_h; ++c) s += q_sh[r][c] * k_sh[jj][c];
                const float2 st = stats[(size_t)head * t + i];
                p = __expf(s * scale - st.x) / st.y;
            }
            p_sh[r][jj] = p;
        }
        __syncthreads();
#pragma unroll 4
        for (int jj = 0; jj < kAxKeys; ++jj) {
            const float p = p_sh[r_out][jj];
#pragma unroll
            for (int u = 0; u < kAxCols / 8; ++u) acc[u] += p * x_sh[jj][c_out + 8 * u];
        }
    }
    const uint32_t i = i0 + r_out;
    if (i < t) {
#pragma unroll
        for (int u = 0; u < kAxCols / 8; ++u) {
            const uint32_t c = c0 + c_out + 8 * u;
            if (c < d) y[(size_t)i * d + c] = acc[u];
        }
    }
}

// v1 entry points (style.md rule 17): d_h ≤ 128 (Llama, Qwen, Mistral), 128 < d_h ≤ 256 (Gemma 3).
extern "C" __global__ void __launch_bounds__(kAxThreads)
attn_x_kernel_v1(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ q,
                 const float* __restrict__ k, const float2* __restrict__ stats, const uint32_t head,
                 const uint32_t t, const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h,
                 const uint32_t d, const uint32_t window) {
    attn_x_v1_impl<kNarrowDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

extern "C" __global__ void __launch_bounds__(kAxThreads)
attn_x_kernel_v1_d256(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ q,
                      const float* __restrict__ k, const float2* __restrict__ stats, const uint32_t head,
                      const uint32_t t, const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h,
                      const uint32_t d, const uint32_t window) {
    attn_x_v1_impl<kMaxDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

// v2: Y [t × d] = A_h X on tensor cores (wmma m16n16k16, f32 accumulate), flash style: per 64-key tile the
// scores S = Q_i K_jᵀ (fp16 operands) go through shared memory as f32, become P = exp(S/√d_h − m_i)/l_i (the
// causal mask applied, rounded to bf16) and are multiplied into the 64 × 256 output tile with X_j (bf16).
// Why fp16 for Q and K: a score error δ multiplies p by e^δ, and bf16 operands (8 significant bits) give
// δ ≈ 2^-8·|q||k|/√d_h, which doubled the error of G in the emulation (profiling/emulate_attn_x_v2.py: worst
// 1.5e-2 vs 3e-3 with fp16's 11 bits). fp16's range (65504) is ample for post-RoPE queries and keys, which
// fp16 inference holds in fp16 anyway; X keeps bf16's range (activation outliers), P is in [0, 1].
//
//   warp tiling (8 warps, w = warp index):     scores S [64 rows × 64 keys]   output acc [64 rows × 256 cols]
//                                              ┌──────┬──────┐                ┌─────┬─────┬─────┬─────┐
//     scores: w ↦ rows 16·(w/2), keys 32·(w%2)  │ w0   │ w1   │ 16 rows        │ w0  │ w1  │ w2  │ w3  │ 32 rows
//     output: w ↦ rows 32·(w/4), cols 64·(w%4)  │ w2   │ w3   │                ├─────┼─────┼─────┼─────┤
//                                              │ …    │ …    │                │ w4  │ w5  │ w6  │ w7  │
//                                              └──────┴──────┘                └─────┴─────┴─────┴─────┘
__device__ __forceinline__ void store_y(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_y(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <int kDh, class TOut>
__device__ __forceinline__ void
attn_x_v2_impl(TOut* __restrict__ y,              // [t × d] out, row-major (f32, or bf16 for a cuBLAS Gram)
                 const float* __restrict__ x,       // [t × d] block input, row-major f32 (bf16 on staging)
                 const float* __restrict__ q,       // [t × n_heads·d_h] post-RoPE queries, f32
                 const float* __restrict__ k,       // [t × n_kv·d_h] post-RoPE keys, f32
                 const float2* __restrict__ stats,  // [n_heads × t] (row max, Σ exp) from softmax_stats_kernel
                 const uint32_t head,               // query head h; reads KV head h / (n_heads / n_kv)
                 const uint32_t t, const uint32_t n_heads, const uint32_t n_kv,
                 const uint32_t d_h,                // ≤ kDh; zero-padded to a multiple of 16 in shared memory
                 const uint32_t d,                  // columns of X and Y
                 const uint32_t window) {           // keys per query, itself included (≥ 1; t: none)
    using namespace nvcuda;
    using L = Ax2Layout<kDh>;
    constexpr int kQkLd = L::kQkLd;
    extern __shared__ __align__(128) unsigned char ax2_smem[];  // L::kBytes, opted in by the launcher
    auto q_sh = reinterpret_cast<__half (*)[kQkLd]>(ax2_smem + L::kQOff);             // [row][dim]
    auto k_sh = reinterpret_cast<__half (*)[kQkLd]>(ax2_smem + L::kKOff);             // [key][dim]
    auto s_sh = reinterpret_cast<float (*)[kAx2SLd]>(ax2_smem + L::kSOff);            // [row][key]
    auto p_sh = reinterpret_cast<__nv_bfloat16 (*)[kAx2PLd]>(ax2_smem + L::kPOff);    // [row][key]
    auto x_sh = reinterpret_cast<__nv_bfloat16 (*)[kAx2XLd]>(ax2_smem + L::kXOff);    // [key][col]
    auto y_sh = reinterpret_cast<float (*)[kAx2YLd]>(ax2_smem);                       // [row][col], after the loop
    float* m_sh = reinterpret_cast<float*>(ax2_smem + L::kStatOff);                   // row max of the scores
    float* linv_sh = m_sh + kAx2Rows;                                                 // 1 / Σ exp; 0 past t
    if (d_h > kDh) return;  // the launcher refuses this; never index past q_sh's row

    const uint32_t kvh = head / (n_heads / n_kv);
    const uint32_t c0 = blockIdx.x * kAx2Cols;
    // Row tile i does i + 1 key tiles: launch the heaviest first (blocks are issued in increasing index) so
    // the light ones fill the tail of the grid.
    const uint32_t i0 = (gridDim.y - 1 - blockIdx.y) * kAx2Rows;
    const int tid = threadIdx.x, warp = tid / kWarpSize;
    const uint32_t dh16 = (d_h + 15) & ~15u;
    const float scale = rsqrtf((float)d_h);
    const size_t q_gl_stride = (size_t)n_heads * d_h, k_gl_stride = (size_t)n_kv * d_h;
    const float* q_gl = q + (size_t)head * d_h;
    const float* k_gl = k + (size_t)kvh * d_h;

    for (uint32_t e = tid; e < kAx2Rows * dh16; e += kAx2Threads) {
        const uint32_t r = e / dh16, c = e % dh16, i = i0 + r;
        const float v = (i < t && c < d_h) ? q_gl[i * q_gl_stride + c] : 0.f;
        q_sh[r][c] = __float2half_rn(v);
    }
    if (tid < kAx2Rows) {
        const uint32_t i = i0 + tid;
        const float2 st = i < t ? stats[(size_t)head * t + i] : make_float2(0.f, 1.f);
        m_sh[tid] = st.x;
        linv_sh[tid] = i < t ? 1.f / st.y : 0.f;  // st.y ≥ 1 for a real row (its max term is exp(0))
    }

    const int s_row = (warp / 2) * 16, s_key = (warp % 2) * 32;  // this warp's 16 × 32 score sub-tile
    const int o_row = (warp / 4) * 32, o_col = (warp % 4) * 64;  // this warp's 32 × 64 output sub-tile
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b) wmma::fill_fragment(acc[a][b], 0.f);

    const bool col_in = c0 + tid < d;
    const float* x_gl = x + c0 + tid;  // this thread's column of X
    const uint32_t i_last = min(i0 + kAx2Rows, t) - 1;  // causal: keys past the last query row add nothing
    // Row i0's window starts earliest (at i0 + 1 − window): the key tiles before that one are masked for all.
    const uint32_t j_begin = i0 + 1 > window ? (i0 + 1 - window) / kAx2Keys * kAx2Keys : 0;
    for (uint32_t j0 = j_begin; j0 <= i_last; j0 += kAx2Keys) {
        __syncthreads();  // the previous tile fully consumed (and q_sh, m_sh written, first time round)
        for (uint32_t e = tid; e < kAx2Keys * dh16; e += kAx2Threads) {
            const uint32_t r = e / dh16, c = e % dh16, j = j0 + r;
            const float v = (j < t && c < d_h) ? k_gl[j * k_gl_stride + c] : 0.f;
            k_sh[r][c] = __float2half_rn(v);
        }
        // One column per thread, 64 keys: a warp reads 128 contiguous bytes of a row per load, and the
        // unrolled loads are independent, so many are in flight before the first conversion.
#pragma unroll 16
        for (int r = 0; r < kAx2Keys; ++r) {
            const uint32_t j = j0 + r;
            const float v = (col_in && j < t) ? x_gl[(size_t)j * d] : 0.f;
            x_sh[r][tid] = __float2bfloat16_rn(v);
        }
        __syncthreads();

        {  // S = Q_i K_jᵀ: A = q_sh row-major, B = Kᵀ, i.e. k_sh read column-major
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_acc[2];
            wmma::fill_fragment(s_acc[0], 0.f);
            wmma::fill_fragment(s_acc[1], 0.f);
            for (uint32_t kk = 0; kk < dh16; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fq;
                wmma::load_matrix_sync(fq, &q_sh[s_row][kk], kQkLd);
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fk;
                    wmma::load_matrix_sync(fk, &k_sh[s_key + 16 * b][kk], kQkLd);
                    wmma::mma_sync(s_acc[b], fq, fk, s_acc[b]);
                }
            }
#pragma unroll
            for (int b = 0; b < 2; ++b)
                wmma::store_matrix_sync(&s_sh[s_row][s_key + 16 * b], s_acc[b], kAx2SLd, wmma::mem_row_major);
        }
        __syncthreads();

        // P = exp(S/√d_h − m_i) / l_i below the diagonal (and inside the window), 0 above it, past t and before
        // the window. A warp covers 32 keys of one row: conflict-free f32 reads, contiguous bf16 writes.
#pragma unroll 4
        for (int e = tid; e < kAx2Rows * kAx2Keys; e += kAx2Threads) {
            const int r = e / kAx2Keys, jj = e % kAx2Keys;
            const uint32_t i = i0 + r, j = j0 + jj;
            // A select, not a multiply: exp of a masked score can overflow to inf, and inf·0 is NaN.
            const bool seen = i < t && j <= i && i - j < window;
            const float p = seen ? __expf(s_sh[r][jj] * scale - m_sh[r]) * linv_sh[r] : 0.f;
            p_sh[r][jj] = __float2bfloat16_rn(p);
        }
        __syncthreads();

        // acc += P X_j: A = p_sh row-major, B = x_sh row-major.
#pragma unroll
        for (int kk = 0; kk < kAx2Keys; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fp[2];
#pragma unroll
            for (int a = 0; a < 2; ++a) wmma::load_matrix_sync(fp[a], &p_sh[o_row + 16 * a][kk], kAx2PLd);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fx;
                wmma::load_matrix_sync(fx, &x_sh[kk][o_col + 16 * b], kAx2XLd);
#pragma unroll
                for (int a = 0; a < 2; ++a) wmma::mma_sync(acc[a][b], fp[a], fx, acc[a][b]);
            }
        }
    }

    // Through shared memory (aliasing the tiles, hence the barrier) for a guarded, coalesced store: t and d
    // need not be multiples of the tile, and wmma's direct store would need d % 8 == 0.
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
            wmma::store_matrix_sync(&y_sh[o_row + 16 * a][o_col + 16 * b], acc[a][b], kAx2YLd,
                                    wmma::mem_row_major);
    __syncthreads();
    if (col_in) {
        TOut* y_gl = y + c0 + tid;
        for (int r = 0; r < kAx2Rows; ++r) {
            const uint32_t i = i0 + r;
            if (i < t) store_y(y_gl + (size_t)i * d, y_sh[r][tid]);
        }
    }
}

// v2 entry points (style.md rule 17): Y in f32 or bf16, d_h ≤ 128 (two CTAs per SM) or ≤ 256 (Gemma 3; one).
extern "C" __global__ void __launch_bounds__(kAx2Threads, 2)  // 2 CTAs per SM: one stages while the other computes
attn_x_kernel_v2(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ q,
                 const float* __restrict__ k, const float2* __restrict__ stats, const uint32_t head,
                 const uint32_t t, const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h,
                 const uint32_t d, const uint32_t window) {
    attn_x_v2_impl<kNarrowDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

// The same with Y in bf16: the operand of the cuBLAS Gram (XxtVariant::Cublas), written once instead of an f32
// Y and a conversion pass (half the bytes of Y, one pass fewer).
extern "C" __global__ void __launch_bounds__(kAx2Threads, 2)
attn_x_kernel_v2_bf16(__nv_bfloat16* __restrict__ y, const float* __restrict__ x, const float* __restrict__ q,
                      const float* __restrict__ k, const float2* __restrict__ stats, const uint32_t head,
                      const uint32_t t, const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h,
                      const uint32_t d, const uint32_t window) {
    attn_x_v2_impl<kNarrowDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

// The same two at d_h ≤ 256 (128.5 KB of shared memory: one CTA per SM, so the register bound is the same).
extern "C" __global__ void __launch_bounds__(kAx2Threads, 2)
attn_x_kernel_v2_d256(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ q,
                      const float* __restrict__ k, const float2* __restrict__ stats, const uint32_t head,
                      const uint32_t t, const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h,
                      const uint32_t d, const uint32_t window) {
    attn_x_v2_impl<kMaxDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

extern "C" __global__ void __launch_bounds__(kAx2Threads, 2)
attn_x_kernel_v2_bf16_d256(__nv_bfloat16* __restrict__ y, const float* __restrict__ x,
                           const float* __restrict__ q, const float* __restrict__ k,
                           const float2* __restrict__ stats, const uint32_t head, const uint32_t t,
                           const uint32_t n_heads, const uint32_t n_kv, const uint32_t d_h, const uint32_t d,
                           const uint32_t window) {
    attn_x_v2_impl<kMaxDh>(y, x, q, k, stats, head, t, n_heads, n_kv, d_h, d, window);
}

// ---------------------------------------------------------------------------------------------------------
// attn_probs_bf16: v3 of V's statistics (AttnXVariant::Gemm) moves A_h X and the scores onto cuBLAS, whose
//   GEMMs run near the tensor-core rate, and keeps only this row pass as a kernel:
//     S = Q_h K_hᵀ       cuBLAS SGEMM, strided-batched over sequences, f32 [batch × t × t] (unscaled)
//     A = softmax rows   this kernel: a_ij = exp(s_ij·scale − m_i) / l_i for i − window < j ≤ i, 0 elsewhere,
//                        m_i and l_i over that range, written bf16 [batch × t × t] (every element)
//     Y = A X            cuBLAS bf16 GEMM, f32 accumulation, Y bf16 [batch·t × d]
//     G += Yᵀ Y          the cuBLAS bf16 Gram of v2.
//   Launch: grid (t, batch), block 256, no smem beyond the 2 × 8 floats of the reductions: one block per
//   (query row, sequence); three passes over the row's t scores (max, Σ exp, write), the first two over the
//   window only. Bytes per head and sequence: S read ~2× (4·t² B, mostly from L2) + A written (2·t² B).
//   Roofline (7B, t = 2048, 32 heads, 128 sequences): A is 8 MB per head and sequence, 32 GB of writes and
//   ~64 GB of S reads per layer: ~25 ms at 4 TB/s; the GEMMs per head and sequence (scores 1.1 GFLOP f32,
//   A X 34 GFLOP bf16 without causal skipping, the Gram 69 GFLOP bf16) are ~0.2 ms at cuBLAS's measured
//   430–570 TFLOP/s (bench stat_xxt, 2026-12-04, H200): ~0.9 s per 7B layer, against 6.6 s for v2's path
//   (run --profile, same day, `statistics: V's per-head H_col` of a 7B-shaped block, 128 × 2048 tokens).
// Measured (H200, 2026-12-04, `run --profile` on a 7B-shaped block, 128 × 2048 tokens, phases fenced): the whole
//   v3 path 0.73–0.79 s per block (`statistics: V's per-head H_col`; 2-block and 16-block runs) against 6.58 s
//   for v2's path on the same run: 8.3×, and within the ~0.9 s predicted. The kernel alone is not timed yet.
// ---------------------------------------------------------------------------------------------------------
constexpr int kProbThreads = 256;

__device__ __forceinline__ float block_reduce(float v, float* sh, bool is_max) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    v = is_max ? warp_max(v) : warp_sum(v);
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < kProbThreads / kWarpSize ? sh[lane] : (is_max ? -INFINITY : 0.f);
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();  // sh is reused by the next reduction
    return v;
}

extern "C" __global__ void __launch_bounds__(kProbThreads)
attn_probs_bf16_kernel(__nv_bfloat16* __restrict__ a,  // [batch × t × t] out: row-major probabilities
                       const float* __restrict__ s,    // [batch × t × t] scores q_i·k_j (unscaled)
                       const uint32_t t,
                       const uint32_t window,          // keys per query, itself included (≥ 1; t: none)
                       const float scale) {            // 1/√d_h
    __shared__ float red[kProbThreads / kWarpSize];
    const uint32_t i = blockIdx.x;
    const size_t row = ((size_t)blockIdx.y * t + i) * t;
    const uint32_t j_lo = i + 1 > window ? i + 1 - window : 0;
    float mx = -INFINITY;
    for (uint32_t j = j_lo + threadIdx.x; j <= i; j += kProbThreads) mx = fmaxf(mx, s[row + j] * scale);
    mx = block_reduce(mx, red, true);
    float sum = 0.f;
    for (uint32_t j = j_lo + threadIdx.x; j <= i; j += kProbThreads) sum += __expf(s[row + j] * scale - mx);
    sum = block_reduce(sum, red, false);
    const float inv = 1.f / sum;
    for (uint32_t j = threadIdx.x; j < t; j += kProbThreads) {
        const float p = (j >= j_lo && j <= i) ? __expf(s[row + j] * scale - mx) * inv : 0.f;
        a[row + j] = __float2bfloat16(p);
    }
}

// ---------------------------------------------------------------------------------------------------------
// rope_moments + rope_row_hessians: BoA's row Hessians of W_Q and W_K (design.md §4.3) made where the
//   per-head covariances are, so nothing of d_h² crosses to the host (it did: C_K and C_Q down, H_row up,
//   ~4 MB per block at Gemma 3's d_h = 256, a sixth of a 270M block's weights).
//   rope_moments_kernel: the position moments of the RoPE average for frequencies θ [half], positions
//     0..P−1: cc[i,j] = mean_p cos(pθ_i)cos(pθ_j), cs[i,j] = mean_p cos(pθ_i)sin(pθ_j), ss[i,j] = mean_p
//     sin(pθ_i)sin(pθ_j), in f64 (angles reach P·θ_0 ≈ 2048 rad: f32 angles would be off by ~1e-4 rad).
//     Launch: grid half, block 128 (thread j < half; half ≤ 128, d_h ≤ 256), no smem; thread (i, j) sums
//     over p in order, as the CPU twin.
//   rope_row_hessians_kernel: out[o] = diag(g) M_o diag(g), M_o[a,b] = cc[k]·C̄[a,b] + s_b·cs[k]·C̄[a,b̄] +
//     s_a·cs[k']·C̄[ā,b] + s_a·s_b·ss[k]·C̄[ā,b̄] (k = (a mod half, b mod half), k' its transpose, ā the
//     rotation partner of a, s_a = +1 for a < half, −1 after), C̄ = the source covariance of output o (one
//     KV head's for W_Q, its query heads' mean for W_K), in f64, stored f32.
//     Launch: grid (ceil(d_h²/256), n_out), block 256, no smem: one output element per thread.
//   CPU twin: ops::RopeAverage::{new, apply} through quant::hessian::{q,k}_row_hessians and
//   scale_by_norm_weight (CpuBackend::rope_row_hessians); launchers: launch_rope_moments,
//   launch_rope_row_hessians (backend/cuda/hessian.rs); parity test: parity_rope_row_hessians
//   (tests/parity_quant.rs).
// Roofline: moments half²·P·(2 sincos + 3 FMA) in f64: d_h 256, P 2048: 33.5M sincos ≈ 0.1–0.3 ms of an
//   H200's f64 units; d_h 128: a quarter. The Hessians: 4 reads and ~10 flop per element of n_out·d_h²
//   (≤ 2 MB at 32 heads × 128²): µs. Once per block each (q and k share the moments' layer).
// Variants measured: correct on an H200 (parity tests, 2026-12-04: rope_row_hessians max rel. error 2.7e-8
//   vs f64); speed not measured yet.
// ---------------------------------------------------------------------------------------------------------
constexpr int kRopeMomentThreads = 128;  // rope_moments: threads (= j) per block; half ≤ this
constexpr int kRopeRowThreads = 256;     // rope_row_hessians: threads per block

extern "C" __global__ void __launch_bounds__(kRopeMomentThreads)
rope_moments_kernel(double* __restrict__ mom,            // [3 × half × half] out: cc, cs, ss
                    const double* __restrict__ inv_freq,  // [half] θ_i
                    const uint32_t half,                  // ≤ kRopeMomentThreads
                    const uint32_t positions) {           // P (0 is read as 1 for the mean)
    const uint32_t i = blockIdx.x, j = threadIdx.x;
    if (i >= half || j >= half) return;
    double cc = 0.0, cs = 0.0, ss = 0.0;
    for (uint32_t p = 0; p < positions; ++p) {
        double si, ci, sj, cj;
        sincos((double)p * inv_freq[i], &si, &ci);
        sincos((double)p * inv_freq[j], &sj, &cj);
        cc += ci * cj;
        cs += ci * sj;
        ss += si * sj;
    }
    const double inv = 1.0 / (double)(positions > 0 ? positions : 1);
    const size_t k = (size_t)i * half + j, hh = (size_t)half * half;
    mom[k] = cc * inv;
    mom[hh + k] = cs * inv;
    mom[2 * hh + k] = ss * inv;
}

extern "C" __global__ void __launch_bounds__(kRopeRowThreads)
rope_row_hessians_kernel(float* __restrict__ out,           // [n_out × d_h × d_h] out
                         const float* __restrict__ c,       // [batch × d_h × d_h] finished covariances
                         const double* __restrict__ mom,    // [3 × half × half] from rope_moments_kernel
                         const float* __restrict__ g,       // [d_h] per-head norm weight (ones: none)
                         const uint32_t n_out, const uint32_t batch,  // one a multiple of the other
                         const uint32_t d_h) {              // = 2·half
    const uint32_t o = blockIdx.y;
    const uint32_t e = blockIdx.x * kRopeRowThreads + threadIdx.x;
    const uint32_t dd = d_h * d_h;
    if (e >= dd) return;
    const uint32_t half = d_h / 2, a = e / d_h, b = e % d_h;
    // C̄ of output o: one source when n_out ≥ batch (a query head reads its KV head), else the mean of r.
    const uint32_t r = n_out >= batch ? 1 : batch / n_out;
    const uint32_t src = n_out >= batch ? o / (n_out / batch) : o * r;
    auto cbar = [&](uint32_t x, uint32_t y) {
        double s = 0.0;
        for (uint32_t q = 0; q < r; ++q) s += (double)c[(size_t)(src + q) * dd + (size_t)x * d_h + y] / (double)r;
        return s;
    };
    const uint32_t pa = a < half ? a + half : a - half, pb = b < half ? b + half : b - half;
    const double sa = a < half ? 1.0 : -1.0, sb = b < half ? 1.0 : -1.0;
    const uint32_t fa = a % half, fb = b % half;
    const size_t k = (size_t)fa * half + fb, kt = (size_t)fb * half + fa, hh = (size_t)half * half;
    const double* cc = mom;
    const double* cs = mom + hh;
    const double* ss = mom + 2 * hh;
    double m = cc[k] * cbar(a, b) + sb * cs[k] * cbar(a, pb) + sa * cs[kt] * cbar(pa, b) +
               sa * sb * ss[k] * cbar(pa, pb);
    m *= (double)g[a] * (double)g[b];
    out[(size_t)o * dd + e] = (float)m;
}
