//! Grids on a GGUF lattice (`ops::Lattice`, design.md §12 "Formats as codecs"): the scale search proposes
//! only grids the format stores, so the sweep's error feedback works on the values llama.cpp decodes.
//!
//! `F16` (Q5_0, Q4_1, Q5_1): the free search's grid (s, z) of design.md §4.1 with s rounded to f16, and on an
//! offset grid the offset m = s·z rounded to f16 (ŵ = s·q − m).
//!
//! `Super` (the K-quants): per row and super-block of `len` columns, f16 d (and dmin) shared by its groups;
//! group j's grid is (d·sc_j, dmin·m_j) with integers sc_j ≤ sc_max, m_j ≤ m_max (on a symmetric grid sc_j
//! may be negative, which mirrors its levels −z..maxq − z). Two levels, as the sweep
//! meets them:
//!   1. At the super-block's first column, [`super_scale`]: the free search of each of its groups on the
//!      current weights gives (s_j, z_j), offsets m_j = s_j·z_j, and
//!      d = f16(max_j s_j / sc_max), dmin = f16(max_j m_j / m_max),
//!      so the largest group's grid lands on the top integer (llama.cpp's make_qkx2_quants / make_qx_quants
//!      choose their super-scales the same way, from unconstrained per-group fits).
//!   2. At each group's first column, [`lattice_grid`]: the group's free grid (s*, z*) on the weights it has
//!      then (after the error feedback of every earlier column), and the storable grids near it: sc within
//!      ±`SC_RADIUS` of s*/d; on an offset grid, for each sc, m at floor/ceil of the offset that keeps the free
//!      grid's code 0 (m*/dmin) and of the one that keeps its centre (the value at code maxq/2), each scored
//!      as the free search scores (Δ H Δᵀ, Σ|Δ|^2.4; min-max takes the nearest).
//!
//! Why d must be fixed at the super-block's first column: the format stores one d for the whole super-block,
//! and every group's codes are decoded with it, so the first group cannot be quantized before d is known;
//! the later groups' weights still move (error feedback) after d is chosen, which the clamp of sc to
//! 1..=sc_max absorbs.
//!
//! A grid here is exact in f32: d·sc (≤ 11 + 8 significant bits) and dmin·m are exact products, so the sweep's
//! ŵ = (d·sc)·q − dmin·m rounds once, in the subtraction, as ggml's decode does (model/gguf/kquant.rs).

use super::Real;
use super::quantizer::{Grid, QuantSpec, ScaleSearch, orientations, pick, search_grid};
use crate::ops::Lattice;
use half::f16;

/// Integers on either side of s*/d tried for a group's sc: the free optimum moves by less than one step of
/// the lattice when only d is coarse, by a few when the group's later columns have drifted.
const SC_RADIUS: i64 = 2;

/// The super-block's shared scales: f16 values, d > 0; dmin ≥ 0 (0 on a symmetric grid).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SuperScale<T> {
    pub d: T,
    pub dmin: T,
}

/// The nearest f16 of x ≥ 0, at least the smallest positive f16 when `positive` (a scale d of 0 would
/// make every grid of the super-block empty).
fn f16_of<T: Real>(x: T, positive: bool) -> T {
    let v = f16::from_f64(x.to_f64().max(0.0)).to_f64();
    let min = f16::from_bits(1).to_f64();
    T::from_f64(if positive { v.max(min) } else { v })
}

/// The spec of the free search behind a lattice grid: same width, symmetry and scoring, positive scales
/// (`lattice_grid` mirrors a signed F16 grid itself, after rounding).
fn free(spec: &QuantSpec) -> QuantSpec {
    QuantSpec {
        signed: false,
        ..spec.on(Lattice::Free)
    }
}

/// Level 1 of `Super`: d (and dmin) of one row's super-block `w` (its groups of `g` columns, the last maybe
/// shorter), `h_blocks[j]` the diagonal H block of group j (read for the Hessian search only).
pub fn super_scale<T: Real>(
    w: &[T],
    h_blocks: &[&[f32]],
    g: usize,
    spec: &QuantSpec,
) -> SuperScale<T> {
    let Lattice::Super { sc_max, m_max, .. } = spec.lattice else {
        return SuperScale::default();
    };
    let fs = free(spec);
    let (mut s_max, mut m_top) = (T::ZERO, T::ZERO);
    for (j, wj) in w.chunks(g).enumerate() {
        let h = (spec.search == ScaleSearch::Hessian).then(|| h_blocks[j]);
        let gr = search_grid(wj, h, &fs);
        s_max = s_max.max(gr.scale);
        if spec.offset() {
            m_top = m_top.max(gr.scale * gr.zero);
        }
    }
    let dmin = if spec.offset() && m_max > 0 {
        f16_of(m_top / T::from_f64(m_max as f64), false)
    } else {
        T::ZERO
    };
    SuperScale {
        d: f16_of(s_max / T::from_f64(sc_max as f64), true),
        dmin,
    }
}

/// A group's grid on the lattice of `spec` (level 2 of `Super`, or `F16`), from its current weights `w` and
/// its diagonal H block `h` (Hessian search); `sup` is its super-block's (ignored off `Super`). On `Free`,
/// the free search itself.
pub fn lattice_grid<T: Real>(
    w: &[T],
    h: Option<&[f32]>,
    spec: &QuantSpec,
    sup: SuperScale<T>,
) -> Grid<T> {
    match spec.lattice {
        // The free search itself, signed scales included.
        Lattice::Free => search_grid(w, h, spec),
        Lattice::F16 if spec.signed => {
            // The f16 grid of each orientation's free optimum, whichever scores lower.
            let f16_grid = |g: Grid<T>| {
                let s = f16_of(g.scale.abs(), true);
                Grid {
                    scale: if g.scale < T::ZERO { -s } else { s },
                    zero: g.zero,
                }
            };
            pick(w, h, spec, &orientations(w, h, spec).map(f16_grid))
        }
        Lattice::F16 => {
            let best = search_grid(w, h, &free(spec));
            Grid {
                scale: f16_of(best.scale, true),
                zero: if spec.offset() {
                    f16_of(best.scale * best.zero, false)
                } else {
                    best.zero
                },
            }
        }
        Lattice::Super { sc_max, m_max, .. } => {
            let best = search_grid(w, h, &free(spec));
            let cands = super_candidates(best, spec, sup, sc_max, m_max);
            pick(w, h, spec, &cands)
        }
    }
}

/// The storable grids near the free optimum `best`, nearest first (ties of the score go to the earlier).
fn super_candidates<T: Real>(
    best: Grid<T>,
    spec: &QuantSpec,
    sup: SuperScale<T>,
    sc_max: u32,
    m_max: u32,
) -> Vec<Grid<T>> {
    let r = (best.scale / sup.d).to_f64().round() as i64;
    let mut scs = Vec::with_capacity(2 * SC_RADIUS as usize + 1);
    for k in 0..=2 * SC_RADIUS {
        // r, r − 1, r + 1, r − 2, r + 2
        let sc = (r + if k % 2 == 1 { -(k + 1) / 2 } else { k / 2 }).clamp(1, sc_max as i64);
        if !scs.contains(&sc) {
            scs.push(sc);
        }
    }
    let maxq = T::from_f64(spec.maxq() as f64);
    let half = maxq / T::from_f64(2.0);
    let mut out = Vec::new();
    for sc in scs {
        let scale = sup.d * T::from_f64(sc as f64);
        if !spec.offset() {
            // A symmetric grid's levels are −z..maxq − z: the negative scale (Q3_K's and Q6_K's sub-block
            // scales are signed) mirrors them, putting the extra level on the other side.
            out.push(Grid {
                scale,
                zero: best.zero,
            });
            out.push(Grid {
                scale: -scale,
                zero: best.zero,
            });
            continue;
        }
        // The free grid's offset (its code 0 at the same value) and the offset that keeps its centre.
        let m0 = best.scale * best.zero;
        let centre = best.scale * half - m0;
        let mut ms: Vec<i64> = Vec::with_capacity(4);
        for off in [m0, scale * half - centre] {
            let x = if sup.dmin > T::ZERO {
                (off / sup.dmin).to_f64().max(0.0)
            } else {
                0.0
            };
            for m in [x.round(), x.floor(), x.ceil()] {
                let m = (m as i64).clamp(0, m_max as i64);
                if !ms.contains(&m) {
                    ms.push(m);
                }
            }
        }
        out.extend(ms.into_iter().map(|m| Grid {
            scale,
            zero: sup.dmin * T::from_f64(m as f64),
        }));
    }
    out
}

/// Every group's grid of one row `w` [n] before a sweep (static grids, RTN): on `Super`, each super-block's
/// d first, then its groups, all from the same weights. `h_blocks[k]` is group k's diagonal H block (Hessian
/// search only).
pub fn lattice_row<T: Real>(
    w: &[T],
    h_blocks: &[&[f32]],
    g: usize,
    spec: &QuantSpec,
) -> Vec<Grid<T>> {
    let sl = match spec.lattice {
        Lattice::Super { len, .. } => len,
        _ => g,
    };
    let mut out = Vec::with_capacity(w.len().div_ceil(g));
    for (si, ws) in w.chunks(sl).enumerate() {
        let k0 = si * sl / g;
        let hb = &h_blocks[k0.min(h_blocks.len())..];
        let sup = super_scale(ws, hb, g, spec);
        for (j, wj) in ws.chunks(g).enumerate() {
            let h = (spec.search == ScaleSearch::Hessian).then(|| hb[j]);
            out.push(lattice_grid(wj, h, spec, sup));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantizer::score;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    fn is_f16(x: f64) -> bool {
        f16::from_f64(x).to_f64() == x
    }

    /// Every grid a `Super` search returns is storable: d, dmin f16, each scale d·sc and offset dmin·m with
    /// integers in range, shared d within a super-block; and it scores no worse than the plain rounding of
    /// the free grid to the lattice (one of its candidates).
    #[test]
    fn super_grids_are_storable() {
        let mut seed = 7u64;
        for (bits, sym, g, sc_max, m_max) in [
            (4, false, 32, 63, 63),
            (6, true, 16, 127, 0),
            (3, true, 16, 31, 0),
            (2, false, 16, 15, 15),
        ] {
            let len = 256;
            let spec = QuantSpec::new(bits, Some(g), sym, ScaleSearch::Hessian)
                .on(Lattice::Super { len, sc_max, m_max });
            spec.validate().unwrap();
            let n = 2 * len;
            let w: Vec<f64> = (0..n)
                .map(|i| lcg(&mut seed) * (1.0 + (i / g) as f64 * 0.3))
                .collect();
            // A diagonal-dominant SPD block per group.
            let hb: Vec<Vec<f32>> = (0..n / g)
                .map(|_| {
                    let mut h = vec![0f32; g * g];
                    for i in 0..g {
                        for j in 0..g {
                            h[i * g + j] = if i == j {
                                2.0 + lcg(&mut seed).abs() as f32
                            } else {
                                0.1 * lcg(&mut seed) as f32
                            };
                        }
                    }
                    for i in 0..g {
                        for j in 0..i {
                            h[i * g + j] = h[j * g + i];
                        }
                    }
                    h
                })
                .collect();
            let refs: Vec<&[f32]> = hb.iter().map(|v| v.as_slice()).collect();
            let grids = lattice_row(&w, &refs, g, &spec);
            assert_eq!(grids.len(), n / g);
            for s in 0..n / len {
                let per = len / g;
                let sup = super_scale(&w[s * len..(s + 1) * len], &refs[s * per..], g, &spec);
                assert!(is_f16(sup.d) && sup.d > 0.0 && is_f16(sup.dmin), "{sup:?}");
                for j in 0..per {
                    let gr = grids[s * per + j];
                    let sc = gr.scale / sup.d;
                    // Signed on a symmetric grid (the mirror), positive on an offset one.
                    let sc = if sym { sc.abs() } else { sc };
                    assert!(
                        sc.fract() == 0.0 && (1.0..=sc_max as f64).contains(&sc),
                        "{bits}-bit: sc {sc}"
                    );
                    if sym {
                        assert_eq!(gr.zero, (1u32 << (bits - 1)) as f64);
                    } else if sup.dmin > 0.0 {
                        let m = gr.zero / sup.dmin;
                        assert!(
                            m.fract() == 0.0 && (0.0..=m_max as f64).contains(&m),
                            "m {m}"
                        );
                    }
                    let k = s * per + j;
                    let wg = &w[k * g..(k + 1) * g];
                    let mut d = vec![0.0; g];
                    let got = score(wg, Some(refs[k]), &spec, gr, &mut d);
                    let nearest = super_candidates(
                        search_grid(wg, Some(refs[k]), &free(&spec)),
                        &spec,
                        sup,
                        sc_max,
                        m_max,
                    )[0];
                    assert!(got <= score(wg, Some(refs[k]), &spec, nearest, &mut d));
                }
            }
        }
    }

    /// `F16`: the scale (and offset) are f16 values, and a symmetric grid keeps its zero point.
    #[test]
    fn f16_grids_are_f16() {
        let mut seed = 3u64;
        for sym in [true, false] {
            let spec = QuantSpec::new(5, Some(32), sym, ScaleSearch::Mse).on(Lattice::F16);
            let w: Vec<f64> = (0..32).map(|_| lcg(&mut seed) * 0.02).collect();
            let gr = lattice_grid(&w, None, &spec, SuperScale::default());
            assert!(is_f16(gr.scale) && gr.scale > 0.0);
            if sym {
                assert_eq!(gr.zero, 16.0);
            } else {
                assert!(is_f16(gr.zero) && gr.zero >= 0.0);
            }
        }
    }

    /// Q5_0 with signed scales: an f16 d of either sign, the mirrored one where a row's largest magnitude is a
    /// positive outlier, and never a higher error than the positive d.
    #[test]
    fn signed_f16_grids_mirror_and_never_lose() {
        let mut seed = 11u64;
        let spec = QuantSpec::new(5, Some(32), true, ScaleSearch::Mse).on(Lattice::F16);
        let signed = spec.signed_if(true);
        let mut d = vec![0f64; 32];
        let mut mirrored = 0;
        for rep in 0..20 {
            let mut w: Vec<f64> = (0..32).map(|_| lcg(&mut seed) * 0.02).collect();
            w[7] = if rep % 2 == 0 { 0.3 } else { -0.3 };
            let pos = lattice_grid(&w, None, &spec, SuperScale::default());
            let got = lattice_grid(&w, None, &signed, SuperScale::default());
            assert!(is_f16(got.scale.abs()) && got.zero == 16.0, "{got:?}");
            let (sp, sg) = (
                score(&w, None, &spec, pos, &mut d),
                score(&w, None, &spec, got, &mut d),
            );
            assert!(sg <= sp, "rep {rep}: {sg} above {sp}");
            if got.scale < 0.0 {
                assert!(rep % 2 == 0 && sg < sp, "rep {rep}: {got:?}");
                mirrored += 1;
            }
        }
        assert_eq!(mirrored, 10);
    }
}
