#!/usr/bin/env bash
# Installs nvcc 13.0 (plus the CUDA runtime headers and CCCL it needs) from PyPI into a Python venv, so a
# machine without a CUDA toolkit can build the kernels. Pinned to 13.0: the GPU machines run driver 580
# (CUDA 13.0), which cannot load PTX from a newer nvcc. Idempotent: a second run only prints the path.
#
#   usage: scripts/install_nvcc.sh [DIR]     (DIR defaults to ./.nvcc-venv)
#   last line of stdout: the absolute path of nvcc  ->  NVCC=$(scripts/install_nvcc.sh /opt/nvcc | tail -n1)
#
# Needs python3 (3.9+) with the venv module and network access to PyPI (Debian 12: apt-get install python3-venv).
set -euo pipefail

dir="${1:-.nvcc-venv}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

find_nvcc() { find "$dir" -path '*/nvidia/cu13/bin/nvcc' -type f 2>/dev/null | head -n1; }
marker="$dir/.boa-nvcc-13.0-ok"

nvcc="$(find_nvcc)"
if [[ -z "$nvcc" || ! -f "$marker" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    # nvidia-cuda-nvcc 13.0 depends on nvidia-nvvm (cicc) and nvidia-cuda-crt without pinning them, so pip
    # takes the newest (13.5): cicc then writes PTX .version 9.5 that the 13.0 ptxas rejects ("Unsupported
    # .version 9.5; current version is '9.0'"). Pin all five to 13.0.
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check \
        "nvidia-cuda-nvcc==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" >&2
    nvcc="$(find_nvcc)"
    [[ -n "$nvcc" ]] || { echo "install_nvcc.sh: pip finished but no nvidia/cu13/bin/nvcc under $dir" >&2; exit 1; }
    chmod +x "$(dirname "$nvcc")"/* "$(dirname "$nvcc")"/../nvvm/bin/* 2>/dev/null || true
    # Smoke test: the whole chain (cudafe++, cicc, ptxas, fatbinary) for both target archs.
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    printf 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n' >"$tmp/k.cu"
    "$nvcc" -fatbin -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a \
        -gencode=arch=compute_80,code=compute_80 -o "$tmp/k.fatbin" "$tmp/k.cu" >&2 \
        || { echo "install_nvcc.sh: $nvcc cannot compile a trivial kernel" >&2; exit 1; }
    touch "$marker"
fi
"$nvcc" --version | tail -n2 >&2
echo "$nvcc"
