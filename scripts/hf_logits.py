"""transformers' logits of HF folders against stored reference logits (hf_reference.py's reference.safetensors:
the token ids and the logits of the model the folder was made from), one JSON line per pair:
{"model": DIR, "max_rel": max |Δlogit| / max |logit|}. Used by tests/transformers_parity.rs to check that a
rotated folder, loaded by transformers itself, computes what the original computed.
"""
import argparse, json
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("pairs", nargs="+", help="DIR REFERENCE.safetensors, repeated")
args = ap.parse_args()
if len(args.pairs) % 2:
    ap.error("pairs: a folder and a reference file each")
torch.manual_seed(0)
for folder, ref_path in zip(args.pairs[::2], args.pairs[1::2]):
    ref = load_file(ref_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(ref["ids"]).logits
    rel = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
    print(json.dumps({"model": folder, "max_rel": rel}), flush=True)
