//! Write a `model.safetensors` from (name, dtype, shape, bytes) entries.
//!
//! The file is written to a temporary name in the destination folder and renamed into place, so a failed or
//! interrupted export never leaves a half-written file under the final name (rename within one folder is
//! atomic on POSIX file systems). The file gets the permissions an ordinary new file would (umask), not the
//! 0600 of the tempfile safetensors writes through.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
pub use safetensors::Dtype;
use safetensors::View;

use crate::input_err;

/// Produces a tensor's bytes when the writer reaches it.
pub type LazyBytes<'a> = Box<dyn Fn() -> Vec<u8> + Send + Sync + 'a>;

/// A tensor's bytes: little-endian, row-major, shape product × dtype size long.
pub enum TensorBytes<'a> {
    Ready(Cow<'a, [u8]>),
    /// Computed while writing, so only one such tensor is in memory at a time (a 70B import does not need
    /// the whole dequantized model in RAM). `len` is checked against the shape up front; a closure that
    /// returns another length is a bug and panics.
    Lazy {
        len: usize,
        make: LazyBytes<'a>,
    },
}

/// One tensor to write.
pub struct TensorEntry<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: TensorBytes<'a>,
}

impl std::fmt::Debug for TensorEntry<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorEntry")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("len", &self.len())
            .finish()
    }
}

/// Bytes of `shape` in `dtype`, or None on overflow.
pub fn byte_len(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.bitsize(), |acc, &d| acc.checked_mul(d))
        .map(|bits| bits.div_ceil(8))
}

impl<'a> TensorEntry<'a> {
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: impl Into<Cow<'a, [u8]>>,
    ) -> Self {
        TensorEntry {
            name: name.into(),
            dtype,
            shape,
            bytes: TensorBytes::Ready(bytes.into()),
        }
    }

    /// A tensor whose bytes `make` computes at write time. Errors if the shape's byte length overflows.
    pub fn lazy(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<usize>,
        make: impl Fn() -> Vec<u8> + Send + Sync + 'a,
    ) -> Result<Self> {
        let name = name.into();
        let len = byte_len(dtype, &shape).ok_or_else(|| {
            input_err!("safetensors export: tensor {name} shape {shape:?} is too large")
        })?;
        Ok(TensorEntry {
            name,
            dtype,
            shape,
            bytes: TensorBytes::Lazy {
                len,
                make: Box::new(make),
            },
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &self.bytes {
            TensorBytes::Ready(b) => b.len(),
            TensorBytes::Lazy { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl View for &TensorEntry<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match &self.bytes {
            TensorBytes::Ready(b) => Cow::Borrowed(b),
            TensorBytes::Lazy { len, make } => {
                let b = make();
                assert_eq!(
                    b.len(),
                    *len,
                    "lazy tensor {} produced the wrong number of bytes",
                    self.name
                );
                Cow::Owned(b)
            }
        }
    }
    fn data_len(&self) -> usize {
        self.len()
    }
}

/// Write `entries` (+ the `__metadata__` map, e.g. {"format": "pt"}) to `path` via a temporary file.
/// Checks names are unique and every byte length matches its shape and dtype before writing anything.
pub fn write_safetensors(
    path: &Path,
    entries: &[TensorEntry<'_>],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let mut seen = std::collections::HashSet::with_capacity(entries.len());
    for e in entries {
        if !seen.insert(e.name.as_str()) {
            return Err(input_err!(
                "safetensors export: tensor {} appears twice",
                e.name
            ));
        }
        let want = byte_len(e.dtype, &e.shape);
        if want != Some(e.len()) {
            return Err(input_err!(
                "safetensors export: tensor {} has {} bytes, but shape {:?} of {:?} needs {want:?}",
                e.name,
                e.len(),
                e.shape,
                e.dtype
            ));
        }
    }
    let tmp = temp_path(path);
    // safetensors writes through a 0600 tempfile of its own; take the mode (umask) an ordinary new file gets.
    let perm = std::fs::File::create(&tmp)
        .and_then(|f| f.metadata())
        .map(|m| m.permissions())
        .with_context(|| format!("creating {}", tmp.display()))?;
    let result = safetensors::serialize_to_file(
        entries.iter().map(|e| (e.name.as_str(), e)),
        Some(metadata),
        &tmp,
    )
    .with_context(|| format!("writing {}", tmp.display()))
    .and_then(|()| {
        std::fs::set_permissions(&tmp, perm).with_context(|| format!("chmod {}", tmp.display()))
    })
    .and_then(|()| {
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `dir/.name.tmp-PID`: same folder (so the rename cannot cross file systems), hidden, unique per process.
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}
