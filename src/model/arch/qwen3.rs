//! Qwen3: the Llama block with a per-head RMSNorm on the queries and keys before RoPE (`q_norm`, `k_norm`,
//! weight [d_h] shared by the heads), an explicit `head_dim`, and q/k/v/o biases only with `attention_bias`.
//! The scores see the normalized projections, so BoA's row Hessians of W_Q and W_K carry the norm's weight
//! (design.md §4.3, "q/k norm").

use super::{
    Activation, BlockDesc, Dims, NormDesc, NormRole, Sliding, check_silu, llama_linears, pre_norms,
    sliding,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    if raw.mlp_bias {
        return Err("mlp_bias true is not part of Qwen3 (its MLP has no biases)".into());
    }
    let mut norms = pre_norms(dims.d);
    norms.extend([
        NormDesc {
            name: "self_attn.q_norm",
            role: NormRole::Q,
            len: dims.d_h,
        },
        NormDesc {
            name: "self_attn.k_norm",
            role: NormRole::K,
            len: dims.d_h,
        },
    ]);
    let (sliding_window, sliding_layers) = sliding(raw, Sliding::Qwen);
    Ok(BlockDesc {
        linears: llama_linears(dims, raw.attention_bias, raw.attention_bias),
        norms,
        sliding_window,
        sliding_layers,
        act: Activation::Silu,
        norm_offset: 0.0,
        q_scale: 1.0,
        embed_scale: None,
        layer_rope: None,
        moe: None,
    })
}
