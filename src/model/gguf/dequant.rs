//! ggml tensor types → f32 (CPU, rayon over chunks of blocks); the 256-value K-quants are in `kquant`.
//! Bit-exact with gguf-py's `gguf.quants.dequantize` (tests/gguf_kquant.rs).
//!
//! Block layouts of the 32-value types (ggml-common.h), all little-endian, `d`/`m` are f16, `qh` a u32:
//!
//! ```text
//! Q8_0  { d; i8 qs[32] }                      x[i] = qs[i]·d
//! Q4_0  { d; u8 qs[16] }                      x[i] = ((qs[i] & 15) − 8)·d,  x[i+16] = ((qs[i] >> 4) − 8)·d
//! Q4_1  { d; m; u8 qs[16] }                   x[i] = (qs[i] & 15)·d + m,    x[i+16] = (qs[i] >> 4)·d + m
//! Q5_0  { d; qh; u8 qs[16] }                  x[i] = (q[i] − 16)·d
//! Q5_1  { d; m; qh; u8 qs[16] }               x[i] = q[i]·d + m
//! ```
//!
//! i.e. the low nibbles are elements 0..15 of the block and the high nibbles elements 16..31; a 5-bit q[i]
//! is that nibble with bit i of `qh` as its fifth bit (q[i] = nibble | ((qh >> i) & 1) << 4).

use anyhow::Result;
use half::{bf16, f16};
use rayon::prelude::*;

use super::kquant;
use super::reader::GgmlType;
use crate::input_err;

/// Types `dequantize` handles.
pub const SUPPORTED: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Blocks per rayon task: 32K elements, enough work to amortise scheduling.
const BLOCKS_PER_TASK: usize = 1024;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn dequant_block_q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(q as i8) * d;
    }
}

fn dequant_block_q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = out.split_at_mut(16);
    for (i, &q) in b[2..18].iter().enumerate() {
        lo[i] = (i32::from(q & 15) - 8) as f32 * d;
        hi[i] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

fn dequant_block_q4_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let (lo, hi) = out.split_at_mut(16);
    for (i, &q) in b[4..20].iter().enumerate() {
        lo[i] = f32::from(q & 15) * d + m;
        hi[i] = f32::from(q >> 4) * d + m;
    }
}

/// The 32 five-bit values of a Q5_0/Q5_1 block: nibbles from `qs` (16 bytes), fifth bits from `qh`.
fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    std::array::from_fn(|i| ((qs[i % 16] >> (4 * (i / 16))) & 15) | ((((qh >> i) & 1) as u8) << 4))
}

fn dequant_block_q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, q) in out.iter_mut().zip(q5_values(&b[2..6], &b[6..22])) {
        *o = (i32::from(q) - 16) as f32 * d;
    }
}

fn dequant_block_q5_1(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (o, q) in out.iter_mut().zip(q5_values(&b[4..8], &b[8..24])) {
        *o = f32::from(q) * d + m;
    }
}

fn dequant_block_f32(b: &[u8], out: &mut [f32]) {
    out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn dequant_block_f16(b: &[u8], out: &mut [f32]) {
    out[0] = f16_at(b, 0);
}

fn dequant_block_bf16(b: &[u8], out: &mut [f32]) {
    out[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32();
}

/// Decodes one block (`type_size` bytes) into `block_size` values.
type BlockFn = fn(&[u8], &mut [f32]);

fn block_fn(ty: GgmlType) -> Option<BlockFn> {
    Some(match ty {
        GgmlType::F32 => dequant_block_f32,
        GgmlType::F16 => dequant_block_f16,
        GgmlType::BF16 => dequant_block_bf16,
        GgmlType::Q8_0 => dequant_block_q8_0,
        GgmlType::Q4_0 => dequant_block_q4_0,
        GgmlType::Q4_1 => dequant_block_q4_1,
        GgmlType::Q5_0 => dequant_block_q5_0,
        GgmlType::Q5_1 => dequant_block_q5_1,
        GgmlType::Q2_K => kquant::dequant_block_q2_k,
        GgmlType::Q3_K => kquant::dequant_block_q3_k,
        GgmlType::Q4_K => kquant::dequant_block_q4_k,
        GgmlType::Q5_K => kquant::dequant_block_q5_k,
        GgmlType::Q6_K => kquant::dequant_block_q6_k,
        _ => return None,
    })
}

/// The checks `dequantize` makes, without doing the work: the type is supported and `n_bytes` holds exactly
/// `n_elements` values. After `Ok`, `dequantize` on the same arguments cannot fail.
pub fn check_dequantizable(
    name: &str,
    ty: GgmlType,
    n_bytes: usize,
    n_elements: usize,
) -> Result<()> {
    if block_fn(ty).is_none() {
        return Err(input_err!(
            "tensor {name}: ggml type {ty} cannot be dequantized yet (supported: {})",
            SUPPORTED.map(|t| t.to_string()).join(", ")
        ));
    }
    let block = ty.block_size() as usize;
    let type_size = ty.type_size() as usize;
    if !n_elements.is_multiple_of(block) || n_bytes != n_elements / block * type_size {
        return Err(input_err!(
            "tensor {name}: {n_bytes} bytes do not hold {n_elements} {ty} values ({block} per {type_size}-byte block)"
        ));
    }
    Ok(())
}

/// Dequantize the `n_elements` values of tensor `name` stored as `ty` in `bytes`.
pub fn dequantize(name: &str, ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    check_dequantizable(name, ty, bytes.len(), n_elements)?;
    let block_fn = block_fn(ty).expect("checked by check_dequantizable");
    let block = ty.block_size() as usize;
    let type_size = ty.type_size() as usize;
    let mut out = vec![0f32; n_elements];
    out.par_chunks_mut(block * BLOCKS_PER_TASK)
        .zip(bytes.par_chunks(type_size * BLOCKS_PER_TASK))
        .for_each(|(o, b)| {
            for (ob, bb) in o.chunks_exact_mut(block).zip(b.chunks_exact(type_size)) {
                block_fn(bb, ob);
            }
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_nibble_order() {
        // d = 1, m = −8: element i = nibble − 8; low nibbles 0..15 are elements 0..15.
        let mut b = Vec::new();
        b.extend(f16::from_f32(1.0).to_le_bytes());
        b.extend(f16::from_f32(-8.0).to_le_bytes());
        b.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
        let x = dequantize("t", GgmlType::Q4_1, &b, 32).unwrap();
        for i in 0..16 {
            assert_eq!(x[i], i as f32 - 8.0);
            assert_eq!(x[16 + i], (15 - i) as f32 - 8.0);
        }
    }

    #[test]
    fn q5_0_fifth_bit() {
        // d = 1; nibble of element i = i % 16, qh bit i set for odd i: element i = (i % 16) + 16·(i odd) − 16.
        let mut b = Vec::new();
        b.extend(f16::from_f32(1.0).to_le_bytes());
        b.extend(0xaaaa_aaaau32.to_le_bytes());
        b.extend((0..16u8).map(|i| i | (i << 4)));
        let x = dequantize("t", GgmlType::Q5_0, &b, 32).unwrap();
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(v, (i % 16 + 16 * (i % 2)) as f32 - 16.0, "element {i}");
        }
    }

    #[test]
    fn unsupported_type_is_named() {
        let e = dequantize("blk.0.attn_q.weight", GgmlType::IQ4_XS, &[0; 136], 256).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("blk.0.attn_q.weight") && msg.contains("IQ4_XS"),
            "{msg}"
        );
    }
}
