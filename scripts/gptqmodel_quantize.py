#!/usr/bin/env python3
"""A GPTQ checkpoint written by GPTQModel itself (tests/transformers_parity.rs: `boa-cuda eval` and `inspect`
must read what the most used GPTQ tool writes, not only our own output).

Quantizes MODEL_DIR on the CPU with GPTQModel's own GPTQ (QuantizeConfig(bits, group_size, desc_act), its
defaults otherwise: symmetric, the v1 `gptq` checkpoint format) on --nsamples windows of --seqlen tokens from
the start of TEXT (the folder's tokenizer.json), and saves it to OUT_DIR with `model.save`.

usage: gptqmodel_quantize.py MODEL_DIR OUT_DIR --text TEXT --bits B --group-size G [--desc-act]
       [--nsamples 8] [--seqlen 64]
needs: the venv of scripts/install_loaders.sh.
"""
import argparse, os, sys

os.environ.setdefault("GPTQMODEL_NO_BANNER", "1")
# GPTQModel sizes a 2-worker model-loader pool under its CPU pool, which defaults to half the cores: on a
# 2-core machine that is 1, and it refuses to start ("requests 2 workers but parent 'cpu' only has 1").
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--text", required=True)
    ap.add_argument("--bits", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--desc-act", action="store_true")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=64)
    a = ap.parse_args()
    a.model, a.out, a.text = (os.path.abspath(p) for p in (a.model, a.out, a.text))
    # GPTQModel writes its quantization logs under ./logs: beside the output folder, never into the caller's
    # directory (cargo test runs in the repository).
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    os.chdir(os.path.dirname(a.out))
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.model, "tokenizer.json"))
    ids = tok(open(a.text, encoding="utf-8").read()[: 200 * a.nsamples * a.seqlen])["input_ids"]
    if len(ids) < a.nsamples * a.seqlen:
        raise SystemExit(f"{a.text}: {len(ids)} tokens, fewer than {a.nsamples} x {a.seqlen}")
    calib = [{"input_ids": ids[i * a.seqlen:(i + 1) * a.seqlen], "attention_mask": [1] * a.seqlen}
             for i in range(a.nsamples)]
    qc = QuantizeConfig(bits=a.bits, group_size=a.group_size, desc_act=a.desc_act)
    model = GPTQModel.load(a.model, qc, device="cpu")
    model.quantize(calib, batch_size=1)
    model.save(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
