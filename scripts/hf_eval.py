"""Perplexity and throughput of an HF folder with transformers (the comparison side of bench_eval.sh).

Same protocol as `boa-cuda eval`: the text's token ids from the folder's tokenizer.json, non-overlapping
windows of --seqlen from the start, mean next-token NLL over all windows, exp. Times the forward passes only
(the model is loaded and warmed up first) and prints one JSON object.
"""
import argparse, json, math, time
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--data", required=True, nargs="+")
ap.add_argument("--seqlen", type=int, default=512)
ap.add_argument("--max-windows", type=int, default=8)
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--threads", type=int, default=0)
a = ap.parse_args()
if a.threads:
    torch.set_num_threads(a.threads)
text = "\n\n".join(open(p, encoding="utf-8").read() for p in a.data)
tok = PreTrainedTokenizerFast(tokenizer_file=f"{a.model}/tokenizer.json")
ids = tok(text)["input_ids"]
n = min(len(ids) // a.seqlen, a.max_windows)
wins = torch.tensor(ids[: n * a.seqlen]).view(n, a.seqlen)
model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32).eval()
with torch.inference_mode():
    model(wins[:1])  # warm-up
    nll, t0 = 0.0, time.perf_counter()
    for b in range(0, n, a.batch):
        x = wins[b : b + a.batch]
        logits = model(x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
    secs = time.perf_counter() - t0
print(json.dumps({"perplexity": math.exp(nll / (n * (a.seqlen - 1))), "tokens": n * a.seqlen, "windows": n,
                  "seconds": secs, "tokens_per_second": n * a.seqlen / secs, "threads": torch.get_num_threads(),
                  "batch": a.batch, "torch": torch.__version__}))
