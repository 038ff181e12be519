//! The CPU eval forward: whole windows in parallel (rayon over the windows of a chunk), every operation
//! sequential inside its window, buffers reused across blocks. The same model math as `block_forward` on the
//! CPU backend, laid out for throughput:
//!
//! - k/v are one GEMM against the stacked [2·kvd × d] weight, and gate/up GEMMs against [gate; up] chunks
//!   whose SwiGLU runs while the output is in cache (fewer, wider GEMMs). q stays apart: faer's f32 kernel runs the stacked q/k/v width 960 at ~60% of the speed
//!   of widths 576 and 384 (examples measured 2026-11-30: 74–90 vs 130–146 GFLOP/s per core at t = 512);
//! - attention reads K and V in place and runs the query heads of a KV group through one GEMM
//!   (`cpu::causal_attention_grouped`);
//! - o and down accumulate straight into the residual stream;
//! - the LM head never materializes the [t × vocab] logits: it runs over the vocabulary a chunk of
//!   `VOCAB_CHUNK` rows at a time with an online log-sum-exp, so the 100 MB per window never leave cache.
//!
//! Why windows in parallel rather than faer's parallel GEMM: on a 2-core machine the per-GEMM fork/join
//! (10 GEMMs per block) and the elementwise ops between them serialize, and a preempted worker stalls the
//! other; a window is ~3.6 GFLOP per block, enough work per task that both cores stay busy.
//!
//! Determinism: each window's arithmetic is sequential and independent of the others, and window NLLs are
//! summed in window order, so the result does not depend on the thread count.
//!
//! `BOA_EVAL_PROFILE=1` prints the thread CPU time spent in each operation (summed over threads) to stderr.

use crate::backend::cpu::{
    causal_attention_grouped, exp_f32, gemm_nt, max_lanes, rms_norm_row, rope_head, sum_exp_f64,
};
use crate::model::arch::{NormRole, Role};
use crate::model::config::Config;
use crate::model::llama::{BlockWeights, Linear, RopeTable};
use rayon::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};

/// Vocabulary rows of the LM head per GEMM: logits [t × VOCAB_CHUNK] (1 MiB at t = 512) stay in L2 for the
/// log-sum-exp pass, and the head chunk [VOCAB_CHUNK × d] (1.2 MB at d = 576) is read once per window.
const VOCAB_CHUNK: usize = 512;

/// gate/up rows per GEMM (×2): a [t × 2·FF_CHUNK] output (2 MiB at t = 512) that SwiGLU consumes while it
/// is in cache; faer ran n = 1024 at 135 vs n = 3072 at 120 GFLOP/s per core (t = 512, k = 576).
const FF_CHUNK: usize = 512;

/// A block's weights stacked for the fused GEMMs. Missing biases of a stacked matrix are zeros (x + 0 = x
/// exactly, so the math is unchanged).
pub struct FusedBlock {
    attn_norm: Vec<f32>,
    /// Qwen3's per-head q/k norms [d_h], when the block has them.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    q: Linear,
    /// [k; v] [2·kvd × d] and its bias.
    kv: Vec<f32>,
    kv_bias: Option<Vec<f32>>,
    o: Linear,
    mlp_norm: Vec<f32>,
    /// [gate; up] [2·d_ff × d] by chunks of FF_CHUNK rows of each, and its bias in the same order.
    gate_up: Vec<f32>,
    gate_up_bias: Option<Vec<f32>>,
    /// The online transform of down_proj's input (`model/online.rs`), applied by its fast transform.
    online: Option<std::sync::Arc<crate::model::online::OnlineQ>>,
    down: Linear,
}

fn stack(ls: &[&Linear]) -> (Vec<f32>, Option<Vec<f32>>) {
    let w = ls.iter().flat_map(|l| l.w.iter().copied()).collect();
    let b = ls.iter().any(|l| l.b.is_some()).then(|| {
        ls.iter()
            .flat_map(|l| match &l.b {
                Some(b) => b.clone(),
                None => vec![0.0; l.d_out],
            })
            .collect()
    });
    (w, b)
}

impl FusedBlock {
    /// None when a linear is held packed (the generic path dequantizes those tile by tile).
    pub fn new(w: BlockWeights) -> anyhow::Result<Option<FusedBlock>> {
        if w.linears.iter().any(|l| l.packed.is_some()) {
            return Ok(None);
        }
        let (q, k, v, o) = (
            w.get(Role::Q)?,
            w.get(Role::K)?,
            w.get(Role::V)?,
            w.get(Role::O)?,
        );
        let (gate, up, down) = (w.get(Role::Gate)?, w.get(Role::Up)?, w.get(Role::Down)?);
        let (kv, kv_bias) = stack(&[k, v]);
        // [gate; up] interleaved by FF_CHUNK rows: chunk c is [gate[c]; up[c]].
        let d = gate.d_in;
        let (mut gate_up, mut bias) = (Vec::new(), Vec::new());
        for j0 in (0..gate.d_out).step_by(FF_CHUNK) {
            let j1 = (j0 + FF_CHUNK).min(gate.d_out);
            for l in [gate, up] {
                gate_up.extend_from_slice(&l.w[j0 * d..j1 * d]);
                match &l.b {
                    Some(b) => bias.extend_from_slice(&b[j0..j1]),
                    None => bias.extend(std::iter::repeat_n(0.0, j1 - j0)),
                }
            }
        }
        let gate_up_bias = (gate.b.is_some() || up.b.is_some()).then_some(bias);
        let norm = |r: NormRole| -> anyhow::Result<Vec<f32>> {
            w.norm(r)
                .map(<[f32]>::to_vec)
                .ok_or_else(|| anyhow::anyhow!("the block has no {r:?} norm"))
        };
        Ok(Some(FusedBlock {
            attn_norm: norm(NormRole::Attn)?,
            q_norm: w.norm(NormRole::Q).map(<[f32]>::to_vec),
            k_norm: w.norm(NormRole::K).map(<[f32]>::to_vec),
            q: q.clone(),
            kv,
            kv_bias,
            o: o.clone(),
            mlp_norm: norm(NormRole::Mlp)?,
            gate_up,
            gate_up_bias,
            online: match &w.online {
                Some(q) if !down.d_in.is_multiple_of(q.h.n) => anyhow::bail!(
                    "down_proj's {} inputs are not blocks of the online transform's {}",
                    down.d_in,
                    q.h.n
                ),
                q => q.clone(),
            },
            down: down.clone(),
        }))
    }
}

/// One thread's buffers, reused across windows and blocks.
#[derive(Default)]
pub struct Workspace {
    xn: Vec<f32>,
    q: Vec<f32>,
    kv: Vec<f32>,
    attn: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    /// The transformed act (an online transform's output).
    act_q: Vec<f32>,
    s: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

fn add_bias(y: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for row in y.chunks_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
        }
    }
}

/// Operations timed by `BOA_EVAL_PROFILE`.
const OPS: [&str; 9] = [
    "rms_norm",
    "q, kv gemms",
    "rope",
    "attention",
    "o gemm",
    "gate_up gemm",
    "swiglu",
    "down gemm",
    "lm_head+lse",
];
static OP_NS: [AtomicU64; 9] = [const { AtomicU64::new(0) }; 9];

fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("BOA_EVAL_PROFILE").is_some_and(|v| v != "0"))
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Adds the thread CPU time since the last lap to op `i` (no-op unless profiling).
struct Laps(Option<u64>);

impl Laps {
    fn start() -> Laps {
        Laps(profiling().then(thread_cpu_ns))
    }
    fn lap(&mut self, i: usize) {
        if let Some(t0) = self.0 {
            let t = thread_cpu_ns();
            OP_NS[i].fetch_add(t - t0, Ordering::Relaxed);
            self.0 = Some(t);
        }
    }
}

/// Prints and resets the per-op CPU times (when profiling).
pub fn report_profile(wall_s: f64) {
    if !profiling() {
        return;
    }
    let ns: Vec<u64> = OP_NS.iter().map(|a| a.swap(0, Ordering::Relaxed)).collect();
    let total = ns.iter().sum::<u64>().max(1) as f64;
    eprintln!("eval op CPU time (all threads), wall {wall_s:.2} s:");
    for (name, &n) in OPS.iter().zip(&ns) {
        eprintln!(
            "  {name:<14}{:>9.3} s {:>6.1}%",
            n as f64 * 1e-9,
            100.0 * n as f64 / total
        );
    }
    eprintln!("  {:<14}{:>9.3} s", "total", total * 1e-9);
}

/// One block forward on one window X [t × d], in place.
pub fn block_forward_window(
    w: &FusedBlock,
    cfg: &Config,
    rope: &RopeTable,
    x: &mut [f32],
    ws: &mut Workspace,
) {
    let t = rope.t;
    let (d, h, h_kv, d_h) = (cfg.d, cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    let (qd, kvd) = (h * d_h, h_kv * d_h);
    assert_eq!(x.len(), t * d);
    let mut laps = Laps::start();

    let xn = sized(&mut ws.xn, t * d);
    for (y, x) in xn.chunks_mut(d).zip(x.chunks(d)) {
        rms_norm_row(y, x, &w.attn_norm, cfg.eps);
    }
    laps.lap(0);
    let q = sized(&mut ws.q, t * qd);
    gemm_nt(q, xn, &w.q.w, t, d, qd, false);
    add_bias(q, w.q.b.as_deref());
    let kv = sized(&mut ws.kv, t * 2 * kvd);
    gemm_nt(kv, xn, &w.kv, t, d, 2 * kvd, false);
    add_bias(kv, w.kv_bias.as_deref());
    laps.lap(1);
    // Qwen3: each head's query and key RMS-normalized before RoPE (one weight for every head).
    let mut head_norm = |rows: &mut [f32], g: &Option<Vec<f32>>, width: usize, stride: usize| {
        if let Some(g) = g {
            for r in rows.chunks_mut(stride) {
                for head in r[..width].chunks_mut(d_h) {
                    ws.s.clear();
                    ws.s.extend_from_slice(head);
                    rms_norm_row(head, &ws.s, g, cfg.eps);
                }
            }
        }
    };
    head_norm(q, &w.q_norm, qd, qd);
    head_norm(kv, &w.k_norm, kvd, 2 * kvd);
    let half = d_h / 2;
    for (p, (qr, kvr)) in q.chunks_mut(qd).zip(kv.chunks_mut(2 * kvd)).enumerate() {
        let (c, s) = (
            &rope.cos[p * half..(p + 1) * half],
            &rope.sin[p * half..(p + 1) * half],
        );
        for head in qr.chunks_mut(d_h).chain(kvr[..kvd].chunks_mut(d_h)) {
            rope_head(head, c, s);
        }
    }
    laps.lap(2);
    let attn = sized(&mut ws.attn, t * qd);
    causal_attention_grouped(attn, q, kv, 2 * kvd, (0, kvd), t, (h, h_kv, d_h), &mut ws.s);
    laps.lap(3);
    // x += attn · Woᵀ (+ b)
    gemm_nt(x, attn, &w.o.w, t, qd, d, true);
    add_bias(x, w.o.b.as_deref());
    laps.lap(4);

    for (y, x) in xn.chunks_mut(d).zip(x.chunks(d)) {
        rms_norm_row(y, x, &w.mlp_norm, cfg.eps);
    }
    laps.lap(0);
    let d_ff = cfg.d_ff;
    let act = sized(&mut ws.act, t * d_ff);
    for j0 in (0..d_ff).step_by(FF_CHUNK) {
        let nj = FF_CHUNK.min(d_ff - j0);
        let gu = sized(&mut ws.gu, t * 2 * nj);
        gemm_nt(
            gu,
            xn,
            &w.gate_up[2 * j0 * d..2 * (j0 + nj) * d],
            t,
            d,
            2 * nj,
            false,
        );
        add_bias(
            gu,
            w.gate_up_bias.as_ref().map(|b| &b[2 * j0..2 * (j0 + nj)]),
        );
        laps.lap(5);
        for (a, gu) in act.chunks_mut(d_ff).zip(gu.chunks(2 * nj)) {
            let (g, u) = gu.split_at(nj);
            for ((a, &g), &u) in a[j0..j0 + nj].iter_mut().zip(g).zip(u) {
                *a = g / (1.0 + exp_f32(-g)) * u;
            }
        }
        laps.lap(6);
    }
    let act = match &w.online {
        Some(q) => {
            // Q = I ⊗ Q_b: each run of b values of act times Q_b, by the fast transform.
            let aq = sized(&mut ws.act_q, t * d_ff);
            aq.copy_from_slice(act);
            // d_ff is a multiple of the block (`FusedBlock::of` checked), so this cannot fail.
            let _ = crate::ops::hadamard::block_transform_f32(&q.h, aq);
            aq
        }
        None => act,
    };
    gemm_nt(x, act, &w.down.w, t, d_ff, d, true);
    add_bias(x, w.down.b.as_deref());
    laps.lap(7);
}

/// Σ_i −log softmax(H_i · headᵀ)[ids_{i+1}] over i < t − 1 for one window's final hidden states H [t × d]
/// and the LM head [vocab × d], without storing the logits: the vocabulary goes by in chunks of
/// `VOCAB_CHUNK`, each row keeping a running max m and Σ exp(logit − m) in f64 (rescaled when m grows).
/// Per-token terms are summed in order.
pub fn lm_head_nll(h: &[f32], head: &[f32], ids: &[u32], d: usize, vocab: usize) -> f64 {
    let mut laps = Laps::start();
    let rows = ids.len() - 1; // the last token predicts nothing
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0f64; rows];
    let mut target = vec![0f32; rows];
    let mut logits = Vec::new();
    for v0 in (0..vocab).step_by(VOCAB_CHUNK) {
        let nv = VOCAB_CHUNK.min(vocab - v0);
        let lg = sized(&mut logits, rows * nv);
        gemm_nt(
            lg,
            &h[..rows * d],
            &head[v0 * d..(v0 + nv) * d],
            rows,
            d,
            nv,
            false,
        );
        for (i, row) in lg.chunks(nv).enumerate() {
            let cm = max_lanes(row);
            if cm > max[i] {
                sum[i] *= ((max[i] - cm) as f64).exp();
                max[i] = cm;
            }
            sum[i] += sum_exp_f64(row, max[i]);
            let next = ids[i + 1] as usize;
            if (v0..v0 + nv).contains(&next) {
                target[i] = row[next - v0];
            }
        }
    }
    let nll = (0..rows)
        .map(|i| max[i] as f64 + sum[i].ln() - target[i] as f64)
        .sum();
    laps.lap(8);
    nll
}

/// The chunk's windows X [n_seq·t × d] through every fused block (`load(l)` gives block l), then the final
/// norm and LM head: Σ NLL over the windows, in window order. `on_block` is called after each block.
#[allow(clippy::too_many_arguments)]
pub fn chunk_nll(
    cfg: &Config,
    rope: &RopeTable,
    x: &mut [f32],
    group: &[&[u32]],
    load: impl Fn(usize) -> anyhow::Result<FusedBlock> + Sync,
    norm: &[f32],
    head: &[f32],
    mut on_block: impl FnMut(),
) -> anyhow::Result<f64> {
    thread_local! {
        static WS: std::cell::RefCell<Workspace> = std::cell::RefCell::default();
    }
    let (t, d) = (rope.t, cfg.d);
    assert_eq!(x.len(), group.len() * t * d);
    // Block l + 1 is loaded (converted to f32 and stacked) while the windows go through block l, so the
    // load does not leave a core idle.
    let mut next = Some(load(0)?);
    for l in 0..cfg.n_layers {
        let w = next.take().expect("loaded in the previous iteration");
        let (loaded, ()) = rayon::join(
            || (l + 1 < cfg.n_layers).then(|| load(l + 1)),
            || {
                x.par_chunks_mut(t * d).for_each(|xw| {
                    WS.with_borrow_mut(|ws| block_forward_window(&w, cfg, rope, xw, ws))
                })
            },
        );
        next = loaded.transpose()?;
        on_block();
    }
    let terms: Vec<f64> = x
        .par_chunks_mut(t * d)
        .zip(group.par_iter())
        .map(|(xw, win)| {
            let mut hn = vec![0f32; t * d];
            for (y, x) in hn.chunks_mut(d).zip(xw.chunks(d)) {
                rms_norm_row(y, x, norm, cfg.eps);
            }
            lm_head_nll(&hn, head, win, d, cfg.vocab)
        })
        .collect();
    on_block();
    Ok(terms.iter().sum())
}
