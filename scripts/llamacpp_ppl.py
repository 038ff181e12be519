#!/usr/bin/env python3
"""Perplexity of a GGUF file in llama.cpp itself (through llama-cpp-python, built from source by
scripts/install_llamacpp.sh), with the protocol of `boa-cuda eval`: the text tokenized by the file's own
vocabulary (llama.cpp's tokenizer, BOS only with --add-bos, as a model whose tokenizer adds one is
evaluated by `boa-cuda eval`), non-overlapping windows of --seqlen from the start, mean
next-token NLL over all windows (log-softmax in f64), exp. The KV cache is f32, not llama.cpp's default
f16 (which alone moved an all-Q8_0 demo model's perplexity by 8.6e-3 relative, 2026-12-03), so what remains
is the weights and llama.cpp's own arithmetic: its CPU kernels multiply Q4_0/Q8_0 weights with activations
rounded to Q8_0, so its perplexity still differs slightly from an f32 forward.
Prints one JSON object: {"perplexity", "windows", "tokens_head"} (the first 32 token ids, to compare with ours).

usage: llamacpp_ppl.py FILE.gguf TEXT [--seqlen 128] [--max-windows 2] [--add-bos]
"""
import argparse, json, math, os

import numpy as np
from llama_cpp import Llama

ap = argparse.ArgumentParser()
ap.add_argument("gguf")
ap.add_argument("text")
ap.add_argument("--seqlen", type=int, default=128)
ap.add_argument("--max-windows", type=int, default=2)
ap.add_argument("--add-bos", action="store_true")
a = ap.parse_args()
GGML_TYPE_F32 = 0
llm = Llama(model_path=a.gguf, n_ctx=a.seqlen, n_batch=a.seqlen, logits_all=True, verbose=False,
            type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, flash_attn=False,
            n_threads=max(1, min(os.cpu_count() or 1, 16)))
ids = llm.tokenize(open(a.text, encoding="utf-8").read().encode("utf-8"), add_bos=a.add_bos, special=False)
n = min(len(ids) // a.seqlen, a.max_windows)
nll = 0.0
for w in range(n):
    toks = ids[w * a.seqlen:(w + 1) * a.seqlen]
    llm.reset()
    llm.eval(toks)
    logits = np.asarray(llm.scores[: a.seqlen - 1], dtype=np.float64)
    m = logits.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1)))
    nll -= float((logits[np.arange(a.seqlen - 1), toks[1:]] - lse).sum())
print(json.dumps({"perplexity": math.exp(nll / (n * (a.seqlen - 1))), "windows": n, "tokens_head": ids[:32]}))
