//! Mixtral 8x7B / 8x22B: Mistral's attention (sliding window when set) and, in every layer, a sparse MLP of
//! `num_local_experts` SwiGLU experts (`block_sparse_moe.experts.{e}.w1` = gate, `w3` = up, `w2` = down, of
//! size `intermediate_size`) under a softmax router `block_sparse_moe.gate` whose top `num_experts_per_tok`
//! probabilities are always renormalized. (`router_jitter_noise` acts only in training.)
//!
//! Checkpoints that GPTQModel 7.7 writes under transformers 5 name the same tensors as transformers 5's
//! modules do: `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj`. Such a checkpoint is read with those
//! names (and quantized into them); Mixtral's own names are the default, as its checkpoints, vLLM's Mixtral
//! loader and llama.cpp's converter use them.

use super::{
    BlockDesc, Dims, MoeDesc, Sliding, check_silu, moe_counts, moe_linears, pre_norms, sliding,
    swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(
    raw: &RawConfig,
    dims: Dims,
    stored: &dyn Fn(&str) -> bool,
) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    if raw.attention_bias || raw.mlp_bias {
        return Err("attention_bias and mlp_bias are not part of Mixtral".into());
    }
    let (n_experts, top_k) = moe_counts(raw)?;
    let (mlp, parts) = if stored("model.layers.0.mlp.gate.weight") {
        ("mlp", ["gate_proj", "up_proj", "down_proj"])
    } else {
        ("block_sparse_moe", ["w1", "w3", "w2"])
    };
    let linears = moe_linears(
        dims,
        false,
        &format!("{mlp}.experts"),
        parts,
        n_experts,
        dims.d_ff,
    );
    Ok(BlockDesc {
        moe: Some(MoeDesc {
            router: if mlp == "mlp" {
                "mlp.gate"
            } else {
                "block_sparse_moe.gate"
            },
            n_experts,
            top_k,
            renormalize: true,
            d_expert: dims.d_ff,
            shared_expert: None,
        }),
        ..swiglu_block(linears, pre_norms(dims.d), sliding(raw, Sliding::AllLayers))
    })
}
