//! Gemma 3 (text): the Llama attention with Qwen3's per-head q/k norm, plus
//! - sandwich norms: the attention's and the MLP's outputs are RMS-normalized before their residual adds
//!   (post_attention_layernorm, post_feedforward_layernorm; the MLP's input norm is pre_feedforward_layernorm);
//! - every RMSNorm scales by (1 + w);
//! - GeGLU (gelu_pytorch_tanh) instead of SwiGLU;
//! - scores scaled by query_pre_attn_scalar^−½ (folded into the q norm), embeddings by √d (the tied head not);
//! - interleaved local (sliding-window) and global layers, each kind with its own RoPE base.

use super::{
    Activation, BlockDesc, Dims, NormDesc, NormRole, RopeSpec, Sliding, llama_linears, sliding,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    let act = raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(format!(
            "hidden_activation {act:?} is not supported for Gemma 3 (its MLP is GeGLU: \"gelu_pytorch_tanh\")"
        ));
    }
    for (field, v) in [
        ("final_logit_softcapping", raw.final_logit_softcapping),
        ("attn_logit_softcapping", raw.attn_logit_softcapping),
    ] {
        if let Some(v) = v {
            return Err(format!(
                "{field} {v} is not supported (logit soft-capping is not implemented)"
            ));
        }
    }
    if raw.use_bidirectional_attention {
        return Err(
            "use_bidirectional_attention true is not supported (the attention here is causal)"
                .into(),
        );
    }
    if raw.mlp_bias {
        return Err("mlp_bias true is not part of Gemma 3 (its MLP has no biases)".into());
    }
    let n_layers = raw.num_hidden_layers;
    if raw.layer_types.len() != n_layers {
        return Err(format!(
            "layer_types has {} entries for {n_layers} layers (Gemma 3 needs one per layer: \
             \"sliding_attention\" or \"full_attention\")",
            raw.layer_types.len()
        ));
    }
    let layer_rope = raw
        .layer_types
        .iter()
        .map(|t| rope_of(raw, t))
        .collect::<Result<Vec<_>, String>>()?;
    let scalar = raw.query_pre_attn_scalar.unwrap_or(dims.d_h as f64);
    if !(scalar.is_finite() && scalar > 0.0) {
        return Err(format!(
            "query_pre_attn_scalar {scalar} must be a positive number"
        ));
    }
    let norm = |name, role, len| NormDesc { name, role, len };
    let (sliding_window, sliding_layers) = sliding(raw, Sliding::LayerTypes);
    Ok(BlockDesc {
        linears: llama_linears(dims, raw.attention_bias, raw.attention_bias),
        norms: vec![
            norm("input_layernorm", NormRole::Attn, dims.d),
            norm("post_attention_layernorm", NormRole::AttnOut, dims.d),
            norm("pre_feedforward_layernorm", NormRole::Mlp, dims.d),
            norm("post_feedforward_layernorm", NormRole::MlpOut, dims.d),
            norm("self_attn.q_norm", NormRole::Q, dims.d_h),
            norm("self_attn.k_norm", NormRole::K, dims.d_h),
        ],
        sliding_window,
        sliding_layers,
        act: Activation::GeluTanh,
        norm_offset: 1.0,
        // The attention divides by √d_h; Gemma wants √query_pre_attn_scalar.
        q_scale: (dims.d_h as f64 / scalar).sqrt() as f32,
        embed_scale: Some((dims.d as f64).sqrt() as f32),
        layer_rope: Some(layer_rope),
        moe: None,
        online_down: None,
    })
}

/// The RoPE of a layer of type `t`: transformers ≥ 5 writes `rope_parameters` per layer type; older configs
/// give the global base as `rope_theta` (with `rope_scaling`) and the local one as `rope_local_base_freq`.
fn rope_of(raw: &RawConfig, t: &str) -> Result<RopeSpec, String> {
    if !matches!(t, "sliding_attention" | "full_attention") {
        return Err(format!(
            "layer type {t:?} is not supported (sliding_attention or full_attention)"
        ));
    }
    let per_type = raw.rope_parameters.as_ref().and_then(|p| p.get(t));
    let (theta, scaling) = match per_type {
        Some(p) => (
            p.get("rope_theta").and_then(|v| v.as_f64()),
            Some(p.clone()),
        ),
        None if t == "sliding_attention" => {
            (Some(raw.rope_local_base_freq.unwrap_or(10_000.0)), None)
        }
        None => (
            Some(raw.rope_theta.unwrap_or(1_000_000.0)),
            raw.rope_scaling_json.clone(),
        ),
    };
    let theta = theta.ok_or_else(|| format!("rope_parameters.{t} has no rope_theta"))?;
    if !(theta.is_finite() && theta > 0.0) {
        return Err(format!(
            "rope_theta {theta} of {t} layers must be a positive number"
        ));
    }
    let rope_type = scaling
        .as_ref()
        .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let linear_factor = match rope_type {
        "default" => 1.0,
        "linear" => scaling
            .as_ref()
            .and_then(|s| s.get("factor"))
            .and_then(|v| v.as_f64())
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| format!("linear rope scaling of {t} layers needs a positive factor"))?,
        other => {
            return Err(format!(
                "rope type {other:?} of {t} layers is not supported for Gemma 3 (default or linear)"
            ));
        }
    };
    Ok(RopeSpec {
        theta,
        linear_factor,
    })
}
