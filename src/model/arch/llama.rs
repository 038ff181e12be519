//! Llama 1/2/3.x, Mistral and Qwen2/2.5: RMSNorm → q/k/v → RoPE → causal GQA attention → o (+ residual),
//! RMSNorm → SwiGLU MLP (+ residual). They differ in biases (Qwen2: q/k/v always; Llama: `attention_bias`
//! on q/k/v/o and `mlp_bias` on the MLP) and in the sliding window (Mistral's whenever set).

use super::{
    BlockDesc, Dims, Sliding, check_silu, llama_linears, pre_norms, sliding, swiglu_block,
};
use crate::model::raw_config::RawConfig;

pub(super) fn describe(
    architecture: &str,
    raw: &RawConfig,
    dims: Dims,
) -> Result<BlockDesc, String> {
    check_silu(raw)?;
    let qwen2 = architecture == "Qwen2ForCausalLM";
    if qwen2 && raw.mlp_bias {
        return Err("mlp_bias true is not part of Qwen2 (its MLP has no biases)".into());
    }
    let mut linears = llama_linears(
        dims,
        qwen2 || raw.attention_bias,
        !qwen2 && raw.attention_bias,
    );
    if raw.mlp_bias {
        for l in linears.iter_mut().skip(4) {
            l.bias = true;
        }
    }
    // transformers' Llama has no sliding window (it ignores the fields); Qwen2's is opt-in.
    let window = match architecture {
        "MistralForCausalLM" => sliding(raw, Sliding::AllLayers),
        "Qwen2ForCausalLM" => sliding(raw, Sliding::Qwen),
        _ => (None, Vec::new()),
    };
    Ok(swiglu_block(linears, pre_norms(dims.d), window))
}
