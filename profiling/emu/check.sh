#!/usr/bin/env bash
# Runs the GPU halves of the tests on the CPU emulator (README.md here): with threads in reverse
# (EMU_SCHEDULE=reverse) and stream operations queued until something forces them (EMU_STREAMS=lazy); under the
# race check of shared and device memory (EMU_RACECHECK=1, its own build; racecheck.h) with threads in order
# between barriers and every stream operation run when issued; and every architecture's forward against
# transformers. The race check is skipped where profiling/race_checked.txt shows a whole EMU_CHECK_ALL=1 run
# passing on the same kernels, emulator, launching code and tests (below). EMU_CHECK_ALL=1 adds the plain
# forward pass with eager streams and the race check with threads in reverse (why CI leaves them out: below).
# A missing barrier, fence, stream wait or host synchronization shows as a failure in one of them; the
# stream-order check (streamorder.h), on in all, refuses any two operations on different streams that share
# bytes with nothing ordering them. All count each kernel's
# registers and static shared memory from the build's ptxas report (resources.h). Builds the emulator first.
# Extra arguments go to cargo (the same as scripts/test.sh's, so nothing is rebuilt: the test binaries must
# have the kernels embedded, BOA_REQUIRE_KERNELS=1).
#
#   profiling/emu/check.sh                    # CI's passes
#   EMU_CHECK_ALL=1 profiling/emu/check.sh    # all five
#
# Time on 2 cores: see profiling/emu/README.md's speed table.
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
       --test resident_forward --test device_errors)
# One pass of the CUDA tests on the emulator: $1 names it, $2 is what its device name must show (the
# emulator says there which checks it ran with), the rest are the test targets. The environment picks the
# emulator's mode. Fails on a failed test, on a skipped CUDA test (no device, no kernels, no cuBLAS: none may
# skip here), and when the device name lacks $2.
pass() {
    local label="$1" shows="$2" log status t0=$SECONDS
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
    echo "[emu] $label: $((SECONDS - t0)) s" | tee -a "${BOA_CI_TIMES:-/dev/null}"
}
cargo_args=("$@")
BOA_PYREF_PYTHON="${BOA_PYREF_PYTHON:-$(scripts/install_pyref.sh | tail -n1)}"
export BOA_PYREF_PYTHON
# The race check (racecheck.h) has its own build of the emulator. device_run and device_errors stay out of it:
# their launches are the parity tests' kernels, and what they add is host code, cuBLAS calls and injected faults.
race_tests=(--test parity_ops --test parity_quant --test parity_search --test parity_boa_dynamic --test parity_qgemm
            --test resident_forward)
# What the race check's verdict depends on: the kernels and their headers, the emulator, the host code that
# launches them, the tests and the crates' versions. The emulator's schedules are deterministic, so on the same
# inputs the check finds what it found before: CI skips its forward pass when a whole EMU_CHECK_ALL=1 run
# passed on inputs with this digest (it appends the digest to $race_stamp, to be committed), and runs it on any
# change there.
race_stamp=profiling/race_checked.txt
race_inputs_digest() {
    git ls-files -z --cached --others --exclude-standard -- cuda include profiling/emu src/backend/cuda src/ops \
        tests/common 'tests/parity_*.rs' tests/resident_forward.rs Cargo.lock \
        | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
race_digest="$(race_inputs_digest)"
race_checked=0
if [[ "${EMU_CHECK_ALL:-0}" != 1 && -f "$race_stamp" ]] && grep -q "^$race_digest " "$race_stamp"; then
    race_checked=1
else
    race_out="$(EMU_RACECHECK=1 profiling/emu/build.sh | tail -n1)"
    "$race_out/test_emu"
    EMU_SCHEDULE=reverse "$race_out/test_emu"
fi

# Passes run two at a time: the emulator runs one launch at a time in a process (runtime.cpp's `serial`), so a
# pass fills about one core. Each pass's output is printed whole when it ends; the first failure fails the script.
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
pids=() names=()
start() {  # start NAME COMMAND...: in the background, output to $logs/NAME
    local name="$1"
    shift
    ("$@") >"$logs/$name" 2>&1 &
    pids+=($!) names+=("$name")
}
finish() {  # waits for every started pass, prints each, fails if one failed
    local i failed=0
    for i in "${!pids[@]}"; do
        if ! wait "${pids[$i]}"; then failed=1; fi
        cat "$logs/${names[$i]}"
    done
    pids=() names=()
    [[ "$failed" == 0 ]] || { echo "check.sh: a pass failed (above)" >&2; exit 1; }
}
lazy_reverse() {
    EMU_SCHEDULE=reverse EMU_STREAMS=lazy pass "threads in reverse order, lazy streams" \
        "stream order, lazy streams, ptxas limits" "${tests[@]}" --test device_run
}
# The second pass ends with every architecture's CUDA forward against transformers, and the MoE runs' errors
# and traffic against the CPU's (tests/transformers_parity.rs `on_cuda`; needs the reference venv, as
# scripts/test.sh does).
race_forward_then_architectures() {
    if [[ "$race_checked" == 1 ]]; then
        echo "== race check: skipped, $race_stamp has these inputs (digest $race_digest) passing every pass:"
        grep "^$race_digest " "$race_stamp"
    else
        EMU_RACECHECK=1 EMU_SCHEDULE=forward pass "race check, threads in forward order" "racecheck" \
            "${race_tests[@]}"
    fi
    EMU_SCHEDULE=forward EMU_STREAMS=eager pass "architectures against transformers" "stream order" \
        --test transformers_parity on_cuda
}
# CI runs two passes side by side (alone on the 2-core machine: 611 s for the whole script, 190% CPU, with the
# race check; 2026-12-07). They leave out two:
# - the plain pass with threads in forward order and eager streams: the race check's forward pass runs the
#   same tests in the same schedule (its checks added), and device_run and device_errors run in the lazy one;
# - the race check with threads in reverse order. Device memory keeps no reads, so the check sees a read that
#   comes before another thread's unordered write only in that order. The lazy pass runs that order without
#   the check: such a read gets the new value there, where the forward passes give it the old one, so one of
#   the two parity results is wrong; only a write of the value already there goes unseen.
# EMU_CHECK_ALL=1 runs those two as well, and the race check's forward pass whatever $race_stamp says. Run it
# after a change to the race check's inputs (above), and commit the digest it appends.
start lazy lazy_reverse
start race race_forward_then_architectures
finish
if [[ "${EMU_CHECK_ALL:-0}" == 1 ]]; then
    eager_forward() {
        EMU_SCHEDULE=forward EMU_STREAMS=eager pass "threads in forward order, eager streams" \
            "stream order, ptxas limits" "${tests[@]}" --test device_run
    }
    race_reverse() {
        EMU_RACECHECK=1 EMU_SCHEDULE=reverse pass "race check, threads in reverse order" "racecheck" \
            "${race_tests[@]}"
    }
    start eager eager_forward
    start race_reverse race_reverse
    finish
    # Inputs edited while the passes ran would make the digest a lie.
    if [[ "$(race_inputs_digest)" == "$race_digest" ]]; then
        echo "$race_digest $(date -u +%F) all five passes passed ($(git rev-parse --short HEAD)$(git diff --quiet \
            HEAD || echo ", with uncommitted changes"))" >>"$race_stamp"
        echo "check.sh: appended digest $race_digest to $race_stamp (commit it: CI then skips the race check)"
    fi
fi
