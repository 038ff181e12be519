//! Hessian preparation for the sweeps (design.md §4.2): dead inputs, damping with bounded retries, and
//! U = chol(H⁻¹)ᵀ (the paper's Alg. 1 l.5–6; Alg. 2's U_col).

use faer::linalg::triangular_inverse::invert_lower_triangular;
use faer::{Accum, Mat, Par, Side, linalg::matmul::matmul};

/// λ of H += λ·mean(diag H)·I (GPTQ's `percdamp`).
pub const DEFAULT_DAMP: f64 = 0.01;
/// Damping rounds tried before a Hessian is declared singular.
pub const MAX_DAMP_TRIES: usize = 8;

/// Dead inputs (H_ii = 0: the input never fires): set H_ii = `dead_diag` so H stays invertible. Returns the
/// dead indices; the caller zeroes those columns of W (design.md §4.2), so their quantization error is 0 and
/// the value of `dead_diag` only enters mean(diag H) for damping.
pub fn fix_dead_inputs(h: &mut [f64], n: usize, dead_diag: f64) -> Vec<usize> {
    assert_eq!(h.len(), n * n, "H is not [{n} × {n}]");
    let dead: Vec<usize> = (0..n).filter(|&i| h[i * n + i] == 0.0).collect();
    for &i in &dead {
        h[i * n + i] = dead_diag;
    }
    dead
}

fn to_mat(h: &[f64], n: usize) -> Mat<f64> {
    Mat::from_fn(n, n, |i, j| h[i * n + j])
}

/// U = chol(H⁻¹)ᵀ [n × n] upper triangular, row-major. None when H is not numerically positive definite.
///
/// One Cholesky and one triangular inverse instead of design.md's "Cholesky, invert, Cholesky again" (same
/// U, ~3× fewer flops): with J the reversal permutation and J H J = L' L'ᵀ, H = R Rᵀ for the upper R = J L' J,
/// so H⁻¹ = R⁻ᵀ R⁻¹ with R⁻ᵀ lower, i.e. chol(H⁻¹) = R⁻ᵀ and U = R⁻¹ = J L'⁻¹ J.
/// [`cholesky_upper_inverse_reference`] is the three-step version; a test checks they agree.
pub fn cholesky_upper_inverse(h: &[f64], n: usize) -> Option<Vec<f64>> {
    assert_eq!(h.len(), n * n, "H is not [{n} × {n}]");
    let par = if n >= 512 { Par::rayon(0) } else { Par::Seq };
    let jhj = Mat::from_fn(n, n, |i, j| h[(n - 1 - i) * n + (n - 1 - j)]);
    let l = jhj.llt(Side::Lower).ok()?;
    let mut linv = Mat::<f64>::zeros(n, n);
    invert_lower_triangular(linv.as_mut(), l.L(), par);
    let mut u = vec![0.0; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = linv[(n - 1 - i, n - 1 - j)];
        }
    }
    if u.iter().all(|x| x.is_finite()) && (0..n).all(|i| u[i * n + i] > 0.0) {
        Some(u)
    } else {
        None
    }
}

/// U = chol(H⁻¹)ᵀ as design.md §4.2 words it: Cholesky of H, invert via the factor (H⁻¹ = L⁻ᵀ L⁻¹), Cholesky
/// again. Kept as the oracle of [`cholesky_upper_inverse`].
pub fn cholesky_upper_inverse_reference(h: &[f64], n: usize) -> Option<Vec<f64>> {
    assert_eq!(h.len(), n * n, "H is not [{n} × {n}]");
    let l = to_mat(h, n).llt(Side::Lower).ok()?;
    let mut linv = Mat::<f64>::zeros(n, n);
    invert_lower_triangular(linv.as_mut(), l.L(), Par::Seq);
    let mut hinv = Mat::<f64>::zeros(n, n);
    matmul(
        hinv.as_mut(),
        Accum::Replace,
        linv.transpose(),
        linv.as_ref(),
        1.0,
        Par::Seq,
    );
    let m = hinv.llt(Side::Lower).ok()?;
    let m = m.L();
    Some(
        (0..n * n)
            .map(|k| {
                if k % n >= k / n {
                    m[(k % n, k / n)]
                } else {
                    0.0
                }
            })
            .collect(),
    )
}

/// H += λ·mean(diag H)·I, then U = chol(H⁻¹)ᵀ; if the factorization fails, the same amount is added again,
/// up to `max_tries` rounds. H is left damped (the scale searches score with the damped H).
pub fn damped_upper_inverse(
    h: &mut [f64],
    n: usize,
    damp: f64,
    max_tries: usize,
) -> anyhow::Result<Vec<f64>> {
    assert_eq!(h.len(), n * n, "H is not [{n} × {n}]");
    let amount = damp * mean_diag(h, n);
    for _ in 0..max_tries.max(1) {
        add_diag(h, n, amount);
        if let Some(u) = cholesky_upper_inverse(h, n) {
            return Ok(u);
        }
    }
    Err(singular(n, damp, amount, max_tries))
}

fn mean_diag(h: &[f64], n: usize) -> f64 {
    (0..n).map(|i| h[i * n + i]).sum::<f64>() / n.max(1) as f64
}

fn add_diag(h: &mut [f64], n: usize, amount: f64) {
    for i in 0..n {
        h[i * n + i] += amount;
    }
}

fn singular(n: usize, damp: f64, amount: f64, max_tries: usize) -> anyhow::Error {
    crate::input_err!(
        "Hessian [{n} × {n}] stays singular after {max_tries} damping rounds of {damp}·mean(diag H) = {amount:e}"
    )
}

/// Order of columns by descending diag(H) (act-order); ties keep the original order.
pub fn act_order_perm(h: &[f64], n: usize) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..n).collect();
    perm.sort_by(|&a, &b| h[b * n + b].total_cmp(&h[a * n + a]));
    perm
}

/// H[perm, perm].
pub fn permute_sym(h: &[f64], n: usize, perm: &[usize]) -> Vec<f64> {
    let mut out = vec![0.0; n * n];
    for (i, &pi) in perm.iter().enumerate() {
        for (j, &pj) in perm.iter().enumerate() {
            out[i * n + j] = h[pi * n + pj];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upper_inverse_factor_reconstructs_inverse() {
        let n = 5;
        let mut h = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] =
                    1.0 / (1.0 + (i as f64 - j as f64).abs()) + if i == j { 1.0 } else { 0.0 };
            }
        }
        let u = cholesky_upper_inverse(&h, n).unwrap();
        let r = cholesky_upper_inverse_reference(&h, n).unwrap();
        for (a, b) in u.iter().zip(&r) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        // Uᵀ U = H⁻¹  ⇒  H Uᵀ U = I.
        for i in 0..n {
            for j in 0..n {
                let mut s = 0.0;
                for k in 0..n {
                    let utu: f64 = (0..n).map(|l| u[l * n + k] * u[l * n + j]).sum();
                    s += h[i * n + k] * utu;
                }
                assert!((s - if i == j { 1.0 } else { 0.0 }).abs() < 1e-10);
            }
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0);
            }
        }
    }

    #[test]
    fn singular_hessian_is_damped_or_reported() {
        let n = 3;
        let mut h = vec![1.0; n * n]; // rank 1
        assert!(cholesky_upper_inverse(&h, n).is_none());
        assert!(damped_upper_inverse(&mut h, n, 0.01, 4).is_ok());
        let mut z = vec![0.0; n * n];
        let err = damped_upper_inverse(&mut z, n, 0.01, 3).unwrap_err();
        assert!(err.to_string().contains("singular"), "{err}");
    }
}
