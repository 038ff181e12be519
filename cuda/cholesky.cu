// cholesky.cu — batched U = chol(H⁻¹)ᵀ for many small SPD matrices (design.md §4.2–4.3, §6 "batched head-wise
// Cholesky"): the H_row,h of every head (d_h = 64/128) in one launch, and any H_col with n ≤ 128.
//
// ---------------------------------------------------------------------------------------------------------
// cholesky_upper_inverse: for each b < count, U_b [n × n] upper = chol(H_b⁻¹)ᵀ, status_b = 0, or status_b =
//   k + 1 when the k-th pivot (of the reversed matrix) is not positive and finite (the caller damps and retries).
//   Same route as the CPU twin quant::linalg::cholesky_upper_inverse (f64 there, f32 here): with J the
//   reversal, J H J = L Lᵀ (lower Cholesky), and U = J L⁻¹ J; no second factorization.
//   Launcher: launch_cholesky (backend/cuda/cholesky.rs); parity test: parity_cholesky_upper_inverse.
//
// Launch shape: grid count, block 256, dynamic smem (n(n+1)/2 + n)·4 B (33.5 KB at n = 128, under the 48 KB
//   default, so no opt-in): one CTA per matrix, the lower triangle packed row by row in shared memory.
//     1. load A = J H J (lower triangle only);
//     2. right-looking Cholesky, n steps: pivot (one thread), scale the column, rank-1 update of the trailing
//        triangle (all threads), three barriers per step;
//     3. L⁻¹ in place, row by row: X[i, j] = −(Σ_{k=j}^{i−1} L[i, k] X[k, j]) / L[i, i] with thread j owning
//        column j; row i of L is copied out first, since X[i, ·] overwrites it;
//     4. U[i, j] = X[n−1−i, n−1−j] (j ≥ i), zeros below, to global memory.
//   n > 128 is refused by the launcher: the large H_col (d_in up to 28672) goes through cuSOLVER (potrf and
//   trtri on J H J, backend/cuda/solver.rs), with reverse_kernel below moving the data in and out.
//
// Roofline: n³/3 + n³/3 flop per matrix = 1.4 MFLOP at n = 128; 32 heads ≈ 45 MFLOP — nothing. The time is the
//   3n + n dependent barrier steps (≈ 500 at n = 128, a few µs each): ~1 ms per launch for all heads, fine
//   next to the sweeps.
//
// Variants measured (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`): this kernel on
//   32 matrices of n = 128 (factor (batched H_row)) 0.498 ms per call, under the ~1 ms predicted above; the
//   cuSOLVER route with reverse_kernel (factor (H_col)) n = 4096 12.695 ms (3.6 TFLOP/s), n = 11008 86.869 ms
//   (10.2 TFLOP/s). Correct on an H200 (parity tests, 2026-12-04: factor max rel. error 1.6e-7 vs f64). In a
//   7B-shaped BoA 3-bit run (H200, 2026-12-04, `run --profile`, 128 × 2048 tokens) the factorization phase
//   took 0.55 s per block.
// ptxas (nvcc 13.0, sm_90a / sm_80): 32 / 31 registers, 0 spills, dynamic smem only.
// ---------------------------------------------------------------------------------------------------------

#include <stdint.h>

constexpr int kCholThreads = 256;
constexpr uint32_t kCholMaxN = 128;  // must match CHOLESKY_MAX_N in backend/cuda/cholesky.rs

// --- device helpers ---------------------------------------------------------------------------------------

// Packed index of (i, j), j ≤ i, in the row-by-row lower triangle.
__device__ __forceinline__ uint32_t pk(uint32_t i, uint32_t j) { return i * (i + 1) / 2 + j; }

// --- GPU kernels ------------------------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(kCholThreads)
cholesky_upper_inverse_kernel(float* __restrict__ u,        // [count × n × n] out: U_b upper, zeros below
                              int32_t* __restrict__ status,  // [count] out: 0 ok, k+1 = failed pivot k
                              const float* __restrict__ h,   // [count × n × n] SPD (only the lower triangle
                                                             // of J H J, i.e. the upper of H, is read)
                              const uint32_t n) {            // ≤ kCholMaxN
    extern __shared__ float sh[];
    float* a = sh;                  // packed lower triangle, n(n+1)/2
    float* row = sh + n * (n + 1) / 2;  // one row of L (step 3)
    __shared__ int32_t fail;
    const uint32_t tid = threadIdx.x;
    const float* hb = h + (size_t)blockIdx.x * n * n;
    float* ub = u + (size_t)blockIdx.x * n * n;
    if (n > kCholMaxN) return;  // the launcher refuses this; never read past the smem it sized
    for (uint32_t e = tid; e < n * n; e += kCholThreads) {
        const uint32_t i = e / n, j = e % n;
        if (j <= i) a[pk(i, j)] = hb[(size_t)(n - 1 - i) * n + (n - 1 - j)];
    }
    if (tid == 0) fail = 0;
    __syncthreads();

    // 2. J H J = L Lᵀ
    for (uint32_t k = 0; k < n; ++k) {
        if (tid == 0) {
            const float p = a[pk(k, k)];
            if (!(p > 0.f) || !isfinite(p)) fail = (int32_t)k + 1;
            a[pk(k, k)] = sqrtf(p);
        }
        __syncthreads();
        if (fail) break;  // block-uniform: read after the barrier
        const float piv = a[pk(k, k)];
        for (uint32_t i = k + 1 + tid; i < n; i += kCholThreads) a[pk(i, k)] /= piv;
        __syncthreads();
        const uint32_t r = n - k - 1;  // trailing triangle (k, n) × (k, n)
        for (uint32_t e = tid; e < r * r; e += kCholThreads) {
            const uint32_t i = k + 1 + e / r, j = k + 1 + e % r;
            if (j <= i) a[pk(i, j)] -= a[pk(i, k)] * a[pk(j, k)];
        }
        __syncthreads();
    }
    if (fail) {
        for (uint32_t e = tid; e < n * n; e += kCholThreads) ub[e] = 0.f;
        if (tid == 0) status[blockIdx.x] = fail;
        return;
    }

    // 3. L⁻¹ in place
    for (uint32_t i = 0; i < n; ++i) {
        for (uint32_t c = tid; c <= i; c += kCholThreads) row[c] = a[pk(i, c)];
        __syncthreads();
        for (uint32_t j = tid; j <= i; j += kCholThreads) {
            float x;
            if (j == i) {
                x = 1.f / row[i];
            } else {
                float s = 0.f;
                for (uint32_t k = j; k < i; ++k) s += row[k] * a[pk(k, j)];
                x = -s / row[i];
            }
            a[pk(i, j)] = x;
        }
        __syncthreads();
    }

    // 4. U = J L⁻¹ J; a non-finite entry (overflow) fails the matrix like a bad pivot.
    for (uint32_t e = tid; e < n * n; e += kCholThreads) {
        const uint32_t i = e / n, j = e % n;
        const float v = j >= i ? a[pk(n - 1 - i, n - 1 - j)] : 0.f;
        if (!isfinite(v)) fail = (int32_t)n + 1;
        ub[e] = v;
    }
    __syncthreads();
    if (tid == 0) status[blockIdx.x] = fail;
}

// ---------------------------------------------------------------------------------------------------------
// reverse_kernel: out[e] = in[n² − 1 − e] for e < n², i.e. out = J A J for row-major A [n × n]; with `upper`,
//   entries below the diagonal are written as 0 and an entry on or above it that is not finite sets *bad = 1.
//   The large-n route of U = chol(H⁻¹)ᵀ (solver.rs) runs it twice around cuSOLVER: in, J H J (symmetric, so
//   row- and column-major agree); out, from X = (Lᵀ)⁻¹ column-major upper (potrf + trtri with fill UPPER on
//   J H J = L Lᵀ), U[i, j] = X[n−1−j, n−1−i] = x[n² − 1 − (i·n + j)] — again a reversal, so both moves are
//   coalesced 1-D copies. Parity: parity_cholesky_large (tests/parity_quant.rs).
//
// Launch shape: 1-D, 256 threads, grid min(⌈n²/256⌉, 65535·4) with a grid-stride loop.
// Roofline: 8 B per element; n = 11008 moves 0.97 GB ≈ 0.2 ms at ~4.8 TB/s, next to ~10 ms of potrf + trtri.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
reverse_kernel(float* __restrict__ out,       // [n × n]
               int32_t* __restrict__ bad,     // [1] set to 1 on a non-finite kept entry (upper only)
               const float* __restrict__ in,  // [n × n]
               const uint64_t n,
               const uint32_t upper) {
    const uint64_t total = n * n;
    for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (uint64_t)gridDim.x * blockDim.x) {
        float v = in[total - 1 - e];
        if (upper) {
            if (e % n < e / n) {
                v = 0.f;
            } else if (!isfinite(v)) {
                *bad = 1;
            }
        }
        out[e] = v;
    }
}

// eye_kernel: out = I [n × n], the right-hand side of the trsm route (solver.rs FactorVariant::Trsm: R X = I
//   gives X = R⁻¹ where the trtri route inverts R in place). Launch shape and loop as reverse_kernel's; it
//   writes 4 B per element (n = 4096: 64 MB, ~15 µs at the copy rate).
extern "C" __global__ void __launch_bounds__(256)
eye_kernel(float* __restrict__ out, const uint64_t n) {
    const uint64_t total = n * n;
    for (uint64_t e = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (uint64_t)gridDim.x * blockDim.x)
        out[e] = (e / n == e % n) ? 1.f : 0.f;
}
