//! `QuantOps` on the CPU: thin calls into the algorithm free functions of `quant::` (hessian_xxt,
//! cholesky_upper_inverse, gptq_block_sweep, boa_sweep), which are the oracles of the CUDA kernels.

use super::cpu::{CpuBackend, causal_softmax_probs};
use super::quant_ops::{AttnShape, QuantOps, StaticGrids, SweepResult, UCol};
use crate::quant::boa::{ColFactor, boa_sweep};
use crate::quant::gptq::{DynamicGroups, gptq_block_sweep};
use crate::quant::hessian::hessian_xxt;
use crate::quant::linalg::cholesky_upper_inverse;
use crate::quant::quantizer::Grid;
use faer::{Accum, MatMut, MatRef, Par, linalg::matmul::matmul};
use rayon::prelude::*;

/// Columns [c0, c0 + w) of the row-major [rows × ld] matrix `x`, contiguous.
fn gather_cols(x: &[f32], rows: usize, ld: usize, c0: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * w);
    for r in 0..rows {
        out.extend_from_slice(&x[r * ld + c0..r * ld + c0 + w]);
    }
    out
}

fn check_grids(g: &StaticGrids, rows: usize, n: usize) {
    assert_eq!(
        g.grids.len(),
        rows * g.n_groups,
        "grids not [{rows} × {}]",
        g.n_groups
    );
    assert_eq!(g.col_group.len(), n, "col_group not [{n}]");
    assert!(
        g.col_group.iter().all(|&k| (k as usize) < g.n_groups),
        "col_group names a group ≥ n_groups = {}",
        g.n_groups
    );
}

impl QuantOps for CpuBackend {
    fn xxt_accumulate(&self, h: &mut [f32], x: &[f32], m: usize, d: usize) {
        assert_eq!(h.len(), d * d, "H is not [{d} × {d}]");
        assert_eq!(x.len(), m * d, "X is not [{m} × {d}]");
        if m == 0 {
            return;
        }
        let mut s = vec![0f32; d * d];
        hessian_xxt(&mut s, x, m, d, d);
        h.iter_mut().zip(&s).for_each(|(a, &b)| *a += b);
    }

    fn head_covariance(&self, x: &[f32], m: usize, n_heads: usize, d_h: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            m * n_heads * d_h,
            "X is not [{m} × {n_heads}·{d_h}]"
        );
        let dd = d_h * d_h;
        let mut out = vec![0f32; n_heads * dd];
        if m == 0 {
            return out;
        }
        for (h, c) in out.chunks_mut(dd).enumerate() {
            hessian_xxt(c, &x[h * d_h..], m, d_h, n_heads * d_h);
        }
        out
    }

    fn v_col_covariance(&self, x: &[f32], q: &[f32], k: &[f32], s: AttnShape) -> Vec<f32> {
        let AttnShape { t, h, h_kv, d_h, d } = s;
        assert!(
            h_kv > 0 && h.is_multiple_of(h_kv),
            "h={h} not a multiple of h_kv={h_kv}"
        );
        assert_eq!(x.len(), t * d, "X is not [{t} × {d}]");
        assert_eq!(q.len(), t * h * d_h, "Q is not [{t} × {h}·{d_h}]");
        assert_eq!(k.len(), t * h_kv * d_h, "K is not [{t} × {h_kv}·{d_h}]");
        let mut out = vec![0f32; h * d * d];
        if t == 0 {
            return out;
        }
        let gs = h / h_kv;
        let xr = MatRef::from_row_major_slice(x, t, d);
        // One head at a time: A_h [t × t] is the largest temporary.
        for (head, g) in out.chunks_mut(d * d).enumerate() {
            let qh = gather_cols(q, t, h * d_h, head * d_h, d_h);
            let kh = gather_cols(k, t, h_kv * d_h, (head / gs) * d_h, d_h);
            let a = causal_softmax_probs(&qh, &kh, t, d_h);
            let mut y = vec![0f32; t * d];
            matmul(
                MatMut::from_row_major_slice_mut(&mut y, t, d),
                Accum::Replace,
                MatRef::from_row_major_slice(&a, t, t),
                xr,
                1.0f32,
                Par::rayon(0),
            );
            hessian_xxt(g, &y, t, d, d);
        }
        out
    }

    fn cholesky_upper_inverse_batched(
        &self,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Vec<Option<Vec<f32>>> {
        assert_eq!(h.len(), count * n * n, "H is not [{count} × {n} × {n}]");
        if n == 0 {
            return vec![Some(Vec::new()); count];
        }
        h.par_chunks(n * n)
            .map(|hb| {
                let h64: Vec<f64> = hb.iter().map(|&v| v as f64).collect();
                cholesky_upper_inverse(&h64, n).map(|u| u.iter().map(|&v| v as f32).collect())
            })
            .collect()
    }

    fn gptq_sweep(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        check_grids(&grids, rows, n);
        let mut w = w.to_vec();
        let mut g = grids.grids.to_vec();
        let mut out = SweepResult {
            q: vec![0.0; rows * n],
            codes: vec![0; rows * n],
        };
        gptq_block_sweep(
            &mut w,
            &mut out.q,
            &mut out.codes,
            u,
            rows,
            n,
            block_size,
            &mut g,
            grids.n_groups,
            grids.col_group,
            None,
            maxq,
        );
        out
    }

    fn gptq_sweep_dynamic(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        groups: &DynamicGroups,
        maxq: u32,
    ) -> (SweepResult, Vec<Grid<f32>>) {
        assert!(groups.g > 0, "group width 0");
        let n_groups = n.div_ceil(groups.g);
        let col_group: Vec<u32> = (0..n).map(|c| (c / groups.g) as u32).collect();
        let mut w = w.to_vec();
        let mut g = vec![Grid::default(); rows * n_groups];
        let mut out = SweepResult {
            q: vec![0.0; rows * n],
            codes: vec![0; rows * n],
        };
        gptq_block_sweep(
            &mut w,
            &mut out.q,
            &mut out.codes,
            u,
            rows,
            n,
            block_size,
            &mut g,
            n_groups,
            &col_group,
            Some(groups),
            maxq,
        );
        (out, g)
    }

    fn boa_sweep(
        &self,
        w: &[f32],
        u_col: UCol,
        u_row: &[f32],
        n_heads: usize,
        d_h: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        let rows = n_heads * d_h;
        check_grids(&grids, rows, n);
        assert_eq!(w.len(), rows * n, "W is not [{n_heads}·{d_h} × {n}]");
        if rows == 0 || n == 0 {
            return SweepResult::default();
        }
        let (cols, head_col): (Vec<ColFactor<f32>>, Vec<usize>) = match u_col {
            UCol::Shared(u) => {
                assert_eq!(u.len(), n * n, "U_col is not [{n} × {n}]");
                (
                    vec![ColFactor {
                        u,
                        col_group: grids.col_group,
                        dynamic: None,
                    }],
                    vec![0; n_heads],
                )
            }
            UCol::PerHead(u) => {
                assert_eq!(
                    u.len(),
                    n_heads * n * n,
                    "U_col is not [{n_heads} × {n} × {n}]"
                );
                (
                    u.chunks(n * n)
                        .map(|u| ColFactor {
                            u,
                            col_group: grids.col_group,
                            dynamic: None,
                        })
                        .collect(),
                    (0..n_heads).collect(),
                )
            }
        };
        let mut w = w.to_vec();
        let mut g = grids.grids.to_vec();
        let mut out = SweepResult {
            q: vec![0.0; rows * n],
            codes: vec![0; rows * n],
        };
        boa_sweep(
            &mut w,
            &mut out.q,
            &mut out.codes,
            &cols,
            &head_col,
            u_row,
            n_heads,
            d_h,
            n,
            block_size,
            &mut g,
            grids.n_groups,
            maxq,
        );
        out
    }
}
