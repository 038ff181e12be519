//! The bit allocation's measured proxy (`--alloc-proxy output`, issue 23): each linear's error at each width
//! of `--bit-choices`, measured on the block's output. The RTN proxy (`--alloc-proxy rtn`: min-max RTN's
//! tr(ΔW H ΔWᵀ) on the linear's own input covariance) gives each linear's error in its own output's units, so
//! q/k (whose outputs reach the block's output through a softmax), v (through the attention and W_O) and
//! gate/up (through SiLU and W_down) are compared with o/down (which add to the residual stream) in different
//! units. Here each linear alone is quantized by GPTQ at the width, the block runs on some calibration
//! sequences with that one Ŵ, and its error is ‖Y − Y_FP‖² over them: the allocation then weighs every linear
//! by what it does to the block's output. Cost: |choices| GPTQ runs per linear and |choices| · linears + 1
//! forwards of those sequences.

use super::options::RunOptions;
use super::quantize_block::{gptq_options, linear_spec};
use super::stats::BlockStats;
use crate::backend::{Backend, Tensor};
use crate::model::Config;
use crate::model::llama::{BlockWeights, RopeTable, block_forward};
use crate::ops::Mat;
use crate::quant::gptq::gptq_quantize;
use anyhow::Context;

/// Calibration sequences the proxy forwards (the first ones of the first chunk).
pub const SEQUENCES: usize = 8;

/// Per linear (description order), its measured error at each of the allocation's widths; a linear without
/// H (an under-routed expert's down_proj) gets zeros, as the RTN proxy gives it.
#[allow(clippy::too_many_arguments)]
pub fn output_errors(
    be: &dyn Backend,
    w: &BlockWeights,
    stats: &BlockStats,
    cfg: &Config,
    rope: &RopeTable,
    x: &[Tensor],
    opts: &RunOptions,
    layer: usize,
) -> anyhow::Result<Vec<Vec<f64>>> {
    let alloc = opts
        .bits
        .as_ref()
        .context("the output proxy needs --avg-bits")?;
    let per_seq = rope.t * cfg.d;
    let first = x.first().context("no calibration activations")?;
    let Tensor::Host(x0) = first else {
        anyhow::bail!("--alloc-proxy output runs on the CPU only");
    };
    let ns = (x0.len() / per_seq).min(SEQUENCES);
    let xs = &x0[..ns * per_seq];
    let forward = |w: &BlockWeights| -> anyhow::Result<Vec<f32>> {
        let mut t = Tensor::Host(xs.to_vec());
        block_forward(be, w, None, cfg, rope, &mut t, ns, None)?;
        match t {
            Tensor::Host(v) => Ok(v),
            _ => anyhow::bail!("the block's output left the host"),
        }
    };
    let y_fp = forward(w)?;
    // One copy of the block; each measurement swaps one linear's Ŵ in and the FP weights back.
    let mut wq = w.clone();
    let mut out = Vec::with_capacity(w.linears.len());
    for (i, ld) in cfg.block.linears.iter().enumerate() {
        let Some(h) = stats.h_col(ld) else {
            out.push(vec![0.0; alloc.choices.len()]);
            continue;
        };
        let lin = &w.linears[i];
        let wm = Mat::f32(lin.w.clone(), 1, lin.d_out, lin.d_in);
        let mut errs = Vec::with_capacity(alloc.choices.len());
        for &b in &alloc.choices {
            let spec = linear_spec(be, opts, cfg, layer, ld, b)?;
            let q = gptq_quantize(be, &wm, h, &gptq_options(opts, opts.seqlen, spec), None)
                .with_context(|| format!("layer {layer} {}: output proxy at {b} bits", ld.name))?;
            let fp = std::mem::replace(&mut wq.linears[i].w, be.read_f32(&q.w_hat)?);
            let y = forward(&wq);
            wq.linears[i].w = fp;
            let y = y?;
            let e: f64 = y
                .iter()
                .zip(&y_fp)
                .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                .sum();
            errs.push(e);
        }
        out.push(errs);
    }
    Ok(out)
}
