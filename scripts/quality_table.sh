#!/usr/bin/env bash
# The README's quality table: RTN, GPTQ and BoA on the demo model, calibrated on the State of the Union
# speeches before 2000 (128 windows × 512 tokens, seed 0), evaluated on the 2001–2016 speeches and on
# Moby-Dick (perplexity, seqlen 512, the first $EVAL_WINDOWS windows of each). Resumable: finished entries
# in $OUT/results.jsonl are skipped. Usage: scripts/quality_table.sh [OUT_DIR]
#
# Another model: MODEL (a Hugging Face folder; default the demo model, fetched), SETTINGS ("bits group"
# pairs separated by ';', group -1 = per-channel) and PASSES (method lists separated by ';', run one after the
# other; boa-wout = BoA with the W_out V row Hessian). scripts/quality_table_gemma3.sh is one such call.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/quality}
nsamples=${NSAMPLES:-128}
eval_windows=${EVAL_WINDOWS:-40}
settings=${SETTINGS:-"3 -1;2 64;3 64;4 -1"}
passes=${PASSES:-"rtn gptq boa;boa-wout"}
mkdir -p "$out"
if [[ -z ${MODEL:-} ]]; then scripts/fetch_demo.sh; fi
python3 scripts/texts.py >/dev/null
texts=data/texts
# A private copy, so rebuilding while the table runs cannot mix two versions in one table; a resumed table
# keeps the copy it started with.
if [[ ! -x "$out/boa-cuda" ]]; then
  cargo build --release --quiet
  cp target/release/boa-cuda "$out/boa-cuda"
fi
bin=$out/boa-cuda
model=${MODEL:-demo/smollm2-135m}
sotu=$texts/sotu
calib=$(ls $sotu | awk -F_ '$1 < 2000' | sed "s|^|$sotu/|")
speeches=$(ls $sotu | awk -F_ '$1 >= 2001 && $1 <= 2016' | sed "s|^|$sotu/|")
moby=$texts/moby-dick.txt
results=$out/results.jsonl
touch "$results"

evaluate() { # name model_dir extra-json
  local name=$1 dir=$2 extra=$3
  grep -q "\"name\": \"$name\"" "$results" && return 0
  local s m
  s=$($bin eval --model "$dir" --data $speeches --seqlen 512 --max-windows "$eval_windows" --device cpu --json)
  m=$($bin eval --model "$dir" --data $moby --seqlen 512 --max-windows "$eval_windows" --device cpu --json)
  python3 -c "import json,sys; s,m=json.loads(sys.argv[2]),json.loads(sys.argv[3]); e=json.loads(sys.argv[4]); \
print(json.dumps(dict(name=sys.argv[1], speeches=s['perplexity'], moby=m['perplexity'], **e)))" \
    "$name" "$s" "$m" "$extra" >> "$results"
}

evaluate fp "$model" '{}'
# Two passes: the table's three methods first (BoA with the default V row Hessian, the identity), then the
# variant the issue asks to compare (W_out).
IFS=';' read -ra pass_list <<< "$passes"
IFS=';' read -ra setting_list <<< "$settings"
for pass in "${pass_list[@]}"; do
  for setting in "${setting_list[@]}"; do
    set -- $setting
    # boa-wout: BoA with the paper's V row Hessian (W_outᵀW_out) instead of the default identity.
    for method in $pass; do
      name="w$1-g$2-$method"
      grep -q "\"name\": \"$name\"" "$results" && continue
      flags="--method $method"
      [[ $method == boa-wout ]] && flags="--method boa --v-row-hessian wout"
      start=$(date +%s)
      $bin run --model $model --calib $calib $flags --wbits $1 --group-size $2 --nsamples "$nsamples" \
        --seqlen 512 --seed 0 --device cpu --format fake --out "$out/$name" --force --quiet
      secs=$(( $(date +%s) - start ))
      evaluate "$name" "$out/$name" "{\"bits\": $1, \"group\": $2, \"method\": \"$method\", \"run_seconds\": $secs}"
      rm -rf "$out/$name"
    done
  done
done

python3 - "$results" "$nsamples" "$eval_windows" "$settings" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
fp = next(r for r in rows if r["name"] == "fp")
print(f"calibration {sys.argv[2]} x 512 tokens (speeches < 2000, seed 0); eval: first {sys.argv[3]} windows x 512")
print(f"FP: 2001-2016 speeches {fp['speeches']:.2f}, Moby-Dick {fp['moby']:.2f}\n")
print("| setting | method | 2001–2016 speeches | Moby-Dick | run time (s) |")
print("|---|---|---|---|---|")
ok = True
settings = sorted(tuple(map(int, s.split())) for s in sys.argv[4].split(";"))
for bits, group in settings:
    ppl = {}
    for m in ["rtn", "gptq", "boa", "boa-wout"]:
        r = next((r for r in rows if r["name"] == f"w{bits}-g{group}-{m}"), None)
        if r is None:
            continue
        ppl[m] = r
        g = "per-channel" if group == -1 else f"g{group}"
        label = {"rtn": "RTN", "gptq": "GPTQ", "boa": "BoA", "boa-wout": "BoA, V row W_out"}[m]
        print(f"| {bits}-bit {g} | {label} | {r['speeches']:.2f} | {r['moby']:.2f} | {r['run_seconds']} |")
    if all(m in ppl for m in ["rtn", "gptq", "boa"]):
        for t in ["speeches", "moby"]:
            ok &= ppl["boa"][t] < ppl["gptq"][t] < ppl["rtn"][t]
print(f"\nordering BoA < GPTQ < RTN on both texts in every setting: {'yes' if ok else 'NO'}")
wins = {"wout": 0, "identity": 0}
for r in rows:
    if r["name"].endswith("-boa-wout"):
        i = next((x for x in rows if x["name"] == r["name"][: -len("-wout")]), None)
        for t in ["speeches", "moby"] if i else []:
            wins["wout" if r[t] < i[t] else "identity"] += 1
print(f"V row Hessian, lower perplexity (setting x text): W_out {wins['wout']}, identity {wins['identity']}")
PY
