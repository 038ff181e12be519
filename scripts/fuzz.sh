#!/usr/bin/env bash
# Fuzz the untrusted-input parsers for a bounded time each (not in CI).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 120)
#
# With a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`): the libFuzzer targets in fuzz/
# (gguf_reader, weight_store), seeded with valid files, with a 4 GiB RSS cap (-rss_limit_mb) so an
# allocation sized by a hostile header is a finding. Without them: the stable seeded-mutation harness
# (#[ignore]d tests fuzz_gguf_mutations and fuzz_safetensors_mutations, 16 GiB address-space cap).
# BOA_FUZZ_STABLE=1 forces the stable harness.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-120}

if [[ -z "${BOA_FUZZ_STABLE:-}" ]] && cargo +nightly fuzz --version >/dev/null 2>&1; then
    mkdir -p fuzz/corpus/gguf_reader fuzz/corpus/weight_store
    # Valid seeds: the synthetic GGUF and the tiny model's safetensors, written by the test helpers.
    BOA_FUZZ_SEED_DIR="$PWD/fuzz/corpus" cargo test --release --test gguf_import --test hostile_inputs \
        write_fuzz_seed -- --ignored --quiet
    for t in gguf_reader weight_store; do
        echo "== $t: ${secs}s"
        cargo +nightly fuzz run --release "$t" "fuzz/corpus/$t" -- \
            -max_total_time="$secs" -rss_limit_mb=4096 -max_len=1048576
    done
else
    echo "cargo-fuzz or nightly missing: running the stable mutation harness (${secs}s per target)"
    BOA_FUZZ_SECS="$secs" BOA_FUZZ_ITERS=100000000 cargo test --release --test gguf_import \
        --test hostile_inputs fuzz_ -- --ignored --nocapture
fi
