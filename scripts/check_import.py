#!/usr/bin/env python3
"""Check a folder written by boa-cuda's GGUF import against transformers' own GGUF loader.

transformers dequantizes with the `gguf` package and un-permutes Q/K itself, so it is an independent
reference for every tensor (dequantization, shapes, Q/K un-permutation) and for the tokenizer on digit-free
text (its converter ignores llama.cpp's "smollm" digit split, so texts with digits are not compared here).

usage: check_import.py IMPORTED_DIR [GGUF]   (GGUF defaults to demo/SmolLM2-135M-Instruct.Q4_1.gguf)
needs: torch, transformers, gguf, safetensors, numpy. Exit status 1 on any mismatch.
"""

import json
import os
import sys
import warnings

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

warnings.filterwarnings("ignore")


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    out_dir = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    gguf = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "demo/SmolLM2-135M-Instruct.Q4_1.gguf")
    gdir, gname = os.path.split(os.path.abspath(gguf))

    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    # f32 output must match exactly up to f32 rounding of d·q + m; 16-bit output up to one rounding.
    tol = {"float32": 1e-6, "float16": 2**-10, "bfloat16": 2**-7}[cfg["torch_dtype"]]

    ref = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, torch_dtype=torch.float32)
    ref_sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = load_file(os.path.join(out_dir, "model.safetensors"))
    failed = 0
    if cfg["tie_word_embeddings"]:
        ref_sd.pop("lm_head.weight", None)
    for name in sorted(set(ref_sd) | set(ours)):
        if name not in ours or name not in ref_sd:
            print(f"MISSING {name}: in ours={name in ours}, in transformers={name in ref_sd}")
            failed += 1
            continue
        a, b = ours[name].astype(np.float32), ref_sd[name]
        if a.shape != b.shape:
            print(f"SHAPE {name}: ours {a.shape} vs transformers {b.shape}")
            failed += 1
            continue
        # Relative to the tensor's scale for 16-bit outputs, absolute for f32.
        scale = 1.0 if tol == 1e-6 else max(float(np.abs(b).max()), 1e-30)
        diff = float(np.abs(a - b).max())
        if diff > tol * scale:
            print(f"VALUES {name}: max abs diff {diff:.3e} > {tol * scale:.3e}")
            failed += 1
    worst = max(float(np.abs(ours[k].astype(np.float32) - ref_sd[k]).max()) for k in ours if k in ref_sd)
    print(f"tensors: {len(ours)} compared, {failed} mismatches, max abs diff over all tensors {worst:.3e}")

    for key, want in [
        ("num_hidden_layers", ref.config.num_hidden_layers),
        ("hidden_size", ref.config.hidden_size),
        ("intermediate_size", ref.config.intermediate_size),
        ("num_attention_heads", ref.config.num_attention_heads),
        ("num_key_value_heads", ref.config.num_key_value_heads),
        ("vocab_size", ref.config.vocab_size),
    ]:
        if cfg[key] != want:
            print(f"CONFIG {key}: ours {cfg[key]} vs transformers {want}")
            failed += 1

    from tokenizers import Tokenizer

    ours_tk = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    ref_tk = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>",
        "  Leading spaces,\ttabs\nand unicode: café, naïve, 東京, emoji 🙂.",
    ]
    for t in texts:
        a = ours_tk.encode(t).ids
        b = ref_tk(t)["input_ids"]
        if a != b:
            print(f"TOKENS {t!r}:\n  ours         {a}\n  transformers {b}")
            failed += 1
    print(f"tokenizer: {len(texts)} digit-free texts compared")

    # The folder must load as a plain HF model and tokenizer and give the GGUF model's logits.
    hf_tk = AutoTokenizer.from_pretrained(out_dir)
    hf = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
    ids = hf_tk("In 2016, the 44th President said: 1,234 things.", return_tensors="pt")["input_ids"]
    if ids[0].tolist() != ours_tk.encode("In 2016, the 44th President said: 1,234 things.").ids:
        print("TOKENS: AutoTokenizer on the imported folder disagrees with tokenizer.json")
        failed += 1
    with torch.no_grad():
        la, lb = hf(ids).logits, ref(ids).logits
    ldiff = float((la - lb).abs().max())
    print(f"logits: max abs diff {ldiff:.3e} over {ids.shape[1]} tokens (imported folder vs GGUF load)")
    if ldiff > 1e-3 * float(lb.abs().max()):
        failed += 1
    print("OK" if failed == 0 else f"FAILED ({failed} mismatches)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
