// racecheck.cpp — the race check of racecheck.h (shared and device memory), behind the __tsan_* hooks that
// -fsanitize=thread makes the kernels call (no ThreadSanitizer runtime is linked).
#include "racecheck.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_emu.h"

extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

namespace emu::race {
namespace {

constexpr uint32_t kMixed = ~0u;          // reads from more than one warp since the last write
constexpr uint32_t kWarpActor = 1u << 31;  // actor id of a whole warp (wmma), or'ed with the warp

// One access: who, and between which barriers.
struct Stamp {
    uint64_t bepoch = 0;  // block epoch: 0 never matches a live one
    uint32_t wepoch = 0;  // the warp's epoch within it
    uint32_t actor = 0;   // thread index in the block, or kWarpActor | warp
    uint32_t warp = 0;
    const void* pc = nullptr;
};

// Per byte of shared memory: the last write, and the reads since it in its block epoch (the warp they came
// from, or kMixed; the newest warp epoch among them, its reader, and whether another thread read then too).
struct Cell {
    Stamp write;
    Stamp read;
    bool read_multi = false;
};

// Per byte of device memory written in this launch: the last write. 24 bytes a byte, in pages made on the
// first write and dropped at the end of the launch.
struct GCell {
    uint32_t epoch = 0;  // block epoch, counted from the launch's (0: not written in this launch)
    uint32_t block = 0;  // the block, in the order the launch ran them
    uint32_t wepoch = 0;
    uint16_t actor = 0;  // thread index in the block, or kGWarp | warp
    uint16_t published = 0;
    const void* pc = nullptr;
};
constexpr uint16_t kGWarp = 1u << 15;
constexpr size_t kPageBits = 12, kPage = size_t(1) << kPageBits;

struct State {
    bool active = false;
    uint64_t bepoch = 0;  // never reset: stamps of earlier launches and blocks never match
    std::vector<uint32_t> wepoch;
    char* dyn = nullptr;
    size_t dyn_bytes = 0;
    std::vector<Cell> dyn_cells, static_cells;
    std::string failure;
    // Device memory. Live allocations, base → bytes: other host threads (cargo's test threads) allocate and
    // free while a launch runs, so the table has a lock, and a change of it empties device_memory's caches.
    std::mutex tracked_mu;
    std::map<uintptr_t, size_t> tracked;
    std::atomic<uint64_t> tracked_gen{0};
    uint64_t hit_gen = ~uint64_t(0);
    uintptr_t hit_lo = 0, hit_hi = 0, miss_lo = 0, miss_hi = 0;  // device_memory's caches
    uint64_t launch_epoch = 0;           // bepoch at launch_begin
    uint32_t block = 0;                  // this block's index in the launch (blocks run one at a time)
    std::vector<uint3> block_coords;     // blockIdx of each block run so far
    std::vector<uint32_t> fence_epoch;   // per block: the newest epoch in which one of its threads fenced
    uint32_t atomic_epoch = UINT32_MAX;  // this block's first epoch with an atomic on device memory
    std::vector<uint8_t> acquired;       // per thread of this block: ran an atomic on device memory
    std::vector<std::vector<std::pair<uintptr_t, size_t>>> unfenced;  // per thread: its writes since its fence
    std::unordered_map<uintptr_t, std::unique_ptr<GCell[]>> pages;
    uintptr_t last_page = ~uintptr_t(0);
    GCell* last_cells = nullptr;
} g;

thread_local int t_quiet = 0, t_warp_wide = 0;

// The running thread's index in its block.
uint32_t linear_tid() {
    const uint3 t = thread_idx(), d = block_dim();
    return t.x + d.x * (t.y + d.y * t.z);
}

// The current block epoch, counted from the launch's (GCell::epoch).
uint32_t launch_relative_epoch() { return (uint32_t)(g.bepoch - g.launch_epoch); }

// The two accesses are ordered: same thread, a block barrier between them, or, for one warp, a warp barrier.
bool ordered(const Stamp& a, const Stamp& b) {
    return a.actor == b.actor || a.bepoch != b.bepoch || (a.warp == b.warp && a.wepoch != b.wepoch);
}

std::string where(const void* pc) {
    Dl_info info{};
    char buf[96];
    if (pc && dladdr(pc, &info) && info.dli_fname) {
        const char* base = std::strrchr(info.dli_fname, '/');
        std::snprintf(buf, sizeof buf, "%s+0x%zx", base ? base + 1 : info.dli_fname,
                      (size_t)((const char*)pc - (const char*)info.dli_fbase));
        return buf;
    }
    std::snprintf(buf, sizeof buf, "%p", pc);
    return buf;
}

std::string who(const Stamp& s) {
    if (s.actor & kWarpActor) return "warp " + std::to_string(s.warp) + " (wmma)";
    return "thread " + std::to_string(s.actor);
}

[[noreturn]] void report(const char* kind, const char* region, size_t offset, const Stamp& now, const Stamp& then,
                         const char* then_did) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s race on byte %zu of %s: ", kind, offset, region);
    g.failure = buf + who(now) + " at " + where(now.pc) + " and " + who(then) + " " + then_did + " at " +
                where(then.pc) + ", with no barrier between them (addr2line -f -i -e <library> <offset>)";
    fail(g.failure.c_str());
    std::abort();  // fail() does not return
}

// Whether a is in a live allocation. [hit_lo, hit_hi) caches the allocation found last, and
// [miss_lo, miss_hi) the gap between allocations found last (the fibers' stacks are in one), so that most
// lookups take neither the lock nor the map.
bool device_memory(uintptr_t a) {
    const uint64_t gen = g.tracked_gen.load(std::memory_order_acquire);
    if (gen == g.hit_gen) {
        if (a >= g.hit_lo && a < g.hit_hi) return true;
        if (a >= g.miss_lo && a < g.miss_hi) return false;
    } else {
        g.hit_gen = gen;
        g.hit_lo = g.hit_hi = g.miss_lo = g.miss_hi = 0;
    }
    std::lock_guard<std::mutex> l(g.tracked_mu);
    auto next = g.tracked.upper_bound(a);
    uintptr_t gap_lo = 0;
    if (next != g.tracked.begin()) {
        auto it = std::prev(next);
        if (a < it->first + it->second) {
            g.hit_lo = it->first;
            g.hit_hi = it->first + it->second;
            return true;
        }
        gap_lo = it->first + it->second;
    }
    g.miss_lo = gap_lo;
    g.miss_hi = next == g.tracked.end() ? UINTPTR_MAX : next->first;
    return false;
}

GCell& gcell(uintptr_t a) {
    const uintptr_t page = a >> kPageBits;
    if (page != g.last_page) {
        auto& cells = g.pages[page];
        if (!cells) cells.reset(new GCell[kPage]);
        g.last_page = page;
        g.last_cells = cells.get();
    }
    return g.last_cells[a & (kPage - 1)];
}

std::string gwho(const GCell& c) {
    const uint3 b = g.block_coords[c.block];
    const std::string t = (c.actor & kGWarp) ? "warp " + std::to_string(c.actor & ~kGWarp) + " (wmma)"
                                             : "thread " + std::to_string(c.actor);
    return t + " of block (" + std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

uint32_t actor_warp(uint16_t actor) { return actor & kGWarp ? actor & ~kGWarp : actor / 32u; }

// A write released to other blocks: its thread fenced after it, or its block did at a later epoch.
bool published(const GCell& w) { return w.published || g.fence_epoch[w.block] > w.epoch; }

// Whether `then`, a write of this launch, is ordered before an access by `now` (in this block).
bool gordered(const GCell& then, const GCell& now) {
    if (then.epoch == 0) return true;
    if (then.block == now.block)
        return then.actor == now.actor || then.epoch != now.epoch ||
               (actor_warp(then.actor) == actor_warp(now.actor) && then.wepoch != now.wepoch);
    const bool acquired = g.atomic_epoch < now.epoch || (!(now.actor & kGWarp) && g.acquired[now.actor]);
    return published(then) && acquired;
}

void gcheck(uintptr_t a, size_t n, bool write, const void* pc, uint32_t tid, uint32_t warp) {
    n = std::min(n, (size_t)(g.hit_hi - a));
    GCell now;
    now.epoch = launch_relative_epoch();
    now.block = g.block;
    now.wepoch = g.wepoch[warp];
    now.actor = t_warp_wide ? (uint16_t)(kGWarp | warp) : (uint16_t)tid;
    now.pc = pc;
    for (size_t i = 0; i < n; ++i) {
        GCell& cell = gcell(a + i);
        if (!gordered(cell, now)) {
            char buf[200];
            std::snprintf(buf, sizeof buf, "%s race on byte %zu of the device allocation at 0x%zx (%zu bytes): ",
                          write ? "write-after-write" : "read-after-write", (size_t)(a + i - g.hit_lo),
                          (size_t)g.hit_lo, (size_t)(g.hit_hi - g.hit_lo));
            const char* why = ", with no barrier between them";
            if (cell.block != now.block)
                why = published(cell) ? ", with no atomic on device memory before the access (an acquire)"
                          : ", with no __threadfence() after the write (no release)";
            g.failure = buf + gwho(now) + " at " + where(now.pc) + " and " + gwho(cell) + " wrote it at " +
                        where(cell.pc) + why + " (addr2line -f -i -e <library> <offset>)";
            fail(g.failure.c_str());
            std::abort();
        }
        if (write) cell = now;
    }
    if (write) {  // a wmma store goes on the list of every lane that runs it: any of them may fence for it
        auto& mine = g.unfenced[tid];
        if (!mine.empty() && mine.back().first + mine.back().second == a) mine.back().second += n;
        else mine.emplace_back(a, n);
    }
}

void check(const void* p, size_t n, bool write, const void* pc) {
    if (!g.active || t_quiet) return;
    const char* c = static_cast<const char*>(p);
    Cell* cells;
    const char* region;
    size_t off;
    if (g.dyn && c >= g.dyn && c < g.dyn + g.dyn_bytes) {
        cells = g.dyn_cells.data();
        region = "dynamic shared memory";
        off = (size_t)(c - g.dyn);
        n = std::min(n, g.dyn_bytes - off);
    } else if (c >= __start_emu_shared && c < __stop_emu_shared) {
        cells = g.static_cells.data();
        region = "the static shared memory section (every kernel's __shared__ variables)";
        off = (size_t)(c - __start_emu_shared);
        n = std::min(n, (size_t)(__stop_emu_shared - c));
    } else if (device_memory((uintptr_t)p)) {
        cells = nullptr;
    } else {
        return;  // the fiber's stack, host memory
    }
    const uint32_t tid = linear_tid(), warp = tid / 32;
    if (!cells) return gcheck((uintptr_t)p, n, write, pc, tid, warp);
    Stamp now{g.bepoch, g.wepoch[warp], t_warp_wide ? (kWarpActor | warp) : tid, warp, pc};
    for (size_t i = off; i < off + n; ++i) {
        Cell& cell = cells[i];
        if (!ordered(now, cell.write))
            report(write ? "write-after-write" : "read-after-write", region, i, now, cell.write, "wrote it");
        if (!write) {
            if (cell.read.bepoch != now.bepoch) {
                cell.read = now;
                cell.read_multi = false;
            } else if (cell.read.warp != now.warp) {
                cell.read.warp = kMixed;
                cell.read.pc = pc;
            } else if (now.wepoch != cell.read.wepoch) {  // newer: reads before it are ordered with later writes
                cell.read = now;
                cell.read_multi = false;
            } else if (now.actor != cell.read.actor) {
                cell.read_multi = true;
            }
            continue;
        }
        // A write conflicts with a read of this block epoch from another warp, or of this warp epoch by
        // another thread of this warp.
        if (cell.read.bepoch == now.bepoch) {
            const bool other_warp = cell.read.warp != now.warp;  // kMixed included
            const bool same_interval = !other_warp && cell.read.wepoch == now.wepoch;
            if (other_warp || (same_interval && (cell.read_multi || cell.read.actor != now.actor)))
                report("write-after-read", region, i, now, cell.read,
                       cell.read.warp == kMixed ? "(or another warp) read it" : "read it");
        }
        cell.write = now;
        cell.read = Stamp{};
        cell.read_multi = false;
    }
}

}  // namespace

void launch_begin(void* dyn_smem, size_t bytes, unsigned nthreads, size_t nblocks) {
    g.active = true;
    g.dyn = static_cast<char*>(dyn_smem);
    g.dyn_bytes = bytes;
    if (g.dyn_cells.size() < bytes) g.dyn_cells.resize(bytes);
    const size_t s = (size_t)(__stop_emu_shared - __start_emu_shared);
    if (g.static_cells.size() < s) g.static_cells.resize(s);
    g.wepoch.assign((nthreads + 31) / 32, 0);
    g.launch_epoch = g.bepoch;
    g.block = UINT32_MAX;  // block_begin makes it 0
    g.block_coords.clear();
    g.block_coords.reserve(nblocks);
    g.fence_epoch.assign(nblocks, 0);
    g.acquired.assign(nthreads, 0);
    g.unfenced.assign(nthreads, {});
    t_quiet = t_warp_wide = 0;  // a launch that failed inside a guarded region never left it
}

void launch_end() {
    g.active = false;
    g.dyn = nullptr;
    g.pages.clear();  // device memory is checked within one launch
    g.last_page = ~uintptr_t(0);
    g.last_cells = nullptr;
}

void block_begin() {
    ++g.bepoch;
    ++g.block;
    g.block_coords.push_back(block_idx());
    g.atomic_epoch = UINT32_MAX;
    std::fill(g.acquired.begin(), g.acquired.end(), 0);
    for (auto& u : g.unfenced) u.clear();
}
void block_barrier() { ++g.bepoch; }
void warp_barrier(unsigned w) { ++g.wepoch[w]; }

void track(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> l(g.tracked_mu);
    g.tracked[(uintptr_t)p] = bytes;
    g.tracked_gen.fetch_add(1, std::memory_order_release);
}
void untrack(const void* p) {
    std::lock_guard<std::mutex> l(g.tracked_mu);
    g.tracked.erase((uintptr_t)p);
    g.tracked_gen.fetch_add(1, std::memory_order_release);
}

void fence() {
    if (!g.active) return;
    const uint32_t tid = linear_tid();
    const uint16_t warp_actor = (uint16_t)(kGWarp | (tid / 32));
    g.fence_epoch[g.block] = launch_relative_epoch();  // publishes the block's earlier epochs
    for (const auto& [a, n] : g.unfenced[tid])  // and this thread's writes of this one
        for (size_t i = 0; i < n; ++i) {
            GCell& c = gcell(a + i);
            if (c.block == g.block && (c.actor == tid || c.actor == warp_actor)) c.published = 1;
        }
    g.unfenced[tid].clear();
}

Quiet::Quiet(const void* atomic_target) {
    ++t_quiet;
    if (g.active && atomic_target && device_memory((uintptr_t)atomic_target)) {
        g.acquired[linear_tid()] = 1;
        g.atomic_epoch = std::min(g.atomic_epoch, launch_relative_epoch());
    }
}
Quiet::~Quiet() { --t_quiet; }
WarpWide::WarpWide() { ++t_warp_wide; }
WarpWide::~WarpWide() { --t_warp_wide; }

}  // namespace emu::race

// ---- the hooks -fsanitize=thread calls -------------------------------------------------------------------

// Hidden: only the kernels of this library (or test program) call them.
#define EMU_TSAN_API extern "C"
#define EMU_TSAN_ACCESS(n)                                                                                    \
    EMU_TSAN_API void __tsan_read##n(void* p) { emu::race::check(p, n, false, __builtin_return_address(0)); }  \
    EMU_TSAN_API void __tsan_write##n(void* p) { emu::race::check(p, n, true, __builtin_return_address(0)); }  \
    EMU_TSAN_API void __tsan_unaligned_read##n(void* p) {                                                    \
        emu::race::check(p, n, false, __builtin_return_address(0));                                         \
    }                                                                                                       \
    EMU_TSAN_API void __tsan_unaligned_write##n(void* p) {                                                   \
        emu::race::check(p, n, true, __builtin_return_address(0));                                          \
    }
EMU_TSAN_ACCESS(1)
EMU_TSAN_ACCESS(2)
EMU_TSAN_ACCESS(4)
EMU_TSAN_ACCESS(8)
EMU_TSAN_ACCESS(16)
EMU_TSAN_API void __tsan_read_range(void* p, unsigned long n) {
    emu::race::check(p, n, false, __builtin_return_address(0));
}
EMU_TSAN_API void __tsan_write_range(void* p, unsigned long n) {
    emu::race::check(p, n, true, __builtin_return_address(0));
}
EMU_TSAN_API void __tsan_init() {}
EMU_TSAN_API void __tsan_func_entry(void*) {}
EMU_TSAN_API void __tsan_func_exit() {}
// Static-local guards and the like: really atomic, never shared memory.
EMU_TSAN_API uint8_t __tsan_atomic8_load(const volatile uint8_t* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); }
EMU_TSAN_API void __tsan_atomic8_store(volatile uint8_t* a, uint8_t v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }
EMU_TSAN_API uint32_t __tsan_atomic32_load(const volatile uint32_t* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); }
EMU_TSAN_API void __tsan_atomic32_store(volatile uint32_t* a, uint32_t v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }
