//! The tensors and configs of a run's output for each `--format` (design.md §9):
//!   fake     one dequantized `.weight` per linear (loads anywhere);
//!   gptq     packed `qweight`/`qzeros`/`scales`/`g_idx` per linear, zeros stored as zero − 1 (AutoGPTQ v1);
//!   gptq_v2  the same with the true zeros;
//!   compressed-tensors  compressed-tensors' `pack-quantized` tensors (compressed_tensors.rs);
//!   gguf     gptq_v2 shards during the run, one llama.cpp file at its end (gguf_model.rs).
//! Scales are stored in f16, so a packed checkpoint dequantizes with f16-rounded scales. The fake format
//! writes exactly those values, ŵ = f16(s)·(q − z) (then cast to the model's dtype), so the two formats hold the
//! same model; the pipeline's own forward of later blocks still uses the f32 scales.

use super::hf_folder::f32_to_bytes;
use super::safetensors_out::TensorEntry;
use crate::ops::Packed;
use crate::quant::pack::{GptqVersion, PackedTensors, dequantize_packed};
use safetensors::Dtype;

/// What `boa-cuda run --format` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum OutFormat {
    /// Dequantized weights (f16-rounded scales) in the model's dtype.
    #[value(name = "fake")]
    #[serde(rename = "fake")]
    Fake,
    /// Packed GPTQ, zeros stored as zero − 1 (AutoGPTQ's convention, `checkpoint_format: "gptq"`).
    #[value(name = "gptq")]
    #[serde(rename = "gptq")]
    Gptq,
    /// Packed GPTQ with the true zeros (`checkpoint_format: "gptq_v2"`).
    #[value(name = "gptq_v2")]
    #[serde(rename = "gptq_v2")]
    GptqV2,
    /// compressed-tensors' `pack-quantized` (`quant_method: "compressed-tensors"`), as llm-compressor writes it.
    #[value(name = "compressed-tensors")]
    #[serde(rename = "compressed-tensors")]
    CompressedTensors,
    /// One llama.cpp GGUF file, model.gguf (gguf_model.rs): Q4_0 at 4 bits, Q8_0 at 8. The run's shards are
    /// gptq_v2 until the end, so it resumes as a packed run does.
    #[value(name = "gguf")]
    #[serde(rename = "gguf")]
    Gguf,
}

impl OutFormat {
    /// The GPTQ zero-point convention; None for the formats that are not GPTQ's.
    pub fn version(self) -> Option<GptqVersion> {
        match self {
            OutFormat::Fake | OutFormat::CompressedTensors => None,
            OutFormat::Gptq => Some(GptqVersion::V1),
            OutFormat::GptqV2 | OutFormat::Gguf => Some(GptqVersion::V2),
        }
    }

    /// From `name()`'s spelling (as a run's options record it).
    pub fn from_name(s: &str) -> Option<OutFormat> {
        [
            OutFormat::Fake,
            OutFormat::Gptq,
            OutFormat::GptqV2,
            OutFormat::CompressedTensors,
            OutFormat::Gguf,
        ]
        .into_iter()
        .find(|f| f.name() == s)
    }

    pub fn name(self) -> &'static str {
        match self {
            OutFormat::Fake => "fake",
            OutFormat::Gptq => "gptq",
            OutFormat::GptqV2 => "gptq_v2",
            OutFormat::CompressedTensors => "compressed-tensors",
            OutFormat::Gguf => "gguf",
        }
    }
}

fn i32_bytes(v: impl IntoIterator<Item = u32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Refuses a scale that f16 cannot hold, naming the tensor, output and group.
pub fn check_scales(prefix: &str, q: &Packed) -> anyhow::Result<()> {
    // Every format goes through f16 scales: one past f16's range would be written as +inf. The checks before
    // block 0 refuse weights that could get there; this catches what the sweep's updates could still push over.
    if let Some(k) = q.scales.iter().position(|s| !s.is_finite()) {
        return Err(crate::input_err!(
            "{prefix}: the scale of output {}, group {} is beyond f16's range (largest 65504), and every \
             --format stores scales in f16",
            k % q.d_out,
            k / q.d_out
        ));
    }
    Ok(())
}

/// The entries replacing `{prefix}.weight` for one quantized linear (`prefix` e.g. "model.layers.3.mlp.up_proj").
/// Errors name the tensor when v1 cannot store a zero point.
pub fn linear_entries(
    prefix: &str,
    q: &Packed,
    format: OutFormat,
    dtype: Dtype,
) -> anyhow::Result<Vec<TensorEntry<'static>>> {
    check_scales(prefix, q)?;
    if format == OutFormat::CompressedTensors {
        // Its symmetric layout needs --sym, which this signature does not carry.
        return Err(crate::input_err!(
            "{prefix}: compressed-tensors tensors are written by compressed_tensors::linear_entries"
        ));
    }
    let Some(version) = format.version() else {
        return Ok(vec![TensorEntry::new(
            format!("{prefix}.weight"),
            dtype,
            vec![q.d_out, q.d_in],
            f32_to_bytes(dtype, &dequantize_packed(q)),
        )]);
    };
    let p =
        PackedTensors::from_packed(q, version).map_err(|m| crate::input_err!("{prefix}: {m}"))?;
    let kw = p.qweight.len() / p.d_out;
    let zw = p.qzeros.len() / p.n_groups;
    Ok(vec![
        TensorEntry::new(
            format!("{prefix}.qweight"),
            Dtype::I32,
            vec![kw, p.d_out],
            i32_bytes(p.qweight.iter().copied()),
        ),
        TensorEntry::new(
            format!("{prefix}.qzeros"),
            Dtype::I32,
            vec![p.n_groups, zw],
            i32_bytes(p.qzeros.iter().copied()),
        ),
        TensorEntry::new(
            format!("{prefix}.scales"),
            Dtype::F16,
            vec![p.n_groups, p.d_out],
            p.scales
                .iter()
                .flat_map(|s| s.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        TensorEntry::new(
            format!("{prefix}.g_idx"),
            Dtype::I32,
            vec![p.d_in],
            i32_bytes(p.g_idx.iter().copied()),
        ),
    ])
}

/// The `quantization_config` block of config.json, also written as quantize_config.json: the fields
/// transformers' `GPTQConfig` and GPTQModel's `QuantizeConfig` read (GPTQModel 7.7 writes the same names:
/// `method`/`quant_method`, `format`/`checkpoint_format`, `pack_dtype`, `lm_head`, `meta`). `meta.quantizer`
/// names the producer as GPTQModel's "name:version" list does; it is ours, never another tool's (GPTQModel
/// trusts its own name for asymmetric v1, which we never write). `dynamic` (GPTQModel's per-module
/// overrides, see `dynamic_bits`) is written when given.
#[allow(clippy::too_many_arguments)]
pub fn quantization_config(
    format: OutFormat,
    bits: u32,
    group_size: Option<usize>,
    desc_act: bool,
    sym: bool,
    damp: f64,
    static_groups: bool,
    method: &str,
    dynamic: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut v = serde_json::json!({
        "quant_method": "gptq",
        "method": "gptq",
        "bits": bits,
        "group_size": group_size.map(|g| g as i64).unwrap_or(-1),
        "desc_act": desc_act,
        "sym": sym,
        // lm_head (and the embeddings) are written unquantized.
        "lm_head": false,
        "damp_percent": damp,
        "static_groups": static_groups,
        // A block's statistics come from one forward of the unquantized block (not linear by linear).
        "true_sequential": false,
        "format": format.name(),
        "checkpoint_format": format.name(),
        // qweight/qzeros are int32 words (design.md §9).
        "pack_dtype": "int32",
        "meta": {
            "quantizer": [format!("{}:{}", env!("CARGO_PKG_NAME"), env!("CARGO_PKG_VERSION"))],
            // BoA's output is GPTQ's format; which algorithm chose the codes is ours to record.
            "boa_cuda_method": method,
            "damp_percent": damp,
            "static_groups": static_groups,
            "true_sequential": false,
        },
    });
    if let Some(d) = dynamic {
        v["dynamic"] = d;
    }
    v
}

/// GPTQModel's `dynamic`: first a "-:" rule per prefix in `skips` (the blocks left unquantized, e.g.
/// `model\.layers\.5\.`: GPTQModel builds plain Linears for them and reads their `.weight`; without the rule
/// it looks for their qweight and refuses the folder), then one "+:" rule per (pattern, width) stored at
/// another width than `bits`, the pattern (a regex: an escaped module name, or one with `\d+` for the expert
/// index) anchored at both ends, so no rule reaches another module. GPTQModel takes the first rule that
/// matches; no module matches both kinds, so their order (serde_json sorts the keys) changes nothing. None
/// when there is no rule.
pub fn dynamic_bits(
    bits: u32,
    patterns: impl IntoIterator<Item = (String, u32)>,
    skips: impl IntoIterator<Item = String>,
) -> Option<serde_json::Value> {
    let mut rules: serde_json::Map<String, serde_json::Value> = skips
        .into_iter()
        .map(|prefix| (format!("-:^{prefix}"), serde_json::json!({})))
        .collect();
    rules.extend(
        patterns
            .into_iter()
            .filter(|&(_, b)| b != bits)
            .map(|(pattern, b)| (format!("+:^{pattern}$"), serde_json::json!({ "bits": b }))),
    );
    (!rules.is_empty()).then_some(serde_json::Value::Object(rules))
}
