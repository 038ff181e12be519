//! The f64 reference sweep that explains every code of a backend's sweep (issue 19: "each differing code is
//! a near-tie of the rounding, or downstream of one in the same row", in place of a percentage of codes).
//!
//! `check` replays the sweep in f64, row by row in sweep order (BoA: Alg. 1's row-by-row order, each row's
//! cross-row terms Eq. (12) first, then its GPTQ column loop; GPTQ is the case d_h = 1), and carries beside
//! every value a rigorous bound on how far an f32 execution of the same arithmetic, in any summation order and
//! blocking (the CPU's lazy batches, the kernels' wavefronts, cuBLAS's trailing GEMMs, FMA or not), can be from
//! it. At each element it compares the backend's code with its own rounding of the value:
//!
//! * equal, or
//! * a **rounding near-tie**: the value lies within τ of the boundary between the two codes, so the backend's
//!   value (within τ of ours) may round either way: both codes are in {code(v − τ), code(v + τ)};
//! * anything else is a failure naming the row, the column, the codes, the value and its distance to the
//!   boundary in grid steps against τ.
//!
//! Then it **follows the backend's code** (and, with dynamic groups, the backend's grid): the errors it feeds
//! forward are the backend's, so the two stay within the bound after a tie, and every later difference must
//! be a tie of its own. This is stricter than "downstream of a tie in the same row": a bug confined to one
//! column fails at that column even behind an earlier tie. It implies the rule for a CUDA–CPU pair
//! too: up to the first column where the two differ, both paths are the same reference path, so that column
//! is a near-tie of it.
//!
//! τ (an absolute bound on |v_backend − v|, plus the quantizer's division): with u = 2⁻²⁴ and
//! γ_m = m·u/(1 − m·u), an f32 sum of m rounded products in any order is within γ_m·Σ|terms| of the exact
//! sum of those products (Higham, Accuracy and Stability §3.1; a fused multiply-add only removes roundings).
//! Row j of a head at sweep column c sums w0, j cross-row terms F_ij·δ_i and c GPTQ terms e_c'·U_c'c, so
//!   b_v(c) = γ_{j+c+2}·(|w0| + Σ_i |F_ij δ_i| + Σ_c' |e_c' U_c'c|) + Σ_i |F_ij|·b_δ(i, c) + Σ_c' b_e(c')·|U_c'c|,
//!   b_e(c) = (b_v(c) + u|v − q|)/|U_cc| + u|e|,   b_δ(i, c) = b_x(i, c) + u(|x| + |q|),
//!   b_x(j, c) = γ_{j+1}·(|w0| + Σ_i |F_ij δ_i|) + Σ_i |F_ij|·b_δ(i, c)    (x: the value after the cross-row terms),
//! (the errors the backend's own earlier values carry, propagated through the same U and F, which both sides
//! read as the same f32 numbers), and τ = b_v + 2u|v| (the quantizer's f32 division v/s). It is a worst case
//! (actual differences are ~√m smaller), so no f32 execution is refused; on this file's shapes it is ~2e-4
//! grid steps at the median and ≤ 3e-2 at the 99th percentile (the propagated terms compound along long rows
//! and down BoA's heads; each summary prints the distribution), so a column off by even a tenth of a step
//! is refused in nearly every row, and a real tie is rare (none in most runs of ~250k codes).
//!
//! **Search near-ties** (dynamic groups, and `search_grids`): the backend's grid, scored in f64 on our values,
//! must not be worse than the best of our candidates by more than ε_search. Scores are intervals: an element
//! within τ of a rounding boundary of a grid may round either way in the backend (a jump of the Hessian score),
//! and τ also widens every score continuously (2|Δ|ᵀ|H|τ + τᵀ|H|τ); our candidates are widened by the
//! perturbation of their scale too (the backend builds its candidates from its own values' range). The rule:
//!   min(score(backend grid)) ≤ min over our candidates c of max(score(c)) + ε_search,
//! sound because the backend picked its grid over its own twin of every c. ε_search is the f32 rounding of the
//! backend's scoring: the CPU's incremental Hessian score keeps u = Hv in f32 through up to k ≈ g·(maxq + 2)
//! rank-1 updates along the shrink path, whose rounding errors add like a random walk, √k·u·|v|ᵀ|H||v| each;
//! ε_search = 16·√k·u·(|w| + |Δ|)ᵀ|H|(|w| + |Δ|) is eight such deviations for each of the two scores
//! compared. Unlike τ this is an estimate, not a bound (the worst case k·u·(…) is √k ≈ 47× larger at g = 128,
//! 4 bits, and would excuse visibly worse grids); a refusal with a gap just above ε_search is where to look
//! first. The Mse score is f64 sums of f32 Δ: ε_mse = 8·u·p·Σ|Δ|^(p−1)·(|w| + |Δ|), p = 2.4. MinMax has no
//! search: the grid must be the min-max grid of the values, its zero allowed to round the other way only
//! within its own τ.
#![allow(dead_code)]

use boa_cuda::ops::{Grid, QuantSpec, ScaleSearch};
use boa_cuda::quant::quantizer::{MSE_NORM, SHRINK_STEPS, minmax_grid};

/// f32's unit roundoff 2⁻²⁴.
pub const U32: f64 = f32::EPSILON as f64 / 2.0;

/// γ_m = m·u / (1 − m·u).
pub fn gamma(m: usize) -> f64 {
    let x = m as f64 * U32;
    x / (1.0 - x)
}

/// How the sweep got its grids.
pub enum RefGrids<'a> {
    /// Given: [rows × ng] f32 scales and zeros; `col_group[f]` maps sweep columns to groups for the rows whose
    /// column factor is f.
    Static {
        scale: &'a [f32],
        zero: &'a [f32],
        ng: usize,
        col_group: &'a [Vec<u32>],
    },
    /// Searched at every group start from the current values; `h` [n_factors × n × n] the f32 H (sweep order)
    /// each column factor's groups are scored with (Hessian search only).
    Dynamic {
        g: usize,
        h: Option<&'a [f32]>,
        spec: QuantSpec,
    },
}

/// One sweep as the backend was given it, in sweep order.
pub struct Case<'a> {
    /// W [rows × n].
    pub w: &'a [f32],
    pub rows: usize,
    pub n: usize,
    /// Rows per head (BoA); 1 for GPTQ (every row its own head, no cross-row terms).
    pub d_h: usize,
    /// [n_factors × n × n], upper.
    pub u_col: &'a [f32],
    /// Per head, its column factor.
    pub head_col: &'a [usize],
    /// [n_heads × d_h × d_h]: F[j, i] = U_row[j, i] / U_row[j, j] for i > j, as the backends compute it (f32).
    pub f_row: &'a [f32],
    /// [n_heads × d_h]: U_row[j, j] (BoA's loss divides by it); empty: 1.
    pub u_row_diag: &'a [f32],
    pub grids: RefGrids<'a>,
    pub maxq: u32,
}

/// What the backend's sweep returned, read back (sweep order).
pub struct Got<'a> {
    pub codes: &'a [u8],
    pub q: &'a [f32],
    /// [rows × ng].
    pub scale: &'a [f32],
    pub zero: &'a [f32],
}

#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub elements: usize,
    /// Codes other than our rounding of our value: each a near-tie.
    pub rounding_ties: usize,
    /// Groups whose grid is not our best candidate (scale or zero differ beyond the values' perturbation):
    /// each within ε_search.
    pub search_ties: usize,
    pub searches: usize,
    /// The largest τ met, in grid steps (τ/s), and every one (for the summary's percentiles), of the values
    /// inside their grid's range (past a clamp no boundary is near).
    pub max_tau_steps: f64,
    pub tau_steps: Vec<f32>,
    /// Of the accepted rounding ties, the largest |v/s − boundary| / (τ/s) (≤ 1).
    pub worst_tie_ratio: f64,
    /// Σ e² along the backend's path (e = (v − q)/U_cc; BoA: /(U_row,jj·U_col,cc)), and a bound on how far the
    /// backend's own f32 sum of the same can be from it.
    pub loss: f64,
    pub loss_tol: f64,
    /// ‖Q − W‖².
    pub delta_sq: f64,
}

impl Verdict {
    pub fn merge(&mut self, o: &Verdict) {
        self.elements += o.elements;
        self.rounding_ties += o.rounding_ties;
        self.search_ties += o.search_ties;
        self.searches += o.searches;
        self.max_tau_steps = self.max_tau_steps.max(o.max_tau_steps);
        self.tau_steps.extend_from_slice(&o.tau_steps);
        self.worst_tie_ratio = self.worst_tie_ratio.max(o.worst_tie_ratio);
        self.loss += o.loss;
        self.loss_tol += o.loss_tol;
        self.delta_sq += o.delta_sq;
    }

    pub fn summary(&self) -> String {
        let mut t = self.tau_steps.clone();
        t.sort_by(f32::total_cmp);
        let at = |q: f64| {
            t.get(((t.len() as f64 - 1.0) * q) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        format!(
            "{} codes: {} rounding near-ties (worst at {:.2} of its τ), {} of {} group searches chose another \
             candidate within ε_search; τ in grid steps: median {:.1e}, 99% {:.1e}, max {:.1e}",
            self.elements,
            self.rounding_ties,
            self.worst_tie_ratio,
            self.search_ties,
            self.searches,
            at(0.5),
            at(0.99),
            self.max_tau_steps
        )
    }
}

/// q = clamp(round(v/s) + z, 0, maxq) in f64 with the grid's (f32) values.
pub fn quant(v: f64, s: f64, z: f64, maxq: f64) -> f64 {
    ((v / s).round_ties_even() + z).clamp(0.0, maxq)
}

/// Replays the sweep of `case` along the backend's results `got` (module comment); the first element it
/// cannot explain is the error.
pub fn check(case: &Case, got: &Got) -> Result<Verdict, String> {
    let Case {
        w,
        rows,
        n,
        d_h,
        u_col,
        head_col,
        f_row,
        u_row_diag,
        ..
    } = *case;
    let maxq = case.maxq as f64;
    let n_heads = rows / d_h;
    let ng = match &case.grids {
        RefGrids::Static { ng, .. } => *ng,
        RefGrids::Dynamic { g, .. } => n.div_ceil(*g),
    };
    assert!(n_heads * d_h == rows && head_col.len() == n_heads);
    assert!(
        w.len() == rows * n && u_col.len() >= (head_col.iter().max().unwrap_or(&0) + 1) * n * n
    );
    if got.codes.len() != rows * n || got.q.len() != rows * n {
        return Err(format!(
            "codes {} / Q {} values for [{rows} × {n}]",
            got.codes.len(),
            got.q.len()
        ));
    }
    if got.scale.len() != rows * ng || got.zero.len() != rows * ng {
        return Err(format!(
            "grids {} / {} values for [{rows} × {ng}]",
            got.scale.len(),
            got.zero.len()
        ));
    }
    if let Some(i) = got.codes.iter().position(|&c| c as f64 > maxq) {
        return Err(format!(
            "code {} > maxq {maxq} at row {}, column {} (unwritten output?)",
            got.codes[i],
            i / n,
            i % n
        ));
    }
    if let RefGrids::Static { scale, zero, .. } = &case.grids {
        for i in 0..rows * ng {
            if got.scale[i].to_bits() != scale[i].to_bits()
                || got.zero[i].to_bits() != zero[i].to_bits()
            {
                return Err(format!(
                    "static grid ({}, {}) of row {}, group {} came back as ({}, {})",
                    scale[i],
                    zero[i],
                    i / ng,
                    i % ng,
                    got.scale[i],
                    got.zero[i]
                ));
            }
        }
    }
    let mut v = Verdict::default();
    for h in 0..n_heads {
        let f = head_col[h];
        let u = &u_col[f * n * n..(f + 1) * n * n];
        // δ_i (value after the cross-row terms − q) and its bound, rows of this head so far.
        let mut delta = vec![0f64; d_h * n];
        let mut b_delta = vec![0f64; d_h * n];
        for j in 0..d_h {
            let r = h * d_h + j;
            // Eq. (12): x = w0 − Σ_{i<j} F_ij δ_i, with |terms| and the propagated bound.
            let mut x = vec![0f64; n];
            let mut a = vec![0f64; n]; // Σ |terms| so far (cross-row, then GPTQ)
            let mut p = vec![0f64; n]; // propagated part of the value's bound
            let mut b_x = vec![0f64; n];
            for c in 0..n {
                let w0 = w[r * n + c] as f64;
                let (mut xv, mut av, mut pv) = (w0, w0.abs(), 0f64);
                for i in 0..j {
                    let fij = f_row[(h * d_h + i) * d_h + j] as f64;
                    let t = fij * delta[i * n + c];
                    xv -= t;
                    av += t.abs();
                    pv += fij.abs() * b_delta[i * n + c];
                }
                x[c] = xv;
                a[c] = av;
                p[c] = pv;
                b_x[c] = gamma(j + 1) * av + pv;
            }
            let mut vals = x.clone();
            let bound = |a: &[f64], p: &[f64], c: usize| gamma(j + c + 2) * a[c] + p[c];
            let mut row_loss = 0f64;
            let urd = u_row_diag.get(h * d_h + j).map_or(1.0, |&d| d as f64);
            let grid_of_group: Vec<(f32, f32)> = (0..ng)
                .map(|k| (got.scale[r * ng + k], got.zero[r * ng + k]))
                .collect();
            for c in 0..n {
                let k = match &case.grids {
                    RefGrids::Static { col_group, .. } => col_group[f][c] as usize,
                    RefGrids::Dynamic { g, h: hd, spec } => {
                        let k = c / g;
                        if c % g == 0 {
                            let len = (*g).min(n - c);
                            let taus: Vec<f64> = (c..c + len)
                                .map(|cc| bound(&a, &p, cc) + 2.0 * U32 * vals[cc].abs())
                                .collect();
                            let hb = hd.map(|hm| {
                                let hf = &hm[f * n * n..(f + 1) * n * n];
                                let mut b = Vec::with_capacity(len * len);
                                for i in c..c + len {
                                    b.extend_from_slice(&hf[i * n + c..i * n + c + len]);
                                }
                                b
                            });
                            let chosen = grid_of_group[k];
                            let out = check_search(
                                &vals[c..c + len],
                                &taus,
                                None,
                                Grid {
                                    scale: chosen.0 as f64,
                                    zero: chosen.1 as f64,
                                },
                                hb.as_deref(),
                                spec,
                            )
                            .map_err(|e| {
                                format!("row {r}, group {k} (columns {c}..{}): {e}", c + len)
                            })?;
                            v.searches += 1;
                            v.search_ties += out as usize;
                        }
                        k
                    }
                };
                let (s32, z32) = grid_of_group[k];
                let (s, z) = (s32 as f64, z32 as f64);
                let val = vals[c];
                let bv = bound(&a, &p, c);
                let tau = bv + 2.0 * U32 * val.abs();
                // τ in grid steps where a boundary can be near (not far past a clamp).
                if (-0.5..=maxq + 0.5).contains(&(val / s + z)) {
                    v.max_tau_steps = v.max_tau_steps.max(tau / s);
                    v.tau_steps.push((tau / s) as f32);
                }
                let kr = quant(val, s, z, maxq);
                let kg = got.codes[r * n + c] as f64;
                if kg != kr {
                    let (lo, hi) = (quant(val - tau, s, z, maxq), quant(val + tau, s, z, maxq));
                    // Distance (in grid steps) from the value to the boundary between the two codes.
                    let boundary = kr.min(kg) + 0.5 - z;
                    let dist = (val / s - boundary).abs();
                    if kg < lo || kg > hi {
                        return Err(format!(
                            "row {r}, column {c}: code {kg} where the reference rounds {val:.9e} (grid s = {s32:e}, \
                             z = {z32}) to {kr}: {dist:.3e} grid steps from the boundary, beyond τ = {:.3e} steps \
                             (not a near-tie)",
                            tau / s
                        ));
                    }
                    v.rounding_ties += 1;
                    v.worst_tie_ratio = v.worst_tie_ratio.max(dist / (tau / s));
                }
                // The backend's code from here on; Q = s·(q − z) in f32 (a product of an exact difference).
                let qv32 = s32 * (kg as f32 - z32);
                let gq = got.q[r * n + c];
                if gq.to_bits() != qv32.to_bits() {
                    return Err(format!(
                        "row {r}, column {c}: Q = {gq} but its code {kg} on grid ({s32}, {z32}) dequantizes to {qv32}"
                    ));
                }
                let qv = qv32 as f64;
                let ucc = u[c * n + c] as f64;
                let e = (val - qv) / ucc;
                let be = (bv + U32 * (val - qv).abs()) / ucc.abs() + U32 * e.abs();
                let el = e / urd;
                let bel = be / urd.abs() + U32 * el.abs();
                row_loss += el * el;
                v.loss_tol += 2.0 * el.abs() * bel + bel * bel;
                for c2 in c + 1..n {
                    let uc = u[c * n + c2] as f64;
                    vals[c2] -= e * uc;
                    a[c2] += (e * uc).abs();
                    p[c2] += be * uc.abs();
                }
                delta[j * n + c] = x[c] - qv;
                b_delta[j * n + c] = b_x[c] + U32 * (x[c].abs() + qv.abs());
                let d = qv - w[r * n + c] as f64;
                v.delta_sq += d * d;
            }
            v.loss += row_loss;
            // The backend may sum a row's loss in f32 (gptq_block_kernel: per block, then the blocks).
            v.loss_tol += gamma(2 * n + 1) * row_loss;
            v.elements += n;
        }
    }
    Ok(v)
}

/// Interval [min, max] of a grid's score over what the backend may have computed: values within `tau` of
/// ours, elements within tau of a rounding boundary rounded either way.
fn score_interval(
    vals: &[f64],
    tau: &[f64],
    g: Grid<f64>,
    h: Option<&[f32]>,
    spec: &QuantSpec,
) -> (f64, f64) {
    let maxq = spec.maxq() as f64;
    let len = vals.len();
    let (s, z) = (g.scale, g.zero);
    let code = |x: f64| quant(x, s, z, maxq);
    let delta: Vec<f64> = vals.iter().map(|&x| s * (code(x) - z) - x).collect();
    match spec.search {
        ScaleSearch::Hessian => {
            let h = h.expect("Hessian score needs H");
            let hd: Vec<f64> = (0..len)
                .map(|i| (0..len).map(|k| h[i * len + k] as f64 * delta[k]).sum())
                .collect();
            let score: f64 = delta.iter().zip(&hd).map(|(a, b)| a * b).sum();
            // Continuous part: |ΔᵀHΔ − Δ'ᵀHΔ'| ≤ 2|Δ|ᵀ|H|τ + τᵀ|H|τ for |Δ − Δ'| ≤ τ.
            let mut cont = 0f64;
            for i in 0..len {
                let ht: f64 = (0..len)
                    .map(|k| (h[i * len + k] as f64).abs() * tau[k])
                    .sum();
                cont += 2.0 * delta[i].abs() * ht + tau[i] * ht;
            }
            // Jumps: elements whose code may differ, each by ±1 (a step ±s of Δ).
            let amb: Vec<(usize, f64)> = (0..len)
                .filter_map(|i| {
                    let (lo, hi) = (code(vals[i] - tau[i]), code(vals[i] + tau[i]));
                    let c0 = code(vals[i]);
                    if lo == hi {
                        None
                    } else {
                        Some((i, s * if c0 == lo { hi - c0 } else { lo - c0 }))
                    }
                })
                .collect();
            let (mut lo, mut hi) = (score, score);
            if amb.len() <= 10 {
                for mask in 1u32..(1 << amb.len()) {
                    let mut ds = 0f64;
                    for (ai, &(i, di)) in amb.iter().enumerate() {
                        if mask >> ai & 1 == 0 {
                            continue;
                        }
                        ds += 2.0 * di * hd[i];
                        for (bi, &(k, dk)) in amb.iter().enumerate() {
                            if mask >> bi & 1 == 1 {
                                ds += di * h[i * len + k] as f64 * dk;
                            }
                        }
                    }
                    lo = lo.min(score + ds);
                    hi = hi.max(score + ds);
                }
            } else {
                let mut b = 0f64;
                for &(i, di) in &amb {
                    b += 2.0 * di.abs() * hd[i].abs();
                    for &(k, dk) in &amb {
                        b += (di * h[i * len + k] as f64 * dk).abs();
                    }
                }
                lo -= b;
                hi += b;
            }
            (lo - cont, hi + cont)
        }
        ScaleSearch::Mse | ScaleSearch::MinMax => {
            // Separable: per element, the smallest and largest |Δ'|^p over its possible codes and values.
            let (mut lo, mut hi) = (0f64, 0f64);
            for i in 0..len {
                let x = vals[i];
                let (cl, ch) = (code(x - tau[i]), code(x + tau[i]));
                let (mut l, mut u) = (f64::INFINITY, 0f64);
                for c in [cl, ch] {
                    let d = (s * (c - z) - x).abs();
                    l = l.min((d - tau[i]).max(0.0).powf(MSE_NORM));
                    u = u.max((d + tau[i]).powf(MSE_NORM));
                }
                lo += l;
                hi += u;
            }
            (lo, hi)
        }
    }
}

/// Checks the grid `chosen` a backend's search picked for `vals` (module comment). `tau`: how far the
/// backend's values may be from `vals`. `cands`: the candidates the backend scored, when it scored exactly
/// these values (`search_grids`); None when it built its own from its perturbed values (a sweep): then ours
/// are the shrink path's (design.md §4.1) with only those zeros both sides are sure to have (a floor/ceil
/// pair where −p·lo/s is not within its perturbation of an integer k, else k alone: f32 or f64 rounding of
/// an exact k, e.g. z = maxq for a group with no positive value, yields k ± 1 on one side only).
/// Returns whether the choice is a search near-tie (another candidate than our best).
pub fn check_search(
    vals: &[f64],
    tau: &[f64],
    cands: Option<&[Grid<f64>]>,
    chosen: Grid<f64>,
    h: Option<&[f32]>,
    spec: &QuantSpec,
) -> Result<bool, String> {
    let len = vals.len();
    let maxq = spec.maxq() as f64;
    let tau_max = tau.iter().cloned().fold(0.0, f64::max);
    let perturbed = cands.is_none();
    // The relative perturbation of a candidate's scale: the range moves by ≤ 2·τ_max, plus f32 rounding.
    let (lo_v, hi_v) = vals
        .iter()
        .fold((0f64, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
    let range = if spec.sym {
        2.0 * hi_v.max(-lo_v)
    } else {
        hi_v - lo_v
    };
    let rho = if perturbed {
        2.0 * tau_max / range.max(f64::MIN_POSITIVE) + 4.0 * U32
    } else {
        0.0
    };
    let same = |a: Grid<f64>, b: Grid<f64>| {
        a.zero == b.zero && (a.scale - b.scale).abs() <= (rho + 4.0 * U32) * b.scale.abs()
    };
    if spec.search == ScaleSearch::MinMax {
        let want: Grid<f64> = minmax_grid(vals, spec.maxq(), spec.sym);
        if (chosen.scale - want.scale).abs() > (rho + 4.0 * U32) * want.scale {
            return Err(format!(
                "min-max scale {} is not the values' {} (relative slack {:.1e})",
                chosen.scale,
                want.scale,
                rho + 4.0 * U32
            ));
        }
        if chosen.zero != want.zero {
            // z = round(−lo/s): may round the other way only if −lo/s is within its perturbation of a tie.
            let t = -lo_v / want.scale;
            let slack = (tau_max / want.scale) + (rho + 4.0 * U32) * t.abs();
            if spec.sym
                || (chosen.zero - want.zero).abs() != 1.0
                || ((t - t.floor()) - 0.5).abs() > slack
            {
                return Err(format!(
                    "min-max zero {} where the values give round({t}) = {}",
                    chosen.zero, want.zero
                ));
            }
            return Ok(true);
        }
        return Ok(false);
    }
    let tau_c: Vec<f64> = vals
        .iter()
        .zip(tau)
        .map(|(&x, &t)| t + rho * x.abs())
        .collect();
    let own;
    let cands = match cands {
        Some(c) => c,
        None => {
            own = shrink_candidates(vals, spec, rho, tau_max);
            &own[..]
        }
    };
    let mut best = (f64::INFINITY, f64::INFINITY, Grid::default());
    for &c in cands {
        let (point, _) = score_interval(vals, &vec![0.0; len], c, h, spec);
        let (_, hi) = score_interval(vals, &tau_c, c, h, spec);
        best.1 = best.1.min(hi);
        if point < best.0 {
            best.0 = point;
            best.2 = c;
        }
    }
    let (got_lo, _) = score_interval(vals, tau, chosen, h, spec);
    // ε_search: the backend's f32 scoring (module comment), at the best candidate.
    let g = best.2;
    let delta: Vec<f64> = vals
        .iter()
        .map(|&x| g.scale * (quant(x, g.scale, g.zero, maxq) - g.zero) - x)
        .collect();
    let eps = match spec.search {
        ScaleSearch::Hessian => {
            let h = h.expect("H");
            let k = (len * (spec.maxq() as usize + 2)) as f64;
            let m: Vec<f64> = vals
                .iter()
                .zip(&delta)
                .map(|(x, d)| x.abs() + d.abs())
                .collect();
            let mut q = 0f64;
            for i in 0..len {
                for j in 0..len {
                    q += m[i] * (h[i * len + j] as f64).abs() * m[j];
                }
            }
            16.0 * k.sqrt() * U32 * q
        }
        _ => {
            8.0 * U32
                * MSE_NORM
                * vals
                    .iter()
                    .zip(&delta)
                    .map(|(x, d)| d.abs().powf(MSE_NORM - 1.0) * (x.abs() + d.abs()))
                    .sum::<f64>()
        }
    };
    if got_lo > best.1 + eps {
        return Err(format!(
            "{:?} search chose grid (s = {}, z = {}) scoring ≥ {got_lo:.6e}, but candidate (s = {}, z = {}) scores \
             {:.6e} (≤ {:.6e} as the backend may see it; ε_search {eps:.2e}): not a search near-tie",
            spec.search, chosen.scale, chosen.zero, g.scale, g.zero, best.0, best.1
        ));
    }
    Ok(!same(chosen, best.2))
}

/// The shrink search's candidates for values known to within `tau_max` (relative scale perturbation `rho`),
/// keeping of a zero pair only what both sides surely have (`check_search`).
fn shrink_candidates(vals: &[f64], spec: &QuantSpec, rho: f64, tau_max: f64) -> Vec<Grid<f64>> {
    let maxq = spec.maxq() as f64;
    let (mut lo, mut hi) = vals
        .iter()
        .fold((0f64, 0f64), |(l, h), &x| (l.min(x), h.max(x)));
    if spec.sym {
        hi = hi.max(-lo);
        lo = -hi;
    }
    if lo == 0.0 && hi == 0.0 {
        (lo, hi) = (-1.0, 1.0);
    }
    let mut out = Vec::with_capacity(2 * SHRINK_STEPS);
    for i in 0..SHRINK_STEPS {
        let p = 1.0 - i as f64 / SHRINK_STEPS as f64;
        let scale = (p * hi - p * lo) / maxq;
        if spec.sym {
            out.push(Grid {
                scale,
                zero: (maxq + 1.0) / 2.0,
            });
            continue;
        }
        let z = -p * lo / scale;
        let slack = (rho + 8.0 * U32) * z.abs().max(1.0) + tau_max / scale;
        if (z - z.round()).abs() <= slack {
            out.push(Grid {
                scale,
                zero: z.round(),
            });
        } else {
            out.push(Grid {
                scale,
                zero: z.floor(),
            });
            out.push(Grid {
                scale,
                zero: z.ceil(),
            });
        }
    }
    out
}
