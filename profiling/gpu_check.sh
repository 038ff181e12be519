#!/usr/bin/env bash
# gpu_check.sh — GPU parity (and later speed) checks for a GPU machine that has a CUDA 13.0 driver but no Rust
# toolchain and no network (design.md §8). Two halves:
#
#   profiling/gpu_check.sh [TEST…]         on the build machine: build the binary and the test executables
#                                          with the kernels embedded (BOA_REQUIRE_KERNELS=1), copy the binary
#                                          and the named tests (default: parity_ops parity_quant parity_search
#                                          parity_boa_dynamic parity_qgemm resident_forward device_run, the
#                                          ones with CUDA halves; ~53 MiB stripped) into
#                                          .gpu_carry/, and print the device call for `run`.
#   profiling/gpu_check.sh --on-device [TEST…]
#                                          on the GPU machine (the `run` tool's command), most valuable first:
#                                          the CUDA halves of the staged tests (or only the named ones); a
#                                          2-block 7B-shaped BoA run with its phase and transfer tables;
#                                          `bench --device cuda --shapes 7b` (attn_x, the packed GEMM, the
#                                          batched expert Grams and R4's transform beside what they replaced
#                                          first); the end-to-end and packed-eval checks; compute-sanitizer.
#                                          Five files under $OUT (summary.md, tests.log, run7b.md, bench.md,
#                                          more.log; scratch elsewhere), the summary printed last.
#                                          SECTIONS="tests 7b bench e2e ppl sanitize" picks sections; all share
#                                          DEADLINE_S (450 s, so a second call fits the session's 15 minutes).
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
default_tests=(parity_ops parity_quant parity_search parity_boa_dynamic parity_qgemm resident_forward device_run)

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
    # Each executable embeds every fatbin, so seven test executables outgrow the carry even stripped (75 MiB at
    # 181b2d8); gzip takes them to about a third, and the device half unpacks them (gzip is on every image).
    local tree
    tree="$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n1 | cut -f1)"
    if ((size + tree > carry_limit)); then
        echo "== $((size >> 20)) MiB staged + $((tree >> 20)) MiB tree, over the carry limit: packing into staged.tar.gz"
        tar -C "$carry" -czf "$carry/staged.tar.gz" bin tests
        rm -rf "$carry/bin" "$carry/tests"
        size="$(du -sb "$carry" | cut -f1)"
        ((size + tree <= carry_limit)) || { echo "gpu_check.sh: still $((size >> 20)) MiB packed" >&2; exit 1; }
    fi
    cat "$carry/manifest.txt"
    cat <<MSG

== staged $((size >> 20)) MiB in $carry_rel/. Now call the \`run\` tool (one call; it prints the table last):
     command:   bash profiling/gpu_check.sh --on-device
     carry:     ["$carry_rel"]
     timeout_s: 600
   (it runs the staged tests: ${want[*]}; stage others with \`profiling/gpu_check.sh NAME…\`)
   summary.md, tests.log, run7b.md, bench.md and more.log come back under \$OUT (files_at); the summary is
   printed last. Give the machine back afterwards unless you rerun at once.
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
    if [[ -f "$carry/staged.tar.gz" && ! -d "$carry/tests" ]]; then tar -C "$carry" -xzf "$carry/staged.tar.gz"; fi
    [[ -d "$carry/tests" ]] || { echo "gpu_check.sh: no $carry_rel/tests; pass carry [\"$carry_rel\"]" >&2; exit 1; }
    export RUST_BACKTRACE=1
    # The `run` tool brings back at most 8 files from $OUT and the last 12 000 characters of output: scratch
    # (models, checkpoints, per-test logs) goes to $scratch, and $OUT gets five files: summary.md (machine,
    # every section's result; also printed last), tests.log, run7b.md, bench.md, more.log.
    local scratch
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
    local summary="$out/summary.md" libs_missing=0
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
    } >"$scratch/machine.txt" 2>&1
    cat "$scratch/machine.txt"
    local status=0 notes="$scratch/notes.txt"
    : >"$notes"
    if ((libs_missing)); then
        status=1
        echo "cuBLAS or cuSOLVER not found (machine section): their work ran on the CPU or the FFMA kernel" >>"$notes"
    fi
    # Sections, most valuable first, under one deadline: each section's timeout shrinks to what is left of
    # DEADLINE_S (default 450 of the call's 600 s, so a second call of the rest fits the session's 15 minutes),
    # and a section left with under 30 s is skipped and named at the end (SECTIONS="bench e2e", say, next time).
    local sections=" ${SECTIONS:-tests 7b bench e2e ppl sanitize} " skipped_sections=() t_start=$SECONDS
    local deadline="${DEADLINE_S:-450}"
    local table="$scratch/tests.md"
    printf '| test binary | exit | passed | failed | CUDA skipped | seconds |\n|---|---|---|---|---|---|\n' >"$table"
    : >"$out/tests.log"
    # 1. The CUDA halves of the parity tests only (the CPU halves ran in CI): the tests named *cuda*, and all of
    #    device_run (every one of its tests runs `run --device cuda`).
    for t in "$carry"/tests/*; do
        local name log rc t0 t1 passed failed skipped c filter=cuda
        name="$(basename "$t")"
        if ((${#only[@]} > 0)) && [[ ! " ${only[*]} " == *" $name "* ]]; then continue; fi
        wanted tests || break
        c="$(cap 150)"
        ((c > 0)) || { skipped_sections+=("tests:$name"); continue; }
        [[ "$name" == device_run ]] && filter=""
        log="$scratch/$name.log"
        chmod +x "$t" "$carry/bin/boa-cuda"
        t0="$(date +%s.%N)"
        set +e
        # device_run runs the binary; cargo's path to it does not exist here.
        BOA_CUDA_BIN="$carry/bin/boa-cuda" timeout "$c" "$t" $filter --test-threads=1 --nocapture >"$log" 2>&1
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
            echo "$name: built against a newer glibc than this machine has (tests.log)" >>"$notes"
        fi
        printf '| %s | %s | %s | %s | %s | %.1f |\n' "$name" "$rc" "$passed" "$failed" "$skipped" \
            "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" >>"$table"
        # The full log of a failed binary, the tail of a passing one.
        { echo "===== $name (exit $rc)"; if ((rc != 0)); then cat "$log"; else tail -n 60 "$log"; fi; } >>"$out/tests.log"
    done
    {
        echo
        echo "max rel. error vs the f64 reference, per backend and kernel variant:"
        sed -n -e 's/^test .* \.\.\. //' -e '/max rel\. error\|rms_norm variant\|linear variant\|causal_attention variant\|cuBLAS unavailable\|skipped: /s/^/    /p' "$scratch"/*.log 2>/dev/null || true
        for log in "$scratch"/*.log; do
            if grep -q -e 'FAILED' -e 'panicked' "$log"; then
                echo "failures in $(basename "$log" .log):"
                grep -e 'panicked' -e 'FAILED' -A4 "$log" | head -n 24 | sed 's/^/    /'
            fi
        done
    } >>"$table"
    # 2. The product's main job on a 7B-shaped model, 2 blocks: the per-phase table and the transfer counts.
    chmod +x "$carry/bin/boa-cuda"
    if wanted 7b; then e2e_7b "$out" "$scratch" || status=1; fi
    # 3. Kernel speed on 7B shapes (src/bench/gpu.rs states the method): attn_x, the packed GEMM and the batched
    #    rows (src/bench/gpu_batched.rs) first, then the quantization core; rows are written as measured, so a
    #    cut-off bench keeps what it finished.
    local bench_rc=0
    if wanted bench; then
        set +e
        timeout "$(cap 150)" "$carry/bin/boa-cuda" bench --device cuda --shapes "${BENCH_SHAPES:-7b}" --reps 3 \
            >"$out/bench.md" 2>"$scratch/bench.log"
        bench_rc=$?
        set -e
        if ((bench_rc != 0)); then
            status=1
            { echo "bench failed (exit $bench_rc):"; tail -n 20 "$scratch/bench.log"; } | tee -a "$notes"
        fi
    fi
    : >"$out/more.log"
    # 4. End to end: `run --device cuda` against `--device cpu` on a synthesized GQA model (d 512, 8 heads over 4
    #    KV heads, 4 blocks), calibrated on this README (the model's tokenizer is byte-level). The relative
    #    output errors of report.json must agree (compare_reports below).
    local e2e_rc=0
    if wanted e2e; then
        set +e
        (
            set -e
            m="$scratch/synth"
            rm -rf "$m" "$scratch"/q-*
            "$carry/bin/boa-cuda" synth-model --out "$m" --d 512 --d-ff 1376 --layers 4 --heads 8 --kv-heads 4
            # BoA 3-bit per channel, GPTQ 4-bit g64 (dynamic groups), then GPTQ under --avg-bits (the output
            # proxy on the device and the model-scope FP pass; fused sets put several Ŵ in the resident block
            # at once; --profile's "allocation proxy" row is its time). Every config runs and reports, even
            # after one fails; the section fails at the end if any did.
            run_config() {
                local cfg="$1" tag="${1// /_}" dev
                for dev in cuda cpu; do
                    # shellcheck disable=SC2086
                    timeout "$(cap 120)" "$carry/bin/boa-cuda" run --model "$m" --calib README.md --method $cfg \
                        --nsamples 16 --seqlen 256 --device "$dev" --format fake --out "$scratch/q-$dev" --quiet \
                        --profile || { echo "e2e: run --device $dev failed"; return 1; }
                    cp "$scratch/q-$dev/report.json" "$scratch/report-$tag-$dev.json" || return 1
                    rm -rf "$scratch/q-$dev"
                done
                compare_reports "$scratch/report-$tag-cuda.json" "$scratch/report-$tag-cpu.json"
            }
            failed=()
            for cfg in "boa --wbits 3" "gptq --wbits 4 --group-size 64" \
                "gptq --avg-bits 3.5 --bit-choices 3,4 --alloc-unit fused --group-size 64"; do
                echo "== $cfg"
                run_config "$cfg" || failed+=("$cfg")
            done
            # Determinism on the GPU: the same BoA run twice must write the same bytes (design.md §3: fixed
            # reduction orders, no atomics in the sums).
            for k in 1 2; do
                timeout "$(cap 120)" "$carry/bin/boa-cuda" run --model "$m" --calib README.md --method boa --wbits 3 \
                    --nsamples 16 --seqlen 256 --device cuda --format gptq_v2 --out "$scratch/det-$k" --quiet \
                    || failed+=("determinism run $k")
            done
            if cmp -s <(cd "$scratch/det-1" && cat ./*.safetensors) <(cd "$scratch/det-2" && cat ./*.safetensors); then
                echo "determinism: two BoA runs on cuda wrote identical tensors"
            else
                echo "determinism: the two BoA runs on cuda wrote different tensors"
                failed+=("determinism")
            fi
            if ((${#failed[@]} > 0)); then
                printf 'e2e: FAIL: %s\n' "${failed[@]}"
                exit 1
            fi
        ) >"$scratch/e2e.log" 2>&1
        e2e_rc=$?
        set -e
        if ((e2e_rc != 0)); then status=1; echo "end-to-end run failed (exit $e2e_rc): more.log" >>"$notes"; fi
        { echo "===== e2e (exit $e2e_rc)"; cat "$scratch/e2e.log"; } >>"$out/more.log"
    fi
    # 5. Packed checkpoints: `eval --device cuda` (packed_linear on the GPU) against `--device cpu`, perplexities
    #    within 1e-3 relative, on checkpoints made here from a synthesized model: 4-bit g128 (contiguous groups:
    #    the fused kernel's fast case) and 3-bit g64 act-order (g_idx permuted), each at seqlen 16, chunk 1 (the
    #    fused kernel) and seqlen 256, chunk 4 (dequantize + cuBLAS). (The demo model's own checkpoint does not
    #    fit the 64 MiB carry: --stage-demo / --demo-part.)
    local ppl_rc=0
    if wanted ppl; then
        set +e
        (
            set -e
            m="$scratch/synth-ppl"
            rm -rf "$m" "$scratch"/q-ppl-*
            "$carry/bin/boa-cuda" synth-model --out "$m" --d 512 --d-ff 1376 --layers 4 --heads 8 --kv-heads 4
            for cfg in "g128 --wbits 4 --group-size 128" "actorder --wbits 3 --group-size 64 --act-order"; do
                tag="${cfg%% *}"
                # shellcheck disable=SC2086
                timeout "$(cap 120)" "$carry/bin/boa-cuda" run --model "$m" --calib README.md --method gptq ${cfg#* } \
                    --nsamples 8 --seqlen 128 --device cpu --format gptq_v2 --out "$scratch/q-ppl-$tag" --quiet
                for shape in "16 1" "256 4"; do
                    read -r sl ch <<<"$shape"
                    for dev in cuda cpu; do
                        timeout "$(cap 120)" "$carry/bin/boa-cuda" eval --model "$scratch/q-ppl-$tag" --data README.md --seqlen "$sl" \
                            --chunk "$ch" --max-windows 8 --device "$dev" --json >"$scratch/ppl-$tag-$sl-$dev.json"
                    done
                    compare_ppl "$scratch/ppl-$tag-$sl-cuda.json" "$scratch/ppl-$tag-$sl-cpu.json" "$tag, seqlen $sl, chunk $ch"
                done
            done
        ) >"$scratch/ppl.log" 2>&1
        ppl_rc=$?
        set -e
        if ((ppl_rc != 0)); then status=1; echo "packed-checkpoint eval check failed (exit $ppl_rc): more.log" >>"$notes"; fi
        { echo "===== ppl (exit $ppl_rc)"; cat "$scratch/ppl.log"; } >>"$out/more.log"
    fi
    # 6. compute-sanitizer: out-of-bounds and uninitialized device accesses the NaN-poisoned parity outputs
    #    cannot see (SANITIZE=0 skips it).
    if wanted sanitize; then sanitize "$scratch" >>"$out/more.log" 2>&1 || { status=1; echo "sanitizer found errors: more.log" >>"$notes"; }; fi
    local not_run=""
    if ((${#skipped_sections[@]} > 0)); then
        status=1
        not_run="not run for lack of time: ${skipped_sections[*]} (DEADLINE_S=$deadline); a second call runs them with
  SECTIONS=\"$(printf '%s\n' "${skipped_sections[@]}" | cut -d: -f1 | sort -u | tr '\n' ' ' | sed 's/ $//')\" bash profiling/gpu_check.sh --on-device"
    fi
    # The summary last: it is what the tool's last 12 000 characters must hold.
    {
        cat "$scratch/machine.txt"
        echo "## parity tests (CUDA halves)"
        cat "$table"
        echo "## 7B-shaped BoA run (run7b.md)"
        [[ -f "$out/run7b.md" ]] && grep -E '^(7B-shaped|per block|blocks|host|floor|\| (0|1|setup|resume|block|phase|total|statistics|scale search|sweep|factorization|forward|error report))' "$out/run7b.md"
        echo "## bench (bench.md): the rows against their goals"
        [[ -f "$out/bench.md" ]] && grep -E '^(\| (attn_x|packed_gemm|gptq_sweep|boa_sweep|stat_|search_grids|factor|quad)|goals|ceilings)' "$out/bench.md" | head -n 40
        echo "## notes"
        cat "$notes"
        echo "$not_run"
        echo "status: $([[ $status == 0 ]] && echo PASS || echo FAIL) after $((SECONDS - t_start)) s"
    } >"$summary"
    rm -rf "$scratch"
    echo
    cat "$summary"
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
    timeout "$(cap 90)" "$cs" --tool memcheck --error-exitcode 9 "$carry/tests/parity_ops" --test-threads=1 cuda \
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
# resident on the GPU, the next block prefetched. E2E_7B_LAYERS blocks (default 2: the first carries one-time
# costs, the second projects the other 31; 32 is the whole model). run7b.md gets the per-phase table, the
# per-block transfer table (bytes each way, syncs, launches against the block's floor) and the projection to
# 32 blocks next to the 2-minute goal (disk reads excluded: the `weights load` row).
e2e_7b() {
    local out="$1" scratch="$2" layers="${E2E_7B_LAYERS:-2}" rc=0
    local m="$scratch/synth7b" q="$scratch/q7b"
    rm -rf "$m" "$q"
    set +e
    (
        set -e
        # Calibration text for the byte-level tokenizer: 262 144 tokens = bytes of this repository's sources.
        find "$root/src" "$root/cuda" "$root/include" -type f -print0 | sort -z | xargs -0 cat >"$scratch/calib7b.txt"
        while (($(stat -c %s "$scratch/calib7b.txt") < 300000)); do cat "$scratch/calib7b.txt" "$scratch/calib7b.txt" >"$scratch/c2" && mv "$scratch/c2" "$scratch/calib7b.txt"; done
        t0="$(date +%s.%N)"
        "$carry/bin/boa-cuda" synth-model --out "$m" --d 4096 --d-ff 11008 --layers "$layers" --heads 32 \
            --kv-heads 32
        echo "synth-model: $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s"
        # ~3.6 s per block on an H200 plus set-up: 60 s + 6 s per block (252 s for 32).
        timeout "$(cap $((60 + 6 * layers)))" "$carry/bin/boa-cuda" run --model "$m" --calib "$scratch/calib7b.txt" --method boa --wbits 3 \
            --nsamples 128 --seqlen 2048 --device cuda --format gptq_v2 --out "$q" --profile
        python3 - "$q/report.json" "$layers" <<'PY'
import json, sys
r, layers = json.load(open(sys.argv[1])), int(sys.argv[2])
s = r["seconds"]
fixed = s.get("calibration_data", 0.0)
per_block = (s["total"] - fixed - s.get("load", 0.0)) / layers
print(f"7B-shaped BoA 3-bit, {layers} blocks: total {s['total']:.1f} s, weights load {s.get('load', 0.0):.1f} s")
print(f"per block (load excluded) {per_block:.2f} s -> 32 blocks {fixed + 32 * per_block:.0f} s (goal <= 120 s)")
# Per-block times (weight waits excluded): the first block carries one-time costs (cuBLAS/cuSOLVER handles,
# pool growth), so the other 31 are projected from the median of the rest.
b = s.get("blocks", [])
if len(b) >= 2:
    rest = sorted(b[1:])[len(b[1:]) // 2]
    print(f"blocks {', '.join(f'{x:.2f}' for x in b)} s -> first + 31 x median of the rest: "
          f"{fixed + b[0] + 31 * rest:.0f} s (goal <= 120 s)")
PY
    ) >"$scratch/e2e-7b.log" 2>&1
    rc=$?
    set -e
    rm -rf "$m" "$q"
    {
        echo "# 7B-shaped BoA 3-bit, $layers blocks, 128 × 2048 tokens (exit $rc)"
        grep -A40 '| phase |' "$scratch/e2e-7b.log" || true
        tail -n 6 "$scratch/e2e-7b.log"
        if ((rc != 0)); then echo "## the run's log"; tail -n 80 "$scratch/e2e-7b.log"; fi
    } >"$out/run7b.md"
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
    # (Packed into staged.tar.gz when the tests made the carry too big: taken out of it.)
    local bin="$carry/bin/boa-cuda"
    if [[ ! -f "$bin" && -f "$carry/staged.tar.gz" ]]; then
        bin="$(mktemp -d)/boa-cuda"
        tar -xzOf "$carry/staged.tar.gz" bin/boa-cuda >"$bin"
    fi
    [[ -s "$bin" ]] || { echo "gpu_check.sh: run the build half first (profiling/gpu_check.sh)" >&2; exit 1; }
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
    cp "$bin" "$dest/p$n/boa-cuda"
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
