//! Quantizes the linears of one block, as its description lists them, from its statistics: the attention
//! projections q/k/v by BoA (or GPTQ/RTN per --method), the others by GPTQ (RTN for --method rtn), each on
//! the covariance of the input it reads. Device-agnostic: it calls `quant/` and `QuantOps`
//! only, on weights and statistics that stay where the backend keeps them.

use super::options::{AllocUnit, BitAllocation, Method, RunOptions, ScaleSearchArg, VRowHessian};
use super::stats::BlockStats;
use crate::model::Config;
use crate::model::arch::{Input, LinearDesc, NormRole, Role};
use crate::model::gguf::GgmlType;
use crate::model::gguf::codec::codec;
use crate::model::llama::BlockWeights;
use crate::ops::{
    Mat, QuadSums, QuantOps, QuantSpec, QuantizedLinear, Result, ScaleSearch, SweepError,
};
use crate::quant::allocate::{Candidate, allocate, merge_units, spread_units};
use crate::quant::boa::{BoaOptions, ColHessian, boa_quantize};
use crate::quant::gptq::{GptqOptions, gptq_quantize};
use crate::quant::plan::{FactorCache, batches};
use crate::quant::rtn::rtn_quantize;
use anyhow::Context;
use std::time::Instant;

/// What happened to one linear layer, for report.json.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LinearReport {
    pub name: String,
    pub method: &'static str,
    /// tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) on the calibration inputs (H = the layer's input covariance): the relative
    /// output error of round-to-nearest with min-max scales ("before") and of the method ("after"). GPTQ's
    /// comes from its sweep's own loss (`Swept::loss`); the others from `QuantOps::quad_forms`.
    pub rtn_error: f64,
    pub error: f64,
    /// Its bit width (--wbits, or chosen by --avg-bits).
    pub bits: u32,
    pub seconds: f64,
    /// An expert's linears: the calibration tokens routed to it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    /// Under --avg-bits: the predicted error at each of --bit-choices that the allocation compared
    /// (--alloc-proxy: the block's output error, or min-max RTN's tr(ΔW H ΔWᵀ)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Vec<f64>>,
    /// Under --asym-calib: how far its target T moved from W, tr(ΔT H ΔTᵀ) / tr(W H Wᵀ) with ΔT = T − W, in
    /// the units of `error` (which is measured from T).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_move: Option<f64>,
}

fn search(opts: &RunOptions) -> ScaleSearch {
    match opts.scale_search {
        ScaleSearchArg::Hessian => ScaleSearch::Hessian,
        ScaleSearchArg::Mse => ScaleSearch::Mse,
        ScaleSearchArg::Minmax => ScaleSearch::MinMax,
    }
}

pub fn spec(opts: &RunOptions, bits: u32) -> QuantSpec {
    QuantSpec::new(bits, opts.group_size.columns(), opts.sym, search(opts))
}

/// The GGUF block type of linear `ld` of block `layer` under `--gguf-type` (None without it).
pub fn gguf_type(
    opts: &RunOptions,
    cfg: &Config,
    layer: usize,
    ld: &LinearDesc,
) -> Option<GgmlType> {
    let n_gqa = cfg.n_heads / cfg.n_kv_heads.max(1);
    let n_expert = cfg.block.moe.as_ref().map_or(0, |m| m.n_experts);
    opts.gguf_type
        .map(|t| t.linear_type(ld.role, layer, cfg.n_layers, ld.d_in, n_gqa, n_expert))
}

/// What linear `ld` is quantized to: its GGUF type's grids under `--gguf-type` (model/gguf/codec.rs), else
/// `bits` with the run's groups and symmetry.
pub fn linear_spec(
    ops: &dyn QuantOps,
    opts: &RunOptions,
    cfg: &Config,
    layer: usize,
    ld: &LinearDesc,
    bits: u32,
) -> Result<QuantSpec> {
    let s = match gguf_type(opts, cfg, layer, ld) {
        Some(ty) => codec(ty)
            .map(|c| c.spec(search(opts)))
            .ok_or_else(|| crate::input_err!("{}: GGUF type {ty} is not written", ld.name))?,
        None => spec(opts, bits),
    };
    Ok(s.signed_if(opts.signed_scales && ops.signed_scales()))
}

pub fn gptq_options(opts: &RunOptions, seqlen: usize, spec: QuantSpec) -> GptqOptions {
    let mut g = GptqOptions::new(spec);
    g.act_order = opts.act_order;
    g.static_groups = opts.static_groups;
    g.damp = opts.damp;
    g.dead_diag = 1.0 / seqlen as f64;
    g
}

/// tr(W H Wᵀ) and tr(ΔW H ΔWᵀ) of min-max RTN at `bits`, H undamped: the report's "before" figure and
/// the bit allocation's predicted error.
fn rtn_forms(
    ops: &dyn QuantOps,
    w: &Mat,
    h: &Mat,
    opts: &RunOptions,
    bits: &[u32],
) -> Result<(f64, Vec<f64>)> {
    let mut deltas = Vec::with_capacity(bits.len());
    for &b in bits {
        let minmax = QuantSpec {
            search: ScaleSearch::MinMax,
            ..spec(opts, b)
        };
        let rtn = rtn_quantize(ops, w, None, &minmax)?;
        deltas.push(ops.sub(w, &rtn.w_hat)?);
    }
    let mut mats = vec![w];
    mats.extend(deltas.iter());
    let forms = ops.quad_forms(h, &mats)?;
    Ok((forms[0], forms[1..].to_vec()))
}

/// Where the quadratic forms of one linear's relative errors come from: a value already known, or a slot of
/// the block's `QuadSums`.
#[derive(Clone, Copy)]
enum Form {
    Known(f64),
    Slot(usize),
    /// A GPTQ sweep's Σ e² and ‖Q − W‖² in this slot and the next, with its damping λ (`SweepError`).
    Sweep(usize, f64),
}

impl Form {
    fn value(self, sums: &[f64]) -> f64 {
        match self {
            Form::Known(v) => v,
            Form::Slot(i) => sums[i],
            Form::Sweep(i, damp) => SweepError::value(damp, sums[i], sums[i + 1]),
        }
    }
}

/// The forms of tr(W H Wᵀ), min-max RTN's and the method's tr(ΔW H ΔWᵀ).
type ErrorForms = [Form; 3];

/// Queues the relative errors (min-max RTN, the method) of `q` against W with H (undamped) into `sums` from
/// slot `*next` on: tr(W H Wᵀ) and tr(ΔW_rtn H ΔW_rtnᵀ) unless `known` (the allocation computed them), and
/// tr(ΔW H ΔWᵀ) of the method (its sweep's own sums when it has them). Nothing is read back here: the block's
/// report reads every linear's forms at once (`relative`).
#[allow(clippy::too_many_arguments)]
fn queue_errors(
    ops: &dyn QuantOps,
    sums: &mut QuadSums,
    next: &mut usize,
    w: &Mat,
    q: &QuantizedLinear,
    h: &Mat,
    spec: &QuantSpec,
    known: Option<(f64, f64)>,
) -> Result<ErrorForms> {
    let mut mats = Vec::with_capacity(3);
    if known.is_none() {
        // Min-max RTN on the same grids (a GGUF type's lattice included).
        let minmax = QuantSpec {
            search: ScaleSearch::MinMax,
            ..*spec
        };
        let rtn = rtn_quantize(ops, w, None, &minmax)?;
        mats.push(ops.sub(w, &rtn.w_hat)?);
    }
    if q.error.is_none() {
        mats.push(ops.sub(w, &q.w_hat)?);
    }
    let mut refs: Vec<&Mat> = Vec::with_capacity(3);
    if known.is_none() {
        refs.push(w);
    }
    refs.extend(mats.iter());
    let first = *next;
    if !refs.is_empty() {
        ops.quad_forms_into(sums, first, h, &refs)?;
    }
    *next += refs.len();
    let mut slot = first;
    let mut take = || {
        slot += 1;
        Form::Slot(slot - 1)
    };
    let (w_form, rtn_form) = match known {
        Some((wf, rf)) => (Form::Known(wf), Form::Known(rf)),
        None => (take(), take()),
    };
    let after = match &q.error {
        Some(e) => {
            ops.queue_sums(sums, *next, &e.sums)?;
            *next += 2;
            Form::Sweep(*next - 2, e.damp)
        }
        None => take(),
    };
    Ok([w_form, rtn_form, after])
}

/// The relative errors (min-max RTN, the method) of `forms` once the block's sums are read.
fn relative(forms: ErrorForms, sums: &[f64]) -> (f64, f64) {
    let [w_form, rtn_form, after] = forms.map(|f| f.value(sums));
    let rel = |num: f64| if w_form > 0.0 { num / w_form } else { 0.0 };
    (rel(rtn_form), rel(after))
}

/// tr(W H Wᵀ) and min-max RTN's tr(ΔW H ΔWᵀ) at the linear's width, when the allocation computed them.
type KnownForms = Option<(f64, f64)>;

/// Each linear's bit width and, under --avg-bits, the errors the allocation predicted at each width.
struct Widths {
    bits: Vec<u32>,
    /// tr(W H Wᵀ) and min-max RTN's error at the chosen width, when the RTN proxy computed them.
    known: Vec<KnownForms>,
    predicted: Vec<Option<Vec<f64>>>,
}

/// Each linear's bit width: --wbits, or under --avg-bits the allocation of the errors `measured` gives per
/// allocation unit (--alloc-proxy output) or else of min-max RTN's, or the model-wide allocation's widths
/// (`chosen`, with the errors it compared in `measured`). A linear without H (an under-routed expert's down_proj) predicts
/// no error, so it gets the narrowest width.
#[allow(clippy::too_many_arguments)]
fn linear_bits(
    ops: &dyn QuantOps,
    weights: &[Mat],
    stats: Option<&BlockStats>,
    cfg: &Config,
    opts: &RunOptions,
    layer: usize,
    measured: Option<&[Vec<f64>]>,
    chosen: Option<&[u32]>,
) -> Result<Widths> {
    let n = cfg.block.linears.len();
    let Some(alloc) = &opts.bits else {
        return Ok(Widths {
            bits: vec![opts.wbits; n],
            known: vec![None; n],
            predicted: vec![None; n],
        });
    };
    let unit = alloc_units(cfg, alloc);
    // The report's predicted errors per linear: under the output proxy, its unit's (measured together).
    let per_linear = |m: &[Vec<f64>]| -> Vec<Option<Vec<f64>>> {
        unit.iter().map(|&u| m.get(u).cloned()).collect()
    };
    if let Some(bits) = chosen {
        return Ok(Widths {
            bits: bits.to_vec(),
            known: vec![None; n],
            predicted: match measured {
                Some(m) => per_linear(m),
                None => vec![None; n],
            },
        });
    }
    if let Some(m) = measured {
        let pick = allocate(&alloc.choices, &unit_candidates(cfg, &unit, m), alloc.avg)
            .map_err(|e| crate::input_err!("layer {layer}: {e}"))?;
        return Ok(Widths {
            bits: spread_units(&pick, &unit)
                .iter()
                .map(|&i| alloc.choices[i])
                .collect(),
            known: vec![None; n],
            predicted: per_linear(m),
        });
    }
    let mut cands = Vec::with_capacity(n);
    let mut w_forms = Vec::with_capacity(n);
    for (i, ld) in cfg.block.linears.iter().enumerate() {
        let (w_form, errors) = match stats.and_then(|s| s.h_col(ld)) {
            Some(h) => rtn_forms(ops, &weights[i], h, opts, &alloc.choices)
                .with_context(|| format!("layer {layer} {}: bit allocation", ld.name))?,
            None => (f64::NAN, vec![0.0; alloc.choices.len()]),
        };
        w_forms.push(w_form);
        cands.push(Candidate {
            weights: ld.d_out * ld.d_in,
            errors,
        });
    }
    let pick = allocate(&alloc.choices, &merge_units(&cands, &unit), alloc.avg)
        .map(|p| spread_units(&p, &unit))
        .map_err(|m| crate::input_err!("layer {layer}: {m}"))?;
    let bits = pick.iter().map(|&i| alloc.choices[i]).collect();
    let known = pick
        .iter()
        .zip(&cands)
        .zip(&w_forms)
        .map(|((&i, c), &wf)| wf.is_finite().then_some((wf, c.errors[i])))
        .collect();
    Ok(Widths {
        bits,
        known,
        predicted: cands.into_iter().map(|c| Some(c.errors)).collect(),
    })
}

/// One candidate per allocation unit from its measured errors (`m[u]`), its weights its linears' sum.
pub(super) fn unit_candidates(cfg: &Config, unit: &[usize], m: &[Vec<f64>]) -> Vec<Candidate> {
    m.iter()
        .enumerate()
        .map(|(u, errors)| Candidate {
            weights: cfg
                .block
                .linears
                .iter()
                .zip(unit)
                .filter(|&(_, &v)| v == u)
                .map(|(ld, _)| ld.d_out * ld.d_in)
                .sum(),
            errors: errors.clone(),
        })
        .collect()
}

/// Which allocation unit each linear of the block (description order) is in, numbered from 0 in order of
/// first appearance. Under `--alloc-unit linear` each linear has its own, and under `fused` the linears that
/// read one input (q/k/v; gate/up) share one. An MoE block's routed experts never get widths of their own:
/// under `linear` all experts' gate_proj share one unit (and up, and down: three units), under `fused` every
/// expert linear of the block is one unit. vLLM runs a block's experts as one fused layer with one scheme,
/// and llama.cpp stores each part of every expert in one tensor of one type; measuring each expert's linears
/// alone would also cost the output proxy 3 · n_experts · |choices| forwards per block.
pub(super) fn alloc_units(cfg: &Config, alloc: &BitAllocation) -> Vec<usize> {
    #[derive(PartialEq)]
    enum Key {
        Linear(usize),
        Input(Input),
        Experts(Option<Role>),
    }
    let mut first: Vec<Key> = Vec::new();
    cfg.block
        .linears
        .iter()
        .enumerate()
        .map(|(i, ld)| {
            let key = match (alloc.unit, ld.expert) {
                (AllocUnit::Linear, Some(_)) => Key::Experts(Some(ld.role)),
                (AllocUnit::Fused, Some(_)) => Key::Experts(None),
                (AllocUnit::Linear, None) => Key::Linear(i),
                (AllocUnit::Fused, None) => Key::Input(ld.input()),
            };
            match first.iter().position(|k| *k == key) {
                Some(u) => u,
                None => {
                    first.push(key);
                    first.len() - 1
                }
            }
        })
        .collect()
}

/// The per-head q/k norm weights of a block that has them (Qwen3), for BoA's row Hessians.
#[derive(Clone, Copy, Default)]
pub struct QkNorms<'a> {
    pub q: Option<&'a [f32]>,
    pub k: Option<&'a [f32]>,
}

impl<'a> QkNorms<'a> {
    pub fn of(w: &'a BlockWeights) -> QkNorms<'a> {
        QkNorms {
            q: w.norm(NormRole::Q),
            k: w.norm(NormRole::K),
        }
    }
}

/// The distinct input covariances that GPTQ plans for the block's routed experts, in batches of one width
/// (`quant::plan::batches`): `FactorCache::plan_batch` plans a batch at once, where planning each expert's H
/// alone reads a diagonal and a factor status from the device for it (an MoE block has two per expert).
fn expert_batches<'h>(
    desc: &crate::model::arch::BlockDesc,
    stats: Option<&'h BlockStats>,
    opts: &RunOptions,
    selected: &dyn Fn(usize) -> bool,
) -> (Vec<Vec<&'h Mat>>, usize) {
    let gptq = |ld: &LinearDesc| {
        ld.expert.is_some()
            && opts.method != Method::Rtn
            && !(opts.method == Method::Boa && opts.boa_treats(ld.role))
    };
    batches(
        desc.linears
            .iter()
            .enumerate()
            .filter(|&(i, ld)| selected(i) && gptq(ld))
            .filter_map(|(_, ld)| stats.and_then(|s| s.h_col(ld))),
    )
}

/// Quantizes every linear of the block. `weights` holds each linear's W (description order) where the backend
/// keeps it (the copy the FP forward read); the results' Ŵ stay there too, for the next forward. `measured`:
/// under --avg-bits with the output proxy, each allocation unit's error at each width (pipeline/sensitivity.rs);
/// `chosen`: the widths the model-wide allocation gave this block (pipeline/model_allocation.rs). `select`:
/// the linears to quantize (all, or one pass over a group of experts, pipeline/expert_groups.rs; the others'
/// `weights` are not read), results in description order.
#[allow(clippy::too_many_arguments)]
pub fn quantize_block(
    ops: &dyn QuantOps,
    weights: &[Mat],
    stats: Option<&BlockStats>,
    cfg: &Config,
    norms: QkNorms<'_>,
    opts: &RunOptions,
    layer: usize,
    measured: Option<&[Vec<f64>]>,
    chosen: Option<&[u32]>,
    select: &[bool],
) -> Result<Vec<(QuantizedLinear, LinearReport)>> {
    let selected = |i: usize| select[i];
    let Widths {
        bits,
        known,
        mut predicted,
    } = linear_bits(ops, weights, stats, cfg, opts, layer, measured, chosen)?;
    // Linears that read the same input share its plan (q/k, and v under GPTQ; gate/up), and the experts'
    // plans are made in batches ahead of their linears.
    let (batches, held) = expert_batches(&cfg.block, stats, opts, &selected);
    let mut planned = vec![false; batches.len()];
    let factors = FactorCache::holding(1 + held);
    let rope = super::stats::rope_average(cfg, layer, opts.seqlen);
    let desc = &cfg.block;
    let mut out = Vec::with_capacity(desc.linears.len());
    // Every linear's error report queued into one set of sums, read once after the last linear: at most
    // three forms each (a sweep's loss takes two slots in place of the method's form).
    let mut sums = ops.quad_sums(4 * desc.linears.len())?;
    let mut next = 0;
    let mut forms = Vec::with_capacity(desc.linears.len());
    for (i, ld) in desc.linears.iter().enumerate() {
        if !selected(i) {
            continue;
        }
        let name = ld.name.as_str();
        let start = Instant::now();
        let lspec = linear_spec(ops, opts, cfg, layer, ld, bits[i])?;
        let g = gptq_options(opts, opts.seqlen, lspec);
        let w = &weights[i];
        let ctx = || format!("layer {layer} {name}");
        // None for an expert's down_proj that too few tokens reached (BlockStats::h_col): RTN.
        let h: Option<&Mat> = stats.and_then(|s| s.h_col(ld));
        let tokens = ld.expert.and_then(|e| stats.map(|s| s.experts[e].tokens));
        let (q, method) = match (opts.method, h) {
            (Method::Rtn, _) | (_, None) => {
                let hs = h.filter(|_| opts.scale_search == ScaleSearchArg::Hessian);
                let mut sp = lspec;
                // An under-routed expert's down_proj has no H to weigh the scale search with.
                if hs.is_none() && sp.search == ScaleSearch::Hessian {
                    sp.search = ScaleSearch::Mse;
                }
                (rtn_quantize(ops, w, hs, &sp).with_context(ctx)?, "rtn")
            }
            (Method::Boa, Some(h)) if opts.boa_treats(ld.role) => {
                let a = stats
                    .and_then(|s| s.attn.as_ref())
                    .context("BoA needs the attention statistics")?;
                let d_h = cfg.d_h;
                let mut b = BoaOptions::new(g.clone());
                b.act_order_col = opts.act_order;
                b.act_order_row = opts.act_order_row;
                let q = match ld.role {
                    // W_Q and W_K share H_col (and its plan, through `factors`); W_V's per-head H_col are its own.
                    // Made where the statistics are (on a device, nothing of d_h² crosses to the host).
                    Role::Q | Role::K => {
                        let (c, heads, norm, exact) = if ld.role == Role::Q {
                            (&a.c_k, cfg.n_heads, norms.q, a.h_row_q.as_ref())
                        } else {
                            (&a.c_q, cfg.n_kv_heads, norms.k, a.h_row_k.as_ref())
                        };
                        let made;
                        let h_row = match exact {
                            Some(h) => h,
                            None => {
                                made = ops
                                    .rope_row_hessians(c, heads, &rope, norm)
                                    .context("H_row")?;
                                &made
                            }
                        };
                        boa_quantize(
                            ops,
                            w,
                            heads,
                            d_h,
                            ColHessian::Shared(h),
                            h_row,
                            &b,
                            Some(&factors),
                        )
                    }
                    _ => {
                        let h_row = match opts.v_row_hessian {
                            VRowHessian::Identity => ops
                                .identity_hessians(cfg.n_kv_heads, d_h)
                                .context("H_row")?,
                            VRowHessian::Wout => {
                                let (o, _) = desc
                                    .linear(Role::O)
                                    .context("W_out's row Hessians need o_proj")?;
                                ops.wout_row_hessians(&weights[o], cfg.n_heads, cfg.n_kv_heads, d_h)
                                    .context("H_row")?
                            }
                        };
                        // V's heads each order their columns by their own H_col, and a checkpoint has
                        // one g_idx per matrix: with groups, V keeps its natural column order (`run` notes
                        // it before any work).
                        if g.spec.n_groups(ld.d_in) > 1 {
                            b.act_order_col = false;
                        }
                        boa_quantize(
                            ops,
                            w,
                            cfg.n_kv_heads,
                            d_h,
                            ColHessian::PerHead(&a.v_col),
                            &h_row,
                            &b,
                            None,
                        )
                    }
                };
                (q.with_context(ctx)?, "boa")
            }
            (_, Some(h)) => {
                if let Some(b) = batches
                    .iter()
                    .position(|b| b.iter().any(|x| std::ptr::eq(*x, h)))
                    && !planned[b]
                {
                    planned[b] = true;
                    factors
                        .plan_batch(ops, &batches[b], &g.damping(), g.act_order)
                        .with_context(|| format!("layer {layer}: the experts' plans"))?;
                }
                let q = gptq_quantize(ops, w, h, &g, Some(&factors)).with_context(ctx)?;
                let q = if opts.refit_scales {
                    ops.refit_scales(w, h, q)
                        .with_context(|| format!("layer {layer} {name}: --refit-scales"))?
                        .0
                } else {
                    q
                };
                (q, "gptq")
            }
        };
        let report = match h {
            Some(h) => Some(
                queue_errors(ops, &mut sums, &mut next, w, &q, h, &lspec, known[i])
                    .with_context(|| format!("layer {layer} {name}: error report"))?,
            ),
            None => None,
        };
        forms.push(report);
        // A device runs ahead of the host, so a kernel fault surfaces at the next synchronization; a fence
        // after each linear's queued work names the linear that faulted. The routed experts share one fence
        // after the last of them, so an MoE block's synchronizations do not grow with its experts.
        let following = (i + 1..desc.linears.len()).find(|&j| selected(j));
        let last_expert =
            ld.expert.is_some() && following.is_none_or(|j| desc.linears[j].expert.is_none());
        if ld.expert.is_none() || last_expert {
            let (what, whose) = if last_expert {
                ("the routed experts", "their")
            } else {
                (name, "its")
            };
            ops.fence().with_context(|| {
                format!("layer {layer} {what}: sweep or error report (a device fault in {whose} queued work)")
            })?;
        }
        let seconds = start.elapsed().as_secs_f64();
        out.push((
            q,
            LinearReport {
                name: name.into(),
                method,
                rtn_error: f64::NAN,
                error: f64::NAN,
                bits: lspec.bits,
                seconds,
                tokens,
                predicted: predicted[i].take(),
                target_move: None,
            },
        ));
    }
    let sums = ops
        .read_quad_sums(&sums)
        .with_context(|| format!("layer {layer}: error report"))?;
    for ((_, r), f) in out.iter_mut().zip(forms) {
        if let Some(f) = f {
            (r.rtn_error, r.error) = relative(f, &sums);
        }
    }
    Ok(out)
}

/// Each linear's W of a block where the backend keeps it: the device copy the FP forward read when there is
/// one (taken from `resident`), else the host values. Linears `select` does not mark get an empty matrix
/// (`quantize_block` reads only the ones it marks).
pub fn weight_mats(
    w: &BlockWeights,
    resident: &mut crate::model::llama::ResidentWeights,
    select: &[bool],
) -> Vec<Mat> {
    w.linears
        .iter()
        .enumerate()
        .map(|(i, l)| match select[i] {
            false => Mat::f32(Vec::new(), 1, 0, 0),
            true => match resident.take(i) {
                Some(t) => Mat::tensor(t, 1, l.d_out, l.d_in),
                None => Mat::f32(l.w.clone(), 1, l.d_out, l.d_in),
            },
        })
        .collect()
}

/// Small configs and allocations for this module's tests and pipeline/sensitivity.rs's.
#[cfg(test)]
pub(crate) mod tests {
    use super::alloc_units;
    use crate::model::Config;
    use crate::pipeline::options::{AllocScope, AllocUnit, BitAllocation};

    /// d 64, d_ff 128, 4 heads over 2 KV heads, 2 layers, with `extra` fields (the architecture).
    pub(crate) fn config(extra: &str) -> Config {
        Config::parse(&format!(
            r#"{{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, {extra}}}"#
        ))
        .unwrap()
    }

    /// --avg-bits 3 over 2, 3 and 4 bits, model scope, by `unit`.
    pub(crate) fn allocation(unit: AllocUnit) -> BitAllocation {
        BitAllocation {
            avg: 3.0,
            choices: vec![2, 3, 4],
            proxy: None,
            scope: AllocScope::Model,
            unit,
        }
    }

    /// Each linear's unit, as (name, unit) in description order.
    fn units(cfg: &Config, unit: AllocUnit) -> Vec<(String, usize)> {
        let u = alloc_units(cfg, &allocation(unit));
        cfg.block
            .linears
            .iter()
            .map(|l| l.name.clone())
            .zip(u)
            .collect()
    }

    #[test]
    fn dense_units_are_linears_or_the_sets_that_read_one_input() {
        let cfg = config(r#""architectures": ["LlamaForCausalLM"]"#);
        let linear: Vec<usize> = units(&cfg, AllocUnit::Linear).iter().map(|p| p.1).collect();
        assert_eq!(linear, [0, 1, 2, 3, 4, 5, 6]);
        let fused: Vec<usize> = units(&cfg, AllocUnit::Fused).iter().map(|p| p.1).collect();
        // q/k/v, o, gate/up, down.
        assert_eq!(fused, [0, 0, 0, 1, 2, 2, 3]);
    }

    #[test]
    fn routed_experts_share_a_width_per_part_or_all_together() {
        let cfg = config(
            r#""architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96"#,
        );
        let unit_of = |u: &[(String, usize)], name: &str| {
            u.iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name}: {u:?}"))
                .1
        };
        let linear = units(&cfg, AllocUnit::Linear);
        let n = linear.iter().map(|p| p.1 + 1).max().unwrap();
        // q, k, v, o, the shared expert's gate, up and down, and the routed experts' three parts.
        assert_eq!(n, 10, "{linear:?}");
        for part in ["gate_proj", "up_proj", "down_proj"] {
            let first = unit_of(&linear, &format!("mlp.experts.0.{part}"));
            for e in 1..4 {
                assert_eq!(unit_of(&linear, &format!("mlp.experts.{e}.{part}")), first);
            }
            assert_ne!(
                unit_of(&linear, &format!("mlp.shared_expert.{part}")),
                first
            );
        }
        let gate = unit_of(&linear, "mlp.experts.0.gate_proj");
        assert_ne!(gate, unit_of(&linear, "mlp.experts.0.up_proj"));
        let fused = units(&cfg, AllocUnit::Fused);
        // q/k/v, o, the shared expert's gate/up and down, every routed expert linear.
        assert_eq!(fused.iter().map(|p| p.1 + 1).max().unwrap(), 5, "{fused:?}");
        let all = unit_of(&fused, "mlp.experts.0.gate_proj");
        assert!(
            fused
                .iter()
                .filter(|(n, _)| n.starts_with("mlp.experts."))
                .all(|&(_, u)| u == all)
        );
        assert_eq!(
            unit_of(&fused, "mlp.shared_expert.gate_proj"),
            unit_of(&fused, "mlp.shared_expert.up_proj")
        );
    }
}
