//! The Hessian-weighted scale search (`quant::quantizer`) against the row-at-a-time incremental search it
//! replaced, kept here verbatim as the reference: the chosen grid must be the same bits (scale and zero) for
//! every row, because the new search performs each score's f32 and f64 operations in the same order (only
//! the loops around them are interchanged). Shapes g ∈ {7, 33, 64, 128, 576, 1536}, bits 2/3/4/8, sym and
//! asym, f32 and f64 rows, rows with outliers, all-zero and constant rows, and rows whose zero −min/s sits on
//! an integer (the f32 rounding of p·min, p·max then moves the floor zero between steps, so the chains
//! restart many times). Both entry points: `search_grid` (one row, Hw in f64) and `search_grids_rows` (the
//! GEMM-started batch).
//!
//! The bench at the end times both on the demo model's shapes:
//!   cargo test --release --test quant_search -- --ignored --nocapture

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::quant::Real;
use boa_cuda::quant::quantizer::{Grid, search_candidates, search_grid, search_grids_rows};
use boa_cuda::quant::{QuantSpec, ScaleSearch};
use common::*;
use rand::RngExt;
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

/// The search as it was (commit a8c617b): one row at a time, two running vectors u = H v and t = H m updated
/// by a full-row axpy at every entry change. The candidates come from `search_candidates`, which shares the
/// search's arithmetic.
mod reference {
    use super::*;

    /// State of the floor chain along the shrink path.
    struct Chain<T> {
        zero: Option<T>,
        v: Vec<i32>,
        u: Vec<f32>,
        a: f64,
        b: f64,
    }

    pub struct Pre<'a> {
        pub hw: &'a [f32],
        pub u: &'a [f32],
    }

    pub fn hessian_search<T: Real>(
        w: &[T],
        h: &[f32],
        spec: &QuantSpec,
        pre: Option<Pre>,
    ) -> Grid<T> {
        let g = w.len();
        let maxq = T::from_f64(spec.maxq() as f64);
        let cands = search_candidates(w, spec);
        let slots = if spec.sym { 1 } else { 2 };
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
        let mut ch = Chain::<T> {
            zero: None,
            v: vec![0; g],
            u: vec![0.0; g],
            a: 0.0,
            b: 0.0,
        };
        let mut m = vec![0i32; g];
        let mut t = vec![0f32; g];
        let (mut gamma, mut mu, mut beta) = (0f64, 0f64, 0f64);
        let mut rho = vec![0i32; g];
        let mut nv = vec![0i32; g];
        let mut nm = vec![0i32; g];
        let mut best = (f64::INFINITY, Grid::default());
        for i in 0..boa_cuda::quant::quantizer::SHRINK_STEPS {
            let floor = cands[i * slots].expect("the floor slot is always a candidate");
            let ceil = if spec.sym { None } else { cands[i * slots + 1] };
            let (scale, zero) = (floor.scale, floor.zero);
            let inv = T::ONE / scale;
            for (r, &x) in rho.iter_mut().zip(w) {
                *r = (x * inv).round_to_i32();
            }
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
                for j in 0..g {
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
            let s = scale.to_f64();
            let score = s * s * ch.a - 2.0 * s * ch.b;
            if score < best.0 {
                best = (score, Grid { scale, zero });
            }
            if let Some(c) = ceil {
                let score = s * s * (ch.a - 2.0 * mu + gamma) - 2.0 * s * (ch.b - beta);
                if score < best.0 {
                    best = (score, c);
                }
            }
        }
        best.1
    }

    /// `search_grids_rows` as it was: chunks of 16 rows, the p = 1 products H·[w, v_floor] in one GEMM.
    pub fn search_grids_rows<T: Real>(
        w: &[T],
        rows: usize,
        g: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Vec<Grid<T>> {
        let maxq = spec.maxq() as i32;
        let mut out = Vec::with_capacity(rows);
        for r0 in (0..rows).step_by(16) {
            let rc = 16.min(rows - r0);
            let mut v = vec![0f32; 2 * rc * g];
            for i in 0..rc {
                let wr = &w[(r0 + i) * g..(r0 + i + 1) * g];
                let c0 = search_candidates(wr, spec)[0].expect("p = 1 floor candidate");
                let inv = T::ONE / c0.scale;
                let z = c0.zero.to_f64() as i32;
                for (j, &x) in wr.iter().enumerate() {
                    v[2 * i * g + j] = x.to_f64() as f32;
                    v[(2 * i + 1) * g + j] = (x * inv).round_to_i32().clamp(-z, maxq - z) as f32;
                }
            }
            let mut prod = vec![0f32; 2 * rc * g];
            boa_cuda::backend::cpu::gemm_nn(&mut prod, &v, h, 2 * rc, g, g);
            for i in 0..rc {
                let pre = Pre {
                    hw: &prod[2 * i * g..(2 * i + 1) * g],
                    u: &prod[(2 * i + 1) * g..(2 * i + 2) * g],
                };
                out.push(hessian_search(
                    &w[(r0 + i) * g..(r0 + i + 1) * g],
                    h,
                    spec,
                    Some(pre),
                ));
            }
        }
        out
    }
}

/// An LLM-like H_col block [g × g] in f32: XᵀX of fewer tokens than columns plus 1% damping (ill-conditioned,
/// like a real calibration Hessian), columns scaled over two decades.
fn test_hessian(r: &mut ChaCha8Rng, g: usize) -> Vec<f32> {
    let n = g / 2 + 3;
    let scale: Vec<f64> = (0..g)
        .map(|i| 10f64.powf(-(((i * 7) % 11) as f64) / 5.0))
        .collect();
    let common: Vec<f64> = randn_vec(r, n);
    let xt: Vec<f32> = (0..g * n)
        .map(|k| ((randn(r) + 0.7 * common[k % n]) * scale[k / n]) as f32)
        .collect();
    let x: Vec<f32> = (0..n * g).map(|k| xt[(k % g) * n + k / g]).collect();
    let mut h = vec![0f32; g * g];
    boa_cuda::backend::cpu::gemm_nn(&mut h, &xt, &x, g, n, g);
    // Symmetric to the bit (the searches read rows of H as its columns).
    for i in 0..g {
        for j in 0..i {
            h[i * g + j] = h[j * g + i];
        }
    }
    let mean_diag = (0..g).map(|i| h[i * g + i] as f64).sum::<f64>() / g as f64;
    for i in 0..g {
        h[i * g + i] += (0.01 * mean_diag) as f32;
    }
    h
}

/// Rows of every kind the search meets (f64 values; the f32 tests round them).
fn test_rows(r: &mut ChaCha8Rng, g: usize, maxq: u32) -> Vec<Vec<f64>> {
    let mut rows = Vec::new();
    for k in 0..6 {
        // Gaussian, scaled over decades, some shifted to one side.
        let sc = 10f64.powi(k as i32 - 3);
        let shift = [0.0, 0.0, 0.5, -0.8, 2.0, 0.0][k];
        rows.push((0..g).map(|_| (randn(r) + shift) * sc).collect());
    }
    // Heavy-tailed with outliers (a few entries 10–40× the rest), as LLM weight rows.
    for _ in 0..3 {
        let mut w: Vec<f64> = (0..g).map(|_| randn(r) * 0.02).collect();
        for _ in 0..(g / 50).max(1) {
            let j = r.random_range(0..g);
            w[j] = 0.02 * r.random_range(10.0..40.0) * if r.random::<bool>() { 1.0 } else { -1.0 };
        }
        rows.push(w);
    }
    // Uniform, all-zero, constant (positive, negative), one nonzero entry.
    rows.push((0..g).map(|_| r.random_range(-1.0..1.0)).collect());
    rows.push(vec![0.0; g]);
    rows.push(vec![0.37; g]);
    rows.push(vec![-2.5; g]);
    let mut one = vec![0.0; g];
    one[g / 2] = -0.7;
    rows.push(one);
    // −min/s on an integer: min = −a, max = b with a·maxq/(a + b) = 1; the floor zero then moves between 0
    // and 1 from step to step as p·min and p·max round, restarting the chains.
    assert_eq!(rows.len(), INTEGER_ZERO_ROW);
    let (a, b) = (1.0, maxq as f64 - 1.0);
    let mut w: Vec<f64> = (0..g).map(|_| r.random_range(-a..b)).collect();
    w[0] = -a;
    w[g - 1] = b;
    rows.push(w);
    // LLM-like rows (Gaussian, 0.5% outliers at 15×) up to PRUNE_ROWS in all: from 32 rows on,
    // `search_grids_rows` prunes the shrink path with its certificate, which must not change a grid.
    while rows.len() < PRUNE_ROWS {
        let mut w: Vec<f64> = (0..g).map(|_| randn(r) * 0.02).collect();
        for _ in 0..(g / 200).max(1) {
            let j = r.random_range(0..g);
            w[j] *= 15.0;
        }
        rows.push(w);
    }
    rows
}

/// Index of the row whose zero −min/s sits on an integer in `test_rows`.
const INTEGER_ZERO_ROW: usize = 14;
/// Rows per batch in the checks: above the 32 from which `search_grids_rows` prunes with its certificate.
const PRUNE_ROWS: usize = 40;

fn same_bits<T: Real>(x: &Grid<T>, y: &Grid<T>) -> bool {
    x.scale.to_f64().to_bits() == y.scale.to_f64().to_bits()
        && x.zero.to_f64().to_bits() == y.zero.to_f64().to_bits()
}

/// Compares both entry points with the reference on every row of `rows` (T-rounded); returns the rows checked.
fn check<T: Real>(rows: &[Vec<f64>], g: usize, h: &[f32], spec: &QuantSpec, label: &str) -> usize {
    let w: Vec<T> = rows.iter().flatten().map(|&x| T::from_f64(x)).collect();
    let n = rows.len();
    let batched = search_grids_rows(&w, n, g, 0, g, Some(h), spec);
    let batched_ref = reference::search_grids_rows(&w, n, g, h, spec);
    for r in 0..n {
        let wr = &w[r * g..(r + 1) * g];
        let one = search_grid(wr, Some(h), spec);
        let one_ref = reference::hessian_search(wr, h, spec, None);
        assert!(
            same_bits(&one, &one_ref),
            "{label} row {r}: search_grid {one:?} vs reference {one_ref:?}"
        );
        assert!(
            same_bits(&batched[r], &batched_ref[r]),
            "{label} row {r}: search_grids_rows {:?} vs reference {:?}",
            batched[r],
            batched_ref[r]
        );
    }
    n
}

/// Same grids, to the bit, as the reference on every shape, width, symmetry, row kind and float type.
#[test]
fn search_matches_reference_bit_for_bit() {
    let mut r = rng(19);
    let mut checked = 0;
    for &g in &[7usize, 33, 64, 128, 576, 1536] {
        let h = test_hessian(&mut r, g);
        for &bits in &[2u32, 3, 4, 8] {
            for sym in [false, true] {
                // Large g costs seconds per configuration: the full width/symmetry sweep runs up to 576,
                // g = 1536 (the down projection) on the production configurations.
                if g == 1536 && !(bits == 3 || bits == 4) {
                    continue;
                }
                let spec = QuantSpec::new(bits, None, sym, ScaleSearch::Hessian);
                let rows = test_rows(&mut r, g, spec.maxq());
                let label = format!("g={g} bits={bits} sym={sym}");
                checked += check::<f32>(&rows, g, &h, &spec, &format!("{label} f32"));
                if g <= 128 {
                    checked += check::<f64>(&rows, g, &h, &spec, &format!("{label} f64"));
                }
            }
        }
    }
    eprintln!("{checked} rows: every grid equal to the reference's, to the bit");
}

/// The restart-heavy row (zero on an integer) does restart: the test above exercises many segments.
#[test]
fn zero_on_integer_row_restarts_the_chains() {
    let mut r = rng(3);
    let spec = QuantSpec::new(3, None, false, ScaleSearch::Hessian);
    let rows = test_rows(&mut r, 64, spec.maxq());
    let w: Vec<f32> = rows[INTEGER_ZERO_ROW].iter().map(|&x| x as f32).collect();
    let zeros: Vec<f32> = search_candidates(&w, &spec)
        .iter()
        .step_by(2)
        .map(|c| c.expect("floor").zero)
        .collect();
    let changes = zeros.windows(2).filter(|z| z[0] != z[1]).count();
    assert!(
        changes >= 5,
        "the floor zero changed only {changes} times: {zeros:?}"
    );
}

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..3)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[1]
}

/// The reference and the new search on the demo model's per-channel shapes (W rows Gaussian with outliers,
/// LLM-like H), 3-bit asymmetric, one thread each (RAYON_NUM_THREADS=1 for the batch) and the default pool.
/// Method: one warm-up, median of 3, wall clock; the rows are the same for both.
#[test]
#[ignore]
fn bench_search() {
    let mut r = rng(7);
    for &(rows, g) in &[(576usize, 576usize), (576, 1536), (512, 64)] {
        let h = test_hessian(&mut r, g);
        let spec = QuantSpec::new(3, None, false, ScaleSearch::Hessian);
        let mut w: Vec<f32> = (0..rows * g)
            .map(|_| (randn(&mut r) * 0.02) as f32)
            .collect();
        for _ in 0..rows * g / 200 {
            let k = r.random_range(0..rows * g);
            w[k] *= 15.0;
        }
        let t_ref = median_ms(|| {
            reference::search_grids_rows(&w, rows, g, &h, &spec);
        });
        let t_new = median_ms(|| {
            search_grids_rows(&w, rows, g, 0, g, Some(&h), &spec);
        });
        // The reference runs on one thread: time the new batch on one thread too.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .expect("pool");
        let t_new1 = median_ms(|| {
            pool.install(|| search_grids_rows(&w, rows, g, 0, g, Some(&h), &spec));
        });
        let t_one = median_ms(|| {
            for wr in w.chunks(g) {
                search_grid(wr, Some(&h), &spec);
            }
        });
        eprintln!(
            "{rows:>4} × {g:<5} reference {t_ref:8.1} ms | new, 1 thread {t_new1:8.1} ms ({:.2}×) | new, {} threads {t_new:8.1} ms | search_grid row by row {t_one:8.1} ms",
            t_ref / t_new1,
            rayon::current_num_threads()
        );
    }
}
