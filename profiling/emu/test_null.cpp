// test_null.cpp — the null mode (EMU_KERNELS=skip) and the counters (counters.h), through the built libraries
// loaded the way cudarc loads them: dlopen("libcuda.so") by name, RTLD_LOCAL, from LD_LIBRARY_PATH, then
// libcublas.so and libcusolver.so, which find the fake driver themselves. Each case runs in a child process,
// because the mode is read once per process:
//   counts    the normal mode: each kind of call moves exactly its counter, read with dlsym on the handle
//             dlopen("libcuda.so", RTLD_NOLOAD) returns (as the Rust side reads them), per-name tables included;
//             the struct's size protocol; the probe kernel writes
//   skip      the null mode: the device name and flags say so; device, page-locked and stream-ordered
//             allocations read back as zeros, and 4 GiB of them leave the resident set as it was; a kernel that
//             would write does not; cuBLAS and cuSOLVER return success with their outputs untouched (info = 0
//             in fresh memory, on a matrix that is not positive definite); bad arguments still fail; copies and
//             memsets still move their bytes; the counters still count
//   json      EMU_COUNTERS=path (%p: the process id) writes the totals and per-name counts at exit, in the null
//             mode, with the library loaded RTLD_GLOBAL and the counters read through dlsym(RTLD_DEFAULT)
// With --bench it times what the null mode costs instead (allocations, copies, memsets, launches with the
// stream-order check on and off, cuBLAS calls) and prints a table (README "The null mode").
//
//   target/cuda-emu/test_null target/cuda-emu [--bench]     (built by build.sh; check.sh runs it in both
//                                                            schedules, EMU_STREAMS=eager and lazy)
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "counters.h"
#include "test_check.h"

// cuda.h #defines many driver names to their _v2 symbols (cuMemAlloc → cuMemAlloc_v2), which is what the fake
// driver exports and cudarc looks up: STR expands the macro before quoting.
#define STR_(x) #x
#define STR(x) STR_(x)

namespace {

std::string g_dir;  // where the built libraries are

void* sym(void* h, const char* name) {
    void* p = dlsym(h, name);
    if (!p) {
        std::fprintf(stderr, "test_null: %s not found: %s\n", name, dlerror());
        std::_Exit(3);
    }
    return p;
}
#define LOAD(h, fn) reinterpret_cast<decltype(&fn)>(sym(h, STR(fn)))

// The driver calls the cases make, looked up by the names cudarc uses.
struct Driver {
    void* h = nullptr;
    decltype(&cuInit) init;
    decltype(&cuDeviceGetName) name;
    decltype(&cuMemAlloc) alloc;
    decltype(&cuMemAllocAsync) alloc_async;
    decltype(&cuMemFree) free;
    decltype(&cuMemFreeAsync) free_async;
    decltype(&cuMemHostAlloc) host_alloc;
    decltype(&cuMemFreeHost) free_host;
    decltype(&cuMemHostRegister) host_register;
    decltype(&cuMemHostUnregister) host_unregister;
    decltype(&cuMemcpyHtoD) htod;
    decltype(&cuMemcpyDtoH) dtoh;
    decltype(&cuMemcpyDtoD) dtod;
    decltype(&cuMemcpyHtoDAsync) htod_async;
    decltype(&cuMemcpyDtoHAsync) dtoh_async;
    decltype(&cuMemsetD8) memset8;
    decltype(&cuMemsetD32) memset32;
    decltype(&cuMemsetD32Async) memset32_async;
    decltype(&cuModuleGetFunction) function;
    decltype(&cuLaunchKernel) launch;
    decltype(&cuStreamCreate) stream_create;
    decltype(&cuStreamSynchronize) stream_sync;
    decltype(&cuStreamQuery) stream_query;
    decltype(&cuStreamWaitEvent) stream_wait;
    decltype(&cuCtxSynchronize) ctx_sync;
    decltype(&cuEventCreate) event_create;
    decltype(&cuEventRecord) event_record;
    decltype(&cuEventSynchronize) event_sync;
    decltype(&boa_emu_counters_get) counters;
    decltype(&boa_emu_counter_name) counter_name;
};

// Loads the fake driver as cudarc's libloading does (RTLD_LAZY | RTLD_LOCAL, by name), or RTLD_GLOBAL; the
// counters are then looked up on the handle dlopen(RTLD_NOLOAD) gives back, as the Rust side will.
Driver load_driver(int scope = RTLD_LOCAL) {
    Driver d;
    d.h = dlopen("libcuda.so", RTLD_LAZY | scope);
    if (!d.h) {
        std::fprintf(stderr, "test_null: dlopen(libcuda.so): %s\n", dlerror());
        std::_Exit(3);
    }
    d.init = LOAD(d.h, cuInit);
    d.name = LOAD(d.h, cuDeviceGetName);
    d.alloc = LOAD(d.h, cuMemAlloc);
    d.alloc_async = LOAD(d.h, cuMemAllocAsync);
    d.free = LOAD(d.h, cuMemFree);
    d.free_async = LOAD(d.h, cuMemFreeAsync);
    d.host_alloc = LOAD(d.h, cuMemHostAlloc);
    d.free_host = LOAD(d.h, cuMemFreeHost);
    d.host_register = LOAD(d.h, cuMemHostRegister);
    d.host_unregister = LOAD(d.h, cuMemHostUnregister);
    d.htod = LOAD(d.h, cuMemcpyHtoD);
    d.dtoh = LOAD(d.h, cuMemcpyDtoH);
    d.dtod = LOAD(d.h, cuMemcpyDtoD);
    d.htod_async = LOAD(d.h, cuMemcpyHtoDAsync);
    d.dtoh_async = LOAD(d.h, cuMemcpyDtoHAsync);
    d.memset8 = LOAD(d.h, cuMemsetD8);
    d.memset32 = LOAD(d.h, cuMemsetD32);
    d.memset32_async = LOAD(d.h, cuMemsetD32Async);
    d.function = LOAD(d.h, cuModuleGetFunction);
    d.launch = LOAD(d.h, cuLaunchKernel);
    d.stream_create = LOAD(d.h, cuStreamCreate);
    d.stream_sync = LOAD(d.h, cuStreamSynchronize);
    d.stream_query = LOAD(d.h, cuStreamQuery);
    d.stream_wait = LOAD(d.h, cuStreamWaitEvent);
    d.ctx_sync = LOAD(d.h, cuCtxSynchronize);
    d.event_create = LOAD(d.h, cuEventCreate);
    d.event_record = LOAD(d.h, cuEventRecord);
    d.event_sync = LOAD(d.h, cuEventSynchronize);
    void* again = dlopen("libcuda.so", RTLD_LAZY | RTLD_NOLOAD);
    if (again != d.h) {
        std::fprintf(stderr, "test_null: dlopen(libcuda.so, RTLD_NOLOAD) did not find the loaded library\n");
        std::_Exit(3);
    }
    d.counters = reinterpret_cast<decltype(&boa_emu_counters_get)>(sym(again, "boa_emu_counters_get"));
    d.counter_name = reinterpret_cast<decltype(&boa_emu_counter_name)>(sym(again, "boa_emu_counter_name"));
    return d;
}

// The library calls, with the signatures of cudarc 0.19.10's bindings (as test_blas.cpp).
using H = void*;
constexpr int OP_N = 0, R_32F = 0, R_16BF = 14, COMPUTE_32F = 68, GEMM_DEFAULT = -1, FILL_LOWER = 0,
              DIAG_NON_UNIT = 0;
constexpr int BLAS_INVALID_VALUE = 7, SOLVER_INVALID_VALUE = 3;
struct Blas {
    int (*create)(H*);
    int (*set_stream)(H, void*);
    int (*sgemm)(H, int, int, int, int, int, const float*, const float*, int, const float*, int, const float*, float*,
                 int);
    int (*gemm_ex)(H, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int, const void*,
                   void*, int, int, int, int);
    int (*solver_create)(H*);
    int (*solver_set_stream)(H, void*);
    int (*params)(H*);
    int (*potrf_size)(H, H, int, int64_t, int, const void*, int64_t, int, size_t*, size_t*);
    int (*potrf)(H, H, int, int64_t, int, void*, int64_t, int, void*, size_t, void*, size_t, int*);
    int (*trtri_size)(H, int, int, int64_t, int, void*, int64_t, size_t*, size_t*);
    int (*trtri)(H, int, int, int64_t, int, void*, int64_t, void*, size_t, void*, size_t, int*);
};

Blas load_blas() {
    void* b = dlopen("libcublas.so", RTLD_LAZY | RTLD_LOCAL);
    void* s = dlopen("libcusolver.so", RTLD_LAZY | RTLD_LOCAL);
    if (!b || !s) {
        std::fprintf(stderr, "test_null: dlopen of libcublas.so / libcusolver.so: %s\n", dlerror());
        std::_Exit(3);
    }
    Blas l;
    l.create = reinterpret_cast<decltype(l.create)>(sym(b, "cublasCreate_v2"));
    l.set_stream = reinterpret_cast<decltype(l.set_stream)>(sym(b, "cublasSetStream_v2"));
    l.sgemm = reinterpret_cast<decltype(l.sgemm)>(sym(b, "cublasSgemm_v2"));
    l.gemm_ex = reinterpret_cast<decltype(l.gemm_ex)>(sym(b, "cublasGemmEx"));
    l.solver_create = reinterpret_cast<decltype(l.solver_create)>(sym(s, "cusolverDnCreate"));
    l.solver_set_stream = reinterpret_cast<decltype(l.solver_set_stream)>(sym(s, "cusolverDnSetStream"));
    l.params = reinterpret_cast<decltype(l.params)>(sym(s, "cusolverDnCreateParams"));
    l.potrf_size = reinterpret_cast<decltype(l.potrf_size)>(sym(s, "cusolverDnXpotrf_bufferSize"));
    l.potrf = reinterpret_cast<decltype(l.potrf)>(sym(s, "cusolverDnXpotrf"));
    l.trtri_size = reinterpret_cast<decltype(l.trtri_size)>(sym(s, "cusolverDnXtrtri_bufferSize"));
    l.trtri = reinterpret_cast<decltype(l.trtri)>(sym(s, "cusolverDnXtrtri"));
    return l;
}

#define OK(call) CHECK((call) == CUDA_SUCCESS, "%s", #call)

boa_emu_counters snapshot(const Driver& d) {
    boa_emu_counters c{};
    c.size = sizeof c;
    CHECK(d.counters(&c) == 0, "boa_emu_counters_get failed");
    return c;
}

uint32_t bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return b;
}

bool all(const std::vector<float>& v, float x) {
    for (float f : v)
        if (std::memcmp(&f, &x, 4) != 0) return false;
    return true;
}

bool all_zero(const void* p, size_t n) {
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i)
        if (b[i]) return false;
    return true;
}

// Resident memory of this process, in bytes (/proc/self/statm's second field).
size_t resident() {
    std::ifstream f("/proc/self/statm");
    size_t pages = 0, rss = 0;
    f >> pages >> rss;
    return rss * (size_t)sysconf(_SC_PAGESIZE);
}

CUresult fill(const Driver& d, CUfunction k, CUdeviceptr out, float v, unsigned n, CUstream s, unsigned threads = 64) {
    void* args[] = {&out, &v, &n};
    return d.launch(k, (n + threads - 1) / threads, 1, 1, threads, 1, 1, 0, s, args, nullptr);
}

// The 2 × 2 identity GEMM C = A·B with A = B = I: what cuBLAS writes when it runs.
void sgemm_2x2(const Blas& l, H h, CUdeviceptr a, CUdeviceptr c, int expect, int lda = 2) {
    const float one = 1, zero = 0;
    const int st = l.sgemm(h, OP_N, OP_N, 2, 2, 2, &one, (const float*)a, lda, (const float*)a, 2, &zero, (float*)c, 2);
    CHECK(st == expect, "cublasSgemm_v2 returned %d, not %d", st, expect);
}

// ---- counts: the normal mode ------------------------------------------------------------------------------
int case_counts() {
    Driver d = load_driver();
    const boa_emu_counters c0 = snapshot(d);
    CHECK(c0.version == BOA_EMU_COUNTERS_VERSION && c0.size == sizeof c0, "version %u size %u", c0.version, c0.size);
    // A caller with a shorter (older) struct gets no more than it has room for.
    {
        alignas(8) unsigned char buf[32];
        std::memset(buf, 0xab, sizeof buf);
        boa_emu_counters* shortc = reinterpret_cast<boa_emu_counters*>(buf);
        shortc->size = 16;
        CHECK(d.counters(shortc) == 0 && shortc->size == 16 && buf[16] == 0xab, "a 16-byte caller got more than 16 bytes");
        CHECK(d.counters(nullptr) == -1, "a null pointer was accepted");
    }
    OK(d.init(0));
    char name[160];
    OK(d.name(name, sizeof name, 0));
    CHECK(std::strstr(name, "kernels skipped") == nullptr, "the normal mode's device name says skipped: %s", name);
    CHECK((c0.flags & BOA_EMU_KERNELS_SKIPPED) == 0, "flags %llu say skipped", (unsigned long long)c0.flags);

    constexpr unsigned N = 64;
    constexpr size_t B = N * sizeof(float);
    CUdeviceptr x = 0, y = 0;
    OK(d.alloc(&x, B));
    OK(d.alloc(&y, B));
    void* pinned = nullptr;
    OK(d.host_alloc(&pinned, B, 0));
    std::vector<float> host(N, 3.0f), back(N, 0.0f), reg(N, 0.0f);
    OK(d.host_register(reg.data(), B, 0));
    std::memcpy(pinned, host.data(), B);
    CUstream s = nullptr;
    OK(d.stream_create(&s, CU_STREAM_NON_BLOCKING));
    CUevent e = nullptr;
    OK(d.event_create(&e, 0));
    CUfunction k = nullptr;
    OK(d.function(&k, nullptr, "emu_probe_fill_kernel"));

    OK(d.htod(x, host.data(), B));                  // h2d pageable, a copy sync
    OK(d.htod_async(y, pinned, B, s));               // h2d locked (after the legacy stream's copy: an event)
    OK(d.memset32_async(y, bits(1.0f), N, s));       // a memset
    OK(fill(d, k, y, 2.5f, N, s));                   // a launch
    OK(d.event_record(e, s));
    OK(d.stream_wait(nullptr, e, 0));                 // a stream wait
    OK(d.dtoh_async(pinned, y, B, s));               // d2h locked
    OK(d.stream_sync(s));                            // a stream sync
    CHECK(all(std::vector<float>((float*)pinned, (float*)pinned + N), 2.5f), "the probe kernel did not write 2.5");
    OK(d.dtoh_async(back.data(), x, B, s));          // d2h pageable: returns when done (a copy sync)
    CHECK(all(back, 3.0f), "the pageable copy back did not bring 3.0");
    OK(d.dtoh_async(reg.data(), y, B, s));           // d2h into registered memory: locked
    OK(d.event_record(e, s));
    OK(d.event_sync(e));                             // an event sync
    CHECK(all(reg, 2.5f), "the copy into registered memory did not bring 2.5");
    OK(d.dtod(x, y, B));                             // d2d, a copy sync
    OK(d.memset8(x, 0, B));                          // a memset, a copy sync
    CHECK(d.stream_query(s) == CUDA_SUCCESS, "the idle stream is not idle");  // a query
    OK(d.ctx_sync());                                // a context sync

    Blas l = load_blas();
    H bh = nullptr, sh = nullptr, params = nullptr;
    CHECK(l.create(&bh) == 0 && l.set_stream(bh, s) == 0, "cuBLAS handle");
    CHECK(l.solver_create(&sh) == 0 && l.solver_set_stream(sh, s) == 0 && l.params(&params) == 0, "cuSOLVER handle");
    CUdeviceptr a = 0, c = 0, info = 0, work = 0;
    OK(d.alloc(&a, 4 * sizeof(float)));
    OK(d.alloc(&c, 4 * sizeof(float)));
    OK(d.alloc(&info, sizeof(int)));
    const float eye[4] = {1, 0, 0, 1};
    OK(d.htod(a, eye, sizeof eye));                  // h2d pageable, a copy sync
    sgemm_2x2(l, bh, a, c, 0);                       // a cuBLAS call
    sgemm_2x2(l, bh, a, c, BLAS_INVALID_VALUE, 1);   // refused: not counted
    size_t dev_bytes = 0, host_bytes = 0;
    CHECK(l.potrf_size(sh, params, FILL_LOWER, 2, R_32F, (void*)a, 2, R_32F, &dev_bytes, &host_bytes) == 0, "bufferSize");
    OK(d.alloc(&work, dev_bytes));
    CHECK(l.potrf(sh, params, FILL_LOWER, 2, R_32F, (void*)a, 2, R_32F, (void*)work, dev_bytes, nullptr, 0,
                  (int*)info) == 0, "cusolverDnXpotrf");  // a cuSOLVER call
    OK(d.stream_sync(s));                            // a stream sync
    float out[4];
    int inf = -1;
    OK(d.dtoh(out, c, sizeof out));                  // d2h pageable, a copy sync
    OK(d.dtoh(&inf, info, sizeof inf));              // d2h pageable, a copy sync
    CHECK(out[0] == 1 && out[1] == 0 && out[2] == 0 && out[3] == 1 && inf == 0, "the GEMM or the factor did not run");

    OK(d.free(x));                                   // a device free, a free sync
    OK(d.free_host(pinned));                         // a host free, a free sync
    OK(d.host_unregister(reg.data()));
    const boa_emu_counters c1 = snapshot(d);

    auto expect = [&](const char* what, uint64_t boa_emu_counters::*f, uint64_t want) {
        const uint64_t got = c1.*f - c0.*f;
        CHECK(got == want, "%s: %llu, expected %llu", what, (unsigned long long)got, (unsigned long long)want);
    };
#define EXPECT(field, want) expect(#field, &boa_emu_counters::field, want)
    EXPECT(h2d_pageable_copies, 2);
    EXPECT(h2d_pageable_bytes, B + sizeof eye);
    EXPECT(h2d_locked_copies, 1);
    EXPECT(h2d_locked_bytes, B);
    EXPECT(d2h_pageable_copies, 3);
    EXPECT(d2h_pageable_bytes, B + sizeof out + sizeof inf);
    EXPECT(d2h_locked_copies, 2);
    EXPECT(d2h_locked_bytes, 2 * B);
    EXPECT(d2d_copies, 1);
    EXPECT(d2d_bytes, B);
    EXPECT(h2h_copies, 0);
    EXPECT(memsets, 2);
    EXPECT(memset_bytes, 2 * B);
    EXPECT(stream_syncs, 2);
    EXPECT(context_syncs, 1);
    EXPECT(event_syncs, 1);
    EXPECT(copy_syncs, 7);  // htod ×2, dtoh ×2, dtod, memset8, and the async copy into pageable memory
    EXPECT(free_syncs, 2);
    EXPECT(host_syncs, 13);
    EXPECT(queries, 1);
    EXPECT(stream_waits, 1);
    EXPECT(event_records, 2);
    EXPECT(kernel_launches, 1);
    EXPECT(cublas_calls, 1);
    EXPECT(cusolver_calls, 1);
    EXPECT(device_allocs, 6);
    EXPECT(device_alloc_bytes, 2 * B + 8 * sizeof(float) + sizeof(int) + dev_bytes);
    EXPECT(device_frees, 1);
    EXPECT(device_free_bytes, B);
    EXPECT(host_allocs, 1);
    EXPECT(host_alloc_bytes, B);
    EXPECT(host_frees, 1);
    EXPECT(host_free_bytes, B);
    EXPECT(host_registers, 1);
    EXPECT(host_register_bytes, B);
#undef EXPECT
    CHECK(c1.copy_ns > c0.copy_ns, "no time was counted for moving bytes");
    CHECK(c1.device_bytes_live == c0.device_bytes_live + B + 8 * sizeof(float) + sizeof(int) + dev_bytes,
          "device_bytes_live %llu", (unsigned long long)c1.device_bytes_live);
    CHECK(c1.device_bytes_peak == c1.device_bytes_live + B, "device_bytes_peak %llu", (unsigned long long)c1.device_bytes_peak);

    // The per-name tables.
    const char* nm = nullptr;
    uint64_t n = 0;
    CHECK(d.counter_name(0, 0, &nm, &n) == 0 && std::string(nm) == "emu_probe_fill_kernel" && n == 1,
          "kernel table entry 0: %s %llu", nm ? nm : "(none)", (unsigned long long)n);
    CHECK(d.counter_name(0, 1, &nm, &n) == 1, "the kernel table has a second entry");
    CHECK(d.counter_name(1, 0, &nm, &n) == 0 && std::string(nm) == "cublasSgemm_v2" && n == 1, "library entry 0: %s", nm);
    CHECK(d.counter_name(1, 1, &nm, &n) == 0 && std::string(nm) == "cusolverDnXpotrf" && n == 1, "library entry 1: %s", nm);
    CHECK(d.counter_name(1, 2, &nm, &n) == 1, "the library table has a third entry");
    CHECK(d.counter_name(2, 0, &nm, &n) == -1 && d.counter_name(0, 0, nullptr, &n) == -1, "bad arguments accepted");
    return g_failures;
}

// ---- skip: the null mode ----------------------------------------------------------------------------------
int case_skip() {
    setenv("EMU_KERNELS", "skip", 1);
    Driver d = load_driver();
    OK(d.init(0));
    char name[160];
    OK(d.name(name, sizeof name, 0));
    CHECK(std::strstr(name, "CPU emulator (profiling/emu, kernels skipped") == name, "device name: %s", name);
    const boa_emu_counters c0 = snapshot(d);
    CHECK(c0.flags & BOA_EMU_KERNELS_SKIPPED, "flags %llu do not say skipped", (unsigned long long)c0.flags);

    // Fresh memory reads as zeros: small and large device allocations, stream-ordered ones, page-locked ones.
    constexpr unsigned N = 64;
    constexpr size_t B = N * sizeof(float);
    CUstream s = nullptr;
    OK(d.stream_create(&s, CU_STREAM_NON_BLOCKING));
    CUdeviceptr x = 0, y = 0;
    OK(d.alloc(&x, B));
    OK(d.alloc_async(&y, B, s));
    std::vector<float> back(N, 7.0f);
    OK(d.dtoh(back.data(), x, B));
    CHECK(all(back, 0.0f), "a small device allocation is not zeros");
    OK(d.dtoh_async(back.data(), y, B, s));
    CHECK(all(back, 0.0f), "a cuMemAllocAsync allocation is not zeros");
    void* pinned = nullptr;
    OK(d.host_alloc(&pinned, B, 0));
    CHECK(all_zero(pinned, B), "a small page-locked allocation is not zeros");

    const size_t rss0 = resident();
    constexpr size_t kGiB = size_t(1) << 30;
    CUdeviceptr big[4] = {};
    for (CUdeviceptr& b : big) OK(d.alloc(&b, kGiB));
    void* big_pinned = nullptr;
    OK(d.host_alloc(&big_pinned, kGiB / 4, 0));
    std::vector<unsigned char> page(4096, 0xee);
    for (size_t off : {size_t(0), kGiB / 2 + 12345, kGiB - 4096}) {
        OK(d.dtoh(page.data(), big[3] + off, page.size()));
        CHECK(all_zero(page.data(), page.size()), "a 1 GiB device allocation is not zeros at %zu", off);
    }
    CHECK(all_zero((const unsigned char*)big_pinned + kGiB / 8, 4096), "a large page-locked allocation is not zeros");
    const size_t grown = resident() - rss0;
    CHECK(grown < (size_t(64) << 20), "4.25 GiB of allocations and reads grew the resident set by %zu MiB", grown >> 20);

    // A kernel that would write does not; a launch past the limits still fails.
    CUfunction k = nullptr;
    OK(d.function(&k, nullptr, "emu_probe_fill_kernel"));
    OK(d.memset32(x, bits(1.0f), N));
    OK(fill(d, k, x, 2.5f, N, nullptr));
    OK(d.dtoh(back.data(), x, B));
    CHECK(all(back, 1.0f), "the probe kernel wrote in the null mode");
    CHECK(fill(d, k, x, 2.5f, N, nullptr, 2048) == CUDA_ERROR_INVALID_VALUE, "a 2048-thread block was launched");
    // Past the kernel's __launch_bounds__(256): refused where the runtime would refuse it, when the launch runs
    // (eager: in the call; lazy: later, as a sticky error, which would end this case).
    const bool lazy = c0.flags & BOA_EMU_LAZY_STREAMS;
    if (!lazy)
        CHECK(fill(d, k, x, 2.5f, N, nullptr, 512) == CUDA_ERROR_LAUNCH_FAILED,
              "a block past the kernel's __launch_bounds__(256) was launched");

    // Copies and memsets still move their bytes.
    std::vector<float> pattern(N);
    for (unsigned i = 0; i < N; ++i) pattern[i] = (float)i;
    OK(d.htod(big[0] + 4096, pattern.data(), B));
    OK(d.dtod(x, big[0] + 4096, B));
    OK(d.dtoh(back.data(), x, B));
    CHECK(std::memcmp(back.data(), pattern.data(), B) == 0, "copies did not move their bytes");
    OK(d.memset32(x + 8, bits(-2.0f), 4));
    OK(d.dtoh(back.data(), x, B));
    CHECK(back[1] == 1 && back[2] == -2 && back[5] == -2 && back[6] == 6, "a memset did not land: %g %g %g %g", back[1],
          back[2], back[5], back[6]);
    // A zero memset of a large allocation: every byte is zero again, and the written pages leave the resident set.
    std::vector<unsigned char> ones(size_t(64) << 20, 1);
    OK(d.htod(big[1], ones.data(), ones.size()));
    const size_t rss1 = resident();
    OK(d.memset8(big[1] + 100, 0, ones.size() - 200));
    OK(d.dtoh(ones.data(), big[1], ones.size()));
    CHECK(ones[99] == 1 && ones[100] == 0 && all_zero(ones.data() + 100, ones.size() - 200) && ones[ones.size() - 100] == 1,
          "the zero memset is not exact");
    CHECK(resident() + (size_t(32) << 20) < rss1, "the zero memset kept the pages resident");

    // cuBLAS and cuSOLVER: success, outputs untouched, arguments still checked.
    Blas l = load_blas();
    H bh = nullptr, sh = nullptr, params = nullptr;
    CHECK(l.create(&bh) == 0 && l.set_stream(bh, s) == 0, "cuBLAS handle");
    CHECK(l.solver_create(&sh) == 0 && l.solver_set_stream(sh, s) == 0 && l.params(&params) == 0, "cuSOLVER handle");
    CUdeviceptr a = 0, c = 0, info = 0, work = 0;
    OK(d.alloc(&a, 4 * sizeof(float)));
    OK(d.alloc(&c, 4 * sizeof(float)));
    OK(d.alloc(&info, sizeof(int)));
    const float eye[4] = {1, 0, 0, 1}, not_spd[4] = {-1, 2, 2, -1};
    OK(d.htod(a, eye, sizeof eye));
    OK(d.memset32(c, bits(9.0f), 4));
    sgemm_2x2(l, bh, a, c, 0);
    sgemm_2x2(l, bh, a, c, BLAS_INVALID_VALUE, 1);
    const float one = 1, zero = 0;
    CHECK(l.gemm_ex(bh, OP_N, OP_N, 2, 2, 2, &one, (void*)a, R_16BF, 2, (void*)a, R_16BF, 2, &zero, (void*)c, R_32F, 2,
                    COMPUTE_32F, GEMM_DEFAULT) == 0, "cublasGemmEx");
    OK(d.stream_sync(s));
    float out[4];
    OK(d.dtoh(out, c, sizeof out));
    CHECK(out[0] == 9 && out[1] == 9 && out[2] == 9 && out[3] == 9, "cuBLAS wrote its output in the null mode");
    OK(d.htod(a, not_spd, sizeof not_spd));
    size_t dev_bytes = 0, host_bytes = 0;
    CHECK(l.potrf_size(sh, params, FILL_LOWER, 2, R_32F, (void*)a, 2, R_32F, &dev_bytes, &host_bytes) == 0, "bufferSize");
    OK(d.alloc(&work, dev_bytes));
    CHECK(l.potrf(sh, params, FILL_LOWER, 2, R_32F, (void*)a, 2, R_32F, (void*)work, dev_bytes, nullptr, 0,
                  (int*)info) == 0, "cusolverDnXpotrf");
    CHECK(l.potrf(sh, params, FILL_LOWER, 2, R_32F, (void*)a, 1, R_32F, (void*)work, dev_bytes, nullptr, 0,
                  (int*)info) == SOLVER_INVALID_VALUE, "cusolverDnXpotrf with lda < n was accepted");
    CHECK(l.trtri_size(sh, FILL_LOWER, DIAG_NON_UNIT, 2, R_32F, (void*)c, 2, &dev_bytes, &host_bytes) == 0, "bufferSize");
    OK(d.memset32(c, 0, 4));  // singular: a running trtri would set info = 1
    CHECK(l.trtri(sh, FILL_LOWER, DIAG_NON_UNIT, 2, R_32F, (void*)c, 2, (void*)work, dev_bytes, nullptr, 0, (int*)info) == 0,
          "cusolverDnXtrtri");
    OK(d.stream_sync(s));
    int inf = -1;
    OK(d.dtoh(&inf, info, sizeof inf));
    OK(d.dtoh(out, a, sizeof out));
    CHECK(inf == 0, "info = %d, not 0, after potrf of a matrix that is not positive definite and trtri of a singular one", inf);
    CHECK(std::memcmp(out, not_spd, sizeof out) == 0, "cuSOLVER wrote A in the null mode");

    // Counted as in the normal mode.
    const boa_emu_counters c1 = snapshot(d);
    // Counted: the launch that ran and (eager) the one past its bounds, which was issued; not the 2048-thread one.
    CHECK(c1.kernel_launches - c0.kernel_launches == (lazy ? 1u : 2u), "launches %llu",
          (unsigned long long)(c1.kernel_launches - c0.kernel_launches));
    CHECK(c1.cublas_calls - c0.cublas_calls == 2 && c1.cusolver_calls - c0.cusolver_calls == 2, "library calls %llu, %llu",
          (unsigned long long)(c1.cublas_calls - c0.cublas_calls), (unsigned long long)(c1.cusolver_calls - c0.cusolver_calls));
    CHECK(c1.device_bytes_live - c0.device_bytes_live >= 4 * kGiB, "device_bytes_live");
    for (CUdeviceptr b : big) OK(d.free(b));
    OK(d.free_host(big_pinned));
    return g_failures;
}

// ---- json: EMU_COUNTERS at exit ---------------------------------------------------------------------------
std::string json_template() {
    return std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/emu_test_null_%p.json";
}

int case_json() {
    setenv("EMU_KERNELS", "skip", 1);
    setenv("EMU_COUNTERS", json_template().c_str(), 1);
    Driver d = load_driver(RTLD_GLOBAL);
    // Loaded RTLD_GLOBAL, the counters are also in the global scope.
    CHECK(dlsym(RTLD_DEFAULT, "boa_emu_counters_get") == (void*)d.counters, "boa_emu_counters_get is not in RTLD_DEFAULT");
    OK(d.init(0));
    CUdeviceptr x = 0;
    OK(d.alloc(&x, 256));
    CUfunction k = nullptr;
    OK(d.function(&k, nullptr, "emu_probe_fill_kernel"));
    OK(fill(d, k, x, 1.0f, 64, nullptr));
    OK(fill(d, k, x, 1.0f, 64, nullptr));
    Blas l = load_blas();
    H bh = nullptr;
    CHECK(l.create(&bh) == 0, "cuBLAS handle");
    sgemm_2x2(l, bh, x, x + 64, 0);
    std::fprintf(stderr, "pid=%d\n", (int)getpid());
    std::exit(g_failures);  // through exit(), so the atexit handler writes the file
}

void check_json(const ChildResult& r) {
    const size_t at = r.err.find("pid=");
    CHECK(at != std::string::npos, "the json child did not say its pid");
    if (at == std::string::npos) return;
    std::string path = json_template();
    path.replace(path.find("%p"), 2, std::to_string(std::atoi(r.err.c_str() + at + 4)));
    std::ifstream f(path);
    std::stringstream ss;
    ss << f.rdbuf();
    const std::string j = ss.str();
    std::remove(path.c_str());
    for (const char* want : {"\"version\": 1", "\"device\": \"CPU emulator (profiling/emu, kernels skipped",
                             "\"kernel_launches\": 2", "\"emu_probe_fill_kernel\": 2", "\"cublasSgemm_v2\": 1",
                             "\"cublas_calls\": 1", "\"device_allocs\": 1", "\"device_alloc_bytes\": 256",
                             "\"copy_syncs\": 0", "\"library_calls\": {"})
        CHECK(j.find(want) != std::string::npos, "%s has no %s:\n%s", path.c_str(), want, j.c_str());
}

// ---- bench: what the null mode costs ----------------------------------------------------------------------
double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <class F>
double timed(F f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return seconds_since(t0);
}

int bench(bool skip) {
    if (skip) setenv("EMU_KERNELS", "skip", 1);
    Driver d = load_driver();
    OK(d.init(0));
    char name[160];
    OK(d.name(name, sizeof name, 0));
    std::printf("%s\n", name);
    constexpr size_t kGiB = size_t(1) << 30;
    const double gib = 1.0;
    if (!skip) {
        CUdeviceptr b = 0;
        std::printf("  cuMemAlloc 1 GiB (0xff fill)                  %8.3f s\n", timed([&] { OK(d.alloc(&b, kGiB)); }));
        OK(d.free(b));
        return g_failures;
    }
    CUdeviceptr big[4] = {}, t = 0;
    std::printf("  cuMemAlloc 4 × 1 GiB                          %8.3f ms\n",
                1e3 * timed([&] { for (CUdeviceptr& b : big) OK(d.alloc(&b, kGiB)); }));
    std::printf("  cuMemAlloc 64 KiB (heap, memset 0), each      %8.3f µs\n", 1e6 / 1000 * timed([&] {
                    for (int i = 0; i < 1000; ++i) {
                        OK(d.alloc(&t, 65536));
                        OK(d.free(t));
                    }
                }));
    std::printf("  cuMemAlloc 8 MiB (mmap), each                 %8.3f µs\n", 1e6 / 1000 * timed([&] {
                    for (int i = 0; i < 1000; ++i) {
                        OK(d.alloc(&t, size_t(8) << 20));
                        OK(d.free(t));
                    }
                }));
    std::vector<unsigned char> host(kGiB, 1);
    std::printf("  cuMemcpyHtoD 1 GiB pageable, fresh device     %8.2f GB/s\n",
                gib * 1.0737 / timed([&] { OK(d.htod(big[0], host.data(), kGiB)); }));
    std::printf("  cuMemcpyHtoD 1 GiB pageable, again            %8.2f GB/s\n",
                gib * 1.0737 / timed([&] { OK(d.htod(big[0], host.data(), kGiB)); }));
    std::printf("  cuMemcpyDtoH 1 GiB into pageable             %8.2f GB/s\n",
                gib * 1.0737 / timed([&] { OK(d.dtoh(host.data(), big[0], kGiB)); }));
    std::printf("  cuMemcpyDtoH 1 GiB never written (zero pages) %8.2f GB/s\n",
                gib * 1.0737 / timed([&] { OK(d.dtoh(host.data(), big[2], kGiB)); }));
    std::printf("  cuMemcpyDtoD 1 GiB, fresh destination         %8.2f GB/s\n",
                gib * 1.0737 / timed([&] { OK(d.dtod(big[1], big[0], kGiB)); }));
    void* pinned = nullptr;
    std::printf("  cuMemHostAlloc 1 GiB                          %8.3f ms\n",
                1e3 * timed([&] { OK(d.host_alloc(&pinned, kGiB, 0)); }));
    std::memset(pinned, 2, kGiB);
    CUstream s = nullptr;
    OK(d.stream_create(&s, CU_STREAM_NON_BLOCKING));
    std::printf("  cuMemcpyHtoDAsync 1 GiB page-locked + sync    %8.2f GB/s\n", gib * 1.0737 / timed([&] {
                    OK(d.htod_async(big[1], pinned, kGiB, s));
                    OK(d.stream_sync(s));
                }));
    std::printf("  cuMemsetD8 1 GiB to 0 (written pages)         %8.3f ms\n",
                1e3 * timed([&] { OK(d.memset8(big[0], 0, kGiB)); }));
    std::printf("  cuMemsetD8 1 GiB to 1                         %8.3f ms\n",
                1e3 * timed([&] { OK(d.memset8(big[0], 1, kGiB)); }));
    CUfunction k = nullptr;
    OK(d.function(&k, nullptr, "emu_probe_fill_kernel"));
    constexpr int kLaunches = 100000;
    std::printf("  cuLaunchKernel, each                          %8.3f µs\n", 1e6 / kLaunches * timed([&] {
                    for (int i = 0; i < kLaunches; ++i) OK(fill(d, k, big[3], 1.0f, 1u << 20, s));
                    OK(d.stream_sync(s));
                }));
    Blas l = load_blas();
    H bh = nullptr;
    CHECK(l.create(&bh) == 0 && l.set_stream(bh, s) == 0, "cuBLAS handle");
    const float one = 1, zero = 0;
    std::printf("  cublasSgemm_v2 4096³, each                    %8.3f µs\n", 1e6 / 10000 * timed([&] {
                    for (int i = 0; i < 10000; ++i)
                        l.sgemm(bh, OP_N, OP_N, 4096, 4096, 4096, &one, (const float*)big[2], 4096, (const float*)big[3],
                                4096, &zero, (float*)big[1], 4096);
                    OK(d.stream_sync(s));
                }));
    std::printf("  resident set at the end                       %8.2f GiB\n", resident() / 1073741824.0);
    const boa_emu_counters c = snapshot(d);
    std::printf("  copy_ns: %.3f s moving %.2f GB of copies and %.2f GB of memsets\n", c.copy_ns * 1e-9,
                (c.h2d_pageable_bytes + c.h2d_locked_bytes + c.d2h_pageable_bytes + c.d2h_locked_bytes + c.d2d_bytes) * 1e-9,
                c.memset_bytes * 1e-9);
    return g_failures;
}

int report(const char* label, const ChildResult& r) {
    if (r.code == 0) return 0;
    std::fprintf(stderr, "test_null: case %s failed (exit %d):\n%s", label, r.code, r.err.c_str());
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: test_null <folder of the built libcuda.so> [--bench]\n");
        return 2;
    }
    g_dir = argv[1];
    // cudarc finds libcuda.so on the library path: put the folder first and start again, once.
    if (!std::getenv("EMU_TEST_NULL_PATH_SET")) {
        const char* lp = std::getenv("LD_LIBRARY_PATH");
        setenv("LD_LIBRARY_PATH", (g_dir + (lp && *lp ? ":" + std::string(lp) : "")).c_str(), 1);
        setenv("EMU_TEST_NULL_PATH_SET", "1", 1);
        execv("/proc/self/exe", argv);
        std::perror("test_null: execv");
        return 2;
    }
    // The cases choose their own mode; a ptxas report would refuse the probe kernel (it lists only the
    // project's). EMU_STREAMS is kept: check.sh runs this in both schedules.
    for (const char* v : {"EMU_KERNELS", "EMU_COUNTERS", "EMU_PTXAS_REPORT", "EMU_STREAM_ORDER"}) unsetenv(v);
    if (argc > 2 && std::string(argv[2]) == "--bench") {
        const ChildResult a = in_child([] { return bench(false); }), b = in_child([] { return bench(true); });
        std::fflush(stdout);
        setenv("EMU_STREAM_ORDER", "off", 1);
        std::printf("(stream-order check off)\n");
        std::fflush(stdout);
        const ChildResult c = in_child([] { return bench(true); });
        return report("bench run", a) | report("bench skip", b) | report("bench skip, order off", c);
    }
    int failed = report("counts", in_child(case_counts));
    failed |= report("skip", in_child(case_skip));
    const ChildResult j = in_child(case_json);
    failed |= report("json", j);
    check_json(j);
    if (failed || g_failures) {
        std::fprintf(stderr, "test_null: %d checks failed\n", g_failures + failed);
        return 1;
    }
    std::printf("test_null: the null mode skips kernels, cuBLAS and cuSOLVER and reads zeros; the counters count "
                "each call (%s)\n", std::getenv("EMU_STREAMS") ? std::getenv("EMU_STREAMS") : "eager");
    return 0;
}
