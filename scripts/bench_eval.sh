#!/usr/bin/env bash
# Eval throughput of boa-cuda against HF transformers on the same CPU, same model, same windows, run side by
# side. Usage: scripts/bench_eval.sh [WINDOWS]   (default 8 windows × 512 tokens of Moby-Dick)
# Installs torch + transformers into .venv-bench on first use (a few GB; not needed for anything else);
# BENCH_VENV=<dir> uses an existing one instead. Prints the load average before and after: the two engines
# run one after the other, so other work on the machine skews the ratio (torch's threads suffer more).
set -euo pipefail
cd "$(dirname "$0")/.."
windows=${1:-8}
scripts/fetch_demo.sh
python3 scripts/texts.py >/dev/null
texts=data/texts
cargo build --release --quiet
venv=${BENCH_VENV:-.venv-bench}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch transformers
fi
model=demo/smollm2-135m
data=$texts/moby-dick.txt
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
ours=$(target/release/boa-cuda eval --model "$model" --data "$data" --seqlen 512 --max-windows "$windows" --device cpu --json)
hf1=$("$venv/bin/python" scripts/hf_eval.py --model "$model" --data "$data" --max-windows "$windows" --batch 1)
hf8=$("$venv/bin/python" scripts/hf_eval.py --model "$model" --data "$data" --max-windows "$windows" --batch 8)
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
python3 - "$ours" "$hf1" "$hf8" "$load_before" "$load_after" <<'PY'
import json, sys, os
o, h1, h8 = (json.loads(a) for a in sys.argv[1:4])
print(f"machine: {os.cpu_count()} cores; {o['windows']} windows x 512 tokens of moby-dick.txt; demo model, f32")
print(f"load average (1, 5, 15 min) before: {sys.argv[4]}; after: {sys.argv[5]}")
print(f"{'engine':<34}{'perplexity':>12}{'seconds':>10}{'tokens/s':>10}")
for name, r in [("boa-cuda eval (cpu)", o), ("transformers, batch 1", h1), ("transformers, batch 8", h8)]:
    print(f"{name:<34}{r['perplexity']:>12.4f}{r['seconds']:>10.2f}{r['tokens_per_second']:>10.0f}")
best = max(h1["tokens_per_second"], h8["tokens_per_second"])
print(f"ratio boa-cuda / best transformers: {o['tokens_per_second'] / best:.2f}x")
PY
