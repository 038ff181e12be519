//! Shared helpers of the quant_* tests: seeded random data with realistic structure.
#![allow(dead_code)]

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Standard normal (Box–Muller).
pub fn randn(r: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = r.random::<f64>().max(1e-300_f64);
    let u2: f64 = r.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

pub fn randn_vec(r: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n).map(|_| randn(r)).collect()
}

/// Correlated inputs X [n_tok × d] (one token per row): Z·M with a random mixing matrix plus per-feature scales
/// spread over two decades, like LLM activations.
pub fn correlated_inputs(r: &mut ChaCha8Rng, n_tok: usize, d: usize) -> Vec<f64> {
    let m = randn_vec(r, d * d);
    let scale: Vec<f64> = (0..d)
        .map(|i| 10f64.powf(-((i % 7) as f64) / 3.0))
        .collect();
    let z = randn_vec(r, n_tok * d);
    let mut x = vec![0.0; n_tok * d];
    for t in 0..n_tok {
        for j in 0..d {
            let mut s = 0.0;
            for k in 0..d {
                s += z[t * d + k] * m[k * d + j];
            }
            x[t * d + j] = (s / (d as f64).sqrt() + 0.5 * z[t * d + j]) * scale[j];
        }
    }
    x
}

/// (2/N) XᵀX in f64.
pub fn xtx(x: &[f64], n_tok: usize, d: usize) -> Vec<f64> {
    let mut h = vec![0.0; d * d];
    for t in 0..n_tok {
        let row = &x[t * d..(t + 1) * d];
        for i in 0..d {
            for j in 0..d {
                h[i * d + j] += row[i] * row[j];
            }
        }
    }
    h.iter().map(|v| v * 2.0 / n_tok as f64).collect()
}

/// Random SPD matrix [n × n] with strong off-diagonal structure.
pub fn random_spd(r: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    let x = correlated_inputs(r, 4 * n, n);
    xtx(&x, 4 * n, n)
}

pub fn damped(h: &[f64], n: usize, lambda: f64) -> Vec<f64> {
    let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
    let mut out = h.to_vec();
    for i in 0..n {
        out[i * n + i] += lambda * mean;
    }
    out
}

pub fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

// ---- The algorithms on the CPU backend with host slices in and out (the oracle, through `QuantOps`).

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::ops::Mat;
use boa_cuda::quant::QuantSpec;
use boa_cuda::quant::Real;
use boa_cuda::quant::boa::{BoaOptions, ColHessian};
use boa_cuda::quant::gptq::{GptqOptions, Quantized, to_host};

/// Host values of a weight as a CPU `Mat` in their own precision (f64 weights run the sweeps in f64).
pub trait HostVal: Real {
    fn mat(v: &[Self], rows: usize, cols: usize) -> Mat;
}
impl HostVal for f32 {
    fn mat(v: &[f32], rows: usize, cols: usize) -> Mat {
        Mat::f32(v.to_vec(), 1, rows, cols)
    }
}
impl HostVal for f64 {
    fn mat(v: &[f64], rows: usize, cols: usize) -> Mat {
        Mat::f64(v.to_vec(), 1, rows, cols)
    }
}

pub fn hmat(h: &[f64], n: usize) -> Mat {
    Mat::f64(h.to_vec(), h.len() / (n * n).max(1), n, n)
}

/// `gptq_quantize` on the CPU backend, host slices in and out.
pub fn gptq_host<T: HostVal>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: &[f64],
    opts: &GptqOptions,
) -> anyhow::Result<Quantized<T>> {
    let ops = CpuBackend;
    let q = boa_cuda::quant::gptq::gptq_quantize(
        &ops,
        &T::mat(w, d_out, d_in),
        &hmat(h, d_in),
        opts,
        None,
    )?;
    to_host(&ops, &q)
}

/// H_col of `boa_host`: one shared [d_in × d_in], or one per head.
#[derive(Clone, Copy)]
pub enum HostCol<'a> {
    Shared(&'a [f64]),
    PerHead(&'a [f64]),
}

/// `boa_quantize` on the CPU backend, host slices in and out.
#[allow(clippy::too_many_arguments)]
pub fn boa_host<T: HostVal>(
    w: &[T],
    n_heads: usize,
    d_h: usize,
    d_in: usize,
    h_col: HostCol,
    h_row: &[f64],
    opts: &BoaOptions,
) -> anyhow::Result<Quantized<T>> {
    let ops = CpuBackend;
    let hc = match h_col {
        HostCol::Shared(h) | HostCol::PerHead(h) => hmat(h, d_in),
    };
    let col = match h_col {
        HostCol::Shared(_) => ColHessian::Shared(&hc),
        HostCol::PerHead(_) => ColHessian::PerHead(&hc),
    };
    let q = boa_cuda::quant::boa::boa_quantize(
        &ops,
        &T::mat(w, n_heads * d_h, d_in),
        n_heads,
        d_h,
        col,
        &hmat(h_row, d_h),
        opts,
        None,
    )?;
    to_host(&ops, &q)
}

/// `rtn_quantize` on the CPU backend, host slices in and out.
pub fn rtn_host<T: HostVal>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: Option<&[f64]>,
    spec: &QuantSpec,
) -> anyhow::Result<Quantized<T>> {
    let ops = CpuBackend;
    let hm = h.map(|h| hmat(h, d_in));
    let q = boa_cuda::quant::rtn::rtn_quantize(&ops, &T::mat(w, d_out, d_in), hm.as_ref(), spec)?;
    to_host(&ops, &q)
}
