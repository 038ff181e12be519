#!/usr/bin/env python3
"""Independent unpacker of packed GPTQ checkpoints, written from the published layout (design.md §9), not
from boa-cuda's code: it checks that what `boa-cuda run --format gptq|gptq_v2` writes means what we say.

Layout: qweight int32 [ceil(d_in*b/32), d_out]: column j is the bit stream of output j's codes q[0..d_in]
laid out LSB-first over consecutive words (3-bit codes straddle words); qzeros int32
[n_groups, ceil(d_out*b/32)]: row g is the bit stream of group g's zeros over outputs; checkpoint_format
"gptq" (v1) stores zero - 1, "gptq_v2" the zero; scales f16 [n_groups, d_out]; g_idx int32 [d_in].
W[j, i] = scales[g_idx[i], j] * (q[i, j] - zero[g_idx[i], j]), in float32.

Usage:
  python3 scripts/unpack_gptq.py PACKED_DIR [--compare FAKE_DIR]
With --compare, every dequantized weight is compared bit for bit with FAKE_DIR's `.weight` of the same
name (a `--format fake` folder written from the same run; F32, or F16 after rounding); exit status 1 on
any difference. Needs numpy and safetensors (pip install numpy safetensors).
"""

import argparse
import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def quant_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    q = cfg.get("quantization_config")
    if q is None:
        with open(os.path.join(folder, "quantize_config.json")) as f:
            q = json.load(f)
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        sys.exit(f"unknown checkpoint_format {fmt!r}")
    return int(q["bits"]), int(q.get("group_size", -1)), fmt


def load_all(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def unpack_stream(words, bits, n):
    """words uint32 [n_words, cols]: stream down each column -> codes [n, cols]."""
    w = words.astype(np.uint64)
    w = np.concatenate([w, np.zeros((1, w.shape[1]), np.uint64)])  # a straddling read of the last word
    bit = np.arange(n, dtype=np.uint64) * np.uint64(bits)
    idx = (bit // np.uint64(32)).astype(np.int64)
    off = (bit % np.uint64(32))[:, None]
    pair = w[idx] | (w[idx + 1] << np.uint64(32))  # 64 bits starting at the code's word
    return ((pair >> off) & np.uint64((1 << bits) - 1)).astype(np.int64)


def dequantize(t, prefix, bits, group_size, fmt):
    qweight = t[prefix + ".qweight"].view(np.uint32)
    qzeros = t[prefix + ".qzeros"].view(np.uint32)
    scales = t[prefix + ".scales"].astype(np.float32)
    n_groups, d_out = scales.shape
    if prefix + ".g_idx" in t:
        g_idx = t[prefix + ".g_idx"].astype(np.int64)
        d_in = g_idx.shape[0]
    else:
        d_in = qweight.shape[0] * 32 // bits
        g = d_in if group_size == -1 else group_size
        g_idx = np.arange(d_in) // g
    q = unpack_stream(qweight, bits, d_in)  # [d_in, d_out]
    z = unpack_stream(qzeros.T, bits, d_out).T  # [n_groups, d_out]
    if fmt == "gptq":
        z = z + 1
    zf = z.astype(np.float32)[g_idx]  # [d_in, d_out]
    sf = scales[g_idx]
    w = sf * (q.astype(np.float32) - zf)  # float32 throughout: s * (q - z)
    return np.ascontiguousarray(w.T), (d_out, d_in, n_groups)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("packed")
    ap.add_argument("--compare", help="fake-quant folder written from the same run")
    a = ap.parse_args()
    bits, group_size, fmt = quant_config(a.packed)
    t = load_all(a.packed)
    ref = load_all(a.compare) if a.compare else None
    prefixes = sorted(k[: -len(".qweight")] for k in t if k.endswith(".qweight"))
    print(f"{a.packed}: {len(prefixes)} packed linears, {bits}-bit, group size {group_size}, format {fmt}")
    bad = 0
    for p in prefixes:
        w, (d_out, d_in, ng) = dequantize(t, p, bits, group_size, fmt)
        if ref is None:
            print(f"  {p}: [{d_out} x {d_in}], {ng} groups, mean |W| {np.abs(w).mean():.6g}")
            continue
        r = ref[p + ".weight"]
        if r.dtype == np.float16:
            w = w.astype(np.float16)
        elif r.dtype != np.float32:
            sys.exit(f"{p}.weight has dtype {r.dtype}; compare against an F32 or F16 fake folder")
        same = r.shape == w.shape and np.array_equal(r.view(np.uint8), w.view(np.uint8))
        if not same:
            bad += 1
            n = int((r != w).sum()) if r.shape == w.shape else -1
            print(f"  {p}: DIFFERS ({n} values)")
    if ref is not None:
        print(f"compared {len(prefixes)} linears with {a.compare}: "
              f"{len(prefixes) - bad} bit-identical, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
