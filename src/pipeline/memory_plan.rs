//! The memory plan of a run (design.md §3), stated before any long work starts.
//!
//! A run holds at once: the calibration activations X_l (updated in place, chunk by chunk, by the quantized
//! forward), the weights of one block (two on a GPU: block l+1 is prefetched while l is quantized), every
//! statistic of the block (all of them come from one FP forward), the factorization and sweep workspace of
//! the largest linear, and one forward chunk's intermediates. When that does not fit the device, X moves to
//! pinned host memory and the device keeps two chunks of it (one in use, one in flight); when even that does
//! not fit, the run is refused up front with the breakdown, instead of failing hours in.
//!
//! A mixture-of-experts block holds its experts' weights and, from the one FP forward, every expert's two
//! input covariances; a shared expert (Qwen2-MoE) is held like the attention, whatever the group, with its
//! down_proj's input covariance. When a GPU cannot hold them all, the plan takes the experts in groups (the largest
//! power-of-two share that fits; the block's FP forward then runs once per group) before it moves X off the
//! device.

use crate::model::config::Config;
use crate::quant::plan::batch_len;
use std::fmt;

const GIB: f64 = (1u64 << 30) as f64;
/// Activations and weights are f32 on every target.
const F32: usize = 4;

/// The dimensions of a decoder that the plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub d: usize,
    pub d_ff: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub d_h: usize,
    /// A mixture-of-experts MLP (then `d_ff` is unused).
    pub experts: Option<ExpertShape>,
    /// The block order b of an online Hadamard before down_proj (R4, I ⊗ H_b, model/online.rs); 0 without
    /// one.
    pub online: usize,
    /// Whether each resident block holds R4's dense f32 [b × b] (`Backend::block_hadamard_reads_dense`: a
    /// GPU does for a block longer than its fast transform takes, cuda ops::HADAMARD_MAX_B). `of` assumes
    /// it does, an upper bound; `run` asks the backend.
    pub online_dense: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    pub n_experts: usize,
    pub top_k: usize,
    /// Each expert's intermediate size.
    pub d_expert: usize,
    /// The shared expert's intermediate size (Qwen2-MoE); 0 without one.
    pub d_shared: usize,
}

impl ModelShape {
    pub fn of(cfg: &Config) -> ModelShape {
        ModelShape {
            d: cfg.d,
            d_ff: cfg.d_ff,
            n_layers: cfg.n_layers,
            n_heads: cfg.n_heads,
            n_kv_heads: cfg.n_kv_heads,
            d_h: cfg.d_h,
            experts: cfg.block.moe.as_ref().map(|m| ExpertShape {
                n_experts: m.n_experts,
                top_k: m.top_k,
                d_expert: m.d_expert,
                d_shared: m.shared_expert.as_ref().map_or(0, |s| s.d_ff),
            }),
            online: cfg.block.online_down.unwrap_or(0),
            online_dense: true,
        }
    }

    fn d_kv(&self) -> usize {
        self.n_kv_heads * self.d_h
    }

    /// The MLP's intermediate size: the dense one's, or one expert's.
    fn d_mlp(&self) -> usize {
        self.experts.map_or(self.d_ff, |e| e.d_expert)
    }

    /// The (d_out, d_in) of q, k, v, o, then gate, up, down of the MLP (of one expert in an MoE block).
    fn linears(&self) -> [(usize, usize); 7] {
        let (d, f, q, kv) = (self.d, self.d_mlp(), self.n_heads * self.d_h, self.d_kv());
        [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]
    }

    /// The shared expert's intermediate size; 0 without one.
    fn d_shared(&self) -> usize {
        self.experts.map_or(0, |e| e.d_shared)
    }

    /// The shared expert's (d_out, d_in) of gate, up, down; empty without one.
    fn shared_linears(&self) -> Vec<(usize, usize)> {
        match self.d_shared() {
            0 => Vec::new(),
            s => vec![(s, self.d), (s, self.d), (self.d, s)],
        }
    }

    /// What a block holds whatever the expert group: the attention's weights, the norms, an MoE block's
    /// router and shared expert (its gate w_g too), and an online Hadamard's matrix.
    fn attention_params(&self) -> usize {
        let router = self.experts.map_or(0, |e| e.n_experts * self.d);
        let shared = match self.d_shared() {
            0 => 0,
            s => 3 * self.d * s + self.d,
        };
        self.linears()[..4]
            .iter()
            .map(|(o, i)| o * i)
            .sum::<usize>()
            + 2 * self.d
            + router
            + shared
            + if self.online_dense {
                self.online * self.online
            } else {
                0
            }
    }

    /// One MLP's weights (one expert's in an MoE block).
    fn mlp_params(&self) -> usize {
        3 * self.d * self.d_mlp()
    }

    fn n_mlps(&self) -> usize {
        self.experts.map_or(1, |e| e.n_experts)
    }

    pub fn block_params(&self) -> usize {
        self.attention_params() + self.n_mlps() * self.mlp_params()
    }
}

/// Where the plan runs and in which precisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// A GPU: f32 activations and weights (X_l then matches the CPU's; design.md §3 budgets bf16, which
    /// would halve both), f32 statistics, a prefetched second block, pinned-host fallback.
    Gpu,
    /// The CPU backend: f32 activations and weights, f64 statistics, one block, no fallback (host = device).
    Cpu,
}

impl Target {
    fn stat_bytes(self) -> usize {
        match self {
            Target::Gpu => 4,
            Target::Cpu => 8,
        }
    }
    fn resident_blocks(self) -> usize {
        match self {
            Target::Gpu => 2,
            Target::Cpu => 1,
        }
    }
    /// Context, cuBLAS workspace and allocator slack on a GPU; nothing extra on the host.
    fn reserve(self) -> u64 {
        match self {
            Target::Gpu => 2 << 30,
            Target::Cpu => 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// X_l lives on the device for the whole run.
    Device,
    /// X_l lives in pinned host memory; the device holds two chunks of `chunk_seqs` sequences.
    HostStreamed,
}

#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub target: Target,
    /// (what, bytes) held on the device at the peak of a block.
    pub items: Vec<(&'static str, u64)>,
    pub activations: Activations,
    /// Sequences forwarded together.
    pub chunk_seqs: usize,
    /// Pinned host memory for X when it is streamed.
    pub host_bytes: u64,
    pub budget: u64,
    /// An MoE block's experts held (weights and statistics) at once: all of them unless they do not fit.
    pub expert_group: Option<usize>,
}

impl MemoryPlan {
    pub fn device_bytes(&self) -> u64 {
        self.items.iter().map(|(_, b)| b).sum()
    }

    /// Whether `bytes` more (the f32 embedding table, uploaded so X is gathered on the device) fit while
    /// the calibration windows are embedded: before the first block, the room its weights, statistics,
    /// workspace and forward chunk take later is free.
    pub fn fits_before_blocks(&self, bytes: u64) -> bool {
        let later: u64 = self
            .items
            .iter()
            .filter(|(n, _)| ![X_ON_DEVICE, X_STREAMED, RESERVE].contains(n))
            .map(|(_, b)| b)
            .sum();
        bytes <= later
    }
}

const X_ON_DEVICE: &str = "calibration activations X";
const X_STREAMED: &str = "two chunks of X (X in pinned host memory)";
const RESERVE: &str = "CUDA context + cuBLAS workspace";

/// The calibration set: `nsamples` sequences of `seqlen` tokens (0 samples: RTN without data).
#[derive(Clone, Copy, Debug)]
pub struct Calibration {
    pub nsamples: usize,
    pub seqlen: usize,
    /// Sequences the bit allocation's output proxy measures on (pipeline/sensitivity.rs; a forward chunk's
    /// at a time), 0 without it.
    pub proxy_sequences: usize,
    /// The weights of the largest allocation unit (all of a block's routed experts' down_proj, say), whose
    /// Ŵ the output proxy holds beside W while it measures the unit; 0 without the proxy.
    pub proxy_weights: usize,
    /// The elements of the plans (damped H and factor) the output proxy keeps while it measures a unit: one
    /// per expert in a unit of experts (sensitivity::plan_cache_elems); 0 without the proxy.
    pub proxy_plans: usize,
    /// `--asym-calib`: the FP model's stream beside X (where X is: a parked one staged a chunk at a time), its
    /// chunk's block forward beside X's, and one block's D sums (quant/asym.rs).
    pub asym: bool,
}

/// Plans a run of `shape` on `target` with `budget` bytes free. `max_chunk_seqs` bounds the forward chunk
/// (the pipeline's own chunk); the plan takes the largest power of two ≤ it that fits, down to one sequence.
pub fn plan(
    shape: &ModelShape,
    calib: Calibration,
    target: Target,
    budget: u64,
    max_chunk_seqs: usize,
) -> Result<MemoryPlan, String> {
    let x_bytes = (calib.nsamples * calib.seqlen * shape.d * F32) as u64;
    let mut chunk_options = Vec::new();
    let mut c = max_chunk_seqs.clamp(1, calib.nsamples.max(1));
    loop {
        chunk_options.push(c);
        if c == 1 {
            break;
        }
        c /= 2;
    }
    // All experts at once, then (a GPU only: the host holds one block in any case) halves of them.
    let mut groups = vec![shape.n_mlps()];
    while target == Target::Gpu && shape.experts.is_some() && groups[groups.len() - 1] > 1 {
        groups.push(groups[groups.len() - 1] / 2);
    }
    let chunk_tokens = |seqs: usize| {
        if calib.nsamples > 0 {
            seqs * calib.seqlen
        } else {
            0
        }
    };
    let with = |seqs: usize, group: usize, first: (&'static str, u64)| {
        let mut items = vec![first];
        items.extend(fixed_items(shape, calib.nsamples > 0, target, group));
        items.push((
            "forward chunk intermediates (f32)",
            forward_workspace(shape, chunk_tokens(seqs)),
        ));
        // Its gathered inputs and FP outputs, all of its sequences (from as many chunks as hold them), and
        // one piece's difference (it forwards a chunk's sequences at a time: the forward's own copy is the
        // chunk's).
        let all = calib.proxy_sequences.min(calib.nsamples);
        let seq = calib.seqlen * shape.d * F32;
        items.push((
            "--avg-bits output proxy (input, Y_FP, Y − Y_FP)",
            ((2 * all + all.min(seqs)) * seq) as u64,
        ));
        items.push((
            "--avg-bits output proxy (the largest unit's Ŵ)",
            (calib.proxy_weights * F32) as u64,
        ));
        items.push((
            "--avg-bits output proxy (the plans of its largest unit)",
            (calib.proxy_plans * target.stat_bytes()) as u64,
        ));
        let asym = calib.asym && calib.nsamples > 0;
        let streamed = first.0 == X_STREAMED;
        items.push((
            "--asym-calib: the FP model's activations",
            match (asym, streamed) {
                (false, _) => 0,
                (true, false) => x_bytes,
                (true, true) => (chunk_tokens(seqs) * shape.d * F32) as u64,
            },
        ));
        // The FP chunk's intermediates, and D's operands of the widest input (A − B in f32, both in bf16
        // on a GPU; in f32 with an n × n product on the host).
        let widest = shape.d.max(shape.d_ff);
        items.push((
            "--asym-calib: the FP chunk's forward and D's operands",
            if asym {
                forward_workspace(shape, chunk_tokens(seqs))
                    + (chunk_tokens(seqs) * widest * 8) as u64
            } else {
                0
            },
        ));
        items.push((
            "--asym-calib: D of the block's four inputs",
            if asym {
                let attn = shape.n_heads * shape.d_h;
                ((2 * shape.d * shape.d + attn * attn + shape.d_ff * shape.d_ff)
                    * target.stat_bytes()) as u64
            } else {
                0
            },
        ));
        items
    };
    let fits = |items: &[(&'static str, u64)]| items.iter().map(|(_, b)| b).sum::<u64>() <= budget;
    let made = |items, activations, seqs, group, host_bytes| MemoryPlan {
        target,
        items,
        activations,
        chunk_seqs: seqs,
        host_bytes,
        budget,
        expert_group: shape.experts.map(|_| group),
    };
    // Smaller chunks cost a little GEMM efficiency; expert groups cost a forward of the block per group;
    // moving X off the device costs two PCIe copies of it per block. So every chunk size and then every
    // expert group is tried with X on the device before X moves.
    for &group in &groups {
        for &seqs in &chunk_options {
            let items = with(seqs, group, (X_ON_DEVICE, x_bytes));
            if fits(&items) {
                return Ok(made(items, Activations::Device, seqs, group, 0));
            }
        }
    }
    let last = groups[groups.len() - 1];
    let mut tightest = with(1, last, (X_ON_DEVICE, x_bytes));
    if target == Target::Gpu && x_bytes > 0 {
        for &group in &groups {
            for &seqs in &chunk_options {
                let chunk_x = (chunk_tokens(seqs) * shape.d * F32) as u64;
                let items = with(seqs, group, (X_STREAMED, 2 * chunk_x));
                if fits(&items) {
                    // --asym-calib parks the FP stream beside X.
                    let host = if calib.asym { 2 * x_bytes } else { x_bytes };
                    return Ok(made(items, Activations::HostStreamed, seqs, group, host));
                }
                tightest = items;
            }
        }
    }
    let items = tightest;
    let total: u64 = items.iter().map(|(_, b)| b).sum();
    let breakdown: Vec<String> = items
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(n, b)| format!("{n} {:.1} GiB", *b as f64 / GIB))
        .collect();
    Err(format!(
        "the run needs at least {:.1} GiB on the {} but {:.1} GiB are free ({}); use a device with more \
         memory or fewer --nsamples/--seqlen",
        total as f64 / GIB,
        match target {
            Target::Gpu => "GPU",
            Target::Cpu => "host",
        },
        budget as f64 / GIB,
        breakdown.join(", ")
    ))
}

/// Everything but X and the forward chunk: block weights, statistics, quantization workspace, reserve, with
/// `group` of an MoE block's experts held at once.
fn fixed_items(
    shape: &ModelShape,
    with_stats: bool,
    target: Target,
    group: usize,
) -> Vec<(&'static str, u64)> {
    let wb = F32 as u64;
    let sb = target.stat_bytes() as u64;
    let (d, f) = (shape.d as u64, shape.d_mlp() as u64);
    let held = shape.attention_params() + group * shape.mlp_params();
    let blocks = held as u64 * wb * target.resident_blocks() as u64;
    // Input covariances of q/k/v, o and the MLP input; V's per-KV-group H_col; q/k row Hessians; down's
    // input covariance, or each held expert's two (its routed inputs and its activation) and the shared
    // expert's down_proj input (its gate/up read the MLP input's).
    let stats = if with_stats {
        let dh = shape.d_h as u64;
        let heads = (shape.n_heads + shape.n_kv_heads) as u64;
        let s = shape.d_shared() as u64;
        let mlp = match shape.experts {
            None => f * f,
            Some(_) => group as u64 * (d * d + f * f) + s * s,
        };
        (3 * d * d + mlp + shape.n_kv_heads as u64 * d * d + heads * dh * dh) * sb
    } else {
        0
    };
    // The linear being quantized, at its peak: about six f32 copies of its W beside the block's own (the
    // dead-zeroed and sweep-order copies, the sweep's W0, Q and ΔW; then Ŵ, the report's ΔW_rtn, ΔW and the
    // product by H), and the damped H_p and U of its input width — for V one of each per KV head (its per-head
    // H_col are planned in one batch).
    let d_kv_heads = shape.n_kv_heads as u64;
    // An MoE block's expert plans are made in batches ahead of their linears (quant/plan.rs `batch_len`;
    // H_p and U, 2n² each, in the statistics' precision): one batch held per width of the experts' inputs
    // (d and d_expert), and while the next is made, its stacked H, batched H_p and U, and their copies one
    // per plan (at most twice a batch).
    let expert_plans = match shape.experts {
        Some(e) if with_stats => {
            let batch = |n: usize| (batch_len(n).min(group) * 2 * n * n) as u64;
            let (bd, bf) = (batch(shape.d), batch(e.d_expert));
            (bd + bf + 2 * bd.max(bf)) * sb
        }
        _ => 0,
    };
    let work = expert_plans
        + shape
            .linears()
            .into_iter()
            .chain(shape.shared_linears())
            .enumerate()
            .map(|(k, (o, i))| {
                let factors = if k == 2 { d_kv_heads } else { 1 };
                (6 * o * i) as u64 * 4 + 2 * factors * (i * i) as u64 * 4
            })
            .max()
            .unwrap_or(0);
    let weights_name = match (target, shape.experts) {
        (Target::Gpu, None) => "block weights ×2 (current + prefetch)",
        (Target::Gpu, Some(e)) if e.d_shared > 0 => {
            "block weights ×2 (attention, router, shared expert, the experts held)"
        }
        (Target::Gpu, Some(_)) => "block weights ×2 (attention, router, the experts held)",
        (Target::Cpu, _) => "block weights (f32)",
    };
    vec![
        (weights_name, blocks),
        ("block statistics", stats),
        (
            if expert_plans > 0 {
                "quantization workspace (largest linear, a batch of expert plans)"
            } else {
                "quantization workspace (largest linear)"
            },
            work,
        ),
        (RESERVE, target.reserve()),
        // Experts in groups (pipeline/expert_groups.rs): the forward that makes the next block's inputs reads
        // the experts' Ŵ from the host, one linear uploaded at a time.
        (
            "an expert linear uploaded for the forward (experts in groups)",
            match shape.experts {
                Some(_) if group < shape.n_mlps() => (shape.mlp_params() / 3 * F32) as u64,
                _ => 0,
            },
        ),
    ]
}

/// f32 intermediates of one forward chunk at the statistics forward's peak: the chunk's copy, the normed
/// inputs, q, k, v, the attention output and the MLP's down output (6·d + 2·d_kv), gate, up and act (3·d_ff)
/// and, with an online Hadamard, act's transform (d_ff; an expert's d_expert).
/// Attention probabilities are formed tile by tile (flash style) and need no t×t buffer per head.
/// An MoE block has, per token, its router logits and, for each of its top-k experts, the gathered input,
/// gate, up, act and output rows instead, and a shared expert's gate, up, act, output and sigmoid gate. The
/// statistics then take a bf16 copy of each routed row's input and act, padded by at most 1/8 and 15 rows
/// per expert (cuda/row_grams.rs): about 2.25 · (d + d_expert) bytes beside the 4 · (d + d_expert) kept, under
/// the 4 · (2·d + 3·d_expert) counted here.
fn forward_workspace(shape: &ModelShape, tokens: usize) -> u64 {
    // gate, up and act; R4's transformed act beside act itself
    let act = if shape.online > 0 { 4 } else { 3 };
    let mlp = match shape.experts {
        None => act * shape.d_ff,
        Some(e) => {
            let shared = match e.d_shared {
                0 => 0,
                s => act * s + shape.d + 1,
            };
            e.n_experts + e.top_k * (act * e.d_expert + 2 * shape.d) + shared
        }
    };
    let per_token = 6 * shape.d + 2 * shape.d_kv() + mlp;
    (tokens * per_token * F32) as u64
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let where_ = match self.target {
            Target::Gpu => "GPU",
            Target::Cpu => "host",
        };
        writeln!(
            f,
            "memory plan: {:.1} GiB of {:.1} GiB free on the {where_}; forward chunks of {} sequences{}",
            self.device_bytes() as f64 / GIB,
            self.budget as f64 / GIB,
            self.chunk_seqs,
            match self.activations {
                Activations::Device => String::new(),
                Activations::HostStreamed => format!(
                    "; X ({:.1} GiB) stays in pinned host memory and is streamed",
                    self.host_bytes as f64 / GIB
                ),
            }
        )?;
        if let Some(g) = self.expert_group {
            writeln!(f, "  experts held at once: {g}")?;
        }
        for (name, bytes) in self.items.iter().filter(|(_, b)| *b > 0) {
            writeln!(f, "  {:>8.2} GiB  {name}", *bytes as f64 / GIB)?;
        }
        Ok(())
    }
}

/// MemAvailable from /proc/meminfo (Linux); None elsewhere.
pub fn host_available_bytes() -> Option<u64> {
    super::report::proc_kb_field("/proc/meminfo", "MemAvailable:")
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn llama(d: usize, d_ff: usize, n_layers: usize, n_heads: usize, n_kv: usize) -> ModelShape {
        ModelShape {
            d,
            d_ff,
            n_layers,
            n_heads,
            n_kv_heads: n_kv,
            d_h: d / n_heads,
            experts: None,
            online: 0,
            online_dense: true,
        }
    }

    /// (name, shape, published parameter count of the whole model, vocabulary).
    fn moe_shapes() -> [(&'static str, ModelShape, f64, usize); 5] {
        let moe = |d, n_layers, n_heads, n_kv, n_experts, top_k, d_expert| ModelShape {
            d,
            d_ff: 0,
            n_layers,
            n_heads,
            n_kv_heads: n_kv,
            d_h: 128,
            experts: Some(ExpertShape {
                n_experts,
                top_k,
                d_expert,
                d_shared: 0,
            }),
            online: 0,
            online_dense: true,
        };
        // Qwen2-MoE: the same with a shared expert of `d_shared`.
        let shared = |s: ModelShape, d_shared| ModelShape {
            experts: s.experts.map(|e| ExpertShape { d_shared, ..e }),
            ..s
        };
        [
            // config.json of Qwen3-30B-A3B, Mixtral-8x7B-v0.1, Qwen3-235B-A22B, Qwen1.5-MoE-A2.7B (14.3B
            // parameters), Qwen2-57B-A14B.
            (
                "Qwen3-30B-A3B",
                moe(2048, 48, 32, 4, 128, 8, 768),
                30.5e9,
                151936,
            ),
            (
                "Mixtral 8x7B",
                moe(4096, 32, 32, 8, 8, 2, 14336),
                46.7e9,
                32000,
            ),
            (
                "Qwen3-235B-A22B",
                moe(4096, 94, 64, 4, 128, 8, 1536),
                235e9,
                151936,
            ),
            (
                "Qwen1.5-MoE-A2.7B",
                shared(moe(2048, 24, 16, 16, 60, 4, 1408), 5632),
                14.3e9,
                151936,
            ),
            (
                "Qwen2-57B-A14B",
                shared(moe(3584, 28, 28, 4, 64, 8, 2560), 20480),
                57.4e9,
                151936,
            ),
        ]
    }

    #[test]
    fn moe_block_params_match_the_published_model_sizes() {
        for (name, s, total, vocab) in moe_shapes() {
            // Untied embeddings and head.
            let n = (s.block_params() * s.n_layers + 2 * vocab * s.d) as f64;
            assert!((n / total - 1.0).abs() < 0.02, "{name}: {n:.4e}");
        }
    }

    #[test]
    fn moe_shapes_fit_80gb_and_141gb_with_every_expert_held() {
        for (name, s, _, _) in moe_shapes() {
            let e = s.experts.unwrap();
            for budget in [80 * GB, 141 * GB] {
                let p = plan(&s, CALIB, Target::Gpu, budget, 8)
                    .unwrap_or_else(|m| panic!("{name}: {m}"));
                println!("{name}, {} GB: {p}", budget / GB);
                assert!(p.device_bytes() <= budget, "{name}: {p}");
                assert_eq!(p.expert_group, Some(e.n_experts), "{name} at {budget}: {p}");
                assert_eq!(
                    p.activations,
                    Activations::Device,
                    "{name} at {budget}: {p}"
                );
            }
        }
    }

    #[test]
    fn experts_that_do_not_fit_are_taken_in_groups_before_x_moves() {
        // 235B-class: 2 × 10 GB of f32 block weights and 9.7 GB of expert statistics do not fit 24 GB.
        let (name, s, _, _) = moe_shapes()[2];
        let p = plan(&s, CALIB, Target::Gpu, 24 * GB, 8).unwrap_or_else(|m| panic!("{name}: {m}"));
        println!("{name}, 24 GB: {p}");
        let g = p.expert_group.unwrap();
        assert!(g < 128 && g.is_power_of_two(), "{p}");
        assert_eq!(p.activations, Activations::Device, "{p}");
        assert!(p.device_bytes() <= 24 * GB, "{p}");
        // Twice the group would not have fit.
        let full = plan(&s, CALIB, Target::Gpu, u64::MAX, 8).unwrap();
        assert!(full.device_bytes() > 24 * GB);
        // The host plan holds the whole block: no groups there.
        let cpu = plan(&s, CALIB, Target::Cpu, 1 << 40, 8).unwrap();
        assert_eq!(cpu.expert_group, Some(128));
    }

    #[test]
    fn a_shared_expert_is_held_beside_every_expert_group() {
        // Qwen2-57B-A14B: a 20480-wide shared expert beside 64 experts of 2560.
        let (name, s, _, _) = moe_shapes()[4];
        let e = s.experts.unwrap();
        let without = ModelShape {
            experts: Some(ExpertShape { d_shared: 0, ..e }),
            ..s
        };
        let item = |p: &MemoryPlan, prefix: &str| {
            p.items
                .iter()
                .find(|(n, _)| n.starts_with(prefix))
                .map_or(0, |i| i.1)
        };
        let (d, d_s) = (s.d as u64, e.d_shared as u64);
        for budget in [80 * GB, 141 * GB, 24 * GB] {
            let p =
                plan(&s, CALIB, Target::Gpu, budget, 8).unwrap_or_else(|m| panic!("{name}: {m}"));
            let q = plan(&without, CALIB, Target::Gpu, budget, 8).unwrap();
            println!("{name}, {} GB: {p}", budget / GB);
            if p.expert_group != q.expert_group {
                continue;
            }
            // Its gate/up/down and w_g in f32, twice (the prefetched block), whatever the group.
            assert_eq!(
                item(&p, "block weights") - item(&q, "block weights"),
                2 * 4 * (3 * d * d_s + d),
                "{p}"
            );
            // Its down_proj's input covariance (gate/up read the MLP input's, already counted).
            assert_eq!(
                item(&p, "block statistics") - item(&q, "block statistics"),
                4 * d_s * d_s,
                "{p}"
            );
            // The widest linear is now its down_proj (d_in 20480).
            assert!(item(&p, "quantization workspace") > item(&q, "quantization workspace"));
        }
        // On 24 GB the experts go in groups; the shared expert stays in every one.
        let p = plan(&s, CALIB, Target::Gpu, 24 * GB, 8).unwrap();
        let g = p.expert_group.unwrap() as u64;
        assert!(g < 64, "{p}");
        let held = s.attention_params() as u64 + g * s.mlp_params() as u64;
        assert!(held > 3 * d * d_s);
        assert_eq!(item(&p, "block weights"), 2 * 4 * held, "{p}");
    }

    fn shapes() -> [(&'static str, ModelShape); 4] {
        [
            ("7B", llama(4096, 11008, 32, 32, 32)),
            ("13B", llama(5120, 13824, 40, 40, 40)),
            ("30B", llama(6656, 17920, 60, 52, 52)),
            ("70B", llama(8192, 28672, 80, 64, 8)),
        ]
    }

    const CALIB: Calibration = Calibration {
        nsamples: 128,
        seqlen: 2048,
        proxy_sequences: 0,
        proxy_weights: 0,
        proxy_plans: 0,
        asym: false,
    };

    #[test]
    fn block_params_match_the_published_model_sizes() {
        // Blocks are all but the embeddings and lm_head: 7B has 6.48e9 in blocks, 70B 68.5e9.
        let [(_, s7), _, _, (_, s70)] = shapes();
        let b7 = (s7.block_params() * s7.n_layers) as f64;
        let b70 = (s70.block_params() * s70.n_layers) as f64;
        assert!((b7 / 6.48e9 - 1.0).abs() < 0.01, "{b7}");
        assert!((b70 / 68.5e9 - 1.0).abs() < 0.01, "{b70}");
    }

    #[test]
    fn every_shape_fits_80gb_and_141gb_with_activations_on_the_gpu() {
        for (name, s) in shapes() {
            for budget in [80 * GB, 141 * GB] {
                let p = plan(&s, CALIB, Target::Gpu, budget, 8)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(p.device_bytes() <= budget, "{name}: {p}");
                assert_eq!(
                    p.activations,
                    Activations::Device,
                    "{name} at {budget}: {p}"
                );
                assert!(p.chunk_seqs >= 1, "{name}");
            }
        }
    }

    #[test]
    fn an_online_hadamard_is_held_with_each_resident_block() {
        // Llama-2-7B with R4 in blocks of 256 (11008 = 43 · 256): a 256² f32 matrix per held block, and one
        // more d_ff-wide row per forward token.
        let (_, s7) = shapes()[0];
        let r4 = ModelShape { online: 256, ..s7 };
        // A backend with the fast transform holds no matrix; the act row stays.
        let fast = ModelShape {
            online_dense: false,
            ..r4
        };
        let (a, b, c) = (
            plan(&s7, CALIB, Target::Gpu, 141 * GB, 8).unwrap(),
            plan(&r4, CALIB, Target::Gpu, 141 * GB, 8).unwrap(),
            plan(&fast, CALIB, Target::Gpu, 141 * GB, 8).unwrap(),
        );
        let item = |p: &MemoryPlan, prefix: &str| {
            p.items
                .iter()
                .find(|(n, _)| n.starts_with(prefix))
                .unwrap()
                .1
        };
        assert_eq!(
            item(&b, "block weights") - item(&a, "block weights"),
            2 * 256 * 256 * 4
        );
        assert_eq!(
            item(&b, "forward chunk") - item(&a, "forward chunk"),
            (8 * CALIB.seqlen * 11008 * 4) as u64
        );
        assert_eq!(item(&c, "block weights"), item(&a, "block weights"));
        assert_eq!(item(&c, "forward chunk"), item(&b, "forward chunk"));
    }

    #[test]
    fn x_of_70b_is_f32() {
        // 128 × 2048 × 8192 f32 = 8 GiB (design.md §3 counts 4.3 GB in bf16; the GPU keeps X in f32).
        let (_, s70) = shapes()[3];
        let p = plan(&s70, CALIB, Target::Gpu, 80 * GB, 8).unwrap();
        assert_eq!(p.items[0], ("calibration activations X", 8 << 30));
    }

    #[test]
    fn the_embedding_table_is_gathered_on_the_gpu_at_every_shape() {
        // f32 tables: Llama-2 7B/13B/30B 32000 rows, Llama-3 70B 128256 rows (4.2 GB): each fits in the room
        // the first block takes later, in the plans above and in a 40 GB one (where 30B streams X: its 52 KV
        // heads' per-head V factors alone take 18 GB on the device).
        let vocab = [32000, 32000, 32000, 128256];
        for ((name, s), v) in shapes().into_iter().zip(vocab) {
            let table = (v * s.d * F32) as u64;
            for budget in [40 * GB, 80 * GB, 141 * GB] {
                let p = plan(&s, CALIB, Target::Gpu, budget, 8).unwrap();
                assert!(p.fits_before_blocks(table), "{name} at {budget}: {p}");
            }
        }
        // A table larger than a block's whole working set does not.
        let (_, s7) = shapes()[0];
        let p = plan(&s7, CALIB, Target::Gpu, 80 * GB, 8).unwrap();
        assert!(!p.fits_before_blocks(p.device_bytes()), "{p}");
    }

    #[test]
    fn a_small_gpu_streams_x_from_pinned_host_memory() {
        // 32 GB: 70B's f32 block weights ×2, statistics, the down projection's workspace (11.4 GiB: six W, H and U
        // of width 28672) and a forward chunk take ~28 GiB; X (another 8 GiB) is streamed.
        let (_, s70) = shapes()[3];
        let p = plan(&s70, CALIB, Target::Gpu, 32 * GB, 8).unwrap();
        assert_eq!(p.activations, Activations::HostStreamed, "{p}");
        assert_eq!(p.host_bytes, 8 << 30);
        assert!(p.device_bytes() <= 32 * GB);
        // Bigger chunks are dropped before X leaves the device only when no chunk size keeps it there.
        let p7 = plan(&shapes()[0].1, CALIB, Target::Gpu, 32 * GB, 8).unwrap();
        assert_eq!(p7.activations, Activations::Device, "{p7}");
    }

    #[test]
    fn chunks_shrink_before_activations_move() {
        let (_, s7) = shapes()[0];
        let roomy = plan(&s7, CALIB, Target::Gpu, 141 * GB, 8).unwrap();
        assert_eq!(roomy.chunk_seqs, 8);
        // Just above the one-sequence plan: X stays, the chunk shrinks.
        let one = plan(&s7, CALIB, Target::Gpu, u64::MAX, 1).unwrap();
        let tight = plan(&s7, CALIB, Target::Gpu, one.device_bytes(), 8).unwrap();
        assert_eq!(tight.activations, Activations::Device);
        assert_eq!(tight.chunk_seqs, 1);
    }

    #[test]
    fn too_small_a_gpu_is_refused_with_the_breakdown() {
        let (_, s70) = shapes()[3];
        let e = plan(&s70, CALIB, Target::Gpu, 8 * GB, 8).unwrap_err();
        assert!(
            e.contains("GiB are free") && e.contains("block statistics"),
            "{e}"
        );
    }

    /// `--asym-calib` holds the FP model's stream (X's size again), its chunk's forward and D's operands, and
    /// one block's four D sums (f64 on the host, f32 on a GPU); with X parked, one staged chunk of the FP
    /// stream on the GPU and the whole stream beside X in pinned memory.
    #[test]
    fn asym_calibration_holds_the_fp_stream_and_its_d_sums() {
        let (_, s7) = shapes()[0];
        let asym = Calibration {
            asym: true,
            ..CALIB
        };
        let x = 128 * 2048 * 4096 * 4;
        let chunk = |seqs: u64| -> u64 {
            let tokens = seqs as usize * 2048;
            forward_workspace(&s7, tokens) + (tokens * 11008 * 8) as u64
        };
        let sums = 3 * 4096 * 4096 + 11008 * 11008;
        let a = plan(&s7, CALIB, Target::Cpu, 1 << 40, 8).unwrap();
        let b = plan(&s7, asym, Target::Cpu, 1 << 40, 8).unwrap();
        assert_eq!(b.chunk_seqs, 8);
        assert_eq!(
            b.device_bytes() - a.device_bytes(),
            x + chunk(8) + sums * 8,
            "{b}"
        );
        let a = plan(&s7, CALIB, Target::Gpu, 1 << 40, 8).unwrap();
        let b = plan(&s7, asym, Target::Gpu, 1 << 40, 8).unwrap();
        assert_eq!(b.activations, Activations::Device);
        assert_eq!(
            b.device_bytes() - a.device_bytes(),
            x + chunk(8) + sums * 4,
            "{b}"
        );
        // At 20 GB the two streams (4 GiB each) do not fit beside a 7B block's statistics: both are parked.
        let b = plan(&s7, asym, Target::Gpu, 20 * GB, 8).unwrap();
        assert_eq!(b.activations, Activations::HostStreamed, "{b}");
        assert_eq!(b.host_bytes, 2 * x, "{b}");
        let fp = b
            .items
            .iter()
            .find(|(n, _)| n.contains("FP model's activations"))
            .map(|(_, v)| *v);
        assert_eq!(fp, Some(b.chunk_seqs as u64 * 2048 * 4096 * 4), "{b}");
    }

    #[test]
    fn the_output_proxy_holds_its_sequences_inputs_and_outputs_and_one_units_w_hat_and_plans() {
        let (_, s7) = shapes()[0];
        let with = Calibration {
            proxy_sequences: 8,
            proxy_weights: 1 << 20,
            proxy_plans: 1 << 18,
            ..CALIB
        };
        let a = plan(&s7, CALIB, Target::Gpu, 141 * GB, 8).unwrap();
        let b = plan(&s7, with, Target::Gpu, 141 * GB, 8).unwrap();
        assert_eq!(a.chunk_seqs, 8);
        assert_eq!(b.chunk_seqs, 8);
        // 7B at seqlen 2048: 3 × 8 × 2048 × 4096 f32 = 768 MiB, the unit's Ŵ 4 MiB and its plans (f32 on a
        // GPU) 1 MiB.
        let w_hat = (4 << 20) + (1 << 20);
        assert_eq!(
            b.device_bytes() - a.device_bytes(),
            3 * 8 * 2048 * 4096 * 4 + w_hat
        );
        // A smaller chunk bounds one piece's difference; the inputs and FP outputs are of all 8 sequences
        // (gathered from four chunks).
        let c = plan(&s7, with, Target::Gpu, 141 * GB, 2).unwrap();
        let d = plan(&s7, CALIB, Target::Gpu, 141 * GB, 2).unwrap();
        assert_eq!(
            c.device_bytes() - d.device_bytes(),
            (2 * 8 + 2) * 2048 * 4096 * 4 + w_hat
        );
        // Fewer calibration sequences than the proxy's: all of them.
        let few = Calibration {
            nsamples: 4,
            ..with
        };
        let e = plan(&s7, few, Target::Gpu, 141 * GB, 8).unwrap();
        let f = plan(
            &s7,
            Calibration {
                nsamples: 4,
                ..CALIB
            },
            Target::Gpu,
            141 * GB,
            8,
        )
        .unwrap();
        assert_eq!(
            e.device_bytes() - f.device_bytes(),
            3 * 4 * 2048 * 4096 * 4 + w_hat
        );
    }

    #[test]
    fn rtn_without_data_needs_no_activations_or_statistics() {
        let (_, s7) = shapes()[0];
        let calib = Calibration {
            nsamples: 0,
            seqlen: 2048,
            proxy_sequences: 0,
            proxy_weights: 0,
            proxy_plans: 0,
            asym: false,
        };
        let p = plan(&s7, calib, Target::Cpu, 16 * GB, 8).unwrap();
        assert_eq!(p.items[0].1, 0);
        assert!(
            p.items
                .iter()
                .any(|&(n, b)| n == "block statistics" && b == 0)
        );
    }

    #[test]
    fn the_cpu_plan_keeps_everything_in_host_memory() {
        let (_, s7) = shapes()[0];
        let p = plan(&s7, CALIB, Target::Cpu, 128 * GB, 8).unwrap();
        assert_eq!(p.activations, Activations::Device);
        // f32 X of 128 × 2048 × 4096 is 4 GiB.
        assert_eq!(p.items[0].1, 4 << 30);
        assert!(plan(&s7, CALIB, Target::Cpu, 4 * GB, 8).is_err());
    }
}
