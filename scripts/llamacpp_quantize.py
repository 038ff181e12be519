#!/usr/bin/env python3
"""llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python: scripts/install_llamacpp.sh) on an
F32/F16 GGUF, the baseline `run --format gguf` is compared with (README, "GGUF"). Only the linears are
quantized, as `boa-cuda run --format gguf` does: token embeddings and the output matrix stay F32
(token_embedding_type, output_tensor_type), so both files have the same size. No importance matrix.

usage: llamacpp_quantize.py IN.gguf OUT.gguf TYPE      (TYPE: q4_0 or q8_0)
"""
import sys

import llama_cpp

FTYPES = {"q4_0": 2, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
GGML_TYPE_F32 = 0

src, dst, ty = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = FTYPES[ty]
p.token_embedding_type = GGML_TYPE_F32
p.output_tensor_type = GGML_TYPE_F32
if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p) != 0:
    sys.exit(f"llama_model_quantize failed on {src}")
