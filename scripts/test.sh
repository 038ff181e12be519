#!/usr/bin/env bash
# The test command: fetches the demo model and unpacks the texts (data/texts.tar.xz) if needed (tests need
# both and fail without them), then runs every test in release mode (the forward passes are too slow unoptimized).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_demo.sh
python3 scripts/texts.py >/dev/null
cargo test --release "$@"
