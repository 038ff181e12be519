//! Memory-mapped safetensors weights: one `model.safetensors` or shards listed in
//! `model.safetensors.index.json`. Headers are validated at open (offsets inside the file, no overlaps);
//! tensors are converted to f32 only when asked for, one at a time.

use crate::error::file_err;
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Where one tensor lives: shard index, dtype, shape and byte range inside that shard's mmap.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

pub struct WeightStore {
    shards: Vec<(PathBuf, Mmap)>,
    entries: BTreeMap<String, TensorEntry>,
}

impl WeightStore {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> anyhow::Result<WeightStore> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            shard_files(&index)?
        } else {
            return Err(file_err(
                dir,
                "no model.safetensors or model.safetensors.index.json",
            ));
        };
        let mut store = WeightStore {
            shards: Vec::new(),
            entries: BTreeMap::new(),
        };
        for path in files {
            store.add_shard(path)?;
        }
        Ok(store)
    }

    fn add_shard(&mut self, path: PathBuf) -> anyhow::Result<()> {
        let file = File::open(&path).map_err(|e| file_err(&path, format!("cannot open: {e}")))?;
        // SAFETY: the file is opened read-only and treated as immutable for the life of the store; a user
        // rewriting a checkpoint while it is being read is outside what we can defend against.
        let mmap = unsafe { Mmap::map(&file) }
            .map_err(|e| file_err(&path, format!("cannot mmap: {e}")))?;
        {
            let (n, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| {
                file_err(
                    &path,
                    format!("not a valid safetensors file (truncated or corrupt?): {e}"),
                )
            })?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                if self.entries.contains_key(&name) {
                    return Err(file_err(
                        &path,
                        format!("tensor {name} appears in two shards"),
                    ));
                }
                let (s, e) = info.data_offsets;
                self.entries.insert(
                    name,
                    TensorEntry {
                        shard: self.shards.len(),
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        start: base + s,
                        end: base + e,
                    },
                );
            }
        }
        self.shards.push((path, mmap));
        Ok(())
    }

    /// Each shard file with its memory-mapped bytes, in open order.
    pub fn shard_files(&self) -> impl Iterator<Item = (&Path, &[u8])> {
        self.shards.iter().map(|(p, m)| (p.as_path(), &m[..]))
    }

    /// Sum of the tensors' stored sizes, bytes.
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .values()
            .map(|e| (e.end - e.start) as u64)
            .sum()
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.entries.keys()
    }

    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.entries.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Raw bytes of a tensor, as stored.
    pub fn bytes(&self, name: &str) -> anyhow::Result<&[u8]> {
        let e = self.get(name)?;
        Ok(&self.shards[e.shard].1[e.start..e.end])
    }

    fn get(&self, name: &str) -> anyhow::Result<&TensorEntry> {
        self.entries.get(name).ok_or_else(|| {
            let shard = self.shards.first().map(|s| s.0.clone()).unwrap_or_default();
            file_err(shard, format!("tensor {name} is missing"))
        })
    }

    /// The tensor converted to f32, after checking that its shape is `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> anyhow::Result<Vec<f32>> {
        let e = self.get(name)?;
        if e.shape != shape {
            return Err(file_err(
                &self.shards[e.shard].0,
                format!("tensor {name} has shape {:?}, expected {shape:?}", e.shape),
            ));
        }
        to_f32(e.dtype, &self.shards[e.shard].1[e.start..e.end])
            .map_err(|msg| file_err(&self.shards[e.shard].0, format!("tensor {name}: {msg}")))
    }

    /// Dtype of the first floating-point weight, used as the output dtype of exports.
    pub fn main_dtype(&self) -> Dtype {
        self.entries
            .values()
            .map(|e| e.dtype)
            .find(|d| matches!(d, Dtype::BF16 | Dtype::F16))
            .unwrap_or(Dtype::F32)
    }
}

fn shard_files(index: &Path) -> anyhow::Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: HashMap<String, String>,
    }
    let text =
        std::fs::read_to_string(index).map_err(|e| file_err(index, format!("cannot read: {e}")))?;
    let idx: Index =
        serde_json::from_str(&text).map_err(|e| file_err(index, format!("invalid index: {e}")))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files: Vec<String> = idx.weight_map.into_values().collect();
    files.sort();
    files.dedup();
    files
        .into_iter()
        .map(|f| {
            if f.contains('/') || f.contains("..") {
                return Err(file_err(
                    index,
                    format!("shard name {f:?} must be a plain file name"),
                ));
            }
            let p = dir.join(&f);
            if p.is_file() {
                Ok(p)
            } else {
                Err(file_err(index, format!("shard {f} is missing")))
            }
        })
        .collect()
}

/// Decodes little-endian f32/f16/bf16 bytes.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, String> {
    match dtype {
        Dtype::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        Dtype::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        Dtype::BF16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        other => Err(format!(
            "dtype {other:?} is not a floating-point weight type (expected F32, F16 or BF16)"
        )),
    }
}

/// What one pass over a floating-point tensor's bytes found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorScan {
    /// The first NaN or ±Inf: (element index, value).
    pub non_finite: Option<(usize, f32)>,
    /// max |w| over the finite values.
    pub max_abs: f32,
}

/// Elements per parallel chunk: 4 MiB of f32, large enough that rayon's overhead vanishes.
const SCAN_CHUNK: usize = 1 << 20;

impl WeightStore {
    /// Scans tensor `name` for NaN/Inf and its largest magnitude, in parallel chunks straight from the mmap
    /// (nothing is converted or copied: the test is on the bit patterns, exponent all ones). None for a
    /// tensor that is not F32, F16 or BF16.
    pub fn scan(&self, name: &str) -> anyhow::Result<Option<TensorScan>> {
        use rayon::prelude::*;
        let e = self.get(name)?;
        let bytes = &self.shards[e.shard].1[e.start..e.end];
        // (element size, exponent mask, sign-cleared mask, decode)
        let (size, exp, abs, decode): (usize, u32, u32, fn(u32) -> f32) = match e.dtype {
            Dtype::F32 => (4, 0x7f80_0000, 0x7fff_ffff, f32::from_bits),
            Dtype::F16 => (2, 0x7c00, 0x7fff, |b| f16::from_bits(b as u16).to_f32()),
            Dtype::BF16 => (2, 0x7f80, 0x7fff, |b| bf16::from_bits(b as u16).to_f32()),
            _ => return Ok(None),
        };
        let per_chunk: Vec<(Option<(usize, u32)>, u32)> = bytes
            .par_chunks(SCAN_CHUNK * size)
            .enumerate()
            .map(|(c, chunk)| {
                let mut first = None;
                let mut max = 0u32;
                for (i, v) in chunk.chunks_exact(size).enumerate() {
                    let b = if size == 4 {
                        u32::from_le_bytes([v[0], v[1], v[2], v[3]])
                    } else {
                        u16::from_le_bytes([v[0], v[1]]) as u32
                    };
                    if b & exp == exp {
                        first.get_or_insert((c * SCAN_CHUNK + i, b));
                    } else {
                        // Finite magnitudes order like their sign-cleared bit patterns.
                        max = max.max(b & abs);
                    }
                }
                (first, max)
            })
            .collect();
        let non_finite = per_chunk
            .iter()
            .find_map(|(f, _)| *f)
            .map(|(i, b)| (i, decode(b)));
        let max_abs = decode(per_chunk.iter().map(|(_, m)| *m).max().unwrap_or(0));
        Ok(Some(TensorScan {
            non_finite,
            max_abs,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One tensor of each float dtype through a real file: NaN, ±Inf and the largest magnitude found at
    /// the right index, across a chunk boundary.
    #[test]
    fn scan_finds_non_finite_values_and_the_max_in_every_dtype() {
        let dir = std::env::temp_dir().join(format!("boa-scan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = SCAN_CHUNK + 10;
        let mut v: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        v[SCAN_CHUNK + 3] = -1000.0;
        let enc = |d: Dtype, x: &[f32]| -> Vec<u8> {
            match d {
                Dtype::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                Dtype::F16 => x
                    .iter()
                    .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => x
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            }
        };
        for (d, bad) in [
            (Dtype::F32, f32::NAN),
            (Dtype::F16, f32::INFINITY),
            (Dtype::BF16, f32::NEG_INFINITY),
        ] {
            let mut w = v.clone();
            w[SCAN_CHUNK + 5] = bad;
            w[SCAN_CHUNK + 8] = f32::NAN;
            let clean = enc(d, &v);
            let dirty = enc(d, &w);
            let views = vec![
                (
                    "clean",
                    safetensors::tensor::TensorView::new(d, vec![n], &clean).unwrap(),
                ),
                (
                    "dirty",
                    safetensors::tensor::TensorView::new(d, vec![n], &dirty).unwrap(),
                ),
            ];
            safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
            let s = WeightStore::open(&dir).unwrap();
            let c = s.scan("clean").unwrap().unwrap();
            assert_eq!((c.non_finite, c.max_abs), (None, 1000.0), "{d:?}");
            let x = s.scan("dirty").unwrap().unwrap();
            let (i, val) = x.non_finite.unwrap();
            assert_eq!(i, SCAN_CHUNK + 5, "{d:?}");
            assert!(val.is_infinite() == bad.is_infinite() && val.is_nan() == bad.is_nan());
            assert_eq!(x.max_abs, 1000.0, "{d:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
