// test_emu.cpp — tests of the emulator's own device semantics (runtime.cpp + cuda_emu.h), on toy kernels
// whose right answers are known: block and warp barriers, shuffles, vote functions, shared memory, wmma,
// and the failures it must report (deadlock, __launch_bounds__). Built and run by build.sh / check.sh:
//
//   g++ -std=c++20 -O2 -include profiling/emu/cuda_emu.h -I profiling/emu/shim -I profiling/emu
//       profiling/emu/test_emu.cpp profiling/emu/runtime.cpp -o test_emu && ./test_emu
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime.h"
#include "test_check.h"
#include <mma.h>

using namespace nvcuda;

// Each thread publishes its index, then reads its neighbour's: right only if the barrier holds everyone.
extern "C" __global__ void __launch_bounds__(256) neighbour_kernel(int* out) {
    __shared__ int sh[256];
    const unsigned t = threadIdx.x, n = blockDim.x;
    sh[t] = (int)(t + 1000 * blockIdx.x);
    __syncthreads();
    out[blockIdx.x * n + t] = sh[(t + 1) % n];
}

// Warp sum by xor shuffles, block OR and count by __syncthreads_or/count, ballot of odd lanes, all_sync.
extern "C" __global__ void __launch_bounds__(64) collectives_kernel(int* out) {
    const int t = (int)threadIdx.x;
    int v = t;
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    out[t] = v;
    out[64 + t] = __syncthreads_or(t == 37);
    out[128 + t] = __syncthreads_count(t % 3 == 0);
    out[192 + t] = (int)__ballot_sync(0xffffffffu, t & 1);
    out[256 + t] = __shfl_down_sync(0xffffffffu, t, 1);
    out[320 + t] = __all_sync(0xffffffffu, t != 5);  // false in warp 0 only
}

// Threads 0–15 wait at the block barrier, 16–31 at a warp barrier that needs 0–15: a deadlock on a GPU too.
extern "C" __global__ void __launch_bounds__(32) deadlock_kernel(int*) {
    if (threadIdx.x < 16) __syncthreads();
    else __syncwarp();
}

// Reads static shared memory nobody wrote: must see the NaN pattern, not zero.
extern "C" __global__ void __launch_bounds__(32) unwritten_smem_kernel(float* out) {
    __shared__ float sh[32];
    out[threadIdx.x] = sh[threadIdx.x];
}

// A float4 load at x + offset: a GPU faults unless x + offset is 16-byte aligned (build.sh's UBSan check).
extern "C" __global__ void __launch_bounds__(32) vector_load_kernel(const float* x, float* out, int offset) {
    const float4 v = *reinterpret_cast<const float4*>(x + offset);
    out[threadIdx.x] = v.x + v.y + v.z + v.w;
}

// Race-check cases (EMU_RACECHECK builds; racecheck.h). `mode` picks one; out[0] gets a result.
//   0: every thread adds 1 to a shared counter without an atomic (a lost update on a GPU)
//   1: a tree reduction with a barrier per level (no race)
//   2: lanes publish, __syncwarp, read a neighbour's (no race)   3: the same without __syncwarp
//   4: warp 0 reads a word that warp 1 then writes, no barrier   5: atomicAdd on a shared counter (no race)
extern "C" __global__ void __launch_bounds__(64) race_kernel(int* out, int mode) {
    __shared__ int sh[64];
    const int t = (int)threadIdx.x;
    sh[t] = t;
    __syncthreads();
    int r = 0;
    if (mode == 0 || mode == 5) {
        if (t == 0) sh[0] = 0;
        __syncthreads();
        if (mode == 0) sh[0] += 1;
        else atomicAdd(&sh[0], 1);
        __syncthreads();
        r = sh[0];
    } else if (mode == 1) {
        for (int s = 32; s > 0; s /= 2) {
            if (t < s) sh[t] += sh[t + s];
            __syncthreads();
        }
        r = sh[0];
    } else if (mode == 2 || mode == 3) {
        sh[t] = 100 + t;
        if (mode == 2) __syncwarp();
        r = sh[(t / 32) * 32 + (t + 1) % 32];
    } else if (mode == 4) {
        if (t == 0) r = sh[40];
        if (t == 32) sh[40] = -1;
    }
    if (t == 0) *out = r;
}

// Device-memory race cases (EMU_RACECHECK builds). g: 64 ints of tracked device memory, zeroed; g[63] counts
// blocks. The split-K pattern: block b leaves b + 1 in g[b], and the last block to count itself sums them.
//   0: thread 0 of every block adds 1 to g[0] without an atomic (a lost update between blocks)
//   1: the pattern, each writer fences (no race)     2: the same without the fence (the sum may miss a write)
//   3: thread 5 writes, a barrier, thread 0 fences for the block (no race: the fence is cumulative)
//   4: the pattern, but "last" is the block with the highest index, not the last counted (no acquire)
//   5: thread 0 writes g[5] and thread 1 reads it, no barrier   6: the same with a barrier (no race)
extern "C" __global__ void __launch_bounds__(64) global_race_kernel(int* g, int* out, int mode) {
    const int t = (int)threadIdx.x, b = (int)blockIdx.x, nb = (int)gridDim.x;
    if (mode == 0) {
        if (t == 0) g[0] += 1;
        return;
    }
    if (mode >= 5) {
        if (b != 0) return;
        if (t == 0) g[5] = 42;
        if (mode == 6) __syncthreads();
        if (t == 1) *out = g[5];
        return;
    }
    if (t == (mode == 3 ? 5 : 0)) {
        g[b] = b + 1;
        if (mode == 1) __threadfence();
    }
    __syncthreads();
    if (mode == 3 && t == 0) __threadfence();
    int last;
    if (mode == 4) {
        if (t == 0) __threadfence();
        last = b == nb - 1;
    } else {
        last = __syncthreads_or(t == 0 && atomicAdd(&g[63], 1) == nb - 1);
    }
    if (last && t == 0) {
        int sum = 0;
        for (int i = 0; i < nb; ++i) sum += g[i];
        *out = sum;
    }
}

// The split-K pattern with a wmma store for the partial: block b stores a 16×16 tile of b + 1 at tiles[256·b],
// fences (fence = 1) or not, and the last block counted sums element 0 of every tile. tiles: 3 tiles, then
// the counter.
extern "C" __global__ void __launch_bounds__(32) global_wmma_race_kernel(float* tiles, float* out, int fence) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, (float)(blockIdx.x + 1));
    wmma::store_matrix_sync(tiles + 256 * blockIdx.x, acc, 16, wmma::mem_row_major);
    if (fence) __threadfence();
    unsigned* counter = reinterpret_cast<unsigned*>(tiles + 256 * gridDim.x);
    const int last = __syncthreads_or(threadIdx.x == 0 && atomicAdd(counter, 1u) == gridDim.x - 1);
    if (last && threadIdx.x == 0) {
        float sum = 0.f;
        for (unsigned b = 0; b < gridDim.x; ++b) sum += tiles[256 * b];
        *out = sum;
    }
}

// One 16×16×16 bf16 wmma product with f32 accumulation, row-major A, col-major B.
extern "C" __global__ void __launch_bounds__(32) wmma_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, float* c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 1.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// Lanes load different tiles: undefined in CUDA, reported by the emulator.
extern "C" __global__ void __launch_bounds__(32) wmma_divergent_kernel(const __nv_bfloat16* a, float* c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a + 256 * (threadIdx.x % 2), 16);
    wmma::load_matrix_sync(fb, a, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

EMU_REGISTER(neighbour_kernel, 256)
EMU_REGISTER(collectives_kernel, 64)
EMU_REGISTER(deadlock_kernel, 32)
EMU_REGISTER(unwritten_smem_kernel, 32)
EMU_REGISTER(wmma_kernel, 32)
EMU_REGISTER(wmma_divergent_kernel, 32)
EMU_REGISTER(vector_load_kernel, 32)
EMU_REGISTER(race_kernel, 64)
EMU_REGISTER(global_race_kernel, 64)
EMU_REGISTER(global_wmma_race_kernel, 32)

template <class... A>
static std::string run(const char* name, uint3 grid, uint3 block, A*... args) {
    const emu::Kernel* k = emu::find_kernel(name);
    if (!k) return std::string("no kernel ") + name;
    void* params[] = {(void*)args...};  // as cuLaunchKernel: one pointer to each argument's value
    return emu::launch(*k, grid, block, 0, params);
}

int main() {
    {
        std::vector<int> out(3 * 256);
        int* p = out.data();
        const std::string err = run("neighbour_kernel", {3, 1, 1}, {256, 1, 1}, &p);
        CHECK(err.empty(), "neighbour_kernel: %s", err.c_str());
        for (unsigned b = 0; b < 3; ++b)
            for (unsigned t = 0; t < 256; ++t)
                CHECK(out[b * 256 + t] == (int)((t + 1) % 256 + 1000 * b), "neighbour b=%u t=%u got %d", b, t,
                      out[b * 256 + t]);
    }
    {
        std::vector<int> out(6 * 64);
        int* p = out.data();
        const std::string err = run("collectives_kernel", {1, 1, 1}, {64, 1, 1}, &p);
        CHECK(err.empty(), "collectives_kernel: %s", err.c_str());
        for (int t = 0; t < 64; ++t) {
            const int w = t / 32;
            CHECK(out[t] == 32 * 31 / 2 + 32 * 32 * w, "warp sum t=%d got %d", t, out[t]);
            CHECK(out[64 + t] == 1, "syncthreads_or t=%d", t);
            CHECK(out[128 + t] == 22, "syncthreads_count t=%d got %d", t, out[128 + t]);
            CHECK((unsigned)out[192 + t] == 0xaaaaaaaau, "ballot t=%d got %x", t, (unsigned)out[192 + t]);
            CHECK(out[256 + t] == (t % 32 == 31 ? t : t + 1), "shfl_down t=%d got %d", t, out[256 + t]);
            CHECK(out[320 + t] == (w == 1), "all_sync t=%d got %d", t, out[320 + t]);
        }
    }
    {
        int dummy = 0;
        int* p = &dummy;
        const std::string err = run("deadlock_kernel", {1, 1, 1}, {32, 1, 1}, &p);
        CHECK(err.find("deadlock") != std::string::npos, "deadlock not reported: '%s'", err.c_str());
        const std::string big = run("neighbour_kernel", {1, 1, 1}, {512, 1, 1}, &p);
        CHECK(big.find("__launch_bounds__(256)") != std::string::npos, "launch bound not enforced: '%s'", big.c_str());
    }
    {
        std::vector<float> out(32, 0.0f);
        float* p = out.data();
        const std::string err = run("unwritten_smem_kernel", {1, 1, 1}, {32, 1, 1}, &p);
        CHECK(err.empty(), "unwritten_smem_kernel: %s", err.c_str());
#ifndef EMU_ASAN
        for (float v : out) CHECK(v != v, "unwritten shared memory read as %g, not NaN", v);
#endif
    }
    {
        alignas(32) __nv_bfloat16 a[256], b[256];
        alignas(32) float c[256];
        for (int i = 0; i < 256; ++i) {
            a[i] = __float2bfloat16_rn(0.25f * (float)(i % 7) - 0.5f);
            b[i] = __float2bfloat16_rn(0.125f * (float)(i % 5) - 0.25f);
        }
        __nv_bfloat16* pa = a;
        __nv_bfloat16* pb = b;
        float* pc = c;
        const std::string err = run("wmma_kernel", {1, 1, 1}, {32, 1, 1}, &pa, &pb, &pc);
        CHECK(err.empty(), "wmma_kernel: %s", err.c_str());
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) {
                float want = 1.0f;
                for (int k = 0; k < 16; ++k) want += (float)a[i * 16 + k] * (float)b[j * 16 + k];  // B col-major
                CHECK(c[i * 16 + j] == want, "wmma c[%d][%d] = %g, want %g", i, j, c[i * 16 + j], want);
            }
    }
    {
        alignas(32) __nv_bfloat16 a[512];
        alignas(32) float c[256];
        for (int i = 0; i < 512; ++i) a[i] = __float2bfloat16_rn((float)(i % 11));
        __nv_bfloat16* pa = a;
        float* pc = c;
        const std::string err = run("wmma_divergent_kernel", {1, 1, 1}, {32, 1, 1}, &pa, &pc);
        CHECK(err.find("different fragments") != std::string::npos, "divergent wmma not reported: '%s'", err.c_str());
    }
    {
        alignas(16) float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        std::vector<float> out(32);
        float* px = x;
        float* po = out.data();
        int aligned = 4;
        const std::string err = run("vector_load_kernel", {1, 1, 1}, {32, 1, 1}, &px, &po, &aligned);
        CHECK(err.empty() && out[0] == 26.0f, "aligned float4 load: '%s', %g", err.c_str(), out[0]);
        // Misaligned by one float: UBSan ends the process, so the launch runs in a child whose stderr is read.
        const ChildResult c = in_child([&] {
            int misaligned = 1;
            run("vector_load_kernel", {1, 1, 1}, {32, 1, 1}, &px, &po, &misaligned);
            return 0;
        });
        CHECK(c.code != 0 && c.err.find("misaligned address") != std::string::npos,
              "a misaligned float4 load was not reported (exit code %d): '%s'", c.code, c.err.c_str());
    }
#ifdef EMU_RACECHECK
    {
        // mode, whether it races, out[0] when it does not (2016 = 0 + 1 + … + 63; lane 0 reads lane 1's 101)
        const struct {
            int mode;
            bool races;
            int want;
        } cases[] = {{0, true, 0}, {1, false, 2016}, {2, false, 101}, {3, true, 0}, {4, true, 0}, {5, false, 64}};
        for (const auto& c : cases) {
            int out = -7;
            int* po = &out;
            int mode = c.mode;
            const std::string err = run("race_kernel", {2, 1, 1}, {64, 1, 1}, &po, &mode);
            const bool raced = err.find("race on byte") != std::string::npos;
            CHECK(raced == c.races, "race_kernel mode %d: %s", c.mode, err.empty() ? "no race reported" : err.c_str());
            if (!c.races) CHECK(err.empty() && out == c.want, "race_kernel mode %d: out %d, want %d (%s)", c.mode, out, c.want, err.c_str());
        }
        // Device memory: mode, whether the race check reports it with threads and blocks in forward order and
        // in reverse order, and out when the kernel is race-free (1 + 2 + 3 from three blocks; 42). Device
        // memory keeps no reads, so a race whose read comes first in the order run (a write after a read) is
        // seen only in the other order: check.sh runs the race check in both.
        const bool reverse = [] {
            const char* s = std::getenv("EMU_SCHEDULE");
            return s && std::string(s) == "reverse";
        }();
        const struct {
            int mode;
            bool forward, reverse;
            int want;
        } gcases[] = {{0, true, true, 0},   {1, false, false, 6}, {2, true, true, 0},   {3, false, false, 6},
                      {4, true, false, 0},  {5, true, false, 0},  {6, false, false, 42}};
        std::vector<int> g(64);
        emu::race::track(g.data(), g.size() * sizeof(int));
        for (const auto& c : gcases) {
            std::fill(g.begin(), g.end(), 0);
            int out = -7;
            int *pg = g.data(), *po = &out;
            int mode = c.mode;
            const std::string err = run("global_race_kernel", {3, 1, 1}, {64, 1, 1}, &pg, &po, &mode);
            const bool raced = err.find("race on byte") != std::string::npos && err.find("device allocation") != std::string::npos;
            const bool races = reverse ? c.reverse : c.forward, race_free = !c.forward && !c.reverse;
            CHECK(raced == races, "global_race_kernel mode %d: %s", c.mode, err.empty() ? "no race reported" : err.c_str());
            if (race_free) CHECK(err.empty() && out == c.want, "global_race_kernel mode %d: out %d, want %d (%s)", c.mode, out, c.want, err.c_str());
        }
        emu::race::untrack(g.data());
        // A wmma store is the warp's write: a fence by its lanes publishes it (no race), no fence does not.
        struct alignas(32) Tiles {  // wmma needs 32-byte aligned tiles
            float v[3 * 256 + 1];
        } tiles{};
        emu::race::track(tiles.v, sizeof tiles.v);
        for (int fence : {1, 0}) {
            std::fill(std::begin(tiles.v), std::end(tiles.v), 0.f);
            float out = -7.f;
            float *pt = tiles.v, *po = &out;
            const std::string err = run("global_wmma_race_kernel", {3, 1, 1}, {32, 1, 1}, &pt, &po, &fence);
            const bool raced = err.find("race on byte") != std::string::npos && err.find("(wmma)") != std::string::npos;
            CHECK(raced == !fence, "global_wmma_race_kernel fence=%d: %s", fence, err.empty() ? "no race reported" : err.c_str());
            if (fence) CHECK(err.empty() && out == 6.f, "global_wmma_race_kernel: out %g, want 6 (%s)", out, err.c_str());
        }
        emu::race::untrack(tiles.v);
    }
    const char* race_note = "; the race check finds races in shared and device memory (and only those)";
#else
    const char* race_note = "";
#endif
    if (g_failures) {
        std::fprintf(stderr, "test_emu: %d failures\n", g_failures);
        return 1;
    }
    std::printf("test_emu: barriers, shuffles, votes, shared memory, wmma, deadlock, launch-bound and warp-uniform checks pass; misaligned vector loads are caught%s\n", race_note);
    return 0;
}
