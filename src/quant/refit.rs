//! Least-squares scales for fixed codes (`run --refit-scales`). A GPTQ sweep fixes each group's grid when it
//! reaches the group's first column, then rounds every later column of the group after the error feedback
//! has moved it; the scale chosen for the weights as they were is not the best one for the codes as they
//! ended. With the codes q and zero points z fixed, Ŵ_ra = s_{r,g(a)}·c_ra (c = q − z), and the layer's
//! output error tr((W − Ŵ) H (W − Ŵ)ᵀ) is, row by row, a quadratic in that row's scales:
//!   f(s) = sᵀA s − 2 bᵀs + wᵀHw,   A_gg' = Σ_{a∈g, a'∈g'} c_a H_aa' c_a',   b_g = Σ_{a∈g} c_a (H w)_a,
//! minimised by A s = b. llama.cpp's quantizer refits each block's scale the same way with a diagonal H (its
//! importance matrix); here H is the full input covariance, so groups are fitted together. The sweep's scales
//! are a feasible point: a row whose solve does not lower f keeps them, so no row's error grows.
//!
//! Cost per linear: d_out·d_in² multiply-adds (the same as the error report's quadratic form) as one faer GEMM
//! per group over row chunks, plus a Cholesky of n_groups² per row.

use crate::ops::RefitStats;
use faer::{Accum, MatRef, Par, linalg::matmul::matmul};
use rayon::prelude::*;

/// Rows per chunk: each chunk holds [rows × d_in] f64 of products and [rows × n_groups²] of A.
const CHUNK: usize = 32;

/// Refits `scales` [d_out × n_groups] in place for the codes [d_out × d_in] and `zeros` [d_out × n_groups] of
/// W [d_out × d_in] with H [d_in × d_in] (undamped, symmetric), column c in group g_idx[c].
#[allow(clippy::too_many_arguments)]
pub fn refit_scales(
    w: &[f64],
    h: &[f64],
    codes: &[u8],
    scales: &mut [f64],
    zeros: &[f64],
    g_idx: &[u32],
    d_out: usize,
    d_in: usize,
) -> RefitStats {
    let ng = scales.len().checked_div(d_out).unwrap_or(0);
    // Columns grouped (a stable order, so contiguous groups keep theirs) and H in that order.
    let mut perm: Vec<usize> = (0..d_in).collect();
    perm.sort_by_key(|&c| g_idx[c]);
    let mut starts = vec![0usize; ng + 1];
    for &c in &perm {
        starts[g_idx[c] as usize + 1] += 1;
    }
    for g in 0..ng {
        starts[g + 1] += starts[g];
    }
    // Contiguous groups (no act-order) read H as it is: a copy of a 7B down_proj's is ~1 GB of f64.
    let permuted: Option<Vec<f64>> = perm.iter().enumerate().any(|(i, &c)| i != c).then(|| {
        perm.iter()
            .flat_map(|&a| perm.iter().map(move |&b| h[a * d_in + b]))
            .collect()
    });
    let hp = MatRef::from_row_major_slice(permuted.as_deref().unwrap_or(h), d_in, d_in);

    let per_chunk: Vec<(Vec<f64>, RefitStats)> = (0..d_out.div_ceil(CHUNK))
        .into_par_iter()
        .map(|k| {
            let (r0, r1) = (k * CHUNK, ((k + 1) * CHUNK).min(d_out));
            let rows = r1 - r0;
            // c and w of the chunk's rows, columns grouped.
            let mut c = vec![0.0f64; rows * d_in];
            let mut wv = vec![0.0f64; rows * d_in];
            for i in 0..rows {
                let r = r0 + i;
                for (a, &col) in perm.iter().enumerate() {
                    let z = zeros[r * ng + g_idx[col] as usize];
                    c[i * d_in + a] = codes[r * d_in + col] as f64 - z;
                    wv[i * d_in + a] = w[r * d_in + col];
                }
            }
            let cm = MatRef::from_row_major_slice(&c, rows, d_in);
            let wm = MatRef::from_row_major_slice(&wv, rows, d_in);
            // W H and, per group g', C[:, g'] H[g', :]: row i of the latter dotted with c_i over group g gives
            // A_i[g][g'].
            let mut wh = faer::Mat::<f64>::zeros(rows, d_in);
            matmul(wh.as_mut(), Accum::Replace, wm, hp, 1.0, Par::Seq);
            let mut a = vec![0.0f64; rows * ng * ng];
            let mut p = faer::Mat::<f64>::zeros(rows, d_in);
            for g2 in 0..ng {
                let (s, e) = (starts[g2], starts[g2 + 1]);
                if s == e {
                    continue;
                }
                matmul(
                    p.as_mut(),
                    Accum::Replace,
                    cm.subcols(s, e - s),
                    hp.subrows(s, e - s),
                    1.0,
                    Par::Seq,
                );
                for i in 0..rows {
                    for g in 0..ng {
                        let mut acc = 0.0;
                        for col in starts[g]..starts[g + 1] {
                            acc += c[i * d_in + col] * p[(i, col)];
                        }
                        a[(i * ng + g) * ng + g2] = acc;
                    }
                }
            }
            let mut out = scales[r0 * ng..r1 * ng].to_vec();
            let mut st = RefitStats::default();
            for i in 0..rows {
                let ai = &mut a[i * ng * ng..(i + 1) * ng * ng];
                let b: Vec<f64> = (0..ng)
                    .map(|g| {
                        (starts[g]..starts[g + 1])
                            .map(|col| c[i * d_in + col] * wh[(i, col)])
                            .sum()
                    })
                    .collect();
                let w_form: f64 = (0..d_in).map(|col| wv[i * d_in + col] * wh[(i, col)]).sum();
                let old = &mut out[i * ng..(i + 1) * ng];
                let f = |s: &[f64], ai: &[f64]| {
                    let mut q = w_form;
                    for g in 0..ng {
                        let row: f64 = (0..ng).map(|g2| ai[g * ng + g2] * s[g2]).sum();
                        q += s[g] * row - 2.0 * b[g] * s[g];
                    }
                    q
                };
                let before = f(old, ai);
                st.before += before;
                let new = solve_row(ai, &b, old, ng);
                let after = new.as_deref().map(|s| f(s, ai));
                match (new, after) {
                    (Some(s), Some(after)) if after.is_finite() && after < before => {
                        old.copy_from_slice(&s);
                        st.after += after;
                        st.rows += 1;
                    }
                    _ => st.after += before,
                }
            }
            (out, st)
        })
        .collect();
    let mut total = RefitStats::default();
    for (k, (s, st)) in per_chunk.into_iter().enumerate() {
        let r0 = k * CHUNK;
        scales[r0 * ng..r0 * ng + s.len()].copy_from_slice(&s);
        total.before += st.before;
        total.after += st.after;
        total.rows += st.rows;
    }
    total
}

/// The minimiser of sᵀA s − 2bᵀs, with every group whose codes are all at the zero point (A_gg = 0: its scale
/// changes nothing) held at its `old` value; None when A is not positive definite on the rest.
fn solve_row(a: &[f64], b: &[f64], old: &[f64], ng: usize) -> Option<Vec<f64>> {
    let free: Vec<usize> = (0..ng).filter(|&g| a[g * ng + g] > 0.0).collect();
    let n = free.len();
    if n == 0 {
        return None;
    }
    let mut m = vec![0.0f64; n * n];
    let mut rhs = vec![0.0f64; n];
    for (i, &g) in free.iter().enumerate() {
        rhs[i] = b[g];
        for (j, &g2) in free.iter().enumerate() {
            m[i * n + j] = a[g * ng + g2];
        }
        // The held groups' terms move to the right-hand side (they are zero: A_gg = 0 and A ⪰ 0 make the
        // whole row and column zero, so this is exact).
    }
    cholesky_solve(&mut m, &mut rhs, n)?;
    let mut s = old.to_vec();
    for (i, &g) in free.iter().enumerate() {
        s[g] = rhs[i];
    }
    s.iter().all(|v| v.is_finite()).then_some(s)
}

/// Solves M x = rhs in place (x in `rhs`) for a symmetric positive definite M [n × n] (lower Cholesky factor
/// in `m`); None when a pivot is not positive.
fn cholesky_solve(m: &mut [f64], rhs: &mut [f64], n: usize) -> Option<()> {
    for j in 0..n {
        let d = m[j * n + j] - (0..j).map(|k| m[j * n + k] * m[j * n + k]).sum::<f64>();
        if !(d > 0.0 && d.is_finite()) {
            return None;
        }
        let d = d.sqrt();
        m[j * n + j] = d;
        for i in j + 1..n {
            let v = m[i * n + j] - (0..j).map(|k| m[i * n + k] * m[j * n + k]).sum::<f64>();
            m[i * n + j] = v / d;
        }
    }
    for i in 0..n {
        let v = rhs[i] - (0..i).map(|k| m[i * n + k] * rhs[k]).sum::<f64>();
        rhs[i] = v / m[i * n + i];
    }
    for i in (0..n).rev() {
        let v = rhs[i] - (i + 1..n).map(|k| m[k * n + i] * rhs[k]).sum::<f64>();
        rhs[i] = v / m[i * n + i];
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    /// A random SPD H and W, and the codes of a 4-bit symmetric grid with deliberately poor scales.
    struct Case {
        w: Vec<f64>,
        h: Vec<f64>,
        codes: Vec<u8>,
        scales: Vec<f64>,
        zeros: Vec<f64>,
        g_idx: Vec<u32>,
        d_out: usize,
        d_in: usize,
    }

    impl Case {
        fn new(d_out: usize, d_in: usize, gl: usize, seed: u64) -> Case {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let t = 2 * d_in;
            let x: Vec<f64> = (0..d_in * t).map(|_| rng.random::<f64>() - 0.5).collect();
            let mut h = vec![0.0; d_in * d_in];
            for i in 0..d_in {
                for j in 0..d_in {
                    h[i * d_in + j] = (0..t).map(|k| x[i * t + k] * x[j * t + k]).sum();
                }
            }
            let w: Vec<f64> = (0..d_out * d_in)
                .map(|_| rng.random::<f64>() - 0.5)
                .collect();
            let ng = d_in / gl;
            let mut scales = vec![0.0; d_out * ng];
            let mut codes = vec![0u8; d_out * d_in];
            for r in 0..d_out {
                for g in 0..ng {
                    let m = (0..gl)
                        .map(|i| w[r * d_in + g * gl + i].abs())
                        .fold(0.0, f64::max);
                    scales[r * ng + g] = 1.3 * m / 7.0;
                }
                for c in 0..d_in {
                    let q = (w[r * d_in + c] / scales[r * ng + c / gl]).round() + 8.0;
                    codes[r * d_in + c] = q.clamp(0.0, 15.0) as u8;
                }
            }
            Case {
                w,
                h,
                codes,
                scales,
                zeros: vec![8.0; d_out * ng],
                g_idx: (0..d_in).map(|c| (c / gl) as u32).collect(),
                d_out,
                d_in,
            }
        }

        /// tr((W − Ŵ) H (W − Ŵ)ᵀ) with scales `s`, the slow way.
        fn error(&self, s: &[f64]) -> f64 {
            let (d_out, d_in) = (self.d_out, self.d_in);
            let ng = s.len() / d_out;
            let mut tot = 0.0;
            for r in 0..d_out {
                let d: Vec<f64> = (0..d_in)
                    .map(|c| {
                        let k = r * ng + self.g_idx[c] as usize;
                        let q = self.codes[r * d_in + c] as f64 - self.zeros[k];
                        self.w[r * d_in + c] - s[k] * q
                    })
                    .collect();
                for a in 0..d_in {
                    for b in 0..d_in {
                        tot += d[a] * self.h[a * d_in + b] * d[b];
                    }
                }
            }
            tot
        }

        fn refit(&self) -> (Vec<f64>, RefitStats) {
            let mut s = self.scales.clone();
            let st = refit_scales(
                &self.w,
                &self.h,
                &self.codes,
                &mut s,
                &self.zeros,
                &self.g_idx,
                self.d_out,
                self.d_in,
            );
            (s, st)
        }
    }

    #[test]
    fn refit_lowers_the_error_to_the_least_squares_optimum() {
        let c = Case::new(37, 48, 8, 1);
        let e0 = c.error(&c.scales);
        let (s, st) = c.refit();
        let e1 = c.error(&s);
        assert!((st.before - e0).abs() <= 1e-9 * e0, "{} vs {e0}", st.before);
        assert!((st.after - e1).abs() <= 1e-9 * e0, "{} vs {e1}", st.after);
        assert!(e1 < 0.9 * e0, "{e1} vs {e0}");
        assert_eq!(st.rows, c.d_out);
        // Optimal: moving any one scale either way raises the error.
        for k in [0, 5, 100, s.len() - 1] {
            for eps in [1e-4, -1e-4] {
                let mut t = s.clone();
                t[k] += eps * s[k].abs().max(1e-3);
                assert!(c.error(&t) > e1, "scale {k}");
            }
        }
    }

    #[test]
    fn scattered_groups_give_the_contiguous_result_and_dead_groups_keep_their_scale() {
        let mut c = Case::new(9, 32, 8, 2);
        // Row 0's group 1 at its zero point: its scale is held.
        c.codes[8..16].fill(8);
        let (a, _) = c.refit();
        assert_eq!(a[1], c.scales[1]);
        // The same problem with columns shuffled (act-order's g_idx): the same scales.
        let (d_out, d_in) = (c.d_out, c.d_in);
        let perm: Vec<usize> = (0..d_in).map(|i| (i * 13) % d_in).collect();
        let rows = |v: &[f64]| -> Vec<f64> {
            (0..d_out)
                .flat_map(|r| perm.iter().map(move |&j| v[r * d_in + j]))
                .collect()
        };
        let (h, codes) = (&c.h, &c.codes);
        let shuffled = Case {
            w: rows(&c.w),
            h: perm
                .iter()
                .flat_map(|&i| perm.iter().map(move |&j| h[i * d_in + j]))
                .collect(),
            codes: (0..d_out)
                .flat_map(|r| perm.iter().map(move |&j| codes[r * d_in + j]))
                .collect(),
            scales: c.scales.clone(),
            zeros: c.zeros.clone(),
            g_idx: perm.iter().map(|&j| c.g_idx[j]).collect(),
            d_out,
            d_in,
        };
        let (b, _) = shuffled.refit();
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-9 * x.abs().max(1e-12), "{x} vs {y}");
        }
    }
}
