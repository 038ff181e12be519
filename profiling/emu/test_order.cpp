// test_order.cpp — tests of the stream-order check (streamorder.h) through the driver API: each case issues
// work on two streams and expects its last call refused (a pair of operations on the same bytes, one of them
// writing, that nothing orders) or accepted (an event, a host synchronization, a stream's own order, reads
// only, or disjoint bytes order or excuse them). A refusal is sticky, as CUDA's errors are, so each case runs
// in a child process. Run by check.sh in both schedules (EMU_STREAMS=eager and lazy): the check does not
// depend on the order work runs in.
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "runtime.h"
#include "streams.h"
#include "test_check.h"

extern "C" __global__ void __launch_bounds__(64) order_scale_kernel(float* x, float s, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) x[i] *= s;
}
EMU_REGISTER(order_scale_kernel, 64)

extern "C" __global__ void __launch_bounds__(64) order_copy_kernel(float* y, const float* x, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) y[i] = x[i];
}
EMU_REGISTER(order_copy_kernel, 64)

constexpr int N = 64;
constexpr size_t BYTES = N * sizeof(float);

// A setup call that fails ends the child with 3: the case did not get as far as its last call.
#define SETUP(call)                                                                                \
    do {                                                                                           \
        if ((call) != CUDA_SUCCESS) {                                                              \
            std::fprintf(stderr, "setup call failed: %s\n", #call);                                \
            std::_Exit(3);                                                                         \
        }                                                                                          \
    } while (0)

namespace {

CUstream stream(unsigned flags = CU_STREAM_NON_BLOCKING) {
    CUstream s = nullptr;
    SETUP(cuStreamCreate(&s, flags));
    return s;
}
CUdeviceptr device() {
    CUdeviceptr d = 0;
    SETUP(cuMemAlloc(&d, BYTES));
    return d;
}
float* pinned() {
    void* p = nullptr;
    SETUP(cuMemAllocHost(&p, BYTES));
    return static_cast<float*>(p);
}
CUevent event() {
    CUevent e = nullptr;
    SETUP(cuEventCreate(&e, 0));
    return e;
}
CUresult launch(const char* kernel, void** args, CUstream s) {
    CUfunction f = nullptr;
    SETUP(cuModuleGetFunction(&f, nullptr, kernel));
    return cuLaunchKernel(f, 1, 1, 1, 64, 1, 1, 0, s, args, nullptr);
}

// Two streams, a device buffer d and a page-locked buffer h, and d written from h on stream a.
struct Setup {
    CUstream a = stream(), b = stream();
    CUdeviceptr d = device(), d2 = device();
    float* h = pinned();
    Setup() { SETUP(cuMemcpyHtoDAsync(d, h, BYTES, a)); }
};

// Launches order_scale_kernel (it may write d) on stream s.
CUresult scale(CUdeviceptr& d, CUstream s) {
    static float f = 2.0f;
    static int n = N;
    void* args[] = {&d, &f, &n};
    return launch("order_scale_kernel", args, s);
}

// Runs `body` in a child; its last call must be refused (naming `other`, the earlier operation) or not.
void run(const char* name, bool refused, const char* other, CUresult (*body)()) {
    const ChildResult c = in_child([body] {
        if (cuInit(0) != CUDA_SUCCESS) return 3;
        const CUresult r = body();
        return r == CUDA_SUCCESS ? 0 : r == CUDA_ERROR_ILLEGAL_ADDRESS ? 1 : 2;
    });
    CHECK(c.code == (refused ? 1 : 0),
          "%s: exit %d (0 accepted, 1 refused, 2 another error, 3 setup failed), expected %s; its stderr: %s", name,
          c.code, refused ? "refused" : "accepted", c.err.c_str());
    if (refused && c.code == 1)
        CHECK(c.err.find("stream race") != std::string::npos && c.err.find(other) != std::string::npos,
              "%s: the report does not name `%s`: %s", name, other, c.err.c_str());
}

}  // namespace

int main() {
    // Read after write.
    run("a read on another stream with no wait", true, "cuMemcpyHtoDAsync` on stream 1", [] {
        Setup s;
        return cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.b);
    });
    run("a read after an event wait", false, "", [] {
        Setup s;
        CUevent e = event();
        SETUP(cuEventRecord(e, s.a));
        SETUP(cuStreamWaitEvent(s.b, e, 0));
        return cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.b);
    });
    run("a read after the host synchronized the writer's stream", false, "", [] {
        Setup s;
        SETUP(cuStreamSynchronize(s.a));
        return cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.b);
    });
    run("a read after the host synchronized an event", false, "", [] {
        Setup s;
        CUevent e = event();
        SETUP(cuEventRecord(e, s.a));
        SETUP(cuEventSynchronize(e));
        return cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.b);
    });
    run("a read after a query found the stream idle", false, "", [] {
        Setup s;
        while (cuStreamQuery(s.a) == CUDA_ERROR_NOT_READY) {
        }
        return cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.b);
    });
    run("an event recorded before the write orders nothing", true, "cuMemcpyHtoDAsync` on stream 1", [] {
        CUstream a = stream(), b = stream();
        CUdeviceptr d = device(), d2 = device();
        float* h = pinned();
        CUevent e = event();
        SETUP(cuEventRecord(e, a));
        SETUP(cuMemcpyHtoDAsync(d, h, BYTES, a));
        SETUP(cuStreamWaitEvent(b, e, 0));
        return cuMemcpyDtoDAsync(d2, d, BYTES, b);
    });

    // Write after read, and reads that need no order.
    run("a write while another stream may still read", true, "cuMemcpyDtoDAsync` on stream 1", [] {
        Setup s;
        SETUP(cuStreamSynchronize(s.a));
        SETUP(cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.a));
        return cuMemsetD32Async(s.d, 0, N, s.b);
    });
    run("two streams reading the same bytes", false, "", [] {
        Setup s;
        CUdeviceptr d3 = device();
        SETUP(cuStreamSynchronize(s.a));
        SETUP(cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.a));
        return cuMemcpyDtoDAsync(d3, s.d, BYTES, s.b);
    });
    run("two streams writing disjoint halves", false, "", [] {
        CUstream a = stream(), b = stream();
        CUdeviceptr d = device();
        SETUP(cuMemsetD32Async(d, 0, N / 2, a));
        return cuMemsetD32Async(d + BYTES / 2, 0, N / 2, b);
    });

    // Kernels: a pointer to const is read, any other pointer may be written.
    run("a kernel reading through a const pointer beside another reader", false, "", [] {
        Setup s;
        CUdeviceptr d3 = device();
        int n = N;
        SETUP(cuStreamSynchronize(s.a));
        SETUP(cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.a));
        void* args[] = {&d3, &s.d, &n};
        return launch("order_copy_kernel", args, s.b);
    });
    run("a kernel that may write while another stream reads", true, "cuMemcpyDtoDAsync` on stream 1", [] {
        Setup s;
        SETUP(cuStreamSynchronize(s.a));
        SETUP(cuMemcpyDtoDAsync(s.d2, s.d, BYTES, s.a));
        return scale(s.d, s.b);
    });

    // Frees: after every use.
    run("cuMemFreeAsync while another stream may still write", true, "kernel order_scale_kernel` on stream 2", [] {
        Setup s;
        SETUP(cuStreamSynchronize(s.a));
        SETUP(scale(s.d, s.b));
        return cuMemFreeAsync(s.d, s.a);
    });
    run("cuMemFreeHost while a copy may still read it", true, "cuMemcpyHtoDAsync` on stream 1", [] {
        Setup s;
        return cuMemFreeHost(s.h);
    });
    run("cuMemFreeHost after the host synchronized", false, "", [] {
        Setup s;
        SETUP(cuStreamSynchronize(s.a));
        return cuMemFreeHost(s.h);
    });

    // The legacy stream: ordered with blocking streams, not with non-blocking ones.
    run("the legacy stream after a blocking stream", false, "", [] {
        CUstream a = stream(0);
        CUdeviceptr d = device(), d2 = device();
        SETUP(cuMemsetD32Async(d, 0, N, a));
        return cuMemcpyDtoDAsync(d2, d, BYTES, nullptr);
    });
    run("the legacy stream after a non-blocking stream", true, "cuMemsetD32Async` on stream 1", [] {
        CUstream a = stream();
        CUdeviceptr d = device(), d2 = device();
        SETUP(cuMemsetD32Async(d, 0, N, a));
        return cuMemcpyDtoDAsync(d2, d, BYTES, nullptr);
    });

    if (g_failures) {
        std::fprintf(stderr, "test_order: %d failures\n", g_failures);
        return 1;
    }
    std::printf("test_order: unordered pairs refused, ordered ones accepted (%s streams)\n",
                emu::streams::lazy() ? "lazy" : "eager");
    return 0;
}
