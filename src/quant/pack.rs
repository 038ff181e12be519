//! GPTQ packed checkpoints' tensors (design.md §9) through the C ABI of include/boa_pack.h and
//! include/boa_quant.h: the bit packing, the quantizer formulas and the tile dequantization that the CUDA
//! kernels compile too (style.md rule 5), so the CPU tests check the code the kernels run.
//!
//! Layout (int32 tensors hold the bit pattern of our u32 words):
//!   qweight [ceil(d_in·b/32) × d_out]: column j is output j's codes along the input dimension, a bit stream
//!           LSB-first over its words (3-bit codes straddle words);
//!   qzeros  [n_groups × ceil(d_out·b/32)]: row g is group g's zero points along the output dimension, packed
//!           the same way; v1 ("gptq", AutoGPTQ) stores zero − 1, v2 ("gptq_v2") the true zero;
//!   scales  f16 [n_groups × d_out];  g_idx int32 [d_in]: the group of each input column.
//! A checkpoint dequantizes with the f16-rounded scales: ŵ = f16(s)·(q − z).

use super::gptq::Quantized;
use crate::ops::Packed;
use half::f16;

/// How zero points are stored in qzeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum GptqVersion {
    /// `checkpoint_format: "gptq"` (AutoGPTQ): zero − 1. A zero of 0 cannot be stored.
    V1,
    /// `checkpoint_format: "gptq_v2"`: the true zero.
    V2,
}

impl GptqVersion {
    /// From a `checkpoint_format` value ("gptq" or "gptq_v2").
    pub fn parse(s: &str) -> Option<GptqVersion> {
        match s {
            "gptq" => Some(GptqVersion::V1),
            "gptq_v2" => Some(GptqVersion::V2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GptqVersion::V1 => "gptq",
            GptqVersion::V2 => "gptq_v2",
        }
    }

    /// What qzeros holds for a true zero point.
    fn stored_offset(self) -> i64 {
        match self {
            GptqVersion::V1 => -1,
            GptqVersion::V2 => 0,
        }
    }
}

mod ffi {
    unsafe extern "C" {
        pub fn boa_quantize_f32(
            w: *const f32,
            s: *const f32,
            z: *const f32,
            maxq: f32,
            n: usize,
            out: *mut f32,
        );
        pub fn boa_dequantize_f32(
            q: *const f32,
            s: *const f32,
            z: *const f32,
            n: usize,
            out: *mut f32,
        );
        pub fn boa_pack_stream(
            codes: *const u8,
            n: usize,
            bits: u32,
            words: *mut u32,
            stride: usize,
        );
        pub fn boa_unpack_stream(
            words: *const u32,
            stride: usize,
            bits: u32,
            i0: usize,
            n: usize,
            codes: *mut u8,
        );
        pub fn boa_dequant_tile_f32(
            qweight: *const u32,
            d_out: usize,
            bits: u32,
            scales: *const f32,
            zeros: *const f32,
            g_idx: *const u32,
            i0: usize,
            ni: usize,
            j0: usize,
            nj: usize,
            out: *mut f32,
        );
        pub fn boa_qdot_group_tile_f32(
            qweight: *const u32,
            d_out: usize,
            bits: u32,
            scales: *const f32,
            zeros: *const f32,
            g: usize,
            i0: usize,
            ni: usize,
            j0: usize,
            nj: usize,
            x: *const f32,
            ldx: usize,
            m: usize,
            y: *mut f32,
            ldy: usize,
        );
    }
}

/// Columns of one register block of the fused small-m tile (`BOA_QDOT_COLS` in include/boa_pack.h).
pub const QDOT_COLS: usize = 64;

fn check_bits(bits: u32) {
    assert!(
        matches!(bits, 2 | 3 | 4 | 8),
        "packing: unsupported bit width {bits}"
    );
}

/// Words of a packed vector of n b-bit codes: ceil(n·b/32).
pub fn pack_words(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(32)
}

/// `boa_quantize` (include/boa_quant.h) elementwise: q = clamp(rint(w/s) + z, 0, maxq).
pub fn quantize_c(w: &[f32], s: &[f32], z: &[f32], maxq: f32) -> Vec<f32> {
    assert!(
        s.len() == w.len() && z.len() == w.len(),
        "quantize_c: lengths differ"
    );
    let mut out = vec![0f32; w.len()];
    // SAFETY: all four slices have length w.len(), which is passed as n.
    unsafe {
        ffi::boa_quantize_f32(
            w.as_ptr(),
            s.as_ptr(),
            z.as_ptr(),
            maxq,
            w.len(),
            out.as_mut_ptr(),
        )
    };
    out
}

/// `boa_dequantize` (include/boa_quant.h) elementwise: ŵ = s·(q − z).
pub fn dequantize_c(q: &[f32], s: &[f32], z: &[f32]) -> Vec<f32> {
    assert!(
        s.len() == q.len() && z.len() == q.len(),
        "dequantize_c: lengths differ"
    );
    let mut out = vec![0f32; q.len()];
    // SAFETY: all four slices have length q.len(), which is passed as n.
    unsafe {
        ffi::boa_dequantize_f32(
            q.as_ptr(),
            s.as_ptr(),
            z.as_ptr(),
            q.len(),
            out.as_mut_ptr(),
        )
    };
    out
}

/// ORs `codes` (each < 2^bits) into the zeroed stream words[0], words[stride], … (`boa_pack_code`).
pub fn pack_stream(codes: &[u8], bits: u32, words: &mut [u32], stride: usize) {
    check_bits(bits);
    let nw = pack_words(codes.len(), bits);
    assert!(
        nw == 0 || (stride >= 1 && (nw - 1) * stride < words.len()),
        "pack_stream: {} words at stride {stride} do not fit in {}",
        nw,
        words.len()
    );
    assert!(
        codes.iter().all(|&q| (q as u32) < (1 << bits)),
        "pack_stream: a code does not fit in {bits} bits"
    );
    // SAFETY: the stream's last word, (nw − 1)·stride, is inside `words` (checked above).
    unsafe {
        ffi::boa_pack_stream(
            codes.as_ptr(),
            codes.len(),
            bits,
            words.as_mut_ptr(),
            stride,
        )
    };
}

/// Codes i0 .. i0+n of the stream words[0], words[stride], … (`boa_unpack_code`).
pub fn unpack_stream(words: &[u32], stride: usize, bits: u32, i0: usize, n: usize) -> Vec<u8> {
    check_bits(bits);
    let nw = pack_words(i0 + n, bits);
    assert!(
        n == 0 || (stride >= 1 && (nw - 1) * stride < words.len()),
        "unpack_stream: codes up to {} need {nw} words at stride {stride}, have {}",
        i0 + n,
        words.len()
    );
    let mut out = vec![0u8; n];
    // SAFETY: every word read, up to (nw − 1)·stride, is inside `words` (checked above).
    unsafe { ffi::boa_unpack_stream(words.as_ptr(), stride, bits, i0, n, out.as_mut_ptr()) };
    out
}

/// The four tensors of one packed linear, as written to / read from a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedTensors {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    pub n_groups: usize,
    /// [ceil(d_in·b/32) × d_out].
    pub qweight: Vec<u32>,
    /// [n_groups × ceil(d_out·b/32)], zeros as stored (v1: zero − 1).
    pub qzeros: Vec<u32>,
    /// [n_groups × d_out].
    pub scales: Vec<f16>,
    /// [d_in].
    pub g_idx: Vec<u32>,
}

/// Packs codes [d_out × d_in] (original column order) with their grids [d_out × n_groups] (f32 scales; true,
/// integer zeros in 0..=maxq) into a checkpoint's layout: the CPU's `QuantOps::pack` and the oracle of the
/// device's. An error (a zero point that is not a code) names the output and group.
#[allow(clippy::too_many_arguments)]
pub fn pack_codes(
    codes: &[u8],
    scales: &[f32],
    zeros: &[f32],
    g_idx: &[u32],
    d_out: usize,
    d_in: usize,
    bits: u32,
    n_groups: usize,
) -> Result<Packed, String> {
    check_bits(bits);
    let maxq = (1u32 << bits) - 1;
    assert!(
        codes.len() == d_out * d_in
            && scales.len() == d_out * n_groups
            && zeros.len() == d_out * n_groups
            && g_idx.len() == d_in,
        "pack_codes: inconsistent sizes for [{d_out} × {d_in}], {n_groups} groups"
    );
    let kw = pack_words(d_in, bits);
    let mut qweight = vec![0u32; kw * d_out];
    for j in 0..d_out {
        pack_stream(
            &codes[j * d_in..(j + 1) * d_in],
            bits,
            &mut qweight[j..],
            d_out,
        );
    }
    let mut z = vec![0u8; n_groups * d_out];
    for j in 0..d_out {
        for g in 0..n_groups {
            let v = zeros[j * n_groups + g];
            if v.fract() != 0.0 || !(0.0..=maxq as f32).contains(&v) {
                return Err(format!(
                    "zero point {v} (output {j}, group {g}) is not a {bits}-bit code"
                ));
            }
            z[g * d_out + j] = v as u8;
        }
    }
    let scales = (0..n_groups * d_out)
        .map(|k| f16::from_f32(scales[(k % d_out) * n_groups + k / d_out]))
        .collect();
    Ok(Packed {
        d_out,
        d_in,
        bits,
        n_groups,
        qweight,
        scales,
        zeros: z,
        g_idx: g_idx.to_vec(),
    })
}

/// Ŵ [d_out × d_in] as a checkpoint dequantizes it: f16(s)·(q − z). The fake-quant export writes this, so the
/// fake and packed formats hold the same model.
pub fn dequantize_packed(p: &Packed) -> Vec<f32> {
    let mut out = vec![0f32; p.d_out * p.d_in];
    for (j, row) in out.chunks_mut(p.d_in).enumerate() {
        let codes = unpack_stream(&p.qweight[j..], p.d_out, p.bits, 0, p.d_in);
        for (c, w) in row.iter_mut().enumerate() {
            let k = p.g_idx[c] as usize * p.d_out + j;
            let s = p.scales[k].to_f32();
            *w = super::quantizer::dequantize(codes[c] as f32, s, p.zeros[k] as f32);
        }
    }
    out
}

impl PackedTensors {
    /// Packs a quantized matrix read back to the host (tests and tools; the pipeline packs through
    /// `QuantOps::pack`). Errors (a user error: the caller names the layer) when v1 cannot store a zero.
    pub fn pack(q: &Quantized<f32>, version: GptqVersion) -> Result<PackedTensors, String> {
        let p = pack_codes(
            &q.codes, &q.scales, &q.zeros, &q.g_idx, q.d_out, q.d_in, q.bits, q.n_groups,
        )?;
        Self::from_packed(&p, version)
    }

    /// The checkpoint tensors of format `version` (its zero-point convention). Errors when v1 cannot store a
    /// zero (a zero of 0: v1 stores zero − 1).
    pub fn from_packed(p: &Packed, version: GptqVersion) -> Result<PackedTensors, String> {
        let (d_out, b, ng) = (p.d_out, p.bits, p.n_groups);
        let maxq = (1i64 << b) - 1;
        let zw = pack_words(d_out, b);
        let mut qzeros = vec![0u32; ng * zw];
        let mut stored = vec![0u8; d_out];
        for g in 0..ng {
            for (j, s) in stored.iter_mut().enumerate() {
                let z = p.zeros[g * d_out + j];
                let v = z as i64 + version.stored_offset();
                if !(0..=maxq).contains(&v) {
                    return Err(format!(
                        "zero point {z} (output {j}, group {g}) cannot be stored in {b} bits as checkpoint \
                         format {:?}{}",
                        version.name(),
                        if version == GptqVersion::V1 && v == -1 {
                            " (it stores zero − 1); use --format gptq_v2 or --sym"
                        } else {
                            ""
                        }
                    ));
                }
                *s = v as u8;
            }
            pack_stream(&stored, b, &mut qzeros[g * zw..(g + 1) * zw], 1);
        }
        Ok(PackedTensors {
            d_out,
            d_in: p.d_in,
            bits: b,
            n_groups: ng,
            qweight: p.qweight.clone(),
            qzeros,
            scales: p.scales.clone(),
            g_idx: p.g_idx.clone(),
        })
    }

    /// The integer codes [d_out × d_in] (original column order).
    pub fn unpack_codes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.d_out * self.d_in);
        for j in 0..self.d_out {
            out.extend(unpack_stream(
                &self.qweight[j..],
                self.d_out,
                self.bits,
                0,
                self.d_in,
            ));
        }
        out
    }

    /// The true zero points [n_groups × d_out].
    pub fn unpack_zeros(&self, version: GptqVersion) -> Vec<f32> {
        let zw = pack_words(self.d_out, self.bits);
        let mut out = Vec::with_capacity(self.n_groups * self.d_out);
        for g in 0..self.n_groups {
            let stored = unpack_stream(&self.qzeros[g * zw..], 1, self.bits, 0, self.d_out);
            out.extend(
                stored
                    .iter()
                    .map(|&v| (v as i64 - version.stored_offset()) as f32),
            );
        }
        out
    }

    /// Ready for the packed GEMM (scales to f32, zeros unpacked).
    pub fn into_linear(self, version: GptqVersion) -> PackedLinear {
        let zeros = self.unpack_zeros(version);
        PackedLinear {
            d_out: self.d_out,
            d_in: self.d_in,
            bits: self.bits,
            n_groups: self.n_groups,
            scales: self.scales.iter().map(|s| s.to_f32()).collect(),
            zeros,
            qweight: self.qweight,
            g_idx: self.g_idx,
        }
    }
}

/// Ŵ of a quantized matrix as a packed checkpoint dequantizes it: f16(s)·(q − z), [d_out × d_in]. The fake-quant
/// export writes this too, so both formats hold the same model.
pub fn dequantize_f16_scales(q: &Quantized<f32>) -> Vec<f32> {
    let mut out = vec![0f32; q.d_out * q.d_in];
    for (r, row) in out.chunks_mut(q.d_in).enumerate() {
        for (c, w) in row.iter_mut().enumerate() {
            let k = r * q.n_groups + q.g_idx[c] as usize;
            let s = f16::from_f32(q.scales[k]).to_f32();
            *w = super::quantizer::dequantize(q.codes[r * q.d_in + c] as f32, s, q.zeros[k]);
        }
    }
    out
}

/// A linear layer held packed in memory, for the packed GEMM (`Backend::packed_linear`): qweight stays packed;
/// the per-group scales and zeros (n_groups × d_out, small) are kept as f32.
#[derive(Clone, Debug)]
pub struct PackedLinear {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    pub n_groups: usize,
    /// [ceil(d_in·b/32) × d_out].
    pub qweight: Vec<u32>,
    /// [n_groups × d_out], f16 values.
    pub scales: Vec<f32>,
    /// [n_groups × d_out], the true zero points.
    pub zeros: Vec<f32>,
    /// [d_in], each < n_groups.
    pub g_idx: Vec<u32>,
}

impl PackedLinear {
    /// Checks every invariant the C tile function relies on; an error names what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.bits, 2 | 3 | 4 | 8) {
            return Err(format!("unsupported bit width {}", self.bits));
        }
        let kw = pack_words(self.d_in, self.bits);
        let gs = self.n_groups * self.d_out;
        if self.qweight.len() != kw * self.d_out
            || self.scales.len() != gs
            || self.zeros.len() != gs
            || self.g_idx.len() != self.d_in
        {
            return Err(format!(
                "packed tensors of a [{} × {}] {}-bit linear have inconsistent sizes",
                self.d_out, self.d_in, self.bits
            ));
        }
        if let Some(i) = self.g_idx.iter().position(|&g| g as usize >= self.n_groups) {
            return Err(format!(
                "g_idx[{i}] = {} is not below the number of groups {}",
                self.g_idx[i], self.n_groups
            ));
        }
        Ok(())
    }

    /// The dequantized tile Ŵᵀ[i0 .. i0+ni, j0 .. j0+nj] into `out` [ni × nj] (`boa_dequant_tile`).
    pub fn dequant_tile(&self, i0: usize, ni: usize, j0: usize, nj: usize, out: &mut [f32]) {
        assert!(
            i0 + ni <= self.d_in && j0 + nj <= self.d_out && out.len() >= ni * nj,
            "dequant_tile: tile [{i0}+{ni}, {j0}+{nj}] outside [{} × {}] or buffer too small",
            self.d_in,
            self.d_out
        );
        debug_assert!(self.validate().is_ok());
        // SAFETY: the sizes were checked by `validate` when the linear was built (qweight holds
        // ceil(d_in·b/32)·d_out words, scales/zeros n_groups·d_out, every g_idx < n_groups), the tile is inside
        // the matrix and `out` holds ni·nj floats (checked above).
        unsafe {
            ffi::boa_dequant_tile_f32(
                self.qweight.as_ptr(),
                self.d_out,
                self.bits,
                self.scales.as_ptr(),
                self.zeros.as_ptr(),
                self.g_idx.as_ptr(),
                i0,
                ni,
                j0,
                nj,
                out.as_mut_ptr(),
            )
        }
    }

    /// The group size when groups are contiguous (g_idx[i] = i / g, no act-order), else None.
    pub fn contiguous_group(&self) -> Option<usize> {
        let g = if self.n_groups <= 1 {
            self.d_in.max(1)
        } else {
            self.g_idx.iter().take_while(|&&v| v == 0).count().max(1)
        };
        (self.d_in.div_ceil(g) == self.n_groups
            && self
                .g_idx
                .iter()
                .enumerate()
                .all(|(i, &v)| v as usize == i / g))
        .then_some(g)
    }

    /// Y[t, j0 + c] += Σ_{i0 ≤ i < i0+ni} X[t, i] · Ŵ[j0 + c, i] for t < m, c < nj (`boa_qdot_group_tile`): rows
    /// i0 .. i0+ni must all be in group `g` and nj a multiple of QDOT_COLS. X is [m × d_in] and Y [m × nj]
    /// (the task's own column block), both row-major.
    #[allow(clippy::too_many_arguments)]
    pub fn qdot_group_tile(
        &self,
        g: usize,
        i0: usize,
        ni: usize,
        j0: usize,
        nj: usize,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) {
        assert!(
            i0 + ni <= self.d_in
                && j0 + nj <= self.d_out
                && nj.is_multiple_of(QDOT_COLS)
                && x.len() >= m * self.d_in
                && y.len() >= m * nj
                && g < self.n_groups
                && self.g_idx[i0..i0 + ni].iter().all(|&v| v as usize == g),
            "qdot_group_tile: tile [{i0}+{ni}, {j0}+{nj}] of group {g}, m {m} does not fit [{} × {}]",
            self.d_in,
            self.d_out
        );
        // SAFETY: sizes as in `dequant_tile` (checked by `validate`); the tile is inside the matrix and in group
        // g < n_groups, X holds m·d_in floats and Y m·nj (checked above).
        unsafe {
            ffi::boa_qdot_group_tile_f32(
                self.qweight.as_ptr(),
                self.d_out,
                self.bits,
                self.scales.as_ptr(),
                self.zeros.as_ptr(),
                g,
                i0,
                ni,
                j0,
                nj,
                x.as_ptr(),
                self.d_in,
                m,
                y.as_mut_ptr(),
                nj,
            )
        }
    }

    /// The whole Ŵ [d_out × d_in] (tests and tools; the forward never builds it).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut t = vec![0f32; self.d_in * self.d_out];
        self.dequant_tile(0, self.d_in, 0, self.d_out, &mut t);
        let mut out = vec![0f32; self.d_out * self.d_in];
        for i in 0..self.d_in {
            for j in 0..self.d_out {
                out[j * self.d_in + i] = t[i * self.d_out + j];
            }
        }
        out
    }

    /// Bytes of the packed representation in memory.
    pub fn bytes(&self) -> usize {
        4 * (self.qweight.len() + self.scales.len() + self.zeros.len() + self.g_idx.len())
    }
}
