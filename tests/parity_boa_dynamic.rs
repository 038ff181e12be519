//! The head-wise BoA sweep with dynamic group grids (design.md §4.3; cuda/boa_dynamic.cu) on the device against
//! the CPU oracle, `QuantOps::boa_sweep` with `GridMode::Dynamic` (quant::boa::boa_sweep), and the kernel's
//! schedule against the row-by-row order of Algorithm 1 (quant::boa::boa_sweep_rowwise).
//!
//! * `schedule_equals_rowwise_sweep_f64`: the group-lagged wavefront of the kernels, emulated on the host in f64
//!   (`emulate_schedule`: super-steps, jobs of a super-step in reverse order, per-job trailing updates), gives
//!   the row-by-row sweep's codes exactly and its values, grids and Q up to rounding, on the cases of
//!   tests/quant_boa_wavefront.rs (asymmetric searched groups wide enough never to be of one sign, so no
//!   search sits on a knife edge in f64). This checks the schedule without the emulator.
//! * `parity_boa_dynamic_cuda`: CUDA (both step variants) against the CPU, f32. Every code and grid of each
//!   backend is explained by a teacher-forced f64 replay (`replay`): row by row, the cross-row terms from the
//!   backend's own Q of the rows above, then the row's column-at-a-time GPTQ sweep in f64 with the backend's
//!   grid of each group and its Q of each column. Each grid must be the f64 search's optimum or within
//!   `search_tol` of its score (a near-tie of the search), each code the f64 quantization of the replayed value
//!   or that value within `tie_tol` of a rounding boundary (a near-tie of the rounding). Teacher forcing keeps
//!   the replay on the backend's path, so every element is checked, not only the first mismatch of a row.
//!   Then CUDA against the CPU directly: the first difference of each row in sweep order (a grid, or a code)
//!   is a near-tie in the replay, or the row is downstream of a difference in a row above it in the same
//!   head (the cross-row terms carry it down). On the emulator (no FMA contraction) the device must also equal
//!   `emulate_schedule` in f32 bit for bit, and v1 and v2 equal each other bit for bit everywhere.
//! * `variants_agree_on_low_rank_h_cuda`: v1 and v2 on a low-rank H_col unrelated to U_col and W of unit
//!   scale (parity_quant's inputs, where searches tie often): both replay cleanly and agree bit for bit.
//! * `parity_boa_quantize_dynamic_cuda`: `boa_quantize` end to end (the plan, act-order, factors and the
//!   sweep on the device) against the CPU, with groups: the same layer error up to near-ties.
//!
//! Tolerances (justified at their constants): TIE_REL, SEARCH_TOL_H, SEARCH_TOL_REL.

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::backend::Backend;
use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::cuda::{BoaDynamicVariant, CudaBackend};
use boa_cuda::ops::{GridMode, Mat, QuantOps};
use boa_cuda::quant::Real;
use boa_cuda::quant::boa::{BoaOptions, ColFactor, ColHessian, boa_quantize, boa_sweep_rowwise};
use boa_cuda::quant::gptq::{DynamicGroups, GptqOptions, to_host};
use boa_cuda::quant::linalg::damped_upper_inverse;
use boa_cuda::quant::quantizer::{Grid, dequantize, h_block_f32, quantize, search_grid};
use boa_cuda::quant::{QuantSpec, ScaleSearch};
use common::*;

/// A value within TIE_REL·max|W| of a rounding boundary (x/s half-integral) may round either way: the backends'
/// values differ from the f64 replay by their f32 rounding, which accumulates over ≤ d_h cross-row terms and
/// ≤ n trailing products of the row's own errors, ~√(d_h + n)·2⁻²⁴·Σ|terms| ≈ 1e-6·max|W| here. 2e-5·max|W| is
/// 20× that, and far below a quantization step (≥ max|W|/255·(a few) at 8 bits): a wrong term, column or
/// row moves a value by a step, not by this.
const TIE_REL: f64 = 2e-5;
/// A Hessian-searched grid within SEARCH_TOL_H·xᵀHx of the optimal Δ H Δᵀ is a near-tie: the searches score
/// s²·vᵀHv − 2s·vᵀ(Hx) in f64 over f32 products u = Hv (quantizer.rs), i.e. Δ H Δᵀ − xᵀHx, whose rounding is
/// ~2⁻²⁴·xᵀHx·√g; and the backends' x differ from the replay's by the rounding above. 1e-6·xᵀHx covers both
/// with a margin of ~10. At 2–4 bits the candidates' Δ H Δᵀ differ by ≥ 1e-3·xᵀHx, so a grid from the wrong
/// values or the wrong H block is far outside; at 8 bits (Δ H Δᵀ ≈ 1e-5·xᵀHx) the check is coarse.
const SEARCH_TOL_H: f64 = 1e-6;
/// Relative to the optimum itself (Mse: Σ|Δ|^2.4 in f64 of f32 Δ, pow to ≤ 2 ulp on a GPU).
const SEARCH_TOL_REL: f64 = 1e-4;

#[derive(Clone, Copy, Debug)]
struct Case {
    n_heads: usize,
    d_h: usize,
    n: usize,
    g: usize,
    bits: u32,
    sym: bool,
    search: ScaleSearch,
    per_head: bool,
    seed: u64,
}

impl Case {
    fn n_fac(&self) -> usize {
        if self.per_head { self.n_heads } else { 1 }
    }
    fn rows(&self) -> usize {
        self.n_heads * self.d_h
    }
    fn n_groups(&self) -> usize {
        self.n.div_ceil(self.g)
    }
    fn spec(&self) -> QuantSpec {
        QuantSpec::new(self.bits, Some(self.g), self.sym, self.search)
    }
    fn maxq(&self) -> u32 {
        (1u32 << self.bits) - 1
    }
}

/// The sweep's inputs, every value f32 (both backends get the same numbers): W [R × n] in sweep order, U_col
/// and the damped H_col [n_fac × n × n], U_row [n_heads × d_h × d_h].
struct Inputs {
    w: Vec<f32>,
    u_col: Vec<f32>,
    h: Vec<f32>,
    u_row: Vec<f32>,
}

fn inputs(c: &Case) -> Inputs {
    let mut r = rng(c.seed);
    let (n, dh) = (c.n, c.d_h);
    let w = (0..c.rows() * n)
        .map(|_| (0.1 * randn(&mut r)) as f32)
        .collect();
    let (mut u_col, mut h) = (Vec::new(), Vec::new());
    for _ in 0..c.n_fac() {
        let hd = damped(&random_spd(&mut r, n), n, 0.01);
        let u = damped_upper_inverse(&mut hd.clone(), n, 0.01, 8).expect("U_col");
        u_col.extend(to_f32(&u));
        h.extend(to_f32(&hd));
    }
    let mut u_row = Vec::new();
    for _ in 0..c.n_heads {
        let mut hr = random_spd(&mut r, dh);
        u_row.extend(to_f32(
            &damped_upper_inverse(&mut hr, dh, 0.01, 8).expect("U_row"),
        ));
    }
    Inputs { w, u_col, h, u_row }
}

fn f64_mat(v: &[f32], b: usize, r: usize, c: usize) -> Mat {
    Mat::f64(v.iter().map(|&x| x as f64).collect(), b, r, c)
}

/// A sweep's results, read back.
#[derive(Clone, PartialEq)]
struct Out {
    q: Vec<f32>,
    codes: Vec<u8>,
    scale: Vec<f32>,
    zero: Vec<f32>,
}

/// `QuantOps::boa_sweep` with dynamic groups on `ops`; `up` moves a host Mat where the backend computes.
fn run(ops: &dyn QuantOps, up: &dyn Fn(Mat) -> Mat, c: &Case, inp: &Inputs) -> Out {
    let (n, dh) = (c.n, c.d_h);
    let w = up(Mat::f32(inp.w.clone(), 1, c.rows(), n));
    let uc = up(f64_mat(&inp.u_col, c.n_fac(), n, n));
    let ur = up(f64_mat(&inp.u_row, c.n_heads, dh, dh));
    let h = up(f64_mat(&inp.h, c.n_fac(), n, n));
    let spec = c.spec();
    let s = ops
        .boa_sweep(
            w,
            &uc,
            &ur,
            dh,
            128,
            GridMode::Dynamic {
                g: c.g,
                h: Some(&h),
                spec: &spec,
            },
            c.maxq(),
        )
        .unwrap_or_else(|e| panic!("{c:?}: boa_sweep: {e:#}"));
    Out {
        q: ops.read_f32(&s.q).unwrap(),
        codes: ops.read_codes(&s.codes).unwrap(),
        scale: ops.read_f32(&s.grids.scale).unwrap(),
        zero: ops.read_f32(&s.grids.zero).unwrap(),
    }
}

// ---- The f64 reference: quantizer, search, replay ----------------------------------------------------------

fn quantize_f64(x: f64, s: f64, z: f64, maxq: f64) -> f64 {
    ((x / s).round_ties_even() + z).clamp(0.0, maxq)
}

/// Distance of x from the nearest rounding boundary of the grid with scale s (x/s half-integral), in units of x.
fn boundary_dist(x: f64, s: f64) -> f64 {
    let t = x / s;
    ((t - t.floor()) - 0.5).abs() * s
}

fn range_f64(x: &[f64], sym: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (0f64, 0f64);
    for &v in x {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if sym {
        hi = hi.max(lo.abs());
        lo = -hi;
    }
    if lo == 0.0 && hi == 0.0 {
        (-1.0, 1.0)
    } else {
        (lo, hi)
    }
}

/// Every candidate of the shrink search (quantizer.rs, in f64): (scale, zero, sure). A group of one sign ≤ 0
/// (max = 0) has −min/s = maxq exactly, which a search computes as maxq or an ulp on either side, so its zero
/// candidates at every step are maxq (sure) and maxq − 1 or maxq + 1 (either, or neither, may be scored:
/// not sure). Elsewhere every candidate is sure.
fn candidates_f64(x: &[f64], maxq: f64, sym: bool) -> Vec<(f64, f64, bool)> {
    let (lo, hi) = range_f64(x, sym);
    let mut out = Vec::new();
    for i in 0..100 {
        let p = 1.0 - i as f64 / 100.0;
        let (l, h) = (p * lo, p * hi);
        let s = (h - l) / maxq;
        if sym {
            out.push((s, (maxq + 1.0) / 2.0, true));
        } else if hi == 0.0 {
            out.extend([
                (s, maxq - 1.0, false),
                (s, maxq, true),
                (s, maxq + 1.0, false),
            ]);
        } else {
            let z = -l / s;
            out.push((s, z.floor(), true));
            if z.ceil() != z.floor() {
                out.push((s, z.ceil(), true));
            }
        }
    }
    out
}

/// The error of a grid on x for given codes: Δ H Δᵀ (H [len × len]) or Σ|Δ|^2.4.
fn score_codes(x: &[f64], codes: &[f64], hb: Option<&[f64]>, s: f64, z: f64) -> f64 {
    let d: Vec<f64> = x
        .iter()
        .zip(codes)
        .map(|(&v, &q)| s * (q - z) - v)
        .collect();
    match hb {
        Some(h) => {
            let g = x.len();
            (0..g)
                .map(|a| d[a] * (0..g).map(|b| h[a * g + b] * d[b]).sum::<f64>())
                .sum()
        }
        None => d.iter().map(|v| v.abs().powf(2.4)).sum(),
    }
}

/// The error of a grid on x, as the least and the largest over the ways its knife edges can round: an entry
/// within `tie_tol` of a rounding boundary may take either neighbouring code in a search that sees x in f32
/// (it scores round(x·(1/s)), and its x carries f32 rounding), e.g. the extreme entry of a symmetric group at
/// shrink 1, which sits exactly on |x|/s = maxq/2. Up to 4 such entries are resolved both ways.
fn score_range(
    x: &[f64],
    hb: Option<&[f64]>,
    s: f64,
    z: f64,
    maxq: f64,
    tie_tol: f64,
) -> (f64, f64) {
    let base: Vec<f64> = x.iter().map(|&v| quantize_f64(v, s, z, maxq)).collect();
    let ties: Vec<usize> = (0..x.len())
        .filter(|&j| boundary_dist(x[j], s) <= tie_tol)
        .take(4)
        .collect();
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for mask in 0..1usize << ties.len() {
        let mut codes = base.clone();
        for (b, &j) in ties.iter().enumerate() {
            if mask >> b & 1 == 1 {
                let t = x[j] / s;
                let other = if t.round_ties_even() == t.floor() {
                    t.floor() + 1.0
                } else {
                    t.floor()
                };
                codes[j] = (other + z).clamp(0.0, maxq);
            }
        }
        let sc = score_codes(x, &codes, hb, s, z);
        lo = lo.min(sc);
        hi = hi.max(sc);
    }
    (lo, hi)
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Search {
    /// The f64 search's own choice (the same candidate up to f32 rounding of its scale).
    Same,
    /// Another candidate within the tolerance of the optimum: a near-tie of the search.
    Tie,
}

/// Checks a backend's grid (s, z) of a group with the replayed values x against the f64 search: the grid must
/// be the optimum, or a near-tie of it: within the tolerance of the best score of the candidates every search
/// scores (`candidates_f64`), each score taken at its most favourable (the grid) or least favourable (the
/// others) resolution of the rounding knife edges (`score_range`).
fn check_grid(
    x: &[f64],
    hb: Option<&[f64]>,
    c: &Case,
    s: f32,
    z: f32,
    tie_tol: f64,
) -> Result<Search, String> {
    let maxq = c.maxq() as f64;
    let (s, z) = (s as f64, z as f64);
    // A zero of maxq + 1 is the search's ceil candidate for a group of one sign (−min/s = maxq up to an ulp):
    // a grid the CPU twin picks too (reported by the callers; no checkpoint can hold it).
    if !(s > 0.0 && s.is_finite()) || z.fract() != 0.0 || !(0.0..=maxq + 1.0).contains(&z) {
        return Err(format!("grid ({s}, {z}) is not a grid"));
    }
    match c.search {
        ScaleSearch::MinMax => {
            let (lo, hi) = range_f64(x, c.sym);
            let s_ref = (hi - lo) / maxq;
            let zr = -lo / s_ref;
            let z_ref = if c.sym {
                (maxq + 1.0) / 2.0
            } else {
                zr.round_ties_even()
            };
            if rel(s, s_ref) > 1e-5 {
                return Err(format!("min-max scale {s} against {s_ref}"));
            }
            if z == z_ref {
                Ok(Search::Same)
            } else if !c.sym && ((zr - zr.floor()) - 0.5).abs() < 1e-4 {
                Ok(Search::Tie)
            } else {
                Err(format!("min-max zero {z} against {z_ref} (−lo/s = {zr})"))
            }
        }
        ScaleSearch::Mse | ScaleSearch::Hessian => {
            let hb = hb.filter(|_| c.search == ScaleSearch::Hessian);
            let (mut best, mut arg, mut best_hi) = (f64::INFINITY, (0.0, 0.0), f64::INFINITY);
            for (cs, cz, sure) in candidates_f64(x, maxq, c.sym) {
                let (_, hi) = score_range(x, hb, cs, cz, maxq, tie_tol);
                let applied = score_codes(
                    x,
                    &x.iter()
                        .map(|&v| quantize_f64(v, cs, cz, maxq))
                        .collect::<Vec<_>>(),
                    hb,
                    cs,
                    cz,
                );
                if applied < best {
                    (best, arg) = (applied, (cs, cz));
                }
                if sure {
                    best_hi = best_hi.min(hi);
                }
            }
            let (mine, _) = score_range(x, hb, s, z, maxq, tie_tol);
            let tol = match hb {
                Some(h) => {
                    let g = x.len();
                    let xhx: f64 = (0..g)
                        .map(|a| x[a] * (0..g).map(|b| h[a * g + b] * x[b]).sum::<f64>())
                        .sum();
                    SEARCH_TOL_H * xhx + SEARCH_TOL_REL * best
                }
                None => SEARCH_TOL_REL * best + 1e-300,
            };
            if rel(s, arg.0) <= 1e-5 && z == arg.1 {
                Ok(Search::Same)
            } else if mine <= best_hi + tol {
                Ok(Search::Tie)
            } else {
                Err(format!(
                    "grid ({s}, {z}) scores ≥ {mine:e}, the optimum ({}, {}) {best:e}, ≤ {best_hi:e} at any \
                     rounding of its knife edges (tolerance {tol:e})",
                    arg.0, arg.1
                ))
            }
        }
    }
}

/// What a replay found.
#[derive(Clone, Copy, Debug, Default)]
struct Replayed {
    grids_same: usize,
    grid_ties: usize,
    /// Grids whose zero is maxq + 1 (`check_grid`).
    zero_over: usize,
    codes_same: usize,
    code_ties: usize,
}

/// The teacher-forced f64 replay of one backend's results (module comment). Returns what it found and the
/// replayed value of every element at its quantization, [R × n], or the first element it cannot explain.
fn try_replay(
    c: &Case,
    inp: &Inputs,
    out: &Out,
    who: &str,
) -> Result<(Replayed, Vec<f64>), String> {
    let (n, dh, ng) = (c.n, c.d_h, c.n_groups());
    let maxq = c.maxq() as f64;
    let w_max = inp.w.iter().fold(0f32, |m, &v| m.max(v.abs())) as f64;
    let tie_tol = TIE_REL * w_max;
    let mut st = Replayed::default();
    let mut x_at = vec![0f64; c.rows() * n];
    for head in 0..c.n_heads {
        let fac = if c.per_head { head } else { 0 };
        let u = &inp.u_col[fac * n * n..(fac + 1) * n * n];
        let h = &inp.h[fac * n * n..(fac + 1) * n * n];
        let ur = &inp.u_row[head * dh * dh..(head + 1) * dh * dh];
        // F in f32 as both backends compute it, then f64.
        let f = |j: usize, i: usize| (ur[j * dh + i] / ur[j * dh + j]) as f64;
        let mut deltas: Vec<Vec<f64>> = Vec::with_capacity(dh);
        for i in 0..dh {
            let r = head * dh + i;
            let mut w_before: Vec<f64> = (0..n).map(|col| inp.w[r * n + col] as f64).collect();
            for (j, dj) in deltas.iter().enumerate() {
                let fj = f(j, i);
                for (wv, &d) in w_before.iter_mut().zip(dj) {
                    *wv -= fj * d;
                }
            }
            let mut x = w_before.clone();
            for k in 0..ng {
                let (c0, c1) = (k * c.g, ((k + 1) * c.g).min(n));
                let (s, z) = (out.scale[r * ng + k], out.zero[r * ng + k]);
                st.zero_over += (z as f64 > maxq) as usize;
                let hb: Vec<f64> = (c0..c1)
                    .flat_map(|a| (c0..c1).map(move |b| h[a * n + b] as f64))
                    .collect();
                match check_grid(&x[c0..c1], Some(&hb), c, s, z, tie_tol) {
                    Ok(Search::Same) => st.grids_same += 1,
                    Ok(Search::Tie) => st.grid_ties += 1,
                    Err(e) => {
                        return Err(format!(
                            "{who} {c:?}: row {r} (head {head}, row {i}), group {k}: {e}"
                        ));
                    }
                }
                for col in c0..c1 {
                    let (code, qv) = (out.codes[r * n + col], out.q[r * n + col]);
                    if qv.to_bits() != dequantize(code as f32, s, z).to_bits() {
                        return Err(format!(
                            "{who} {c:?}: Q[{r}, {col}] = {qv} is not its code {code} on its grid ({s}, {z})"
                        ));
                    }
                    let want = quantize_f64(x[col], s as f64, z as f64, maxq);
                    if want == code as f64 {
                        st.codes_same += 1;
                    } else if boundary_dist(x[col], s as f64) <= tie_tol {
                        st.code_ties += 1;
                    } else {
                        return Err(format!(
                            "{who} {c:?}: code [{r}, {col}] (head {head}, row {i}, group {k}) is {code}, the \
                             replay's value {} rounds to {want} on the grid ({s}, {z}), {:e} from a boundary \
                             (tolerance {tie_tol:e})",
                            x[col],
                            boundary_dist(x[col], s as f64)
                        ));
                    }
                    x_at[r * n + col] = x[col];
                    let e = (x[col] - qv as f64) / u[col * n + col] as f64;
                    for c2 in col + 1..n {
                        x[c2] -= e * u[col * n + c2] as f64;
                    }
                }
            }
            deltas.push(
                w_before
                    .iter()
                    .zip(&out.q[r * n..(r + 1) * n])
                    .map(|(&wv, &qv)| wv - qv as f64)
                    .collect(),
            );
        }
    }
    Ok((st, x_at))
}

fn replay(c: &Case, inp: &Inputs, out: &Out, who: &str) -> (Replayed, Vec<f64>) {
    try_replay(c, inp, out, who).unwrap_or_else(|e| panic!("{e}"))
}

/// How CUDA and the CPU differ, row by row (module comment).
#[derive(Clone, Copy, Debug, Default)]
struct Compared {
    codes_equal: usize,
    rows_equal: usize,
    /// Rows whose first difference is a grid, a near-tie of the search in both replays.
    first_grid: usize,
    /// Rows whose first difference is a code on equal grids, a near-tie of the rounding.
    first_code: usize,
    /// Rows that differ below a row that differs (the cross-row terms carry it down).
    downstream: usize,
}

fn grid_eq(a: &Out, b: &Out, i: usize) -> bool {
    a.zero[i] == b.zero[i] && rel(a.scale[i] as f64, b.scale[i] as f64) <= 1e-5
}

fn compare(c: &Case, cuda: &Out, cpu: &Out, x_at: &[f64], tie_tol: f64) -> Compared {
    let (n, dh, ng) = (c.n, c.d_h, c.n_groups());
    let mut st = Compared {
        codes_equal: cuda
            .codes
            .iter()
            .zip(&cpu.codes)
            .filter(|(a, b)| a == b)
            .count(),
        ..Default::default()
    };
    for head in 0..c.n_heads {
        let mut above = false;
        for i in 0..dh {
            let r = head * dh + i;
            let mut first = None;
            'row: for k in 0..ng {
                if !grid_eq(cuda, cpu, r * ng + k) {
                    first = Some((k, None));
                    break;
                }
                for col in k * c.g..((k + 1) * c.g).min(n) {
                    if cuda.codes[r * n + col] != cpu.codes[r * n + col] {
                        first = Some((k, Some(col)));
                        break 'row;
                    }
                }
            }
            match first {
                None => st.rows_equal += 1,
                Some(_) if above => st.downstream += 1,
                // Both grids passed their replays' search check: a near-tie of the search.
                Some((_, None)) => st.first_grid += 1,
                Some((k, Some(col))) => {
                    let d = boundary_dist(x_at[r * n + col], cuda.scale[r * ng + k] as f64);
                    assert!(
                        d <= tie_tol,
                        "{c:?}: the first difference of row {r} (head {head}, row {i}) from the CPU is code \
                         [{r}, {col}] ({} against {}), {d:e} from a rounding boundary (tolerance {tie_tol:e}), \
                         with every row above and every earlier element of the row equal",
                        cuda.codes[r * n + col],
                        cpu.codes[r * n + col]
                    );
                    st.first_code += 1;
                }
            }
            above |= first.is_some();
        }
    }
    st
}

// ---- The kernels' schedule on the host ----------------------------------------------------------------------

/// cuda/boa_dynamic.cu's group-lagged wavefront on host slices, generic over the float type, in the kernels'
/// order of operations: super-step S runs row i of every head on group S − i (here the jobs of a super-step go
/// in reverse order: they are independent), each job taking its cross-row terms (rows above, ascending), its
/// own trailing updates so far (A), its group's grid (`search_grid`), then GPTQ's column loop inside the group;
/// after the jobs, each job's trailing update A[c ≥ c1] −= Σ_k E_k·U_col[k, c] (k ascending). Returns (Q,
/// codes, grids [R × n_groups]). `bug` plants a defect (for `replay_catches_planted_bugs`).
#[allow(clippy::too_many_arguments)]
fn emulate_schedule<T: Real>(
    bug: Bug,
    w: &[T],
    u_cols: &[Vec<T>],
    head_col: &[usize],
    u_row: &[T],
    h_blocks: &[Vec<Vec<f32>>],
    n_heads: usize,
    d_h: usize,
    n: usize,
    g: usize,
    spec: &QuantSpec,
    maxq: u32,
) -> (Vec<T>, Vec<u8>, Vec<Grid<T>>) {
    let rows = n_heads * d_h;
    let ng = n.div_ceil(g);
    let maxq_t = T::from_f64(maxq as f64);
    let mut acc = vec![T::ZERO; rows * n];
    let mut delta = vec![T::ZERO; rows * n];
    let mut q = vec![T::ZERO; rows * n];
    let mut codes = vec![0u8; rows * n];
    let mut grids = vec![Grid::default(); rows * ng];
    let hessian = spec.search == ScaleSearch::Hessian;
    for step in 0..ng + d_h - 1 {
        let i_lo = (step + 1).saturating_sub(ng);
        let i_hi = step.min(d_h - 1);
        let mut jobs = Vec::new();
        for head in (0..n_heads).rev() {
            for i in (i_lo..=i_hi).rev() {
                let (k, r) = (step - i, head * d_h + i);
                let (c0, c1) = (k * g, ((k + 1) * g).min(n));
                let ur = &u_row[head * d_h * d_h..];
                let u = &u_cols[head_col[head]];
                let mut x = vec![T::ZERO; c1 - c0];
                for (c, xv) in (c0..c1).zip(x.iter_mut()) {
                    let mut wv = w[r * n + c];
                    for j in 0..i {
                        if bug == Bug::CrossColumn(c) {
                            continue;
                        }
                        let f = ur[j * d_h + i] / ur[j * d_h + j];
                        wv -= f * delta[(head * d_h + j) * n + c];
                    }
                    delta[r * n + c] = wv;
                    *xv = wv + acc[r * n + c];
                }
                let kb = match bug {
                    Bug::SearchBlock
                        if h_blocks[head_col[head]][0].len() == (c1 - c0) * (c1 - c0) =>
                    {
                        0
                    }
                    _ => k,
                };
                let hb = hessian.then(|| h_blocks[head_col[head]][kb].as_slice());
                let gr = search_grid(&x, hb, spec);
                grids[r * ng + k] = gr;
                let mut e = vec![T::ZERO; c1 - c0];
                for c in c0..c1 {
                    let xv = x[c - c0];
                    let qc = quantize(xv, gr.scale, gr.zero, maxq_t);
                    let qv = dequantize(qc, gr.scale, gr.zero);
                    q[r * n + c] = qv;
                    codes[r * n + c] = qc.to_f64() as u8;
                    let err = (xv - qv) / u[c * n + c];
                    e[c - c0] = err;
                    for c2 in c + 1..c1 {
                        x[c2 - c0] -= err * u[c * n + c2];
                    }
                    delta[r * n + c] -= qv;
                }
                jobs.push((r, head, c0, c1, e));
            }
        }
        for (r, head, c0, c1, e) in jobs {
            let u = &u_cols[head_col[head]];
            for c in c1..n {
                if bug == Bug::TrailingColumn(c) {
                    continue;
                }
                let mut s = T::ZERO;
                for (kk, &ek) in e.iter().enumerate() {
                    s += ek * u[(c0 + kk) * n + c];
                }
                acc[r * n + c] -= s;
            }
        }
    }
    (q, codes, grids)
}

/// A defect planted in `emulate_schedule`: each confined to one column or to the search, the kind of bug a
/// fraction-of-codes bound would let through.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bug {
    None,
    /// The cross-row terms of Eq. (12) left out at one column.
    CrossColumn(usize),
    /// The trailing update left out at one column.
    TrailingColumn(usize),
    /// Every group's search scored with the first group's H block.
    SearchBlock,
}

/// `emulate_schedule` on a case's f32 inputs (what the device computes, in f32).
fn emulate_case_f32(c: &Case, inp: &Inputs) -> Out {
    emulate_case_f32_with(c, inp, Bug::None)
}

fn emulate_case_f32_with(c: &Case, inp: &Inputs, bug: Bug) -> Out {
    let n = c.n;
    let u_cols: Vec<Vec<f32>> = inp.u_col.chunks(n * n).map(|u| u.to_vec()).collect();
    let head_col: Vec<usize> = (0..c.n_heads)
        .map(|h| if c.per_head { h } else { 0 })
        .collect();
    let blocks = h_blocks(&inp.h, c.n_fac(), n, c.g);
    let (q, codes, grids) = emulate_schedule::<f32>(
        bug,
        &inp.w,
        &u_cols,
        &head_col,
        &inp.u_row,
        &blocks,
        c.n_heads,
        c.d_h,
        n,
        c.g,
        &c.spec(),
        c.maxq(),
    );
    Out {
        q,
        codes,
        scale: grids.iter().map(|g| g.scale).collect(),
        zero: grids.iter().map(|g| g.zero).collect(),
    }
}

/// Per column factor, per group, the group's diagonal block of H (f32), as the CPU backend makes them.
fn h_blocks(h: &[f32], n_fac: usize, n: usize, g: usize) -> Vec<Vec<Vec<f32>>> {
    (0..n_fac)
        .map(|f| {
            let hf: Vec<f64> = h[f * n * n..(f + 1) * n * n]
                .iter()
                .map(|&v| v as f64)
                .collect();
            (0..n.div_ceil(g))
                .map(|k| h_block_f32(&hf, n, k * g, g.min(n - k * g)))
                .collect()
        })
        .collect()
}

fn max_rel_diff<T: Real>(a: &[T], b: &[T]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x.to_f64() - y.to_f64()).abs() / (1.0 + y.to_f64().abs()))
        .fold(0.0, f64::max)
}

#[test]
fn schedule_equals_rowwise_sweep_f64() {
    let mut cases = 0;
    let mut seed = 700;
    for (n_heads, d_h, n) in [
        (2, 4, 12),
        (3, 8, 45),
        (2, 16, 236),
        (4, 4, 140),
        (3, 8, 300),
    ] {
        for per_head in [false, true] {
            // As in quant_boa_wavefront.rs: asymmetric searches over groups wide enough never to be of one sign
            // (no f64 knife edges); the trailing group is partial wherever g does not divide n.
            for (g, search) in [
                (4, ScaleSearch::MinMax),
                (6, ScaleSearch::MinMax),
                (16, ScaleSearch::Hessian),
                (24, ScaleSearch::Mse),
                (32, ScaleSearch::Hessian),
            ] {
                for bits in [2, 3, 4] {
                    seed += 1;
                    if n > 12 && seed % 3 != 0 {
                        continue;
                    }
                    let c = Case {
                        n_heads,
                        d_h,
                        n,
                        g: g.min(n),
                        bits,
                        sym: false,
                        search,
                        per_head,
                        seed,
                    };
                    let inp = inputs(&c);
                    let w: Vec<f64> = inp.w.iter().map(|&v| v as f64).collect();
                    let up = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
                    let u_cols: Vec<Vec<f64>> = inp.u_col.chunks(n * n).map(up).collect();
                    let u_row = up(&inp.u_row);
                    let head_col: Vec<usize> =
                        (0..n_heads).map(|h| if per_head { h } else { 0 }).collect();
                    let blocks = h_blocks(&inp.h, c.n_fac(), n, c.g);
                    let spec = c.spec();
                    let (q, codes, grids) = emulate_schedule::<f64>(
                        Bug::None,
                        &w,
                        &u_cols,
                        &head_col,
                        &u_row,
                        &blocks,
                        n_heads,
                        d_h,
                        n,
                        c.g,
                        &spec,
                        c.maxq(),
                    );
                    let cg: Vec<u32> = (0..n).map(|k| (k / c.g) as u32).collect();
                    let cols: Vec<ColFactor<f64>> = (0..c.n_fac())
                        .map(|f| ColFactor {
                            u: &u_cols[f],
                            col_group: &cg,
                            dynamic: Some(DynamicGroups {
                                g: c.g,
                                h_blocks: &blocks[f],
                                spec: &spec,
                            }),
                        })
                        .collect();
                    let mut wr = w.clone();
                    let mut qr = vec![0f64; w.len()];
                    let mut cr = vec![0u8; w.len()];
                    let mut gr = vec![Grid::default(); c.rows() * c.n_groups()];
                    boa_sweep_rowwise::<f64>(
                        &mut wr,
                        &mut qr,
                        &mut cr,
                        &cols,
                        &head_col,
                        &u_row,
                        n_heads,
                        d_h,
                        n,
                        128,
                        &mut gr,
                        c.n_groups(),
                        c.maxq(),
                    );
                    assert_eq!(codes, cr, "codes: {c:?}");
                    assert!(max_rel_diff(&q, &qr) < 1e-9, "q: {c:?}");
                    let (sa, sb): (Vec<f64>, Vec<f64>) = grids
                        .iter()
                        .zip(&gr)
                        .map(|(a, b)| (a.scale, b.scale))
                        .unzip();
                    assert!(max_rel_diff(&sa, &sb) < 1e-9, "scales: {c:?}");
                    assert!(
                        grids.iter().zip(&gr).all(|(a, b)| a.zero == b.zero),
                        "zeros: {c:?}"
                    );
                    cases += 1;
                }
            }
        }
    }
    assert!(cases > 40, "only {cases} cases");
    eprintln!(
        "the kernels' schedule, emulated in f64: {cases} cases, codes equal to the row-by-row sweep's"
    );
}

// ---- CUDA against the CPU -----------------------------------------------------------------------------------

fn with_cuda(f: impl FnOnce(&mut CudaBackend)) {
    match CudaBackend::new(0) {
        Ok(mut b) => {
            eprintln!("device: {}", b.name());
            b.set_poison_outputs(true);
            f(&mut b)
        }
        Err(why) => println!("skipped: {why}"),
    }
}

/// The emulator adds and multiplies as written (no FMA contraction), so there the device's f32 results are
/// exactly `emulate_schedule`'s; a GPU fuses the trailing kernel's products and sums.
fn exact_f32(b: &CudaBackend) -> bool {
    b.name().contains("CPU emulator")
}

fn parity_cases() -> Vec<Case> {
    use ScaleSearch::*;
    let case = |n_heads, d_h, n, g, bits, sym, search, per_head, seed| Case {
        n_heads,
        d_h,
        n,
        g,
        bits,
        sym,
        search,
        per_head,
        seed,
    };
    vec![
        // d_h 128 (the Llama head), a partial last group (136 = 2·64 + 8), shared U_col, the default search.
        case(2, 128, 136, 64, 3, false, Hessian, false, 1),
        // W_V: per-head U_col and H_col, symmetric 4-bit.
        case(3, 16, 96, 32, 4, true, Hessian, true, 2),
        // GQA-sized k_proj (8 KV heads), 2-bit, partial group of 6.
        case(8, 8, 70, 16, 2, false, Hessian, false, 3),
        // The other searches.
        case(4, 8, 70, 16, 2, false, MinMax, false, 4),
        case(3, 16, 96, 24, 4, true, Mse, true, 5),
        case(2, 32, 160, 64, 3, false, Mse, false, 6),
        // 8 bits (the Hessian score's signal is ~1e-5 of xᵀHx: SEARCH_TOL_H's coarse end).
        case(2, 8, 100, 64, 8, false, Hessian, true, 7),
        // One group of 128 and one of 2 columns; d_h 64.
        case(2, 64, 130, 128, 4, true, Hessian, false, 8),
        // Groups wider than v2's registers (g > 256): v1 runs for both variants.
        case(1, 4, 600, 300, 3, false, Hessian, false, 9),
        // One row per head, one group per row.
        case(5, 1, 40, 40, 3, false, Hessian, false, 10),
        // d_h 136 > 128 (the static-grid kernel's limit; the dynamic sweep has none), a partial group of 8.
        case(1, 136, 40, 16, 3, false, Hessian, false, 11),
    ]
}

#[test]
fn parity_boa_dynamic_cuda() {
    with_cuda(|b| {
        let exact = exact_f32(b);
        let mut totals = (Replayed::default(), Compared::default(), 0usize);
        for c in parity_cases() {
            let inp = inputs(&c);
            let t0 = std::time::Instant::now();
            let cpu = run(&CpuBackend, &|m| m, &c, &inp);
            let t_cpu = t0.elapsed();
            let (cpu_rep, _) = replay(&c, &inp, &cpu, "CPU");
            let emulated = emulate_case_f32(&c, &inp);
            let mut outs = Vec::new();
            for v in BoaDynamicVariant::ALL {
                b.set_boa_dynamic_variant(v);
                let t0 = std::time::Instant::now();
                let out = run(&*b, &|m| b.upload_mat(m).unwrap(), &c, &inp);
                let t_dev = t0.elapsed();
                let used = b.boa_dynamic_variant_in_use(c.g);
                let (rep, x_at) = replay(&c, &inp, &out, &format!("CUDA {used:?}"));
                let w_max = inp.w.iter().fold(0f32, |m, &v| m.max(v.abs())) as f64;
                let cmp = compare(&c, &out, &cpu, &x_at, TIE_REL * w_max);
                if exact {
                    assert!(
                        out == emulated,
                        "{c:?}, {used:?}: the device's f32 results are not the host emulation's bit for bit"
                    );
                }
                eprintln!(
                    "{c:?} {used:?}: {:.4} of {} codes equal to the CPU's, rows equal {}/{} (first difference: \
                     {} search ties, {} rounding ties; {} rows downstream); replay: grids {} same + {} ties ({} with \
                     zero maxq + 1), codes {} ties (CPU: grids {} ties, codes {} ties); {:.2} s (CPU {:.2} s)",
                    cmp.codes_equal as f64 / out.codes.len() as f64,
                    out.codes.len(),
                    cmp.rows_equal,
                    c.rows(),
                    cmp.first_grid,
                    cmp.first_code,
                    cmp.downstream,
                    rep.grids_same,
                    rep.grid_ties,
                    rep.zero_over,
                    rep.code_ties,
                    cpu_rep.grid_ties,
                    cpu_rep.code_ties,
                    t_dev.as_secs_f64(),
                    t_cpu.as_secs_f64()
                );
                totals.0.grid_ties += rep.grid_ties;
                totals.0.zero_over += rep.zero_over;
                totals.0.code_ties += rep.code_ties;
                totals.0.codes_same += rep.codes_same;
                totals.1.downstream += cmp.downstream;
                totals.1.rows_equal += cmp.rows_equal;
                totals.2 += c.rows();
                outs.push(out);
            }
            assert!(
                outs[0] == outs[1],
                "{c:?}: v1 and v2 differ (they compute the same operations in the same order)"
            );
        }
        eprintln!(
            "parity_boa_dynamic: {} codes checked against their replays ({} rounding ties), {} grid ties, {} grids \
             with zero maxq + 1; rows equal to the CPU's {}/{} ({} downstream of a near-tie above); bit-exact \
             against the host emulation: {}",
            totals.0.codes_same + totals.0.code_ties,
            totals.0.code_ties,
            totals.0.grid_ties,
            totals.0.zero_over,
            totals.1.rows_equal,
            totals.2,
            totals.1.downstream,
            exact
        );
    });
}

/// The CPU's own sweep passes the replay (the check itself is sound), and emulate_schedule in f32 agrees with
/// the CPU up to near-ties: runs everywhere, no GPU needed.
#[test]
fn replay_explains_the_cpu_and_the_emulated_schedule() {
    for c in parity_cases()
        .into_iter()
        .filter(|c| c.rows() * c.n <= 30_000)
    {
        let inp = inputs(&c);
        let cpu = run(&CpuBackend, &|m| m, &c, &inp);
        let (rep, _) = replay(&c, &inp, &cpu, "CPU");
        let emulated = emulate_case_f32(&c, &inp);
        let (rep_e, x_at) = replay(&c, &inp, &emulated, "emulated schedule");
        let w_max = inp.w.iter().fold(0f32, |m, &v| m.max(v.abs())) as f64;
        let cmp = compare(&c, &emulated, &cpu, &x_at, TIE_REL * w_max);
        eprintln!(
            "{c:?}: CPU replay {rep:?}; emulated schedule replay {rep_e:?}; against the CPU {cmp:?}"
        );
    }
}

/// The replay is sharp: a defect confined to one column of W, or a search scored with the wrong H block, fails
/// it (host only).
#[test]
fn replay_catches_planted_bugs() {
    let c = Case {
        n_heads: 2,
        d_h: 16,
        n: 96,
        g: 32,
        bits: 3,
        sym: false,
        search: ScaleSearch::Hessian,
        per_head: false,
        seed: 31,
    };
    let inp = inputs(&c);
    replay(
        &c,
        &inp,
        &emulate_case_f32(&c, &inp),
        "the emulated schedule",
    );
    for bug in [
        Bug::CrossColumn(50),
        Bug::TrailingColumn(70),
        Bug::SearchBlock,
    ] {
        let out = emulate_case_f32_with(&c, &inp, bug);
        match try_replay(&c, &inp, &out, &format!("planted {bug:?}")) {
            Ok(_) => panic!("the replay let {bug:?} through"),
            Err(e) => eprintln!("caught: {e}"),
        }
    }
}

// ---- boa_quantize end to end ---------------------------------------------------------------------------------

/// BoA's objective (design.md §4.3: H = H_col ⊗ H_row): Σ_h Σ_{i,j} H_row,h[i, j]·Δ_i H_col,h Δ_jᵀ over the
/// rows i, j of each head, Δ = W − Ŵ (original order); H_col shared, or one per head.
#[allow(clippy::too_many_arguments)]
fn layer_error(
    w: &[f32],
    w_hat: &[f32],
    hc: &[f64],
    hr: &[f64],
    n_heads: usize,
    d_h: usize,
    n: usize,
) -> f64 {
    let per_head = hc.len() == n_heads * n * n;
    let mut total = 0.0;
    for head in 0..n_heads {
        let h = if per_head { &hc[head * n * n..] } else { hc };
        let d: Vec<Vec<f64>> = (0..d_h)
            .map(|i| {
                let r = head * d_h + i;
                (0..n)
                    .map(|c| (w[r * n + c] - w_hat[r * n + c]) as f64)
                    .collect()
            })
            .collect();
        let hd: Vec<Vec<f64>> = d
            .iter()
            .map(|dj| {
                (0..n)
                    .map(|a| (0..n).map(|b| h[a * n + b] * dj[b]).sum())
                    .collect()
            })
            .collect();
        for i in 0..d_h {
            for j in 0..d_h {
                let dot: f64 = d[i].iter().zip(&hd[j]).map(|(x, y)| x * y).sum();
                total += hr[head * d_h * d_h + i * d_h + j] * dot;
            }
        }
    }
    total
}

#[test]
fn parity_boa_quantize_dynamic_cuda() {
    with_cuda(|b| {
        // (n_heads, d_h, n, g, bits, sym, per-head H_col, act-order columns, act-order rows, seed)
        for (n_heads, d_h, n, g, bits, sym, per_head, aoc, aor, seed) in [
            (4, 32, 160, 64, 3, false, false, true, true, 21),
            (2, 128, 136, 64, 4, true, false, false, true, 22),
            (3, 16, 100, 32, 3, false, true, false, true, 23),
        ] {
            let mut r = rng(seed);
            let rows = n_heads * d_h;
            let w: Vec<f32> = (0..rows * n)
                .map(|_| (0.1 * randn(&mut r)) as f32)
                .collect();
            let hc: Vec<f64> = (0..if per_head { n_heads } else { 1 })
                .flat_map(|_| random_spd(&mut r, n))
                .collect();
            let hr: Vec<f64> = (0..n_heads).flat_map(|_| random_spd(&mut r, d_h)).collect();
            // f32 values for both backends (the device's statistics are f32).
            let hc: Vec<f64> = hc.iter().map(|&v| v as f32 as f64).collect();
            let hr: Vec<f64> = hr.iter().map(|&v| v as f32 as f64).collect();
            let mut opts = BoaOptions::new(GptqOptions::new(QuantSpec::new(
                bits,
                Some(g),
                sym,
                ScaleSearch::Hessian,
            )));
            opts.act_order_col = aoc;
            opts.act_order_row = aor;
            let hb = hc.len() / (n * n);
            let quant = |ops: &dyn QuantOps, up: &dyn Fn(Mat) -> Mat| {
                let wm = up(Mat::f32(w.clone(), 1, rows, n));
                let hcm = up(Mat::f64(hc.clone(), hb, n, n));
                let hrm = up(Mat::f64(hr.clone(), n_heads, d_h, d_h));
                let col = if per_head {
                    ColHessian::PerHead(&hcm)
                } else {
                    ColHessian::Shared(&hcm)
                };
                let q = boa_quantize(ops, &wm, n_heads, d_h, col, &hrm, &opts, None)
                    .unwrap_or_else(|e| panic!("boa_quantize: {e:#}"));
                to_host::<f32>(ops, &q).unwrap()
            };
            let t0 = std::time::Instant::now();
            let cpu = quant(&CpuBackend, &|m| m);
            let t_cpu = t0.elapsed();
            let t0 = std::time::Instant::now();
            let dev = quant(&*b, &|m| b.upload_mat(m).unwrap());
            let t_dev = t0.elapsed();
            assert_eq!(dev.g_idx, cpu.g_idx, "g_idx");
            assert_eq!(
                dev.dequantize_from_codes(),
                dev.w_hat,
                "the device's Ŵ is not its codes on its grids"
            );
            let (e_dev, e_cpu) = (
                layer_error(&w, &dev.w_hat, &hc, &hr, n_heads, d_h, n),
                layer_error(&w, &cpu.w_hat, &hc, &hr, n_heads, d_h, n),
            );
            let eq = dev
                .codes
                .iter()
                .zip(&cpu.codes)
                .filter(|(a, b)| a == b)
                .count() as f64
                / cpu.codes.len() as f64;
            let rtn: f64 = {
                // The min-max RTN error of the same groups, for scale.
                let mut wh = w.clone();
                for row in wh.chunks_mut(n) {
                    for grp in row.chunks_mut(g) {
                        let gr = boa_cuda::quant::quantizer::minmax_grid(grp, (1 << bits) - 1, sym);
                        let mq = ((1u32 << bits) - 1) as f32;
                        for v in grp.iter_mut() {
                            *v = dequantize(quantize(*v, gr.scale, gr.zero, mq), gr.scale, gr.zero);
                        }
                    }
                }
                layer_error(&w, &wh, &hc, &hr, n_heads, d_h, n)
            };
            eprintln!(
                "boa_quantize {n_heads}×{d_h}×{n} g{g} {bits}-bit sym {sym} per-head {per_head} act-order \
                 {aoc}/{aor}: error {e_dev:.6e} on the device, {e_cpu:.6e} on the CPU (RTN {rtn:.6e}); {eq:.4} \
                 of the codes equal; {:.2} s (CPU {:.2} s)",
                t_dev.as_secs_f64(),
                t_cpu.as_secs_f64()
            );
            // Both backends run the same algorithm on the same numbers; they differ only where a near-tie went
            // the other way (the device's factors are f32 Cholesky factors, the CPU's f64), which moves the
            // error by a fraction of the gap to RTN, not by the gap.
            assert!(
                (e_dev - e_cpu).abs() <= 0.02 * e_cpu,
                "layer error {e_dev} on the device against {e_cpu} on the CPU"
            );
            assert!(e_dev < rtn, "device error {e_dev} not below RTN's {rtn}");
        }
    });
}

/// `inputs` with parity_quant's harder H: W of unit scale and a low-rank H_col (rank n/2 + 1, 1% of its mean
/// diagonal added) that is not U_col's, so many Hessian-search candidates score nearly alike.
fn inputs_low_rank(c: &Case) -> Inputs {
    let mut inp = inputs(c);
    let mut r = rng(c.seed ^ 0x5eed);
    let n = c.n;
    for w in inp.w.iter_mut() {
        *w = randn(&mut r) as f32;
    }
    inp.h.clear();
    for _ in 0..c.n_fac() {
        let m = n / 2 + 1;
        let x: Vec<f64> = (0..m * n).map(|_| randn(&mut r)).collect();
        let mut h = vec![0f64; n * n];
        for k in 0..m {
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] += x[k * n + i] * x[k * n + j] / m as f64;
                }
            }
        }
        let mean = (0..n).map(|i| h[i * n + i]).sum::<f64>() / n as f64;
        for i in 0..n {
            h[i * n + i] += 1e-2 * mean;
        }
        inp.h.extend(to_f32(&h));
    }
    inp
}

/// The two step variants on near-tied Hessian searches (`inputs_low_rank`): each passes its replay and they
/// agree bit for bit (their f64 accumulators run in the same order, so a near-tie goes the same way in both).
#[test]
fn variants_agree_on_low_rank_h_cuda() {
    with_cuda(|b| {
        for c in [
            Case {
                n_heads: 3,
                d_h: 32,
                n: 100,
                g: 32,
                bits: 3,
                sym: false,
                search: ScaleSearch::Hessian,
                per_head: false,
                seed: 41,
            },
            Case {
                n_heads: 2,
                d_h: 64,
                n: 130,
                g: 64,
                bits: 4,
                sym: false,
                search: ScaleSearch::Hessian,
                per_head: true,
                seed: 42,
            },
        ] {
            let inp = inputs_low_rank(&c);
            let cpu = run(&CpuBackend, &|m| m, &c, &inp);
            replay(&c, &inp, &cpu, "CPU");
            let mut outs = Vec::new();
            for v in BoaDynamicVariant::ALL {
                b.set_boa_dynamic_variant(v);
                let out = run(&*b, &|m| b.upload_mat(m).unwrap(), &c, &inp);
                let (rep, _) = replay(&c, &inp, &out, &format!("CUDA {v:?}"));
                eprintln!("{c:?} {v:?}: {rep:?}");
                outs.push(out);
            }
            let ng = c.n_groups();
            let first = (0..c.rows() * ng).find(|&i| !grid_eq(&outs[0], &outs[1], i));
            if let Some(i) = first {
                panic!(
                    "{c:?}: v1 and v2 differ first at row {}, group {}: ({}, {}) against ({}, {})",
                    i / ng,
                    i % ng,
                    outs[0].scale[i],
                    outs[0].zero[i],
                    outs[1].scale[i],
                    outs[1].zero[i]
                );
            }
            assert!(outs[0] == outs[1], "{c:?}: v1 and v2 differ in a code");
        }
    });
}
