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
//! With signed scales (`QuantSpec::signed`, GGUF's symmetric blocks) the search runs on w and on −w, the
//! latter's grid (s, z) becoming (−s, z) for w, and keeps the orientation whose exact score (f64) is lower.
//!
//! Why the Hessian score is incremental rather than a GEMM over all candidates: z = −p·min/(p·(max−min)/maxq)
//! does not depend on p, so along the shrink path (s decreasing) each candidate's integer vector
//! v = clamp(round(w/s), −z, maxq − z) = q − z changes in only a few entries (each entry moves monotonically
//! towards a clamp bound: at most ~maxq changes over the whole path). With u = H v, a = vᵀHv and b = vᵀHw
//! kept up to date (a change δ at entry i costs one row of H: a += δ(2u_i + δH_ii), b += δ(Hw)_i,
//! u += δ H_i,:), the score Δ H Δᵀ = s²a − 2s b + wᵀHw costs O(g²·changes) per row instead of O(g²·200).
//! H is scored in f32 (u, H block) with f64 accumulators a, b; the constant wᵀHw is dropped.
//!
//! How the incremental search is laid out (the same f32 and f64 operations, in the same order per score, as
//! the row-at-a-time chain it replaced, so the same grid bits; tests/quant_search.rs keeps that chain as the
//! reference):
//!   1. `shrink_path`: walk the 100 steps of one row without touching H, recording every entry change
//!      (event) of v and of the ceil mask m, and which entries of u = H v and t = H m each score reads.
//!   2. `chain_passes`: replay the axpys column tile by column tile (`TiledH`, 64 columns of H): each tile
//!      is read once per chunk of 16 rows instead of once per change, the running vectors' tiles live in
//!      registers, and only the values the scores read are kept. Each entry of u and t sees the same f32
//!      mul-then-add sequence as before.
//!   3. `best_grid`: the f64 scalars a, b, μ, γ, β event by event and every candidate's score, in step order
//!      (the first of equal scores wins).
//!
//! Pruning (batches of ≥ `PRUNE_MIN_ROWS` rows): with H positive definite (checked once per H by a
//! Cholesky), Cauchy–Schwarz bounds the exact score of any candidate x from below,
//!   ‖s·x − w‖²_H − c ≥ (s·xᵀHw − c)²/c − c,   c = wᵀHw,
//! and xᵀHw is a cheap running sum (b, β above). `Certifier` lowers that bound by a rigorous bound on the
//! rounding of the f32 chains and f64 scalars (via the absolute row sums of H), so it is below the score the
//! chains would compute. The steps after the last one whose bound is not above the first candidate's
//! computed score cannot win (a tie goes to the earlier candidate) and are never replayed in phase 2.

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

/// q = clamp(round((w + m)/s), 0, maxq) on an offset grid (`QuantSpec::offset`): ŵ = s·q − m.
#[inline(always)]
pub fn quantize_offset<T: Real>(w: T, scale: T, m: T, maxq: T) -> T {
    ((w + m) / scale).round_ties_even().max(T::ZERO).min(maxq)
}

/// ŵ = s·q − m: ggml's K-quant order (d·sc)·q − dmin·m, one rounding (the subtraction) when s·q and m are
/// exact, as they are on a GGUF lattice (model/gguf/kquant.rs).
#[inline(always)]
pub fn dequantize_offset<T: Real>(q: T, scale: T, m: T) -> T {
    scale * q - m
}

/// (q, ŵ) of `w` on `g`: an offset grid when `offset` (`QuantSpec::offset`), else a zero-point grid (the
/// formulas above, so a zero-point grid's codes are those of [`quantize`] to the bit).
#[inline(always)]
pub fn quant_dequant<T: Real>(w: T, g: Grid<T>, maxq: T, offset: bool) -> (T, T) {
    if offset {
        let q = quantize_offset(w, g.scale, g.zero, maxq);
        (q, dequantize_offset(q, g.scale, g.zero))
    } else {
        let q = quantize(w, g.scale, g.zero, maxq);
        (q, dequantize(q, g.scale, g.zero))
    }
}

/// The range [min(w,0), max(w,0)] (symmetric: [−m, m], m = max(|min|, max)); all-zero → [−1, 1].
pub(crate) fn range<T: Real>(w: &[T], sym: bool) -> (T, T) {
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
    if spec.signed {
        return pick(w, h, &unsigned(spec), &orientations(w, h, spec));
    }
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
            hessian_search_rows(&[w], h, &TiledH::new(h, w.len(), false), spec, None)[0]
        }
    }
}

/// `spec` with positive scales only (the search each orientation runs).
fn unsigned(spec: &QuantSpec) -> QuantSpec {
    QuantSpec {
        signed: false,
        ..*spec
    }
}

/// The positive-scale search's grid of w and, mirrored, of −w: the two orientations a signed search chooses
/// between (after the lattice's rounding, on F16).
pub(crate) fn orientations<T: Real>(w: &[T], h: Option<&[f32]>, spec: &QuantSpec) -> [Grid<T>; 2] {
    let free = unsigned(spec);
    let neg: Vec<T> = w.iter().map(|&x| -x).collect();
    [
        search_grid(w, h, &free),
        mirrored(search_grid(&neg, h, &free)),
    ]
}

/// The grid for w of the grid `g` that −w's search found: quantize(w, −s, z) = quantize(−w, s, z), as
/// round-half-to-even is odd, so its levels are w's mirrored (`QuantSpec::signed`).
fn mirrored<T: Real>(g: Grid<T>) -> Grid<T> {
    Grid {
        scale: -g.scale,
        zero: g.zero,
    }
}

/// The candidate with the smallest score (the first of equal scores); min-max takes the first.
pub(crate) fn pick<T: Real>(
    w: &[T],
    h: Option<&[f32]>,
    spec: &QuantSpec,
    cands: &[Grid<T>],
) -> Grid<T> {
    if spec.search == ScaleSearch::MinMax || cands.len() == 1 {
        return cands[0];
    }
    let mut best = (f64::INFINITY, cands[0]);
    let mut d = vec![0f64; w.len()];
    for &c in cands {
        let s = score(w, h, spec, c, &mut d);
        if s < best.0 {
            best = (s, c);
        }
    }
    best.1
}

/// Δ H Δᵀ (Hessian) or Σ|Δ|^2.4 (Mse) of `w` on grid `gr`, Δ = ŵ − w, in f64; `d` is scratch of w's length.
pub(crate) fn score<T: Real>(
    w: &[T],
    h: Option<&[f32]>,
    spec: &QuantSpec,
    gr: Grid<T>,
    d: &mut [f64],
) -> f64 {
    let maxq = T::from_f64(spec.maxq() as f64);
    for (x, &v) in d.iter_mut().zip(w) {
        *x = (quant_dequant(v, gr, maxq, spec.offset()).1 - v).to_f64();
    }
    match (spec.search, h) {
        (ScaleSearch::Hessian, Some(h)) => {
            let n = w.len();
            let mut total = 0f64;
            for (i, &di) in d.iter().enumerate() {
                let row = &h[i * n..(i + 1) * n];
                let hd: f64 = row.iter().zip(d.iter()).map(|(&a, &b)| a as f64 * b).sum();
                total += di * hd;
            }
            total
        }
        (ScaleSearch::Hessian, None) => panic!("the Hessian scale search needs the H block"),
        _ => d.iter().map(|x| x.abs().powf(MSE_NORM)).sum(),
    }
}

pub(crate) fn shrink(i: usize) -> f64 {
    1.0 - i as f64 / SHRINK_STEPS as f64
}

fn mse_search<T: Real>(w: &[T], spec: &QuantSpec) -> Grid<T> {
    let maxq = T::from_f64(spec.maxq() as f64);
    let (lo, hi) = range(w, spec.sym);
    let mut best = (f64::INFINITY, Grid::default());
    for i in 0..SHRINK_STEPS {
        let (scale, zs, nz) = candidates(lo, hi, T::from_f64(shrink(i)), maxq, spec.sym);
        for &zero in &zs[..nz] {
            let mut err = 0f64;
            for &x in w {
                let d = dequantize(quantize(x, scale, zero, maxq), scale, zero) - x;
                err += d.to_f64().abs().powf(MSE_NORM);
                // A sum of non-negative terms only grows (rounding is monotone), so a candidate whose
                // partial sum reaches the best cannot win: the same grid, without the rest of its powers.
                if err >= best.0 {
                    break;
                }
            }
            if err < best.0 {
                best = (err, Grid { scale, zero });
            }
        }
    }
    best.1
}

/// Columns of H per tile of the chain passes: a running vector's tile is 64 f32, four AVX-512 registers
/// (eight AVX2), and a [g × 64] tile of H stays in L2 (144 KiB at g = 576, 384 KiB at g = 1536) while a
/// chunk of rows passes over it.
const TILE: usize = 64;
/// Ops ahead whose H rows a chain pass prefetches into L1: the rows an op reads are known in advance but
/// jump by ~g/25 rows (several pages), which the hardware prefetchers do not follow.
const PREFETCH: usize = 8;

/// H [g × g] by column tiles: tile t is H[:, t·TILE..(t+1)·TILE], row j of it at data[j·stride..][..TILE].
/// The batched search packs every tile contiguously (one [g × TILE] block, 144 KiB at g = 576, stays in
/// L2 while a chunk of rows passes over it, and costs no TLB entry per row); a single row reads full tiles
/// in place (stride g) and packs only a partial last tile (zero-padded). H is symmetric, so row j of a
/// tile is also H[j, tile]: the piece of row j that an axpy reads.
struct TiledH<'a> {
    g: usize,
    h: &'a [f32],
    /// diag(H) as f64, contiguous (the scores read H_jj at every event).
    diag: Vec<f64>,
    /// Packed tiles from tile `packed_from` on.
    packed: Vec<f32>,
    packed_from: usize,
}

impl<'a> TiledH<'a> {
    fn new(h: &'a [f32], g: usize, pack_all: bool) -> Self {
        let tiles = g.div_ceil(TILE);
        let packed_from = if pack_all { 0 } else { g / TILE };
        let mut packed = vec![0f32; (tiles - packed_from) * g * TILE];
        for (k, tile) in packed.chunks_exact_mut(g * TILE).enumerate() {
            let c0 = (packed_from + k) * TILE;
            let c1 = (c0 + TILE).min(g);
            for (j, dst) in tile.chunks_exact_mut(TILE).enumerate() {
                dst[..c1 - c0].copy_from_slice(&h[j * g + c0..j * g + c1]);
            }
        }
        Self {
            g,
            h,
            diag: (0..g).map(|j| h[j * g + j] as f64).collect(),
            packed,
            packed_from,
        }
    }

    fn tiles(&self) -> usize {
        self.g.div_ceil(TILE)
    }

    /// (data, stride) of tile t.
    fn tile(&self, t: usize) -> (&[f32], usize) {
        if t < self.packed_from {
            (&self.h[t * TILE..], self.g)
        } else {
            let k = t - self.packed_from;
            (
                &self.packed[k * self.g * TILE..(k + 1) * self.g * TILE],
                TILE,
            )
        }
    }
}

/// One entry change along the shrink path: v_j (floor chain) or m_j (ceil mask) moves by d.
#[derive(Clone, Copy, Default)]
struct Event {
    j: u32,
    d: i32,
    mask: bool,
}

/// A read of both running vectors at entry j = tile·TILE + lane just before event `slot`: after the first
/// `ku` ops of u's chain and `kt` of t's.
#[derive(Clone, Copy)]
struct Read {
    ku: u32,
    kt: u32,
    lane: u32,
    slot: u32,
}

/// The axpys x += δ·H[j,:] of one running vector (u = H v, or t = H m) over one segment, in order: the
/// initial sum from zero (j ascending, as a fresh chain is built; none when u starts from the GEMM's
/// product), then the segment's changes.
#[derive(Default)]
struct Chain {
    ops: Vec<(u32, f32)>,
    n_init: usize,
    /// ops.len() after each step (for truncation).
    ends: Vec<usize>,
}

/// A run of shrink steps with one floor zero: the chains start from scratch at its first step (the f32
/// rounding of p·min and p·max can move −min/s across an integer between steps) and then change by events,
/// in the order the scores consume them: step, then j ascending, v_j before m_j.
struct Segment {
    first: usize,
    v0: Vec<i32>,
    m0: Vec<i32>,
    events: Vec<Event>,
    /// events.len() after each step of the segment (0 after the first, which only starts the chains).
    ends: Vec<usize>,
    u: Chain,
    t: Chain,
    /// Each tile's reads (the events at its entries), in event order.
    reads: Vec<Vec<Read>>,
    /// Some step has a ceil candidate: only then are t = H m and μ, γ, β needed.
    ceil: bool,
}

/// The shrink path of one row: the candidates (scale, zeros, count) of every step and every entry change.
struct Path<T> {
    steps: Vec<(T, [T; 2], usize)>,
    segments: Vec<Segment>,
}

impl<T: Real> Path<T> {
    /// Keeps the steps 0..=last (the later ones are certified losers).
    fn truncate(&mut self, last: usize) {
        self.steps.truncate(last + 1);
        self.segments.retain(|s| s.first <= last);
        let steps = &self.steps;
        let seg = self.segments.last_mut().expect("step 0 opens a segment");
        let k = last - seg.first;
        seg.ends.truncate(k + 1);
        let e_end = seg.ends[k];
        seg.events.truncate(e_end);
        seg.u.ops.truncate(seg.u.ends[k]);
        seg.t.ops.truncate(seg.t.ends[k]);
        for r in &mut seg.reads {
            r.truncate(r.partition_point(|r| (r.slot as usize) < e_end));
        }
        seg.ceil = steps[seg.first..].iter().any(|s| s.2 == 2);
    }
}

/// Walks the shrink path of `w` (O(g) per step, no H): phase 1 of the search (module comment). Builds
/// the events, the chains' ops and the tiles' reads in one sweep, and with `cert` each step's certificate.
#[inline(always)]
fn shrink_path<T: Real>(
    w: &[T],
    spec: &QuantSpec,
    tiles: usize,
    from_gemm: bool,
    mut cert: Option<&mut Certifier>,
) -> Path<T> {
    let g = w.len();
    let maxq = T::from_f64(spec.maxq() as f64);
    let (lo, hi) = range(w, spec.sym);
    let mut steps = Vec::with_capacity(SHRINK_STEPS);
    let mut segments: Vec<Segment> = Vec::new();
    let mut zero_of_segment = None;
    // v, m and their candidates nv, nm as floats (small integers, exact): a float-to-int cast is
    // saturating in Rust, which does not vectorize. diff_j: bit 0 = v_j changes, bit 1 = m_j changes
    // (padded to whole 16-byte words).
    let (mut v, mut m) = (vec![T::ZERO; g], vec![T::ZERO; g]);
    let (mut nv, mut nm) = (vec![T::ZERO; g], vec![T::ZERO; g]);
    let mut diff = vec![0u8; g.div_ceil(16) * 16];
    let to_i32 = |x: &[T]| -> Vec<i32> { x.iter().map(|&x| x.to_f64() as i32).collect() };
    for i in 0..SHRINK_STEPS {
        let (scale, zs, nz) = candidates(lo, hi, T::from_f64(shrink(i)), maxq, spec.sym);
        // ρ = round(w/s), shared by both chains (scored with w·(1/s): a last-bit difference at a rounding
        // tie only perturbs a score; the chosen grid is applied with `quantize`). q − z = clamp(ρ, −z,
        // maxq − z): integers, exact in float. m_j = [ρ_j ≥ maxq − z or ρ_j ≤ −z − 1]: exactly the entries
        // where the ceil chain's clamp differs, by 1. A NaN ρ counts as 0, as the saturating
        // `round_to_i32` of the row-at-a-time search made it.
        let inv = T::ONE / scale;
        let zero = zs[0];
        let vlo = T::from_f64((-zero.to_f64() as i32) as f64);
        let vhi = T::from_f64(((maxq - zero).to_f64() as i32) as f64);
        for j in 0..g {
            let r = (w[j] * inv).round_ties_even();
            #[allow(clippy::eq_op)] // r != r: NaN
            let r = if r != r { T::ZERO } else { r };
            nv[j] = r.max(vlo).min(vhi);
            nm[j] = if r >= vhi || r < vlo { T::ONE } else { T::ZERO };
            diff[j] = (nv[j] != v[j]) as u8 | ((nm[j] != m[j]) as u8) << 1;
        }
        if zero_of_segment != Some(zero) {
            let (v0, m0) = (to_i32(&nv), to_i32(&nm));
            let init = |x: &[i32]| {
                let mut c = Chain::default();
                for (j, &x) in x.iter().enumerate() {
                    if x != 0 {
                        c.ops.push((j as u32, x as f32));
                    }
                }
                c.n_init = c.ops.len();
                c
            };
            let mut u = init(&v0);
            if from_gemm && segments.is_empty() {
                u = Chain::default();
            }
            let mut t = init(&m0);
            if let Some(c) = cert.as_deref_mut() {
                c.start_segment(
                    &v0,
                    &m0,
                    u.n_init,
                    t.n_init,
                    segments.is_empty() && from_gemm,
                );
            }
            // Typical counts (LLM rows, 3 bits): ~3 events per entry, u's ~3/4 of them.
            u.ops.reserve(3 * g);
            t.ops.reserve(g);
            segments.push(Segment {
                first: i,
                v0,
                m0,
                events: Vec::with_capacity(4 * g),
                ends: Vec::with_capacity(SHRINK_STEPS),
                u,
                t,
                reads: (0..tiles).map(|_| Vec::with_capacity(4 * TILE)).collect(),
                ceil: false,
            });
            zero_of_segment = Some(zero);
        } else {
            let seg = segments.last_mut().expect("a segment is open");
            // Few entries change per step: find them 16 at a time in the diff bytes, j ascending.
            for (c, word) in diff.chunks_exact(16).enumerate() {
                let mut x = nonzero_bytes(word.try_into().expect("16 bytes"));
                while x != 0 {
                    let k = x.trailing_zeros() as usize;
                    x &= x - 1;
                    let j = c * 16 + k;
                    let f = diff[j];
                    let read = |seg: &Segment| Read {
                        ku: seg.u.ops.len() as u32,
                        kt: seg.t.ops.len() as u32,
                        lane: (j % TILE) as u32,
                        slot: seg.events.len() as u32,
                    };
                    if f & 1 != 0 {
                        let ev = Event {
                            j: j as u32,
                            d: (nv[j] - v[j]).to_f64() as i32,
                            mask: false,
                        };
                        let r = read(seg);
                        seg.reads[j / TILE].push(r);
                        seg.u.ops.push((ev.j, ev.d as f32));
                        seg.events.push(ev);
                        if let Some(c) = cert.as_deref_mut() {
                            c.event(ev, v[j].to_f64() as i32);
                        }
                    }
                    if f & 2 != 0 {
                        let ev = Event {
                            j: j as u32,
                            d: (nm[j] - m[j]).to_f64() as i32,
                            mask: true,
                        };
                        let r = read(seg);
                        seg.reads[j / TILE].push(r);
                        seg.t.ops.push((ev.j, ev.d as f32));
                        seg.events.push(ev);
                        if let Some(c) = cert.as_deref_mut() {
                            c.event(ev, 0);
                        }
                    }
                }
            }
        }
        // nv, nm are rewritten in full at the next step.
        std::mem::swap(&mut v, &mut nv);
        std::mem::swap(&mut m, &mut nm);
        let seg = segments.last_mut().expect("a segment is open");
        seg.ends.push(seg.events.len());
        seg.u.ends.push(seg.u.ops.len());
        seg.t.ends.push(seg.t.ops.len());
        seg.ceil |= nz == 2;
        if let Some(c) = cert.as_deref_mut() {
            c.step(scale.to_f64(), nz == 2);
        }
        steps.push((scale, zs, nz));
    }
    Path { steps, segments }
}

/// Bit k set where byte k of `b` is nonzero.
#[inline(always)]
fn nonzero_bytes(b: &[u8; 16]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of x86-64; the load is of 16 bytes that `b` holds.
        unsafe {
            let v = _mm_loadu_si128(b.as_ptr() as *const __m128i);
            !(_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_setzero_si128())) as u32) & 0xffff
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    b.iter()
        .enumerate()
        .fold(0, |m, (k, &x)| m | ((x != 0) as u32) << k)
}

/// f32's unit roundoff, 2^-24.
const EPS32: f64 = 1.0 / (1u64 << 24) as f64;
/// Relative slack that covers every f64 rounding in the scores and in the certificate: 2^-40, at least
/// 2^12 times their bound (each is ≤ (N + g + 10)·2^-52 times the quantities' magnitudes, N the ops).
const SLACK64: f64 = 1.0 / (1u64 << 40) as f64;

/// What the pruning certificate needs of H: H is symmetric positive definite (checked once per search),
/// and its absolute row sums r_j bound the rounding error of every f32 product and sum involving row j.
struct Bounds {
    r: Vec<f64>,
    r_sum: f64,
}

impl Bounds {
    /// None (no pruning) unless H is finite, symmetric to the bit and positive definite: Cholesky of
    /// H − σI in f64 succeeds with σ = 2^-30·tr H, far above that factorization's backward error
    /// (γ_{cn}·tr H with γ_{cn} ≤ c·n·2^-53) and far below the damping (1% of mean(diag H)).
    fn new(h: &[f32], g: usize) -> Option<Self> {
        if g as f64 * EPS32 > 1e-3 || !h.iter().all(|x| x.is_finite()) {
            return None;
        }
        for i in 0..g {
            for j in 0..i {
                if h[i * g + j] != h[j * g + i] {
                    return None;
                }
            }
        }
        let trace: f64 = (0..g).map(|j| h[j * g + j] as f64).sum();
        if trace.is_nan() || trace <= 0.0 {
            return None;
        }
        let sigma = trace / (1u64 << 30) as f64;
        let a = faer::Mat::<f64>::from_fn(g, g, |i, j| {
            h[i * g + j] as f64 - if i == j { sigma } else { 0.0 }
        });
        a.llt(faer::Side::Lower).ok()?;
        let r: Vec<f64> = h
            .chunks_exact(g)
            .map(|row| row.iter().map(|&x| (x as f64).abs()).sum())
            .collect();
        Some(Self {
            r_sum: r.iter().sum(),
            r,
        })
    }
}

/// The pruning certificate of one row (module comment), accumulated along the shrink path: for each step,
/// a number below the score that the chains would compute for either candidate (rounding included). The
/// steps after the last one whose number is not above the first candidate's score cannot win.
struct Certifier<'a> {
    hw: &'a [f64],
    u0: &'a [f32],
    r: &'a [f64],
    maxq: f64,
    g: f64,
    /// max|w|, ĉ = Σ w_j·ĥw_j ≈ wᵀHw and its error bound, the GEMM's error coefficient e
    /// (|ĥw_j − (Hw)_j| ≤ e·r_j·max|w|: γ_g, plus w's cast to f32).
    m_w: f64,
    c_hat: f64,
    eb_c: f64,
    e: f64,
    /// The first candidate's score, exactly as `best_grid` computes it.
    first: f64,
    certs: Vec<f64>,
    // Per segment: GEMM start (u's initial error γ_g), ops so far, Σ|coefficient|·r_j accumulated by a
    // (initial sum and 2|δ|), μ (through u and through t), γ; Σ|v_j|·r_j and Σ m_j·r_j; b and β.
    gemm: f64,
    n_u: f64,
    n_t: f64,
    sa: f64,
    smu_u: f64,
    smu_t: f64,
    sg: f64,
    svr: f64,
    smr: f64,
    bb: f64,
    beta: f64,
}

impl<'a> Certifier<'a> {
    /// None (no pruning) when wᵀHw is not certifiably positive (an all-zero row) or not finite.
    fn new<T: Real>(
        w: &[T],
        hw: &'a [f64],
        u0: &'a [f32],
        b: &'a Bounds,
        maxq: f64,
    ) -> Option<Self> {
        let g = w.len() as f64;
        let m_w = w.iter().fold(0f64, |a, &x| a.max(x.to_f64().abs()));
        let c_hat: f64 = w.iter().zip(hw).map(|(&x, &y)| x.to_f64() * y).sum();
        let e = 1.01 * (g + 2.0) * EPS32;
        let eb_c =
            e * m_w * m_w * b.r_sum + SLACK64 * (g + 10.0) * (c_hat.abs() + m_w * m_w * b.r_sum);
        (c_hat.is_finite() && c_hat - eb_c > 0.0).then_some(Self {
            hw,
            u0,
            r: &b.r,
            maxq,
            g,
            m_w,
            c_hat,
            eb_c,
            e,
            first: f64::NAN,
            certs: Vec::with_capacity(SHRINK_STEPS),
            gemm: 0.0,
            n_u: 0.0,
            n_t: 0.0,
            sa: 0.0,
            smu_u: 0.0,
            smu_t: 0.0,
            sg: 0.0,
            svr: 0.0,
            smr: 0.0,
            bb: 0.0,
            beta: 0.0,
        })
    }

    fn start_segment(&mut self, v0: &[i32], m0: &[i32], n_u: usize, n_t: usize, gemm: bool) {
        let hw = self.hw;
        let dot_hw = |x: &[i32]| x.iter().zip(hw).map(|(&v, &x)| v as f64 * x).sum::<f64>();
        let weighted = |x: &[i32]| {
            x.iter()
                .zip(self.r)
                .map(|(&x, &r)| x.abs() as f64 * r)
                .sum::<f64>()
        };
        let (su0, sm0) = (weighted(v0), weighted(m0));
        (self.sa, self.smu_u, self.smu_t, self.sg) = (su0, sm0, 0.0, sm0);
        (self.svr, self.smr) = (su0, sm0);
        (self.bb, self.beta) = (dot_hw(v0), dot_hw(m0));
        (self.n_u, self.n_t) = (n_u as f64, n_t as f64);
        self.gemm = if gemm { self.g } else { 0.0 };
        if gemm {
            let dot = v0
                .iter()
                .zip(self.u0)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>();
            // The score of step 0's floor candidate: the same arithmetic as `best_grid` (set by `step`).
            self.first = dot;
        }
    }

    /// An event; `v_old` is v_j before it (for a change of v).
    #[inline(always)]
    fn event(&mut self, ev: Event, v_old: i32) {
        let (j, df) = (ev.j as usize, ev.d as f64);
        let rj = self.r[j];
        if !ev.mask {
            self.sa += 2.0 * df.abs() * rj;
            self.smu_t += df.abs() * rj;
            self.svr += ((v_old + ev.d).abs() - v_old.abs()) as f64 * rj;
            self.bb += df * self.hw[j];
            self.n_u += 1.0;
        } else {
            self.smu_u += df.abs() * rj;
            self.sg += 2.0 * df.abs() * rj;
            self.smr += df * rj;
            self.beta += df * self.hw[j];
            self.n_t += 1.0;
        }
    }

    /// The certificate of the step just walked (scale s, with a ceil candidate or not).
    fn step(&mut self, s: f64, ceil: bool) {
        if self.certs.is_empty() {
            // Step 0 (segment 0, from the GEMM): `first` holds v0·ũ0; finish its score as `best_grid`.
            self.first = s * s * self.first - 2.0 * s * self.bb;
        }
        let (maxq, g, c_hat, eb_c, e, m_w) =
            (self.maxq, self.g, self.c_hat, self.eb_c, self.e, self.m_w);
        // |ũ_j − (Hv)_j| ≤ κ_u·r_j after n_u axpys: each adds ≤ ε|δ·H_ij| + ε|ũ_j| with |ũ_j| ≤ maxq·r_j,
        // Σ|δ·H_ij| ≤ TV·r_j with TV ≤ 2·maxq (v_j moves monotonically within a segment, as |w_j|/s
        // grows); likewise t with |m| ≤ 1, TV ≤ 2; (1 + 2nε) bounds (1 − ε)^-n.
        let k_u =
            (1.0 + 2.0 * self.n_u * EPS32) * 1.01 * EPS32 * maxq * (self.gemm + self.n_u + 2.0);
        let k_t = (1.0 + 2.0 * self.n_t * EPS32) * 1.01 * EPS32 * (self.n_t + 2.0);
        let (eb_a, eb_mu, eb_g) = (
            k_u * self.sa,
            k_u * self.smu_u + k_t * self.smu_t,
            k_t * self.sg,
        );
        let (eb_b, eb_beta) = (e * m_w * self.svr, e * m_w * self.smr);
        let f64s = SLACK64
            * (self.n_u + self.n_t + g + 10.0)
            * (s * s * 3.0 * maxq * (self.sa + 2.0 * (self.smu_u + self.smu_t) + self.sg)
                + 2.0 * s * 1.01 * m_w * (self.sa + self.sg)
                + c_hat);
        // A lower bound of the exact score ‖s·x − w‖²_H − c from Cauchy–Schwarz, ⟨Δ, w⟩²_H / c ≤ ‖Δ‖²_H,
        // with ⟨Δ, w⟩_H = s·xᵀHw − c computed as d (error ≤ eb_d).
        let lower = |d: f64, eb_d: f64| {
            let x = (d.abs() - eb_d - SLACK64 * d.abs()).max(0.0);
            x * x / (c_hat + eb_c) * (1.0 - SLACK64) - (c_hat + eb_c)
        };
        let floor = lower(s * self.bb - c_hat, s * eb_b + eb_c + f64s)
            - (s * s * eb_a + 2.0 * s * eb_b + f64s);
        let cert = if ceil {
            let ceil =
                lower(
                    s * (self.bb - self.beta) - c_hat,
                    s * (eb_b + eb_beta) + eb_c + f64s,
                ) - (s * s * (eb_a + 2.0 * eb_mu + eb_g) + 2.0 * s * (eb_b + eb_beta) + f64s);
            floor.min(ceil)
        } else {
            floor
        };
        self.certs.push(cert);
    }

    /// The last step that can win.
    fn last_needed_step(&self) -> usize {
        let bar = self.first + SLACK64 * self.first.abs();
        let mut k = self.certs.len() - 1;
        if !bar.is_finite() {
            return k;
        }
        while k > 0 && self.certs[k] > bar {
            k -= 1;
        }
        k
    }
}

/// What the scores need of one running vector over one segment: all of it after the initial sum, and its
/// entry j_e just before each event e.
struct ChainValues {
    init: Vec<f32>,
    at: Vec<f32>,
}

impl ChainValues {
    fn new(g: usize, events: usize) -> Self {
        Self {
            init: vec![0.0; g],
            at: vec![0.0; events],
        }
    }
}

/// One running vector restricted to tile `t` (columns c0..c0 + TILE), held in registers: starts from
/// `start` (the GEMM's product) or zero, applies the chain's axpys in order and serves the tile's reads
/// (each read's k picked by `k_of`), up to the tile's last read. Each entry sees the same f32 operations
/// in the same order as the row-at-a-time chain (y += δ·H[j, c]: mul then add, no FMA), so its values are
/// the same bits.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile_pass(
    (tile, stride): (&[f32], usize),
    t: usize,
    chain: &Chain,
    reads: &[Read],
    k_of: impl Fn(&Read) -> u32,
    start: Option<&[f32]>,
    out: &mut ChainValues,
) {
    let (c0, c1) = (t * TILE, ((t + 1) * TILE).min(out.init.len()));
    let mut acc = [0f32; TILE];
    if let Some(s) = start {
        acc[..c1 - c0].copy_from_slice(&s[c0..c1]);
    }
    let ops = &chain.ops[..];
    // Every op's row j < g was pushed by `shrink_path` from an entry of a row of g values, and the tile holds
    // g rows of TILE floats `stride` apart (checked here once), so the loop below (about ten instructions per
    // op, the search's hottest) carries no bounds check.
    let g = out.init.len();
    assert!(
        g > 0 && stride >= TILE && tile.len() >= (g - 1) * stride + TILE,
        "tile of {} floats for {g} rows {stride} apart",
        tile.len()
    );
    let row_at = |j: u32| -> &[f32; TILE] {
        debug_assert!((j as usize) < g, "chain op at row {j} of {g}");
        // SAFETY: j < g (every op comes from an entry of the row, `shrink_path`), so
        // j·stride + TILE ≤ tile.len() (asserted above).
        unsafe { &*(tile.as_ptr().add(j as usize * stride) as *const [f32; TILE]) }
    };
    let run = |acc: &mut [f32; TILE], k0: usize, k1: usize| {
        for k in k0..k1 {
            if let Some(&(jp, _)) = ops.get(k + PREFETCH) {
                prefetch_row(row_at(jp));
            }
            let (j, d) = ops[k];
            for (a, &h) in acc.iter_mut().zip(row_at(j)) {
                *a += d * h;
            }
        }
    };
    run(&mut acc, 0, chain.n_init);
    out.init[c0..c1].copy_from_slice(&acc[..c1 - c0]);
    let mut k = chain.n_init;
    for r in reads {
        let k1 = k_of(r) as usize;
        run(&mut acc, k, k1);
        k = k1;
        out.at[r.slot as usize] = acc[r.lane as usize];
    }
}

/// Prefetches a tile row (TILE f32, four cache lines) into L1.
#[inline(always)]
fn prefetch_row(row: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks(16) {
        // SAFETY: a prefetch has no architectural effect; the address is inside `row`.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr() as *const i8
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// The values of one row: per segment, u's and (when it has ceil candidates) t's.
type RowValues = Vec<(ChainValues, Option<ChainValues>)>;

/// Phase 2: every tile of H once per chunk of rows, every row's chains over it (tile-outer, so the tile
/// stays in L2 across the rows).
#[inline(always)]
fn chain_passes<T: Real>(
    th: &TiledH,
    paths: &[Path<T>],
    values: &mut [RowValues],
    gemm_u: &[Option<&[f32]>],
) {
    for t in 0..th.tiles() {
        let tile = th.tile(t);
        for ((path, vals), &pre_u) in paths.iter().zip(values.iter_mut()).zip(gemm_u) {
            for (s, (seg, (uv, tv))) in path.segments.iter().zip(vals.iter_mut()).enumerate() {
                let start = if s == 0 { pre_u } else { None };
                let reads = &seg.reads[t];
                tile_pass(tile, t, &seg.u, reads, |r| r.ku, start, uv);
                if let Some(tv) = tv {
                    tile_pass(tile, t, &seg.t, reads, |r| r.kt, None, tv);
                }
            }
        }
    }
}

/// Phase 3: the scores of every candidate from the chains' values, with the f64 scalars a, b (floor) and
/// μ, γ, β (ceil) updated event by event in the order, and with the arithmetic, of the row-at-a-time chain;
/// the first of equal scores wins.
fn best_grid<T: Real>(path: &Path<T>, values: &RowValues, hw: &[f64], diag: &[f64]) -> Grid<T> {
    let dot = |x: &[i32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(&a, &b)| a as f64 * b as f64)
            .sum::<f64>()
    };
    let dot_hw = |x: &[i32]| x.iter().zip(hw).map(|(&v, &x)| v as f64 * x).sum::<f64>();
    let mut best = (f64::INFINITY, Grid::default());
    for (seg, (uv, tv)) in path.segments.iter().zip(values) {
        let mut a = dot(&seg.v0, &uv.init);
        let mut b = dot_hw(&seg.v0);
        let (mut gamma, mut mu, mut beta) = match tv {
            Some(tv) => (
                dot(&seg.m0, &tv.init),
                dot(&seg.m0, &uv.init),
                dot_hw(&seg.m0),
            ),
            None => (0.0, 0.0, 0.0),
        };
        let mut e0 = 0;
        for (k, &e1) in seg.ends.iter().enumerate() {
            for e in e0..e1 {
                let Event { j, d, mask } = seg.events[e];
                let (j, df) = (j as usize, d as f64);
                let hjj = diag[j];
                if !mask {
                    a += df * (2.0 * uv.at[e] as f64 + df * hjj);
                    b += df * hw[j];
                    if let Some(tv) = tv {
                        mu += df * tv.at[e] as f64;
                    }
                } else if let Some(tv) = tv {
                    mu += df * uv.at[e] as f64;
                    gamma += df * (2.0 * tv.at[e] as f64 + df * hjj);
                    beta += df * hw[j];
                }
            }
            e0 = e1;
            let (scale, zs, nz) = path.steps[seg.first + k];
            let s = scale.to_f64();
            let score = s * s * a - 2.0 * s * b;
            if score < best.0 {
                best = (score, Grid { scale, zero: zs[0] });
            }
            if nz == 2 {
                debug_assert!(zs[1] == zs[0] + T::ONE);
                let score = s * s * (a - 2.0 * mu + gamma) - 2.0 * s * (b - beta);
                if score < best.0 {
                    best = (score, Grid { scale, zero: zs[1] });
                }
            }
        }
    }
    best.1
}

/// Precomputed products for one row (from a GEMM over many rows): Hw and H v of the floor chain at p = 1.
struct Pre<'a> {
    hw: &'a [f32],
    u: &'a [f32],
}

/// The Hessian search of `rows` rows (each [g], one H [g × g] and its tiles `th`): the phases of the module
/// comment. `pre` (one per row) supplies Hw and the first u from a GEMM; with it and `bounds`, the steps
/// after the last one that can win are not scored.
fn hessian_search_rows<T: Real>(
    rows: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    pre: Option<(&[Pre], Option<&Bounds>)>,
) -> Vec<Grid<T>> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected.
            return unsafe { hessian_search_rows_avx512(rows, h, th, spec, pre) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            return unsafe { hessian_search_rows_avx2(rows, h, th, spec, pre) };
        }
    }
    hessian_search_rows_impl(rows, h, th, spec, pre)
}

/// The same code compiled for AVX-512 and AVX2 (the build targets baseline x86-64, where even rounding is a
/// libm call). No FMA, so the results are the same bits on every path: the axpys are mul + add either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn hessian_search_rows_avx512<T: Real>(
    rows: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    pre: Option<(&[Pre], Option<&Bounds>)>,
) -> Vec<Grid<T>> {
    hessian_search_rows_impl(rows, h, th, spec, pre)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hessian_search_rows_avx2<T: Real>(
    rows: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    pre: Option<(&[Pre], Option<&Bounds>)>,
) -> Vec<Grid<T>> {
    hessian_search_rows_impl(rows, h, th, spec, pre)
}

// Plain loops below, not iterator adaptors: a closure the inliner leaves out of line is compiled for
// baseline x86-64 (round_ties_even becomes a libm call per entry).
#[inline(always)]
fn hessian_search_rows_impl<T: Real>(
    rows: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    pre: Option<(&[Pre], Option<&Bounds>)>,
) -> Vec<Grid<T>> {
    let g = th.g;
    let maxq = spec.maxq() as f64;
    let mut hws: Vec<Vec<f64>> = Vec::with_capacity(rows.len());
    let mut paths: Vec<Path<T>> = Vec::with_capacity(rows.len());
    for (r, w) in rows.iter().enumerate() {
        let hw: Vec<f64> = match pre {
            Some((p, _)) => p[r].hw.iter().map(|&x| x as f64).collect(),
            None => h_times_w(w, h),
        };
        let mut cert = match pre {
            Some((p, Some(b))) => Certifier::new(w, &hw, p[r].u, b, maxq),
            _ => None,
        };
        let mut path = shrink_path(w, spec, th.tiles(), pre.is_some(), cert.as_mut());
        if let Some(c) = &cert {
            path.truncate(c.last_needed_step());
        }
        hws.push(hw);
        paths.push(path);
    }
    let mut values: Vec<RowValues> = Vec::with_capacity(rows.len());
    for p in &paths {
        let mut vals: RowValues = Vec::with_capacity(p.segments.len());
        for seg in &p.segments {
            let n = seg.events.len();
            vals.push((
                ChainValues::new(g, n),
                seg.ceil.then(|| ChainValues::new(g, n)),
            ));
        }
        values.push(vals);
    }
    let mut gemm_u: Vec<Option<&[f32]>> = Vec::with_capacity(rows.len());
    for r in 0..rows.len() {
        gemm_u.push(pre.map(|(p, _)| p[r].u));
    }
    chain_passes(th, &paths, &mut values, &gemm_u);
    let mut grids: Vec<Grid<T>> = Vec::with_capacity(rows.len());
    for r in 0..rows.len() {
        grids.push(best_grid(&paths[r], &values[r], &hws[r], &th.diag));
    }
    grids
}

/// Hw in f64 (b = vᵀ(Hw)), as a sum of rows of H (H symmetric): elementwise, so it vectorizes.
#[inline(always)]
fn h_times_w<T: Real>(w: &[T], h: &[f32]) -> Vec<f64> {
    let g = w.len();
    let mut hw = vec![0f64; g];
    for (j, &x) in w.iter().enumerate() {
        let x = x.to_f64();
        for (o, &hh) in hw.iter_mut().zip(&h[j * g..(j + 1) * g]) {
            *o += x * hh as f64;
        }
    }
    hw
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
    if spec.signed {
        // Each orientation's batched search, then per row the lower of the two exact scores.
        let free = unsigned(spec);
        let pos = search_grids_rows(w, rows, ld, c0, len, h, &free);
        let neg: Vec<T> = (0..rows).flat_map(|r| row(r).iter().map(|&x| -x)).collect();
        let negs = search_grids_rows(&neg, rows, len, 0, len, h, &free);
        return (0..rows)
            .into_par_iter()
            .map(|r| pick(row(r), h, &free, &[pos[r], mirrored(negs[r])]))
            .collect();
    }
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
    // Once per H, shared by every row: its tiles, and the checks behind the pruning certificate (O(g³),
    // worth it only for many rows).
    let th = TiledH::new(h, len, true);
    let bounds = if rows >= PRUNE_MIN_ROWS {
        Bounds::new(h, len)
    } else {
        None
    };
    const ROWS_PER_TASK: usize = 16;
    let chunks: Vec<Vec<Grid<T>>> = (0..rows.div_ceil(ROWS_PER_TASK))
        .into_par_iter()
        .map(|ci| {
            let r0 = ci * ROWS_PER_TASK;
            let ws: Vec<&[T]> = (r0..rows.min(r0 + ROWS_PER_TASK)).map(row).collect();
            hessian_search_batch(&ws, h, &th, spec, bounds.as_ref())
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

/// The batched search of a chunk of rows: the p = 1 products H·[w, v_floor] of all of them in one GEMM,
/// then `hessian_search_rows` with them (and the pruning certificate when `bounds`).
#[inline(always)]
fn hessian_search_batch_impl<T: Real>(
    ws: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    bounds: Option<&Bounds>,
) -> Vec<Grid<T>> {
    let (rc, len) = (ws.len(), th.g);
    let maxq = T::from_f64(spec.maxq() as f64);
    let mut v = vec![0f32; 2 * rc * len];
    for (i, wr) in ws.iter().enumerate() {
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
    let mut pre: Vec<Pre> = Vec::with_capacity(rc);
    for i in 0..rc {
        let b = 2 * i * len;
        pre.push(Pre {
            hw: &prod[b..b + len],
            u: &prod[b + len..b + 2 * len],
        });
    }
    hessian_search_rows_impl(ws, h, th, spec, Some((&pre, bounds)))
}

/// `hessian_search_batch_impl` compiled for the best instruction set present (as `hessian_search_rows`).
fn hessian_search_batch<T: Real>(
    ws: &[&[T]],
    h: &[f32],
    th: &TiledH,
    spec: &QuantSpec,
    bounds: Option<&Bounds>,
) -> Vec<Grid<T>> {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        unsafe fn avx512<T: Real>(
            ws: &[&[T]],
            h: &[f32],
            th: &TiledH,
            spec: &QuantSpec,
            bounds: Option<&Bounds>,
        ) -> Vec<Grid<T>> {
            hessian_search_batch_impl(ws, h, th, spec, bounds)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<T: Real>(
            ws: &[&[T]],
            h: &[f32],
            th: &TiledH,
            spec: &QuantSpec,
            bounds: Option<&Bounds>,
        ) -> Vec<Grid<T>> {
            hessian_search_batch_impl(ws, h, th, spec, bounds)
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was just detected.
            return unsafe { avx512(ws, h, th, spec, bounds) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was just detected.
            return unsafe { avx2(ws, h, th, spec, bounds) };
        }
    }
    hessian_search_batch_impl(ws, h, th, spec, bounds)
}

/// Rows from which `search_grids_rows` checks H for the pruning certificate: the check is one f64 Cholesky
/// of H (O(g³)), about the cost of searching g/8 rows without pruning.
const PRUNE_MIN_ROWS: usize = 32;

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

    /// H = X Xᵀ [g × g] (f32) of uniform X [g × 3g] from `rng`: a positive definite Hessian-like block.
    fn random_gram(rng: &mut ChaCha8Rng, g: usize) -> Vec<f32> {
        let x: Vec<f64> = (0..g * 3 * g).map(|_| rng.random::<f64>() - 0.5).collect();
        let mut h = vec![0f32; g * g];
        for i in 0..g {
            for j in 0..g {
                h[i * g + j] = (0..3 * g)
                    .map(|t| x[i * 3 * g + t] * x[j * 3 * g + t])
                    .sum::<f64>() as f32;
            }
        }
        h
    }

    /// The Mse search with every candidate's sum taken in full (`search_candidates`' order): the first grid
    /// of the smallest Σ|Δ|^2.4.
    fn mse_full<T: Real>(w: &[T], spec: &QuantSpec) -> Grid<T> {
        let maxq = T::from_f64(spec.maxq() as f64);
        let mut best = (f64::INFINITY, Grid::default());
        for gr in search_candidates(w, spec).into_iter().flatten() {
            let err: f64 = w
                .iter()
                .map(|&x| {
                    let d = dequantize(quantize(x, gr.scale, gr.zero, maxq), gr.scale, gr.zero) - x;
                    d.to_f64().abs().powf(MSE_NORM)
                })
                .sum();
            if err < best.0 {
                best = (err, gr);
            }
        }
        best.1
    }

    #[test]
    fn mse_search_stopping_early_keeps_the_full_sums_grid() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for case in 0..240 {
            let g = [1, 7, 64, 300][case % 4];
            let (bits, sym) = ([2, 3, 4, 8][case / 4 % 4], case / 16 % 2 == 1);
            // Heavy tails, exact zeros and repeated values: the shapes where candidates tie or prune late.
            let w: Vec<f64> = (0..g)
                .map(|j| match case % 5 {
                    0 => (rng.random::<f64>() - 0.5).powi(3),
                    1 if j % 3 == 0 => 0.0,
                    2 => ((rng.random::<f64>() * 4.0).floor() - 2.0) * 0.25,
                    _ => rng.random::<f64>() - 0.3,
                })
                .collect();
            let spec = QuantSpec::new(bits, None, sym, ScaleSearch::Mse);
            let (a, b) = (mse_search(&w, &spec), mse_full(&w, &spec));
            assert!(
                a.scale.to_bits() == b.scale.to_bits() && a.zero.to_bits() == b.zero.to_bits(),
                "case {case}: {a:?} against the full sums' {b:?}"
            );
            let w32: Vec<f32> = w.iter().map(|&x| x as f32).collect();
            let (a, b) = (mse_search(&w32, &spec), mse_full(&w32, &spec));
            assert!(a.scale.to_bits() == b.scale.to_bits() && a.zero.to_bits() == b.zero.to_bits());
        }
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
            let h = random_gram(&mut rng, g);
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

    /// Signed scales (`QuantSpec::signed`): the search scores both orientations of the symmetric grid and
    /// keeps the lower exact score, so it is never above the positive-only search; a row whose largest
    /// magnitude is a positive outlier takes the mirrored grid (its extra level on the positive side), and
    /// the batched search (pruning on) picks the same grids as the one-row search.
    #[test]
    fn signed_scales_mirror_where_the_row_needs_it() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let (g, rows) = (32usize, 40usize);
        let h = random_gram(&mut rng, g);
        let w: Vec<f64> = (0..rows * g)
            .map(|k| {
                let v = (rng.random::<f64>() - 0.5) * 0.1;
                // Every other row's largest magnitude is positive, the others' negative.
                if k % g == 5 {
                    if (k / g) % 2 == 0 { 0.4 } else { -0.4 }
                } else {
                    v
                }
            })
            .collect();
        for search in [ScaleSearch::Hessian, ScaleSearch::Mse] {
            let spec = QuantSpec::new(4, Some(g), true, search);
            let signed = spec.signed_if(true);
            assert!(
                signed.signed
                    && !QuantSpec::new(4, None, false, search)
                        .signed_if(true)
                        .signed
            );
            let batched = search_grids_rows(&w, rows, g, 0, g, Some(&h), &signed);
            let mut mirrored_rows = 0;
            let mut d = vec![0f64; g];
            for r in 0..rows {
                let row = &w[r * g..(r + 1) * g];
                let pos = search_grid(row, Some(&h), &spec);
                let got = search_grid(row, Some(&h), &signed);
                assert_eq!(
                    got, batched[r],
                    "{search:?} row {r}: batched and one-row searches differ"
                );
                let (sp, sg) = (
                    score(row, Some(&h), &spec, pos, &mut d),
                    score(row, Some(&h), &spec, got, &mut d),
                );
                assert!(
                    sg <= sp,
                    "{search:?} row {r}: signed {sg} above positive-only {sp}"
                );
                if r % 2 == 0 && got.scale < 0.0 {
                    assert!(sg < sp, "{search:?} row {r}: {got:?} {sg} vs {sp}");
                    mirrored_rows += 1;
                }
            }
            // −8..7 cannot reach +0.4 at the scale the rest of the row needs; 8 levels up can. The weighted
            // error of the rest can still favour the other grid under H (not under Σ|Δ|^2.4).
            let need = if search == ScaleSearch::Mse {
                rows / 2
            } else {
                rows / 4
            };
            assert!(
                mirrored_rows >= need,
                "{search:?}: {mirrored_rows} rows mirrored"
            );
        }
    }

    /// The pruning certificate cuts the shrink path of typical rows short, and the pruned batch picks the
    /// same grid bits as the unpruned one (`bounds` None): the certified-loser steps never win. H is XᵀX of
    /// fewer tokens than columns plus 1% damping, as a calibration Hessian; the rows are Gaussian with 0.5%
    /// outliers, as LLM weight rows.
    #[test]
    fn pruning_certificate_cuts_the_path_and_keeps_the_grids() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let (g, rows) = (192usize, 48usize);
        let n = g / 2;
        let x: Vec<f32> = (0..g * n).map(|_| rng.random::<f32>() - 0.5).collect();
        let mut h = vec![0f32; g * g];
        for i in 0..g {
            for j in 0..=i {
                let d: f64 = (0..n)
                    .map(|t| x[i * n + t] as f64 * x[j * n + t] as f64)
                    .sum();
                h[i * g + j] = d as f32;
                h[j * g + i] = d as f32;
            }
        }
        let mean_diag = (0..g).map(|i| h[i * g + i] as f64).sum::<f64>() / g as f64;
        for i in 0..g {
            h[i * g + i] += (0.01 * mean_diag) as f32;
        }
        let w: Vec<f32> = (0..rows * g)
            .map(|k| {
                let x = (rng.random::<f32>() - 0.5) * 0.04;
                if k % 200 == 7 { x * 15.0 } else { x }
            })
            .collect();
        let th = TiledH::new(&h, g, true);
        let bounds = Bounds::new(&h, g).expect("a damped XᵀX is positive definite");
        for (bits, sym) in [(3u32, false), (4, false), (3, true)] {
            let spec = QuantSpec::new(bits, None, sym, ScaleSearch::Hessian);
            let ws: Vec<&[f32]> = w.chunks_exact(g).collect();
            let mut pruned = Vec::new();
            let mut full = Vec::new();
            let mut steps = 0;
            for chunk in ws.chunks(16) {
                pruned.extend(hessian_search_batch(chunk, &h, &th, &spec, Some(&bounds)));
                full.extend(hessian_search_batch(chunk, &h, &th, &spec, None));
                // The steps each row's path keeps (the certificate's cut), from the same GEMM start.
                let mut v = vec![0f32; 2 * chunk.len() * g];
                let maxq = spec.maxq() as f32;
                for (i, wr) in chunk.iter().enumerate() {
                    let (lo, hi) = range(wr, sym);
                    let (scale, zs, _) = candidates(lo, hi, 1.0, maxq, sym);
                    let z = zs[0] as i32;
                    for (j, &x) in wr.iter().enumerate() {
                        v[2 * i * g + j] = x;
                        v[(2 * i + 1) * g + j] = (x * (1.0 / scale))
                            .round_to_i32()
                            .clamp(-z, spec.maxq() as i32 - z)
                            as f32;
                    }
                }
                let mut prod = vec![0f32; 2 * chunk.len() * g];
                gemm_nn(&mut prod, &v, &h, 2 * chunk.len(), g, g);
                for (i, wr) in chunk.iter().enumerate() {
                    let hw: Vec<f64> = prod[2 * i * g..(2 * i + 1) * g]
                        .iter()
                        .map(|&x| x as f64)
                        .collect();
                    let u0 = &prod[(2 * i + 1) * g..(2 * i + 2) * g];
                    let mut cert = Certifier::new(wr, &hw, u0, &bounds, spec.maxq() as f64)
                        .expect("a nonzero row has a certifiably positive wᵀHw");
                    shrink_path(wr, &spec, th.tiles(), true, Some(&mut cert));
                    steps += cert.last_needed_step() + 1;
                }
            }
            for r in 0..rows {
                assert_eq!(
                    (pruned[r].scale.to_bits(), pruned[r].zero.to_bits()),
                    (full[r].scale.to_bits(), full[r].zero.to_bits()),
                    "bits={bits} sym={sym} row {r}: pruned {:?} vs full {:?}",
                    pruned[r],
                    full[r]
                );
            }
            // Without a cut every row keeps all SHRINK_STEPS steps; here the certificate keeps 74% (3-bit),
            // 47% (4-bit) and 85% (3-bit symmetric) of them.
            assert!(
                steps < rows * SHRINK_STEPS * 95 / 100,
                "bits={bits} sym={sym}: the certificate kept {steps} of {} steps",
                rows * SHRINK_STEPS
            );
            eprintln!(
                "bits={bits} sym={sym}: {steps} of {} steps kept",
                rows * SHRINK_STEPS
            );
        }
    }
}
