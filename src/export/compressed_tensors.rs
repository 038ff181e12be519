//! `--format compressed-tensors`: compressed-tensors 0.20's `pack-quantized` layout (what llm-compressor writes
//! for W{2,3,4,8}A16 and transformers / vLLM load), from the same codes as the GPTQ formats. Per linear:
//!   weight_packed      int32 [d_out × ceil(d_in·b/32)]: row j is output j's codes along the input, a dense
//!                      LSB-first b-bit stream (compressed-tensors' `pack_to_int32`, packed_dim 1);
//!   weight_scale       the model's dtype [d_out × n_groups] (compressed-tensors makes its scale parameter in
//!                      the weight's dtype, and dequantizes in the scale's dtype);
//!   weight_zero_point  int32 [ceil(d_out·b/32) × n_groups], asymmetric only: column g is group g's zeros
//!                      along the outputs, the same stream (`pack_to_int32(zp, b, packed_dim=0)`);
//!   weight_shape       int64 [2] = [d_out, d_in].
//! compressed-tensors quantizes to the signed range −2^(b−1) … 2^(b−1) − 1 and packs value + 2^(b−1), so the
//! stored values are our unsigned codes q and zeros z unchanged, and its ŵ = s·((q − 2^(b−1)) − (z − 2^(b−1)))
//! is ours. A symmetric scheme stores no zero point: it dequantizes as s·(q − 2^(b−1)), so every zero must be
//! 2^(b−1) (our symmetric grid's), which is checked, never assumed.
//! Groups are contiguous columns (no `weight_g_idx`): act-order is refused before any work (RunOptions).

use super::gptq_packed::check_scales;
use super::hf_folder::f32_to_bytes;
use super::safetensors_out::TensorEntry;
use crate::ops::Packed;
use crate::quant::pack::{pack_stream, pack_words};
use safetensors::Dtype;

/// The compressed-tensors release whose format is written (config.json's `version`).
pub const VERSION: &str = "0.20.0";

fn words_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The entries replacing `{prefix}.weight` for one quantized linear. Errors name the tensor when the codes do
/// not fit the format (a symmetric zero other than 2^(b−1), or groups that are not contiguous columns).
pub fn linear_entries(
    prefix: &str,
    q: &Packed,
    sym: bool,
    dtype: Dtype,
) -> anyhow::Result<Vec<TensorEntry<'static>>> {
    check_scales(prefix, q)?;
    let (d_out, d_in, ng, bits) = (q.d_out, q.d_in, q.n_groups, q.bits);
    if ng == 0 || d_in % ng != 0 {
        return Err(crate::input_err!(
            "{prefix}: {ng} groups do not split its {d_in} inputs evenly, which compressed-tensors' group \
             strategy cannot store"
        ));
    }
    let g = d_in / ng;
    if let Some(c) = (0..d_in).find(|&c| q.g_idx[c] as usize != c / g) {
        return Err(crate::input_err!(
            "{prefix}: input {c} is in group {} rather than {} (compressed-tensors' groups are contiguous \
             columns)",
            q.g_idx[c],
            c / g
        ));
    }
    let mid = 1u8 << (bits - 1);
    if sym && let Some(k) = q.zeros.iter().position(|&z| z != mid) {
        return Err(crate::input_err!(
            "{prefix}: the zero point of output {}, group {} is {}, but a symmetric compressed-tensors \
             scheme stores none and dequantizes with {mid}",
            k % d_out,
            k / d_out,
            q.zeros[k]
        ));
    }
    // Ours is [kw × d_out] (word-major, GPTQ's layout); theirs is its transpose, the same streams.
    let kw = pack_words(d_in, bits);
    let mut packed = vec![0u32; d_out * kw];
    for w in 0..kw {
        for j in 0..d_out {
            packed[j * kw + w] = q.qweight[w * d_out + j];
        }
    }
    let scales: Vec<f32> = (0..d_out * ng)
        .map(|k| q.scales[(k % ng) * d_out + k / ng].to_f32())
        .collect();
    let mut out = vec![
        TensorEntry::new(
            format!("{prefix}.weight_packed"),
            Dtype::I32,
            vec![d_out, kw],
            words_bytes(&packed),
        ),
        TensorEntry::new(
            format!("{prefix}.weight_scale"),
            dtype,
            vec![d_out, ng],
            f32_to_bytes(dtype, &scales),
        ),
    ];
    if !sym {
        let zw = pack_words(d_out, bits);
        let mut zp = vec![0u32; zw * ng];
        for gi in 0..ng {
            pack_stream(
                &q.zeros[gi * d_out..(gi + 1) * d_out],
                bits,
                &mut zp[gi..],
                ng,
            );
        }
        out.push(TensorEntry::new(
            format!("{prefix}.weight_zero_point"),
            Dtype::I32,
            vec![zw, ng],
            words_bytes(&zp),
        ));
    }
    out.push(TensorEntry::new(
        format!("{prefix}.weight_shape"),
        Dtype::I64,
        vec![2],
        [d_out as i64, d_in as i64]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>(),
    ));
    Ok(out)
}

/// config.json's `quantization_config`, with the keys compressed-tensors 0.20's `ModelCompressor.update_config`
/// writes (its `QuantizationConfig.model_dump()` plus `version`, `quant_method`, `sparsity_config`,
/// `transform_config`). `ignore` names the linears left unquantized (lm_head, blocks outside --layers).
/// `widths`: each quantized linear's full name and bits. All at `bits`: one scheme whose target is every
/// `Linear`. Several (`--avg-bits`): one config group per width, each naming its linears exactly; no class
/// target, because vLLM tries a fused layer's (qkv_proj's) class name before its parts' names, and a
/// `Linear` target would give it the base width whatever its parts hold. compressed-tensors forbids unknown
/// keys in a scheme's args, so which algorithm chose the codes is recorded in config.json's own `boa_cuda`
/// block, not here.
pub fn quantization_config(
    bits: u32,
    widths: &[(String, u32)],
    group_size: Option<usize>,
    sym: bool,
    ignore: Vec<String>,
) -> serde_json::Value {
    let (strategy, group) = match group_size {
        Some(g) => ("group", serde_json::json!(g)),
        None => ("channel", serde_json::Value::Null),
    };
    let mut all: Vec<u32> = widths.iter().map(|&(_, b)| b).collect();
    all.sort_unstable();
    all.dedup();
    let scheme = |b: u32, targets: Vec<String>| {
        serde_json::json!({
            "targets": targets,
            "weights": {
                "num_bits": b,
                "type": "int",
                "symmetric": sym,
                "strategy": strategy,
                "group_size": group,
                "dynamic": false,
            },
            "input_activations": null,
            "output_activations": null,
            "format": null,
        })
    };
    let groups: serde_json::Map<String, serde_json::Value> = if all.iter().all(|&b| b == bits) {
        [("group_0".to_string(), scheme(bits, vec!["Linear".into()]))]
            .into_iter()
            .collect()
    } else {
        all.iter()
            .enumerate()
            .map(|(i, &b)| {
                let names = widths
                    .iter()
                    .filter(|&&(_, w)| w == b)
                    .map(|(n, _)| n.clone())
                    .collect();
                (format!("group_{i}"), scheme(b, names))
            })
            .collect()
    };
    serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "version": VERSION,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": null,
        "global_compression_ratio": null,
        "moe_sparsity_config": null,
        "sparsity_config": {},
        "transform_config": {},
    })
}
