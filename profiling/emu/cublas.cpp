// cublas.cpp — libcublas.so of the CPU emulator: the cuBLAS calls the project makes, computed on the host.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md), which runs the project's CUDA code
// paths without a GPU: host memory stands in for device memory (a CUdeviceptr is a host address), and each
// GEMM is one operation on the handle's stream, queued by the fake driver (streams.h). cudarc (`dynamic-loading`)
// dlopen()s this file's library as libcublas.so and resolves each function lazily by the name below; the
// ABI (argument types, enum values, status codes) is the one of cudarc 0.19.10's src/cublas/sys/mod.rs with
// the cuda-13000 bindings. No CUDA header is used.
//
// Build:
//   profiling/emu/build.sh (into target/cuda-emu/libcublas.so)
// Test: profiling/emu/test_blas.cpp.
//
// Exported (what the project reaches through cudarc is marked *):
//   handle:  cublasCreate_v2*, cublasDestroy_v2*, cublasSetStream_v2*, cublasGetStream_v2,
//            cublasSetMathMode*, cublasGetMathMode, cublasSetPointerMode_v2, cublasGetPointerMode_v2,
//            cublasSetAtomicsMode, cublasGetAtomicsMode, cublasSetWorkspace_v2,
//            and the un-suffixed aliases cublasCreate, cublasDestroy, cublasSetStream, cublasGetStream,
//            cublasSetPointerMode, cublasGetPointerMode (cublas_v2.h #defines these to the _v2 names)
//   info:    cublasGetVersion_v2, cublasGetVersion (the legacy cublas.h form: no handle), cublasGetProperty,
//            cublasGetCudartVersion, cublasGetStatusName, cublasGetStatusString
//   GEMM:    cublasSgemm_v2*, cublasDgemm_v2, cublasSgemmStridedBatched*, cublasDgemmStridedBatched,
//            cublasGemmEx*, cublasGemmStridedBatchedEx, cublasGemmBatchedEx (pointer arrays; no _64 form),
//            cublasSgemmEx, and the _64 (64-bit integer) form of
//            each: cublasSgemm_v2_64, cublasDgemm_v2_64, cublasSgemmStridedBatched_64,
//            cublasDgemmStridedBatched_64, cublasGemmEx_64, cublasGemmStridedBatchedEx_64, cublasSgemmEx_64
//   TRSM:    cublasStrsm_v2*, cublasStrsm_v2_64 (side LEFT, fill UPPER, op N only: the one case called)
//   The legacy un-suffixed cublasSgemm/cublasDgemm are not exported: in the real library those names are the
//   cuBLAS v1 API (char transposes, scalars by value, no handle), and a v2 signature under them would lie.
//
// Numerics: every product is accumulated in double and rounded once to the output type, so results are at
// least as accurate as cuBLAS's f32 accumulation and do not depend on the thread count. The reduced-
// precision compute types (CUBLAS_COMPUTE_32F_FAST_16F/16BF/TF32, EMULATED_16BFX9) and CUBLAS_TF32_TENSOR_OP
// math are computed exactly too: on a GPU they may be less accurate than here, never more.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <vector>

namespace {

// cublasStatus_t
constexpr int ST_SUCCESS = 0, ST_NOT_INITIALIZED = 1, ST_ALLOC_FAILED = 3, ST_INVALID_VALUE = 7,
              ST_ARCH_MISMATCH = 8, ST_MAPPING_ERROR = 11, ST_EXECUTION_FAILED = 13, ST_INTERNAL_ERROR = 14,
              ST_NOT_SUPPORTED = 15, ST_LICENSE_ERROR = 16;
// cublasOperation_t
constexpr int OP_N = 0, OP_T = 1, OP_C = 2;
// cudaDataType_t
constexpr int R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14;
// cublasComputeType_t (cuda-13000 values)
constexpr int COMPUTE_16F = 64, COMPUTE_16F_PEDANTIC = 65, COMPUTE_32F = 68, COMPUTE_32F_PEDANTIC = 69,
              COMPUTE_64F = 70, COMPUTE_64F_PEDANTIC = 71, COMPUTE_32I = 72, COMPUTE_32I_PEDANTIC = 73,
              COMPUTE_32F_FAST_16F = 74, COMPUTE_32F_FAST_16BF = 75, COMPUTE_32F_FAST_TF32 = 77,
              COMPUTE_32F_EMULATED_16BFX9 = 78, COMPUTE_64F_EMULATED_FIXEDPOINT = 79;
// cublasPointerMode_t, cublasAtomicsMode_t, cublasMath_t
constexpr int POINTER_MODE_HOST = 0, POINTER_MODE_DEVICE = 1;
constexpr int ATOMICS_NOT_ALLOWED = 0, ATOMICS_ALLOWED = 1;
constexpr int MATH_DEFAULT = 0, MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16;
// libraryPropertyType_t
constexpr int MAJOR_VERSION = 0, MINOR_VERSION = 1, PATCH_LEVEL = 2;

// The version this library claims: cuBLAS 13.0.0 (CUBLAS_VERSION = major·10000 + minor·100 + patch), the
// release of CUDA 13.0, which is what the project's cudarc bindings (cuda-13000) describe.
constexpr int VER_MAJOR = 13, VER_MINOR = 0, VER_PATCH = 0;
constexpr int CUDART_VERSION = 13000;

constexpr uint64_t HANDLE_MAGIC = 0x656d75626c617321ull;  // "emublas!": catches stale or foreign handles

constexpr const char* kEmuLib = "libcublas";  // for host_blas.h's messages

}  // namespace

#include "host_blas.h"

struct cublasContext {
    uint64_t magic;
    void* stream;
    int pointer_mode;
    int math_mode;
    int atomics_mode;
    void* workspace;
    size_t workspace_bytes;
};
using cublasHandle_t = cublasContext*;

namespace {

// ---- element types --------------------------------------------------------------------------------------
// Each reads its storage into double and writes a double back rounded to nearest even. bf16 and f16 writes
// round through f32 first, as cuBLAS rounds its f32 result to the output type.

float f32_of_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
uint32_t bits_of_f32(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

struct F32 {
    using storage = float;
    static double get(float v) { return v; }
    static float put(double v) { return static_cast<float>(v); }
};
struct F64 {
    using storage = double;
    static double get(double v) { return v; }
    static double put(double v) { return v; }
};
struct BF16 {
    using storage = uint16_t;
    static double get(uint16_t v) { return f32_of_bits(static_cast<uint32_t>(v) << 16); }
    static uint16_t put(double v) {
        uint32_t x = bits_of_f32(static_cast<float>(v));
        if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet NaN
        x += 0x7fffu + ((x >> 16) & 1u);
        return static_cast<uint16_t>(x >> 16);
    }
};
struct F16 {
    using storage = uint16_t;
    static double get(uint16_t h) {
        const int sign = (h & 0x8000) ? -1 : 1;
        const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
        if (exp == 0) return sign * std::ldexp(static_cast<double>(mant), -24);
        if (exp == 31) return mant ? std::nan("") : sign * INFINITY;
        return sign * std::ldexp(static_cast<double>(mant | 0x400), exp - 25);
    }
    static uint16_t put(double v) {
        const uint32_t x = bits_of_f32(static_cast<float>(v));
        const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
        const uint32_t a = x & 0x7fffffffu;
        if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
        if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 rounds to infinity
        if (a < 0x38800000u) {
            // Below 2^-14: subnormal; 2^24·|v| is exact in f32 and its nearest-even integer is the mantissa
            // (1024 lands on the smallest normal, whose bits are the same).
            const float scaled = f32_of_bits(a) * 16777216.0f;
            return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
        }
        uint32_t h = (a >> 13) - (112u << 10);
        const uint32_t rest = a & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;
        return static_cast<uint16_t>(sign | h);
    }
};

// ---- the GEMM engine ------------------------------------------------------------------------------------
// C is cut into MC × NC tiles, each computed whole (all of k) by one thread into a double accumulator and
// then scaled into C once: that keeps beta·C (and the no-read rule for beta = 0) in one place and makes the
// result independent of how tiles are spread over threads. Inside a tile, op(A) and op(B) are packed per
// KC slice into double panels (MR rows / NR columns, k-major) so the micro-kernel streams contiguous memory
// whatever the transposes and leading dimensions are.

constexpr int64_t KC = 256, MC = 128, NC = 128;  // MR, NR: host_blas.h

struct GemmCall {
    int opa, opb;
    int64_t m, n, k;
    double alpha, beta;
    const void* a;
    int64_t lda, stride_a;
    const void* b;
    int64_t ldb, stride_b;
    void* c;
    int64_t ldc, stride_c;
    int64_t batch;
};

// op(A) rows [i0, i0+mc) × k [p0, p0+kc) → MR-row panels, rows past mc zero.
template <class T>
void pack_a(const typename T::storage* a, int64_t lda, bool trans, int64_t i0, int64_t mc, int64_t p0, int64_t kc,
            double* dst) {
    for (int64_t r = 0; r < mc; r += MR, dst += MR * kc) {
        const int64_t rows = std::min(MR, mc - r);
        if (!trans) {
            for (int64_t p = 0; p < kc; ++p) {
                const typename T::storage* src = a + (i0 + r) + (p0 + p) * lda;
                double* d = dst + p * MR;
                int64_t i = 0;
                for (; i < rows; ++i) d[i] = T::get(src[i]);
                for (; i < MR; ++i) d[i] = 0.0;
            }
        } else {
            for (int64_t i = 0; i < MR; ++i) {
                if (i < rows) {
                    const typename T::storage* src = a + p0 + (i0 + r + i) * lda;
                    for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = T::get(src[p]);
                } else {
                    for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = 0.0;
                }
            }
        }
    }
}

// op(B) k [p0, p0+kc) × columns [j0, j0+nc) → NR-column panels, columns past nc zero.
template <class T>
void pack_b(const typename T::storage* b, int64_t ldb, bool trans, int64_t p0, int64_t kc, int64_t j0, int64_t nc,
            double* dst) {
    for (int64_t c = 0; c < nc; c += NR, dst += NR * kc) {
        const int64_t cols = std::min(NR, nc - c);
        if (!trans) {
            for (int64_t j = 0; j < NR; ++j) {
                if (j < cols) {
                    const typename T::storage* src = b + p0 + (j0 + c + j) * ldb;
                    for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = T::get(src[p]);
                } else {
                    for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = 0.0;
                }
            }
        } else {
            for (int64_t p = 0; p < kc; ++p) {
                const typename T::storage* src = b + (j0 + c) + (p0 + p) * ldb;
                double* d = dst + p * NR;
                int64_t j = 0;
                for (; j < cols; ++j) d[j] = T::get(src[j]);
                for (; j < NR; ++j) d[j] = 0.0;
            }
        }
    }
}

// Per-worker packing and accumulator buffers, sized for this call (small GEMMs are frequent, e.g. the
// sweeps' trailing updates) and left uninitialized: every element read is written first.
struct Scratch {
    std::unique_ptr<double[]> ap, bp, acc;
    explicit Scratch(const GemmCall& g) {
        const int64_t mc = std::min(MC, (g.m + MR - 1) / MR * MR), nc = std::min(NC, (g.n + NR - 1) / NR * NR);
        const int64_t kc = std::max<int64_t>(1, std::min(KC, g.k));
        ap.reset(new double[mc * kc]);
        bp.reset(new double[kc * nc]);
        acc.reset(new double[mc * nc]);
    }
};

// One MC × NC tile of one batch member: C = alpha·op(A)·op(B) + beta·C over rows [i0, i0+mc), columns
// [j0, j0+nc).
template <class TAB, class TC>
void gemm_tile(const GemmCall& g, int64_t z, int64_t i0, int64_t mc, int64_t j0, int64_t nc, Scratch& s) {
    using SA = typename TAB::storage;
    using SC = typename TC::storage;
    const SA* a = static_cast<const SA*>(g.a) + z * g.stride_a;
    const SA* b = static_cast<const SA*>(g.b) + z * g.stride_b;
    SC* c = static_cast<SC*>(g.c) + z * g.stride_c;
    double* acc = s.acc.get();  // mc × nc, column-major, ld mc
    std::fill(acc, acc + mc * nc, 0.0);
    // Reference BLAS reads neither A nor B when alpha = 0 or k = 0, so NaNs there must not reach C.
    if (g.alpha != 0.0) {
        for (int64_t p0 = 0; p0 < g.k; p0 += KC) {
            const int64_t kc = std::min(KC, g.k - p0);
            pack_a<TAB>(a, g.lda, g.opa != OP_N, i0, mc, p0, kc, s.ap.get());
            pack_b<TAB>(b, g.ldb, g.opb != OP_N, p0, kc, j0, nc, s.bp.get());
            double tile[MR * NR];
            for (int64_t jr = 0; jr < nc; jr += NR) {
                const int64_t cols = std::min(NR, nc - jr);
                for (int64_t ir = 0; ir < mc; ir += MR) {
                    const int64_t rows = std::min(MR, mc - ir);
                    micro(kc, s.ap.get() + ir * kc, s.bp.get() + jr * kc, tile);
                    for (int64_t j = 0; j < cols; ++j) {
                        double* dst = acc + ir + (jr + j) * mc;
                        for (int64_t i = 0; i < rows; ++i) dst[i] += tile[i + j * MR];
                    }
                }
            }
        }
    }
    for (int64_t j = 0; j < nc; ++j) {
        SC* col = c + i0 + (j0 + j) * g.ldc;
        const double* src = acc + j * mc;
        if (g.beta == 0.0) {
            // beta = 0: C is write-only (it may hold NaN garbage), as cuBLAS documents.
            for (int64_t i = 0; i < mc; ++i) col[i] = TC::put(g.alpha * src[i]);
        } else {
            for (int64_t i = 0; i < mc; ++i) col[i] = TC::put(g.alpha * src[i] + g.beta * TC::get(col[i]));
        }
    }
}

template <class TAB, class TC>
void gemm_run(const GemmCall& g) {
    const int64_t tm = (g.m + MC - 1) / MC, tn = (g.n + NC - 1) / NC;
    parallel_tasks(
        g.batch * tm * tn, static_cast<double>(g.m) * g.n * g.k * g.batch, [&] { return Scratch(g); },
        [&](Scratch& s, int64_t t) {
            const int64_t z = t / (tm * tn), r = t % (tm * tn);
            const int64_t i0 = (r % tm) * MC, j0 = (r / tm) * NC;
            gemm_tile<TAB, TC>(g, z, i0, std::min(MC, g.m - i0), j0, std::min(NC, g.n - j0), s);
        });
}

// Elements a column-major operand of rows × cols (leading dimension ld) spans over `batch` matrices
// `stride` apart: what the stream-order check is told the call touches.
size_t extent(int64_t rows, int64_t cols, int64_t ld, int64_t stride, int64_t batch) {
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    return (size_t)((batch - 1) * stride + (cols - 1) * ld + rows);
}

// A touch of `bytes` at p; none when bytes is 0 (to the driver, 0 bytes means "to the end of the allocation").
Touch span(const void* p, size_t bytes, int write) { return {bytes ? p : nullptr, bytes, write}; }

// Checks shared by every GEMM entry point (cuBLAS's documented CUBLAS_STATUS_INVALID_VALUE cases), then runs:
// queued on the handle's stream, or at once with `now` (a member of cublasGemmBatchedEx, already running as
// one operation on the stream).
template <class TAB, class TC>
int gemm_checked(const char* fn, cublasHandle_t h, GemmCall g, bool now = false) {
    if (!now && !live(h)) {  // a member of a batched call runs after the call checked it (the handle may be gone)
        complain(fn, "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    for (int op : {g.opa, g.opb}) {
        if (op != OP_N && op != OP_T && op != OP_C) {
            complain(fn, "transa/transb = %d (only CUBLAS_OP_N, T and C are valid for real types)", op);
            return ST_INVALID_VALUE;
        }
    }
    if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 0) {
        complain(fn, "negative size m=%lld n=%lld k=%lld batchCount=%lld", (long long)g.m, (long long)g.n,
                 (long long)g.k, (long long)g.batch);
        return ST_INVALID_VALUE;
    }
    const int64_t rows_a = g.opa == OP_N ? g.m : g.k, rows_b = g.opb == OP_N ? g.k : g.n;
    if (g.lda < std::max<int64_t>(1, rows_a) || g.ldb < std::max<int64_t>(1, rows_b) ||
        g.ldc < std::max<int64_t>(1, g.m)) {
        complain(fn, "leading dimension too small: lda=%lld (needs ≥ %lld), ldb=%lld (≥ %lld), ldc=%lld (≥ %lld)",
                 (long long)g.lda, (long long)std::max<int64_t>(1, rows_a), (long long)g.ldb,
                 (long long)std::max<int64_t>(1, rows_b), (long long)g.ldc, (long long)std::max<int64_t>(1, g.m));
        return ST_INVALID_VALUE;
    }
    // Reference BLAS's quick return: nothing to do, and C is not touched.
    if (g.m == 0 || g.n == 0 || g.batch == 0 || ((g.alpha == 0.0 || g.k == 0) && g.beta == 1.0)) return ST_SUCCESS;
    if (g.c == nullptr || (g.alpha != 0.0 && g.k > 0 && (g.a == nullptr || g.b == nullptr))) {
        complain(fn, "null matrix pointer (A=%p B=%p C=%p)", g.a, g.b, g.c);
        return ST_INVALID_VALUE;
    }
    const size_t ab = sizeof(typename TAB::storage), cb = sizeof(typename TC::storage);
    const Touch a = span(g.a, extent(rows_a, g.opa == OP_N ? g.k : g.m, g.lda, g.stride_a, g.batch) * ab, 0),
                b = span(g.b, extent(rows_b, g.opb == OP_N ? g.n : g.k, g.ldb, g.stride_b, g.batch) * ab, 0),
                c = span(g.c, extent(g.m, g.n, g.ldc, g.stride_c, g.batch) * cb, 1);
    if (now) {
        gemm_run<TAB, TC>(g);
        return ST_SUCCESS;
    }
    return on_stream(h->stream, fn, {a, b, c}, [g] {
        gemm_run<TAB, TC>(g);
        return ST_SUCCESS;
    });
}

template <class T>
int gemm_typed(const char* fn, cublasHandle_t h, int opa, int opb, int64_t m, int64_t n, int64_t k,
               const typename T::storage* alpha, const typename T::storage* a, int64_t lda, int64_t sa,
               const typename T::storage* b, int64_t ldb, int64_t sb, const typename T::storage* beta,
               typename T::storage* c, int64_t ldc, int64_t sc, int64_t batch) {
    if (!live(h)) {
        complain(fn, "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    if (alpha == nullptr || beta == nullptr) {
        complain(fn, "alpha or beta is null");
        return ST_INVALID_VALUE;
    }
    // Host and device pointer modes read the scalars the same way: device memory is host memory here.
    const GemmCall g{opa, opb, m, n, k, T::get(*alpha), T::get(*beta), a, lda, sa, b, ldb, sb, c, ldc, sc, batch};
    return gemm_checked<T, T>(fn, h, g);
}

const char* type_name(int t) {
    switch (t) {
        case R_32F: return "CUDA_R_32F";
        case R_64F: return "CUDA_R_64F";
        case R_16F: return "CUDA_R_16F";
        case R_16BF: return "CUDA_R_16BF";
        default: return "another cudaDataType";
    }
}

// cublasGemmEx and friends: the type combinations of cuBLAS's cublasGemmEx table that this emulator covers
// (real floating types); anything else is refused by name.
int gemm_ex(const char* fn, cublasHandle_t h, int opa, int opb, int64_t m, int64_t n, int64_t k, const void* alpha,
            const void* a, int atype, int64_t lda, int64_t sa, const void* b, int btype, int64_t ldb, int64_t sb,
            const void* beta, void* c, int ctype, int64_t ldc, int64_t sc, int64_t batch, int compute,
            bool now = false) {
    if (!now && !live(h)) {
        complain(fn, "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    if (alpha == nullptr || beta == nullptr) {
        complain(fn, "alpha or beta is null");
        return ST_INVALID_VALUE;
    }
    const bool c32 = compute == COMPUTE_32F || compute == COMPUTE_32F_PEDANTIC;
    const bool c32_fast = compute == COMPUTE_32F_FAST_16F || compute == COMPUTE_32F_FAST_16BF ||
                          compute == COMPUTE_32F_FAST_TF32 || compute == COMPUTE_32F_EMULATED_16BFX9;
    const bool c64 = compute == COMPUTE_64F || compute == COMPUTE_64F_PEDANTIC ||
                     compute == COMPUTE_64F_EMULATED_FIXEDPOINT;
    if (!c32 && !c32_fast && !c64) {
        const char* why = (compute == COMPUTE_16F || compute == COMPUTE_16F_PEDANTIC) ? " (half accumulation)"
                          : (compute == COMPUTE_32I || compute == COMPUTE_32I_PEDANTIC) ? " (integer GEMM)"
                                                                                         : "";
        complain(fn, "computeType %d not emulated%s", compute, why);
        return ST_NOT_SUPPORTED;
    }
    auto refuse = [&] {
        complain(fn, "Atype=%d (%s), Btype=%d (%s), Ctype=%d (%s) with computeType %d: not a supported combination",
                 atype, type_name(atype), btype, type_name(btype), ctype, type_name(ctype), compute);
        return ST_NOT_SUPPORTED;
    };
    if (atype != btype) return refuse();
    if (c64) {
        if (atype != R_64F || ctype != R_64F) return refuse();
        const GemmCall g{opa, opb, m, n, k, *static_cast<const double*>(alpha), *static_cast<const double*>(beta),
                         a, lda, sa, b, ldb, sb, c, ldc, sc, batch};
        return gemm_checked<F64, F64>(fn, h, g, now);
    }
    // 32F compute types take float alpha and beta.
    const GemmCall g{opa, opb, m, n, k, *static_cast<const float*>(alpha), *static_cast<const float*>(beta),
                     a, lda, sa, b, ldb, sb, c, ldc, sc, batch};
    if (atype == R_32F && ctype == R_32F) return gemm_checked<F32, F32>(fn, h, g, now);
    if (c32_fast) return refuse();  // the FAST/EMULATED types are for f32 operands only
    if (atype == R_16BF && ctype == R_32F) return gemm_checked<BF16, F32>(fn, h, g, now);
    if (atype == R_16BF && ctype == R_16BF) return gemm_checked<BF16, BF16>(fn, h, g, now);
    if (atype == R_16F && ctype == R_32F) return gemm_checked<F16, F32>(fn, h, g, now);
    if (atype == R_16F && ctype == R_16F) return gemm_checked<F16, F16>(fn, h, g, now);
    return refuse();
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

// ---- handle ---------------------------------------------------------------------------------------------

EXPORT int cublasCreate_v2(cublasHandle_t* handle) {
    if (handle == nullptr) {
        complain("cublasCreate_v2", "handle pointer is null");
        return ST_INVALID_VALUE;
    }
    auto* h = new (std::nothrow) cublasContext{HANDLE_MAGIC, nullptr, POINTER_MODE_HOST, MATH_DEFAULT,
                                               ATOMICS_NOT_ALLOWED, nullptr, 0};
    if (h == nullptr) return ST_ALLOC_FAILED;
    *handle = h;
    return ST_SUCCESS;
}

EXPORT int cublasDestroy_v2(cublasHandle_t handle) {
    if (!live(handle)) {
        complain("cublasDestroy_v2", "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    handle->magic = 0;  // makes a later use of the stale handle likely to be reported rather than to work
    delete handle;
    return ST_SUCCESS;
}

EXPORT int cublasSetStream_v2(cublasHandle_t handle, void* stream) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    // Calls run in this stream's order (host_blas.h's on_stream).
    handle->stream = stream;
    return ST_SUCCESS;
}

EXPORT int cublasGetStream_v2(cublasHandle_t handle, void** stream) {
    return get_field(handle, stream, &cublasContext::stream);
}

EXPORT int cublasSetPointerMode_v2(cublasHandle_t handle, int mode) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    if (mode != POINTER_MODE_HOST && mode != POINTER_MODE_DEVICE) {
        complain("cublasSetPointerMode_v2", "mode %d is neither HOST (0) nor DEVICE (1)", mode);
        return ST_INVALID_VALUE;
    }
    handle->pointer_mode = mode;
    return ST_SUCCESS;
}

EXPORT int cublasGetPointerMode_v2(cublasHandle_t handle, int* mode) {
    return get_field(handle, mode, &cublasContext::pointer_mode);
}

EXPORT int cublasSetMathMode(cublasHandle_t handle, int mode) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    // A base mode (DEFAULT, TENSOR_OP, PEDANTIC, TF32_TENSOR_OP, FP32_EMULATED_BF16X9, FP64_EMULATED_FIXEDPOINT)
    // optionally or-ed with DISALLOW_REDUCED_PRECISION_REDUCTION. All compute the same here (exactly).
    const int base = mode & ~MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    if (base != 0 && base != 1 && base != 2 && base != 3 && base != 4 && base != 8) {
        complain("cublasSetMathMode", "mode %d is not a cublasMath_t", mode);
        return ST_INVALID_VALUE;
    }
    handle->math_mode = mode;
    return ST_SUCCESS;
}

EXPORT int cublasGetMathMode(cublasHandle_t handle, int* mode) {
    return get_field(handle, mode, &cublasContext::math_mode);
}

EXPORT int cublasSetAtomicsMode(cublasHandle_t handle, int mode) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    if (mode != ATOMICS_NOT_ALLOWED && mode != ATOMICS_ALLOWED) return ST_INVALID_VALUE;
    handle->atomics_mode = mode;
    return ST_SUCCESS;
}

EXPORT int cublasGetAtomicsMode(cublasHandle_t handle, int* mode) {
    return get_field(handle, mode, &cublasContext::atomics_mode);
}

EXPORT int cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t bytes) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    // Never used: the host computation allocates what it needs. Kept so the call round-trips.
    handle->workspace = workspace;
    handle->workspace_bytes = bytes;
    return ST_SUCCESS;
}

EXPORT int cublasCreate(cublasHandle_t* handle) { return cublasCreate_v2(handle); }
EXPORT int cublasDestroy(cublasHandle_t handle) { return cublasDestroy_v2(handle); }
EXPORT int cublasSetStream(cublasHandle_t handle, void* stream) { return cublasSetStream_v2(handle, stream); }
EXPORT int cublasGetStream(cublasHandle_t handle, void** stream) { return cublasGetStream_v2(handle, stream); }
EXPORT int cublasSetPointerMode(cublasHandle_t handle, int mode) { return cublasSetPointerMode_v2(handle, mode); }
EXPORT int cublasGetPointerMode(cublasHandle_t handle, int* mode) { return cublasGetPointerMode_v2(handle, mode); }

// ---- library information --------------------------------------------------------------------------------

EXPORT int cublasGetVersion_v2(cublasHandle_t handle, int* version) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    if (version == nullptr) return ST_INVALID_VALUE;
    *version = VER_MAJOR * 10000 + VER_MINOR * 100 + VER_PATCH;
    return ST_SUCCESS;
}

EXPORT int cublasGetVersion(int* version) {
    if (version == nullptr) return ST_INVALID_VALUE;
    *version = VER_MAJOR * 10000 + VER_MINOR * 100 + VER_PATCH;
    return ST_SUCCESS;
}

EXPORT int cublasGetProperty(int type, int* value) {
    if (value == nullptr) return ST_INVALID_VALUE;
    switch (type) {
        case MAJOR_VERSION: *value = VER_MAJOR; return ST_SUCCESS;
        case MINOR_VERSION: *value = VER_MINOR; return ST_SUCCESS;
        case PATCH_LEVEL: *value = VER_PATCH; return ST_SUCCESS;
        default: return ST_INVALID_VALUE;
    }
}

EXPORT size_t cublasGetCudartVersion() { return CUDART_VERSION; }

EXPORT const char* cublasGetStatusName(int status) {
    switch (status) {
        case ST_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case ST_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case ST_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case ST_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case ST_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case ST_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case ST_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case ST_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case ST_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case ST_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
        default: return "CUBLAS_STATUS_UNKNOWN";
    }
}

EXPORT const char* cublasGetStatusString(int status) {
    switch (status) {
        case ST_SUCCESS: return "success";
        case ST_NOT_INITIALIZED: return "the library was not initialized";
        case ST_ALLOC_FAILED: return "the resource allocation failed";
        case ST_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case ST_ARCH_MISMATCH: return "an absent device architectural feature is required";
        case ST_MAPPING_ERROR: return "an access to GPU memory space failed";
        case ST_EXECUTION_FAILED: return "the GPU program failed to execute";
        case ST_INTERNAL_ERROR: return "an internal operation failed";
        case ST_NOT_SUPPORTED: return "the functionality requested is not supported";
        case ST_LICENSE_ERROR: return "error detected trying to check the license";
        default: return "unknown error";
    }
}

// ---- GEMM -----------------------------------------------------------------------------------------------

EXPORT int cublasSgemm_v2_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n, int64_t k,
                             const float* alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                             const float* beta, float* C, int64_t ldc) {
    return gemm_typed<F32>("cublasSgemm_v2", handle, transa, transb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                           ldc, 0, 1);
}

EXPORT int cublasSgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const float* alpha,
                          const float* A, int lda, const float* B, int ldb, const float* beta, float* C, int ldc) {
    return cublasSgemm_v2_64(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

EXPORT int cublasDgemm_v2_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n, int64_t k,
                             const double* alpha, const double* A, int64_t lda, const double* B, int64_t ldb,
                             const double* beta, double* C, int64_t ldc) {
    return gemm_typed<F64>("cublasDgemm_v2", handle, transa, transb, m, n, k, alpha, A, lda, 0, B, ldb, 0, beta, C,
                           ldc, 0, 1);
}

EXPORT int cublasDgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const double* alpha,
                          const double* A, int lda, const double* B, int ldb, const double* beta, double* C,
                          int ldc) {
    return cublasDgemm_v2_64(handle, transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
}

EXPORT int cublasSgemmStridedBatched_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n,
                                        int64_t k, const float* alpha, const float* A, int64_t lda, long long strideA,
                                        const float* B, int64_t ldb, long long strideB, const float* beta, float* C,
                                        int64_t ldc, long long strideC, int64_t batchCount) {
    return gemm_typed<F32>("cublasSgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A, lda, strideA, B,
                           ldb, strideB, beta, C, ldc, strideC, batchCount);
}

EXPORT int cublasSgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                                     const float* alpha, const float* A, int lda, long long strideA, const float* B,
                                     int ldb, long long strideB, const float* beta, float* C, int ldc,
                                     long long strideC, int batchCount) {
    return cublasSgemmStridedBatched_64(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                                        beta, C, ldc, strideC, batchCount);
}

EXPORT int cublasDgemmStridedBatched_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n,
                                        int64_t k, const double* alpha, const double* A, int64_t lda,
                                        long long strideA, const double* B, int64_t ldb, long long strideB,
                                        const double* beta, double* C, int64_t ldc, long long strideC,
                                        int64_t batchCount) {
    return gemm_typed<F64>("cublasDgemmStridedBatched", handle, transa, transb, m, n, k, alpha, A, lda, strideA, B,
                           ldb, strideB, beta, C, ldc, strideC, batchCount);
}

EXPORT int cublasDgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                                     const double* alpha, const double* A, int lda, long long strideA,
                                     const double* B, int ldb, long long strideB, const double* beta, double* C,
                                     int ldc, long long strideC, int batchCount) {
    return cublasDgemmStridedBatched_64(handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB,
                                        beta, C, ldc, strideC, batchCount);
}

EXPORT int cublasGemmEx_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n, int64_t k,
                           const void* alpha, const void* A, int Atype, int64_t lda, const void* B, int Btype,
                           int64_t ldb, const void* beta, void* C, int Ctype, int64_t ldc, int computeType,
                           int /*algo: every algorithm computes the same here*/) {
    return gemm_ex("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta,
                   C, Ctype, ldc, 0, 1, computeType);
}

EXPORT int cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const void* alpha,
                        const void* A, int Atype, int lda, const void* B, int Btype, int ldb, const void* beta,
                        void* C, int Ctype, int ldc, int computeType, int algo) {
    return cublasGemmEx_64(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
                           ldc, computeType, algo);
}

EXPORT int cublasGemmStridedBatchedEx_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n,
                                         int64_t k, const void* alpha, const void* A, int Atype, int64_t lda,
                                         long long strideA, const void* B, int Btype, int64_t ldb,
                                         long long strideB, const void* beta, void* C, int Ctype, int64_t ldc,
                                         long long strideC, int64_t batchCount, int computeType, int /*algo*/) {
    return gemm_ex("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B,
                   Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType);
}

EXPORT int cublasGemmStridedBatchedEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                                      const void* alpha, const void* A, int Atype, int lda, long long strideA,
                                      const void* B, int Btype, int ldb, long long strideB, const void* beta,
                                      void* C, int Ctype, int ldc, long long strideC, int batchCount,
                                      int computeType, int algo) {
    return cublasGemmStridedBatchedEx_64(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype,
                                         ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType, algo);
}

// cublasGemmBatchedEx: batchCount GEMMs of one shape whose A, B and C addresses are read from device arrays of
// pointers, as cublasGemmEx computes each (the same type combinations). The arrays may be written by an earlier
// operation still queued on the stream (an upload), so they are read when the call runs, and the stream-order
// check is told of them only: where the matrices they point to lie is not known when the call is issued.
EXPORT int cublasGemmBatchedEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const void* alpha,
                               const void* const Aarray[], int Atype, int lda, const void* const Barray[], int Btype,
                               int ldb, const void* beta, void* const Carray[], int Ctype, int ldc, int batchCount,
                               int computeType, int /*algo*/) {
    const char* fn = "cublasGemmBatchedEx";
    if (!live(handle)) {
        complain(fn, "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    if (alpha == nullptr || beta == nullptr || batchCount < 0 || m < 0 || n < 0 || k < 0) {
        complain(fn, "alpha or beta is null, or a negative size (m=%d n=%d k=%d batchCount=%d)", m, n, k,
                 batchCount);
        return ST_INVALID_VALUE;
    }
    if (batchCount == 0 || m == 0 || n == 0) return ST_SUCCESS;
    if (Aarray == nullptr || Barray == nullptr || Carray == nullptr) {
        complain(fn, "null pointer array (Aarray=%p Barray=%p Carray=%p)", (const void*)Aarray,
                 (const void*)Barray, (const void*)Carray);
        return ST_INVALID_VALUE;
    }
    // The scalars are read now (host pointer mode): 64F compute types take doubles, the others floats.
    const bool c64 = computeType == COMPUTE_64F || computeType == COMPUTE_64F_PEDANTIC ||
                     computeType == COMPUTE_64F_EMULATED_FIXEDPOINT;
    double scalars[2] = {0, 0};
    std::memcpy(&scalars[0], alpha, c64 ? 8 : 4);
    std::memcpy(&scalars[1], beta, c64 ? 8 : 4);
    const size_t bytes = sizeof(void*) * (size_t)batchCount;
    return on_stream(handle->stream, fn, {span(Aarray, bytes, 0), span(Barray, bytes, 0), span(Carray, bytes, 0)},
                     [=] {
                         for (int z = 0; z < batchCount; ++z) {
                             const int st = gemm_ex(fn, handle, transa, transb, m, n, k, &scalars[0], Aarray[z],
                                                    Atype, lda, 0, Barray[z], Btype, ldb, 0, &scalars[1], Carray[z],
                                                    Ctype, ldc, 0, 1, computeType, true);
                             if (st != ST_SUCCESS) return st;
                         }
                         return ST_SUCCESS;
                     });
}

// cublasSgemmEx: f32 scalars and f32 computation over the operand types of cublasGemmEx's 32F rows.
EXPORT int cublasSgemmEx_64(cublasHandle_t handle, int transa, int transb, int64_t m, int64_t n, int64_t k,
                            const float* alpha, const void* A, int Atype, int64_t lda, const void* B, int Btype,
                            int64_t ldb, const float* beta, void* C, int Ctype, int64_t ldc) {
    return gemm_ex("cublasSgemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta,
                   C, Ctype, ldc, 0, 1, COMPUTE_32F);
}

EXPORT int cublasSgemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const float* alpha,
                         const void* A, int Atype, int lda, const void* B, int Btype, int ldb, const float* beta,
                         void* C, int Ctype, int ldc) {
    return cublasSgemmEx_64(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc);
}

// ---- TRSM -----------------------------------------------------------------------------------------------
// cublasStrsm_v2: B := alpha · A⁻¹ · B for the one case the project calls (solver.rs, the trsm route of
// U = chol(H⁻¹)ᵀ): side LEFT, A upper triangular (CUBLAS_FILL_MODE_UPPER), op N; unit or non-unit diagonal.
// Other cases are refused with CUBLAS_STATUS_NOT_SUPPORTED and a message. Column-major; each column of B is
// one back substitution, accumulated in double and rounded once (at least as accurate as cuBLAS's f32).
namespace {
constexpr int SIDE_LEFT = 0, FILL_LOWER = 0, FILL_UPPER = 1, DIAG_NON_UNIT = 0, DIAG_UNIT = 1;
}  // namespace

EXPORT int cublasStrsm_v2_64(cublasHandle_t handle, int side, int uplo, int trans, int diag, int64_t m, int64_t n,
                             const float* alpha, const float* A, int64_t lda, float* B, int64_t ldb) {
    const char* fn = "cublasStrsm_v2";
    if (!live(handle)) {
        complain(fn, "handle is null or not a live cuBLAS handle");
        return ST_NOT_INITIALIZED;
    }
    if ((uplo != FILL_LOWER && uplo != FILL_UPPER) || (trans != OP_N && trans != OP_T && trans != OP_C) ||
        (diag != DIAG_NON_UNIT && diag != DIAG_UNIT) || m < 0 || n < 0 || lda < std::max<int64_t>(1, m) ||
        ldb < std::max<int64_t>(1, m)) {
        complain(fn, "invalid argument (uplo=%d trans=%d diag=%d m=%lld n=%lld lda=%lld ldb=%lld)", uplo, trans,
                 diag, (long long)m, (long long)n, (long long)lda, (long long)ldb);
        return ST_INVALID_VALUE;
    }
    if (side != SIDE_LEFT || uplo != FILL_UPPER || trans != OP_N) {
        complain(fn, "only side LEFT, fill UPPER, op N is emulated (side=%d uplo=%d trans=%d)", side, uplo, trans);
        return ST_NOT_SUPPORTED;
    }
    if (m == 0 || n == 0) return ST_SUCCESS;
    if (alpha == nullptr || A == nullptr || B == nullptr) {
        complain(fn, "null pointer (alpha=%p A=%p B=%p)", (const void*)alpha, (const void*)A, (void*)B);
        return ST_INVALID_VALUE;
    }
    const double al = *alpha;
    const bool unit = diag == DIAG_UNIT;
    const Touch a = span(A, extent(m, m, lda, 0, 1) * sizeof(float), 0),
                b = span(B, extent(m, n, ldb, 0, 1) * sizeof(float), 1);
    return on_stream(handle->stream, fn, {a, b}, [=] {
        parallel_tasks(
            n, static_cast<double>(m) * m * n / 2, [m] { return std::vector<double>(m); },
            [&](std::vector<double>& x, int64_t j) {
                float* col = B + j * ldb;
                for (int64_t i = m - 1; i >= 0; --i) {
                    double s = al * col[i];
                    for (int64_t k = i + 1; k < m; ++k) s -= static_cast<double>(A[i + k * lda]) * x[k];
                    x[i] = unit ? s : s / A[i + i * lda];
                }
                for (int64_t i = 0; i < m; ++i) col[i] = static_cast<float>(x[i]);
            });
        return ST_SUCCESS;
    });
}

EXPORT int cublasStrsm_v2(cublasHandle_t handle, int side, int uplo, int trans, int diag, int m, int n,
                          const float* alpha, const float* A, int lda, float* B, int ldb) {
    return cublasStrsm_v2_64(handle, side, uplo, trans, diag, m, n, alpha, A, lda, B, ldb);
}
