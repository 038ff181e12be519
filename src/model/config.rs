//! config.json of a Hugging Face Llama-family model, validated so that later code can trust every shape.

use super::arch::{self, BlockDesc, Dims};
use super::raw_config::RawConfig;
use crate::error::file_err;
use serde::Deserialize;
use std::path::Path;

pub use super::arch::SUPPORTED_ARCHITECTURES;

#[derive(Debug, Clone, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: f64,
    #[serde(default)]
    pub low_freq_factor: f64,
    #[serde(default)]
    pub high_freq_factor: f64,
    #[serde(default)]
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    /// Llama 3.1's divisor f_i of each inverse frequency θ_i = base^(−2i/d_h), i < d_h/2: 1 for wavelengths
    /// shorter than original/high_freq_factor, `factor` for those longer than original/low_freq_factor, the
    /// interpolation 1/((1 − s)/factor + s) between (s = (original/λ − low)/(high − low)). This is llama.cpp's
    /// rope_freqs tensor as convert_hf_to_gguf.py computes it, and `Config::inv_freq` is θ_i / f_i.
    pub fn llama3_divisors(&self, theta: f64, d_h: usize) -> Vec<f64> {
        let old = self.original_max_position_embeddings as f64;
        let (low_wl, high_wl) = (old / self.low_freq_factor, old / self.high_freq_factor);
        (0..d_h / 2)
            .map(|i| {
                let wl = 2.0 * std::f64::consts::PI * theta.powf((2 * i) as f64 / d_h as f64);
                if wl < high_wl {
                    1.0
                } else if wl > low_wl {
                    self.factor
                } else {
                    let smooth = (old / wl - self.low_freq_factor)
                        / (self.high_freq_factor - self.low_freq_factor);
                    1.0 / ((1.0 - smooth) / self.factor + smooth)
                }
            })
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub architecture: String,
    pub d: usize,
    pub d_ff: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_h: usize,
    pub eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    pub vocab: usize,
    /// The decoder block's linears, norms and attention (`model/arch`).
    pub block: BlockDesc,
    /// The parsed config.json, kept so exports can copy it with additions.
    pub json: serde_json::Value,
}

impl Config {
    /// config.json of `dir` with every architecture's default tensor names (`Model::open` asks the checkpoint).
    pub fn load(dir: &Path) -> anyhow::Result<Config> {
        Self::load_stored(dir, &|_| false)
    }

    /// config.json of `dir`; `stored` says whether the checkpoint holds a tensor (`arch::describe`).
    pub fn load_stored(dir: &Path, stored: &dyn Fn(&str) -> bool) -> anyhow::Result<Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
        Self::parse_stored(&text, stored).map_err(|msg| file_err(&path, msg))
    }

    /// A config with no checkpoint behind it: every architecture's default tensor names.
    pub fn parse(text: &str) -> Result<Config, String> {
        Self::parse_stored(text, &|_| false)
    }

    pub fn parse_stored(text: &str, stored: &dyn Fn(&str) -> bool) -> Result<Config, String> {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
        let raw: RawConfig =
            serde_json::from_value(json.clone()).map_err(|e| format!("invalid config: {e}"))?;
        let architecture = match raw.architectures.first() {
            Some(a) if SUPPORTED_ARCHITECTURES.contains(&a.as_str()) => a.clone(),
            Some(a) => {
                return Err(format!(
                    "unsupported architecture {a}; supported: {}",
                    SUPPORTED_ARCHITECTURES.join(", ")
                ));
            }
            None => return Err("no \"architectures\" entry".into()),
        };
        let n_heads = raw.num_attention_heads;
        let n_kv_heads = raw.num_key_value_heads.unwrap_or(n_heads);
        if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(format!(
                "num_attention_heads={n_heads} must be a positive multiple of num_key_value_heads={n_kv_heads}"
            ));
        }
        if raw.hidden_size == 0
            || raw.intermediate_size == 0
            || raw.vocab_size == 0
            || raw.num_hidden_layers == 0
        {
            return Err(
                "hidden_size, intermediate_size, vocab_size and num_hidden_layers must be positive"
                    .into(),
            );
        }
        let d_h = raw.head_dim.unwrap_or(raw.hidden_size / n_heads);
        if d_h == 0
            || !d_h.is_multiple_of(2)
            || (raw.head_dim.is_none() && !raw.hidden_size.is_multiple_of(n_heads))
        {
            return Err(format!(
                "head dimension {d_h} (hidden_size={} / heads={n_heads}) must be a positive even number",
                raw.hidden_size
            ));
        }
        let mut rope_theta = raw.rope_theta;
        let mut rope_scaling: Option<RopeScaling> = match &raw.rope_scaling_json {
            Some(v) if !v.is_null() => Some(
                serde_json::from_value(v.clone())
                    .map_err(|e| format!("invalid rope_scaling: {e}"))?,
            ),
            _ => None,
        };
        if let Some(p) = &raw.rope_parameters {
            rope_theta = rope_theta.or(p.get("rope_theta").and_then(|v| v.as_f64()));
            if rope_scaling.is_none() && p.get("rope_type").is_some_and(|t| t != "default") {
                rope_scaling = Some(
                    serde_json::from_value(p.clone())
                        .map_err(|e| format!("invalid rope_parameters: {e}"))?,
                );
            }
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps > 0.0) {
            return Err(format!(
                "rms_norm_eps {} must be a positive number",
                raw.rms_norm_eps
            ));
        }
        if let Some(t) = rope_theta
            && !(t.is_finite() && t > 0.0)
        {
            return Err(format!("rope_theta {t} must be a positive number"));
        }
        // Fields the block does not implement are refused by its description, never ignored.
        let dims = Dims {
            d: raw.hidden_size,
            d_ff: raw.intermediate_size,
            n_heads,
            n_kv_heads,
            d_h,
        };
        let mut block = arch::describe(&architecture, &raw, dims, stored)?;
        block.online_down = super::online::parse(&json, &block.down_widths(raw.intermediate_size))?;
        // A per-layer RoPE (`BlockDesc::layer_rope`) was checked by the description.
        if block.layer_rope.is_none()
            && let Some(s) = &rope_scaling
            && !matches!(s.rope_type.as_str(), "llama3" | "default")
        {
            return Err(format!(
                "unsupported rope_scaling type {:?} (supported: llama3)",
                s.rope_type
            ));
        }
        Ok(Config {
            block,
            architecture,
            d: raw.hidden_size,
            d_ff: raw.intermediate_size,
            n_layers: raw.num_hidden_layers,
            n_heads,
            n_kv_heads,
            d_h,
            eps: raw.rms_norm_eps as f32,
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling: rope_scaling.filter(|s| s.rope_type == "llama3"),
            tie_word_embeddings: raw.tie_word_embeddings,
            vocab: raw.vocab_size,
            json,
        })
    }

    /// Refuses a bias tensor the architecture does not declare (the forward would use it but the output
    /// would drop it, and transformers would ignore it).
    pub fn check_tensor_names<'a>(
        &self,
        names: impl IntoIterator<Item = &'a String>,
    ) -> Result<(), String> {
        let biases: Vec<String> = self.block.bias_names().collect();
        let declared = |n: &str| {
            n.strip_prefix("model.layers.").is_some_and(|rest| {
                rest.split_once('.').is_some_and(|(l, p)| {
                    l.parse::<usize>().is_ok_and(|l| l < self.n_layers)
                        && biases.iter().any(|b| b == p)
                })
            })
        };
        match names
            .into_iter()
            .find(|n| n.ends_with(".bias") && !declared(n))
        {
            Some(n) => Err(format!(
                "tensor {n} is a bias that {} does not declare ({}): the forward here would add it, \
                 but the output would drop it and transformers would ignore it",
                self.architecture,
                if biases.is_empty() {
                    "no linear carries a bias: attention_bias and mlp_bias are false".to_string()
                } else {
                    format!("only {} carry biases", biases.join(", "))
                }
            )),
            None => Ok(()),
        }
    }

    /// The input widths of the block's down_projs (`BlockDesc::down_widths`).
    pub fn down_widths(&self) -> Vec<usize> {
        self.block.down_widths(self.d_ff)
    }

    /// Layer l's RoPE inverse frequencies: its own (`BlockDesc::layer_rope`) or the config's one RoPE.
    pub fn inv_freq_for(&self, l: usize) -> Vec<f64> {
        match self.block.layer_rope.as_ref().and_then(|r| r.get(l)) {
            Some(r) => (0..self.d_h / 2)
                .map(|i| 1.0 / r.theta.powf((2 * i) as f64 / self.d_h as f64) / r.linear_factor)
                .collect(),
            None => self.inv_freq(),
        }
    }

    /// RoPE inverse frequencies θ_i = base^(−2i/d_h), with Llama 3's frequency-dependent rescaling when set.
    pub fn inv_freq(&self) -> Vec<f64> {
        let half = self.d_h / 2;
        let mut f: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / self.d_h as f64))
            .collect();
        if let Some(s) = &self.rope_scaling {
            // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
            // (transformers' arithmetic, step for step; `RopeScaling::llama3_divisors` is convert_hf_to_gguf's.)
            let old = s.original_max_position_embeddings as f64;
            let (low_wl, high_wl) = (old / s.low_freq_factor, old / s.high_freq_factor);
            for v in f.iter_mut() {
                let wl = 2.0 * std::f64::consts::PI / *v;
                if wl > low_wl {
                    *v /= s.factor;
                } else if wl >= high_wl {
                    let smooth =
                        (old / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    *v = (1.0 - smooth) * *v / s.factor + smooth * *v;
                }
            }
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::Config;

    fn parse(extra: &str) -> Result<Config, String> {
        Config::parse(&format!(
            r#"{{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, {extra}}}"#
        ))
    }

    #[test]
    fn sliding_window_is_declared_the_way_each_architecture_declares_it() {
        let window = |extra: &str| parse(extra).unwrap().block.sliding_window;
        let w = r#""sliding_window": 16"#;
        assert_eq!(
            window(&format!(r#""architectures": ["MistralForCausalLM"], {w}"#)),
            Some(16)
        );
        assert_eq!(
            window(&format!(r#""architectures": ["LlamaForCausalLM"], {w}"#)),
            None
        );
        assert_eq!(
            window(&format!(r#""architectures": ["Qwen2ForCausalLM"], {w}"#)),
            None
        );
        // Qwen: only with use_sliding_window, then the layers from max_window_layers on (default 28) or
        // those layer_types marks.
        let qwen_on = r#""architectures": ["Qwen2ForCausalLM"], "use_sliding_window": true"#;
        assert_eq!(window(&format!("{qwen_on}, {w}")), None);
        let c = parse(&format!("{qwen_on}, {w}, \"max_window_layers\": 1")).unwrap();
        assert_eq!(
            (c.block.window_at(0), c.block.window_at(1)),
            (None, Some(16))
        );
        let by_types = r#""architectures": ["Qwen3ForCausalLM"], "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"]"#;
        assert_eq!(window(by_types), None);
        let c = parse(&format!("{by_types}, \"use_sliding_window\": true")).unwrap();
        assert_eq!(
            (c.block.window_at(0), c.block.window_at(1)),
            (None, Some(8))
        );
        let c = parse(&format!(r#""architectures": ["MistralForCausalLM"], {w}"#)).unwrap();
        assert_eq!(
            (c.block.window_at(0), c.block.window_at(1)),
            (Some(16), Some(16))
        );
    }

    #[test]
    fn each_architecture_declares_its_biases_and_norms() {
        let names = |extra: &str| {
            let c = parse(extra).unwrap();
            let b: Vec<String> = c.block.bias_names().collect();
            let n: Vec<&str> = c.block.norms.iter().map(|n| n.name).collect();
            (b, n)
        };
        let (b, n) = names(r#""architectures": ["Qwen2ForCausalLM"]"#);
        assert_eq!(
            b,
            [
                "self_attn.q_proj.bias",
                "self_attn.k_proj.bias",
                "self_attn.v_proj.bias"
            ]
        );
        assert_eq!(n, ["input_layernorm", "post_attention_layernorm"]);
        let (b, _) = names(
            r#""architectures": ["LlamaForCausalLM"], "attention_bias": true, "mlp_bias": true"#,
        );
        assert_eq!(b.len(), 7);
        let (b, n) = names(r#""architectures": ["Qwen3ForCausalLM"], "head_dim": 32"#);
        assert!(b.is_empty());
        assert_eq!(n[2..], ["self_attn.q_norm", "self_attn.k_norm"]);
        let c = parse(r#""architectures": ["Qwen3ForCausalLM"], "head_dim": 32"#).unwrap();
        assert_eq!(c.block.linears[0].d_out, 4 * 32);
        assert_eq!(c.block.linears[3].d_in, 4 * 32);
        assert!(
            parse(r#""architectures": ["Qwen3ForCausalLM"], "hidden_act": "gelu""#)
                .unwrap_err()
                .contains("hidden_act")
        );
    }

    #[test]
    fn moe_blocks_list_every_expert_and_refuse_what_they_do_not_implement() {
        let c = parse(
            r#""architectures": ["Qwen3MoeForCausalLM"], "head_dim": 32, "num_experts": 8,
               "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": true"#,
        )
        .unwrap();
        let m = c.block.moe.as_ref().unwrap();
        assert_eq!(
            (m.n_experts, m.top_k, m.renormalize, m.router),
            (8, 2, true, "mlp.gate")
        );
        assert_eq!(c.block.linears.len(), 4 + 3 * 8);
        let down = &c.block.linears[4 + 3 * 7 + 2];
        assert_eq!(
            (down.name.as_str(), down.expert, down.d_out, down.d_in),
            ("mlp.experts.7.down_proj", Some(7), 64, 24)
        );
        assert!(!c.block.is_llama_like());
        // transformers 5 writes num_local_experts for Qwen3-MoE too; Mixtral's experts are w1/w3/w2.
        let c = parse(
            r#""architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2"#,
        )
        .unwrap();
        assert_eq!(c.block.linears[4].name, "block_sparse_moe.experts.0.w1");
        assert_eq!(c.block.linears[5].name, "block_sparse_moe.experts.0.w3");
        assert!(c.block.moe.as_ref().unwrap().renormalize);
        // A checkpoint written under transformers 5's names (GPTQModel 7.7's Mixtral) is read with them.
        let text = r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}"#;
        let c = Config::parse_stored(text, &|n| n == "model.layers.0.mlp.gate.weight").unwrap();
        let names: Vec<&str> = c.block.linears[4..7]
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "mlp.experts.0.gate_proj",
                "mlp.experts.0.up_proj",
                "mlp.experts.0.down_proj"
            ]
        );
        assert_eq!(c.block.moe.as_ref().unwrap().router, "mlp.gate");
        for (extra, why) in [
            (
                r#""num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8"#,
                "between 1",
            ),
            (
                r#""num_experts_per_tok": 2, "moe_intermediate_size": 8"#,
                "num_experts",
            ),
            (
                r#""num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [0]"#,
                "dense layers",
            ),
            (
                r#""num_experts": 4, "num_experts_per_tok": 2"#,
                "moe_intermediate_size",
            ),
        ] {
            let e = parse(&format!(
                r#""architectures": ["Qwen3MoeForCausalLM"], {extra}"#
            ))
            .unwrap_err();
            assert!(e.contains(why), "{extra}: {e}");
        }
    }

    #[test]
    fn qwen2_moe_lists_its_shared_expert_and_refuses_dense_layers() {
        let q2 = r#""architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40"#;
        let c = parse(q2).unwrap();
        let m = c.block.moe.as_ref().unwrap();
        let s = m.shared_expert.as_ref().unwrap();
        assert_eq!((s.gate, s.d_ff), ("mlp.shared_expert_gate", 40));
        assert_eq!((m.router, m.renormalize), ("mlp.gate", false));
        // Attention (q/k/v biases by default, none on o), the shared expert, then the experts.
        assert_eq!(c.block.linears.len(), 4 + 3 + 3 * 4);
        let b: Vec<String> = c.block.bias_names().collect();
        assert_eq!(b.len(), 3);
        assert!(b.iter().all(|n| !n.contains("o_proj")));
        let names: Vec<&str> = c.block.linears[4..8]
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "mlp.shared_expert.gate_proj",
                "mlp.shared_expert.up_proj",
                "mlp.shared_expert.down_proj",
                "mlp.experts.0.gate_proj"
            ]
        );
        let [g, u, d] = c.block.dense_mlp().unwrap();
        assert_eq!((g, u, d), (4, 5, 6));
        assert_eq!(
            (c.block.linears[d].d_in, c.block.linears[d].d_out),
            (40, 64)
        );
        assert!(c.block.linears[4..7].iter().all(|l| l.expert.is_none()));
        // No dense MLP and no shared expert: none every token goes through.
        let mixtral = parse(
            r#""architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2"#,
        )
        .unwrap();
        assert_eq!(mixtral.block.dense_mlp(), None);
        let c = parse(&format!(
            r#"{q2}, "qkv_bias": false, "norm_topk_prob": true"#
        ))
        .unwrap();
        assert_eq!(c.block.bias_names().count(), 0);
        assert!(c.block.moe.unwrap().renormalize);
        // Qwen2-MoE's default layer_types: the even layers below max_window_layers slide.
        let c = parse(&format!(
            r#"{q2}, "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 2"#
        ))
        .unwrap();
        assert_eq!(
            (c.block.window_at(0), c.block.window_at(1)),
            (Some(16), None)
        );
        let no_shared = r#""architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 24"#;
        for (config, why) in [
            (format!(r#"{q2}, "mlp_only_layers": [1]"#), "dense layers"),
            (format!(r#"{q2}, "decoder_sparse_step": 2"#), "dense layers"),
            (format!(r#"{q2}, "mlp_bias": true"#), "mlp_bias"),
            (no_shared.to_string(), "shared_expert_intermediate_size"),
            (
                format!(r#"{no_shared}, "shared_expert_intermediate_size": 0"#),
                "shared_expert_intermediate_size",
            ),
        ] {
            let e = parse(&config).unwrap_err();
            assert!(e.contains(why), "{config}: {e}");
        }
    }
}
