// test_launch.cpp — the fake driver's launch limits with a ptxas report (resources.h), through the driver API:
// static shared memory counts against the 48 KiB default and the 227 KiB opt-in, registers against the 64 K
// of a block, and a kernel the report does not list is refused (a stale report). Writes its own report, so it
// runs without nvcc; built by build.sh, run by check.sh.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

#include "runtime.h"
#include "test_check.h"

extern "C" __global__ void __launch_bounds__(1024) smem_kernel(int* x) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *x = 1;
}
EMU_REGISTER(smem_kernel, 1024)
extern "C" __global__ void __launch_bounds__(1024) regs_kernel(int* x) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *x = 2;
}
EMU_REGISTER(regs_kernel, 1024)
extern "C" __global__ void __launch_bounds__(32) unlisted_kernel(int* x) {
    if (threadIdx.x == 0) *x = 3;
}
EMU_REGISTER(unlisted_kernel, 32)

// ptxas's wording, an sm_80 entry first (ignored: the H200 runs the sm_90a code).
constexpr const char* kReport = R"(# ptxas resource report
ptxas info    : Compiling entry function 'smem_kernel' for 'sm_80'
ptxas info    : Function properties for smem_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers, 100 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'smem_kernel' for 'sm_90a'
ptxas info    : Function properties for smem_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 1 barriers, 40000 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'regs_kernel' for 'sm_90a'
ptxas info    : Function properties for regs_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 0 barriers, 360 bytes cmem[0]
)";

static CUresult launch(CUfunction f, unsigned threads, unsigned smem, CUdeviceptr* x) {
    void* args[] = {x};
    return cuLaunchKernel(f, 1, 1, 1, threads, 1, 1, smem, nullptr, args, nullptr);
}

int main() {
    const std::string path = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") +
                             "/emu_test_launch_" + std::to_string(getpid()) + ".txt";
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) return 2;
    std::fputs(kReport, f);
    std::fclose(f);
    setenv("EMU_PTXAS_REPORT", path.c_str(), 1);  // before the first driver call that reads it

    CHECK(cuInit(0) == CUDA_SUCCESS, "cuInit");
    char name[128];
    CHECK(cuDeviceGetName(name, sizeof name, 0) == CUDA_SUCCESS && std::string(name).find("ptxas limits") != std::string::npos,
          "the device name does not say the report was read: %s", name);
    CUdeviceptr x = 0;
    CHECK(cuMemAlloc(&x, sizeof(int)) == CUDA_SUCCESS, "cuMemAlloc");
    CUfunction smem = nullptr, regs = nullptr, unlisted = nullptr;
    CHECK(cuModuleGetFunction(&smem, nullptr, "smem_kernel") == CUDA_SUCCESS, "smem_kernel");
    CHECK(cuModuleGetFunction(&regs, nullptr, "regs_kernel") == CUDA_SUCCESS, "regs_kernel");
    CHECK(cuModuleGetFunction(&unlisted, nullptr, "unlisted_kernel") == CUDA_SUCCESS, "unlisted_kernel");

    int v = 0;
    CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, smem) == CUDA_SUCCESS && v == 40000,
          "static shared memory %d, not the report's 40000 for sm_90a", v);
    CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, regs) == CUDA_SUCCESS && v == 128, "registers %d, not 128", v);
    CHECK(cuFuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) == CUDA_SUCCESS && v == 49152 - 40000,
          "dynamic limit %d, not 48 KiB less the static 40000", v);

    // 40000 static + 9152 dynamic is exactly 48 KiB; one byte more needs an opt-in.
    CHECK(launch(smem, 64, 9152, &x) == CUDA_SUCCESS, "48 KiB in all was refused");
    CHECK(launch(smem, 64, 9153, &x) == CUDA_ERROR_INVALID_VALUE, "48 KiB + 1 in all was launched without an opt-in");
    // The opt-in may give at most 227 KiB less the static part.
    CHECK(cuFuncSetAttribute(smem, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 227 * 1024 - 40000 + 1) ==
              CUDA_ERROR_INVALID_VALUE,
          "an opt-in past 227 KiB in all was taken");
    CHECK(cuFuncSetAttribute(smem, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 100000) == CUDA_SUCCESS, "opt-in 100000");
    CHECK(launch(smem, 64, 100000, &x) == CUDA_SUCCESS, "a launch within its opt-in was refused");
    CHECK(launch(smem, 64, 100001, &x) == CUDA_ERROR_INVALID_VALUE, "a launch past its opt-in was taken");

    // 128 registers × 512 threads fill the block's 64 K; 1024 threads need twice that.
    CHECK(launch(regs, 512, 0, &x) == CUDA_SUCCESS, "512 threads × 128 registers were refused");
    CHECK(launch(regs, 1024, 0, &x) == CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "1024 threads × 128 registers were launched");

    // A kernel the report does not know: the report is stale.
    CHECK(launch(unlisted, 32, 0, &x) == CUDA_ERROR_INVALID_VALUE, "a kernel missing from the report was launched");

    int h = 0;
    CHECK(cuMemcpyDtoH(&h, x, sizeof h) == CUDA_SUCCESS && h == 2, "the last allowed launch wrote %d, not 2", h);
    std::remove(path.c_str());
    if (g_failures) {
        std::fprintf(stderr, "test_launch: %d checks failed\n", g_failures);
        return 1;
    }
    std::printf("test_launch: static shared memory, opt-ins and registers from a ptxas report limit launches as expected\n");
    return 0;
}
