#!/usr/bin/env bash
# The quality table of the real Gemma 3 270M (docs/architectures.md, "Gemma 3 270M (real model)"): the
# Q4_K_M GGUF (scripts/fetch_gemma3.sh) imported to f32 — that dequantized model is the table's FP — then
# RTN, GPTQ and BoA at 3-bit per-channel and 4-bit groups of 64 through scripts/quality_table.sh (calibration
# on the speeches before 2000, perplexity on the 2001–2016 speeches and Moby-Dick, seqlen 512). Fewer windows
# than the demo table by default (NSAMPLES=64, EVAL_WINDOWS=20): the 262k-token head makes each eval window
# about 7× the demo model's work. Resumable like quality_table.sh. Usage: scripts/quality_table_gemma3.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/quality-gemma3}
mkdir -p "$out"
gguf=${BOA_GEMMA3_GGUF:-$(scripts/fetch_gemma3.sh | tail -n1)}
model=$out/gemma-3-270m
if [[ ! -f $model/model.safetensors ]]; then
  cargo build --release --quiet
  target/release/boa-cuda import-gguf "$gguf" --out "$model" --force
fi
MODEL=$model SETTINGS="3 -1;4 64" PASSES="rtn gptq boa" NSAMPLES=${NSAMPLES:-64} \
  EVAL_WINDOWS=${EVAL_WINDOWS:-20} scripts/quality_table.sh "$out"
