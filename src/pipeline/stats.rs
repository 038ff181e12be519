//! Statistics of one FP block forward on the (quantized) calibration inputs — every Hessian of design.md
//! §4.2–4.3, accumulated window chunk by window chunk so memory holds one chunk's intermediates. On the CPU
//! every sum is f64 (the accumulators' own path); a device backend keeps f32 running sums in its memory for
//! the whole block and they are folded into the f64 totals once.

use crate::backend::{AttnShape, Backend, Tensor};
use crate::model::Config;
use crate::model::llama::{BlockTrace, BlockWeights, ResidentWeights, RopeTable, block_forward};
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

/// Chunk i of X staged on the device when it is parked in pinned host memory, else None. The forward loops
/// stage chunk i+1 before computing chunk i, so its upload overlaps the compute (the plan's two chunks of X
/// on the device).
pub(crate) fn stage_if_parked(be: &dyn Backend, x: &[Tensor], i: usize) -> Option<Tensor> {
    x.get(i)
        .filter(|c| matches!(c, Tensor::Pinned(_)))
        .map(|c| be.stage(c))
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
    let mut sums = be
        .accelerates_statistics()
        .then(|| DeviceSums::new(be, cfg, attention_aware));
    // A chunk already on the device is copied when its turn comes.
    let mut next = stage_if_parked(be, x, 0);
    for (i, chunk) in x.iter().enumerate() {
        let ns = chunk.len() / (t * d);
        let staged = next.take();
        next = stage_if_parked(be, x, i + 1);
        let mut xc = staged.unwrap_or_else(|| be.duplicate(chunk));
        let mut tr = BlockTrace::default();
        let t0 = Instant::now();
        crate::nvtx::ranged(c"forward", || {
            block_forward(be, w, resident, cfg, rope, &mut xc, ns, Some(&mut tr))
        });
        drop(xc);
        let t1 = Instant::now();
        let _r = crate::nvtx::range(c"statistics");
        match &mut sums {
            Some(sums) => sums.add(be, &tr, cfg, t, ns),
            None => add_on_host(be, &mut s, &tr, cfg, t, ns, attention_aware),
        }
        s.forward_time += t1 - t0;
        s.stats_time += t1.elapsed();
    }
    if let Some(sums) = sums {
        let t1 = Instant::now();
        sums.fold_into(be, &mut s);
        s.stats_time += t1.elapsed();
    }
    s
}

/// The CPU's own path: every sum in f64 (the accumulators' add_batch), bit for bit as before tensors.
fn add_on_host(
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
    let (x_attn, q_all, k_all) = (be.read(&tr.x_attn), be.read(&tr.q), be.read(&tr.k));
    s.h_attn.add_batch(&x_attn, m);
    s.h_o.add_batch(&be.read(&tr.attn_out), m);
    s.h_mlp.add_batch(&be.read(&tr.x_mlp), m);
    s.h_down.add_batch(&be.read(&tr.act), m);
    if attention_aware {
        s.c_k.add_batch(&k_all, m);
        s.c_q.add_batch(&q_all, m);
        let v_col = s.v_col.as_mut().expect("attention-aware");
        for i in 0..ns {
            let (qs, ks) = (
                &q_all[i * t * h * d_h..(i + 1) * t * h * d_h],
                &k_all[i * t * h_kv * d_h..(i + 1) * t * h_kv * d_h],
            );
            let probs = be.attention_probs(qs, ks, t, h, h_kv, d_h);
            v_col.add_sequence(&x_attn[i * t * d..(i + 1) * t * d], &probs, t);
        }
    }
}

/// The statistics summed where the backend computes (the CUDA kernels, f32): one running sum per statistic
/// for the whole block, read back once and folded into the accumulators' f64 totals. V's attention
/// probabilities are never materialized, and nothing crosses PCIe per chunk.
struct DeviceSums {
    h_attn: Tensor,
    h_o: Tensor,
    h_mlp: Tensor,
    h_down: Tensor,
    /// Per-head covariances and V's per-KV-head H_col (attention-aware runs only).
    c_k: Option<Tensor>,
    c_q: Option<Tensor>,
    v_col: Option<Tensor>,
    tokens: usize,
}

impl DeviceSums {
    fn new(be: &dyn Backend, cfg: &Config, attention_aware: bool) -> DeviceSums {
        let (d, hd) = (cfg.d, cfg.n_heads * cfg.d_h);
        let dd_h = cfg.d_h * cfg.d_h;
        DeviceSums {
            h_attn: be.zeros(d * d),
            h_o: be.zeros(hd * hd),
            h_mlp: be.zeros(d * d),
            h_down: be.zeros(cfg.d_ff * cfg.d_ff),
            c_k: attention_aware.then(|| be.zeros(cfg.n_kv_heads * dd_h)),
            c_q: attention_aware.then(|| be.zeros(cfg.n_heads * dd_h)),
            v_col: attention_aware.then(|| be.zeros(cfg.n_kv_heads * d * d)),
            tokens: 0,
        }
    }

    fn add(&mut self, be: &dyn Backend, tr: &BlockTrace, cfg: &Config, t: usize, ns: usize) {
        let (d, m) = (cfg.d, ns * t);
        let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
        be.xxt_accumulate_t(&mut self.h_attn, &tr.x_attn, m, d);
        be.xxt_accumulate_t(&mut self.h_o, &tr.attn_out, m, h * d_h);
        be.xxt_accumulate_t(&mut self.h_mlp, &tr.x_mlp, m, d);
        be.xxt_accumulate_t(&mut self.h_down, &tr.act, m, cfg.d_ff);
        if let (Some(c_k), Some(c_q), Some(v_col)) = (&mut self.c_k, &mut self.c_q, &mut self.v_col)
        {
            be.head_covariance_t(c_k, &tr.k, m, h_kv, d_h);
            be.head_covariance_t(c_q, &tr.q, m, h, d_h);
            let shape = AttnShape { t, h, h_kv, d_h, d };
            be.v_col_covariance_t(v_col, &tr.x_attn, &tr.q, &tr.k, shape, ns);
        }
        self.tokens += m;
    }

    fn fold_into(self, be: &dyn Backend, s: &mut BlockStats) {
        let n = self.tokens;
        s.h_attn.add_sum(&be.read(&self.h_attn), n);
        s.h_o.add_sum(&be.read(&self.h_o), n);
        s.h_mlp.add_sum(&be.read(&self.h_mlp), n);
        s.h_down.add_sum(&be.read(&self.h_down), n);
        if let (Some(c_k), Some(c_q), Some(v_col)) = (&self.c_k, &self.c_q, &self.v_col) {
            s.c_k.add_sums(&be.read(c_k), n);
            s.c_q.add_sums(&be.read(c_q), n);
            let acc = s.v_col.as_mut().expect("attention-aware");
            acc.add_kv_sums(&be.read(v_col), n);
        }
    }
}
