//! Hessian statistics against brute force (design.md §4.4): XXᵀ running mean is batch-order independent; the
//! RoPE position average equals mean_p R_pᵀ C R_p with explicit R_p built from the forward's own `rope_head`;
//! GQA grouping (C̄_Q averages the right query heads, Q's H_row takes its KV head's C_K, V's H_col averages
//! the right heads) and the V statistic (2/N) Σ (A_h X)ᵀ(A_h X).

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::backend::cpu::{CpuBackend, causal_softmax_probs, gather_head, rope_head};
use boa_cuda::ops::{AttnShape, QuantOps, Tensor};
use boa_cuda::quant::hessian::{
    Accumulator, RopeAverage, group_means, k_row_hessians, q_row_hessians, v_row_hessians_from_wout,
};
use common::*;

/// A finished accumulator's values.
fn values(acc: Accumulator) -> Vec<f64> {
    let m = acc.finish(&CpuBackend).unwrap();
    CpuBackend.read_f64(&m).unwrap()
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn close(a: &[f64], b: &[f64], rtol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= rtol * scale, "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn xxt_running_mean_any_batching() {
    for d in [24, 70] {
        xxt_running_mean_case(d);
    }
}

fn xxt_running_mean_case(d: usize) {
    let n = 1100;
    let mut r = rng(1);
    let x = to_f32(&correlated_inputs(&mut r, n, d));
    let brute = xtx(&x.iter().map(|&v| v as f64).collect::<Vec<_>>(), n, d);
    let ops = CpuBackend;
    let mut a = Accumulator::xxt(&ops, d).unwrap();
    a.add_xxt(&ops, &Tensor::Host(x.clone()), n).unwrap();
    let mut b = Accumulator::xxt(&ops, d).unwrap();
    for (t0, t1) in [(700, 1100), (0, 3), (3, 700)] {
        b.add_xxt(&ops, &Tensor::Host(x[t0 * d..t1 * d].to_vec()), t1 - t0)
            .unwrap();
    }
    assert_eq!(b.n_tokens(), n);
    let (a, b) = (values(a), values(b));
    close(&a, &brute, 1e-5, "one batch");
    close(&b, &a, 1e-5, "three batches");
    let h = a;
    for i in 0..d {
        for j in 0..d {
            assert_eq!(h[i * d + j], h[j * d + i]);
        }
    }
}

/// mean_p R_pᵀ C R_p with R_p's columns = rope_head applied to basis vectors (the forward's convention).
#[test]
fn rope_average_equals_explicit_rotations() {
    for &(d_h, seqlen, base) in &[(8usize, 37usize, 10000.0f64), (64, 300, 1e5)] {
        let half = d_h / 2;
        let mut r = rng(d_h as u64);
        let c = random_spd(&mut r, d_h);
        let inv_freq = RopeAverage::llama_inv_freq(d_h, base);
        let ra = RopeAverage::new(&inv_freq, seqlen);
        let mut brute = vec![0.0; d_h * d_h];
        for p in 0..seqlen {
            let cos: Vec<f32> = inv_freq
                .iter()
                .map(|&t| (p as f64 * t).cos() as f32)
                .collect();
            let sin: Vec<f32> = inv_freq
                .iter()
                .map(|&t| (p as f64 * t).sin() as f32)
                .collect();
            // R [d_h × d_h], column a = R e_a
            let mut rm = vec![0.0; d_h * d_h];
            for a in 0..d_h {
                let mut e = vec![0f32; d_h];
                e[a] = 1.0;
                rope_head(&mut e, &cos[..half], &sin[..half]);
                for (i, &v) in e.iter().enumerate() {
                    rm[i * d_h + a] = v as f64;
                }
            }
            // brute += Rᵀ (C R) / seqlen
            let mut cr = vec![0.0; d_h * d_h];
            for i in 0..d_h {
                for j in 0..d_h {
                    for b in 0..d_h {
                        cr[i * d_h + b] += c[i * d_h + j] * rm[j * d_h + b];
                    }
                }
            }
            for a in 0..d_h {
                for i in 0..d_h {
                    for b in 0..d_h {
                        brute[a * d_h + b] += rm[i * d_h + a] * cr[i * d_h + b] / seqlen as f64;
                    }
                }
            }
        }
        close(&ra.apply(&c), &brute, 2e-6, "RoPE average");
    }
}

#[test]
fn gqa_grouping_of_query_key_statistics() {
    let (n_heads, n_kv, d_h, m) = (6, 2, 4, 50);
    let mut r = rng(3);
    // head h's vectors are scaled by (h + 1), so a wrong grouping is visible
    let mut qv = to_f32(&randn_vec(&mut r, m * n_heads * d_h));
    for t in 0..m {
        for h in 0..n_heads {
            for i in 0..d_h {
                qv[t * n_heads * d_h + h * d_h + i] *= (h + 1) as f32;
            }
        }
    }
    let mut acc = Accumulator::heads(&CpuBackend, n_heads, d_h).unwrap();
    acc.add_heads(&CpuBackend, &Tensor::Host(qv.clone()), m)
        .unwrap();
    let per_head = values(acc);
    let dd = d_h * d_h;
    for h in 0..n_heads {
        let xh: Vec<f64> = gather_head(&qv, m, n_heads, d_h, h)
            .iter()
            .map(|&v| v as f64)
            .collect();
        close(
            &per_head[h * dd..(h + 1) * dd],
            &xtx(&xh, m, d_h),
            1e-5,
            "per-head covariance",
        );
    }
    // query heads 0,1,2 share KV head 0; 3,4,5 share KV head 1
    let gm = group_means(&per_head, n_heads, d_h, n_kv);
    for kv in 0..n_kv {
        let expect: Vec<f64> = (0..dd)
            .map(|i| (0..3).map(|k| per_head[(kv * 3 + k) * dd + i]).sum::<f64>() / 3.0)
            .collect();
        close(&gm[kv * dd..(kv + 1) * dd], &expect, 1e-12, "C̄_Q");
    }
    let rope = RopeAverage::new(&RopeAverage::llama_inv_freq(d_h, 10000.0), 16);
    let kr = k_row_hessians(&gm, &rope);
    close(
        &kr[dd..2 * dd],
        &rope.apply(&gm[dd..2 * dd]),
        0.0,
        "K H_row",
    );
    // Q's H_row: query head h takes its KV head's C_K
    let c_k = per_head[..n_kv * dd].to_vec();
    let qr = q_row_hessians(&c_k, n_heads, n_kv, &rope);
    for h in 0..n_heads {
        close(
            &qr[h * dd..(h + 1) * dd],
            &rope.apply(&c_k[(h / 3) * dd..(h / 3 + 1) * dd]),
            0.0,
            "Q H_row",
        );
    }
    // V's H_row option from W_out: averaged over the right heads
    let d_model = 5;
    let w_o = to_f32(&randn_vec(&mut r, d_model * n_heads * d_h));
    let vr = v_row_hessians_from_wout(&w_o, d_model, n_heads, n_kv, d_h);
    for kv in 0..n_kv {
        for a in 0..d_h {
            for b in 0..d_h {
                let mut s = 0.0;
                for h in kv * 3..kv * 3 + 3 {
                    for row in 0..d_model {
                        let ld = n_heads * d_h;
                        s +=
                            w_o[row * ld + h * d_h + a] as f64 * w_o[row * ld + h * d_h + b] as f64;
                    }
                }
                assert!((vr[kv * dd + a * d_h + b] - s / 3.0).abs() < 1e-9);
            }
        }
    }
}

/// softmax(q_i · k_j / √d_h) over the keys query i sees (j ≤ i, and i − j < window), from the definition.
fn brute_probs(qh: &[f32], kh: &[f32], t: usize, d_h: usize, window: Option<usize>) -> Vec<f32> {
    let mut p = vec![0f32; t * t];
    for i in 0..t {
        let seen = |j: usize| j <= i && window.is_none_or(|w| i - j < w);
        let s: Vec<f64> = (0..t)
            .map(|j| {
                let dot: f64 = (0..d_h)
                    .map(|c| qh[i * d_h + c] as f64 * kh[j * d_h + c] as f64)
                    .sum();
                dot / (d_h as f64).sqrt()
            })
            .collect();
        let max = (0..t)
            .filter(|&j| seen(j))
            .map(|j| s[j])
            .fold(f64::MIN, f64::max);
        let z: f64 = (0..t)
            .filter(|&j| seen(j))
            .map(|j| (s[j] - max).exp())
            .sum();
        for j in (0..t).filter(|&j| seen(j)) {
            p[i * t + j] = ((s[j] - max).exp() / z) as f32;
        }
    }
    p
}

#[test]
fn v_column_statistic_matches_brute_force() {
    // Full causal attention, and a sliding window of 3 keys.
    for window in [None, Some(3)] {
        v_column_statistic_case(window, (4, 2, 4, 6, 9));
    }
    // Past one 64-row block of the causal product and one 32-wide tile of the mirrored triangle.
    v_column_statistic_case(Some(40), (2, 1, 4, 37, 130));
}

fn v_column_statistic_case(
    window: Option<usize>,
    (n_heads, n_kv, d_h, d, t): (usize, usize, usize, usize, usize),
) {
    let mut r = rng(4);
    let mut acc = Accumulator::v_col(&CpuBackend, d, n_heads, n_kv).unwrap();
    let shape = AttnShape {
        t,
        h: n_heads,
        h_kv: n_kv,
        d_h,
        d,
        window,
    };
    let mut brute = vec![0.0; n_kv * d * d];
    let n_seq = 2;
    for _ in 0..n_seq {
        let x = to_f32(&randn_vec(&mut r, t * d));
        let q = to_f32(&randn_vec(&mut r, t * n_heads * d_h));
        let k = to_f32(&randn_vec(&mut r, t * n_kv * d_h));
        let mut probs = Vec::new();
        for h in 0..n_heads {
            let qh = gather_head(&q, t, n_heads, d_h, h);
            let kh = gather_head(&k, t, n_kv, d_h, h / 2);
            let p = brute_probs(&qh, &kh, t, d_h, window);
            // The library's own probabilities agree with the definition.
            close(
                &widen(&causal_softmax_probs(&qh, &kh, t, d_h, window)),
                &widen(&p),
                1e-5,
                "probabilities",
            );
            probs.extend(p);
        }
        let host = |v: &[f32]| Tensor::Host(v.to_vec());
        acc.add_v_col(&CpuBackend, &host(&x), &host(&q), &host(&k), shape, 1)
            .unwrap();
        for h in 0..n_heads {
            let a = &probs[h * t * t..(h + 1) * t * t];
            let mut y = vec![0.0; t * d]; // A_h X
            for i in 0..t {
                for j in 0..t {
                    for c in 0..d {
                        y[i * d + c] += a[i * t + j] as f64 * x[j * d + c] as f64;
                    }
                }
            }
            let kv = h / 2; // query heads 0,1 → KV 0; 2,3 → KV 1
            for i in 0..t {
                for a_ in 0..d {
                    for b in 0..d {
                        brute[kv * d * d + a_ * d + b] +=
                            y[i * d + a_] * y[i * d + b] * 2.0 / (n_seq * t) as f64 / 2.0;
                    }
                }
            }
        }
    }
    close(
        &values(acc),
        &brute,
        1e-5,
        &format!("V H_col (window {window:?})"),
    );
}

/// The exact row Hessian behind a q/k norm (`QuantOps::stat_norm_jacobian`) against Σ_t J_tᵀ A J_t with
/// each J_t taken by central differences of q ↦ q / √(mean(q²) + ε) in f64: the Jacobian's derivation and
/// the S A − C A − A C + F expansion both, over 700 tokens (two chunks) fed in two batches. The queries share
/// a strong common direction, as trained queries do, so dropping the projection (the diag approximation,
/// E[1/r²]·A) is far off; the test asserts that too, so it fails if the exact form degenerates to it.
#[test]
fn norm_jacobian_equals_finite_differences() {
    let (heads, d_h, m, eps) = (2usize, 16usize, 700usize, 1e-6f32);
    let mut r = rng(7);
    let common = randn_vec(&mut r, d_h);
    let mut x = vec![0f32; m * heads * d_h];
    for t in 0..m {
        let scale = 0.2 + 3.0 * (t % 7) as f64 / 7.0;
        for h in 0..heads {
            let z = randn_vec(&mut r, d_h);
            for j in 0..d_h {
                x[t * heads * d_h + h * d_h + j] = (scale * (2.0 * common[j] + 0.5 * z[j])) as f32;
            }
        }
    }
    let a: Vec<f64> = (0..heads).flat_map(|_| random_spd(&mut r, d_h)).collect();
    let dd = d_h * d_h;
    let norm = |q: &[f64]| -> Vec<f64> {
        let r2 = q.iter().map(|v| v * v).sum::<f64>() / d_h as f64 + eps as f64;
        q.iter().map(|v| v / r2.sqrt()).collect()
    };
    let (mut brute, mut approx) = (vec![0f64; heads * dd], vec![0f64; heads * dd]);
    for t in 0..m {
        for h in 0..heads {
            let q: Vec<f64> = widen(&x[t * heads * d_h + h * d_h..][..d_h]);
            // J[i][k] = ∂n_i/∂q_k
            let mut jac = vec![0f64; dd];
            for k in 0..d_h {
                let step = 1e-6 * q[k].abs().max(1e-3);
                let (mut up, mut dn) = (q.clone(), q.clone());
                up[k] += step;
                dn[k] -= step;
                let (nu, nd) = (norm(&up), norm(&dn));
                for i in 0..d_h {
                    jac[i * d_h + k] = (nu[i] - nd[i]) / (2.0 * step);
                }
            }
            let ah = &a[h * dd..(h + 1) * dd];
            let r2 = q.iter().map(|v| v * v).sum::<f64>() / d_h as f64 + eps as f64;
            for i in 0..d_h {
                for j in 0..d_h {
                    let mut v = 0.0;
                    for p in 0..d_h {
                        for s in 0..d_h {
                            v += jac[p * d_h + i] * ah[p * d_h + s] * jac[s * d_h + j];
                        }
                    }
                    brute[h * dd + i * d_h + j] += v;
                    approx[h * dd + i * d_h + j] += ah[i * d_h + j] / r2;
                }
            }
        }
    }
    let ops = CpuBackend;
    let am = boa_cuda::ops::Mat::f64(a.clone(), heads, d_h, d_h);
    let mut acc = Accumulator::heads(&ops, heads, d_h).unwrap();
    let split = 300 * heads * d_h;
    acc.add_norm_jacobian(&ops, &Tensor::Host(x[..split].to_vec()), 300, &am, eps)
        .unwrap();
    acc.add_norm_jacobian(&ops, &Tensor::Host(x[split..].to_vec()), m - 300, &am, eps)
        .unwrap();
    assert_eq!(acc.n_tokens(), m);
    let got = values(acc);
    // `finish` scales by 2/N
    let scaled = |v: &[f64]| -> Vec<f64> { v.iter().map(|x| x * 2.0 / m as f64).collect() };
    let (brute, approx) = (scaled(&brute), scaled(&approx));
    let rel = |a: &[f64], b: &[f64]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        (num / b.iter().map(|y| y * y).sum::<f64>()).sqrt()
    };
    let (err, off) = (rel(&got, &brute), rel(&approx, &brute));
    println!("exact vs finite differences {err:.2e}; the diag approximation {off:.2e}");
    assert!(err < 1e-4, "exact form: rel. error {err:.3e}");
    assert!(off > 0.1, "the diag approximation is only {off:.3e} off");
}
