#!/usr/bin/env bash
# Installs the third-party reference implementations the tests compare against into a cached Python venv:
# torch + transformers (the forward of every architecture, from random models built with `from_config`) and
# the `gguf` package (GGUF dequantization), and accelerate (which transformers needs to load a GGUF model:
# tests/gemma3_gguf.rs). Pinned, so a CI run compares against the same code every time.
# Idempotent: a second run only prints the path. ~3 GB of wheels (torch brings the CUDA libraries with it;
# only the CPU is used), about a minute from PyPI.
#
#   usage: scripts/install_pyref.sh [DIR]     (DIR defaults to ~/.cache/boa-cuda/pyref)
#   last line of stdout: the venv's python  ->  BOA_PYREF_PYTHON=$(scripts/install_pyref.sh | tail -n1)
set -euo pipefail

dir="${1:-$HOME/.cache/boa-cuda/pyref}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pins=(torch==2.15.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.16.0 safetensors numpy)
marker="$dir/.boa-pyref-$(echo "${pins[*]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$marker" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
    "$dir/bin/python" -c "import torch, transformers, gguf, safetensors" >&2
    touch "$marker"
fi
echo "$dir/bin/python"
