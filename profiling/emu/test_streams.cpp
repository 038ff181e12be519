// test_streams.cpp — tests of the lazy schedule of streams.h (EMU_STREAMS=lazy) through the driver API:
// that it really runs work late (a consumer that does not wait sees NaN), that it keeps CUDA's rules
// (events, the legacy stream's implicit order, pageable and page-locked copies, kernel arguments copied at
// the launch), and that a free with a queued user is reported. The stream-order check is off here. Built by build.sh with driver.cpp,
// streams.cpp and runtime.cpp linked in; run by check.sh.
#include <cuda.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime.h"
#include "test_check.h"

#define OK(call) CHECK((call) == CUDA_SUCCESS, "%s", #call)

extern "C" __global__ void __launch_bounds__(64) scale_kernel(float* x, float s, int n) {
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) x[i] *= s;
}
EMU_REGISTER(scale_kernel, 64)

constexpr int N = 100;
constexpr size_t BYTES = N * sizeof(float);

static float* pinned() {
    void* p = nullptr;
    OK(cuMemAllocHost(&p, BYTES));
    return static_cast<float*>(p);
}

static CUdeviceptr device() {
    CUdeviceptr d = 0;
    OK(cuMemAlloc(&d, BYTES));
    return d;
}

static CUstream stream(unsigned flags) {
    CUstream s = nullptr;
    OK(cuStreamCreate(&s, flags));
    return s;
}

static bool all(const float* x, float v) {
    for (int i = 0; i < N; ++i)
        if (!(x[i] == v || (std::isnan(v) && std::isnan(x[i])))) return false;
    return true;
}

int main() {
    setenv("EMU_STREAMS", "lazy", 1);  // before the first driver call, which reads it
    // Unordered work is what this test watches run late; the stream-order check would refuse it at issue
    // (test_order tests that check).
    setenv("EMU_STREAM_ORDER", "off", 1);
    OK(cuInit(0));
    CUstream a = stream(CU_STREAM_NON_BLOCKING), b = stream(CU_STREAM_NON_BLOCKING);
    float* h = pinned();
    float* out = pinned();
    for (int i = 0; i < N; ++i) h[i] = 3.0f;

    // A consumer on another stream that does not wait runs first: it copies the NaN bytes of fresh memory.
    CUdeviceptr d = device();
    OK(cuMemcpyHtoDAsync(d, h, BYTES, a));
    OK(cuMemcpyDtoHAsync(out, d, BYTES, b));
    OK(cuStreamSynchronize(b));
    CHECK(all(out, NAN), "without a wait the consumer saw %g, not the NaN of unwritten memory", out[0]);
    OK(cuStreamSynchronize(a));

    // With an event between them it sees the producer's data.
    CUevent e = nullptr;
    OK(cuEventCreate(&e, 0));
    CUdeviceptr d2 = device();
    OK(cuMemcpyHtoDAsync(d2, h, BYTES, a));
    OK(cuEventRecord(e, a));
    OK(cuStreamWaitEvent(b, e, 0));
    OK(cuMemcpyDtoHAsync(out, d2, BYTES, b));
    OK(cuStreamSynchronize(b));
    CHECK(all(out, 3.0f), "after a stream wait the consumer saw %g, not 3", out[0]);

    // A page-locked destination is written when the copy runs, not when it is issued.
    for (int i = 0; i < N; ++i) out[i] = -1.0f;
    OK(cuMemcpyDtoHAsync(out, d2, BYTES, a));
    CHECK(all(out, -1.0f), "a queued copy into page-locked memory already ran");
    CUresult q = cuStreamQuery(a);
    CHECK(q == CUDA_ERROR_NOT_READY, "cuStreamQuery with queued work returned %d, not NOT_READY", (int)q);
    OK(cuStreamQuery(a));  // the query ran the queue: a polling loop ends
    CHECK(all(out, 3.0f), "the copy into page-locked memory did not run");

    // A pageable source is staged at the call; a pageable destination is written before the call returns.
    std::vector<float> v(N, 5.0f), w(N, 0.0f);
    OK(cuMemcpyHtoDAsync(d, v.data(), BYTES, a));
    std::fill(v.begin(), v.end(), 6.0f);
    OK(cuMemcpyDtoHAsync(w.data(), d, BYTES, a));
    CHECK(all(w.data(), 5.0f), "pageable copies: saw %g, not the 5 staged at the first call", w[0]);

    // Kernel arguments are copied at the launch: changing the variable afterwards changes nothing.
    CUfunction f = nullptr;
    OK(cuModuleGetFunction(&f, nullptr, "scale_kernel"));
    float s = 2.0f;
    int n = N;
    void* args[] = {&d, &s, &n};
    OK(cuLaunchKernel(f, (N + 63) / 64, 1, 1, 64, 1, 1, 0, a, args, nullptr));
    s = 100.0f;
    OK(cuMemcpyDtoHAsync(w.data(), d, BYTES, a));
    CHECK(all(w.data(), 10.0f), "kernel argument: saw %g, not 5 × 2", w[0]);

    // Timing needs both events complete.
    CUevent t0 = nullptr, t1 = nullptr;
    OK(cuEventCreate(&t0, 0));
    OK(cuEventCreate(&t1, 0));
    OK(cuEventRecord(t0, a));
    OK(cuLaunchKernel(f, (N + 63) / 64, 1, 1, 64, 1, 1, 0, a, args, nullptr));
    OK(cuEventRecord(t1, a));
    float ms = -1.0f;
    q = cuEventElapsedTime(&ms, t0, t1);
    CHECK(q == CUDA_ERROR_NOT_READY, "elapsed time of queued events returned %d, not NOT_READY", (int)q);
    OK(cuEventSynchronize(t1));
    OK(cuEventElapsedTime(&ms, t0, t1));
    CHECK(ms >= 0.0f, "elapsed time %g ms", ms);

    // The legacy stream is ordered with a blocking stream (created without CU_STREAM_NON_BLOCKING).
    CUstream blocking = stream(0);
    CUdeviceptr d3 = device();
    OK(cuMemcpyHtoDAsync(d3, h, BYTES, blocking));
    OK(cuMemcpyDtoHAsync(out, d3, BYTES, nullptr));
    OK(cuStreamSynchronize(nullptr));
    CHECK(all(out, 3.0f), "legacy stream after a blocking stream saw %g, not 3", out[0]);

    // Last (the error is sticky): a free that runs while a queued copy on another stream still reads the memory.
    OK(cuMemcpyDtoDAsync(d2, d, BYTES, b));
    OK(cuMemFreeAsync(d, a));
    q = cuStreamSynchronize(a);
    CHECK(q == CUDA_ERROR_ILLEGAL_ADDRESS, "free with a queued user returned %d, not ILLEGAL_ADDRESS", (int)q);
    q = cuStreamSynchronize(b);
    CHECK(q == CUDA_ERROR_ILLEGAL_ADDRESS, "the error is not sticky: %d", (int)q);

    if (g_failures) {
        std::fprintf(stderr, "test_streams: %d failures\n", g_failures);
        return 1;
    }
    std::printf("test_streams: lazy streams, events, copies, launches and frees as expected\n");
    return 0;
}
