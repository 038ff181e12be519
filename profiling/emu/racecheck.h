// racecheck.h — compute-sanitizer's racecheck on the CPU: conflicting shared-memory accesses by two threads
// of a block with no barrier between them (profiling/emu/README.md). Built with EMU_RACECHECK=1 only.
//
// The fibers of the emulator run one at a time, so a race never tears a value here, and a read-modify-write
// by many threads without a barrier or an atomic (sh[i] += v) even gives the right sum; the two thread
// orders of check.sh cannot see it. With EMU_RACECHECK=1, build.sh compiles the kernels with
// -fsanitize=thread but links no ThreadSanitizer runtime: racecheck.cpp defines the __tsan_* hooks the
// compiler calls on every load and store, and checks each access to shared memory (static and dynamic)
// against the last write and the reads since it:
//   - two accesses by different threads conflict when one is a write and no barrier separates them: no
//     __syncthreads* completed between them, and, for two lanes of one warp, no warp-level
//     synchronization (__syncwarp, a shuffle, a vote) either;
//   - the first conflict fails the launch with both threads, the byte's offset, and the code addresses of
//     the two accesses (`addr2line -e libcuda.so`).
// Not checked: global memory, and accesses inside the emulated atomics (they are atomic). A wmma load or
// store is one access of the whole warp (every lane of the emulator writes the whole tile).
#pragma once

#include <cstddef>

namespace emu::race {

// The launch's dynamic shared memory (checked with the static shared memory of every kernel).
void launch_begin(void* dyn_smem, size_t bytes, unsigned nwarps);
void launch_end();
// Epochs: a new block, a completed block barrier, and a completed barrier of warp `w` order the accesses
// on either side of them.
void block_begin();
void block_barrier();
void warp_barrier(unsigned w);

// While one is alive on a fiber, its accesses are not checked (atomics) ...
struct Quiet {
    Quiet();
    ~Quiet();
};
// ... or count as the whole warp's (wmma loads and stores).
struct WarpWide {
    WarpWide();
    ~WarpWide();
};

}  // namespace emu::race
