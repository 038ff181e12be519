//! The uniform quantizer of design.md §4.1 and its scale/zero search.
//!
//! Formulas (kept as two tiny scalar functions, [`quantize`] and [`dequantize`], so they can move verbatim into
//! the C header shared with the CUDA kernels):
//!   q = clamp(round(w/s) + z, 0, maxq),  ŵ = s·(q − z),  maxq = 2^b − 1.
//! Rounding is half-to-even, as `torch.round` (which GPTQ's reference quantizer uses); it is used everywhere,
//! including the search, through [`Real::round_ties_even`].
//!
//! Scale search: the range [min(w,0), max(w,0)] is shrunk by p = 1 − i/100, i = 0..99; asymmetric grids try
//! both floor and ceil of −min/s for z. Each candidate is scored by
//!   * `Hessian`: Δ H Δᵀ with Δ = ŵ − w and H the matching diagonal block of H_col (the paper's Alg. 1 l.4,
//!     min tr(ΔW H_col ΔWᵀ));
//!   * `Mse`: Σ |Δ|^2.4 (GPTQ's `mse` option);
//!   * `MinMax`: no search (p = 1, z = round(−min/s)).
//!
//! Why the Hessian score is incremental rather than a GEMM over all candidates: z = −p·min/(p·(max−min)/maxq)
//! does not depend on p, so along the shrink path (s decreasing) each candidate's integer vector
//! v = clamp(round(w/s), −z, maxq − z) = q − z changes in only a few entries (each entry moves monotonically
//! towards a clamp bound: at most ~maxq changes over the whole path). With u = H v, a = vᵀHv and b = vᵀHw
//! kept up to date (a change δ at entry i costs one row of H: a += δ(2u_i + δH_ii), b += δ(Hw)_i,
//! u += δ H_i,:), the score Δ H Δᵀ = s²a − 2s b + wᵀHw costs O(g²·changes) per row instead of O(g²·200).
//! H is scored in f32 (u, H block) with f64 accumulators a, b; the constant wᵀHw is dropped.

use super::Real;
pub use crate::ops::{Grid, QuantSpec, ScaleSearch};
use rayon::prelude::*;

/// Number of shrink steps of the search grid (p = 1 − i/100, i = 0..99).
pub const SHRINK_STEPS: usize = 100;
/// Exponent of the `Mse` score (GPTQ's `norm=2.4`).
pub const MSE_NORM: f64 = 2.4;

/// q = clamp(round(w/s) + z, 0, maxq) (design.md §4.1). Returns the integer code as a float.
#[inline(always)]
pub fn quantize<T: Real>(w: T, scale: T, zero: T, maxq: T) -> T {
    ((w / scale).round_ties_even() + zero)
        .max(T::ZERO)
        .min(maxq)
}

/// ŵ = s·(q − z) (design.md §4.1).
#[inline(always)]
pub fn dequantize<T: Real>(q: T, scale: T, zero: T) -> T {
    scale * (q - zero)
}

/// The range [min(w,0), max(w,0)] (symmetric: [−m, m], m = max(|min|, max)); all-zero → [−1, 1].
fn range<T: Real>(w: &[T], sym: bool) -> (T, T) {
    let mut lo = T::ZERO;
    let mut hi = T::ZERO;
    for &x in w {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if sym {
        hi = hi.max(lo.abs());
        lo = -hi;
    }
    if lo == T::ZERO && hi == T::ZERO {
        (-T::ONE, T::ONE)
    } else {
        (lo, hi)
    }
}

/// The candidates (scale, zero) of one shrink step p: one zero for symmetric, floor and ceil of −min/s for
/// asymmetric (one when they coincide). `p = 1` with `round` zero is the min-max grid.
fn candidates<T: Real>(lo: T, hi: T, p: T, maxq: T, sym: bool) -> (T, [T; 2], usize) {
    let (lo, hi) = (p * lo, p * hi);
    let scale = (hi - lo) / maxq;
    if sym {
        (scale, [(maxq + T::ONE) / T::from_f64(2.0), T::ZERO], 1)
    } else {
        let z = -lo / scale;
        let (zf, zc) = (z.floor(), z.ceil());
        if zf == zc {
            (scale, [zf, zf], 1)
        } else {
            (scale, [zf, zc], 2)
        }
    }
}

/// Every candidate grid of the shrink search of `w`, in the order the search scores them (and breaks ties:
/// the first of equal scores wins): step i = 0..SHRINK_STEPS, then floor before ceil zero. Slot
/// `i·slots + k` with `slots` = 1 (symmetric) or 2 (asymmetric); the ceil slot of a step where floor = ceil
/// is None. The same arithmetic as the search itself, so a device search scores the very same set.
pub fn search_candidates<T: Real>(w: &[T], spec: &QuantSpec) -> Vec<Option<Grid<T>>> {
    let maxq = T::from_f64(spec.maxq() as f64);
    let (lo, hi) = range(w, spec.sym);
    let slots = candidate_slots(spec);
    let mut out = Vec::with_capacity(SHRINK_STEPS * slots);
    for i in 0..SHRINK_STEPS {
        let (scale, zs, nz) = candidates(lo, hi, T::from_f64(shrink(i)), maxq, spec.sym);
        for (k, &zero) in zs[..slots].iter().enumerate() {
            out.push((k < nz).then_some(Grid { scale, zero }));
        }
    }
    out
}

/// Candidate slots per shrink step of [`search_candidates`]: 1 symmetric, 2 asymmetric (floor, ceil zero).
pub fn candidate_slots(spec: &QuantSpec) -> usize {
    if spec.sym { 1 } else { 2 }
}

/// The min-max grid of `w` (no search).
pub fn minmax_grid<T: Real>(w: &[T], maxq: u32, sym: bool) -> Grid<T> {
    let maxq = T::from_f64(maxq as f64);
    let (lo, hi) = range(w, sym);
    let scale = (hi - lo) / maxq;
    let zero = if sym {
        (maxq + T::ONE) / T::from_f64(2.0)
    } else {
        (-lo / scale).round_ties_even()
    };
    Grid { scale, zero }
}

/// Search the grid of one row or (row, group) `w` [g]. `h` is the matching [g × g] diagonal block of H_col
/// (f32, row-major), required for `ScaleSearch::Hessian`.
pub fn search_grid<T: Real>(w: &[T], h: Option<&[f32]>, spec: &QuantSpec) -> Grid<T> {
    match spec.search {
        ScaleSearch::MinMax => minmax_grid(w, spec.maxq(), spec.sym),
        ScaleSearch::Mse => mse_search(w, spec),
        ScaleSearch::Hessian => {
            let h = h.expect("Hessian scale search needs the H_col block");
            assert_eq!(
                h.len(),
                w.len() * w.len(),
                "H block is not [g × g] for g = {}",
                w.len()
            );
            hessian_search(w, h, spec, None)
        }
    }
}

fn shrink(i: usize) -> f64 {
    1.0 - i as f64 / SHRINK_STEPS as f64
}

fn mse_search<T: Real>(w: &[T], spec: &QuantSpec) -> Grid<T> {
    let maxq = T::from_f64(spec.maxq() as f64);
    let (lo, hi) = range(w, spec.sym);
    let mut best = (f64::INFINITY, Grid::default());
    for i in 0..SHRINK_STEPS {
        let (scale, zs, nz) = candidates(lo, hi, T::from_f64(shrink(i)), maxq, spec.sym);
        for &zero in &zs[..nz] {
            let err: f64 = w
                .iter()
                .map(|&x| {
                    let d = dequantize(quantize(x, scale, zero, maxq), scale, zero) - x;
                    d.to_f64().abs().powf(MSE_NORM)
                })
                .sum();
            if err < best.0 {
                best = (err, Grid { scale, zero });
            }
        }
    }
    best.1
}

/// State of one zero-candidate chain (floor or ceil) along the shrink path; see the module comment.
struct Chain<T> {
    zero: Option<T>,
    v: Vec<i32>,
    u: Vec<f32>,
    a: f64,
    b: f64,
}

/// Precomputed products for one row (from a GEMM over many rows): Hw and H v of the floor chain at p = 1.
struct Pre<'a> {
    hw: &'a [f32],
    u: &'a [f32],
}

fn hessian_search<T: Real>(w: &[T], h: &[f32], spec: &QuantSpec, pre: Option<Pre>) -> Grid<T> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected.
        return unsafe { hessian_search_avx2(w, h, spec, pre) };
    }
    hessian_search_impl(w, h, spec, pre)
}

/// The same code compiled for AVX2 (the build targets baseline x86-64). No FMA, so the results are the same
/// bits as the baseline path: the axpys are mul + add either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hessian_search_avx2<T: Real>(
    w: &[T],
    h: &[f32],
    spec: &QuantSpec,
    pre: Option<Pre>,
) -> Grid<T> {
    hessian_search_impl(w, h, spec, pre)
}

#[inline(always)]
fn hessian_search_impl<T: Real>(w: &[T], h: &[f32], spec: &QuantSpec, pre: Option<Pre>) -> Grid<T> {
    let g = w.len();
    let maxq = T::from_f64(spec.maxq() as f64);
    let (lo, hi) = range(w, spec.sym);
    // Hw (b = vᵀ(Hw)), as a sum of rows of H (H symmetric): elementwise, so it vectorizes.
    let hw: Vec<f64> = match &pre {
        Some(p) => p.hw.iter().map(|&x| x as f64).collect(),
        None => {
            let mut hw = vec![0f64; g];
            for (j, &x) in w.iter().enumerate() {
                let x = x.to_f64();
                hw.iter_mut()
                    .zip(&h[j * g..(j + 1) * g])
                    .for_each(|(o, &hh)| *o += x * hh as f64);
            }
            hw
        }
    };
    let axpy = |y: &mut [f32], a: f32, j: usize| {
        y.iter_mut()
            .zip(&h[j * g..(j + 1) * g])
            .for_each(|(y, &hh)| *y += a * hh);
    };
    // Floor chain: v = clamp(ρ, −z, maxq − z), u = H v, a = vᵀHv, b = vᵀHw.
    let mut ch = Chain::<T> {
        zero: None,
        v: vec![0; g],
        u: vec![0.0; g],
        a: 0.0,
        b: 0.0,
    };
    // Ceil chain (z + 1) as v − m with m_j = [ρ_j ≥ maxq − z or ρ_j ≤ −z − 1] (exactly the entries where the
    // two clamps differ, by 1): a_c = a − 2μ + γ, b_c = b − β with t = H m, γ = mᵀt, μ = mᵀu, β = mᵀHw. An
    // entry enters m at most once along the path (|ρ| grows as s shrinks), so the ceil chain costs at most g
    // row updates instead of ~2.5·g.
    let mut m = vec![0i32; g];
    let mut t = vec![0f32; g];
    let (mut gamma, mut mu, mut beta) = (0f64, 0f64, 0f64);
    let mut rho = vec![0i32; g];
    let mut nv = vec![0i32; g];
    let mut nm = vec![0i32; g];
    let mut best = (f64::INFINITY, Grid::default());
    for i in 0..SHRINK_STEPS {
        let (scale, zs, nz) = candidates(lo, hi, T::from_f64(shrink(i)), maxq, spec.sym);
        // round(w/s), shared by both chains (scored with w·(1/s): a last-bit difference at a rounding tie
        // only perturbs a score; the chosen grid is applied with `quantize`).
        let inv = T::ONE / scale;
        for (r, &x) in rho.iter_mut().zip(w) {
            *r = (x * inv).round_to_i32();
        }
        let zero = zs[0];
        // q − z = clamp(round(w/s), −z, maxq − z): integers, exact in float.
        let vlo = -zero.to_f64() as i32;
        let vhi = (maxq - zero).to_f64() as i32;
        for ((v, mm), &r) in nv.iter_mut().zip(nm.iter_mut()).zip(&rho) {
            *v = r.clamp(vlo, vhi);
            *mm = (r >= vhi || r < vlo) as i32;
        }
        if ch.zero != Some(zero) {
            ch.v.copy_from_slice(&nv);
            m.copy_from_slice(&nm);
            match (&pre, i) {
                (Some(p), 0) => ch.u.copy_from_slice(p.u),
                _ => {
                    ch.u.iter_mut().for_each(|u| *u = 0.0);
                    for j in 0..g {
                        if ch.v[j] != 0 {
                            axpy(&mut ch.u, ch.v[j] as f32, j);
                        }
                    }
                }
            }
            t.iter_mut().for_each(|x| *x = 0.0);
            for (j, &mj) in m.iter().enumerate() {
                if mj != 0 {
                    axpy(&mut t, 1.0, j);
                }
            }
            let dot = |x: &[i32], y: &[f32]| {
                x.iter()
                    .zip(y)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
            };
            ch.a = dot(&ch.v, &ch.u);
            ch.b = ch.v.iter().zip(&hw).map(|(&v, &x)| v as f64 * x).sum();
            gamma = dot(&m, &t);
            mu = dot(&m, &ch.u);
            beta = m.iter().zip(&hw).map(|(&v, &x)| v as f64 * x).sum();
            ch.zero = Some(zero);
        } else {
            // Few entries change per step: skip 8-wide chunks with no change (vector compares).
            for c8 in 0..g.div_ceil(8) {
                let (j0, j1) = (c8 * 8, (c8 * 8 + 8).min(g));
                if nv[j0..j1] == ch.v[j0..j1] && nm[j0..j1] == m[j0..j1] {
                    continue;
                }
                for j in j0..j1 {
                    let d = nv[j] - ch.v[j];
                    if d != 0 {
                        let df = d as f64;
                        ch.a += df * (2.0 * ch.u[j] as f64 + df * h[j * g + j] as f64);
                        ch.b += df * hw[j];
                        mu += df * t[j] as f64;
                        axpy(&mut ch.u, d as f32, j);
                        ch.v[j] = nv[j];
                    }
                    let dm = nm[j] - m[j];
                    if dm != 0 {
                        let df = dm as f64;
                        mu += df * ch.u[j] as f64;
                        gamma += df * (2.0 * t[j] as f64 + df * h[j * g + j] as f64);
                        beta += df * hw[j];
                        axpy(&mut t, dm as f32, j);
                        m[j] = nm[j];
                    }
                }
            }
        }
        let s = scale.to_f64();
        let score = s * s * ch.a - 2.0 * s * ch.b;
        if score < best.0 {
            best = (score, Grid { scale, zero });
        }
        if nz == 2 {
            debug_assert!(zs[1] == zero + T::ONE);
            let score = s * s * (ch.a - 2.0 * mu + gamma) - 2.0 * s * (ch.b - beta);
            if score < best.0 {
                best = (score, Grid { scale, zero: zs[1] });
            }
        }
    }
    best.1
}

/// Searches the grids of `rows` rows of W (row stride `ld`) over the columns `c0..c0 + len`, in parallel over
/// rows. `h` is the [len × len] H_col block for those columns (f32), needed by the Hessian search.
pub fn search_grids_rows<T: Real>(
    w: &[T],
    rows: usize,
    ld: usize,
    c0: usize,
    len: usize,
    h: Option<&[f32]>,
    spec: &QuantSpec,
) -> Vec<Grid<T>> {
    let row = |r: usize| &w[r * ld + c0..r * ld + c0 + len];
    let h = match (spec.search, h) {
        (ScaleSearch::Hessian, Some(h)) => h,
        _ => {
            return (0..rows)
                .into_par_iter()
                .map(|r| search_grid(row(r), h, spec))
                .collect();
        }
    };
    assert_eq!(h.len(), len * len, "H block is not [{len} × {len}]");
    // Hessian search: the p = 1 products H·[w, v_floor] of a chunk of rows in one GEMM.
    const ROWS_PER_TASK: usize = 16;
    let maxq = T::from_f64(spec.maxq() as f64);
    let chunks: Vec<Vec<Grid<T>>> = (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|ci| {
            let r0 = ci * ROWS_PER_TASK;
            let rc = ROWS_PER_TASK.min(rows - r0);
            let mut v = vec![0f32; 2 * rc * len];
            for i in 0..rc {
                let wr = row(r0 + i);
                let (lo, hi) = range(wr, spec.sym);
                let (scale, zs, _) = candidates(lo, hi, T::ONE, maxq, spec.sym);
                let inv = T::ONE / scale;
                let z = zs[0].to_f64() as i32;
                let base = 2 * i * len;
                for (j, &x) in wr.iter().enumerate() {
                    v[base + j] = x.to_f64() as f32;
                    let rho = (x * inv).round_to_i32();
                    v[base + len + j] = rho.clamp(-z, spec.maxq() as i32 - z) as f32;
                }
            }
            let mut prod = vec![0f32; 2 * rc * len];
            gemm_nn(&mut prod, &v, h, 2 * rc, len, len);
            (0..rc)
                .map(|i| {
                    let b = 2 * i * len;
                    let pre = Pre {
                        hw: &prod[b..b + len],
                        u: &prod[b + len..b + 2 * len],
                    };
                    hessian_search(row(r0 + i), h, spec, Some(pre))
                })
                .collect()
        })
        .collect();
    chunks.concat()
}

/// C [m × n] = A [m × k] · B [k × n], row-major, sequential (faer): the search's batched p = 1 products.
fn gemm_nn(c: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize) {
    use faer::{Accum, MatMut, MatRef, Par, linalg::matmul::matmul};
    let a = MatRef::from_row_major_slice(a, m, k);
    let b = MatRef::from_row_major_slice(b, k, n);
    let c = MatMut::from_row_major_slice_mut(c, m, n);
    matmul(c, Accum::Replace, a, b, 1.0f32, Par::Seq);
}

/// The [len × len] diagonal block of H [n × n] starting at c0, as f32 (for scoring).
pub fn h_block_f32(h: &[f64], n: usize, c0: usize, len: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * len);
    for i in c0..c0 + len {
        out.extend(h[i * n + c0..i * n + c0 + len].iter().map(|&x| x as f32));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn brute_score(w: &[f64], h: &[f32], g: Grid<f64>, maxq: f64) -> f64 {
        let n = w.len();
        let d: Vec<f64> = w
            .iter()
            .map(|&x| dequantize(quantize(x, g.scale, g.zero, maxq), g.scale, g.zero) - x)
            .collect();
        let mut s = 0.0;
        for i in 0..n {
            for j in 0..n {
                s += d[i] * h[i * n + j] as f64 * d[j];
            }
        }
        s
    }

    #[test]
    fn formulas_round_half_to_even_and_clamp() {
        assert_eq!(quantize(2.5f32, 1.0, 0.0, 7.0), 2.0);
        assert_eq!(quantize(3.5f32, 1.0, 0.0, 7.0), 4.0);
        assert_eq!(quantize(-9.0f32, 1.0, 3.0, 7.0), 0.0);
        assert_eq!(quantize(90.0f32, 1.0, 3.0, 7.0), 7.0);
        assert_eq!(dequantize(5.0f32, 0.5, 3.0), 1.0);
        let g: Grid<f32> = minmax_grid(&[0.0, 0.0], 7, false);
        assert_eq!(
            (g.scale, g.zero),
            (2.0 / 7.0, (1.0f32 / (2.0 / 7.0)).round_ties_even())
        ); // all-zero → [−1, 1]
        let g: Grid<f32> = minmax_grid(&[-1.0, 3.0], 15, true);
        assert_eq!((g.scale, g.zero), (6.0 / 15.0, 8.0));
    }

    /// The incremental Hessian search finds the candidate with the smallest brute-force Δ H Δᵀ.
    #[test]
    fn hessian_search_matches_brute_force() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for &(g, bits, sym) in &[
            (7usize, 2u32, false),
            (33, 3, false),
            (64, 4, true),
            (20, 8, false),
        ] {
            let x: Vec<f64> = (0..g * 3 * g).map(|_| rng.random::<f64>() - 0.5).collect();
            let mut h = vec![0f32; g * g];
            for i in 0..g {
                for j in 0..g {
                    h[i * g + j] = (0..3 * g)
                        .map(|t| x[i * 3 * g + t] * x[j * 3 * g + t])
                        .sum::<f64>() as f32;
                }
            }
            for rep in 0..12 {
                let w: Vec<f64> = (0..g)
                    .map(|_| {
                        (rng.random::<f64>() * 2.0 - 0.3 * rep as f64 / 4.0) * (1.0 + rep as f64)
                    })
                    .collect();
                let spec = QuantSpec::new(bits, None, sym, ScaleSearch::Hessian);
                let maxq = spec.maxq() as f64;
                let got = search_grid(&w, Some(&h), &spec);
                let (lo, hi) = range(&w, sym);
                let mut best = f64::INFINITY;
                for i in 0..SHRINK_STEPS {
                    let (scale, zs, nz) = candidates(lo, hi, shrink(i), maxq, sym);
                    for &zero in &zs[..nz] {
                        best = best.min(brute_score(&w, &h, Grid { scale, zero }, maxq));
                    }
                }
                let batched = search_grids_rows(&w, 1, g, 0, g, Some(&h), &spec)[0];
                let sb = brute_score(&w, &h, batched, maxq);
                assert!(
                    sb <= best * (1.0 + 1e-4) + 1e-12,
                    "batched g={g} b={bits}: {sb} vs best {best}"
                );
                let s = brute_score(&w, &h, got, maxq);
                assert!(
                    s <= best * (1.0 + 1e-4) + 1e-12,
                    "g={g} b={bits}: {s} vs best {best}"
                );
            }
        }
    }
}
