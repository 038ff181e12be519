// runtime.cpp — runs an emulated kernel launch: every block in turn, every thread of a block as a fiber.
//
// Part of the CPU emulator of the CUDA stack (profiling/emu/README.md). A fiber runs until it reaches a
// barrier (__syncthreads*, __syncwarp, a shuffle) or returns; a barrier completes when every live thread
// of its scope (block or warp) has arrived, as on Volta and later where exited threads are not waited for.
// When no fiber can run and some have not returned, the block is deadlocked (a barrier under divergent
// control flow): the launch fails and says where the threads stopped.
//
// The context switch is a dozen instructions of x86-64 assembly instead of swapcontext(3), which makes a
// system call per switch; a parity test's launch switches some millions of times.

#include "runtime.h"

#include <sys/mman.h>
#ifdef EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"  // and racecheck.h, in an EMU_RACECHECK build

// emu_switch(save, to): pushes the callee-saved registers on the current stack, stores the stack pointer in
// *save, and resumes the context whose stack pointer is `to`. MXCSR and the x87 control word are not
// switched: nothing in a kernel or in the host code changes them, and their loads serialise the pipeline.
asm(R"(
    .pushsection .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .popsection
)");
extern "C" void emu_switch(void** save, void* to);
// The linker's bounds of the static shared memory of every kernel in this library (cuda_emu.h).
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

namespace emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // wmma fragments keep whole tiles per lane: ~1 KiB each
constexpr unsigned kMaxThreads = 1024;

struct Barrier {
    unsigned live = 0, arrived = 0;
    int acc_or = 0, acc_and = 1, acc_count = 0;
    int res_or = 0, res_and = 1, res_count = 0;
};

enum class State { Runnable, Waiting, Done };

struct Fiber {
    void* sp = nullptr;
    char* stack = nullptr;
    uint3 tid{};
    unsigned lane = 0, warp = 0;
    State state = State::Runnable;
    const Barrier* waiting_on = nullptr;
    uint64_t uniform_calls = 0;  // warp_uniform calls made so far: pairs a lane's call with its warp-mates'
};

// One warp-uniform computation: its inputs (for comparison) and result, kept until every lane took it.
struct UniformCall {
    std::vector<unsigned char> in, out;
    unsigned left;
};

struct Block {
    const Kernel* kernel = nullptr;
    void** params = nullptr;
    uint3 bid{}, bdim{}, gdim{};
    void* smem = nullptr;
    std::vector<Fiber> fibers;
    Barrier block;
    std::vector<Barrier> warps;
    std::vector<std::array<uint64_t, 32>> slots;
    std::vector<std::map<uint64_t, UniformCall>> uniform;  // per warp, by call number
    std::vector<unsigned> now, next;  // fibers to run in this round and the next
    unsigned done = 0;
    bool reverse = false;
    void* sched_sp = nullptr;
    const char* failure = nullptr;
};

// initial-exec: the general-dynamic model of a shared library costs a __tls_get_addr call per access.
__attribute__((tls_model("initial-exec"))) thread_local Block* g_block = nullptr;
__attribute__((tls_model("initial-exec"))) thread_local Fiber* g_fiber = nullptr;

std::map<std::string, Kernel>& registry() {
    static std::map<std::string, Kernel> r;
    return r;
}

// Stacks are reserved once (committed lazily by the kernel) and handed to a fiber when it first runs; a
// finished fiber's stack goes back on the free list. A kernel without barriers thus runs all its threads on
// one hot stack, which makes elementwise kernels of millions of threads several times faster.
std::vector<char*> g_free_stacks;
char* take_stack() {
    if (!g_free_stacks.empty()) {
        char* s = g_free_stacks.back();
        g_free_stacks.pop_back();
        return s;
    }
    // A guard page below each stack: a kernel that overflows its fiber's stack faults instead of silently
    // overwriting the next fiber's.
    constexpr size_t kGuard = 4096;
    void* p = mmap(nullptr, kStackBytes + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED || mprotect(p, kGuard, PROT_NONE) != 0) throw std::runtime_error("emu: cannot map a fiber stack");
    return static_cast<char*>(p) + kGuard;
}

// Under EMU_ASAN the sanitizer is told about every stack switch (its fiber API), so it knows which stack it
// is on; otherwise a [[noreturn]] call on a fiber stack makes it warn and may give false reports.
#ifdef EMU_ASAN
thread_local const void* g_sched_bottom = nullptr;
thread_local size_t g_sched_size = 0;
#endif

void yield_to_scheduler(bool finished = false) {
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(finished ? nullptr : &fake, g_sched_bottom, g_sched_size);
#endif
    emu_switch(&g_fiber->sp, g_block->sched_sp);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, &g_sched_bottom, &g_sched_size);
#endif
    (void)finished;
}

// The scheduler's side of a switch into fiber `f`.
void run_fiber(Block& b, Fiber& f) {
#ifdef EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
    emu_switch(&b.sched_sp, f.sp);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void complete(Barrier& b, unsigned first, unsigned count) {
#ifdef EMU_RACECHECK
    if (&b == &g_block->block) race::block_barrier();
    else race::warp_barrier(first / 32);
#endif
    b.res_or = b.acc_or;
    b.res_and = b.acc_and;
    b.res_count = b.acc_count;
    b.acc_or = 0;
    b.acc_and = 1;
    b.acc_count = 0;
    b.arrived = 0;
    const unsigned end = std::min(first + count, (unsigned)g_block->fibers.size());
    for (unsigned j = first; j < end; ++j) {
        const unsigned i = g_block->reverse ? end - 1 - (j - first) : j;
        Fiber& f = g_block->fibers[i];
        if (f.state == State::Waiting && f.waiting_on == &b) {
            f.state = State::Runnable;
            f.waiting_on = nullptr;
            g_block->next.push_back(i);
        }
    }
}

void arrive(Barrier& b, int pred, unsigned first, unsigned count) {
    b.acc_or |= pred;
    b.acc_and &= pred;
    b.acc_count += pred;
    if (++b.arrived == b.live) {
        complete(b, first, count);
        return;
    }
    g_fiber->state = State::Waiting;
    g_fiber->waiting_on = &b;
    yield_to_scheduler();
}

void fiber_main() {
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
    g_block->kernel->invoke(g_block->params);
    Fiber& f = *g_fiber;
    Block& blk = *g_block;
    f.state = State::Done;
    ++blk.done;
    // An exited thread stops counting towards its block's and its warp's barriers.
    Barrier& w = blk.warps[f.warp];
    if (--blk.block.live > 0 && blk.block.arrived == blk.block.live && blk.block.arrived > 0)
        complete(blk.block, 0, (unsigned)blk.fibers.size());
    if (--w.live > 0 && w.arrived == w.live && w.arrived > 0) complete(w, f.warp * 32, 32);
    yield_to_scheduler(true);
    std::abort();  // a finished fiber is never resumed
}

// Lays out a fresh stack so that emu_switch's epilogue "returns" into fiber_main with an ABI-aligned rsp.
void* initial_sp(char* stack) {
    auto* top = reinterpret_cast<uint64_t*>(((uintptr_t)(stack + kStackBytes)) & ~(uintptr_t)15);
    *--top = 0;                                     // fiber_main's (never used) return address
    *--top = reinterpret_cast<uint64_t>(&fiber_main);
    for (int i = 0; i < 6; ++i) *--top = 0;         // rbp rbx r12 r13 r14 r15
    return top;
}

// After a failed launch the parked fibers never resume: their stacks are free again.
void release_stacks(Block& b) {
    for (Fiber& f : b.fibers)
        if (f.stack) {
            g_free_stacks.push_back(f.stack);
            f.stack = nullptr;
        }
}

std::string describe_deadlock(const Block& b) {
    unsigned at_block = 0, at_warp = 0, done = 0;
    for (const Fiber& f : b.fibers) {
        if (f.state == State::Done) ++done;
        else if (f.waiting_on == &b.block) ++at_block;
        else ++at_warp;
    }
    char buf[256];
    std::snprintf(buf, sizeof buf, "%u threads wait at a block barrier, %u at a warp barrier, %u returned", at_block,
                  at_warp, done);
    return buf;
}

}  // namespace

Registrar::Registrar(const char* name, void (*invoke)(void**), unsigned max_threads, std::vector<size_t> arg_sizes,
                     std::vector<ArgRole> arg_roles) {
    registry()[name] = Kernel{name, invoke, max_threads, std::move(arg_sizes), std::move(arg_roles)};
}

const Kernel* find_kernel(const char* name) {
    auto it = registry().find(name);
    return it == registry().end() ? nullptr : &it->second;
}

std::string launch(const Kernel& k, uint3 grid, uint3 block, size_t smem_bytes, void** params) {
    // EMU_SCHEDULE=reverse runs the threads between two barriers from the last to the first, and the blocks
    // from the last to the first: a result that changes with the order is a race (a missing barrier or
    // fence), which one fixed order can hide.
    static const bool reverse = [] {
        const char* s = std::getenv("EMU_SCHEDULE");
        return s && std::string(s) == "reverse";
    }();
    static std::mutex serial;  // static __shared__ storage is one copy per kernel: one launch at a time
    std::lock_guard<std::mutex> lock(serial);
    const unsigned nthreads = block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > std::min(kMaxThreads, k.max_threads))
        return "block of " + std::to_string(nthreads) + " threads, but kernel " + k.name + " has __launch_bounds__(" +
               std::to_string(k.max_threads) + ")";
    // Exactly the bytes launched with (an EMU_ASAN build catches a kernel that goes past them), and not
    // zeroed, as on a GPU: NaN-patterned bytes make a read before a write visible.
    std::unique_ptr<void, decltype(&std::free)> smem(nullptr, &std::free);
    {
        void* p = nullptr;
        if (posix_memalign(&p, 128, std::max<size_t>(smem_bytes, 1)) != 0) return "cannot allocate shared memory";
        smem.reset(p);
        std::memset(p, 0xff, smem_bytes);
    }
    void* smem_base = smem.get();

    Block b;
    b.reverse = reverse;
    b.kernel = &k;
    b.params = params;
    b.bdim = block;
    b.gdim = grid;
    b.smem = smem_base;
    b.fibers.resize(nthreads);
    const unsigned nwarps = (nthreads + 31) / 32;
    b.warps.resize(nwarps);
    b.slots.resize(nwarps);
    b.uniform.resize(nwarps);
    // Static shared memory is poisoned once per launch: blocks then see what the previous block left, as
    // on a GPU, and a read before any write sees NaN.
    if (&__stop_emu_shared > &__start_emu_shared)
        std::memset(__start_emu_shared, 0xff, (size_t)(__stop_emu_shared - __start_emu_shared));
    g_block = &b;
#ifdef EMU_RACECHECK
    race::launch_begin(smem_base, smem_bytes, nthreads, (size_t)grid.x * grid.y * grid.z);
    struct End {
        ~End() { race::launch_end(); }
    } end_race;
#endif
    // Reverse order also runs the blocks last to first: a kernel whose blocks communicate (qgemm's split-K
    // "last block sums") must not depend on which block finishes first.
    for (unsigned zi = 0; zi < grid.z; ++zi)
        for (unsigned yi = 0; yi < grid.y; ++yi)
            for (unsigned xi = 0; xi < grid.x; ++xi) {
                const unsigned x = reverse ? grid.x - 1 - xi : xi, y = reverse ? grid.y - 1 - yi : yi,
                               z = reverse ? grid.z - 1 - zi : zi;
                b.bid = {x, y, z};
#ifdef EMU_RACECHECK
                race::block_begin();
#endif
                b.block = Barrier{};
                b.block.live = nthreads;
                for (unsigned w = 0; w < nwarps; ++w) {
                    b.warps[w] = Barrier{};
                    b.warps[w].live = std::min(32u, nthreads - 32 * w);
                }
                b.next.clear();
                for (auto& u : b.uniform) u.clear();
                for (unsigned i = 0; i < nthreads; ++i) {
                    Fiber& f = b.fibers[i];
                    f = Fiber{};
                    f.tid = {i % block.x, (i / block.x) % block.y, i / (block.x * block.y)};
                    f.lane = i % 32;
                    f.warp = i / 32;
                    b.next.push_back(reverse ? nthreads - 1 - i : i);
                }
                b.done = 0;
                // Rounds: run every runnable fiber once; barriers that complete queue their waiters next.
                while (!b.next.empty()) {
                    b.now.swap(b.next);
                    b.next.clear();
                    for (unsigned i : b.now) {
                        Fiber& f = b.fibers[i];
                        if (!f.stack) {
                            f.stack = take_stack();
                            f.sp = initial_sp(f.stack);
                        }
                        g_fiber = &f;
                        run_fiber(b, f);
                        if (f.state == State::Done) {  // off its stack now: the stack can be reused
                            g_free_stacks.push_back(f.stack);
                            f.stack = nullptr;
                        }
                        if (b.failure) {
                            release_stacks(b);
                            g_block = nullptr;
                            return std::string(b.failure) + " (kernel " + k.name + ", block " + std::to_string(x) +
                                   "," + std::to_string(y) + "," + std::to_string(z) + ")";
                        }
                    }
                }
                if (b.done != nthreads) {
                    release_stacks(b);
                    g_block = nullptr;
                    return "deadlock in kernel " + k.name + " block " + std::to_string(x) + "," + std::to_string(y) +
                           "," + std::to_string(z) + ": " + describe_deadlock(b);
                }
            }
    g_block = nullptr;
    return {};
}

// ---- the device-side API of cuda_emu.h -------------------------------------------------------------------

const uint3& thread_idx() { return g_fiber->tid; }
const uint3& block_idx() { return g_block->bid; }
const uint3& block_dim() { return g_block->bdim; }
const uint3& grid_dim() { return g_block->gdim; }
unsigned lane_id() { return g_fiber->lane; }
void* dyn_smem() { return g_block->smem; }

int block_barrier(int pred, int* and_out, int* count_out) {
    Barrier& b = g_block->block;
    arrive(b, pred, 0, (unsigned)g_block->fibers.size());
    if (and_out) *and_out = b.res_and;
    if (count_out) *count_out = b.res_count;
    return b.res_or;
}

void warp_barrier() {
    const unsigned w = g_fiber->warp;
    arrive(g_block->warps[w], 0, w * 32, 32);
}

void warp_gather(uint64_t v, uint64_t out[32]) {
    const unsigned w = g_fiber->warp;
    auto& slots = g_block->slots[w];
    // Lanes that have exited leave a 0, as ballot expects; live lanes overwrite theirs before the barrier.
    if (g_block->warps[w].arrived == 0)
        for (unsigned l = 0; l < 32; ++l) {
            const unsigned i = w * 32 + l;
            if (i >= g_block->fibers.size() || g_block->fibers[i].state == State::Done) slots[l] = 0;
        }
    slots[g_fiber->lane] = v;
    warp_barrier();
    std::memcpy(out, slots.data(), sizeof(uint64_t) * 32);
    warp_barrier();
}

void warp_uniform(const void* in, size_t n_in, void* out, size_t n_out, void (*compute)(const void*, void*)) {
    const unsigned w = g_fiber->warp;
    auto& calls = g_block->uniform[w];
    const uint64_t seq = g_fiber->uniform_calls++;
    auto it = calls.find(seq);
    if (it == calls.end()) {
        compute(in, out);
        const unsigned live = g_block->warps[w].live;
        if (live > 1) {
            UniformCall c{std::vector<unsigned char>((const unsigned char*)in, (const unsigned char*)in + n_in),
                          std::vector<unsigned char>((unsigned char*)out, (unsigned char*)out + n_out), live - 1};
            calls.emplace(seq, std::move(c));
        }
        return;
    }
    UniformCall& c = it->second;
    if (c.in.size() != n_in || std::memcmp(c.in.data(), in, n_in) != 0)
        fail("a warp-collective operation (wmma::mma_sync) got different fragments in lanes of one warp");
    std::memcpy(out, c.out.data(), n_out);
    if (--c.left == 0) calls.erase(it);
}

void fail(const char* what) {
    // Unwinding across fibers is not possible: record the failure and park this fiber for good.
    g_block->failure = what;
    g_fiber->state = State::Waiting;
    g_fiber->waiting_on = nullptr;
    yield_to_scheduler();
    std::abort();
}

}  // namespace emu
