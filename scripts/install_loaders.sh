#!/usr/bin/env bash
# Installs the third-party loaders our checkpoints are checked against (tests/loaders.rs,
# tests/compressed_tensors.rs): GPTQModel (its own `GPTQModel.load`), transformers + optimum (`from_pretrained`
# of a GPTQ folder, through GPTQModel's kernels) and compressed-tensors. They go into the reference venv of
# scripts/install_pyref.sh, which already holds the same torch and transformers: one copy of torch and its
# CUDA libraries (~3 GB that PyPI's torch always brings, though only the CPU is used) instead of two, minutes
# of CI. What install_pyref.sh pinned stays as it is (pip gets it as constraints): GPTQModel's own
# dependencies (datasets, torchao, …) cannot move the versions the parity tests compare against. GPTQModel
# builds no extension at install (its CPU kernels are JIT-compiled or pure torch). Pinned; idempotent: a
# second run only prints the path.
#
#   usage: scripts/install_loaders.sh [DIR]     (DIR: the reference venv, default ~/.cache/boa-cuda/pyref)
#   last line of stdout: the venv's python  ->  BOA_LOADERS_PYTHON=$(scripts/install_loaders.sh | tail -n1)
set -euo pipefail

py="$("$(dirname "$0")/install_pyref.sh" "$@" | tail -n1)"
dir="$(dirname "$(dirname "$py")")"
pins=(optimum==2.3.0 gptqmodel==7.7.0 compressed-tensors==0.20.0)
marker="$dir/.boa-loaders-$(echo "${pins[*]} $(cd "$dir" && ls .boa-pyref-*)" | sha256sum | cut -c1-12)"
if [[ ! -f "$marker" ]]; then
    # Not named .boa-pyref-*: the marker hashes that listing, which this file would change after the first run.
    constraints="$dir/.boa-loaders-constraints.txt"
    "$py" -m pip freeze --disable-pip-version-check \
        | grep -iE '^(torch|transformers|accelerate|gguf|safetensors|numpy|tokenizers)==' >"$constraints"
    "$py" -m pip install --quiet --disable-pip-version-check -c "$constraints" "${pins[@]}" >&2
    "$py" -c "import torch, transformers, optimum, gptqmodel, compressed_tensors, safetensors, gguf" >&2
    touch "$marker"
fi
echo "$py"
