//! A streaming GGUF v3 writer: key-values, then every tensor's description, then the tensors' bytes, each at a
//! 32-byte aligned offset (ggml's `general.alignment` default). Tensors are produced one at a time by the
//! caller, so a 7B model's file is written without holding it in memory. The reader is `model::gguf::reader`;
//! what llama.cpp, transformers and the `gguf` package make of our files is checked in tests/gguf_export.rs.

use crate::error::file_err;
use crate::model::gguf::reader::GgmlType;
use std::io::Write;
use std::path::Path;

const ALIGNMENT: u64 = 32;

/// A metadata value (the GGUF value types our files use).
#[derive(Clone, Debug)]
pub enum Kv {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
    F32Arr(Vec<f32>),
}

/// One tensor's description; its bytes come from the caller's `fill`.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    pub name: String,
    /// ggml order: dims[0] varies fastest (a matrix [rows, cols] is [cols, rows]).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl GgufTensor {
    /// Bytes of the tensor's data; None when its row length is not a whole number of the type's blocks.
    pub fn n_bytes(&self) -> Option<u64> {
        let bs = self.ty.block_size();
        let row = *self.dims.first()?;
        if !row.is_multiple_of(bs) {
            return None;
        }
        let n: u64 = self.dims.iter().product();
        Some(n / bs * self.ty.type_size())
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// GGUF value type ids (gguf.md).
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STR: u32 = 8;
const T_ARR: u32 = 9;

fn put_kv(b: &mut Vec<u8>, key: &str, v: &Kv) {
    put_str(b, key);
    match v {
        Kv::U32(x) => {
            b.extend(T_U32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Kv::I32(x) => {
            b.extend(T_I32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Kv::F32(x) => {
            b.extend(T_F32.to_le_bytes());
            b.extend(x.to_le_bytes());
        }
        Kv::Bool(x) => {
            b.extend(T_BOOL.to_le_bytes());
            b.push(*x as u8);
        }
        Kv::Str(s) => {
            b.extend(T_STR.to_le_bytes());
            put_str(b, s);
        }
        Kv::StrArr(a) => {
            b.extend(T_ARR.to_le_bytes());
            b.extend(T_STR.to_le_bytes());
            b.extend((a.len() as u64).to_le_bytes());
            for s in a {
                put_str(b, s);
            }
        }
        Kv::I32Arr(a) => {
            b.extend(T_ARR.to_le_bytes());
            b.extend(T_I32.to_le_bytes());
            b.extend((a.len() as u64).to_le_bytes());
            for x in a {
                b.extend(x.to_le_bytes());
            }
        }
        Kv::F32Arr(a) => {
            b.extend(T_ARR.to_le_bytes());
            b.extend(T_F32.to_le_bytes());
            b.extend((a.len() as u64).to_le_bytes());
            for x in a {
                b.extend(x.to_le_bytes());
            }
        }
    }
}

/// Writes a GGUF file at `path` (through `path` + ".tmp" and a rename, so a failure leaves no file that
/// looks complete). `fill(i)` returns tensor i's bytes, in order; a wrong length is an error.
pub fn write_gguf(
    path: &Path,
    kvs: &[(String, Kv)],
    tensors: &[GgufTensor],
    mut fill: impl FnMut(usize) -> anyhow::Result<Vec<u8>>,
) -> anyhow::Result<u64> {
    let mut head = Vec::new();
    head.extend(b"GGUF");
    head.extend(3u32.to_le_bytes());
    head.extend((tensors.len() as u64).to_le_bytes());
    head.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_kv(&mut head, k, v);
    }
    let mut sizes = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for t in tensors {
        let n = t.n_bytes().ok_or_else(|| {
            anyhow::anyhow!(
                "GGUF tensor {}: row of {} values is not a whole number of {} blocks",
                t.name,
                t.dims.first().copied().unwrap_or(0),
                t.ty
            )
        })?;
        put_str(&mut head, &t.name);
        head.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            head.extend(d.to_le_bytes());
        }
        head.extend(t.ty.id().to_le_bytes());
        head.extend(offset.to_le_bytes());
        sizes.push(n);
        offset = (offset + n).next_multiple_of(ALIGNMENT);
    }
    let tmp = path.with_extension("gguf.tmp");
    let written = write_body(&tmp, &head, tensors, &sizes, &mut fill);
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    let pos = written?;
    std::fs::rename(&tmp, path).map_err(|e| file_err(path, format!("cannot write: {e}")))?;
    Ok(pos)
}

fn write_body(
    tmp: &Path,
    head: &[u8],
    tensors: &[GgufTensor],
    sizes: &[u64],
    fill: &mut impl FnMut(usize) -> anyhow::Result<Vec<u8>>,
) -> anyhow::Result<u64> {
    let io = |e: std::io::Error| file_err(tmp, format!("cannot write: {e}"));
    let file = std::fs::File::create(tmp).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    let mut pos = head.len() as u64;
    w.write_all(head).map_err(io)?;
    for (i, (t, &n)) in tensors.iter().zip(sizes).enumerate() {
        let pad = pos.next_multiple_of(ALIGNMENT) - pos;
        w.write_all(&[0u8; ALIGNMENT as usize][..pad as usize])
            .map_err(io)?;
        let bytes = fill(i)?;
        if bytes.len() as u64 != n {
            anyhow::bail!(
                "GGUF tensor {}: {} bytes produced, {n} expected for {:?} {}",
                t.name,
                bytes.len(),
                t.dims,
                t.ty
            );
        }
        w.write_all(&bytes).map_err(io)?;
        pos += pad + n;
    }
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(pos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::reader::GgufFile;

    #[test]
    fn our_reader_reads_what_the_writer_wrote() {
        let dir = std::env::temp_dir().join(format!("boa-gguf-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.gguf");
        let kvs = vec![
            ("general.architecture".to_string(), Kv::Str("llama".into())),
            ("a.u".to_string(), Kv::U32(7)),
            ("a.f".to_string(), Kv::F32(0.5)),
            ("a.t".to_string(), Kv::StrArr(vec!["x".into(), "yz".into()])),
        ];
        let tensors = vec![
            GgufTensor {
                name: "n".into(),
                dims: vec![3],
                ty: GgmlType::F32,
            },
            GgufTensor {
                name: "q".into(),
                dims: vec![32, 2],
                ty: GgmlType::Q8_0,
            },
        ];
        let data = [vec![1u8; 12], vec![2u8; 68]];
        write_gguf(&path, &kvs, &tensors, |i| Ok(data[i].clone())).unwrap();
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.get_u64("a.u").unwrap(), Some(7));
        assert_eq!(g.get_f64("a.f").unwrap(), Some(0.5));
        for (t, d) in tensors.iter().zip(&data) {
            let info = g.tensor(&t.name).unwrap();
            assert_eq!(info.dims, t.dims);
            assert_eq!(g.tensor_data(info), &d[..]);
        }
        // A row that is not whole blocks, and a wrong length, are errors and leave no file.
        let bad = [GgufTensor {
            name: "b".into(),
            dims: vec![16],
            ty: GgmlType::Q4_0,
        }];
        std::fs::remove_file(&path).unwrap();
        assert!(write_gguf(&path, &kvs, &bad, |_| Ok(vec![])).is_err());
        assert!(write_gguf(&path, &kvs, &tensors, |_| Ok(vec![0u8; 5])).is_err());
        assert!(!path.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
