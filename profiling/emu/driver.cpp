// driver.cpp — a fake libcuda.so: the CUDA driver API that cudarc calls, on host memory.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md). cudarc loads libcuda by name at run
// time, so with this library first on LD_LIBRARY_PATH the project's CUDA backend, its launch code and its
// GPU tests run unchanged on a machine without a GPU. Choices that matter:
//   - A CUdeviceptr is the address of a host allocation of exactly the bytes asked for. Allocations are
//     filled with 0xff bytes (NaN as f32) because device memory is not zeroed, and every copy and memset is
//     checked against the live allocations, so a copy past the end of a buffer fails with a message instead
//     of corrupting the heap. Built with EMU_ASAN=1, AddressSanitizer checks the kernels' own loads and
//     stores the same way (compute-sanitizer's memcheck, on the CPU).
//   - Streams and events follow streams.h: by default every operation completes before the call returns;
//     with EMU_STREAMS=lazy operations wait in their stream's queue until something forces them, which
//     reveals a missing stream wait or host synchronization. Copies follow CUDA's rules for pageable host
//     memory (staged at the call; a copy into it returns when done) and page-locked memory (read and written
//     when the copy runs). In both schedules each operation names the memory it touches (touch_of) for the
//     stream-order check of streamorder.h, which refuses one that nothing orders with an earlier user.
//   - EMU_KERNELS=skip, the null mode, times the host alone: launches, cuBLAS and cuSOLVER calls are checked
//     and ordered as always but do no arithmetic, and all memory starts as zeros (mmapped zero pages, so a
//     large allocation costs nothing until written). Copies and memsets still move their bytes. The device
//     name says "kernels skipped".
//   - Every call is counted (counters.h; counting.h is how this file feeds them).
//   - The device claims to be an H200-like sm_90 part (132 SMs, 227 KiB opt-in shared memory) with
//     EMU_MEM_GIB (default 16) of memory, and enforces the launch limits the real one would: threads per
//     block, grid dimensions, and dynamic shared memory above 48 KiB only after the kernel opted in. With
//     ptxas's report of the real build (EMU_PTXAS_REPORT; resources.h) it also counts each kernel's static
//     shared memory against those limits and its registers against the 64 K of a block.
// Kernels come from the registry filled by the generated kernel files (gen_kernels.py); the module images
// cudarc passes (the embedded fatbins) are not read.

#include <cuda.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "counting.h"
#include "cuda_emu.h"
#include "resources.h"
#include "runtime.h"
#include "streams.h"

#define EMU_API extern "C" __attribute__((visibility("default")))

namespace streams = emu::streams;
namespace counters = emu::counters;
using C = boa_emu_counters;

namespace {

constexpr int kSms = 132;
constexpr int kDefaultSmem = 48 * 1024;
constexpr int kOptinSmem = 227 * 1024;

std::mutex g_mu;                            // guards the tables below (the prefetch thread calls in too)
std::map<uintptr_t, size_t> g_device;      // live device allocations: base → bytes
std::map<uintptr_t, size_t> g_host;        // live page-locked host allocations
std::map<uintptr_t, size_t> g_registered;  // pageable ranges page-locked by cuMemHostRegister
std::map<const emu::Kernel*, int> g_optin; // MAX_DYNAMIC_SHARED_SIZE_BYTES per kernel
std::map<uintptr_t, size_t> g_mapped;      // allocations that are mappings of their own (null mode): base → length
size_t g_device_bytes = 0;

// EMU_KERNELS=skip: the null mode (README "The null mode").
bool skipped() {
    static const bool v = streams::env_choice("EMU_KERNELS", "run", "skip");
    return v;
}

constexpr size_t kPage = 4096;
// From this size on, null-mode memory is a mapping of its own: zero pages that cost nothing until written.
constexpr size_t kMapFrom = size_t(1) << 20;

// `len` bytes (a multiple of kPage) of fresh anonymous memory; null when the system refuses. Transparent
// huge pages are not asked for: on the 2-core build machine (THP "madvise", defrag "madvise") a first write
// into them ran at 0.7 to 3.4 GB/s in six tries against a steady 1.4 GB/s for 4 KiB pages (2026-12-01).
void* map_zeros(size_t len) {
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return m == MAP_FAILED ? nullptr : m;
}

// Runs f, a copy's or memset's data movement, and adds its wall time to the copy_ns counter: the share of a
// null-mode run that a GPU's copy engines would spend, not its host (counters.h).
template <class F>
void moving(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    counters::add(&C::copy_ns, (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - t0).count());
}

// Memory for an allocation of n bytes, `align`-aligned (a power of two ≤ kPage). In the checking modes it
// is exactly n bytes of heap (EMU_ASAN sees a kernel run past its end), filled with `fill` unless that is
// negative. In the null mode it reads as zeros whatever `fill` says; from kMapFrom on it is a mapping of its
// own, rounded up to pages (give_back unmaps it).
void* obtain(size_t n, size_t align, int fill) {
    if (skipped() && n >= kMapFrom) {
        const size_t len = (n + kPage - 1) & ~(kPage - 1);
        void* m = map_zeros(len);
        if (!m) return nullptr;
        std::lock_guard<std::mutex> l(g_mu);
        g_mapped[(uintptr_t)m] = len;
        return m;
    }
    void* m = nullptr;
    if (posix_memalign(&m, align, n) != 0) return nullptr;
    if (skipped()) std::memset(m, 0, n);
    else if (fill >= 0) std::memset(m, fill, n);
    return m;
}

void give_back(void* p) {
    size_t len = 0;
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (auto it = g_mapped.find((uintptr_t)p); it != g_mapped.end()) len = it->second, g_mapped.erase(it);
    }
    if (len) munmap(p, len);
    else std::free(p);
}

// Zeros [p, p + n): whole pages of a mapped allocation are handed back to the kernel (they read as zeros
// again and leave the resident set), the rest is written. A large zero memset in the null mode, e.g. of
// accumulators no kernel will add to, then costs neither time nor memory.
void zero_bytes(unsigned char* p, size_t n) {
    const uintptr_t lo = ((uintptr_t)p + kPage - 1) & ~(kPage - 1), hi = ((uintptr_t)p + n) & ~(kPage - 1);
    bool mapped = false;
    if (hi > lo + kPage) {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_mapped.upper_bound((uintptr_t)p);
        mapped = it != g_mapped.begin() && (uintptr_t)p + n <= std::prev(it)->first + std::prev(it)->second;
    }
    if (!mapped || madvise((void*)lo, hi - lo, MADV_DONTNEED) != 0) {
        std::memset(p, 0, n);
        return;
    }
    std::memset(p, 0, lo - (uintptr_t)p);
    std::memset((void*)hi, 0, (uintptr_t)p + n - hi);
}

size_t total_bytes() {
    static const size_t t = [] {
        const char* s = std::getenv("EMU_MEM_GIB");
        return (size_t)((s ? std::atof(s) : 16.0) * (double)(size_t(1) << 30));
    }();
    return t;
}

// ---- fault injection (README "Fault injection"; off unless the variable is set) ----------------------------
// EMU_FAIL_ALLOC_AFTER=N: every device allocation after the N-th fails with CUDA_ERROR_OUT_OF_MEMORY.
// EMU_FAIL_KERNEL=name[:k]: the k-th launch (default the first) of kernel `name` faults: a sticky
// CUDA_ERROR_ILLEGAL_ADDRESS, returned where the launch runs (at the launch when eager, at the synchronization
// that forces it when lazy) and by every later synchronizing call. Counted when issued, so both schedules
// fail the same launch.
long long env_count(const char* var) {
    const char* s = std::getenv(var);
    if (s == nullptr || *s == 0) return -1;
    char* end = nullptr;
    const long long v = std::strtoll(s, &end, 10);
    if (*end != 0 || v < 0) {
        std::fprintf(stderr, "emu: %s=%s is not a count; no fault injected\n", var, s);
        return -1;
    }
    return v;
}

// Whether this allocation is one past EMU_FAIL_ALLOC_AFTER (counts the successful ones; under g_mu).
bool alloc_fails(size_t n) {
    static const long long after = env_count("EMU_FAIL_ALLOC_AFTER");
    static long long made = 0;
    if (after < 0) return false;
    if (made < after) {
        ++made;
        return false;
    }
    std::fprintf(stderr, "emu: injected fault: device allocation %lld of %zu bytes fails (EMU_FAIL_ALLOC_AFTER=%lld)\n",
                 made + 1, n, after);
    return true;
}

struct KernelFault {
    std::string name;
    long long k = 1;
};
const KernelFault* kernel_fault() {
    static const KernelFault* f = []() -> const KernelFault* {
        const char* s = std::getenv("EMU_FAIL_KERNEL");
        if (s == nullptr || *s == 0) return nullptr;
        auto* f = new KernelFault{s};
        if (const size_t c = f->name.find(':'); c != std::string::npos) {
            char* end = nullptr;
            f->k = std::strtoll(f->name.c_str() + c + 1, &end, 10);
            if (*end != 0 || f->k < 1) {
                std::fprintf(stderr, "emu: EMU_FAIL_KERNEL=%s: k must be a count from 1; no fault injected\n", s);
                return nullptr;
            }
            f->name.resize(c);
        }
        return f;
    }();
    return f;
}

// Whether this launch of `name` is the one EMU_FAIL_KERNEL names (counted at the issue).
bool launch_faults(const std::string& name) {
    const KernelFault* f = kernel_fault();
    if (f == nullptr || f->name != name) return false;
    static std::mutex mu;
    static long long seen = 0;
    std::lock_guard<std::mutex> l(mu);
    return ++seen == f->k;
}

int g_pool_tag, g_module_tag, g_ctx_tag;

// A kernel's registers and static shared memory from ptxas's report; 32 registers and none when there is no
// report (resources.h).
emu::resources::Usage usage(const emu::Kernel& k) {
    const emu::resources::Usage* u = emu::resources::find(k.name);
    return u ? *u : emu::resources::Usage{32, 0};
}

// The most dynamic shared memory a launch of `k` may ask for: its opt-in, else what 48 KiB leaves beside its
// `static_smem` bytes of static shared memory.
int dynamic_limit(const emu::Kernel& k, int static_smem) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_optin.find(&k);
    return it != g_optin.end() ? it->second : kDefaultSmem - static_smem;
}

CUresult report(CUresult r, const std::string& what) {
    std::fprintf(stderr, "emu: %s\n", what.c_str());
    return r;
}

// The live allocation holding address p, in any of the three tables, as {base, bytes}; {0, 0} if none.
std::pair<uintptr_t, size_t> holder(uintptr_t p) {
    std::lock_guard<std::mutex> l(g_mu);
    for (const auto* table : {&g_device, &g_host, &g_registered}) {
        auto it = table->upper_bound(p);
        if (it == table->begin()) continue;
        --it;
        if (p < it->first + it->second) return *it;
    }
    return {0, 0};
}

// [p, p + bytes) as a touch for the stream-order check, or p to the end of its allocation when bytes is 0
// (a kernel argument: the driver does not know how far the kernel goes). Pageable memory is not checked.
void touch_of(std::vector<emu::order::Touch>& out, const void* p, size_t bytes, bool write) {
    const auto [base, n] = holder((uintptr_t)p);
    if (n == 0) return;
    const uintptr_t end = base + n, lo = (uintptr_t)p;
    out.push_back({lo, bytes ? std::min(lo + bytes, end) : end, write, base});
}

// The allocation containing [p, p + n), in either table; false when the range is not wholly inside one.
bool inside(const std::map<uintptr_t, size_t>& m, uintptr_t p, size_t n) {
    auto it = m.upper_bound(p);
    if (it == m.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

CUresult check_device(uintptr_t p, size_t n, const char* what) {
    std::lock_guard<std::mutex> l(g_mu);
    if (n == 0 || inside(g_device, p, n)) return CUDA_SUCCESS;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s: %zu bytes at 0x%zx are not inside one live device allocation", what, n,
                  (size_t)p);
    return report(CUDA_ERROR_INVALID_VALUE, buf);
}

CUresult alloc_device(CUdeviceptr* p, size_t n) {
    if (n == 0) return CUDA_ERROR_INVALID_VALUE;
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (g_device_bytes + n > total_bytes() || alloc_fails(n)) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // 256-aligned as cudaMalloc's; NaN bytes, or zeros in the null mode (obtain).
    void* m = obtain(n, 256, 0xff);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> l(g_mu);
    g_device[(uintptr_t)m] = n;
    g_device_bytes += n;
    counters::add2(&C::device_allocs, &C::device_alloc_bytes, n);
    counters::device_live(g_device_bytes);
    emu::order::forget((uintptr_t)m, (uintptr_t)m + n);
#ifdef EMU_RACECHECK
    emu::race::track(m, n);
#endif
    *p = (CUdeviceptr)m;
    return CUDA_SUCCESS;
}

// Frees `p`, an allocation of `table` (device or page-locked host memory), with `what` the call that frees.
// A queued operation that still names the memory would use it after the free (lazy schedule; streams.h),
// so that is reported instead of freeing.
CUresult release(std::map<uintptr_t, size_t>& table, void* p, const char* what) {
    size_t n = 0;
    {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = table.find((uintptr_t)p);
        if (it == table.end())
            return report(CUDA_ERROR_INVALID_VALUE, std::string(what) + " of a pointer that is not a live allocation");
        n = it->second;
    }
    if (std::string user = streams::pending_user((uintptr_t)p, n); !user.empty()) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s of %zu bytes at 0x%zx while ", what, n, (size_t)p);
        return report(CUDA_ERROR_ILLEGAL_ADDRESS, buf + user + " uses them: a stream wait is missing before the free");
    }
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (&table == &g_device) {
            g_device_bytes -= n;
            counters::add2(&C::device_frees, &C::device_free_bytes, n);
            counters::device_live(g_device_bytes);
#ifdef EMU_RACECHECK
            emu::race::untrack(p);
#endif
        } else {
            counters::add2(&C::host_frees, &C::host_free_bytes, n);
        }
        table.erase((uintptr_t)p);
    }
    give_back(p);
    return CUDA_SUCCESS;
}

CUresult copy(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev, const char* what) {
    if (dst_dev)
        if (CUresult r = check_device((uintptr_t)dst, n, what)) return r;
    if (src_dev)
        if (CUresult r = check_device((uintptr_t)src, n, what)) return r;
    if (n) moving([=] { std::memmove(dst, src, n); });
    return CUDA_SUCCESS;
}

enum class Mem { Device, PageLocked, Pageable };

Mem kind(const void* p, size_t n) {
    std::lock_guard<std::mutex> l(g_mu);
    if (inside(g_device, (uintptr_t)p, std::max<size_t>(n, 1))) return Mem::Device;
    if (inside(g_host, (uintptr_t)p, std::max<size_t>(n, 1)) || inside(g_registered, (uintptr_t)p, std::max<size_t>(n, 1)))
        return Mem::PageLocked;
    return Mem::Pageable;
}

// Counts a copy (counters.h): by direction and, on the host side, by the kind of host memory.
void count_copy(size_t n, Mem dst, Mem src) {
    const bool dd = dst == Mem::Device, sd = src == Mem::Device;
    if (dd && sd) counters::add2(&C::d2d_copies, &C::d2d_bytes, n);
    else if (dd && src == Mem::PageLocked) counters::add2(&C::h2d_locked_copies, &C::h2d_locked_bytes, n);
    else if (dd) counters::add2(&C::h2d_pageable_copies, &C::h2d_pageable_bytes, n);
    else if (sd && dst == Mem::PageLocked) counters::add2(&C::d2h_locked_copies, &C::d2h_locked_bytes, n);
    else if (sd) counters::add2(&C::d2h_pageable_copies, &C::d2h_pageable_bytes, n);
    else counters::add2(&C::h2h_copies, &C::h2h_bytes, n);
}

// A copy in stream order, with CUDA's rules for host memory: a pageable source may be reused when the call
// returns (lazy: it is staged now; eager: the copy has run by then); a pageable destination means the call
// returns when the copy is done; page-locked memory is read or written when the copy runs, so the host must
// wait for it. `waits`: the caller is a synchronous form, which returns when the copy is done.
CUresult copy_async(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev, CUstream s, const char* what,
                    bool waits = false) {
    if (dst_dev)
        if (CUresult r = check_device((uintptr_t)dst, n, what)) return r;
    if (src_dev)
        if (CUresult r = check_device((uintptr_t)src, n, what)) return r;
    const Mem dk = dst_dev ? Mem::Device : kind(dst, n), sk = src_dev ? Mem::Device : kind(src, n);
    count_copy(n, dk, sk);
    if (waits || dk == Mem::Pageable) counters::add(&C::copy_syncs);
    if (n == 0) return CUDA_SUCCESS;
    std::vector<emu::order::Touch> touches;
    touch_of(touches, src, n, false);
    touch_of(touches, dst, n, true);
    if (dk == Mem::Pageable) {
        if (CUresult r = streams::submit(s, {what, touches, [=] { return copy(dst, src, n, false, src_dev, what); }}))
            return r;
        return streams::synchronize(s);
    }
    if (sk == Mem::Pageable && streams::lazy()) {
        auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src, (const unsigned char*)src + n);
        return streams::submit(s, {what, touches, [=] { return copy(dst, staged->data(), n, dst_dev, false, what); }});
    }
    return streams::submit(s, {what, touches, [=] { return copy(dst, src, n, dst_dev, src_dev, what); }});
}

// The synchronous copies and memsets run on the legacy stream and return when done.
CUresult copy_sync(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev, const char* what) {
    if (CUresult r = copy_async(dst, src, n, dst_dev, src_dev, nullptr, what, true)) return r;
    return streams::synchronize(nullptr);
}

template <class T>
CUresult memset_async(CUdeviceptr d, T v, size_t count, CUstream s, const char* what) {
    if (CUresult r = check_device((uintptr_t)d, count * sizeof(T), what)) return r;
    counters::add2(&C::memsets, &C::memset_bytes, count * sizeof(T));
    std::vector<emu::order::Touch> touches;
    touch_of(touches, (const void*)d, count * sizeof(T), true);
    return streams::submit(s, {what, touches, [=] {
                                   moving([=] {
                                       if (v == 0) zero_bytes((unsigned char*)d, count * sizeof(T));
                                       else for (size_t i = 0; i < count; ++i) ((T*)d)[i] = v;
                                   });
                                   return CUDA_SUCCESS;
                               }});
}

// The synchronous memsets: on the legacy stream, returning when done.
template <class T>
CUresult memset_sync(CUdeviceptr d, T v, size_t count, const char* what) {
    if (CUresult r = memset_async(d, v, count, nullptr, what)) return r;
    counters::add(&C::copy_syncs);
    return streams::synchronize(nullptr);
}

// cuLaunchKernel's argument array points at the caller's variables, valid only during the call: a queued
// launch keeps copies.
struct Args {
    struct alignas(16) Slot {
        unsigned char b[16];
    };
    std::vector<Slot> storage;     // every argument at a 16-byte aligned offset
    std::vector<void*> ptrs;
    std::vector<emu::order::Touch> touches;  // its pointer arguments' memory, read or written by their constness
    Args(const emu::Kernel& k, void** params) {
        std::vector<size_t> at;
        size_t slots = 0;
        for (size_t n : k.arg_sizes) at.push_back(slots), slots += (n + 15) / 16;
        storage.resize(std::max<size_t>(slots, 1));
        auto* base = reinterpret_cast<unsigned char*>(storage.data());
        for (size_t i = 0; i < k.arg_sizes.size(); ++i) {
            unsigned char* dst = base + 16 * at[i];
            std::memcpy(dst, params[i], k.arg_sizes[i]);
            ptrs.push_back(dst);
            if (k.arg_roles[i] != emu::ArgRole::Value) {
                const void* p;
                std::memcpy(&p, dst, sizeof p);
                touch_of(touches, p, 0, k.arg_roles[i] == emu::ArgRole::Writes);
            }
        }
    }
};

}  // namespace

// What counters.cpp asks of the driver (counting.h): the mode, as flags and as the device name.
namespace emu::counters {
uint64_t mode_flags() {
    uint64_t f = 0;
    if (skipped()) f |= BOA_EMU_KERNELS_SKIPPED;
    if (streams::lazy()) f |= BOA_EMU_LAZY_STREAMS;
    if (streams::order_checked()) f |= BOA_EMU_STREAM_ORDER;
    if (emu::resources::loaded()) f |= BOA_EMU_PTXAS_LIMITS;
#ifdef EMU_RACECHECK
    f |= BOA_EMU_RACECHECK;
#endif
    return f;
}

// The mode and the schedule are in the name, so a log shows which ran (check.sh relies on it), and a
// measurement cannot be taken in the null mode unawares.
std::string device_name() {
    const uint64_t f = mode_flags();
    std::string s = "CPU emulator (profiling/emu";
    if (f & BOA_EMU_KERNELS_SKIPPED) s += ", kernels skipped";
    if (f & BOA_EMU_STREAM_ORDER) s += ", stream order";
    if (f & BOA_EMU_LAZY_STREAMS) s += ", lazy streams";
    if (f & BOA_EMU_PTXAS_LIMITS) s += ", ptxas limits";
    if (f & BOA_EMU_RACECHECK) s += ", racecheck";
    return s + ")";
}
}  // namespace emu::counters

// ---- initialisation, device, context ---------------------------------------------------------------------
EMU_API CUresult cuInit(unsigned int) {
    // The null mode's results are zeros: say so where a run's log shows it, once.
    static const bool said = skipped() && std::fprintf(stderr,
        "emu: EMU_KERNELS=skip: kernels, cuBLAS and cuSOLVER do no arithmetic and memory starts as zeros "
        "(the null mode, for timing the host; results are meaningless)\n") > 0;
    (void)said;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, (size_t)len, "%s", counters::device_name().c_str());
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceTotalMem(size_t* bytes, CUdevice) {
    *bytes = total_bytes();
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGetUuid(CUuuid* u, CUdevice) {
    std::memset(u, 0, sizeof *u);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGetAttribute(int* pi, CUdevice_attribute a, CUdevice) {
    switch (a) {
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: *pi = 1024; break;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: *pi = 64; break;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: *pi = 2147483647; break;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: *pi = 65535; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = kDefaultSmem; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *pi = kOptinSmem; break;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *pi = 228 * 1024; break;
        case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
        case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = kSms; break;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: *pi = 2048; break;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *pi = 65536; break;
        case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
        case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *pi = 2619000; break;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 6144; break;
        case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: *pi = 50 * 1024 * 1024; break;
        case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: *pi = 1; break;
        case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: *pi = 1; break;
        case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: *pi = 1; break;
        case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: *pi = 2; break;
        default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice) {
    *c = (CUcontext)&g_ctx_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = (CUcontext)&g_ctx_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxPushCurrent(CUcontext) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxPopCurrent(CUcontext* c) {
    if (c) *c = (CUcontext)&g_ctx_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxGetDevice(CUdevice* d) {
    *d = 0;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxSynchronize() {
    counters::add(&C::context_syncs);
    return streams::synchronize_all();
}
EMU_API CUresult cuCtxDestroy(CUcontext) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = -5;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxSetLimit(CUlimit, size_t) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxGetLimit(size_t* v, CUlimit) {
    *v = 0;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxSetCacheConfig(CUfunc_cache) { return CUDA_SUCCESS; }
EMU_API CUresult cuCtxGetCacheConfig(CUfunc_cache* c) {
    *c = CU_FUNC_CACHE_PREFER_NONE;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuCtxSetFlags(unsigned int) { return CUDA_SUCCESS; }
EMU_API CUresult cuGetErrorName(CUresult e, const char** s) {
    static thread_local char buf[48];
    std::snprintf(buf, sizeof buf, "CUDA_ERROR_%d (emulator)", (int)e);
    *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS" : buf;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuGetErrorString(CUresult e, const char** s) { return cuGetErrorName(e, s); }
EMU_API CUresult cuProfilerStart() { return CUDA_SUCCESS; }
EMU_API CUresult cuProfilerStop() { return CUDA_SUCCESS; }

// ---- memory ----------------------------------------------------------------------------------------------
EMU_API CUresult cuMemAlloc(CUdeviceptr* p, size_t n) { return alloc_device(p, n); }
EMU_API CUresult cuMemFree(CUdeviceptr p) {
    // cuMemFree waits for the device in practice; the lazy schedule's queued work runs first.
    streams::synchronize_all();
    const CUresult r = release(g_device, (void*)p, "cuMemFree");
    if (r == CUDA_SUCCESS) counters::add(&C::free_syncs);
    return r;
}
// Memory comes into being at the call (its contents are NaN bytes until something writes them; zeros in the
// null mode).
EMU_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) { return alloc_device(p, n); }
EMU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, size_t n, CUmemoryPool, CUstream) { return alloc_device(p, n); }
EMU_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    if (CUresult r = check_device((uintptr_t)p, 1, "cuMemFreeAsync")) return r;
    std::vector<emu::order::Touch> touches;  // a free is a write of it all: after every use
    touch_of(touches, (const void*)p, 0, true);
    return streams::submit(s, {"cuMemFreeAsync", touches, [p] { return release(g_device, (void*)p, "cuMemFreeAsync"); }});
}
EMU_API CUresult cuMemGetInfo(size_t* free_b, size_t* total) {
    std::lock_guard<std::mutex> l(g_mu);
    *total = total_bytes();
    *free_b = total_bytes() - g_device_bytes;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemHostAlloc(void** pp, size_t n, unsigned int) {
    // Page-aligned; not filled (zeros in the null mode, as device memory is there).
    void* m = obtain((n + kPage - 1) & ~(kPage - 1), kPage, -1);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> l(g_mu);
    g_host[(uintptr_t)m] = n;
    counters::add2(&C::host_allocs, &C::host_alloc_bytes, n);
    emu::order::forget((uintptr_t)m, (uintptr_t)m + n);
    *pp = m;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemAllocHost(void** pp, size_t n) { return cuMemHostAlloc(pp, n, 0); }
EMU_API CUresult cuMemFreeHost(void* p) {
    // The host frees it, so every stream's use of it must be done, by a synchronization the host waited on.
    std::vector<emu::order::Touch> touches;
    touch_of(touches, p, 0, true);
    if (!touches.empty() && (void*)touches[0].base == p)
        if (CUresult r = streams::host_touch("cuMemFreeHost", touches)) return r;
    const CUresult r = release(g_host, p, "cuMemFreeHost");
    if (r == CUDA_SUCCESS) counters::add(&C::free_syncs);  // cudaFreeHost waits for the device on a GPU
    return r;
}
EMU_API CUresult cuMemHostRegister(void* p, size_t n, unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    g_registered[(uintptr_t)p] = n;
    counters::add2(&C::host_registers, &C::host_register_bytes, n);
    emu::order::forget((uintptr_t)p, (uintptr_t)p + n);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemHostUnregister(void* p) {
    std::lock_guard<std::mutex> l(g_mu);
    g_registered.erase((uintptr_t)p);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned int) {
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n) { return copy_sync((void*)d, s, n, true, false, "cuMemcpyHtoD"); }
EMU_API CUresult cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n) { return copy_sync(d, (void*)s, n, false, true, "cuMemcpyDtoH"); }
EMU_API CUresult cuMemcpyDtoD(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy_sync((void*)d, (void*)s, n, true, true, "cuMemcpyDtoD"); }
EMU_API CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void* s, size_t n, CUstream st) {
    return copy_async((void*)d, s, n, true, false, st, "cuMemcpyHtoDAsync");
}
EMU_API CUresult cuMemcpyDtoHAsync(void* d, CUdeviceptr s, size_t n, CUstream st) {
    return copy_async(d, (void*)s, n, false, true, st, "cuMemcpyDtoHAsync");
}
EMU_API CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    return copy_async((void*)d, (void*)s, n, true, true, st, "cuMemcpyDtoDAsync");
}
// Unified addressing: either side may be host or device memory.
EMU_API CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    return copy_async((void*)d, (const void*)s, n, kind((void*)d, n) == Mem::Device, kind((void*)s, n) == Mem::Device,
                      st, "cuMemcpyAsync");
}
EMU_API CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) {
    return copy_sync((void*)d, (const void*)s, n, kind((void*)d, n) == Mem::Device, kind((void*)s, n) == Mem::Device,
                     "cuMemcpy");
}
EMU_API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    return memset_async(d, v, n, s, "cuMemsetD8Async");
}
EMU_API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream s) {
    return memset_async(d, v, n, s, "cuMemsetD32Async");
}
EMU_API CUresult cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) { return memset_sync(d, v, n, "cuMemsetD8"); }
EMU_API CUresult cuMemsetD32(CUdeviceptr d, unsigned int v, size_t n) { return memset_sync(d, v, n, "cuMemsetD32"); }
EMU_API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* p, CUdevice) {
    *p = (CUmemoryPool)&g_pool_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuDeviceGetMemPool(CUmemoryPool* p, CUdevice d) { return cuDeviceGetDefaultMemPool(p, d); }
EMU_API CUresult cuMemPoolSetAttribute(CUmemoryPool, CUmemPool_attribute, void*) { return CUDA_SUCCESS; }
EMU_API CUresult cuMemPoolGetAttribute(CUmemoryPool, CUmemPool_attribute, void* v) {
    *(uint64_t*)v = 0;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemPoolTrimTo(CUmemoryPool, size_t) { return CUDA_SUCCESS; }

// ---- streams and events ----------------------------------------------------------------------------------
EMU_API CUresult cuStreamCreate(CUstream* s, unsigned int flags) { return streams::create(s, flags); }
EMU_API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned int f, int) { return cuStreamCreate(s, f); }
EMU_API CUresult cuStreamDestroy(CUstream s) { return streams::destroy(s); }
EMU_API CUresult cuStreamSynchronize(CUstream s) {
    counters::add(&C::stream_syncs);
    return streams::synchronize(s);
}
EMU_API CUresult cuStreamQuery(CUstream s) {
    counters::add(&C::queries);
    return streams::query(s);
}
EMU_API CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
    counters::add(&C::stream_waits);
    return streams::wait_event(s, e);
}
EMU_API CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* s) {
    *s = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
    return streams::submit(s, {"cuLaunchHostFunc", {}, [fn, data] {
                                   fn(data);
                                   return CUDA_SUCCESS;
                               }});
}
EMU_API CUresult cuEventCreate(CUevent* e, unsigned int) { return streams::event_create(e); }
EMU_API CUresult cuEventDestroy(CUevent e) { return streams::event_destroy(e); }
EMU_API CUresult cuEventRecord(CUevent e, CUstream s) {
    counters::add(&C::event_records);
    return streams::event_record(e, s);
}
EMU_API CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int) { return cuEventRecord(e, s); }
EMU_API CUresult cuEventSynchronize(CUevent e) {
    counters::add(&C::event_syncs);
    return streams::event_synchronize(e);
}
EMU_API CUresult cuEventQuery(CUevent e) {
    counters::add(&C::queries);
    return streams::event_query(e);
}
EMU_API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) { return streams::event_elapsed(ms, a, b); }
#undef cuEventElapsedTime
EMU_API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime_v2(ms, a, b); }

// ---- modules and launches --------------------------------------------------------------------------------
EMU_API CUresult cuModuleLoadData(CUmodule* m, const void*) {
    *m = (CUmodule)&g_module_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuModuleLoadDataEx(CUmodule* m, const void* img, unsigned int, CUjit_option*, void**) {
    return cuModuleLoadData(m, img);
}
EMU_API CUresult cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
EMU_API CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    const emu::Kernel* k = emu::find_kernel(name);
    if (!k) return report(CUDA_ERROR_NOT_FOUND, std::string("no emulated kernel named ") + name);
    *f = (CUfunction)k;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
    if (a == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        const auto* k = (const emu::Kernel*)f;
        const int static_smem = usage(*k).static_smem, room = kOptinSmem - static_smem;
        if (v < 0 || v > room) {
            char buf[200];
            std::snprintf(buf, sizeof buf, "%s: dynamic shared memory opt-in of %d bytes; at most %d beside its %d static",
                          k->name.c_str(), v, room, static_smem);
            return report(CUDA_ERROR_INVALID_VALUE, buf);
        }
        std::lock_guard<std::mutex> l(g_mu);
        g_optin[k] = v;
    }
    return CUDA_SUCCESS;
}
EMU_API CUresult cuFuncGetAttribute(int* pi, CUfunction_attribute a, CUfunction f) {
    const auto* k = (const emu::Kernel*)f;
    const emu::resources::Usage u = usage(*k);
    switch (a) {
        case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = (int)std::min(k->max_threads, 1024u); break;
        case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = u.registers; break;
        case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = u.static_smem; break;
        case CU_FUNC_ATTRIBUTE_PTX_VERSION:
        case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = dynamic_limit(*k, u.static_smem); break;
        default: *pi = 0; break;
    }
    return CUDA_SUCCESS;
}
EMU_API CUresult cuFuncSetCacheConfig(CUfunction, CUfunc_cache) { return CUDA_SUCCESS; }
EMU_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction, int block, size_t) {
    *n = block > 0 ? std::max(1, 2048 / block) : 1;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, CUfunction f, int block, size_t s, unsigned int) {
    return cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block, s);
}
EMU_API CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* s, CUfunction, int, int) {
    *s = kOptinSmem;
    return CUDA_SUCCESS;
}

EMU_API CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
                                unsigned int by, unsigned int bz, unsigned int smem, CUstream s, void** params,
                                void** extra) {
    const auto* k = (const emu::Kernel*)f;
    if (extra) return report(CUDA_ERROR_NOT_SUPPORTED, "cuLaunchKernel with `extra` is not emulated");
    char buf[256];
    if (gx == 0 || gy == 0 || gz == 0 || gx > 2147483647u || gy > 65535 || gz > 65535) {
        std::snprintf(buf, sizeof buf, "%s: invalid grid %u×%u×%u", k->name.c_str(), gx, gy, gz);
        return report(CUDA_ERROR_INVALID_VALUE, buf);
    }
    if (bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 || (size_t)bx * by * bz > 1024) {
        std::snprintf(buf, sizeof buf, "%s: invalid block %u×%u×%u", k->name.c_str(), bx, by, bz);
        return report(CUDA_ERROR_INVALID_VALUE, buf);
    }
    if (emu::resources::loaded() && !emu::resources::find(k->name)) {
        std::snprintf(buf, sizeof buf, "%s is not in %s: a stale report? (rebuild with the kernels)",
                      k->name.c_str(), emu::resources::source().c_str());
        return report(CUDA_ERROR_INVALID_VALUE, buf);
    }
    const emu::resources::Usage u = usage(*k);
    if (const int limit = dynamic_limit(*k, u.static_smem); (int)smem > limit) {
        std::snprintf(buf, sizeof buf,
                      "%s: %u bytes of dynamic shared memory beside %d static, limit %d (opt in above 48 KiB in all)",
                      k->name.c_str(), smem, u.static_smem, limit);
        return report(CUDA_ERROR_INVALID_VALUE, buf);
    }
    // Registers are given to whole warps, in units of 256 per warp.
    const unsigned warps = (bx * by * bz + 31) / 32, per_warp = (u.registers * 32 + 255) / 256 * 256;
    if (warps * per_warp > 65536) {
        std::snprintf(buf, sizeof buf, "%s: %u threads × %d registers need %u of the block's 65536",
                      k->name.c_str(), bx * by * bz, u.registers, warps * per_warp);
        return report(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, buf);
    }
    auto args = std::make_shared<Args>(*k, params);
    counters::launch(k->name);
    if (launch_faults(k->name)) {
        // An injected fault (EMU_FAIL_KERNEL): the kernel does not run; its stream's error is sticky.
        return streams::submit(s, {"kernel " + k->name, args->touches, [k] {
                                       streams::fault(CUDA_ERROR_ILLEGAL_ADDRESS);
                                       return report(CUDA_ERROR_ILLEGAL_ADDRESS,
                                                     "injected fault: kernel " + k->name +
                                                         " made an illegal address access (EMU_FAIL_KERNEL)");
                                   }});
    }
    // The null mode: checked, counted and ordered (its touches) like any launch, and nothing runs; the one
    // check that the runtime makes when a launch runs (its __launch_bounds__) is made here instead, at the
    // same point in the stream, with the same error.
    if (skipped()) {
        const unsigned threads = bx * by * bz;
        return streams::submit(s, {"kernel " + k->name, args->touches, [k, threads] {
                                       if (threads <= k->max_threads) return CUDA_SUCCESS;
                                       return report(CUDA_ERROR_LAUNCH_FAILED,
                                                     "block of " + std::to_string(threads) + " threads, but kernel " +
                                                         k->name + " has __launch_bounds__(" +
                                                         std::to_string(k->max_threads) + ")");
                                   }});
    }
    const uint3 grid{gx, gy, gz}, block{bx, by, bz};
    return streams::submit(s, {"kernel " + k->name, args->touches, [k, args, grid, block, smem] {
                                   const std::string err = emu::launch(*k, grid, block, smem, args->ptrs.data());
                                   return err.empty() ? CUDA_SUCCESS : report(CUDA_ERROR_LAUNCH_FAILED, err);
                               }});
}

// ---- the emulated libraries' stream operations (streams.h) ------------------------------------------------
EMU_API int emu_stream_defer(void* stream, const char* what, const EmuTouch* touches, size_t ntouches,
                             int (*run)(void*), void (*drop)(void*), void* arg) {
    std::shared_ptr<void> box(arg, drop);
    std::vector<emu::order::Touch> t;
    for (size_t i = 0; i < ntouches; ++i) touch_of(t, touches[i].p, touches[i].bytes, touches[i].write != 0);
    counters::library_call(what);
    // The null mode: the library has checked the arguments; the call is ordered on its stream and does nothing
    // (outputs untouched: a cuSOLVER info stays what the memory held, zero in fresh memory).
    if (skipped()) {
        const CUresult r = streams::submit(static_cast<CUstream>(stream), {what, std::move(t), [] { return CUDA_SUCCESS; }});
        return r == CUDA_ERROR_ILLEGAL_ADDRESS ? -1 : 0;
    }
    auto status = std::make_shared<int>(0);  // eager: the library's own status goes back to its caller
    const CUresult r = streams::submit(static_cast<CUstream>(stream), {what, std::move(t), [run, box, status] {
                                           *status = run(box.get());
                                           return *status == 0 ? CUDA_SUCCESS : CUDA_ERROR_LAUNCH_FAILED;
                                       }});
    if (r == CUDA_ERROR_ILLEGAL_ADDRESS) return -1;
    return streams::lazy() ? 0 : *status;
}
