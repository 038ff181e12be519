/* counters.h — the fake driver's counters (profiling/emu/README.md, "Counters"): what a process asked of the
 * emulated CUDA stack, counted by the emulator itself, independently of the host layer's own counters, so the
 * two can be checked against each other (issue 19, point 7).
 *
 * Two ways to read them:
 *   - at any point, from the fake libcuda.so: look `boa_emu_counters_get` up with dlsym (on the handle of
 *     dlopen("libcuda.so", RTLD_NOLOAD | RTLD_LAZY), which is the library cudarc loaded; RTLD_DEFAULT finds it
 *     only when it was loaded RTLD_GLOBAL, which cudarc's libloading does not do), fill `size`, call it, and
 *     subtract two snapshots (e.g. before and after a block). On a real driver the symbol is absent;
 *   - at exit: EMU_COUNTERS=path writes the totals and the per-name counts as JSON ("%p" in the path becomes
 *     the process id, for commands that start several processes).
 *
 * Plain C, fixed layout: two 32-bit words, then only 64-bit unsigned fields, so there is no padding and Rust
 * mirrors it field for field with #[repr(C)] (u32, u32, then u64s in this order; 328 bytes in version 1; the
 * README's "Counters" has the Rust struct and the lookup, tried from Rust against this library). Fields are
 * only ever appended: a newer library writes a longer struct with a higher version, and writes no more than
 * the caller's `size` says it has room for.
 *
 * What is counted, and when: every call is counted when it is issued and has passed the argument checks
 * (so a refused call is not counted; a launch that fails only when it runs, past its __launch_bounds__, was
 * issued and is), the same in both stream schedules (EMU_STREAMS) and in every mode,
 * EMU_KERNELS=skip included. Counts never decrease; they are per process, over all threads and streams. */
#ifndef BOA_EMU_COUNTERS_H
#define BOA_EMU_COUNTERS_H

#include <stddef.h>
#include <stdint.h>

#define BOA_EMU_COUNTERS_VERSION 1u

/* Bits of `flags`: the mode the emulator runs in, as its device name also says. */
#define BOA_EMU_KERNELS_SKIPPED 1u /* EMU_KERNELS=skip: no kernel, cuBLAS or cuSOLVER arithmetic */
#define BOA_EMU_LAZY_STREAMS 2u    /* EMU_STREAMS=lazy */
#define BOA_EMU_STREAM_ORDER 4u    /* the stream-order check is on (EMU_STREAM_ORDER unset or on) */
#define BOA_EMU_PTXAS_LIMITS 8u    /* a ptxas report was read (EMU_PTXAS_REPORT) */
#define BOA_EMU_RACECHECK 16u      /* the EMU_RACECHECK=1 build */

struct boa_emu_counters {
    uint32_t version; /* out: BOA_EMU_COUNTERS_VERSION of the library that wrote it */
    uint32_t size;    /* in: sizeof the caller's struct; out: the bytes written (the smaller of the two sizes) */
    uint64_t flags;   /* BOA_EMU_* bits above */

    /* Copies, by direction and, for the host side, by the kind of host memory: page-locked ("locked": from
     * cuMemHostAlloc/cuMemAllocHost, or registered with cuMemHostRegister) or pageable (anything else). A copy
     * of 0 bytes counts as a copy of 0 bytes. Sync and async forms (cuMemcpyHtoD, cuMemcpyHtoDAsync,
     * cuMemcpy, cuMemcpyAsync, …) count alike. */
    uint64_t h2d_pageable_copies, h2d_pageable_bytes;
    uint64_t h2d_locked_copies, h2d_locked_bytes;
    uint64_t d2h_pageable_copies, d2h_pageable_bytes;
    uint64_t d2h_locked_copies, d2h_locked_bytes;
    uint64_t d2d_copies, d2d_bytes;
    uint64_t h2h_copies, h2h_bytes; /* cuMemcpy(Async) with host memory on both sides */
    uint64_t memsets, memset_bytes; /* cuMemsetD8/D32 and their Async forms; bytes = count × element size */

    /* Host synchronizations: calls after which the host thread has waited for device work. */
    uint64_t host_syncs;    /* the sum of the five below */
    uint64_t stream_syncs;  /* cuStreamSynchronize */
    uint64_t context_syncs; /* cuCtxSynchronize */
    uint64_t event_syncs;   /* cuEventSynchronize */
    uint64_t copy_syncs;    /* copies and memsets that return only when done: the synchronous forms
                               (cuMemcpyHtoD/DtoH/DtoD, cuMemcpy, cuMemsetD8/D32), and an async copy into
                               pageable host memory (CUDA returns from it only when it is done) */
    uint64_t free_syncs;    /* cuMemFree and cuMemFreeHost, which wait for the device on a GPU */
    uint64_t queries;       /* cuStreamQuery and cuEventQuery (polls: they do not wait, so not above) */
    uint64_t stream_waits;  /* cuStreamWaitEvent */
    uint64_t event_records; /* cuEventRecord(WithFlags) */

    /* Work. */
    uint64_t kernel_launches; /* cuLaunchKernel; per kernel name: boa_emu_counter_name(0, …) and the JSON */
    uint64_t cublas_calls;    /* cuBLAS calls that queue work on a stream (a GEMM with nothing to do, a refused
                                 call, and the handle calls are not counted); per function: table 1 */
    uint64_t cusolver_calls;  /* cuSOLVER factorizations (Xpotrf, Xtrtri, Spotrf, …); *_bufferSize and the
                                 handle calls are not counted; per function: table 1 */

    /* Memory. Allocations count when made, frees when the memory is released (cuMemFreeAsync: when it runs). */
    uint64_t device_allocs, device_alloc_bytes; /* cuMemAlloc, cuMemAllocAsync, cuMemAllocFromPoolAsync */
    uint64_t device_frees, device_free_bytes;   /* cuMemFree, cuMemFreeAsync */
    uint64_t device_bytes_live;                 /* allocated and not yet freed, now */
    uint64_t device_bytes_peak;                 /* the most device_bytes_live has been */
    uint64_t host_allocs, host_alloc_bytes;     /* page-locked: cuMemHostAlloc, cuMemAllocHost */
    uint64_t host_frees, host_free_bytes;       /* cuMemFreeHost */
    uint64_t host_registers, host_register_bytes; /* cuMemHostRegister */

    /* Time. */
    uint64_t copy_ns; /* wall time the emulator spent moving the bytes of copies and memsets (memmove and
                         memset on the host, with the page faults of first writes into fresh memory: about
                         1.4 GB/s on the 2-core build machine, 8 GB/s into written memory). On a GPU the copy
                         engines do that work; a null-mode timing of the host subtracts it (README "The null
                         mode") */
};

#ifdef __cplusplus
extern "C" {
#endif

/* Copies the counters into *out. The caller sets out->size to sizeof(*out) first. Returns 0, or -1 when out
 * is null or out->size is under 8 (nothing is written then). Thread-safe. */
int boa_emu_counters_get(struct boa_emu_counters* out);

/* The per-name counts: table 0 is kernel launches by kernel name, table 1 is cuBLAS and cuSOLVER calls by
 * function name ("cublasGemmEx", "cusolverDnXpotrf"). Entry `index` (0, 1, …, in name order, which a new name
 * can shift) as *name (valid for the life of the process) and *count. Returns 0, 1 past the last entry, or -1
 * for an unknown table or a null pointer. */
int boa_emu_counter_name(int table, size_t index, const char** name, uint64_t* count);

#ifdef __cplusplus
}
#endif

#endif /* BOA_EMU_COUNTERS_H */
