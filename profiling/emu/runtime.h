// runtime.h — the kernel registry and launch entry of the CUDA emulator (profiling/emu/README.md).
// Generated kernel translation units register each `extern "C"` kernel by name; the fake driver
// (driver.cpp) finds it for cuModuleGetFunction and runs it for cuLaunchKernel.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3;

namespace emu {

struct Kernel {
    std::string name;
    void (*invoke)(void** params);  // calls the kernel with cuLaunchKernel's argument array
    unsigned max_threads;           // its __launch_bounds__: a larger block fails to launch on a GPU
    std::vector<size_t> arg_sizes;  // bytes of each argument: a queued launch copies them (streams.h)
};

struct Registrar {
    Registrar(const char* name, void (*invoke)(void**), unsigned max_threads, std::vector<size_t> arg_sizes);
};

const Kernel* find_kernel(const char* name);

// Runs the whole grid synchronously; returns an empty string, or what went wrong (deadlock, emu::fail).
std::string launch(const Kernel& k, uint3 grid, uint3 block, size_t smem_bytes, void** params);

// cuLaunchKernel passes one pointer per argument; the kernel's own signature says how to read each.
template <class... A, size_t... I>
void invoke_with(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}
template <class... A>
void invoke(void (*f)(A...), void** p) {
    invoke_with(f, p, std::index_sequence_for<A...>{});
}
template <class... A>
std::vector<size_t> arg_sizes(void (*)(A...)) {
    return {sizeof(std::remove_cv_t<std::remove_reference_t<A>>)...};
}

}  // namespace emu

#define EMU_REGISTER(name, max_threads) \
    static emu::Registrar emu_registrar_##name(#name, [](void** p) { emu::invoke(&name, p); }, (max_threads), \
                                               emu::arg_sizes(&name));
