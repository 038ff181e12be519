//! The one validation pass of `run`, before block 0: anything a later block, the export or a loader would
//! reject is rejected here, with one line naming the option, file or tensor. Two parts:
//!
//! * `before_work`: the options against the model (layers, group size, calibration paths, config fields the
//!   engine does not implement, the output folder's safety). Milliseconds; runs before the output lock is
//!   taken, so a bad command touches nothing.
//! * `scan_tensors`: every tensor's bytes, once: NaN/±Inf anywhere (quantized blocks, copied-through ones,
//!   embeddings, norms, lm_head) and, in the linears to be quantized, magnitudes whose scales f16 cannot
//!   hold. It reads the whole checkpoint — on a 70B bf16 model 140 GB, ~45 s from a 3 GB/s NVMe cold,
//!   memory bandwidth when cached — which the run then reads again block by block; the blocks to quantize
//!   (the rest is copied through) take minutes each, so the scan costs a few percent of a full run.
//!   Tensors are scanned in parallel (rayon), each straight from its memory map.

use super::options::{AllocScope, AllocUnit, LayerSet, QkNormHessian, RunOptions};
use crate::data::text;
use crate::error::file_err;
use crate::export::gptq_packed::OutFormat;
use crate::export::out_guard::{Input, check_out};
use crate::model::Model;
use crate::progress::Progress;

/// The largest finite f16.
const F16_MAX: f32 = 65504.0;

/// What the checks settled for the run.
pub struct Plan {
    pub layers: LayerSet,
    /// The run reads calibration text (see `RunOptions::needs_calibration`).
    pub needs_calib: bool,
}

/// Where vLLM 0.32 cannot serve a GPTQ checkpoint as `opts` write it, and the option that makes it serve
/// (measured with its CPU build: README "vLLM", tests/vllm_load.rs). Notes, not errors: GPTQModel,
/// transformers and `boa-cuda eval` read all of these.
fn vllm_notes(opts: &RunOptions, moe: bool) -> Vec<&'static str> {
    let mut notes = Vec::new();
    if !opts.sym {
        notes.push(
            "note: vLLM 0.32 refuses asymmetric GPTQ checkpoints (sym=False): pass --sym, or write \
             --format compressed-tensors, to serve this model in vLLM",
        );
    }
    if opts.permuted_groups() {
        notes.push(
            "note: vLLM 0.32 refuses act-order with groups (desc_act): add --static-groups, whose groups stay \
             contiguous columns (desc_act false), to serve this model in vLLM",
        );
    }
    if opts.sym && moe && opts.format == OutFormat::GptqV2 {
        notes.push(
            "note: vLLM 0.32 reads qzeros as gptq's (zero − 1) and its CPU int4 experts kernel uses them even \
             for a symmetric grid, so it reads this gptq_v2 checkpoint's experts one zero step off: write \
             --format gptq for vLLM",
        );
    }
    notes
}

/// The checks that need the model's config and tensor list, not its data.
pub fn before_work(opts: &RunOptions, model: &Model, progress: &Progress) -> anyhow::Result<Plan> {
    let cfg = &model.cfg;
    let layers = opts
        .layers
        .clone()
        .unwrap_or_else(|| LayerSet::all(cfg.n_layers));
    layers
        .check(cfg.n_layers)
        .map_err(|m| crate::input_err!("{m}"))?;
    if let Some(g) = opts.group_size.columns()
        && let Some(l) = cfg.block.linears.iter().min_by_key(|l| l.d_in)
        && g > l.d_in
    {
        let (name, d_in) = (l.name.as_str(), l.d_in);
        return Err(crate::input_err!(
            "--group-size {g} is larger than the input width {d_in} of {name} (use at most {d_in}, or -1)"
        ));
    }
    if opts.format == crate::export::gptq_packed::OutFormat::CompressedTensors {
        if opts.bits.is_some() && cfg.block.moe.is_some() {
            // Measured with transformers 5.24 + compressed-tensors 0.20: a config group naming an expert's
            // linears matches no module (transformers holds a block's experts fused), and the fused experts
            // are decoded at another group's width.
            return Err(crate::input_err!(
                "--format compressed-tensors with --avg-bits on a mixture of experts: transformers decodes \
                 every expert at one width, so mixed widths load wrong; use --wbits, or --format gptq_v2"
            ));
        }
        if let Some(g) = opts.group_size.columns()
            && let Some(l) = cfg.block.linears.iter().find(|l| l.d_in % g != 0)
        {
            let (name, d_in) = (l.name.as_str(), l.d_in);
            return Err(crate::input_err!(
                "--format compressed-tensors needs --group-size to divide every input width, but {name} has \
                 {d_in} (not a multiple of {g}): choose a divisor, or -1 (per-channel)"
            ));
        }
        if !opts.sym {
            // Not silenced by --quiet, like the GPTQ layout warning: the checkpoint is right (vLLM and
            // compressed-tensors' decompressor read it), but the default load path of transformers fails.
            eprintln!(
                "warning: transformers' default from_pretrained (compressed-tensors 0.20) builds an asymmetric \
                 pack-quantized model with unpacked zero points and refuses the packed weight_zero_point \
                 (size mismatch): load it with quantization_config=CompressedTensorsConfig(dequantize=True)"
            );
        }
        if opts.bits.is_some() {
            // transformers 5.24's dequantize=True converter decompresses every dense linear with one config
            // group's scheme (tests/compressed_tensors.rs measured it).
            if opts.sym {
                eprintln!(
                    "note: with several widths, transformers loads this checkpoint through its default \
                     from_pretrained only: CompressedTensorsConfig(dequantize=True) reads every linear at one \
                     width"
                );
            } else {
                eprintln!(
                    "warning: an asymmetric checkpoint with several widths loads in neither of transformers' \
                     paths (the default refuses packed zero points, dequantize=True reads every linear at one \
                     width): pass --sym to load it in transformers"
                );
            }
        }
    }
    let v_in = cfg
        .block
        .linears
        .iter()
        .find(|l| l.role == crate::model::arch::Role::V)
        .map_or(0, |l| l.d_in);
    if opts.act_order
        && opts.boa_treats(crate::model::arch::Role::V)
        && opts.group_size.columns().is_some_and(|g| g < v_in)
    {
        progress.line(
            "note: with --act-order and groups, BoA quantizes v_proj in its natural column order: its heads \
             would each order the columns by their own Hessian, and a checkpoint has one g_idx per matrix",
        );
    }
    if opts.qk_norm_hessian == QkNormHessian::Exact && !opts.exact_qk_norm(cfg) {
        progress.line(
            "note: --qk-norm-hessian exact changes nothing here: it weighs BoA's Q/K row Hessians by a per-head \
             q/k norm's Jacobian, and this run has no such norm, or no BoA on q_proj or k_proj",
        );
    }
    let gptq = matches!(opts.format, OutFormat::Gptq | OutFormat::GptqV2);
    if gptq
        && let Some(w) = loader_warning(
            opts.bits.as_ref().map_or(&[opts.wbits][..], |b| &b.choices),
            opts.group_size.columns(),
            &cfg.block.linears,
        )
    {
        // Not silenced by --quiet: the checkpoint is written, but some loaders will refuse it.
        eprintln!("warning: {w}");
    }
    if gptq {
        for note in vllm_notes(opts, cfg.block.moe.is_some()) {
            progress.line(note);
        }
    }
    if let Some(b) = &opts.bits
        && b.unit == AllocUnit::Linear
        && matches!(
            opts.format,
            OutFormat::Gptq | OutFormat::GptqV2 | OutFormat::CompressedTensors
        )
    {
        // Not silenced by --quiet, like the loader warnings.
        eprintln!(
            "note: q, k and v (and gate, up{}) may get different widths; vLLM runs each set as one fused \
             layer and cannot load such a checkpoint: pass --alloc-unit fused to serve it in vLLM",
            if cfg.block.moe.is_some() {
                "; a block's experts' gate, up and down"
            } else {
                ""
            }
        );
    }
    if opts.bits.is_some() && gptq {
        // Measured with optimum 2.3.0 (README "Loader matrix"): its GPTQ loader has no `dynamic`.
        eprintln!(
            "note: transformers' from_pretrained (through optimum 2.3) ignores GPTQ's per-module widths \
             (`dynamic`) and refuses a checkpoint with several (size mismatch); GPTQModel.load and vLLM read \
             them: for transformers, write --format compressed-tensors --sym"
        );
    }
    if gptq
        && cfg
            .block
            .moe
            .as_ref()
            .is_some_and(|m| m.router == "block_sparse_moe.gate")
    {
        // Measured: with the experts renamed, both load and match (docs/architectures.md, "Loaders").
        eprintln!(
            "note: GPTQModel 7.7 and transformers 5.24 look for Mixtral's experts as \
             mlp.experts.E.{{gate,up,down}}_proj and refuse the block_sparse_moe.experts.E.w1/w3/w2 names of \
             Mixtral's checkpoints, which this one keeps (vLLM and llama.cpp's converter read them)"
        );
    }
    if let Some(b) = &opts.bits
        && b.scope == AllocScope::Block
    {
        // The model scope's search is polynomial in the units; the block scope enumerates them.
        let n = super::quantize_block::alloc_units(cfg, b)
            .iter()
            .map(|&u| u + 1)
            .max()
            .unwrap_or(0);
        if crate::quant::allocate::assignments(b.choices.len(), n).is_none() {
            return Err(crate::input_err!(
                "--alloc-scope block searches every assignment of a block's widths, and a block of this model \
                 has {n} allocation units ({}^{n} assignments, more than {}): pass fewer --bit-choices, \
                 --alloc-unit fused, or --alloc-scope model",
                b.choices.len(),
                crate::quant::allocate::MAX_ASSIGNMENTS
            ));
        }
    }
    cfg.check_tensor_names(model.store.names())
        .map_err(|m| file_err(model.dir.join("config.json"), m))?;
    let needs_calib = opts.needs_calibration();
    // Existence and kind of every calibration path now, read or not: a typo is an error, never ignored.
    if !opts.calib.is_empty() {
        text::expand(&opts.calib)?;
        if !needs_calib {
            progress.line(&format!(
                "note: --method rtn with {} scales reads no calibration text; --calib was checked to exist \
                 but is not used",
                match opts.scale_search {
                    super::options::ScaleSearchArg::Mse => "mse",
                    _ => "min-max",
                }
            ));
        }
    }
    let mut inputs = vec![Input {
        path: &model.dir,
        what: "the model folder",
    }];
    inputs.extend(opts.calib.iter().map(|p| Input {
        path: p,
        what: "the calibration text",
    }));
    check_out(&opts.out, opts.force, &inputs)?;
    Ok(Plan {
        layers,
        needs_calib,
    })
}

/// Why third-party loaders will refuse the packed checkpoint on the CPU (measured with GPTQModel 7.7.0 and
/// transformers 5.24 + optimum 2.3.0, README "Loader matrix"), or None. `widths`: every width a linear may
/// get (--wbits, or --bit-choices). GPTQModel's 4-bit CPU kernels (TorchFused, TorchAten: torch's
/// _weight_int4pack_mm_cpu) need a group of 32–256 columns that divides d_in; per-channel (a group of d_in)
/// and a trailing partial group fail there. At other widths its kernel check refuses a partial group unless
/// the kernel pads. At 3 bits both loaders unpack qweight and qzeros 32 values per 3 words, so a d_in or d_out
/// that is not a multiple of 32 fails to reshape (a random Qwen3-MoE's experts of 48 did).
pub fn loader_warning(
    widths: &[u32],
    group_size: Option<usize>,
    linears: &[crate::model::arch::LinearDesc],
) -> Option<String> {
    let four = widths.contains(&4);
    if widths.contains(&3)
        && let Some(l) = linears
            .iter()
            .find(|l| l.d_in % 32 != 0 || l.d_out % 32 != 0)
    {
        return Some(format!(
            "{} is {} x {}, not a multiple of 32 both ways: GPTQModel.load and transformers' from_pretrained \
             cannot unpack its 3-bit qweight/qzeros (32 values per 3 words; \"shape ... is invalid\"); \
             choose --wbits (or --bit-choices) without 3",
            l.name, l.d_out, l.d_in
        ));
    }
    let bad = linears.iter().find(|l| match group_size {
        Some(g) => l.d_in % g != 0 || (four && !(32..=256).contains(&g)),
        None => four && !(32..=256).contains(&l.d_in),
    })?;
    let why = match group_size {
        Some(g) if bad.d_in % g != 0 => format!(
            "{} has d_in {}, not a multiple of --group-size {g}",
            bad.name, bad.d_in
        ),
        Some(g) => format!("--group-size {g} is outside 32-256"),
        None => format!(
            "per-channel scales make {}'s group its d_in {}, outside 32-256",
            bad.name, bad.d_in
        ),
    };
    let fails = if four {
        "GPTQModel.load and transformers' from_pretrained fail on the CPU (4-bit TorchFused kernel: \
         \"_weight_int4pack_mm_cpu\")"
    } else {
        "GPTQModel's kernels that do not pad a partial group refuse it (\"in_features must be divisible by \
         group_size\")"
    };
    Some(format!(
        "{why}: {fails}; it loads with GPTQConfig(backend=\"torch\") / backend=BACKEND.TORCH, or choose a \
         --group-size of 32-256 that divides every d_in"
    ))
}

/// Every tensor finite; every linear to be quantized within what f16 scales can store.
pub fn scan_tensors(model: &Model, layers: &LayerSet, wbits: u32) -> anyhow::Result<()> {
    use rayon::prelude::*;
    let names: Vec<&String> = model.store.names().collect();
    let scans = names
        .par_iter()
        .map(|n| model.store.scan(n))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let quantized: std::collections::HashSet<String> = layers
        .iter()
        .flat_map(|l| {
            model
                .cfg
                .block
                .linears
                .iter()
                .map(move |d| format!("model.layers.{l}.{}.weight", d.name))
        })
        .collect();
    // A scale is at most the weight range over maxq (≤ 2·max|w|/maxq); GPTQ's updates can widen a later
    // group's range, so leave a factor of 4 to spare. No real checkpoint comes near: weights are O(1).
    let maxq = ((1u32 << wbits) - 1) as f32;
    let limit = F16_MAX * maxq / 8.0;
    for (name, scan) in names.iter().zip(scans) {
        let Some(scan) = scan else { continue };
        if let Some((i, v)) = scan.non_finite {
            return Err(file_err(
                &model.dir,
                format!("tensor {name} has a non-finite value ({v}) at index {i}"),
            ));
        }
        if quantized.contains(name.as_str()) && scan.max_abs > limit {
            return Err(file_err(
                &model.dir,
                format!(
                    "tensor {name} has a weight of magnitude {:.3e}: its {wbits}-bit scales (range / {maxq}) \
                     could exceed f16's largest value 65504, and every --format stores scales in f16 \
                     (at most {limit:.0} is accepted at {wbits} bits)",
                    scan.max_abs
                ),
            ));
        }
    }
    Ok(())
}
