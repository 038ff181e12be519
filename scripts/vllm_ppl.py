#!/usr/bin/env python3
"""Perplexity of a model folder as vLLM serves it (tests/vllm_load.rs, README "vLLM").

Same protocol as `boa-cuda eval` and scripts/check_loaders.py: the text's token ids from the folder's
tokenizer.json, non-overlapping windows of --seqlen from the start, mean next-token NLL over all windows, exp.
vLLM scores each window as a prompt (`prompt_logprobs=0`: the log-probability of each actual next token),
one `LLM` per run, in this process (no engine subprocess), eager (no compilation).

vLLM's CPU build quantizes the activations of 4-bit linears to int8 by default on AMX machines
(VLLM_CPU_INT4_W4A8=1, its W4A8 path): that is a different model from the W4A16 one its GPU kernels run, so
this script turns it off unless the caller set it.

Prints one JSON object: {"dir", "loader": "vllm", "vllm", "dtype", "quantization", "perplexity"}, or
{"dir", "loader": "vllm", "vllm", "error"} when vLLM refuses the folder (its message, whitespace folded): a
refusal is a result, not a crash.

usage: vllm_ppl.py --data TEXT [--seqlen 64] [--max-windows 8] [--dtype float16] DIR
needs: the venv of scripts/install_vllm.sh.
"""
import argparse, json, math, os, sys

os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a few short windows need little


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--max-windows", type=int, default=8)
    # vLLM's GPTQ path takes float16 or bfloat16 activations; float16 keeps 3 more mantissa bits, so its
    # perplexity lands closer to our f32 one.
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("dir")
    a = ap.parse_args()

    import vllm
    from transformers import PreTrainedTokenizerFast
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(a.dir, "tokenizer.json"))
    with open(a.data, encoding="utf-8") as f:
        ids = tok(f.read())["input_ids"]
    n = min(len(ids) // a.seqlen, a.max_windows)
    if n == 0:
        sys.exit(f"{a.data}: fewer than {a.seqlen} tokens")
    wins = [ids[i * a.seqlen:(i + 1) * a.seqlen] for i in range(n)]
    row = {"dir": a.dir, "loader": "vllm", "vllm": vllm.__version__}
    try:
        llm = LLM(model=a.dir, dtype=a.dtype, enforce_eager=True, max_model_len=a.seqlen + 1, seed=0,
                  max_num_seqs=n)
    except Exception as e:  # vLLM refusing the checkpoint (config validation, weight loading)
        print(json.dumps({**row, "error": " ".join(str(e).split())[:400]}), flush=True)
        return
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in wins],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    nll = 0.0
    for w, o in zip(wins, outs):
        nll -= sum(o.prompt_logprobs[t][w[t]].logprob for t in range(1, a.seqlen))
    quant = getattr(llm.llm_engine.vllm_config.model_config, "quantization", None)
    print(json.dumps({**row, "dtype": a.dtype, "quantization": quant,
                      "perplexity": math.exp(nll / (n * (a.seqlen - 1)))}), flush=True)


if __name__ == "__main__":
    main()
