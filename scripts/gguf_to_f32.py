#!/usr/bin/env python3
"""A GGUF file with every tensor dequantized to F32 by the `gguf` package (gguf.quants.dequantize) and every
metadata key copied: the same model as llama.cpp computes it without its quantized kernels (which round the
activations to Q8_0 before each quantized product). tests/gguf_export.rs runs llama.cpp on both files: the F32
twin checks the file's layout and hyper-parameters to f32 rounding, the original that llama.cpp runs it.

usage: gguf_to_f32.py IN.gguf OUT.gguf
needs: the reference venv (scripts/install_pyref.sh: gguf, numpy).
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def value(f, i):
    part = f.parts[i]
    return bytes(part).decode("utf-8") if f.types[-1] == GGUFValueType.STRING else part[0].item()


def main():
    src, dst = sys.argv[1:3]
    r = GGUFReader(src)
    f = r.fields["general.architecture"]
    w = GGUFWriter(dst, bytes(f.parts[f.data[0]]).decode("utf-8"))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_array(name, [value(f, i) for i in f.data])
        elif f.types[0] == GGUFValueType.STRING:
            w.add_string(name, value(f, f.data[0]))
        else:
            w.add_key_value(name, value(f, f.data[0]), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
