//! GPTQ (design.md §4.2; the paper's Algorithm 2, with gptq.py's lazy batches and act-order).
//!
//! Symbols as in the paper: W (weights, rows independent), U = U_col = chol(H⁻¹)ᵀ (upper), Q (quantized
//! result), E (scaled errors of the current block), block bounds i1/i2 as in gptq.py.

use super::Real;
use super::linalg::{
    DEFAULT_DAMP, MAX_DAMP_TRIES, act_order_perm, damped_upper_inverse_batch, fix_dead_inputs,
    permute_sym,
};
use super::profile::{Phase, timed};
use super::quantizer::{
    Grid, QuantSpec, ScaleSearch, dequantize, quantize, search_grid, search_grids_rows,
};
use crate::backend::quant_ops::{QuantOps, StaticGrids};
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

/// A quantized matrix, enough for a packed GPTQ checkpoint (qweight/qzeros/scales/g_idx).
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
/// when the sweep reaches column k·g, from the current weights.
pub struct DynamicGroups<'a> {
    pub g: usize,
    /// Per group, the [len × len] diagonal block of H in sweep order (f32; empty unless Hessian search).
    pub h_blocks: &'a [Vec<f32>],
    pub spec: &'a QuantSpec,
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
        for c in i1..i2 {
            if let Some(dg) = dynamic
                && c % dg.g == 0
            {
                let k = c / dg.g;
                let len = dg.g.min(n - c);
                let hb =
                    (dg.spec.search == ScaleSearch::Hessian).then(|| dg.h_blocks[k].as_slice());
                for r in 0..rows {
                    grids[r * n_groups + k] =
                        search_grid(&w[r * n + c..r * n + c + len], hb, dg.spec);
                }
            }
            let ucc = u[c * n + c];
            let urow = &u[c * n + c + 1..c * n + i2];
            for r in 0..rows {
                let gr = grids[r * n_groups + col_group[c] as usize];
                let wc = w[r * n + c];
                let qc = quantize(wc, gr.scale, gr.zero, maxq_t); // Alg. 2 l.4
                let qv = dequantize(qc, gr.scale, gr.zero);
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

/// The [len × len] block of H over ORIGINAL columns c0..c0+len, read from the permuted H_p (inv = perm⁻¹), f32.
fn orig_block_f32(h_p: &[f64], n: usize, inv: &[usize], c0: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * len);
    for a in c0..c0 + len {
        for b in c0..c0 + len {
            out.push(h_p[inv[a] * n + inv[b]] as f32);
        }
    }
    out
}

/// Everything a sweep needs besides W: U, grids and the column → group map, in sweep order.
pub(crate) struct SweepPlan<T> {
    pub perm: Vec<usize>,
    pub u: Vec<T>,
    pub col_group: Vec<u32>,
    pub n_groups: usize,
    /// Dynamic groups: H blocks per group (sweep order). None for static grids.
    pub dyn_blocks: Option<Vec<Vec<f32>>>,
    /// Damped H in sweep order.
    pub h_p: Vec<f64>,
    pub inv: Vec<usize>,
    /// Dead inputs (H_ii = 0, original order): their columns of W are zeroed (`zero_dead_columns`).
    pub dead: Vec<usize>,
}

impl<T: Real> SweepPlan<T> {
    /// Zeroes the dead-input columns of every row of `w` [rows × n] (design.md §4.2).
    pub fn zero_dead_columns(&self, w: &mut [T], n: usize) {
        for &c in &self.dead {
            for row in w.chunks_mut(n) {
                row[c] = T::ZERO;
            }
        }
    }
}

/// f32 bytes of H a batch of [`plan_sweeps`] hands to the backend in one call: with V's per-head H_col
/// (32 × 4096² for a 7B layer, 2 GiB of f32) the batch, the factors coming back and their f64 copies would
/// otherwise all be alive at once; 512 MiB is 8 heads of 4096, 2 of 8192.
pub(crate) const FACTOR_BATCH_BYTES: usize = 512 << 20;

/// Dead inputs, act-order permutation, damping and U for one H_col; zeroes dead columns of every row of `w`.
/// U is factorized by `ops` when given (see [`gptq_quantize_with`]).
pub(crate) fn plan_sweep<T: Real>(
    w: &mut [T],
    n: usize,
    h: &[f64],
    opts: &GptqOptions,
    act_order: bool,
    ops: Option<&dyn QuantOps>,
) -> anyhow::Result<SweepPlan<T>> {
    let plan = plan_sweeps::<T>(&[h], n, opts, act_order, ops).remove(0)?;
    plan.zero_dead_columns(w, n);
    Ok(plan)
}

/// [`plan_sweep`] of several H_col [n × n] at once (W untouched: the caller zeroes each plan's dead columns),
/// their factors in batches of ≤ FACTOR_BATCH_BYTES through one `damped_upper_inverse_batch` each, so a
/// device factors a batch in one call per damping round instead of one call per matrix. Each result is what
/// `plan_sweep` gives for that H alone (the factors are independent). One result per H, in order.
pub(crate) fn plan_sweeps<T: Real>(
    hs: &[&[f64]],
    n: usize,
    opts: &GptqOptions,
    act_order: bool,
    ops: Option<&dyn QuantOps>,
) -> Vec<anyhow::Result<SweepPlan<T>>> {
    let per_call = (FACTOR_BATCH_BYTES / (n * n * 4).max(1)).max(1);
    plan_sweeps_batched(hs, n, opts, act_order, ops, per_call)
}

/// [`plan_sweeps`] with at most `per_call` matrices per factor batch.
fn plan_sweeps_batched<T: Real>(
    hs: &[&[f64]],
    n: usize,
    opts: &GptqOptions,
    act_order: bool,
    ops: Option<&dyn QuantOps>,
    per_call: usize,
) -> Vec<anyhow::Result<SweepPlan<T>>> {
    let mut out = Vec::with_capacity(hs.len());
    for chunk in hs.chunks(per_call) {
        // Dead inputs and act-order (diag(H) only: gptq.py's argsort of the diagonal), then H in sweep order.
        let mut prepared = Vec::with_capacity(chunk.len());
        let mut h_ps = Vec::with_capacity(chunk.len());
        for &h in chunk {
            assert_eq!(h.len(), n * n, "H is not [{n} × {n}]");
            let mut h = h.to_vec();
            let dead = fix_dead_inputs(&mut h, n, opts.dead_diag);
            let perm: Vec<usize> = if act_order {
                act_order_perm(&h, n)
            } else {
                (0..n).collect()
            };
            let mut inv = vec![0; n];
            for (k, &c) in perm.iter().enumerate() {
                inv[c] = k;
            }
            h_ps.push(permute_sym(&h, n, &perm));
            prepared.push((dead, perm, inv));
        }
        let us = damped_upper_inverse_batch(&mut h_ps, n, opts.damp, opts.max_damp_tries, ops);
        for (((dead, perm, inv), h_p), u) in prepared.into_iter().zip(h_ps).zip(us) {
            out.push(
                u.map(|u| finish_plan(&opts.spec, n, opts.static_groups, perm, inv, h_p, &u, dead)),
            );
        }
    }
    out
}

/// The grouping of a plan (column → group, dynamic H blocks) around its factor.
#[allow(clippy::too_many_arguments)]
fn finish_plan<T: Real>(
    spec: &QuantSpec,
    n: usize,
    static_groups: bool,
    perm: Vec<usize>,
    inv: Vec<usize>,
    h_p: Vec<f64>,
    u: &[f64],
    dead: Vec<usize>,
) -> SweepPlan<T> {
    let g = spec.group_len(n);
    let n_groups = spec.n_groups(n);
    let grouped = spec.group_size.is_some() && g < n;
    let (col_group, dyn_blocks) = if grouped && !static_groups {
        let blocks = if spec.search == ScaleSearch::Hessian {
            (0..n_groups)
                .map(|k| super::quantizer::h_block_f32(&h_p, n, k * g, g.min(n - k * g)))
                .collect()
        } else {
            vec![Vec::new(); n_groups]
        };
        ((0..n).map(|c| (c / g) as u32).collect(), Some(blocks))
    } else {
        (perm.iter().map(|&c| (c / g) as u32).collect(), None)
    };
    SweepPlan {
        perm,
        u: u.iter().map(|&x| T::from_f64(x)).collect(),
        col_group,
        n_groups,
        dyn_blocks,
        h_p,
        inv,
        dead,
    }
}

/// What a plan depends on besides H itself: the options of `plan_sweep` and where U is factored.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PlanKey {
    n: usize,
    act_order: bool,
    static_groups: bool,
    spec: QuantSpec,
    damp: f64,
    max_damp_tries: usize,
    dead_diag: f64,
    /// Factored by a backend (f32) or by quant:: (f64): different U.
    on_backend: bool,
}

/// The sweep plans (U = chol(H⁻¹)ᵀ and the rest) of one block, shared by the layers that read the same
/// H_col: q_proj and k_proj (and v_proj under GPTQ) all read the attention input's covariance, gate_proj and
/// up_proj the MLP input's, and without sharing each factors it again (on a GPU one extra 4096 and one
/// extra 11008 factor per 7B layer).
///
/// An H is recognised by identity (the same slice, which the `'h` borrow keeps alive and unchanged), and the
/// plan by the options it was computed with (`PlanKey`), so a hit returns exactly what planning again would
/// (same bits: planning is deterministic, damping retries included — the cached plan is the damped result).
/// Act-order's permutation depends on diag(H) only (never on the weights), so it is keyed by the flag.
/// Only the last plan is kept: the block's order (q, k, v, o, gate, up, down) puts the sharers next to each
/// other, and a d_ff-sized plan (1.5 GB for 11008) is not held longer than its layers need it.
pub struct FactorCache<'h, T> {
    last: std::sync::Mutex<Option<CachedPlan<'h, T>>>,
    hits: std::sync::atomic::AtomicUsize,
}

/// The H a plan was made for (by identity), its key and the plan.
type CachedPlan<'h, T> = (&'h [f64], PlanKey, std::sync::Arc<SweepPlan<T>>);

impl<T> Default for FactorCache<'_, T> {
    fn default() -> Self {
        FactorCache {
            last: std::sync::Mutex::new(None),
            hits: std::sync::atomic::AtomicUsize::new(0),
        }
    }
}

impl<'h, T: Real> FactorCache<'h, T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Plans served from the cache so far.
    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `plan_sweep` of `h` through the cache: the dead columns of `w` are zeroed either way.
    pub(crate) fn plan(
        &self,
        w: &mut [T],
        n: usize,
        h: &'h [f64],
        opts: &GptqOptions,
        act_order: bool,
        ops: Option<&dyn QuantOps>,
    ) -> anyhow::Result<std::sync::Arc<SweepPlan<T>>> {
        let key = PlanKey {
            n,
            act_order,
            static_groups: opts.static_groups,
            spec: opts.spec,
            damp: opts.damp,
            max_damp_tries: opts.max_damp_tries,
            dead_diag: opts.dead_diag,
            on_backend: ops.is_some(),
        };
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((ch, ck, plan)) = last.as_ref()
            && std::ptr::eq(*ch, h)
            && *ck == key
        {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            plan.zero_dead_columns(w, n);
            return Ok(plan.clone());
        }
        // Drop the old plan before computing the new one (peak memory: one plan, not two).
        *last = None;
        let plan = std::sync::Arc::new(plan_sweep(w, n, h, opts, act_order, ops)?);
        *last = Some((h, key, plan.clone()));
        Ok(plan)
    }
}

/// Static grids [rows × n_groups] from the ORIGINAL rows `w` [rows × n] (per channel, or static groups over
/// original columns), scored with the damped H. The Hessian search goes through `ops.search_grids` (f32) when
/// `ops` is given; MinMax / Mse, and everything without `ops`, run here.
pub(crate) fn static_grids<T: Real>(
    w: &[T],
    rows: usize,
    n: usize,
    plan: &SweepPlan<T>,
    spec: &QuantSpec,
    ops: Option<&dyn QuantOps>,
) -> Vec<Grid<T>> {
    let g = spec.group_len(n);
    let mut grids = vec![Grid::default(); rows * plan.n_groups];
    for k in 0..plan.n_groups {
        let len = g.min(n - k * g);
        let hb = (spec.search == ScaleSearch::Hessian)
            .then(|| orig_block_f32(&plan.h_p, n, &plan.inv, k * g, len));
        let gk = match (ops, &hb) {
            (Some(ops), Some(hb)) => {
                let wk: Vec<f32> = (0..rows)
                    .flat_map(|r| to_f32(&w[r * n + k * g..r * n + k * g + len]))
                    .collect();
                grids_from_f32(&ops.search_grids(&wk, rows, len, hb, spec))
            }
            _ => search_grids_rows(w, rows, n, k * g, len, hb.as_deref(), spec),
        };
        assert_eq!(
            gk.len(),
            rows,
            "search_grids returned {} grids for {rows} rows",
            gk.len()
        );
        for r in 0..rows {
            grids[r * plan.n_groups + k] = gk[r];
        }
    }
    grids
}

pub(crate) fn to_f32<T: Real>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f64() as f32).collect()
}

pub(crate) fn grids_f32<T: Real>(g: &[Grid<T>]) -> Vec<Grid<f32>> {
    g.iter()
        .map(|x| Grid {
            scale: x.scale.to_f64() as f32,
            zero: x.zero.to_f64() as f32,
        })
        .collect()
}

pub(crate) fn from_f32<T: Real>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f64(x as f64)).collect()
}

pub(crate) fn grids_from_f32<T: Real>(g: &[Grid<f32>]) -> Vec<Grid<T>> {
    g.iter()
        .map(|x| Grid {
            scale: T::from_f64(x.scale as f64),
            zero: T::from_f64(x.zero as f64),
        })
        .collect()
}

/// Gathers columns: out[:, k] = w[:, perm[k]].
pub(crate) fn permute_cols<T: Copy>(w: &[T], n: usize, perm: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(w.len());
    for row in w.chunks(n) {
        out.extend(perm.iter().map(|&c| row[c]));
    }
    out
}

/// Scatters columns back: out[:, perm[k]] = w[:, k].
pub(crate) fn unpermute_cols<T: Copy + Default>(w: &[T], n: usize, perm: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); w.len()];
    for (orow, row) in out.chunks_mut(n).zip(w.chunks(n)) {
        for (k, &c) in perm.iter().enumerate() {
            orow[c] = row[k];
        }
    }
    out
}

/// GPTQ-quantizes W [d_out × d_in] with H = H_col [d_in × d_in] (f64, undamped; see `hessian`).
pub fn gptq_quantize<T: Real>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: &[f64],
    opts: &GptqOptions,
) -> anyhow::Result<Quantized<T>> {
    gptq_quantize_with(w, d_out, d_in, h, opts, None)
}

/// [`gptq_quantize`] with U factorized and the sweep run by a backend's `QuantOps` (f32) when `ops` is given;
/// with dynamic groups the backend calls back into this crate's `search_grid` at every group start.
pub fn gptq_quantize_with<T: Real>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: &[f64],
    opts: &GptqOptions,
    ops: Option<&dyn QuantOps>,
) -> anyhow::Result<Quantized<T>> {
    gptq_quantize_cached(w, d_out, d_in, h, opts, ops, None)
}

/// [`gptq_quantize_with`] taking the plan of `h` from `cache` when another layer of the block planned it
/// (same result, one factorization fewer).
pub fn gptq_quantize_cached<'h, T: Real>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: &'h [f64],
    opts: &GptqOptions,
    ops: Option<&dyn QuantOps>,
    cache: Option<&FactorCache<'h, T>>,
) -> anyhow::Result<Quantized<T>> {
    opts.spec.validate()?;
    assert_eq!(w.len(), d_out * d_in, "W is not [{d_out} × {d_in}]");
    let mut w0 = w.to_vec();
    let plan = timed(Phase::Factor, || match cache {
        Some(c) => c.plan(&mut w0, d_in, h, opts, opts.act_order, ops),
        None => {
            plan_sweep::<T>(&mut w0, d_in, h, opts, opts.act_order, ops).map(std::sync::Arc::new)
        }
    })?;
    let mut grids = match plan.dyn_blocks {
        Some(_) => vec![Grid::default(); d_out * plan.n_groups],
        None => timed(Phase::Search, || {
            static_grids(&w0, d_out, d_in, &plan, &opts.spec, ops)
        }),
    };
    let mut wp = permute_cols(&w0, d_in, &plan.perm);
    let mut qp = vec![T::ZERO; d_out * d_in];
    let mut cp = vec![0u8; d_out * d_in];
    let dynamic = plan.dyn_blocks.as_ref().map(|b| DynamicGroups {
        g: opts.spec.group_len(d_in),
        h_blocks: b,
        spec: &opts.spec,
    });
    timed(Phase::Sweep, || match (ops, dynamic.as_ref()) {
        (Some(ops), None) => {
            let grids32 = grids_f32(&grids);
            let r = ops.gptq_sweep(
                &to_f32(&wp),
                &to_f32(&plan.u),
                d_out,
                d_in,
                opts.block_size,
                StaticGrids {
                    grids: &grids32,
                    n_groups: plan.n_groups,
                    col_group: &plan.col_group,
                },
                opts.spec.maxq(),
            );
            qp = from_f32(&r.q);
            cp = r.codes;
        }
        (Some(ops), Some(dg)) => {
            let (r, g) = ops.gptq_sweep_dynamic(
                &to_f32(&wp),
                &to_f32(&plan.u),
                d_out,
                d_in,
                opts.block_size,
                dg,
                opts.spec.maxq(),
            );
            qp = from_f32(&r.q);
            cp = r.codes;
            grids = grids_from_f32(&g);
        }
        (None, _) => gptq_block_sweep(
            &mut wp,
            &mut qp,
            &mut cp,
            &plan.u,
            d_out,
            d_in,
            opts.block_size,
            &mut grids,
            plan.n_groups,
            &plan.col_group,
            dynamic.as_ref(),
            opts.spec.maxq(),
        ),
    });
    let mut g_idx = vec![0u32; d_in];
    for (k, &c) in plan.perm.iter().enumerate() {
        g_idx[c] = plan.col_group[k];
    }
    Ok(Quantized {
        d_out,
        d_in,
        bits: opts.spec.bits,
        w_hat: unpermute_cols(&qp, d_in, &plan.perm),
        codes: unpermute_cols(&cp, d_in, &plan.perm),
        scales: grids.iter().map(|g| g.scale).collect(),
        zeros: grids.iter().map(|g| g.zero).collect(),
        g_idx,
        n_groups: plan.n_groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Batched planning (V's per-head H_col) gives each H exactly the plan it gets alone, in order, whatever
    /// the batch split, on quant::'s f64 route and through a backend; a singular H fails alone.
    #[test]
    fn plan_sweeps_in_batches_equal_one_at_a_time() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let n = 12;
        let mut hs: Vec<Vec<f64>> = (0..5)
            .map(|_| {
                let x: Vec<f64> = (0..3 * n * n)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let mut h = vec![0.0; n * n];
                for r in 0..3 * n {
                    for i in 0..n {
                        for j in 0..n {
                            h[i * n + j] += x[r * n + i] * x[r * n + j];
                        }
                    }
                }
                h
            })
            .collect();
        // H 1 has a dead input; H 3 stays singular (NaN survives any damping).
        for j in 0..n {
            hs[1][4 * n + j] = 0.0;
            hs[1][j * n + 4] = 0.0;
        }
        hs[3][0] = f64::NAN;
        let refs: Vec<&[f64]> = hs.iter().map(|h| h.as_slice()).collect();
        let mut opts = GptqOptions::new(QuantSpec::new(3, Some(5), false, ScaleSearch::Hessian));
        opts.act_order = true;
        for ops in [None, Some(&CpuBackend as &dyn QuantOps)] {
            for per_call in [1, 2, 5] {
                let batched = plan_sweeps_batched::<f32>(&refs, n, &opts, true, ops, per_call);
                assert_eq!(batched.len(), hs.len());
                for (i, (b, h)) in batched.iter().zip(&refs).enumerate() {
                    let mut w = vec![1f32; 2 * n];
                    let alone = plan_sweep::<f32>(&mut w, n, h, &opts, true, ops);
                    match (b, alone) {
                        (Ok(b), Ok(a)) => {
                            assert_eq!(b.u, a.u, "H {i}, per_call {per_call}: U");
                            assert_eq!(b.perm, a.perm, "H {i}: perm");
                            assert_eq!(b.h_p, a.h_p, "H {i}: damped H");
                            assert_eq!(b.col_group, a.col_group, "H {i}: groups");
                            assert_eq!(b.dyn_blocks, a.dyn_blocks, "H {i}: H blocks");
                            assert_eq!(b.dead, a.dead, "H {i}: dead inputs");
                            assert_eq!(b.dead, if i == 1 { vec![4] } else { vec![] });
                            assert_eq!(w[4] == 0.0, i == 1, "H {i}: dead column zeroed");
                        }
                        (Err(_), Err(_)) => assert_eq!(i, 3, "only H 3 is singular"),
                        _ => panic!("H {i}, per_call {per_call}: batched and alone disagree"),
                    }
                }
            }
        }
    }
}
