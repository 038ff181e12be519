//! `boa-cuda bench`: the `QuantOps` methods on random inputs of real layer shapes, on the CPU or CUDA, each
//! reported against the device's measured ceilings (METHOD.md "Two numbers first", style.md rule 13).
//!
//! Method: inputs are drawn once per (method, shape) and placed where the backend computes (device memory on
//! CUDA, as the pipeline holds them), as two independent sets that alternate between runs where a method's
//! cost could depend on caching (never zeros); one warm-up call, then `reps` timed calls, median. A quant-core
//! row's time is the wall time of the call followed by a synchronization (so on CUDA: the kernels, their
//! launches and the host logic between them, nothing over PCIe but what the method itself moves); the
//! attn_x and packed-GEMM rows add the device time of their kernels from events. A sweep consumes its W, so
//! its timed call includes one device copy of W (~W's bytes at copy bandwidth: 30 µs for 4096², noise). Work counts the useful arithmetic (a symmetric Gram counts the full d² output, as a
//! GEMM would: the triangle kernel halves the work, so its fraction can exceed what a GEMM reaches).
//! Ceilings: CUDA measures a 1 GiB copy and a register-only bf16 mma.sync loop (cuda/ceiling.cu); the CPU a
//! 256 MiB memcpy and a 1024³ f32 faer GEMM.

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::search::{SEARCH_TOP, SearchVariant};
use crate::backend::cuda::{
    BoaBlockVariant, CudaBackend, FactorVariant, GptqBlockVariant, TrailingVariant,
};
use crate::ops::{AttnShape, GridMode, Grids, Mat, QuantOps, Tensor};
use crate::quant::quantizer::{
    Grid, QuantSpec, SHRINK_STEPS, ScaleSearch, candidate_slots, minmax_grid,
};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fmt;
use std::io::Write;
use std::time::Instant;

/// One transformer layer's shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerShape {
    pub name: &'static str,
    pub d: usize,
    pub h: usize,
    pub h_kv: usize,
    pub d_h: usize,
    pub d_ff: usize,
}

/// The shapes `--shapes` accepts.
pub const SHAPES: [LayerShape; 4] = [
    LayerShape {
        name: "smol",
        d: 576,
        h: 9,
        h_kv: 3,
        d_h: 64,
        d_ff: 1536,
    },
    LayerShape {
        name: "7b",
        d: 4096,
        h: 32,
        h_kv: 32,
        d_h: 128,
        d_ff: 11008,
    },
    LayerShape {
        name: "8b",
        d: 4096,
        h: 32,
        h_kv: 8,
        d_h: 128,
        d_ff: 14336,
    },
    LayerShape {
        name: "70b",
        d: 8192,
        h: 64,
        h_kv: 8,
        d_h: 128,
        d_ff: 28672,
    },
];

pub fn shape_by_name(name: &str) -> anyhow::Result<LayerShape> {
    SHAPES
        .iter()
        .find(|s| s.name == name)
        .copied()
        .ok_or_else(|| {
            crate::input_err!(
                "unknown shape {name:?} (expected one of {})",
                SHAPES.map(|s| s.name).join(", ")
            )
        })
}

/// Query heads the V statistics are timed on: the output is [heads × d × d] (17 GB for all 64 heads of a
/// 70B layer), so the bench times a slice of the heads and reports per-layer time scaled up.
const V_HEADS: usize = 4;

/// What a row's fraction is measured against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ceiling {
    /// Tensor-core (CUDA) or f32 GEMM (CPU) rate, TFLOP/s.
    Compute,
    /// Copy bandwidth, GB/s.
    Bandwidth,
}

#[derive(Clone, Debug)]
pub struct BenchRow {
    pub method: &'static str,
    pub shape: String,
    /// Median wall time of the call (host slices in and out).
    pub wall_ms: f64,
    /// Median device time of the kernels (CUDA), None on the CPU.
    pub kernel_ms: Option<f64>,
    /// Useful floating-point operations, or bytes for bandwidth rows.
    pub work: f64,
    pub ceiling: Ceiling,
    /// Multiply the time by this for a whole layer (V statistics: heads timed vs heads of the layer).
    pub layer_scale: f64,
}

#[derive(Clone, Debug)]
pub struct BenchReport {
    pub backend: String,
    pub copy_gbs: f64,
    pub compute_tflops: f64,
    pub ceiling_note: &'static str,
    pub tokens: usize,
    pub rows: Vec<BenchRow>,
}

/// The backend being timed: the CPU, or CUDA (with kernel times from device events).
pub enum BenchBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

impl BenchBackend {
    fn ops(&self) -> &dyn QuantOps {
        match self {
            BenchBackend::Cpu(b) => b,
            BenchBackend::Cuda(b) => b.as_ref(),
        }
    }

    fn name(&self) -> String {
        use crate::backend::Backend;
        match self {
            BenchBackend::Cpu(b) => b.name(),
            BenchBackend::Cuda(b) => b.name(),
        }
    }

    /// A host matrix where this backend computes.
    fn place(&self, m: Mat) -> anyhow::Result<Mat> {
        match self {
            BenchBackend::Cpu(_) => Ok(m),
            BenchBackend::Cuda(b) => b.upload_mat(m),
        }
    }

    /// A host tensor where this backend computes.
    fn place_t(&self, v: Vec<f32>) -> anyhow::Result<Tensor> {
        use crate::backend::Backend;
        match self {
            BenchBackend::Cpu(_) => Ok(Tensor::Host(v)),
            BenchBackend::Cuda(b) => b.to_device(Tensor::Host(v)),
        }
    }

    /// Waits for queued device work (a timed call ends with it).
    fn sync(&self) -> anyhow::Result<()> {
        match self {
            BenchBackend::Cpu(_) => Ok(()),
            BenchBackend::Cuda(b) => Ok(b.synchronize()?),
        }
    }

    /// The trailing-update variants the sweep rows are timed with: both on CUDA (cuBLAS, the default, then
    /// the FFMA kernel), the CPU's own GEMM otherwise.
    fn trailing_variants(&self) -> Vec<Option<TrailingVariant>> {
        match self {
            BenchBackend::Cpu(_) => vec![None],
            BenchBackend::Cuda(_) => {
                vec![Some(TrailingVariant::Cublas), Some(TrailingVariant::Ffma)]
            }
        }
    }

    /// Selects trailing variant `v` (CUDA; the CPU has one GEMM).
    fn set_trailing(&mut self, v: Option<TrailingVariant>) {
        if let (BenchBackend::Cuda(b), Some(v)) = (self, v) {
            b.set_trailing_variant(v);
        }
    }

    /// The inversions the large-factor rows are timed with: both on CUDA (trtri, strsm), none on the CPU.
    fn factor_variants(&self) -> Vec<Option<FactorVariant>> {
        match self {
            BenchBackend::Cpu(_) => vec![None],
            BenchBackend::Cuda(_) => FactorVariant::ALL.map(Some).to_vec(),
        }
    }

    /// Selects factor variant `v` (CUDA) and returns the row label with the variant in use (trtri when cuBLAS
    /// cannot be opened).
    fn set_factor(&mut self, v: Option<FactorVariant>) -> &'static str {
        let BenchBackend::Cuda(b) = self else {
            return "factor (H_col)";
        };
        if let Some(v) = v {
            b.set_factor_variant(v);
        }
        match b.factor_variant_in_use() {
            FactorVariant::Trtri => "factor (H_col, potrf + trtri)",
            FactorVariant::Trsm => "factor (H_col, potrf + strsm)",
        }
    }

    /// The GPTQ block variants the gptq_sweep rows are timed with: both on CUDA (v1 one warp per 32 rows, v2
    /// four), none on the CPU.
    fn gptq_block_variants(&self) -> Vec<Option<GptqBlockVariant>> {
        match self {
            BenchBackend::Cpu(_) => vec![None],
            BenchBackend::Cuda(_) => GptqBlockVariant::ALL.map(Some).to_vec(),
        }
    }

    /// Selects GPTQ block variant `v` and trailing variant `t` (CUDA) and returns the row label with the
    /// variants in use (v1 when v2 cannot be loaded, FFMA when cuBLAS cannot be opened).
    fn set_gptq(
        &mut self,
        v: Option<GptqBlockVariant>,
        t: Option<TrailingVariant>,
    ) -> &'static str {
        self.set_trailing(t);
        let BenchBackend::Cuda(b) = self else {
            return "gptq_sweep";
        };
        if let Some(v) = v {
            b.set_gptq_block_variant(v);
        }
        match (b.gptq_block_variant_in_use(), b.trailing_variant_in_use()) {
            (GptqBlockVariant::Lane, TrailingVariant::Cublas) => "gptq_sweep (block v1, cuBLAS)",
            (GptqBlockVariant::Lane, TrailingVariant::Ffma) => "gptq_sweep (block v1, FFMA v1)",
            (GptqBlockVariant::Split, TrailingVariant::Cublas) => "gptq_sweep (block v2, cuBLAS)",
            (GptqBlockVariant::Split, TrailingVariant::Ffma) => "gptq_sweep (block v2, FFMA v1)",
        }
    }

    /// The BoA block variants the boa_sweep rows are timed with: both on CUDA (v1 32 columns, v2 128), none
    /// on the CPU (its own blocked sweep).
    fn boa_block_variants(&self) -> Vec<Option<BoaBlockVariant>> {
        match self {
            BenchBackend::Cpu(_) => vec![None],
            BenchBackend::Cuda(_) => BoaBlockVariant::ALL.map(Some).to_vec(),
        }
    }

    /// Selects BoA block variant `v` and trailing variant `t` (CUDA) and returns the row label with the
    /// variants in use (v1 when v2 cannot be loaded, FFMA when cuBLAS cannot be opened).
    fn set_boa(&mut self, v: Option<BoaBlockVariant>, t: Option<TrailingVariant>) -> &'static str {
        self.set_trailing(t);
        let BenchBackend::Cuda(b) = self else {
            return "boa_sweep";
        };
        if let Some(v) = v {
            b.set_boa_block_variant(v);
        }
        match (b.boa_block_variant_in_use(), b.trailing_variant_in_use()) {
            (BoaBlockVariant::W32, TrailingVariant::Cublas) => "boa_sweep (B 32 v1, cuBLAS)",
            (BoaBlockVariant::W32, TrailingVariant::Ffma) => "boa_sweep (B 32 v1, FFMA v1)",
            (BoaBlockVariant::W128, TrailingVariant::Cublas) => "boa_sweep (B 128 v2, cuBLAS)",
            (BoaBlockVariant::W128, TrailingVariant::Ffma) => "boa_sweep (B 128 v2, FFMA v1)",
        }
    }
}

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) + rng.random_range(-1.0f32..1.0))
        .collect()
}

/// An upper-triangular U with a positive diagonal and small off-diagonal entries (a stand-in for
/// chol(H⁻¹)ᵀ: the sweeps' cost does not depend on its values, only that they are finite).
fn upper(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        u[i * n + i] = 1.0 + rng.random_range(0.0f32..0.5);
        for j in i + 1..n {
            u[i * n + j] = rng.random_range(-0.5f32..0.5) / (n as f32).sqrt();
        }
    }
    u
}

fn spd(rng: &mut ChaCha8Rng, n: usize, count: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(count * n * n);
    for _ in 0..count {
        let a = randn(rng, 2 * n * n);
        let mut h = vec![0f32; n * n];
        for r in 0..2 * n {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += a[r * n + i] * a[r * n + j] / (2 * n) as f32;
                }
            }
        }
        for i in 0..n {
            h[i * n + i] += 0.5;
        }
        out.extend(h);
    }
    out
}

/// A diagonally dominant SPD matrix in O(n²) (off-diagonals ±0.5/√n, diagonal 1–1.5): Cholesky's cost does
/// not depend on the values, and the AᵀA of `spd` would take minutes at d_ff = 28672.
fn spd_cheap(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    let mut h = vec![0f32; n * n];
    for i in 0..n {
        h[i * n + i] = 1.0 + rng.random_range(0.0f32..0.5);
        for j in i + 1..n {
            let v = rng.random_range(-0.5f32..0.5) / (n as f32).sqrt();
            h[i * n + j] = v;
            h[j * n + i] = v;
        }
    }
    h
}

fn row_grids(w: &[f32], rows: usize, n: usize, maxq: u32) -> Vec<Grid<f32>> {
    (0..rows)
        .map(|r| minmax_grid(&w[r * n..(r + 1) * n], maxq, false))
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `f(i)` then a synchronization (i = run index, so inputs can alternate): one warm-up, then `reps`
/// runs; the median wall time. The first error stops the timing and is returned.
fn time(
    b: &BenchBackend,
    reps: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, Option<f64>)> {
    f(1)?;
    b.sync()?;
    let mut wall = Vec::new();
    for i in 0..reps.max(1) {
        let t0 = Instant::now();
        f(i)?;
        b.sync()?;
        wall.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok((median(wall), None))
}

/// Static per-row grids as the backend holds them.
fn grids_of(b: &BenchBackend, g: &[Grid<f32>], rows: usize) -> anyhow::Result<Grids> {
    Ok(Grids {
        scale: b.place(Mat::f32(g.iter().map(|x| x.scale).collect(), 1, rows, 1))?,
        zero: b.place(Mat::f32(g.iter().map(|x| x.zero).collect(), 1, rows, 1))?,
    })
}

/// CPU ceilings: a 256 MiB copy (bytes read + written) and a 1024³ f32 GEMM through faer.
fn cpu_ceilings() -> (f64, f64) {
    let n = 1 << 26;
    let src = vec![1.5f32; n];
    let mut dst = vec![0f32; n];
    let copy_ms = median(
        (0..3)
            .map(|_| {
                let t0 = Instant::now();
                dst.copy_from_slice(&src);
                std::hint::black_box(&dst);
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    let k = 1024;
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let a = faer::Mat::<f32>::from_fn(k, k, |_, _| rng.random_range(-1.0f32..1.0));
    let gemm_ms = median(
        (0..3)
            .map(|_| {
                let t0 = Instant::now();
                let c = &a * &a;
                std::hint::black_box(&c);
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    (
        8.0 * n as f64 / (copy_ms * 1e-3) / 1e9,
        2.0 * (k as f64).powi(3) / (gemm_ms * 1e-3) / 1e12,
    )
}

/// A zero matrix of `m`'s shape where the backend computes (W − 0 is a fresh copy of W for a sweep to consume).
fn zeros_like(b: &BenchBackend, m: &Mat) -> anyhow::Result<Mat> {
    b.place(Mat::f32(vec![0.0; m.len()], m.batch, m.rows, m.cols))
}

/// Runs the QuantOps methods on each shape. `tokens`: calibration tokens per call (one sequence for the V
/// statistics).
pub fn bench_quant_ops(
    b: &mut BenchBackend,
    shapes: &[LayerShape],
    tokens: usize,
    reps: usize,
    out: &mut dyn Write,
) -> anyhow::Result<BenchReport> {
    let (copy_gbs, compute_tflops, ceiling_note) = match b {
        BenchBackend::Cpu(_) => {
            let (c, g) = cpu_ceilings();
            (c, g, "CPU: memcpy GB/s, faer f32 GEMM TFLOP/s")
        }
        BenchBackend::Cuda(cb) => {
            let c = cb
                .measure_ceilings()
                .map_err(|e| anyhow::anyhow!("measuring the device ceilings: {e}"))?;
            (
                c.copy_gbs,
                c.mma_tflops,
                "CUDA: 1 GiB device copy GB/s, bf16 mma.sync TFLOP/s (cuda/ceiling.cu)",
            )
        }
    };
    let mut sink = Sink {
        report: BenchReport {
            backend: b.name(),
            copy_gbs,
            compute_tflops,
            ceiling_note,
            tokens,
            rows: Vec::new(),
        },
        out,
    };
    sink.out.write_all(sink.report.header().as_bytes())?;
    // First the two kernels nothing else measures (attn_x: V's statistics; the packed GEMM: eval and serving),
    // so a bench cut off by gpu_check.sh's deadline has them.
    if let BenchBackend::Cuda(cb) = &*b {
        for r in attn_x_rows(cb, shapes, tokens, reps)? {
            sink.push(r)?;
        }
        for r in packed_gemm_rows(cb, reps)? {
            sink.push(r)?;
        }
        // Two batched launches beside what they replaced (an MoE chunk's expert Grams, R4's transform).
        let batched = super::gpu_batched::expert_gram_rows(cb, tokens, reps)?
            .into_iter()
            .chain(super::gpu_batched::hadamard_rows(cb, tokens, reps)?);
        for m in batched {
            sink.push(BenchRow {
                method: m.method,
                shape: m.shape,
                wall_ms: m.wall_ms,
                kernel_ms: None,
                work: m.work,
                ceiling: match m.bandwidth_bound {
                    true => Ceiling::Bandwidth,
                    false => Ceiling::Compute,
                },
                layer_scale: 1.0,
            })?;
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let m = tokens;
    for s in shapes {
        let tag = |what: String| format!("{} {what}", s.name);
        let ops = b.ops();

        // XᵀX of the attention/MLP input (d) and of the down_proj input (d_ff).
        for d in [s.d, s.d_ff] {
            let xs = [
                b.place_t(randn(&mut rng, m * d))?,
                b.place_t(randn(&mut rng, m * d))?,
            ];
            let mut acc = ops.stat_acc(1, d)?;
            let (wall, kern) = time(b, reps, |i| ops.stat_xxt(&mut acc, &xs[i % 2], m))?;
            sink.push(BenchRow {
                method: "stat_xxt",
                shape: tag(format!("m={m} d={d}")),
                wall_ms: wall,
                kernel_ms: kern,
                work: 2.0 * m as f64 * (d * d) as f64,
                ceiling: Ceiling::Compute,
                layer_scale: 1.0,
            })?;
        }

        // Per-head covariance of post-RoPE queries.
        {
            let w = s.h * s.d_h;
            let xs = [
                b.place_t(randn(&mut rng, m * w))?,
                b.place_t(randn(&mut rng, m * w))?,
            ];
            let mut acc = ops.stat_acc(s.h, s.d_h)?;
            let (wall, kern) = time(b, reps, |i| ops.stat_head_cov(&mut acc, &xs[i % 2], m))?;
            sink.push(BenchRow {
                method: "stat_head_cov",
                shape: tag(format!("m={m} heads={} d_h={}", s.h, s.d_h)),
                wall_ms: wall,
                kernel_ms: kern,
                work: 2.0 * m as f64 * (s.h * s.d_h * s.d_h) as f64,
                ceiling: Ceiling::Compute,
                layer_scale: 1.0,
            })?;
        }

        // V column statistics on V_HEADS query heads (GQA ratio kept), one sequence.
        {
            let gs = s.h / s.h_kv;
            let h = V_HEADS.max(gs).min(s.h);
            let a = AttnShape {
                t: m,
                h,
                h_kv: (h / gs).max(1),
                d_h: s.d_h,
                d: s.d,
                window: None,
            };
            let x = b.place_t(randn(&mut rng, m * s.d))?;
            let q = b.place_t(randn(&mut rng, m * a.h * s.d_h))?;
            let k = b.place_t(randn(&mut rng, m * a.h_kv * s.d_h))?;
            let mut acc = ops.stat_acc(a.h_kv, s.d)?;
            let (t, d) = (m as f64, s.d as f64);
            // On CUDA, v2 (the attn_x kernel, then the Gram) and v3 (cuBLAS around the softmax kernel) side by
            // side on the same inputs; elsewhere the backend's one way.
            let variants: Vec<(&str, Option<crate::backend::cuda::AttnXVariant>)> = match &*b {
                BenchBackend::Cuda(_) => vec![
                    (
                        "v2 attn_x",
                        Some(crate::backend::cuda::AttnXVariant::Bf16Wmma),
                    ),
                    ("v3 cuBLAS", Some(crate::backend::cuda::AttnXVariant::Gemm)),
                ],
                BenchBackend::Cpu(_) => vec![("", None)],
            };
            for (name, v) in variants {
                let (wall, kern) = time(b, reps, |_| match (&*b, v) {
                    (BenchBackend::Cuda(cb), Some(v)) => {
                        cb.stat_v_col_with(v, &mut acc, &x, &q, &k, a, 1)
                    }
                    _ => ops.stat_v_col(&mut acc, &x, &q, &k, a, 1),
                })?;
                sink.push(BenchRow {
                    method: "stat_v_col",
                    shape: tag(match name {
                        "" => format!("t={m} heads={h}/{} d={}", s.h, s.d),
                        n => format!("t={m} heads={h}/{} d={} ({n})", s.h, s.d),
                    }),
                    wall_ms: wall,
                    kernel_ms: kern,
                    // scores (causal half) + A·X (causal half) + the Gram, per head
                    work: h as f64 * (t * t * s.d_h as f64 + t * t * d + 2.0 * t * d * d),
                    ceiling: Ceiling::Compute,
                    layer_scale: s.h as f64 / h as f64,
                })?;
            }
        }

        // Batched factor of every head's H_row.
        {
            let hs = [
                b.place(Mat::f32(spd(&mut rng, s.d_h, s.h), s.h, s.d_h, s.d_h))?,
                b.place(Mat::f32(spd(&mut rng, s.d_h, s.h), s.h, s.d_h, s.d_h))?,
            ];
            let all: Vec<usize> = (0..s.h).collect();
            let (wall, kern) = time(b, reps, |i| {
                let (_, ok) = ops.factor(&hs[i % 2], None, &all)?;
                anyhow::ensure!(ok.iter().all(|&o| o), "an SPD H_row did not factor");
                Ok(())
            })?;
            sink.push(BenchRow {
                method: "factor (batched H_row)",
                shape: tag(format!("n={} count={}", s.d_h, s.h)),
                wall_ms: wall,
                kernel_ms: kern,
                work: s.h as f64 * 2.0 / 3.0 * (s.d_h as f64).powi(3),
                ceiling: Ceiling::Compute,
                layer_scale: 1.0,
            })?;
        }

        // U of the d_in-sized H_col of q/k/v, o, gate/up (d) and down (d_ff): the large-n route.
        let variants = b.factor_variants();
        for (n, v) in [s.d, s.d_ff]
            .into_iter()
            .flat_map(|n| variants.iter().map(move |&v| (n, v)))
        {
            let method = b.set_factor(v);
            let ops = b.ops();
            let h = b.place(Mat::f32(spd_cheap(&mut rng, n), 1, n, n))?;
            let (wall, kern) = time(b, reps.min(3), |_| {
                let (_, ok) = ops.factor(&h, None, &[0])?;
                anyhow::ensure!(ok[0], "an SPD H_col did not factor");
                Ok(())
            })?;
            sink.push(BenchRow {
                method,
                shape: tag(format!("n={n}")),
                wall_ms: wall,
                kernel_ms: kern,
                // potrf n³/3 + trtri n³/3 (strsm does n³: its row shows the work the result needs)
                work: 2.0 / 3.0 * (n as f64).powi(3),
                ceiling: Ceiling::Compute,
                layer_scale: 1.0,
            })?;
        }
        b.set_factor(Some(FactorVariant::Trtri));

        // GPTQ sweep of q_proj-sized (d × d) and down_proj-sized (d × d_ff) weights, 3-bit per channel, with
        // each block and trailing-update variant on the same inputs.
        let maxq = 7;
        for (rows_w, n) in [(s.d, s.d), (s.d, s.d_ff)] {
            let wv = randn(&mut rng, rows_w * n);
            let grids = row_grids(&wv, rows_w, n, maxq);
            let w = b.place(Mat::f32(wv, 1, rows_w, n))?;
            let u = b.place(Mat::f32(upper(&mut rng, n), 1, n, n))?;
            let col_group = vec![vec![0u32; n]];
            // Block variants side by side with each trailing variant, on the same inputs.
            let combos: Vec<_> = b
                .gptq_block_variants()
                .into_iter()
                .flat_map(|bv| b.trailing_variants().into_iter().map(move |t| (bv, t)))
                .collect();
            for (bv, v) in combos {
                let method = b.set_gptq(bv, v);
                let ops = b.ops();
                let (wall, kern) = time(b, reps, |_| {
                    let mode = GridMode::Static {
                        grids: grids_of(b, &grids, rows_w)?,
                        col_group: &col_group,
                    };
                    let wc = ops.sub(&w, &zeros_like(b, &w)?)?;
                    ops.gptq_sweep(wc, &u, mode, 128, maxq).map(|_| ())
                })?;
                sink.push(BenchRow {
                    method,
                    shape: tag(format!("{rows_w}×{n}")),
                    wall_ms: wall,
                    kernel_ms: kern,
                    // the error updates W −= E U over the upper triangle: rows·n² multiply-adds
                    work: rows_w as f64 * (n as f64).powi(2),
                    ceiling: Ceiling::Compute,
                    layer_scale: 1.0,
                })?;
            }
        }
        // Back to the defaults for anything timed after this.
        b.set_gptq(Some(GptqBlockVariant::Split), Some(TrailingVariant::Cublas));
        let ops = b.ops();

        // Hessian scale search (3-bit asymmetric per channel: 200 candidate slots per row) of a q_proj-sized
        // (d × d), a gate/up-sized (d_ff × d) and a down_proj-sized (d × d_ff) weight, through QuantOps (what
        // the pipeline calls) and, on CUDA, the device kernels' two variants side by side. Work counts the GEMM
        // formulation of the CUDA kernels: v1 (F32) slots · 2·rows·n² for V·H plus W·H in f32 SGEMM, against
        // the bf16 mma ceiling its fraction is low by design; v2 (Bf16Rescore) slots · 2·rows·n² in bf16 plus
        // SEARCH_TOP · 2·rows·n² of f32 re-score (v2's row names how many rows chose another grid than v1:
        // near-ties, see tests/parity_search.rs); the CPU's incremental search does far fewer flops for the same
        // result. Matrices over 48M weights (8B d×d_ff, 70B: 5–45 s a call on an H200 at f32) are left out so
        // the bench stays inside profiling/gpu_check.sh's limit.
        for (rows_w, n) in [(s.d, s.d), (s.d_ff, s.d), (s.d, s.d_ff)] {
            if rows_w * n > 48 << 20 {
                continue;
            }
            let spec = QuantSpec::new(3, None, false, ScaleSearch::Hessian);
            let wv = [randn(&mut rng, rows_w * n), randn(&mut rng, rows_w * n)];
            let hv = spd_cheap(&mut rng, n);
            let slots = SHRINK_STEPS * candidate_slots(&spec);
            let gemm = 2.0 * rows_w as f64 * (n as f64).powi(2);
            {
                let ws = [
                    b.place(Mat::f32(wv[0].clone(), 1, rows_w, n))?,
                    b.place(Mat::f32(wv[1].clone(), 1, rows_w, n))?,
                ];
                let h = b.place(Mat::f32(hv.clone(), 1, n, n))?;
                let idx = vec![(0..n).collect::<Vec<usize>>()];
                // Up to seconds per call: one timed call after the warm-up.
                let (wall, kern) = time(b, reps.min(1), |i| {
                    ops.search_grids(&ws[i % 2], Some(&h), &idx, &[0], n, &spec)
                        .map(|_| ())
                })?;
                sink.push(BenchRow {
                    // The work column counts the GEMM form's flops, which the CPU's incremental search
                    // skips: its "of ceiling" can pass 100%.
                    method: "search_grids (QuantOps; GEMM-form flops)",
                    shape: tag(format!("{rows_w}×{n}")),
                    wall_ms: wall,
                    kernel_ms: kern,
                    work: (slots + 1) as f64 * gemm,
                    ceiling: Ceiling::Compute,
                    layer_scale: 1.0,
                })?;
            }
            let BenchBackend::Cuda(cb) = &*b else {
                continue;
            };
            let mut chosen = Vec::new();
            for v in SearchVariant::ALL {
                let mut last = Vec::new();
                // Up to seconds per call on an H200 (v1): one timed call after the warm-up.
                let (wall, kern) = time(b, reps.min(1), |i| {
                    last = cb
                        .try_search_grids_with(v, &wv[i % 2], rows_w, n, &hv, &spec)
                        .map_err(|e| anyhow::anyhow!("search_grids {v:?} {rows_w}×{n}: {e}"))?;
                    Ok(())
                })?;
                let kern = kern.or(Some(cb.last_kernel_ms() as f64).filter(|k| k.is_finite()));
                let (method, extra, note) = match v {
                    SearchVariant::F32 => ("search_grids kernels v1 f32", 1, String::new()),
                    SearchVariant::Bf16Rescore => {
                        let differ = last.iter().zip(&chosen).filter(|(a, b)| a != b).count();
                        (
                            "search_grids kernels v2 bf16",
                            SEARCH_TOP,
                            format!(", {differ} rows ≠ v1"),
                        )
                    }
                };
                sink.push(BenchRow {
                    method,
                    shape: tag(format!("{rows_w}×{n}{note}")),
                    wall_ms: wall,
                    kernel_ms: kern,
                    work: (slots + extra) as f64 * gemm,
                    ceiling: Ceiling::Compute,
                    layer_scale: 1.0,
                })?;
                chosen = last;
            }
        }

        // BoA sweep of q_proj (shared U_col) with per-head U_row.
        {
            let (heads, n) = (s.h, s.d);
            let rows_w = heads * s.d_h;
            let wv = randn(&mut rng, rows_w * n);
            let grids = row_grids(&wv, rows_w, n, maxq);
            let w = b.place(Mat::f32(wv, 1, rows_w, n))?;
            let u = b.place(Mat::f32(upper(&mut rng, n), 1, n, n))?;
            let u_row: Vec<f32> = (0..heads).flat_map(|_| upper(&mut rng, s.d_h)).collect();
            let u_row = b.place(Mat::f32(u_row, heads, s.d_h, s.d_h))?;
            let col_group = vec![vec![0u32; n]];
            // Block variants side by side with each trailing variant: the same inputs for all four rows.
            let combos: Vec<_> = b
                .boa_block_variants()
                .into_iter()
                .flat_map(|bv| b.trailing_variants().into_iter().map(move |t| (bv, t)))
                .collect();
            for (bv, v) in combos {
                let method = b.set_boa(bv, v);
                let ops = b.ops();
                let (wall, kern) = time(b, reps, |_| {
                    let mode = GridMode::Static {
                        grids: grids_of(b, &grids, rows_w)?,
                        col_group: &col_group,
                    };
                    let wc = ops.sub(&w, &zeros_like(b, &w)?)?;
                    ops.boa_sweep(wc, &u, &u_row, s.d_h, 128, mode, maxq)
                        .map(|_| ())
                })?;
                sink.push(BenchRow {
                    method,
                    shape: tag(format!("{heads}×{}×{n}", s.d_h)),
                    wall_ms: wall,
                    kernel_ms: kern,
                    // own GPTQ updates (rows·n²) + cross-row terms (heads·d_h²/2·n)
                    work: rows_w as f64 * (n as f64).powi(2)
                        + heads as f64 * (s.d_h as f64).powi(2) / 2.0 * n as f64 * 2.0,
                    ceiling: Ceiling::Compute,
                    layer_scale: 1.0,
                })?;
            }
            // Back to the defaults for anything timed after this.
            b.set_boa(Some(BoaBlockVariant::W128), Some(TrailingVariant::Cublas));
        }

        // The error report's products of a down_proj (the widest H): tr(A H Aᵀ) of [W; ΔW_rtn; ΔW] in one call.
        {
            let ops = b.ops();
            let (rows_w, n) = (s.d, s.d_ff);
            let mats: Vec<Mat> = (0..3)
                .map(|_| b.place(Mat::f32(randn(&mut rng, rows_w * n), 1, rows_w, n)))
                .collect::<anyhow::Result<_>>()?;
            let h = b.place(Mat::f32(spd_cheap(&mut rng, n), 1, n, n))?;
            let refs: Vec<&Mat> = mats.iter().collect();
            let (wall, kern) = time(b, reps.min(3), |_| ops.quad_forms(&h, &refs).map(|_| ()))?;
            sink.push(BenchRow {
                method: "quad_forms (report)",
                shape: tag(format!("3×{rows_w}×{n}")),
                wall_ms: wall,
                kernel_ms: kern,
                work: 2.0 * 3.0 * rows_w as f64 * (n as f64).powi(2),
                ceiling: Ceiling::Compute,
                layer_scale: 1.0,
            })?;
        }
    }
    writeln!(sink.out, "{GOALS}")?;
    Ok(sink.report)
}

/// The rows as they are measured: kept for the report and written out at once, so a run cut off by a
/// timeout (gpu_check.sh caps the bench) still shows every row it finished.
struct Sink<'a> {
    report: BenchReport,
    out: &'a mut dyn Write,
}

impl Sink<'_> {
    fn push(&mut self, r: BenchRow) -> std::io::Result<()> {
        writeln!(self.out, "{}", self.report.row_line(&r))?;
        self.out.flush()?;
        self.report.rows.push(r);
        Ok(())
    }
}

/// Y = A_h X (cuda/hessian.cu attn_x, the bulk of v_col_covariance's attention work) for every variant side
/// by side, one sequence of `tokens` tokens per shape. Kernel time: events around back-to-back launches cycling
/// over the heads, divided by the launch count, median of `reps` (≥ 3); X stays in L2 across launches, as it
/// does across the heads of a sequence in the pipeline. Wall time: one whole `time_attn_x` call (uploads, the
/// stats, the launches). Work counts the useful causal flops (scores t²·d_h + P·X t²·d), not the diagonal
/// tiles or the scores each variant recomputes per column tile, so the TFLOP/s compare the variants directly.
/// Before timing, every variant's Y of head 0 is checked against v1 (f32, exact up to summation order).
fn attn_x_rows(
    cb: &CudaBackend,
    shapes: &[LayerShape],
    tokens: usize,
    reps: usize,
) -> anyhow::Result<Vec<BenchRow>> {
    use crate::backend::cuda::AttnXVariant;
    let mut rows = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(0xa77);
    let t = tokens;
    for s in shapes {
        let a = AttnShape {
            t,
            h: s.h,
            h_kv: s.h_kv,
            d_h: s.d_h,
            d: s.d,
            window: None,
        };
        let x = randn(&mut rng, t * s.d);
        let q = randn(&mut rng, t * s.h * s.d_h);
        let k = randn(&mut rng, t * s.h_kv * s.d_h);
        let launches = s.h.max(8);
        let mut y_v1: Option<Vec<f32>> = None;
        for v in AttnXVariant::KERNELS {
            let (mut kern, mut wall) = (Vec::new(), Vec::new());
            for _ in 0..reps.max(3) {
                let t0 = Instant::now();
                let (ms, y) = cb
                    .time_attn_x(v, &x, &q, &k, a, launches)
                    .map_err(|e| anyhow::anyhow!("attn_x {v:?} {} t={t}: {e}", s.name))?;
                wall.push(t0.elapsed().as_secs_f64() * 1e3);
                kern.push(ms);
                match &y_v1 {
                    None => y_v1 = Some(y),
                    Some(r) if kern.len() == 1 => {
                        let (num, den) = y.iter().zip(r).fold((0f64, 0f64), |(n, d), (&g, &c)| {
                            (n + (g as f64 - c as f64).powi(2), d + (c as f64).powi(2))
                        });
                        let err = (num / den.max(f64::MIN_POSITIVE)).sqrt();
                        // bf16 operands (tests/parity_quant.rs ATTN_BF16_TOL); NaN fails too.
                        if err.is_nan() || err > 1e-2 {
                            anyhow::bail!(
                                "attn_x {v:?} {} t={t}: rel. difference {err:e} from v1",
                                s.name
                            );
                        }
                    }
                    Some(_) => {}
                }
            }
            let (tf, df, dhf) = (t as f64, s.d as f64, s.d_h as f64);
            rows.push(BenchRow {
                method: "attn_x",
                shape: format!("{} t={t} d={} d_h={} ({v:?})", s.name, s.d, s.d_h),
                wall_ms: median(wall),
                kernel_ms: Some(median(kern)),
                work: tf * tf * dhf + tf * tf * df,
                ceiling: Ceiling::Compute,
                // one launch is one head of one sequence
                layer_scale: s.h as f64,
            });
        }
    }
    Ok(rows)
}

/// Bytes of distinct packed-weight copies the packed GEMM rows rotate through: over 2× the L2 of an H100/H200
/// (50 MiB), so each launch reads its weights from HBM, as a decode step does.
const QGEMM_ROTATE_BYTES: usize = 128 << 20;

/// Packed GEMM (cuda/qgemm.cu, CUDA only; the CPU's is `bench-qgemm`) at the decode batches 1, 4 and 16 on a
/// 7B q_proj (4096 × 4096) and gate/up (11008 × 4096), 2/3/4-bit with groups of 128, against the copy bandwidth.
/// Bytes count qweight + scales + zeros (f32 on the device) + X + Y, each once. Kernel time: events around
/// back-to-back launches over rotating copies, divided by the launch count (launch gaps included), median
/// of `reps` (≥ 3); wall time: one whole `try_packed_linear` call (uploads of the packed tensors and X,
/// download of Y). Each configuration is first checked against the CPU backend.
fn packed_gemm_rows(cb: &CudaBackend, reps: usize) -> anyhow::Result<Vec<BenchRow>> {
    use crate::backend::Backend;
    use crate::backend::cuda::qgemm::auto_variant;
    let mut rows = Vec::new();
    let mut rng = ChaCha8Rng::seed_from_u64(0x9e3);
    for (n, k) in [(4096usize, 4096usize), (11008, 4096)] {
        for bits in [2u32, 3, 4] {
            let p = crate::bench::qgemm::random_packed(n, k, bits, 128, rng.random());
            let copies = QGEMM_ROTATE_BYTES.div_ceil(p.bytes()).max(2);
            let ws = (0..copies)
                .map(|_| cb.upload_packed(&p))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("uploading {n}×{k} {bits}-bit: {e}"))?;
            for m in [1usize, 4, 16] {
                let x = randn(&mut rng, m * k);
                let variant = auto_variant(m);
                let mut kern = Vec::new();
                for _ in 0..reps.max(3) {
                    let (ms, y) = cb
                        .time_packed_linear(variant, &ws, &x, m, copies.max(20))
                        .map_err(|e| {
                            anyhow::anyhow!("packed_gemm {n}×{k} {bits}-bit m={m}: {e}")
                        })?;
                    if kern.is_empty() {
                        let cpu = CpuBackend.packed_linear(&x, &p, None, m)?;
                        let (num, den) =
                            y.iter().zip(&cpu).fold((0f64, 0f64), |(a, b), (&g, &c)| {
                                (a + (g as f64 - c as f64).powi(2), b + (c as f64).powi(2))
                            });
                        let err = (num / den.max(f64::MIN_POSITIVE)).sqrt();
                        // NaN fails too.
                        if err.is_nan() || err > 1e-4 {
                            anyhow::bail!(
                                "packed_gemm {n}×{k} {bits}-bit m={m}: rel. difference {err:e} from the CPU"
                            );
                        }
                    }
                    kern.push(ms);
                }
                let mut wall = Vec::new();
                for _ in 0..3 {
                    let t0 = Instant::now();
                    std::hint::black_box(
                        cb.try_packed_linear(&x, &p, None, m)
                            .map_err(|e| anyhow::anyhow!("packed_gemm {n}×{k} m={m}: {e}"))?,
                    );
                    wall.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                rows.push(BenchRow {
                    method: "packed_gemm",
                    shape: format!("{n}×{k} {bits}-bit g128 m={m} ({variant:?})"),
                    wall_ms: median(wall),
                    kernel_ms: Some(median(kern)),
                    work: 4.0
                        * (p.qweight.len() + p.scales.len() + p.zeros.len() + m * k + m * n) as f64,
                    ceiling: Ceiling::Bandwidth,
                    layer_scale: 1.0,
                });
            }
        }
    }
    Ok(rows)
}

const GOALS: &str = "goals (design.md §6, H200 kernel time): gptq_sweep 4096×4096 ≤ 5 ms; boa_sweep 32×128×4096 ≤ 10 ms";

impl BenchReport {
    /// The backend, the ceilings and the table's head.
    fn header(&self) -> String {
        format!(
            "backend: {}\nceilings ({}): copy {:.0} GB/s, compute {:.3} TFLOP/s; tokens per call {}\n\
             | method | shape | wall ms | kernel ms | per layer ms | achieved | of ceiling |\n\
             |---|---|---|---|---|---|---|\n",
            self.backend, self.ceiling_note, self.copy_gbs, self.compute_tflops, self.tokens
        )
    }

    /// One row of the table, with its rate against this report's ceilings.
    fn row_line(&self, r: &BenchRow) -> String {
        let t = r.kernel_ms.unwrap_or(r.wall_ms);
        let (achieved, frac) = match r.ceiling {
            Ceiling::Compute => {
                let tf = r.work / (t * 1e-3) / 1e12;
                (format!("{tf:.3} TFLOP/s"), tf / self.compute_tflops)
            }
            Ceiling::Bandwidth => {
                let gb = r.work / (t * 1e-3) / 1e9;
                (format!("{gb:.0} GB/s"), gb / self.copy_gbs)
            }
        };
        let kern = r
            .kernel_ms
            .map_or_else(|| "-".to_string(), |k| format!("{k:.3}"));
        format!(
            "| {} | {} | {:.3} | {} | {:.3} | {} | {:.1}% |",
            r.method,
            r.shape,
            r.wall_ms,
            kern,
            t * r.layer_scale,
            achieved,
            100.0 * frac
        )
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.header())?;
        for r in &self.rows {
            writeln!(f, "{}", self.row_line(r))?;
        }
        writeln!(f, "{GOALS}")
    }
}

/// The backend for `--device`: `cuda` fails with the reason when CUDA is unusable, `auto` falls back to
/// the CPU (and says why).
pub fn open_backend(
    device: crate::backend::Device,
) -> anyhow::Result<(BenchBackend, Option<String>)> {
    use crate::backend::Device;
    match device {
        Device::Cpu => Ok((BenchBackend::Cpu(CpuBackend), None)),
        Device::Cuda => CudaBackend::new(0)
            .map(|b| (BenchBackend::Cuda(Box::new(b)), None))
            .map_err(|why| anyhow::Error::new(crate::error::BoaError::NoCuda(why))),
        Device::Auto => Ok(match CudaBackend::new(0) {
            Ok(b) => (BenchBackend::Cuda(Box::new(b)), None),
            Err(why) => (
                BenchBackend::Cpu(CpuBackend),
                Some(format!("using the CPU: {why}")),
            ),
        }),
    }
}

/// Default shapes and tokens per device: real layers on CUDA; SmolLM's on the CPU so it finishes in seconds.
pub fn defaults(b: &BenchBackend) -> (Vec<LayerShape>, usize) {
    match b {
        BenchBackend::Cpu(_) => (vec![SHAPES[0]], 256),
        BenchBackend::Cuda(_) => (SHAPES[1..].to_vec(), 2048),
    }
}
