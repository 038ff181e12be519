#!/usr/bin/env bash
# gpu_check.sh — GPU parity (and later speed) checks for a GPU machine that has a CUDA 13.0 driver but no Rust
# toolchain and no network (design.md §8). Two halves:
#
#   profiling/gpu_check.sh [TEST…]         on the build machine: build the binary and the test executables
#                                          with the kernels embedded (BOA_REQUIRE_KERNELS=1), copy the binary
#                                          and the named tests (default: parity_ops parity_quant parity_qgemm
#                                          resident_forward device_run, the ones with CUDA halves) into
#                                          .gpu_carry/, and print the device call for `run`.
#   profiling/gpu_check.sh --on-device [TEST…]
#                                          on the GPU machine (the `run` tool's command): run each staged
#                                          test executable (or only the named ones, e.g. parity_ops
#                                          parity_quant, to keep the call short), then `boa-cuda bench
#                                          --device cuda` (the quantization-core kernels on 7B/8B/70B layer
#                                          shapes against the measured copy and tensor-core ceilings), the
#                                          end-to-end checks and the 7B-shaped run, then compute-sanitizer;
#                                          logs, results.md and bench.md go under $OUT. SECTIONS="tests bench
#                                          e2e ppl 7b sanitize" picks sections; all share DEADLINE_S (570 s).
#
#   profiling/gpu_check.sh --stage-demo [CKPT]
#                                          on the build machine: split the demo model's packed checkpoint
#                                          (default demo/smollm2-135m-boa-w3g64, 155 MiB, from scripts/demo.sh)
#                                          and a copy of the binary into .gpu_demo/p1…pN, each small enough to
#                                          travel in one call, and print the N device calls.
#   profiling/gpu_check.sh --demo-part K N on the GPU machine: keep part K in /tmp/boa_demo (a warm machine
#                                          keeps /tmp between calls); at K = N, reassemble the checkpoint and
#                                          compare `eval --device cuda` with `--device cpu` (perplexity within
#                                          1e-3 relative), writing demo-ppl.txt under $OUT.
#
# Build half: needs nvcc (NVCC=<path>, CUDA_HOME, PATH or /usr/local/cuda/bin; otherwise it is installed with
# scripts/install_nvcc.sh into $NVCC_DIR, default .nvcc-venv/). Everything staged must fit the 64 MiB the
# `run` tool carries; debug info is stripped from the copies when it would not.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
carry_rel=".gpu_carry"
carry="$root/$carry_rel"
carry_limit=$((64 * 1024 * 1024))

# Staged by default: the tests that exercise CUDA code. Every test binary together is ~94 MiB stripped, over
# the 64 MiB the `run` tool carries; the rest are CPU tests that CI already runs.
default_tests=(parity_ops parity_quant parity_qgemm resident_forward device_run)

build_half() {
    local want=("$@")
    ((${#want[@]} > 0)) || want=("${default_tests[@]}")
    cd "$root"
    if [[ -z "${NVCC:-}" && -z "${CUDA_HOME:-}" ]] && ! command -v nvcc >/dev/null \
        && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
        NVCC="$(scripts/install_nvcc.sh "${NVCC_DIR:-$root/.nvcc-venv}" | tail -n1)"
        export NVCC
    fi
    export BOA_REQUIRE_KERNELS=1
    # NVTX ranges in the staged binaries, so an nsys capture on the device shows every phase and kernel family.
    local libclang_env
    libclang_env="$(scripts/install_libclang.sh "${LIBCLANG_DIR:-$root/.libclang-venv}")"
    eval "$(sed 's/^/export /' <<<"$libclang_env")"
    echo "== building with kernels (NVCC=${NVCC:-<search>}) and NVTX ranges"
    cargo build --release --features nvtx --bins --tests
    # The test executables' paths, from cargo itself (one JSON object per artifact).
    local list
    list="$(cargo test --release --features nvtx --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        print(m["target"]["name"] + "\t" + m["executable"])
')"
    [[ -n "$list" ]] || { echo "gpu_check.sh: cargo listed no test executables" >&2; exit 1; }

    rm -rf "$carry"
    mkdir -p "$carry/tests" "$carry/bin"
    cp target/release/boa-cuda "$carry/bin/"
    while IFS=$'\t' read -r name exe; do
        [[ " ${want[*]} " == *" $name "* ]] && cp "$exe" "$carry/tests/$name"
    done <<<"$list"
    local staged
    staged="$(ls "$carry/tests")"
    for name in "${want[@]}"; do
        grep -qx "$name" <<<"$staged" || { echo "gpu_check.sh: no test executable named $name" >&2; exit 1; }
    done
    local size
    size="$(du -sb "$carry" | cut -f1)"
    if ((size > carry_limit)); then
        echo "== $((size >> 20)) MiB staged, over the 64 MiB carry limit: stripping debug info"
        strip --strip-debug "$carry"/bin/* "$carry"/tests/*
        size="$(du -sb "$carry" | cut -f1)"
        ((size <= carry_limit)) || { echo "gpu_check.sh: still $((size >> 20)) MiB after strip" >&2; exit 1; }
    fi
    {
        echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ uncommitted changes)')"
        echo "built: $(date -u +%FT%TZ) on $(uname -n), $(ldd --version 2>/dev/null | head -n1)"
        echo "nvcc: ${NVCC:-<found by build.rs>}"
        # The newest glibc symbol version the staged executables use: the device machine's glibc must be at least it.
        echo "needs: $(objdump -T "$carry"/bin/* "$carry"/tests/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV \
            | tail -n1 | sed 's/_/ ≥ /')"
        (cd "$carry" && find bin tests -type f -printf '%p %s\n' | sort)
    } >"$carry/manifest.txt"
    cat "$carry/manifest.txt"
    cat <<MSG

== staged $((size >> 20)) MiB in $carry_rel/. Now call the \`run\` tool (one call; it prints the table last):
     command:   bash profiling/gpu_check.sh --on-device
     carry:     ["$carry_rel"]
     timeout_s: 600
   (it runs the staged tests: ${want[*]}; stage others with \`profiling/gpu_check.sh NAME…\`)
   Logs and results.md come back under \$OUT (files_at). Give the machine back afterwards unless you rerun at once.
   Then, with ≥ 4 minutes of device time left and the machine still warm, the demo model's own packed
   checkpoint: \`profiling/gpu_check.sh --stage-demo\` here prints three calls to make back to back.
MSG
}

# cudarc opens cuBLAS and cuSOLVER by name (libcublas.so, then .so.13, .so.12, …), through the loader's path.
# When the loader cannot find one, GEMMs, the scale search and the large factorizations quietly fall back to
# the CPU or the FFMA kernel (the backend says so once), and the speed rows and the 7B run would time the CPU.
# So: say where each library resolves; if one does not, look where CUDA 13 and PyTorch's wheels keep it and put
# that folder on LD_LIBRARY_PATH (exported for everything after). Prints one line per library; returns 1 when
# one stays missing.
find_cuda_libs() {
    local lib dir where rc=0 site=()
    if command -v python3 >/dev/null; then
        mapfile -t site < <(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null || true)
    fi
    for lib in cublas cusolver; do
        if where="$(lib_resolves "$lib")"; then
            echo "lib$lib: $where"
            continue
        fi
        where=""
        for dir in ${CUDA_HOME:+"$CUDA_HOME/lib64"} /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 \
            /usr/local/cuda*/targets/x86_64-linux/lib "${site[@]/%//nvidia/cu13/lib}" "${site[@]/%//nvidia/$lib/lib}"; do
            if compgen -G "$dir/lib$lib.so.1[0-9]*" >/dev/null; then where="$dir"; break; fi
        done
        if [[ -z "$where" ]]; then
            where="$(find /usr /opt "${site[@]}" -name "lib$lib.so.1[0-9]*" -printf '%h\n' 2>/dev/null | head -n1 || true)"
        fi
        if [[ -n "$where" ]]; then
            export LD_LIBRARY_PATH="$where${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
        if where="$(lib_resolves "$lib")"; then
            echo "lib$lib: $where (its folder added to LD_LIBRARY_PATH)"
        else
            echo "lib$lib: NOT FOUND by the loader nor under /usr, /opt or python's site-packages"
            rc=1
        fi
    done
    return "$rc"
}

# The file the loader opens for cudarc's first candidate names of lib$1; fails when it opens none. Needs python3
# (ctypes, then /proc/self/maps for the path); without it, `ldconfig -p` and LD_LIBRARY_PATH are searched.
lib_resolves() {
    if command -v python3 >/dev/null; then
        python3 - "$1" <<'PY'
import ctypes, re, sys
lib = sys.argv[1]
for name in [f"lib{lib}.so"] + [f"lib{lib}.so.{v}" for v in (13, 12, 11, 10)]:
    try:
        ctypes.CDLL(name)
    except OSError:
        continue
    path = next((l.split()[-1] for l in open("/proc/self/maps") if re.search(rf"/lib{lib}\.so", l)), name)
    print(path)
    sys.exit(0)
sys.exit(1)
PY
        return
    fi
    local dir
    for dir in ${LD_LIBRARY_PATH//:/ }; do
        compgen -G "$dir/lib$1.so*" >/dev/null && { echo "$dir"; return 0; }
    done
    ldconfig -p 2>/dev/null | grep -o "/[^ ]*/lib$1\.so[.0-9]*" | head -n1 | grep .
}

device_half() {
    local only=("$@")
    cd "$root"
    local out="${OUT:-$root/gpu_out}"
    mkdir -p "$out"
    [[ -d "$carry/tests" ]] || { echo "gpu_check.sh: no $carry_rel/tests; pass carry [\"$carry_rel\"]" >&2; exit 1; }
    export RUST_BACKTRACE=1
    local libs_missing=0
    {
        echo "# gpu_check $(date -u +%FT%TZ)"
        cat "$carry/manifest.txt" 2>/dev/null || true
        echo "## machine"
        uname -a
        ldd --version 2>/dev/null | head -n1 || true
        # Read-only queries; never change the card's settings (METHOD.md).
        nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
            --format=csv 2>&1 || echo "nvidia-smi failed"
        command -v nvcc >/dev/null && nvcc --version | tail -n1 || echo "no nvcc on PATH"
        echo "## CUDA libraries"
        find_cuda_libs || libs_missing=1
    } >"$out/machine.txt" 2>&1
    cat "$out/machine.txt"

    local table="$out/results.md" status=0
    if ((libs_missing)); then
        status=1
        echo "cuBLAS or cuSOLVER not found (machine.txt): their work ran on the CPU or the FFMA kernel" >>"$out/notes.txt"
    fi
    # The call's sections and its deadline: each section's timeout shrinks to what is left of DEADLINE_S
    # (default 570 of the call's 600 s), and a section left with under 30 s is skipped and named at the end,
    # so a second call can run just those (SECTIONS="7b sanitize", say).
    local sections=" ${SECTIONS:-tests bench e2e ppl 7b sanitize} " skipped_sections=() t_start=$SECONDS
    local deadline="${DEADLINE_S:-570}"
    printf '| test binary | exit | passed | failed | CUDA skipped | seconds |\n|---|---|---|---|---|---|\n' >"$table"
    for t in "$carry"/tests/*; do
        local name log rc t0 t1 passed failed skipped c
        name="$(basename "$t")"
        if ((${#only[@]} > 0)) && [[ ! " ${only[*]} " == *" $name "* ]]; then continue; fi
        wanted tests || break
        c="$(cap 240)"
        ((c > 0)) || { skipped_sections+=("tests:$name"); continue; }
        log="$out/$name.log"
        chmod +x "$t" "$carry/bin/boa-cuda"
        t0="$(date +%s.%N)"
        set +e
        # device_run runs the binary; cargo's path to it does not exist here.
        BOA_CUDA_BIN="$carry/bin/boa-cuda" timeout "$c" "$t" --test-threads=1 --nocapture >"$log" 2>&1
        rc=$?
        set -e
        t1="$(date +%s.%N)"
        passed="$(grep -o '[0-9]* passed' "$log" | awk '{s += $1} END {print s + 0}')"
        failed="$(grep -o '[0-9]* failed' "$log" | awk '{s += $1} END {print s + 0}')"
        # On the GPU machine a CUDA test that skips is a failure of this check, not a pass.
        # (with --nocapture a test's first line follows "test <name> ... " on the same line: no ^ anchors)
        skipped="$(grep -c 'skipped: ' "$log" || true)"
        if ((rc != 0 || skipped > 0)); then status=1; fi
        if grep -q 'GLIBC_[0-9.]* not found' "$log"; then
            echo "$name: built against a newer glibc than this machine has (see $name.log)" >>"$out/notes.txt"
        fi
        printf '| %s | %s | %s | %s | %s | %.1f |\n' "$name" "$rc" "$passed" "$failed" "$skipped" \
            "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" >>"$table"
    done
    {
        echo
        echo "max rel. error vs the f64 reference, per backend and kernel variant:"
        sed -n -e 's/^test .* \.\.\. //' -e '/max rel\. error\|rms_norm variant\|linear variant\|causal_attention variant\|cuBLAS unavailable\|skipped: /s/^/    /p' "$out"/*.log 2>/dev/null || true
    } >>"$table"
    for log in "$out"/*.log; do
        if grep -q -e 'FAILED' -e 'panicked' "$log"; then
            echo "== failures in $(basename "$log"):"
            grep -e 'panicked' -e 'FAILED' -A4 "$log" | head -n 40
        fi
    done
    # Kernel speed: every QuantOps method on real layer shapes (src/bench/gpu.rs states the method). Rows are
    # printed as they are measured, 7B's first, so bench.md keeps what a run cut off by its timeout finished.
    local bench_rc=0
    chmod +x "$carry/bin/boa-cuda"
    if wanted bench; then
        set +e
        timeout "$(cap 150)" "$carry/bin/boa-cuda" bench --device cuda --reps 3 >"$out/bench.md" 2>"$out/bench.log"
        bench_rc=$?
        set -e
        if ((bench_rc != 0)); then
            status=1
            echo "== bench failed (exit $bench_rc):"
            tail -n 20 "$out/bench.log"
        fi
    fi
    # End to end: `run --device cuda` (statistics, Cholesky and sweeps on the GPU) against `--device cpu` on a
    # synthesized GQA model (d 512, 8 heads over 4 KV heads, 4 blocks), calibrated on this README (the model's
    # tokenizer is byte-level). The relative output errors of report.json must agree (compare_reports below).
    local e2e_rc=0
    if wanted e2e; then
        set +e
        (
            set -e
            m="$out/synth"
            rm -rf "$m" "$out"/q-*
            "$carry/bin/boa-cuda" synth-model --out "$m" --d 512 --d-ff 1376 --layers 4 --heads 8 --kv-heads 4
            # BoA 3-bit per-channel (static grids: every sweep on the device), then GPTQ 4-bit g64 (dynamic groups:
            # the device sweep calls back to the host search at every group start). Every config runs and reports,
            # even after one fails; the section fails at the end if any did. (set -e does not act inside a command
            # whose status `||` tests, hence the explicit returns.)
            run_config() {
                local cfg="$1" tag="${1%% *}" dev
                for dev in cuda cpu; do
                    # shellcheck disable=SC2086
                    timeout "$(cap 120)" "$carry/bin/boa-cuda" run --model "$m" --calib README.md --method $cfg \
                        --nsamples 16 --seqlen 256 --device "$dev" --format fake --out "$out/q-$dev" --quiet \
                        --profile || { echo "e2e: run --device $dev failed"; return 1; }
                    cp "$out/q-$dev/report.json" "$out/report-$tag-$dev.json" || return 1
                    rm -rf "$out/q-$dev"
                done
                compare_reports "$out/report-$tag-cuda.json" "$out/report-$tag-cpu.json"
            }
            failed=()
            for cfg in "boa --wbits 3" "gptq --wbits 4 --group-size 64"; do
                echo "== $cfg"
                run_config "$cfg" || failed+=("$cfg")
            done
            if ((${#failed[@]} > 0)); then
                printf 'e2e: FAIL: %s\n' "${failed[@]}"
                exit 1
            fi
        ) >"$out/e2e.log" 2>&1
        e2e_rc=$?
        set -e
        rm -rf "$out/synth"
        if ((e2e_rc != 0)); then status=1; echo "== end-to-end run failed (exit $e2e_rc):"; fi
        tail -n 30 "$out/e2e.log"
    fi
    # Packed checkpoints: `eval --device cuda` (packed_linear on the GPU) against `--device cpu`, perplexities
    # within 1e-3 relative. The demo model's packed checkpoint (155 MiB: its f32 embedding alone is 113 MB) and
    # the demo model itself (517 MiB; its GGUF 94 MiB) do not fit the 64 MiB carry (the demo checkpoint has its
    # own check in parts: --stage-demo, --demo-part), so these checkpoints are made here from a synthesized
    # model: 4-bit g128 (contiguous groups: the fused kernel's fast case) and 3-bit g64 act-order (dynamic
    # groups, so g_idx is permuted: the kernel's g_idx path). Each is evaluated at seqlen 16, chunk 1 (16 tokens
    # per call: the fused kernel) and seqlen 256, chunk 4 (1024: dequantize + cuBLAS).
    local ppl_rc=0
    if wanted ppl; then
        set +e
        (
            set -e
            m="$out/synth-ppl"
            rm -rf "$m" "$out"/q-ppl-*
            "$carry/bin/boa-cuda" synth-model --out "$m" --d 512 --d-ff 1376 --layers 4 --heads 8 --kv-heads 4
            for cfg in "g128 --wbits 4 --group-size 128" "actorder --wbits 3 --group-size 64 --act-order"; do
                tag="${cfg%% *}"
                # shellcheck disable=SC2086
                timeout "$(cap 120)" "$carry/bin/boa-cuda" run --model "$m" --calib README.md --method gptq ${cfg#* } \
                    --nsamples 8 --seqlen 128 --device cpu --format gptq_v2 --out "$out/q-ppl-$tag" --quiet
                for shape in "16 1" "256 4"; do
                    read -r sl ch <<<"$shape"
                    for dev in cuda cpu; do
                        timeout "$(cap 120)" "$carry/bin/boa-cuda" eval --model "$out/q-ppl-$tag" --data README.md --seqlen "$sl" \
                            --chunk "$ch" --max-windows 8 --device "$dev" --json >"$out/ppl-$tag-$sl-$dev.json"
                    done
                    compare_ppl "$out/ppl-$tag-$sl-cuda.json" "$out/ppl-$tag-$sl-cpu.json" "$tag, seqlen $sl, chunk $ch"
                done
            done
        ) >"$out/ppl.log" 2>&1
        ppl_rc=$?
        set -e
        rm -rf "$out/synth-ppl" "$out"/q-ppl-*
        if ((ppl_rc != 0)); then status=1; echo "== packed-checkpoint eval check failed (exit $ppl_rc):"; fi
        tail -n 12 "$out/ppl.log"
    fi
    if wanted 7b; then e2e_7b "$out" || status=1; fi
    [[ -f "$out/notes.txt" ]] && cat "$out/notes.txt"
    echo
    [[ -f "$out/bench.md" ]] && cat "$out/bench.md"
    echo
    cat "$table"
    echo "status: $([[ $status == 0 ]] && echo PASS || echo FAIL) after $((SECONDS - t_start)) s"
    # Last, so a call that runs out of time has everything above: out-of-bounds and uninitialized device
    # accesses that the NaN-poisoned parity outputs cannot see (SANITIZE=0 skips it).
    if wanted sanitize; then sanitize "$out" || status=1; fi
    if ((${#skipped_sections[@]} > 0)); then
        echo "not run for lack of time: ${skipped_sections[*]} (DEADLINE_S=$deadline); a second call can run them:"
        echo "  SECTIONS=\"$(printf '%s\n' "${skipped_sections[@]}" | cut -d: -f1 | sort -u | tr '\n' ' ' | sed 's/ $//')\" bash profiling/gpu_check.sh --on-device"
        status=1
    fi
    return "$status"
}

# The timeout a section gets: its own cap ($1 s), or what is left before the call's deadline; 0 when under
# 30 s are left. (Reads device_half's locals deadline and t_start: bash scopes dynamically.)
cap() {
    local left=$((deadline - (SECONDS - t_start) - 5))
    if ((left < 30)); then echo 0; elif ((left < $1)); then echo "$left"; else echo "$1"; fi
}

# Whether section $1 runs: named in SECTIONS and at least 30 s left, else listed in skipped_sections when it
# was wanted.
wanted() {
    [[ "$sections" == *" $1 "* ]] || return 1
    (($(cap 30) > 0)) && return 0
    skipped_sections+=("$1")
    return 1
}

# compute-sanitizer memcheck over parity_ops (small shapes, every forward kernel; ~10-100x slower than plain).
sanitize() {
    local out="$1" cs
    [[ "${SANITIZE:-1}" == 0 ]] && return 0
    cs="$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)"
    if [[ -z "$cs" || ! -x "$carry/tests/parity_ops" ]]; then
        echo "sanitizer: skipped (no compute-sanitizer, or parity_ops not staged)"
        return 0
    fi
    local rc=0
    set +e
    timeout "$(cap 120)" "$cs" --tool memcheck --error-exitcode 9 "$carry/tests/parity_ops" --test-threads=1 cuda \
        >"$out/sanitizer.log" 2>&1
    rc=$?
    set -e
    # Errors are printed as they happen, so a run cut off by the timeout (exit 124) still reports what it saw.
    local found
    found="$(grep -c '^========= \(Invalid\|Program hit\|Misaligned\|Out-of-range\)' "$out/sanitizer.log" || true)"
    echo "sanitizer (memcheck, parity_ops cuda tests, exit $rc$( ((rc == 124)) && echo ', cut off by its timeout')): $found errors seen; $(grep -o 'ERROR SUMMARY: [0-9]* errors*' "$out/sanitizer.log" | tail -n1)"
    if ((found > 0 || (rc != 0 && rc != 124))); then
        grep -m 20 -e '^========= ' "$out/sanitizer.log"
        return 1
    fi
}

# The product's main job on a 7B-shaped model (d 4096, d_ff 11008, 32 heads, realistic-scale random weights):
# `run --method boa --wbits 3 --device cuda --profile` with 128 × 2048 calibration tokens, X and the statistics
# resident on the GPU, the next block prefetched. E2E_7B_LAYERS blocks (default 4, so the call stays within a
# few minutes; 32 is the whole model): the per-phase table goes to e2e-7b.md, with the per-block time scaled
# to 32 blocks next to the 3-minute target (disk reads excluded: the `weights load` row).
e2e_7b() {
    local out="$1" layers="${E2E_7B_LAYERS:-4}" rc=0
    local m="$out/synth7b" q="$out/q7b"
    rm -rf "$m" "$q"
    set +e
    (
        set -e
        # Calibration text for the byte-level tokenizer: 262 144 tokens = bytes of this repository's sources.
        find "$root/src" "$root/cuda" "$root/include" -type f -print0 | sort -z | xargs -0 cat >"$out/calib7b.txt"
        while (($(stat -c %s "$out/calib7b.txt") < 300000)); do cat "$out/calib7b.txt" "$out/calib7b.txt" >"$out/c2" && mv "$out/c2" "$out/calib7b.txt"; done
        t0="$(date +%s.%N)"
        "$carry/bin/boa-cuda" synth-model --out "$m" --d 4096 --d-ff 11008 --layers "$layers" --heads 32 \
            --kv-heads 32
        echo "synth-model: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
        timeout "$(cap 240)" "$carry/bin/boa-cuda" run --model "$m" --calib "$out/calib7b.txt" --method boa --wbits 3 \
            --nsamples 128 --seqlen 2048 --device cuda --format gptq --out "$q" --profile
        python3 - "$q/report.json" "$layers" <<'PY'
import json, sys
r, layers = json.load(open(sys.argv[1])), int(sys.argv[2])
s = r["seconds"]
fixed = s.get("calibration_data", 0.0)
per_block = (s["total"] - fixed - s.get("load", 0.0)) / layers
print(f"7B-shaped BoA 3-bit, {layers} blocks: total {s['total']:.1f} s, weights load {s.get('load', 0.0):.1f} s")
print(f"per block (load excluded) {per_block:.2f} s -> 32 blocks {fixed + 32 * per_block:.0f} s (target <= 180 s)")
# Per-block times (weight waits excluded): the first block carries one-time costs (cuBLAS/cuSOLVER handles,
# pool growth), so the other 31 are projected from the median of the rest.
b = s.get("blocks", [])
if len(b) >= 2:
    rest = sorted(b[1:])[len(b[1:]) // 2]
    print(f"blocks {', '.join(f'{x:.2f}' for x in b)} s -> first + 31 x median of the rest: "
          f"{fixed + b[0] + 31 * rest:.0f} s (target <= 180 s)")
PY
    ) >"$out/e2e-7b.log" 2>&1
    rc=$?
    set -e
    rm -rf "$m" "$q"
    grep -A30 '| phase |' "$out/e2e-7b.log" >"$out/e2e-7b.md" || true
    tail -n 5 "$out/e2e-7b.log" >>"$out/e2e-7b.md"
    echo "== 7B-shaped end to end ($layers blocks, exit $rc):"
    cat "$out/e2e-7b.md"
    return "$rc"
}

# The demo model's packed checkpoint does not fit one call's 64 MiB, so it travels in parts over consecutive
# calls, each within the machine's 30 s warm window of the last (every part is checked by size on arrival).
stage_demo() {
    local ckpt="${1:-$root/demo/smollm2-135m-boa-w3g64}" dest="$root/.gpu_demo"
    [[ -f "$ckpt/quantize_config.json" ]] || {
        echo "gpu_check.sh: $ckpt is not a packed checkpoint (scripts/demo.sh writes demo/smollm2-135m-boa-w3g64)" >&2
        exit 1
    }
    # The binary the build half staged (kernels embedded), not target/release's, which a later plain build
    # may have replaced with one without kernels.
    [[ -f "$carry/bin/boa-cuda" ]] || { echo "gpu_check.sh: run the build half first (profiling/gpu_check.sh)" >&2; exit 1; }
    # Each call also carries the tracked and untracked files of the repository; leave them 4 MiB of room.
    local tree part_mib
    tree="$(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)"
    part_mib=$(((carry_limit - tree) / 1048576 - 4))
    rm -rf "$dest"
    mkdir -p "$dest/split"
    tar -C "$(dirname "$ckpt")" -cf - "$(basename "$ckpt")" | split -b "${part_mib}m" -d -a 2 - "$dest/split/ckpt.tar."
    local files=("$dest"/split/ckpt.tar.*) n k
    n=${#files[@]}
    for ((k = 1; k <= n; k++)); do
        mkdir -p "$dest/p$k"
        mv "${files[k - 1]}" "$dest/p$k/"
    done
    # The binary rides with the smallest part, so the last call needs nothing from an earlier one but /tmp.
    cp "$carry/bin/boa-cuda" "$dest/p$n/boa-cuda"
    strip --strip-debug "$dest/p$n/boa-cuda"
    (cd "$dest" && find p* -type f -printf '%p %s\n' | sort) >"$dest/manifest.txt"
    cp "$dest/manifest.txt" "$dest/p$n/manifest.txt"
    rmdir "$dest/split"
    local size
    for ((k = 1; k <= n; k++)); do
        size="$(du -sb "$dest/p$k" | cut -f1)"
        ((size + tree <= carry_limit)) || { echo "gpu_check.sh: part $k is $((size >> 20)) MiB, too big" >&2; exit 1; }
    done
    echo "== $(basename "$ckpt") staged in $n parts under .gpu_demo/ ($(du -sh "$dest" | cut -f1)). Make the $n calls back to back"
    echo "   (the machine stays warm 30 s after each; a cold machine loses the earlier parts and says so):"
    for ((k = 1; k <= n; k++)); do
        echo "     command: bash profiling/gpu_check.sh --demo-part $k $n   carry: [\".gpu_demo/p$k\"]   timeout_s: $((k == n ? 300 : 60))"
    done
}

demo_part() {
    local k="$1" n="$2" keep=/tmp/boa_demo out="${OUT:-$root/gpu_out}"
    mkdir -p "$keep" "$out"
    cp -r "$root/.gpu_demo/p$k/." "$keep/"
    echo "part $k of $n kept in $keep"
    ((k == n)) || return 0
    local ok=1 path size
    while read -r path size; do
        local f="$keep/$(basename "$path")"
        [[ "$(basename "$path")" == manifest.txt ]] && continue
        if [[ ! -f "$f" || "$(stat -c %s "$f")" != "$size" ]]; then
            echo "missing or short: $(basename "$path") (the machine went cold between calls? make the calls again)"
            ok=0
        fi
    done <"$keep/manifest.txt"
    ((ok)) || return 1
    rm -rf "$keep/ckpt"
    mkdir -p "$keep/ckpt"
    cat "$keep"/ckpt.tar.* | tar -C "$keep/ckpt" -xf -
    local m
    m="$(find "$keep/ckpt" -mindepth 1 -maxdepth 1 -type d)"
    chmod +x "$keep/boa-cuda"
    find_cuda_libs || echo "packed eval: without cuBLAS, m > 16 runs on the CPU"
    {
        echo "# demo packed checkpoint $(basename "$m"), eval on README.md, seqlen 512, 8 windows"
        for dev in cuda cpu; do
            timeout 200 "$keep/boa-cuda" eval --model "$m" --data README.md --seqlen 512 --max-windows 8 \
                --device "$dev" --json >"$out/demo-ppl-$dev.json"
            cat "$out/demo-ppl-$dev.json"
        done
        compare_ppl "$out/demo-ppl-cuda.json" "$out/demo-ppl-cpu.json" "demo model $(basename "$m")"
    } 2>&1 | tee "$out/demo-ppl.txt"
    return "${PIPESTATUS[0]}"
}

# Mean relative output error per method of two report.json files; fails when CUDA's is off by more than 10%
# (the GPU statistics are bf16 and its factors f32, so the codes differ a little; a wrong kernel is far off).
compare_reports() {
    if ! command -v python3 >/dev/null; then
        echo "e2e: no python3 on this machine; compare $1 and $2 (layers[].linears[].error) by hand"
        return 0
    fi
    python3 - "$1" "$2" <<'PY'
import json, sys
def errs(path):
    r = json.load(open(path))
    out = {}
    for layer in r["layers"]:
        for lin in layer["linears"]:
            out.setdefault(lin["method"], []).append(lin["error"])
    return {m: sum(v) / len(v) for m, v in out.items()}
cuda, cpu = errs(sys.argv[1]), errs(sys.argv[2])
ok = True
for m in sorted(cpu):
    ratio = cuda[m] / cpu[m]
    ok &= 0.9 <= ratio <= 1.1
    print(f"e2e {m}: mean relative output error cuda {cuda[m]:.5f}, cpu {cpu[m]:.5f}, ratio {ratio:.3f}")
print("e2e:", "PASS" if ok else "FAIL (ratio outside [0.9, 1.1])")
sys.exit(0 if ok else 1)
PY
}

# Perplexity of two `eval --json` outputs; fails unless the first (CUDA) is within 1e-3 relative of the second (CPU).
# awk rather than python3: the device machine may have no python (a missing or null value reads as 0 and fails).
compare_ppl() {
    local a b
    a="$(grep -o '"perplexity":[^,}]*' "$1" | cut -d: -f2 || true)"
    b="$(grep -o '"perplexity":[^,}]*' "$2" | cut -d: -f2 || true)"
    awk -v a="$a" -v b="$b" -v what="$3" 'BEGIN {
        ok = (b + 0 > 0); r = ok ? (a - b) / b : 1; if (r < 0) r = -r; ok = ok && r <= 1e-3
        printf "packed eval (%s): perplexity cuda %s, cpu %s, rel. difference %.2e: %s\n", what, a, b, r, ok ? "PASS" : "FAIL"
        exit !ok }'
}

case "${1:-}" in
    --on-device) shift; device_half "$@" ;;
    --stage-demo) shift; stage_demo "$@" ;;
    --demo-part) shift; (($# == 2)) || { echo "usage: $0 --demo-part K N" >&2; exit 2; }; demo_part "$@" ;;
    -h|--help)
        echo "usage: $0 [TEST…]  |  $0 --on-device [TEST…]  |  $0 --stage-demo [CKPT]  |  $0 --demo-part K N" >&2
        exit 2 ;;
    *) build_half "$@" ;;
esac
