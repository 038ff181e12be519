#!/usr/bin/env bash
# The test command: fetches the demo model if needed (tests need it and fail without it), then runs every
# test in release mode (the forward passes are too slow unoptimized).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_demo.sh
cargo test --release "$@"
