//! `boa-cuda bench-qgemm`: the CPU packed GEMM (`cpu::packed_linear_f32`) against the dense f32 GEMM
//! (`cpu::linear_f32`) on the same inputs, in one run.
//!
//! Method (style.md rule 13): for each (matrix, batch m, variant) the result is first validated against the
//! f32 GEMM on the dequantized weights (max relative error, printed), then run `warmup` times untimed and
//! `repeats` times timed; the median is reported. Before each timed call a 128 MiB buffer is rewritten, so
//! caches hold nothing of the weights (a decode step sees the weights cold too). Weight traffic counts the
//! bytes the GEMM must read from memory: f32 W (4·n·k) for the dense GEMM; qweight (n·k·b/8) plus the f32
//! scales and zeros (8·n·k/g) for the packed one. Activations and outputs are negligible at small m.

use crate::backend::cpu::{linear_f32, packed_linear_f32};
use crate::quant::pack::{PackedLinear, pack_words};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
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
    /// Time of the f32 GEMM at the same shape / time of this variant.
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

fn median_ms(mut f: impl FnMut(), warmup: usize, repeats: usize, flush: &mut [u8]) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut t: Vec<f64> = (0..repeats)
        .map(|r| {
            flush
                .iter_mut()
                .for_each(|b| *b = b.wrapping_add(r as u8 | 1));
            std::hint::black_box(&flush);
            let s = Instant::now();
            f();
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

/// Runs the benchmark over `shapes` (d_out, d_in) × `batches` × {f32, each of `bits` at group `group`}.
pub fn bench_qgemm(
    shapes: &[(usize, usize)],
    batches: &[usize],
    bits: &[u32],
    group: usize,
    warmup: usize,
    repeats: usize,
) -> Vec<QgemmRow> {
    let mut rows = Vec::new();
    let mut flush = vec![0u8; 128 << 20];
    for &(n, k) in shapes {
        let packed: Vec<PackedLinear> = bits
            .iter()
            .map(|&b| random_packed(n, k, b, group, 1000 + b as u64))
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let w: Vec<f32> = (0..n * k).map(|_| rng.random::<f32>() - 0.5).collect();
        for &m in batches {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random::<f32>() - 0.5).collect();
            let t_f32 = median_ms(
                || {
                    std::hint::black_box(linear_f32(&x, &w, m, k, n));
                },
                warmup,
                repeats,
                &mut flush,
            );
            let f32_bytes = 4 * n * k;
            rows.push(QgemmRow {
                d_out: n,
                d_in: k,
                m,
                variant: "f32".into(),
                median_ms: t_f32,
                weight_bytes: f32_bytes,
                gb_per_s: f32_bytes as f64 / t_f32 / 1e6,
                speedup_vs_f32: 1.0,
                max_rel_err: 0.0,
            });
            for p in &packed {
                let y = packed_linear_f32(&x, p, m);
                let y_ref = linear_f32(&x, &p.dequantize(), m, k, n);
                let err = max_rel_err(&y, &y_ref);
                let t = median_ms(
                    || {
                        std::hint::black_box(packed_linear_f32(&x, p, m));
                    },
                    warmup,
                    repeats,
                    &mut flush,
                );
                let bytes = 4 * p.qweight.len() + 4 * (p.scales.len() + p.zeros.len());
                rows.push(QgemmRow {
                    d_out: n,
                    d_in: k,
                    m,
                    variant: format!("q{}g{group}", p.bits),
                    median_ms: t,
                    weight_bytes: bytes,
                    gb_per_s: bytes as f64 / t / 1e6,
                    speedup_vs_f32: t_f32 / t,
                    max_rel_err: err,
                });
            }
        }
    }
    rows
}
