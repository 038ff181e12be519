#!/usr/bin/env bash
# Runs the GPU halves of the tests on the CPU emulator (README.md here), twice: first with threads in order
# between barriers and every stream operation run when issued; then with threads in reverse
# (EMU_SCHEDULE=reverse) and stream operations queued until something forces them (EMU_STREAMS=lazy). A
# race on shared memory, or a missing stream wait or host synchronization, shows as a failure in one. Both
# count each kernel's registers and static shared memory from the build's ptxas report (resources.h).
# Builds the emulator first. Extra arguments go to cargo (the same as scripts/test.sh's, so nothing is
# rebuilt: the test binaries must have the kernels embedded, BOA_REQUIRE_KERNELS=1).
#
#   profiling/emu/check.sh              # 4 to 5 min on 2 cores (2026-11-30)
set -euo pipefail
cd "$(dirname "$0")/../.."
out="$(profiling/emu/build.sh | tail -n1)"
echo "== the emulator's own tests"
"$out/test_emu"
EMU_SCHEDULE=reverse "$out/test_emu"
"$out/test_streams" 2>/dev/null  # stderr: the report its use-after-free case provokes
"$out/test_launch" 2>/dev/null   # stderr: the refusals its over-limit launches provoke
"$out/test_blas" "$out" 2>/dev/null | tail -n1  # stderr: the refusals its bad-argument cases provoke
tests=(--test parity_ops --test parity_quant --test parity_qgemm --test resident_forward --test device_run)
for order in forward reverse; do
    streams=eager
    [[ "$order" == reverse ]] && streams=lazy
    echo "== CUDA tests on the CPU emulator, threads in $order order, $streams streams"
    log="$(mktemp)"
    # The tests print "skipped: <why>"; on the emulator nothing may be skipped (no device, no kernels, no cuBLAS).
    set +e
    EMU_SCHEDULE="$order" EMU_STREAMS="$streams" profiling/emu/run.sh cargo test --release "$@" "${tests[@]}" -- --nocapture 2>&1 \
        | tee "$log" | grep -E "^test |test result|emulator\): .*(error|differ|mismatch)"
    status="${PIPESTATUS[0]}"  # cargo's, not grep's
    set -e
    if [[ "$status" != 0 ]]; then echo "check.sh: tests failed on the emulator ($order order, $streams streams)" >&2; exit 1; fi
    if grep -q "skipped: " "$log"; then
        echo "check.sh: CUDA tests skipped on the emulator:" >&2
        grep "skipped: " "$log" | sort | uniq -c | head -5 >&2
        exit 1
    fi
    grep -q "CPU emulator" "$log" || { echo "check.sh: no test ran on the emulator" >&2; exit 1; }
    # run.sh hands the emulator the build's ptxas report, so launches count registers and static shared memory.
    grep -q "ptxas limits" "$log" || { echo "check.sh: the emulator ran without the ptxas report (run.sh did not find ptxas_report.txt)" >&2; exit 1; }
    if [[ "$streams" == lazy ]] && ! grep -q "CPU emulator (profiling/emu, lazy streams" "$log"; then
        echo "check.sh: the lazy pass did not run with lazy streams (EMU_STREAMS not seen by the emulator)" >&2
        exit 1
    fi
    rm -f "$log"
done
