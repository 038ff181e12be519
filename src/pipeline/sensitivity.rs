//! The bit allocation's measured proxy (`--alloc-proxy output`, issue 23): each linear's error at each width
//! of `--bit-choices`, measured on the block's output. The RTN proxy (`--alloc-proxy rtn`: min-max RTN's
//! tr(ΔW H ΔWᵀ) on the linear's own input covariance) gives each linear's error in its own output's units, so
//! q/k (whose outputs reach the block's output through a softmax), v (through the attention and W_O) and
//! gate/up (through SiLU and W_down) are compared with o/down (which add to the residual stream) in different
//! units. Here each linear alone is quantized by GPTQ (min-max scales) at the width, the block runs on some
//! calibration sequences with that one Ŵ, and its error is ‖Y − Y_FP‖² over them: the allocation then weighs
//! every linear by what it does to the block's output. Linears that must share a width (`--alloc-unit fused`: q/k/v,
//! gate/up) are quantized and measured together, so what they do to each other (q's and k's errors meet in
//! the scores) is in their error. Cost: |choices| GPTQ runs per linear and |choices| · units + 1 forwards of
//! those sequences.

use super::options::RunOptions;
use super::quantize_block::{gptq_options, linear_spec, spec};
use super::stats::{BlockStats, stage_if_parked};
use crate::backend::{Backend, Tensor};
use crate::model::Config;
use crate::model::llama::{BlockWeights, ResidentWeights, RopeTable, block_forward};
use crate::ops::{Mat, MatData, QuantSpec, ScaleSearch};
use crate::quant::gptq::gptq_quantize;
use crate::quant::plan::{FactorCache, batches};
use anyhow::Context;

/// Calibration sequences the proxy measures on: the first ones of X, whatever the forward chunk.
pub const SEQUENCES: usize = 8;

/// Per allocation unit (`unit[i]`: linear i's, numbered 0.. in description order; pipeline/quantize_block.rs
/// `alloc_units`), its measured error at each of the allocation's widths: the unit's linears quantized
/// together at the width, the others left at W. A unit without H (an under-routed expert's down_proj) gets
/// zeros, as the RTN proxy gives it. Runs where the block's weights are (`resident`: the device copies the
/// statistics' forward read, else `w`'s host values): each Ŵ takes its linear's place there for one
/// forward, and W goes back. Only the errors reach the host.
#[allow(clippy::too_many_arguments)]
pub fn output_errors(
    be: &dyn Backend,
    w: &mut BlockWeights,
    resident: &mut ResidentWeights,
    stats: &BlockStats,
    cfg: &Config,
    rope: &RopeTable,
    x: &[Tensor],
    opts: &RunOptions,
    layer: usize,
    unit: &[usize],
) -> anyhow::Result<Vec<Vec<f64>>> {
    let alloc = opts
        .bits
        .as_ref()
        .context("the output proxy needs --avg-bits")?;
    let pieces = first_sequences(be, x, rope.t, cfg.d, SEQUENCES)?;
    // Each piece forwarded alone: at most one forward chunk's sequences, which the memory plan sized.
    let forward = |w: &BlockWeights, resident: &ResidentWeights| -> anyhow::Result<Vec<Mat>> {
        pieces
            .iter()
            .map(|(xs, ns)| {
                let mut t = be.duplicate(xs)?;
                block_forward(be, w, Some(resident), cfg, rope, &mut t, *ns, None)?;
                let n = t.len();
                Ok(Mat::tensor(t, 1, n, 1))
            })
            .collect()
    };
    let y_fp = forward(w, resident)?;
    // ‖Y − Y_FP‖² as tr(D·1·Dᵀ) of D = Y − Y_FP seen as one column: the backend's f64 sum of squares.
    let one = be.hessian(vec![1.0], 1, 1)?;
    let error = |w: &BlockWeights, resident: &ResidentWeights| -> anyhow::Result<f64> {
        let mut sum = 0.0;
        for (y, fp) in forward(w, resident)?.iter().zip(&y_fp) {
            sum += be.quad_forms(&one, &[&be.sub(y, fp)?])?[0];
        }
        Ok(sum)
    };
    // The widths share each H's plan (q/k/v and gate/up share it too). A unit of experts has an H per expert
    // and quantizes them all at each width: the cache holds the largest unit's plans (the memory plan counts
    // them, `plan_cache_elems`), so each is made once, not once per width.
    let n_units = unit.iter().map(|&u| u + 1).max().unwrap_or(0);
    let factors = FactorCache::holding(plans_held(cfg, unit));
    let mut out = Vec::with_capacity(n_units);
    for u in 0..n_units {
        let members: Vec<(usize, &Mat)> = cfg
            .block
            .linears
            .iter()
            .enumerate()
            .filter(|&(i, _)| unit[i] == u)
            .filter_map(|(i, ld)| stats.h_col(ld).map(|h| (i, h)))
            .collect();
        if members.is_empty() {
            out.push(vec![0.0; alloc.choices.len()]);
            continue;
        }
        // Each member's W, taken from where the forward reads it (`true`: the resident copy).
        let ws: Vec<(Mat, bool)> = members
            .iter()
            .map(|&(i, _)| {
                let (d_out, d_in) = (w.linears[i].d_out, w.linears[i].d_in);
                match resident.take(i) {
                    Some(t) => (Mat::tensor(t, 1, d_out, d_in), true),
                    None => (Mat::f32(w.linears[i].w.clone(), 1, d_out, d_in), false),
                }
            })
            .collect();
        // A unit of experts: their plans in batches, made once for every width either way (the cache holds
        // the unit's), read back a batch at a time instead of one H at a time.
        let g = gptq_options(opts, opts.seqlen, spec(opts, opts.wbits));
        for batch in batches(members.iter().map(|&(_, h)| h)).0 {
            factors
                .plan_batch(be, &batch, &g.damping(), g.act_order)
                .with_context(|| format!("layer {layer}: the output proxy's plans"))?;
        }
        let mut errs = Vec::with_capacity(alloc.choices.len());
        let mut failed = None;
        for &b in &alloc.choices {
            match unit_error(
                be, w, resident, &members, &ws, &factors, b, opts, cfg, layer, &error,
            ) {
                Ok(e) => errs.push(e),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // W back where the forward reads it, whatever happened.
        for (&(i, _), (wm, was_resident)) in members.iter().zip(ws) {
            if was_resident && let MatData::F32(t) = wm.data {
                resident.put(i, t);
            }
        }
        if let Some(e) = failed {
            let names: Vec<&str> = members
                .iter()
                .map(|&(i, _)| cfg.block.linears[i].name.as_str())
                .collect();
            return Err(e.context(format!("layer {layer} {}: output proxy", names.join("+"))));
        }
        out.push(errs);
    }
    Ok(out)
}

/// The plans the output proxy's cache holds: the most distinct H_col any allocation unit's linears read
/// (q/k/v share the attention input's, gate/up the MLP input's, each expert's gate/up their routed inputs').
pub fn plans_held(cfg: &Config, unit: &[usize]) -> usize {
    let n_units = unit.iter().map(|&u| u + 1).max().unwrap_or(0);
    let mut per_unit = vec![0; n_units];
    let mut seen = std::collections::HashSet::new();
    for (ld, &u) in cfg.block.linears.iter().zip(unit) {
        if seen.insert((u, ld.input())) {
            per_unit[u] += 1;
        }
    }
    per_unit.into_iter().max().unwrap_or(0)
}

/// The elements the output proxy's plan cache holds at most (each plan: the damped H and its factor, n² each,
/// in the statistics' precision): the largest plans of the block, as many as the cache holds.
pub fn plan_cache_elems(cfg: &Config, unit: &[usize]) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut sizes: Vec<usize> = cfg
        .block
        .linears
        .iter()
        .filter(|ld| seen.insert(ld.input()))
        .map(|ld| 2 * ld.d_in * ld.d_in)
        .collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.into_iter().take(plans_held(cfg, unit)).sum()
}

/// The first `n` sequences of X (chunks of whole sequences of `t` rows of `d`; fewer if X has fewer), as
/// (piece, sequences) where the backend computes: the rows of each chunk they lie in, gathered (a parked
/// chunk staged first). Across chunks, so the proxy measures the same sequences whatever forward chunk the
/// memory plan chose (a GPU short of memory may forward fewer than `SEQUENCES` at once).
pub(crate) fn first_sequences(
    be: &dyn Backend,
    x: &[Tensor],
    t: usize,
    d: usize,
    n: usize,
) -> anyhow::Result<Vec<(Tensor, usize)>> {
    let mut pieces = Vec::new();
    let mut taken = 0;
    for i in 0..x.len() {
        if taken == n {
            break;
        }
        let staged = stage_if_parked(be, x, i)?;
        let chunk = staged.as_ref().unwrap_or(&x[i]);
        let ns = (chunk.len() / (t * d)).min(n - taken);
        if ns == 0 {
            continue;
        }
        let rows: Vec<u32> = (0..(ns * t) as u32).collect();
        pieces.push((be.embed_t(chunk, &rows, d, 1.0)?, ns));
        taken += ns;
    }
    anyhow::ensure!(!pieces.is_empty(), "no calibration activations");
    Ok(pieces)
}

/// The block's output error with `members`' W (`ws`) quantized by GPTQ at `b` bits and put where the forward
/// reads them; each is back at W when this returns (the resident ones taken out again for the caller).
#[allow(clippy::too_many_arguments)]
fn unit_error<'h>(
    be: &dyn Backend,
    w: &mut BlockWeights,
    resident: &mut ResidentWeights,
    members: &[(usize, &'h Mat)],
    ws: &[(Mat, bool)],
    factors: &FactorCache<'h>,
    b: u32,
    opts: &RunOptions,
    cfg: &Config,
    layer: usize,
    error: &dyn Fn(&BlockWeights, &ResidentWeights) -> anyhow::Result<f64>,
) -> anyhow::Result<f64> {
    let mut host_w: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut on_device: Vec<usize> = Vec::new();
    let installed = (|| -> anyhow::Result<()> {
        for (&(i, h), (wm, _)) in members.iter().zip(ws) {
            let ld = &cfg.block.linears[i];
            // Min-max scales, whatever --scale-search: the Hessian-weighted search was two thirds of the
            // proxy's time, and at the quality table's 128 × 512 its widths were no better (README, "Bit
            // allocation": 2.5 bits 51.47 / 118.18 with min-max against 54.27 / 128.43, 3.0 bits 36.57 /
            // 69.10 against 36.11 / 69.48; the proxy 0.44× the time). At 8 × 256, 3.0 bits, min-max was worse.
            let spec = QuantSpec {
                search: ScaleSearch::MinMax,
                ..linear_spec(be, opts, cfg, layer, ld, b)?
            };
            let g = gptq_options(opts, opts.seqlen, spec);
            let q = gptq_quantize(be, wm, h, &g, Some(factors))
                .with_context(|| format!("{}: GPTQ at {b} bits", ld.name))?;
            match q.w_hat.data {
                MatData::F32(Tensor::Host(v)) => {
                    host_w.push((i, std::mem::replace(&mut w.linears[i].w, v)))
                }
                MatData::F32(t) => {
                    resident.put(i, t);
                    on_device.push(i);
                }
                MatData::F64(_) => anyhow::bail!("Ŵ came back in f64"),
            }
        }
        Ok(())
    })();
    let e = installed.and_then(|()| error(w, resident));
    for (i, v) in host_w {
        w.linears[i].w = v;
    }
    for i in on_device {
        drop(resident.take(i));
    }
    e
}

#[cfg(test)]
mod tests {
    use super::{first_sequences, plan_cache_elems, plans_held};
    use crate::backend::Tensor;
    use crate::backend::cpu::CpuBackend;
    use crate::pipeline::options::AllocUnit;
    use crate::pipeline::quantize_block::alloc_units;
    use crate::pipeline::quantize_block::tests::{allocation, config};

    #[test]
    fn the_proxy_holds_one_plan_per_expert_input_of_its_largest_unit() {
        // d 64; a shared expert of 96; 4 experts of 32.
        let cfg = config(
            r#""architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 96"#,
        );
        let units = |unit| alloc_units(&cfg, &allocation(unit));
        // Per part: each expert's routed-input H (gate, up: 64) or activation H (down: 32), four of them.
        let linear = units(AllocUnit::Linear);
        assert_eq!(plans_held(&cfg, &linear), 4);
        // The four largest of the block's H: 96 (the shared expert's down), then three of 64.
        assert_eq!(plan_cache_elems(&cfg, &linear), 2 * (96 * 96 + 3 * 64 * 64));
        // All experts together: both of each expert's H, eight plans; the eight largest H of the block are
        // 96 and seven of 64 (attention input, o's input, the MLP input, four experts' routed inputs).
        let fused = units(AllocUnit::Fused);
        assert_eq!(plans_held(&cfg, &fused), 8);
        assert_eq!(plan_cache_elems(&cfg, &fused), 2 * (96 * 96 + 7 * 64 * 64));
        // A dense block holds one plan, its largest (down's, 128).
        let dense = config(r#""architectures": ["LlamaForCausalLM"]"#);
        let linear = alloc_units(&dense, &allocation(AllocUnit::Linear));
        assert_eq!(plan_cache_elems(&dense, &linear), 2 * 128 * 128);
    }

    #[test]
    fn the_first_sequences_are_gathered_across_chunks() {
        let (t, d) = (3, 2);
        let seq = |s: usize| -> Vec<f32> { (0..t * d).map(|i| (100 * s + i) as f32).collect() };
        // Chunks of 2, 1 and 3 sequences: 0-1, 2, 3-5.
        let x: Vec<Tensor> = [0..2, 2..3, 3..6]
            .into_iter()
            .map(|r| Tensor::Host(r.flat_map(seq).collect()))
            .collect();
        for (n, sizes) in [
            (1, vec![1]),
            (2, vec![2]),
            (4, vec![2, 1, 1]),
            (8, vec![2, 1, 3]),
        ] {
            let pieces = first_sequences(&CpuBackend, &x, t, d, n).unwrap();
            assert_eq!(
                pieces.iter().map(|p| p.1).collect::<Vec<_>>(),
                sizes,
                "n {n}"
            );
            let got: Vec<f32> = pieces
                .iter()
                .flat_map(|(p, _)| p.host().unwrap().to_vec())
                .collect();
            let want: Vec<f32> = (0..sizes.iter().sum()).flat_map(seq).collect();
            assert_eq!(got, want, "n {n}");
        }
    }
}
