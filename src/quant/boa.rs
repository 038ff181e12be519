//! BoA (design.md §4.3; the paper's Algorithm 1 with Proposition 3.1 / Eq. (12)).
//!
//! For an attention projection W [n_heads·d_h × d_in] (rows grouped by head), H_h = H_col,h ⊗ H_row,h
//! (Table 1). U_col,h = chol(H_col,h⁻¹)ᵀ, U_row,h = chol(H_row,h⁻¹)ᵀ (Alg. 1 l.5–6). For j = 0..d_h−1 the j-th
//! rows of all heads are stacked into W⁽ʲ⁾ (l.8) and GPTQ-swept, each with its head's U_col (l.9); then the
//! remaining rows of each head get the cross-row update (l.10, Eq. (12)):
//!   W_h[i, :] −= (U_row,h[j, i] / U_row,h[j, j]) · (E_h U_col,h),  i > j,
//! where E_h U_col,h = W_h[j, :]_before − Q_h[j, :] exactly (the GPTQ sweep moves every column of the row
//! to its quantized value, so the row's total change is its error times U_col): a rank-1 update per head,
//! no d_in × d_in GEMM per row. `boa_sweep_rowwise` is that order; `boa_sweep` (what `boa_quantize` runs)
//! visits the same grid in 2-D blocks, which gives the same codes (§4.3, last two paragraphs) with one
//! trailing GEMM per column block for all the rows of a head instead of one per row.

use super::Real;
use super::gptq::{
    DynamicGroups, GptqOptions, dynamic_groups, g_idx_of, gptq_block_sweep, static_col_group,
};
use super::lattice::SuperScale;
use super::plan::{FactorCache, Plan, plan};
use super::profile::{Phase, timed};
use super::quantizer::{Grid, ScaleSearch, quant_dequant};
use crate::ops::{GridMode, Mat, QuantOps, QuantizedLinear, Result};
use anyhow::Context;
use rayon::prelude::*;
use std::sync::Arc;

/// H_col of an attention projection.
#[derive(Clone, Copy)]
pub enum ColHessian<'a> {
    /// One [d_in × d_in] H_col for every head (W_Q, W_K: 2XXᵀ).
    Shared(&'a Mat),
    /// [n_heads × d_in × d_in], one per head (W_V: the attention-weighted input covariance).
    PerHead(&'a Mat),
}

#[derive(Clone, Debug)]
pub struct BoaOptions {
    /// Quantizer, lazy-batch width, static/dynamic groups, damping (shared with GPTQ).
    pub gptq: GptqOptions,
    /// Columns by descending diag H_col (per H_col).
    pub act_order_col: bool,
    /// Rows of each head by descending diag H_row,h.
    pub act_order_row: bool,
}

impl BoaOptions {
    pub fn new(gptq: GptqOptions) -> Self {
        Self {
            gptq,
            act_order_col: false,
            act_order_row: false,
        }
    }
}

/// The column factor one or more heads share: U_col (sweep order), column → group map, dynamic groups.
pub struct ColFactor<'a, T> {
    /// [n × n] U_col, upper.
    pub u: &'a [T],
    /// [n] sweep column → group.
    pub col_group: &'a [u32],
    pub dynamic: Option<DynamicGroups<'a>>,
}

/// One column factor's share of a step j: (W⁽ʲ⁾ before the sweep, Q, codes, grids).
type Swept<T> = (Vec<T>, Vec<T>, Vec<u8>, Vec<Grid<T>>);

/// The head-wise BoA sweep in the row-by-row order of Alg. 1 l.7–11, in sweep order (rows and columns
/// already permuted per head). The oracle of `boa_sweep`, which visits the same grid in 2-D blocks.
///
/// * `w` [n_heads × d_h × n]: per head, its rows; on return each row holds its values after all cross-row
///   updates and before its own GPTQ sweep.
/// * `q`, `codes` [n_heads × d_h × n]: results.
/// * `cols`: the distinct column factors; `head_col[h]` indexes the one of head h.
/// * `u_row` [n_heads × d_h × d_h]: U_row,h, upper.
/// * `grids` [n_heads × d_h × n_groups]: static grids in, or dynamic grids out.
#[allow(clippy::too_many_arguments)]
pub fn boa_sweep_rowwise<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    cols: &[ColFactor<T>],
    head_col: &[usize],
    u_row: &[T],
    n_heads: usize,
    d_h: usize,
    n: usize,
    block_size: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    maxq: u32,
) {
    let hs = d_h * n; // head stride
    assert!(w.len() == n_heads * hs && q.len() == w.len() && codes.len() == w.len());
    assert_eq!(u_row.len(), n_heads * d_h * d_h);
    assert_eq!(grids.len(), n_heads * d_h * n_groups);
    assert_eq!(head_col.len(), n_heads);
    // Heads sharing a column factor are swept together (rows of W⁽ʲ⁾ are independent).
    let members: Vec<Vec<usize>> = (0..cols.len())
        .map(|f| (0..n_heads).filter(|&h| head_col[h] == f).collect())
        .collect();
    for j in 0..d_h {
        // Alg. 1 l.8–9: stack the j-th rows, GPTQ-sweep them.
        let swept: Vec<Swept<T>> = members
            .par_iter()
            .zip(cols.par_iter())
            .map(|(heads, cf)| {
                let rows = heads.len();
                let mut wj = Vec::with_capacity(rows * n);
                let mut gj = Vec::with_capacity(rows * n_groups);
                for &h in heads {
                    wj.extend_from_slice(&w[h * hs + j * n..h * hs + (j + 1) * n]);
                    let g0 = (h * d_h + j) * n_groups;
                    gj.extend_from_slice(&grids[g0..g0 + n_groups]);
                }
                let w_before = wj.clone();
                let mut qj = vec![T::ZERO; rows * n];
                let mut cj = vec![0u8; rows * n];
                gptq_block_sweep(
                    &mut wj,
                    &mut qj,
                    &mut cj,
                    cf.u,
                    rows,
                    n,
                    block_size,
                    &mut gj,
                    n_groups,
                    cf.col_group,
                    cf.dynamic.as_ref(),
                    maxq,
                );
                (w_before, qj, cj, gj)
            })
            .collect();
        for (heads, (w_before, qj, cj, gj)) in members.iter().zip(&swept) {
            for (k, &h) in heads.iter().enumerate() {
                let o = h * hs + j * n;
                q[o..o + n].copy_from_slice(&qj[k * n..(k + 1) * n]);
                codes[o..o + n].copy_from_slice(&cj[k * n..(k + 1) * n]);
                let g0 = (h * d_h + j) * n_groups;
                grids[g0..g0 + n_groups].copy_from_slice(&gj[k * n_groups..(k + 1) * n_groups]);
                w[o..o + n].copy_from_slice(&w_before[k * n..(k + 1) * n]);
            }
        }
        // Alg. 1 l.10, Eq. (12): W_h[i, :] −= (U_row[j, i]/U_row[j, j])·(W_h[j, :]_before − Q_h[j, :]), i > j.
        w.par_chunks_mut(hs)
            .zip(q.par_chunks(hs))
            .enumerate()
            .for_each(|(h, (wh, qh))| {
                let ur = &u_row[h * d_h * d_h..(h + 1) * d_h * d_h];
                let (done, rest) = wh.split_at_mut((j + 1) * n);
                let delta: Vec<T> = done[j * n..]
                    .iter()
                    .zip(&qh[j * n..(j + 1) * n])
                    .map(|(&a, &b)| a - b)
                    .collect();
                for (ii, row) in rest.chunks_mut(n).enumerate() {
                    let i = j + 1 + ii;
                    let f = ur[j * d_h + i] / ur[j * d_h + j];
                    for (x, &d) in row.iter_mut().zip(&delta) {
                        *x -= f * d;
                    }
                }
            });
    }
}

/// Rows a task of `boa_sweep` aims for: its heads' column loops interleave (independent dependency chains)
/// and share one trailing GEMM, but too many would leave cores idle. Depends on the shape only, so results do
/// not depend on the thread count.
const TASK_ROWS: usize = 128;

/// The head-wise BoA sweep (Alg. 1 l.7–11) blocked in 2-D (design.md §4.3, last two paragraphs), in sweep
/// order (rows and columns already permuted per head). Same arguments and results as `boa_sweep_rowwise`.
///
/// BoA is GPTQ over vec(W_h) with U = U_row ⊗ U_col, so element (j, c) may be quantized as soon as every
/// (j'', c'') ≤ (j, c) has been. Columns go in blocks of B; within a block, rows go in order, and row j first
/// takes the cross-row terms of rows i < j over the block, Σ_i (U_row[i, j]/U_row[i, i])·δ_i with δ_i = (row
/// i's value after its cross-row updates) − q_i, then runs GPTQ's column loop over the block. After a block,
/// the trailing GPTQ update of all rows is one GEMM. Heads never interact, so they run in parallel, each task
/// over all blocks without barriers.
///
/// With dynamic groups, blocks hold whole groups (B rounded down to a multiple of g, or g if g > B), so at a
/// group's first column every column of the group has all its cross-row and GPTQ updates, as in the
/// row-by-row order. Values agree with `boa_sweep_rowwise` up to rounding (the trailing updates are summed in a
/// different order), so codes agree except where a value or a scale search sits on a rounding knife edge.
#[allow(clippy::too_many_arguments)]
pub fn boa_sweep<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    cols: &[ColFactor<T>],
    head_col: &[usize],
    u_row: &[T],
    n_heads: usize,
    d_h: usize,
    n: usize,
    block_size: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    maxq: u32,
) {
    let hs = d_h * n;
    assert!(w.len() == n_heads * hs && q.len() == w.len() && codes.len() == w.len());
    assert_eq!(u_row.len(), n_heads * d_h * d_h);
    assert_eq!(grids.len(), n_heads * d_h * n_groups);
    assert_eq!(head_col.len(), n_heads);
    assert!(block_size > 0);
    if n_heads == 0 || d_h == 0 || n == 0 {
        return;
    }
    // Tasks: runs of consecutive heads with one column factor (their trailing updates share U_col).
    let max_heads = TASK_ROWS.div_ceil(d_h);
    let mut tasks = Vec::new();
    let (mut rest_w, mut rest_q, mut rest_c, mut rest_g, mut rest_u) = (w, q, codes, grids, u_row);
    let mut h0 = 0;
    while h0 < n_heads {
        let mut h1 = h0 + 1;
        while h1 < n_heads && h1 - h0 < max_heads && head_col[h1] == head_col[h0] {
            h1 += 1;
        }
        let nh = h1 - h0;
        let (tw, rw) = rest_w.split_at_mut(nh * hs);
        let (tq, rq) = rest_q.split_at_mut(nh * hs);
        let (tc, rc) = rest_c.split_at_mut(nh * hs);
        let (tg, rg) = rest_g.split_at_mut(nh * d_h * n_groups);
        let (tu, ru) = rest_u.split_at(nh * d_h * d_h);
        tasks.push((&cols[head_col[h0]], nh, tw, tq, tc, tg, tu));
        (rest_w, rest_q, rest_c, rest_g, rest_u) = (rw, rq, rc, rg, ru);
        h0 = h1;
    }
    tasks
        .into_par_iter()
        .for_each(|(cf, nh, w, q, codes, grids, u_row)| {
            sweep_heads(
                w, q, codes, cf, u_row, nh, d_h, n, block_size, grids, n_groups, maxq,
            )
        });
}

/// `boa_sweep` for `nh` consecutive heads sharing one column factor.
#[allow(clippy::too_many_arguments)]
fn sweep_heads<T: Real>(
    w: &mut [T],
    q: &mut [T],
    codes: &mut [u8],
    cf: &ColFactor<T>,
    u_row: &[T],
    nh: usize,
    d_h: usize,
    n: usize,
    block_size: usize,
    grids: &mut [Grid<T>],
    n_groups: usize,
    maxq: u32,
) {
    let rows = nh * d_h;
    let u = cf.u;
    let maxq_t = T::from_f64(maxq as f64);
    let dynamic = cf.dynamic.as_ref();
    let offset = dynamic.is_some_and(|dg| dg.spec.offset());
    // A dynamic group (a K-quant super-block: `unit`) is searched over all its columns at its first one, so
    // it must lie in one block: only then have the rows above already quantized, and handed down their
    // cross-row terms for, all of it.
    let bw = match dynamic.map(|dg| dg.unit()) {
        Some(u) if u <= block_size => block_size / u * u,
        Some(u) => u,
        None => block_size,
    };
    let mut sup = vec![SuperScale::default(); nh];
    // U_row[i, j] / U_row[i, i], computed as the row-by-row sweep does (same bits).
    let f: Vec<T> = (0..nh * d_h * d_h)
        .map(|k| {
            let (h, i, j) = (k / (d_h * d_h), k / d_h % d_h, k % d_h);
            let ur = &u_row[h * d_h * d_h..];
            if j > i {
                ur[i * d_h + j] / ur[i * d_h + i]
            } else {
                T::ZERO
            }
        })
        .collect();
    // −(the trailing GPTQ updates so far), kept apart from w so that δ (w after the cross-row updates − q)
    // stays at hand.
    let mut acc = vec![T::ZERO; rows * n];
    let mut e = vec![T::ZERO; rows * bw];
    let mut delta = vec![T::ZERO; rows * bw];
    // Working values of row j of every head of the task over the block, [nh × bw].
    let mut x = vec![T::ZERO; nh * bw];
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + bw).min(n);
        let len = i2 - i1;
        for j in 0..d_h {
            for (h, xh) in x.chunks_mut(bw).enumerate() {
                let o = (h * d_h + j) * n + i1;
                let wr = &mut w[o..o + len];
                // Eq. (12) over this block, rows i < j in ascending order as the row-by-row sweep adds them.
                for i in 0..j {
                    let fij = f[(h * d_h + i) * d_h + j];
                    let di = &delta[(h * d_h + i) * bw..(h * d_h + i) * bw + len];
                    for (a, &d) in wr.iter_mut().zip(di) {
                        *a -= fij * d;
                    }
                }
                for ((xv, &a), &t) in xh.iter_mut().zip(wr.iter()).zip(&acc[o..o + len]) {
                    *xv = a + t;
                }
            }
            // GPTQ's column loop over the block, the heads interleaved column by column: their chains
            // (quantize → error → update of the next column) are independent, so their latencies overlap.
            for k in 0..len {
                let c = i1 + k;
                let ucc = u[c * n + c];
                let urow = &u[c * n + c + 1..c * n + i2];
                let group_start = dynamic
                    .filter(|dg| c % dg.g == 0)
                    .map(|dg| (dg, c / dg.g, dg.g.min(n - c)));
                let super_start = dynamic
                    .and_then(|dg| dg.super_len())
                    .is_some_and(|sl| c % sl == 0);
                let cg = cf.col_group[c] as usize;
                for (h, xh) in x.chunks_mut(bw).enumerate() {
                    let row = h * d_h + j;
                    let gr_row = &mut grids[row * n_groups..(row + 1) * n_groups];
                    if let Some((dg, g, gl)) = group_start {
                        if super_start {
                            // The whole super-block is in this block (bw is a multiple of it).
                            let sn = dg.unit().min(n - c);
                            sup[h] = dg.super_scale(&xh[k..k + sn], g);
                        }
                        gr_row[g] = dg.grid(&xh[k..k + gl], g, sup[h]);
                    }
                    let gr = gr_row[cg];
                    let (head, tail) = xh[..len].split_at_mut(k + 1);
                    let wc = head[k];
                    let (qc, qv) = quant_dequant(wc, gr, maxq_t, offset);
                    q[row * n + c] = qv;
                    codes[row * n + c] = qc.to_f64() as u8;
                    let err = (wc - qv) / ucc;
                    e[row * bw + k] = err;
                    for (xv, &uu) in tail.iter_mut().zip(urow) {
                        *xv -= err * uu;
                    }
                }
            }
            for h in 0..nh {
                let (row, o) = (h * d_h + j, (h * d_h + j) * n + i1);
                let dr = &mut delta[row * bw..row * bw + len];
                for ((d, &a), &qv) in dr.iter_mut().zip(&w[o..o + len]).zip(&q[o..o + len]) {
                    *d = a - qv;
                }
            }
        }
        // Lazy batch of all rows: acc[:, i2:] −= E[:, block] · U_col[block, i2:].
        if i2 < n {
            T::gemm_sub(
                &mut acc[i2..],
                n,
                &e,
                bw,
                &u[i1 * n + i2..],
                n,
                rows,
                len,
                n - i2,
            );
        }
        i1 = i2;
    }
}

/// BoA-quantizes an attention projection W [n_heads·d_h × d_in] (head h owns rows h·d_h..(h+1)·d_h) through
/// `ops`. `h_row` [n_heads × d_h × d_h] are the undamped H_row,h (identity for V by default). A shared H_col's
/// plan comes from `cache` when another layer of the block made it (W_Q and W_K read the same H_col); per-head
/// H_col (W_V) are V's own.
#[allow(clippy::too_many_arguments)]
pub fn boa_quantize<'h>(
    ops: &dyn QuantOps,
    w: &Mat,
    n_heads: usize,
    d_h: usize,
    h_col: ColHessian<'h>,
    h_row: &Mat,
    opts: &BoaOptions,
    cache: Option<&FactorCache<'h>>,
) -> Result<QuantizedLinear> {
    let g = &opts.gptq;
    g.spec.validate()?;
    let (d_out, n) = (n_heads * d_h, w.cols);
    let (hc, per_head) = match h_col {
        ColHessian::Shared(m) => (m, false),
        ColHessian::PerHead(m) => (m, true),
    };
    if w.batch != 1
        || w.rows != d_out
        || hc.rows != n
        || hc.cols != n
        || hc.batch != if per_head { n_heads } else { 1 }
        || h_row.batch != n_heads
        || h_row.rows != d_h
        || h_row.cols != d_h
    {
        return Err(anyhow::anyhow!(
            "boa_quantize: W {}, H_col {} and H_row {} do not fit {n_heads} heads of {d_h} rows",
            w.describe(),
            hc.describe(),
            h_row.describe()
        ));
    }
    // One g_idx per matrix: with per-head H_col (V) and act_order_col the heads' column orders differ, so
    // grouped grids would need a g_idx per head, which no checkpoint format has.
    if per_head && opts.act_order_col && g.spec.n_groups(n) > 1 {
        return Err(crate::input_err!(
            "BoA with per-head H_col, act_order_col and groups has no single g_idx; disable act_order_col for V"
        ));
    }
    // Column factors (Alg. 1 l.5–6, H_col side): one shared plan, or one per head in one batch.
    let cols: Arc<Plan> = timed(ops, Phase::Factor, || match (cache, per_head) {
        (Some(c), false) => c.plan(ops, hc, &g.damping(), opts.act_order_col),
        _ => plan(ops, hc, &g.damping(), opts.act_order_col).map(Arc::new),
    })
    .map_err(|e| e.context("factor of H_col"))?;
    let head_col: Vec<usize> = (0..n_heads).map(|h| if per_head { h } else { 0 }).collect();
    // Row factors (Alg. 1 l.5–6, H_row side), all heads in one batch; a dead row input gets H_ii = 1.
    let row_damping = super::plan::Damping {
        dead_diag: 1.0,
        ..g.damping()
    };
    let rows = timed(ops, Phase::Factor, || {
        plan(ops, h_row, &row_damping, opts.act_order_row)
    })
    .map_err(|e| e.context("factor of H_row"))?;

    let dead: Vec<Vec<usize>> = head_col.iter().map(|&f| cols.dead[f].clone()).collect();
    let w0 = ops
        .zero_cols(w, &dead)
        .context("sweep setup (dead inputs)")?;
    let gl = g.spec.group_len(n);
    let dynamic = dynamic_groups(&g.spec, n, g.static_groups);
    super::gptq::check_lattice_dynamic(&g.spec, dynamic)?;
    let hessian = g.spec.search == ScaleSearch::Hessian;
    // Sweep order: rows of each head by its row permutation, columns by its column factor's permutation.
    let row_perm: Vec<usize> = (0..n_heads)
        .flat_map(|h| rows.perm[h].iter().map(move |&r| h * d_h + r))
        .collect();
    let col_perms: Vec<Vec<usize>> = head_col.iter().map(|&f| cols.perm[f].clone()).collect();
    let col_group: Vec<Vec<u32>> = if dynamic {
        vec![(0..n).map(|c| (c / gl) as u32).collect(); cols.batch()]
    } else {
        cols.perm.iter().map(|p| static_col_group(p, gl)).collect()
    };
    let (wp, mode) = if dynamic {
        let (wp, _) = ops
            .reorder(&w0, None, &row_perm, &col_perms)
            .context("sweep setup (the sweep order)")?;
        let mode = GridMode::Dynamic {
            g: gl,
            h: hessian.then_some(&cols.h_p),
            spec: &g.spec,
        };
        (wp, mode)
    } else {
        // Static grids from the original rows, head by head (each head scores with its H_col).
        let grids = timed(ops, Phase::Search, || {
            ops.search_grids(
                &w0,
                hessian.then_some(&cols.h_p),
                &cols.inv,
                &head_col,
                gl,
                &g.spec,
            )
        })
        .context("scale search")?;
        let (wp, grids) = ops
            .reorder(&w0, Some(&grids), &row_perm, &col_perms)
            .context("sweep setup (the sweep order)")?;
        let grids = grids.expect("reorder returns the grids it was given");
        (
            wp,
            GridMode::Static {
                grids,
                col_group: &col_group,
            },
        )
    };
    drop(w0);
    let swept = timed(ops, Phase::Sweep, || {
        ops.boa_sweep(wp, &cols.u, &rows.u, d_h, g.block_size, mode, g.spec.maxq())
    })
    .context("sweep")?;
    let (w_hat, codes, grids) = ops
        .unorder(swept, &row_perm, &col_perms)
        .context("sweep (back to the original order)")?;
    Ok(QuantizedLinear {
        d_out,
        d_in: n,
        bits: g.spec.bits,
        w_hat,
        codes,
        grids,
        g_idx: g_idx_of(&cols.perm[0], &col_group[0]),
        error: None,
    })
}
