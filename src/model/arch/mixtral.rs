//! Mixtral 8x7B / 8x22B: Mistral's attention (sliding window when set) and, in every layer, a sparse MLP of
//! `num_local_experts` SwiGLU experts (`block_sparse_moe.experts.{e}.w1` = gate, `w3` = up, `w2` = down, of
//! size `intermediate_size`) under a softmax router `block_sparse_moe.gate` whose top `num_experts_per_tok`
//! probabilities are always renormalized. (`router_jitter_noise` acts only in training.)

use super::{
    BlockDesc, Dims, MoeDesc, Sliding, check_silu, moe_counts, moe_linears, pre_norms, sliding,
    swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(raw: &RawConfig, dims: Dims) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    if raw.attention_bias || raw.mlp_bias {
        return Err("attention_bias and mlp_bias are not part of Mixtral".into());
    }
    let (n_experts, top_k) = moe_counts(raw)?;
    let linears = moe_linears(
        dims,
        false,
        "block_sparse_moe.experts",
        ["w1", "w3", "w2"],
        n_experts,
        dims.d_ff,
    );
    Ok(BlockDesc {
        moe: Some(MoeDesc {
            router: "block_sparse_moe.gate",
            n_experts,
            top_k,
            renormalize: true,
            d_expert: dims.d_ff,
            shared_expert: None,
        }),
        ..swiglu_block(linears, pre_norms(dims.d), sliding(raw, Sliding::AllLayers))
    })
}
