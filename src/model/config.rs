//! config.json of a Hugging Face Llama-family model, validated so that later code can trust every shape.

use crate::error::file_err;
use serde::Deserialize;
use std::path::Path;

/// Architectures whose decoder is the Llama block (RMSNorm, RoPE rotate-half, GQA, SwiGLU).
pub const SUPPORTED_ARCHITECTURES: &[&str] =
    &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

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

#[derive(Debug, Clone, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeScaling>,
    /// transformers ≥ 5 writes theta and scaling here instead ({"rope_theta", "rope_type", "factor", …}).
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    tie_word_embeddings: bool,
    vocab_size: usize,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    hidden_act: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
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
    /// q/k/v carry a bias (Qwen2 always; Llama when attention_bias is set).
    pub qkv_bias: bool,
    /// The parsed config.json, kept so exports can copy it with additions.
    pub json: serde_json::Value,
}

impl Config {
    pub fn load(dir: &Path) -> anyhow::Result<Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
        Self::parse(&text).map_err(|msg| file_err(&path, msg))
    }

    pub fn parse(text: &str) -> Result<Config, String> {
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
        let mut rope_scaling = raw.rope_scaling.clone();
        if let Some(p) = &raw.rope_parameters {
            rope_theta = rope_theta.or(p.get("rope_theta").and_then(|v| v.as_f64()));
            if rope_scaling.is_none() && p.get("rope_type").is_some_and(|t| t != "default") {
                rope_scaling = Some(
                    serde_json::from_value(p.clone())
                        .map_err(|e| format!("invalid rope_parameters: {e}"))?,
                );
            }
        }
        // Fields the Llama block here does not implement are refused, never ignored.
        if let Some(act) = &raw.hidden_act
            && !matches!(act.as_str(), "silu" | "swish")
        {
            return Err(format!(
                "hidden_act {act:?} is not supported (the MLP here is SwiGLU: \"silu\")"
            ));
        }
        if raw.mlp_bias {
            return Err("mlp_bias true is not supported (the MLP here has no biases)".into());
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
        if let Some(s) = &rope_scaling
            && !matches!(s.rope_type.as_str(), "llama3" | "default")
        {
            return Err(format!(
                "unsupported rope_scaling type {:?} (supported: llama3)",
                s.rope_type
            ));
        }
        Ok(Config {
            qkv_bias: architecture == "Qwen2ForCausalLM" || raw.attention_bias,
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
    /// would drop it, and transformers would ignore it): only q/k/v biases exist, when `qkv_bias`.
    pub fn check_tensor_names<'a>(
        &self,
        names: impl IntoIterator<Item = &'a String>,
    ) -> Result<(), String> {
        let declared = |n: &str| {
            self.qkv_bias
                && n.strip_prefix("model.layers.").is_some_and(|rest| {
                    rest.split_once('.').is_some_and(|(l, p)| {
                        l.parse::<usize>().is_ok_and(|l| l < self.n_layers)
                            && matches!(
                                p,
                                "self_attn.q_proj.bias"
                                    | "self_attn.k_proj.bias"
                                    | "self_attn.v_proj.bias"
                            )
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
                if self.qkv_bias {
                    "only q/k/v carry biases"
                } else {
                    "no linear carries a bias: attention_bias is false"
                }
            )),
            None => Ok(()),
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
