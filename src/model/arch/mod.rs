//! One block description per architecture: which linears a decoder block has (name, shape, bias), what each
//! one is to the quantizer (an attention projection BoA treats head-wise, or a GPTQ linear) and which input
//! covariance it reads, and which norms sit where. The forward, the statistics, the quantization plan, export,
//! validation and resume all iterate this description instead of naming layers; adding an architecture is a
//! file here that builds its `BlockDesc` and refuses the config fields it does not implement.

mod gemma3;
mod llama;
mod mixtral;
mod qwen2_moe;
mod qwen3;
mod qwen3_moe;

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Input {
    /// The attention norm's output (q/k/v).
    Attn,
    /// The attention's output (o).
    AttnOut,
    /// The MLP norm's output (gate/up).
    Mlp,
    /// The MLP activation's output (down).
    MlpAct,
    /// The MLP norm's output on the tokens routed to expert e (its gate/up).
    Expert(usize),
    /// Expert e's activation on its routed tokens (its down).
    ExpertAct(usize),
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
    pub name: String,
    pub role: Role,
    pub d_out: usize,
    pub d_in: usize,
    pub bias: bool,
    /// The expert of a mixture-of-experts MLP this linear belongs to (its gate/up/down see only the tokens
    /// routed to it).
    pub expert: Option<usize>,
}

impl LinearDesc {
    /// The input whose covariance this linear's quantizer reads.
    pub fn input(&self) -> Input {
        match (self.expert, self.role) {
            (Some(e), Role::Down) => Input::ExpertAct(e),
            (Some(e), _) => Input::Expert(e),
            (None, r) => r.input(),
        }
    }
}

/// A sparse mixture-of-experts MLP: a router (kept in full precision) picks `top_k` of `n_experts` SwiGLU
/// experts per token, softmax(router logits) over all experts, the top k kept (renormalized to sum 1 when
/// `renormalize`), and the block adds Σ_k p_k · expert_k(x).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeDesc {
    /// The router's weight [n_experts × d] under `model.layers.{l}.` without `.weight`.
    pub router: &'static str,
    pub n_experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    /// Each expert's intermediate size.
    pub d_expert: usize,
    /// A SwiGLU MLP every token goes through beside the routed experts (Qwen2-MoE).
    pub shared_expert: Option<SharedExpertDesc>,
}

/// Qwen2-MoE's shared expert: a SwiGLU MLP of intermediate size `d_ff` on every token, its output scaled per
/// token by sigmoid(w_g · x) and added to the routed experts' sum. Its gate/up/down are the block's linears
/// that belong to no expert after the attention (`expert: None`, roles Gate/Up/Down): they read the MLP
/// input's covariance over every token, like a dense MLP. w_g [1 × d] is kept in full precision, like the
/// router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedExpertDesc {
    /// w_g's name under `model.layers.{l}.` without `.weight`.
    pub gate: &'static str,
    pub d_ff: usize,
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
    /// Keys this many positions back or further are masked in the layers `sliding_layers` marks; None:
    /// full causal attention everywhere.
    pub sliding_window: Option<usize>,
    pub sliding_layers: Vec<bool>,
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
    /// A mixture-of-experts MLP instead of the dense one (its experts' linears are in `linears`).
    pub moe: Option<MoeDesc>,
    /// An online Hadamard transform of down_proj's input, I ⊗ Q_b with this block order b
    /// (`model/online.rs`): set by the checkpoint's config.json, not by the architecture.
    pub online_down: Option<usize>,
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

    /// The input widths of the block's down_projs, the widths an online transform before them must divide:
    /// a dense MLP's `d_ff`; in a mixture of experts each expert's and then the shared expert's.
    pub fn down_widths(&self, d_ff: usize) -> Vec<usize> {
        match &self.moe {
            None => vec![d_ff],
            Some(m) => std::iter::once(m.d_expert)
                .chain(m.shared_expert.as_ref().map(|s| s.d_ff))
                .collect(),
        }
    }

    /// The gate, up and down of the MLP every token goes through: the dense MLP, or an MoE block's shared
    /// expert; None in an MoE block without one.
    pub fn dense_mlp(&self) -> Option<[usize; 3]> {
        let find = |role| {
            self.linears
                .iter()
                .position(|l| l.role == role && l.expert.is_none())
        };
        Some([find(Role::Gate)?, find(Role::Up)?, find(Role::Down)?])
    }

    pub fn norm(&self, role: NormRole) -> Option<(usize, &NormDesc)> {
        self.norms.iter().enumerate().find(|(_, n)| n.role == role)
    }

    /// Layer l's attention window, if it slides.
    pub fn window_at(&self, l: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.get(l).copied().unwrap_or(false))
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
            && self.moe.is_none()
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
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
];

/// The block of `architecture`, or why this config cannot be run here (a field that changes the math and is
/// not implemented is refused, never ignored). `stored` says whether the checkpoint holds a tensor, for the
/// one architecture whose tensor names changed between writers (Mixtral).
pub fn describe(
    architecture: &str,
    raw: &RawConfig,
    dims: Dims,
    stored: &dyn Fn(&str) -> bool,
) -> Result<BlockDesc, String> {
    match architecture {
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            llama::describe(architecture, raw, dims)
        }
        "Qwen3ForCausalLM" => qwen3::describe(raw, dims),
        "Gemma3ForCausalLM" => gemma3::describe(raw, dims),
        "Qwen3MoeForCausalLM" => qwen3_moe::describe(raw, dims),
        "MixtralForCausalLM" => mixtral::describe(raw, dims, stored),
        "Qwen2MoeForCausalLM" => qwen2_moe::describe(raw, dims),
        a => Err(format!(
            "unsupported architecture {a}; supported: {}",
            SUPPORTED_ARCHITECTURES.join(", ")
        )),
    }
}

/// The attention and SwiGLU MLP linears of the Llama family, with the given biases.
pub(super) fn llama_linears(dims: Dims, qkv_bias: bool, o_bias: bool) -> Vec<LinearDesc> {
    let (qd, kvd) = (dims.n_heads * dims.d_h, dims.n_kv_heads * dims.d_h);
    let l = |name: &str, role, d_out, d_in, bias| LinearDesc {
        name: name.into(),
        role,
        d_out,
        d_in,
        bias,
        expert: None,
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

/// Qwen3's per-head RMSNorms on the queries and keys before RoPE (weight [d_h], shared by the heads).
pub(super) fn qk_norms(d_h: usize) -> [NormDesc; 2] {
    [
        NormDesc {
            name: "self_attn.q_norm",
            role: NormRole::Q,
            len: d_h,
        },
        NormDesc {
            name: "self_attn.k_norm",
            role: NormRole::K,
            len: d_h,
        },
    ]
}

/// The Llama family's SwiGLU block with pre-norms at weight w (no offset), unscaled queries and embeddings,
/// one RoPE for every layer and a dense MLP; the architectures differ in the fields they override.
pub(super) fn swiglu_block(
    linears: Vec<LinearDesc>,
    norms: Vec<NormDesc>,
    (sliding_window, sliding_layers): (Option<usize>, Vec<bool>),
) -> BlockDesc {
    BlockDesc {
        linears,
        norms,
        sliding_window,
        sliding_layers,
        act: Activation::Silu,
        norm_offset: 0.0,
        q_scale: 1.0,
        embed_scale: None,
        layer_rope: None,
        moe: None,
        online_down: None,
    }
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

/// Which layers' attention slides, as transformers decides it for each architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sliding {
    /// Every layer whenever `sliding_window` is set (Mistral, Mixtral; transformers ignores their
    /// `layer_types`).
    AllLayers,
    /// Only with `use_sliding_window`, then the `layer_types` entries marked sliding (by default transformers
    /// marks the layers from `max_window_layers` on) (Qwen2/3).
    Qwen,
    /// The `layer_types` entries marked sliding (Gemma 3).
    LayerTypes,
    /// Only with `use_sliding_window`, then the `layer_types` entries marked sliding (by default transformers
    /// marks the even layers below `max_window_layers`) (Qwen2-MoE).
    Qwen2Moe,
}

/// The window and the layers it applies to; (None, []) when no layer slides. Query i attends to keys j with
/// i − window < j ≤ i (transformers' sliding_window_overlay on the causal mask).
pub(super) fn sliding(raw: &RawConfig, rule: Sliding) -> (Option<usize>, Vec<bool>) {
    let n = raw.num_hidden_layers;
    let by_types = |i: usize| {
        raw.layer_types
            .get(i)
            .is_some_and(|t| t == "sliding_attention")
    };
    let layers: Vec<bool> = match rule {
        Sliding::AllLayers => vec![true; n],
        Sliding::Qwen if !raw.use_sliding_window => vec![false; n],
        Sliding::Qwen if raw.layer_types.is_empty() => (0..n)
            .map(|i| i >= raw.max_window_layers.unwrap_or(28))
            .collect(),
        Sliding::Qwen2Moe if !raw.use_sliding_window => vec![false; n],
        Sliding::Qwen2Moe if raw.layer_types.is_empty() => (0..n)
            .map(|i| i % 2 == 0 && i < raw.max_window_layers.unwrap_or(28))
            .collect(),
        Sliding::Qwen | Sliding::Qwen2Moe | Sliding::LayerTypes => (0..n).map(by_types).collect(),
    };
    match raw.sliding_window {
        Some(w) if layers.iter().any(|&s| s) => (Some(w), layers),
        _ => (None, Vec::new()),
    }
}

/// The q/k/v/o linears of the Llama family followed by `n_experts` SwiGLU experts of intermediate size `d_e`,
/// named `{prefix}.{e}.{gate}` etc.
pub(super) fn moe_linears(
    dims: Dims,
    attn_bias: bool,
    prefix: &str,
    [gate, up, down]: [&str; 3],
    n_experts: usize,
    d_e: usize,
) -> Vec<LinearDesc> {
    let mut v: Vec<LinearDesc> = llama_linears(dims, attn_bias, attn_bias)
        .into_iter()
        .take(4)
        .collect();
    for e in 0..n_experts {
        for (name, role, d_out, d_in) in [
            (gate, Role::Gate, d_e, dims.d),
            (up, Role::Up, d_e, dims.d),
            (down, Role::Down, dims.d, d_e),
        ] {
            v.push(LinearDesc {
                name: format!("{prefix}.{e}.{name}"),
                role,
                d_out,
                d_in,
                bias: false,
                expert: Some(e),
            });
        }
    }
    v
}

/// The router fields every MoE config here shares: experts, experts per token (both positive, k ≤ n).
pub(super) fn moe_counts(raw: &RawConfig) -> Result<(usize, usize), String> {
    let n = raw
        .num_experts
        .or(raw.num_local_experts)
        .ok_or("a mixture-of-experts config needs num_experts (or num_local_experts)")?;
    let k = raw
        .num_experts_per_tok
        .ok_or("a mixture-of-experts config needs num_experts_per_tok")?;
    if n == 0 || k == 0 || k > n {
        return Err(format!(
            "num_experts_per_tok={k} must be between 1 and the number of experts ({n})"
        ));
    }
    Ok((n, k))
}
