//! Hessian statistics (design.md §4.2–4.3; the paper's Table 1), accumulated from batches of activations.
//!
//! All accumulators keep f64 sums of f32 GEMM chunks and a token count N, and return (2/N)·Σ: a running mean,
//! so batches can be added in any order. N counts tokens (GPTQ's reference counts sequences; the scale does
//! not matter: damping is relative to mean(diag H) and the scale search is scale-invariant).
//!
//! Token batches are row-major [m × width] (one token per row), as the forward produces them.

pub use crate::ops::RopeAverage;
use crate::ops::{AttnShape, Mat, QuantOps, Result, RowGram, Tensor};
use faer::linalg::matmul::triangular;
use faer::{Accum, MatMut, MatRef, Par};

/// H [d × d] = Xᵀ X of one chunk X [m × d] (one token per row), f32 (the CPU twin of the CUDA SYRK).
/// X is read as [m × d] with row stride `ld` (ld > d selects a column window, e.g. one head).
pub fn hessian_xxt(h: &mut [f32], x: &[f32], m: usize, d: usize, ld: usize) {
    gram_f32(h, x, m, d, ld, Par::rayon(0));
}

/// `hessian_xxt` with the GEMM's parallelism given: `Par::Seq` inside a task that is itself one of many
/// in parallel. Only the lower triangle is multiplied (faer's triangular product: 1.4–1.7× faster at d = 576
/// and 1536, m = 512, measured), then mirrored. Its entries are the bits the full GEMM gave (the same dot
/// products in the same order; the full product's two triangles were equal bit for bit), and faer splits only
/// the output between threads, never a dot product, so `par` does not change them either.
pub fn gram_f32(h: &mut [f32], x: &[f32], m: usize, d: usize, ld: usize, par: Par) {
    assert_eq!(h.len(), d * d, "H is not [{d} × {d}]");
    if m == 0 {
        h.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    assert!(
        x.len() >= (m - 1) * ld + d,
        "X is not [{m} × {d}] with stride {ld}"
    );
    let xr = MatRef::from_row_major_slice_with_stride(&x[..(m - 1) * ld + d], m, d, ld);
    let hm = MatMut::from_row_major_slice_mut(h, d, d);
    triangular::matmul(
        hm,
        triangular::BlockStructure::TriangularLower,
        Accum::Replace,
        xr.transpose(),
        triangular::BlockStructure::Rectangular,
        xr,
        triangular::BlockStructure::Rectangular,
        1.0f32,
        par,
    );
    mirror_lower(h, d);
}

/// Copies the strict lower triangle of `h` [d × d] onto the upper one, in 32 × 32 tiles (a plain column walk
/// of the upper triangle misses the cache on every write at d = 1536).
fn mirror_lower(h: &mut [f32], d: usize) {
    const T: usize = 32;
    for i0 in (0..d).step_by(T) {
        for j0 in (0..=i0).step_by(T) {
            for i in i0..(i0 + T).min(d) {
                for j in j0..(j0 + T).min(i) {
                    h[j * d + i] = h[i * d + j];
                }
            }
        }
    }
}

/// Tokens per f32 GEMM chunk before the sum is folded into f64 (bounds f32 accumulation error).
pub const CHUNK_TOKENS: usize = 512;

/// sum [d × d] (f64) += Xᵀ X of X [m × d] (row stride `ld`), in f32 GEMM chunks of CHUNK_TOKENS tokens folded
/// into f64: the CPU's statistics (bounded f32 error, f64 totals).
pub fn add_xxt_f64(
    sum: &mut [f64],
    x: &[f32],
    m: usize,
    d: usize,
    ld: usize,
    scratch: &mut Vec<f32>,
) {
    let chunks = m.div_ceil(CHUNK_TOKENS);
    fold_grams(
        sum,
        d,
        chunks,
        |_| 0,
        |i, h, par| {
            let t0 = i * CHUNK_TOKENS;
            gram_f32(h, &x[t0 * ld..], CHUNK_TOKENS.min(m - t0), d, ld, par);
        },
        scratch,
    );
}

/// sums[target(i)] (f64, [· × d × d]) += the f32 Gram that `gram(i, h, par)` writes into h [d × d], for
/// i = 0..n. The Grams are computed in parallel, as many at a time as the pool has threads, each sequential
/// (`par`), and added in order i = 0..n: the bits of computing and adding them one at a time with the
/// parallel GEMM, whatever the thread count. Small GEMMs (t = 512 tokens of one head) waste most of a
/// parallel GEMM's time in its fork/join barriers on two cores; a lone Gram keeps the parallel GEMM.
pub fn fold_grams(
    sums: &mut [f64],
    d: usize,
    n: usize,
    target: impl Fn(usize) -> usize,
    gram: impl Fn(usize, &mut [f32], Par) + Sync,
    scratch: &mut Vec<f32>,
) {
    let dd = d * d;
    let p = rayon::current_num_threads().clamp(1, n.max(1));
    scratch.resize(p * dd, 0.0);
    for g0 in (0..n).step_by(p) {
        let g1 = (g0 + p).min(n);
        let bufs = &mut scratch[..(g1 - g0) * dd];
        if g1 - g0 == 1 {
            gram(g0, bufs, Par::rayon(0));
        } else {
            use rayon::prelude::*;
            bufs.par_chunks_mut(dd)
                .enumerate()
                .for_each(|(j, h)| gram(g0 + j, h, Par::Seq));
        }
        for (j, h) in bufs.chunks(dd).enumerate() {
            let b = target(g0 + j);
            sums[b * dd..(b + 1) * dd]
                .iter_mut()
                .zip(h)
                .for_each(|(s, &v)| *s += v as f64);
        }
    }
}

/// (2 / (n · extra_div)) · sum [d × d], made exactly symmetric (the GEMM's two triangles may differ in the last
/// bit).
pub fn finish(sum: &[f64], d: usize, n: usize, extra_div: f64) -> Vec<f64> {
    let f = if n == 0 {
        0.0
    } else {
        2.0 / (n as f64 * extra_div)
    };
    let mut h: Vec<f64> = sum.iter().map(|&v| v * f).collect();
    // exact symmetry (the GEMM's two triangles may differ in the last bit)
    for i in 0..d {
        for j in 0..i {
            let v = 0.5 * (h[i * d + j] + h[j * d + i]);
            h[i * d + j] = v;
            h[j * d + i] = v;
        }
    }
    h
}

/// H_row for W_Q [n_heads × d_h × d_h]: query head h gets mean_p R_pᵀ C_K R_p of its KV head h / G.
/// `c_k` [n_kv × d_h × d_h] (per-KV-head post-RoPE key covariances).
pub fn q_row_hessians(c_k: &[f64], n_heads: usize, n_kv: usize, rope: &RopeAverage) -> Vec<f64> {
    assert!(n_kv > 0 && n_heads.is_multiple_of(n_kv));
    let per_kv = rope.apply_all(c_k);
    let dd = per_kv.len() / n_kv;
    let gs = n_heads / n_kv;
    (0..n_heads)
        .flat_map(|h| per_kv[(h / gs) * dd..(h / gs + 1) * dd].to_vec())
        .collect()
}

/// H_row for W_K [n_kv × d_h × d_h]: mean_p R_pᵀ C̄_Q R_p with C̄_Q the group-averaged post-RoPE query
/// covariance (`HeadCovAccumulator::group_means(n_kv)` of the queries).
pub fn k_row_hessians(c_q_group_mean: &[f64], rope: &RopeAverage) -> Vec<f64> {
    rope.apply_all(c_q_group_mean)
}

/// H_row of W_Q or W_K behind a per-head RMSNorm with weight g [d_h] (Qwen3's q_norm/k_norm), in place on
/// stacked [d_h × d_h] matrices: H[a, b] ← g_a · H[a, b] · g_b.
///
/// Why: the scores read n(q) = g ⊙ q / r(q), r² = mean(q²) + ε, so a change Δq of the projection's output
/// reaches them as J Δq with J = diag(g) (I − q qᵀ/(d_h r²)) / r. The bracket removes the part of Δq along q
/// (the norm undoes a change of length): dropping it, J ≈ diag(g)/r, and H_row = E[Jᵀ M J] ≈ E[1/r²] diag(g)
/// M diag(g) with M the RoPE-averaged covariance of the other side (`q_row_hessians`, `k_row_hessians`). A
/// scalar per head leaves BoA's solution unchanged (its updates are ratios of U_row and the damping is
/// relative), so E[1/r²] drops out; diag(g) stays. What is dropped is a rank-one projection per token, a
/// fraction ~1/d_h of Δq's energy (design.md §4.3, "q/k norm").
pub fn scale_by_norm_weight(h: &mut [f64], g: &[f32]) {
    let d = g.len();
    for m in h.chunks_mut(d * d) {
        for (a, row) in m.chunks_mut(d).enumerate() {
            for (b, v) in row.iter_mut().enumerate() {
                *v *= f64::from(g[a]) * f64::from(g[b]);
            }
        }
    }
}

/// sum [heads × d_h × d_h] (f64) += Σ_t J_tᵀ A_h J_t per head over the m pre-norm vectors of x
/// [m × heads·d_h] (W_Q's or W_K's outputs before a per-head RMSNorm), with J_t = (I − q_t q_tᵀ/(d_h r_t²)) / r_t,
/// r_t² = mean(q_t²) + eps: the exact form of the row Hessian behind a q/k norm, where `scale_by_norm_weight`
/// keeps only diag(g)/r. A [heads × d_h × d_h] is diag(g) M diag(g) with M the RoPE-averaged covariance of the
/// other side (`rope_row_hessians` with the norm weight), so J's diag(g) is inside it.
///
/// Why not per token: with v = q/(√d_h r), s = 1/r² and P = I − v vᵀ, Σ_t s_t P_t A P_t = S A − C A − A C + F
/// with S = Σ s_t, C = Σ s_t v_t v_tᵀ and F = Σ s_t (v_tᵀ A v_t) v_t v_tᵀ: two Grams of scaled rows and one
/// GEMM for the quadratic forms per chunk (d_h² work per token, as the covariance itself), not 4 d_h² of
/// scalar updates per token.
pub fn add_norm_jacobian_f64(
    sum: &mut [f64],
    x: &[f32],
    m: usize,
    heads: usize,
    d_h: usize,
    a: &[f64],
    eps: f32,
) {
    let (dd, ld) = (d_h * d_h, heads * d_h);
    assert_eq!(
        sum.len(),
        heads * dd,
        "the sums are not [{heads} × {d_h} × {d_h}]"
    );
    assert_eq!(a.len(), heads * dd, "A is not [{heads} × {d_h} × {d_h}]");
    assert_eq!(x.len(), m * ld, "X is not [{m} × {heads}·{d_h}]");
    let mut scratch = Vec::new();
    for h in 0..heads {
        let ah = &a[h * dd..(h + 1) * dd];
        let a32: Vec<f32> = ah.iter().map(|&v| v as f32).collect();
        let (mut c, mut f, mut s_sum) = (vec![0f64; dd], vec![0f64; dd], 0f64);
        for t0 in (0..m).step_by(CHUNK_TOKENS) {
            let n = CHUNK_TOKENS.min(m - t0);
            // v rows, and √s·v (C's rows)
            let mut v = vec![0f32; n * d_h];
            let mut w1 = vec![0f32; n * d_h];
            let mut s = vec![0f64; n];
            for t in 0..n {
                let q = &x[(t0 + t) * ld + h * d_h..][..d_h];
                let r2 = q.iter().map(|&e| f64::from(e) * f64::from(e)).sum::<f64>() / d_h as f64
                    + f64::from(eps);
                s[t] = 1.0 / r2;
                let (fv, fw) = (
                    1.0 / (d_h as f64 * r2).sqrt(),
                    1.0 / (r2 * (d_h as f64).sqrt()),
                );
                for j in 0..d_h {
                    v[t * d_h + j] = (f64::from(q[j]) * fv) as f32;
                    w1[t * d_h + j] = (f64::from(q[j]) * fw) as f32;
                }
            }
            s_sum += s.iter().sum::<f64>();
            // v_tᵀ A v_t from one GEMM V·A; F's rows √(s·vᵀAv)·v (≥ 0: A is a covariance)
            let mut va = vec![0f32; n * d_h];
            faer::linalg::matmul::matmul(
                MatMut::from_row_major_slice_mut(&mut va, n, d_h),
                Accum::Replace,
                MatRef::from_row_major_slice(&v, n, d_h),
                MatRef::from_row_major_slice(&a32, d_h, d_h),
                1.0f32,
                Par::rayon(0),
            );
            let mut w2 = v.clone();
            for (((w, va), v), &s) in w2
                .chunks_mut(d_h)
                .zip(va.chunks(d_h))
                .zip(v.chunks(d_h))
                .zip(&s)
            {
                let qf: f64 = va
                    .iter()
                    .zip(v)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum();
                let k = (s * qf.max(0.0)).sqrt() as f32;
                w.iter_mut().for_each(|e| *e *= k);
            }
            add_xxt_f64(&mut c, &w1, n, d_h, d_h, &mut scratch);
            add_xxt_f64(&mut f, &w2, n, d_h, d_h, &mut scratch);
        }
        // S A − C A − A C + F, in f64 (C A and A C are transposes of each other: A and C are symmetric)
        let out = &mut sum[h * dd..(h + 1) * dd];
        for i in 0..d_h {
            for j in 0..d_h {
                let ca: f64 = (0..d_h).map(|k| c[i * d_h + k] * ah[k * d_h + j]).sum();
                let ac: f64 = (0..d_h).map(|k| ah[i * d_h + k] * c[k * d_h + j]).sum();
                out[i * d_h + j] += s_sum * ah[i * d_h + j] - ca - ac + f[i * d_h + j];
            }
        }
    }
}

/// H_row for W_V from the paper's Table 1: W_out,hᵀ W_out,h [d_h × d_h] per KV head, averaged
/// over the query heads sharing the KV head. `w_o` is o_proj [d_model × n_heads·d_h] (y = W_o x).
pub fn v_row_hessians_from_wout(
    w_o: &[f32],
    d_model: usize,
    n_heads: usize,
    n_kv: usize,
    d_h: usize,
) -> Vec<f64> {
    assert_eq!(
        w_o.len(),
        d_model * n_heads * d_h,
        "W_o is not [{d_model} × {n_heads}·{d_h}]"
    );
    assert!(n_kv > 0 && n_heads.is_multiple_of(n_kv));
    let gs = n_heads / n_kv;
    let ld = n_heads * d_h;
    let mut out = vec![0.0; n_kv * d_h * d_h];
    for h in 0..n_heads {
        let o = &mut out[(h / gs) * d_h * d_h..(h / gs + 1) * d_h * d_h];
        for r in 0..d_model {
            let row = &w_o[r * ld + h * d_h..r * ld + (h + 1) * d_h];
            for a in 0..d_h {
                for b in 0..d_h {
                    o[a * d_h + b] += row[a] as f64 * row[b] as f64 / gs as f64;
                }
            }
        }
    }
    out
}

/// H_row = I for W_V (the reference code's choice), [n_kv × d_h × d_h].
pub fn identity_row_hessians(n: usize, d_h: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * d_h * d_h];
    for h in 0..n {
        for i in 0..d_h {
            out[h * d_h * d_h + i * d_h + i] = 1.0;
        }
    }
    out
}

/// Per-head covariances [n_heads × d_h × d_h] averaged over consecutive groups of `n_heads / n_groups` heads
/// (GQA: query heads h·G..(h+1)·G share KV head h, as the attention maps query head i to KV head i / G):
/// [n_groups × d_h × d_h], f64.
pub fn group_means(cov: &[f64], n_heads: usize, d_h: usize, n_groups: usize) -> Vec<f64> {
    assert!(
        n_groups > 0 && n_heads.is_multiple_of(n_groups),
        "{n_heads} heads not divisible into {n_groups} groups"
    );
    let gs = n_heads / n_groups;
    let dd = d_h * d_h;
    let mut out = vec![0.0; n_groups * dd];
    for h in 0..n_heads {
        for (o, &c) in out[(h / gs) * dd..(h / gs + 1) * dd]
            .iter_mut()
            .zip(&cov[h * dd..(h + 1) * dd])
        {
            *o += c / gs as f64;
        }
    }
    out
}

/// An input covariance H = (2/N) Σ_t x_t xᵀ_t (or a batch: per-head covariances, V's per-KV-head H_col),
/// summed where the backend computes and finished once: a running mean, so chunks may come in any order.
pub struct Accumulator {
    acc: Mat,
    tokens: usize,
    /// Extra divisor of the mean (V: the query heads folded into each KV head's sum).
    div: f64,
}

impl Accumulator {
    /// Σ x xᵀ of one input [d × d].
    pub fn xxt(ops: &dyn QuantOps, d: usize) -> Result<Self> {
        Ok(Accumulator {
            acc: ops.stat_acc(1, d)?,
            tokens: 0,
            div: 1.0,
        })
    }

    /// Per-head Σ x_h x_hᵀ [n_heads × d_h × d_h] of post-RoPE queries or keys.
    pub fn heads(ops: &dyn QuantOps, n_heads: usize, d_h: usize) -> Result<Self> {
        Ok(Accumulator {
            acc: ops.stat_acc(n_heads, d_h)?,
            tokens: 0,
            div: 1.0,
        })
    }

    /// W_V's H_col per KV head [n_kv × d × d], averaged over the n_heads / n_kv query heads of each.
    pub fn v_col(ops: &dyn QuantOps, d: usize, n_heads: usize, n_kv: usize) -> Result<Self> {
        if n_kv == 0 || !n_heads.is_multiple_of(n_kv) {
            return Err(anyhow::anyhow!(
                "{n_heads} heads are not divisible into {n_kv} KV heads"
            ));
        }
        Ok(Accumulator {
            acc: ops.stat_acc(n_kv, d)?,
            tokens: 0,
            div: (n_heads / n_kv) as f64,
        })
    }

    /// Adds X [m × d] (one token per row).
    pub fn add_xxt(&mut self, ops: &dyn QuantOps, x: &Tensor, m: usize) -> Result<()> {
        ops.stat_xxt(&mut self.acc, x, m)?;
        self.tokens += m;
        Ok(())
    }

    /// Adds each item's X [m × d] (row r times s_r where it has scales) to its accumulator, all in one
    /// `QuantOps::stat_xxt_rows` call (a GPU batches them: an MoE block's experts).
    pub fn add_xxt_rows(
        ops: &dyn QuantOps,
        items: Vec<(&mut Accumulator, &Tensor, usize, Option<&[f32]>)>,
    ) -> Result<()> {
        let mut counts = Vec::with_capacity(items.len());
        let mut grams = Vec::with_capacity(items.len());
        for (a, x, m, scales) in items {
            let Accumulator { acc, tokens, .. } = a;
            counts.push((tokens, m));
            grams.push(RowGram { acc, x, m, scales });
        }
        ops.stat_xxt_rows(&mut grams)?;
        counts.into_iter().for_each(|(t, m)| *t += m);
        Ok(())
    }

    /// Adds [m × n_heads·d_h] post-RoPE vectors.
    pub fn add_heads(&mut self, ops: &dyn QuantOps, x: &Tensor, m: usize) -> Result<()> {
        ops.stat_head_cov(&mut self.acc, x, m)?;
        self.tokens += m;
        Ok(())
    }

    /// Adds [m × heads·d_h] pre-norm vectors' Σ J_tᵀ A J_t (`QuantOps::stat_norm_jacobian`).
    pub fn add_norm_jacobian(
        &mut self,
        ops: &dyn QuantOps,
        x: &Tensor,
        m: usize,
        a: &Mat,
        eps: f32,
    ) -> Result<()> {
        ops.stat_norm_jacobian(&mut self.acc, x, m, a, eps)?;
        self.tokens += m;
        Ok(())
    }

    /// Adds `n_seq` sequences of V's column statistics (`QuantOps::stat_v_col`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_v_col(
        &mut self,
        ops: &dyn QuantOps,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<()> {
        ops.stat_v_col(&mut self.acc, x, q, k, s, n_seq)?;
        self.tokens += n_seq * s.t;
        Ok(())
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens
    }

    /// (2/N) Σ (÷ the query heads per KV head for V), exactly symmetric.
    pub fn finish(self, ops: &dyn QuantOps) -> Result<Mat> {
        ops.stat_finish(self.acc, self.tokens, self.div)
    }
}
