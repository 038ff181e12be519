// ceiling.cu — the two device ceilings every benchmark is reported against (METHOD.md "Two numbers first";
// style.md rule 13): copy bandwidth and tensor-core rate, measured on the card as found.
//
// ---------------------------------------------------------------------------------------------------------
// ceiling_copy_kernel: y[i] = x[i] over n float4 (16-byte loads and stores, grid-stride). Launch: grid 8·SMs,
//   block 256 (enough blocks to fill the chip). Bytes moved = 2·16·n (read + write), 1 GiB each way.
//   Expect ~85–90% of the datasheet HBM bandwidth (H200: 4.8 TB/s → ~4.2 TB/s).
//
// ceiling_mma_kernel: every warp issues `iters` × 4 independent bf16 wmma m16n16k16 (mma.sync, f32
//   accumulate) on fragments held in registers, no memory traffic in the loop; one checksum per warp is
//   written so the loop is not dead code. FLOP = 2·16·16·16 per mma. This is the ceiling of the mma.sync
//   path our wmma kernels use (HMMA in SASS); Hopper's wgmma (HGMMA) peak is higher (H100 SXM: ~990 dense
//   bf16 TFLOP/s vs ~660 for mma.sync as commonly measured), so fractions against this number are fractions
//   of what wmma can reach, not of the datasheet.
//   Launch: grid 8·SMs (host), block 256 (8 warps).
// ptxas (nvcc 13.0): copy 14 regs, mma 48 regs, 0 spills.
// Measured (H200, 2026-12-04, `boa-cuda bench --device cuda`): copy 3883 GB/s (81% of the datasheet, under the
//   ~4.2 TB/s expected; KINDS.md's PyTorch copy on such a card: ~4.3 TB/s), mma.sync 650.35 TFLOP/s (as
//   expected for mma.sync; cuBLAS's bf16 Gram reached 568 TFLOP/s on the 11008-wide stat_xxt row).
// ---------------------------------------------------------------------------------------------------------

#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

constexpr int kCeilThreads = 256;
constexpr int kMmaChains = 4;  // independent accumulators per warp: hides the mma latency

extern "C" __global__ void __launch_bounds__(kCeilThreads)
ceiling_copy_kernel(float4* __restrict__ y,        // [n4] out
                    const float4* __restrict__ x,  // [n4] in
                    const uint64_t n4) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (uint64_t)gridDim.x * blockDim.x)
        y[i] = x[i];
}

extern "C" __global__ void __launch_bounds__(kCeilThreads)
ceiling_mma_kernel(float* __restrict__ out,  // [gridDim.x · 8] one checksum per warp
                   const uint32_t iters) {
    using namespace nvcuda;
    __shared__ __align__(32) __nv_bfloat16 tile[16 * 16];
    __shared__ __align__(32) float acc_sh[kCeilThreads / 32][16 * 16];
    for (int i = threadIdx.x; i < 16 * 16; i += kCeilThreads)
        tile[i] = __float2bfloat16_rn(1e-3f * (float)((i * 7 + blockIdx.x) % 13));
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMmaChains];
    wmma::load_matrix_sync(a, tile, 16);
    wmma::load_matrix_sync(b, tile, 16);
#pragma unroll
    for (int c = 0; c < kMmaChains; ++c) wmma::fill_fragment(acc[c], 0.f);
    for (uint32_t it = 0; it < iters; ++it)
#pragma unroll
        for (int c = 0; c < kMmaChains; ++c) wmma::mma_sync(acc[c], a, b, acc[c]);
#pragma unroll
    for (int c = 1; c < kMmaChains; ++c)
        for (int e = 0; e < acc[0].num_elements; ++e) acc[0].x[e] += acc[c].x[e];
    const int warp = threadIdx.x / 32;
    wmma::store_matrix_sync(acc_sh[warp], acc[0], 16, wmma::mem_row_major);
    __syncwarp();
    if (threadIdx.x % 32 == 0) out[blockIdx.x * (kCeilThreads / 32) + warp] = acc_sh[warp][0];
}
