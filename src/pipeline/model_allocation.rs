//! `--avg-bits` under one budget for the whole model (`--alloc-scope model`, issue 23): before any block is
//! quantized, a pass of the FP model over the calibration activations measures every selected block's
//! output-proxy errors (pipeline/sensitivity.rs) on its FP inputs, and `quant::allocate::allocate_model`
//! picks all the widths at once, so a block whose errors fall fast with bits can take them from one whose
//! errors barely move. The quantizing pass then uses those widths and reports those errors. The pass costs
//! what the per-block proxy costs, plus the statistics and a forward of each block up to the last selected
//! one on FP inputs; a resumed run makes it again (it is deterministic, so the widths are the same).

use super::forward_all;
use super::options::{LayerSet, RunOptions};
use super::quantize_block::{alloc_units, unit_candidates};
use super::sensitivity::output_errors;
use super::stats::{self, MoeStats};
use crate::backend::{Backend, Tensor};
use crate::model::llama::{Model, ResidentWeights, RopeTables};
use crate::progress::Progress;
use crate::quant::allocate::{Candidate, allocate_model, spread_units};
use anyhow::Context;

/// Per block (None where not quantized): each linear's width, and each allocation unit's predicted errors at
/// every choice.
pub struct ModelAllocation {
    pub bits: Vec<Option<Vec<u32>>>,
    pub errors: Vec<Option<Vec<Vec<f64>>>>,
}

/// Measures the selected blocks on the FP model's activations `x` (consumed: each block's forward
/// overwrites them) and allocates the widths under `opts.bits`' average over all their weights.
#[allow(clippy::too_many_arguments)]
pub fn allocate(
    be: &dyn Backend,
    model: &Model,
    opts: &RunOptions,
    layers: &LayerSet,
    ropes: &RopeTables,
    mut x: Vec<Tensor>,
    progress: Progress,
) -> anyhow::Result<ModelAllocation> {
    let alloc = opts
        .bits
        .as_ref()
        .context("the model-wide allocation needs --avg-bits")?;
    let cfg = &model.cfg;
    let last = layers.last();
    let unit = alloc_units(cfg, alloc);
    let mut errors: Vec<Option<Vec<Vec<f64>>>> = vec![None; cfg.n_layers];
    let mut bar = progress.bar("allocation (FP pass)", (last + 1) as u64, "blocks");
    for (l, slot) in errors.iter_mut().enumerate().take(last + 1) {
        let rope = ropes.layer(l);
        let ctx = || format!("layer {l}: bit allocation (--alloc-scope model)");
        let mut w = model.load_block(l).with_context(ctx)?;
        let mut resident = ResidentWeights::upload_now(be, &w).with_context(ctx)?;
        if layers.contains(l) {
            // GPTQ on XᵀX is all the proxy runs: no attention-aware statistics. An MoE block's experts get
            // the statistics the quantizing pass gives them (routed tokens or router-weighted, fallback).
            let s = stats::collect(
                be,
                &w,
                Some(&resident),
                cfg,
                rope,
                &x,
                false,
                false,
                MoeStats::of(opts),
            )
            .with_context(ctx)?;
            let e = output_errors(be, &mut w, &mut resident, &s, cfg, rope, &x, opts, l, &unit)
                .with_context(ctx)?;
            *slot = Some(e);
        }
        if l < last {
            forward_all(be, &w, &resident, cfg, rope, &mut x).with_context(ctx)?;
        }
        bar.inc(1);
    }
    bar.finish();
    let blocks: Vec<Vec<Candidate>> = errors
        .iter()
        .flatten()
        .map(|e| unit_candidates(cfg, &unit, e))
        .collect();
    let picks =
        allocate_model(&alloc.choices, &blocks, alloc.avg).map_err(|m| crate::input_err!("{m}"))?;
    let mut picks = picks.into_iter().map(|p| spread_units(&p, &unit));
    let bits = errors
        .iter()
        .map(|e| {
            e.as_ref().map(|_| {
                picks
                    .next()
                    .unwrap_or_default()
                    .iter()
                    .map(|&i| alloc.choices[i])
                    .collect()
            })
        })
        .collect();
    Ok(ModelAllocation { bits, errors })
}
