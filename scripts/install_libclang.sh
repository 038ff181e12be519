#!/usr/bin/env bash
# Installs libclang from PyPI into a Python venv, for the `nvtx` cargo feature (nvtx-sys generates its bindings
# with bindgen, which loads libclang at build time). Idempotent. Prints two lines, ready for `export`:
#   LIBCLANG_PATH=<folder of libclang.so>
#   BINDGEN_EXTRA_CLANG_ARGS=-I<the C compiler's own include folder>   (PyPI's libclang has no stddef.h)
#
#   usage: env="$(scripts/install_libclang.sh [DIR])" && eval "$(sed 's/^/export /' <<<"$env")"
#          (DIR defaults to ./.libclang-venv)
set -euo pipefail

dir="${1:-.libclang-venv}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
find_lib() { find "$dir" -path '*/clang/native/libclang.so' -type f 2>/dev/null | head -n1; }
lib="$(find_lib)"
if [[ -z "$lib" ]]; then
    [[ -x "$dir/bin/python" ]] || python3 -m venv "$dir" >&2
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "libclang==18.1.*" >&2
    lib="$(find_lib)"
    [[ -n "$lib" ]] || { echo "install_libclang.sh: pip finished but no clang/native/libclang.so under $dir" >&2; exit 1; }
fi
stddef="$(cc -print-file-name=include/stddef.h)"
[[ "$stddef" == /* ]] || { echo "install_libclang.sh: the C compiler (cc) has no include/stddef.h" >&2; exit 1; }
echo "LIBCLANG_PATH=$(dirname "$lib")"
echo "BINDGEN_EXTRA_CLANG_ARGS=-I$(dirname "$stddef")"
