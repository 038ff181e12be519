//! One pass over a block being quantized: the FP block's statistics on the calibration inputs, then the
//! linears the pass selects quantized and packed (every linear in one pass, or an MoE block's experts group
//! by group: pipeline/expert_groups.rs).

use super::options::{AllocProxy, Method, RunOptions};
use super::report::Timings;
use super::{
    StoredLinear, expert_groups, model_allocation, quantize_block, sensitivity, stats, store_block,
};
use crate::backend::{Backend, Tensor};
use crate::model::llama::{BlockWeights, ResidentWeights};
use crate::nvtx::ranged;
use anyhow::Context;
use std::time::Instant;

/// What one block's passes share (`quantize_pass`).
pub(super) struct BlockRun<'a> {
    pub(super) cfg: &'a crate::model::config::Config,
    pub(super) opts: &'a RunOptions,
    pub(super) layer: usize,
    pub(super) rope: &'a crate::model::llama::RopeTable,
    pub(super) x: &'a [Tensor],
    pub(super) needs_calib: bool,
    pub(super) chosen: Option<&'a model_allocation::ModelAllocation>,
    pub(super) timings: &'a mut Timings,
    /// The block's floor traffic (`run --profile`): its weights up, its packed linears down.
    pub(super) floor_bytes: &'a mut u64,
    /// `--asym-calib`: the FP model's activations at this block, chunked as `x`; the dense pass's statistics
    /// forward them through the FP block.
    pub(super) x_fp: Option<&'a mut [Tensor]>,
}

/// A quantized linear of a pass: its index, packed form, report, and Ŵ where the backend keeps it (None:
/// the host values, now in the block's weights).
pub(super) type Done = (
    usize,
    (StoredLinear, quantize_block::LinearReport, Option<Tensor>),
);

/// One pass over a block (all of it, or one group of its experts: pipeline/expert_groups.rs): the FP
/// block's statistics on X, the selected linears quantized and packed. Ŵ of a linear left on the host goes
/// into `w` (after this pass's statistics, so no later pass reads it: later passes read only experts of
/// their own group, and the linears outside the experts are quantized by the last pass); a grouped expert's
/// device Ŵ comes to the host too, to free the device for the next group.
pub(super) fn quantize_pass(
    be: &dyn Backend,
    w: &mut BlockWeights,
    resident: &mut ResidentWeights,
    pass: &expert_groups::Pass,
    run: &mut BlockRun<'_>,
) -> anyhow::Result<Vec<Done>> {
    let (cfg, opts, l) = (run.cfg, run.opts, run.layer);
    let select = pass.selection(&cfg.block);
    let stats = match run.needs_calib {
        true => Some(
            stats::collect_asym(
                be,
                w,
                Some(resident),
                cfg,
                run.rope,
                run.x,
                opts.method == Method::Boa && pass.dense,
                opts.exact_qk_norm(cfg) && pass.dense,
                stats::MoeStats {
                    group: pass.experts,
                    ..stats::MoeStats::of(opts)
                },
                run.x_fp.as_deref_mut().filter(|_| pass.dense),
            )
            .with_context(|| format!("layer {l}: statistics ({pass})"))?,
        ),
        false => None,
    };
    let timings = &mut *run.timings;
    if let Some(s) = &stats {
        timings.forward += s.forward_time.as_secs_f64();
        timings.statistics += s.stats_time.as_secs_f64();
        timings.v_col += s.v_col_time.as_secs_f64();
    }
    // Before the quantize timer, whose parts (factor, search, sweep) `take` then restarts. (--avg-bits is
    // refused with experts in groups: `expert_group`.)
    let measured = match &stats {
        _ if run.chosen.is_some() => run.chosen.and_then(|c| c.errors[l].clone()),
        Some(s)
            if let Some(alloc) = &opts.bits
                && alloc.proxy() == AllocProxy::Output =>
        {
            let t = Instant::now();
            let m = ranged(c"allocation proxy", || {
                sensitivity::output_errors(
                    be,
                    w,
                    resident,
                    s,
                    cfg,
                    run.rope,
                    run.x,
                    opts,
                    l,
                    &quantize_block::alloc_units(cfg, alloc),
                )
            })?;
            timings.alloc_proxy += t.elapsed().as_secs_f64();
            Some(m)
        }
        _ => None,
    };
    crate::quant::profile::fence(be);
    let t = Instant::now();
    crate::quant::profile::take();
    // W is quantized where the FP forward read it (the device copy on a GPU).
    let mut weights = quantize_block::weight_mats(w, resident, &select);
    let moves = match (&stats, opts.asym_calib) {
        (Some(s), Some(alpha)) => asym_targets(be, &mut weights, s, cfg, opts, alpha, &select, l)?,
        _ => vec![None; select.len()],
    };
    let quantized = ranged(c"quantize block", || {
        quantize_block::quantize_block(
            be,
            &weights,
            stats.as_ref(),
            cfg,
            quantize_block::QkNorms::of(w),
            opts,
            l,
            measured.as_deref(),
            run.chosen.and_then(|c| c.bits[l].as_deref()),
            &select,
        )
    })?;
    if !be.traffic().source.is_empty() {
        // The weights went up in f32 (ResidentWeights::upload) for the FP forward.
        *run.floor_bytes += weights.iter().map(|m| 4 * m.len() as u64).sum::<u64>()
            + if pass.dense {
                resident.online_bytes()
            } else {
                0
            };
    }
    drop(weights);
    let index: Vec<usize> = (0..select.len()).filter(|&i| select[i]).collect();
    let types: Vec<_> = index
        .iter()
        .map(|&i| quantize_block::gguf_type(opts, cfg, l, &cfg.block.linears[i]))
        .collect();
    let packed = store_block(be, &quantized, &types)
        .with_context(|| format!("layer {l}: packing ({pass})"))?;
    // qweight words, then scales and zeros as f32 (QuantOps::pack's downloads).
    *run.floor_bytes += packed.iter().map(StoredLinear::down_bytes).sum::<u64>();
    crate::quant::profile::fence(be);
    timings.quantize += t.elapsed().as_secs_f64();
    let [factor, search, sweep] = crate::quant::profile::take();
    (timings.factor, timings.search, timings.sweep) = (
        timings.factor + factor,
        timings.search + search,
        timings.sweep + sweep,
    );
    drop(stats);
    anyhow::ensure!(
        quantized.len() == index.len() && packed.len() == index.len(),
        "layer {l}: {pass} quantized {} linears of {}",
        quantized.len(),
        index.len()
    );
    let mut done = Vec::with_capacity(index.len());
    for ((i, (q, mut r)), p) in index.into_iter().zip(quantized).zip(packed) {
        use crate::ops::MatData;
        r.target_move = moves[i];
        let lin = &mut w.linears[i];
        let hat = match q.w_hat.data {
            MatData::F32(Tensor::Host(v)) => {
                lin.w = v;
                None
            }
            MatData::F32(t) if pass.experts.is_some() && cfg.block.linears[i].expert.is_some() => {
                lin.w = be
                    .read(&t)
                    .with_context(|| format!("layer {l}: reading back Ŵ of {}", r.name))?
                    .into_owned();
                None
            }
            MatData::F32(t) => Some(t),
            MatData::F64(_) => anyhow::bail!("{}: Ŵ came back in f64", r.name),
        };
        done.push((i, (p, r, hat)));
    }
    Ok(done)
}

/// `--asym-calib`: each selected dense linear's W replaced by its asymmetric target (quant/asym.rs), the one
/// the sweep then fits; the linears that read one input share its factor (one `ridge_shift` per input).
/// Returns each linear's move (`LinearReport::target_move`; one read of the block's sums). BoA's V too: its
/// target fits V's own output (before attention mixes the tokens) on the FP input, with the plain input's H
/// and D, and the sweep then fits that target in BoA's attention-weighted metric.
#[allow(clippy::too_many_arguments)]
fn asym_targets(
    be: &dyn Backend,
    weights: &mut [crate::ops::Mat],
    s: &stats::BlockStats,
    cfg: &crate::model::config::Config,
    opts: &RunOptions,
    alpha: f64,
    select: &[bool],
    l: usize,
) -> anyhow::Result<Vec<Option<f64>>> {
    let mut moves = vec![None; select.len()];
    let Some(dxx) = &s.dxx else {
        return Ok(moves);
    };
    // tr(ΔT H ΔTᵀ) and tr(W H Wᵀ) of linear i, in slots 2i and 2i + 1.
    let mut sums = be.quad_sums(2 * select.len())?;
    let mut moved = Vec::new();
    for k in 0..dxx.sums.len() {
        let group: Vec<usize> = (0..select.len())
            .filter(|&i| select[i] && stats::asym_slot(cfg.block.linears[i].input()) == Some(k))
            .collect();
        let Some(&first) = group.first() else {
            continue;
        };
        let names = group
            .iter()
            .map(|&i| cfg.block.linears[i].name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let (Some(h), Some(d)) = (s.h_col(&cfg.block.linears[first]), dxx.sums[k].as_ref()) else {
            anyhow::bail!(
                "layer {l} {names}: asymmetric calibration has no H or D for their input"
            );
        };
        let ws: Vec<&crate::ops::Mat> = group.iter().map(|&i| &weights[i]).collect();
        let targets = be
            .ridge_shift(&ws, d, dxx.scale, h, opts.damp, alpha)
            .with_context(|| format!("layer {l} {names}: the asymmetric target"))?
            .with_context(|| {
                format!("layer {l} {names}: the asymmetric target (H + μI does not factor, or it is not finite)")
            })?;
        for (&i, t) in group.iter().zip(targets) {
            let name = &cfg.block.linears[i].name;
            let delta = be.sub(&t, &weights[i])?;
            be.quad_forms_into(&mut sums, 2 * i, h, &[&delta, &weights[i]])
                .with_context(|| format!("layer {l} {name}: the asymmetric target's move"))?;
            moved.push(i);
            weights[i] = t;
        }
    }
    if !moved.is_empty() {
        let v = be
            .read_quad_sums(&sums)
            .with_context(|| format!("layer {l}: the asymmetric targets' moves"))?;
        for i in moved {
            moves[i] = Some(v[2 * i] / v[2 * i + 1]);
        }
    }
    Ok(moves)
}
