//! A minimal GGUF v3 writer for the tests (independent of the reader it checks): key-values and tensors in
//! ggml's order (dims fastest first). Included by the GGUF tests with `#[path]`.
#![allow(dead_code)] // each test uses the kinds of value it needs

pub enum Kv {
    Str(String),
    U32(u32),
    F32(f32),
    Bool(bool),
    StrArr(Vec<String>),
    I32Arr(Vec<i32>),
}

pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>, // ggml order, fastest first
    pub ty: u32,
    pub data: Vec<u8>,
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// GGUF v3 bytes: the key-values, then each tensor's info, then the data (32-byte aligned).
pub fn gguf_bytes(kvs: &[(&str, Kv)], tensors: &[Tensor]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        put_str(&mut b, k);
        match v {
            Kv::Str(s) => {
                b.extend(8u32.to_le_bytes());
                put_str(&mut b, s);
            }
            Kv::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(*x as u8);
            }
            Kv::StrArr(a) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for s in a {
                    put_str(&mut b, s);
                }
            }
            Kv::I32Arr(a) => {
                b.extend(9u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    b.extend(x.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut b, &t.name);
        b.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset = (offset + t.data.len() as u64).next_multiple_of(32);
    }
    // Padding before each tensor (not after the last), so the file ends where the last tensor does.
    for t in tensors {
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend(&t.data);
    }
    b
}
