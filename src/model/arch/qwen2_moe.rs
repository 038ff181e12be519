//! Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases unless `qkv_bias` is
//! false) and, in every layer, a sparse MLP of `num_experts` SwiGLU experts (`mlp.experts.{e}.{gate,up,
//! down}_proj`, intermediate size `moe_intermediate_size`) under a softmax router `mlp.gate` keeping the top
//! `num_experts_per_tok` (renormalized only with `norm_topk_prob`), plus a shared expert: a SwiGLU MLP
//! `mlp.shared_expert` of `shared_expert_intermediate_size` on every token, scaled by
//! sigmoid(`mlp.shared_expert_gate` · x). Dense layers (`mlp_only_layers`, `decoder_sparse_step` > 1,
//! `num_experts` 0) would need a second block kind: refused. The sliding window follows Qwen2-MoE's own
//! default `layer_types` (even layers below `max_window_layers`), not Qwen2's.

use super::{
    BlockDesc, Dims, LinearDesc, MoeDesc, Role, SharedExpertDesc, Sliding, check_silu, moe_counts,
    moe_linears, pre_norms, sliding, swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    if raw.mlp_bias {
        return Err("mlp_bias true is not part of Qwen2-MoE (its MLPs have no biases)".into());
    }
    if raw.num_experts == Some(0)
        || raw.decoder_sparse_step.is_some_and(|s| s != 1)
        || !raw.mlp_only_layers.is_empty()
    {
        return Err(
            "dense layers in a Qwen2-MoE model (mlp_only_layers, decoder_sparse_step other than 1, \
             num_experts 0) are not supported"
                .into(),
        );
    }
    let (n_experts, top_k) = moe_counts(raw)?;
    let d_e = raw
        .moe_intermediate_size
        .filter(|&n| n > 0)
        .ok_or("Qwen2-MoE needs a positive moe_intermediate_size")?;
    let d_s = raw
        .shared_expert_intermediate_size
        .filter(|&n| n > 0)
        .ok_or("Qwen2-MoE needs a positive shared_expert_intermediate_size")?;
    let mut linears = moe_linears(
        dims,
        raw.qkv_bias.unwrap_or(true),
        "mlp.experts",
        ["gate_proj", "up_proj", "down_proj"],
        n_experts,
        d_e,
    );
    // o_proj has no bias in Qwen2-MoE whatever qkv_bias says.
    linears[3].bias = false;
    // The shared expert after the attention, before the routed experts (the order transformers runs them in).
    let shared = [
        ("gate_proj", Role::Gate, d_s, dims.d),
        ("up_proj", Role::Up, d_s, dims.d),
        ("down_proj", Role::Down, dims.d, d_s),
    ]
    .map(|(name, role, d_out, d_in)| LinearDesc {
        name: format!("mlp.shared_expert.{name}"),
        role,
        d_out,
        d_in,
        bias: false,
        expert: None,
    });
    linears.splice(4..4, shared);
    Ok(BlockDesc {
        moe: Some(MoeDesc {
            router: "mlp.gate",
            n_experts,
            top_k,
            renormalize: raw.norm_topk_prob,
            d_expert: d_e,
            shared_expert: Some(SharedExpertDesc {
                gate: "mlp.shared_expert_gate",
                d_ff: d_s,
            }),
        }),
        ..swiglu_block(linears, pre_norms(dims.d), sliding(raw, Sliding::Qwen2Moe))
    })
}
