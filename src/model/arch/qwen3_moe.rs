//! Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norm) and, in every layer, a sparse
//! MLP of `num_experts` SwiGLU experts (`mlp.experts.{e}.{gate,up,down}_proj`, intermediate size
//! `moe_intermediate_size`) under a softmax router `mlp.gate` that keeps the top `num_experts_per_tok`,
//! renormalized only with `norm_topk_prob`. It has no shared expert. Dense layers (`mlp_only_layers`,
//! `decoder_sparse_step` > 1) would need a second block kind: refused.

use super::{
    BlockDesc, Dims, MoeDesc, Sliding, check_silu, moe_counts, moe_linears, pre_norms, qk_norms,
    sliding, swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    let (n_experts, top_k) = moe_counts(raw)?;
    if raw.decoder_sparse_step.is_some_and(|s| s != 1) || !raw.mlp_only_layers.is_empty() {
        return Err(
            "dense layers in a Qwen3-MoE model (mlp_only_layers, decoder_sparse_step > 1) are not supported"
                .into(),
        );
    }
    let d_e = raw
        .moe_intermediate_size
        .filter(|&n| n > 0)
        .ok_or("Qwen3-MoE needs a positive moe_intermediate_size")?;
    let mut norms = pre_norms(dims.d);
    norms.extend(qk_norms(dims.d_h));
    let linears = moe_linears(
        dims,
        raw.attention_bias,
        "mlp.experts",
        ["gate_proj", "up_proj", "down_proj"],
        n_experts,
        d_e,
    );
    Ok(BlockDesc {
        moe: Some(MoeDesc {
            router: "mlp.gate",
            n_experts,
            top_k,
            renormalize: raw.norm_topk_prob,
            d_expert: d_e,
            shared_expert: None,
        }),
        ..swiglu_block(linears, norms, sliding(raw, Sliding::Qwen))
    })
}
