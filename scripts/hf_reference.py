"""Small random models of every architecture boa-cuda supports, with transformers' own logits on them.

For each architecture: a config of that architecture (every option that changes the math switched on
somewhere: GQA, Llama 3 rope scaling, q/k/v/o and MLP biases, tied embeddings, Qwen3's q/k norm and an
explicit head_dim, mixtures of experts with and without renormalized top-k, with a shared expert), a model built with `from_config` (no hub) whose parameters — norms and biases too — are
drawn at random so no term is an identity, `save_pretrained` into OUT/<name>/ with the given tokenizer.json,
and OUT/<name>/reference.safetensors holding the token ids of the first windows of the text and transformers'
f32 logits on them. Prints one JSON line per model: name, architecture, windows, seqlen, summed next-token
NLL and perplexity.

    python scripts/hf_reference.py --out DIR --tokenizer demo/smollm2-135m/tokenizer.json \
        --text data/texts/<file> [--seqlen 64] [--windows 2] [--only NAME ...]
"""
import argparse, json, math, os, shutil

import torch
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)


def common(vocab):
    return dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


def configs(vocab):
    c = common(vocab)
    kq = {**c, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4}
    return {
        # Llama 3.x: GQA, untied head, rope scaling with a short original context so the scaled band is used.
        "llama3": LlamaConfig(**c, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32}),
        # Llama with every bias switch on (q/k/v/o and the MLP).
        "llama_bias": LlamaConfig(**c, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        # Mistral: a sliding window (40) shorter than the windows evaluated here, in every layer.
        "mistral": MistralConfig(**c, sliding_window=40, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Qwen2: q/k/v biases, tied embeddings.
        "qwen2": Qwen2Config(**c, tie_word_embeddings=True, use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Qwen3: per-head q/k RMSNorm before RoPE, head_dim (32) ≠ hidden_size / heads (16).
        "qwen3": Qwen3Config(**c, head_dim=32, tie_word_embeddings=True, attention_bias=False,
                             use_sliding_window=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Gemma 3: sandwich norms (1 + w), GeGLU, √d embedding scale, q/k norm, scores scaled by
        # query_pre_attn_scalar (≠ head_dim), local and global layers with their own RoPE (linear scaling
        # on the global one), the local layers' sliding window (24) shorter than the windows here.
        "gemma3": Gemma3TextConfig(**{**c, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
                                   sliding_window=24, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 1000000.0}}),
        # Qwen3-MoE: Qwen3's attention, 8 experts of 48, top-2 of the softmax kept as they are
        # (norm_topk_prob false; Mixtral covers the renormalized case).
        "qwen3_moe": Qwen3MoeConfig(**c, head_dim=32, moe_intermediate_size=48, num_experts=8,
                                    num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Mixtral: Mistral's attention, 4 experts of intermediate_size, top-2 renormalized.
        "mixtral": MixtralConfig(**{**c, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=None, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Qwen2-MoE: q/k/v biases, 4 experts of 32, top-2 renormalized, a shared expert of 96 gated by
        # sigmoid(w_g · x); a sliding window (40 < 64) in layer 0 only (Qwen2-MoE marks even layers below
        # max_window_layers).
        "qwen2_moe": Qwen2MoeConfig(**c, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    use_sliding_window=True, sliding_window=40, max_window_layers=1,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Qwen3 with every released Qwen3's head_dim (128): transformers' GGUF loader does not read the
        # file's key_length for qwen3 and takes Qwen3Config's default head_dim, 128 (tests/gguf_export.rs).
        # Last, so the other models keep their seeds.
        "qwen3_hd128": Qwen3Config(**c, head_dim=128, tie_word_embeddings=True, attention_bias=False,
                                   use_sliding_window=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # The MoE models as llama.cpp runs them (tests/gguf_export.rs): experts 64 wide (GGUF's 32-column
        # blocks), Qwen3-MoE's top-k renormalized as every released one and llama.cpp's qwen3moe do, Qwen2-MoE's
        # not (Qwen1.5-MoE's; llama.cpp's qwen2moe never renormalizes) and without a sliding window.
        "qwen3_moe_gguf": Qwen3MoeConfig(**c, head_dim=32, moe_intermediate_size=64, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen2_moe_gguf": Qwen2MoeConfig(**c, moe_intermediate_size=32, shared_expert_intermediate_size=96,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                         use_sliding_window=False, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Mixtures of experts sized for the K-quants (tests/gguf_export.rs, --gguf-type): inputs of 256 (one
        # super-block), 4 layers (llama.cpp's use_more_bits marks 2 and 3), 8 experts (where llama.cpp's
        # Mixtral rules apply) and 4 (where they do not).
        "mixtral_kq": MixtralConfig(**kq, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                                    tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen2_moe_kq": Qwen2MoeConfig(**kq, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                       use_sliding_window=False, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen3_moe_kq": Qwen3MoeConfig(**kq, head_dim=64, moe_intermediate_size=256, num_experts=4,
                                       num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        # Gemma 3 as llama.cpp's gemma3 runs it (tests/gguf_export.rs): every 6th layer global, the local ones
        # at RoPE base 10000 with a window (24) shorter than the windows here, query_pre_attn_scalar = head_dim;
        # the global layer's linear RoPE scaling travels as gemma3.rope.scaling.*.
        "gemma3_gguf": Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=32, query_pre_attn_scalar=32,
                                        sliding_window=24, tie_word_embeddings=True,
                                        layer_types=["sliding_attention"] * 5 + ["full_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 1000000.0}}),
    }


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by (1 + w): around 1 either way, never all ones.
    offset = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(offset + 0.25 * r)
            elif name.endswith(".bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.2 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))  # unit-variance outputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--only", nargs="*")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = PreTrainedTokenizerFast(tokenizer_file=a.tokenizer)
    ids = tok(open(a.text, encoding="utf-8").read())["input_ids"]
    n = a.windows
    assert len(ids) >= n * a.seqlen, "text too short"
    wins = torch.tensor(ids[: n * a.seqlen]).view(n, a.seqlen)
    for i, (name, cfg) in enumerate(configs(len(tok)).items()):
        if a.only and name not in a.only:
            continue
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        randomize(model, 2000 + i)
        d = os.path.join(a.out, name)
        model.save_pretrained(d, safe_serialization=True)
        shutil.copy(a.tokenizer, os.path.join(d, "tokenizer.json"))
        with torch.inference_mode():
            logits = model(wins).logits.float().contiguous()
        lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        nll = -lp.gather(-1, wins[:, 1:, None]).sum().item()
        save_file({"ids": wins.to(torch.int64).contiguous(), "logits": logits},
                  os.path.join(d, "reference.safetensors"))
        print(json.dumps({"name": name, "architecture": cfg.architectures[0] if cfg.architectures else
                          type(model).__name__, "windows": n, "seqlen": a.seqlen, "nll": nll,
                          "perplexity": math.exp(nll / (n * (a.seqlen - 1)))}), flush=True)


if __name__ == "__main__":
    main()
