//! GGUF block types as codecs (design.md §12 "Formats as codecs"): each type states, before any sweep, the
//! grids it can store ([`BlockCodec::spec`]: width, group, symmetry and `ops::Lattice`), and encodes a row
//! from the sweep's codes and grids with no re-rounding ([`BlockCodec::encode_row`]). The decoders are the
//! import's (`dequant`, `kquant`): `encode_row` decodes what it wrote and refuses a row whose decode is not
//! the sweep's ŵ to the bit, so a file we write holds exactly the weights the error feedback assumed.
//!
//! | type | bits | group | grid (ŵ) | lattice |
//! |---|---|---|---|---|
//! | Q4_0, Q8_0 | 4, 8 | 32 | f16(s)·(q − z), z = 2^(b−1) | free (the scale is f16-rounded here, as every GPTQ format does) |
//! | Q5_0 | 5 | 32 | d·(q − 16) | f16 d |
//! | Q4_1, Q5_1 | 4, 5 | 32 | d·q + m | f16 d, f16 m (our offset is −m) |
//! | Q2_K | 2 | 16 | (d·sc)·q − dmin·m | super-block 256, sc, m ≤ 15 |
//! | Q3_K | 3 | 16 | (d·sc)·(q − 4) | super-block 256, \|sc\| ≤ 31 (signed 6 bits) |
//! | Q4_K, Q5_K | 4, 5 | 32 | (d·sc)·q − dmin·m | super-block 256, sc, m ≤ 63 |
//! | Q6_K | 6 | 16 | (d·sc)·(q − 32) | super-block 256, \|sc\| ≤ 127 (int8) |
//!
//! The sweep keeps each group's scale d·sc and offset dmin·m as plain values (exact products), not d:
//! `factor` recovers an f16 d and the integers from them. Any exact factorization decodes to the same values
//! (ggml multiplies d by sc first, exactly), so it need not be the sweep's own d.

use super::dequant::dequantize;
use super::reader::GgmlType;
use crate::ops::{Lattice, QuantSpec, ScaleSearch};
use half::f16;

/// Values per K-quant super-block (ggml QK_K).
pub const QK_K: usize = 256;

/// What one GGUF block type stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCodec {
    pub ty: GgmlType,
    pub bits: u32,
    /// Columns per group (sub-block).
    pub group: usize,
    pub sym: bool,
    pub lattice: Lattice,
}

/// The codec of `ty`, for the types we write.
pub fn codec(ty: GgmlType) -> Option<BlockCodec> {
    let k = |sc_max, m_max| Lattice::Super {
        len: QK_K,
        sc_max,
        m_max,
    };
    let (bits, group, sym, lattice) = match ty {
        GgmlType::Q4_0 => (4, 32, true, Lattice::Free),
        GgmlType::Q8_0 => (8, 32, true, Lattice::Free),
        GgmlType::Q5_0 => (5, 32, true, Lattice::F16),
        GgmlType::Q4_1 => (4, 32, false, Lattice::F16),
        GgmlType::Q5_1 => (5, 32, false, Lattice::F16),
        GgmlType::Q2_K => (2, 16, false, k(15, 15)),
        GgmlType::Q3_K => (3, 16, true, k(31, 0)),
        GgmlType::Q4_K => (4, 32, false, k(63, 63)),
        GgmlType::Q5_K => (5, 32, false, k(63, 63)),
        GgmlType::Q6_K => (6, 16, true, k(127, 0)),
        _ => return None,
    };
    Some(BlockCodec {
        ty,
        bits,
        group,
        sym,
        lattice,
    })
}

/// The types `codec` knows, in ggml id order.
pub const WRITTEN: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// An f16 d and integers k_j ≤ `max` with d·k_j = v_j exactly for every v_j ≥ 0 (None when there is none).
/// Tried from the largest k for the largest value down, so it is found in at most `max` tries.
fn factor(v: &[f64], max: u32) -> Option<(f16, Vec<u8>)> {
    let top = v.iter().copied().fold(0.0, f64::max);
    if top == 0.0 {
        return Some((f16::ZERO, vec![0; v.len()]));
    }
    (1..=max).rev().find_map(|k| {
        let d = top / k as f64;
        let h = f16::from_f64(d);
        if h.to_f64() != d {
            return None;
        }
        let ks: Option<Vec<u8>> = v
            .iter()
            .map(|&x| {
                let kj = (x / d).round();
                (kj >= 0.0 && kj <= max as f64 && kj * d == x).then_some(kj as u8)
            })
            .collect();
        ks.map(|ks| (h, ks))
    })
}

/// `factor` of signed values (a symmetric K-quant's sub-block scales): d·k_j = v_j with |k_j| ≤ `max`.
fn factor_signed(v: &[f64], max: u32) -> Option<(f16, Vec<i8>)> {
    let abs: Vec<f64> = v.iter().map(|x| x.abs()).collect();
    let (d, ks) = factor(&abs, max)?;
    let signed = ks
        .iter()
        .zip(v)
        .map(|(&k, &x)| if x < 0.0 { -(k as i8) } else { k as i8 })
        .collect();
    Some((d, signed))
}

fn exact_f16(x: f64, what: &str) -> Result<f16, String> {
    let h = f16::from_f64(x);
    if h.to_f64() == x {
        Ok(h)
    } else {
        Err(format!("{what} {x} is not an f16 value"))
    }
}

impl BlockCodec {
    pub fn maxq(&self) -> u32 {
        (1 << self.bits) - 1
    }

    /// The grids this type stores, searched with `search`.
    pub fn spec(&self, search: ScaleSearch) -> QuantSpec {
        QuantSpec::new(self.bits, Some(self.group), self.sym, search).on(self.lattice)
    }

    /// Bytes of a row of `d_in` values (None when d_in is not a whole number of blocks).
    pub fn row_bytes(&self, d_in: usize) -> Option<usize> {
        let b = self.ty.block_size() as usize;
        d_in.is_multiple_of(b)
            .then(|| d_in / b * self.ty.type_size() as usize)
    }

    /// ŵ of one code on a group's grid, in f32 as ggml decodes it: s·(q − z), or s·q − m on an offset grid
    /// (a free grid's scale f16-rounded, as the GPTQ formats store it).
    fn value(&self, q: u8, scale: f64, zero: f64) -> f32 {
        let s = match self.lattice {
            Lattice::Free => f16::from_f64(scale).to_f32(),
            _ => scale as f32,
        };
        if self.sym || self.lattice == Lattice::Free {
            s * (q as f32 - zero as f32)
        } else {
            s * q as f32 - zero as f32
        }
    }

    /// One row of the sweep's result as GGUF blocks: `codes` [d_in] in 0..=maxq, `scales`/`zeros` the grids of
    /// its groups (a symmetric grid's zero point, or an offset grid's offset m), as the sweep left them. An
    /// error says which grid the type cannot store (off its lattice), or that the decode differs.
    pub fn encode_row(
        &self,
        codes: &[u8],
        scales: &[f64],
        zeros: &[f64],
    ) -> Result<Vec<u8>, String> {
        let d_in = codes.len();
        let g = self.group;
        let nbytes = self
            .row_bytes(d_in)
            .ok_or_else(|| format!("{d_in} values are not whole {} blocks", self.ty))?;
        if scales.len() != d_in / g || zeros.len() != scales.len() {
            return Err(format!(
                "{} grids for {d_in} values in groups of {g}",
                scales.len()
            ));
        }
        if let Some(i) = codes.iter().position(|&q| q as u32 > self.maxq()) {
            return Err(format!(
                "code {} at {i} exceeds {} bits",
                codes[i], self.bits
            ));
        }
        let mid = (1u32 << (self.bits - 1)) as f64;
        if self.sym
            && let Some(j) = zeros.iter().position(|&z| z != mid)
        {
            return Err(format!(
                "group {j} has zero point {} (a symmetric grid's is {mid})",
                zeros[j]
            ));
        }
        let bs = self.ty.block_size() as usize;
        let per = bs / g;
        let mut out = Vec::with_capacity(nbytes);
        for (b, cb) in codes.chunks(bs).enumerate() {
            let (sb, zb) = (
                &scales[b * per..(b + 1) * per],
                &zeros[b * per..(b + 1) * per],
            );
            self.encode_block(cb, sb, zb, &mut out)
                .map_err(|m| format!("block {b}: {m}"))?;
        }
        // The decode of what was written is the sweep's ŵ, to the bit.
        let back = dequantize("row", self.ty, &out, d_in).map_err(|e| e.to_string())?;
        for (c, &x) in back.iter().enumerate() {
            let want = self.value(codes[c], scales[c / g], zeros[c / g]);
            if x.to_bits() != want.to_bits() {
                return Err(format!(
                    "column {c} decodes to {x}, the grid gives {want} (a grid off the {:?} lattice)",
                    self.lattice
                ));
            }
        }
        Ok(out)
    }

    /// One block: `q` its codes, `s`/`z` the grids of its groups.
    fn encode_block(
        &self,
        q: &[u8],
        s: &[f64],
        z: &[f64],
        out: &mut Vec<u8>,
    ) -> Result<(), String> {
        let le = |h: f16| h.to_le_bytes();
        match self.ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 => {
                out.extend(le(f16::from_f64(s[0])));
                if self.ty == GgmlType::Q8_0 {
                    out.extend(q.iter().map(|&c| (c as i16 - 128) as i8 as u8));
                } else {
                    out.extend((0..16).map(|i| q[i] | (q[i + 16] << 4)));
                }
            }
            GgmlType::Q5_0 | GgmlType::Q4_1 | GgmlType::Q5_1 => {
                out.extend(le(exact_f16(s[0], "scale")?));
                if !self.sym {
                    // ggml adds m: our offset is −m.
                    out.extend(le(exact_f16(-z[0], "offset")?));
                }
                if self.bits == 5 {
                    let qh = (0..32).fold(0u32, |h, i| h | (((q[i] >> 4) as u32 & 1) << i));
                    out.extend(qh.to_le_bytes());
                }
                out.extend((0..16).map(|i| (q[i] & 15) | ((q[i + 16] & 15) << 4)));
            }
            GgmlType::Q2_K | GgmlType::Q4_K | GgmlType::Q5_K => {
                let Lattice::Super { sc_max, m_max, .. } = self.lattice else {
                    unreachable!("K-quant codecs are on the super-block lattice")
                };
                let (d, sc) = factor(s, sc_max).ok_or("scales share no f16 d")?;
                let (dmin, m) = factor(z, m_max).ok_or("offsets share no f16 dmin")?;
                if self.ty == GgmlType::Q2_K {
                    out.extend((0..16).map(|j| sc[j] | (m[j] << 4)));
                    let mut qs = [0u8; 64];
                    for (i, &c) in q.iter().enumerate() {
                        qs[32 * (i / 128) + i % 32] |= c << (2 * ((i / 32) % 4));
                    }
                    out.extend(qs);
                    out.extend(le(d));
                    out.extend(le(dmin));
                } else {
                    out.extend(le(d));
                    out.extend(le(dmin));
                    out.extend(pack_k4_scales(&sc, &m));
                    if self.ty == GgmlType::Q5_K {
                        let mut qh = [0u8; 32];
                        for (i, &c) in q.iter().enumerate() {
                            qh[i % 32] |= (c >> 4) << (i / 32);
                        }
                        out.extend(qh);
                    }
                    let mut qs = [0u8; 128];
                    for (i, &c) in q.iter().enumerate() {
                        qs[32 * (i / 64) + i % 32] |= (c & 15) << (4 * ((i / 32) % 2));
                    }
                    out.extend(qs);
                }
            }
            GgmlType::Q3_K => {
                let (d, sc) = factor_signed(s, 31).ok_or("scales share no f16 d")?;
                let (mut hmask, mut qs) = ([0u8; 32], [0u8; 64]);
                for (i, &c) in q.iter().enumerate() {
                    // Stored q − 4 ∈ −4..3: low two bits of c, and the hmask bit set when c ≥ 4.
                    qs[32 * (i / 128) + i % 32] |= (c & 3) << (2 * ((i / 32) % 4));
                    hmask[i % 32] |= (c >> 2) << (i / 32);
                }
                let mut scales = [0u8; 12];
                for (j, &k) in sc.iter().enumerate() {
                    let v = (k + 32) as u8; // the signed 6-bit scale, biased
                    scales[j % 8] |= (v & 15) << (4 * (j / 8));
                    scales[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
                }
                out.extend(hmask);
                out.extend(qs);
                out.extend(scales);
                out.extend(le(d));
            }
            GgmlType::Q6_K => {
                let (d, sc) = factor_signed(s, 127).ok_or("scales share no f16 d")?;
                let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
                for (i, &c) in q.iter().enumerate() {
                    ql[64 * (i / 128) + i % 64] |= (c & 15) << (4 * ((i / 64) % 2));
                    qh[32 * (i / 128) + i % 32] |= (c >> 4) << (2 * ((i / 32) % 4));
                }
                out.extend(ql);
                out.extend(qh);
                out.extend(sc.iter().map(|&k| k as u8));
                out.extend(le(d));
            }
            other => return Err(format!("{other} is not written")),
        }
        Ok(())
    }
}

/// Q4_K/Q5_K's 8 (scale, min) pairs of 6 bits in 12 bytes, the inverse of ggml's `get_scale_min_k4`: pairs
/// 0..4 in the low 6 bits of bytes 0..4 / 4..8, pairs 4..8 in the nibbles of bytes 8..12 with their top two
/// bits in the top of bytes 0..4 (scales) and 4..8 (mins).
fn pack_k4_scales(sc: &[u8], m: &[u8]) -> [u8; 12] {
    let mut b = [0u8; 12];
    for j in 0..4 {
        b[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        b[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        b[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::lattice::lattice_row;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// Every written type: random rows, grids from the lattice search (MSE, no H), codes by the grid's own
    /// quantizer; the encoded row decodes (through the import's decoders) to the quantizer's ŵ, in f32 and
    /// in f64 sweeps alike; and the row's size is the type's.
    #[test]
    fn encoded_rows_decode_to_the_sweeps_values() {
        use crate::quant::quantizer::quant_dequant;
        let mut seed = 11u64;
        for ty in WRITTEN {
            let c = codec(ty).unwrap();
            let spec = c.spec(ScaleSearch::Mse);
            spec.validate().unwrap();
            let d_in = 512;
            for scale in [1e-3, 0.7, 40.0] {
                let w: Vec<f32> = (0..d_in)
                    .map(|i| (lcg(&mut seed) * scale * (1.0 + (i % 97) as f64 / 50.0)) as f32)
                    .collect();
                let grids = lattice_row(&w, &[], c.group, &spec);
                let maxq = c.maxq() as f32;
                let mut codes = vec![0u8; d_in];
                let mut what = vec![0f32; d_in];
                for i in 0..d_in {
                    let (q, v) = quant_dequant(w[i], grids[i / c.group], maxq, spec.offset());
                    codes[i] = q as u8;
                    what[i] = v;
                }
                let s: Vec<f64> = grids.iter().map(|g| g.scale as f64).collect();
                let z: Vec<f64> = grids.iter().map(|g| g.zero as f64).collect();
                let row = c
                    .encode_row(&codes, &s, &z)
                    .unwrap_or_else(|m| panic!("{ty}: {m}"));
                assert_eq!(row.len(), c.row_bytes(d_in).unwrap(), "{ty}");
                let back = dequantize("t", ty, &row, d_in).unwrap();
                if c.lattice != Lattice::Free {
                    // The sweep's own ŵ (f32) is the decode: nothing re-rounded.
                    assert_eq!(back, what, "{ty} at scale {scale}");
                }
            }
        }
    }

    /// A grid off the lattice is refused, naming what is wrong.
    #[test]
    fn off_lattice_grids_are_refused() {
        let c = codec(GgmlType::Q4_K).unwrap();
        let codes = vec![3u8; 256];
        let mut s = vec![0.5f64; 8];
        let z = vec![0.0; 8];
        assert!(c.encode_row(&codes, &s, &z).is_ok());
        s[3] = 0.5 * 1.0001; // not a multiple of any common f16 d
        assert!(c.encode_row(&codes, &s, &z).is_err());
        let c = codec(GgmlType::Q6_K).unwrap();
        let e = c
            .encode_row(&vec![0; 256], &[1.0; 16], &[31.0; 16])
            .unwrap_err();
        assert!(e.contains("zero point"), "{e}");
        let e = codec(GgmlType::Q5_0)
            .unwrap()
            .encode_row(&[0; 32], &[0.1], &[16.0])
            .unwrap_err();
        assert!(e.contains("f16"), "{e}");
    }

    #[test]
    fn factor_finds_an_exact_f16_d() {
        let d = f16::from_f32(0.013).to_f64();
        let v: Vec<f64> = [63u32, 1, 17, 40].iter().map(|&k| d * k as f64).collect();
        let (h, ks) = factor(&v, 63).unwrap();
        for (&x, &k) in v.iter().zip(&ks) {
            assert_eq!(h.to_f64() * k as f64, x);
        }
        assert_eq!(factor(&[0.0, 0.0], 15), Some((f16::ZERO, vec![0, 0])));
        assert!(factor(&[0.1], 15).is_none_or(|(h, k)| h.to_f64() * k[0] as f64 == 0.1));
    }
}
