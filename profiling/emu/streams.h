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
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace emu::streams {

struct Op {
    std::string what;             // for messages: "kernel xxt_bf16", "cuMemcpyHtoDAsync", "cublasGemmEx"
    std::vector<uintptr_t> refs;  // addresses it reads or writes (device or page-locked host memory)
    std::function<CUresult()> run;
};

bool lazy();

// Runs `op` now (eager), or queues it on `s` (lazy: CUDA_SUCCESS, and a failure when it runs is kept and
// returned by every later synchronizing call, as CUDA's sticky errors are).
CUresult submit(CUstream s, Op op);
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
// it ran. A nonzero status from a queued run becomes the sticky error CUDA_ERROR_LAUNCH_FAILED.
extern "C" int emu_stream_defer(void* stream, const char* what, const uintptr_t* refs, size_t nrefs,
                                int (*run)(void*), void (*drop)(void*), void* arg);
