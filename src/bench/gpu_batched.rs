//! `boa-cuda bench --device cuda` rows for two ops that replaced per-item work with one batched launch, each
//! timed beside what it replaced on the same inputs: an MoE chunk's expert Grams (`stat_xxt_rows`, one
//! padded batch, against one `stat_xxt` per expert and Gram) and R4's online transform (`block_hadamard_t`,
//! the fast transform, against the b × b GEMM on its dense matrix). Wall time of the call and a
//! synchronization, median of `reps`; the inputs are on the device, as the pipeline holds them.

use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Tensor, Weight};
use crate::model::online::OnlineQ;
use crate::ops::{Mat, QuantOps, RowGram};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// One timed case; bench/gpu.rs makes it a table row against the device's ceilings.
pub(super) struct Measured {
    pub method: &'static str,
    pub shape: String,
    pub wall_ms: f64,
    /// Useful flops, or bytes where `bandwidth_bound`.
    pub work: f64,
    pub bandwidth_bound: bool,
}

/// Qwen3-30B-A3B's experts: 128 of width 768 on d 2048, top-8 per token.
const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const D: usize = 2048;
const D_EXPERT: usize = 768;

fn timed(
    cb: &CudaBackend,
    reps: usize,
    mut f: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    f()?;
    cb.synchronize()?;
    let mut ms = Vec::new();
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        f()?;
        cb.synchronize()?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn device(cb: &CudaBackend, rng: &mut ChaCha8Rng, n: usize) -> anyhow::Result<Tensor> {
    let v = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    cb.to_device(Tensor::Host(v))
}

/// One chunk of `tokens` tokens routed top-8 over 128 experts, each expert's count drawn between 0.25× and
/// 1.75× the mean (a trained router's imbalance), two Grams per expert (its input, its activation).
pub(super) fn expert_gram_rows(
    cb: &CudaBackend,
    tokens: usize,
    reps: usize,
) -> anyhow::Result<Vec<Measured>> {
    let mut rng = ChaCha8Rng::seed_from_u64(0xe4e);
    let mean = (tokens * TOP_K / EXPERTS).max(1) as f64;
    let counts: Vec<usize> = (0..EXPERTS)
        .map(|_| (mean * rng.random_range(0.25..1.75)).round().max(1.0) as usize)
        .collect();
    let mut xs = Vec::new();
    for &n in &counts {
        xs.push((device(cb, &mut rng, n * D)?, n, D));
        xs.push((device(cb, &mut rng, n * D_EXPERT)?, n, D_EXPERT));
    }
    let mut accs: Vec<Mat> = xs
        .iter()
        .map(|&(_, _, d)| cb.stat_acc(1, d))
        .collect::<anyhow::Result<_>>()?;
    let work: f64 = xs.iter().map(|&(_, n, d)| 2.0 * (n * d * d) as f64).sum();
    let shape = format!(
        "{EXPERTS} experts d={D} d_e={D_EXPERT}, {tokens} tokens top-{TOP_K} ({} Grams)",
        xs.len()
    );
    let batched = timed(cb, reps, || {
        let mut grams: Vec<RowGram> = accs
            .iter_mut()
            .zip(&xs)
            .map(|(acc, (x, m, _))| RowGram {
                acc,
                x,
                m: *m,
                scales: None,
            })
            .collect();
        cb.stat_xxt_rows(&mut grams)
    })?;
    let each = timed(cb, reps, || {
        for (acc, (x, m, _)) in accs.iter_mut().zip(&xs) {
            cb.stat_xxt(acc, x, *m)?;
        }
        Ok(())
    })?;
    let row = |method, wall_ms| Measured {
        method,
        shape: shape.clone(),
        wall_ms,
        work,
        bandwidth_bound: false,
    };
    Ok(vec![
        row("stat_xxt_rows (one batch)", batched),
        row("stat_xxt (one per Gram)", each),
    ])
}

/// R4 on `tokens` rows of down_proj's input: Llama-2-7B's 11008 = 43 blocks of 256 (Sylvester) and
/// Qwen2.5-7B's 18944 = 16 blocks of 1184 (148 Paley II ⊗ 8), the fast transform and the dense GEMM.
pub(super) fn hadamard_rows(
    cb: &CudaBackend,
    tokens: usize,
    reps: usize,
) -> anyhow::Result<Vec<Measured>> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x4ada);
    let mut rows = Vec::new();
    for (d_ff, b) in [(11008usize, 256usize), (18944, 1184)] {
        let q = OnlineQ::new(b).map_err(anyhow::Error::msg)?;
        let x = device(cb, &mut rng, tokens * d_ff)?;
        let dense = cb
            .upload_weight(&q.dense)?
            .ok_or_else(|| anyhow::anyhow!("no device copy of the dense transform"))?;
        let shape = format!("{tokens}×{d_ff}, blocks of {}", q.h.describe());
        let fast = timed(cb, reps, || {
            cb.block_hadamard_t(&x, &q.h, Weight::host(&q.dense))
                .map(drop)
        })?;
        let gemm = timed(cb, reps, || {
            let w = Weight {
                host: &q.dense,
                resident: Some(&dense),
            };
            cb.linear_t(&x, w, None, tokens * d_ff / b, b, b).map(drop)
        })?;
        rows.push(Measured {
            method: "block_hadamard (fast)",
            shape: shape.clone(),
            wall_ms: fast,
            work: 8.0 * (tokens * d_ff) as f64,
            bandwidth_bound: true,
        });
        rows.push(Measured {
            method: "block_hadamard (dense GEMM)",
            shape,
            wall_ms: gemm,
            work: 2.0 * (tokens * d_ff * b) as f64,
            bandwidth_bound: false,
        });
    }
    Ok(rows)
}
