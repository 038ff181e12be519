// host_blas.h — what the emulator's libcublas.so and libcusolver.so share (profiling/emu/README.md): the
// double-precision MR × NR micro-kernel both spend their time in, the worker threads both spread tasks
// over, the one-line refusal message, and the hand-off of a call to the fake driver's stream queues. Header-only, with internal linkage: each library gets its own copy
// and neither exports these names.
//
// Before including it, a file defines, inside an anonymous namespace, `constexpr const char* kEmuLib` (the
// library's name, for messages), HANDLE_MAGIC (the first word of its live handles) and its status codes
// ST_SUCCESS, ST_NOT_INITIALIZED, ST_INVALID_VALUE, ST_ALLOC_FAILED and ST_INTERNAL_ERROR.
#pragma once

#include <dlfcn.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <new>
#include <thread>
#include <vector>

namespace {

void complain(const char* fn, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void complain(const char* fn, const char* fmt, ...) {
    // One line per refused call, so an emulated run that takes a path the emulator lacks says which.
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "emu %s: %s: %s\n", kEmuLib, fn, msg);
}

// Panel widths of the micro-kernel: A (or P) packed in MR-row panels, B (or Q) in NR-column panels, k-major.
constexpr int64_t MR = 8, NR = 4;

// out (MR × NR, column-major) = Σ_p a[p·MR + i] · b[p·NR + j].
__attribute__((target("avx2,fma"))) void micro_avx2(int64_t kc, const double* a, const double* b, double* out) {
    __m256d c00 = _mm256_setzero_pd(), c01 = c00, c02 = c00, c03 = c00;
    __m256d c10 = c00, c11 = c00, c12 = c00, c13 = c00;
    for (int64_t p = 0; p < kc; ++p, a += MR, b += NR) {
        const __m256d a0 = _mm256_loadu_pd(a), a1 = _mm256_loadu_pd(a + 4);
        __m256d bj = _mm256_broadcast_sd(b);
        c00 = _mm256_fmadd_pd(a0, bj, c00);
        c10 = _mm256_fmadd_pd(a1, bj, c10);
        bj = _mm256_broadcast_sd(b + 1);
        c01 = _mm256_fmadd_pd(a0, bj, c01);
        c11 = _mm256_fmadd_pd(a1, bj, c11);
        bj = _mm256_broadcast_sd(b + 2);
        c02 = _mm256_fmadd_pd(a0, bj, c02);
        c12 = _mm256_fmadd_pd(a1, bj, c12);
        bj = _mm256_broadcast_sd(b + 3);
        c03 = _mm256_fmadd_pd(a0, bj, c03);
        c13 = _mm256_fmadd_pd(a1, bj, c13);
    }
    _mm256_storeu_pd(out + 0, c00);
    _mm256_storeu_pd(out + 4, c10);
    _mm256_storeu_pd(out + 8, c01);
    _mm256_storeu_pd(out + 12, c11);
    _mm256_storeu_pd(out + 16, c02);
    _mm256_storeu_pd(out + 20, c12);
    _mm256_storeu_pd(out + 24, c03);
    _mm256_storeu_pd(out + 28, c13);
}

void micro_generic(int64_t kc, const double* a, const double* b, double* out) {
    double acc[MR * NR] = {};
    for (int64_t p = 0; p < kc; ++p, a += MR, b += NR)
        for (int64_t j = 0; j < NR; ++j)
            for (int64_t i = 0; i < MR; ++i) acc[i + j * MR] += a[i] * b[j];
    std::memcpy(out, acc, sizeof acc);
}

using Micro = void (*)(int64_t, const double*, const double*, double*);

Micro pick_micro() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return micro_avx2;
    return micro_generic;
}

const Micro micro = pick_micro();

unsigned thread_count() {
    // EMU_BLAS_THREADS caps the worker threads (results do not depend on it; only the time does).
    static const unsigned n = [] {
        unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        if (const char* e = std::getenv("EMU_BLAS_THREADS")) {
            const long v = std::strtol(e, nullptr, 10);
            if (v >= 1) hw = static_cast<unsigned>(std::min<long>(v, 256));
        }
        return hw;
    }();
    return n;
}

// Runs body(state, task) for every task in [0, tasks) on up to thread_count() threads, each with its own
// `state = init()` (scratch buffers); one thread when `work` (multiply-adds) is under a few million, where
// threads do not pay off. A worker that runs out of memory may have claimed tasks it never ran, so
// bad_alloc is rethrown once all have joined: the call has failed.
template <class Init, class Body>
void parallel_tasks(int64_t tasks, double work, Init&& init, Body&& body) {
    std::atomic<int64_t> next{0};
    std::atomic<bool> out_of_memory{false};
    auto worker = [&] {
        // Exceptions must not leave a std::thread (that would terminate the process): report them instead.
        try {
            auto state = init();
            for (int64_t t; (t = next.fetch_add(1)) < tasks;) body(state, t);
        } catch (const std::bad_alloc&) {
            out_of_memory = true;
        }
    };
    const int64_t want = work < 4e6 ? 1 : std::min<int64_t>(thread_count(), tasks);
    std::vector<std::thread> pool;
    try {
        for (int64_t i = 1; i < want; ++i) pool.emplace_back(worker);
    } catch (const std::exception&) {
        // Fewer threads than wanted (thread creation failed): the shared task counter still covers every task.
    }
    worker();
    for (auto& t : pool) t.join();
    if (out_of_memory) throw std::bad_alloc();
}

// A handle of this library (its context struct starts with `uint64_t magic`), not null, freed or foreign.
template <class Ctx>
bool live(const Ctx* h) {
    return h != nullptr && h->magic == HANDLE_MAGIC;
}

// The Get* calls: a live handle and somewhere to write, then one field of it.
template <class Ctx, class T>
int get_field(const Ctx* h, T* out, T Ctx::*field) {
    if (!live(h)) return ST_NOT_INITIALIZED;
    if (out == nullptr) return ST_INVALID_VALUE;
    *out = h->*field;
    return ST_SUCCESS;
}

// Memory a call reads or writes: bytes from p (0: to the end of its allocation). The layout of the fake
// driver's EmuTouch (streams.h), which these libraries do not include.
struct Touch {
    const void* p;
    size_t bytes;
    int write;
};

using Defer = int (*)(void*, const char*, const Touch*, size_t, int (*)(void*), void (*)(void*), void*);

// The fake driver's emu_stream_defer, when the fake driver is loaded (cudarc loads it before these).
Defer find_defer() {
    static const Defer defer = [] {
        for (const char* name : {"libcuda.so", "libcuda.so.1"})
            if (void* h = dlopen(name, RTLD_NOLOAD | RTLD_LAZY))
                if (void* f = dlsym(h, "emu_stream_defer")) return reinterpret_cast<Defer>(f);
        return static_cast<Defer>(nullptr);
    }();
    return defer;
}

// Runs `body` (returning a library status, 0 = success) as one operation on `stream`, through the fake
// driver's emu_stream_defer (streams.h): under EMU_STREAMS=lazy it waits in the stream's queue like a
// kernel, so a missing stream wait shows here too. `touches` are the memory it reads and writes, for the
// driver's stream-order check (streamorder.h), which refuses a call that nothing orders with an earlier user
// of that memory (ST_EXECUTION_FAILED; the driver prints why). Without the fake driver loaded (test_blas
// dlopens the library alone) the body runs at once. Exceptions become statuses: nothing may unwind into C.
template <class B>
int on_stream(void* stream, const char* what, std::initializer_list<Touch> touches, B run) {
    auto body = [what, run] {
        try {
            return run();
        } catch (const std::bad_alloc&) {
            complain(what, "out of host memory");
            return ST_ALLOC_FAILED;
        } catch (const std::exception& e) {
            complain(what, "%s", e.what());
            return ST_INTERNAL_ERROR;
        }
    };
    using F = decltype(body);
    const Defer defer = find_defer();
    if (defer == nullptr) return body();
    const std::vector<Touch> t(touches);
    auto* box = new F(std::move(body));
    const int r = defer(
        stream, what, t.data(), t.size(), [](void* b) { return (*static_cast<F*>(b))(); },
        [](void* b) { delete static_cast<F*>(b); }, box);
    return r < 0 ? ST_EXECUTION_FAILED : r;
}

}  // namespace
