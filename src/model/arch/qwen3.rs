//! Qwen3: the Llama block with a per-head RMSNorm on the queries and keys before RoPE (`q_norm`, `k_norm`,
//! weight [d_h] shared by the heads), an explicit `head_dim`, and q/k/v/o biases only with `attention_bias`.
//! The scores see the normalized projections, so BoA's row Hessians of W_Q and W_K carry the norm's weight
//! (design.md §4.3, "q/k norm").

use super::{
    BlockDesc, Dims, Sliding, check_silu, llama_linears, pre_norms, qk_norms, sliding, swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    if raw.mlp_bias {
        return Err("mlp_bias true is not part of Qwen3 (its MLP has no biases)".into());
    }
    let mut norms = pre_norms(dims.d);
    norms.extend(qk_norms(dims.d_h));
    Ok(swiglu_block(
        llama_linears(dims, raw.attention_bias, raw.attention_bias),
        norms,
        sliding(raw, Sliding::Qwen),
    ))
}
