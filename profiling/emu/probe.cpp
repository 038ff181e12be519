// probe.cpp — a kernel of the emulator's own, compiled into libcuda.so beside the project's, so a test that
// loads the built library by name as cudarc does (test_null.cpp) has a launch whose effect it knows without
// depending on the project's kernels. No project code names it; a ptxas report does not list it, so it can be
// launched only without one (EMU_PTXAS_REPORT empty or unset).
#include "runtime.h"

// out[i] = v for i < n.
extern "C" __global__ void __launch_bounds__(256) emu_probe_fill_kernel(float* out, float v, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = v;
}
EMU_REGISTER(emu_probe_fill_kernel, 256)
