#!/usr/bin/env bash
# Builds the CPU emulator of the CUDA stack (profiling/emu/README.md) into $EMU_DIR (default
# target/cuda-emu): libcuda.so (the fake driver, the fiber runtime and every kernel of cuda/*.cu, compiled by
# g++ from the unchanged sources), libcublas.so and libcusolver.so.
# EMU_ASAN=1 builds the AddressSanitizer variant into target/cuda-emu-asan (run.sh with EMU_ASAN=1 uses it);
# EMU_RACECHECK=1 the race check of racecheck.h (shared and device memory) into target/cuda-emu-race (likewise).
#
#   profiling/emu/build.sh            then   profiling/emu/run.sh cargo test --release --test parity_ops
#
# Needs g++ ≥ 12 (C++20, _Float16) on x86-64, python3, and cuda.h: from CUDA_HOME/include, or from the
# PyPI nvcc that scripts/install_nvcc.sh installs (found next to $NVCC).
set -euo pipefail
cd "$(dirname "$0")/../.."
emu=profiling/emu
out="${EMU_DIR:-target/cuda-emu}"
[[ "${EMU_ASAN:-0}" == 1 && -z "${EMU_DIR:-}" ]] && out=target/cuda-emu-asan
[[ "${EMU_RACECHECK:-0}" == 1 && -z "${EMU_DIR:-}" ]] && out=target/cuda-emu-race
cxx="${CXX:-g++}"
mkdir -p "$out/gen"

inc=""
for cand in "${CUDA_HOME:-/nonexistent}/include" "$(dirname "${NVCC:-/nonexistent/bin/nvcc}")/../include" \
    .nvcc-venv/lib/python3*/site-packages/nvidia/cu13/include \
    "$HOME"/.cache/boa-cuda/nvcc/lib/python3*/site-packages/nvidia/cu13/include; do
    if [[ -f "$cand/cuda.h" ]]; then inc="$cand"; break; fi
done
[[ -n "$inc" ]] || { echo "build.sh: cuda.h not found (set CUDA_HOME, or NVCC to a PyPI nvcc from scripts/install_nvcc.sh)" >&2; exit 1; }

kernels=()
for f in cuda/*.cu; do kernels+=("$f"); done
python3 "$emu/gen_kernels.py" "$out/gen" "$cxx" "${kernels[@]}"

# No -march: without FMA instructions the compiler cannot contract a·b+c, so __fmul_rn/__fsub_rn keep
# their meaning (README "Limits"). -O2 keeps the parity tests' launches to seconds.
flags=(-std=c++20 -O2 -g -fPIC -fvisibility=hidden -Wall -Wno-unused-variable -Wno-unused-function -Wno-unknown-pragmas
       -include "$emu/cuda_emu.h" -I "$emu/shim" -I "$emu" -I include -I "$out/gen")
if [[ "${EMU_ASAN:-0}" == 1 ]]; then
    # AddressSanitizer on the kernels and the driver: compute-sanitizer's memcheck on the CPU (run.sh preloads
    # the runtime, because the Rust binaries are not instrumented).
    flags+=(-fsanitize=address -fno-omit-frame-pointer -DEMU_ASAN)
    link=(-fsanitize=address)
else
    link=()
fi
# A vector load or store (float4, uint2, bf16x2, …) at an address its type's alignment does not divide is a
# fault on a GPU ("misaligned address") but works on x86: UBSan's alignment check makes it an error here too.
flags+=(-fsanitize=alignment -fno-sanitize-recover=alignment)
link+=(-fsanitize=alignment)
# Race check: the kernels (and test_emu's) call racecheck.cpp's hooks on every load and store; no
# ThreadSanitizer runtime is linked.
race_src=() tsan=()
if [[ "${EMU_RACECHECK:-0}" == 1 ]]; then
    flags+=(-DEMU_RACECHECK)
    tsan=(-fsanitize=thread)
    race_src=("$emu/racecheck.cpp")
fi
objs=() pids=()
# probe.cpp: the emulator's own kernel, for test_null (compiled as the project's kernels are).
for f in "$out"/gen/*.emu.cpp "$emu/probe.cpp" "$emu/runtime.cpp" "$emu/streams.cpp" "$emu/streamorder.cpp" \
    "$emu/resources.cpp" "$emu/counters.cpp" "$emu/driver.cpp" "${race_src[@]}"; do
    o="$out/gen/$(basename "${f%.cpp}").o"
    extra=()
    [[ "$f" == */driver.cpp || "$f" == */streams.cpp ]] && extra=(-I "$inc")  # only the driver sees the real CUDA headers
    [[ "$f" == *.emu.cpp || "$f" == */probe.cpp ]] && extra=("${tsan[@]}")
    "$cxx" "${flags[@]}" "${extra[@]}" -c "$f" -o "$o" &
    objs+=("$o") pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { echo "build.sh: a compile failed (messages above)" >&2; exit 1; }; done
"$cxx" -shared "${link[@]}" -o "$out/libcuda.so" "${objs[@]}" -lpthread &
pids=($!)
"$cxx" -std=c++20 -O2 -fPIC -shared "${link[@]}" -o "$out/libcublas.so" "$emu/cublas.cpp" -lpthread &
pids+=($!)
"$cxx" -std=c++20 -O2 -fPIC -shared "${link[@]}" -o "$out/libcusolver.so" "$emu/cusolver.cpp" -lpthread &
pids+=($!)
# The emulator's own tests (check.sh runs them): device semantics on toy kernels, the lazy stream schedule,
# the stream-order check, the launch limits with a ptxas report, the two libraries, and (test_null, through
# dlopen of the built libraries as cudarc loads them) the null mode and the counters. They link the objects
# compiled above with the same flags (compiling the driver again for each took ~40 s a program).
o="$out/gen"
race_obj=()
[[ ${#race_src[@]} -gt 0 ]] && race_obj=("$o/racecheck.o")
( "$cxx" "${flags[@]}" "${tsan[@]}" -c "$emu/test_emu.cpp" -o "$o/test_emu.o" &&  # its kernels, as the real ones
  "$cxx" "${flags[@]}" "${link[@]}" -o "$out/test_emu" "$o/test_emu.o" "$o/runtime.o" "${race_obj[@]}" ) &
pids+=($!)
for t in test_streams test_order test_launch; do
    "$cxx" "${flags[@]}" -I "$inc" "${link[@]}" -o "$out/$t" "$emu/$t.cpp" "$o/driver.o" "$o/streams.o" \
        "$o/streamorder.o" "$o/resources.o" "$o/counters.o" "$o/runtime.o" "${race_obj[@]}" -lpthread &
    pids+=($!)
done
"$cxx" -std=c++20 -O2 "${link[@]}" -o "$out/test_blas" "$emu/test_blas.cpp" -ldl &
pids+=($!)
"$cxx" -std=c++20 -O2 -Wall -I "$emu" -I "$inc" "${link[@]}" -o "$out/test_null" "$emu/test_null.cpp" -ldl &
pids+=($!)
for p in "${pids[@]}"; do
    wait "$p" || { echo "build.sh: a link or test program failed (messages above)" >&2; exit 1; }
done
echo "$out"
