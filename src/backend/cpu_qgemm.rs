//! The CPU packed GEMM for few tokens on contiguous groups (no act-order): AVX-512 unpack + FMA straight from
//! the GPTQ layout, `cpu::packed_linear_f32`'s fast path. Anything it does not take (no AVX-512F, act-order
//! g_idx, groups or d_in not multiples of 32, many tokens) returns None and runs the portable tile path.
//!
//! Math: per group g and output j the zero point is folded out of the inner loop,
//!     Σ_{i∈g} x_i · s·(q_i − z) = s·(Σ_{i∈g} x_i·q_i − z·Σ_{i∈g} x_i),
//! with Σ_{i∈g} x_i computed once per call; the inner loop is shift, code → float, FMA. The rounding differs
//! from dequantize-then-multiply by a few ulp of Σ|x·q| (tests/packed_roundtrip.rs bounds it at 1e-5 of the
//! output scale).
//!
//! Layout: qweight [d_in·b/32 × d_out] packs along d_in, so one u32 of column j holds 32/b consecutive codes of
//! output j, and 16 adjacent columns' words are one contiguous 64 B load. The kernel vectorizes across output
//! columns (16 per zmm) and walks d_in in "super-rows" of 32 codes (b words: 3-bit codes straddle words only
//! inside a super-row). Per code: one shift of the word vector (successive shifts by b, so the immediate is
//! loop-invariant), one `vpermps` through a 16-entry LUT that maps the low 4 bits to the float code (it ignores
//! the higher index bits, so no mask is needed; 8-bit codes use and + cvtdq2ps), then an FMA per token with
//! x_i broadcast. On Sapphire Rapids the shift runs on port 0, vpermps on port 5, the FMAs on both.
//!
//! Work partition (deterministic: each output element is reduced over d_in in one fixed order by one task):
//! ```text
//!   rayon task = strip of QGEMM_NB output columns, whole d_in.  For each group gi:
//!     for each chunk of 64 columns:  prefetch group gi+1's words of this chunk;
//!       for each run of MT tokens:   acc[MT × 64] = Σ_{i∈gi} x[t, i]·q[i, j]      (registers)
//!                                    Y[t, j] += s[gi, j]·(acc − z[gi, j]·Σx[t, gi])
//! ```
//! Variants measured (bench-qgemm, 2 shared cores of a Sapphire Rapids VM, load average 6–10, weights from
//! DRAM; packed GB/s counts qweight + f32 scales and zeros), 4-bit m = 1, 4096×4096 and 11008×4096:
//!   variant 1, the C tile path (`boa_qdot_group_tile` / `boa_dequant_tile`, BOA_QGEMM_GENERIC=1): 3.97 ms
//!     (2.4 GB/s) and 19.5 ms (1.3 GB/s);
//!   variant 2, `avx2` (BOA_QGEMM_ISA=avx2): 3.57 ms and 11.8 ms, at load 10;
//!   variant 3, `avx512`: 1.40–1.82 ms (5–7 GB/s) and 6.9–12.2 ms over three runs; on one thread 1.23 ms
//!     (7.7 GB/s), ~14 G weights/s on one core, close to its shift (port 0) + FMA issue limit, so at m = 1 it
//!     is bound by the unpack issue rate about as much as by DRAM. The 11008×4096 times vary most: a call
//!     waits for its slowest thread, and on this loaded machine a thread loses the CPU for milliseconds.
//! At m = 16 it does 16 FMAs per unpacked code and ran 1.5× faster than variant 1 (dequantized tile + faer).

use crate::quant::pack::PackedLinear;
use rayon::prelude::*;

/// Output columns per rayon task: a task reads QGEMM_NB contiguous words (1 KiB) of each qweight row, then jumps
/// d_out words.
const QGEMM_NB: usize = 256;
/// Columns per register block (4 zmm).
const CHUNK: usize = 64;
/// Up to this many tokens the fused kernel runs; each run of ≤ 8 tokens unpacks the group's words again (from
/// L1), which is cheap next to the 8 FMAs per code.
pub const FAST_MAX_M: usize = 16;

/// Which SIMD kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QgemmIsa {
    /// 16 columns per zmm, codes → floats through a `vpermps` LUT.
    Avx512,
    /// 8 columns per ymm, codes → floats by and + cvtdq2ps (AVX2 + FMA: the build's x86-64-v3 baseline).
    Avx2,
}

/// The fast path of `cpu::packed_linear_f32`, or None when it does not apply (the caller falls back): AVX-512
/// where the CPU has AVX-512F, else AVX2. BOA_QGEMM_GENERIC=1 in the environment turns it off, so the portable
/// tile path (variant 1, style.md rule 4) can be timed on the same machine; BOA_QGEMM_ISA=avx2 forces AVX2.
pub fn packed_linear_fast(x: &[f32], p: &PackedLinear, m: usize) -> Option<Vec<f32>> {
    if std::env::var_os("BOA_QGEMM_GENERIC").is_some() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::env::var("BOA_QGEMM_ISA").as_deref() != Ok("avx2")
        {
            return packed_linear_fast_isa(x, p, m, QgemmIsa::Avx512);
        }
    }
    packed_linear_fast_isa(x, p, m, QgemmIsa::Avx2)
}

/// `packed_linear_fast` with the kernel chosen by the caller (tests run both); None also when `isa` is not
/// available on this CPU or build.
pub fn packed_linear_fast_isa(
    x: &[f32],
    p: &PackedLinear,
    m: usize,
    isa: QgemmIsa,
) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    {
        let have = match isa {
            QgemmIsa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            QgemmIsa::Avx2 => cfg!(all(target_feature = "avx2", target_feature = "fma")),
        };
        if m == 0 || m > FAST_MAX_M || !have {
            return None;
        }
        let (k, n) = (p.d_in, p.d_out);
        let g = p.contiguous_group()?;
        if k == 0 || n == 0 || !k.is_multiple_of(32) || (g < k && !g.is_multiple_of(32)) {
            return None;
        }
        assert_eq!(x.len(), m * k, "packed_linear: x is not [m={m} × k={k}]");
        assert!(p.validate().is_ok(), "packed_linear: invalid packed linear");
        let ng = p.n_groups;
        let g = g.min(k);
        // Σx per token and group, in a fixed order.
        let xs: Vec<f32> = (0..m * ng)
            .map(|tg| {
                let (t, gi) = (tg / ng, tg % ng);
                x[t * k + gi * g..t * k + ((gi + 1) * g).min(k)]
                    .iter()
                    .sum()
            })
            .collect();
        let ctx = Ctx {
            p,
            x,
            xs: &xs,
            m,
            gsr: g / 32,
        };
        let blocks: Vec<(usize, Vec<f32>)> = (0..n.div_ceil(QGEMM_NB))
            .into_par_iter()
            .map(|sb| {
                let j0 = sb * QGEMM_NB;
                let nj = QGEMM_NB.min(n - j0);
                let mut yb = vec![0f32; m * nj];
                // SAFETY: the ISA was checked above; `Ctx` satisfies the size invariants (`validate`, x is
                // [m × k], xs [m × ng], k a multiple of 32, groups a multiple of 32 super-row aligned) and yb is
                // [m × nj] with j0 + nj ≤ n.
                unsafe {
                    match (isa, p.bits) {
                        (QgemmIsa::Avx512, 2) => avx512::strip::<2>(&ctx, j0, nj, &mut yb),
                        (QgemmIsa::Avx512, 3) => avx512::strip::<3>(&ctx, j0, nj, &mut yb),
                        (QgemmIsa::Avx512, 4) => avx512::strip::<4>(&ctx, j0, nj, &mut yb),
                        (QgemmIsa::Avx512, 8) => avx512::strip::<8>(&ctx, j0, nj, &mut yb),
                        #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
                        (QgemmIsa::Avx2, 2) => avx2::strip::<2>(&ctx, j0, nj, &mut yb),
                        #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
                        (QgemmIsa::Avx2, 3) => avx2::strip::<3>(&ctx, j0, nj, &mut yb),
                        #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
                        (QgemmIsa::Avx2, 4) => avx2::strip::<4>(&ctx, j0, nj, &mut yb),
                        #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
                        (QgemmIsa::Avx2, 8) => avx2::strip::<8>(&ctx, j0, nj, &mut yb),
                        (i, b) => unreachable!("{i:?} {b}-bit was checked above"),
                    }
                }
                (j0, yb)
            })
            .collect();
        let mut y = vec![0f32; m * n];
        for (j0, yb) in blocks {
            let nj = yb.len() / m;
            for (yr, br) in y.chunks_mut(n).zip(yb.chunks(nj)) {
                yr[j0..j0 + nj].copy_from_slice(br);
            }
        }
        Some(y)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, p, m, isa);
        None
    }
}

/// What every strip reads.
struct Ctx<'a> {
    p: &'a PackedLinear,
    /// [m × d_in] row-major.
    x: &'a [f32],
    /// [m × n_groups]: Σ x over each group.
    xs: &'a [f32],
    m: usize,
    /// Super-rows (32 codes) per group.
    gsr: usize,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{CHUNK, Ctx};
    use std::arch::x86_64::*;

    /// Y block [m × nj] (row-major, columns j0 .. j0+nj) of the strip.
    ///
    /// # Safety
    /// AVX-512F must be available; ctx as built by `packed_linear_fast`; yb.len() = m·nj, j0 + nj ≤ d_out.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn strip<const BITS: u32>(ctx: &Ctx, j0: usize, nj: usize, yb: &mut [f32]) {
        let p = ctx.p;
        let (n, k) = (p.d_out, p.d_in);
        let nsr = k / 32;
        let b = BITS as usize;
        for gi in 0..p.n_groups {
            let sr0 = gi * ctx.gsr;
            let sr1 = (sr0 + ctx.gsr).min(nsr);
            let sr2 = (sr1 + ctx.gsr).min(nsr);
            for c0 in (0..nj).step_by(CHUNK) {
                let cols = CHUNK.min(nj - c0);
                // The next group's words of this chunk: rows are d_out words apart, so each 256 B run starts a
                // new page and the hardware streamers would restart on every row.
                for r in sr1 * b..sr2 * b {
                    let row = p.qweight.as_ptr().wrapping_add(r * n + j0 + c0);
                    for l in (0..cols).step_by(16) {
                        // SAFETY: r < k·b/32 and j0 + c0 + l < n, so the address is inside qweight.
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(row.add(l) as *const i8) };
                    }
                }
                let mut t0 = 0;
                while t0 < ctx.m {
                    let rem = ctx.m - t0;
                    // SAFETY: as for `strip`; the tokens t0 .. t0+MT are < m and the columns inside the strip.
                    unsafe {
                        if rem >= 8 {
                            group_dot::<BITS, 8, 2>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            group_dot::<BITS, 8, 2>(ctx, gi, sr0, sr1, j0, nj, c0 + 32, t0, yb);
                            t0 += 8;
                        } else if rem >= 4 {
                            group_dot::<BITS, 4, 2>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            group_dot::<BITS, 4, 2>(ctx, gi, sr0, sr1, j0, nj, c0 + 32, t0, yb);
                            t0 += 4;
                        } else if rem >= 2 {
                            group_dot::<BITS, 2, 4>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            t0 += 2;
                        } else {
                            group_dot::<BITS, 1, 4>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            t0 += 1;
                        }
                    }
                }
            }
        }
    }

    /// Y[t, c] += s·(Σ_{super-rows sr0..sr1} x[t, i]·q[i, j] − z·Σx[t, gi]) for tokens t0 .. t0+MT and the CV·16
    /// columns from c (strip-relative; those at or past nj are masked off).
    ///
    /// # Safety
    /// As for `strip`; t0 + MT ≤ m, super-rows sr0 .. sr1 all in group gi.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn group_dot<const BITS: u32, const MT: usize, const CV: usize>(
        ctx: &Ctx,
        gi: usize,
        sr0: usize,
        sr1: usize,
        j0: usize,
        nj: usize,
        c: usize,
        t0: usize,
        yb: &mut [f32],
    ) {
        let p = ctx.p;
        let (n, k) = (p.d_out, p.d_in);
        let b = BITS as usize;
        let mut masks = [0u16; CV];
        for (v, mk) in masks.iter_mut().enumerate() {
            let lo = c + 16 * v;
            *mk = if lo >= nj {
                0
            } else if lo + 16 <= nj {
                0xffff
            } else {
                (1u16 << (nj - lo)) - 1
            };
        }
        if masks[0] == 0 {
            return;
        }
        let maxq = (1u32 << BITS.min(4)) - 1;
        // lut[v] = v & maxq: vpermps reads only the low 4 bits of each index, so bits of the next code above the
        // b-bit code are ignored or masked here.
        let lut: [f32; 16] = std::array::from_fn(|v| (v as u32 & maxq) as f32);
        // SAFETY: 16 floats.
        let lut = unsafe { _mm512_loadu_ps(lut.as_ptr()) };
        let byte = _mm512_set1_epi32(0xff);
        let mut acc = [[_mm512_setzero_ps(); CV]; MT];
        let qw = p.qweight.as_ptr();
        let x = ctx.x.as_ptr();
        // SAFETY (whole body): every qweight word read is row r < k·b/32, column j0 + c + 16v + lane < n (masked
        // loads skip the rest); x reads are t < m, i < k; scales/zeros/yb reads and writes are masked likewise.
        unsafe {
            macro_rules! load_words {
                ($r:expr) => {{
                    let row = qw.wrapping_add($r * n + j0 + c);
                    let mut v = [_mm512_setzero_si512(); CV];
                    for (cv, vv) in v.iter_mut().enumerate() {
                        *vv = _mm512_maskz_loadu_epi32(
                            masks[cv],
                            row.wrapping_add(16 * cv) as *const i32,
                        );
                    }
                    v
                }};
            }
            // The code in the low bits of each lane of $v is input $i: convert and accumulate.
            macro_rules! step {
                ($v:expr, $i:expr) => {{
                    let mut q = [_mm512_setzero_ps(); CV];
                    for cv in 0..CV {
                        q[cv] = if BITS == 8 {
                            _mm512_cvtepi32_ps(_mm512_and_si512($v[cv], byte))
                        } else {
                            _mm512_permutexvar_ps($v[cv], lut)
                        };
                    }
                    for t in 0..MT {
                        let xb = _mm512_set1_ps(*x.add((t0 + t) * k + $i));
                        for cv in 0..CV {
                            acc[t][cv] = _mm512_fmadd_ps(q[cv], xb, acc[t][cv]);
                        }
                    }
                }};
            }
            macro_rules! shift {
                ($v:expr, $s:literal) => {{
                    for vv in $v.iter_mut() {
                        *vv = _mm512_srli_epi32::<$s>(*vv);
                    }
                }};
            }
            for sr in sr0..sr1 {
                let i0 = 32 * sr;
                if BITS == 3 {
                    // 32 codes in 3 words; codes 10 and 21 straddle (bits 30-32 and 63-65).
                    let w1 = load_words!(3 * sr + 1);
                    let w2 = load_words!(3 * sr + 2);
                    let mut v = load_words!(3 * sr);
                    for s in 0..10 {
                        step!(v, i0 + s);
                        shift!(v, 3);
                    }
                    for cv in 0..CV {
                        v[cv] = _mm512_or_si512(v[cv], _mm512_slli_epi32::<2>(w1[cv]));
                    }
                    step!(v, i0 + 10);
                    let mut v = w1;
                    shift!(v, 1);
                    for s in 0..10 {
                        step!(v, i0 + 11 + s);
                        shift!(v, 3);
                    }
                    for cv in 0..CV {
                        v[cv] = _mm512_or_si512(v[cv], _mm512_slli_epi32::<1>(w2[cv]));
                    }
                    step!(v, i0 + 21);
                    let mut v = w2;
                    shift!(v, 2);
                    for s in 0..10 {
                        step!(v, i0 + 22 + s);
                        shift!(v, 3);
                    }
                } else {
                    let per = 32 / b;
                    for w in 0..b {
                        let mut v = load_words!(sr * b + w);
                        for s in 0..per {
                            step!(v, i0 + w * per + s);
                            for vv in v.iter_mut() {
                                *vv = _mm512_srli_epi32::<BITS>(*vv);
                            }
                        }
                    }
                }
            }
            let s_ptr = p.scales.as_ptr().wrapping_add(gi * n + j0 + c);
            let z_ptr = p.zeros.as_ptr().wrapping_add(gi * n + j0 + c);
            let ng = p.n_groups;
            for (t, acc_t) in acc.iter().enumerate() {
                let xs = _mm512_set1_ps(ctx.xs[(t0 + t) * ng + gi]);
                let y_ptr = yb.as_mut_ptr().wrapping_add((t0 + t) * nj + c);
                for cv in 0..CV {
                    let mk = masks[cv];
                    let s = _mm512_maskz_loadu_ps(mk, s_ptr.wrapping_add(16 * cv));
                    let z = _mm512_maskz_loadu_ps(mk, z_ptr.wrapping_add(16 * cv));
                    let yv = _mm512_maskz_loadu_ps(mk, y_ptr.wrapping_add(16 * cv));
                    let d = _mm512_fnmadd_ps(z, xs, acc_t[cv]);
                    _mm512_mask_storeu_ps(
                        y_ptr.wrapping_add(16 * cv),
                        mk,
                        _mm512_fmadd_ps(s, d, yv),
                    );
                }
            }
        }
    }
}

/// The AVX2 twin of `avx512`: 8 columns per ymm, 32-column chunks, runs of ≤ 4 tokens (16 ymm registers),
/// codes → floats by and + cvtdq2ps (vpermps on ymm has only 8 entries). Compiled only where the build enables
/// AVX2 + FMA (the x86-64-v3 baseline of .cargo/config.toml), so it needs no run-time check.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2 {
    use super::Ctx;
    use std::arch::x86_64::*;

    const CHUNK: usize = 32;

    /// As `avx512::strip`.
    ///
    /// # Safety
    /// ctx as built by `packed_linear_fast_isa`; yb.len() = m·nj, j0 + nj ≤ d_out.
    pub unsafe fn strip<const BITS: u32>(ctx: &Ctx, j0: usize, nj: usize, yb: &mut [f32]) {
        let p = ctx.p;
        let (n, k) = (p.d_out, p.d_in);
        let nsr = k / 32;
        let b = BITS as usize;
        for gi in 0..p.n_groups {
            let sr0 = gi * ctx.gsr;
            let sr1 = (sr0 + ctx.gsr).min(nsr);
            let sr2 = (sr1 + ctx.gsr).min(nsr);
            for c0 in (0..nj).step_by(CHUNK) {
                let cols = CHUNK.min(nj - c0);
                for r in sr1 * b..sr2 * b {
                    let row = p.qweight.as_ptr().wrapping_add(r * n + j0 + c0);
                    for l in (0..cols).step_by(16) {
                        // SAFETY: r < k·b/32 and j0 + c0 + l < n, so the address is inside qweight.
                        unsafe { _mm_prefetch::<_MM_HINT_T0>(row.add(l) as *const i8) };
                    }
                }
                let mut t0 = 0;
                while t0 < ctx.m {
                    let rem = ctx.m - t0;
                    // SAFETY: as for `strip`; the tokens t0 .. t0+MT are < m and the columns inside the strip.
                    unsafe {
                        if rem >= 4 {
                            group_dot::<BITS, 4, 2>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            group_dot::<BITS, 4, 2>(ctx, gi, sr0, sr1, j0, nj, c0 + 16, t0, yb);
                            t0 += 4;
                        } else if rem >= 2 {
                            group_dot::<BITS, 2, 4>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            t0 += 2;
                        } else {
                            group_dot::<BITS, 1, 4>(ctx, gi, sr0, sr1, j0, nj, c0, t0, yb);
                            t0 += 1;
                        }
                    }
                }
            }
        }
    }

    /// As `avx512::group_dot`, CV·8 columns.
    ///
    /// # Safety
    /// As for `strip`; t0 + MT ≤ m, super-rows sr0 .. sr1 all in group gi.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn group_dot<const BITS: u32, const MT: usize, const CV: usize>(
        ctx: &Ctx,
        gi: usize,
        sr0: usize,
        sr1: usize,
        j0: usize,
        nj: usize,
        c: usize,
        t0: usize,
        yb: &mut [f32],
    ) {
        if c >= nj {
            return;
        }
        let p = ctx.p;
        let (n, k) = (p.d_out, p.d_in);
        let b = BITS as usize;
        // SAFETY (whole body): as in `avx512::group_dot`; masked loads and stores skip columns at or past nj.
        unsafe {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            // Lane l of masks[v] is all ones when column c + 8v + l < nj (maskload reads the top bit).
            let masks: [__m256i; CV] = std::array::from_fn(|v| {
                let valid = nj.saturating_sub(c + 8 * v).min(8) as i32;
                _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane)
            });
            let code = _mm256_set1_epi32(((1u64 << BITS) - 1) as i32);
            let shift = _mm256_set1_epi32(BITS as i32);
            let mut acc = [[_mm256_setzero_ps(); CV]; MT];
            let qw = p.qweight.as_ptr();
            let x = ctx.x.as_ptr();
            macro_rules! load_words {
                ($r:expr) => {{
                    let row = qw.wrapping_add($r * n + j0 + c);
                    let mut v = [_mm256_setzero_si256(); CV];
                    for (cv, vv) in v.iter_mut().enumerate() {
                        *vv = _mm256_maskload_epi32(
                            row.wrapping_add(8 * cv) as *const i32,
                            masks[cv],
                        );
                    }
                    v
                }};
            }
            macro_rules! step {
                ($v:expr, $i:expr) => {{
                    let mut q = [_mm256_setzero_ps(); CV];
                    for cv in 0..CV {
                        q[cv] = _mm256_cvtepi32_ps(_mm256_and_si256($v[cv], code));
                    }
                    for t in 0..MT {
                        let xb = _mm256_set1_ps(*x.add((t0 + t) * k + $i));
                        for cv in 0..CV {
                            acc[t][cv] = _mm256_fmadd_ps(q[cv], xb, acc[t][cv]);
                        }
                    }
                }};
            }
            macro_rules! shift {
                ($v:expr, $s:literal) => {{
                    for vv in $v.iter_mut() {
                        *vv = _mm256_srli_epi32::<$s>(*vv);
                    }
                }};
            }
            for sr in sr0..sr1 {
                let i0 = 32 * sr;
                if BITS == 3 {
                    let w1 = load_words!(3 * sr + 1);
                    let w2 = load_words!(3 * sr + 2);
                    let mut v = load_words!(3 * sr);
                    for s in 0..10 {
                        step!(v, i0 + s);
                        shift!(v, 3);
                    }
                    for cv in 0..CV {
                        v[cv] = _mm256_or_si256(v[cv], _mm256_slli_epi32::<2>(w1[cv]));
                    }
                    step!(v, i0 + 10);
                    let mut v = w1;
                    shift!(v, 1);
                    for s in 0..10 {
                        step!(v, i0 + 11 + s);
                        shift!(v, 3);
                    }
                    for cv in 0..CV {
                        v[cv] = _mm256_or_si256(v[cv], _mm256_slli_epi32::<1>(w2[cv]));
                    }
                    step!(v, i0 + 21);
                    let mut v = w2;
                    shift!(v, 2);
                    for s in 0..10 {
                        step!(v, i0 + 22 + s);
                        shift!(v, 3);
                    }
                } else {
                    let per = 32 / b;
                    for w in 0..b {
                        let mut v = load_words!(sr * b + w);
                        for s in 0..per {
                            step!(v, i0 + w * per + s);
                            for vv in v.iter_mut() {
                                *vv = _mm256_srlv_epi32(*vv, shift);
                            }
                        }
                    }
                }
            }
            let s_ptr = p.scales.as_ptr().wrapping_add(gi * n + j0 + c);
            let z_ptr = p.zeros.as_ptr().wrapping_add(gi * n + j0 + c);
            let ng = p.n_groups;
            for (t, acc_t) in acc.iter().enumerate() {
                let xs = _mm256_set1_ps(ctx.xs[(t0 + t) * ng + gi]);
                let y_ptr = yb.as_mut_ptr().wrapping_add((t0 + t) * nj + c);
                for cv in 0..CV {
                    let mk = masks[cv];
                    let s = _mm256_maskload_ps(s_ptr.wrapping_add(8 * cv), mk);
                    let z = _mm256_maskload_ps(z_ptr.wrapping_add(8 * cv), mk);
                    let yv = _mm256_maskload_ps(y_ptr.wrapping_add(8 * cv), mk);
                    let d = _mm256_fnmadd_ps(z, xs, acc_t[cv]);
                    _mm256_maskstore_ps(y_ptr.wrapping_add(8 * cv), mk, _mm256_fmadd_ps(s, d, yv));
                }
            }
        }
    }
}
