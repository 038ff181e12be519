//! Perplexity: mean next-token NLL over non-overlapping windows, exp'd (the protocol of GPTQ/BoA papers).
//!
//! On the CPU, windows go through the model a chunk at a time and block by block, so memory holds one block's
//! f32 weights plus the chunk's activations, whatever the model size. A device backend keeps the activations of
//! a pass of windows (all of them when they fit a quarter of its free memory) and streams the blocks once per
//! pass, each block's weights uploaded once (packed ones in their packed form) and read by every chunk.

use crate::backend::Backend;
use crate::backend::cpu::{max_lanes, sum_exp_f64};
use crate::backend::{Tensor, Weight};
use crate::data::{text, tokenizer::Tokenizer, windows};
use crate::model::Model;
use crate::model::llama::{ResidentWeights, block_forward};
use crate::progress::Progress;
use rayon::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

pub mod cpu;

pub struct EvalOptions {
    pub data: Vec<PathBuf>,
    pub seqlen: usize,
    pub max_windows: Option<usize>,
    /// Windows forwarded together through each block.
    pub chunk: usize,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalResult {
    pub perplexity: f64,
    pub tokens: usize,
    pub windows: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
}

pub fn perplexity(
    be: &dyn Backend,
    model: &Model,
    opts: &EvalOptions,
    progress: &Progress,
) -> anyhow::Result<EvalResult> {
    model
        .cfg
        .check_tensor_names(model.store.names())
        .map_err(|m| crate::error::file_err(model.dir.join("config.json"), m))?;
    windows::check_max_windows(opts.max_windows)?;
    let tok = Tokenizer::load(&model.dir)?;
    let text = text::read_all(&opts.data)?;
    let ids = tok.encode(&text)?;
    let wins = windows::eval_windows(&ids, opts.seqlen, opts.max_windows)?;
    let start = Instant::now();
    let (nll, count) = window_nll(be, model, &wins, opts.chunk.max(1), progress)?;
    let seconds = start.elapsed().as_secs_f64();
    cpu::report_profile(seconds);
    let tokens = wins.len() * opts.seqlen;
    Ok(EvalResult {
        perplexity: (nll / count as f64).exp(),
        tokens,
        windows: wins.len(),
        seconds,
        tokens_per_second: tokens as f64 / seconds,
    })
}

/// Sum of next-token NLLs over all windows and the number of predictions (seqlen − 1 per window).
pub fn window_nll(
    be: &dyn Backend,
    model: &Model,
    wins: &[&[u32]],
    chunk: usize,
    progress: &Progress,
) -> anyhow::Result<(f64, usize)> {
    let c = &model.cfg;
    let t = wins[0].len();
    let ropes = model.rope_tables(t);
    let norm = model.final_norm()?;
    let head = model.lm_head()?;
    // A device backend keeps the LM head (and, when tied, the embedding table: the same matrix) in its own
    // memory for the whole evaluation instead of copying it per window.
    let head_t = be.upload_weight(&head)?;
    // An untied table has the head's length: through `to_device`, so it does not claim a staging buffer.
    let table_t = match &head_t {
        Some(_) if !c.tie_word_embeddings => {
            Some(be.to_device(Tensor::Host(model.embed_table()?))?)
        }
        _ => None,
    };
    let n_chunks = wins.len().div_ceil(chunk);
    let mut bar = progress.bar("eval", (n_chunks * (c.n_layers + 1)) as u64, "blocks");
    let (mut nll, mut count) = (0f64, 0usize);
    // The CPU backend on a model without packed linears takes the fused window-parallel path (eval::cpu).
    // It masks causally only: a layer whose window is shorter than the evaluation window takes the generic one.
    let slides = (0..c.n_layers).any(|l| c.block.window_at(l).is_some_and(|w| w < t));
    let fused = be.name() == "cpu" && !model.is_quantized() && c.block.is_llama_like() && !slides;
    if fused {
        for group in wins.chunks(chunk) {
            let ids: Vec<u32> = group.iter().flat_map(|w| w.iter().copied()).collect();
            count += group.len() * (t - 1);
            let mut x = model.embed(&ids)?;
            nll += cpu::chunk_nll(
                c,
                ropes.layer(0),
                &mut x,
                group,
                |l| {
                    cpu::FusedBlock::new(model.load_block(l)?)?
                        .ok_or_else(|| anyhow::anyhow!("block {l} has packed linears"))
                },
                &norm,
                &head,
                || bar.inc(1),
            )?;
        }
        bar.finish();
        return Ok((nll, count));
    }
    let head_w = Weight {
        host: &head,
        resident: head_t.as_ref(),
    };
    let x_bytes = t * c.d * size_of::<f32>();
    let per_pass = match be.device_memory() {
        Some((free, _)) => ((free as usize / 4) / x_bytes.max(1)).max(chunk),
        None => wins.len(),
    };
    for pass in wins.chunks(per_pass.div_ceil(chunk) * chunk) {
        let mut xs = Vec::with_capacity(pass.len().div_ceil(chunk));
        for group in pass.chunks(chunk) {
            let ids: Vec<u32> = group.iter().flat_map(|w| w.iter().copied()).collect();
            count += group.len() * (t - 1);
            // A scaled embedding (Gemma) is scaled by the gather: a tied table is the unscaled head.
            let table = table_t.as_ref().or(head_t.as_ref());
            xs.push(match table {
                Some(table) => {
                    model.check_ids(&ids)?;
                    be.embed_t(table, &ids, c.d, c.block.embed_scale.unwrap_or(1.0))?
                }
                None => be.to_device(Tensor::Host(model.embed(&ids)?))?,
            });
        }
        for l in 0..c.n_layers {
            let w = model.load_block(l)?;
            let resident = ResidentWeights::upload_all(be, &w)?;
            for (x, group) in xs.iter_mut().zip(pass.chunks(chunk)) {
                block_forward(
                    be,
                    &w,
                    Some(&resident),
                    c,
                    ropes.layer(l),
                    x,
                    group.len(),
                    None,
                )?;
                bar.inc(1);
            }
        }
        for (x, group) in xs.iter().zip(pass.chunks(chunk)) {
            nll += head_nll(be, model, x, group, &norm, head_w)?;
            bar.inc(1);
        }
    }
    bar.finish();
    Ok((nll, count))
}

/// The logits [t × vocab] of one window of token ids, through the generic forward on `be` (the
/// comparison with other implementations; perplexity runs take the paths above).
pub fn logits(be: &dyn Backend, model: &Model, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
    let c = &model.cfg;
    anyhow::ensure!(!ids.is_empty(), "logits: no token ids");
    let ropes = model.rope_tables(ids.len());
    let mut x = be.to_device(Tensor::Host(model.embed(ids)?))?;
    for l in 0..c.n_layers {
        let w = model.load_block(l)?;
        let resident = ResidentWeights::upload_all(be, &w)?;
        block_forward(be, &w, Some(&resident), c, ropes.layer(l), &mut x, 1, None)?;
    }
    let h = be.rms_norm(&be.read(&x)?, &model.final_norm()?, c.d, c.eps)?;
    let head = model.lm_head()?;
    be.linear(&h, &head, None, ids.len(), c.d, c.vocab)
}

/// The NLL of one group of windows from the last block's output X: the final norm, then per window the
/// logits against `head`.
fn head_nll(
    be: &dyn Backend,
    model: &Model,
    xt: &Tensor,
    group: &[&[u32]],
    norm: &[f32],
    head: Weight<'_>,
) -> anyhow::Result<f64> {
    let c = &model.cfg;
    let t = group[0].len();
    let h = be.rms_norm(&be.read(xt)?, norm, c.d, c.eps)?;
    let mut nll = 0f64;
    for (s, win) in group.iter().enumerate() {
        let hs = Tensor::Host(h[s * t * c.d..(s + 1) * t * c.d].to_vec());
        let logits = be.linear_t(&hs, head, None, t, c.d, c.vocab)?;
        nll += next_token_nll(&be.read(&logits)?, win, c.vocab);
    }
    Ok(nll)
}

/// Σ_i −log softmax(logits_i)[ids_{i+1}] for i < t − 1; logits [t × vocab]. Log-sum-exp in f64; the
/// per-token terms are summed in order (a rayon `sum` would depend on the thread count).
pub fn next_token_nll(logits: &[f32], ids: &[u32], vocab: usize) -> f64 {
    let terms: Vec<f64> = logits
        .par_chunks(vocab)
        .zip(ids[1..].par_iter())
        .map(|(row, &next)| {
            let max = max_lanes(row);
            max as f64 + sum_exp_f64(row, max).ln() - row[next as usize] as f64
        })
        .collect();
    terms.iter().sum()
}
