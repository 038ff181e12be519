#!/usr/bin/env python3
"""llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python: scripts/install_llamacpp.sh) on an
F32/F16 GGUF, the baseline `run --format gguf` is compared with (README, "GGUF"). Only the linears are
quantized, as `boa-cuda run --format gguf` does: token embeddings and the output matrix stay F32
(token_embedding_type, output_tensor_type), so both files have the same size. No importance matrix.

TYPE is a `boa-cuda run --gguf-type` name: one type for every linear (q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k,
q4_k, q5_k, q6_k: llama.cpp's `pure` mode with the file type whose default type it is), or one of llama.cpp's
presets (q2_k_mix = its Q2_K, q2_k_s, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m). In both, llama.cpp
falls back per tensor when a row is not whole blocks of the type. --requantize lets it take an already
quantized file (it dequantizes first): tests/gguf_export.rs compares the type it gives each tensor of one of
our files with ours.

usage: llamacpp_quantize.py IN.gguf OUT.gguf TYPE [--requantize]
"""
import sys

import llama_cpp

# llama.cpp's LLAMA_FTYPE_MOSTLY_*; pure types use the file type whose default tensor type they are.
PURE = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 11, "q4_k": 14, "q5_k": 16,
        "q6_k": 18}
PRESETS = {"q2_k_mix": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16,
           "q5_k_m": 17, "q2_k_s": 21}
GGML_TYPE_F32 = 0

src, dst, ty = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
if ty in PURE:
    p.ftype = PURE[ty]
    p.pure = True
elif ty in PRESETS:
    p.ftype = PRESETS[ty]
else:
    sys.exit(f"unknown TYPE {ty} (one of {', '.join([*PURE, *PRESETS])})")
p.allow_requantize = "--requantize" in sys.argv[4:]
p.token_embedding_type = GGML_TYPE_F32
p.output_tensor_type = GGML_TYPE_F32
if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p) != 0:
    sys.exit(f"llama_model_quantize failed on {src}")
