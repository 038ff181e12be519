// test_blas.cpp — checks the CPU emulator's libcublas.so and libcusolver.so against naive reference code.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md): cublas.cpp and cusolver.cpp stand in
// for NVIDIA's libraries so the project's CUDA code paths run without a GPU (host memory as device memory,
// every call synchronous). This program loads the two built libraries with dlopen/dlsym by the same symbol
// names and C signatures cudarc 0.19.10 uses, so a wrong name or ABI shows up here and not in a Rust run.
// It exits non-zero when any check fails; --big adds timing runs at the project's larger shapes.
//
// Build and run:
//   profiling/emu/build.sh                                  (builds the libraries and this test)
//   target/cuda-emu/test_blas target/cuda-emu [--big]       (check.sh runs it)
//
// Covered: cublasSgemm_v2 (all transposes, odd sizes, ld > rows, beta = 0 over NaN, beta = 1, alpha = 0 over
// NaN operands, device pointer mode), cublasSgemmStridedBatched, cublasGemmEx (bf16 and f16 operands, f32 /
// bf16 / f16 output and its rounding), the refused combinations, handle calls; cusolverDnXpotrf (lower and
// upper, SPD and not, the failure state), cusolverDnXtrtri (lower/upper, unit/non-unit, singular), the
// project's potrf → trtri sequence, and the legacy cusolverDnSpotrf.

#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

// Values of cudarc 0.19.10's sys bindings (cuda-13000).
constexpr int OP_N = 0, OP_T = 1, OP_C = 2;
constexpr int R_32F = 0, R_64F = 1, R_16F = 2, R_16BF = 14;
constexpr int COMPUTE_16F = 64, COMPUTE_32F = 68, COMPUTE_32F_FAST_TF32 = 77;
constexpr int GEMM_DEFAULT = -1;
constexpr int FILL_LOWER = 0, FILL_UPPER = 1, DIAG_NON_UNIT = 0, DIAG_UNIT = 1;
constexpr int BLAS_INVALID_VALUE = 7, BLAS_NOT_INITIALIZED = 1, BLAS_NOT_SUPPORTED = 15;
constexpr int SOLVER_INVALID_VALUE = 3, SOLVER_NOT_SUPPORTED = 9;

using H = void*;
using i64 = int64_t;
using ll = long long;

int (*cublasCreate_v2)(H*);
int (*cublasDestroy_v2)(H);
int (*cublasSetStream_v2)(H, void*);
int (*cublasGetStream_v2)(H, void**);
int (*cublasSetMathMode)(H, int);
int (*cublasGetMathMode)(H, int*);
int (*cublasSetPointerMode_v2)(H, int);
int (*cublasGetPointerMode_v2)(H, int*);
int (*cublasGetVersion_v2)(H, int*);
int (*cublasSgemm_v2)(H, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*,
                      float*, int);
int (*cublasSgemmStridedBatched)(H, int, int, int, int, int, const float*, const float*, int, ll, const float*, int, ll,
                                 const float*, float*, int, ll, int);
int (*cublasGemmEx)(H, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int, const void*,
                    void*, int, int, int, int);
int (*cublasGemmStridedBatchedEx)(H, int, int, int, int, int, const void*, const void*, int, int, ll, const void*, int,
                                  int, ll, const void*, void*, int, int, ll, int, int, int);

int (*cublasGemmBatchedEx)(H, int, int, int, int, int, const void*, const void* const*, int, int, const void* const*,
                           int, int, const void*, void* const*, int, int, int, int, int);

int (*cublasStrsm_v2)(H, int, int, int, int, int, int, const float*, const float*, int, float*, int);

int (*cusolverDnCreate)(H*);
int (*cusolverDnDestroy)(H);
int (*cusolverDnSetStream)(H, void*);
int (*cusolverDnGetStream)(H, void**);
int (*cusolverDnCreateParams)(H*);
int (*cusolverDnDestroyParams)(H);
int (*cusolverDnSetAdvOptions)(H, int, int);
int (*cusolverDnXpotrf_bufferSize)(H, H, int, i64, int, const void*, i64, int, size_t*, size_t*);
int (*cusolverDnXpotrf)(H, H, int, i64, int, void*, i64, int, void*, size_t, void*, size_t, int*);
int (*cusolverDnXtrtri_bufferSize)(H, int, int, i64, int, void*, i64, size_t*, size_t*);
int (*cusolverDnXtrtri)(H, int, int, i64, int, void*, i64, void*, size_t, void*, size_t, int*);
int (*cusolverDnSpotrf_bufferSize)(H, int, int, float*, int, int*);
int (*cusolverDnSpotrf)(H, int, int, float*, int, float*, int, int*);

int failures = 0, checks = 0;

void check(bool ok, const std::string& what) {
    ++checks;
    if (!ok) {
        ++failures;
        std::printf("FAIL: %s\n", what.c_str());
    }
}

template <class F>
void load(void* lib, F& fn, const char* name) {
    void* p = dlsym(lib, name);
    if (p == nullptr) {
        std::printf("FAIL: symbol %s missing\n", name);
        std::exit(2);
    }
    std::memcpy(&fn, &p, sizeof p);
}

std::mt19937_64 rng(20240611);
float uni() { return std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng); }

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char b[512];
    va_list ap;
    va_start(ap, f);
    std::vsnprintf(b, sizeof b, f, ap);
    va_end(ap);
    return b;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- bf16 / f16 helpers (independent of the library's own) -----------------------------------------------

uint16_t to_bf16(float f) {  // round to nearest even; the test data holds no NaN
    uint32_t x;
    std::memcpy(&x, &f, 4);
    x += 0x7fff + ((x >> 16) & 1);
    return static_cast<uint16_t>(x >> 16);
}
double from_bf16(uint16_t h) {
    uint32_t x = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
double from_f16(uint16_t h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double s = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0) return s * std::ldexp(m, -24);
    if (e == 31) return m ? NAN : s * INFINITY;
    return s * std::ldexp(m + 1024, e - 25);
}
uint16_t to_f16_slow(double v) {  // nearest f16 by search over all finite values (ties to even); test-only
    uint16_t best = 0;
    double bestd = INFINITY;
    for (uint32_t h = 0; h < 0x7c00; ++h) {
        const double d = std::fabs(std::fabs(v) - from_f16(static_cast<uint16_t>(h)));
        if (d < bestd || (d == bestd && (h & 1) == 0)) bestd = d, best = static_cast<uint16_t>(h);
    }
    return static_cast<uint16_t>(best | (v < 0 ? 0x8000 : 0));
}

// ---- reference GEMM ------------------------------------------------------------------------------------

// C(i,j) = alpha·Σ op(A)(i,p)·op(B)(p,j) + beta·C(i,j) in double, with the bound Σ|…| + |beta·C| for the
// tolerance. get_a / get_b read the stored (column-major) element (row, col).
template <class GA, class GB>
void ref_gemm(int opa, int opb, int m, int n, int k, double alpha, GA get_a, GB get_b, double beta,
              const std::vector<double>& c_in, int ldc, std::vector<double>& out, std::vector<double>& bound) {
    out.assign(static_cast<size_t>(m) * n, 0.0);
    bound.assign(static_cast<size_t>(m) * n, 0.0);
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double s = 0, sa = 0;
            for (int p = 0; p < k; ++p) {
                const double a = opa == OP_N ? get_a(i, p) : get_a(p, i);
                const double b = opb == OP_N ? get_b(p, j) : get_b(j, p);
                s += a * b;
                sa += std::fabs(a * b);
            }
            double v = alpha * s, bd = std::fabs(alpha) * sa;
            if (beta != 0) {
                v += beta * c_in[i + static_cast<size_t>(j) * ldc];
                bd += std::fabs(beta * c_in[i + static_cast<size_t>(j) * ldc]);
            }
            out[i + static_cast<size_t>(j) * m] = v;
            bound[i + static_cast<size_t>(j) * m] = bd;
        }
}

constexpr float SENTINEL = 12345.0f;

// One Sgemm case: random A, B, C with padding rows (ld > rows) holding SENTINEL, checked against ref_gemm.
void sgemm_case(H h, int opa, int opb, int m, int n, int k, int pad, float alpha, float beta, bool nan_c,
                bool nan_ab = false) {
    const int ra = opa == OP_N ? m : k, ca = opa == OP_N ? k : m;
    const int rb = opb == OP_N ? k : n, cb = opb == OP_N ? n : k;
    const int lda = std::max(1, ra + pad), ldb = std::max(1, rb + pad), ldc = std::max(1, m + pad);
    std::vector<float> a(static_cast<size_t>(lda) * std::max(1, ca), SENTINEL);
    std::vector<float> b(static_cast<size_t>(ldb) * std::max(1, cb), SENTINEL);
    std::vector<float> c(static_cast<size_t>(ldc) * std::max(1, n), SENTINEL);
    for (int j = 0; j < ca; ++j)
        for (int i = 0; i < ra; ++i) a[i + static_cast<size_t>(j) * lda] = nan_ab ? NAN : uni();
    for (int j = 0; j < cb; ++j)
        for (int i = 0; i < rb; ++i) b[i + static_cast<size_t>(j) * ldb] = nan_ab ? NAN : uni();
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) c[i + static_cast<size_t>(j) * ldc] = nan_c ? NAN : uni();
    std::vector<double> c_in(c.begin(), c.end()), want, bound;
    ref_gemm(opa, opb, m, n, k, alpha, [&](int i, int j) { return (double)a[i + (size_t)j * lda]; },
             [&](int i, int j) { return (double)b[i + (size_t)j * ldb]; }, beta, c_in, ldc, want, bound);
    const int st = cublasSgemm_v2(h, opa, opb, m, n, k, &alpha, a.data(), lda, b.data(), ldb, &beta, c.data(), ldc);
    const std::string what = fmt("sgemm op=(%d,%d) m=%d n=%d k=%d pad=%d alpha=%g beta=%g%s%s", opa, opb, m, n, k, pad,
                                 alpha, beta, nan_c ? " C=NaN" : "", nan_ab ? " A,B=NaN" : "");
    check(st == 0, what + fmt(": status %d", st));
    double worst = 0;
    bool pad_ok = true;
    for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
            const double got = c[i + (size_t)j * ldc], w = want[i + (size_t)j * m];
            const double err = std::fabs(got - w) / (bound[i + (size_t)j * m] * 1e-6 + 1e-30);
            worst = std::isnan(got) ? INFINITY : std::max(worst, err);
        }
        for (int i = m; i < ldc; ++i) pad_ok &= c[i + (size_t)j * ldc] == SENTINEL;
    }
    check(worst <= 1.0, what + fmt(": error %.3g × tolerance", worst));
    check(pad_ok, what + ": C's rows past m were written");
}

void test_sgemm(H h) {
    const int ops[] = {OP_N, OP_T};
    const int shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 29}, {130, 67, 259}, {9, 300, 1}, {200, 3, 520}};
    for (int opa : ops)
        for (int opb : ops)
            for (auto& s : shapes) {
                sgemm_case(h, opa, opb, s[0], s[1], s[2], 3, 1.5f, 0.0f, true);
                sgemm_case(h, opa, opb, s[0], s[1], s[2], 0, -0.75f, 1.0f, false);
                sgemm_case(h, opa, opb, s[0], s[1], s[2], 1, 1.0f, -0.5f, false);
            }
    // Bigger than one tile in every direction and past the threading threshold.
    sgemm_case(h, OP_N, OP_N, 257, 300, 513, 2, 1.0f, 0.0f, true);
    sgemm_case(h, OP_T, OP_N, 300, 129, 700, 0, 1.0f, 0.0f, true);   // gemm.rs linear: (T, N)
    sgemm_case(h, OP_N, OP_T, 131, 250, 77, 5, -1.0f, 1.0f, false);  // sweep.rs trailing update: (N, T)
    // CUBLAS_OP_C means T for real types.
    sgemm_case(h, OP_C, OP_C, 19, 23, 31, 2, 2.0f, 0.0f, true);
    // alpha = 0: A and B are not read (their NaNs must not appear); beta = 0 then zeroes C.
    sgemm_case(h, OP_N, OP_N, 13, 11, 7, 1, 0.0f, 0.0f, true, true);
    sgemm_case(h, OP_N, OP_N, 13, 11, 7, 1, 0.0f, 0.5f, false, true);
    // k = 0: C = beta·C.
    sgemm_case(h, OP_N, OP_N, 6, 5, 0, 1, 1.0f, 2.0f, false);
    sgemm_case(h, OP_T, OP_N, 6, 5, 0, 1, 1.0f, 0.0f, true);

    // Device pointer mode: alpha and beta read through the pointers (host memory here too).
    check(cublasSetPointerMode_v2(h, 1) == 0, "set pointer mode DEVICE");
    int mode = -1;
    check(cublasGetPointerMode_v2(h, &mode) == 0 && mode == 1, "get pointer mode DEVICE");
    sgemm_case(h, OP_T, OP_N, 20, 21, 22, 1, 1.25f, 0.0f, true);
    check(cublasSetPointerMode_v2(h, 0) == 0, "set pointer mode HOST");

    // Refused arguments.
    float one = 1, zero = 0, x[64] = {}, y[64] = {}, z[64] = {};
    check(cublasSgemm_v2(h, OP_N, OP_N, 4, 4, 4, &one, x, 3, y, 4, &zero, z, 4) == BLAS_INVALID_VALUE,
          "sgemm lda < m is INVALID_VALUE");
    check(cublasSgemm_v2(h, OP_T, OP_N, 4, 4, 5, &one, x, 4, y, 5, &zero, z, 4) == BLAS_INVALID_VALUE,
          "sgemm (T) lda < k is INVALID_VALUE");
    check(cublasSgemm_v2(h, OP_N, OP_N, 4, 4, 4, &one, x, 4, y, 4, &zero, z, 3) == BLAS_INVALID_VALUE,
          "sgemm ldc < m is INVALID_VALUE");
    check(cublasSgemm_v2(h, 3, OP_N, 4, 4, 4, &one, x, 4, y, 4, &zero, z, 4) == BLAS_INVALID_VALUE,
          "sgemm transa = CONJG is INVALID_VALUE");
    check(cublasSgemm_v2(h, OP_N, OP_N, -1, 4, 4, &one, x, 4, y, 4, &zero, z, 4) == BLAS_INVALID_VALUE,
          "sgemm m < 0 is INVALID_VALUE");
    check(cublasSgemm_v2(nullptr, OP_N, OP_N, 4, 4, 4, &one, x, 4, y, 4, &zero, z, 4) == BLAS_NOT_INITIALIZED,
          "sgemm null handle is NOT_INITIALIZED");
}

void test_strided_batched(H h) {
    // The sweep's shape of call: (N, T), alpha = −1, beta = 1, strides larger than one matrix.
    for (int batch : {1, 3}) {
        const int m = 37, n = 29, k = 23, lda = m + 2, ldb = n + 1, ldc = m + 3;
        const ll sa = (ll)lda * k + 5, sb = (ll)ldb * k + 7, sc = (ll)ldc * n + 11;
        std::vector<float> a(sa * batch), b(sb * batch), c(sc * batch, SENTINEL);
        for (auto& v : a) v = uni();
        for (auto& v : b) v = uni();
        for (int z = 0; z < batch; ++z)
            for (int j = 0; j < n; ++j)
                for (int i = 0; i < m; ++i) c[z * sc + i + (ll)j * ldc] = uni();
        const std::vector<float> c0 = c;
        const float alpha = -1, beta = 1;
        const int st = cublasSgemmStridedBatched(h, OP_N, OP_T, m, n, k, &alpha, a.data(), lda, sa, b.data(), ldb, sb,
                                                 &beta, c.data(), ldc, sc, batch);
        check(st == 0, fmt("sgemm strided batched batch=%d: status %d", batch, st));
        double worst = 0;
        bool untouched = true;
        for (int z = 0; z < batch; ++z) {
            std::vector<double> c_in(c0.begin() + z * sc, c0.begin() + z * sc + (ll)ldc * n), want, bound;
            ref_gemm(OP_N, OP_T, m, n, k, alpha, [&](int i, int j) { return (double)a[z * sa + i + (ll)j * lda]; },
                     [&](int i, int j) { return (double)b[z * sb + i + (ll)j * ldb]; }, beta, c_in, ldc, want, bound);
            for (int j = 0; j < n; ++j)
                for (int i = 0; i < m; ++i)
                    worst = std::max(worst, std::fabs(c[z * sc + i + (ll)j * ldc] - want[i + j * m]) /
                                                (bound[i + j * m] * 1e-6 + 1e-30));
        }
        for (ll i = 0; i < (ll)c.size(); ++i) {
            const ll z = i / sc, r = i % sc, col = r / ldc, row = r % ldc;
            if (z < batch && (col >= n || row >= m)) untouched &= c[i] == c0[i];
        }
        check(worst <= 1.0, fmt("sgemm strided batched batch=%d: error %.3g × tolerance", batch, worst));
        check(untouched, fmt("sgemm strided batched batch=%d: elements outside the matrices changed", batch));
    }
    float one = 1, x[16] = {};
    check(cublasSgemmStridedBatched(h, OP_N, OP_N, 2, 2, 2, &one, x, 2, 4, x, 2, 4, &one, x, 2, 4, -1) ==
              BLAS_INVALID_VALUE,
          "strided batched batchCount < 0 is INVALID_VALUE");
    check(cublasSgemmStridedBatched(h, OP_N, OP_N, 2, 2, 2, &one, x, 2, 4, x, 2, 4, &one, x, 2, 4, 0) == 0,
          "strided batched batchCount = 0 is a no-op");
}

// GemmEx with 16-bit operands (bf16 or f16 bit patterns) and an f32, bf16 or f16 C.
void gemm_ex_case(H h, int type_ab, int type_c, int opa, int opb, int m, int n, int k, float alpha, float beta) {
    const bool bf = type_ab == R_16BF;
    auto enc = [&](float f) { return bf ? to_bf16(f) : to_f16_slow(f); };
    auto dec = [&](uint16_t v) { return bf ? from_bf16(v) : from_f16(v); };
    const int ra = opa == OP_N ? m : k, ca = opa == OP_N ? k : m, rb = opb == OP_N ? k : n, cb = opb == OP_N ? n : k;
    const int lda = ra + 1, ldb = rb + 2, ldc = m + 1;
    std::vector<uint16_t> a((size_t)lda * ca), b((size_t)ldb * cb);
    // f16's encoder searches every value: draw from a small table to keep that cheap.
    std::vector<uint16_t> table(256);
    for (auto& t : table) t = enc(uni() * 2.0f);
    for (auto& v : a) v = table[rng() % 256];
    for (auto& v : b) v = table[rng() % 256];
    std::vector<float> c32((size_t)ldc * n);
    std::vector<uint16_t> c16((size_t)ldc * n);
    std::vector<double> c_in((size_t)ldc * n);
    for (size_t i = 0; i < c_in.size(); ++i) {
        if (type_c == R_32F) {
            c32[i] = beta == 0 ? NAN : uni();
            c_in[i] = c32[i];
        } else {
            c16[i] = beta == 0 ? 0x7fc0 : table[rng() % 256];  // 0x7fc0: NaN in both 16-bit formats
            c_in[i] = dec(c16[i]);
        }
    }
    std::vector<double> want, bound;
    ref_gemm(opa, opb, m, n, k, alpha, [&](int i, int j) { return dec(a[i + (size_t)j * lda]); },
             [&](int i, int j) { return dec(b[i + (size_t)j * ldb]); }, beta, c_in, ldc, want, bound);
    void* cp = type_c == R_32F ? (void*)c32.data() : (void*)c16.data();
    const int st = cublasGemmEx(h, opa, opb, m, n, k, &alpha, a.data(), type_ab, lda, b.data(), type_ab, ldb, &beta,
                                cp, type_c, ldc, COMPUTE_32F, GEMM_DEFAULT);
    const std::string what = fmt("gemmEx %s→%s op=(%d,%d) m=%d n=%d k=%d beta=%g", bf ? "bf16" : "f16",
                                 type_c == R_32F ? "f32" : (bf ? "bf16" : "f16"), opa, opb, m, n, k, beta);
    check(st == 0, what + fmt(": status %d", st));
    // f32 output: exact to f32 rounding. 16-bit output: the nearest 16-bit value, within one of its ulps.
    const double rel = type_c == R_32F ? 1e-6 : (bf ? 1.0 / 128 : 1.0 / 1024);
    double worst = 0;
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            const size_t at = i + (size_t)j * ldc;
            const double got = type_c == R_32F ? c32[at] : dec(c16[at]);
            const double w = want[i + (size_t)j * m];
            const double tol = type_c == R_32F ? bound[i + j * m] * rel : std::fabs(w) * rel + 1e-7 + bound[i + j * m] * 1e-6;
            worst = std::isnan(got) ? INFINITY : std::max(worst, std::fabs(got - w) / tol);
        }
    check(worst <= 1.0, what + fmt(": error %.3g × tolerance", worst));
}

// Rounding of a single value into a 16-bit C: C = alpha·1·1 with beta = 0.
uint16_t round_through_gemm_ex(H h, int type, float alpha) {
    const uint16_t one = type == R_16BF ? 0x3f80 : 0x3c00;
    uint16_t c = 0x7fc0;
    const float beta = 0;
    const int st = cublasGemmEx(h, OP_N, OP_N, 1, 1, 1, &alpha, &one, type, 1, &one, type, 1, &beta, &c, type, 1,
                                COMPUTE_32F, GEMM_DEFAULT);
    check(st == 0, fmt("gemmEx 1×1×1 type %d: status %d", type, st));
    return c;
}

void test_gemm_ex(H h) {
    const int ops[] = {OP_N, OP_T};
    for (int opa : ops)
        for (int opb : ops) {
            gemm_ex_case(h, R_16BF, R_32F, opa, opb, 45, 38, 71, 1.0f, 0.0f);
            gemm_ex_case(h, R_16BF, R_32F, opa, opb, 9, 13, 300, -0.5f, 1.0f);
            gemm_ex_case(h, R_16F, R_32F, opa, opb, 21, 17, 40, 1.0f, 0.0f);
        }
    gemm_ex_case(h, R_16BF, R_32F, OP_T, OP_N, 260, 140, 530, 1.0f, 0.0f);  // gemm.rs linear bf16 at size
    gemm_ex_case(h, R_16BF, R_16BF, OP_N, OP_N, 30, 20, 50, 1.0f, 0.0f);
    gemm_ex_case(h, R_16BF, R_16BF, OP_T, OP_N, 30, 20, 50, 0.5f, 1.0f);
    gemm_ex_case(h, R_16F, R_16F, OP_N, OP_T, 25, 20, 30, 1.0f, 0.0f);

    // Rounding into 16-bit outputs: ties to even, overflow to infinity, f16 subnormals.
    struct Case {
        int type;
        float v;
        uint16_t want;
    } cases[] = {
        {R_16BF, 1.0f + 0x1p-8f, 0x3f80},      {R_16BF, 1.0f + 3 * 0x1p-8f, 0x3f82}, {R_16BF, -2.5f, 0xc020},
        {R_16BF, 3.4e38f, 0x7f80},             {R_16F, 1.0f, 0x3c00},                {R_16F, 1.0f + 0x1p-11f, 0x3c00},
        {R_16F, 1.0f + 3 * 0x1p-11f, 0x3c02},  {R_16F, 65504.0f, 0x7bff},            {R_16F, 65519.0f, 0x7bff},
        {R_16F, 65520.0f, 0x7c00},             {R_16F, -0x1p-24f, 0x8001},           {R_16F, 0x1p-25f, 0x0000},
        {R_16F, 0x1.8p-24f, 0x0002},           {R_16F, 0x1p-14f, 0x0400},            {R_16F, 0x1.ffcp-15f, 0x0400},
        {R_16F, 0x1.ff8p-15f, 0x03ff},
        {R_16F, -0.0f, 0x8000},
    };
    for (auto& c : cases) {
        const uint16_t got = round_through_gemm_ex(h, c.type, c.v);
        check(got == c.want, fmt("%s rounding of %a: got 0x%04x, want 0x%04x", c.type == R_16BF ? "bf16" : "f16",
                                 (double)c.v, got, c.want));
    }

    // GemmStridedBatchedEx, bf16 → f32, against per-member GemmEx.
    {
        const int m = 17, n = 11, k = 19, batch = 3;
        const ll sa = m * k + 3, sb = k * n + 1, sc = m * n + 2;
        std::vector<uint16_t> a(sa * batch), b(sb * batch);
        for (auto& v : a) v = to_bf16(uni());
        for (auto& v : b) v = to_bf16(uni());
        std::vector<float> c(sc * batch, 0.0f), c1(sc * batch, 0.0f);
        const float alpha = 1, beta = 0;
        int st = cublasGemmStridedBatchedEx(h, OP_N, OP_N, m, n, k, &alpha, a.data(), R_16BF, m, sa, b.data(), R_16BF, k,
                                            sb, &beta, c.data(), R_32F, m, sc, batch, COMPUTE_32F, GEMM_DEFAULT);
        for (int z = 0; z < batch; ++z)
            st |= cublasGemmEx(h, OP_N, OP_N, m, n, k, &alpha, a.data() + z * sa, R_16BF, m, b.data() + z * sb, R_16BF,
                               k, &beta, c1.data() + z * sc, R_32F, m, COMPUTE_32F, GEMM_DEFAULT);
        check(st == 0 && c == c1, "gemmStridedBatchedEx bf16 equals per-member gemmEx");
    }

    // GemmBatchedEx (pointer arrays; members scattered, not strided), bf16 → f32 accumulated with beta = 1,
    // against per-member GemmEx; then a null pointer array and a negative size are refused.
    {
        const int m = 13, n = 13, k = 21, batch = 3;
        std::vector<std::vector<uint16_t>> a(batch, std::vector<uint16_t>(m * k));
        std::vector<std::vector<float>> c(batch, std::vector<float>(m * n)), c1 = c;
        for (int z = 0; z < batch; ++z) {
            for (auto& v : a[z]) v = to_bf16(uni());
            for (size_t i = 0; i < c[z].size(); ++i) c[z][i] = c1[z][i] = uni();
        }
        const void* ap[batch];
        void* cp[batch];
        for (int z = 0; z < batch; ++z) ap[z] = a[z].data(), cp[z] = c[z].data();
        const float alpha = 1, beta = 1;
        int st = cublasGemmBatchedEx(h, OP_N, OP_T, m, n, k, &alpha, ap, R_16BF, m, ap, R_16BF, n, &beta, cp, R_32F, m,
                                     batch, COMPUTE_32F, GEMM_DEFAULT);
        for (int z = 0; z < batch; ++z)
            st |= cublasGemmEx(h, OP_N, OP_T, m, n, k, &alpha, a[z].data(), R_16BF, m, a[z].data(), R_16BF, n, &beta,
                               c1[z].data(), R_32F, m, COMPUTE_32F, GEMM_DEFAULT);
        check(st == 0 && c == c1, "gemmBatchedEx bf16 (A·Aᵀ, beta 1) equals per-member gemmEx");
        check(cublasGemmBatchedEx(h, OP_N, OP_T, m, n, k, &alpha, nullptr, R_16BF, m, ap, R_16BF, n, &beta, cp, R_32F,
                                  m, batch, COMPUTE_32F, GEMM_DEFAULT) == BLAS_INVALID_VALUE,
              "gemmBatchedEx with a null pointer array is INVALID_VALUE");
        check(cublasGemmBatchedEx(h, OP_N, OP_T, m, n, -1, &alpha, ap, R_16BF, m, ap, R_16BF, n, &beta, cp, R_32F, m,
                                  batch, COMPUTE_32F, GEMM_DEFAULT) == BLAS_INVALID_VALUE,
              "gemmBatchedEx with k < 0 is INVALID_VALUE");
    }

    // FAST_TF32 on f32 operands computes (exactly) here.
    {
        float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, -1, 2, 1, 0}, c[4], alpha = 1, beta = 0;
        const int st = cublasGemmEx(h, OP_N, OP_N, 2, 2, 3, &alpha, a, R_32F, 2, b, R_32F, 3, &beta, c, R_32F, 2,
                                    COMPUTE_32F_FAST_TF32, GEMM_DEFAULT);
        check(st == 0 && c[0] == -4 && c[1] == -4 && c[2] == 5 && c[3] == 8, "gemmEx f32 FAST_TF32");
    }

    // Refused combinations.
    float x[16] = {}, alpha = 1, beta = 0;
    check(cublasGemmEx(h, OP_N, OP_N, 2, 2, 2, &alpha, x, R_16BF, 2, x, R_32F, 2, &beta, x, R_32F, 2, COMPUTE_32F,
                       GEMM_DEFAULT) == BLAS_NOT_SUPPORTED,
          "gemmEx A bf16 with B f32 is NOT_SUPPORTED");
    check(cublasGemmEx(h, OP_N, OP_N, 2, 2, 2, &alpha, x, R_16F, 2, x, R_16F, 2, &beta, x, R_16F, 2, COMPUTE_16F,
                       GEMM_DEFAULT) == BLAS_NOT_SUPPORTED,
          "gemmEx compute 16F is NOT_SUPPORTED");
    check(cublasGemmEx(h, OP_N, OP_N, 2, 2, 2, &alpha, x, R_16BF, 2, x, R_16BF, 2, &beta, x, R_32F, 2,
                       COMPUTE_32F_FAST_TF32, GEMM_DEFAULT) == BLAS_NOT_SUPPORTED,
          "gemmEx bf16 with FAST_TF32 is NOT_SUPPORTED");
    check(cublasGemmEx(h, OP_N, OP_N, 2, 2, 2, &alpha, x, R_32F, 2, x, R_32F, 2, &beta, x, R_16BF, 2, COMPUTE_32F,
                       GEMM_DEFAULT) == BLAS_NOT_SUPPORTED,
          "gemmEx f32 operands into a bf16 C is NOT_SUPPORTED");
    check(cublasGemmEx(h, OP_N, OP_N, 2, 2, 2, &alpha, x, R_64F, 2, x, R_64F, 2, &beta, x, R_64F, 2, COMPUTE_32F,
                       GEMM_DEFAULT) == BLAS_NOT_SUPPORTED,
          "gemmEx f64 with compute 32F is NOT_SUPPORTED");
}

void test_handle() {
    H h = nullptr;
    check(cublasCreate_v2(&h) == 0 && h != nullptr, "cublasCreate_v2");
    void* s = reinterpret_cast<void*>(0x1234);
    void* got = nullptr;
    check(cublasSetStream_v2(h, s) == 0, "cublasSetStream_v2");
    check(cublasGetStream_v2(h, &got) == 0 && got == s, "cublasGetStream_v2 returns the stream set");
    int mode = -1;
    check(cublasGetMathMode(h, &mode) == 0 && mode == 0, "default math mode is CUBLAS_DEFAULT_MATH");
    check(cublasSetMathMode(h, 0) == 0, "cublasSetMathMode(DEFAULT)");
    check(cublasSetMathMode(h, 3 | 16) == 0 && cublasGetMathMode(h, &mode) == 0 && mode == 19,
          "cublasSetMathMode(TF32 | DISALLOW_REDUCED_PRECISION_REDUCTION)");
    check(cublasSetMathMode(h, 5) == BLAS_INVALID_VALUE, "cublasSetMathMode(5) is INVALID_VALUE");
    check(cublasGetPointerMode_v2(h, &mode) == 0 && mode == 0, "default pointer mode is HOST");
    int v = 0;
    check(cublasGetVersion_v2(h, &v) == 0 && v >= 130000, fmt("cublasGetVersion_v2 = %d", v));
    check(cublasDestroy_v2(h) == 0, "cublasDestroy_v2");
}

// ---- cuSOLVER ------------------------------------------------------------------------------------------

// Random SPD matrix, full (both triangles), column-major n × n: G·Gᵀ/n + I.
std::vector<double> random_spd(int n) {
    std::vector<double> g((size_t)n * n), a((size_t)n * n, 0.0);
    for (auto& v : g) v = uni();
    for (int j = 0; j < n; ++j)
        for (int p = 0; p < n; ++p) {
            const double gjp = g[j + (size_t)p * n];
            for (int i = 0; i < n; ++i) a[i + (size_t)j * n] += g[i + (size_t)p * n] * gjp;
        }
    for (auto& v : a) v /= n;
    for (int i = 0; i < n; ++i) a[i + (size_t)i * n] += 1.0;
    return a;
}

// A stored in the `uplo` triangle of an lda × n buffer; the other triangle and padding hold SENTINEL.
std::vector<float> store_tri(const std::vector<double>& full, int n, int lda, int uplo) {
    std::vector<float> s((size_t)lda * n, SENTINEL);
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < n; ++i)
            if (uplo == FILL_LOWER ? i >= j : i <= j) s[i + (size_t)j * lda] = (float)full[i + (size_t)j * n];
    return s;
}

bool others_untouched(const std::vector<float>& s, int n, int lda, int uplo) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < lda; ++i) {
            const bool in_tri = i < n && (uplo == FILL_LOWER ? i >= j : i <= j);
            if (!in_tri && s[i + (size_t)j * lda] != SENTINEL) return false;
        }
    return true;
}

struct Solver {
    H h = nullptr, params = nullptr;
    size_t dev_bytes = 0, host_bytes = 0;
    std::vector<unsigned char> dev, host;
};

int potrf(Solver& s, int uplo, int n, std::vector<float>& a, int lda) {
    int st = cusolverDnXpotrf_bufferSize(s.h, s.params, uplo, n, R_32F, a.data(), lda, R_32F, &s.dev_bytes, &s.host_bytes);
    check(st == 0, fmt("potrf_bufferSize n=%d: status %d", n, st));
    s.dev.assign(std::max<size_t>(s.dev_bytes, 1), 0);
    s.host.assign(std::max<size_t>(s.host_bytes, 1), 0);
    int info = -7;
    st = cusolverDnXpotrf(s.h, s.params, uplo, n, R_32F, a.data(), lda, R_32F, s.dev.data(), s.dev_bytes,
                          s.host.data(), s.host_bytes, &info);
    check(st == 0, fmt("potrf n=%d uplo=%d: status %d", n, uplo, st));
    return info;
}

int trtri(Solver& s, int uplo, int diag, int n, std::vector<float>& a, int lda) {
    int st = cusolverDnXtrtri_bufferSize(s.h, uplo, diag, n, R_32F, a.data(), lda, &s.dev_bytes, &s.host_bytes);
    check(st == 0, fmt("trtri_bufferSize n=%d: status %d", n, st));
    s.dev.assign(std::max<size_t>(s.dev_bytes, 1), 0);
    s.host.assign(std::max<size_t>(s.host_bytes, 1), 0);
    int info = -7;
    st = cusolverDnXtrtri(s.h, uplo, diag, n, R_32F, a.data(), lda, s.dev.data(), s.dev_bytes, s.host.data(),
                          s.host_bytes, &info);
    check(st == 0, fmt("trtri n=%d uplo=%d diag=%d: status %d", n, uplo, diag, st));
    return info;
}

// Element (i, j) of the factor as a lower matrix: L(i, j) for lower, U(j, i) for upper.
double lower_at(const std::vector<float>& a, int lda, int uplo, int i, int j) {
    return uplo == FILL_LOWER ? a[i + (size_t)j * lda] : a[j + (size_t)i * lda];
}

void potrf_case(Solver& s, int n, int uplo, int pad) {
    const auto full = random_spd(n);
    const int lda = n + pad;
    auto a = store_tri(full, n, lda, uplo);
    const int info = potrf(s, uplo, n, a, lda);
    const std::string what = fmt("potrf n=%d %s lda=%d", n, uplo == FILL_LOWER ? "lower" : "upper", lda);
    check(info == 0, what + fmt(": info %d", info));
    // L·Lᵀ (lower) or Uᵀ·U (upper) against A, relative to max |A|.
    double worst = 0, amax = 0;
    for (double v : full) amax = std::max(amax, std::fabs(v));
    for (int j = 0; j < n; ++j)
        for (int i = j; i < n; ++i) {
            double sum = 0;
            for (int t = 0; t <= j; ++t) sum += lower_at(a, lda, uplo, i, t) * lower_at(a, lda, uplo, j, t);
            worst = std::max(worst, std::fabs(sum - full[i + (size_t)j * n]) / amax);
        }
    check(worst < 2e-6, what + fmt(": max |L·Lᵀ − A| / max|A| = %.3g", worst));
    check(others_untouched(a, n, lda, uplo), what + ": the other triangle or the padding changed");
}

void potrf_failure_case(Solver& s, int n, int uplo, int bad /* 1-based */) {
    auto full = random_spd(n);
    const int lda = n;
    auto good = store_tri(full, n, lda, uplo);
    potrf(s, uplo, n, good, lda);
    full[(bad - 1) + (size_t)(bad - 1) * n] = -1.0;  // the leading minors of order < bad stay positive definite
    const auto before = store_tri(full, n, lda, uplo);
    auto a = before;
    const int info = potrf(s, uplo, n, a, lda);
    const std::string what = fmt("potrf not SPD n=%d %s minor %d", n, uplo == FILL_LOWER ? "lower" : "upper", bad);
    check(info == bad, what + fmt(": info %d", info));
    // The failure state: the factor's first bad−1 columns (as lower), the pivot ≤ 0, the rest the input.
    bool ok = true;
    for (int j = 0; j < n; ++j)
        for (int i = j; i < n; ++i) {
            const double got = lower_at(a, lda, uplo, i, j);
            if (j < bad - 1) ok &= got == lower_at(good, lda, uplo, i, j);
            else if (i == bad - 1 && j == bad - 1) ok &= got <= 0;
            else ok &= got == lower_at(before, lda, uplo, i, j);
        }
    check(ok, what + ": not LAPACK's partial-factor state");
}

// Triangular test matrix (as lower, full n × n double): diagonal ±[1, 2], small off-diagonal, so the inverse
// is well conditioned.
std::vector<double> random_lower(int n) {
    std::vector<double> l((size_t)n * n, 0.0);
    for (int j = 0; j < n; ++j) {
        l[j + (size_t)j * n] = (1.0 + std::fabs(uni())) * (uni() < 0 ? -1 : 1);
        for (int i = j + 1; i < n; ++i) l[i + (size_t)j * n] = uni() * 2.0 / n;
    }
    return l;
}

// Stores lower L as the `uplo` triangle (upper: U = Lᵀ); unit: the diagonal holds NaN (must not be read).
std::vector<float> store_lower_as(const std::vector<double>& l, int n, int lda, int uplo, bool unit) {
    std::vector<float> s((size_t)lda * n, SENTINEL);
    for (int j = 0; j < n; ++j)
        for (int i = j; i < n; ++i) {
            const float v = (unit && i == j) ? NAN : (float)l[i + (size_t)j * n];
            if (uplo == FILL_LOWER) s[i + (size_t)j * lda] = v;
            else s[j + (size_t)i * lda] = v;
        }
    return s;
}

void trtri_case(Solver& s, int n, int uplo, int diag, int pad) {
    const bool unit = diag == DIAG_UNIT;
    auto l = random_lower(n);
    if (unit)
        for (int i = 0; i < n; ++i) l[i + (size_t)i * n] = 1.0;
    const int lda = n + pad;
    auto a = store_lower_as(l, n, lda, uplo, unit);
    const auto before = a;
    // Reference operand as stored (f32), for the residual.
    std::vector<double> lf((size_t)n * n, 0.0);
    for (int j = 0; j < n; ++j)
        for (int i = j; i < n; ++i) lf[i + (size_t)j * n] = (unit && i == j) ? 1.0 : (double)(float)l[i + (size_t)j * n];
    const int info = trtri(s, uplo, diag, n, a, lda);
    const std::string what = fmt("trtri n=%d %s %s lda=%d", n, uplo == FILL_LOWER ? "lower" : "upper",
                                 unit ? "unit" : "non-unit", lda);
    check(info == 0, what + fmt(": info %d", info));
    // L·X = I with X the result as lower (unit: X's diagonal is 1 and the stored NaN is untouched).
    double worst = 0;
    bool diag_kept = true;
    for (int j = 0; j < n; ++j) {
        if (unit) diag_kept &= std::isnan(lower_at(a, lda, uplo, j, j));
        for (int i = j; i < n; ++i) {
            double sum = 0;
            for (int t = j; t <= i; ++t) {
                const double x = (unit && t == j) ? 1.0 : lower_at(a, lda, uplo, t, j);
                sum += lf[i + (size_t)t * n] * x;
            }
            worst = std::max(worst, std::fabs(sum - (i == j ? 1.0 : 0.0)));
        }
    }
    check(worst < 1e-5, what + fmt(": max |L·X − I| = %.3g", worst));
    check(!unit || diag_kept, what + ": the unit diagonal was written");
    bool others = true;
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < lda; ++i) {
            const bool in_tri = i < n && (uplo == FILL_LOWER ? i >= j : i <= j);
            if (!in_tri) others &= a[i + (size_t)j * lda] == before[i + (size_t)j * lda];
        }
    check(others, what + ": the other triangle or the padding changed");
}

void test_solver() {
    Solver s;
    check(cusolverDnCreate(&s.h) == 0 && s.h != nullptr, "cusolverDnCreate");
    check(cusolverDnSetStream(s.h, reinterpret_cast<void*>(0x42)) == 0, "cusolverDnSetStream");
    void* got = nullptr;
    check(cusolverDnGetStream(s.h, &got) == 0 && got == reinterpret_cast<void*>(0x42), "cusolverDnGetStream");
    check(cusolverDnCreateParams(&s.params) == 0 && s.params != nullptr, "cusolverDnCreateParams");
    check(cusolverDnSetAdvOptions(s.params, 1, 0) == 0, "cusolverDnSetAdvOptions(POTRF, ALG_0)");

    for (int uplo : {FILL_LOWER, FILL_UPPER})
        for (int n : {1, 2, 5, 63, 64, 65, 130, 300, 513}) potrf_case(s, n, uplo, n % 3);
    for (int uplo : {FILL_LOWER, FILL_UPPER})
        for (int bad : {1, 2, 40, 64, 65, 100}) potrf_failure_case(s, 100, uplo, bad);
    {
        auto a = store_tri(random_spd(10), 10, 10, FILL_LOWER);
        a[3 + 3 * 10] = NAN;
        check(potrf(s, FILL_LOWER, 10, a, 10) == 4, "potrf with a NaN pivot: info 4");
    }

    for (int uplo : {FILL_LOWER, FILL_UPPER})
        for (int diag : {DIAG_NON_UNIT, DIAG_UNIT})
            for (int n : {1, 3, 64, 65, 100, 200, 513}) trtri_case(s, n, uplo, diag, (n + 1) % 3);
    {
        auto l = random_lower(80);
        l[37 + 37 * 80] = 0.0;
        auto a = store_lower_as(l, 80, 80, FILL_UPPER, false);
        const auto before = a;
        check(trtri(s, FILL_UPPER, DIAG_NON_UNIT, 80, a, 80) == 38, "trtri singular: info = 38");
        check(a == before, "trtri singular: A unchanged");
        check(trtri(s, FILL_UPPER, DIAG_UNIT, 80, a, 80) == 0, "trtri unit ignores the zero diagonal");
    }

    // The project's sequence (solver.rs): potrf then trtri, both upper non-unit, on the same buffer: X = U⁻¹.
    {
        const int n = 300;
        const auto full = random_spd(n);
        auto a = store_tri(full, n, n, FILL_UPPER);
        check(potrf(s, FILL_UPPER, n, a, n) == 0, "solver.rs sequence: potrf info 0");
        const auto u = a;
        check(trtri(s, FILL_UPPER, DIAG_NON_UNIT, n, a, n) == 0, "solver.rs sequence: trtri info 0");
        double worst = 0;
        for (int j = 0; j < n; ++j)
            for (int i = 0; i <= j; ++i) {
                double sum = 0;
                for (int t = i; t <= j; ++t) sum += (double)u[i + (size_t)t * n] * a[t + (size_t)j * n];
                worst = std::max(worst, std::fabs(sum - (i == j ? 1.0 : 0.0)));
            }
        check(worst < 1e-5, fmt("solver.rs sequence: max |U·U⁻¹ − I| = %.3g", worst));
    }

    // Refusals.
    {
        std::vector<float> a(16, 1.0f);
        size_t d = 0, hb = 0;
        int info = 0;
        check(cusolverDnXpotrf_bufferSize(s.h, s.params, FILL_LOWER, 4, R_16F, a.data(), 4, R_16F, &d, &hb) ==
                  SOLVER_NOT_SUPPORTED,
              "potrf f16 is NOT_SUPPORTED");
        check(cusolverDnXpotrf_bufferSize(s.h, s.params, FILL_LOWER, 4, R_32F, a.data(), 3, R_32F, &d, &hb) ==
                  SOLVER_INVALID_VALUE,
              "potrf lda < n is INVALID_VALUE");
        check(cusolverDnXpotrf_bufferSize(s.h, s.params, 2, 4, R_32F, a.data(), 4, R_32F, &d, &hb) == SOLVER_INVALID_VALUE,
              "potrf uplo FULL is INVALID_VALUE");
        check(cusolverDnXpotrf(s.h, s.params, FILL_LOWER, 4, R_32F, a.data(), 4, R_32F, nullptr, 0, nullptr, 0, &info) ==
                  SOLVER_INVALID_VALUE,
              "potrf without the queried workspace is INVALID_VALUE");
        check(cusolverDnXtrtri_bufferSize(s.h, FILL_LOWER, 2, 4, R_32F, a.data(), 4, &d, &hb) == SOLVER_INVALID_VALUE,
              "trtri diag 2 is INVALID_VALUE");
        check(cusolverDnXpotrf_bufferSize(nullptr, s.params, FILL_LOWER, 4, R_32F, a.data(), 4, R_32F, &d, &hb) == 1,
              "potrf null handle is NOT_INITIALIZED");
    }

    // Legacy 32-bit potrf.
    {
        const int n = 70;
        const auto full = random_spd(n);
        auto a = store_tri(full, n, n, FILL_LOWER);
        auto x = a;
        int lwork = 0, info = -1;
        check(cusolverDnSpotrf_bufferSize(s.h, FILL_LOWER, n, a.data(), n, &lwork) == 0 && lwork > 0,
              "cusolverDnSpotrf_bufferSize");
        std::vector<float> work(lwork);
        check(cusolverDnSpotrf(s.h, FILL_LOWER, n, a.data(), n, work.data(), lwork, &info) == 0 && info == 0,
              "cusolverDnSpotrf");
        potrf(s, FILL_LOWER, n, x, n);
        check(a == x, "cusolverDnSpotrf equals cusolverDnXpotrf");
    }

    check(cusolverDnDestroyParams(s.params) == 0, "cusolverDnDestroyParams");
    check(cusolverDnDestroy(s.h) == 0, "cusolverDnDestroy");
}

// ---- timing at the project's larger shapes (--big) -------------------------------------------------------

void timing(H h, bool big) {
    auto time_sgemm = [&](int opa, int opb, int m, int n, int k) {
        const int lda = opa == OP_N ? m : k, ldb = opb == OP_N ? k : n;
        std::vector<float> a((size_t)m * k), b((size_t)k * n), c((size_t)m * n, NAN);
        for (auto& v : a) v = uni();
        for (auto& v : b) v = uni();
        const float alpha = 1, beta = 0;
        const auto t0 = std::chrono::steady_clock::now();
        const int st = cublasSgemm_v2(h, opa, opb, m, n, k, &alpha, a.data(), lda, b.data(), ldb, &beta, c.data(), m);
        const double dt = seconds_since(t0);
        // Spot-check some elements against a direct sum.
        double worst = 0;
        for (int s = 0; s < 64; ++s) {
            const int i = rng() % m, j = rng() % n;
            double sum = 0, bound = 0;
            for (int p = 0; p < k; ++p) {
                const double x = opa == OP_N ? a[i + (size_t)p * lda] : a[p + (size_t)i * lda];
                const double y = opb == OP_N ? b[p + (size_t)j * ldb] : b[j + (size_t)p * ldb];
                sum += x * y;
                bound += std::fabs(x * y);
            }
            worst = std::max(worst, std::fabs(c[i + (size_t)j * m] - sum) / (bound * 1e-6));
        }
        check(st == 0 && worst <= 1.0, fmt("timed sgemm %dx%dx%d: status %d, error %.3g × tolerance", m, n, k, st, worst));
        std::printf("  sgemm (%s,%s) m=%d n=%d k=%d: %.3f s, %.1f GFLOP/s\n", opa == OP_N ? "N" : "T",
                    opb == OP_N ? "N" : "T", m, n, k, dt, 2.0 * m * n * k / dt * 1e-9);
    };
    time_sgemm(OP_T, OP_N, 1024, 1024, 1024);
    if (big) {
        time_sgemm(OP_T, OP_N, 4096, 4096, 512);
        time_sgemm(OP_N, OP_T, 4096, 4096, 512);
    }
    Solver s;
    cusolverDnCreate(&s.h);
    cusolverDnCreateParams(&s.params);
    for (int n : big ? std::vector<int>{1024, 4096} : std::vector<int>{1024}) {
        const auto full = random_spd(std::min(n, 1024));  // the O(n³) test-side product is kept small
        std::vector<float> a((size_t)n * n, 0.0f);
        for (int j = 0; j < n; ++j)
            for (int i = 0; i < n; ++i) {
                const int m = std::min(n, 1024);
                a[i + (size_t)j * n] = (i < m && j < m) ? (float)full[i + (size_t)j * m] : (i == j ? 1.0f : 0.0f);
            }
        auto t0 = std::chrono::steady_clock::now();
        const int i1 = potrf(s, FILL_UPPER, n, a, n);
        const double dp = seconds_since(t0);
        t0 = std::chrono::steady_clock::now();
        const int i2 = trtri(s, FILL_UPPER, DIAG_NON_UNIT, n, a, n);
        const double dt = seconds_since(t0);
        check(i1 == 0 && i2 == 0, fmt("timed potrf+trtri n=%d: info %d, %d", n, i1, i2));
        std::printf("  potrf upper n=%d: %.3f s; trtri upper n=%d: %.3f s\n", n, dp, n, dt);
    }
    cusolverDnDestroyParams(s.params);
    cusolverDnDestroy(s.h);
}

}  // namespace

// cublasStrsm_v2 (side LEFT, fill UPPER, op N): B := alpha·A⁻¹·B with A upper triangular (its strict lower part
// garbage, which must not be read), checked as A·X = alpha·B in double; then X = A⁻¹ against I (the factor's
// use, solver.rs) has zeros below the diagonal; other sides and fills are refused, not computed.
void test_trsm(H h) {
    const int m = 37, n = 5, ld = 40;
    std::vector<float> a(ld * m), b(ld * n), x;
    for (int j = 0; j < m; ++j)
        for (int i = 0; i < ld; ++i) a[i + j * ld] = i > j ? 1e30f : uni() + (i == j ? 4.0f : 0.0f);
    for (auto& v : b) v = uni();
    x = b;
    const float alpha = 0.5f;
    check(cublasStrsm_v2(h, 0, 1, OP_N, 0, m, n, &alpha, a.data(), ld, x.data(), ld) == 0, "strsm: status");
    double worst = 0;
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double s = 0;
            for (int k = i; k < m; ++k) s += (double)a[i + k * ld] * x[k + j * ld];
            worst = std::max(worst, std::fabs(s - alpha * b[i + j * ld]) / 1e-5);
        }
    check(worst <= 1.0, fmt("strsm: A·X vs alpha·B, error %.3g × tolerance", worst));
    std::vector<float> eye(ld * m, 0.0f);
    for (int i = 0; i < m; ++i) eye[i + i * ld] = 1.0f;
    const float one = 1.0f;
    check(cublasStrsm_v2(h, 0, 1, OP_N, 0, m, m, &one, a.data(), ld, eye.data(), ld) == 0, "strsm of I: status");
    bool upper = true;
    for (int j = 0; j < m; ++j)
        for (int i = j + 1; i < m; ++i) upper &= eye[i + j * ld] == 0.0f;
    check(upper, "strsm of I: the inverse of an upper triangle is upper");
    check(cublasStrsm_v2(h, 1, 1, OP_N, 0, m, n, &alpha, a.data(), ld, x.data(), ld) == BLAS_NOT_SUPPORTED,
          "strsm side RIGHT refused");
    check(cublasStrsm_v2(h, 0, 1, OP_N, 0, m, n, &alpha, a.data(), m - 1, x.data(), ld) == BLAS_INVALID_VALUE,
          "strsm lda < m refused");
}

int main(int argc, char** argv) {
    const std::string dir = argc > 1 && argv[1][0] != '-' ? argv[1] : "target/cuda-emu";
    bool big = false;
    for (int i = 1; i < argc; ++i) big |= std::string(argv[i]) == "--big";
    void* blas = dlopen((dir + "/libcublas.so").c_str(), RTLD_NOW | RTLD_LOCAL);
    void* solver = dlopen((dir + "/libcusolver.so").c_str(), RTLD_NOW | RTLD_LOCAL);
    if (blas == nullptr || solver == nullptr) {
        std::printf("FAIL: dlopen: %s\n", dlerror());
        return 2;
    }
    load(blas, cublasCreate_v2, "cublasCreate_v2");
    load(blas, cublasDestroy_v2, "cublasDestroy_v2");
    load(blas, cublasSetStream_v2, "cublasSetStream_v2");
    load(blas, cublasGetStream_v2, "cublasGetStream_v2");
    load(blas, cublasSetMathMode, "cublasSetMathMode");
    load(blas, cublasGetMathMode, "cublasGetMathMode");
    load(blas, cublasSetPointerMode_v2, "cublasSetPointerMode_v2");
    load(blas, cublasGetPointerMode_v2, "cublasGetPointerMode_v2");
    load(blas, cublasGetVersion_v2, "cublasGetVersion_v2");
    load(blas, cublasSgemm_v2, "cublasSgemm_v2");
    load(blas, cublasSgemmStridedBatched, "cublasSgemmStridedBatched");
    load(blas, cublasGemmEx, "cublasGemmEx");
    load(blas, cublasGemmStridedBatchedEx, "cublasGemmStridedBatchedEx");
    load(blas, cublasGemmBatchedEx, "cublasGemmBatchedEx");
    load(blas, cublasStrsm_v2, "cublasStrsm_v2");
    load(solver, cusolverDnCreate, "cusolverDnCreate");
    load(solver, cusolverDnDestroy, "cusolverDnDestroy");
    load(solver, cusolverDnSetStream, "cusolverDnSetStream");
    load(solver, cusolverDnGetStream, "cusolverDnGetStream");
    load(solver, cusolverDnCreateParams, "cusolverDnCreateParams");
    load(solver, cusolverDnDestroyParams, "cusolverDnDestroyParams");
    load(solver, cusolverDnSetAdvOptions, "cusolverDnSetAdvOptions");
    load(solver, cusolverDnXpotrf_bufferSize, "cusolverDnXpotrf_bufferSize");
    load(solver, cusolverDnXpotrf, "cusolverDnXpotrf");
    load(solver, cusolverDnXtrtri_bufferSize, "cusolverDnXtrtri_bufferSize");
    load(solver, cusolverDnXtrtri, "cusolverDnXtrtri");
    load(solver, cusolverDnSpotrf_bufferSize, "cusolverDnSpotrf_bufferSize");
    load(solver, cusolverDnSpotrf, "cusolverDnSpotrf");

    // The refusal checks below print the libraries' one-line complaints to stderr; that is expected.
    test_handle();
    H h = nullptr;
    cublasCreate_v2(&h);
    cublasSetMathMode(h, 0);
    test_sgemm(h);
    test_strided_batched(h);
    test_gemm_ex(h);
    test_trsm(h);
    test_solver();
    timing(h, big);
    cublasDestroy_v2(h);

    std::printf("%d checks, %d failed\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
