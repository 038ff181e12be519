//! The RoPE position average of BoA's row Hessians (design.md §4.3): pure arithmetic on host values, here so
//! that `QuantOps::rope_row_hessians` can take it (its CPU implementation applies it, the CUDA one remakes
//! the moments on the device from `source`).

/// The RoPE position average M = mean_{p=0..seqlen−1} R_pᵀ C R_p (design.md §4.3), for the rotate-half
/// convention: pairs (i, i + d_h/2) rotate by p·θ_i, R_p maps pre-RoPE to post-RoPE vectors:
///   x'_i = x_i cos − x_{i+h} sin,  x'_{i+h} = x_{i+h} cos + x_i sin.
/// Column a of R_p is cos_f e_a + s_a sin_f e_{ā} (f = a mod d_h/2, ā its partner, s_a = +1 for the first
/// half, −1 for the second), so M[a, b] needs only mean_p of cos·cos, cos·sin, sin·sin over frequency pairs,
/// precomputed once per (θ, seqlen).
#[derive(Clone, Debug)]
pub struct RopeAverage {
    half: usize,
    /// mean_p cos(pθ_i)cos(pθ_j), cos(pθ_i)sin(pθ_j), sin(pθ_i)sin(pθ_j), [half × half] each.
    cc: Vec<f64>,
    cs: Vec<f64>,
    ss: Vec<f64>,
    /// What they were made from, for a backend that makes them itself (the CUDA backend, on the device).
    inv_freq: Vec<f64>,
    seqlen: usize,
}

impl RopeAverage {
    /// `inv_freq` [d_h/2]: θ_i; positions 0..seqlen−1.
    pub fn new(inv_freq: &[f64], seqlen: usize) -> Self {
        let half = inv_freq.len();
        let (mut cc, mut cs, mut ss) = (
            vec![0.0; half * half],
            vec![0.0; half * half],
            vec![0.0; half * half],
        );
        let mut c = vec![0.0; half];
        let mut s = vec![0.0; half];
        for p in 0..seqlen {
            for i in 0..half {
                let a = p as f64 * inv_freq[i];
                c[i] = a.cos();
                s[i] = a.sin();
            }
            for i in 0..half {
                for j in 0..half {
                    cc[i * half + j] += c[i] * c[j];
                    cs[i * half + j] += c[i] * s[j];
                    ss[i * half + j] += s[i] * s[j];
                }
            }
        }
        let inv = 1.0 / seqlen.max(1) as f64;
        for v in cc.iter_mut().chain(cs.iter_mut()).chain(ss.iter_mut()) {
            *v *= inv;
        }
        Self {
            half,
            cc,
            cs,
            ss,
            inv_freq: inv_freq.to_vec(),
            seqlen,
        }
    }

    /// The head dimension it averages over (2 · the number of frequencies).
    pub fn d_h(&self) -> usize {
        2 * self.half
    }

    /// θ_i [d_h/2] and the number of positions averaged over.
    pub fn source(&self) -> (&[f64], usize) {
        (&self.inv_freq, self.seqlen)
    }

    /// inv_freq of Llama's RoPE: θ_i = base^(−2i/d_h).
    pub fn llama_inv_freq(d_h: usize, base: f64) -> Vec<f64> {
        (0..d_h / 2)
            .map(|i| base.powf(-2.0 * i as f64 / d_h as f64))
            .collect()
    }

    /// M = mean_p R_pᵀ C R_p for one C [d_h × d_h].
    pub fn apply(&self, c: &[f64]) -> Vec<f64> {
        let h = self.half;
        let d = 2 * h;
        assert_eq!(c.len(), d * d, "C is not [{d} × {d}]");
        let partner = |a: usize| if a < h { (a + h, 1.0) } else { (a - h, -1.0) };
        let mut m = vec![0.0; d * d];
        for a in 0..d {
            let (pa, sa) = partner(a);
            let fa = a % h;
            for b in 0..d {
                let (pb, sb) = partner(b);
                let fb = b % h;
                let k = fa * h + fb;
                let kt = fb * h + fa;
                m[a * d + b] = self.cc[k] * c[a * d + b]
                    + sb * self.cs[k] * c[a * d + pb]
                    + sa * self.cs[kt] * c[pa * d + b]
                    + sa * sb * self.ss[k] * c[pa * d + pb];
            }
        }
        m
    }

    /// Applies to each of `k` stacked [d_h × d_h] matrices.
    pub fn apply_all(&self, cs: &[f64]) -> Vec<f64> {
        let dd = 4 * self.half * self.half;
        cs.chunks(dd).flat_map(|c| self.apply(c)).collect()
    }
}
