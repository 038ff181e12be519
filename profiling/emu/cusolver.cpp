// cusolver.cpp — libcusolver.so of the CPU emulator: the cuSOLVER dense calls the project makes, on the host.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md), which runs the project's CUDA code
// paths without a GPU: host memory stands in for device memory (a CUdeviceptr is a host address, so the
// "device" info word and workspace are plain host memory), and each factorization is one operation on the
// handle's stream, queued by the fake driver (streams.h). cudarc (`dynamic-loading`) dlopen()s this file's library as
// libcusolver.so and resolves each function lazily by the name below; the ABI (argument types, enum values,
// status codes) is the one of cudarc 0.19.10's src/cusolver/sys/mod.rs with the cuda-13000 bindings. No CUDA
// header is used.
//
// Build:
//   profiling/emu/build.sh (into target/cuda-emu/libcusolver.so)
// Test: profiling/emu/test_blas.cpp.
//
// Exported (what the project reaches through cudarc and solver.rs is marked *):
//   handle:  cusolverDnCreate*, cusolverDnDestroy*, cusolverDnSetStream*, cusolverDnGetStream,
//            cusolverDnSetDeterministicMode, cusolverDnGetDeterministicMode
//   params:  cusolverDnCreateParams*, cusolverDnDestroyParams*, cusolverDnSetAdvOptions
//   info:    cusolverGetVersion, cusolverGetProperty
//   64-bit:  cusolverDnXpotrf_bufferSize*, cusolverDnXpotrf*, cusolverDnXtrtri_bufferSize*, cusolverDnXtrtri*
//            (CUDA_R_32F or CUDA_R_64F matrices, computeType equal to the matrix type)
//   legacy:  cusolverDnSpotrf_bufferSize, cusolverDnSpotrf, cusolverDnDpotrf_bufferSize, cusolverDnDpotrf
//
// Semantics are LAPACK's (spotrf/strtri), column-major:
//   potrf: A = L·Lᵀ (lower) or Uᵀ·U (upper) in the chosen triangle; the other triangle is not touched. When
//     the leading minor of order i is not positive definite (or the pivot is NaN), *info = i and A is left as
//     LAPACK's unblocked spotf2 leaves it: columns (lower) / rows (upper) before i hold the factor, the
//     i-th diagonal element holds the non-positive pivot, the rest is the input.
//   trtri: the triangle is replaced by its inverse; with CUBLAS_DIAG_UNIT the diagonal is neither read nor
//     written. If a diagonal element is exactly zero (non-unit), *info = its 1-based index and A is unchanged.
// Numerics: products are accumulated in double and each output element is rounded once to f32 per block of
// columns, so results are at least as accurate as cuSOLVER's f32 arithmetic and do not depend on the thread
// count.

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

// cusolverStatus_t
constexpr int ST_SUCCESS = 0, ST_NOT_INITIALIZED = 1, ST_ALLOC_FAILED = 2, ST_INVALID_VALUE = 3,
              ST_EXECUTION_FAILED = 6, ST_INTERNAL_ERROR = 7, ST_NOT_SUPPORTED = 9;
// cublasFillMode_t, cublasDiagType_t
constexpr int FILL_LOWER = 0, FILL_UPPER = 1;
constexpr int DIAG_NON_UNIT = 0, DIAG_UNIT = 1;
// cudaDataType_t
constexpr int R_32F = 0, R_64F = 1;
// cusolverDeterministicMode_t
constexpr int DETERMINISTIC = 1, NON_DETERMINISTIC = 2;
// cusolverAlgMode_t
constexpr int ALG_0 = 0, ALG_2 = 2;
// libraryPropertyType_t
constexpr int MAJOR_VERSION = 0, MINOR_VERSION = 1, PATCH_LEVEL = 2;

// The version this library claims: cuSOLVER 12.0.0, the release of CUDA 13.0 (CUSOLVER_VERSION =
// major·1000 + minor·100 + patch), which is what the project's cudarc bindings (cuda-13000) describe.
constexpr int VER_MAJOR = 12, VER_MINOR = 0, VER_PATCH = 0;

// Workspace sizes the *_bufferSize queries report. Nothing is kept there (the host computation allocates its
// own), but a nonzero device size makes the caller's size → allocate → pass sequence real, and the size
// passed back in is checked against it.
constexpr size_t DEVICE_WORKSPACE_BYTES = 256, HOST_WORKSPACE_BYTES = 0;

constexpr uint64_t HANDLE_MAGIC = 0x656d75736f6c7672ull, PARAMS_MAGIC = 0x656d757061726d73ull;

constexpr const char* kEmuLib = "libcusolver";  // for host_blas.h's messages

}  // namespace

#include "host_blas.h"

struct cusolverDnContext {
    uint64_t magic;
    void* stream;
    int deterministic_mode;
};
struct cusolverDnParams {
    uint64_t magic;
    int algo[8];  // per cusolverDnFunction_t; recorded only, every algorithm computes the same here
};
using cusolverDnHandle_t = cusolverDnContext*;
using cusolverDnParams_t = cusolverDnParams*;

namespace {

// ---- blocked update kernel ------------------------------------------------------------------------------
// Both factorizations spend their time in W += P·Qᵀ (W a double panel, P a block of the stored triangle, Q a
// small block already in double). P is packed per KC slice into MR-row panels so the micro-kernel streams
// contiguous memory whichever triangle (lower: column-contiguous, upper: row-contiguous) P comes from.

constexpr int64_t KC = 256, MC = 128, NB = 64;  // MR, NR: host_blas.h

// The stored triangle seen as lower: element (i, j), i ≥ j, of L (or of the symmetric A's lower half). For
// CUBLAS_FILL_MODE_UPPER that is U(j, i) = a[j + i·lda]: U = Lᵀ, so one lower algorithm serves both fills.
template <class S>
struct Tri {
    S* a;
    int64_t rs, cs;
    S& at(int64_t i, int64_t j) const { return a[i * rs + j * cs]; }
};

template <class S>
Tri<S> tri_view(S* a, int64_t lda, int uplo) {
    return uplo == FILL_LOWER ? Tri<S>{a, 1, lda} : Tri<S>{a, lda, 1};
}

// Q (nq × k, element (c, t) = q(c, t)) → NR-column panels over the whole k, columns past nq zero.
template <class Q>
std::vector<double> pack_q(int64_t nq, int64_t k, Q&& q) {
    const int64_t panels = (nq + NR - 1) / NR;
    std::vector<double> out(static_cast<size_t>(panels * NR * k));
    for (int64_t c0 = 0; c0 < nq; c0 += NR) {
        double* dst = out.data() + c0 * k;
        for (int64_t t = 0; t < k; ++t)
            for (int64_t j = 0; j < NR; ++j) dst[t * NR + j] = c0 + j < nq ? q(c0 + j, t) : 0.0;
    }
    return out;
}

// W[0:m, 0:nq] (column-major, ld ldw) += P·Qᵀ, where P(r, t) = view.at(r0 + r, t0 + t) for r < m, t < k and Q
// is pack_q's output (nq × k).
template <class S>
void update(double* w, int64_t ldw, int64_t m, int64_t nq, int64_t k, const Tri<S>& view, int64_t r0, int64_t t0,
            const std::vector<double>& qp) {
    if (m <= 0 || nq <= 0 || k <= 0) return;
    const int64_t chunks = (m + MC - 1) / MC;
    const bool row_contiguous = view.rs == 1;
    parallel_tasks(chunks, static_cast<double>(m) * nq * k, [] { return 0; }, [&](int, int64_t chunk) {
        const int64_t i0 = chunk * MC, mc = std::min(MC, m - i0);
        // Packed P slice, uninitialized: pack fills every element the micro-kernel reads.
        const int64_t rows_p = (mc + MR - 1) / MR * MR;
        std::unique_ptr<double[]> pp(new double[rows_p * std::min(KC, k)]);
        double tile[MR * NR];
        for (int64_t p0 = 0; p0 < k; p0 += KC) {
            const int64_t kc = std::min(KC, k - p0);
            for (int64_t r = 0; r < mc; r += MR) {
                double* dst = pp.get() + r * kc;
                const int64_t rows = std::min(MR, mc - r);
                for (int64_t i = rows; i < MR; ++i)
                    for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = 0.0;
                if (row_contiguous) {
                    for (int64_t p = 0; p < kc; ++p) {
                        const S* src = &view.at(r0 + i0 + r, t0 + p0 + p);
                        for (int64_t i = 0; i < rows; ++i) dst[p * MR + i] = src[i];
                    }
                } else {
                    for (int64_t i = 0; i < rows; ++i) {
                        const S* src = &view.at(r0 + i0 + r + i, t0 + p0);
                        for (int64_t p = 0; p < kc; ++p) dst[p * MR + i] = src[p * view.cs];
                    }
                }
            }
            for (int64_t jr = 0; jr < nq; jr += NR) {
                const int64_t cols = std::min(NR, nq - jr);
                for (int64_t ir = 0; ir < mc; ir += MR) {
                    const int64_t rows = std::min(MR, mc - ir);
                    micro(kc, pp.get() + ir * kc, qp.data() + jr * k + p0 * NR, tile);
                    for (int64_t j = 0; j < cols; ++j) {
                        double* d = w + i0 + ir + (jr + j) * ldw;
                        for (int64_t i = 0; i < rows; ++i) d[i] += tile[i + j * MR];
                    }
                }
            }
        }
    });
}

// ---- potrf ----------------------------------------------------------------------------------------------
// Left-looking by blocks of NB columns: a block's panel W = A[j0:n, J] − L[j0:n, 0:j0]·L[J, 0:j0]ᵀ is formed
// in double in one pass (one rounding per element for the whole history), then factored column by column.
template <class S>
int potrf(Tri<S> v, int64_t n) {
    for (int64_t j0 = 0; j0 < n; j0 += NB) {
        const int64_t nb = std::min(NB, n - j0), rows = n - j0;
        std::vector<double> w(static_cast<size_t>(rows * nb));
        for (int64_t c = 0; c < nb; ++c) {
            for (int64_t r = 0; r < c; ++r) w[r + c * rows] = 0.0;
            for (int64_t r = c; r < rows; ++r) w[r + c * rows] = v.at(j0 + r, j0 + c);
        }
        if (j0 > 0) {
            const auto qp = pack_q(nb, j0, [&](int64_t c, int64_t t) { return -static_cast<double>(v.at(j0 + c, t)); });
            update(w.data(), rows, rows, nb, j0, v, j0, 0, qp);
        }
        for (int64_t c = 0; c < nb; ++c) {
            double* col = w.data() + c * rows;
            const double d = col[c];
            if (!(d > 0.0)) {
                // spotf2's failure state: earlier columns final, the pivot stored, everything after untouched.
                for (int64_t cc = 0; cc < c; ++cc)
                    for (int64_t r = cc; r < rows; ++r) v.at(j0 + r, j0 + cc) = static_cast<S>(w[r + cc * rows]);
                v.at(j0 + c, j0 + c) = static_cast<S>(d);
                return static_cast<int>(j0 + c + 1);
            }
            const double l = std::sqrt(d), inv = 1.0 / l;
            col[c] = l;
            for (int64_t r = c + 1; r < rows; ++r) col[r] *= inv;
            for (int64_t c2 = c + 1; c2 < nb; ++c2) {
                const double f = col[c2];
                double* dst = w.data() + c2 * rows;
                for (int64_t r = c2; r < rows; ++r) dst[r] -= col[r] * f;
            }
        }
        for (int64_t c = 0; c < nb; ++c)
            for (int64_t r = c; r < rows; ++r) v.at(j0 + r, j0 + c) = static_cast<S>(w[r + c * rows]);
    }
    return 0;
}

// ---- trtri ----------------------------------------------------------------------------------------------
// X = L⁻¹ by blocks of NB columns, left to right: X[J,J] = L[J,J]⁻¹, then L[j1:,j1:]·Y = −L[j1:,J]·X[J,J] is
// solved for Y = X[j1:,J] by forward substitution over blocks of NB rows, each block's contribution to the rows
// below applied as one update. A block column reads only L[j0:, j0:], so writing X[:,J] over L[:,J] when the
// block is done is safe for the blocks to its right.
template <class S>
int trtri(Tri<S> v, int64_t n, bool unit) {
    if (!unit)
        for (int64_t i = 0; i < n; ++i)
            if (v.at(i, i) == static_cast<S>(0)) return static_cast<int>(i + 1);
    auto diag = [&](int64_t i) { return unit ? 1.0 : static_cast<double>(v.at(i, i)); };
    std::vector<double> x11(static_cast<size_t>(NB * NB)), lii(static_cast<size_t>(NB * NB));
    for (int64_t j0 = 0; j0 < n; j0 += NB) {
        const int64_t nb = std::min(NB, n - j0), j1 = j0 + nb, below = n - j1;
        // x11 = L[J,J]⁻¹ (column-major, ld NB), by forward substitution per column.
        std::fill(x11.begin(), x11.end(), 0.0);
        for (int64_t c = 0; c < nb; ++c) {
            double* xc = x11.data() + c * NB;
            xc[c] = 1.0 / diag(j0 + c);
            for (int64_t r = c + 1; r < nb; ++r) {
                double s = 0.0;
                for (int64_t t = c; t < r; ++t) s += static_cast<double>(v.at(j0 + r, j0 + t)) * xc[t];
                xc[r] = -s / diag(j0 + r);
            }
        }
        std::vector<double> y;  // below × nb, column-major, ld below
        if (below > 0) {
            y.assign(static_cast<size_t>(below * nb), 0.0);
            const auto qx = pack_q(nb, nb, [&](int64_t c, int64_t t) { return -x11[t + c * NB]; });
            update(y.data(), below, below, nb, nb, v, j1, j0, qx);  // y = −L[j1:, J]·x11
            for (int64_t i0 = j1; i0 < n; i0 += NB) {
                const int64_t ib = std::min(NB, n - i0), o = i0 - j1;
                for (int64_t t = 0; t < ib; ++t)
                    for (int64_t r = t + 1; r < ib; ++r) lii[r + t * NB] = v.at(i0 + r, i0 + t);
                for (int64_t c = 0; c < nb; ++c) {
                    double* yc = y.data() + o + c * below;
                    for (int64_t t = 0; t < ib; ++t) {
                        const double yt = yc[t] / diag(i0 + t);
                        yc[t] = yt;
                        const double* lt = lii.data() + t * NB;
                        for (int64_t r = t + 1; r < ib; ++r) yc[r] -= lt[r] * yt;
                    }
                }
                const int64_t rest = n - (i0 + ib);
                if (rest > 0) {
                    const auto qy = pack_q(nb, ib, [&](int64_t c, int64_t t) { return -y[o + t + c * below]; });
                    update(y.data() + o + ib, below, rest, nb, ib, v, i0 + ib, i0, qy);
                }
            }
        }
        for (int64_t c = 0; c < nb; ++c) {
            if (!unit) v.at(j0 + c, j0 + c) = static_cast<S>(x11[c + c * NB]);
            for (int64_t r = c + 1; r < nb; ++r) v.at(j0 + r, j0 + c) = static_cast<S>(x11[r + c * NB]);
            for (int64_t r = 0; r < below; ++r) v.at(j1 + r, j0 + c) = static_cast<S>(y[r + c * below]);
        }
    }
    return 0;
}

// ---- argument checks shared by the entry points ---------------------------------------------------------

int check_common(const char* fn, cusolverDnHandle_t h, int uplo, int64_t n, const void* a, int64_t lda) {
    if (!live(h)) {
        complain(fn, "handle is null or not a live cuSOLVER handle");
        return ST_NOT_INITIALIZED;
    }
    if (uplo != FILL_LOWER && uplo != FILL_UPPER) {
        complain(fn, "uplo = %d (only CUBLAS_FILL_MODE_LOWER (0) and UPPER (1))", uplo);
        return ST_INVALID_VALUE;
    }
    if (n < 0 || lda < std::max<int64_t>(1, n)) {
        complain(fn, "n = %lld, lda = %lld (needs n ≥ 0, lda ≥ max(1, n))", (long long)n, (long long)lda);
        return ST_INVALID_VALUE;
    }
    if (n > 0 && a == nullptr) {
        complain(fn, "A is null");
        return ST_INVALID_VALUE;
    }
    return ST_SUCCESS;
}

int check_types(const char* fn, int type_a, int compute) {
    if ((type_a == R_32F && compute == R_32F) || (type_a == R_64F && compute == R_64F)) return ST_SUCCESS;
    complain(fn, "dataTypeA = %d, computeType = %d: only CUDA_R_32F/CUDA_R_32F (0/0) and CUDA_R_64F/CUDA_R_64F (1/1)",
             type_a, compute);
    return ST_NOT_SUPPORTED;
}

int check_type(const char* fn, int type_a) {
    if (type_a == R_32F || type_a == R_64F) return ST_SUCCESS;
    complain(fn, "dataTypeA = %d: only CUDA_R_32F (0) and CUDA_R_64F (1)", type_a);
    return ST_NOT_SUPPORTED;
}

int check_workspace(const char* fn, const void* dev, size_t dev_bytes, const void* host, size_t host_bytes) {
    if (dev_bytes < DEVICE_WORKSPACE_BYTES || (DEVICE_WORKSPACE_BYTES > 0 && dev == nullptr) ||
        host_bytes < HOST_WORKSPACE_BYTES || (HOST_WORKSPACE_BYTES > 0 && host == nullptr)) {
        complain(fn, "workspace smaller than the *_bufferSize query said (device %zu of %zu bytes at %p, host %zu of %zu)",
                 dev_bytes, DEVICE_WORKSPACE_BYTES, dev, host_bytes, HOST_WORKSPACE_BYTES);
        return ST_INVALID_VALUE;
    }
    return ST_SUCCESS;
}

// Fault injection (README "Fault injection"): EMU_FAIL_POTRF=k makes the k-th potrf call (counted when
// issued, from 1) and every later one report the matrix not positive definite, *info = n (the last leading
// minor), after factoring it as usual: every damping retry of the host fails too. Off when unset.
bool potrf_fails(const char* fn, int64_t n) {
    static const long long from = [] {
        const char* s = std::getenv("EMU_FAIL_POTRF");
        if (s == nullptr || *s == 0) return -1LL;
        char* end = nullptr;
        const long long v = std::strtoll(s, &end, 10);
        if (*end != 0 || v < 1) {
            std::fprintf(stderr, "emu: EMU_FAIL_POTRF=%s is not a count from 1; no fault injected\n", s);
            return -1LL;
        }
        return v;
    }();
    static long long calls = 0;
    if (from < 0 || ++calls < from) return false;
    std::fprintf(stderr, "emu: injected fault: %s call %lld (n = %lld) reports info = n (EMU_FAIL_POTRF=%lld)\n", fn,
                 calls, (long long)n, from);
    return true;
}

// Runs a factorization of A on the handle's stream and stores its info. `body` is kept until the stream
// runs it: it captures by value.
template <class F>
int run(const char* fn, cusolverDnHandle_t handle, int* info, const void* A, F body) {
    if (info == nullptr) {
        complain(fn, "info is null");
        return ST_INVALID_VALUE;
    }
    // A is factored in place (to the end of its allocation: the driver's bound, as for a kernel argument).
    return on_stream(handle->stream, fn, {{A, 0, 1}, {info, sizeof(int), 1}}, [info, body] {
        *info = body();
        return ST_SUCCESS;
    });
}

}  // namespace

#define EXPORT extern "C" __attribute__((visibility("default")))

// ---- handle and params ----------------------------------------------------------------------------------

EXPORT int cusolverDnCreate(cusolverDnHandle_t* handle) {
    if (handle == nullptr) {
        complain("cusolverDnCreate", "handle pointer is null");
        return ST_INVALID_VALUE;
    }
    auto* h = new (std::nothrow) cusolverDnContext{HANDLE_MAGIC, nullptr, DETERMINISTIC};
    if (h == nullptr) return ST_ALLOC_FAILED;
    *handle = h;
    return ST_SUCCESS;
}

EXPORT int cusolverDnDestroy(cusolverDnHandle_t handle) {
    if (!live(handle)) {
        complain("cusolverDnDestroy", "handle is null or not a live cuSOLVER handle");
        return ST_NOT_INITIALIZED;
    }
    handle->magic = 0;  // makes a later use of the stale handle likely to be reported rather than to work
    delete handle;
    return ST_SUCCESS;
}

EXPORT int cusolverDnSetStream(cusolverDnHandle_t handle, void* stream) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    // Calls run in this stream's order (host_blas.h's on_stream).
    handle->stream = stream;
    return ST_SUCCESS;
}

EXPORT int cusolverDnGetStream(cusolverDnHandle_t handle, void** stream) {
    return get_field(handle, stream, &cusolverDnContext::stream);
}

EXPORT int cusolverDnSetDeterministicMode(cusolverDnHandle_t handle, int mode) {
    if (!live(handle)) return ST_NOT_INITIALIZED;
    if (mode != DETERMINISTIC && mode != NON_DETERMINISTIC) return ST_INVALID_VALUE;
    handle->deterministic_mode = mode;  // results here are deterministic either way
    return ST_SUCCESS;
}

EXPORT int cusolverDnGetDeterministicMode(cusolverDnHandle_t handle, int* mode) {
    return get_field(handle, mode, &cusolverDnContext::deterministic_mode);
}

EXPORT int cusolverDnCreateParams(cusolverDnParams_t* params) {
    if (params == nullptr) return ST_INVALID_VALUE;
    auto* p = new (std::nothrow) cusolverDnParams{PARAMS_MAGIC, {}};
    if (p == nullptr) return ST_ALLOC_FAILED;
    *params = p;
    return ST_SUCCESS;
}

EXPORT int cusolverDnDestroyParams(cusolverDnParams_t params) {
    if (params == nullptr || params->magic != PARAMS_MAGIC) {
        complain("cusolverDnDestroyParams", "params is null or not live");
        return ST_INVALID_VALUE;
    }
    params->magic = 0;
    delete params;
    return ST_SUCCESS;
}

EXPORT int cusolverDnSetAdvOptions(cusolverDnParams_t params, int function, int algo) {
    if (params == nullptr || params->magic != PARAMS_MAGIC) return ST_INVALID_VALUE;
    if (function < 0 || function >= 8 || algo < ALG_0 || algo > ALG_2) {
        complain("cusolverDnSetAdvOptions", "function = %d, algo = %d not known", function, algo);
        return ST_INVALID_VALUE;
    }
    params->algo[function] = algo;
    return ST_SUCCESS;
}

EXPORT int cusolverGetVersion(int* version) {
    if (version == nullptr) return ST_INVALID_VALUE;
    *version = VER_MAJOR * 1000 + VER_MINOR * 100 + VER_PATCH;
    return ST_SUCCESS;
}

EXPORT int cusolverGetProperty(int type, int* value) {
    if (value == nullptr) return ST_INVALID_VALUE;
    switch (type) {
        case MAJOR_VERSION: *value = VER_MAJOR; return ST_SUCCESS;
        case MINOR_VERSION: *value = VER_MINOR; return ST_SUCCESS;
        case PATCH_LEVEL: *value = VER_PATCH; return ST_SUCCESS;
        default: return ST_INVALID_VALUE;
    }
}

// ---- 64-bit API: potrf and trtri ------------------------------------------------------------------------

EXPORT int cusolverDnXpotrf_bufferSize(cusolverDnHandle_t handle, cusolverDnParams_t /*params*/, int uplo, int64_t n,
                                       int dataTypeA, const void* A, int64_t lda, int computeType,
                                       size_t* workspaceInBytesOnDevice, size_t* workspaceInBytesOnHost) {
    const char* fn = "cusolverDnXpotrf_bufferSize";
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (int st = check_types(fn, dataTypeA, computeType)) return st;
    if (workspaceInBytesOnDevice == nullptr || workspaceInBytesOnHost == nullptr) return ST_INVALID_VALUE;
    *workspaceInBytesOnDevice = DEVICE_WORKSPACE_BYTES;
    *workspaceInBytesOnHost = HOST_WORKSPACE_BYTES;
    return ST_SUCCESS;
}

EXPORT int cusolverDnXpotrf(cusolverDnHandle_t handle, cusolverDnParams_t /*params*/, int uplo, int64_t n,
                            int dataTypeA, void* A, int64_t lda, int computeType, void* bufferOnDevice,
                            size_t workspaceInBytesOnDevice, void* bufferOnHost, size_t workspaceInBytesOnHost,
                            int* info) {
    const char* fn = "cusolverDnXpotrf";
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (int st = check_types(fn, dataTypeA, computeType)) return st;
    if (int st = check_workspace(fn, bufferOnDevice, workspaceInBytesOnDevice, bufferOnHost, workspaceInBytesOnHost))
        return st;
    return run(fn, handle, info, A, [=, fails = potrf_fails(fn, n)] {
        const int i = dataTypeA == R_32F ? potrf(tri_view(static_cast<float*>(A), lda, uplo), n)
                                         : potrf(tri_view(static_cast<double*>(A), lda, uplo), n);
        return fails ? static_cast<int>(n) : i;
    });
}

EXPORT int cusolverDnXtrtri_bufferSize(cusolverDnHandle_t handle, int uplo, int diag, int64_t n, int dataTypeA,
                                       void* A, int64_t lda, size_t* workspaceInBytesOnDevice,
                                       size_t* workspaceInBytesOnHost) {
    const char* fn = "cusolverDnXtrtri_bufferSize";
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (diag != DIAG_NON_UNIT && diag != DIAG_UNIT) {
        complain(fn, "diag = %d (only CUBLAS_DIAG_NON_UNIT (0) and UNIT (1))", diag);
        return ST_INVALID_VALUE;
    }
    if (int st = check_type(fn, dataTypeA)) return st;
    if (workspaceInBytesOnDevice == nullptr || workspaceInBytesOnHost == nullptr) return ST_INVALID_VALUE;
    *workspaceInBytesOnDevice = DEVICE_WORKSPACE_BYTES;
    *workspaceInBytesOnHost = HOST_WORKSPACE_BYTES;
    return ST_SUCCESS;
}

EXPORT int cusolverDnXtrtri(cusolverDnHandle_t handle, int uplo, int diag, int64_t n, int dataTypeA, void* A,
                            int64_t lda, void* bufferOnDevice, size_t workspaceInBytesOnDevice, void* bufferOnHost,
                            size_t workspaceInBytesOnHost, int* info) {
    const char* fn = "cusolverDnXtrtri";
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (diag != DIAG_NON_UNIT && diag != DIAG_UNIT) {
        complain(fn, "diag = %d (only CUBLAS_DIAG_NON_UNIT (0) and UNIT (1))", diag);
        return ST_INVALID_VALUE;
    }
    if (int st = check_type(fn, dataTypeA)) return st;
    if (int st = check_workspace(fn, bufferOnDevice, workspaceInBytesOnDevice, bufferOnHost, workspaceInBytesOnHost))
        return st;
    const bool unit = diag == DIAG_UNIT;
    return run(fn, handle, info, A, [=] {
        return dataTypeA == R_32F ? trtri(tri_view(static_cast<float*>(A), lda, uplo), n, unit)
                                  : trtri(tri_view(static_cast<double*>(A), lda, uplo), n, unit);
    });
}

// ---- legacy 32-bit API: potrf ---------------------------------------------------------------------------
// Lwork counts elements; the workspace itself is unused, as for the 64-bit API.

namespace {

template <class S>
int legacy_potrf_size(const char* fn, cusolverDnHandle_t handle, int uplo, int n, S* A, int lda, int* lwork) {
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (lwork == nullptr) return ST_INVALID_VALUE;
    *lwork = static_cast<int>(DEVICE_WORKSPACE_BYTES / sizeof(S));
    return ST_SUCCESS;
}

template <class S>
int legacy_potrf(const char* fn, cusolverDnHandle_t handle, int uplo, int n, S* A, int lda, S* work, int lwork,
                 int* info) {
    if (int st = check_common(fn, handle, uplo, n, A, lda)) return st;
    if (int st = check_workspace(fn, work, lwork < 0 ? 0 : static_cast<size_t>(lwork) * sizeof(S), nullptr, 0))
        return st;
    return run(fn, handle, info, A, [=, fails = potrf_fails(fn, n)] {
        const int i = potrf(tri_view(A, lda, uplo), n);
        return fails ? n : i;
    });
}

}  // namespace

EXPORT int cusolverDnSpotrf_bufferSize(cusolverDnHandle_t handle, int uplo, int n, float* A, int lda, int* Lwork) {
    return legacy_potrf_size("cusolverDnSpotrf_bufferSize", handle, uplo, n, A, lda, Lwork);
}

EXPORT int cusolverDnDpotrf_bufferSize(cusolverDnHandle_t handle, int uplo, int n, double* A, int lda, int* Lwork) {
    return legacy_potrf_size("cusolverDnDpotrf_bufferSize", handle, uplo, n, A, lda, Lwork);
}

EXPORT int cusolverDnSpotrf(cusolverDnHandle_t handle, int uplo, int n, float* A, int lda, float* Workspace,
                            int Lwork, int* devInfo) {
    return legacy_potrf("cusolverDnSpotrf", handle, uplo, n, A, lda, Workspace, Lwork, devInfo);
}

EXPORT int cusolverDnDpotrf(cusolverDnHandle_t handle, int uplo, int n, double* A, int lda, double* Workspace,
                            int Lwork, int* devInfo) {
    return legacy_potrf("cusolverDnDpotrf", handle, uplo, n, A, lda, Workspace, Lwork, devInfo);
}
