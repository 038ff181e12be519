#!/usr/bin/env python3
"""Whether llama.cpp tokenizes texts the same with two GGUF files' vocabularies (through llama-cpp-python,
vocabulary only): each text whole, BOS added, once with special-token parsing off and once on. Prints one
JSON object: {"compared": ids compared, "texts": n, "first_difference": null or where the ids first differ}.

usage: llamacpp_tokens_equal.py A.gguf B.gguf TEXT...
"""
import json, sys

from llama_cpp import Llama

a = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
b = Llama(model_path=sys.argv[2], vocab_only=True, verbose=False)
compared, diff = 0, None
for path in sys.argv[3:]:
    text = open(path, encoding="utf-8").read().encode("utf-8")
    for special in (False, True):
        x = a.tokenize(text, add_bos=True, special=special)
        y = b.tokenize(text, add_bos=True, special=special)
        compared += len(x)
        if x != y and diff is None:
            i = next((i for i in range(min(len(x), len(y))) if x[i] != y[i]), min(len(x), len(y)))
            diff = {"text": path, "special": special, "lengths": [len(x), len(y)], "at": i,
                    "a": x[max(0, i - 3):i + 4], "b": y[max(0, i - 3):i + 4]}
print(json.dumps({"compared": compared, "texts": len(sys.argv) - 3, "first_difference": diff}))
