// racecheck.cpp — the shared-memory race check of racecheck.h, behind the __tsan_* hooks that
// -fsanitize=thread makes the kernels call (no ThreadSanitizer runtime is linked).
#include "racecheck.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

struct State {
    bool active = false;
    uint64_t bepoch = 0;  // never reset: stamps of earlier launches and blocks never match
    std::vector<uint32_t> wepoch;
    char* dyn = nullptr;
    size_t dyn_bytes = 0;
    std::vector<Cell> dyn_cells, static_cells;
    std::string failure;
} g;

thread_local int t_quiet = 0, t_warp_wide = 0;

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
    } else {
        return;
    }
    const uint3 t = thread_idx(), d = block_dim();
    const uint32_t tid = t.x + d.x * (t.y + d.y * t.z), warp = tid / 32;
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

void launch_begin(void* dyn_smem, size_t bytes, unsigned nwarps) {
    g.active = true;
    g.dyn = static_cast<char*>(dyn_smem);
    g.dyn_bytes = bytes;
    if (g.dyn_cells.size() < bytes) g.dyn_cells.resize(bytes);
    const size_t s = (size_t)(__stop_emu_shared - __start_emu_shared);
    if (g.static_cells.size() < s) g.static_cells.resize(s);
    g.wepoch.assign(nwarps, 0);
    t_quiet = t_warp_wide = 0;  // a launch that failed inside a guarded region never left it
}

void launch_end() {
    g.active = false;
    g.dyn = nullptr;
}

void block_begin() { ++g.bepoch; }
void block_barrier() { ++g.bepoch; }
void warp_barrier(unsigned w) { ++g.wepoch[w]; }

Quiet::Quiet() { ++t_quiet; }
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
