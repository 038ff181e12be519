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

// A kernel argument as the stream-order check (streamorder.h) sees it: a pointer to const memory is read, any
// other pointer may be written (the signature is all the driver knows of a launch's accesses).
enum class ArgRole : unsigned char { Value, Reads, Writes };

struct Kernel {
    std::string name;
    void (*invoke)(void** params);  // calls the kernel with cuLaunchKernel's argument array
    unsigned max_threads;           // its __launch_bounds__: a larger block fails to launch on a GPU
    std::vector<size_t> arg_sizes;  // bytes of each argument: a queued launch copies them (streams.h)
    std::vector<ArgRole> arg_roles; // what each argument lets it do to memory (the stream-order check)
};

struct Registrar {
    Registrar(const char* name, void (*invoke)(void**), unsigned max_threads, std::vector<size_t> arg_sizes,
              std::vector<ArgRole> arg_roles);
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
template <class A>
constexpr ArgRole arg_role() {
    using T = std::remove_cv_t<std::remove_reference_t<A>>;
    if constexpr (!std::is_pointer_v<T>) return ArgRole::Value;
    else return std::is_const_v<std::remove_pointer_t<T>> ? ArgRole::Reads : ArgRole::Writes;
}
template <class... A>
std::vector<ArgRole> arg_roles(void (*)(A...)) {
    return {arg_role<A>()...};
}

}  // namespace emu

#define EMU_REGISTER(name, max_threads) \
    static emu::Registrar emu_registrar_##name(#name, [](void** p) { emu::invoke(&name, p); }, (max_threads), \
                                               emu::arg_sizes(&name), emu::arg_roles(&name));
