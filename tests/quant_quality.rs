//! Quality sanity on synthetic data (design.md §4.4, last point, scaled down): on correlated inputs the output
//! error ‖(W − Ŵ)Xᵀ‖ of GPTQ is below RTN's, and BoA's attention-aware loss Σ_h tr(ΔW_hᵀ H_row,h ΔW_h H_col)
//! (the quadratic form of H_col ⊗ H_row) is at most GPTQ's.

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::quant::boa::BoaOptions;
use boa_cuda::quant::gptq::GptqOptions;
use boa_cuda::quant::{QuantSpec, ScaleSearch};
use common::*;

/// tr(Δ H Δᵀ) = ‖Δ Xᵀ‖² · 2/N for H = (2/N) XᵀX.
fn layer_loss(w: &[f32], w_hat: &[f32], rows: usize, n: usize, h: &[f64]) -> f64 {
    let mut s = 0.0;
    for r in 0..rows {
        let d: Vec<f64> = (0..n)
            .map(|c| (w_hat[r * n + c] - w[r * n + c]) as f64)
            .collect();
        for i in 0..n {
            let hi: f64 = (0..n).map(|j| h[i * n + j] * d[j]).sum();
            s += d[i] * hi;
        }
    }
    s
}

/// Σ_h Σ_{j,j',c,c'} Δ_h[j,c] H_row,h[j,j'] H_col[c,c'] Δ_h[j',c'].
fn attention_loss(
    w: &[f32],
    w_hat: &[f32],
    nh: usize,
    dh: usize,
    n: usize,
    hc: &[f64],
    hr: &[f64],
) -> f64 {
    let mut s = 0.0;
    for h in 0..nh {
        let d: Vec<f64> = (0..dh * n)
            .map(|i| (w_hat[h * dh * n + i] - w[h * dh * n + i]) as f64)
            .collect();
        // M = Δ H_col [dh × n]
        let mut m = vec![0.0; dh * n];
        for j in 0..dh {
            for c in 0..n {
                m[j * n + c] = (0..n).map(|k| d[j * n + k] * hc[k * n + c]).sum();
            }
        }
        for j in 0..dh {
            for j2 in 0..dh {
                let dot: f64 = (0..n).map(|c| m[j * n + c] * d[j2 * n + c]).sum();
                s += hr[h * dh * dh + j * dh + j2] * dot;
            }
        }
    }
    s
}

#[test]
fn gptq_beats_rtn_on_correlated_inputs() {
    let (rows, n, n_tok) = (48, 96, 2000);
    let mut r = rng(11);
    let x = correlated_inputs(&mut r, n_tok, n);
    let h = xtx(&x, n_tok, n);
    let w = to_f32(&randn_vec(&mut r, rows * n));
    for spec in [
        QuantSpec::new(3, None, false, ScaleSearch::Hessian),
        QuantSpec::new(2, Some(32), false, ScaleSearch::Hessian),
        QuantSpec::new(4, None, true, ScaleSearch::Mse),
    ] {
        let gq = gptq_host(&w, rows, n, &h, &GptqOptions::new(spec)).unwrap();
        let rt_mm = rtn_host(
            &w,
            rows,
            n,
            None,
            &QuantSpec {
                search: ScaleSearch::MinMax,
                ..spec
            },
        )
        .unwrap();
        let rt_same = rtn_host(&w, rows, n, Some(&h), &spec).unwrap();
        let (eg, er, es) = (
            layer_loss(&w, &gq.w_hat, rows, n, &h),
            layer_loss(&w, &rt_mm.w_hat, rows, n, &h),
            layer_loss(&w, &rt_same.w_hat, rows, n, &h),
        );
        eprintln!("{spec:?}: GPTQ {eg:.4e}  RTN(min-max) {er:.4e}  RTN(same search) {es:.4e}");
        assert!(eg < 0.8 * er && eg < es, "GPTQ {eg} vs RTN {er} / {es}");
        // the Hessian search alone already helps RTN
        if spec.search == ScaleSearch::Hessian {
            assert!(es < er);
        }
    }
}

#[test]
fn boa_attention_loss_at_most_gptq() {
    let (nh, dh, n, n_tok) = (4, 16, 64, 1000);
    let mut r = rng(12);
    let x = correlated_inputs(&mut r, n_tok, n);
    let hc = xtx(&x, n_tok, n);
    let hr: Vec<f64> = (0..nh).flat_map(|_| random_spd(&mut r, dh)).collect();
    let w = to_f32(&randn_vec(&mut r, nh * dh * n));
    for (spec, act) in [
        (QuantSpec::new(3, None, false, ScaleSearch::Hessian), false),
        (
            QuantSpec::new(2, Some(16), false, ScaleSearch::Hessian),
            false,
        ),
        (QuantSpec::new(3, None, false, ScaleSearch::Hessian), true),
    ] {
        let g = GptqOptions::new(spec);
        let gq = gptq_host(&w, nh * dh, n, &hc, &g).unwrap();
        let mut o = BoaOptions::new(g);
        o.act_order_row = act;
        o.act_order_col = act;
        let bq = boa_host(&w, nh, dh, n, HostCol::Shared(&hc), &hr, &o).unwrap();
        let (lg, lb) = (
            attention_loss(&w, &gq.w_hat, nh, dh, n, &hc, &hr),
            attention_loss(&w, &bq.w_hat, nh, dh, n, &hc, &hr),
        );
        eprintln!("{spec:?} act={act}: attention-aware loss GPTQ {lg:.4e}  BoA {lb:.4e}");
        assert!(lb <= lg, "BoA {lb} > GPTQ {lg}");
    }
}
