#!/usr/bin/env bash
# Runs the GPU halves of the tests on the CPU emulator (README.md here), four times: with threads in order
# between barriers and every stream operation run when issued; with threads in reverse (EMU_SCHEDULE=reverse)
# and stream operations queued until something forces them (EMU_STREAMS=lazy); and, without device_run and
# device_errors, under the race check of shared and device memory (EMU_RACECHECK=1, its own build;
# racecheck.h) in each order of threads. A missing barrier, fence, stream wait or host synchronization shows
# as a failure in one of them; the stream-order check (streamorder.h), on in all four, refuses any two
# operations on different streams that share bytes with nothing ordering them. All count each kernel's
# registers and static shared memory from the build's ptxas report (resources.h). Builds the emulator first.
# Extra arguments go to cargo (the same as scripts/test.sh's, so nothing is rebuilt: the test binaries must
# have the kernels embedded, BOA_REQUIRE_KERNELS=1).
#
#   profiling/emu/check.sh              # 12 to 18 min on 2 cores (2026-12-01)
set -euo pipefail
cd "$(dirname "$0")/../.."
# The tests compare results: never in the null mode (EMU_KERNELS=skip, which computes nothing), whatever the
# caller's environment says.
export EMU_KERNELS=run
out="$(profiling/emu/build.sh | tail -n1)"
echo "== the emulator's own tests"
"$out/test_emu"
EMU_SCHEDULE=reverse "$out/test_emu"
"$out/test_streams" 2>/dev/null  # stderr: the report its use-after-free case provokes
"$out/test_order"  # its children's stderr is checked by the test itself
EMU_STREAMS=lazy "$out/test_order"
"$out/test_launch" 2>/dev/null   # stderr: the refusals its over-limit launches provoke
"$out/test_blas" "$out" 2>/dev/null | tail -n1  # stderr: the refusals its bad-argument cases provoke
"$out/test_null" "$out"  # the null mode and the counters, through dlopen; its children's stderr is checked by it
EMU_STREAMS=lazy "$out/test_null" "$out"
tests=(--test parity_ops --test parity_quant --test parity_search --test parity_boa_dynamic --test parity_qgemm
       --test resident_forward --test device_run --test device_errors)
# Every architecture's CUDA forward against transformers, and the MoE runs' errors and traffic against the CPU's
# (tests/transformers_parity.rs `on_cuda`; needs the reference venv, as scripts/test.sh does).

# One pass of the CUDA tests on the emulator: $1 names it, $2 is what its device name must show (the
# emulator says there which checks it ran with), the rest are the test targets. The environment picks the
# emulator's mode. Fails on a failed test, on a skipped CUDA test (no device, no kernels, no cuBLAS: none may
# skip here), and when the device name lacks $2.
pass() {
    local label="$1" shows="$2" log status
    shift 2
    echo "== CUDA tests on the CPU emulator, $label"
    log="$(mktemp)"
    set +e
    profiling/emu/run.sh cargo test --release "${cargo_args[@]}" "$@" -- --nocapture 2>&1 \
        | tee "$log" | grep -E "^test |test result|^emu: "
    status="${PIPESTATUS[0]}"  # cargo's, not grep's
    set -e
    if [[ "$status" != 0 ]]; then echo "check.sh: tests failed on the emulator ($label)" >&2; exit 1; fi
    if grep -q "skipped: " "$log"; then
        echo "check.sh: CUDA tests skipped on the emulator:" >&2
        grep "skipped: " "$log" | sort | uniq -c | head -5 >&2
        exit 1
    fi
    # No test on the emulator, or not in the mode asked for: e.g. "ptxas limits" shows that run.sh handed the
    # emulator the build's ptxas report, so launches count registers and static shared memory.
    grep -q "CPU emulator (profiling/emu.*$shows" "$log" || {
        echo "check.sh: no test ran on the emulator with \"$shows\" in its device name ($label)" >&2
        exit 1
    }
    rm -f "$log"
}
cargo_args=("$@")
EMU_SCHEDULE=forward EMU_STREAMS=eager pass "threads in forward order, eager streams" "stream order, ptxas limits" \
    "${tests[@]}"
EMU_SCHEDULE=reverse EMU_STREAMS=lazy pass "threads in reverse order, lazy streams" \
    "stream order, lazy streams, ptxas limits" "${tests[@]}"
BOA_PYREF_PYTHON="${BOA_PYREF_PYTHON:-$(scripts/install_pyref.sh | tail -n1)}" EMU_SCHEDULE=forward \
    EMU_STREAMS=eager pass "architectures against transformers" "stream order" \
    --test transformers_parity on_cuda
# The race check (racecheck.h): its own build of the emulator; device_run adds only host code
# and cuBLAS calls to what the others run, so it is left out (its launches are the parity tests' kernels), and
# so is device_errors (the same runs, with injected faults).
# Both orders: device memory keeps no reads, so a race seen as a write after a read in one order is a read
# after a write in the other.
race_out="$(EMU_RACECHECK=1 profiling/emu/build.sh | tail -n1)"
"$race_out/test_emu"
EMU_SCHEDULE=reverse "$race_out/test_emu"
race_tests=(--test parity_ops --test parity_quant --test parity_search --test parity_boa_dynamic --test parity_qgemm
            --test resident_forward)
EMU_RACECHECK=1 EMU_SCHEDULE=forward pass "race check, threads in forward order" "racecheck" "${race_tests[@]}"
EMU_RACECHECK=1 EMU_SCHEDULE=reverse pass "race check, threads in reverse order" "racecheck" "${race_tests[@]}"
