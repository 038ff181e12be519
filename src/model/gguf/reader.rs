//! GGUF container parser (versions 2 and 3, little-endian).
//!
//! Layout (ggml/docs/gguf.md):
//!
//! ```text
//! "GGUF" u32 version  u64 tensor_count  u64 kv_count
//! kv_count × { string key, u32 value_type, value }             string = u64 len + UTF-8 bytes
//! tensor_count × { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset }
//! padding to general.alignment (default 32)
//! tensor data; each offset is relative to the start of this section and a multiple of the alignment
//! ```
//!
//! Every length, count and offset read from the file is checked against the bytes that are actually left
//! before anything is allocated, so a hostile or truncated file gives an error naming what is wrong instead of
//! a panic or a huge allocation. Tensor dims are in ggml order (fastest-varying first): GGUF [576, 1536] is
//! the row-major [1536, 576] matrix.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::Result;
use memmap2::Mmap;

use crate::error::file_err;

/// Default of `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
const MAX_DIMS: u32 = 4;
/// Arrays of arrays are legal; deeper nesting than this is not something any writer produces.
const MAX_ARRAY_DEPTH: u32 = 4;
/// Largest metadata array accepted. Each element becomes a 32-byte `Value`, so without a cap a file of N
/// bytes of u8 array could ask for 32·N bytes; real vocabularies have at most a few hundred thousand entries.
const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Fixed header: magic, version, tensor_count, kv_count.
const HEADER_LEN: usize = 4 + 4 + 8 + 8;

/// A metadata value. Arrays keep their element type implicitly (all elements share one variant).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer type that holds a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            Value::U64(v) => i64::try_from(v).ok(),
            _ => self.as_u64().map(|v| v as i64),
        }
    }

    /// Floats, and integers (some writers store e.g. rope.freq_base as an integer).
    /// An f32 is widened through its shortest decimal form, so 1e-5f32 gives 1e-5 and not 9.99999974e-6.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => v.to_string().parse().ok(),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// GGUF's name of the value type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F32(_) => "float32",
            Value::F64(_) => "float64",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// ggml tensor types (ggml.h `enum ggml_type`). All are known to the reader so it can check sizes; only
/// some can be dequantized (see `dequant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

impl GgmlType {
    /// (type, ggml id, elements per block, bytes per block), from ggml.c `type_traits`.
    const TABLE: [(GgmlType, u32, u64, u64); 32] = [
        (GgmlType::F32, 0, 1, 4),
        (GgmlType::F16, 1, 1, 2),
        (GgmlType::Q4_0, 2, 32, 18),
        (GgmlType::Q4_1, 3, 32, 20),
        (GgmlType::Q5_0, 6, 32, 22),
        (GgmlType::Q5_1, 7, 32, 24),
        (GgmlType::Q8_0, 8, 32, 34),
        (GgmlType::Q8_1, 9, 32, 36),
        (GgmlType::Q2_K, 10, 256, 84),
        (GgmlType::Q3_K, 11, 256, 110),
        (GgmlType::Q4_K, 12, 256, 144),
        (GgmlType::Q5_K, 13, 256, 176),
        (GgmlType::Q6_K, 14, 256, 210),
        (GgmlType::Q8_K, 15, 256, 292),
        (GgmlType::IQ2_XXS, 16, 256, 66),
        (GgmlType::IQ2_XS, 17, 256, 74),
        (GgmlType::IQ3_XXS, 18, 256, 98),
        (GgmlType::IQ1_S, 19, 256, 50),
        (GgmlType::IQ4_NL, 20, 32, 18),
        (GgmlType::IQ3_S, 21, 256, 110),
        (GgmlType::IQ2_S, 22, 256, 82),
        (GgmlType::IQ4_XS, 23, 256, 136),
        (GgmlType::I8, 24, 1, 1),
        (GgmlType::I16, 25, 1, 2),
        (GgmlType::I32, 26, 1, 4),
        (GgmlType::I64, 27, 1, 8),
        (GgmlType::F64, 28, 1, 8),
        (GgmlType::IQ1_M, 29, 256, 56),
        (GgmlType::BF16, 30, 1, 2),
        (GgmlType::TQ1_0, 34, 256, 54),
        (GgmlType::TQ2_0, 35, 256, 66),
        (GgmlType::MXFP4, 39, 32, 17),
    ];

    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::TABLE.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    fn entry(self) -> &'static (GgmlType, u32, u64, u64) {
        // Every variant has exactly one row in TABLE (checked by a unit test).
        Self::TABLE
            .iter()
            .find(|e| e.0 == self)
            .expect("GgmlType missing from TABLE")
    }

    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// Elements per block.
    pub fn block_size(self) -> u64 {
        self.entry().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.entry().3
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// One tensor's description; its bytes are `GgufFile::tensor_data`.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: dims[0] varies fastest (the row length of a matrix).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Relative to the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Row-major (PyTorch / safetensors) shape: the ggml dims reversed.
    pub fn shape_row_major(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed, validated GGUF file over a read-only memory map.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// In file order.
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    meta_index: HashMap<String, usize>,
    data_start: usize,
    mmap: Mmap,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}

impl GgufFile {
    /// Map and parse `path`. The file must not be modified while the returned value is alive.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
        let len = file
            .metadata()
            .map_err(|e| file_err(path, format!("cannot stat: {e}")))?
            .len();
        if len < HEADER_LEN as u64 {
            return Err(file_err(
                path,
                format!(
                    "not a GGUF file: {len} bytes is shorter than the {HEADER_LEN}-byte header"
                ),
            ));
        }
        // SAFETY: the map is read-only and private to this value; like every mmap-based loader (llama.cpp,
        // safetensors) we rely on nobody truncating or rewriting the file while it is open.
        let mmap =
            unsafe { Mmap::map(&file) }.map_err(|e| file_err(path, format!("cannot mmap: {e}")))?;
        Self::parse(path, mmap)
    }

    fn parse(path: &Path, mmap: Mmap) -> Result<GgufFile> {
        let err = |msg: String| file_err(path, msg);
        let mut c = Cursor {
            buf: &mmap[..],
            pos: 0,
        };
        let magic = c.take(4, "magic").map_err(&err)?;
        if magic != b"GGUF" {
            return Err(err(format!(
                "not a GGUF file: magic is {:?}, expected \"GGUF\"",
                String::from_utf8_lossy(magic)
            )));
        }
        let version = c.u32("version").map_err(&err)?;
        if version != 2 && version != 3 {
            return Err(err(format!(
                "unsupported GGUF version {version} (supported: 2, 3; a big-endian file also reads as a huge version)"
            )));
        }
        let tensor_count = c.u64("tensor_count").map_err(&err)?;
        let kv_count = c.u64("kv_count").map_err(&err)?;
        // Smallest possible entries: kv = key len (8) + type (4) + a 1-byte value;
        // tensor = name len (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
        c.check_count(kv_count, 13, "metadata key-value pairs")
            .map_err(&err)?;
        c.check_count(tensor_count, 32, "tensor infos")
            .map_err(&err)?;

        let mut metadata = Vec::with_capacity(kv_count as usize);
        let mut meta_index = HashMap::with_capacity(kv_count as usize);
        for i in 0..kv_count {
            let key = c
                .string(&format!("key of metadata entry {i}"))
                .map_err(&err)?;
            let ty = c.u32(&format!("value type of {key}")).map_err(&err)?;
            let value = c.value(ty, &key, 0).map_err(&err)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(err(format!("metadata key {key} appears twice")));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => {
                let a = v.as_u64().ok_or_else(|| {
                    err(format!(
                        "general.alignment is a {}, expected an integer",
                        v.type_name()
                    ))
                })?;
                if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                    return Err(err(format!(
                        "general.alignment = {a} is not a power of two between 1 and 2^20"
                    )));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut names = HashMap::with_capacity(tensor_count as usize);
        for i in 0..tensor_count {
            let name = c.string(&format!("name of tensor {i}")).map_err(&err)?;
            let n_dims = c.u32(&format!("n_dims of tensor {name}")).map_err(&err)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(err(format!(
                    "tensor {name} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("dims of tensor {name}")).map_err(&err)?);
            }
            let type_id = c.u32(&format!("type of tensor {name}")).map_err(&err)?;
            let ggml_type = GgmlType::from_id(type_id)
                .ok_or_else(|| err(format!("tensor {name} has unknown ggml type id {type_id}")))?;
            let offset = c.u64(&format!("offset of tensor {name}")).map_err(&err)?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= isize::MAX as u64)
                .ok_or_else(|| {
                    err(format!(
                        "tensor {name}: shape {dims:?} has an element count that overflows"
                    ))
                })?;
            let block = ggml_type.block_size();
            if !dims[0].is_multiple_of(block) {
                return Err(err(format!(
                    "tensor {name}: row length {} is not a multiple of the {ggml_type} block size {block}",
                    dims[0]
                )));
            }
            // n_elements / block ≤ n_elements, and type_size ≤ 292, so only the product can overflow.
            let n_bytes = (n_elements / block)
                .checked_mul(ggml_type.type_size())
                .ok_or_else(|| {
                    err(format!(
                        "tensor {name}: byte size of shape {dims:?} overflows"
                    ))
                })?;
            if !offset.is_multiple_of(alignment) {
                return Err(err(format!(
                    "tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            if names.insert(name.clone(), i).is_some() {
                return Err(err(format!("tensor name {name} appears twice")));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let file_len = mmap.len() as u64;
        let data_start = (c.pos as u64).next_multiple_of(alignment);
        for t in &tensors {
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes))
                .filter(|&e| e <= file_len);
            if end.is_none() {
                return Err(err(format!(
                    "tensor {}: data at offset {} (+{} bytes of {} {:?}) runs past the end of the file \
                     ({file_len} bytes, data section starts at {data_start}); the file is truncated or corrupt",
                    t.name, t.offset, t.n_bytes, t.ggml_type, t.dims
                )));
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            alignment,
            meta_index,
            data_start: data_start.min(file_len) as usize,
            mmap,
        })
    }

    /// The raw bytes of one tensor (bounds were checked when parsing).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.data_start + t.offset as usize;
        &self.mmap[start..start + t.n_bytes as usize]
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn wrong_type(&self, key: &str, v: &Value, want: &str) -> anyhow::Error {
        file_err(
            &self.path,
            format!("metadata {key} is a {}, expected {want}", v.type_name()),
        )
    }

    fn missing(&self, key: &str) -> anyhow::Error {
        file_err(&self.path, format!("metadata key {key} is missing"))
    }

    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(key, v, "a non-negative integer"))
            })
            .transpose()
    }

    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .ok_or_else(|| self.wrong_type(key, v, "a number"))
            })
            .transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong_type(key, v, "a bool")))
            .transpose()
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| self.wrong_type(key, v, "a string"))
            })
            .transpose()
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&[Value]>> {
        self.get(key)
            .map(|v| {
                v.as_array()
                    .ok_or_else(|| self.wrong_type(key, v, "an array"))
            })
            .transpose()
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn require_f64(&self, key: &str) -> Result<f64> {
        self.get_f64(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn require_array(&self, key: &str) -> Result<&[Value]> {
        self.get_array(key)?.ok_or_else(|| self.missing(key))
    }
}

/// Bounds-checked little-endian reader. Errors are plain strings; `parse` attaches the path.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        if n > self.remaining() as u64 {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {} but the file has {} bytes",
                self.pos,
                self.buf.len()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self
            .take(N as u64, what)?
            .try_into()
            .expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Refuse a count whose smallest possible encoding is longer than what is left of the file.
    fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<(), String> {
        match count.checked_mul(min_size) {
            Some(n) if n <= self.remaining() as u64 => Ok(()),
            _ => Err(format!(
                "{count} {what} cannot fit in the {} bytes left after offset {} (absurd count or corrupt file)",
                self.remaining(),
                self.pos
            )),
        }
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| format!("{what} at offset {start} is not valid UTF-8"))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(key)?[0]),
            1 => Value::I8(self.array::<1>(key)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(key)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("metadata {key}: bool byte is {b}, expected 0 or 1")),
            },
            8 => Value::Str(self.string(&format!("string value of {key}"))?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "metadata {key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    ));
                }
                let elem_ty = self.u32(&format!("array element type of {key}"))?;
                let count = self.u64(&format!("array length of {key}"))?;
                let min_size = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(format!("metadata {key}: unknown array element type {t}")),
                };
                self.check_count(count, min_size, &format!("elements of array {key}"))?;
                if count > MAX_ARRAY_LEN {
                    return Err(format!(
                        "metadata {key}: array of {count} elements is larger than the {MAX_ARRAY_LEN} supported"
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(key)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(format!("metadata {key}: unknown value type {t}")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_table_is_consistent() {
        for (i, e) in GgmlType::TABLE.iter().enumerate() {
            assert_eq!(GgmlType::from_id(e.1), Some(e.0));
            assert_eq!(e.0.entry().1, e.1);
            assert!(
                GgmlType::TABLE[i + 1..]
                    .iter()
                    .all(|o| o.0 != e.0 && o.1 != e.1)
            );
        }
    }
}
