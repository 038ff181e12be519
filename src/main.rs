//! The `boa-cuda` command line: parse, call the library, print. Every error is one line on stderr and exit
//! code 2.

use boa_cuda::backend::{Device, GemmPrecision, select_backend};
use boa_cuda::eval::{EvalOptions, perplexity};
use boa_cuda::export::gguf_mix::GgufType;
use boa_cuda::export::gptq_packed::OutFormat;
use boa_cuda::model::Model;
use boa_cuda::model::orthogonal::RotationKind;
use boa_cuda::model::rotate::RotateSpec;
use boa_cuda::pipeline::options::{
    AllocProxy, AllocScope, AllocUnit, BitAllocation, GroupSize, LayerSet, Method, MoeHessian,
    Projection, QkNormHessian, RunOptions, ScaleSearchArg, VRowHessian,
};
use boa_cuda::progress::Progress;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "boa-cuda",
    version,
    about = "Post-training quantization of Llama-family LLMs (BoA, GPTQ, RTN)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Quantize a model block by block (BoA, GPTQ or RTN) and write a packed GPTQ checkpoint (or a fake-quant
    /// HF folder) + report.json.
    Run(Box<RunArgs>),
    /// Write the model with its norms folded and orthogonal rotations fused into its weights (R1 on the
    /// residual stream, R2 per KV head on the values): the same function, an ordinary f32 HF folder of the
    /// same architecture, easier to quantize. `run --rotate` does this before calibrating.
    Rotate {
        /// Model folder (config.json, *.safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// Output folder (must not exist unless --force).
        #[arg(long)]
        out: PathBuf,
        /// hadamard: randomized Hadamard matrices where this code can construct the size (Sylvester 2^k,
        /// Paley, Kronecker products), else a random orthogonal matrix (said on stderr). random: seeded
        /// random orthogonal matrices throughout.
        #[arg(long, value_enum, default_value_t = RotationKind::Hadamard)]
        kind: RotationKind,
        /// Seed of the Hadamard signs and random matrices.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also QuaRot's R4: an online Hadamard transform of down_proj's input (in blocks: I ⊗ H_b), its
        /// inverse folded into down_proj (every expert's in a mixture of experts). Only boa-cuda runs the
        /// result: config.json's model_type becomes boa_cuda_online_hadamard, so other loaders refuse it
        /// instead of computing another function.
        #[arg(long)]
        online: bool,
        /// R4's block order b (a divisor of intermediate_size with a Hadamard matrix; of every expert's and
        /// the shared expert's width in a mixture of experts); default: the largest such divisor up to 2048
        /// (the whole width on the demo model; 256 at Llama-2-7B's 11008), refused below 64 unless asked
        /// for here. Larger blocks mix more columns and cost more in the forward (d_ff · b per token).
        #[arg(long, requires = "online")]
        online_block: Option<usize>,
        /// Replace --out if it exists.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        quiet: bool,
    },
    /// Benchmark of the quantization engine: phase times of whole-model GPTQ and BoA runs, and BoA's sweep
    /// against the reference-style column-at-a-time sweep on one attention projection.
    BenchQuant {
        /// Model folder for the whole-model runs (skipped without it).
        #[arg(long)]
        model: Option<PathBuf>,
        /// Calibration text for the whole-model runs.
        #[arg(long, num_args = 1..)]
        calib: Vec<PathBuf>,
        #[arg(long, default_value_t = 16)]
        nsamples: usize,
        #[arg(long, default_value_t = 512)]
        seqlen: usize,
        #[arg(long, default_value_t = 3)]
        wbits: u32,
        /// Projection shapes for the sweep comparison, as heads,head_dim,input_width triples (default: the
        /// demo model's q_proj and two 128-wide heads over a 2048-wide input).
        #[arg(long, num_args = 1.., default_values = ["9,64,576", "2,128,2048"])]
        sweep_shape: Vec<String>,
    },
    /// Convert a llama- or gemma3-architecture GGUF (F32/F16/BF16, Q4/5/8_0, Q4/5_1, Q2_K…Q6_K tensors) to an
    /// HF folder.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// Output folder (must not exist yet, unless --force).
        #[arg(long)]
        out: PathBuf,
        /// dtype of the written weights (f32 keeps dequantized 4-bit values exact).
        #[arg(long, value_enum, default_value_t = ImportDtype::F32)]
        dtype: ImportDtype,
        /// Replace --out if it is an existing folder (never a file, never one holding the GGUF); the old
        /// folder stays until the new one is complete.
        #[arg(long)]
        force: bool,
    },
    /// Perplexity of a model on a text: mean next-token NLL over non-overlapping windows, exponentiated.
    Eval {
        /// Model folder (config.json, *.safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// Text file(s) or folder(s) (a folder's .txt files in name order, joined by blank lines).
        #[arg(long, required = true, num_args = 1..)]
        data: Vec<PathBuf>,
        /// Tokens per window.
        #[arg(long, default_value_t = 512)]
        seqlen: usize,
        /// Evaluate at most this many windows (from the start of the text).
        #[arg(long)]
        max_windows: Option<usize>,
        /// Windows forwarded together through each block.
        #[arg(long, default_value_t = 8)]
        chunk: usize,
        #[arg(long, value_enum, default_value_t = Device::Auto)]
        device: Device,
        /// Print one JSON object {perplexity, tokens, windows, seconds, tokens_per_second} instead of text.
        #[arg(long)]
        json: bool,
    },
    /// What a model folder holds: architecture, layers, quantized layers, bits, group size, format, size.
    Inspect {
        /// Model folder (HF or packed GPTQ checkpoint).
        dir: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Benchmark the CPU packed low-bit GEMM against the f32 GEMM (4096×4096 and 11008×4096, m = 1, 4, 16).
    BenchQgemm {
        /// Timed repeats per case (the median is reported).
        #[arg(long, default_value_t = 15)]
        repeats: usize,
        /// Untimed calls before timing.
        #[arg(long, default_value_t = 3)]
        warmup: usize,
        /// Print JSON rows instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write a Llama model with seeded random weights (f32 safetensors, uniform with variance 1/d_in) and a
    /// byte-level tokenizer, so any text calibrates it: GPU checks and benchmarks without a model hub.
    SynthModel {
        /// Output folder (must not exist).
        #[arg(long)]
        out: PathBuf,
        /// Hidden size.
        #[arg(long, default_value_t = 512)]
        d: usize,
        /// MLP width.
        #[arg(long, default_value_t = 1376)]
        d_ff: usize,
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Query heads (head dim = d / heads).
        #[arg(long, default_value_t = 8)]
        heads: usize,
        /// Key/value heads (GQA when fewer than --heads).
        #[arg(long, default_value_t = 4)]
        kv_heads: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Benchmark the quantization core (XᵀX, head covariances, V statistics, batched Cholesky, Hessian scale
    /// search, GPTQ and BoA sweeps) on random inputs of real layer shapes, against the device's measured
    /// ceilings.
    Bench {
        /// cpu, cuda, or auto (CUDA when usable).
        #[arg(long, value_enum, default_value = "auto")]
        device: boa_cuda::backend::Device,
        /// Comma-separated layer shapes: smol, 7b, 8b, 70b (default: smol on the CPU, 7b,8b,70b on CUDA).
        #[arg(long, value_delimiter = ',')]
        shapes: Vec<String>,
        /// Calibration tokens per call (default: 256 on the CPU, 2048 on CUDA).
        #[arg(long)]
        tokens: Option<usize>,
        /// Timed repeats per case (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ImportDtype {
    F32,
    F16,
    Bf16,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Model folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Calibration text file(s) or folder(s) (a folder's .txt files in name order).
    #[arg(long, num_args = 1..)]
    calib: Vec<PathBuf>,
    /// Output folder: an HF folder with report.json, its linears in --format.
    #[arg(long)]
    out: PathBuf,
    /// gptq_v2 (default): packed GPTQ checkpoint with the true zero points (loads in GPTQModel and
    /// transformers). gptq: zeros stored as zero − 1 (AutoGPTQ v1), which cannot store an asymmetric
    /// grid's zero point 0: needs --sym. fake: dequantized weights in the input dtype. compressed-tensors:
    /// compressed-tensors' pack-quantized (transformers with compressed-tensors, vLLM; --act-order only with
    /// --static-groups; on a mixture of experts no --avg-bits: transformers decodes its fused experts at one
    /// width).
    /// gguf: one llama.cpp file, --out/model.gguf (Llama architecture; 4-bit Q4_0 or 8-bit Q8_0, so
    /// symmetric 32-column groups, --act-order only with --static-groups), the GPTQ/BoA codes stored
    /// exactly. Scales are f16-rounded in every format (compressed-tensors stores them in the model's
    /// dtype). For vLLM 0.32: gptq with --sym at 4 or 8 bits (it refuses asymmetric GPTQ and reads qzeros
    /// as gptq's), or compressed-tensors; act-order only with --static-groups (README "vLLM").
    #[arg(long, value_enum, default_value_t = OutFormat::GptqV2)]
    format: OutFormat,
    /// With --format gguf (or fake: the same weights dequantized): each linear's GGUF block type, whose own
    /// grids the sweep searches (no re-rounding at export). One type for every linear: q4_0, q4_1, q5_0,
    /// q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k; or one of llama.cpp's K-quant presets: q2_k_mix (its
    /// "Q2_K"), q2_k_s, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m. A linear whose input width is
    /// not a whole number of the type's blocks falls back as llama.cpp's quantizer does (Q4_K → Q5_0, Q5_K →
    /// Q5_1, Q6_K → Q8_0, Q2_K/Q3_K → Q4_0). CPU only. Without it, --format gguf writes Q4_0/Q8_0 by --wbits.
    #[arg(long, value_parser = GgufType::parse, conflicts_with_all = ["wbits", "avg_bits", "group_size"])]
    gguf_type: Option<GgufType>,
    /// Let a symmetric grid's scale be negative, which mirrors its levels (−8..7 at 4 bits becomes −7..8), so
    /// the extra level falls on the side each group's weights need; the search tries both and keeps the
    /// lower error. GGUF stores the scale signed (llama.cpp's own Q4_0 does the same), so this is on by
    /// default with --format gguf (Q4_0, Q5_0, Q8_0) and with --format fake --gguf-type; --signed-scales
    /// turns it on for any --format fake (the twin of a GGUF run), --no-signed-scales turns it off. CPU
    /// only: a GPU run keeps positive scales. Not for the GPTQ formats or compressed-tensors, whose
    /// loaders are not known to take a negative scale.
    #[arg(long, conflicts_with = "no_signed_scales")]
    signed_scales: bool,
    /// Positive scales only, also with --format gguf (see --signed-scales).
    #[arg(long)]
    no_signed_scales: bool,
    /// boa: BoA on q/k/v, GPTQ on o and the MLP. gptq: GPTQ everywhere. rtn: round-to-nearest.
    #[arg(long, value_enum, default_value_t = Method::Boa)]
    method: Method,
    /// Bits per weight: 2, 3, 4 or 8.
    #[arg(long, default_value_t = 4)]
    wbits: u32,
    /// Bit allocation: an average bit width (e.g. 2.5) instead of --wbits. The quantized linears get the
    /// widths of --bit-choices that minimise the predicted error (--alloc-proxy) with their weights
    /// averaging at most this, over the whole model or each block (--alloc-scope), per linear or per fused
    /// set (--alloc-unit). report.json gives each linear's width and predicted errors; the checkpoint states
    /// the widths in its format's own config (GPTQ's `dynamic`, compressed-tensors' config groups, GGUF's
    /// tensor types).
    #[arg(long, conflicts_with = "wbits")]
    avg_bits: Option<f64>,
    /// The widths --avg-bits chooses from.
    #[arg(long, value_delimiter = ',', default_values_t = [2u32, 3, 4], requires = "avg_bits")]
    bit_choices: Vec<u32>,
    /// How --avg-bits predicts a linear's error at a width. output (the default): the linear alone
    /// quantized by GPTQ (min-max scales) at that width, measured on the block's output over 8 calibration
    /// sequences, so every linear counts in the same units (lower perplexity; each block costs |bit-choices|
    /// GPTQ runs per linear more). rtn: min-max RTN's tr(ΔW H ΔWᵀ) on the linear's input covariance (fast).
    #[arg(long, value_enum, requires = "avg_bits")]
    alloc_proxy: Option<AllocProxy>,
    /// Over which weights --avg-bits holds. model (the default with the output proxy): one budget for all
    /// quantized linears, measured on the FP model before any block is quantized, so blocks whose errors
    /// fall fast with bits take them from the others. block (the default with --alloc-proxy rtn): each
    /// block's linears on their own.
    #[arg(long, value_enum, requires = "avg_bits")]
    alloc_scope: Option<AllocScope>,
    /// What gets one width under --avg-bits. linear (the default): each linear its own (the lowest
    /// perplexity; the checkpoint loads in GPTQModel, transformers and llama.cpp, but not in vLLM, which
    /// runs q/k/v and gate/up as fused layers of one width). fused: the linears that read one input (q/k/v,
    /// gate/up) share one width, measured together by the output proxy, so vLLM can load the checkpoint.
    /// A mixture-of-experts block's routed experts share widths either way: one per part (gate, up, down)
    /// under linear, one for all under fused.
    #[arg(long, value_enum, requires = "avg_bits")]
    alloc_unit: Option<AllocUnit>,
    /// Input columns per scale/zero group (a multiple of 16), -1 for one scale per output channel, or auto:
    /// the largest of 128, 64, 32 dividing every quantized linear's input width (the layout GPTQModel's
    /// and transformers' kernels load), else per-channel.
    #[arg(long, default_value = "auto", allow_negative_numbers = true, value_parser = GroupSize::parse)]
    group_size: GroupSize,
    /// Symmetric quantization (zero at the middle of the grid); implied by --format gguf.
    #[arg(long)]
    sym: bool,
    /// Quantize columns in descending diag(H) order (records g_idx). With BoA and groups, v_proj keeps its
    /// natural order: its heads would each want their own, and a checkpoint has one g_idx per matrix. With
    /// --static-groups (or per-channel) the groups stay contiguous columns: g_idx is the plain one and
    /// desc_act false, which vLLM, compressed-tensors and GGUF need.
    #[arg(long)]
    act_order: bool,
    /// BoA: quantize the rows of each head in descending diag(H_row) order.
    #[arg(long)]
    act_order_row: bool,
    /// Group scales computed before the sweep from the original weights (default: searched as the sweep
    /// reaches each group; static groups serve act-order checkpoints).
    #[arg(long)]
    static_groups: bool,
    /// Scale/zero search: hessian (default for gptq/boa), mse, or minmax (default for rtn).
    #[arg(long, value_enum)]
    scale_search: Option<ScaleSearchArg>,
    /// After each GPTQ sweep (every linear under --method gptq; o/gate/up/down under boa), refit each row's
    /// group scales by least squares to the codes the sweep chose, on the full input covariance (codes and
    /// zero points kept; a row whose error would not fall keeps its scales). CPU only; not with --gguf-type.
    #[arg(long)]
    refit_scales: bool,
    /// Asymmetric calibration (GPTAQ): fit each linear to the FP model's output on the FP model's input, not
    /// to its own output on the partly quantized model's input, so each block also undoes part of the error
    /// the blocks before it left. The value α (0 < α ≤ 1; 0.25 without one, GPTAQ's) scales the correction of
    /// the target, W + α·W·D·(H + μI)⁻¹ with D = Σ(a − ã)ãᵀ (quant/asym.rs): α = 1 overfits the calibration
    /// set. Costs one more forward of each block on the FP activations and keeps them (twice the calibration
    /// activations' memory, on the GPU where they fit). Dense models only (on a mixture of experts it is
    /// refused); BoA's V gets the target of its own output before attention (the input's plain H and D)
    #[arg(long, value_name = "ALPHA", num_args = 0..=1, default_missing_value = "0.25")]
    asym_calib: Option<f64>,
    /// BoA's row Hessian for V: identity (the reference code's; lower perplexity in 5 of 8 comparisons of the
    /// README's 128 × 512 table, and the only one with BoA < GPTQ at 2 bits) or wout (the paper's Table 1).
    #[arg(long, value_enum, default_value_t = VRowHessian::Identity)]
    v_row_hessian: VRowHessian,
    /// BoA's row Hessians of W_Q and W_K where the model has a per-head q/k norm (Qwen3, Gemma 3): diag
    /// (the norm's weight and mean scale only) or exact (each token's norm Jacobian, which removes the part of
    /// an error along q that the norm undoes; a second pass over each block's input for the pre-norm q and k,
    /// computed on the host even on a GPU). No effect on models without a q/k norm.
    #[arg(long, value_enum, default_value_t = QkNormHessian::Diag)]
    qk_norm_hessian: QkNormHessian,
    /// --method boa: the attention projections BoA quantizes, comma-separated (default q,k,v); the others of
    /// q/k/v go through GPTQ on their input's XᵀX, like o and the MLP. To find which projection BoA helps or
    /// hurts on a model.
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1..)]
    boa_on: Option<Vec<Projection>>,
    /// Mixture-of-experts models: an expert's H_col counts each token routed to it once (tokens) or weighs
    /// it by its router probability squared (router).
    #[arg(long, value_enum, default_value_t = MoeHessian::Tokens)]
    moe_hessian: MoeHessian,
    /// Mixture-of-experts models: an expert routed fewer calibration tokens than this falls back to GPTQ on
    /// every token's MLP-input statistic for gate/up and RTN for down_proj (report.json lists each expert's
    /// tokens).
    #[arg(long, default_value_t = 64)]
    moe_min_tokens: usize,
    /// Calibration windows.
    #[arg(long, default_value_t = 128)]
    nsamples: usize,
    /// Tokens per calibration window (default 2048 on CUDA, 512 on the CPU).
    #[arg(long)]
    seqlen: Option<usize>,
    /// Seed of the calibration window offsets.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Hessian damping λ: H += λ·mean(diag H)·I (repeated when the Cholesky fails).
    #[arg(long, default_value_t = 0.01)]
    damp: f64,
    /// Fold the norms and fuse orthogonal rotations into the weights before calibrating (as `boa-cuda
    /// rotate`; the output is a checkpoint of the rotated model, same architecture, no online transform):
    /// hadamard (the default when the flag has no value) or random.
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "hadamard")]
    rotate: Option<RotationKind>,
    /// Seed of the rotation (default 0).
    #[arg(long, requires = "rotate")]
    rotate_seed: Option<u64>,
    /// With --rotate, also QuaRot's R4: an online Hadamard transform of down_proj's input, its inverse
    /// folded into down_proj. The checkpoint then needs boa-cuda's forward: config.json's model_type
    /// becomes boa_cuda_online_hadamard (other loaders refuse it) and --format gguf is refused.
    #[arg(long, requires = "rotate")]
    rotate_online: bool,
    /// R4's block order (see `rotate --online-block`).
    #[arg(long, requires = "rotate_online")]
    rotate_online_block: Option<usize>,
    /// Blocks to quantize, e.g. 0-3,8,10-12 (default: all); the others are copied through unchanged.
    #[arg(long)]
    layers: Option<String>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Operand precision of the forward's GEMMs on a GPU: bf16 on the tensor cores with f32 accumulation, or
    /// f32 (SGEMM, the CPU's numbers to rounding, ~10× slower). The statistics' XᵀX is bf16 either way; the
    /// CPU always computes in f32.
    #[arg(long, value_enum, default_value_t = GemmPrecision::Bf16)]
    gemm: GemmPrecision,
    /// Plan within at most this many GiB of GPU memory instead of all that is free (to leave room for
    /// another process). When the calibration activations do not fit, they stay in pinned host memory and
    /// visit the GPU chunk by chunk: slower, same result.
    #[arg(long, value_name = "GIB", allow_negative_numbers = true)]
    gpu_mem: Option<f64>,
    /// Hold at most N of an MoE block's experts (weights and statistics) in memory at once; the block is then
    /// quantized in passes over its calibration inputs, one per group, with the same result. Default: as many
    /// as the memory plan fits on the GPU (all of them on the CPU).
    #[arg(long, value_name = "N")]
    expert_group: Option<usize>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// Continue an interrupted run of the same --out (its `.NAME.partial` folder) from its last saved
    /// block; refused when the model, calibration data or options differ. Without it, a partial folder is
    /// replaced. The state (with the calibration activations) is saved after a block whenever at least ten
    /// times the last save's duration has passed since it, so saving costs at most ~10% of the run.
    #[arg(long)]
    resume: bool,
    /// No progress output.
    #[arg(long)]
    quiet: bool,
    /// At the end, print the time of every phase (calibration data, forward, statistics, factorization,
    /// scale search, sweep, error report, write), its share of the run, and (on a GPU) the host↔device
    /// traffic per block. On a GPU each phase boundary waits for the device, so a phase's time holds its own
    /// device work: the phases lose their overlap, and the run takes a little longer.
    #[arg(long)]
    profile: bool,
}

fn main() -> ExitCode {
    boa_cuda::alloc::keep_freed_memory();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", boa_cuda::error::one_line(&e));
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Run(a) => {
            let progress = Progress::auto(a.quiet);
            let layers = a
                .layers
                .as_deref()
                .map(LayerSet::parse)
                .transpose()
                .map_err(|m| boa_cuda::input_err!("{m}"))?;
            let seqlen = a
                .seqlen
                .unwrap_or(if a.device == Device::Cuda { 2048 } else { 512 });
            let scale_search = a.scale_search.unwrap_or(if a.method == Method::Rtn {
                ScaleSearchArg::Minmax
            } else {
                ScaleSearchArg::Hessian
            });
            let opts = RunOptions {
                model: a.model,
                calib: a.calib,
                out: a.out,
                method: a.method,
                // With --avg-bits, the narrowest choice: the config's base width, and the worst case the
                // input checks size scales for.
                wbits: match (a.avg_bits, a.gguf_type) {
                    (Some(_), _) => a.bit_choices.iter().copied().min().unwrap_or(a.wbits),
                    // The narrowest type's width (the scale-range checks size for it).
                    (None, Some(t)) => t
                        .types()
                        .iter()
                        .filter_map(|&ty| boa_cuda::model::gguf::codec::codec(ty))
                        .map(|c| c.bits)
                        .min()
                        .unwrap_or(a.wbits),
                    (None, None) => a.wbits,
                },
                bits: a.avg_bits.map(|avg| BitAllocation {
                    avg,
                    choices: a.bit_choices.clone(),
                    proxy: a.alloc_proxy,
                    scope: a.alloc_scope.unwrap_or(match a.alloc_proxy {
                        Some(AllocProxy::Rtn) => AllocScope::Block,
                        _ => AllocScope::Model,
                    }),
                    unit: a.alloc_unit.unwrap_or(AllocUnit::Linear),
                }),
                group_size: a.group_size,
                // GGUF's Q4_0/Q8_0 have no zero point: the format implies --sym (a --gguf-type decides).
                sym: a.sym || (a.format == OutFormat::Gguf && a.gguf_type.is_none()),
                act_order: a.act_order,
                act_order_row: a.act_order_row,
                static_groups: a.static_groups,
                scale_search,
                v_row_hessian: a.v_row_hessian,
                qk_norm_hessian: a.qk_norm_hessian,
                boa_on: a.boa_on.clone(),
                moe_hessian: a.moe_hessian,
                moe_min_tokens: a.moe_min_tokens,
                nsamples: a.nsamples,
                seqlen,
                seed: a.seed,
                damp: a.damp,
                layers,
                device: a.device,
                gemm: a.gemm,
                gpu_mem: a.gpu_mem,
                expert_group: a.expert_group,
                force: a.force,
                resume: a.resume,
                format: a.format,
                gguf_type: a.gguf_type,
                signed_scales: !a.no_signed_scales
                    && (a.signed_scales
                        || a.format == OutFormat::Gguf
                        || (a.format == OutFormat::Fake && a.gguf_type.is_some())),
                refit_scales: a.refit_scales,
                asym_calib: a.asym_calib,
                profile: a.profile,
                rotate: a.rotate.map(|kind| RotateSpec {
                    kind,
                    seed: a.rotate_seed.unwrap_or(0),
                    online: a.rotate_online,
                    online_block: a.rotate_online_block,
                }),
            };
            let r = boa_cuda::pipeline::run(&opts, &progress)?;
            let (rtn, err) = r.mean_errors();
            let t = &r.seconds;
            let errors = if err.is_nan() {
                String::new()
            } else {
                format!(", mean relative output error {err:.4} vs {rtn:.4} for min-max RTN")
            };
            println!(
                "wrote {} ({} layers quantized{errors}) in {:.1} s (forward {:.1}, statistics {:.1}, \
                 quantize {:.1}, write {:.1}); peak memory {:.2} GiB",
                opts.out.display(),
                r.layers.len(),
                t.total,
                t.forward,
                t.statistics,
                t.quantize,
                t.write,
                r.peak_rss_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64
            );
            if a.profile {
                print!("{}", t.phase_table());
                print!("{}", r.traffic.table());
            }
        }
        Cmd::Rotate {
            model,
            out,
            kind,
            seed,
            online,
            online_block,
            force,
            quiet,
        } => {
            use boa_cuda::model::rotate;
            let progress = Progress::auto(quiet);
            let spec = RotateSpec {
                kind,
                seed,
                online,
                online_block,
            };
            rotate::check_foldable(&model, &spec)?;
            let src = Model::open(&model)?;
            let info = rotate::rotate_model(&src, &out, &spec, force, &progress)?;
            rotate::print_info(&info, &progress);
            let r4 = match &info.r4 {
                Some(m) => format!(", R4 {} of {} × {} online", m.count, m.size, m.size),
                None => String::new(),
            };
            println!(
                "wrote {} (norms folded, R1 {} × {}, {} R2 of {} × {}{r4}) in {:.1} s",
                out.display(),
                info.r1.size,
                info.r1.size,
                info.r2.count,
                info.r2.size,
                info.r2.size,
                info.seconds
            );
        }
        Cmd::BenchQuant {
            model,
            calib,
            nsamples,
            seqlen,
            wbits,
            sweep_shape,
        } => bench_quant(model, calib, nsamples, seqlen, wbits, &sweep_shape)?,
        Cmd::ImportGguf {
            file,
            out,
            dtype,
            force,
        } => {
            use boa_cuda::model::gguf::import::{OutDType, import_gguf_to};
            let dtype = match dtype {
                ImportDtype::F32 => OutDType::F32,
                ImportDtype::F16 => OutDType::F16,
                ImportDtype::Bf16 => OutDType::BF16,
            };
            let s = import_gguf_to(&file, &out, dtype, force)?;
            println!(
                "imported {} → {} ({} tensors, {} layers, vocabulary {}{})",
                file.display(),
                s.out_dir.display(),
                s.n_tensors,
                s.n_layers,
                s.vocab_size,
                if s.tie_word_embeddings {
                    ", tied embeddings"
                } else {
                    ""
                }
            );
        }
        Cmd::Eval {
            model,
            data,
            seqlen,
            max_windows,
            chunk,
            device,
            json,
        } => {
            let progress = Progress::auto(json);
            let (be, note) = select_backend(device)?;
            if let Some(n) = note {
                progress.line(&n);
            }
            let model = Model::open(&model)?;
            let r = perplexity(
                be.as_ref(),
                &model,
                &EvalOptions {
                    data,
                    seqlen,
                    max_windows,
                    chunk,
                },
                &progress,
            )?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "perplexity {:.4} over {} windows × {seqlen} tokens ({:.1} s, {:.0} tokens/s, {})",
                    r.perplexity,
                    r.windows,
                    r.seconds,
                    r.tokens_per_second,
                    be.name()
                );
            }
        }
        Cmd::Inspect { dir, json } => {
            let s = boa_cuda::model::packed::inspect(&dir)?;
            if json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("folder        {}", dir.display());
                println!("architecture  {}, {} layers", s.architecture, s.n_layers);
                match (s.bits, s.checkpoint_format) {
                    (Some(bits), Some(fmt)) => {
                        println!(
                            "quantized     {} of {} layers ({} packed linears): {}",
                            s.quantized_layers.len(),
                            s.n_layers,
                            s.packed_linears,
                            compact_ranges(&s.quantized_layers)
                        );
                        println!(
                            "format        {fmt}, {bits}-bit, group size {}, desc_act {}, sym {}, act-order g_idx {}",
                            s.group_size.unwrap_or(-1),
                            s.desc_act.unwrap_or(false),
                            s.sym.unwrap_or(false),
                            if s.act_order_g_idx { "yes" } else { "no" }
                        );
                    }
                    _ => println!("quantized     no packed layers (dense weights)"),
                }
                println!(
                    "size on disk  {:.1} MiB in {} files",
                    s.size_bytes as f64 / (1u64 << 20) as f64,
                    s.files
                );
            }
        }
        Cmd::SynthModel {
            out,
            d,
            d_ff,
            layers,
            heads,
            kv_heads,
            seed,
        } => {
            let spec = boa_cuda::model::synth::SynthSpec {
                arch: boa_cuda::model::synth::SynthArch::Llama,
                d,
                d_ff,
                n_layers: layers,
                n_heads: heads,
                n_kv_heads: kv_heads,
                vocab: 256,
                tie_word_embeddings: false,
                qkv_bias: false,
                seed,
            };
            boa_cuda::model::synth::write_model_new(&out, &spec)?;
            println!("wrote {}", out.display());
        }
        Cmd::Bench {
            device,
            shapes,
            tokens,
            reps,
        } => {
            use boa_cuda::bench::gpu;
            let (mut b, note) = gpu::open_backend(device)?;
            if let Some(note) = note {
                eprintln!("{note}");
            }
            let (default_shapes, default_tokens) = gpu::defaults(&b);
            let shapes = if shapes.is_empty() {
                default_shapes
            } else {
                shapes
                    .iter()
                    .map(|s| gpu::shape_by_name(s))
                    .collect::<anyhow::Result<_>>()?
            };
            // Rows are printed as they are measured (a run cut off by a timeout keeps them).
            gpu::bench_quant_ops(
                &mut b,
                &shapes,
                tokens.unwrap_or(default_tokens),
                reps,
                &mut std::io::stdout(),
            )?;
        }
        Cmd::BenchQgemm {
            repeats,
            warmup,
            json,
        } => {
            let rows = boa_cuda::bench::qgemm::bench_qgemm(
                &[(4096, 4096), (11008, 4096)],
                &[1, 4, 16],
                &[4, 3],
                128,
                warmup,
                repeats.max(1),
            );
            if json {
                for r in &rows {
                    println!("{}", serde_json::to_string(r)?);
                }
            } else {
                println!(
                    "{:>13} {:>3} {:>8} {:>10} {:>9} {:>8} {:>8} {:>10}",
                    "d_out×d_in",
                    "m",
                    "variant",
                    "median ms",
                    "MB",
                    "GB/s",
                    "vs f32",
                    "max rel err"
                );
                for r in &rows {
                    println!(
                        "{:>13} {:>3} {:>8} {:>10.3} {:>9.1} {:>8.1} {:>7.2}× {:>10.1e}",
                        format!("{}×{}", r.d_out, r.d_in),
                        r.m,
                        r.variant,
                        r.median_ms,
                        r.weight_bytes as f64 / 1e6,
                        r.gb_per_s,
                        r.speedup_vs_f32,
                        r.max_rel_err
                    );
                }
            }
        }
    }
    Ok(())
}

/// "0-3,8,10-12" from a sorted list.
fn compact_ranges(v: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

fn bench_quant(
    model: Option<PathBuf>,
    calib: Vec<PathBuf>,
    nsamples: usize,
    seqlen: usize,
    wbits: u32,
    shapes: &[String],
) -> anyhow::Result<()> {
    if let Some(model) = model {
        println!(
            "whole model: {} — {wbits}-bit per-channel, {nsamples} × {seqlen} calibration tokens",
            model.display()
        );
        println!(
            "{:<6}{:>9}{:>9}{:>11}{:>9}{:>9}{:>9}{:>9}",
            "method", "total", "forward", "statistics", "factor", "search", "sweep", "other"
        );
        let mut totals = Vec::new();
        for method in [Method::Gptq, Method::Boa] {
            let out = std::env::temp_dir().join(format!("boa-bench-quant-{}", std::process::id()));
            let opts = RunOptions {
                model: model.clone(),
                calib: calib.clone(),
                out: out.clone(),
                method,
                wbits,
                bits: None,
                group_size: GroupSize::PerChannel,
                sym: false,
                act_order: false,
                act_order_row: false,
                static_groups: false,
                scale_search: ScaleSearchArg::Hessian,
                v_row_hessian: VRowHessian::Identity,
                qk_norm_hessian: QkNormHessian::Diag,
                boa_on: None,
                moe_hessian: MoeHessian::Tokens,
                moe_min_tokens: 64,
                nsamples,
                seqlen,
                seed: 0,
                damp: 0.01,
                layers: None,
                device: Device::Cpu,
                gemm: GemmPrecision::F32,
                gpu_mem: None,
                expert_group: None,
                force: true,
                resume: false,
                format: OutFormat::Fake,
                gguf_type: None,
                signed_scales: false,
                refit_scales: false,
                asym_calib: None,
                profile: false,
                rotate: None,
            };
            let r = boa_cuda::pipeline::run(&opts, &Progress::Quiet);
            let _ = std::fs::remove_dir_all(&out);
            let t = r?.seconds;
            let other = t.total - t.forward - t.statistics - t.factor - t.search - t.sweep;
            println!(
                "{:<6}{:>9.1}{:>9.1}{:>11.1}{:>9.1}{:>9.1}{:>9.1}{:>9.1}",
                format!("{method:?}").to_lowercase(),
                t.total,
                t.forward,
                t.statistics,
                t.factor,
                t.search,
                t.sweep,
                other
            );
            totals.push(t.total);
        }
        println!(
            "BoA / GPTQ whole run: {:.2}× (target ≤ 2×)\n",
            totals[1] / totals[0]
        );
    }
    for shape in shapes {
        let dims: Vec<usize> = shape
            .split(',')
            .filter_map(|v| v.trim().parse().ok())
            .collect();
        if dims.len() != 3 || dims.contains(&0) {
            return Err(boa_cuda::input_err!(
                "--sweep-shape {shape:?}: expected heads,head_dim,input_width"
            ));
        }
        sweep_line(dims[0], dims[1], dims[2], wbits)?;
    }
    Ok(())
}

fn sweep_line(n_heads: usize, d_h: usize, d_in: usize, wbits: u32) -> anyhow::Result<()> {
    let b = boa_cuda::bench::quant::sweep_comparison(n_heads, d_h, d_in, wbits, 15)?;
    println!(
        "BoA sweep of one {}×{} projection ({} heads × {} rows, {wbits}-bit): 2-D blocked {:.1} ms (row by row {:.1} ms), \
         column at a time + GEMV per row (reference style) {:.1} ms: {:.1}× faster (target ≥ 10×); codes equal: {:.4}",
        b.n_heads * b.d_h,
        b.d_in,
        b.n_heads,
        b.d_h,
        b.fast_seconds * 1e3,
        b.rowwise_seconds * 1e3,
        b.reference_seconds * 1e3,
        b.reference_seconds / b.fast_seconds,
        b.codes_equal
    );
    Ok(())
}
