//! Statistics of one FP block forward on the (quantized) calibration inputs — every Hessian of design.md
//! §4.2–4.3, accumulated window chunk by window chunk so memory holds one chunk's intermediates.

use crate::backend::Backend;
use crate::backend::quant_ops::AttnShape;
use crate::model::Config;
use crate::model::llama::{BlockTrace, BlockWeights, RopeTable, block_forward};
use crate::quant::hessian::{HeadCovAccumulator, VColAccumulator, XxtAccumulator};
use std::time::{Duration, Instant};

pub struct BlockStats {
    /// 2/N Σ x xᵀ of the q/k/v input [d × d].
    pub h_attn: XxtAccumulator,
    /// Post-RoPE key covariances per KV head, query covariances per query head.
    pub c_k: HeadCovAccumulator,
    pub c_q: HeadCovAccumulator,
    /// V's attention-weighted H_col per KV head (BoA only).
    pub v_col: Option<VColAccumulator>,
    pub h_o: XxtAccumulator,
    pub h_mlp: XxtAccumulator,
    pub h_down: XxtAccumulator,
    /// Time in the block forward vs. in accumulating statistics.
    pub forward_time: Duration,
    pub stats_time: Duration,
}

/// Forwards the FP block over `x` [n_seq·t × d] in chunks of `chunk` windows (x is not modified) and
/// accumulates the statistics. `attention_aware` adds the per-head statistics BoA needs.
#[allow(clippy::too_many_arguments)]
pub fn collect(
    be: &dyn Backend,
    w: &BlockWeights,
    cfg: &Config,
    rope: &RopeTable,
    x: &[f32],
    n_seq: usize,
    chunk: usize,
    attention_aware: bool,
) -> BlockStats {
    let (d, t) = (cfg.d, rope.t);
    let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    let mut s = BlockStats {
        h_attn: XxtAccumulator::new(d),
        c_k: HeadCovAccumulator::new(h_kv, d_h),
        c_q: HeadCovAccumulator::new(h, d_h),
        v_col: attention_aware.then(|| VColAccumulator::new(d, h, h_kv)),
        h_o: XxtAccumulator::new(h * d_h),
        h_mlp: XxtAccumulator::new(d),
        h_down: XxtAccumulator::new(cfg.d_ff),
        forward_time: Duration::ZERO,
        stats_time: Duration::ZERO,
    };
    for s0 in (0..n_seq).step_by(chunk) {
        let ns = chunk.min(n_seq - s0);
        let m = ns * t;
        let mut xc = x[s0 * t * d..(s0 + ns) * t * d].to_vec();
        let mut tr = BlockTrace::default();
        let t0 = Instant::now();
        crate::nvtx::ranged(c"forward", || {
            block_forward(be, w, cfg, rope, &mut xc, ns, Some(&mut tr))
        });
        let t1 = Instant::now();
        let _r = crate::nvtx::range(c"statistics");
        if be.accelerates_statistics() {
            add_through_backend(be, &mut s, &tr, cfg, t, ns, attention_aware);
            s.forward_time += t1 - t0;
            s.stats_time += t1.elapsed();
            continue;
        }
        s.h_attn.add_batch(&tr.x_attn, m);
        s.h_o.add_batch(&tr.attn_out, m);
        s.h_mlp.add_batch(&tr.x_mlp, m);
        s.h_down.add_batch(&tr.act, m);
        if attention_aware {
            s.c_k.add_batch(&tr.k, m);
            s.c_q.add_batch(&tr.q, m);
            let v_col = s.v_col.as_mut().expect("attention-aware");
            for q in 0..ns {
                let (qs, ks) = (
                    &tr.q[q * t * h * d_h..(q + 1) * t * h * d_h],
                    &tr.k[q * t * h_kv * d_h..(q + 1) * t * h_kv * d_h],
                );
                let probs = be.attention_probs(qs, ks, t, h, h_kv, d_h);
                v_col.add_sequence(&tr.x_attn[q * t * d..(q + 1) * t * d], &probs, t);
            }
        }
        s.forward_time += t1 - t0;
        s.stats_time += t1.elapsed();
    }
    s
}

/// The statistics of one chunk through the backend's `QuantOps` (the CUDA kernels): each sum is computed in f32
/// on the device over the whole chunk and folded into the accumulators' f64 totals, and V's attention
/// probabilities are never materialized.
fn add_through_backend(
    be: &dyn Backend,
    s: &mut BlockStats,
    tr: &BlockTrace,
    cfg: &Config,
    t: usize,
    ns: usize,
    attention_aware: bool,
) {
    let (d, m) = (cfg.d, ns * t);
    let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    let gram = |x: &[f32], width: usize| {
        let mut g = vec![0f32; width * width];
        be.xxt_accumulate(&mut g, x, m, width);
        g
    };
    s.h_attn.add_sum(&gram(&tr.x_attn, d), m);
    s.h_o.add_sum(&gram(&tr.attn_out, h * d_h), m);
    s.h_mlp.add_sum(&gram(&tr.x_mlp, d), m);
    s.h_down.add_sum(&gram(&tr.act, cfg.d_ff), m);
    if attention_aware {
        s.c_k.add_sums(&be.head_covariance(&tr.k, m, h_kv, d_h), m);
        s.c_q.add_sums(&be.head_covariance(&tr.q, m, h, d_h), m);
        let v_col = s.v_col.as_mut().expect("attention-aware");
        let shape = AttnShape { t, h, h_kv, d_h, d };
        for q in 0..ns {
            let sums = be.v_col_covariance(
                &tr.x_attn[q * t * d..(q + 1) * t * d],
                &tr.q[q * t * h * d_h..(q + 1) * t * h * d_h],
                &tr.k[q * t * h_kv * d_h..(q + 1) * t * h_kv * d_h],
                shape,
            );
            v_col.add_head_sums(&sums, t);
        }
    }
}
