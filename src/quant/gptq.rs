//! GPTQ (design.md §4.2; the paper's Algorithm 2, with gptq.py's lazy batches and act-order).
//!
//! Symbols as in the paper: W (weights, rows independent), U = U_col = chol(H⁻¹)ᵀ (upper), Q (quantized
//! result), E (scaled errors of the current block), block bounds i1/i2 as in gptq.py.
//!
//! `gptq_quantize` is the algorithm, on any backend through `QuantOps`; `gptq_block_sweep` is the sweep
//! itself on host slices (generic over f32/f64), which the CPU backend runs and every device sweep is checked
//! against.

use super::Real;
use super::lattice::{SuperScale, lattice_grid, super_scale};
use super::linalg::{DEFAULT_DAMP, MAX_DAMP_TRIES};
use super::plan::FactorCache;
use super::profile::{Phase, timed};
use super::quantizer::{Grid, QuantSpec, ScaleSearch, dequantize, quant_dequant};
use crate::ops::Lattice;
use crate::ops::{GridMode, Mat, QuadSums, QuantOps, QuantizedLinear, Result, SweepError};
use anyhow::Context;
use rayon::prelude::*;

/// gptq.py's lazy-batch width B.
pub const DEFAULT_BLOCK_SIZE: usize = 128;

/// Options of a GPTQ (and BoA) sweep.
#[derive(Clone, Debug)]
pub struct GptqOptions {
    pub spec: QuantSpec,
    /// Lazy-batch width B (1 = column-at-a-time, Alg. 2 literally).
    pub block_size: usize,
    /// Process columns in descending diag(H) order.
    pub act_order: bool,
    /// Group grids computed before the sweep from the original weights (default: dynamic, searched when the
    /// sweep reaches each group's first column). Ignored for per-channel grids, which are always static.
    pub static_groups: bool,
    /// λ of the damping H += λ·mean(diag H)·I.
    pub damp: f64,
    pub max_damp_tries: usize,
    /// Value given to H_ii for dead inputs (design.md §4.2: 1/seqlen; the pipeline passes it).
    pub dead_diag: f64,
}

impl GptqOptions {
    /// The damping of the sweep's plan.
    pub fn damping(&self) -> super::plan::Damping {
        super::plan::Damping {
            damp: self.damp,
            max_tries: self.max_damp_tries,
            dead_diag: self.dead_diag,
        }
    }

    pub fn new(spec: QuantSpec) -> Self {
        Self {
            spec,
            block_size: DEFAULT_BLOCK_SIZE,
            act_order: false,
            static_groups: false,
            damp: DEFAULT_DAMP,
            max_damp_tries: MAX_DAMP_TRIES,
            dead_diag: 1.0,
        }
    }
}

/// A quantized matrix read back to the host (`to_host`): tests, tools and host-side exports look at it.
#[derive(Clone, Debug)]
pub struct Quantized<T = f32> {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    /// Ŵ [d_out × d_in], dequantized, original column order.
    pub w_hat: Vec<T>,
    /// q [d_out × d_in] in 0..=maxq, original order.
    pub codes: Vec<u8>,
    /// [d_out × n_groups].
    pub scales: Vec<T>,
    /// [d_out × n_groups], integer-valued (the true zero point, not GPTQ v1's zero − 1).
    pub zeros: Vec<T>,
    /// [d_in]: the group of each ORIGINAL input column.
    pub g_idx: Vec<u32>,
    pub n_groups: usize,
}

impl<T: Real> Quantized<T> {
    /// Ŵ recomputed from (codes, scales, zeros, g_idx): what a checkpoint loader computes.
    pub fn dequantize_from_codes(&self) -> Vec<T> {
        let mut out = vec![T::ZERO; self.d_out * self.d_in];
        for r in 0..self.d_out {
            for c in 0..self.d_in {
                let k = r * self.n_groups + self.g_idx[c] as usize;
                let q = T::from_f64(self.codes[r * self.d_in + c] as f64);
                out[r * self.d_in + c] = dequantize(q, self.scales[k], self.zeros[k]);
            }
        }
        out
    }
}

/// Dynamic group-wise grids of a sweep: group k covers sweep columns [k·g, min((k+1)·g, n)) and is searched
/// when the sweep reaches column k·g, from the current weights. On a K-quant lattice (`Lattice::Super`) the
/// super-block's d is searched first, at its first column (quant/lattice.rs).
pub struct DynamicGroups<'a> {
    pub g: usize,
    /// Per group, the [len × len] diagonal block of H in sweep order (f32; empty unless Hessian search).
    pub h_blocks: &'a [Vec<f32>],
    pub spec: &'a QuantSpec,
}

impl DynamicGroups<'_> {
    /// Columns of a super-block whose scale is fixed at its first column (None: groups only).
    pub fn super_len(&self) -> Option<usize> {
        match self.spec.lattice {
            Lattice::Super { len, .. } => Some(len),
            _ => None,
        }
    }

    /// Columns that must be searched together at their first one: the super-block, else the group.
    pub fn unit(&self) -> usize {
        self.super_len().unwrap_or(self.g)
    }

    fn h_block(&self, k: usize) -> Option<&[f32]> {
        (self.spec.search == ScaleSearch::Hessian).then(|| self.h_blocks[k].as_slice())
    }

    /// The grid of group k from its current weights `w` (`sup`: its super-block's scales on `Super`).
    pub fn grid<T: Real>(&self, w: &[T], k: usize, sup: SuperScale<T>) -> Grid<T> {
        match self.spec.lattice {
            // The free search itself: the grids (and so the codes) of every existing format, to the bit.
            Lattice::Free => super::quantizer::search_grid(w, self.h_block(k), self.spec),
            _ => lattice_grid(w, self.h_block(k), self.spec, sup),
        }
    }

    /// The super-block scales from its current weights `w` (all its columns), its first group k0.
    pub fn super_scale<T: Real>(&self, w: &[T], k0: usize) -> SuperScale<T> {
        let blocks: Vec<&[f32]> = match self.spec.search {
            ScaleSearch::Hessian => (k0..k0 + w.len().div_ceil(self.g))
                .map(|k| self.h_blocks[k].as_slice())
                .collect(),
            _ => Vec::new(),
        };
        super_scale(w, &blocks, self.g, self.spec)
    }
}

/// Rows per parallel task: depends on the shape only, so results do not depend on the thread count.
fn rows_per_task(rows: usize) -> usize {
    rows.div_ceil(16).clamp(1, 32)
}

/// The GPTQ sweep over `rows` independent rows (Alg. 2 with lazy batches of `block_size` columns).
///
/// * `w` [rows × n]: weights in sweep order; on return, column c holds its value when it was quantized.
/// * `q` [rows × n], `codes` [rows × n]: results Q (dequantized) and the integer codes.
/// * `u` [n × n]: U = chol(H⁻¹)ᵀ in sweep order, upper triangular.
/// * `grids` [rows × n_groups], `col_group` [n]: the grid of (row, col_group[c]); read for static grids,
///   written at group starts when `dynamic` is set.
///
/// With dynamic groups a block never ends inside a group that started inside it, so at a group's first column
/// every column of the group has received all earlier updates (same weights as the column-at-a-time sweep).
#[allow(clippy::too_many_arguments)]
pub fn gptq_block_sweep<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    u: &[T],
    rows: usize,
    n: usize,
    block_size: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    col_group: &[u32],
    dynamic: Option<&DynamicGroups>,
    maxq: u32,
) {
    assert!(
        w.len() == rows * n && q.len() == rows * n && codes.len() == rows * n,
        "W/Q/codes not [{rows} × {n}]"
    );
    assert_eq!(u.len(), n * n, "U is not [{n} × {n}]");
    assert_eq!(
        grids.len(),
        rows * n_groups,
        "grids not [{rows} × {n_groups}]"
    );
    assert_eq!(col_group.len(), n);
    assert!(block_size > 0);
    if rows == 0 || n == 0 {
        return;
    }
    let rc = rows_per_task(rows);
    w.par_chunks_mut(rc * n)
        .zip(q.par_chunks_mut(rc * n))
        .zip(codes.par_chunks_mut(rc * n))
        .zip(grids.par_chunks_mut(rc * n_groups))
        .for_each(|(((w, q), codes), grids)| {
            let rows = w.len() / n;
            sweep_rows(
                w, q, codes, u, rows, n, block_size, grids, n_groups, col_group, dynamic, maxq,
            )
        });
}

#[allow(clippy::too_many_arguments)]
fn sweep_rows<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    u: &[T],
    rows: usize,
    n: usize,
    bs: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    col_group: &[u32],
    dynamic: Option<&DynamicGroups>,
    maxq: u32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe {
            sweep_rows_avx2(
                w, q, codes, u, rows, n, bs, grids, n_groups, col_group, dynamic, maxq,
            )
        };
    }
    sweep_rows_impl(
        w, q, codes, u, rows, n, bs, grids, n_groups, col_group, dynamic, maxq,
    )
}

/// `sweep_rows_impl` compiled for AVX2 (no FMA: same bits as the baseline path).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep_rows_avx2<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    u: &[T],
    rows: usize,
    n: usize,
    bs: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    col_group: &[u32],
    dynamic: Option<&DynamicGroups>,
    maxq: u32,
) {
    sweep_rows_impl(
        w, q, codes, u, rows, n, bs, grids, n_groups, col_group, dynamic, maxq,
    )
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn sweep_rows_impl<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    u: &[T],
    rows: usize,
    n: usize,
    bs: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    col_group: &[u32],
    dynamic: Option<&DynamicGroups>,
    maxq: u32,
) {
    let maxq_t = T::from_f64(maxq as f64);
    let offset = dynamic.is_some_and(|dg| dg.spec.offset());
    let super_len = dynamic.and_then(|dg| dg.super_len());
    let mut sup = vec![SuperScale::default(); if super_len.is_some() { rows } else { 0 }];
    let mut e = vec![T::ZERO; rows * bs]; // E [rows × B] of the current block
    let mut i1 = 0;
    while i1 < n {
        let mut i2 = (i1 + bs).min(n);
        if let Some(dg) = dynamic {
            // Last group starting inside (i1, i2) must end by i2, else the block stops before it.
            let s = (i2 - 1) / dg.g * dg.g;
            if s > i1 && (s + dg.g).min(n) > i2 {
                i2 = s;
            }
        }
        if let Some(sl) = super_len {
            // A super-block starts a block: at its first column every column of it has every earlier
            // update, so its d is searched on the weights the column-at-a-time sweep would have.
            i2 = i2.min((i1 / sl + 1) * sl);
        }
        for c in i1..i2 {
            if let Some(dg) = dynamic
                && c % dg.g == 0
            {
                let k = c / dg.g;
                let len = dg.g.min(n - c);
                if let Some(sl) = super_len
                    && c % sl == 0
                {
                    let sn = sl.min(n - c);
                    for (r, s) in sup.iter_mut().enumerate() {
                        *s = dg.super_scale(&w[r * n + c..r * n + c + sn], k);
                    }
                }
                for r in 0..rows {
                    let s = sup.get(r).copied().unwrap_or_default();
                    grids[r * n_groups + k] = dg.grid(&w[r * n + c..r * n + c + len], k, s);
                }
            }
            let ucc = u[c * n + c];
            let urow = &u[c * n + c + 1..c * n + i2];
            for r in 0..rows {
                let gr = grids[r * n_groups + col_group[c] as usize];
                let wc = w[r * n + c];
                let (qc, qv) = quant_dequant(wc, gr, maxq_t, offset); // Alg. 2 l.4
                q[r * n + c] = qv;
                codes[r * n + c] = qc.to_f64() as u8;
                let err = (wc - qv) / ucc; // Alg. 2 l.5
                e[r * bs + c - i1] = err;
                // Alg. 2 l.6, inside the block only
                for (x, &uu) in w[r * n + c + 1..r * n + i2].iter_mut().zip(urow) {
                    *x -= err * uu;
                }
            }
        }
        // Lazy batch: W[:, i2:] −= E[:, i1:i2] · U[i1:i2, i2:] (one GEMM instead of i2−i1 rank-1 updates).
        if i2 < n {
            T::gemm_sub(
                &mut w[i2..],
                n,
                &e,
                bs,
                &u[i1 * n + i2..],
                n,
                rows,
                i2 - i1,
                n - i2,
            );
        }
        i1 = i2;
    }
}

/// Static-grid column map in sweep order: sweep column k is original column perm[k], in group perm[k] / g.
pub fn static_col_group(perm: &[usize], g: usize) -> Vec<u32> {
    perm.iter().map(|&c| (c / g) as u32).collect()
}

/// g_idx [d_in] of a sweep: the group each ORIGINAL column was quantized on (`col_group` in sweep order).
pub fn g_idx_of(perm: &[usize], col_group: &[u32]) -> Vec<u32> {
    let mut g_idx = vec![0u32; perm.len()];
    for (k, &c) in perm.iter().enumerate() {
        g_idx[c] = col_group[k];
    }
    g_idx
}

/// Whether the grids of a sweep are searched as it reaches each group (design.md §4.2: the default for
/// groups) rather than fixed before it.
pub fn dynamic_groups(spec: &QuantSpec, n: usize, static_groups: bool) -> bool {
    spec.group_size.is_some() && spec.group_len(n) < n && !static_groups
}

/// A sweep's grids on a GGUF lattice are searched as it goes (dynamic groups): a static grid there would
/// need the lattice's offset form in every backend's static sweep, which is not written.
pub(crate) fn check_lattice_dynamic(spec: &QuantSpec, dynamic: bool) -> Result<()> {
    if spec.lattice != Lattice::Free && !dynamic {
        return Err(crate::input_err!(
            "grids on a GGUF lattice ({:?}) need dynamic groups (no --static-groups, groups narrower than \
             the input)",
            spec.lattice
        ));
    }
    Ok(())
}

/// GPTQ-quantizes W [d_out × d_in] with H = H_col [d_in × d_in] (undamped, as the statistics give it),
/// through `ops`; the plan of `h` comes from `cache` when another layer of the block made it (same result,
/// one factorization fewer). The result's `error` is tr(ΔW H ΔWᵀ) from the sweep's own loss (`Swept::loss`,
/// minus the damping term), queued where the backend computed it.
pub fn gptq_quantize<'h>(
    ops: &dyn QuantOps,
    w: &Mat,
    h: &'h Mat,
    opts: &GptqOptions,
    cache: Option<&FactorCache<'h>>,
) -> Result<QuantizedLinear> {
    opts.spec.validate()?;
    let (d_out, d_in) = (w.rows, w.cols);
    if w.batch != 1 || h.batch != 1 || h.rows != d_in || h.cols != d_in {
        return Err(anyhow::anyhow!(
            "gptq_quantize: W {} and H {} do not fit",
            w.describe(),
            h.describe()
        ));
    }
    let plan = timed(ops, Phase::Factor, || match cache {
        Some(c) => c.plan(ops, h, &opts.damping(), opts.act_order),
        None => super::plan::plan(ops, h, &opts.damping(), opts.act_order).map(std::sync::Arc::new),
    })
    .context("factor")?;
    let perm = &plan.perm[0];
    let g = opts.spec.group_len(d_in);
    let w0 = ops
        .zero_cols(w, &plan.dead)
        .context("sweep setup (dead inputs)")?;
    let dynamic = dynamic_groups(&opts.spec, d_in, opts.static_groups);
    check_lattice_dynamic(&opts.spec, dynamic)?;
    let hessian = opts.spec.search == ScaleSearch::Hessian;
    let (wp, col_group, mode_grids) = if dynamic {
        let (wp, _) = ops
            .reorder(&w0, None, &identity(d_out), &plan.perm)
            .context("sweep setup (the sweep order)")?;
        (wp, (0..d_in).map(|c| (c / g) as u32).collect(), None)
    } else {
        // Static grids from the original rows, each group over original columns (design.md §4.2).
        let grids = timed(ops, Phase::Search, || {
            ops.search_grids(
                &w0,
                hessian.then_some(&plan.h_p),
                &plan.inv,
                &[0],
                g,
                &opts.spec,
            )
        })
        .context("scale search")?;
        let (wp, grids) = ops
            .reorder(&w0, Some(&grids), &identity(d_out), &plan.perm)
            .context("sweep setup (the sweep order)")?;
        (wp, static_col_group(perm, g), grids)
    };
    drop(w0);
    let col_groups = [col_group];
    let mode = match mode_grids {
        Some(grids) => GridMode::Static {
            grids,
            col_group: &col_groups,
        },
        None => GridMode::Dynamic {
            g,
            h: hessian.then_some(&plan.h_p),
            spec: &opts.spec,
        },
    };
    let mut swept = timed(ops, Phase::Sweep, || {
        ops.gptq_sweep(wp, &plan.u, mode, opts.block_size, opts.spec.maxq())
    })
    .context("sweep")?;
    let error = SweepError {
        sums: std::mem::replace(&mut swept.loss, QuadSums::Host(Vec::new())),
        damp: plan.damp[0],
    };
    let (w_hat, codes, grids) = ops
        .unorder(swept, &identity(d_out), &plan.perm)
        .context("sweep (back to the original order)")?;
    Ok(QuantizedLinear {
        d_out,
        d_in,
        bits: opts.spec.bits,
        w_hat,
        codes,
        grids,
        g_idx: g_idx_of(perm, &col_groups[0]),
        error: Some(error),
    })
}

pub(crate) fn identity(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// A quantized linear read back to the host, in `T` (the backend's values converted).
pub fn to_host<T: Real>(ops: &dyn QuantOps, q: &QuantizedLinear) -> Result<Quantized<T>> {
    let conv = |v: Vec<f64>| -> Vec<T> { v.into_iter().map(T::from_f64).collect() };
    Ok(Quantized {
        d_out: q.d_out,
        d_in: q.d_in,
        bits: q.bits,
        w_hat: conv(ops.read_f64(&q.w_hat)?),
        codes: ops.read_codes(&q.codes)?,
        scales: conv(ops.read_f64(&q.grids.scale)?),
        zeros: conv(ops.read_f64(&q.grids.zero)?),
        g_idx: q.g_idx.clone(),
        n_groups: q.n_groups(),
    })
}
