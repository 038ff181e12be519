//! Quantizes the seven linear layers of one block from its statistics: q/k/v by BoA (or GPTQ/RTN per
//! --method), o and the MLP by GPTQ (RTN for --method rtn). Device-agnostic: it calls `quant/` only.

use super::options::{Method, RunOptions, ScaleSearchArg, VRowHessian};
use super::stats::BlockStats;
use crate::backend::quant_ops::QuantOps;
use crate::model::Config;
use crate::model::llama::{BlockWeights, LINEAR_NAMES};
use crate::quant::boa::{BoaOptions, ColHessian, boa_quantize_cached, boa_quantize_with};
use crate::quant::gptq::{FactorCache, GptqOptions, Quantized, gptq_quantize_cached};
use crate::quant::hessian::{
    RopeAverage, identity_row_hessians, k_row_hessians, q_row_hessians, v_row_hessians_from_wout,
};
use crate::quant::rtn::rtn_quantize;
use crate::quant::{QuantSpec, ScaleSearch};
use anyhow::Context;
use std::time::Instant;

/// What happened to one linear layer, for report.json.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LinearReport {
    pub name: String,
    pub method: &'static str,
    /// tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) on the calibration inputs (H = the layer's input covariance): the relative
    /// output error of round-to-nearest with min-max scales ("before") and of the method ("after").
    pub rtn_error: f64,
    pub error: f64,
    pub seconds: f64,
}

pub fn spec(opts: &RunOptions) -> QuantSpec {
    let search = match opts.scale_search {
        ScaleSearchArg::Hessian => ScaleSearch::Hessian,
        ScaleSearchArg::Mse => ScaleSearch::Mse,
        ScaleSearchArg::Minmax => ScaleSearch::MinMax,
    };
    QuantSpec::new(opts.wbits, opts.group_size, opts.sym, search)
}

fn gptq_options(opts: &RunOptions, seqlen: usize) -> GptqOptions {
    let mut g = GptqOptions::new(spec(opts));
    g.act_order = opts.act_order;
    g.static_groups = opts.static_groups;
    g.damp = opts.damp;
    g.dead_diag = 1.0 / seqlen as f64;
    g
}

/// Relative Hessian-weighted errors tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) of several approximations Ŵ of one W: the
/// denominator is computed once, each numerator with one f64 GEMM.
pub fn relative_errors(w: &[f32], w_hats: &[&[f32]], h: &[f64], d_in: usize) -> Vec<f64> {
    use faer::{Accum, Mat, MatRef, Par, linalg::matmul::matmul};
    let d_out = w.len() / d_in;
    let hm = MatRef::from_row_major_slice(h, d_in, d_in);
    let quad = |v: &dyn Fn(usize) -> f64| -> f64 {
        let a = Mat::<f64>::from_fn(d_out, d_in, |r, c| v(r * d_in + c));
        let mut ah = Mat::<f64>::zeros(d_out, d_in);
        matmul(
            ah.as_mut(),
            Accum::Replace,
            a.as_ref(),
            hm,
            1.0,
            Par::rayon(0),
        );
        let mut total = 0.0;
        for c in 0..d_in {
            for r in 0..d_out {
                total += a[(r, c)] * ah[(r, c)];
            }
        }
        total
    };
    let den = quad(&|i| w[i] as f64);
    w_hats
        .iter()
        .map(|w_hat| {
            let num = quad(&|i| (w[i] - w_hat[i]) as f64);
            if den > 0.0 { num / den } else { 0.0 }
        })
        .collect()
}

/// Quantizes every linear of `w` in place (weights replaced by their dequantized values) and returns the
/// quantized matrices (for packed exports) with their reports. `ops`: the backend that factors and sweeps
/// (None: `quant::`'s own code).
pub fn quantize_block(
    w: &mut BlockWeights,
    stats: Option<&BlockStats>,
    cfg: &Config,
    opts: &RunOptions,
    layer: usize,
    ops: Option<&dyn QuantOps>,
) -> anyhow::Result<Vec<(Quantized<f32>, LinearReport)>> {
    let seqlen = opts.seqlen;
    let g = gptq_options(opts, seqlen);
    // Each input covariance once: q/k/v share one, gate/up share one.
    let hessians = stats.map(|s| {
        [
            s.h_attn.hessian(),
            s.h_o.hessian(),
            s.h_mlp.hessian(),
            s.h_down.hessian(),
        ]
    });
    // q/k (and v under GPTQ) factor the attention input's H once, gate/up the MLP input's.
    let factors = FactorCache::new();
    let rope = RopeAverage::new(&cfg.inv_freq(), seqlen);
    let w_o = w.o.w.clone();
    let mut out = Vec::with_capacity(7);
    for name in LINEAR_NAMES {
        let start = Instant::now();
        let lin = w.linear(name).clone();
        let (d_out, d_in) = (lin.d_out, lin.d_in);
        let h: Option<&[f64]> = hessians.as_ref().map(|hs| {
            hs[match name {
                "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj" => 0,
                "self_attn.o_proj" => 1,
                "mlp.gate_proj" | "mlp.up_proj" => 2,
                _ => 3,
            }]
            .as_slice()
        });
        let is_qkv = matches!(
            name,
            "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj"
        );
        let ctx = || format!("layer {layer} {name}");
        let (q, method) = match (opts.method, h) {
            (Method::Rtn, _) | (_, None) => {
                let hs = h.filter(|_| opts.scale_search == ScaleSearchArg::Hessian);
                (
                    rtn_quantize(&lin.w, d_out, d_in, hs, &spec(opts)).with_context(ctx)?,
                    "rtn",
                )
            }
            (Method::Boa, Some(h)) if is_qkv => {
                let s = stats.expect("BoA has statistics");
                let (n_heads, d_h) = (d_out / cfg.d_h, cfg.d_h);
                let mut b = BoaOptions::new(g.clone());
                b.act_order_col = opts.act_order;
                b.act_order_row = opts.act_order_row;
                // W_Q and W_K share H_col (and its factor, through `factors`); W_V's per-head H_col are its own.
                let q = match name {
                    "self_attn.q_proj" | "self_attn.k_proj" => {
                        let h_row = if name == "self_attn.q_proj" {
                            q_row_hessians(&s.c_k.covariances(), cfg.n_heads, cfg.n_kv_heads, &rope)
                        } else {
                            k_row_hessians(&s.c_q.group_means(cfg.n_kv_heads), &rope)
                        };
                        boa_quantize_cached(
                            &lin.w,
                            n_heads,
                            d_h,
                            d_in,
                            ColHessian::Shared(h),
                            &h_row,
                            &b,
                            ops,
                            Some(&factors),
                        )
                    }
                    _ => {
                        let v_col = s
                            .v_col
                            .as_ref()
                            .expect("BoA collects V statistics")
                            .hessians();
                        let h_row = match opts.v_row_hessian {
                            VRowHessian::Identity => identity_row_hessians(cfg.n_kv_heads, d_h),
                            VRowHessian::Wout => v_row_hessians_from_wout(
                                &w_o,
                                cfg.d,
                                cfg.n_heads,
                                cfg.n_kv_heads,
                                d_h,
                            ),
                        };
                        boa_quantize_with(
                            &lin.w,
                            n_heads,
                            d_h,
                            d_in,
                            ColHessian::PerHead(&v_col),
                            &h_row,
                            &b,
                            ops,
                        )
                    }
                };
                (q.with_context(ctx)?, "boa")
            }
            (_, Some(h)) => (
                gptq_quantize_cached(&lin.w, d_out, d_in, h, &g, ops, Some(&factors))
                    .with_context(ctx)?,
                "gptq",
            ),
        };
        let (rtn_error, error) = match h {
            Some(h) => {
                let minmax =
                    QuantSpec::new(opts.wbits, opts.group_size, opts.sym, ScaleSearch::MinMax);
                let r = rtn_quantize(&lin.w, d_out, d_in, None, &minmax).with_context(ctx)?;
                let e = relative_errors(&lin.w, &[&r.w_hat, &q.w_hat], h, d_in);
                (e[0], e[1])
            }
            None => (f64::NAN, f64::NAN),
        };
        w.linear_mut(name).w.clone_from(&q.w_hat);
        let seconds = start.elapsed().as_secs_f64();
        out.push((
            q,
            LinearReport {
                name: name.into(),
                method,
                rtn_error,
                error,
                seconds,
            },
        ));
    }
    Ok(out)
}
