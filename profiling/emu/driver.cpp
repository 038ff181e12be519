// driver.cpp — a fake libcuda.so: the CUDA driver API that cudarc calls, on host memory, synchronously.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md). cudarc loads libcuda by name at run
// time, so with this library first on LD_LIBRARY_PATH the project's CUDA backend, its launch code and its
// GPU tests run unchanged on a machine without a GPU. Choices that matter:
//   - A CUdeviceptr is the address of a host allocation of exactly the bytes asked for. Allocations are
//     filled with 0xff bytes (NaN as f32) because device memory is not zeroed, and every copy and memset is
//     checked against the live allocations, so a copy past the end of a buffer fails with a message instead
//     of corrupting the heap. Built with EMU_ASAN=1, AddressSanitizer checks the kernels' own loads and
//     stores the same way (compute-sanitizer's memcheck, on the CPU).
//   - Every operation completes before the call returns. That is one legal schedule of CUDA's stream
//     semantics, so events and stream waits need no work; it cannot reveal a missing dependency.
//   - The device claims to be an H200-like sm_90 part (132 SMs, 227 KiB opt-in shared memory) with
//     EMU_MEM_GIB (default 16) of memory, and enforces the launch limits the real one would: threads per
//     block, grid dimensions, and dynamic shared memory above 48 KiB only after the kernel opted in.
// Kernels come from the registry filled by the generated kernel files (gen_kernels.py); the module images
// cudarc passes (the embedded fatbins) are not read.

#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "cuda_emu.h"
#include "runtime.h"

#define EMU_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kSms = 132;
constexpr int kDefaultSmem = 48 * 1024;
constexpr int kOptinSmem = 227 * 1024;

std::mutex g_mu;                            // guards the tables below (the prefetch thread calls in too)
std::map<uintptr_t, size_t> g_device;      // live device allocations: base → bytes
std::map<uintptr_t, size_t> g_host;        // live page-locked host allocations
std::map<const emu::Kernel*, int> g_optin; // MAX_DYNAMIC_SHARED_SIZE_BYTES per kernel
size_t g_device_bytes = 0;

size_t total_bytes() {
    static const size_t t = [] {
        const char* s = std::getenv("EMU_MEM_GIB");
        return (size_t)((s ? std::atof(s) : 16.0) * (double)(size_t(1) << 30));
    }();
    return t;
}

struct Event {
    std::chrono::steady_clock::time_point at{};
};
int g_stream_tag, g_pool_tag, g_module_tag, g_ctx_tag;

CUresult report(CUresult r, const std::string& what) {
    std::fprintf(stderr, "emu: %s\n", what.c_str());
    return r;
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
        if (g_device_bytes + n > total_bytes()) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // Exactly n bytes (256-aligned as cudaMalloc's): under EMU_ASAN a kernel's access past the end is caught.
    void* m = nullptr;
    if (posix_memalign(&m, 256, n) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    std::memset(m, 0xff, n);
    std::lock_guard<std::mutex> l(g_mu);
    g_device[(uintptr_t)m] = n;
    g_device_bytes += n;
    *p = (CUdeviceptr)m;
    return CUDA_SUCCESS;
}

CUresult free_device(CUdeviceptr p) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_device.find((uintptr_t)p);
    if (it == g_device.end()) return report(CUDA_ERROR_INVALID_VALUE, "free of a pointer that is not a live allocation");
    g_device_bytes -= it->second;
    g_device.erase(it);
    std::free((void*)p);
    return CUDA_SUCCESS;
}

CUresult copy(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev, const char* what) {
    if (dst_dev)
        if (CUresult r = check_device((uintptr_t)dst, n, what)) return r;
    if (src_dev)
        if (CUresult r = check_device((uintptr_t)src, n, what)) return r;
    if (n) std::memmove(dst, src, n);
    return CUDA_SUCCESS;
}

}  // namespace

// ---- initialisation, device, context ---------------------------------------------------------------------
EMU_API CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
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
    std::snprintf(name, (size_t)len, "CPU emulator (profiling/emu)");
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
EMU_API CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
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
EMU_API CUresult cuMemFree(CUdeviceptr p) { return free_device(p); }
EMU_API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) { return alloc_device(p, n); }
EMU_API CUresult cuMemAllocFromPoolAsync(CUdeviceptr* p, size_t n, CUmemoryPool, CUstream) { return alloc_device(p, n); }
EMU_API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return free_device(p); }
EMU_API CUresult cuMemGetInfo(size_t* free_b, size_t* total) {
    std::lock_guard<std::mutex> l(g_mu);
    *total = total_bytes();
    *free_b = total_bytes() - g_device_bytes;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemHostAlloc(void** pp, size_t n, unsigned int) {
    void* m = std::aligned_alloc(4096, (n + 4095) & ~size_t(4095));
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> l(g_mu);
    g_host[(uintptr_t)m] = n;
    *pp = m;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemAllocHost(void** pp, size_t n) { return cuMemHostAlloc(pp, n, 0); }
EMU_API CUresult cuMemFreeHost(void* p) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_host.erase((uintptr_t)p)) return report(CUDA_ERROR_INVALID_VALUE, "cuMemFreeHost of an unknown pointer");
    std::free(p);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemHostRegister(void*, size_t, unsigned int) { return CUDA_SUCCESS; }
EMU_API CUresult cuMemHostUnregister(void*) { return CUDA_SUCCESS; }
EMU_API CUresult cuMemHostGetDevicePointer(CUdeviceptr* d, void* p, unsigned int) {
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemcpyHtoD(CUdeviceptr d, const void* s, size_t n) { return copy((void*)d, s, n, true, false, "cuMemcpyHtoD"); }
EMU_API CUresult cuMemcpyDtoH(void* d, CUdeviceptr s, size_t n) { return copy(d, (void*)s, n, false, true, "cuMemcpyDtoH"); }
EMU_API CUresult cuMemcpyDtoD(CUdeviceptr d, CUdeviceptr s, size_t n) { return copy((void*)d, (void*)s, n, true, true, "cuMemcpyDtoD"); }
EMU_API CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void* s, size_t n, CUstream) {
    return copy((void*)d, s, n, true, false, "cuMemcpyHtoDAsync");
}
EMU_API CUresult cuMemcpyDtoHAsync(void* d, CUdeviceptr s, size_t n, CUstream) {
    return copy(d, (void*)s, n, false, true, "cuMemcpyDtoHAsync");
}
EMU_API CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) {
    return copy((void*)d, (void*)s, n, true, true, "cuMemcpyDtoDAsync");
}
EMU_API CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) {
    std::memmove((void*)d, (const void*)s, n);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { return cuMemcpyAsync(d, s, n, nullptr); }
EMU_API CUresult cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) {
    if (CUresult r = check_device((uintptr_t)d, n, "cuMemsetD8")) return r;
    std::memset((void*)d, v, n);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream) { return cuMemsetD8(d, v, n); }
EMU_API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream) {
    if (CUresult r = check_device((uintptr_t)d, n * 4, "cuMemsetD32Async")) return r;
    for (size_t i = 0; i < n; ++i) ((unsigned*)d)[i] = v;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuMemsetD32(CUdeviceptr d, unsigned int v, size_t n) { return cuMemsetD32Async(d, v, n, nullptr); }
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
EMU_API CUresult cuStreamCreate(CUstream* s, unsigned int) {
    *s = (CUstream)&g_stream_tag;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuStreamCreateWithPriority(CUstream* s, unsigned int f, int) { return cuStreamCreate(s, f); }
EMU_API CUresult cuStreamDestroy(CUstream) { return CUDA_SUCCESS; }
EMU_API CUresult cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
EMU_API CUresult cuStreamQuery(CUstream) { return CUDA_SUCCESS; }
EMU_API CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int) { return CUDA_SUCCESS; }
EMU_API CUresult cuStreamIsCapturing(CUstream, CUstreamCaptureStatus* s) {
    *s = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuLaunchHostFunc(CUstream, CUhostFn fn, void* data) {
    fn(data);
    return CUDA_SUCCESS;
}
EMU_API CUresult cuEventCreate(CUevent* e, unsigned int) {
    *e = (CUevent) new Event;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuEventDestroy(CUevent e) {
    delete (Event*)e;
    return CUDA_SUCCESS;
}
EMU_API CUresult cuEventRecord(CUevent e, CUstream) {
    ((Event*)e)->at = std::chrono::steady_clock::now();
    return CUDA_SUCCESS;
}
EMU_API CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned int) { return cuEventRecord(e, s); }
EMU_API CUresult cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
EMU_API CUresult cuEventQuery(CUevent) { return CUDA_SUCCESS; }
EMU_API CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    *ms = std::chrono::duration<float, std::milli>(((Event*)b)->at - ((Event*)a)->at).count();
    return CUDA_SUCCESS;
}
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
        if (v < 0 || v > kOptinSmem) return report(CUDA_ERROR_INVALID_VALUE, "dynamic shared memory opt-in above 227 KiB");
        std::lock_guard<std::mutex> l(g_mu);
        g_optin[(const emu::Kernel*)f] = v;
    }
    return CUDA_SUCCESS;
}
EMU_API CUresult cuFuncGetAttribute(int* pi, CUfunction_attribute a, CUfunction) {
    switch (a) {
        case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
        case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
        case CU_FUNC_ATTRIBUTE_PTX_VERSION:
        case CU_FUNC_ATTRIBUTE_BINARY_VERSION: *pi = 90; break;
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: *pi = kDefaultSmem; break;
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
                                unsigned int by, unsigned int bz, unsigned int smem, CUstream, void** params,
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
    int limit = kDefaultSmem;
    {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_optin.find(k);
        if (it != g_optin.end()) limit = std::max(limit, it->second);
    }
    if ((int)smem > limit) {
        std::snprintf(buf, sizeof buf, "%s: %u bytes of dynamic shared memory, limit %d (opt in above 48 KiB)",
                      k->name.c_str(), smem, limit);
        return report(CUDA_ERROR_INVALID_VALUE, buf);
    }
    const std::string err = emu::launch(*k, uint3{gx, gy, gz}, uint3{bx, by, bz}, smem, params);
    if (!err.empty()) return report(CUDA_ERROR_LAUNCH_FAILED, err);
    return CUDA_SUCCESS;
}
