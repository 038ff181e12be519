#!/usr/bin/env python3
"""A `run --format gguf` file's quantized linears, dequantized by the `gguf` package (gguf.quants.dequantize,
the reader transformers uses; not our code), against the same run written as `--format fake`
(tests/gguf_export.rs). In llama-architecture files, llama.cpp's q/k row permutation is undone here as
transformers does it (rows reshaped [n_head, hd/2, 2, cols] -> [n_head, 2, hd/2, cols]).

Mixture-of-experts files: each expert of `ffn_{gate,up,down}_exps` and the shared expert count as one linear.
Prints one JSON object: {"compared": n, "max_abs_diff": x, "mismatched": [names…], "types": {tensor: type}}.

usage: check_gguf_weights.py FILE.gguf FAKE_DIR
needs: the reference venv (scripts/install_pyref.sh: gguf, numpy, safetensors).
"""
import glob, json, os, sys

import gguf
import numpy as np
from safetensors import safe_open

HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Mixture-of-experts blocks: one GGUF tensor per layer and part holds every expert ([n_expert, d_out, d_in]);
# the shared expert (Qwen2-MoE) has its own.
SHEXP = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
         "ffn_down_shexp": "mlp.shared_expert.down_proj"}
EXPS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"), "ffn_down_exps": ("down_proj", "w2")}
FLOAT = {"F32", "F16", "BF16"}


def field(r, key):
    f = r.fields[key]
    return int(f.parts[f.data[0]][0])


def main():
    path, fake = sys.argv[1:3]
    r = gguf.GGUFReader(path)
    f = r.fields["general.architecture"]
    arch = bytes(f.parts[f.data[0]]).decode()
    # Only convert_hf_to_gguf.py's llama architecture permutes q/k rows (qwen2/qwen3 keep HF's).
    heads = {"attn_q": field(r, f"{arch}.attention.head_count"),
             "attn_k": field(r, f"{arch}.attention.head_count_kv")} if arch == "llama" else {}
    # Tensor name -> shard, read lazily (only the quantized linears are compared).
    shards = {}
    for f in sorted(glob.glob(os.path.join(fake, "*.safetensors"))):
        with safe_open(f, "numpy") as st:
            shards.update({k: f for k in st.keys()})
    n, worst, bad, types = 0, 0.0, [], {}
    def expert_key(layer, part, e):
        """The fake folder's name of expert e's linear (Qwen-MoE or Mixtral naming)."""
        qwen, mixtral = EXPS[part]
        for k in (f"model.layers.{layer}.mlp.experts.{e}.{qwen}.weight",
                  f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral}.weight"):
            if k in shards:
                return k
        sys.exit(f"blk.{layer}.{part}: no expert {e} in {fake}")

    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in {**HF, **SHEXP, **EXPS}:
            continue
        types[t.name] = t.tensor_type.name
        if t.tensor_type.name in FLOAT:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if parts[2] in EXPS:
            pairs = [(expert_key(parts[1], parts[2], e), w[e]) for e in range(w.shape[0])]
        else:
            if parts[2] in heads:
                h = heads[parts[2]]
                rows, cols = w.shape
                w = w.reshape(h, rows // h // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
            pairs = [(f"model.layers.{parts[1]}.{HF.get(parts[2]) or SHEXP[parts[2]]}.weight", w)]
        for key, w in pairs:
            with safe_open(shards[key], "numpy") as st:
                want = st.get_tensor(key).astype(np.float32)
            if want.shape != w.shape:
                sys.exit(f"{t.name}: shape {w.shape} vs {want.shape} of {key} in {fake}")
            d = float(np.abs(w.astype(np.float64) - want.astype(np.float64)).max())
            if not np.array_equal(w.view(np.uint32), want.view(np.uint32)):
                bad.append(key)
            worst = max(worst, d)
            n += 1
    print(json.dumps({"compared": n, "max_abs_diff": worst, "mismatched": bad, "types": types}))


if __name__ == "__main__":
    main()
