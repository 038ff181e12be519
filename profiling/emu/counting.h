// counting.h — how the fake driver feeds the counters of counters.h (profiling/emu/README.md, "Counters").
// The driver calls these at each API entry point once the call's arguments are checked; counters.cpp keeps the
// numbers under one lock, answers boa_emu_counters_get and boa_emu_counter_name, and writes EMU_COUNTERS's JSON at
// exit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "counters.h"

namespace emu::counters {

// One more of `field` (a count), or `n` more (bytes).
void add(uint64_t boa_emu_counters::*field, uint64_t n = 1);
// Two at once under one lock: a copy's count and its bytes, an allocation's count and its bytes.
void add2(uint64_t boa_emu_counters::*count, uint64_t boa_emu_counters::*bytes, uint64_t n);
// The device bytes allocated now; the peak follows.
void device_live(uint64_t bytes);
// A launch of the kernel `name`, or a library call `fn` (cuBLAS or cuSOLVER, told apart by its prefix).
void launch(const std::string& name);
void library_call(const char* fn);

// Defined in driver.cpp, which knows the mode: the BOA_EMU_* flags and the device name.
uint64_t mode_flags();
std::string device_name();

}  // namespace emu::counters
