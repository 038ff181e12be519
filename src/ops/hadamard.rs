//! Hadamard matrices (±1 entries, H Hᵀ = n I) for the orders this code can construct, and the fast
//! transform that applies one without forming it.
//!
//! Constructions (each checked by `H Hᵀ = n I` in the tests):
//! - Sylvester: 2^k, applied by the fast Walsh–Hadamard transform (n log n);
//! - Paley I: q + 1 for a prime q ≡ 3 (mod 4) (4, 8, 12, 20, 24, 32, 44, 48, 60, …);
//! - Paley II: 2(q + 1) for a prime q ≡ 1 (mod 4) (12, 28, 36, 60, 76, 108, …);
//! - Kronecker products of the above (H_a ⊗ H_b has order a·b).
//!
//! An order n is split as n = m · 2^k with the largest k whose m is constructible, so the dense part
//! (m × m, applied by a small GEMM) is as small as possible: 576 = 36 (Paley II, q = 17) ⊗ 16,
//! 1536 = 12 ⊗ 128, 3200 = (20 ⊗ 20) ⊗ 8, 3584 = 28 ⊗ 128, 5120 = 20 ⊗ 256, 14336 = 28 ⊗ 512 (11008 only as
//! 5504 (Paley I, q = 5503) ⊗ 2: a large dense part, still exact). Paley for prime powers that are not
//! primes (GF(p^k) arithmetic) and Williamson-type matrices are not implemented, so 52, 92, 100, 116, 156,
//! 172, … have no construction here (callers fall back to a random orthogonal matrix). No Hadamard matrix
//! exists at all for odd n > 1 or n ≡ 2 (mod 4).

/// A Hadamard matrix of order n = m · p (p = 2^k) as H = H_m ⊗ H_p, H_p Sylvester's.
#[derive(Clone, Debug)]
pub struct Hadamard {
    pub n: usize,
    /// The dense factor H_m, m × m, row-major, entries ±1.
    pub small: Vec<f64>,
    pub m: usize,
    /// The Sylvester factor's order 2^k.
    pub p: usize,
    /// How H_m was built, e.g. "36 (Paley II, q = 17)"; "1" when n is a power of two.
    pub small_recipe: String,
}

impl Hadamard {
    /// The construction for order n, or why there is none.
    pub fn new(n: usize) -> Result<Hadamard, String> {
        if n == 0 {
            return Err("order 0".into());
        }
        if n > 2 && !n.is_multiple_of(4) {
            return Err(format!(
                "no Hadamard matrix of order {n} exists (an order above 2 must be a multiple of 4)"
            ));
        }
        let mut p = 1usize << n.trailing_zeros();
        while p >= 1 {
            let m = n / p;
            if let Some((small, recipe)) = small_hadamard(m) {
                return Ok(Hadamard {
                    n,
                    small,
                    m,
                    p,
                    small_recipe: recipe,
                });
            }
            p /= 2;
        }
        Err(format!(
            "no construction of a Hadamard matrix of order {n} here: {n} = {} · 2^{}, and {} is not a \
             Kronecker product of Sylvester and Paley (prime q) orders",
            n >> n.trailing_zeros(),
            n.trailing_zeros(),
            n >> n.trailing_zeros()
        ))
    }

    /// "576 = 36 (Paley II, q = 17) ⊗ 16 (Sylvester)".
    pub fn describe(&self) -> String {
        match (self.m, self.p) {
            (1, p) => format!("{p} (Sylvester)"),
            (_, 1) => format!("{} = {}", self.n, self.small_recipe),
            (_, p) => format!("{} = {} ⊗ {p} (Sylvester)", self.n, self.small_recipe),
        }
    }

    /// x ← x · H (unnormalized) for one row of length n; `tmp` is scratch of length n.
    pub fn apply_row(&self, x: &mut [f64], tmp: &mut [f64]) {
        debug_assert_eq!(x.len(), self.n);
        let (m, p) = (self.m, self.p);
        // Row-major x as an m × p matrix X: x · (H_m ⊗ H_p) = vec(H_mᵀ X H_p). Sylvester's H_p is
        // symmetric, so X H_p is the FWHT of each row of X.
        for row in x.chunks_exact_mut(p) {
            fwht(row);
        }
        if m == 1 {
            return;
        }
        tmp.fill(0.0);
        for a in 0..m {
            let src = &x[a * p..(a + 1) * p];
            for a2 in 0..m {
                let h = self.small[a * m + a2];
                let dst = &mut tmp[a2 * p..(a2 + 1) * p];
                for (d, s) in dst.iter_mut().zip(src) {
                    *d += h * s;
                }
            }
        }
        x.copy_from_slice(tmp);
    }

    /// The whole matrix, n × n row-major (tests and small sizes).
    pub fn dense(&self) -> Vec<f64> {
        let n = self.n;
        let mut h = vec![0.0; n * n];
        let mut tmp = vec![0.0; n];
        // Row i of H is e_i · H.
        for i in 0..n {
            let row = &mut h[i * n..(i + 1) * n];
            row[i] = 1.0;
            self.apply_row(row, &mut tmp);
        }
        h
    }
}

/// x ← x · (I ⊗ H/√n): each run of n values of x (a row of [len/n × n]) times the normalized H, QuaRot's
/// online R4 in blocks (model/online.rs). In f64 per run (n log n + m·n operations, not n²), runs in parallel;
/// any thread count gives the same values.
pub fn block_transform_f32(h: &Hadamard, x: &mut [f32]) -> Result<(), String> {
    use rayon::prelude::*;
    let n = h.n;
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(format!(
            "block_transform: {} values are not runs of {n}",
            x.len()
        ));
    }
    let scale = 1.0 / (n as f64).sqrt();
    // Enough runs per task that the scratch and the task overhead amortize.
    let per_task = (16384 / n).max(1) * n;
    x.par_chunks_mut(per_task).for_each(|chunk| {
        let (mut row, mut tmp) = (vec![0.0f64; n], vec![0.0f64; n]);
        for run in chunk.chunks_exact_mut(n) {
            for (r, &v) in row.iter_mut().zip(run.iter()) {
                *r = v as f64;
            }
            h.apply_row(&mut row, &mut tmp);
            for (v, &r) in run.iter_mut().zip(row.iter()) {
                *v = (r * scale) as f32;
            }
        }
    });
    Ok(())
}

/// In-place unnormalized fast Walsh–Hadamard transform (x ← x · H_p, Sylvester order p = x.len(), a
/// power of two).
pub fn fwht(x: &mut [f64]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
}

/// A dense Hadamard matrix of order m (row-major ±1) with how it was built, for the small orders
/// this code constructs: 1, 2, Paley I and II for prime q, and Kronecker products of those.
pub fn small_hadamard(m: usize) -> Option<(Vec<f64>, String)> {
    match m {
        0 => None,
        1 => Some((vec![1.0], "1".into())),
        2 => Some((vec![1.0, 1.0, 1.0, -1.0], "2 (Sylvester)".into())),
        _ if !m.is_multiple_of(4) => None,
        _ => {
            if is_prime(m - 1) && (m - 1) % 4 == 3 {
                return Some((paley1(m - 1), format!("{m} (Paley I, q = {})", m - 1)));
            }
            let q = m / 2 - 1;
            if is_prime(q) && q % 4 == 1 {
                return Some((paley2(q), format!("{m} (Paley II, q = {q})")));
            }
            // A Kronecker product a · b, the larger factor first tried as small as possible.
            (2..m)
                .filter(|a| m.is_multiple_of(*a) && a * a <= m)
                .find_map(|a| {
                    let (ha, ra) = small_hadamard(a)?;
                    let (hb, rb) = small_hadamard(m / a)?;
                    Some((kron(&ha, a, &hb, m / a), format!("{m} = {ra} ⊗ {rb}")))
                })
        }
    }
}

fn is_prime(q: usize) -> bool {
    q >= 2
        && (2..)
            .take_while(|d| d * d <= q)
            .all(|d| !q.is_multiple_of(d))
}

/// Quadratic character mod a prime q: χ(0) = 0, 1 on nonzero squares, −1 otherwise.
fn quadratic_character(q: usize) -> Vec<f64> {
    let mut chi = vec![-1.0; q];
    chi[0] = 0.0;
    for x in 1..q {
        chi[x * x % q] = 1.0;
    }
    chi
}

/// Paley I, order q + 1 (q ≡ 3 mod 4 prime): H = I + S, S = [[0, 1ᵀ], [−1, Q]], Q[i][j] = χ(j − i)
/// (antisymmetric for such q, so S Sᵀ = q I and H Hᵀ = (q + 1) I).
fn paley1(q: usize) -> Vec<f64> {
    let chi = quadratic_character(q);
    let n = q + 1;
    let mut h = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            let s = match (i, j) {
                (0, 0) => 0.0,
                (0, _) => 1.0,
                (_, 0) => -1.0,
                _ => chi[(j + q - i) % q],
            };
            h[i * n + j] = s + if i == j { 1.0 } else { 0.0 };
        }
    }
    h
}

/// Paley II, order 2(q + 1) (q ≡ 1 mod 4 prime): the symmetric conference matrix C = [[0, 1ᵀ], [1, Q]]
/// with each 0 replaced by [[1, −1], [−1, −1]] and each ±1 by ±[[1, 1], [1, −1]].
fn paley2(q: usize) -> Vec<f64> {
    let chi = quadratic_character(q);
    let c = q + 1;
    let n = 2 * c;
    let mut h = vec![0.0; n * n];
    for i in 0..c {
        for j in 0..c {
            let s = match (i, j) {
                (0, 0) => 0.0,
                (0, _) | (_, 0) => 1.0,
                _ => chi[(j + q - i) % q],
            };
            let block = if s == 0.0 {
                [[1.0, -1.0], [-1.0, -1.0]]
            } else {
                [[s, s], [s, -s]]
            };
            for (di, row) in block.iter().enumerate() {
                for (dj, v) in row.iter().enumerate() {
                    h[(2 * i + di) * n + 2 * j + dj] = *v;
                }
            }
        }
    }
    h
}

/// A ⊗ B for square row-major A (a × a) and B (b × b).
fn kron(ha: &[f64], a: usize, hb: &[f64], b: usize) -> Vec<f64> {
    let n = a * b;
    let mut h = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            h[i * n + j] = ha[(i / b) * a + j / b] * hb[(i % b) * b + j % b];
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_hadamard(h: &[f64], n: usize, what: &str) {
        for i in 0..n {
            for j in 0..n {
                assert!(
                    h[i * n + j] == 1.0 || h[i * n + j] == -1.0,
                    "{what}: entry ({i},{j})"
                );
                let dot: f64 = (0..n).map(|k| h[i * n + k] * h[j * n + k]).sum();
                let want = if i == j { n as f64 } else { 0.0 };
                assert_eq!(dot, want, "{what}: rows {i} and {j}");
            }
        }
    }

    #[test]
    fn every_constructed_order_up_to_256_is_a_hadamard_matrix() {
        let mut built = Vec::new();
        for n in 1..=256 {
            if let Ok(h) = Hadamard::new(n) {
                assert_hadamard(&h.dense(), n, &h.describe());
                built.push(n);
            }
        }
        // Every multiple of 4 up to 256 except those needing prime powers or Williamson matrices.
        let missing: Vec<usize> = (1..=64)
            .map(|i| 4 * i)
            .filter(|n| !built.contains(n))
            .collect();
        assert_eq!(
            missing,
            [52, 92, 100, 116, 156, 172, 184, 188, 232, 236, 244],
            "{built:?}"
        );
        assert!(built.starts_with(&[1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36]));
    }

    #[test]
    fn model_widths_have_constructions() {
        for (n, recipe) in [
            (64, "64 (Sylvester)"),
            (576, "576 = 36 (Paley II, q = 17) ⊗ 16 (Sylvester)"),
            (1536, "1536 = 12 (Paley I, q = 11) ⊗ 128 (Sylvester)"),
            (4096, "4096 (Sylvester)"),
            (5120, "5120 = 20 (Paley I, q = 19) ⊗ 256 (Sylvester)"),
            (14336, "14336 = 28 (Paley II, q = 13) ⊗ 512 (Sylvester)"),
        ] {
            assert_eq!(Hadamard::new(n).unwrap().describe(), recipe);
        }
        // Orders no Hadamard matrix has, and one that needs a construction not implemented here.
        for n in [6, 30, 9] {
            assert!(Hadamard::new(n).unwrap_err().contains("exists"), "{n}");
        }
        for n in [52, 92, 184] {
            assert!(
                Hadamard::new(n).unwrap_err().contains("no construction"),
                "{n}"
            );
        }
    }

    #[test]
    fn the_576_transform_is_orthogonal_up_to_sqrt_n() {
        // The Kronecker path (dense 36 × 36 and FWHT 16) on a whole matrix, not only on unit vectors.
        let h = Hadamard::new(576).unwrap();
        assert_hadamard(&h.dense(), 576, "576");
    }
}
