//! One block description per architecture: which linears a decoder block has (name, shape, bias), what each
//! one is to the quantizer (an attention projection BoA treats head-wise, or a GPTQ linear) and which input
//! covariance it reads, and which norms sit where. The forward, the statistics, the quantization plan, export,
//! validation and resume all iterate this description instead of naming layers; adding an architecture is a
//! file here that builds its `BlockDesc` and refuses the config fields it does not implement.

mod gemma3;
mod llama;
mod qwen3;

use super::raw_config::RawConfig;

/// What a linear is in the block's math.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// The input whose covariance H_col = (2/N) X Xᵀ a linear's quantizer reads; linears that share an input share
/// its statistic (and, under GPTQ, its factorization).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// The attention norm's output (q/k/v).
    Attn,
    /// The attention's output (o).
    AttnOut,
    /// The MLP norm's output (gate/up).
    Mlp,
    /// The MLP activation's output (down).
    MlpAct,
}

impl Role {
    pub fn input(self) -> Input {
        match self {
            Role::Q | Role::K | Role::V => Input::Attn,
            Role::O => Input::AttnOut,
            Role::Gate | Role::Up => Input::Mlp,
            Role::Down => Input::MlpAct,
        }
    }

    /// q/k/v: BoA quantizes these head-wise with attention-aware row Hessians.
    pub fn is_attention_projection(self) -> bool {
        matches!(self, Role::Q | Role::K | Role::V)
    }
}

/// A linear of the block: `name` is its path under `model.layers.{l}.` without `.weight`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearDesc {
    pub name: &'static str,
    pub role: Role,
    pub d_out: usize,
    pub d_in: usize,
    pub bias: bool,
}

/// Where a norm sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormRole {
    /// Before the attention (input_layernorm).
    Attn,
    /// On the attention's output, before the residual add (Gemma's post_attention_layernorm).
    AttnOut,
    /// Before the MLP (post_attention_layernorm in the Llama family, pre_feedforward_layernorm in Gemma).
    Mlp,
    /// On the MLP's output, before the residual add (Gemma's post_feedforward_layernorm).
    MlpOut,
    /// Per-head RMSNorm of the queries before RoPE (Qwen3), weight [d_h] shared by every head.
    Q,
    /// The same for the keys.
    K,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormDesc {
    pub name: &'static str,
    pub role: NormRole,
    pub len: usize,
}

/// A decoder block, as the config declares it.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockDesc {
    /// In the order the pipeline quantizes them (attention, then MLP: each reads the previous ones' outputs).
    pub linears: Vec<LinearDesc>,
    pub norms: Vec<NormDesc>,
    /// Keys further back than this many positions are masked, in some or all layers; None: full causal.
    pub sliding_window: Option<usize>,
    /// The MLP's gate activation: act(gate) ⊙ up.
    pub act: Activation,
    /// Every RMSNorm here (the final one too) scales by (offset + w): 0 in the Llama family, 1 in Gemma,
    /// whose checkpoints store w − 1. Applied to the weights when they are loaded.
    pub norm_offset: f32,
    /// A factor on the queries (folded into the q norm's weight at load): Gemma scales scores by
    /// query_pre_attn_scalar^−½ instead of d_h^−½.
    pub q_scale: f32,
    /// Around the blocks: the embedding rows are multiplied by this (Gemma: √d); the tied LM head is not.
    pub embed_scale: Option<f32>,
    /// RoPE per layer (Gemma: local layers' base differs from global ones'); None: the config's one RoPE.
    pub layer_rope: Option<Vec<RopeSpec>>,
}

/// The MLP activations here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: silu(gate) ⊙ up.
    Silu,
    /// GeGLU with the tanh approximation of GELU ("gelu_pytorch_tanh").
    GeluTanh,
}

/// One layer's RoPE: θ_i = theta^(−2i/d_h) / linear_factor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub linear_factor: f64,
}

impl BlockDesc {
    pub fn linear(&self, role: Role) -> Option<(usize, &LinearDesc)> {
        self.linears
            .iter()
            .enumerate()
            .find(|(_, l)| l.role == role)
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.linears.iter().position(|l| l.name == name)
    }

    pub fn norm(&self, role: NormRole) -> Option<(usize, &NormDesc)> {
        self.norms.iter().enumerate().find(|(_, n)| n.role == role)
    }

    /// Per-head q/k RMSNorm before RoPE (the scores see normalized projections: design.md §4.3).
    pub fn qk_norm(&self) -> bool {
        self.norm(NormRole::Q).is_some()
    }

    /// The Llama block exactly (SwiGLU, pre-norms only, unscaled queries): what the fused CPU eval forward
    /// implements. Other blocks take the generic forward.
    pub fn is_llama_like(&self) -> bool {
        self.act == Activation::Silu
            && self.norm(NormRole::AttnOut).is_none()
            && self.norm(NormRole::MlpOut).is_none()
            && self.q_scale == 1.0
            && self.norm_offset == 0.0
    }

    /// Every tensor name of the block's linears' biases (under `model.layers.{l}.`).
    pub fn bias_names(&self) -> impl Iterator<Item = String> + '_ {
        self.linears
            .iter()
            .filter(|l| l.bias)
            .map(|l| format!("{}.bias", l.name))
    }
}

/// The shapes every architecture here shares (the config's validated numbers).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub d: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_h: usize,
}

/// Architectures with a block description, by the name config.json's `architectures` gives.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
];

/// The block of `architecture`, or why this config cannot be run here (a field that changes the math and is
/// not implemented is refused, never ignored).
pub fn describe(architecture: &str, raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    match architecture {
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            llama::describe(architecture, raw, dims)
        }
        "Qwen3ForCausalLM" => qwen3::describe(raw, dims),
        "Gemma3ForCausalLM" => gemma3::describe(raw, dims),
        a => Err(format!(
            "unsupported architecture {a}; supported: {}",
            SUPPORTED_ARCHITECTURES.join(", ")
        )),
    }
}

/// The attention and SwiGLU MLP linears of the Llama family, with the given biases.
pub(super) fn llama_linears(dims: Dims, qkv_bias: bool, o_bias: bool) -> Vec<LinearDesc> {
    let (qd, kvd) = (dims.n_heads * dims.d_h, dims.n_kv_heads * dims.d_h);
    let l = |name, role, d_out, d_in, bias| LinearDesc {
        name,
        role,
        d_out,
        d_in,
        bias,
    };
    vec![
        l("self_attn.q_proj", Role::Q, qd, dims.d, qkv_bias),
        l("self_attn.k_proj", Role::K, kvd, dims.d, qkv_bias),
        l("self_attn.v_proj", Role::V, kvd, dims.d, qkv_bias),
        l("self_attn.o_proj", Role::O, dims.d, qd, o_bias),
        l("mlp.gate_proj", Role::Gate, dims.d_ff, dims.d, false),
        l("mlp.up_proj", Role::Up, dims.d_ff, dims.d, false),
        l("mlp.down_proj", Role::Down, dims.d, dims.d_ff, false),
    ]
}

/// input_layernorm and post_attention_layernorm.
pub(super) fn pre_norms(d: usize) -> Vec<NormDesc> {
    vec![
        NormDesc {
            name: "input_layernorm",
            role: NormRole::Attn,
            len: d,
        },
        NormDesc {
            name: "post_attention_layernorm",
            role: NormRole::Mlp,
            len: d,
        },
    ]
}

/// The activation fields of the SwiGLU MLP: SiLU only.
pub(super) fn check_silu(raw: &RawConfig) -> Result<(), String> {
    match raw.hidden_act.as_deref() {
        None | Some("silu") | Some("swish") => Ok(()),
        Some(act) => Err(format!(
            "hidden_act {act:?} is not supported (the MLP here is SwiGLU: \"silu\")"
        )),
    }
}

/// The window of a config whose attention slides in some layer: Mistral's `sliding_window` whenever set,
/// Qwen's only with `use_sliding_window`, and any architecture whose `layer_types` name a sliding layer.
/// It changes the attention only when a window (--seqlen) is longer; that is checked when a run or an eval
/// starts (`Config::check_seqlen`).
pub(super) fn sliding_window(raw: &RawConfig, declared_by_field: bool) -> Option<usize> {
    let by_layer_types = raw
        .layer_types
        .iter()
        .any(|t| t.as_str() == "sliding_attention");
    raw.sliding_window
        .filter(|_| declared_by_field || raw.use_sliding_window || by_layer_types)
}
