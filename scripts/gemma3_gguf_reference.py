"""transformers' own load of a Gemma 3 GGUF (tokenizer and model, `gguf_file=`), for tests/gemma3_gguf.rs to
compare boa-cuda's import with. Run with the pyref venv (scripts/install_pyref.sh):

    gemma3_gguf_reference.py --gguf FILE.gguf --out OUT.safetensors --text A.txt [B.txt ...] \
        [--seqlen 128] [--windows 2] [--window-texts 2]

OUT gets `ids_<k>`: the token ids transformers gives text k (`tokenizer(text)["input_ids"]`, BOS included),
`windows`: `--windows` consecutive windows of `--seqlen` ids from the start of each of the first
`--window-texts` texts, and `logits`: the model's f32 logits on them [windows, seqlen, vocab]. Prints one
JSON line with the timings.
"""
import argparse, json, os, time

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--text", nargs="+", required=True)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window-texts", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder, name = os.path.split(os.path.abspath(a.gguf))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    t_tok = time.time() - t0
    out = {}
    wins = []
    for k, path in enumerate(a.text):
        ids = tok(open(path, encoding="utf-8").read())["input_ids"]
        out[f"ids_{k}"] = torch.tensor(ids, dtype=torch.int64)
        if k < a.window_texts:
            assert len(ids) >= a.windows * a.seqlen, f"{path} is too short"
            wins += [ids[w * a.seqlen : (w + 1) * a.seqlen] for w in range(a.windows)]
    t1 = time.time()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    t_load = time.time() - t1
    wins = torch.tensor(wins, dtype=torch.int64)
    with torch.inference_mode():
        logits = torch.cat([model(w[None]).logits.float() for w in wins]).contiguous()
    out["windows"] = wins.contiguous()
    out["logits"] = logits
    save_file(out, a.out)
    print(json.dumps({"tokenizer_s": round(t_tok, 1), "model_load_s": round(t_load, 1),
                      "total_s": round(time.time() - t0, 1), "windows": len(wins), "seqlen": a.seqlen,
                      "class": type(model).__name__}), flush=True)


if __name__ == "__main__":
    main()
