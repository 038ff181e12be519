// resources.h — each kernel's registers and static shared memory, as ptxas compiled it for the H200, so the
// fake driver refuses the launches a real one would (profiling/emu/README.md).
//
// g++ compiles the emulated kernels, so it cannot say how much static `__shared__` memory or how many
// registers nvcc gave each one; both count against the launch limits (static + dynamic shared memory ≤ 48 KiB
// unless the kernel opted in, registers × threads ≤ 64 K). build.rs writes ptxas's report of the real build
// (OUT_DIR/ptxas_report.txt); EMU_PTXAS_REPORT names it (run.sh finds the newest). Without it the emulator
// checks only dynamic shared memory, as before.
#pragma once

#include <string>

namespace emu::resources {

struct Usage {
    int registers;    // per thread
    int static_smem;  // bytes
};

// Whether EMU_PTXAS_REPORT named a report that could be read, with at least one kernel for the target.
bool loaded();
// The report's path and how many kernels it lists, for the device name and messages ("" when not loaded).
std::string source();
// The kernel's usage for sm_90a (sm_90 when the report has no sm_90a entries); nullptr when not listed.
const Usage* find(const std::string& kernel);

}  // namespace emu::resources
