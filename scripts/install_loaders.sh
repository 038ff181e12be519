#!/usr/bin/env bash
# Installs the third-party loaders our checkpoints are checked against (tests/loaders.rs) into a cached
# Python venv: GPTQModel (its own `GPTQModel.load`) and transformers + optimum (`from_pretrained` of a
# GPTQ folder, which goes through GPTQModel's kernels), and compressed-tensors (`from_pretrained` of a
# --format compressed-tensors folder; tests/compressed_tensors.rs). Separate from the pyref venv
# (install_pyref.sh): GPTQModel pulls in accelerate, datasets, torchao…, which must not move the versions the parity tests
# compare against. Pinned, so a CI run loads with the same code every time; GPTQModel builds no extension
# at install (its CPU kernels are JIT-compiled or pure torch). Idempotent: a second run only prints the
# path. ~3.5 GB of wheels (torch brings the CUDA libraries; only the CPU is used), a few minutes from PyPI.
#
#   usage: scripts/install_loaders.sh [DIR]     (DIR defaults to ~/.cache/boa-cuda/loaders)
#   last line of stdout: the venv's python  ->  BOA_LOADERS_PYTHON=$(scripts/install_loaders.sh | tail -n1)
set -euo pipefail

dir="${1:-$HOME/.cache/boa-cuda/loaders}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pins=(torch==2.15.0 transformers==5.24.0 optimum==2.3.0 gptqmodel==7.7.0 compressed-tensors==0.20.0 safetensors numpy)
marker="$dir/.boa-loaders-$(echo "${pins[*]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$marker" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" >&2
    "$dir/bin/python" -c "import torch, transformers, optimum, gptqmodel, compressed_tensors, safetensors" >&2
    touch "$marker"
fi
echo "$dir/bin/python"
