//! `import_gguf`: a llama- or gemma3-architecture GGUF → a Hugging Face folder (config.json,
//! model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).
//!
//! GGUF dims are fastest-first, so a GGUF [576, 1536] tensor is the row-major HF [1536, 576] matrix and its
//! bytes are already in HF order: only the shape is reversed. What convert_hf_to_gguf.py changed per
//! architecture (llama's Q/K row permutation, Gemma's norm weights + 1) is in `arch`; the permutation is
//! `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)`, which `unpermute_qk` inverts (with
//! head_count for Q and head_count_kv for K).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use rayon::prelude::*;
use serde_json::json;

use super::arch::{
    Arch, Fixup, SpecialIds, config_json, expected_shape, hf_names, hparams, llama3_rope_scaling,
    required_names,
};
use super::dequant::{check_dequantizable, dequantize};
use super::reader::{GgufFile, TensorInfo};
use super::tokenizer::build_tokenizer;
use crate::error::file_err;
use crate::export::safetensors_out::{Dtype, TensorEntry, temp_path, write_safetensors};

/// dtype of the written weights. F32 is the default because dequantized Q4_1 values (d·q + m with f16 d, m)
/// are not exactly representable in 16 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutDType {
    #[default]
    F32,
    F16,
    BF16,
}

impl OutDType {
    fn safetensors(self) -> Dtype {
        match self {
            OutDType::F32 => Dtype::F32,
            OutDType::F16 => Dtype::F16,
            OutDType::BF16 => Dtype::BF16,
        }
    }

    /// config.json's torch_dtype.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutDType::F32 => "float32",
            OutDType::F16 => "float16",
            OutDType::BF16 => "bfloat16",
        }
    }

    fn encode(self, x: &[f32]) -> Vec<u8> {
        crate::export::hf_folder::f32_to_bytes(self.safetensors(), x)
    }
}

/// What an import did, for the CLI to print.
#[derive(Debug, Clone)]
pub struct ImportSummary {
    pub out_dir: PathBuf,
    pub n_tensors: usize,
    pub n_layers: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub out_dtype: OutDType,
    /// ggml type name → number of tensors stored in it.
    pub source_types: BTreeMap<String, usize>,
    pub bytes_written: u64,
    pub seconds: f64,
    /// Non-fatal problems (also printed to stderr as they are found).
    pub warnings: Vec<String>,
}

/// The checks `unpermute_qk` makes on a matrix of `len` values.
fn check_unpermute(len: usize, rows: usize, cols: usize, n_head: usize) -> Result<()> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) || rows.checked_mul(cols) != Some(len) {
        return Err(crate::input_err!(
            "cannot un-permute a [{rows}, {cols}] matrix ({len} values) with {n_head} heads: rows must be a multiple of 2·heads"
        ));
    }
    Ok(())
}

/// Invert llama.cpp's Q/K permutation of a row-major [rows, cols] matrix with `n_head` heads.
///
/// convert_hf_to_gguf: gguf = hf.reshape(n_head, 2, half, cols).swapaxes(1, 2), half = rows/n_head/2, i.e.
/// GGUF row (h, i, s) holds HF row (h, s, i). So HF row h·hd + s·half + i comes from GGUF row h·hd + 2i + s.
pub fn unpermute_qk(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Result<Vec<f32>> {
    check_unpermute(w.len(), rows, cols, n_head)?;
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0f32; w.len()];
    out.par_chunks_mut(cols).enumerate().for_each(|(r, dst)| {
        let (h, j) = (r / hd, r % hd);
        let (s, i) = (j / half, j % half);
        let src = h * hd + 2 * i + s;
        dst.copy_from_slice(&w[src * cols..(src + 1) * cols]);
    });
    Ok(out)
}

/// Write `bytes` to `dir/name` through a temporary file and a rename.
fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    let tmp = temp_path(&path);
    let r = std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .with_context(|| format!("writing {}", path.display()));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn json_bytes(v: &serde_json::Value) -> Vec<u8> {
    let mut s = serde_json::to_string_pretty(v).expect("serde_json::Value always serializes");
    s.push('\n');
    s.into_bytes()
}

/// Convert the llama- or gemma3-architecture GGUF `gguf` into a new Hugging Face folder `out_dir` (refused
/// if it exists). Weights are dequantized to f32 and written as `dtype`. Fails, leaving nothing at `out_dir`,
/// on any other architecture, on tensor types `dequant` does not handle, and on unknown or missing tensors.
pub fn import_gguf(gguf: &Path, out_dir: &Path, dtype: OutDType) -> Result<ImportSummary> {
    import_gguf_to(gguf, out_dir, dtype, false)
}

/// `import_gguf`; with `force`, an existing folder at `out_dir` (never a file, never one holding the GGUF)
/// is replaced once the new one is complete. The folder is written as `.NAME.partial` beside it, under the
/// output lock, and renamed into place.
pub fn import_gguf_to(
    gguf: &Path,
    out_dir: &Path,
    dtype: OutDType,
    force: bool,
) -> Result<ImportSummary> {
    use crate::export::hf_folder::{partial_path, publish_dir};
    use crate::export::out_guard::{Input, check_out};
    let input = [Input {
        path: gguf,
        what: "the input GGUF",
    }];
    check_out(out_dir, force, &input)?;
    let _lock = crate::export::out_lock::OutLock::acquire(out_dir)?;
    let tmp = partial_path(out_dir);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| file_err(&tmp, format!("cannot remove: {e}")))?;
    }
    let r = import_into(gguf, &tmp, dtype).and_then(|mut s| {
        publish_dir(&tmp, out_dir)?;
        s.out_dir = out_dir.to_path_buf();
        Ok(s)
    });
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    r
}

/// The row-major shape of the HF tensor `fix` makes of GGUF tensor `t`: one expert's matrix of a stacked
/// [n_expert × d_out × d_in], a [1 × d] row of a vector, else the tensor's own.
fn hf_shape(t: &TensorInfo, fix: Fixup) -> Vec<usize> {
    let shape = t.shape_row_major();
    match fix {
        Fixup::Expert(_) => shape.get(1..).map(<[usize]>::to_vec).unwrap_or_default(),
        Fixup::Row => [&[1][..], &shape].concat(),
        _ => shape,
    }
}

/// The import proper, into the fresh folder `out_dir`.
fn import_into(gguf: &Path, out_dir: &Path, dtype: OutDType) -> Result<ImportSummary> {
    let t0 = Instant::now();
    let g = GgufFile::open(gguf)?;
    let arch = Arch::of(&g)?;
    let h = hparams(&g, arch)?;
    let tok = build_tokenizer(&g, arch, h.ctx)?;
    let mut warnings = tok.warnings.clone();

    // Map every tensor before dequantizing anything, so naming errors come first and cheaply.
    let mut plan: Vec<(&TensorInfo, String, Fixup)> = Vec::with_capacity(g.tensors.len());
    // Llama 3.1's rope scaling is a tensor in GGUF and a config entry in HF.
    let mut rope_scaling = None;
    for t in &g.tensors {
        if t.name == "rope_freqs.weight" {
            let n = t.n_elements as usize;
            let bad = |m: String| file_err(gguf, format!("tensor rope_freqs.weight: {m}"));
            if arch != Arch::Llama || h.gemma.is_some() {
                return Err(bad(format!(
                    "the {} architecture has no rope_freqs",
                    arch.key()
                )));
            }
            check_dequantizable(&t.name, t.ggml_type, t.n_bytes as usize, n)?;
            let f = dequantize(&t.name, t.ggml_type, g.tensor_data(t), n)?;
            rope_scaling = Some(llama3_rope_scaling(&f, h.theta, h.head_dim).map_err(bad)?);
            continue;
        }
        let names = hf_names(&t.name, &h).ok_or_else(|| {
            file_err(
                gguf,
                format!(
                    "tensor {} has no Hugging Face {} counterpart known to this importer",
                    t.name,
                    arch.key()
                ),
            )
        })?;
        plan.extend(names.into_iter().map(|(hf, fix)| (t, hf, fix)));
    }
    let embed = g
        .tensor("token_embd.weight")
        .ok_or_else(|| file_err(gguf, "tensor token_embd.weight is missing"))?;
    let vocab = embed.shape_row_major().first().copied().unwrap_or(0);
    let tie = g.tensor("output.weight").is_none();
    let have: HashMap<&str, &TensorInfo> =
        plan.iter().map(|(t, hf, _)| (hf.as_str(), *t)).collect();
    for r in &required_names(&h) {
        if !have.contains_key(r.as_str()) {
            return Err(file_err(
                gguf,
                format!(
                    "no GGUF tensor maps to {r} ({}.block_count = {})",
                    arch.key(),
                    h.n_layer
                ),
            ));
        }
    }
    for (t, hf, fix) in &plan {
        let stacked = t.shape_row_major();
        let n_expert = h.moe.as_ref().map_or(0, |m| m.n_expert);
        if matches!(fix, Fixup::Expert(_)) && (stacked.len() != 3 || stacked[0] != n_expert) {
            return Err(file_err(
                gguf,
                format!(
                    "tensor {} has GGUF dims {:?}: not {n_expert} stacked experts ({}.expert_count)",
                    t.name,
                    t.dims,
                    arch.key()
                ),
            ));
        }
        let want = expected_shape(hf, &h, vocab);
        if hf_shape(t, *fix) != want {
            return Err(file_err(
                gguf,
                format!(
                    "tensor {} has GGUF dims {:?} (HF shape {:?}) but the hyper-parameters imply HF shape {want:?}",
                    t.name,
                    t.dims,
                    t.shape_row_major()
                ),
            ));
        }
    }
    if vocab != tok.vocab_size {
        warnings.push(format!(
            "token_embd has {vocab} rows but the tokenizer has {} tokens; config.json uses {vocab}",
            tok.vocab_size
        ));
    }
    for w in &warnings {
        eprintln!("warning: {w}");
    }

    // Everything that can fail is checked here; the lazy closures below then run while the file is written,
    // so only one dequantized tensor is in memory at a time (rayon parallelizes within each tensor).
    let entries: Vec<TensorEntry<'_>> = plan
        .iter()
        .map(|(t, hf, fix)| -> Result<TensorEntry<'_>> {
            let shape = hf_shape(t, *fix);
            check_dequantizable(
                &t.name,
                t.ggml_type,
                t.n_bytes as usize,
                t.n_elements as usize,
            )?;
            let n: usize = shape.iter().product();
            if let Fixup::Unpermute(n_head) = *fix {
                check_unpermute(n, shape[0], shape[1], n_head)
                    .with_context(|| format!("tensor {}", t.name))?;
            }
            let (g, t, fix, rows, cols) =
                (&g, *t, *fix, shape[0], shape.get(1).copied().unwrap_or(1));
            // An expert's rows are whole blocks, so its bytes are its own slice of the stacked tensor.
            let data = match fix {
                Fixup::Expert(e) => {
                    let per = t.n_bytes as usize / (t.n_elements as usize / n);
                    &g.tensor_data(t)[e * per..(e + 1) * per]
                }
                _ => g.tensor_data(t),
            };
            TensorEntry::lazy(hf.clone(), dtype.safetensors(), shape, move || {
                let w = dequantize(&t.name, t.ggml_type, data, n).expect("checked above");
                let w = match fix {
                    Fixup::Unpermute(n_head) => {
                        unpermute_qk(&w, rows, cols, n_head).expect("checked above")
                    }
                    Fixup::MinusOne => w.into_iter().map(|v| v - 1.0).collect(),
                    Fixup::None | Fixup::Expert(_) | Fixup::Row => w,
                };
                dtype.encode(&w)
            })
        })
        .collect::<Result<_>>()?;
    let mut source_types = BTreeMap::new();
    for t in &g.tensors {
        *source_types.entry(t.ggml_type.to_string()).or_insert(0) += 1;
    }

    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    write_safetensors(&out_dir.join("model.safetensors"), &entries, meta)?;
    let bytes_written: u64 = entries.iter().map(|e| e.len() as u64).sum();
    drop(entries);

    let ids = SpecialIds {
        bos: tok.bos_id,
        eos: tok.eos_id,
        pad: tok.pad_id,
    };
    let mut config = config_json(&h, vocab, tie, &ids, dtype.torch_name());
    if let Some(r) = rope_scaling {
        config["rope_scaling"] = r;
    }
    write_atomic(out_dir, "config.json", &json_bytes(&config))?;
    let tk_json = tok
        .tokenizer
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("serializing tokenizer.json: {e}"))?;
    write_atomic(out_dir, "tokenizer.json", tk_json.as_bytes())?;
    write_atomic(out_dir, "tokenizer_config.json", &json_bytes(&tok.config))?;
    let gen_config = json!({
        "_from_model_config": true,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
    });
    write_atomic(out_dir, "generation_config.json", &json_bytes(&gen_config))?;

    Ok(ImportSummary {
        out_dir: out_dir.to_path_buf(),
        n_tensors: g.tensors.len(),
        n_layers: h.n_layer,
        vocab_size: vocab,
        tie_word_embeddings: tie,
        out_dtype: dtype,
        source_types,
        bytes_written,
        seconds: t0.elapsed().as_secs_f64(),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_small() {
        // 1 head, hd = 4, cols = 1: HF rows [0,1,2,3] → llama.cpp order [0,2,1,3].
        let gguf = [0.0, 2.0, 1.0, 3.0];
        assert_eq!(
            unpermute_qk(&gguf, 4, 1, 1).unwrap(),
            vec![0.0, 1.0, 2.0, 3.0]
        );
    }
}
