#!/usr/bin/env bash
# Runs a command with the CPU emulator's libcuda/libcublas/libcusolver first on the library path, so cudarc
# loads them instead of a real driver (profiling/emu/README.md). Build them first with build.sh.
#
#   profiling/emu/run.sh cargo test --release --test parity_quant
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
if [[ "${EMU_ASAN:-0}" == 1 ]]; then
    out="$root/${EMU_DIR:-target/cuda-emu-asan}"
    # The Rust binaries are not instrumented: the sanitizer runtime must be loaded first. Leak checking is
    # off (the test harness and cudarc keep handles for the process's life); the first error ends the run.
    export LD_PRELOAD="$("${CXX:-g++}" -print-file-name=libasan.so)${LD_PRELOAD:+:$LD_PRELOAD}"
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1}"
elif [[ "${EMU_RACECHECK:-0}" == 1 ]]; then
    out="$root/${EMU_DIR:-target/cuda-emu-race}"
else
    out="$root/${EMU_DIR:-target/cuda-emu}"
fi
[[ -f "$out/libcuda.so" ]] || { echo "run.sh: $out/libcuda.so missing: run profiling/emu/build.sh" >&2; exit 1; }
export LD_LIBRARY_PATH="$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The kernels' registers and static shared memory as ptxas gave them in the real build (resources.h): the
# newest report cargo's build.rs wrote, unless EMU_PTXAS_REPORT is set (empty: launch limits without them).
if [[ -z "${EMU_PTXAS_REPORT+set}" ]]; then
    report="$(ls -t "${CARGO_TARGET_DIR:-$root/target}"/release/build/boa-cuda-*/out/ptxas_report.txt 2>/dev/null \
        | head -n1 || true)"
    [[ -n "$report" ]] && export EMU_PTXAS_REPORT="$report"
fi
exec "$@"
