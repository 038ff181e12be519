// streamorder.h — the stream-order check of the emulator's fake driver (profiling/emu/README.md): two
// operations that touch the same bytes of device or page-locked memory, at least one of them writing, must be
// ordered by CUDA's rules (one stream's issue order, an event recorded after the one and waited for before
// the other, or a host synchronization between them). Otherwise a GPU may run them at the same time or in
// either order: a copy-stream upload overwriting a buffer a kernel still reads, a free of memory another
// stream still uses, a consumer that reads before its producer wrote.
//
// The lazy schedule of streams.h catches some of these by running work late, but only when the late order
// changes a result the tests compare, and only in the order it picks. This check needs no particular order:
// it keeps a vector clock per stream and for the host (FastTrack's happens-before, at the grain of whole
// operations) and compares every operation, when it is issued, with the last write and the reads since of
// each byte range it touches. Issue order is itself an order CUDA allows, so whatever the schedule runs, a
// pair that nothing orders is reported in every run, eager or lazy.
//
// What an operation touches: a copy its source and destination, a memset its range, a free the whole
// allocation (a write: it must come after every use), a cuBLAS or cuSOLVER call its matrices (host_blas.h),
// and a kernel launch, from its signature, every pointer argument from that pointer to the end of its
// allocation, read when it points to const, else written. Host code's own loads and stores of page-locked
// memory are not seen (the lazy schedule catches a host read before its copy finished).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace emu::order {

// Bytes [lo, hi) that an operation reads or writes, inside the allocation at `base`.
struct Touch {
    uintptr_t lo = 0, hi = 0;
    bool write = false;
    uintptr_t base = 0;
};

// What each actor (0: the host, 1: the legacy stream, 2…: created streams) has seen of every other: entry
// a is the count of actor a's operations ordered before this point.
struct Clock {
    std::vector<uint64_t> at;
    uint64_t operator[](unsigned a) const { return a < at.size() ? at[a] : 0; }
    void tick(unsigned a);  // one more operation of actor a
    void join(const Clock& o);
};

// Checks the touches of one operation of `actor`, whose clock (after its own tick) is `now`, against every
// earlier operation's, and records them. Returns what conflicts, for a message, or an empty string.
// `who` names the operation ("`kernel foo` on stream 2").
std::string touch(unsigned actor, const Clock& now, const std::shared_ptr<const std::string>& who,
                  const std::vector<Touch>& touches);

// New memory at [lo, hi): what earlier allocations there did is forgotten.
void forget(uintptr_t lo, uintptr_t hi);

}  // namespace emu::order
