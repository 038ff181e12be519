// racecheck.h — compute-sanitizer's racecheck on the CPU, and more: conflicting accesses by two threads of
// one launch with nothing ordering them, in shared memory and in device memory (profiling/emu/README.md).
// Built with EMU_RACECHECK=1 only.
//
// The fibers of the emulator run one at a time, so a race never tears a value here, and a read-modify-write
// by many threads without a barrier or an atomic (sh[i] += v) even gives the right sum; the two thread
// orders of check.sh cannot see it. With EMU_RACECHECK=1, build.sh compiles the kernels with
// -fsanitize=thread but links no ThreadSanitizer runtime: racecheck.cpp defines the __tsan_* hooks the
// compiler calls on every load and store, and checks them:
//   - shared memory (static and dynamic): each access against the last write and the reads since it. Two
//     accesses by different threads conflict when one is a write and no barrier separates them: no
//     __syncthreads* completed between them, and, for two lanes of one warp, no warp-level
//     synchronization (__syncwarp, a shuffle, a vote) either;
//   - device memory (the driver's live allocations, track/untrack): each access against the last write of
//     this launch (read-after-write and write-after-write). Reads are not kept there (inputs are large), so
//     a read followed by another thread's write goes unseen in that order; run in the other order of
//     threads and blocks (EMU_SCHEDULE=reverse, as check.sh does), the same pair is a read after a write.
//     Within a block the rules are shared memory's. Between blocks, which have no barrier,
//     the write must have been published and the access must come after an acquire, the pattern of a
//     split-K "last block sums": the writer, or a thread of its block at a later barrier epoch, ran
//     __threadfence() after the write; the accessing thread, or a thread of its block at an earlier epoch,
//     ran an atomic on device memory before the access. Without that, two blocks writing one address lose
//     an update on a GPU, and a block reading another's output may see it half written;
//   - the first conflict fails the launch with both threads, the byte, and the code addresses of the two
//     accesses (`addr2line -e libcuda.so`).
// Not checked: accesses inside the emulated atomics (they are atomic), and anything across launches. A wmma
// load or store is one access of the whole warp (every lane of the emulator moves the whole tile).
#pragma once

#include <cstddef>

namespace emu::race {

// The launch: its dynamic shared memory (checked with the static shared memory of every kernel), its
// threads per block and its number of blocks.
void launch_begin(void* dyn_smem, size_t bytes, unsigned nthreads, size_t nblocks);
void launch_end();
// Epochs: a new block, a completed block barrier, and a completed barrier of warp `w` order the accesses
// on either side of them.
void block_begin();
void block_barrier();
void warp_barrier(unsigned w);
// Device memory: the driver's allocations (cuMemAlloc*), whose accesses are checked while they live.
void track(const void* p, size_t bytes);
void untrack(const void* p);
// __threadfence(): publishes this thread's device-memory writes, and those of its block before the last
// completed barrier, to the other blocks.
void fence();

// While one is alive on a fiber, its accesses are not checked (atomics: one on device memory is this
// thread's acquire) ...
struct Quiet {
    explicit Quiet(const void* atomic_target = nullptr);
    ~Quiet();
};
// ... or count as the whole warp's (wmma loads and stores).
struct WarpWide {
    WarpWide();
    ~WarpWide();
};

}  // namespace emu::race
