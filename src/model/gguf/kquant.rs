//! ggml's K-quants (Q2_K … Q6_K) → f32, one 256-value super-block at a time. `dequant` runs these per
//! block over rayon chunks; bit-exact with gguf-py's `gguf.quants.dequantize` (and ggml's
//! `dequantize_row_q*_K`), checked by tests/gguf_kquant.rs.
//!
//! Why bit-exactness does not hang on evaluation order: d (f16, ≤ 11 significant bits) × sc (|sc| ≤ 128:
//! ≤ 7 bits) × q (|q| ≤ 32: ≤ 5 bits) needs at most 23 bits, so every product is exact in f32 (whose range
//! also holds every f16 subnormal times 2^12) and x = d·sc·q − dmin·m rounds once, in the subtraction,
//! whatever the grouping of the products (or an FMA). A wrong bit layout, not a reordering, is what the
//! tests catch (a reordered Q4_K still matches; a flipped Q3_K hmask does not).
//!
//! Block layouts (ggml-common.h, QK_K = 256), little-endian, `d`/`dmin` are f16, bytes in field order:
//!
//! ```text
//! Q2_K   84 B { u8 scales[16]; u8 qs[64]; d; dmin }              16 sub-blocks of 16, 2-bit q
//! Q3_K  110 B { u8 hmask[32]; u8 qs[64]; u8 scales[12]; d }      16 sub-blocks of 16, 3-bit q
//! Q4_K  144 B { d; dmin; u8 scales[12]; u8 qs[128] }             8 sub-blocks of 32, 4-bit q
//! Q5_K  176 B { d; dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }  8 sub-blocks of 32, 5-bit q
//! Q6_K  210 B { u8 ql[128]; u8 qh[64]; i8 scales[16]; d }        16 sub-blocks of 16, 6-bit q
//! ```
//!
//! Element i (0..256) of a block, with l = i % 32 and s its sub-block:
//!
//! ```text
//! Q2_K  s = i/16   q = (qs[32·(i/128) + l] >> 2·((i/32) % 4)) & 3
//!                  x = (d·(scales[s] & 15))·q − dmin·(scales[s] >> 4)
//! Q3_K  s = i/16   q = ((qs[32·(i/128) + l] >> 2·((i/32) % 4)) & 3) − (bit i/32 of hmask[l] ? 0 : 4)
//!                  x = (d·(sc6[s] − 32))·q
//!       sc6[s] = (scales[s % 8] >> 4·(s/8)) & 15  |  ((scales[8 + s % 4] >> 2·(s/4)) & 3) << 4
//! Q4_K  s = i/32   q = (qs[32·(i/64) + l] >> 4·(s % 2)) & 15
//!                  x = (d·sc[s])·q − dmin·m[s]
//! Q5_K  s = i/32   q = Q4_K's q | (bit s of qh[l]) << 4,  x as Q4_K
//!       (sc, m) = 6-bit pairs packed in scales[12] (ggml get_scale_min_k4), for s < 4:
//!                  sc = scales[s] & 63,                         m = scales[s+4] & 63
//!       and for s ≥ 4 the low 4 bits from scales[s+4], the high 2 bits from the top of scales[s−4] / scales[s]:
//!                  sc = (scales[s+4] & 15) | (scales[s−4] >> 6) << 4,  m = (scales[s+4] >> 4) | (scales[s] >> 6) << 4
//! Q6_K  s = i/16   q = ((ql[64·(i/128) + i % 64] >> 4·((i/64) % 2)) & 15
//!                       | ((qh[32·(i/128) + l] >> 2·((i/32) % 4)) & 3) << 4) − 32
//!                  x = (d·scales[s])·q
//! ```
//!
//! Every K-quant tensor's row length must be a multiple of 256 (the reader refuses other shapes, as ggml
//! does); `dequant` hands these functions exactly one block of `type_size` bytes and 256 outputs.

use half::f16;

/// Values per K-quant super-block (ggml QK_K).
pub const QK_K: usize = 256;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q2_K: `b` is 84 bytes, `out` 256 values.
pub fn dequant_block_q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, o) in out[..QK_K].iter_mut().enumerate() {
        let sc = scales[i / 16];
        let q = (qs[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
        let dl = d * f32::from(sc & 15);
        let ml = dmin * f32::from(sc >> 4);
        *o = dl * f32::from(q) - ml;
    }
}

/// Q3_K's 16 signed 6-bit sub-block scales (already minus 32).
fn q3_k_scales(scales: &[u8]) -> [i8; 16] {
    std::array::from_fn(|s| {
        let lo = (scales[s % 8] >> (4 * (s / 8))) & 15;
        let hi = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        (lo | (hi << 4)) as i8 - 32
    })
}

/// Q3_K: `b` is 110 bytes, `out` 256 values.
pub fn dequant_block_q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs) = (&b[0..32], &b[32..96]);
    let sc = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (i, o) in out[..QK_K].iter_mut().enumerate() {
        let l = i % 32;
        let low = ((qs[32 * (i / 128) + l] >> (2 * ((i / 32) % 4))) & 3) as i8;
        // A set hmask bit means no offset; a clear one subtracts 4 (ggml: `(hm & m) ? 0 : 4`).
        let high = if (hmask[l] >> (i / 32)) & 1 == 1 {
            0
        } else {
            4
        };
        let dl = d * f32::from(sc[i / 16]);
        *o = dl * f32::from(low - high);
    }
}

/// Q4_K/Q5_K's 8 (scale, min) pairs of 6 bits from the 12 packed bytes (ggml `get_scale_min_k4`).
fn k4_scale_min(scales: &[u8]) -> [(u8, u8); 8] {
    std::array::from_fn(|s| {
        if s < 4 {
            (scales[s] & 63, scales[s + 4] & 63)
        } else {
            (
                (scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4),
                (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4),
            )
        }
    })
}

/// Q4_K: `b` is 144 bytes, `out` 256 values.
pub fn dequant_block_q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sm = k4_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for (i, o) in out[..QK_K].iter_mut().enumerate() {
        let s = i / 32;
        let q = (qs[32 * (i / 64) + i % 32] >> (4 * (s % 2))) & 15;
        let (dl, ml) = (d * f32::from(sm[s].0), dmin * f32::from(sm[s].1));
        *o = dl * f32::from(q) - ml;
    }
}

/// Q5_K: `b` is 176 bytes, `out` 256 values.
pub fn dequant_block_q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let sm = k4_scale_min(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (i, o) in out[..QK_K].iter_mut().enumerate() {
        let (s, l) = (i / 32, i % 32);
        let q = ((qs[32 * (i / 64) + l] >> (4 * (s % 2))) & 15) | (((qh[l] >> s) & 1) << 4);
        let (dl, ml) = (d * f32::from(sm[s].0), dmin * f32::from(sm[s].1));
        *o = dl * f32::from(q) - ml;
    }
}

/// Q6_K: `b` is 210 bytes, `out` 256 values.
pub fn dequant_block_q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, o) in out[..QK_K].iter_mut().enumerate() {
        let lo = (ql[64 * (i / 128) + i % 64] >> (4 * ((i / 64) % 2))) & 15;
        let hi = (qh[32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3;
        let q = (lo | (hi << 4)) as i8 - 32;
        let dl = d * f32::from(scales[i / 16] as i8);
        *o = dl * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed 6-bit scale layouts, element by element against their bit diagrams (gguf-py quants.py).
    #[test]
    fn packed_scales() {
        // Q4_K/Q5_K: bytes 0..4 = EEAAAAAA…, 4..8 = eeaaaaaa…, 8..12 = eeeeEEEE…
        let mut s = [0u8; 12];
        s[0] = 0b10_000001; // A = 1, top of E = 2
        s[4] = 0b01_000011; // a = 3, top of e = 1
        s[8] = 0b0101_0110; // low of E = 6, low of e = 5
        let sm = k4_scale_min(&s);
        assert_eq!(sm[0], (1, 3));
        assert_eq!(sm[4], (6 | (2 << 4), 5 | (1 << 4)));
        // Q3_K: scale s has low 4 bits in nibble s/8 of byte s%8 and high 2 bits at 2·(s/4) of byte 8 + s%4.
        let mut s = [0u8; 12];
        s[1] = 0x7 << 4; // low bits of scale 9
        s[9] = 0b10 << 4; // high bits of scale 9 (s/4 = 2, s%4 = 1)
        let sc = q3_k_scales(&s);
        assert_eq!(sc[9], (7 | (2 << 4)) - 32);
        assert_eq!(sc[0], -32);
    }

    #[test]
    fn q6_k_element_order() {
        // d = 1, scales = 1, ql/qh chosen so element i decodes to a value that names its source bytes.
        let mut b = vec![0u8; 210];
        b[192..208].fill(1);
        b[208..210].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[64 + 5] = 0x30; // element 128 + 5 + 64 = 197: high nibble of ql[69] = 3
        b[128 + 32 + 5] = 0b11 << 4; // element 128 + 64 + 5 = 197: bits 4..6 of qh[37] = 3
        let mut out = [0f32; QK_K];
        dequant_block_q6_k(&b, &mut out);
        assert_eq!(out[197], (3 | (3 << 4)) as f32 - 32.0);
        assert!(out.iter().enumerate().all(|(i, &x)| i == 197 || x == -32.0));
    }
}
