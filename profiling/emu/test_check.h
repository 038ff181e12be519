// test_check.h — the CHECK macro of the emulator's own tests (test_emu.cpp, test_streams.cpp): prints the
// first 20 failures with their line and counts them all in g_failures, which main() turns into the exit code.
#pragma once

#include <cstdio>

static int g_failures = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond) && ++g_failures <= 20) {                          \
            std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            std::fprintf(stderr, __VA_ARGS__);                        \
            std::fprintf(stderr, "\n");                               \
        }                                                             \
    } while (0)
