//! `boa-cuda run`: the block-by-block streaming driver of design.md §3. It owns the order of work and the
//! memory budget: one block's f32 weights plus the calibration activations X_l are in memory at a time.
//!
//! For each block l: (b) forward the FP block on X_l collecting statistics, (c) quantize its linears,
//! (d) forward the quantized block on X_l → X_{l+1}, (e) write its shard. Blocks outside --layers are copied
//! through unquantized (and forwarded in FP while a later block still needs its inputs).

mod block_pass;
pub mod expert_groups;
pub mod memory_plan;
pub mod model_allocation;
pub mod options;
pub mod quantize_block;
pub mod report;
pub mod resume;
pub mod sensitivity;
pub mod stats;
pub mod traffic;
pub mod validate;
mod width_rules;

use crate::backend::{Backend, Tensor, select_backend_with};
use crate::data::{text, tokenizer::Tokenizer, windows};
use crate::error::file_err;
use crate::export::gptq_packed::{OutFormat, linear_entries, quantization_config};
use crate::export::hf_folder::{OutFolder, shard_contents, write_shard_file};
use crate::export::safetensors_out::TensorEntry;
use crate::model::Model;
use crate::model::llama::{BlockWeights, ResidentWeights, block_forward};
use crate::nvtx::ranged;
use crate::progress::Progress;
use anyhow::Context;
use options::{AllocProxy, AllocScope, RunOptions};
use report::{LayerReport, RunReport, Timings};
use std::time::Instant;

/// Windows forwarded together (at most: the memory plan may take fewer); bounds the memory of one forward's
/// intermediates.
pub const CHUNK: usize = 8;

/// Where the calibration activations live and how many sequences one forward takes.
struct Placement {
    /// X parked in pinned host memory between uses (the GPU plan did not fit X on the device).
    parked: bool,
    chunk_seqs: usize,
    /// The embedding table goes to the device and X is gathered there (a device backend whose plan has room
    /// for the table before the first block); else X is embedded on the host and uploaded.
    embed_on_device: bool,
    /// An MoE block's experts held at once when they are taken in groups (pipeline/expert_groups.rs);
    /// None: all of them.
    expert_group: Option<usize>,
}

/// The experts held at once: the plan's (`planned`, None where it holds them all) or `--expert-group`'s,
/// whichever is fewer; None when that is all of them.
fn expert_group(
    planned: Option<usize>,
    cfg: &crate::model::config::Config,
    opts: &RunOptions,
    progress: &Progress,
) -> anyhow::Result<Option<usize>> {
    let Some(n) = cfg.block.moe.as_ref().map(|m| m.n_experts) else {
        if opts.expert_group.is_some() {
            progress.line("note: --expert-group has no effect: the model has no experts");
        }
        return Ok(None);
    };
    let g = planned
        .unwrap_or(n)
        .min(opts.expert_group.unwrap_or(n))
        .max(1);
    if g >= n {
        return Ok(None);
    }
    if opts.bits.is_some() {
        return Err(crate::input_err!(
            "--avg-bits measures all {n} experts of a block at once, but only {g} are held at a time \
             (the memory plan or --expert-group): drop --avg-bits, or give the run more GPU memory"
        ));
    }
    progress.line(&format!(
        "experts in groups of {g}: {} passes over each block's calibration inputs (the same result; \
         each further pass repeats the router and the attention's forward)",
        n.div_ceil(g)
    ));
    Ok(Some(g))
}

/// Prints the memory plan before any long work and returns where X lives. A GPU plan that cannot fit is
/// refused now; on the host the estimate (f64 statistics, no reuse between buffers) is an upper bound, so it
/// only warns.
fn state_memory_plan(
    be: &dyn Backend,
    cfg: &crate::model::config::Config,
    opts: &RunOptions,
    needs_calib: bool,
    progress: &Progress,
) -> anyhow::Result<Placement> {
    use memory_plan::{Activations, Calibration, ModelShape, Target, host_available_bytes, plan};
    let output_proxy = opts
        .bits
        .as_ref()
        .is_some_and(|b| b.proxy() == AllocProxy::Output);
    let calib = Calibration {
        nsamples: if needs_calib { opts.nsamples } else { 0 },
        seqlen: opts.seqlen,
        proxy_sequences: if output_proxy {
            sensitivity::SEQUENCES
        } else {
            0
        },
        proxy_weights: match &opts.bits {
            Some(b) if output_proxy => {
                let unit = quantize_block::alloc_units(cfg, b);
                let mut sums = vec![0usize; cfg.block.linears.len()];
                for (ld, &u) in cfg.block.linears.iter().zip(&unit) {
                    sums[u] += ld.d_out * ld.d_in;
                }
                sums.into_iter().max().unwrap_or(0)
            }
            _ => 0,
        },
        proxy_plans: match &opts.bits {
            Some(b) if output_proxy => {
                sensitivity::plan_cache_elems(cfg, &quantize_block::alloc_units(cfg, b))
            }
            _ => 0,
        },
        asym: opts.asym_calib.is_some(),
    };
    // `--rotate-online` makes the R4 transform after this plan, from the source's config.
    let online = match &opts.rotate {
        Some(r) => r.r4_block(&cfg.down_widths())?.unwrap_or(0),
        None => cfg.block.online_down.unwrap_or(0),
    };
    let shape = ModelShape {
        online,
        online_dense: online > 0 && be.block_hadamard_reads_dense(online),
        ..ModelShape::of(cfg)
    };
    match be.device_memory() {
        Some((free, _)) => {
            let cap = opts
                .gpu_mem
                .map_or(u64::MAX, |g| (g * (1u64 << 30) as f64) as u64);
            let p = plan(&shape, calib, Target::Gpu, free.min(cap), CHUNK).map_err(|m| {
                let why = if cap < free {
                    " (free memory capped by --gpu-mem)"
                } else {
                    ""
                };
                crate::input_err!("{m}{why}")
            })?;
            progress.line(p.to_string().trim_end());
            Ok(Placement {
                parked: p.activations == Activations::HostStreamed,
                chunk_seqs: p.chunk_seqs,
                embed_on_device: p.fits_before_blocks((cfg.vocab * cfg.d * 4) as u64),
                expert_group: expert_group(p.expert_group, cfg, opts, progress)?,
            })
        }
        None => {
            if opts.gpu_mem.is_some() {
                progress.line(
                    "note: --gpu-mem caps GPU memory; this run is on the CPU, so it has no effect",
                );
            }
            let free = host_available_bytes().unwrap_or(u64::MAX);
            match plan(&shape, calib, Target::Cpu, free, CHUNK) {
                Ok(p) => progress.line(p.to_string().trim_end()),
                Err(m) => progress.line(&format!("warning: {m}")),
            }
            Ok(Placement {
                parked: false,
                chunk_seqs: CHUNK,
                embed_on_device: false,
                expert_group: expert_group(None, cfg, opts, progress)?,
            })
        }
    }
}

/// Splits X [n_seq·t × d] into chunks of `placement.chunk_seqs` sequences, placed as planned: on the device,
/// or parked in pinned host memory (host backends keep plain vectors either way).
fn place_activations(
    be: &dyn Backend,
    x: Vec<f32>,
    per_seq: usize,
    placement: &Placement,
) -> anyhow::Result<Vec<Tensor>> {
    if x.is_empty() {
        return Ok(Vec::new());
    }
    let per_chunk = placement.chunk_seqs * per_seq;
    x.chunks(per_chunk)
        .map(|c| place(be, c.to_vec(), placement))
        .collect()
}

/// One chunk of X where the plan puts it.
fn place(be: &dyn Backend, chunk: Vec<f32>, placement: &Placement) -> anyhow::Result<Tensor> {
    place_t(be, Tensor::Host(chunk), placement)
}

fn place_t(be: &dyn Backend, t: Tensor, placement: &Placement) -> anyhow::Result<Tensor> {
    if placement.parked {
        be.to_host(t, true)
    } else {
        be.to_device(t)
    }
}

pub fn run(opts: &RunOptions, progress: &Progress) -> anyhow::Result<RunReport> {
    let t_start = Instant::now();
    opts.validate().map_err(|m| crate::input_err!("{m}"))?;
    if let Some(r) = &opts.rotate {
        crate::model::rotate::check_foldable(&opts.model, r)?;
    }
    let (be, note) = select_backend_with(opts.device, opts.gemm)?;
    if let Some(n) = note {
        progress.line(&n);
    }
    crate::quant::profile::set_fencing(opts.profile);
    if let Some(t) = opts.gguf_type
        && be.device_memory().is_some()
        && t.types()
            .into_iter()
            .any(crate::export::gguf_mix::via_codec)
    {
        return Err(crate::input_err!(
            "--gguf-type {}: its grids (GGUF lattices: quant/lattice.rs) are searched on the CPU only, not \
             on {}: pass --device cpu",
            t.name(),
            be.name()
        ));
    }
    if opts.signed_scales && !be.signed_scales() {
        progress.line(&format!(
            "note: signed scales (GGUF's default) are searched on the CPU only; on {} the scales stay positive",
            be.name()
        ));
    }
    if opts.refit_scales && be.device_memory().is_some() {
        return Err(crate::input_err!(
            "--refit-scales runs on the CPU only, not on {}: pass --device cpu",
            be.name()
        ));
    }
    let traffic_start = be.traffic();
    let model = Model::open(&opts.model)?;
    if opts.asym_calib.is_some() && model.cfg.block.moe.is_some() {
        return Err(crate::input_err!(
            "--asym-calib is for dense models: in a mixture of experts the FP and the quantized stream \
             route tokens to different experts"
        ));
    }
    if model.is_quantized() {
        return Err(file_err(
            &opts.model,
            "is a quantized checkpoint; quantize the original model instead",
        ));
    }
    // The default group size follows the model's widths; everything after this reads the resolved one.
    // GGUF's blocks are 32 columns whatever the widths.
    let gguf = opts.format == OutFormat::Gguf || opts.gguf_type.is_some();
    let resolved = RunOptions {
        group_size: match (gguf, opts.group_size) {
            (true, options::GroupSize::Auto) => {
                options::GroupSize::Columns(crate::export::gguf_model::BLOCK)
            }
            (_, g) => g.resolve(model.cfg.block.linears.iter().map(|l| l.d_in)),
        },
        ..opts.clone()
    };
    // llama.cpp reads no field that could say so: it would run the model without the transform.
    if opts.format == OutFormat::Gguf
        && (model.cfg.block.online_down.is_some() || opts.rotate.as_ref().is_some_and(|r| r.online))
    {
        return Err(crate::input_err!(
            "an online Hadamard (--rotate-online, R4) cannot be written as GGUF: llama.cpp would run the \
             model without it; use --format gptq_v2 or fake and evaluate with boa-cuda"
        ));
    }
    if gguf {
        crate::export::gguf_model::check_model(&model.cfg, &model.dir)
            .map_err(|m| crate::input_err!("{m}"))?;
    } else if opts.group_size == options::GroupSize::Auto {
        progress.line(&match resolved.group_size.columns() {
            Some(g) => format!(
                "group size {g} (auto: the largest of 128, 64, 32 dividing every input width; --group-size \
                 -1 for per-channel)"
            ),
            None => "group size per-channel (auto: no 128, 64 or 32 divides every input width)".into(),
        });
    }
    let opts = &resolved;
    opts.validate().map_err(|m| crate::input_err!("{m}"))?;
    let cfg = &model.cfg;
    // Everything a later block would reject, before any work (validate.rs); the output is locked for the
    // whole run once the command is known to be sound, before anything is written or removed.
    let validate::Plan {
        layers,
        needs_calib,
    } = validate::before_work(opts, &model, progress)?;
    let placement = state_memory_plan(be.as_ref(), cfg, opts, needs_calib, progress)?;
    let _lock = crate::export::out_lock::OutLock::acquire(&opts.out)?;
    validate::scan_tensors(&model, &layers, opts.wbits)?;
    let last_needed = layers.last();

    // The output folder first: an unwritable --out or a full disk fails now, not after the calibration.
    let (mut folder, existed) =
        OutFolder::prepare(&opts.out, opts.force, opts.resume, cfg.n_layers + 1)?;
    if existed && !opts.resume {
        progress.line(&format!(
            "replaced the partial folder {} of an earlier run (pass --resume to continue one)",
            folder.tmp.display()
        ));
    }
    // From here on, an error removes the partial folder unless it holds finished blocks.
    let had_state = opts.resume && resume::exists(&folder.tmp);
    let mut progressed = false;
    let result = (|| -> anyhow::Result<RunReport> {
        let streams: usize = if opts.asym_calib.is_some() { 2 } else { 1 };
        let x_bytes = if needs_calib {
            (opts.nsamples * opts.seqlen * cfg.d * 4) as u64
        } else {
            0
        };
        let rotated_bytes = match opts.rotate {
            Some(_) => crate::model::rotate::rotated_bytes(&model),
            None => 0,
        };
        resume::check_free_space(
            &folder.tmp,
            // --asym-calib saves the FP stream beside X.
            model.store.total_bytes() + streams as u64 * 2 * x_bytes + rotated_bytes,
        )?;
        // --rotate: the rotated model (written inside the partial folder, removed before the publish) is the
        // one calibrated, quantized and exported; the fingerprint is the source's plus the rotation options.
        let rotated = match &opts.rotate {
            Some(spec) => Some(crate::model::rotate::rotate_for_run(
                &model,
                &folder.tmp,
                spec,
                progress,
            )?),
            None => None,
        };
        let source = &model;
        let (model, rotation) = match &rotated {
            Some((m, info)) => (m, Some(info)),
            None => (source, None),
        };
        let cfg = &model.cfg;

        let mut timings = Timings::default();
        let t0 = Instant::now();
        let (calib_ids, n_seq) = if needs_calib {
            let tok = Tokenizer::load(&model.dir)?;
            let ids = tok.encode(&text::read_all(&opts.calib)?)?;
            let need = opts.nsamples * opts.seqlen;
            if ids.len() < need {
                return Err(crate::input_err!(
                    "the calibration text has {} tokens, fewer than --nsamples {} × --seqlen {} = {need}",
                    ids.len(),
                    opts.nsamples,
                    opts.seqlen
                ));
            }
            let wins = windows::calibration_windows(&ids, opts.nsamples, opts.seqlen, opts.seed)?;
            (Some(wins.concat()), opts.nsamples)
        } else {
            (None, 0)
        };
        let fingerprint = resume::fingerprint(opts, source, &be.name(), calib_ids.as_deref())?;
        // Embedded a chunk at a time, so the host never holds X twice; on a device with room for the table,
        // gathered there, so X never crosses PCIe.
        let embed = |flat: &[u32]| -> anyhow::Result<Vec<Tensor>> {
            // A scaled embedding (Gemma) is scaled by the gather: the table is also the head.
            let table = if placement.embed_on_device {
                be.upload_weight(&model.embed_table()?)?
            } else {
                None
            };
            let scale = cfg.block.embed_scale.unwrap_or(1.0);
            flat.chunks(placement.chunk_seqs * opts.seqlen)
                .map(|ids| {
                    Ok(match &table {
                        Some(t) => {
                            model.check_ids(ids)?;
                            place_t(be.as_ref(), be.embed_t(t, ids, cfg.d, scale)?, &placement)?
                        }
                        None => place(be.as_ref(), model.embed(ids)?, &placement)?,
                    })
                })
                .collect()
        };
        let ropes = model.rope_tables(opts.seqlen);
        // --alloc-scope model: every block's widths before any block is quantized (a resumed run makes the
        // same pass again and gets the same widths).
        let t_alloc = Instant::now();
        let chosen = match (&opts.bits, &calib_ids) {
            (Some(a), Some(flat)) if a.scope == AllocScope::Model => {
                Some(ranged(c"allocation proxy", || {
                    model_allocation::allocate(
                        be.as_ref(),
                        model,
                        opts,
                        &layers,
                        &ropes,
                        embed(flat)?,
                        *progress,
                    )
                })?)
            }
            _ => None,
        };
        let alloc_secs = t_alloc.elapsed().as_secs_f64();
        let saved = if opts.resume {
            let export = resume::Export {
                format: opts.format,
                bits: opts.wbits,
                // Per-linear widths (--avg-bits) or GGUF codecs (--gguf-type): not converted.
                mixed_bits: opts.bits.is_some() || opts.gguf_type.is_some(),
                dtype: model.store.main_dtype(),
                quantized: &|l| layers.contains(l),
            };
            resume::load(&folder.tmp, &fingerprint, cfg.n_layers, &export, progress)?
        } else {
            None
        };
        let (start, mut x, mut x_fp, mut reports) = match saved {
            Some(s) => {
                progress.line(&format!(
                    "resuming from block {} of {} ({})",
                    s.next_block,
                    cfg.n_layers,
                    folder.tmp.display()
                ));
                for i in 0..s.next_block {
                    folder.adopt_shard(i)?;
                }
                timings = s.timings;
                let mut x = s.x.unwrap_or_default();
                let want = if needs_calib && s.next_block <= last_needed {
                    streams * n_seq * opts.seqlen * cfg.d
                } else {
                    0
                };
                if x.len() != want {
                    return Err(crate::input_err!(
                        "the resume state in {} has {} activations, expected {want}; run without \
                         --resume to start over",
                        folder.tmp.display(),
                        x.len()
                    ));
                }
                // --asym-calib: the FP stream was saved after X.
                let fp = x.split_off(want / streams);
                let x = place_activations(be.as_ref(), x, opts.seqlen * cfg.d, &placement)?;
                let fp = place_activations(be.as_ref(), fp, opts.seqlen * cfg.d, &placement)?;
                (s.next_block, x, fp, s.reports)
            }
            None => {
                if opts.resume {
                    progress.line(&format!(
                        "nothing to resume at {}; starting from block 0",
                        folder.tmp.display()
                    ));
                }
                let x = match &calib_ids {
                    Some(flat) => embed(flat)?,
                    None => Vec::new(),
                };
                // --asym-calib: the FP model's stream starts as X (the embedding is not quantized), placed
                // as X is (a parked chunk's copy parked too).
                let fp = match opts.asym_calib {
                    Some(_) => x
                        .iter()
                        .map(|c| match c {
                            Tensor::Pinned(_) => {
                                place(be.as_ref(), be.read(c)?.into_owned(), &placement)
                            }
                            _ => be.duplicate(c),
                        })
                        .collect::<anyhow::Result<_>>()?,
                    None => Vec::new(),
                };
                (0, x, fp, Vec::new())
            }
        };
        drop(calib_ids);
        if start == 0 {
            timings.calibration_data = t0.elapsed().as_secs_f64() - alloc_secs;
        }
        timings.alloc_proxy += alloc_secs;
        let out_dtype = model.store.main_dtype();

        let base_total = timings.total;
        // Blocks whose weights the loop reads: the selected ones, and the others while X must pass them.
        let needs_weights = |l: usize| layers.contains(l) || (needs_calib && l < last_needed);
        // The bar counts only those: the rest are copied through in a moment, and counting them would make
        // the ETA of `--layers 0-1` on an 80-layer model forty times too long.
        let worked = |r: std::ops::Range<usize>| r.filter(|&l| needs_weights(l)).count() as u64;
        let mut bar = progress.bar("quantize", worked(0..cfg.n_layers), "blocks");
        bar.skip(worked(0..start));
        let be = be.as_ref();
        // A block's weights in f32 on the host, and (when X goes through it) copied into the backend's
        // memory: for the prefetch thread, so both the disk read and the upload overlap the previous block.
        let model_ref = &model;
        // With experts in groups, the block goes up with its first group of experts; each later group when
        // its pass comes.
        let passes = expert_groups::passes(&cfg.block, placement.expert_group);
        let first_pass = passes[0].holds(&cfg.block);
        let first_pass = &first_pass;
        let load = move |l: usize| -> anyhow::Result<(BlockWeights, ResidentWeights)> {
            let w = model_ref.load_block(l)?;
            // On the prefetch thread, off the block loop's path: a scan of every weight (0.2 s of one core
            // per 7B block). scan_tensors checked the file before any work; this checks what the block's
            // forward will read (a --rotate model is derived after that scan).
            check_finite(&w, l)?;
            let resident = if needs_calib {
                ResidentWeights::upload_some(be, &w, &|i| first_pass[i])?
            } else {
                ResidentWeights::default()
            };
            Ok((w, resident))
        };
        let mut traffic = traffic::TrafficReport {
            source: be.traffic().source,
            setup: be.traffic() - traffic_start,
            ..Default::default()
        };
        std::thread::scope(|scope| -> anyhow::Result<()> {
            // Block l+1 is read and converted on a second thread while block l works (design.md §3).
            let mut prefetch = None;
            let (mut last_save, mut save_cost) = (Instant::now(), 0.0);
            let mut writing = None;
            // A resume save being made durable on a third thread (its seconds come back); one in flight.
            let mut saving: Option<std::thread::ScopedJoinHandle<'_, anyhow::Result<f64>>> = None;
            for l in start..cfg.n_layers {
                let rope = ropes.layer(l);
                let t_block = Instant::now();
                let traffic_block = be.traffic();
                let mut traffic_save = crate::ops::Traffic::default();
                let mut floor_bytes = 0u64;
                let mut load_wait = 0.0;
                let selected = layers.contains(l);
                let w_read = needs_weights(l);
                let w = if w_read {
                    let t = Instant::now();
                    let w = match prefetch.take() {
                        Some(h) => join_load(h)?,
                        None => load(l)?,
                    };
                    load_wait = t.elapsed().as_secs_f64();
                    timings.load += load_wait;
                    Some(w)
                } else {
                    None
                };
                if l + 1 < cfg.n_layers && needs_weights(l + 1) {
                    prefetch = Some(scope.spawn(move || load(l + 1)));
                }
                if !selected {
                    if let Some((w, resident)) = &w {
                        let t = Instant::now();
                        ranged(c"forward", || {
                            forward_all(be, w, resident, &model.cfg, rope, &mut x)?;
                            // An unselected block is FP in both streams.
                            forward_all(be, w, resident, &model.cfg, rope, &mut x_fp)
                        })
                        .with_context(|| format!("layer {l}: forward"))?;
                        timings.forward += t.elapsed().as_secs_f64();
                    }
                    let t = Instant::now();
                    ranged(c"write", || {
                        folder.write_shard(l, &stored_entries(model, l)?)
                    })?;
                    timings.write += t.elapsed().as_secs_f64();
                } else {
                    bar.set_message(format!("layer {l}"));
                    let (mut w, mut resident) = w.expect("a selected block's weights are read");
                    let n = cfg.block.linears.len();
                    let mut packed: Vec<Option<StoredLinear>> = (0..n).map(|_| None).collect();
                    let mut linears: Vec<Option<quantize_block::LinearReport>> = vec![None; n];
                    let mut hats: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
                    for pass in &passes {
                        if pass.experts.is_some() {
                            let holds = pass.holds(&cfg.block);
                            resident
                                .upload_more(be, &w, &|i| holds[i])
                                .with_context(|| format!("layer {l}: uploading {pass}"))?;
                        }
                        let done = block_pass::quantize_pass(
                            be,
                            &mut w,
                            &mut resident,
                            pass,
                            &mut block_pass::BlockRun {
                                cfg,
                                opts,
                                layer: l,
                                rope,
                                x: &x,
                                needs_calib,
                                chosen: chosen.as_ref(),
                                timings: &mut timings,
                                floor_bytes: &mut floor_bytes,
                                x_fp: opts.asym_calib.map(|_| &mut x_fp[..]),
                            },
                        )?;
                        for (i, (p, r, hat)) in done {
                            (packed[i], linears[i], hats[i]) = (Some(p), Some(r), hat);
                        }
                    }
                    let missing = || anyhow::anyhow!("layer {l}: a linear no pass quantized");
                    let packed = packed
                        .into_iter()
                        .map(|p| p.ok_or_else(missing))
                        .collect::<anyhow::Result<Vec<_>>>()?;
                    reports.push(LayerReport {
                        layer: l,
                        linears: linears
                            .into_iter()
                            .map(|r| r.ok_or_else(missing))
                            .collect::<anyhow::Result<_>>()?,
                    });
                    // The quantized block makes the next block's inputs from the Ŵ the quantizer left in the
                    // backend's memory (an expert of a grouped block: on the host, uploaded as it runs).
                    let online = resident.take_online();
                    drop(resident);
                    let resident = ResidentWeights::from_tensors(hats, online);
                    if needs_calib && l < last_needed {
                        let t = Instant::now();
                        ranged(c"forward", || {
                            forward_all(be, &w, &resident, cfg, rope, &mut x)
                        })
                        .with_context(|| format!("layer {l}: forward of the quantized block"))?;
                        crate::quant::profile::fence(be);
                        timings.forward += t.elapsed().as_secs_f64();
                    }
                    drop(resident);
                    // Written on another thread while the next block works; one write in flight.
                    let t = Instant::now();
                    finish_write(&mut writing, &mut folder)?;
                    timings.write += t.elapsed().as_secs_f64();
                    let (path, model, format, sym) =
                        (folder.shard_path(l), &model, opts.format, opts.sym);
                    writing = Some(scope.spawn(move || {
                        ranged(c"write", || {
                            let entries =
                                quantized_entries(model, l, &packed, format, sym, out_dtype)?;
                            write_shard_file(&path, &entries)?;
                            Ok((l, shard_contents(&entries)))
                        })
                    }));
                }
                // X_{l+1} is kept only while a later block still needs it.
                if !(needs_calib && l < last_needed) {
                    x.clear();
                    x_fp.clear();
                }
                if selected {
                    timings
                        .blocks
                        .push(t_block.elapsed().as_secs_f64() - load_wait);
                }
                // Saving X costs seconds per block on a 7B model (GiBs to disk). The block waits only for X's
                // copy to the host; the disk write overlaps the next blocks. Save when the last save took at
                // most ~10% of the time since it, and after the last block.
                if saving.as_ref().is_some_and(|h| h.is_finished()) {
                    save_cost += finish_save(&mut saving)?;
                }
                if saving.is_none() && last_save.elapsed().as_secs_f64() >= 10.0 * save_cost
                    || l + 1 == cfg.n_layers
                {
                    let t = Instant::now();
                    finish_write(&mut writing, &mut folder)?;
                    finish_save(&mut saving)?;
                    // X, then --asym-calib's FP stream (empty without it).
                    let x_next = (needs_calib && l < last_needed)
                        .then(|| (be, x.iter().chain(&x_fp).collect::<Vec<_>>()));
                    timings.total = base_total + t_start.elapsed().as_secs_f64();
                    let before_save = be.traffic();
                    // A copy of X on the host lets the disk write overlap the next blocks; without room for
                    // it (twice X free), the write streams X from the backend while the run waits.
                    let x_bytes = x_next
                        .as_ref()
                        .map_or(0, |(_, c)| 4 * c.iter().map(|t| t.len()).sum::<usize>());
                    let room = x_bytes == 0
                        || memory_plan::host_available_bytes()
                            .is_none_or(|free| free >= 2 * x_bytes as u64);
                    let copy = room && !resume::test_streamed_saves();
                    let snap = resume::snapshot(l + 1, x_next, &reports, &timings, copy)?;
                    match snap.detach() {
                        resume::Detached::Free(snap) => {
                            let (tmp, fingerprint) = (folder.tmp.clone(), &fingerprint);
                            saving = Some(scope.spawn(move || {
                                let t = Instant::now();
                                ranged(c"resume save", || {
                                    resume::persist(&tmp, fingerprint, snap)
                                })?;
                                Ok(t.elapsed().as_secs_f64())
                            }));
                        }
                        resume::Detached::Streamed(streamed) => ranged(c"resume save", || {
                            resume::persist(&folder.tmp, &fingerprint, streamed)
                        })?,
                    }
                    traffic_save = be.traffic() - before_save;
                    traffic.resume_saves = traffic.resume_saves + traffic_save;
                    save_cost = t.elapsed().as_secs_f64();
                    timings.write += save_cost;
                    last_save = Instant::now();
                    progressed = true;
                }
                if selected && !traffic.source.is_empty() {
                    traffic.blocks.push(traffic::BlockTraffic {
                        layer: l,
                        traffic: (be.traffic() - traffic_block) - traffic_save,
                        floor_bytes,
                    });
                }
                resume::test_hooks(l)?;
                if w_read {
                    bar.inc(1);
                }
            }
            let t = Instant::now();
            finish_save(&mut saving)?;
            timings.write += t.elapsed().as_secs_f64();
            Ok(())
        })?;
        bar.finish();
        folder.write_shard(cfg.n_layers, &global_entries(model)?)?;
        if opts.format == OutFormat::Gguf {
            let t = Instant::now();
            let w = write_gguf(&folder, model, source, opts, &reports)?;
            timings.write += t.elapsed().as_secs_f64();
            progress.line(&format!(
                "wrote {} ({} tensors, {:.1} MiB) in {:.1} s",
                crate::export::gguf_model::FILE_NAME,
                w.tensors,
                w.bytes as f64 / (1u64 << 20) as f64,
                t.elapsed().as_secs_f64()
            ));
        } else {
            write_hf_configs(&folder, model, opts, &layers, &reports, rotation)?;
        }
        timings.total = base_total + t_start.elapsed().as_secs_f64();
        let mut report = RunReport::new(opts, be.name(), reports, timings, n_seq * opts.seqlen);
        report.traffic = traffic;
        if let Some(m) = &cfg.block.moe {
            report.full_precision = std::iter::once(m.router)
                .chain(m.shared_expert.as_ref().map(|s| s.gate))
                .map(|n| format!("{n}.weight"))
                .collect();
        }
        let mut report_json = serde_json::to_value(&report)?;
        if let Some(info) = rotation {
            report_json["rotation"] = serde_json::to_value(info)?;
        }
        folder.write_json("report.json", &report_json)?;
        Ok(report)
    })();
    match result {
        Ok(report) => {
            resume::clear(&folder.tmp)?;
            crate::model::rotate::remove_for_run(&folder.tmp)?;
            if opts.format == OutFormat::Gguf {
                folder.publish_without_shards()?;
            } else {
                folder.publish()?;
            }
            Ok(report)
        }
        Err(e) => {
            if progressed {
                progress.line(&format!(
                    "kept the finished blocks in {}: rerun with --resume to continue",
                    folder.tmp.display()
                ));
            }
            if !(progressed || had_state) {
                // Nothing worth keeping: the partial folder goes with the error.
                let _ = std::fs::remove_dir_all(&folder.tmp);
            }
            Err(e)
        }
    }
}

/// `--format gguf`: the finished shards of the partial folder (gptq_v2) as one GGUF file beside them; the
/// shards go at the publish.
fn write_gguf(
    folder: &OutFolder,
    model: &Model,
    source: &Model,
    opts: &RunOptions,
    reports: &[LayerReport],
) -> anyhow::Result<crate::export::gguf_model::Written> {
    folder.write_index()?;
    let store = crate::model::weights::WeightStore::open(&folder.tmp)?;
    let bits: std::collections::HashMap<String, u32> = width_rules::linear_bits(reports).collect();
    let name = source
        .dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".into());
    crate::export::gguf_model::write_model_gguf(
        &store,
        &model.cfg,
        &model.dir,
        &|p| bits.get(p).copied().unwrap_or(opts.wbits),
        opts.gguf_type.map_or(
            crate::export::gguf_model::file_type_of_bits(opts.wbits),
            |t| t.file_type(),
        ),
        &name,
        &folder.tmp.join(crate::export::gguf_model::FILE_NAME),
    )
}

/// config.json (with the format's quantization_config), quantize_config.json for the GPTQ formats, and the
/// model folder's other files.
fn write_hf_configs(
    folder: &OutFolder,
    model: &Model,
    opts: &RunOptions,
    layers: &options::LayerSet,
    reports: &[LayerReport],
    rotation: Option<&crate::model::rotate::RotationInfo>,
) -> anyhow::Result<()> {
    let cfg = &model.cfg;
    {
        let mut config = cfg.json.clone();
        // The one entry of the source's own that the output keeps: without it, model_type names a
        // transform no field describes (model/online.rs).
        let online = config["boa_cuda"]["online_hadamard"].clone();
        config["boa_cuda"] = serde_json::json!({"quantized": true, "method": opts.method, "wbits": opts.wbits,
            "avg_bits": opts.bits.as_ref().map(|b| b.avg),
            "group_size": opts.group_size.columns().map(|g| g as i64).unwrap_or(-1), "sym": opts.sym,
            "format": opts.format.name()});
        if let Some(info) = rotation {
            config["boa_cuda"]["rotation"] = info.config_json();
        }
        if !online.is_null() {
            config["boa_cuda"]["online_hadamard"] = online;
        }
        if let Some(t) = opts.gguf_type {
            config["boa_cuda"]["gguf_type"] = t.name().into();
        }
        if opts.format == OutFormat::CompressedTensors {
            // Every Linear is a target; the unquantized ones must be named or the loader looks for their
            // packed weights.
            let mut ignore = vec!["lm_head".to_string()];
            for l in (0..cfg.n_layers).filter(|&l| !layers.contains(l)) {
                ignore.extend(
                    cfg.block
                        .linears
                        .iter()
                        .map(|d| format!("model.layers.{l}.{}", d.name)),
                );
            }
            // An MoE block's router (and Qwen2-MoE's shared-expert gate) are Linear modules kept in high
            // precision in every block.
            if let Some(m) = &cfg.block.moe {
                for l in 0..cfg.n_layers {
                    ignore.extend(
                        std::iter::once(m.router)
                            .chain(m.shared_expert.as_ref().map(|s| s.gate))
                            .map(|n| format!("model.layers.{l}.{n}")),
                    );
                }
            }
            let widths: Vec<(String, u32)> = width_rules::linear_bits(reports).collect();
            config["quantization_config"] = crate::export::compressed_tensors::quantization_config(
                opts.wbits,
                &widths,
                opts.group_size.columns(),
                opts.sym,
                ignore,
            );
        } else if opts.format != OutFormat::Fake {
            let q = quantization_config(
                opts.format,
                opts.wbits,
                opts.group_size.columns(),
                opts.permuted_groups(),
                opts.sym,
                opts.damp,
                opts.static_groups,
                opts.method.name(),
                crate::export::gptq_packed::dynamic_bits(
                    opts.wbits,
                    width_rules::dynamic_rules(cfg, reports),
                    width_rules::unquantized_blocks(cfg, layers),
                ),
            );
            let mut q = q;
            q["modules_in_block_to_quantize"] =
                width_rules::modules_in_block_to_quantize(cfg, layers);
            config["quantization_config"] = q.clone();
            folder.write_json("quantize_config.json", &q)?;
        }
        folder.write_json("config.json", &config)?;
        folder.copy_model_files(&model.dir)?;
    }
    Ok(())
}

/// X ← block(X), chunk by chunk, with the block's weights already in the backend's memory (`resident`). A
/// parked chunk (pinned host memory) visits the device for its forward and goes back.
pub(super) fn forward_all(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: &ResidentWeights,
    cfg: &crate::model::config::Config,
    rope: &crate::model::llama::RopeTable,
    x: &mut [Tensor],
) -> anyhow::Result<()> {
    let per_seq = rope.t * cfg.d;
    let mut staging = stats::Staging::new(be, x)?;
    for i in 0..x.len() {
        let staged = staging.advance(be, x)?;
        let c = &mut x[i];
        let ns = c.len() / per_seq;
        match staged {
            Some(mut xt) => {
                block_forward(be, w, Some(resident), cfg, rope, &mut xt, ns, None)?;
                be.write_back(&xt, c)?;
            }
            None => block_forward(be, w, Some(resident), cfg, rope, c, ns, None)?,
        }
    }
    Ok(())
}

/// A shard being written on the writer thread: its block and (tensor, bytes) for the folder's index.
type ShardWrite<'s> =
    std::thread::ScopedJoinHandle<'s, anyhow::Result<(usize, Vec<(String, u64)>)>>;

/// Waits for the shard in flight, if any, and books it into the folder's index.
fn finish_write(
    writing: &mut Option<ShardWrite<'_>>,
    folder: &mut OutFolder,
) -> anyhow::Result<()> {
    if let Some(h) = writing.take() {
        let (l, contents) = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        folder.record_shard(l, &contents);
    }
    Ok(())
}

/// Waits for the resume save in flight, if any; its seconds on the saving thread (0 when none).
fn finish_save(
    saving: &mut Option<std::thread::ScopedJoinHandle<'_, anyhow::Result<f64>>>,
) -> anyhow::Result<f64> {
    match saving.take() {
        Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
        None => Ok(0.0),
    }
}

/// The weights the prefetch thread read (its panic, if any, resumes here).
fn join_load(
    h: std::thread::ScopedJoinHandle<'_, anyhow::Result<(BlockWeights, ResidentWeights)>>,
) -> anyhow::Result<(BlockWeights, ResidentWeights)> {
    h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// NaN or Inf in a weight would poison every Hessian downstream: name the tensor instead.
fn check_finite(w: &BlockWeights, l: usize) -> anyhow::Result<()> {
    for (name, lin) in w.named() {
        if let Some(i) = lin.w.iter().position(|v| !v.is_finite()) {
            return Err(crate::input_err!(
                "tensor model.layers.{l}.{name}.weight has a non-finite value ({}) at index {i}",
                lin.w[i]
            ));
        }
    }
    Ok(())
}

/// Every tensor of block l exactly as stored (blocks outside --layers).
fn stored_entries(model: &Model, l: usize) -> anyhow::Result<Vec<TensorEntry<'_>>> {
    model
        .block_shapes(l)
        .into_iter()
        .filter(|(n, _)| model.store.contains(n))
        .map(|(name, _)| {
            let e = model.store.entry(&name).expect("checked").clone();
            Ok(TensorEntry::new(
                name.clone(),
                e.dtype,
                e.shape,
                model.store.bytes(&name)?,
            ))
        })
        .collect()
}

/// Block l with each linear's weight replaced by its quantized form (`quantized`, in the description's order):
/// dequantized in `dtype` for the fake format, packed tensors otherwise (`sym`: compressed-tensors' symmetric
/// layout, which stores no zero points).
fn quantized_entries<'a>(
    model: &'a Model,
    l: usize,
    quantized: &[StoredLinear],
    format: OutFormat,
    sym: bool,
    dtype: safetensors::Dtype,
) -> anyhow::Result<Vec<TensorEntry<'a>>> {
    let mut out = Vec::new();
    for e in stored_entries(model, l)? {
        let short = e
            .name
            .trim_start_matches(&format!("model.layers.{l}."))
            .to_string();
        match short
            .strip_suffix(".weight")
            .and_then(|n| model.cfg.block.index_of(n))
        {
            Some(i) => {
                let prefix = format!("model.layers.{l}.{}", model.cfg.block.linears[i].name);
                out.extend(match &quantized[i] {
                    StoredLinear::Blocks(c) => {
                        c.entries(&prefix, format == OutFormat::Fake, dtype)?
                    }
                    StoredLinear::Packed(p) if format == OutFormat::CompressedTensors => {
                        crate::export::compressed_tensors::linear_entries(&prefix, p, sym, dtype)?
                    }
                    StoredLinear::Packed(p) => linear_entries(&prefix, p, format, dtype)?,
                })
            }
            None => out.push(e),
        }
    }
    Ok(out)
}

/// A quantized linear as the shard holds it: GPTQ's packed tensors, or (a `--gguf-type` codec type whose
/// grids GPTQ's layout cannot hold) its GGUF blocks.
pub(super) enum StoredLinear {
    Packed(crate::ops::Packed),
    Blocks(crate::export::gguf_model::CodecLinear),
}

impl StoredLinear {
    /// Bytes the backend handed to the host for it (`run --profile`'s floor).
    pub(super) fn down_bytes(&self) -> u64 {
        match self {
            StoredLinear::Packed(p) => {
                4 * p.qweight.len() as u64 + 8 * (p.d_out * p.n_groups) as u64
            }
            // Encoded on the host (codec types run on the CPU only): nothing crossed.
            StoredLinear::Blocks(_) => 0,
        }
    }
}

/// Packs a block's quantized linears (`types`: each one's GGUF type under --gguf-type), the packed ones read
/// back together (`QuantOps::pack_all`: one synchronization for the block); a codec type is encoded from its
/// codes and grids read back to the host (a CPU run: the codec types refuse the GPU before any work).
pub(super) fn store_block(
    be: &dyn Backend,
    quantized: &[(crate::ops::QuantizedLinear, quantize_block::LinearReport)],
    types: &[Option<crate::model::gguf::GgmlType>],
) -> anyhow::Result<Vec<StoredLinear>> {
    let codec = |i: usize| {
        types
            .get(i)
            .copied()
            .flatten()
            .filter(|&t| crate::export::gguf_mix::via_codec(t))
    };
    let plain: Vec<&crate::ops::QuantizedLinear> = quantized
        .iter()
        .enumerate()
        .filter(|&(i, _)| codec(i).is_none())
        .map(|(_, (q, _))| q)
        .collect();
    let mut packed = be.pack_all(&plain)?.into_iter();
    quantized
        .iter()
        .enumerate()
        .map(|(i, (q, r))| -> anyhow::Result<StoredLinear> {
            let stored = match codec(i) {
                Some(t) => StoredLinear::Blocks(
                    crate::export::gguf_model::CodecLinear::encode(
                        "linear",
                        t,
                        &be.read_codes(&q.codes)?,
                        &be.read_f64(&q.grids.scale)?,
                        &be.read_f64(&q.grids.zero)?,
                        q.d_out,
                        q.d_in,
                    )
                    .with_context(|| r.name.clone())?,
                ),
                None => StoredLinear::Packed(
                    packed
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("pack_all returned too few linears"))?
                        .with_context(|| r.name.clone())?,
                ),
            };
            Ok(stored)
        })
        .collect()
}

/// Embeddings, final norm and lm_head as stored.
fn global_entries(model: &Model) -> anyhow::Result<Vec<TensorEntry<'_>>> {
    let mut names = vec!["model.embed_tokens.weight", "model.norm.weight"];
    if model.store.contains("lm_head.weight") {
        names.push("lm_head.weight");
    }
    names
        .into_iter()
        .map(|n| {
            let e = model
                .store
                .entry(n)
                .ok_or_else(|| file_err(&model.dir, format!("tensor {n} is missing")))?;
            Ok(TensorEntry::new(
                n,
                e.dtype,
                e.shape.clone(),
                model.store.bytes(n)?,
            ))
        })
        .collect()
}
