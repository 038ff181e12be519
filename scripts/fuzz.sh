#!/usr/bin/env bash
# Fuzz the untrusted-input parsers for a bounded time each. CI runs it with a short budget (.ci/run).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 120)
#
# Targets: gguf_reader (GGUF container + importer), gguf_dequant (the ggml tensor decoders), weight_store
# (safetensors opener and block loaders), packed_checkpoint (the packed GPTQ loader and its quantization
# config). With a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`; BOA_FUZZ_INSTALL=1 makes
# this script install it when missing): the libFuzzer targets in fuzz/, seeded with valid inputs, with a
# 4 GiB RSS cap (-rss_limit_mb) so an allocation sized by a hostile header is a finding. Without them: the
# stable seeded-mutation harness, the same bodies as #[ignore]d tests (fuzz_* in tests/gguf_import.rs,
# hostile_inputs.rs and packed_checkpoint.rs) under a 16 GiB address-space cap. BOA_FUZZ_STABLE=1 forces
# the stable harness. Exits non-zero on the first crash (libFuzzer saves the input under fuzz/artifacts/).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}
targets=(gguf_reader gguf_dequant weight_store packed_checkpoint)

have_libfuzzer() { cargo +nightly fuzz --version >/dev/null 2>&1; }
if [[ -z "${BOA_FUZZ_STABLE:-}" && -n "${BOA_FUZZ_INSTALL:-}" ]] && ! have_libfuzzer \
    && cargo +nightly --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install --locked --quiet cargo-fuzz || echo "cargo-fuzz could not be installed"
fi

if [[ -z "${BOA_FUZZ_STABLE:-}" ]] && have_libfuzzer; then
    for t in "${targets[@]}"; do mkdir -p "fuzz/corpus/$t"; done
    # Valid seeds written by the test helpers.
    BOA_FUZZ_SEED_DIR="$PWD/fuzz/corpus" cargo test --release --test gguf_import --test hostile_inputs \
        --test packed_checkpoint write_fuzz_seed -- --ignored --quiet
    for t in "${targets[@]}"; do
        echo "== $t: ${secs}s"
        # The parsers never touch CUDA: the sanitizer build (its own target dir) skips nvcc.
        env -u NVCC -u BOA_REQUIRE_KERNELS cargo +nightly fuzz run --release "$t" "fuzz/corpus/$t" -- \
            -max_total_time="$secs" -rss_limit_mb=4096 -max_len=1048576
    done
else
    echo "cargo-fuzz or nightly missing: running the stable mutation harness (${secs}s per target)"
    BOA_FUZZ_SECS="$secs" BOA_FUZZ_ITERS=100000000 cargo test --release --test gguf_import \
        --test hostile_inputs --test packed_checkpoint fuzz_ -- --ignored --nocapture
fi
