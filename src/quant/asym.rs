//! Asymmetric calibration (GPTAQ, Li et al. 2025): a linear of block l reads ã, its input in the model whose
//! blocks < l are already quantized, where the FP model reads a. GPTQ fits Ŵ to W's output on ã; asymmetric
//! calibration fits it to W's output on a, the FP model's, so each block also undoes part of the error the
//! earlier blocks left in its input.
//!
//! With H = Σ ã ãᵀ and D = Σ (a − ã) ãᵀ (both ×2/N, as every H here), Σ ‖W a − Ŵ ã‖² + μ‖Ŵ − W‖²_F is
//! minimised by Ŵ = W + W D (H + μI)⁻¹ (a ridge toward W, μ = λ·mean(diag H) as GPTQ's damping). GPTQ or BoA
//! on that target with the usual H minimises the same objective, since it equals tr((Ŵ − W*) H (Ŵ − W*)ᵀ) +
//! const; BoA's row Hessian sits on the output side, so it carries over. The full correction overfits the
//! calibration set: on the rotated demo model at 3 bits it multiplied perplexity by 7–29 (README,
//! "Asymmetric calibration"). GPTAQ scales its correction by α = 0.25 and keeps only a triangular part of it
//! inside the sweep; here the target moves by α·W D (H + μI)⁻¹, the same correction in every sweep order.

use faer::linalg::solvers::Solve;
use faer::{Accum, Mat, Par, Side, linalg::matmul::matmul};

/// GPTAQ's scale of the correction.
pub const DEFAULT_ALPHA: f64 = 0.25;

/// `acc` [n × n] += Σ_t (a_t − ã_t) ã_tᵀ for one chunk of m tokens (one per row of `a` and `a_q`, n wide).
/// The product is formed in f32 from the difference (no cancellation between two large sums) and added into
/// f64 sums, as the Hessians are.
pub fn add_diff_cross(acc: &mut [f64], a: &[f32], a_q: &[f32], m: usize, n: usize) {
    debug_assert!(a.len() == m * n && a_q.len() == m * n && acc.len() == n * n);
    let diff = Mat::<f32>::from_fn(m, n, |t, i| a[t * n + i] - a_q[t * n + i]);
    let q = faer::MatRef::from_row_major_slice(a_q, m, n);
    let mut c = Mat::<f32>::zeros(n, n);
    let par = if m * n >= 1 << 16 {
        Par::rayon(0)
    } else {
        Par::Seq
    };
    matmul(c.as_mut(), Accum::Replace, diff.transpose(), q, 1.0, par);
    for i in 0..n {
        for j in 0..n {
            acc[i * n + j] += c[(i, j)] as f64;
        }
    }
}

/// The target W + α·W D (H + μI)⁻¹ for W [d_out × n] and D, H [n × n] on one scale, μ = `damp`·mean(diag H).
/// An input that never fires (H_ii = 0) gets mean(diag H) on its diagonal, as GPTQ's dead inputs do. None
/// when the damped H does not factor or the target is not finite.
pub fn target(
    w: &[f32],
    d_out: usize,
    n: usize,
    d: &[f64],
    h: &[f64],
    damp: f64,
    alpha: f64,
) -> Option<Vec<f32>> {
    shift(w, d_out, &ridge_solve(n, d, h, damp)?, alpha)
}

/// Z = (H + μI)⁻¹ Dᵀ [n × n], the part of `target` that does not depend on W: the linears that read one input
/// share it. None when the damped H does not factor.
pub fn ridge_solve(n: usize, d: &[f64], h: &[f64], damp: f64) -> Option<Mat<f64>> {
    debug_assert!(d.len() == n * n && h.len() == n * n);
    let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n.max(1) as f64;
    let mu = damp * mean;
    let hd = Mat::<f64>::from_fn(n, n, |i, j| match (i == j, h[i * n + j]) {
        (true, 0.0) => mean.max(1.0) + mu,
        (true, v) => v + mu,
        (false, v) => v,
    });
    let llt = hd.llt(Side::Lower).ok()?;
    // (H + μI)⁻¹ Dᵀ, whose transpose is D (H + μI)⁻¹.
    let dt = Mat::<f64>::from_fn(n, n, |i, j| d[j * n + i]);
    Some(llt.solve(dt.as_ref()))
}

/// W + α·W Zᵀ for W [d_out × n] and `ridge_solve`'s Z; None when it is not finite.
pub fn shift(w: &[f32], d_out: usize, z: &Mat<f64>, alpha: f64) -> Option<Vec<f32>> {
    let n = z.nrows();
    debug_assert!(w.len() == d_out * n);
    let fw = Mat::<f64>::from_fn(d_out, n, |r, i| w[r * n + i] as f64);
    let mut corr = Mat::<f64>::zeros(d_out, n);
    let par = if d_out * n >= 1 << 16 {
        Par::rayon(0)
    } else {
        Par::Seq
    };
    matmul(
        corr.as_mut(),
        Accum::Replace,
        fw.as_ref(),
        z.transpose(),
        alpha,
        par,
    );
    let out: Vec<f32> = (0..d_out * n)
        .map(|k| (w[k] as f64 + corr[(k / n, k % n)]) as f32)
        .collect();
    out.iter().all(|v| v.is_finite()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded stream of values in [-1, 1).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
            })
            .collect()
    }

    fn gram(a: &[f32], b: &[f32], m: usize, n: usize) -> Vec<f64> {
        let mut g = vec![0.0; n * n];
        for t in 0..m {
            for i in 0..n {
                for j in 0..n {
                    g[i * n + j] += a[t * n + i] as f64 * b[t * n + j] as f64;
                }
            }
        }
        g
    }

    /// α = 1 gives the ridge least-squares fit: Ŵ (H + μI) = W (C + μI) with C = Σ a ãᵀ, i.e. the gradient of
    /// Σ‖W a − Ŵ ã‖² + μ‖Ŵ − W‖² vanishes; α scales the step; equal streams leave W alone.
    #[test]
    fn full_correction_solves_the_asymmetric_least_squares() {
        let (m, n, d_out) = (200, 12, 5);
        let a = values(1, m * n);
        let noise = values(2, m * n);
        let a_q: Vec<f32> = a.iter().zip(&noise).map(|(x, e)| x + 0.2 * e).collect();
        let w = values(3, d_out * n);
        let mut d = vec![0.0; n * n];
        add_diff_cross(&mut d, &a[..100 * n], &a_q[..100 * n], 100, n);
        add_diff_cross(&mut d, &a[100 * n..], &a_q[100 * n..], 100, n);
        let h = gram(&a_q, &a_q, m, n);
        let c = gram(&a, &a_q, m, n);
        for k in 0..n * n {
            assert!(
                (d[k] - (c[k] - h[k])).abs() < 1e-4,
                "D[{k}] {} against {}",
                d[k],
                c[k] - h[k]
            );
        }
        let damp = 0.01;
        let mu = damp * (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
        let full = target(&w, d_out, n, &d, &h, damp, 1.0).unwrap();
        for r in 0..d_out {
            for j in 0..n {
                let lhs: f64 = (0..n)
                    .map(|i| {
                        full[r * n + i] as f64 * (h[i * n + j] + if i == j { mu } else { 0.0 })
                    })
                    .sum();
                let rhs: f64 = (0..n)
                    .map(|i| w[r * n + i] as f64 * (c[i * n + j] + if i == j { mu } else { 0.0 }))
                    .sum();
                assert!(
                    (lhs - rhs).abs() < 1e-3 * rhs.abs().max(1.0),
                    "row {r} col {j}: {lhs} against {rhs}"
                );
            }
        }
        let quarter = target(&w, d_out, n, &d, &h, damp, 0.25).unwrap();
        for k in 0..d_out * n {
            let want = w[k] + 0.25 * (full[k] - w[k]);
            assert!((quarter[k] - want).abs() < 1e-5, "α = 0.25 at {k}");
        }
        assert!(
            full.iter().zip(&w).any(|(x, y)| (x - y).abs() > 1e-3),
            "the correction is empty"
        );
        let same = target(&w, d_out, n, &vec![0.0; n * n], &h, damp, 1.0).unwrap();
        assert_eq!(same, w, "equal streams moved W");
    }

    /// A dead input (H_ii = 0, its column of D zero) factors and leaves that column's target finite.
    #[test]
    fn dead_inputs_factor() {
        let n = 3;
        let h = vec![2.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.5, 0.0, 1.0];
        let d = vec![0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.1];
        let t = target(&[1.0, 2.0, 3.0], 1, n, &d, &h, 0.01, 0.25).unwrap();
        assert_eq!(t[1], 2.0);
        assert!(t.iter().all(|v| v.is_finite()));
    }
}
