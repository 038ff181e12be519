//! `QuantOps` on the CPU: host vectors, f64 statistics, Hessians and factors, and the sweeps of `quant::` in
//! the precision of the weights they are given (f32 in production; f64 for the exactness tests of design.md
//! §4.4). This is the engine's reference: the arithmetic is the one the CPU engine has always done (the
//! accumulators' f64-chunked sums, faer's f64 Cholesky, `search_grids_rows`, `gptq_block_sweep`, `boa_sweep`),
//! and every CUDA kernel is checked against it.

use super::cpu::{self, CpuBackend};
use crate::ops::{
    AttnShape, Codes, Grid, GridMode, Grids, Lattice, Mat, MatData, Packed, QuadSums, QuantOps,
    QuantSpec, QuantizedLinear, Result, RopeAverage, ScaleSearch, Swept, Tensor, check_ridge_shift,
    check_rope_row_hessians,
};
use crate::quant::Real;
use crate::quant::boa::{ColFactor, boa_sweep};
use crate::quant::gptq::{DynamicGroups, gptq_block_sweep};
use crate::quant::hessian::{
    CHUNK_TOKENS, add_norm_jacobian_f64, add_xxt_f64, finish, fold_grams, gram_f32, group_means,
    k_row_hessians, q_row_hessians, scale_by_norm_weight, v_row_hessians_from_wout,
};
use crate::quant::lattice::lattice_row;
use crate::quant::linalg::{cholesky_upper_inverse, permute_sym};
use crate::quant::quantizer::{h_block_f32, quant_dequant, search_grids_rows};
use anyhow::{anyhow, bail};
use rayon::prelude::*;
use std::borrow::Cow;

/// The host values of a tensor (the CPU never holds device memory).
fn host<'a>(t: &'a Tensor, what: &str) -> Result<&'a [f32]> {
    t.host()
        .ok_or_else(|| anyhow!("cpu: {what} is in device memory"))
}

fn f64_mut<'a>(m: &'a mut Mat, what: &str) -> Result<&'a mut Vec<f64>> {
    match &mut m.data {
        MatData::F64(v) => Ok(v),
        MatData::F32(_) => bail!("cpu: {what} is not an f64 accumulator"),
    }
}

/// The values of `m` as f64 (borrowed when they are f64).
fn as_f64<'a>(m: &'a Mat, what: &str) -> Result<Cow<'a, [f64]>> {
    match &m.data {
        MatData::F64(v) => Ok(Cow::Borrowed(v)),
        MatData::F32(t) => Ok(Cow::Owned(
            host(t, what)?.iter().map(|&x| x as f64).collect(),
        )),
    }
}

/// A weight-precision buffer: the sweeps run in the precision of the weights they are given.
enum Vals {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

fn vals(m: &Mat, what: &str) -> Result<Vals> {
    Ok(match &m.data {
        MatData::F64(v) => Vals::F64(v.clone()),
        MatData::F32(t) => Vals::F32(host(t, what)?.to_vec()),
    })
}

/// `vals` of a Mat the caller gives up (no copy).
fn into_vals(m: Mat, what: &str) -> Result<Vals> {
    Ok(match m.data {
        MatData::F64(v) => Vals::F64(v),
        MatData::F32(Tensor::Host(v)) => Vals::F32(v),
        MatData::F32(t) => Vals::F32(host(&t, what)?.to_vec()),
    })
}

/// `m`'s values converted to T (f64 → f32 rounds, as `T::from_f64` always did for the CPU's U).
fn conv<T: Real>(m: &Mat, what: &str) -> Result<Vec<T>> {
    Ok(match &m.data {
        MatData::F64(v) => v.iter().map(|&x| T::from_f64(x)).collect(),
        MatData::F32(t) => host(t, what)?
            .iter()
            .map(|&x| T::from_f64(x as f64))
            .collect(),
    })
}

/// A [batch × rows × cols] Mat of T's values (f64 stays f64, f32 goes into a host tensor).
trait IntoMat: Real {
    fn into_mat(v: Vec<Self>, batch: usize, rows: usize, cols: usize) -> Mat;
}
impl IntoMat for f32 {
    fn into_mat(v: Vec<f32>, batch: usize, rows: usize, cols: usize) -> Mat {
        Mat::f32(v, batch, rows, cols)
    }
}
impl IntoMat for f64 {
    fn into_mat(v: Vec<f64>, batch: usize, rows: usize, cols: usize) -> Mat {
        Mat::f64(v, batch, rows, cols)
    }
}

fn grids_mat<T: IntoMat>(g: &[Grid<T>], rows: usize, n_groups: usize) -> Grids {
    Grids {
        scale: T::into_mat(g.iter().map(|x| x.scale).collect(), 1, rows, n_groups),
        zero: T::into_mat(g.iter().map(|x| x.zero).collect(), 1, rows, n_groups),
    }
}

fn grids_vec<T: Real>(g: &Grids) -> Result<Vec<Grid<T>>> {
    let s = conv::<T>(&g.scale, "scales")?;
    let z = conv::<T>(&g.zero, "zeros")?;
    Ok(s.into_iter()
        .zip(z)
        .map(|(scale, zero)| Grid { scale, zero })
        .collect())
}

fn codes_host(c: &Codes) -> Result<&[u8]> {
    match c {
        Codes::Host(v) => Ok(v),
        Codes::Device(_) => bail!("cpu: codes are in device memory"),
    }
}

/// Rows per part of a weight split into `parts` equal parts.
fn part_rows(rows: usize, parts: usize, op: &str) -> Result<usize> {
    if parts == 0 || !rows.is_multiple_of(parts) {
        bail!("{op}: {rows} rows do not split into {parts} equal parts");
    }
    Ok(rows / parts)
}

/// The [len × len] block H[idx[a], idx[b]] for the columns a, b of c0..c0+len, f32 (the scale search's H).
fn index_block_f32(h: &[f64], n: usize, idx: &[usize], c0: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * len);
    for a in c0..c0 + len {
        for b in c0..c0 + len {
            out.push(h[idx[a] * n + idx[b]] as f32);
        }
    }
    out
}

/// The H blocks of each group of a dynamic sweep, in sweep order (empty unless the Hessian search).
fn dynamic_blocks(h: Option<&[f64]>, n: usize, g: usize, spec: &QuantSpec) -> Vec<Vec<f32>> {
    let n_groups = n.div_ceil(g);
    match (spec.search, h) {
        (ScaleSearch::Hessian, Some(h)) => (0..n_groups)
            .map(|k| h_block_f32(h, n, k * g, g.min(n - k * g)))
            .collect(),
        _ => vec![Vec::new(); n_groups],
    }
}

#[allow(clippy::too_many_arguments)]
fn search_all<T: Real + IntoMat>(
    w: &[T],
    rows: usize,
    n: usize,
    h: Option<&[f64]>,
    idx: &[Vec<usize>],
    h_of_part: &[usize],
    g: usize,
    spec: &QuantSpec,
) -> Result<Grids> {
    let n_groups = n.div_ceil(g);
    let rp = part_rows(rows, h_of_part.len(), "search_grids")?;
    let hessian = spec.search == ScaleSearch::Hessian;
    if hessian && h.is_none() {
        bail!("search_grids: the Hessian search needs H");
    }
    let mut grids = vec![Grid::default(); rows * n_groups];
    // Consecutive parts on the same H (every head of a shared H_col) are searched as one block of rows:
    // each row's grid depends only on the row and H, and H's tiles and pruning checks (an O(g³) Cholesky)
    // are then made once instead of once per head.
    let mut p0 = 0;
    while p0 < h_of_part.len() {
        let f = h_of_part[p0];
        let p1 = p0 + h_of_part[p0..].iter().take_while(|&&x| x == f).count();
        let (r0, nr) = (p0 * rp, (p1 - p0) * rp);
        p0 = p1;
        let wp = &w[r0 * n..(r0 + nr) * n];
        if spec.lattice != Lattice::Free {
            // A GGUF lattice: row by row, each K-quant super-block's d before its groups.
            let blocks: Vec<Vec<f32>> = match h.filter(|_| hessian) {
                Some(h) => {
                    let ix = idx
                        .get(f)
                        .ok_or_else(|| anyhow!("search_grids: no index for matrix {f}"))?;
                    let hf = &h[f * n * n..(f + 1) * n * n];
                    (0..n_groups)
                        .map(|k| index_block_f32(hf, n, ix, k * g, g.min(n - k * g)))
                        .collect()
                }
                None => Vec::new(),
            };
            let refs: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
            let rg: Vec<Vec<Grid<T>>> = wp
                .par_chunks(n)
                .map(|row| lattice_row(row, &refs, g, spec))
                .collect();
            for (r, gr) in rg.into_iter().enumerate() {
                grids[(r0 + r) * n_groups..(r0 + r + 1) * n_groups].copy_from_slice(&gr);
            }
            continue;
        }
        for k in 0..n_groups {
            let len = g.min(n - k * g);
            let hb = match h.filter(|_| hessian) {
                Some(h) => {
                    let ix = idx
                        .get(f)
                        .ok_or_else(|| anyhow!("search_grids: no index for matrix {f}"))?;
                    Some(index_block_f32(
                        &h[f * n * n..(f + 1) * n * n],
                        n,
                        ix,
                        k * g,
                        len,
                    ))
                }
                None => None,
            };
            let gk = search_grids_rows(wp, nr, n, k * g, len, hb.as_deref(), spec);
            for (r, gr) in gk.into_iter().enumerate() {
                grids[(r0 + r) * n_groups + k] = gr;
            }
        }
    }
    Ok(grids_mat(&grids, rows, n_groups))
}

/// Rows by `row_perm`, then the columns of part p gathered (`gather`) or scattered back (`!gather`) by
/// `col_perms[p]`.
fn permute<T: Copy + Default>(
    w: &[T],
    rows: usize,
    n: usize,
    row_perm: &[usize],
    col_perms: &[Vec<usize>],
    gather: bool,
) -> Vec<T> {
    let rp = rows / col_perms.len().max(1);
    let mut out = vec![T::default(); rows * n];
    for i in 0..rows {
        let perm = &col_perms[i / rp.max(1)];
        if gather {
            let src = &w[row_perm[i] * n..(row_perm[i] + 1) * n];
            let dst = &mut out[i * n..(i + 1) * n];
            for (k, &c) in perm.iter().enumerate() {
                dst[k] = src[c];
            }
        } else {
            let src = &w[i * n..(i + 1) * n];
            let dst = &mut out[row_perm[i] * n..(row_perm[i] + 1) * n];
            for (k, &c) in perm.iter().enumerate() {
                dst[c] = src[k];
            }
        }
    }
    out
}

fn permute_rows<T: Copy + Default>(
    g: &[T],
    cols: usize,
    row_perm: &[usize],
    gather: bool,
) -> Vec<T> {
    let mut out = vec![T::default(); g.len()];
    for (i, &r) in row_perm.iter().enumerate() {
        let (src, dst) = if gather { (r, i) } else { (i, r) };
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&g[src * cols..(src + 1) * cols]);
    }
    out
}

fn check_perms(rows: usize, n: usize, row_perm: &[usize], col_perms: &[Vec<usize>]) -> Result<()> {
    if row_perm.len() != rows
        || col_perms.is_empty()
        || !rows.is_multiple_of(col_perms.len())
        || col_perms.iter().any(|p| p.len() != n)
    {
        bail!(
            "reorder: a row permutation of {} and {} column permutations do not fit [{rows} × {n}]",
            row_perm.len(),
            col_perms.len()
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn gptq_sweep_t<T: Real + IntoMat>(
    w: Vec<T>,
    u: &Mat,
    grids: GridMode,
    rows: usize,
    n: usize,
    block: usize,
    maxq: u32,
) -> Result<Swept> {
    if u.rows != n || u.cols != n || u.batch != 1 {
        bail!("gptq_sweep: U {} for W [{rows} × {n}]", u.describe());
    }
    let u_t = conv::<T>(u, "U")?;
    let (mut g, n_groups, col_group, h_blocks, dyn_g) = match &grids {
        GridMode::Static { grids, col_group } => {
            let cg = col_group
                .first()
                .ok_or_else(|| anyhow!("gptq_sweep: no col_group"))?;
            (
                grids_vec::<T>(grids)?,
                grids.n_groups(),
                cg.clone(),
                None,
                0,
            )
        }
        GridMode::Dynamic { g, h, spec } => {
            let h = h.map(|h| as_f64(h, "H")).transpose()?;
            let ng = n.div_ceil(*g);
            (
                vec![Grid::default(); rows * ng],
                ng,
                (0..n).map(|c| (c / g) as u32).collect(),
                Some((dynamic_blocks(h.as_deref(), n, *g, spec), **spec)),
                *g,
            )
        }
    };
    if g.len() != rows * n_groups || col_group.len() != n {
        bail!("gptq_sweep: grids or col_group do not fit [{rows} × {n}]");
    }
    let dynamic = h_blocks.as_ref().map(|(b, spec)| DynamicGroups {
        g: dyn_g,
        h_blocks: b,
        spec,
    });
    let w0 = w.clone();
    let mut wv = w;
    let mut q = vec![T::ZERO; rows * n];
    let mut codes = vec![0u8; rows * n];
    gptq_block_sweep(
        &mut wv,
        &mut q,
        &mut codes,
        &u_t,
        rows,
        n,
        block,
        &mut g,
        n_groups,
        &col_group,
        dynamic.as_ref(),
        maxq,
    );
    // The sweep leaves each column at its value when it was quantized, so e = (w − q) / U_cc is its error.
    let (mut loss, mut delta_sq) = (0f64, 0f64);
    for r in 0..rows {
        for c in 0..n {
            let i = r * n + c;
            let e = ((wv[i] - q[i]) / u_t[c * n + c]).to_f64();
            loss += e * e;
            let d = (q[i] - w0[i]).to_f64();
            delta_sq += d * d;
        }
    }
    Ok(Swept {
        q: T::into_mat(q, 1, rows, n),
        codes: Codes::Host(codes),
        grids: grids_mat(&g, rows, n_groups),
        loss: QuadSums::Host(vec![loss, delta_sq]),
    })
}

#[allow(clippy::too_many_arguments)]
fn boa_sweep_t<T: Real + IntoMat>(
    w: Vec<T>,
    u_col: &Mat,
    u_row: &Mat,
    rows: usize,
    n: usize,
    d_h: usize,
    block: usize,
    grids: GridMode,
    maxq: u32,
) -> Result<Swept> {
    let n_heads = rows / d_h.max(1);
    if d_h == 0
        || n_heads * d_h != rows
        || u_col.rows != n
        || u_col.cols != n
        || !(u_col.batch == 1 || u_col.batch == n_heads)
        || u_row.batch != n_heads
        || u_row.rows != d_h
        || u_row.cols != d_h
    {
        bail!(
            "boa_sweep: U_col {} and U_row {} for W [{rows} × {n}] in heads of {d_h}",
            u_col.describe(),
            u_row.describe()
        );
    }
    let per_head = u_col.batch == n_heads && n_heads > 1;
    let head_col: Vec<usize> = (0..n_heads).map(|h| if per_head { h } else { 0 }).collect();
    let n_cols = if per_head { n_heads } else { 1 };
    let u_t = conv::<T>(u_col, "U_col")?;
    let ur_t = conv::<T>(u_row, "U_row")?;
    let (mut g, n_groups, col_group, blocks, dyn_g, spec) = match &grids {
        GridMode::Static { grids, col_group } => {
            if col_group.len() < n_cols {
                bail!(
                    "boa_sweep: {} col_group maps for {n_cols} column factors",
                    col_group.len()
                );
            }
            (
                grids_vec::<T>(grids)?,
                grids.n_groups(),
                col_group[..n_cols].to_vec(),
                None,
                0,
                None,
            )
        }
        GridMode::Dynamic { g, h, spec } => {
            let h = h.map(|h| as_f64(h, "H_col")).transpose()?;
            let ng = n.div_ceil(*g);
            let blocks: Vec<Vec<Vec<f32>>> = (0..n_cols)
                .map(|f| {
                    dynamic_blocks(
                        h.as_deref().map(|h| &h[f * n * n..(f + 1) * n * n]),
                        n,
                        *g,
                        spec,
                    )
                })
                .collect();
            (
                vec![Grid::default(); rows * ng],
                ng,
                vec![(0..n).map(|c| (c / g) as u32).collect(); n_cols],
                Some(blocks),
                *g,
                Some(**spec),
            )
        }
    };
    if g.len() != rows * n_groups {
        bail!("boa_sweep: grids do not fit [{rows} × {n_groups}]");
    }
    let cols: Vec<ColFactor<T>> = (0..n_cols)
        .map(|f| ColFactor {
            u: &u_t[f * n * n..(f + 1) * n * n],
            col_group: &col_group[f],
            dynamic: blocks.as_ref().map(|b| DynamicGroups {
                g: dyn_g,
                h_blocks: &b[f],
                spec: spec.as_ref().expect("dynamic"),
            }),
        })
        .collect();
    let mut wv = w;
    let mut q = vec![T::ZERO; rows * n];
    let mut codes = vec![0u8; rows * n];
    boa_sweep(
        &mut wv, &mut q, &mut codes, &cols, &head_col, &ur_t, n_heads, d_h, n, block, &mut g,
        n_groups, maxq,
    );
    Ok(Swept {
        q: T::into_mat(q, 1, rows, n),
        codes: Codes::Host(codes),
        grids: grids_mat(&g, rows, n_groups),
        // BoA's sweep leaves rows before their own GPTQ updates; its report comes from `quad_forms`.
        loss: QuadSums::Host(vec![f64::NAN; 2]),
    })
}

fn rtn_t<T: Real + IntoMat>(
    w: &[T],
    rows: usize,
    n: usize,
    grids: &Grids,
    col_group: &[u32],
    spec: &QuantSpec,
) -> Result<(Mat, Codes)> {
    let g = grids_vec::<T>(grids)?;
    let ng = grids.n_groups();
    crate::ops::check_col_group("rtn", 0, col_group, n, ng)?;
    if g.len() != rows * ng {
        bail!(
            "rtn: grids [{} × {ng}] do not fit [{rows} × {n}]",
            grids.rows()
        );
    }
    let maxq = T::from_f64(spec.maxq() as f64);
    let offset = spec.offset();
    let mut codes = vec![0u8; rows * n];
    let mut q = vec![T::ZERO; rows * n];
    for r in 0..rows {
        for c in 0..n {
            let gr = g[r * ng + col_group[c] as usize];
            let (v, qv) = quant_dequant(w[r * n + c], gr, maxq, offset);
            codes[r * n + c] = v.to_f64() as u8;
            q[r * n + c] = qv;
        }
    }
    Ok((T::into_mat(q, 1, rows, n), Codes::Host(codes)))
}

/// W_V's column sums of one sequence: for every query head h, sums[h / G] (f64, [h_kv × d × d]) +=
/// (A_h X)ᵀ (A_h X), X [t × d] the block input, A_h the causal softmax probabilities (G = h / h_kv query
/// heads share a KV head). Each (head, CHUNK_TOKENS rows of A_h X) is one Gram of `fold_grams`: computed a
/// head per thread, straight from Q and K block by block (A_h is never stored), and added in head order.
fn add_v_col_sequence(
    sums: &mut [f64],
    x: &[f32],
    q: &[f32],
    k: &[f32],
    s: AttnShape,
    scratch: &mut Vec<f32>,
) {
    let AttnShape {
        t, h, h_kv, d_h, d, ..
    } = s;
    let (gs, per_head) = (h / h_kv, t.div_ceil(CHUNK_TOKENS));
    fold_grams(
        sums,
        d,
        h * per_head,
        |i| i / per_head / gs,
        |i, g, par| {
            let (head, c) = (i / per_head, i % per_head);
            let qh = cpu::gather_head(q, t, h, d_h, head);
            let kh = cpu::gather_head(k, t, h_kv, d_h, head / gs);
            let rows = c * CHUNK_TOKENS..((c + 1) * CHUNK_TOKENS).min(t);
            let m = rows.len();
            let y = cpu::causal_attention_rows(&qh, &kh, x, d_h, d, s.window, rows);
            gram_f32(g, &y, m, d, d, par);
        },
        scratch,
    );
}

fn check_sym(h: &Mat, op: &str) -> Result<()> {
    if h.rows != h.cols {
        bail!("{op}: {} is not square", h.describe());
    }
    Ok(())
}

impl QuantOps for CpuBackend {
    fn stat_acc(&self, batch: usize, n: usize) -> Result<Mat> {
        Ok(Mat::f64(vec![0.0; batch * n * n], batch, n, n))
    }

    fn stat_xxt(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()> {
        let d = acc.rows;
        let x = host(x, "X")?;
        if acc.batch != 1 || x.len() != m * d {
            bail!(
                "stat_xxt: X of {} values for {m} tokens into {}",
                x.len(),
                acc.describe()
            );
        }
        let mut s = Vec::new();
        add_xxt_f64(f64_mut(acc, "stat_xxt")?, x, m, d, d, &mut s);
        Ok(())
    }

    fn stat_head_cov(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()> {
        let (nh, dh) = (acc.batch, acc.rows);
        let x = host(x, "X")?;
        if x.len() != m * nh * dh {
            bail!(
                "stat_head_cov: X of {} values is not [{m} × {nh}·{dh}]",
                x.len()
            );
        }
        let mut s = Vec::new();
        let sums = f64_mut(acc, "stat_head_cov")?;
        for (h, sum) in sums.chunks_mut(dh * dh).enumerate() {
            if m > 0 {
                add_xxt_f64(sum, &x[h * dh..], m, dh, nh * dh, &mut s);
            }
        }
        Ok(())
    }

    fn stat_norm_jacobian(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        m: usize,
        a: &Mat,
        eps: f32,
    ) -> Result<()> {
        let (nh, dh) = (acc.batch, acc.rows);
        let x = host(x, "X")?;
        if x.len() != m * nh * dh || (a.batch, a.rows, a.cols) != (nh, dh, dh) {
            bail!(
                "stat_norm_jacobian: X of {} values for {m} tokens and A {} into {}",
                x.len(),
                a.describe(),
                acc.describe()
            );
        }
        let a = as_f64(a, "stat_norm_jacobian")?;
        add_norm_jacobian_f64(f64_mut(acc, "stat_norm_jacobian")?, x, m, nh, dh, &a, eps);
        Ok(())
    }

    fn stat_v_col(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<()> {
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let (x, q, k) = (host(x, "X")?, host(q, "Q")?, host(k, "K")?);
        if acc.batch != h_kv
            || acc.rows != d
            || x.len() != n_seq * t * d
            || q.len() != n_seq * t * h * d_h
            || k.len() != n_seq * t * h_kv * d_h
            || h_kv == 0
            || !h.is_multiple_of(h_kv)
        {
            bail!(
                "stat_v_col: {s:?} × {n_seq} sequences do not fit {}",
                acc.describe()
            );
        }
        let sums = f64_mut(acc, "stat_v_col")?;
        let mut scratch = Vec::new();
        for i in 0..n_seq {
            let qs = &q[i * t * h * d_h..(i + 1) * t * h * d_h];
            let ks = &k[i * t * h_kv * d_h..(i + 1) * t * h_kv * d_h];
            add_v_col_sequence(
                sums,
                &x[i * t * d..(i + 1) * t * d],
                qs,
                ks,
                s,
                &mut scratch,
            );
        }
        Ok(())
    }

    fn stat_finish(&self, acc: Mat, tokens: usize, div: f64) -> Result<Mat> {
        check_sym(&acc, "stat_finish")?;
        let (batch, n) = (acc.batch, acc.rows);
        let sums = as_f64(&acc, "stat_finish")?;
        let v = sums
            .chunks(n * n)
            .flat_map(|s| finish(s, n, tokens, div))
            .collect();
        Ok(Mat::f64(v, batch, n, n))
    }

    fn stat_diff_cross(&self, acc: &mut Mat, a: &Tensor, b: &Tensor, m: usize) -> Result<()> {
        let n = acc.rows;
        let (a, b) = (host(a, "A")?, host(b, "B")?);
        if acc.batch != 1 || acc.cols != n || a.len() != m * n || b.len() != m * n {
            bail!(
                "stat_diff_cross: A of {} and B of {} values for {m} tokens into {}",
                a.len(),
                b.len(),
                acc.describe()
            );
        }
        crate::quant::asym::add_diff_cross(f64_mut(acc, "stat_diff_cross")?, a, b, m, n);
        Ok(())
    }

    /// In f64 (quant/asym.rs `target`); W's f32 values, D scaled entry by entry first. H + μI is factored
    /// and solved once for all of `ws` (`ridge_solve`), then each W gets its product (`shift`).
    fn ridge_shift(
        &self,
        ws: &[&Mat],
        d: &Mat,
        s: f64,
        h: &Mat,
        damp: f64,
        alpha: f64,
    ) -> Result<Option<Vec<Mat>>> {
        check_ridge_shift(ws, d, h)?;
        let ds: Vec<f64> = as_f64(d, "D")?.iter().map(|e| e * s).collect();
        let n = h.rows;
        let Some(z) = crate::quant::asym::ridge_solve(n, &ds, &as_f64(h, "H")?, damp) else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(ws.len());
        for w in ws {
            let Some(t) = crate::quant::asym::shift(&conv::<f32>(w, "W")?, w.rows, &z, alpha)
            else {
                return Ok(None);
            };
            out.push(Mat::f32(t, 1, w.rows, n));
        }
        Ok(Some(out))
    }

    fn wout_row_hessians(&self, w_o: &Mat, n_heads: usize, n_kv: usize, d_h: usize) -> Result<Mat> {
        let w = conv::<f32>(w_o, "W_o")?;
        if w_o.cols != n_heads * d_h || n_kv == 0 || !n_heads.is_multiple_of(n_kv) {
            bail!(
                "wout_row_hessians: W_o {} for {n_heads} heads of {d_h}",
                w_o.describe()
            );
        }
        let v = v_row_hessians_from_wout(&w, w_o.rows, n_heads, n_kv, d_h);
        Ok(Mat::f64(v, n_kv, d_h, d_h))
    }

    /// The f64 oracle: quant::hessian's position average of the covariances' f64 values (the engine's
    /// reference, as it was computed before this was a backend op).
    fn rope_row_hessians(
        &self,
        c: &Mat,
        n_out: usize,
        rope: &RopeAverage,
        norm: Option<&[f32]>,
    ) -> Result<Mat> {
        check_rope_row_hessians(c, n_out, rope, norm)?;
        let (batch, d_h) = (c.batch, c.rows);
        let cv = as_f64(c, "rope_row_hessians")?;
        let mut h = if n_out >= batch {
            q_row_hessians(&cv, n_out, batch, rope)
        } else {
            k_row_hessians(&group_means(&cv, batch, d_h, n_out), rope)
        };
        if let Some(g) = norm {
            scale_by_norm_weight(&mut h, g);
        }
        Ok(Mat::f64(h, n_out, d_h, d_h))
    }

    fn read_f64(&self, m: &Mat) -> Result<Vec<f64>> {
        Ok(as_f64(m, "read_f64")?.into_owned())
    }

    fn read_f32(&self, m: &Mat) -> Result<Vec<f32>> {
        conv::<f32>(m, "read_f32")
    }

    fn read_codes(&self, c: &Codes) -> Result<Vec<u8>> {
        Ok(codes_host(c)?.to_vec())
    }

    fn hessian(&self, v: Vec<f64>, batch: usize, n: usize) -> Result<Mat> {
        if v.len() != batch * n * n {
            bail!("hessian: {} values are not [{batch} × {n} × {n}]", v.len());
        }
        Ok(Mat::f64(v, batch, n, n))
    }

    fn diag(&self, h: &Mat) -> Result<Vec<f64>> {
        check_sym(h, "diag")?;
        let n = h.rows;
        let v = as_f64(h, "diag")?;
        Ok(v.chunks(n * n)
            .flat_map(|m| (0..n).map(move |i| m[i * n + i]))
            .collect())
    }

    fn permute_sym(&self, h: &Mat, perms: &[Vec<usize>]) -> Result<Mat> {
        check_sym(h, "permute_sym")?;
        let n = h.rows;
        if perms.len() != h.batch || perms.iter().any(|p| p.len() != n) {
            bail!(
                "permute_sym: {} permutations for {}",
                perms.len(),
                h.describe()
            );
        }
        let v = as_f64(h, "permute_sym")?;
        let out = v
            .chunks(n * n)
            .zip(perms)
            .flat_map(|(m, p)| permute_sym(m, n, p))
            .collect();
        Ok(Mat::f64(out, h.batch, n, n))
    }

    fn set_diag(&self, h: &mut Mat, entries: &[(usize, usize, f64)]) -> Result<()> {
        let (b, n) = (h.batch, h.rows);
        let v = f64_mut(h, "set_diag")?;
        for &(m, i, x) in entries {
            if m >= b || i >= n {
                bail!("set_diag: entry ({m}, {i}) outside [{b} × {n} × {n}]");
            }
            v[m * n * n + i * n + i] = x;
        }
        Ok(())
    }

    fn add_diag(&self, h: &mut Mat, amounts: &[(usize, f64)]) -> Result<()> {
        let (b, n) = (h.batch, h.rows);
        let v = f64_mut(h, "add_diag")?;
        for &(m, a) in amounts {
            if m >= b {
                bail!("add_diag: matrix {m} of {b}");
            }
            for i in 0..n {
                v[m * n * n + i * n + i] += a;
            }
        }
        Ok(())
    }

    fn factor(&self, h: &Mat, u: Option<Mat>, which: &[usize]) -> Result<(Mat, Vec<bool>)> {
        check_sym(h, "factor")?;
        let (batch, n) = (h.batch, h.rows);
        let hv = as_f64(h, "factor")?;
        let mut u = match u {
            Some(u) if u.batch == batch && u.rows == n && u.cols == n => u,
            Some(u) => bail!("factor: U {} for H {}", u.describe(), h.describe()),
            None => Mat::f64(vec![0.0; batch * n * n], batch, n, n),
        };
        if which.iter().any(|&b| b >= batch) {
            bail!("factor: a matrix index ≥ {batch}");
        }
        // Each factor is sequential code (faer parallelizes inside for n ≥ 512), so the batch may go in
        // parallel without changing a bit.
        let factors: Vec<Option<Vec<f64>>> = which
            .par_iter()
            .map(|&b| cholesky_upper_inverse(&hv[b * n * n..(b + 1) * n * n], n))
            .collect();
        let uv = f64_mut(&mut u, "factor")?;
        let mut ok = Vec::with_capacity(which.len());
        for (&b, f) in which.iter().zip(factors) {
            ok.push(f.is_some());
            if let Some(f) = f {
                uv[b * n * n..(b + 1) * n * n].copy_from_slice(&f);
            }
        }
        Ok((u, ok))
    }

    fn zero_cols(&self, w: &Mat, cols: &[Vec<usize>]) -> Result<Mat> {
        let (rows, n) = (w.rows, w.cols);
        let rp = part_rows(rows, cols.len(), "zero_cols")?;
        if cols.iter().flatten().any(|&c| c >= n) {
            bail!("zero_cols: a column ≥ {n}");
        }
        fn zero<T: Real>(v: &mut [T], n: usize, rp: usize, cols: &[Vec<usize>]) {
            for (r, row) in v.chunks_mut(n).enumerate() {
                for &c in &cols[r / rp.max(1)] {
                    row[c] = T::ZERO;
                }
            }
        }
        Ok(match vals(w, "W")? {
            Vals::F32(mut v) => {
                zero(&mut v, n, rp, cols);
                Mat::f32(v, 1, rows, n)
            }
            Vals::F64(mut v) => {
                zero(&mut v, n, rp, cols);
                Mat::f64(v, 1, rows, n)
            }
        })
    }

    fn search_grids(
        &self,
        w: &Mat,
        h: Option<&Mat>,
        idx: &[Vec<usize>],
        h_of_part: &[usize],
        g: usize,
        spec: &QuantSpec,
    ) -> Result<Grids> {
        let (rows, n) = (w.rows, w.cols);
        if g == 0 {
            bail!("search_grids: group width 0");
        }
        let hv = match h {
            Some(h) if spec.search == ScaleSearch::Hessian => {
                if h.rows != n || h.cols != n || h_of_part.iter().any(|&f| f >= h.batch) {
                    bail!("search_grids: H {} for W [{rows} × {n}]", h.describe());
                }
                Some(as_f64(h, "H")?)
            }
            _ => None,
        };
        match vals(w, "W")? {
            Vals::F32(v) => search_all(&v, rows, n, hv.as_deref(), idx, h_of_part, g, spec),
            Vals::F64(v) => search_all(&v, rows, n, hv.as_deref(), idx, h_of_part, g, spec),
        }
    }

    fn reorder(
        &self,
        w: &Mat,
        grids: Option<&Grids>,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Option<Grids>)> {
        let (rows, n) = (w.rows, w.cols);
        check_perms(rows, n, row_perm, col_perms)?;
        let wp = match vals(w, "W")? {
            Vals::F32(v) => Mat::f32(permute(&v, rows, n, row_perm, col_perms, true), 1, rows, n),
            Vals::F64(v) => Mat::f64(permute(&v, rows, n, row_perm, col_perms, true), 1, rows, n),
        };
        let gp = grids
            .map(|g| reorder_grids(g, row_perm, true))
            .transpose()?;
        Ok((wp, gp))
    }

    fn unorder(
        &self,
        s: Swept,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Codes, Grids)> {
        let (rows, n) = (s.q.rows, s.q.cols);
        check_perms(rows, n, row_perm, col_perms)?;
        let w_hat = match vals(&s.q, "Q")? {
            Vals::F32(v) => Mat::f32(permute(&v, rows, n, row_perm, col_perms, false), 1, rows, n),
            Vals::F64(v) => Mat::f64(permute(&v, rows, n, row_perm, col_perms, false), 1, rows, n),
        };
        let codes = permute(codes_host(&s.codes)?, rows, n, row_perm, col_perms, false);
        let grids = reorder_grids(&s.grids, row_perm, false)?;
        Ok((w_hat, Codes::Host(codes), grids))
    }

    fn rtn(
        &self,
        w: &Mat,
        grids: &Grids,
        col_group: &[u32],
        spec: &QuantSpec,
    ) -> Result<(Mat, Codes)> {
        let (rows, n) = (w.rows, w.cols);
        match vals(w, "W")? {
            Vals::F32(v) => rtn_t(&v, rows, n, grids, col_group, spec),
            Vals::F64(v) => rtn_t(&v, rows, n, grids, col_group, spec),
        }
    }

    fn gptq_sweep(
        &self,
        w: Mat,
        u: &Mat,
        grids: GridMode,
        block: usize,
        maxq: u32,
    ) -> Result<Swept> {
        let (rows, n) = (w.rows, w.cols);
        if block == 0 {
            bail!("gptq_sweep: block size 0");
        }
        grids.check("gptq_sweep", n)?;
        match into_vals(w, "W")? {
            Vals::F32(v) => gptq_sweep_t(v, u, grids, rows, n, block, maxq),
            Vals::F64(v) => gptq_sweep_t(v, u, grids, rows, n, block, maxq),
        }
    }

    fn boa_sweep(
        &self,
        w: Mat,
        u_col: &Mat,
        u_row: &Mat,
        d_h: usize,
        block: usize,
        grids: GridMode,
        maxq: u32,
    ) -> Result<Swept> {
        let (rows, n) = (w.rows, w.cols);
        if block == 0 {
            bail!("boa_sweep: block size 0");
        }
        grids.check("boa_sweep", n)?;
        match into_vals(w, "W")? {
            Vals::F32(v) => boa_sweep_t(v, u_col, u_row, rows, n, d_h, block, grids, maxq),
            Vals::F64(v) => boa_sweep_t(v, u_col, u_row, rows, n, d_h, block, grids, maxq),
        }
    }

    fn quad_sums(&self, slots: usize) -> Result<QuadSums> {
        Ok(QuadSums::Host(vec![0.0; slots]))
    }

    fn read_quad_sums(&self, sums: &QuadSums) -> Result<Vec<f64>> {
        match sums {
            QuadSums::Host(v) => Ok(v.clone()),
            QuadSums::Device { .. } => bail!("read_quad_sums: the sums are in device memory"),
        }
    }

    fn stack(&self, mats: &[&Mat]) -> Result<Mat> {
        crate::ops::check_stack(mats)?;
        Mat::stack_host(mats).ok_or_else(|| anyhow!("stack: a matrix is not in host memory"))
    }

    fn unstack(&self, m: Mat) -> Result<Vec<Mat>> {
        m.unstack_host()
            .map_err(|m| anyhow!("unstack: {} is not in host memory", m.describe()))
    }

    fn queue_sums(&self, into: &mut QuadSums, first: usize, from: &QuadSums) -> Result<()> {
        into.check_room(first, from.slots())?;
        match (into, from) {
            (QuadSums::Host(to), QuadSums::Host(v)) => {
                to[first..first + v.len()].copy_from_slice(v);
                Ok(())
            }
            _ => bail!("queue_sums: the sums are in device memory"),
        }
    }

    /// Computed now: the values are what the CPU holds.
    fn quad_forms_into(
        &self,
        sums: &mut QuadSums,
        first: usize,
        h: &Mat,
        a: &[&Mat],
    ) -> Result<()> {
        sums.check_room(first, a.len())?;
        let QuadSums::Host(slots) = sums else {
            bail!("quad_forms_into: the sums are in device memory");
        };
        slots[first..first + a.len()].copy_from_slice(&quad_forms_host(h, a)?);
        Ok(())
    }

    fn refit_scales(
        &self,
        w: &Mat,
        h: &Mat,
        q: QuantizedLinear,
    ) -> Result<(QuantizedLinear, crate::ops::RefitStats)> {
        check_sym(h, "refit_scales")?;
        let (d_out, d_in, ng) = (q.d_out, q.d_in, q.n_groups());
        if w.batch != 1 || w.rows != d_out || w.cols != d_in || h.rows != d_in {
            bail!(
                "refit_scales: W {} and H {} do not fit a [{d_out} × {d_in}] linear",
                w.describe(),
                h.describe()
            );
        }
        let hv = as_f64(h, "H")?;
        let wv = conv::<f64>(w, "W")?;
        let codes = codes_host(&q.codes)?;
        let mut scales = conv::<f64>(&q.grids.scale, "scales")?;
        let zeros = conv::<f64>(&q.grids.zero, "zeros")?;
        if scales.len() != d_out * ng || zeros.len() != scales.len() || codes.len() != d_out * d_in
        {
            bail!("refit_scales: grids or codes do not fit [{d_out} × {d_in}] in {ng} groups");
        }
        let st = crate::quant::refit::refit_scales(
            &wv,
            &hv,
            codes,
            &mut scales,
            &zeros,
            &q.g_idx,
            d_out,
            d_in,
        );
        // Ŵ and the grids in the precision the sweep kept them (f64 in the exactness tests).
        fn rebuild<T: Real + IntoMat>(
            q: &QuantizedLinear,
            codes: &[u8],
            scales: &[f64],
            zeros: &[f64],
        ) -> (Mat, Mat, Mat) {
            let (d_out, d_in, ng) = (q.d_out, q.d_in, scales.len() / q.d_out.max(1));
            let s: Vec<T> = scales.iter().map(|&v| T::from_f64(v)).collect();
            let z: Vec<T> = zeros.iter().map(|&v| T::from_f64(v)).collect();
            let w_hat: Vec<T> = (0..d_out * d_in)
                .map(|i| {
                    let k = (i / d_in) * ng + q.g_idx[i % d_in] as usize;
                    crate::quant::quantizer::dequantize(T::from_f64(codes[i] as f64), s[k], z[k])
                })
                .collect();
            (
                T::into_mat(w_hat, 1, d_out, d_in),
                T::into_mat(s, 1, d_out, ng),
                T::into_mat(z, 1, d_out, ng),
            )
        }
        let (w_hat, scale, zero) = if q.grids.scale.host_f64().is_some() {
            rebuild::<f64>(&q, codes, &scales, &zeros)
        } else {
            rebuild::<f32>(&q, codes, &scales, &zeros)
        };
        Ok((
            QuantizedLinear {
                w_hat,
                grids: Grids { scale, zero },
                error: None,
                ..q
            },
            st,
        ))
    }

    fn sub(&self, a: &Mat, b: &Mat) -> Result<Mat> {
        if a.len() != b.len() {
            bail!("sub: {} − {}", a.describe(), b.describe());
        }
        Ok(match (vals(a, "a")?, vals(b, "b")?) {
            (Vals::F32(x), Vals::F32(y)) => Mat::f32(
                x.iter().zip(&y).map(|(p, q)| p - q).collect(),
                a.batch,
                a.rows,
                a.cols,
            ),
            _ => {
                let (x, y) = (conv::<f64>(a, "a")?, conv::<f64>(b, "b")?);
                Mat::f64(
                    x.iter().zip(&y).map(|(p, q)| p - q).collect(),
                    a.batch,
                    a.rows,
                    a.cols,
                )
            }
        })
    }

    fn pack(&self, q: &QuantizedLinear) -> Result<Packed> {
        let scales = conv::<f32>(&q.grids.scale, "scales")?;
        let zeros = conv::<f32>(&q.grids.zero, "zeros")?;
        crate::quant::pack::pack_codes(
            codes_host(&q.codes)?,
            &scales,
            &zeros,
            &q.g_idx,
            q.d_out,
            q.d_in,
            q.bits,
            q.n_groups(),
        )
        .map_err(|m| anyhow!("pack: {m}"))
    }
}

fn reorder_grids(g: &Grids, row_perm: &[usize], gather: bool) -> Result<Grids> {
    let (rows, ng) = (g.rows(), g.n_groups());
    if row_perm.len() != rows {
        bail!(
            "reorder: {} grid rows for a permutation of {}",
            rows,
            row_perm.len()
        );
    }
    let one = |m: &Mat| -> Result<Mat> {
        Ok(match vals(m, "grids")? {
            Vals::F32(v) => Mat::f32(permute_rows(&v, ng, row_perm, gather), 1, rows, ng),
            Vals::F64(v) => Mat::f64(permute_rows(&v, ng, row_perm, gather), 1, rows, ng),
        })
    };
    Ok(Grids {
        scale: one(&g.scale)?,
        zero: one(&g.zero)?,
    })
}

/// tr(A H Aᵀ) of every A of `a` on the host.
fn quad_forms_host(h: &Mat, a: &[&Mat]) -> Result<Vec<f64>> {
    check_sym(h, "quad_forms")?;
    let n = h.rows;
    if a.iter().any(|m| m.cols != n || m.batch != 1) {
        bail!("quad_forms: a matrix does not have {n} columns");
    }
    let rows: usize = a.iter().map(|m| m.rows).sum();
    let exact = a.iter().any(|m| m.host_f64().is_some());
    let hv = as_f64(h, "H")?;
    // All A stacked: one GEMM A·H. f64 when an A is f64 (the exactness tests), else f32 with f64 sums: the
    // report's relative errors need a few digits, and f32 halves the time of the CPU's error report.
    Ok(if exact {
        let stacked: Vec<f64> = a
            .iter()
            .map(|m| conv::<f64>(m, "A"))
            .collect::<Result<Vec<_>>>()?
            .concat();
        quad_forms_f64(&stacked, &hv, rows, n, a)
    } else {
        let stacked: Vec<f32> = a
            .iter()
            .map(|m| conv::<f32>(m, "A"))
            .collect::<Result<Vec<_>>>()?
            .concat();
        quad_forms_f32(&stacked, &hv, rows, n, a)
    })
}

/// tr(A_i H A_iᵀ) of the matrices stacked in `a` [rows × n] (their row counts from `parts`), in f64 (the
/// exactness tests' inputs): one parallel GEMM A·H, then f64 sums.
fn quad_forms_f64(a: &[f64], h: &[f64], rows: usize, n: usize, parts: &[&Mat]) -> Vec<f64> {
    use faer::{Accum, Mat as FMat, MatRef, Par, linalg::matmul::matmul};
    let am = MatRef::from_row_major_slice(a, rows, n);
    let hm = MatRef::from_row_major_slice(h, n, n);
    let mut ah = FMat::<f64>::zeros(rows, n);
    matmul(ah.as_mut(), Accum::Replace, am, hm, 1.0, Par::rayon(0));
    let mut out = Vec::with_capacity(parts.len());
    let mut r0 = 0;
    for m in parts {
        let mut total = 0f64;
        for r in r0..r0 + m.rows {
            for c in 0..n {
                total += a[r * n + c] * ah[(r, c)];
            }
        }
        out.push(total);
        r0 += m.rows;
    }
    out
}

/// `quad_forms_f64`'s f32 twin, on half the GEMM: with L = the strict lower triangle of H plus half its
/// diagonal, a H aᵀ = 2·a·(a L)ᵀ, so one triangular product A·L (f32, faer) and f64 sums.
fn quad_forms_f32(a: &[f32], h: &[f64], rows: usize, n: usize, parts: &[&Mat]) -> Vec<f64> {
    use faer::linalg::matmul::triangular::{BlockStructure, matmul};
    use faer::{Accum, MatMut, MatRef, Par};
    let l: Vec<f32> = (0..n * n)
        .map(|k| match (k / n, k % n) {
            (i, j) if j < i => h[k] as f32,
            (i, j) if j == i => (0.5 * h[k]) as f32,
            _ => 0.0,
        })
        .collect();
    // Row-major, so the sums below read A and A·L along the same rows (a column-major product made them
    // stride by `rows`, which at 3072 × 576 cost as much as the product).
    let mut al = vec![0f32; rows * n];
    matmul(
        MatMut::from_row_major_slice_mut(&mut al, rows, n),
        BlockStructure::Rectangular,
        Accum::Replace,
        MatRef::from_row_major_slice(a, rows, n),
        BlockStructure::Rectangular,
        MatRef::from_row_major_slice(&l, n, n),
        BlockStructure::TriangularLower,
        1.0f32,
        Par::rayon(0),
    );
    // Each row's dot product in eight f64 lanes (one running sum is a chain of dependent adds, ~2 ms at
    // 3072 × 576), rows on every thread, then the rows in order.
    let row_sums: Vec<f64> = a
        .par_chunks_exact(n)
        .zip(al.par_chunks_exact(n))
        .map(|(x, y)| {
            let mut lanes = [0f64; 8];
            let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
            let tail: f64 = xc
                .remainder()
                .iter()
                .zip(yc.remainder())
                .map(|(&p, &q)| p as f64 * q as f64)
                .sum();
            for (p, q) in xc.zip(yc) {
                for ((l, &p), &q) in lanes.iter_mut().zip(p).zip(q) {
                    *l += p as f64 * q as f64;
                }
            }
            lanes.iter().sum::<f64>() + tail
        })
        .collect();
    let mut out = Vec::with_capacity(parts.len());
    let mut r0 = 0;
    for m in parts {
        out.push(2.0 * row_sums[r0..r0 + m.rows].iter().sum::<f64>());
        r0 += m.rows;
    }
    out
}
