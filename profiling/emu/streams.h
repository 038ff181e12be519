// streams.h — CUDA's stream and event semantics for the emulator's fake driver (profiling/emu/README.md).
//
// Two schedules, chosen by EMU_STREAMS:
//   eager (default)  every operation runs when it is issued. One legal schedule; it hides a missing
//                    dependency, because a producer has always finished before anything else is issued.
//   lazy             operations queue on their stream and run only when something forces them: a
//                    synchronize, an event synchronize, a copy into pageable host memory, or a stream wait
//                    that a forced stream reaches. Also a legal schedule, the latest one: a consumer that does
//                    not wait for its producer (on another stream, or on the host) runs first and reads stale
//                    or NaN-filled memory, and a free that runs while a queued operation still names the
//                    allocation is reported with both operations' names.
// The legacy default stream (CUstream 0) is ordered with streams created without CU_STREAM_NON_BLOCKING, as
// in CUDA; cudarc's own streams are non-blocking, so nothing orders them with stream 0 but events.
// In both schedules every operation is checked when it is issued against the operations it must be ordered
// with (streamorder.h): a pair that touches the same memory with nothing ordering them fails the call.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "streamorder.h"

namespace emu::streams {

struct Op {
    std::string what;                   // for messages: "kernel xxt_bf16", "cuMemcpyHtoDAsync", "cublasGemmEx"
    std::vector<order::Touch> touches;  // the device and page-locked memory it reads or writes
    std::function<CUresult()> run;
};

// An environment switch between two words: false for `no` (the default, also when unset), true for `yes`;
// anything else is reported and taken as `no`. Also the driver's EMU_KERNELS.
bool env_choice(const char* var, const char* no, const char* yes);

bool lazy();
// The stream-order check of streamorder.h: on unless EMU_STREAM_ORDER=off (test_streams turns it off to
// watch the lazy schedule run unordered work late).
bool order_checked();

// Runs `op` now (eager), or queues it on `s` (lazy: CUDA_SUCCESS, and a failure when it runs is kept and
// returned by every later synchronizing call, as CUDA's sticky errors are). An operation that nothing orders
// with an earlier one touching its memory (streamorder.h) is refused: CUDA_ERROR_ILLEGAL_ADDRESS, sticky.
CUresult submit(CUstream s, Op op);
// Makes `r` the sticky error (if none is yet) that every later synchronizing call returns: a kernel fault.
void fault(CUresult r);
// The same check for the host's own use of memory (freeing page-locked memory): it must come after every
// stream operation that touches it, by a synchronization.
CUresult host_touch(const char* what, std::vector<order::Touch> touches);
CUresult create(CUstream* s, unsigned flags);
CUresult destroy(CUstream s);
// Runs everything queued on `s` (cuStreamSynchronize, and the calls CUDA documents as synchronous for
// their stream); returns the sticky error.
CUresult synchronize(CUstream s);
CUresult synchronize_all();
CUresult query(CUstream s);
CUresult wait_event(CUstream s, CUevent e);

CUresult event_create(CUevent* e);
CUresult event_destroy(CUevent e);
CUresult event_record(CUevent e, CUstream s);
CUresult event_synchronize(CUevent e);
CUresult event_query(CUevent e);
CUresult event_elapsed(float* ms, CUevent a, CUevent b);

// The queued operation that names an address in [base, base + bytes), as "`what` on <stream>"; empty when
// none does. A free runs this check: whatever still names the memory would use it after the free.
std::string pending_user(uintptr_t base, size_t bytes);

}  // namespace emu::streams

// For the emulator's libcublas and libcusolver, which find it with dlopen(RTLD_NOLOAD) + dlsym: queues
// run(arg) on `stream` as one operation (eager: runs it and returns its status). drop(arg) frees arg after
// it ran. A nonzero status from a queued run becomes the sticky error CUDA_ERROR_LAUNCH_FAILED. `touches`
// are the memory it reads or writes (bytes 0: from p to the end of its allocation); -1: refused, unordered
// with an earlier operation (streamorder.h). Defined in driver.cpp, which knows the allocations.
struct EmuTouch {
    const void* p;
    size_t bytes;
    int write;
};
extern "C" int emu_stream_defer(void* stream, const char* what, const EmuTouch* touches, size_t ntouches,
                                int (*run)(void*), void (*drop)(void*), void* arg);
