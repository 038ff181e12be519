//! Statistics of one FP block forward on the (quantized) calibration inputs — every Hessian of design.md
//! §4.2–4.3, accumulated window chunk by window chunk where the backend computes (`QuantOps`: f64 sums on the
//! CPU, f32 in device memory on a GPU), so memory holds one chunk's intermediates and nothing crosses PCIe.

use crate::backend::{AttnShape, Backend, Tensor};
use crate::model::Config;
use crate::model::arch::{Input, LinearDesc, NormRole};
use crate::model::llama::{
    BlockTrace, BlockWeights, ResidentWeights, RopeTable, attn_projections, block_forward,
};
use crate::ops::{Mat, Result};
use crate::quant::hessian::{Accumulator, RopeAverage};
use anyhow::Context as _;
use std::time::{Duration, Instant};

pub struct BlockStats {
    /// 2/N Σ x xᵀ of the q/k/v input [d × d].
    pub h_attn: Mat,
    pub h_o: Mat,
    pub h_mlp: Mat,
    /// The dense MLP's down_proj input covariance, or an MoE block's shared expert's; None in an MoE block
    /// without one (each expert's down_proj has its own, in `experts`).
    pub h_down: Option<Mat>,
    /// An MoE block's per-expert statistics, by expert.
    pub experts: Vec<ExpertStats>,
    /// BoA only: post-RoPE key covariances per KV head, query covariances per query head [heads × d_h × d_h],
    /// and V's attention-weighted H_col per KV head [h_kv × d × d].
    pub attn: Option<AttnStats>,
    /// Time in the block forward vs. in accumulating statistics, and the part of the latter spent on V's
    /// per-head H_col (attention-weighted: the costliest statistic).
    pub forward_time: Duration,
    pub stats_time: Duration,
    pub v_col_time: Duration,
    /// `--asym-calib`: Σ (a − ã) ãᵀ of each dense input (`asym_slot`) of the FP model's a and the quantized
    /// model's ã (quant/asym.rs); None without an FP stream.
    pub dxx: Option<DiffCross>,
}

/// `BlockStats::dxx`: the raw sums where the backend computes (`QuantOps::stat_diff_cross`), by
/// `asym_slot` (None for an input the block lacks), and the scale that makes them D (2/N, as every H).
pub struct DiffCross {
    pub sums: [Option<Mat>; 4],
    pub scale: f64,
}

/// Where an input's D of `BlockStats::dxx` is: the dense inputs only (an expert's tokens differ between the
/// two streams' routings).
pub fn asym_slot(input: Input) -> Option<usize> {
    match input {
        Input::Attn => Some(0),
        Input::AttnOut => Some(1),
        Input::Mlp => Some(2),
        Input::MlpAct => Some(3),
        Input::Expert(_) | Input::ExpertAct(_) => None,
    }
}

/// One expert's H_col on the tokens routed to it. With fewer than `MoeStats::min_tokens` of them both are
/// None: its gate/up then read the MLP input's covariance over every token, and its down_proj (whose input
/// exists only on routed tokens) falls back to RTN.
pub struct ExpertStats {
    pub tokens: usize,
    pub h_in: Option<Mat>,
    pub h_act: Option<Mat>,
}

/// How an MoE block's expert statistics are gathered.
#[derive(Clone, Copy, Debug)]
pub struct MoeStats {
    /// An expert routed fewer calibration tokens than this gets the documented fallback (`ExpertStats`).
    pub min_tokens: usize,
    /// Weight each routed token by its router probability squared (the factor its error reaches the block's
    /// output with) instead of counting every routed token once.
    pub router_weighted: bool,
    /// Experts [start, end) when the block's experts are taken in groups (pipeline/expert_groups.rs): only
    /// these run and get statistics; the others' `ExpertStats` are empty (0 tokens, no H) and unused.
    pub group: Option<(usize, usize)>,
}

impl Default for MoeStats {
    /// `boa-cuda run`'s defaults.
    fn default() -> Self {
        MoeStats {
            min_tokens: 64,
            router_weighted: false,
            group: None,
        }
    }
}

impl MoeStats {
    /// The run's `--moe-hessian` and `--moe-min-tokens`.
    pub fn of(opts: &super::options::RunOptions) -> MoeStats {
        MoeStats {
            min_tokens: opts.moe_min_tokens,
            router_weighted: opts.moe_hessian == super::options::MoeHessian::Router,
            group: None,
        }
    }
}

impl BlockStats {
    /// H_col of linear `ld`; None when it has none (an under-routed expert's down_proj).
    pub fn h_col(&self, ld: &LinearDesc) -> Option<&Mat> {
        match ld.input() {
            Input::Attn => Some(&self.h_attn),
            Input::AttnOut => Some(&self.h_o),
            Input::Mlp => Some(&self.h_mlp),
            Input::MlpAct => self.h_down.as_ref(),
            Input::Expert(e) => Some(self.experts.get(e)?.h_in.as_ref().unwrap_or(&self.h_mlp)),
            Input::ExpertAct(e) => self.experts.get(e)?.h_act.as_ref(),
        }
    }
}

pub struct AttnStats {
    pub c_k: Mat,
    pub c_q: Mat,
    pub v_col: Mat,
    /// `--qk-norm-hessian exact`: W_Q's and W_K's row Hessians behind their norms, each token's Jacobian
    /// included (`norm_row_hessians`); None where the block has no such norm or the run asks for diag.
    pub h_row_q: Option<Mat>,
    pub h_row_k: Option<Mat>,
}

/// The position average of BoA's Q/K row Hessians in layer `layer`: over the offsets between a query and
/// the keys it sees, fewer than the window where the layer slides.
pub fn rope_average(cfg: &Config, layer: usize, seqlen: usize) -> RopeAverage {
    let offsets = cfg.block.window_at(layer).map_or(seqlen, |w| w.min(seqlen));
    RopeAverage::new(&cfg.inv_freq_for(layer), offsets)
}

/// W_Q's and W_K's row Hessians behind their per-head norms with each token's norm Jacobian J
/// (`QuantOps::stat_norm_jacobian`): E[Jᵀ diag(g) M diag(g) J], M from the finished covariances of the
/// other side. Why a second pass over the block's input X: J weighs M, which exists only after the first
/// pass; only the q and k projections are recomputed (the same calls as the forward's), nothing is kept.
#[allow(clippy::too_many_arguments)]
fn norm_row_hessians(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    t: usize,
    x: &[Tensor],
    c_k: &Mat,
    c_q: &Mat,
) -> Result<(Option<Mat>, Option<Mat>)> {
    let (gq, gk) = (w.norm(NormRole::Q), w.norm(NormRole::K));
    if gq.is_none() && gk.is_none() {
        return Ok((None, None));
    }
    let rope = rope_average(cfg, w.layer, t);
    let side = |g: Option<&[f32]>, c: &Mat, heads: usize| -> Result<Option<(Mat, Accumulator)>> {
        g.map(|g| {
            Ok((
                be.rope_row_hessians(c, heads, &rope, Some(g))?,
                Accumulator::heads(be, heads, cfg.d_h)?,
            ))
        })
        .transpose()
    };
    let mut q_side = side(gq, c_k, cfg.n_heads)?;
    let mut k_side = side(gk, c_q, cfg.n_kv_heads)?;
    let mut staging = Staging::new(be, x)?;
    for chunk in x {
        let staged = staging.advance(be, x)?;
        let xc = staged.as_ref().unwrap_or(chunk);
        let m = chunk.len() / cfg.d;
        let (_, q, k) = attn_projections(be, w, resident, cfg, xc, m)?;
        if let Some((a, acc)) = &mut q_side {
            acc.add_norm_jacobian(be, &q, m, a, cfg.eps)?;
        }
        if let Some((a, acc)) = &mut k_side {
            acc.add_norm_jacobian(be, &k, m, a, cfg.eps)?;
        }
    }
    let finish = |s: Option<(Mat, Accumulator)>| s.map(|(_, acc)| acc.finish(be)).transpose();
    Ok((finish(q_side)?, finish(k_side)?))
}

/// Chunk i of X staged on the device when it is parked in pinned host memory, else None.
pub(crate) fn stage_if_parked(be: &dyn Backend, x: &[Tensor], i: usize) -> Result<Option<Tensor>> {
    x.get(i)
        .filter(|c| matches!(c, Tensor::Pinned(_)))
        .map(|c| be.stage(c))
        .transpose()
}

/// X's chunks staged in order for a loop over them: `advance` hands out chunk i's staged copy after queueing
/// chunk i+1's, so its upload overlaps chunk i's compute (the plan's two chunks of X on the device).
pub(crate) struct Staging {
    next: Option<Tensor>,
    i: usize,
}

impl Staging {
    pub(crate) fn new(be: &dyn Backend, x: &[Tensor]) -> Result<Staging> {
        Ok(Staging {
            next: stage_if_parked(be, x, 0).context("staging chunk 0 of the block's input")?,
            i: 0,
        })
    }

    /// The next chunk's staged copy (None where X is not parked).
    pub(crate) fn advance(&mut self, be: &dyn Backend, x: &[Tensor]) -> Result<Option<Tensor>> {
        let staged = self.next.take();
        self.i += 1;
        self.next = stage_if_parked(be, x, self.i)
            .with_context(|| format!("staging chunk {} of the block's input", self.i))?;
        Ok(staged)
    }
}

/// The accumulators of one block.
struct Sums {
    h_attn: Accumulator,
    h_o: Accumulator,
    h_mlp: Accumulator,
    h_down: Option<Accumulator>,
    /// Per expert: (gate/up input, down input); None outside the pass's group of experts.
    experts: Vec<Option<(Accumulator, Accumulator)>>,
    attn: Option<(Accumulator, Accumulator, Accumulator)>,
}

/// Forwards the FP block over the chunks of `x` (each [n·t × d] for its n sequences; not modified) and
/// accumulates the statistics. `attention_aware` adds the per-head statistics BoA needs, and `exact_qk_norm`
/// its exact Q/K row Hessians where the block has q/k norms; `resident` holds the block's weights in the
/// backend's memory.
#[allow(clippy::too_many_arguments)]
pub fn collect(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    rope: &RopeTable,
    x: &[Tensor],
    attention_aware: bool,
    exact_qk_norm: bool,
    moe: MoeStats,
) -> Result<BlockStats> {
    collect_asym(
        be,
        w,
        resident,
        cfg,
        rope,
        x,
        attention_aware,
        exact_qk_norm,
        moe,
        None,
    )
}

/// `collect`, and with `x_fp` (`--asym-calib`'s FP stream, chunked as `x`, on the host) also each dense
/// input's D = Σ (a − ã) ãᵀ; `x_fp` leaves as the FP block's output, the next block's FP stream.
#[allow(clippy::too_many_arguments)]
pub fn collect_asym(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    rope: &RopeTable,
    x: &[Tensor],
    attention_aware: bool,
    exact_qk_norm: bool,
    moe: MoeStats,
    mut x_fp: Option<&mut [Tensor]>,
) -> Result<BlockStats> {
    let (d, t) = (cfg.d, rope.t);
    let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    // What each statistic is for, in errors: the linears that read it.
    const H_ATTN: &str = "H_col of self_attn.q_proj, k_proj and v_proj";
    const H_O: &str = "H_col of self_attn.o_proj";
    const H_MLP: &str = "H_col of the MLP's gate_proj and up_proj";
    const H_DOWN: &str = "H_col of the MLP's down_proj";
    const H_EXPERT: &str = "an expert's H_col";
    const C_K: &str = "the key covariances (H_row of self_attn.q_proj)";
    const C_Q: &str = "the query covariances (H_row of self_attn.k_proj)";
    const V_COL: &str = "the per-head H_col of self_attn.v_proj";
    let of = |what: &'static str| move || what;
    let mut s = Sums {
        h_attn: Accumulator::xxt(be, d).with_context(of(H_ATTN))?,
        h_o: Accumulator::xxt(be, h * d_h).with_context(of(H_O))?,
        h_mlp: Accumulator::xxt(be, d).with_context(of(H_MLP))?,
        // The down_proj of the MLP every token goes through (dense, or an MoE block's shared expert).
        h_down: match cfg.block.dense_mlp() {
            Some([.., down]) => {
                Some(Accumulator::xxt(be, cfg.block.linears[down].d_in).with_context(of(H_DOWN))?)
            }
            None => None,
        },
        experts: match &cfg.block.moe {
            Some(m) => (0..m.n_experts)
                .map(|e| {
                    if moe.group.is_some_and(|(a, b)| !(a..b).contains(&e)) {
                        return Ok(None);
                    }
                    Ok(Some((
                        Accumulator::xxt(be, d)?,
                        Accumulator::xxt(be, m.d_expert)?,
                    )))
                })
                .collect::<Result<_>>()
                .with_context(of(H_EXPERT))?,
            None => Vec::new(),
        },
        attn: match attention_aware {
            true => Some((
                Accumulator::heads(be, h_kv, d_h).with_context(of(C_K))?,
                Accumulator::heads(be, h, d_h).with_context(of(C_Q))?,
                Accumulator::v_col(be, d, h, h_kv).with_context(of(V_COL))?,
            )),
            false => None,
        },
    };
    let widths = [
        d,
        h * d_h,
        d,
        cfg.block
            .dense_mlp()
            .map_or(0, |[.., down]| cfg.block.linears[down].d_in),
    ];
    if let Some(xf) = &x_fp {
        anyhow::ensure!(
            xf.len() == x.len() && cfg.block.moe.is_none(),
            "asymmetric calibration: {} chunks of the FP stream for {} of X (dense blocks only)",
            xf.len(),
            x.len()
        );
    }
    let mut dxx = match &x_fp {
        Some(_) => Some(
            widths
                .iter()
                .map(|&n| (n > 0).then(|| be.stat_acc(1, n)).transpose())
                .collect::<Result<Vec<_>>>()
                .context("asymmetric calibration: D's accumulators")?,
        ),
        None => None,
    };
    let (mut forward_time, mut stats_time, mut v_col_time) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let fence = || crate::quant::profile::fence(be);
    // A chunk already on the device is copied when its turn comes.
    let mut staging = Staging::new(be, x)?;
    for (i, chunk) in x.iter().enumerate() {
        let ns = chunk.len() / (t * d);
        let mut xc = match staging.advance(be, x)? {
            Some(s) => s,
            None => be
                .duplicate(chunk)
                .with_context(|| format!("copying chunk {i} of the block's input"))?,
        };
        let mut tr = BlockTrace {
            experts_only: moe.group.map(|(a, b)| a..b),
            ..Default::default()
        };
        fence();
        let t0 = Instant::now();
        crate::nvtx::ranged(c"forward", || {
            block_forward(be, w, resident, cfg, rope, &mut xc, ns, Some(&mut tr))
        })?;
        drop(xc);
        // The FP stream's block forward, its inputs traced beside X's (a parked chunk staged and written
        // back: it leaves as the next block's FP input).
        let fp = match x_fp.as_deref_mut() {
            Some(xf) => {
                let mut fp = BlockTrace {
                    full: true,
                    ..Default::default()
                };
                let at = || format!("asymmetric calibration: the FP stream's chunk {i}");
                match stage_if_parked(be, xf, i).with_context(at)? {
                    Some(mut staged) => {
                        block_forward(be, w, resident, cfg, rope, &mut staged, ns, Some(&mut fp))
                            .with_context(at)?;
                        be.write_back(&staged, &mut xf[i]).with_context(at)?;
                    }
                    None => {
                        block_forward(be, w, resident, cfg, rope, &mut xf[i], ns, Some(&mut fp))
                            .with_context(at)?
                    }
                }
                Some(fp)
            }
            None => None,
        };
        fence();
        let t1 = Instant::now();
        let _r = crate::nvtx::range(c"statistics");
        let m = ns * t;
        s.h_attn
            .add_xxt(be, &tr.x_attn, m)
            .with_context(of(H_ATTN))?;
        s.h_o.add_xxt(be, &tr.attn_out, m).with_context(of(H_O))?;
        s.h_mlp.add_xxt(be, &tr.x_mlp, m).with_context(of(H_MLP))?;
        if let Some(a) = &mut s.h_down {
            a.add_xxt(be, &tr.act, m).with_context(of(H_DOWN))?;
        }
        // Every expert's two Grams in one batch (one or a few library calls on a GPU), router-weighted rows
        // times p_r (the product rounded once to f32).
        let mut grams = Vec::with_capacity(2 * tr.experts.len());
        for (sums, et) in s.experts.iter_mut().zip(&tr.experts) {
            let n = et.weights.len();
            let Some((h_in, h_act)) = sums.as_mut().filter(|_| n > 0) else {
                continue;
            };
            let scales = moe.router_weighted.then_some(et.weights.as_slice());
            grams.push((h_in, &et.x, n, scales));
            grams.push((h_act, &et.act, n, scales));
        }
        Accumulator::add_xxt_rows(be, grams).with_context(of(H_EXPERT))?;
        if let (Some(fp), Some(dxx)) = (fp, dxx.as_mut()) {
            let pairs = [
                (&fp.x_attn, &tr.x_attn),
                (&fp.attn_out, &tr.attn_out),
                (&fp.x_mlp, &tr.x_mlp),
                (&fp.act, &tr.act),
            ];
            for (acc, (a, a_q)) in dxx.iter_mut().zip(pairs) {
                if let Some(acc) = acc {
                    be.stat_diff_cross(acc, a, a_q, m)
                        .context("asymmetric calibration: D's sums")?;
                }
            }
        }
        if let Some((c_k, c_q, v_col)) = &mut s.attn {
            c_k.add_heads(be, &tr.k, m).with_context(of(C_K))?;
            c_q.add_heads(be, &tr.q, m).with_context(of(C_Q))?;
            fence();
            let tv = Instant::now();
            let shape = AttnShape {
                t,
                h,
                h_kv,
                d_h,
                d,
                window: w.desc.window_at(w.layer),
            };
            v_col
                .add_v_col(be, &tr.x_attn, &tr.q, &tr.k, shape, ns)
                .with_context(of(V_COL))?;
            fence();
            v_col_time += tv.elapsed();
        }
        fence();
        forward_time += t1 - t0;
        stats_time += t1.elapsed();
    }
    let t1 = Instant::now();
    // N of every H here (its tokens), for D's scale.
    let n_tokens = s.h_attn.n_tokens();
    let stats = BlockStats {
        h_attn: s.h_attn.finish(be).with_context(of(H_ATTN))?,
        h_o: s.h_o.finish(be).with_context(of(H_O))?,
        h_mlp: s.h_mlp.finish(be).with_context(of(H_MLP))?,
        h_down: match s.h_down {
            Some(a) => Some(a.finish(be).with_context(of(H_DOWN))?),
            None => None,
        },
        experts: s
            .experts
            .into_iter()
            .map(|sums| {
                let Some((h_in, h_act)) = sums else {
                    return Ok(ExpertStats {
                        tokens: 0,
                        h_in: None,
                        h_act: None,
                    });
                };
                let tokens = h_in.n_tokens();
                Ok(match tokens >= moe.min_tokens.max(1) {
                    true => ExpertStats {
                        tokens,
                        h_in: Some(h_in.finish(be)?),
                        h_act: Some(h_act.finish(be)?),
                    },
                    false => ExpertStats {
                        tokens,
                        h_in: None,
                        h_act: None,
                    },
                })
            })
            .collect::<Result<_>>()
            .with_context(of(H_EXPERT))?,
        attn: match s.attn {
            Some((c_k, c_q, v_col)) => {
                let c_k = c_k.finish(be).with_context(of(C_K))?;
                let c_q = c_q.finish(be).with_context(of(C_Q))?;
                let (h_row_q, h_row_k) = match exact_qk_norm {
                    true => norm_row_hessians(be, w, resident, cfg, t, x, &c_k, &c_q)
                        .context("the exact Q/K row Hessians behind the q/k norms")?,
                    false => (None, None),
                };
                Some(AttnStats {
                    c_k,
                    c_q,
                    v_col: v_col.finish(be).with_context(of(V_COL))?,
                    h_row_q,
                    h_row_k,
                })
            }
            None => None,
        },
        forward_time,
        stats_time: stats_time + t1.elapsed(),
        v_col_time,
        // D's scale, as every H's (hessian::finish: 2/N).
        dxx: match dxx {
            Some(sums) => Some(DiffCross {
                sums: sums
                    .try_into()
                    .map_err(|_| anyhow::anyhow!("D of four inputs"))?,
                scale: 2.0 / n_tokens.max(1) as f64,
            }),
            None => None,
        },
    };
    Ok(stats)
}
