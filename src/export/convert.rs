//! A finished block's shard rewritten in another `--format`, so `run --resume` can change the format of a
//! run that failed (the format only shapes the export: the activations, reports and codes are the same).
//! Every linear goes through `linear_entries`, the function a fresh run writes with, so a converted shard
//! has the bytes of one written in the new format from the start:
//!   gptq ↔ gptq_v2   the zero points are re-stored (zero − 1 or the true zero);
//!   packed → fake    Ŵ = f16(s)·(q − z), the values the packed checkpoint dequantizes to;
//!   fake → packed    impossible: a fake shard keeps only Ŵ, not the integer codes (the caller refuses).

use super::gptq_packed::{OutFormat, linear_entries};
use super::hf_folder::write_shard_file;
use super::safetensors_out::TensorEntry;
use crate::error::file_err;
use crate::ops::Packed;
use crate::quant::pack::{PackedTensors, pack_words};
use half::f16;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeSet;
use std::path::Path;

/// Whether the shard at `path` holds a packed linear (a `.qweight` tensor).
pub fn has_packed_linears(path: &Path) -> anyhow::Result<bool> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| {
        file_err(
            path,
            format!("a shard of the run to resume is damaged: {e}"),
        )
    })?;
    Ok(meta.tensors().keys().any(|n| n.ends_with(".qweight")))
}

/// Writes `src` (packed linears in format `from`) to `dst` with the linears in `to`; every other tensor as
/// it is. `bits` is the run's --wbits; `dtype` the model's (what fake weights are written in).
pub fn convert_shard(
    src: &Path,
    dst: &Path,
    from: OutFormat,
    to: OutFormat,
    bits: u32,
    dtype: Dtype,
) -> anyhow::Result<()> {
    let Some(version) = from.version() else {
        return Err(crate::input_err!(
            "{}: a --format fake shard cannot be converted (the integer codes are not stored)",
            src.display()
        ));
    };
    let damaged =
        |m: String| file_err(src, format!("a shard of the run to resume is damaged: {m}"));
    let bytes = std::fs::read(src).map_err(|e| file_err(src, format!("cannot read: {e}")))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| damaged(e.to_string()))?;
    let prefixes: BTreeSet<String> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".qweight").map(str::to_string))
        .collect();
    let of_packed = |n: &str| {
        ["qweight", "qzeros", "scales", "g_idx"].iter().any(|s| {
            n.strip_suffix(s)
                .and_then(|p| p.strip_suffix('.'))
                .is_some_and(|p| prefixes.contains(p))
        })
    };
    let mut entries: Vec<TensorEntry<'_>> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !of_packed(n))
        .map(|(n, v)| TensorEntry::new(n, v.dtype(), v.shape().to_vec(), v.data()))
        .collect();
    for prefix in &prefixes {
        let words = |suffix: &str| -> anyhow::Result<(Vec<usize>, Vec<u32>)> {
            let name = format!("{prefix}.{suffix}");
            let v = st
                .tensor(&name)
                .map_err(|e| damaged(format!("{name}: {e}")))?;
            if v.dtype() != Dtype::I32 {
                return Err(damaged(format!("{name} has dtype {:?}", v.dtype())));
            }
            let w = v
                .data()
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok((v.shape().to_vec(), w))
        };
        let (qw_shape, qweight) = words("qweight")?;
        let (_, qzeros) = words("qzeros")?;
        let (_, g_idx) = words("g_idx")?;
        let sname = format!("{prefix}.scales");
        let sv = st
            .tensor(&sname)
            .map_err(|e| damaged(format!("{sname}: {e}")))?;
        let (d_in, d_out) = (g_idx.len(), qw_shape.get(1).copied().unwrap_or(0));
        let n_groups = sv.shape().first().copied().unwrap_or(0);
        if sv.dtype() != Dtype::F16
            || sv.shape() != [n_groups, d_out]
            || qw_shape != [pack_words(d_in, bits), d_out]
            || qzeros.len() != n_groups * pack_words(d_out, bits)
            || n_groups == 0
        {
            return Err(damaged(format!(
                "{prefix}: the packed tensors do not fit a {bits}-bit [{d_out} × {d_in}] linear"
            )));
        }
        let scales: Vec<f16> = sv
            .data()
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect();
        let p = PackedTensors {
            d_out,
            d_in,
            bits,
            n_groups,
            qweight,
            qzeros,
            scales,
            g_idx,
        };
        let lin = p.into_linear(version);
        lin.validate()
            .map_err(|m| damaged(format!("{prefix}: {m}")))?;
        // The stored scales are f16 already, so `linear_entries` writes them back bit for bit.
        let q = Packed {
            d_out,
            d_in,
            bits,
            n_groups,
            qweight: lin.qweight,
            scales: lin.scales.iter().map(|&s| f16::from_f32(s)).collect(),
            zeros: lin.zeros.iter().map(|&z| z as u8).collect(),
            g_idx: lin.g_idx,
        };
        entries.extend(linear_entries(prefix, &q, to, dtype)?);
    }
    write_shard_file(dst, &entries)?;
    std::fs::File::open(dst)
        .and_then(|f| f.sync_all())
        .map_err(|e| file_err(dst, format!("cannot sync: {e}")))
}
