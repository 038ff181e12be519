//! What differs between the GGUF architectures `import_gguf` reads: the hyper-parameter keys, the tensor
//! names, what convert_hf_to_gguf.py did to each tensor on the way (which the import undoes), and
//! config.json.
//!
//! * llama: convert_hf_to_gguf.py permutes the rows of q_proj/k_proj so llama.cpp can use interleaved (GPT-J
//!   style) RoPE; `Fixup::Unpermute` inverts it.
//! * qwen2, qwen3: no permutation (NEOX RoPE, HF's layout); Qwen2's q/k/v biases are `attn_{q,k,v}.bias`,
//!   Qwen3's per-head norms `attn_{q,k}_norm`, both stored as HF stores them.
//! * gemma3: no permutation (llama.cpp runs Gemma with NEOX RoPE, HF's half-split layout), but every RMSNorm
//!   weight — the q/k norms and the sandwich norms included — was stored as w + 1 so llama.cpp can scale by
//!   the weight alone; `Fixup::MinusOne` restores HF's w (transformers' GGUF loader, Gemma2TensorProcessor,
//!   does the same `w - 1` in f32). llama.cpp hard-codes what the file does not say: every 6th layer global
//!   (unless `gemma3.attention.sliding_window_pattern` says otherwise), local RoPE base 10000, and scores
//!   scaled by head_dim^−½ except on the 27B (62 layers), which uses (hidden / heads)^−½.

use anyhow::Result;
use serde_json::json;

use super::reader::{GgufFile, Value};
use crate::error::file_err;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Gemma3,
    Qwen2Moe,
    Qwen3Moe,
}

impl Arch {
    pub fn of(g: &GgufFile) -> Result<Arch> {
        const SUPPORTED: &str = "only \"llama\" (Mixtral included), \"qwen2\", \"qwen3\", \"gemma3\", \
                                 \"qwen2moe\" and \"qwen3moe\" are supported";
        match g.get_str("general.architecture")? {
            Some("llama") => Ok(Arch::Llama),
            Some("qwen2") => Ok(Arch::Qwen2),
            Some("qwen3") => Ok(Arch::Qwen3),
            Some("gemma3") => Ok(Arch::Gemma3),
            Some("qwen2moe") => Ok(Arch::Qwen2Moe),
            Some("qwen3moe") => Ok(Arch::Qwen3Moe),
            Some(other) => Err(file_err(
                &g.path,
                format!("general.architecture is {other:?}; {SUPPORTED}"),
            )),
            None => Err(file_err(
                &g.path,
                format!("general.architecture is missing; {SUPPORTED}"),
            )),
        }
    }

    /// The prefix of the architecture's keys (`llama.block_count`).
    pub fn key(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    fn hf_architecture(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
            Arch::Qwen2Moe => "Qwen2MoeForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// The GGUF architecture `--format gguf` writes a model of this config.json architecture as (what
    /// convert_hf_to_gguf.py picks: Mistral and Mixtral are llama.cpp's "llama"), None for one not written.
    pub fn of_hf(architecture: &str) -> Option<Arch> {
        match architecture {
            "LlamaForCausalLM" | "MistralForCausalLM" | "MixtralForCausalLM" => Some(Arch::Llama),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "Qwen2MoeForCausalLM" => Some(Arch::Qwen2Moe),
            "Qwen3MoeForCausalLM" => Some(Arch::Qwen3Moe),
            "Gemma3ForCausalLM" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    /// Per-head q/k norms (`attn_q_norm`, `attn_k_norm`).
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3)
    }

    /// convert_hf_to_gguf.py permutes q/k rows for llama.cpp's interleaved RoPE in the llama architecture
    /// only; the others run NEOX RoPE on HF's layout.
    pub fn permutes_qk(self) -> bool {
        self == Arch::Llama
    }

    /// The block parts (HF names under `model.layers.{l}.`) whose bias llama.cpp reads.
    pub fn bias_parts(self) -> &'static [&'static str] {
        match self {
            Arch::Qwen2 | Arch::Qwen2Moe => {
                &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            }
            _ => &[],
        }
    }
}

/// Model hyper-parameters read from the `{arch}.*` keys.
#[derive(Debug, Clone)]
pub struct Hparams {
    pub arch: Arch,
    pub n_layer: usize,
    pub d: usize,
    pub d_ff: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub theta: f64,
    pub ctx: u64,
    pub gemma: Option<GemmaHparams>,
    pub moe: Option<MoeHparams>,
}

/// A mixture-of-experts block's sizes (llama with `expert_count` is Mixtral).
#[derive(Debug, Clone)]
pub struct MoeHparams {
    pub n_expert: usize,
    pub n_used: usize,
    /// Each expert's hidden width.
    pub d_expert: usize,
    /// Qwen2-MoE's shared expert's hidden width.
    pub d_shared: Option<usize>,
}

/// What only Gemma 3 has.
#[derive(Debug, Clone)]
pub struct GemmaHparams {
    pub sliding_window: usize,
    /// Per layer: true for a local (sliding-window) layer.
    pub sliding: Vec<bool>,
    pub query_pre_attn_scalar: f64,
    /// Linear RoPE scaling factor of the global layers (Gemma 3 4B and larger), 1 for none.
    pub rope_linear_factor: f64,
}

/// llama.cpp's RoPE base of Gemma 3's local layers (not stored in the file).
const GEMMA3_LOCAL_ROPE_BASE: f64 = 10_000.0;
/// llama.cpp's Gemma 3 default: every 6th layer is global.
const GEMMA3_SWA_PATTERN: u64 = 6;
/// Gemma 3 27B: the one size whose scores llama.cpp scales by (hidden / heads)^−½.
const GEMMA3_27B_LAYERS: usize = 62;

/// What llama.cpp's gemma3 assumes beyond the file's keys: which layers are local (sliding), the local
/// layers' RoPE base, and the query_pre_attn_scalar the scores are scaled by (^−½). The import reads a file
/// with these; `--format gguf` refuses a model that differs.
pub struct Gemma3Implied {
    pub sliding: Vec<bool>,
    pub local_rope_base: f64,
    pub query_pre_attn_scalar: f64,
}

pub fn gemma3_implied(n_layer: usize, d: usize, n_head: usize, head_dim: usize) -> Gemma3Implied {
    Gemma3Implied {
        sliding: every_nth_global(n_layer, GEMMA3_SWA_PATTERN),
        local_rope_base: GEMMA3_LOCAL_ROPE_BASE,
        query_pre_attn_scalar: if n_layer == GEMMA3_27B_LAYERS {
            d as f64 / n_head as f64
        } else {
            head_dim as f64
        },
    }
}

pub fn hparams(g: &GgufFile, arch: Arch) -> Result<Hparams> {
    let a = arch.key();
    let k = |name: &str| format!("{a}.{name}");
    let int = |name: &str| -> Result<usize> { Ok(g.require_u64(&k(name))? as usize) };
    let bad = |msg: String| Err(file_err(&g.path, msg));
    let n_head = int("attention.head_count")?;
    let d = int("embedding_length")?;
    let mut h = Hparams {
        arch,
        n_layer: int("block_count")?,
        d,
        d_ff: int("feed_forward_length")?,
        n_head,
        n_kv_head: g
            .get_u64(&k("attention.head_count_kv"))?
            .map_or(n_head, |v| v as usize),
        head_dim: match g.get_u64(&k("attention.key_length"))? {
            Some(v) => v as usize,
            None if n_head > 0 => d / n_head,
            None => 0,
        },
        eps: g.require_f64(&k("attention.layer_norm_rms_epsilon"))?,
        theta: g.get_f64(&k("rope.freq_base"))?.unwrap_or(match arch {
            Arch::Gemma3 => 1_000_000.0,
            _ => 10_000.0,
        }),
        ctx: g.get_u64(&k("context_length"))?.unwrap_or(2048),
        gemma: None,
        moe: None,
    };
    if h.n_layer == 0
        || h.d == 0
        || h.d_ff == 0
        || h.n_head == 0
        || h.n_kv_head == 0
        || h.head_dim == 0
    {
        return bad(format!("zero-sized {a} hyper-parameter: {h:?}"));
    }
    let huge = [h.d, h.d_ff, h.n_head, h.n_kv_head, h.head_dim]
        .iter()
        .any(|&v| v > 1 << 20);
    if huge
        || h.n_layer > 10_000
        || !h.n_head.is_multiple_of(h.n_kv_head)
        || !h.head_dim.is_multiple_of(2)
    {
        return bad(format!(
            "inconsistent {a} hyper-parameters (need layers ≤ 10000, sizes ≤ 2^20, head_count a multiple \
             of head_count_kv, even head_dim): {h:?}"
        ));
    }
    // Keys the block would otherwise ignore or write as nonsense into config.json.
    if let Some(n) = g.get_u64(&k("rope.dimension_count"))?
        && n != h.head_dim as u64
    {
        return bad(format!(
            "{a}.rope.dimension_count {n} differs from the head dimension {}: partial rotary \
             embeddings are not supported",
            h.head_dim
        ));
    }
    if let Some(n) = g.get_u64(&k("attention.value_length"))?
        && n != h.head_dim as u64
    {
        return bad(format!(
            "{a}.attention.value_length {n} differs from the key length {}: different query/key and \
             value head sizes are not supported",
            h.head_dim
        ));
    }
    if h.ctx == 0 {
        return bad(format!(
            "{a}.context_length is 0: a model needs a positive context length"
        ));
    }
    if !(h.eps.is_finite() && h.eps > 0.0) {
        return bad(format!(
            "{a}.attention.layer_norm_rms_epsilon {} must be a positive number",
            h.eps
        ));
    }
    if !(h.theta.is_finite() && h.theta > 0.0) {
        return bad(format!(
            "{a}.rope.freq_base {} must be a positive number",
            h.theta
        ));
    }
    h.moe = moe_hparams(g, &h)?;
    let scaling = g.get_str(&k("rope.scaling.type"))?;
    match (arch, scaling) {
        (_, None | Some("none")) => {}
        (Arch::Gemma3, Some("linear")) => {}
        (_, Some(t)) => {
            return bad(format!(
                "RoPE scaling {t:?} ({a}.rope.scaling.type) is not supported yet"
            ));
        }
    }
    if arch == Arch::Gemma3 {
        h.gemma = Some(gemma_hparams(g, &h, scaling == Some("linear"))?);
    }
    Ok(h)
}

/// The expert sizes of a mixture-of-experts file: `expert_count` and `expert_used_count`; the experts' width
/// from `expert_feed_forward_length` (the llama architecture's Mixtral uses feed_forward_length), Qwen2-MoE's
/// shared expert's from `expert_shared_feed_forward_length`. None for a dense file (qwen2moe and qwen3moe
/// must have experts; gemma3, qwen2 and qwen3 must not).
fn moe_hparams(g: &GgufFile, h: &Hparams) -> Result<Option<MoeHparams>> {
    let a = h.arch.key();
    let k = |name: &str| format!("{a}.{name}");
    let bad = |msg: String| Err(file_err(&g.path, msg));
    let n_expert = g.get_u64(&k("expert_count"))?.unwrap_or(0) as usize;
    let moe_arch = matches!(h.arch, Arch::Qwen2Moe | Arch::Qwen3Moe);
    match (n_expert, h.arch) {
        (0, _) if moe_arch => return bad(format!("{a}.expert_count is missing or 0")),
        (0, _) => return Ok(None),
        (_, Arch::Llama | Arch::Qwen2Moe | Arch::Qwen3Moe) => {}
        (n, _) => {
            return bad(format!(
                "{a}.expert_count is {n}: llama.cpp's {a} has no experts"
            ));
        }
    }
    let n_used = g.require_u64(&k("expert_used_count"))? as usize;
    let d_expert = match h.arch {
        Arch::Llama => h.d_ff,
        _ => g.require_u64(&k("expert_feed_forward_length"))? as usize,
    };
    let d_shared = match h.arch {
        Arch::Qwen2Moe => Some(g.require_u64(&k("expert_shared_feed_forward_length"))? as usize),
        _ => None,
    };
    if n_used == 0
        || n_used > n_expert
        || n_expert > 1 << 16
        || d_expert == 0
        || d_expert > 1 << 20
        || d_shared.is_some_and(|d| d == 0 || d > 1 << 20)
    {
        return bad(format!(
            "inconsistent {a} expert sizes: {n_expert} experts, {n_used} used per token, width {d_expert}, \
             shared {d_shared:?}"
        ));
    }
    Ok(Some(MoeHparams {
        n_expert,
        n_used,
        d_expert,
        d_shared,
    }))
}

fn gemma_hparams(g: &GgufFile, h: &Hparams, linear: bool) -> Result<GemmaHparams> {
    let bad = |msg: String| Err(file_err(&g.path, msg));
    for key in [
        "gemma3.final_logit_softcapping",
        "gemma3.attn_logit_softcapping",
    ] {
        if g.get(key).is_some() {
            return bad(format!(
                "{key} is set: logit soft-capping is not implemented"
            ));
        }
    }
    let sliding_window = g.require_u64("gemma3.attention.sliding_window")? as usize;
    if sliding_window == 0 {
        return bad("gemma3.attention.sliding_window is 0".into());
    }
    const PATTERN: &str = "gemma3.attention.sliding_window_pattern";
    let sliding: Vec<bool> = match g.get(PATTERN) {
        None => every_nth_global(h.n_layer, GEMMA3_SWA_PATTERN),
        Some(Value::Array(a)) => {
            if a.len() != h.n_layer {
                return bad(format!(
                    "{PATTERN} has {} entries for {} layers",
                    a.len(),
                    h.n_layer
                ));
            }
            a.iter()
                .map(|v| {
                    v.as_bool().ok_or_else(|| {
                        file_err(&g.path, format!("{PATTERN} holds a {}", v.type_name()))
                    })
                })
                .collect::<Result<_>>()?
        }
        Some(v) => match v.as_u64() {
            Some(n) => every_nth_global(h.n_layer, n),
            None => {
                return bad(format!(
                    "{PATTERN} is a {}, expected an integer or an array of booleans",
                    v.type_name()
                ));
            }
        },
    };
    let rope_linear_factor = if linear {
        let f = g.require_f64("gemma3.rope.scaling.factor")?;
        if !(f.is_finite() && f > 0.0) {
            return bad(format!(
                "gemma3.rope.scaling.factor {f} must be a positive number"
            ));
        }
        f
    } else {
        1.0
    };
    let query_pre_attn_scalar =
        gemma3_implied(h.n_layer, h.d, h.n_head, h.head_dim).query_pre_attn_scalar;
    Ok(GemmaHparams {
        sliding_window,
        sliding,
        query_pre_attn_scalar,
        rope_linear_factor,
    })
}

/// llama.cpp's `set_swa_pattern(n)`: layer l is local unless l % n == n − 1; n = 0 makes every layer local.
fn every_nth_global(n_layer: usize, n: u64) -> Vec<bool> {
    (0..n_layer as u64)
        .map(|l| n == 0 || l % n < n - 1)
        .collect()
}

/// How a GGUF tensor becomes an HF tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fixup {
    None,
    /// Undo the Q/K row permutation with this many heads.
    Unpermute(usize),
    /// Undo Gemma's stored w + 1 of a norm weight.
    MinusOne,
    /// Expert e's [d_out × d_in] of a stacked `ffn_*_exps` tensor [n_expert × d_out × d_in].
    Expert(usize),
    /// Qwen2-MoE's shared-expert gate: GGUF's vector [d] is HF's [1 × d].
    Row,
}

/// Tensor names outside the blocks: (GGUF, HF), without `.weight`.
const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// A Llama block's tensors: (GGUF, HF under `model.layers.{l}.`), without `.weight`. Gemma 3 shares the
/// first eight; its norms differ (`hf_name`).
const LLAMA_BLOCK_NAMES: [(&str, &str); 9] = [
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
];

/// Qwen3's per-head norms: (GGUF, HF under `model.layers.{l}.`), without `.weight`.
const QK_NORM_NAMES: [(&str, &str); 2] = [
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
];

/// (GGUF, HF) name pairs of a block's parts.
type Names = &'static [(&'static str, &'static str)];

/// Gemma 3's sandwich norms and MLP input norm: (GGUF, HF under `model.layers.{l}.`), without `.weight`.
const GEMMA3_NORM_NAMES: [(&str, &str); 3] = [
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// GGUF tensor name → its HF tensors (one, or one per expert of a stacked `ffn_*_exps`) with their fixups,
/// or None for a name this importer does not know.
pub fn hf_names(name: &str, h: &Hparams) -> Option<Vec<(String, Fixup)>> {
    let Some(m) = &h.moe else {
        return hf_name(name, h).map(|n| vec![n]);
    };
    let (base, suffix) = name.rsplit_once('.')?;
    // Outside the blocks, or a block name this importer refuses: the dense mapping says which.
    let Some((layer, part)) = block_part(base, h) else {
        return hf_name(name, h).map(|n| vec![n]);
    };
    let (mlp, experts) = match h.arch {
        Arch::Llama => ("block_sparse_moe", ["w1", "w3", "w2"]),
        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
    };
    let at = |hf: String, fix| Some(vec![(format!("model.layers.{layer}.{hf}.weight"), fix)]);
    if suffix != "weight" {
        return hf_name(name, h).map(|n| vec![n]);
    }
    let exps = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];
    let shexp = ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"];
    if let Some(i) = exps.iter().position(|&p| p == part) {
        return Some(
            (0..m.n_expert)
                .map(|e| {
                    (
                        format!(
                            "model.layers.{layer}.{mlp}.experts.{e}.{}.weight",
                            experts[i]
                        ),
                        Fixup::Expert(e),
                    )
                })
                .collect(),
        );
    }
    match part {
        "ffn_gate_inp" => at(format!("{mlp}.gate"), Fixup::None),
        "ffn_gate_inp_shexp" if m.d_shared.is_some() => {
            at("mlp.shared_expert_gate".into(), Fixup::Row)
        }
        p if m.d_shared.is_some() && shexp.contains(&p) => {
            let i = shexp.iter().position(|&x| x == p)?;
            at(format!("mlp.shared_expert.{}", experts[i]), Fixup::None)
        }
        // A mixture of experts has no dense MLP.
        "ffn_gate" | "ffn_up" | "ffn_down" => None,
        _ => hf_name(name, h).map(|n| vec![n]),
    }
}

/// (layer, part) of a block tensor's name without its suffix ("blk.3.attn_q"), for a layer of the model.
fn block_part<'a>(base: &'a str, h: &Hparams) -> Option<(usize, &'a str)> {
    let (layer_text, part) = base.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer_text.parse().ok()?;
    // "blk.01" or "blk.+1" would parse too; only the canonical spelling maps.
    (layer < h.n_layer && layer.to_string() == layer_text).then_some((layer, part))
}

/// Every HF tensor an imported model of `h` must have (`.weight` unless named `.bias`).
pub fn required_names(h: &Hparams) -> Vec<String> {
    let mut out = vec![
        "model.embed_tokens.weight".to_owned(),
        "model.norm.weight".to_owned(),
    ];
    let dense_mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];
    for l in 0..h.n_layer {
        for p in layer_parts(h.arch)
            .iter()
            .filter(|p| h.moe.is_none() || !dense_mlp.contains(p))
        {
            out.push(format!("model.layers.{l}.{p}.weight"));
        }
        for p in h.arch.bias_parts() {
            out.push(format!("model.layers.{l}.{p}.bias"));
        }
        if let Some(m) = &h.moe {
            for n in [
                "ffn_gate_inp",
                "ffn_gate_exps",
                "ffn_up_exps",
                "ffn_down_exps",
            ]
            .into_iter()
            .chain(
                m.d_shared
                    .map(|_| {
                        [
                            "ffn_gate_shexp",
                            "ffn_up_shexp",
                            "ffn_down_shexp",
                            "ffn_gate_inp_shexp",
                        ]
                    })
                    .into_iter()
                    .flatten(),
            ) {
                let names = hf_names(&format!("blk.{l}.{n}.weight"), h).unwrap_or_default();
                out.extend(names.into_iter().map(|(hf, _)| hf));
            }
        }
    }
    out
}

/// GGUF tensor name → (HF name, fixup), or None for a name this importer does not know.
pub fn hf_name(name: &str, h: &Hparams) -> Option<(String, Fixup)> {
    let arch = h.arch;
    let gemma = arch == Arch::Gemma3;
    let norm_fix = if gemma { Fixup::MinusOne } else { Fixup::None };
    let (base, suffix) = name.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    if let Some(&(g, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == base) {
        let fix = if g == "output_norm" {
            norm_fix
        } else {
            Fixup::None
        };
        return (suffix == "weight").then(|| (format!("{hf}.weight"), fix));
    }
    let (layer, part) = block_part(base, h)?;
    let shared = if gemma {
        &LLAMA_BLOCK_NAMES[..8]
    } else {
        &LLAMA_BLOCK_NAMES[..]
    };
    let (hf, fix) = match shared.iter().find(|(g, _)| *g == part) {
        Some(&(g, hf)) => (
            hf,
            match g {
                "attn_q" if arch.permutes_qk() => Fixup::Unpermute(h.n_head),
                "attn_k" if arch.permutes_qk() => Fixup::Unpermute(h.n_kv_head),
                "attn_norm" => norm_fix,
                _ => Fixup::None,
            },
        ),
        // Gemma's ffn_norm is the MLP's input norm; its post_attention_norm normalizes the attention's
        // output before the residual add.
        None if gemma => (
            GEMMA3_NORM_NAMES
                .iter()
                .chain(&QK_NORM_NAMES)
                .find(|(g, _)| *g == part)?
                .1,
            norm_fix,
        ),
        None if matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe) => (
            QK_NORM_NAMES.iter().find(|(g, _)| *g == part)?.1,
            Fixup::None,
        ),
        None => return None,
    };
    if suffix == "bias" && !arch.bias_parts().contains(&hf) {
        return None;
    }
    Some((format!("model.layers.{layer}.{hf}.{suffix}"), fix))
}

/// HF tensor name (`….weight` or `….bias`) → its GGUF name in `arch` (what convert_hf_to_gguf.py writes),
/// or None for a tensor llama.cpp's architecture has no place for. The inverse of `hf_name` for the
/// architectures `--format gguf` writes.
pub fn gguf_name(name: &str, arch: Arch) -> Option<String> {
    let (base, suffix) = name.rsplit_once('.')?;
    if suffix == "weight"
        && let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, hf)| *hf == base)
    {
        return Some(format!("{g}.weight"));
    }
    let (layer_text, part) = base.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer_text.parse().ok()?;
    let qk_norms: &[(&str, &str)] = if arch.qk_norm() { &QK_NORM_NAMES } else { &[] };
    // Gemma 3 shares Llama's linears and input norm; its other norms are its own (`hf_name`).
    let (shared, own): (Names, Names) = match arch {
        Arch::Gemma3 => (&LLAMA_BLOCK_NAMES[..8], &GEMMA3_NORM_NAMES),
        _ => (&LLAMA_BLOCK_NAMES, &[]),
    };
    let (g, hf) = shared
        .iter()
        .chain(qk_norms)
        .chain(own)
        .find(|(_, hf)| *hf == part)?;
    match suffix {
        "weight" => {}
        "bias" if arch.bias_parts().contains(hf) => {}
        _ => return None,
    }
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// The tensors of one layer (names under `model.layers.{l}.`, without `.weight`) that must be present.
pub fn layer_parts(arch: Arch) -> &'static [&'static str] {
    // Llama's nine, then Qwen3's q/k norms, then Gemma 3's sandwich norms: each list is a prefix of the next.
    const GEMMA3: [&str; 13] = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ];
    match arch {
        Arch::Llama | Arch::Qwen2 | Arch::Qwen2Moe => &GEMMA3[..9],
        Arch::Qwen3 | Arch::Qwen3Moe => &GEMMA3[..11],
        Arch::Gemma3 => &GEMMA3,
    }
}

/// Expected row-major shape of each HF tensor.
pub fn expected_shape(hf: &str, h: &Hparams, vocab: usize) -> Vec<usize> {
    let (q, kv) = (h.n_head * h.head_dim, h.n_kv_head * h.head_dim);
    let part = hf.rsplit('.').nth(1).unwrap_or("");
    if let Some(m) = &h.moe {
        let width = if hf.contains(".experts.") {
            Some(m.d_expert)
        } else if hf.contains(".shared_expert.") {
            m.d_shared
        } else {
            None
        };
        if let Some(w) = width {
            return match part {
                "w1" | "w3" | "gate_proj" | "up_proj" => vec![w, h.d],
                "w2" | "down_proj" => vec![h.d, w],
                _ => vec![],
            };
        }
        match part {
            "gate" => return vec![m.n_expert, h.d],
            "shared_expert_gate" => return vec![1, h.d],
            _ => {}
        }
    }
    if hf.ends_with(".bias") {
        return match part {
            "q_proj" => vec![q],
            "k_proj" | "v_proj" => vec![kv],
            _ => vec![],
        };
    }
    match part {
        "embed_tokens" | "lm_head" => vec![vocab, h.d],
        "norm"
        | "input_layernorm"
        | "post_attention_layernorm"
        | "pre_feedforward_layernorm"
        | "post_feedforward_layernorm" => vec![h.d],
        "q_norm" | "k_norm" => vec![h.head_dim],
        "q_proj" => vec![q, h.d],
        "k_proj" | "v_proj" => vec![kv, h.d],
        "o_proj" => vec![h.d, q],
        "gate_proj" | "up_proj" => vec![h.d_ff, h.d],
        "down_proj" => vec![h.d, h.d_ff],
        _ => vec![],
    }
}

/// Token ids config.json and generation_config.json name.
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
}

/// The `rope_scaling` of config.json (Llama 3.1's "llama3" type) that gives the divisors `factors` of a
/// llama GGUF's rope_freqs tensor (`RopeScaling::llama3_divisors`). The divisors fix `factor` (the largest)
/// and, through the interpolated band, only the ratios low/original and high/original, which is all the
/// formula uses: low_freq_factor is taken as 1 (Llama 3.1's and 3.2's) and original_max_position_embeddings
/// as the nearest integer; a band of one frequency also takes high_freq_factor as 4 (theirs), a band of none
/// any original between the last unscaled and the first scaled wavelength. The result must reproduce every
/// divisor to 1e-5, else the file is refused (a rope_freqs of another shape).
pub fn llama3_rope_scaling(
    factors: &[f32],
    theta: f64,
    d_h: usize,
) -> Result<serde_json::Value, String> {
    let f: Vec<f64> = factors.iter().map(|&x| x as f64).collect();
    let big = f.iter().copied().fold(f64::NAN, f64::max);
    if factors.len() != d_h / 2
        || !(big.is_finite() && big > 1.0)
        || f.iter().any(|&x| x.is_nan() || x < 1.0)
    {
        return Err(format!(
            "rope_freqs ({} values for head_dim {d_h}, largest {big}) are not Llama 3.1 rope-scaling divisors",
            factors.len()
        ));
    }
    let wl = |i: usize| 2.0 * std::f64::consts::PI * theta.powf((2 * i) as f64 / d_h as f64);
    // On the interpolated band s = (1/f − 1/F)/(1 − 1/F) = (original/λ − low)/(high − low).
    let band: Vec<(f64, f64)> = f
        .iter()
        .enumerate()
        .filter(|&(_, &x)| x > 1.0 + 1e-6 && x < big * (1.0 - 1e-6))
        .map(|(i, &x)| (1.0 / wl(i), (1.0 / x - 1.0 / big) / (1.0 - 1.0 / big)))
        .collect();
    let (original, high) = match band.as_slice() {
        [] => {
            let last_one = (0..f.len())
                .filter(|&i| f[i] <= 1.0 + 1e-6)
                .map(wl)
                .fold(0.0, f64::max);
            let first_big = (0..f.len())
                .filter(|&i| f[i] >= big * (1.0 - 1e-6))
                .map(wl)
                .fold(f64::INFINITY, f64::min);
            ((4.0 * last_one * first_big).sqrt().round(), 4.0)
        }
        [(x, s)] => (((3.0 * s + 1.0) / x).round(), 4.0),
        _ => {
            // Least squares of s = a·(1/λ) + b: low/original = −b/a, high/original = (1 − b)/a.
            let n = band.len() as f64;
            let mx = band.iter().map(|p| p.0).sum::<f64>() / n;
            let my = band.iter().map(|p| p.1).sum::<f64>() / n;
            let sxx: f64 = band.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
            let sxy: f64 = band.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
            let a = sxy / sxx;
            let b = my - a * mx;
            let original = (-a / b).round();
            (
                original,
                ((1.0 - b) / a * original * 1024.0).round() / 1024.0,
            )
        }
    };
    let s = super::super::config::RopeScaling {
        rope_type: "llama3".into(),
        factor: big,
        low_freq_factor: 1.0,
        high_freq_factor: high,
        original_max_position_embeddings: original.max(0.0) as usize,
    };
    let ok = original >= 1.0
        && high > 1.0
        && s.llama3_divisors(theta, d_h)
            .iter()
            .zip(&f)
            .all(|(want, got)| (want - got).abs() <= 1e-5 * got);
    if !ok {
        return Err(format!(
            "rope_freqs are not Llama 3.1 rope-scaling divisors (the nearest: factor {big}, low_freq_factor 1, \
             high_freq_factor {high}, original_max_position_embeddings {original})"
        ));
    }
    Ok(json!({
        "rope_type": "llama3",
        "factor": big,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": original as usize,
    }))
}

/// config.json of the imported model, in the form transformers 5 writes for the architecture.
pub fn config_json(
    h: &Hparams,
    vocab: usize,
    tie: bool,
    ids: &SpecialIds,
    torch_dtype: &str,
) -> serde_json::Value {
    let mut c = json!({
        "architectures": [h.arch.hf_architecture()],
        "hidden_size": h.d,
        "intermediate_size": h.d_ff,
        "num_hidden_layers": h.n_layer,
        "num_attention_heads": h.n_head,
        "num_key_value_heads": h.n_kv_head,
        "head_dim": h.head_dim,
        "rms_norm_eps": h.eps,
        "max_position_embeddings": h.ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": tie,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "torch_dtype": torch_dtype,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
    });
    let extra = match &h.gemma {
        None if h.arch == Arch::Llama => json!({
            "model_type": "llama",
            "rope_theta": h.theta,
            "rope_scaling": null,
            "mlp_bias": false,
            "hidden_act": "silu",
            "pretraining_tp": 1,
        }),
        // Qwen2 always has q/k/v biases (its config has no switch); Qwen3 has none unless attention_bias,
        // which llama.cpp's qwen3 does not read.
        None => json!({
            "model_type": h.arch.key(),
            "rope_theta": h.theta,
            "rope_scaling": null,
            "hidden_act": "silu",
            "use_sliding_window": false,
            "sliding_window": null,
            "max_window_layers": h.n_layer,
        }),
        Some(gm) => {
            let global = if gm.rope_linear_factor == 1.0 {
                json!({"rope_type": "default", "rope_theta": h.theta})
            } else {
                json!({"rope_type": "linear", "factor": gm.rope_linear_factor, "rope_theta": h.theta})
            };
            let layer_types: Vec<&str> = gm
                .sliding
                .iter()
                .map(|&s| {
                    if s {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            json!({
                "model_type": "gemma3_text",
                "hidden_activation": "gelu_pytorch_tanh",
                // An integer where it is one: transformers' Gemma3TextConfig refuses 256.0 for its int field.
                "query_pre_attn_scalar": match gm.query_pre_attn_scalar {
                    s if s.fract() == 0.0 && s.abs() < 1e15 => json!(s as i64),
                    s => json!(s),
                },
                "sliding_window": gm.sliding_window,
                "layer_types": layer_types,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE},
                    "full_attention": global,
                },
                "final_logit_softcapping": null,
                "attn_logit_softcapping": null,
                "use_bidirectional_attention": false,
            })
        }
    };
    if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(e.clone());
    }
    if let (Some(m), Some(obj)) = (&h.moe, c.as_object_mut()) {
        obj.extend(
            moe_config(h.arch, m)
                .as_object()
                .cloned()
                .unwrap_or_default(),
        );
    }
    c
}

/// The config.json entries of a mixture of experts, with the top-k weighting llama.cpp applies to the
/// architecture (its graph builders fix it: Mixtral and Qwen3-MoE renormalize, Qwen2-MoE does not).
fn moe_config(arch: Arch, m: &MoeHparams) -> serde_json::Value {
    match arch {
        Arch::Llama => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": m.n_expert,
            "num_experts_per_tok": m.n_used,
            "intermediate_size": m.d_expert,
            "sliding_window": null,
            "output_router_logits": false,
        }),
        _ => json!({
            "num_experts": m.n_expert,
            "num_experts_per_tok": m.n_used,
            "moe_intermediate_size": m.d_expert,
            "shared_expert_intermediate_size": m.d_shared,
            "norm_topk_prob": arch == Arch::Qwen3Moe,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": false,
        }),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn llama3_rope_scaling_is_recovered_from_its_divisors() {
        use crate::model::config::RopeScaling;
        // Llama 3.1 8B (a wide band), and hf_reference.py's tiny llama3 (a band of one frequency).
        for (theta, d_h, factor, high, original) in [
            (500000.0, 128, 8.0, 4.0, 8192),
            (10000.0, 16, 8.0, 4.0, 32),
            (10000.0, 64, 32.0, 4.0, 2048),
        ] {
            let s = RopeScaling {
                rope_type: "llama3".into(),
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            };
            let f: Vec<f32> = s
                .llama3_divisors(theta, d_h)
                .iter()
                .map(|&x| x as f32)
                .collect();
            let r = llama3_rope_scaling(&f, theta, d_h).unwrap();
            assert_eq!(r["factor"], factor, "{r}");
            assert_eq!(r["high_freq_factor"], high, "{r}");
            assert_eq!(r["original_max_position_embeddings"], original, "{r}");
        }
        let mut f: Vec<f32> = vec![1.0, 1.0, 3.0, 8.0, 8.0, 8.0, 8.0, 8.0];
        assert!(
            llama3_rope_scaling(&f, 10000.0, 16).is_err(),
            "3 is no Llama 3.1 divisor there"
        );
        f.pop();
        assert!(
            llama3_rope_scaling(&f, 10000.0, 16).is_err(),
            "7 divisors for head_dim 16"
        );
    }

    use super::*;

    /// Two small layers of `arch` (the names' mapping reads only arch, n_layer and the head counts).
    fn small(arch: Arch) -> Hparams {
        Hparams {
            arch,
            n_layer: 2,
            d: 8,
            d_ff: 16,
            n_head: 2,
            n_kv_head: 1,
            head_dim: 4,
            eps: 1e-6,
            theta: 1e6,
            ctx: 32,
            gemma: None,
            moe: None,
        }
    }

    #[test]
    fn gguf_name_inverts_hf_name() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let h = small(arch);
            let mut names = vec!["token_embd.weight", "output_norm.weight", "output.weight"]
                .into_iter()
                .map(String::from)
                .collect::<Vec<_>>();
            for (g, _) in LLAMA_BLOCK_NAMES {
                names.push(format!("blk.1.{g}.weight"));
            }
            if arch == Arch::Qwen3 {
                names.extend(QK_NORM_NAMES.map(|(g, _)| format!("blk.1.{g}.weight")));
            }
            if arch == Arch::Qwen2 {
                names.extend(["attn_q", "attn_k", "attn_v"].map(|g| format!("blk.1.{g}.bias")));
            }
            for g in names {
                let (hf, fix) = hf_name(&g, &h).unwrap_or_else(|| panic!("{arch:?} {g}"));
                assert_eq!(gguf_name(&hf, arch).as_deref(), Some(g.as_str()), "{hf}");
                if !arch.permutes_qk() {
                    assert_eq!(fix, Fixup::None, "{arch:?} {g}");
                }
            }
        }
        // Gemma 3: every norm stored as w + 1 (`Fixup::MinusOne` on the way in), its own norm names.
        let h = small(Arch::Gemma3);
        let mut names: Vec<String> = ["token_embd.weight", "output_norm.weight"]
            .map(String::from)
            .to_vec();
        for (g, _) in LLAMA_BLOCK_NAMES[..8]
            .iter()
            .chain(&QK_NORM_NAMES)
            .chain(&GEMMA3_NORM_NAMES)
        {
            names.push(format!("blk.1.{g}.weight"));
        }
        for g in names {
            let (hf, fix) = hf_name(&g, &h).unwrap_or_else(|| panic!("gemma3 {g}"));
            assert_eq!(
                gguf_name(&hf, Arch::Gemma3).as_deref(),
                Some(g.as_str()),
                "{hf}"
            );
            let norm = g.contains("norm");
            assert_eq!(fix == Fixup::MinusOne, norm, "{g}");
        }
        let q_norm = "model.layers.0.self_attn.q_norm.weight";
        assert_eq!(gguf_name(q_norm, Arch::Llama), None);
        assert_eq!(
            gguf_name(q_norm, Arch::Qwen3).as_deref(),
            Some("blk.0.attn_q_norm.weight")
        );
        // llama.cpp reads q/k/v biases in qwen2 only, and never an o_proj or global bias.
        let bias = "model.layers.0.self_attn.q_proj.bias";
        assert_eq!(gguf_name(bias, Arch::Llama), None);
        assert_eq!(gguf_name(bias, Arch::Qwen3), None);
        assert_eq!(
            gguf_name("model.layers.0.self_attn.o_proj.bias", Arch::Qwen2),
            None
        );
        assert_eq!(hf_name("blk.0.attn_output.bias", &small(Arch::Qwen2)), None);
        assert_eq!(hf_name("blk.0.attn_q.bias", &small(Arch::Llama)), None);
        assert_eq!(hf_name("output_norm.bias", &small(Arch::Qwen2)), None);
        assert_eq!(expected_shape(bias, &small(Arch::Qwen2), 10), vec![2 * 4]);
    }

    #[test]
    fn gemma3_pattern_makes_every_sixth_layer_global() {
        let s = every_nth_global(18, 6);
        let global: Vec<usize> = (0..18).filter(|&l| !s[l]).collect();
        assert_eq!(global, vec![5, 11, 17]);
        assert!(every_nth_global(3, 0).iter().all(|&x| x));
    }

    #[test]
    fn gemma3_names_keep_q_k_rows_and_undo_the_norm_offset() {
        let h = small(Arch::Gemma3);
        let map = |n: &str| hf_name(n, &h);
        let l = |p: &str| format!("model.layers.1.{p}.weight");
        assert_eq!(
            map("blk.1.attn_q.weight"),
            Some((l("self_attn.q_proj"), Fixup::None))
        );
        for (gguf, hf) in [
            ("attn_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
        ] {
            assert_eq!(
                map(&format!("blk.1.{gguf}.weight")),
                Some((l(hf), Fixup::MinusOne)),
                "{gguf}"
            );
        }
        assert_eq!(
            map("output_norm.weight"),
            Some(("model.norm.weight".into(), Fixup::MinusOne))
        );
        // Llama has no sandwich norms; its ffn_norm is the MLP's input norm under HF's Llama name.
        let llama = Hparams {
            arch: Arch::Llama,
            ..h
        };
        assert_eq!(hf_name("blk.0.post_ffw_norm.weight", &llama), None);
        assert_eq!(
            hf_name("blk.0.attn_q.weight", &llama).map(|x| x.1),
            Some(Fixup::Unpermute(2))
        );
    }
}
