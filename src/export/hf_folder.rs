//! The output folder of a run: written under a temporary sibling (`.NAME.partial`), one safetensors shard
//! per block as each block finishes, then published by one rename. A killed run never leaves a folder at
//! --out that looks complete.

use super::safetensors_out::{Dtype, TensorEntry, write_safetensors};
use crate::error::file_err;
use half::{bf16, f16};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Files of the input folder that a run rewrites, so they are not copied through: config.json and
/// quantize_config.json (rewritten with the quantization config), report.json (a fake-quant input's own).
fn is_rewritten(name: &str) -> bool {
    matches!(name, "config.json" | "quantize_config.json" | "report.json")
}

/// Weights in any format, at any depth (Llama 3 folders hold the original checkpoint under original/).
fn is_weights(name: &str) -> bool {
    [
        ".safetensors",
        ".safetensors.index.json",
        ".bin",
        ".bin.index.json",
        ".pt",
        ".pth",
        ".gguf",
        ".ckpt",
        ".h5",
        ".msgpack",
        ".onnx",
    ]
    .iter()
    .any(|ext| name.ends_with(ext))
}

const INDEX: &str = "model.safetensors.index.json";

pub struct OutFolder {
    pub out: PathBuf,
    pub tmp: PathBuf,
    n_shards: usize,
    weight_map: BTreeMap<String, String>,
    total_bytes: u64,
}

/// `.NAME.partial` next to `out`.
pub fn partial_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    out.with_file_name(format!(".{name}.partial"))
}

/// The file name of shard `i` of `n_shards` (one per block, then one for the embeddings and the head).
pub fn shard_name(i: usize, n_shards: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n_shards)
}

/// `.NAME.old` next to `out`: where `--force` moves the folder it replaces for a moment.
pub fn old_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    out.with_file_name(format!(".{name}.old"))
}

/// Renames the finished folder `tmp` to `out`. An existing `out` (`--force`, checked by `out_guard`) steps
/// aside only now, so a failed or killed run leaves it intact; a kill between the two renames leaves no
/// folder at `out` (the old one is at `.NAME.old`, removed by the next publish).
pub fn publish_dir(tmp: &Path, out: &Path) -> anyhow::Result<()> {
    if std::fs::symlink_metadata(out).is_err() {
        return std::fs::rename(tmp, out)
            .map_err(|e| file_err(out, format!("cannot publish: {e}")));
    }
    let old = old_path(out);
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| file_err(&old, format!("cannot remove: {e}")))?;
    }
    std::fs::rename(out, &old).map_err(|e| file_err(out, format!("cannot replace: {e}")))?;
    std::fs::rename(tmp, out).map_err(|e| file_err(out, format!("cannot publish: {e}")))?;
    std::fs::remove_dir_all(&old).map_err(|e| file_err(&old, format!("cannot remove: {e}")))
}

impl OutFolder {
    /// Refuses an existing `out` unless `force`; starts a fresh temporary folder (an old one is removed)
    /// unless `keep_partial`, when an existing one is kept for resuming. Returns the folder and whether a
    /// partial folder of an earlier run was found. Fails now, before any long work, when the folder cannot be
    /// created or written.
    pub fn prepare(
        out: &Path,
        force: bool,
        keep_partial: bool,
        n_shards: usize,
    ) -> anyhow::Result<(OutFolder, bool)> {
        if out.exists() && !force {
            return Err(file_err(
                out,
                "already exists; choose another --out or pass --force to replace it",
            ));
        }
        let tmp = partial_path(out);
        let existed = tmp.exists();
        if existed && !keep_partial {
            std::fs::remove_dir_all(&tmp)
                .map_err(|e| file_err(&tmp, format!("cannot remove: {e}")))?;
        }
        std::fs::create_dir_all(&tmp)
            .map_err(|e| file_err(&tmp, format!("cannot create the output folder: {e}")))?;
        let probe = tmp.join(".write-test");
        std::fs::write(&probe, b"")
            .and_then(|()| std::fs::remove_file(&probe))
            .map_err(|e| file_err(&tmp, format!("cannot write in the output folder: {e}")))?;
        Ok((
            OutFolder {
                out: out.to_path_buf(),
                tmp,
                n_shards,
                weight_map: BTreeMap::new(),
                total_bytes: 0,
            },
            existed,
        ))
    }

    /// Counts shard `i`, written by an earlier (interrupted) run, into the index as if written now.
    pub fn adopt_shard(&mut self, i: usize) -> anyhow::Result<()> {
        let name = self.shard_name(i);
        let path = self.tmp.join(&name);
        // SAFETY: read-only map of a file only this run writes, and only after this map is dropped.
        let bytes = std::fs::File::open(&path)
            .and_then(|f| unsafe { memmap2::Mmap::map(&f) })
            .map_err(|e| {
                file_err(
                    &path,
                    format!("cannot read a shard of the run to resume: {e}"),
                )
            })?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| {
            file_err(
                &path,
                format!("a shard of the run to resume is damaged: {e}"),
            )
        })?;
        for (t, info) in meta.tensors() {
            self.total_bytes += (info.data_offsets.1 - info.data_offsets.0) as u64;
            self.weight_map.insert(t, name.clone());
        }
        Ok(())
    }

    pub fn shard_name(&self, i: usize) -> String {
        shard_name(i, self.n_shards)
    }

    pub fn write_shard(&mut self, i: usize, entries: &[TensorEntry<'_>]) -> anyhow::Result<()> {
        write_shard_file(&self.shard_path(i), entries)?;
        self.record_shard(i, &shard_contents(entries));
        Ok(())
    }

    /// Where shard i goes (for a writer on another thread: `write_shard_file`, then `record_shard`).
    pub fn shard_path(&self, i: usize) -> PathBuf {
        self.tmp.join(self.shard_name(i))
    }

    /// Books shard i's tensors (name, bytes) into the index once its file is written.
    pub fn record_shard(&mut self, i: usize, contents: &[(String, u64)]) {
        let name = self.shard_name(i);
        for (t, len) in contents {
            self.weight_map.insert(t.clone(), name.clone());
            self.total_bytes += len;
        }
    }

    pub fn write_json(&self, name: &str, value: &serde_json::Value) -> anyhow::Result<()> {
        let path = self.tmp.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(value)? + "\n")
            .map_err(|e| file_err(&path, format!("cannot write: {e}")))
    }

    /// Copies every other file of the input folder `src` (tokenizer, generation config, chat templates,
    /// README, licence, …; subfolders such as additional_chat_templates/ too), so the output serves as the
    /// input did. Hidden files (tool state) are left behind.
    pub fn copy_model_files(&self, src: &Path) -> anyhow::Result<()> {
        copy_tree(src, &self.tmp, true)
    }

    /// Writes the shard index (model.safetensors.index.json), so the shards open as one checkpoint.
    pub fn write_index(&self) -> anyhow::Result<()> {
        let index = serde_json::json!({
            "metadata": {"total_size": self.total_bytes},
            "weight_map": self.weight_map,
        });
        self.write_json(INDEX, &index)
    }

    /// Writes the shard index and renames the temporary folder to `out` (replacing it when forced).
    pub fn publish(self) -> anyhow::Result<PathBuf> {
        self.write_index()?;
        publish_dir(&self.tmp, &self.out)?;
        Ok(self.out)
    }

    /// Removes the shards and their index (their contents now live in another file of the folder, e.g.
    /// model.gguf), then renames the temporary folder to `out` as `publish` does.
    pub fn publish_without_shards(self) -> anyhow::Result<PathBuf> {
        for i in 0..self.n_shards {
            let p = self.shard_path(i);
            match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(file_err(&p, format!("cannot remove: {e}")));
                }
                _ => {}
            }
        }
        let index = self.tmp.join(INDEX);
        if index.exists() {
            std::fs::remove_file(&index)
                .map_err(|e| file_err(&index, format!("cannot remove: {e}")))?;
        }
        publish_dir(&self.tmp, &self.out)?;
        Ok(self.out)
    }
}

/// f32 values as little-endian bytes of `dtype` (F32, F16 or BF16), converted in parallel chunks.
pub fn f32_to_bytes(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    use rayon::prelude::*;
    let size = match dtype {
        Dtype::F32 => 4,
        Dtype::F16 | Dtype::BF16 => 2,
        other => panic!("f32_to_bytes: {other:?} is not a float dtype"),
    };
    let mut out = vec![0u8; v.len() * size];
    out.par_chunks_mut(size * 4096)
        .zip(v.par_chunks(4096))
        .for_each(|(o, x)| {
            for (o, &x) in o.chunks_exact_mut(size).zip(x) {
                match dtype {
                    Dtype::F16 => o.copy_from_slice(&f16::from_f32(x).to_le_bytes()),
                    Dtype::BF16 => o.copy_from_slice(&bf16::from_f32(x).to_le_bytes()),
                    _ => o.copy_from_slice(&x.to_le_bytes()),
                }
            }
        });
    out
}

/// Writes one shard file (the part of `OutFolder::write_shard` that needs no access to the folder's index).
pub fn write_shard_file(path: &Path, entries: &[TensorEntry<'_>]) -> anyhow::Result<()> {
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(path, entries, meta)
}

/// (name, bytes) of each tensor of a shard, for `OutFolder::record_shard`.
pub fn shard_contents(entries: &[TensorEntry<'_>]) -> Vec<(String, u64)> {
    entries
        .iter()
        .map(|e| (e.name.clone(), e.len() as u64))
        .collect()
}

/// The files of `src` into `dst`, weights skipped (the run writes its own), and at the `top` (the model
/// folder itself) the files the run rewrites. Links are followed: a Hugging Face cache folder links every file to a blob.
fn copy_tree(src: &Path, dst: &Path, top: bool) -> anyhow::Result<()> {
    let entries = std::fs::read_dir(src).map_err(|e| file_err(src, format!("cannot list: {e}")))?;
    for e in entries {
        let e = e.map_err(|e| file_err(src, format!("cannot list: {e}")))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        if name.starts_with('.') || is_weights(&name) || (top && is_rewritten(&name)) {
            continue;
        }
        let to = dst.join(&name);
        if path.is_dir() {
            std::fs::create_dir_all(&to)
                .map_err(|e| file_err(&to, format!("cannot create: {e}")))?;
            copy_tree(&path, &to, false)?;
        } else if path.is_file() {
            std::fs::copy(&path, &to).map_err(|e| file_err(&path, format!("cannot copy: {e}")))?;
        }
    }
    Ok(())
}
