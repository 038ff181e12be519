// resources.cpp — reads ptxas's resource report (resources.h).
#include "resources.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>

namespace emu::resources {
namespace {

struct Table {
    std::map<std::string, Usage> usage;
    std::string path;
};

// The report lists every entry function once per target ("Compiling entry function 'K' for 'sm_90a'"), its
// resources two lines on ("Used R registers, …, S bytes smem"; no smem part when it has none). The H200 runs
// the sm_90a code; a report built for sm_90 only serves too.
const Table& table() {
    static const Table t = [] {
        Table t;
        const char* path = std::getenv("EMU_PTXAS_REPORT");
        if (!path || !*path) return t;
        std::ifstream in(path);
        if (!in) {
            std::fprintf(stderr, "emu: EMU_PTXAS_REPORT=%s cannot be read; launch resources are not checked\n", path);
            return t;
        }
        const std::regex entry(R"(Compiling entry function '(\w+)' for '(sm_\w+)')");
        const std::regex used(R"(Used (\d+) registers(?:.*?, (\d+) bytes smem)?)");
        std::map<std::string, std::map<std::string, Usage>> by_arch;
        std::string line, kernel, arch;
        std::smatch m;
        while (std::getline(in, line)) {
            if (std::regex_search(line, m, entry)) {
                kernel = m[1];
                arch = m[2];
            } else if (!kernel.empty() && std::regex_search(line, m, used)) {
                by_arch[arch][kernel] = {std::stoi(m[1]), m[2].matched ? std::stoi(m[2]) : 0};
                kernel.clear();
            }
        }
        for (const char* want : {"sm_90a", "sm_90"}) {
            if (auto it = by_arch.find(want); it != by_arch.end()) {
                t.usage = it->second;
                t.path = path;
                break;
            }
        }
        if (t.path.empty())
            std::fprintf(stderr, "emu: %s lists no sm_90a or sm_90 kernel; launch resources are not checked\n", path);
        return t;
    }();
    return t;
}

}  // namespace

bool loaded() { return !table().path.empty(); }

std::string source() {
    const Table& t = table();
    return t.path.empty() ? "" : t.path + " (" + std::to_string(t.usage.size()) + " kernels)";
}

const Usage* find(const std::string& kernel) {
    const Table& t = table();
    auto it = t.usage.find(kernel);
    return it == t.usage.end() ? nullptr : &it->second;
}

}  // namespace emu::resources
