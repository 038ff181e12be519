//! `bench-quant`: (1) the phases of whole-model GPTQ and BoA runs, (2) BoA's sweep (2-D blocked: column
//! blocks, one trailing GEMM per block, heads in parallel) against the reference-style sweep (column at a
//! time, a GEMV per row) and the row-by-row sweep of Algorithm 1, on one attention projection of a given
//! shape, side by side in one process.

use crate::quant::boa::{ColFactor, boa_sweep, boa_sweep_rowwise};
use crate::quant::boa_reference::boa_sweep_reference;
use crate::quant::linalg::damped_upper_inverse;
use crate::quant::quantizer::{Grid, minmax_grid};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

pub struct SweepBench {
    pub n_heads: usize,
    pub d_h: usize,
    pub d_in: usize,
    pub bits: u32,
    /// Median of the runs of `boa_sweep` (B = 128).
    pub fast_seconds: f64,
    /// Median of the runs of `boa_sweep_rowwise` (B = 128), the row-by-row order `boa_sweep` replaced.
    pub rowwise_seconds: f64,
    /// The reference-style sweep: median of 3 runs, or one run when that takes over a second.
    pub reference_seconds: f64,
    /// Fraction of integer codes equal between the two (f32 rounding of different operation orders can
    /// flip a value sitting on a rounding boundary).
    pub codes_equal: f64,
}

/// Symmetric positive definite (2/N) XᵀX of N = 4·n correlated random samples.
fn random_spd(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let m = 4 * n;
    let mix: Vec<f64> = (0..n * n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let z: Vec<f64> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
    // x = z · (I + 0.3·mix): correlated columns, like real activations.
    let mut x = vec![0f64; m * n];
    for r in 0..m {
        for k in 0..n {
            let zk = z[r * n + k];
            x[r * n + k] += zk;
            for c in 0..n {
                x[r * n + c] += 0.3 / (n as f64).sqrt() * zk * mix[k * n + c];
            }
        }
    }
    let mut h = vec![0f64; n * n];
    for r in 0..m {
        let row = &x[r * n..(r + 1) * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] += 2.0 * row[i] * row[j] / m as f64;
            }
        }
    }
    h
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

pub fn sweep_comparison(
    n_heads: usize,
    d_h: usize,
    d_in: usize,
    bits: u32,
    repeats: usize,
) -> anyhow::Result<SweepBench> {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let d_out = n_heads * d_h;
    let maxq = (1u32 << bits) - 1;
    let w: Vec<f32> = (0..d_out * d_in)
        .map(|_| rng.random_range(-0.1..0.1))
        .collect();
    let mut h_col = random_spd(d_in, &mut rng);
    let u_col: Vec<f32> = damped_upper_inverse(&mut h_col, d_in, 0.01, 8)?
        .iter()
        .map(|&v| v as f32)
        .collect();
    let mut u_row = Vec::with_capacity(n_heads * d_h * d_h);
    for _ in 0..n_heads {
        let mut hr = random_spd(d_h, &mut rng);
        u_row.extend(
            damped_upper_inverse(&mut hr, d_h, 0.01, 8)?
                .iter()
                .map(|&v| v as f32),
        );
    }
    let grids: Vec<Grid<f32>> = w
        .chunks(d_in)
        .map(|row| minmax_grid(row, maxq, false))
        .collect();
    let col_group = vec![0u32; d_in];
    let cols = [ColFactor {
        u: &u_col,
        col_group: &col_group,
        dynamic: None,
    }];
    let head_col = vec![0usize; n_heads];

    // The two sweeps alternate, so a burst of load on a shared machine hits both alike.
    let mut fast_times = Vec::new();
    let mut rowwise_times = Vec::new();
    let mut fast_codes = Vec::new();
    for _ in 0..repeats.max(1) {
        for rowwise in [false, true] {
            let (mut wp, mut q, mut codes, mut g) = (
                w.clone(),
                vec![0f32; w.len()],
                vec![0u8; w.len()],
                grids.clone(),
            );
            let sweep = if rowwise {
                boa_sweep_rowwise::<f32>
            } else {
                boa_sweep::<f32>
            };
            let t = Instant::now();
            sweep(
                &mut wp, &mut q, &mut codes, &cols, &head_col, &u_row, n_heads, d_h, d_in, 128,
                &mut g, 1, maxq,
            );
            let dt = t.elapsed().as_secs_f64();
            if rowwise {
                rowwise_times.push(dt);
            } else {
                fast_times.push(dt);
                fast_codes = codes;
            }
        }
    }
    let mut ref_times = Vec::new();
    let mut ref_codes = Vec::new();
    while ref_times.len() < 3 && ref_times.iter().sum::<f64>() < 1.0 {
        let mut wr = w.clone();
        let t = Instant::now();
        ref_codes = boa_sweep_reference(&mut wr, &u_col, &u_row, n_heads, d_h, d_in, &grids, maxq);
        ref_times.push(t.elapsed().as_secs_f64());
    }
    let equal = fast_codes
        .iter()
        .zip(&ref_codes)
        .filter(|(a, b)| a == b)
        .count();
    Ok(SweepBench {
        n_heads,
        d_h,
        d_in,
        bits,
        fast_seconds: median(fast_times),
        rowwise_seconds: median(rowwise_times),
        reference_seconds: median(ref_times),
        codes_equal: equal as f64 / fast_codes.len() as f64,
    })
}
