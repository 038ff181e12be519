"""Reference decodes of ggml tensors by the `gguf` Python package (gguf.quants.dequantize), for
tests/gguf_kquant.rs to compare with boa-cuda's decoders bit for bit. Run with the pyref venv
(scripts/install_pyref.sh):

  gguf_reference.py blocks TYPE IN OUT [TYPE IN OUT ...]
      IN holds whole blocks of ggml type TYPE (a name: Q4_K, F16, ...); OUT gets their f32 values (LE).
  gguf_reference.py tensors FILE.gguf
      Every tensor of FILE.gguf in file order, to stdout: u32 name length, name (UTF-8), u32 ggml type id,
      u64 element count, then the f32 values (LE). Rows are decoded a chunk at a time, so memory stays small.
"""

import struct
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

ROWS_PER_CHUNK = 4096


def decode_rows(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`raw`: uint8 [rows, bytes per row] → float32 [rows, values per row]."""
    return np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)


def blocks(args: list[str]) -> None:
    if len(args) % 3 != 0 or not args:
        sys.exit("blocks: expected TYPE IN OUT triples")
    for name, src, dst in zip(args[0::3], args[1::3], args[2::3]):
        qtype = GGMLQuantizationType[name]
        _, type_size = GGML_QUANT_SIZES[qtype]
        raw = np.fromfile(src, dtype=np.uint8)
        if raw.size % type_size != 0:
            sys.exit(f"{src}: {raw.size} bytes is not a whole number of {name} blocks ({type_size} B)")
        decode_rows(raw.reshape(1, -1), qtype).tofile(dst)


def tensors(path: str) -> None:
    out = sys.stdout.buffer
    for t in GGUFReader(path).tensors:
        name = t.name.encode()
        out.write(struct.pack("<I", len(name)) + name + struct.pack("<IQ", int(t.tensor_type), int(t.n_elements)))
        # t.data is typed for F32/F16 and uint8 bytes for the rest; as bytes, one row per ggml row.
        row_len = int(t.shape[0])
        block_size, type_size = GGML_QUANT_SIZES[t.tensor_type]
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1, row_len // block_size * type_size)
        for r0 in range(0, raw.shape[0], ROWS_PER_CHUNK):
            out.write(decode_rows(raw[r0 : r0 + ROWS_PER_CHUNK], t.tensor_type).tobytes())
    out.flush()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "blocks":
        blocks(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "tensors":
        tensors(sys.argv[2])
    else:
        sys.exit(__doc__)
