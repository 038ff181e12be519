#!/usr/bin/env bash
# Installs llama.cpp itself, through llama-cpp-python (PyPI has no CPU wheel: pip builds llama.cpp from its
# source, ~5.5 min on 2 cores), into a cached Python venv: tests/gguf_export.rs evaluates our GGUF files with
# it (scripts/llamacpp_ppl.py). Portable build (no -march=native), no tools or examples. Pinned; idempotent: a
# second run only prints the path.
#
#   usage: scripts/install_llamacpp.sh [DIR]     (DIR defaults to ~/.cache/boa-cuda/llamacpp)
#   last line of stdout: the venv's python  ->  BOA_LLAMACPP_PYTHON=$(scripts/install_llamacpp.sh | tail -n1)
set -euo pipefail

dir="${1:-$HOME/.cache/boa-cuda/llamacpp}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pins=(llama-cpp-python==0.3.36 numpy)
cmake_args="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF"
marker="$dir/.boa-llamacpp-$(echo "${pins[*]} $cmake_args" | sha256sum | cut -c1-12)"
if [[ ! -f "$marker" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    echo "building llama.cpp (llama-cpp-python from source; minutes)" >&2
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir "${pins[@]}" >&2
    "$dir/bin/python" -c "import llama_cpp, numpy" >&2
    touch "$marker"
fi
echo "$dir/bin/python"
