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
    DynamicGroups, FactorCache, GptqOptions, Quantized, from_f32, gptq_block_sweep, grids_f32,
    permute_cols, plan_sweep, plan_sweeps, static_grids, to_f32,
};
use super::linalg::{act_order_perm, damped_upper_inverse_batch, fix_dead_inputs, permute_sym};
use super::profile::{Phase, timed};
use super::quantizer::{Grid, ScaleSearch, dequantize, quantize, search_grid};
use crate::backend::quant_ops::{QuantOps, StaticGrids, UCol};
use rayon::prelude::*;

/// H_col of an attention projection.
#[derive(Clone, Copy, Debug)]
pub enum ColHessian<'a> {
    /// One [d_in × d_in] H_col for every head (W_Q, W_K: 2XXᵀ).
    Shared(&'a [f64]),
    /// [n_heads × d_in × d_in], one per head (W_V: the attention-weighted input covariance).
    PerHead(&'a [f64]),
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
    // A dynamic group is searched over all its columns at its first one, so it must lie in one block: only
    // then have the rows above already quantized, and handed down their cross-row terms for, all of it.
    let bw = match dynamic {
        Some(dg) if dg.g <= block_size => block_size / dg.g * dg.g,
        Some(dg) => dg.g,
        None => block_size,
    };
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
                let group_start = dynamic.filter(|dg| c % dg.g == 0).map(|dg| {
                    let g = c / dg.g;
                    let hb =
                        (dg.spec.search == ScaleSearch::Hessian).then(|| dg.h_blocks[g].as_slice());
                    (dg, g, dg.g.min(n - c), hb)
                });
                let cg = cf.col_group[c] as usize;
                for (h, xh) in x.chunks_mut(bw).enumerate() {
                    let row = h * d_h + j;
                    let gr_row = &mut grids[row * n_groups..(row + 1) * n_groups];
                    if let Some((dg, g, gl, hb)) = group_start {
                        gr_row[g] = search_grid(&xh[k..k + gl], hb, dg.spec);
                    }
                    let gr = gr_row[cg];
                    let (head, tail) = xh[..len].split_at_mut(k + 1);
                    let wc = head[k];
                    let qc = quantize(wc, gr.scale, gr.zero, maxq_t);
                    let qv = dequantize(qc, gr.scale, gr.zero);
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

/// BoA-quantizes an attention projection W [n_heads·d_h × d_in] (head h owns rows h·d_h..(h+1)·d_h).
/// `h_row` [n_heads × d_h × d_h] are the undamped H_row,h (identity for V by default).
pub fn boa_quantize<T: Real>(
    w: &[T],
    n_heads: usize,
    d_h: usize,
    d_in: usize,
    h_col: ColHessian,
    h_row: &[f64],
    opts: &BoaOptions,
) -> anyhow::Result<Quantized<T>> {
    boa_quantize_with(w, n_heads, d_h, d_in, h_col, h_row, opts, None)
}

/// [`boa_quantize`] with the U factors (all heads' U_row in one batch, V's per-head U_col in batches) and
/// static-grid sweeps through a backend's `QuantOps` (f32) when `ops` is given. Dynamic groups keep this
/// module's sweep: in the wavefront order a row reaches a group start mid-kernel, right after the row above
/// it, so there is no point at which a host search could run.
#[allow(clippy::too_many_arguments)]
pub fn boa_quantize_with<T: Real>(
    w: &[T],
    n_heads: usize,
    d_h: usize,
    d_in: usize,
    h_col: ColHessian,
    h_row: &[f64],
    opts: &BoaOptions,
    ops: Option<&dyn QuantOps>,
) -> anyhow::Result<Quantized<T>> {
    boa_quantize_cached(w, n_heads, d_h, d_in, h_col, h_row, opts, ops, None)
}

/// [`boa_quantize_with`] taking the plan of a shared H_col from `cache` when another layer of the block
/// planned it (W_Q and W_K read the same H_col; same result, one factorization fewer). Per-head H_col (W_V)
/// are V's own and bypass the cache.
#[allow(clippy::too_many_arguments)]
pub fn boa_quantize_cached<'h, T: Real>(
    w: &[T],
    n_heads: usize,
    d_h: usize,
    d_in: usize,
    h_col: ColHessian<'h>,
    h_row: &[f64],
    opts: &BoaOptions,
    ops: Option<&dyn QuantOps>,
    cache: Option<&FactorCache<'h, T>>,
) -> anyhow::Result<Quantized<T>> {
    let g = &opts.gptq;
    g.spec.validate()?;
    let d_out = n_heads * d_h;
    let n = d_in;
    assert_eq!(w.len(), d_out * n, "W is not [{d_out} × {n}]");
    assert_eq!(
        h_row.len(),
        n_heads * d_h * d_h,
        "H_row is not [{n_heads} × {d_h} × {d_h}]"
    );
    // One g_idx per matrix: with per-head H_col (V) and act_order_col the heads' column orders differ, so
    // grouped grids would need a g_idx per head, which no checkpoint format has.
    if matches!(h_col, ColHessian::PerHead(_)) && opts.act_order_col && g.spec.n_groups(n) > 1 {
        return Err(crate::input_err!(
            "BoA with per-head H_col, act_order_col and groups has no single g_idx; disable act_order_col for V"
        ));
    }
    let mut w0 = w.to_vec();
    let hs = d_h * n;

    // Column factors (Alg. 1 l.5–6, H_col side); dead inputs zeroed in the heads that use the H_col.
    let t_factor = std::time::Instant::now();
    let (plans, head_col) = match h_col {
        ColHessian::Shared(hc) => (
            vec![match cache {
                Some(c) => c.plan(&mut w0, n, hc, g, opts.act_order_col, ops)?,
                None => std::sync::Arc::new(plan_sweep::<T>(
                    &mut w0,
                    n,
                    hc,
                    g,
                    opts.act_order_col,
                    ops,
                )?),
            }],
            vec![0; n_heads],
        ),
        ColHessian::PerHead(hc) => {
            assert_eq!(
                hc.len(),
                n_heads * n * n,
                "per-head H_col is not [{n_heads} × {n} × {n}]"
            );
            // All heads' factors in batches (one backend call per batch, not one per head).
            let hcs: Vec<&[f64]> = hc.chunks(n * n).collect();
            let mut plans = Vec::with_capacity(n_heads);
            for (h, (p, wh)) in plan_sweeps::<T>(&hcs, n, g, opts.act_order_col, ops)
                .into_iter()
                .zip(w0.chunks_mut(hs))
                .enumerate()
            {
                let p = p.map_err(|e| e.context(format!("H_col of head {h}")))?;
                p.zero_dead_columns(wh, n);
                plans.push(std::sync::Arc::new(p));
            }
            (plans, (0..n_heads).collect())
        }
    };
    super::profile::add(Phase::Factor, t_factor);
    let n_groups = plans[0].n_groups;

    // Row factors (Alg. 1 l.5–6, H_row side), all heads in one batch.
    let mut row_perm = Vec::with_capacity(n_heads);
    let mut h_rows = Vec::with_capacity(n_heads);
    for h in 0..n_heads {
        let mut hr = h_row[h * d_h * d_h..(h + 1) * d_h * d_h].to_vec();
        fix_dead_inputs(&mut hr, d_h, 1.0);
        let perm: Vec<usize> = if opts.act_order_row {
            act_order_perm(&hr, d_h)
        } else {
            (0..d_h).collect()
        };
        h_rows.push(permute_sym(&hr, d_h, &perm));
        row_perm.push(perm);
    }
    let us = timed(Phase::Factor, || {
        damped_upper_inverse_batch(&mut h_rows, d_h, g.damp, g.max_damp_tries, ops)
    });
    let mut u_row = Vec::with_capacity(n_heads * d_h * d_h);
    for (h, u) in us.into_iter().enumerate() {
        let u = u.map_err(|e| e.context(format!("H_row of head {h}")))?;
        u_row.extend(u.iter().map(|&x| T::from_f64(x)));
    }

    // Grids: static ones from the original rows; dynamic ones are searched in the sweep.
    let dynamic = plans[0].dyn_blocks.is_some();
    let mut grids_orig = vec![Grid::default(); d_out * n_groups];
    if !dynamic && ops.is_some() && plans.len() == 1 {
        // One shared H_col: all heads' rows in one backend search (a device wants the tall matrix; the rows
        // are searched independently, so this is the per-head result).
        grids_orig = timed(Phase::Search, || {
            static_grids(&w0, d_out, n, &plans[0], &g.spec, ops)
        });
    } else if !dynamic {
        for h in 0..n_heads {
            let p = &plans[head_col[h]];
            let gh = timed(Phase::Search, || {
                static_grids(&w0[h * hs..(h + 1) * hs], d_h, n, p, &g.spec, ops)
            });
            grids_orig[h * d_h * n_groups..(h + 1) * d_h * n_groups].copy_from_slice(&gh);
        }
    }

    // Sweep order: rows by row_perm, columns by the head's column permutation.
    let mut wp = Vec::with_capacity(d_out * n);
    let mut grids = Vec::with_capacity(d_out * n_groups);
    for h in 0..n_heads {
        let wh = permute_cols(&w0[h * hs..(h + 1) * hs], n, &plans[head_col[h]].perm);
        for &r in &row_perm[h] {
            wp.extend_from_slice(&wh[r * n..(r + 1) * n]);
            let g0 = (h * d_h + r) * n_groups;
            grids.extend_from_slice(&grids_orig[g0..g0 + n_groups]);
        }
    }
    let gl = g.spec.group_len(n);
    let cols: Vec<ColFactor<T>> = plans
        .iter()
        .map(|p| ColFactor {
            u: &p.u,
            col_group: &p.col_group,
            dynamic: p.dyn_blocks.as_ref().map(|b| DynamicGroups {
                g: gl,
                h_blocks: b,
                spec: &g.spec,
            }),
        })
        .collect();
    let mut qp = vec![T::ZERO; d_out * n];
    let mut cp = vec![0u8; d_out * n];
    timed(Phase::Sweep, || match ops.filter(|_| !dynamic) {
        Some(ops) => {
            let grids32 = grids_f32(&grids);
            let u_col = match h_col {
                ColHessian::Shared(_) => to_f32(&plans[0].u),
                ColHessian::PerHead(_) => plans.iter().flat_map(|p| to_f32(&p.u)).collect(),
            };
            let r = ops.boa_sweep(
                &to_f32(&wp),
                match h_col {
                    ColHessian::Shared(_) => UCol::Shared(&u_col),
                    ColHessian::PerHead(_) => UCol::PerHead(&u_col),
                },
                &to_f32(&u_row),
                n_heads,
                d_h,
                n,
                g.block_size,
                StaticGrids {
                    grids: &grids32,
                    n_groups,
                    col_group: &plans[0].col_group,
                },
                g.spec.maxq(),
            );
            qp = from_f32(&r.q);
            cp = r.codes;
        }
        None => boa_sweep(
            &mut wp,
            &mut qp,
            &mut cp,
            &cols,
            &head_col,
            &u_row,
            n_heads,
            d_h,
            n,
            g.block_size,
            &mut grids,
            n_groups,
            g.spec.maxq(),
        ),
    });

    // Back to the original row and column order.
    let mut w_hat = vec![T::ZERO; d_out * n];
    let mut codes = vec![0u8; d_out * n];
    let mut scales = vec![T::ZERO; d_out * n_groups];
    let mut zeros = vec![T::ZERO; d_out * n_groups];
    let mut g_idx = vec![0u32; n];
    for h in 0..n_heads {
        let p = &plans[head_col[h]];
        for (i, &r) in row_perm[h].iter().enumerate() {
            let (src, dst) = ((h * d_h + i) * n, (h * d_h + r) * n);
            for (k, &c) in p.perm.iter().enumerate() {
                w_hat[dst + c] = qp[src + k];
                codes[dst + c] = cp[src + k];
            }
            for k in 0..n_groups {
                let gr = grids[(h * d_h + i) * n_groups + k];
                scales[(h * d_h + r) * n_groups + k] = gr.scale;
                zeros[(h * d_h + r) * n_groups + k] = gr.zero;
            }
        }
    }
    let p0 = &plans[0];
    for (k, &c) in p0.perm.iter().enumerate() {
        g_idx[c] = p0.col_group[k];
    }
    Ok(Quantized {
        d_out,
        d_in: n,
        bits: g.spec.bits,
        w_hat,
        codes,
        scales,
        zeros,
        g_idx,
        n_groups,
    })
}
