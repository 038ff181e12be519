#!/usr/bin/env bash
# The test command: fetches the demo model and Gemma 3 270M Q4_K_M, unpacks the texts (data/texts.tar.xz)
# and installs the reference venv with the loaders and the llama.cpp venv (scripts/install_pyref.sh,
# install_loaders.sh, install_llamacpp.sh) if needed (tests need all five and fail without them), then runs
# every test in release mode (the forward passes are too slow unoptimized).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_demo.sh
# The real K-quant file every GGUF decoder is checked on (tests/gguf_kquant.rs); 253 MB, cached.
BOA_GEMMA3_GGUF="${BOA_GEMMA3_GGUF:-$(scripts/fetch_gemma3.sh | tail -n1)}"
export BOA_GEMMA3_GGUF
python3 scripts/texts.py >/dev/null
# transformers and the gguf package, the references of tests/transformers_parity.rs (cached venv).
BOA_PYREF_PYTHON="${BOA_PYREF_PYTHON:-$(scripts/install_pyref.sh | tail -n1)}"
export BOA_PYREF_PYTHON
# GPTQModel, transformers + optimum and compressed-tensors, the loaders of tests/loaders.rs and
# compressed_tensors.rs (added to the reference venv, which has the same torch and transformers).
BOA_LOADERS_PYTHON="${BOA_LOADERS_PYTHON:-$(scripts/install_loaders.sh | tail -n1)}"
export BOA_LOADERS_PYTHON
# llama.cpp through llama-cpp-python, built from source once (tests/gguf_export.rs; a third cached venv).
BOA_LLAMACPP_PYTHON="${BOA_LLAMACPP_PYTHON:-$(scripts/install_llamacpp.sh | tail -n1)}"
export BOA_LLAMACPP_PYTHON
phase() {  # also into .ci/run's summary of step times when it runs us
    echo "[test.sh] $1 after ${SECONDS} s" | tee -a "${BOA_CI_TIMES:-/dev/null}" >&2
}
phase "data and venvs ready"
cargo test --release --no-run "$@"
phase "tests built"
cargo test --release "$@"
