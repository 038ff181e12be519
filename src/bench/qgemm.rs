//! `boa-cuda bench-qgemm`: the CPU packed GEMM (`cpu::packed_linear_f32`) against the dense f32 GEMM
//! (`cpu::linear_f32`) on the same inputs, in one run.
//!
//! Method (style.md rule 13): for each (matrix, batch m, variant) the result is first validated against the
//! f32 GEMM on the dequantized weights (max relative error, printed), then run `warmup` times untimed and
//! `repeats` times timed; the median is reported. Timed calls rotate through distinct copies of the weights
//! totalling ≥ 1 GiB (ROTATE_BYTES), so every call reads its weights from DRAM. Weight traffic counts the
//! bytes the GEMM must read from memory: f32 W (4·n·k) for the dense GEMM; qweight (n·k·b/8) plus the f32
//! scales and zeros (8·n·k/g) for the packed one. Activations and outputs are negligible at small m.

use crate::backend::cpu::{linear_f32, packed_linear_f32};
use crate::quant::pack::{PackedLinear, pack_words};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct QgemmRow {
    pub d_out: usize,
    pub d_in: usize,
    pub m: usize,
    /// "f32" or "q4g128" etc.
    pub variant: String,
    pub median_ms: f64,
    pub weight_bytes: usize,
    pub gb_per_s: f64,
    /// Time of the f32 GEMM at the same shape / time of this variant ("read" rows, m = 0: the f32 GEMM at the
    /// first batch / the plain read, i.e. how far the f32 GEMM is from the roofline).
    pub speedup_vs_f32: f64,
    /// max |y − y_ref| / max |y_ref| against the f32 GEMM on the dequantized weights.
    pub max_rel_err: f64,
}

/// A random packed linear: codes uniform, scales in [0.5, 1.5)·1e-2, zeros uniform in 0..=maxq.
pub fn random_packed(
    d_out: usize,
    d_in: usize,
    bits: u32,
    group: usize,
    seed: u64,
) -> PackedLinear {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ng = d_in.div_ceil(group);
    let maxq = (1u32 << bits) - 1;
    let p = PackedLinear {
        d_out,
        d_in,
        bits,
        n_groups: ng,
        qweight: (0..pack_words(d_in, bits) * d_out)
            .map(|_| rng.random::<u32>())
            .collect(),
        scales: (0..ng * d_out)
            .map(|_| half::f16::from_f32(0.01 * (0.5 + rng.random::<f32>())).to_f32())
            .collect(),
        zeros: (0..ng * d_out)
            .map(|_| rng.random_range(0..=maxq) as f32)
            .collect(),
        g_idx: (0..d_in).map(|i| (i / group) as u32).collect(),
    };
    p.validate().expect("random packed linear");
    p
}

/// Bytes of distinct weight copies every timed call rotates through: over 3× this CPU's 300 MiB L3, so the copy
/// a call reads was last touched ≥ 1 GiB of other traffic ago and comes from DRAM (a decode step sees its
/// weights cold too). A flush buffer smaller than the L3 left much of a 67 MB f32 matrix cached.
const ROTATE_BYTES: usize = 1 << 30;

/// Distinct copies of a `bytes`-sized operand that fill ROTATE_BYTES.
fn n_copies(bytes: usize) -> usize {
    ROTATE_BYTES.div_ceil(bytes.max(1)).max(2)
}

/// Median over `repeats` timed calls f(c), c cycling through the copies; warm-up calls first (at least one full
/// rotation, so page faults and first-touch costs are not timed).
fn median_ms(mut f: impl FnMut(usize), copies: usize, warmup: usize, repeats: usize) -> f64 {
    let mut c = 0;
    for _ in 0..warmup.max(copies) {
        f(c % copies);
        c += 1;
    }
    let mut t: Vec<f64> = (0..repeats)
        .map(|_| {
            let s = Instant::now();
            f(c % copies);
            c += 1;
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn max_rel_err(y: &[f32], r: &[f32]) -> f64 {
    let den = r.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    y.iter()
        .zip(r)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64))
        / den
}

/// Runs the benchmark over `shapes` (d_out, d_in) × `batches` × {f32, each of `bits` at group `group`}, plus
/// one "read" row per shape: a plain parallel read of the f32 weight bytes (the DRAM roofline of this run).
pub fn bench_qgemm(
    shapes: &[(usize, usize)],
    batches: &[usize],
    bits: &[u32],
    group: usize,
    warmup: usize,
    repeats: usize,
) -> Vec<QgemmRow> {
    let mut rows = Vec::new();
    for &(n, k) in shapes {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<Vec<f32>> = batches
            .iter()
            .map(|&m| (0..m * k).map(|_| rng.random::<f32>() - 0.5).collect())
            .collect();
        let f32_bytes = 4 * n * k;
        let mut t_f32 = Vec::new();
        {
            let w0: Vec<f32> = (0..n * k).map(|_| rng.random::<f32>() - 0.5).collect();
            let ws: Vec<Vec<f32>> = vec![w0; n_copies(f32_bytes)];
            let t_read = median_ms(
                |c| {
                    std::hint::black_box(
                        ws[c]
                            .par_chunks(1 << 16)
                            .map(|ch| ch.iter().fold(0u32, |a, v| a.wrapping_add(v.to_bits())))
                            .reduce(|| 0, u32::wrapping_add),
                    );
                },
                ws.len(),
                warmup,
                repeats,
            );
            rows.push(QgemmRow {
                d_out: n,
                d_in: k,
                m: 0,
                variant: "read".into(),
                median_ms: t_read,
                weight_bytes: f32_bytes,
                gb_per_s: f32_bytes as f64 / t_read / 1e6,
                speedup_vs_f32: f64::NAN,
                max_rel_err: 0.0,
            });
            let i_read = rows.len() - 1;
            for (&m, x) in batches.iter().zip(&xs) {
                let t = median_ms(
                    |c| {
                        std::hint::black_box(linear_f32(x, &ws[c], m, k, n));
                    },
                    ws.len(),
                    warmup,
                    repeats,
                );
                if t_f32.is_empty() {
                    rows[i_read].speedup_vs_f32 = t / t_read;
                }
                t_f32.push(t);
                rows.push(QgemmRow {
                    d_out: n,
                    d_in: k,
                    m,
                    variant: "f32".into(),
                    median_ms: t,
                    weight_bytes: f32_bytes,
                    gb_per_s: f32_bytes as f64 / t / 1e6,
                    speedup_vs_f32: 1.0,
                    max_rel_err: 0.0,
                });
            }
        }
        for &b in bits {
            let p0 = random_packed(n, k, b, group, 1000 + b as u64);
            let w_deq = p0.dequantize();
            let bytes = 4 * p0.qweight.len() + 4 * (p0.scales.len() + p0.zeros.len());
            let ps: Vec<PackedLinear> = vec![p0; n_copies(bytes)];
            for ((&m, x), &tf) in batches.iter().zip(&xs).zip(&t_f32) {
                let y = packed_linear_f32(x, &ps[0], m);
                let y_ref = linear_f32(x, &w_deq, m, k, n);
                let err = max_rel_err(&y, &y_ref);
                let t = median_ms(
                    |c| {
                        std::hint::black_box(packed_linear_f32(x, &ps[c], m));
                    },
                    ps.len(),
                    warmup,
                    repeats,
                );
                rows.push(QgemmRow {
                    d_out: n,
                    d_in: k,
                    m,
                    variant: format!("q{b}g{group}"),
                    median_ms: t,
                    weight_bytes: bytes,
                    gb_per_s: bytes as f64 / t / 1e6,
                    speedup_vs_f32: tf / t,
                    max_rel_err: err,
                });
            }
        }
    }
    // Table order: per shape and batch, f32 then each packed variant.
    rows.sort_by_key(|r| {
        let v = match r.variant.as_str() {
            "read" => 0,
            "f32" => 1,
            _ => {
                2 + bits
                    .iter()
                    .position(|&b| r.variant.starts_with(&format!("q{b}g")))
                    .unwrap_or(0)
            }
        };
        (shapes.iter().position(|&s| s == (r.d_out, r.d_in)), r.m, v)
    });
    rows
}
