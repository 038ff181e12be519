// counters.cpp — the counters of counters.h: kept under one lock, read by boa_emu_counters_get and
// boa_emu_counter_name, written as JSON at exit when EMU_COUNTERS names a file (profiling/emu/README.md,
// "Counters"). The driver feeds them through counting.h.

#include "counting.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#define EMU_API extern "C" __attribute__((visibility("default")))

namespace emu::counters {
namespace {

struct State {
    std::mutex mu;
    boa_emu_counters c{};
    std::map<std::string, uint64_t> kernels, calls;  // launches by kernel name, library calls by function
};

// Never destroyed: the JSON is written by an atexit handler, which may run after static destructors.
State& state() {
    static State* s = new State;
    return *s;
}

// Every field after `flags`, by its name in counters.h, for the JSON. The static_assert below keeps the
// table complete when a field is appended.
struct Field {
    const char* name;
    uint64_t boa_emu_counters::*f;
};
#define F(x) {#x, &boa_emu_counters::x}
constexpr Field kFields[] = {
    F(h2d_pageable_copies), F(h2d_pageable_bytes), F(h2d_locked_copies), F(h2d_locked_bytes),
    F(d2h_pageable_copies), F(d2h_pageable_bytes), F(d2h_locked_copies), F(d2h_locked_bytes),
    F(d2d_copies), F(d2d_bytes), F(h2h_copies), F(h2h_bytes), F(memsets), F(memset_bytes),
    F(host_syncs), F(stream_syncs), F(context_syncs), F(event_syncs), F(copy_syncs), F(free_syncs),
    F(queries), F(stream_waits), F(event_records),
    F(kernel_launches), F(cublas_calls), F(cusolver_calls),
    F(device_allocs), F(device_alloc_bytes), F(device_frees), F(device_free_bytes), F(device_bytes_live),
    F(device_bytes_peak), F(host_allocs), F(host_alloc_bytes), F(host_frees), F(host_free_bytes),
    F(host_registers), F(host_register_bytes), F(copy_ns),
};
#undef F
static_assert(sizeof(boa_emu_counters) == 16 + 8 * (sizeof kFields / sizeof kFields[0]),
              "counters.h gained a field that kFields does not list");

// A snapshot: the sum of the synchronizations and the mode are filled in here, not kept.
boa_emu_counters snapshot() {
    State& s = state();
    boa_emu_counters c;
    {
        std::lock_guard<std::mutex> l(s.mu);
        c = s.c;
    }
    c.version = BOA_EMU_COUNTERS_VERSION;
    c.size = sizeof c;
    c.flags = mode_flags();
    c.host_syncs = c.stream_syncs + c.context_syncs + c.event_syncs + c.copy_syncs + c.free_syncs;
    return c;
}

void put_string(FILE* f, const std::string& s) {
    std::fputc('"', f);
    for (char ch : s) {
        if (ch == '"' || ch == '\\') std::fputc('\\', f);
        if ((unsigned char)ch < 0x20) std::fprintf(f, "\\u%04x", (unsigned)ch);
        else std::fputc(ch, f);
    }
    std::fputc('"', f);
}

void put_table(FILE* f, const char* key, const std::map<std::string, uint64_t>& m) {
    std::fprintf(f, ",\n  \"%s\": {", key);
    const char* sep = "\n    ";
    for (const auto& [name, n] : m) {
        std::fputs(sep, f);
        put_string(f, name);
        std::fprintf(f, ": %llu", (unsigned long long)n);
        sep = ",\n    ";
    }
    std::fputs(m.empty() ? "}" : "\n  }", f);
}

// EMU_COUNTERS's file, "%p" replaced by the process id.
std::string json_path() {
    const char* e = std::getenv("EMU_COUNTERS");
    std::string p = e ? e : "";
    if (size_t at = p.find("%p"); at != std::string::npos) p.replace(at, 2, std::to_string(getpid()));
    return p;
}

void write_json() {
    const std::string path = json_path();
    FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
        std::fprintf(stderr, "emu: EMU_COUNTERS: cannot write %s\n", path.c_str());
        return;
    }
    const boa_emu_counters c = snapshot();
    std::fprintf(f, "{\n  \"version\": %u,\n  \"device\": ", c.version);
    put_string(f, device_name());
    std::fprintf(f, ",\n  \"flags\": %llu,\n  \"counters\": {", (unsigned long long)c.flags);
    const char* sep = "\n    ";
    for (const Field& x : kFields) {
        std::fprintf(f, "%s\"%s\": %llu", sep, x.name, (unsigned long long)(c.*x.f));
        sep = ",\n    ";
    }
    std::fputs("\n  }", f);
    State& s = state();
    {
        std::lock_guard<std::mutex> l(s.mu);
        put_table(f, "kernels", s.kernels);
        put_table(f, "library_calls", s.calls);
    }
    std::fputs("\n}\n", f);
    std::fclose(f);
}

// Armed when the library loads: the handler must be registered before anything it reads could be torn down.
__attribute__((constructor)) void arm_json() {
    if (const char* e = std::getenv("EMU_COUNTERS"); e && *e) std::atexit(write_json);
}

}  // namespace

void add(uint64_t boa_emu_counters::*field, uint64_t n) {
    State& s = state();
    std::lock_guard<std::mutex> l(s.mu);
    s.c.*field += n;
}

void add2(uint64_t boa_emu_counters::*count, uint64_t boa_emu_counters::*bytes, uint64_t n) {
    State& s = state();
    std::lock_guard<std::mutex> l(s.mu);
    s.c.*count += 1;
    s.c.*bytes += n;
}

void device_live(uint64_t bytes) {
    State& s = state();
    std::lock_guard<std::mutex> l(s.mu);
    s.c.device_bytes_live = bytes;
    if (bytes > s.c.device_bytes_peak) s.c.device_bytes_peak = bytes;
}

void launch(const std::string& name) {
    State& s = state();
    std::lock_guard<std::mutex> l(s.mu);
    ++s.c.kernel_launches;
    ++s.kernels[name];
}

void library_call(const char* fn) {
    State& s = state();
    std::lock_guard<std::mutex> l(s.mu);
    if (std::strncmp(fn, "cusolver", 8) == 0) ++s.c.cusolver_calls;
    else ++s.c.cublas_calls;
    ++s.calls[fn];
}

}  // namespace emu::counters

EMU_API int boa_emu_counters_get(boa_emu_counters* out) {
    if (out == nullptr || out->size < 8) return -1;
    const boa_emu_counters c = emu::counters::snapshot();
    const uint32_t n = out->size < sizeof c ? out->size : (uint32_t)sizeof c;
    std::memcpy(out, &c, n);
    out->size = n;
    return 0;
}

EMU_API int boa_emu_counter_name(int table, size_t index, const char** name, uint64_t* count) {
    if ((table != 0 && table != 1) || name == nullptr || count == nullptr) return -1;
    auto& s = emu::counters::state();
    std::lock_guard<std::mutex> l(s.mu);
    const auto& m = table == 0 ? s.kernels : s.calls;
    if (index >= m.size()) return 1;
    auto it = m.begin();
    std::advance(it, (long)index);
    *name = it->first.c_str();  // map nodes never move or go: valid for the process's life
    *count = it->second;
    return 0;
}
