//! Statistics of one FP block forward on the (quantized) calibration inputs — every Hessian of design.md
//! §4.2–4.3, accumulated window chunk by window chunk where the backend computes (`QuantOps`: f64 sums on the
//! CPU, f32 in device memory on a GPU), so memory holds one chunk's intermediates and nothing crosses PCIe.

use crate::backend::{AttnShape, Backend, Tensor};
use crate::model::Config;
use crate::model::arch::Input;
use crate::model::llama::{BlockTrace, BlockWeights, ResidentWeights, RopeTable, block_forward};
use crate::ops::{Mat, Result};
use crate::quant::hessian::Accumulator;
use anyhow::Context as _;
use std::time::{Duration, Instant};

pub struct BlockStats {
    /// 2/N Σ x xᵀ of the q/k/v input [d × d].
    pub h_attn: Mat,
    pub h_o: Mat,
    pub h_mlp: Mat,
    pub h_down: Mat,
    /// BoA only: post-RoPE key covariances per KV head, query covariances per query head [heads × d_h × d_h],
    /// and V's attention-weighted H_col per KV head [h_kv × d × d].
    pub attn: Option<AttnStats>,
    /// Time in the block forward vs. in accumulating statistics.
    pub forward_time: Duration,
    pub stats_time: Duration,
}

impl BlockStats {
    /// H_col of the linears that read `input`.
    pub fn h_col(&self, input: Input) -> &Mat {
        match input {
            Input::Attn => &self.h_attn,
            Input::AttnOut => &self.h_o,
            Input::Mlp => &self.h_mlp,
            Input::MlpAct => &self.h_down,
        }
    }
}

pub struct AttnStats {
    pub c_k: Mat,
    pub c_q: Mat,
    pub v_col: Mat,
}

/// Chunk i of X staged on the device when it is parked in pinned host memory, else None. The forward loops
/// stage chunk i+1 before computing chunk i, so its upload overlaps the compute (the plan's two chunks of X
/// on the device).
pub(crate) fn stage_if_parked(be: &dyn Backend, x: &[Tensor], i: usize) -> Result<Option<Tensor>> {
    x.get(i)
        .filter(|c| matches!(c, Tensor::Pinned(_)))
        .map(|c| be.stage(c))
        .transpose()
}

/// The accumulators of one block.
struct Sums {
    h_attn: Accumulator,
    h_o: Accumulator,
    h_mlp: Accumulator,
    h_down: Accumulator,
    attn: Option<(Accumulator, Accumulator, Accumulator)>,
}

/// Forwards the FP block over the chunks of `x` (each [n·t × d] for its n sequences; not modified) and
/// accumulates the statistics. `attention_aware` adds the per-head statistics BoA needs; `resident` holds
/// the block's weights in the backend's memory.
#[allow(clippy::too_many_arguments)]
pub fn collect(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    rope: &RopeTable,
    x: &[Tensor],
    attention_aware: bool,
) -> Result<BlockStats> {
    let (d, t) = (cfg.d, rope.t);
    let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    // What each statistic is for, in errors: the linears that read it.
    const H_ATTN: &str = "H_col of self_attn.q_proj, k_proj and v_proj";
    const H_O: &str = "H_col of self_attn.o_proj";
    const H_MLP: &str = "H_col of mlp.gate_proj and up_proj";
    const H_DOWN: &str = "H_col of mlp.down_proj";
    const C_K: &str = "the key covariances (H_row of self_attn.q_proj)";
    const C_Q: &str = "the query covariances (H_row of self_attn.k_proj)";
    const V_COL: &str = "the per-head H_col of self_attn.v_proj";
    let of = |what: &'static str| move || what;
    let mut s = Sums {
        h_attn: Accumulator::xxt(be, d).with_context(of(H_ATTN))?,
        h_o: Accumulator::xxt(be, h * d_h).with_context(of(H_O))?,
        h_mlp: Accumulator::xxt(be, d).with_context(of(H_MLP))?,
        h_down: Accumulator::xxt(be, cfg.d_ff).with_context(of(H_DOWN))?,
        attn: match attention_aware {
            true => Some((
                Accumulator::heads(be, h_kv, d_h).with_context(of(C_K))?,
                Accumulator::heads(be, h, d_h).with_context(of(C_Q))?,
                Accumulator::v_col(be, d, h, h_kv).with_context(of(V_COL))?,
            )),
            false => None,
        },
    };
    let chunk_ctx = |i: usize| move || format!("staging chunk {i} of the block's input");
    let (mut forward_time, mut stats_time) = (Duration::ZERO, Duration::ZERO);
    // A chunk already on the device is copied when its turn comes.
    let mut next = stage_if_parked(be, x, 0).with_context(chunk_ctx(0))?;
    for (i, chunk) in x.iter().enumerate() {
        let ns = chunk.len() / (t * d);
        let staged = next.take();
        next = stage_if_parked(be, x, i + 1).with_context(chunk_ctx(i + 1))?;
        let mut xc = match staged {
            Some(s) => s,
            None => be.duplicate(chunk).with_context(chunk_ctx(i))?,
        };
        let mut tr = BlockTrace::default();
        let t0 = Instant::now();
        crate::nvtx::ranged(c"forward", || {
            block_forward(be, w, resident, cfg, rope, &mut xc, ns, Some(&mut tr))
        })?;
        drop(xc);
        let t1 = Instant::now();
        let _r = crate::nvtx::range(c"statistics");
        let m = ns * t;
        s.h_attn
            .add_xxt(be, &tr.x_attn, m)
            .with_context(of(H_ATTN))?;
        s.h_o.add_xxt(be, &tr.attn_out, m).with_context(of(H_O))?;
        s.h_mlp.add_xxt(be, &tr.x_mlp, m).with_context(of(H_MLP))?;
        s.h_down.add_xxt(be, &tr.act, m).with_context(of(H_DOWN))?;
        if let Some((c_k, c_q, v_col)) = &mut s.attn {
            c_k.add_heads(be, &tr.k, m).with_context(of(C_K))?;
            c_q.add_heads(be, &tr.q, m).with_context(of(C_Q))?;
            let shape = AttnShape { t, h, h_kv, d_h, d };
            v_col
                .add_v_col(be, &tr.x_attn, &tr.q, &tr.k, shape, ns)
                .with_context(of(V_COL))?;
        }
        forward_time += t1 - t0;
        stats_time += t1.elapsed();
    }
    let t1 = Instant::now();
    let stats = BlockStats {
        h_attn: s.h_attn.finish(be).with_context(of(H_ATTN))?,
        h_o: s.h_o.finish(be).with_context(of(H_O))?,
        h_mlp: s.h_mlp.finish(be).with_context(of(H_MLP))?,
        h_down: s.h_down.finish(be).with_context(of(H_DOWN))?,
        attn: match s.attn {
            Some((c_k, c_q, v_col)) => Some(AttnStats {
                c_k: c_k.finish(be).with_context(of(C_K))?,
                c_q: c_q.finish(be).with_context(of(C_Q))?,
                v_col: v_col.finish(be).with_context(of(V_COL))?,
            }),
            None => None,
        },
        forward_time,
        stats_time: stats_time + t1.elapsed(),
    };
    Ok(stats)
}
