#!/usr/bin/env python3
"""Perplexity of packed GPTQ folders as third-party loaders see them (tests/loaders.rs, README loader matrix).

Same protocol as `boa-cuda eval`: the text's token ids from the folder's tokenizer.json, non-overlapping
windows of --seqlen from the start, mean next-token NLL over all windows (log-softmax in f64), exp.
Loaders:
  gptqmodel           GPTQModel.load(DIR, device="cpu"), its automatic kernel and dtype (bfloat16);
  gptqmodel-f16       the same in float16 (closer to f32 than bfloat16: a tighter comparison);
  transformers        AutoModelForCausalLM.from_pretrained(DIR), the folder's own quantization_config
                      (transformers hands it to optimum + GPTQModel and picks the kernel);
  transformers-torch  the same with GPTQConfig(backend="torch"), GPTQModel's pure-torch kernel;
  compressed-tensors  from_pretrained of a --format compressed-tensors folder as transformers loads it by default
                      (dequantize=False: the modules are built compressed and compressed-tensors decompresses
                      them on the first forward, on the CPU too);
  compressed-tensors-dequantize  the same with CompressedTensorsConfig(dequantize=True): decompressed while
                      the weights load.
  transformers-gguf   from_pretrained(DIR, gguf_file="model.gguf") of a --format gguf folder in float32:
                      transformers dequantizes every tensor with the gguf package and undoes llama.cpp's q/k
                      row permutation itself (run it with the venv of scripts/install_pyref.sh, which has
                      gguf). The folder has no tokenizer.json: pass --tokenizer.
Prints one JSON object per folder and loader: {"dir", "loader", "dtype", "kernel", "perplexity"} or {"dir", "loader",
"error"} (the exception's first line); a loader that refuses a folder is a result, not a crash.
--weights-like SUFFIX adds {"compared", "max_abs_diff"}: the loaded model's linear weights (after the forward, so
decompressed) against the `.weight` tensors of the folder DIR+SUFFIX (e.g. the same run written as --format fake).

--tokenizer DIR takes the token ids from DIR/tokenizer.json instead of each folder's own.

usage: check_loaders.py --data TEXT [--seqlen 128] [--max-windows 2] [--weights-like SUFFIX] [--tokenizer DIR]
       --loader NAME [--loader NAME…] DIR…
needs: the reference venv with the loaders (scripts/install_loaders.sh; transformers-gguf: install_pyref.sh alone).
"""
import argparse, contextlib, io, json, logging, math, os, sys, warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("GPTQMODEL_NO_BANNER", "1")


def windows(folder, text, seqlen, max_windows):
    import torch
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    ids = tok(text)["input_ids"]
    n = min(len(ids) // seqlen, max_windows)
    return torch.tensor(ids[: n * seqlen]).view(n, seqlen)


def load(folder, loader):
    import torch
    if loader == "gptqmodel":
        from gptqmodel import GPTQModel
        # GPTQModel's own default dtype: bfloat16 on the CPU (its TorchLinear kernel refuses float32).
        return GPTQModel.load(folder, device="cpu").model
    if loader == "gptqmodel-f16":
        from gptqmodel import GPTQModel
        return GPTQModel.load(folder, device="cpu", dtype=torch.float16).model
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, GPTQConfig
    kw = {}
    if loader == "transformers-gguf":
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", device_map="cpu",
                                                    dtype=torch.float32)
    if loader == "compressed-tensors-dequantize":
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    elif loader == "compressed-tensors":
        pass
    elif loader == "transformers-torch":
        kw["quantization_config"] = GPTQConfig(bits=json.load(open(os.path.join(folder, "config.json")))
                                               ["quantization_config"]["bits"], backend="torch")
    elif loader != "transformers":
        raise SystemExit(f"unknown loader {loader!r}")
    # transformers' default dtype: the config's (float32 for the demo model).
    return AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", **kw)


def perplexity(model, wins):
    import torch
    nll = 0.0
    with torch.inference_mode():
        for w in wins:
            x = w[None]
            lp = torch.log_softmax(model(x).logits[0, :-1].double(), dim=-1)
            nll -= lp.gather(-1, x[0, 1:, None]).sum().item()
    return math.exp(nll / (wins.shape[0] * (wins.shape[1] - 1)))


def weights_diff(model, ref_dir):
    import glob, re
    from safetensors.torch import load_file
    sd = model.state_dict()
    ref = {}
    for f in sorted(glob.glob(os.path.join(ref_dir, "*.safetensors"))):
        ref.update(load_file(f))
    n, worst = 0, 0.0

    def compare(name, got, want):
        nonlocal n, worst
        if got.shape != want.shape:
            raise ValueError(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)} in {ref_dir}")
        worst = max(worst, (got.double() - want.double()).abs().max().item())
        n += 1

    for k, v in ref.items():
        # Only the quantized linears: norms and embeddings are copied through in every format.
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and k in sd:
            compare(k, sd[k], v)
    # transformers 5 holds a block's experts fused, [E × 2·I × d] (gate rows, then up rows) and [E × d × I];
    # the folder has one linear per expert and part, under either set of names Mixtral has had.
    parts = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
    for k, v in sd.items():
        m = re.fullmatch(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", k)
        if m is None:
            continue
        layer, fused = m.groups()

        def expert(e, part):
            for block, name in zip(("mlp", "block_sparse_moe"), parts[part]):
                key = f"{layer}.{block}.experts.{e}.{name}.weight"
                if key in ref:
                    return key, ref[key]
            raise ValueError(f"{layer} expert {e}: no {part} weight in {ref_dir}")

        for e in range(v.shape[0]):
            if fused == "down_proj":
                name, want = expert(e, "down")
                compare(name, v[e], want)
            else:
                half = v.shape[1] // 2
                for part, got in (("gate", v[e][:half]), ("up", v[e][half:])):
                    name, want = expert(e, part)
                    compare(name, got, want)
    return n, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--max-windows", type=int, default=2)
    ap.add_argument("--loader", action="append", required=True)
    ap.add_argument("--weights-like")
    ap.add_argument("--tokenizer")
    ap.add_argument("dirs", nargs="+")
    a = ap.parse_args()
    text = open(a.data, encoding="utf-8").read()
    logging.disable(logging.WARNING)
    for d in a.dirs:
        wins = windows(a.tokenizer or d, text, a.seqlen, a.max_windows)
        for loader in a.loader:
            row = {"dir": d, "loader": loader}
            # The loaders log freely on stdout; only our JSON lines go there.
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    model = load(d, loader)
                    row["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
                    row["kernel"] = type(model.model.layers[0].self_attn.q_proj).__name__
                    row["perplexity"] = perplexity(model, wins)
                    if a.weights_like is not None:
                        row["compared"], row["max_abs_diff"] = weights_diff(model, d + a.weights_like)
                except Exception as e:  # a refusal is the measurement
                    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
