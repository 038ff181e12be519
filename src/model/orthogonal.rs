//! Seeded orthogonal matrices Q (n × n) for the rotations of `rotate.rs`, applied to row-major f64 matrices
//! without forming Q where it has structure:
//! - randomized Hadamard Q = D · H / √n (D a diagonal of random ±1 from the seed, H from `hadamard.rs`),
//!   wherever a construction of order n exists: every entry has magnitude 1/√n, so no input channel can
//!   keep an outlier (QuaRot's choice; SpinQuant found it far better than random orthogonal matrices);
//! - else, or when asked for, a random orthogonal matrix: QR of an n × n standard Gaussian with R's diagonal
//!   made positive (so Q is Haar-distributed, not biased by the QR's sign convention).

use super::hadamard::Hadamard;
use faer::{Accum, Mat, MatMut, MatRef, Par, linalg::matmul::matmul};
use rand::RngExt;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum RotationKind {
    /// Randomized Hadamard where a construction of the size exists, else random orthogonal (says so).
    Hadamard,
    /// Seeded random orthogonal matrices for every rotation.
    Random,
}

enum Form {
    /// D · H / √n: `signs` is D's diagonal.
    Hadamard { h: Hadamard, signs: Vec<f64> },
    /// Q itself, n × n row-major.
    Dense(Vec<f64>),
}

pub struct Orthogonal {
    pub n: usize,
    form: Form,
    /// What Q is, e.g. "randomized Hadamard 576 = 36 (Paley II, q = 17) ⊗ 16 (Sylvester)".
    pub construction: String,
    /// Why a Hadamard was asked for and not used (no construction of that order).
    pub fallback: Option<String>,
}

impl Orthogonal {
    /// Q of order n drawn from `rng` (the caller seeds one stream per matrix).
    pub fn new(n: usize, kind: RotationKind, rng: &mut ChaCha8Rng) -> Orthogonal {
        let hadamard = match kind {
            RotationKind::Hadamard => Some(Hadamard::new(n)),
            RotationKind::Random => None,
        };
        match hadamard {
            Some(Ok(h)) => {
                let signs = (0..n)
                    .map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 })
                    .collect();
                Orthogonal {
                    n,
                    construction: format!("randomized Hadamard {}", h.describe()),
                    form: Form::Hadamard { h, signs },
                    fallback: None,
                }
            }
            other => Orthogonal {
                n,
                form: Form::Dense(random_orthogonal(n, rng)),
                construction: format!("random orthogonal {n} × {n} (QR of a Gaussian)"),
                fallback: other.and_then(Result::err),
            },
        }
    }

    /// H / √n itself, no random signs: the fixed transform of an online rotation (model/online.rs), which
    /// the forward applies by order alone; an error says why order n has no construction here.
    pub fn plain_hadamard(n: usize) -> Result<Orthogonal, String> {
        let h = Hadamard::new(n)?;
        Ok(Orthogonal {
            n,
            construction: format!("Hadamard {}", h.describe()),
            form: Form::Hadamard {
                h,
                signs: vec![1.0; n],
            },
            fallback: None,
        })
    }

    /// W ← W · Q for W [rows × n] row-major.
    pub fn right(&self, w: &mut [f64]) {
        let n = self.n;
        assert_eq!(w.len() % n, 0, "right: W is not [rows × {n}]");
        match &self.form {
            Form::Hadamard { h, signs } => {
                let scale = 1.0 / (n as f64).sqrt();
                // Rows are independent: parallel over rows, so the result is thread-count independent.
                w.par_chunks_mut(n).for_each_init(
                    || vec![0.0; n],
                    |tmp, row| {
                        for (x, s) in row.iter_mut().zip(signs) {
                            *x *= s;
                        }
                        h.apply_row(row, tmp);
                        for x in row.iter_mut() {
                            *x *= scale;
                        }
                    },
                );
            }
            Form::Dense(q) => {
                let rows = w.len() / n;
                let a = w.to_vec();
                // faer splits the output, never the reduction: thread-count independent too.
                matmul(
                    MatMut::from_row_major_slice_mut(w, rows, n),
                    Accum::Replace,
                    MatRef::from_row_major_slice(&a, rows, n),
                    MatRef::from_row_major_slice(q, n, n),
                    1.0,
                    Par::rayon(0),
                );
            }
        }
    }

    /// W ← Qᵀ · W for W [n × cols] row-major (Qᵀ W = (Wᵀ Q)ᵀ).
    pub fn left_t(&self, w: &mut [f64], cols: usize) {
        let n = self.n;
        assert_eq!(w.len(), n * cols, "left_t: W is not [{n} × {cols}]");
        let mut t = transpose(w, n, cols);
        self.right(&mut t);
        w.copy_from_slice(&transpose(&t, cols, n));
    }

    /// Q, n × n row-major (tests).
    pub fn dense(&self) -> Vec<f64> {
        let n = self.n;
        let mut q = vec![0.0; n * n];
        for i in 0..n {
            q[i * n + i] = 1.0;
        }
        self.right(&mut q);
        q
    }
}

/// A [rows × cols] row-major → [cols × rows].
pub fn transpose(a: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    let mut t = vec![0.0; a.len()];
    for i in 0..rows {
        for j in 0..cols {
            t[j * rows + i] = a[i * cols + j];
        }
    }
    t
}

/// Haar-random orthogonal n × n (row-major): Q of the QR of a standard Gaussian matrix, each column
/// multiplied by the sign of R's matching diagonal entry.
fn random_orthogonal(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let g: Vec<f64> = (0..n * n).map(|_| gaussian(rng)).collect();
    let a = Mat::from_fn(n, n, |i, j| g[i * n + j]);
    let qr = a.qr();
    let (q, r) = (qr.compute_Q(), qr.R());
    let mut out = vec![0.0; n * n];
    for j in 0..n {
        let s = if r[(j, j)] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..n {
            out[i * n + j] = s * q[(i, j)];
        }
    }
    out
}

/// Box–Muller: one standard normal draw.
fn gaussian(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>(); // (0, 1]: ln is finite
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn max_orthogonality_error(q: &[f64], n: usize) -> f64 {
        let mut worst = 0.0f64;
        for i in 0..n {
            for j in 0..n {
                let dot: f64 = (0..n).map(|k| q[i * n + k] * q[j * n + k]).sum();
                worst = worst.max((dot - if i == j { 1.0 } else { 0.0 }).abs());
            }
        }
        worst
    }

    #[test]
    fn both_kinds_are_orthogonal_and_left_t_is_the_transpose() {
        // 30 has no Hadamard matrix (the fallback), 48 = 12 ⊗ 4, 64 Sylvester.
        for (n, kind, hadamard) in [
            (30, RotationKind::Hadamard, false),
            (48, RotationKind::Hadamard, true),
            (64, RotationKind::Hadamard, true),
            (48, RotationKind::Random, false),
        ] {
            let mut rng = ChaCha8Rng::seed_from_u64(3);
            let q = Orthogonal::new(n, kind, &mut rng);
            assert_eq!(q.construction.starts_with("randomized Hadamard"), hadamard);
            assert_eq!(
                q.fallback.is_some(),
                kind == RotationKind::Hadamard && !hadamard
            );
            let d = q.dense();
            assert!(max_orthogonality_error(&d, n) < 1e-12, "{n} {kind:?}");
            // Qᵀ W against the dense product, W [n × 3].
            let w: Vec<f64> = (0..n * 3).map(|i| (i as f64 * 0.37).sin()).collect();
            let mut got = w.clone();
            q.left_t(&mut got, 3);
            for i in 0..n {
                for c in 0..3 {
                    let want: f64 = (0..n).map(|k| d[k * n + i] * w[k * 3 + c]).sum();
                    assert!((got[i * 3 + c] - want).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn the_seed_decides_the_matrix() {
        let q =
            |seed, kind| Orthogonal::new(48, kind, &mut ChaCha8Rng::seed_from_u64(seed)).dense();
        for kind in [RotationKind::Hadamard, RotationKind::Random] {
            assert_eq!(q(1, kind), q(1, kind));
            assert_ne!(q(1, kind), q(2, kind));
        }
    }
}
