//! config.json as written, before validation: the fields that change the math. `Config::parse` validates the
//! shared ones; each architecture's description (`model/arch`) reads and refuses its own. Apart from both so
//! that neither imports the other.

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
pub struct RawConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub rope_theta: Option<f64>,
    /// transformers ≥ 5 writes theta and scaling here instead ({"rope_theta", "rope_type", "factor", …}), or,
    /// for models whose layer types differ (Gemma 3), one such object per layer type.
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    pub hidden_act: Option<String>,
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Qwen2/3 without `layer_types`: the layers from this one on slide (transformers' default 28).
    pub max_window_layers: Option<usize>,
    /// transformers ≥ 4.53: "full_attention" / "sliding_attention" per layer.
    #[serde(default)]
    pub layer_types: Vec<String>,
    /// Gemma: the activation's field name, the scores' scale, soft-capping, the local layers' RoPE base.
    pub hidden_activation: Option<String>,
    pub query_pre_attn_scalar: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub use_bidirectional_attention: bool,
    pub rope_local_base_freq: Option<f64>,
    /// Mixture of experts (Qwen3-MoE: num_experts, Mixtral and transformers 5's Qwen3-MoE:
    /// num_local_experts).
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    pub moe_intermediate_size: Option<usize>,
    /// Qwen2-MoE: the shared expert's intermediate size, and whether q/k/v carry biases (transformers'
    /// default: they do).
    pub shared_expert_intermediate_size: Option<usize>,
    pub qkv_bias: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(rename = "rope_scaling")]
    pub rope_scaling_json: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-6
}
