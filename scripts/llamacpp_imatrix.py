#!/usr/bin/env python3
"""An importance matrix for llama.cpp's quantizer (scripts/llamacpp_quantize.py --imatrix), made without its
`llama-imatrix` tool (llama-cpp-python does not build it): what that tool collects, the mean over calibration
tokens of each input column's square, x_j², for every linear, by transformers' f32 forward with a hook on each
nn.Linear's input. Keys are the GGUF tensor names of convert_hf_to_gguf.py's llama mapping (blk.N.attn_q.weight
...); a row permutation of q/k (llama.cpp's RoPE layout) does not touch columns, so the values need none. Only
the columns' relative sizes matter to ggml's quantizers (each row's weights are scaled by them).

Calibration: the texts concatenated (in the order given, one newline between files) and tokenized by the
model's tokenizer, then NSAMPLES windows of SEQLEN tokens evenly spaced over the stream (llama-imatrix takes
consecutive chunks from the start; spacing them covers all the files, as `boa-cuda run`'s random windows do).

usage: llamacpp_imatrix.py MODEL_DIR OUT.npz TEXT... [--nsamples 32] [--seqlen 512]
Runs in the reference venv (scripts/install_pyref.sh).
"""
import argparse
import re

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("out")
ap.add_argument("texts", nargs="+")
ap.add_argument("--nsamples", type=int, default=32)
ap.add_argument("--seqlen", type=int, default=512)
a = ap.parse_args()

GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down"}

tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
text = "\n".join(open(p, encoding="utf-8").read() for p in a.texts)
ids = tok(text, return_tensors="pt").input_ids[0]
if len(ids) < a.nsamples * a.seqlen:
    raise SystemExit(f"{len(ids)} tokens: fewer than {a.nsamples} windows of {a.seqlen}")
stride = (len(ids) - a.seqlen) // max(1, a.nsamples - 1)

sums, counts, hooks = {}, {}, []
for name, mod in model.named_modules():
    m = re.fullmatch(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)", name)
    if not isinstance(mod, torch.nn.Linear) or m is None:
        continue
    key = f"blk.{m.group(1)}.{GGUF[m.group(2)]}.weight"

    def hook(_mod, inp, _out, key=key):
        x = inp[0].reshape(-1, inp[0].shape[-1]).double()
        sums[key] = sums.get(key, 0) + (x * x).sum(0)
        counts[key] = counts.get(key, 0) + x.shape[0]

    hooks.append(mod.register_forward_hook(hook))
with torch.no_grad():
    for w in range(a.nsamples):
        model(ids[w * stride:w * stride + a.seqlen][None])
np.savez(a.out, **{k: (s / counts[k]).float().numpy() for k, s in sums.items()})
print(f"{a.out}: {len(sums)} tensors, {a.nsamples} x {a.seqlen} tokens")
