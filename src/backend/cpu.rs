//! CPU backend: faer GEMMs and rayon. The reference for every CUDA kernel, and fast enough to quantize a
//! 135M model on a laptop.
//!
//! Determinism: parallel work is split into chunks whose bounds depend only on the problem shape, never on
//! the number of threads, and each chunk runs sequentially; so results are bit-identical whatever
//! RAYON_NUM_THREADS is.

use super::Backend;
use crate::ops::Result;
use anyhow::ensure;
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use rayon::prelude::*;

#[path = "cpu_qgemm.rs"]
pub mod qgemm;

#[derive(Default, Clone, Copy)]
pub struct CpuBackend;

/// C [m × n] (+)= A [m × k] · B [n × k]ᵀ, sequential. Row-major slices.
pub fn gemm_nt(
    c: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    let a = MatRef::from_row_major_slice(a, m, k);
    let bt = MatRef::from_row_major_slice(b, n, k).transpose();
    let c = MatMut::from_row_major_slice_mut(c, m, n);
    let beta = if accumulate {
        Accum::Add
    } else {
        Accum::Replace
    };
    matmul(c, beta, a, bt, 1.0f32, Par::Seq);
}

/// C [m × n] = A [m × k] · B [k × n], sequential. Row-major slices.
pub fn gemm_nn(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    let a = MatRef::from_row_major_slice(a, m, k);
    let b = MatRef::from_row_major_slice(b, k, n);
    let c = MatMut::from_row_major_slice_mut(c, m, n);
    matmul(c, Accum::Replace, a, b, 1.0f32, Par::Seq);
}

/// Y [m × n] = X [m × k] · W [n × k]ᵀ with faer's parallel GEMM. faer splits the output over threads but
/// keeps each element's reduction over k in one fixed order, so the result does not depend on the thread
/// count (tests/determinism.rs checks this on whole runs).
pub fn linear_f32(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "linear: x is not [m={m} × k={k}]");
    assert_eq!(w.len(), n * k, "linear: w is not [n={n} × k={k}]");
    let mut y = vec![0f32; m * n];
    let a = MatRef::from_row_major_slice(x, m, k);
    let bt = MatRef::from_row_major_slice(w, n, k).transpose();
    let c = MatMut::from_row_major_slice_mut(&mut y, m, n);
    matmul(c, Accum::Replace, a, bt, 1.0f32, Par::rayon(0));
    y
}

/// Output columns per task of the packed GEMM. Wide, because a task reads QGEMM_NB contiguous words of each
/// qweight row and then jumps d_out words: 1 KiB runs keep the prefetchers busy (64 columns, 256 B runs one
/// page apart, ran 2× slower at m = 1).
pub const QGEMM_NB: usize = 256;
/// Input rows per dequantized tile (a multiple of 32: 3-bit tiles start on a word); the tile
/// [QGEMM_TK × QGEMM_NB] f32 is 32 KiB.
pub const QGEMM_TK: usize = 32;
/// Up to this many tokens, contiguous groups use the fused tile (`boa_qdot_group_tile`): it unpacks once per
/// token, so it wins only while m is small.
const QGEMM_FUSED_M: usize = 2;
/// Columns whose per-token partial sums stay in registers in the small-m loop (8 AVX2 registers).
const QGEMM_SUB: usize = 64;
/// From this many tokens on, each tile is multiplied with faer's GEMM instead of the plain loops (at m = 16
/// both took the same time in bench-qgemm).
const QGEMM_FAER_M: usize = 16;

/// Y [m × n] = X [m × k] · Ŵᵀ, Ŵ [n × k] packed (`PackedLinear`, n = d_out, k = d_in): the CPU twin of the
/// packed GEMM kernel. Up to 16 tokens on contiguous groups, the SIMD kernels of `qgemm` (cpu_qgemm.rs) run;
/// the tile path below is the portable one for everything else.
///
/// Work partition: rayon over blocks of QGEMM_NB output columns; each block walks the input dimension in tiles
/// of QGEMM_TK rows, dequantizes the tile Ŵᵀ[i0.., j0..] (QGEMM_TK × QGEMM_NB f32, 32 KiB, L1/L2-resident)
/// with the shared C code (`boa_dequant_tile`, include/boa_pack.h), and accumulates X[:, i0..] · tile into its
/// own [m × QGEMM_NB] output block. Each output element is owned by one task and reduced over k in a fixed
/// order, so the result does not depend on the thread count. Weight traffic: the packed words once.
///
/// ```text
///            j0 ─ QGEMM_NB ─┐
///   i0 ┌──────────────────┐ │   task (j0): for i0 in (0..k).step_by(QGEMM_TK):
///      │ tile Ŵᵀ[i0.., j0..] │     tile ← dequant(qweight[i0·b/32.., j0..])
///      └──────────────────┘      Y[:, j0..] += X[:, i0..] · tile
/// ```
pub fn packed_linear_f32(x: &[f32], p: &crate::quant::pack::PackedLinear, m: usize) -> Vec<f32> {
    let (k, n) = (p.d_in, p.d_out);
    assert_eq!(x.len(), m * k, "packed_linear: x is not [m={m} × k={k}]");
    if let Some(y) = qgemm::packed_linear_fast(x, p, m) {
        return y;
    }
    // Few tokens and contiguous groups that tiles do not straddle: the fused kernel (no dequantized tile).
    let fused_group = p
        .contiguous_group()
        .filter(|g| m <= QGEMM_FUSED_M && (g.is_multiple_of(QGEMM_TK) || *g >= k));
    let blocks: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(QGEMM_NB))
        .into_par_iter()
        .map(|jb| {
            let j0 = jb * QGEMM_NB;
            let nj = QGEMM_NB.min(n - j0);
            let mut y = vec![0f32; m * nj];
            let mut tile = vec![0f32; QGEMM_TK * nj];
            for i0 in (0..k).step_by(QGEMM_TK) {
                let ni = QGEMM_TK.min(k - i0);
                if let Some(g) = fused_group
                    && nj.is_multiple_of(crate::quant::pack::QDOT_COLS)
                {
                    p.qdot_group_tile(i0 / g, i0, ni, j0, nj, x, m, &mut y);
                    continue;
                }
                p.dequant_tile(i0, ni, j0, nj, &mut tile);
                if m >= QGEMM_FAER_M {
                    let a = MatRef::from_row_major_slice_with_stride(&x[i0..], m, ni, k);
                    let b = MatRef::from_row_major_slice(&tile[..ni * nj], ni, nj);
                    let c = MatMut::from_row_major_slice_mut(&mut y, m, nj);
                    matmul(c, Accum::Add, a, b, 1.0f32, Par::Seq);
                } else if nj.is_multiple_of(QGEMM_SUB) {
                    // QGEMM_SUB partial sums of a token live in registers (8 ymm) across the tile's rows and
                    // are added to Y once per tile.
                    for (yr, xr) in y.chunks_exact_mut(nj).zip(x.chunks(k)) {
                        for c0 in (0..nj).step_by(QGEMM_SUB) {
                            let mut acc = [0f32; QGEMM_SUB];
                            for (t, &xv) in tile.chunks_exact(nj).zip(&xr[i0..i0 + ni]) {
                                let t = &t[c0..c0 + QGEMM_SUB];
                                for c in 0..QGEMM_SUB {
                                    acc[c] += xv * t[c];
                                }
                            }
                            yr[c0..c0 + QGEMM_SUB]
                                .iter_mut()
                                .zip(&acc)
                                .for_each(|(y, a)| *y += a);
                        }
                    }
                } else {
                    for (yr, xr) in y.chunks_mut(nj).zip(x.chunks(k)) {
                        for (t, &xv) in tile.chunks(nj).zip(&xr[i0..i0 + ni]) {
                            yr.iter_mut().zip(t).for_each(|(y, w)| *y += xv * w);
                        }
                    }
                }
            }
            (j0, y)
        })
        .collect();
    let mut y = vec![0f32; m * n];
    for (j0, yb) in blocks {
        let nj = yb.len() / m.max(1);
        for (yr, br) in y.chunks_mut(n).zip(yb.chunks(nj.max(1))) {
            yr[j0..j0 + nj].copy_from_slice(br);
        }
    }
    y
}

/// Rows per parallel task for row-wise elementwise ops.
const ROWS_PER_TASK: usize = 16;

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>> {
        let mut y = linear_f32(x, w, m, k, n);
        if let Some(b) = bias {
            ensure!(b.len() == n, "linear: bias is not [n={n}]");
            y.par_chunks_mut(n)
                .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
        }
        Ok(y)
    }

    fn packed_linear(
        &self,
        x: &[f32],
        w: &crate::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Result<Vec<f32>> {
        let n = w.d_out;
        let mut y = packed_linear_f32(x, w, m);
        if let Some(b) = bias {
            ensure!(b.len() == n, "packed_linear: bias is not [n={n}]");
            y.par_chunks_mut(n)
                .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
        }
        Ok(y)
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> Result<Vec<f32>> {
        ensure!(w.len() == d, "rms_norm: w is not [d={d}]");
        ensure!(
            x.len().is_multiple_of(d),
            "rms_norm: x is not [rows × d={d}]"
        );
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(d * ROWS_PER_TASK)
            .zip(x.par_chunks(d * ROWS_PER_TASK))
            .for_each(|(yc, xc)| {
                for (yr, xr) in yc.chunks_mut(d).zip(xc.chunks(d)) {
                    rms_norm_row(yr, xr, w, eps);
                }
            });
        Ok(y)
    }

    fn rope(
        &self,
        x: &mut [f32],
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<()> {
        let width = n_heads * d_h;
        ensure!(
            x.len().is_multiple_of(t * width),
            "rope: x is not [n_seq·{t} × {width}]"
        );
        ensure!(
            cos.len() >= t * d_h / 2 && sin.len() >= t * d_h / 2,
            "rope: tables shorter than t={t}"
        );
        x.par_chunks_mut(width * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk, xc)| {
                let half = d_h / 2;
                for (r, xr) in xc.chunks_mut(width).enumerate() {
                    let p = (chunk * ROWS_PER_TASK + r) % t;
                    let (c, s) = (
                        &cos[p * half..(p + 1) * half],
                        &sin[p * half..(p + 1) * half],
                    );
                    for head in xr.chunks_mut(d_h) {
                        rope_head(head, c, s);
                    }
                }
            });
        Ok(())
    }

    fn causal_attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>> {
        attention(q, k, v, n_seq, (t, h, h_kv, d_h), None)
    }

    fn attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>> {
        attention_probs(q, k, (t, h, h_kv, d_h), None)
    }

    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        gated(gate, up, |g| g / (1.0 + exp_f32(-g)))
    }
}

/// Q [n_seq·t × h·d_h] and K [n_seq·t × h_kv·d_h], with whole groups of query heads per KV head.
fn check_qk(
    q: &[f32],
    k: &[f32],
    n_seq: usize,
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
) -> Result<()> {
    ensure!(
        h_kv > 0 && h.is_multiple_of(h_kv),
        "attention: h={h} is not a multiple of h_kv={h_kv}"
    );
    ensure!(
        q.len() == n_seq * t * h * d_h,
        "q.len() != n_seq * t * h * d_h"
    );
    ensure!(
        k.len() == n_seq * t * h_kv * d_h,
        "k.len() != n_seq * t * h_kv * d_h"
    );
    Ok(())
}

/// Causal softmax attention with GQA (`Backend::causal_attention`), each query attending to at most `window`
/// keys (itself included) when the layer's attention slides.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_seq: usize,
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
    window: Option<usize>,
) -> Result<Vec<f32>> {
    check_qk(q, k, n_seq, (t, h, h_kv, d_h))?;
    ensure!(v.len() == k.len(), "v.len() != k.len()");
    let heads: Vec<Vec<f32>> = (0..n_seq * h)
        .into_par_iter()
        .map(|sh| {
            let (s, head) = (sh / h, sh % h);
            let kvh = head / (h / h_kv);
            let qh = gather_head(&q[s * t * h * d_h..(s + 1) * t * h * d_h], t, h, d_h, head);
            let kh = gather_head(
                &k[s * t * h_kv * d_h..(s + 1) * t * h_kv * d_h],
                t,
                h_kv,
                d_h,
                kvh,
            );
            let vh = gather_head(
                &v[s * t * h_kv * d_h..(s + 1) * t * h_kv * d_h],
                t,
                h_kv,
                d_h,
                kvh,
            );
            causal_attention_head(&qh, &kh, &vh, t, d_h, window)
        })
        .collect();
    let mut out = vec![0f32; n_seq * t * h * d_h];
    for (sh, o) in heads.iter().enumerate() {
        let (s, head) = (sh / h, sh % h);
        for i in 0..t {
            let dst = (s * t + i) * h * d_h + head * d_h;
            out[dst..dst + d_h].copy_from_slice(&o[i * d_h..(i + 1) * d_h]);
        }
    }
    Ok(out)
}

/// The softmax probabilities of every query head of one sequence (`Backend::attention_probs`), under the
/// causal mask and, when the layer slides, its window.
pub fn attention_probs(
    q: &[f32],
    k: &[f32],
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
    window: Option<usize>,
) -> Result<Vec<f32>> {
    check_qk(q, k, 1, (t, h, h_kv, d_h))?;
    let heads: Vec<Vec<f32>> = (0..h)
        .into_par_iter()
        .map(|head| {
            let qh = gather_head(q, t, h, d_h, head);
            let kh = gather_head(k, t, h_kv, d_h, head / (h / h_kv));
            causal_softmax_probs(&qh, &kh, t, d_h, window)
        })
        .collect();
    Ok(heads.concat())
}

/// gelu_tanh(gate) ⊙ up in f32 with transformers' "gelu_pytorch_tanh":
/// ½ g (1 + tanh(√(2/π) (g + 0.044715 g³))).
pub fn geglu(gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
    const BETA: f32 = 0.797_884_6; // √(2/π)
    gated(gate, up, |g| {
        0.5 * g * (1.0 + (BETA * (g + 0.044715 * g * g * g)).tanh())
    })
}

/// act(gate) ⊙ up, elementwise, rayon over chunks: the gated MLPs' activation.
fn gated(gate: &[f32], up: &[f32], act: impl Fn(f32) -> f32 + Sync) -> Result<Vec<f32>> {
    ensure!(gate.len() == up.len(), "gate.len() != up.len()");
    let mut out = vec![0f32; gate.len()];
    out.par_chunks_mut(4096)
        .zip(gate.par_chunks(4096).zip(up.par_chunks(4096)))
        .for_each(|(o, (g, u))| {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = act(g) * u;
            }
        });
    Ok(out)
}

/// e^x in f32 that the compiler vectorizes (libm's expf does not), within 2 ulp of it for the range that
/// matters, and exactly 0 below −87: results that would be denormal are flushed, because denormal
/// arithmetic costs ~100 cycles per operation on x86 and attention rows are full of tiny probabilities.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = x.min(88.0);
    // e^x = 2^k · e^r with k = round(x·log2 e), |r| ≤ ln2/2; e^r by its Taylor series to r^7 (error < 1e-8).
    // Adding and subtracting 1.5·2^23 rounds to nearest-even without roundps (absent before SSE4.1).
    const ROUND: f32 = 12_582_912.0;
    let kf = xc * LOG2E + ROUND;
    let k = kf - ROUND;
    // k as an integer from kf's low mantissa bits (exact for |k| < 2^22): Rust's saturating `k as i32`
    // compiles to a scalar conversion per lane and kept every loop calling this from vectorizing. Below −87
    // the bits are garbage, but that lane returns 0.
    let ki = kf.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = xc - k * LN2_HI - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let scale = f32::from_bits((ki.wrapping_add(127).max(1) as u32) << 23);
    if x < -87.0 { 0.0 } else { p * scale }
}

pub fn rms_norm_row(y: &mut [f32], x: &[f32], w: &[f32], eps: f32) {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let ms = (acc.iter().sum::<f32>() + chunks.remainder().iter().map(|v| v * v).sum::<f32>())
        / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
        *y = x * r * w;
    }
}

/// Rotate-half RoPE of one head vector: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), halves of d_h/2.
pub fn rope_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (x1, x2) = (x[i], x[i + half]);
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + half] = x2 * cos[i] + x1 * sin[i];
    }
}

/// Copies head `head` of X [t × n_heads·d_h] into a contiguous [t × d_h] matrix.
pub fn gather_head(x: &[f32], t: usize, n_heads: usize, d_h: usize, head: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(t * d_h);
    for i in 0..t {
        let off = i * n_heads * d_h + head * d_h;
        out.extend_from_slice(&x[off..off + d_h]);
    }
    out
}

/// Query rows per block of the causal attention: block b only needs keys 0..(b+1)·B, which skips the masked
/// half of Q Kᵀ and of P V.
const ATTENTION_BLOCK: usize = 64;

/// Max and sum over 16 lanes: a fixed order the compiler can vectorize (a plain fold is a serial chain).
pub fn max_lanes(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = a.max(v);
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(acc.iter())
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

fn sum_lanes(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// Σ exp(x − shift) in f64: 16 f32 lanes over blocks of 1024 values (vectorizable), blocks summed in f64,
/// in a fixed order. For log-sum-exp over a vocabulary of ~50K logits.
pub fn sum_exp_f64(x: &[f32], shift: f32) -> f64 {
    let mut total = 0f64;
    for block in x.chunks(1024) {
        let mut acc = [0f32; 16];
        let mut chunks = block.chunks_exact(16);
        for c in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += exp_f32(v - shift);
            }
        }
        let rest: f32 = chunks.remainder().iter().map(|&v| exp_f32(v - shift)).sum();
        total += acc.iter().map(|&a| a as f64).sum::<f64>() + rest as f64;
    }
    total
}

/// Scores S [rows × width] of queries i0.. against keys 0..width → causal softmax probabilities in place
/// (row r sees keys 0..=i0+r, and with a window only the last `window` of them; the rest is set to 0).
fn causal_softmax_rows(s: &mut [f32], width: usize, i0: usize, scale: f32, window: Option<usize>) {
    for (r, row) in s.chunks_mut(width).enumerate() {
        let i = i0 + r;
        let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
        let (row, masked) = row.split_at_mut(i + 1);
        let (before, live) = row.split_at_mut(lo);
        before.iter_mut().for_each(|v| *v = 0.0);
        let max = max_lanes(live) * scale;
        for v in live.iter_mut() {
            *v = exp_f32(*v * scale - max);
        }
        let inv = 1.0 / sum_lanes(live);
        live.iter_mut().for_each(|v| *v *= inv);
        masked.iter_mut().for_each(|v| *v = 0.0);
    }
}

/// Calls `f(i0, rows, P_block)` for each block of query rows in `queries` (its start a multiple of
/// ATTENTION_BLOCK, so the blocks are the same whatever range is asked), P_block [rows × i0+rows] the causal
/// softmax probabilities of those queries against keys 0..i0+rows.
fn causal_prob_blocks(
    qh: &[f32],
    kh: &[f32],
    d_h: usize,
    window: Option<usize>,
    queries: std::ops::Range<usize>,
    mut f: impl FnMut(usize, usize, &[f32]),
) {
    debug_assert!(queries.start.is_multiple_of(ATTENTION_BLOCK));
    let scale = 1.0 / (d_h as f32).sqrt();
    let mut s = Vec::new();
    for i0 in queries.clone().step_by(ATTENTION_BLOCK) {
        let i1 = (i0 + ATTENTION_BLOCK).min(queries.end);
        let rows = i1 - i0;
        s.resize(rows * i1, 0.0);
        gemm_nt(
            &mut s,
            &qh[i0 * d_h..i1 * d_h],
            &kh[..i1 * d_h],
            rows,
            d_h,
            i1,
            false,
        );
        causal_softmax_rows(&mut s, i1, i0, scale, window);
        f(i0, rows, &s);
    }
}

/// A = softmax(Q Kᵀ / sqrt(d_h)) with the causal mask (and a sliding window's), [t × t] row-major (masked
/// entries are 0).
pub fn causal_softmax_probs(
    qh: &[f32],
    kh: &[f32],
    t: usize,
    d_h: usize,
    window: Option<usize>,
) -> Vec<f32> {
    let mut p = vec![0f32; t * t];
    causal_prob_blocks(qh, kh, d_h, window, 0..t, |i0, rows, s| {
        let w = i0 + rows;
        for r in 0..rows {
            p[(i0 + r) * t..(i0 + r) * t + w].copy_from_slice(&s[r * w..(r + 1) * w]);
        }
    });
    p
}

/// One head's causal attention output [t × d_h] = A V, block by block (A is never stored whole).
pub fn causal_attention_head(
    qh: &[f32],
    kh: &[f32],
    vh: &[f32],
    t: usize,
    d_h: usize,
    window: Option<usize>,
) -> Vec<f32> {
    causal_attention_rows(qh, kh, vh, d_h, d_h, window, 0..t)
}

/// Rows `queries` of one head's A V, [len × d_v], V [t × d_v] any width: with V = the block input X this is
/// (A_h X)[queries], W_V's column statistic for those positions. The start of `queries` is a multiple of 64
/// (the blocks of `causal_prob_blocks`), so every row is the bits the whole product gives it.
pub fn causal_attention_rows(
    qh: &[f32],
    kh: &[f32],
    vh: &[f32],
    d_h: usize,
    d_v: usize,
    window: Option<usize>,
    queries: std::ops::Range<usize>,
) -> Vec<f32> {
    let q0 = queries.start;
    let mut o = vec![0f32; queries.len() * d_v];
    causal_prob_blocks(qh, kh, d_h, window, queries, |i0, rows, s| {
        let w = i0 + rows;
        gemm_nn(
            &mut o[(i0 - q0) * d_v..(i0 - q0 + rows) * d_v],
            s,
            &vh[..w * d_v],
            rows,
            w,
            d_v,
        );
    });
    o
}

/// One sequence's causal GQA attention, sequential, for the CPU eval forward: Q [t × h·d_h] (row-major),
/// K and V column ranges of one row-major [t × kv_width] matrix at columns k0 and v0, out [t × h·d_h]. The
/// same blocks, mask and softmax as `causal_attention_head`, but the h/h_kv query heads that share a KV head
/// go through the GEMMs together (3·64 rows instead of 64 for SmolLM2), and K and V are read in place
/// through strided views. `scratch` is resized as needed.
///
/// ```text
///   block i0..i1, KV head g:  Q_g = [Q_{g·r}[i0..i1]; …; Q_{g·r+r−1}[i0..i1]]      (r·rows × d_h, gathered)
///                             S = Q_g · K_g[0..i1]ᵀ → causal softmax per head's rows → O = S · V_g[0..i1]
///                             out[i0..i1, head·d_h..] ← O's rows of that head
/// ```
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_grouped(
    out: &mut [f32],
    q: &[f32],
    kv: &[f32],
    kv_width: usize,
    (k0, v0): (usize, usize),
    t: usize,
    (h, h_kv, d_h): (usize, usize, usize),
    scratch: &mut Vec<f32>,
) {
    assert!(
        h_kv > 0 && h.is_multiple_of(h_kv),
        "attention: h={h} is not a multiple of h_kv={h_kv}"
    );
    let qd = h * d_h;
    assert!(k0 + h_kv * d_h <= kv_width && v0 + h_kv * d_h <= kv_width);
    assert_eq!(q.len(), t * qd);
    assert_eq!(kv.len(), t * kv_width);
    assert_eq!(out.len(), t * qd);
    let scale = 1.0 / (d_h as f32).sqrt();
    let r = h / h_kv;
    let rows_max = ATTENTION_BLOCK.min(t);
    scratch.resize(r * rows_max * (t + 2 * d_h), 0.0);
    let (s, rest) = scratch.split_at_mut(r * rows_max * t);
    let (qg, ob) = rest.split_at_mut(r * rows_max * d_h);
    for g in 0..h_kv {
        let (kc, vc) = (k0 + g * d_h, v0 + g * d_h);
        for i0 in (0..t).step_by(ATTENTION_BLOCK) {
            let i1 = (i0 + ATTENTION_BLOCK).min(t);
            let rows = i1 - i0;
            let n = r * rows;
            for j in 0..r {
                let col = (g * r + j) * d_h;
                for i in 0..rows {
                    let src = (i0 + i) * qd + col;
                    qg[(j * rows + i) * d_h..(j * rows + i + 1) * d_h]
                        .copy_from_slice(&q[src..src + d_h]);
                }
            }
            let s = &mut s[..n * i1];
            let qm = MatRef::from_row_major_slice(&qg[..n * d_h], n, d_h);
            let k = MatRef::from_row_major_slice_with_stride(&kv[kc..], i1, d_h, kv_width);
            let sm = MatMut::from_row_major_slice_mut(s, n, i1);
            matmul(sm, Accum::Replace, qm, k.transpose(), 1.0f32, Par::Seq);
            for sj in s.chunks_mut(rows * i1) {
                causal_softmax_rows(sj, i1, i0, scale, None);
            }
            let p = MatRef::from_row_major_slice(s, n, i1);
            let v = MatRef::from_row_major_slice_with_stride(&kv[vc..], i1, d_h, kv_width);
            // Into a contiguous block, then scattered: faer 0.24.4 (private-gemm-x86 0.1.22) computes wrong
            // values into a row-major destination whose row stride exceeds its width (seen 2026-11-30).
            let o = MatMut::from_row_major_slice_mut(&mut ob[..n * d_h], n, d_h);
            matmul(o, Accum::Replace, p, v, 1.0f32, Par::Seq);
            for j in 0..r {
                let col = (g * r + j) * d_h;
                for i in 0..rows {
                    let dst = (i0 + i) * qd + col;
                    out[dst..dst + d_h]
                        .copy_from_slice(&ob[(j * rows + i) * d_h..(j * rows + i + 1) * d_h]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::exp_f32;

    #[test]
    fn exp_f32_matches_libm() {
        let mut worst = 0f64;
        for i in 0..200_000 {
            let x = -87.0 + i as f32 * (175.0 / 200_000.0);
            let (a, b) = (exp_f32(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(0.0) == 1.0);
    }
}
