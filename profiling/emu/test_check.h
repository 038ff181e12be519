// test_check.h — what the emulator's own tests share (test_emu.cpp, test_streams.cpp, test_order.cpp): the
// CHECK macro, which prints the first 20 failures with their line and counts them all in g_failures (main()
// turns it into the exit code), and in_child, for cases that end their process.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

static int g_failures = 0;
#define CHECK(cond, ...)                                              \
    do {                                                              \
        if (!(cond) && ++g_failures <= 20) {                          \
            std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            std::fprintf(stderr, __VA_ARGS__);                        \
            std::fprintf(stderr, "\n");                               \
        }                                                             \
    } while (0)

// Runs body() in a child process with its stderr captured, and returns the child's exit code (body's
// return value; -1 if it did not exit normally) and its stderr. For a case that ends the process (UBSan)
// or leaves it unusable (a sticky CUDA error).
struct ChildResult {
    int code;
    std::string err;
};
template <class F>
ChildResult in_child(F body) {
    int fds[2];
    if (pipe(fds) != 0) std::abort();
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        const int code = body();
        std::fflush(nullptr);
        std::_Exit(code);
    }
    close(fds[1]);
    ChildResult r{-1, {}};
    char buf[4096];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) r.err.append(buf, (size_t)n);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status)) r.code = WEXITSTATUS(status);
    return r;
}
