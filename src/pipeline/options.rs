//! Options of `boa-cuda run`, validated before any long work starts.

use crate::backend::Device;
use crate::export::gguf_mix;
use crate::export::gptq_packed::OutFormat;
use std::path::PathBuf;

/// `--group-size`: how many input columns share one scale and zero point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupSize {
    /// The default: the largest of 128, 64 and 32 that divides every quantized linear's d_in, else one
    /// group per output channel. Groups of 32–256 that divide d_in are the layout every GPTQ loader's
    /// kernels take (GPTQModel's and transformers' 4-bit CPU kernels refuse any other; README "Loader
    /// matrix"). `pipeline::run` resolves it from the model before anything reads it.
    Auto,
    /// One scale per output channel (a group of d_in columns).
    PerChannel,
    Columns(usize),
}

impl GroupSize {
    /// "auto", "-1" (per-channel) or a positive column count (checked by `RunOptions::validate`).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "-1" => Ok(Self::PerChannel),
            t => match t.parse::<usize>() {
                Ok(g) if g > 0 => Ok(Self::Columns(g)),
                _ => Err(format!(
                    "--group-size {t} is not supported (use auto, -1 or a multiple of 16: 32, 64, 128, …)"
                )),
            },
        }
    }

    /// Auto made concrete for linears of these input widths; the others as they are.
    pub fn resolve(self, d_ins: impl IntoIterator<Item = usize> + Clone) -> Self {
        match self {
            Self::Auto => [128, 64, 32]
                .into_iter()
                .find(|&g| d_ins.clone().into_iter().all(|d| d % g == 0))
                .map_or(Self::PerChannel, Self::Columns),
            other => other,
        }
    }

    /// Columns per group, None for per-channel. An unresolved Auto reads as per-channel; `pipeline::run`
    /// resolves it first.
    pub fn columns(self) -> Option<usize> {
        match self {
            Self::Columns(g) => Some(g),
            Self::Auto | Self::PerChannel => None,
        }
    }
}

/// report.json as before the default became auto: the column count, null for per-channel.
impl serde::Serialize for GroupSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Columns(g) => s.serialize_u64(*g as u64),
            Self::PerChannel => s.serialize_none(),
            Self::Auto => s.serialize_str("auto"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Round-to-nearest (no calibration data used for the weights themselves).
    Rtn,
    /// GPTQ on every linear layer.
    Gptq,
    /// BoA on q/k/v (attention-aware Hessians, head-wise simultaneous sweep), GPTQ on o and the MLP.
    Boa,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VRowHessian {
    /// H_row = I for V (the reference code's choice).
    Identity,
    /// H_row,h = W_out,hᵀ W_out,h (the paper's Table 1).
    Wout,
}

/// BoA's row Hessians of W_Q and W_K behind a per-head q/k norm (Qwen3, Gemma 3; docs/architectures.md,
/// "BoA behind a q/k norm").
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum QkNormHessian {
    /// diag(g) M diag(g): the norm's Jacobian without its projection off q (one pass, no extra work).
    #[default]
    Diag,
    /// E[Jᵀ diag(g) M diag(g) J] with each token's Jacobian J: a second pass over the block's input for the
    /// pre-norm q and k (on the host on a GPU).
    Exact,
}

impl QkNormHessian {
    pub fn is_diag(&self) -> bool {
        *self == QkNormHessian::Diag
    }
}

/// An attention projection BoA can take (`--boa-on`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Projection {
    Q,
    K,
    V,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeHessian {
    /// Every token routed to an expert counts once in its H_col.
    Tokens,
    /// Each routed token weighted by its router probability squared (how its error reaches the output).
    Router,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleSearchArg {
    /// Shrink the range over 100 steps, keep the smallest Hessian-weighted error (default).
    Hessian,
    /// Shrink the range over 100 steps, keep the smallest Σ|Δ|^2.4 (no data). Measured on the demo model
    /// (README, "The scale search after the rotation"): lower perplexity than hessian on a rotated model,
    /// much higher on the unrotated one.
    Mse,
    /// The full min/max range, no search.
    Minmax,
}

/// The layers to quantize, from "0-3,8,10-12": sorted, merged inclusive ranges. Never expanded before
/// `check` has bounded them by the model's layer count (`0-18446744073709551615` once took 22.5 GB).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSet(Vec<(usize, usize)>);

impl LayerSet {
    pub fn parse(s: &str) -> Result<LayerSet, String> {
        let mut ranges = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad =
                || format!("invalid layer range {part:?} in --layers (expected e.g. 0-3,8,10-12)");
            let (a, b): (usize, usize) = match part.split_once('-') {
                Some((a, b)) => (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                ),
                None => {
                    let l = part.parse().map_err(|_| bad())?;
                    (l, l)
                }
            };
            if a > b {
                return Err(bad());
            }
            ranges.push((a, b));
        }
        if ranges.is_empty() {
            return Err("--layers names no layer".into());
        }
        ranges.sort_unstable();
        let mut merged: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        Ok(LayerSet(merged))
    }

    pub fn all(n: usize) -> LayerSet {
        LayerSet(vec![(0, n.saturating_sub(1))])
    }

    pub fn contains(&self, l: usize) -> bool {
        self.0.iter().any(|&(a, b)| (a..=b).contains(&l))
    }

    /// The highest layer named.
    pub fn last(&self) -> usize {
        self.0.last().map_or(0, |r| r.1)
    }

    /// Errors when a layer is outside a model of `n_layers`.
    pub fn check(&self, n_layers: usize) -> Result<(), String> {
        match self.0.iter().find(|r| r.1 >= n_layers) {
            Some(&(a, b)) => Err(format!(
                "--layers names layer {}{}, but the model has layers 0-{}",
                a.max(n_layers),
                if a == b {
                    String::new()
                } else {
                    format!(" (in {a}-{b})")
                },
                n_layers.saturating_sub(1)
            )),
            None => Ok(()),
        }
    }

    /// The layers, in order (bounded once `check` has passed).
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.0.iter().flat_map(|&(a, b)| a..=b)
    }
}

/// As the list of layers (what report.json and the resume fingerprint have always held).
impl serde::Serialize for LayerSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Only checked sets are serialized; an unchecked absurd range must not be expanded here either.
        let n: u128 = self.0.iter().map(|&(a, b)| (b - a) as u128 + 1).sum();
        if n > 1 << 24 {
            return Err(serde::ser::Error::custom(
                "--layers names more layers than any model has",
            ));
        }
        s.collect_seq(self.iter())
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RunOptions {
    pub model: PathBuf,
    pub calib: Vec<PathBuf>,
    pub out: PathBuf,
    pub method: Method,
    /// Bits per weight; with `bits`, the narrowest of its choices.
    pub wbits: u32,
    /// Per-linear bit widths chosen from the statistics (None: every linear at `wbits`). Absent from the
    /// fingerprint when off, so fingerprints of uniform runs are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bits: Option<BitAllocation>,
    pub group_size: GroupSize,
    pub sym: bool,
    pub act_order: bool,
    pub act_order_row: bool,
    pub static_groups: bool,
    pub scale_search: ScaleSearchArg,
    pub v_row_hessian: VRowHessian,
    /// `--qk-norm-hessian`; absent from the fingerprint at its default, so other runs' are unchanged.
    #[serde(default, skip_serializing_if = "QkNormHessian::is_diag")]
    pub qk_norm_hessian: QkNormHessian,
    /// `--boa-on`: the attention projections BoA quantizes (the others of q/k/v go through GPTQ on their
    /// input's XᵀX); None: all three. Absent from the fingerprint when None, so other runs' are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boa_on: Option<Vec<Projection>>,
    /// Mixture-of-experts models: how an expert's H_col weighs its routed tokens, and how few routed
    /// calibration tokens make an expert fall back (gate/up on every token's statistic, down_proj RTN).
    pub moe_hessian: MoeHessian,
    pub moe_min_tokens: usize,
    pub nsamples: usize,
    pub seqlen: usize,
    pub seed: u64,
    pub damp: f64,
    /// None: every layer.
    pub layers: Option<LayerSet>,
    pub device: Device,
    /// Operand precision of the forward's GEMMs on a GPU.
    #[serde(default)]
    pub gemm: crate::backend::GemmPrecision,
    /// GiB of GPU memory the plan may use at most (None: all that is free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mem: Option<f64>,
    /// Hold at most this many of an MoE block's experts on the device at once (None: as many as the memory
    /// plan fits); more passes over the calibration inputs, the same result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_group: Option<usize>,
    /// Replace --out if it exists.
    pub force: bool,
    /// Continue the partial run of the same --out from its last finished block. Not in report.json: a
    /// resumed run's report equals an uninterrupted one's (timings aside).
    #[serde(skip_serializing)]
    pub resume: bool,
    /// What the linears are written as (fake-quant or packed GPTQ).
    pub format: OutFormat,
    /// `--gguf-type`: each linear's GGUF block type, whose codec states its grids (export/gguf_mix.rs); with
    /// `--format gguf` or `fake` (the same weights, dequantized). Absent from the fingerprint when off, so
    /// fingerprints of other runs are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gguf_type: Option<crate::export::gguf_mix::GgufType>,
    /// Symmetric grids' scales free in sign (`QuantSpec::signed`): on for GGUF, whose blocks store d signed.
    /// Absent from the fingerprint when off, so fingerprints of other runs are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub signed_scales: bool,
    /// Refit each GPTQ-swept row's scales by least squares to its codes (quant/refit.rs). Absent from the
    /// fingerprint when off, so fingerprints of other runs are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refit_scales: bool,
    /// `--asym-calib α`: each linear's target moves toward the FP model's output on the FP model's input
    /// (quant/asym.rs); None: off. Absent from the fingerprint when off, so fingerprints of other runs are
    /// unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asym_calib: Option<f64>,
    /// Rotate the model (norms folded, R1 and R2 fused into the weights) before calibration
    /// (model/rotate.rs). In the fingerprint, so a resumed run never mixes rotated and unrotated blocks;
    /// absent from it when off, so fingerprints of unrotated runs are unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotate: Option<crate::model::rotate::RotateSpec>,
    /// `--profile`: phase boundaries wait for the device (`quant::profile::set_fencing`), so each phase's time
    /// holds its own device work; the phases no longer overlap. Changes no result: not in the fingerprint.
    #[serde(skip)]
    pub profile: bool,
}

/// `--avg-bits`, `--bit-choices` and `--alloc-proxy`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct BitAllocation {
    pub avg: f64,
    /// Ascending, distinct, each in SUPPORTED_WBITS (checked by `validate`).
    pub choices: Vec<u32>,
    /// None: `AllocProxy::Output`.
    pub proxy: Option<AllocProxy>,
    pub scope: AllocScope,
    /// Absent from the fingerprint when `Linear`, so the fingerprints of runs made before the option are
    /// unchanged.
    #[serde(skip_serializing_if = "AllocUnit::is_linear")]
    pub unit: AllocUnit,
}

/// What gets one width under `--avg-bits` (`--alloc-unit`). Linear is the default: on the demo model, fused
/// sets cost 8–11% of perplexity at 2.5 bits and fall behind uniform 3-bit at 3.0 (README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocUnit {
    /// Each linear its own (a mixture-of-experts block's routed experts: one per part, gate/up/down).
    Linear,
    /// The linears that read one input (q/k/v; gate/up) share one width: vLLM runs each such set as one
    /// fused layer (qkv_proj, gate_up_proj), which takes one scheme for all its parts; a block's routed
    /// experts share one, as vLLM's fused MoE layer.
    Fused,
}

impl BitAllocation {
    /// The proxy in force: `--alloc-proxy`, or the output proxy when it is not given.
    pub fn proxy(&self) -> AllocProxy {
        self.proxy.unwrap_or(AllocProxy::Output)
    }
}

impl AllocUnit {
    fn is_linear(&self) -> bool {
        *self == AllocUnit::Linear
    }
}

/// Over which weights `--avg-bits` holds (`--alloc-scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocScope {
    /// Each block's linears average at most A bits on their own.
    Block,
    /// All quantized linears together (pipeline/model_allocation.rs): blocks trade bits. Output proxy only.
    Model,
}

/// How `--avg-bits` predicts each linear's error at each width (`--alloc-proxy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocProxy {
    /// Each linear alone quantized by GPTQ (min-max scales) at the width, and the block's output error
    /// ‖Y − Y_FP‖² on the first calibration sequences (pipeline/sensitivity.rs): every linear in the same units.
    Output,
    /// Min-max RTN's tr(ΔW H ΔWᵀ) on the linear's input covariance: fast, but in each linear's own output
    /// units.
    Rtn,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Rtn => "rtn",
            Method::Gptq => "gptq",
            Method::Boa => "boa",
        }
    }
}

pub const SUPPORTED_WBITS: [u32; 4] = [2, 3, 4, 8];

impl RunOptions {
    /// Whether BoA's Q/K row Hessians take the q/k norms' exact Jacobian (`--qk-norm-hessian exact`): asked
    /// for, and the block has such norms, and BoA quantizes q_proj or k_proj (else the second statistics
    /// pass it costs would feed nothing).
    pub fn exact_qk_norm(&self, cfg: &crate::model::Config) -> bool {
        use crate::model::arch::Role;
        self.qk_norm_hessian == QkNormHessian::Exact
            && cfg.block.qk_norm()
            && (self.boa_treats(Role::Q) || self.boa_treats(Role::K))
    }

    /// Whether BoA quantizes the linear of `role` (under --method boa: q/k/v as `--boa-on` lists them).
    pub fn boa_treats(&self, role: crate::model::arch::Role) -> bool {
        use crate::model::arch::Role;
        let p = match role {
            Role::Q => Projection::Q,
            Role::K => Projection::K,
            Role::V => Projection::V,
            _ => return false,
        };
        self.method == Method::Boa && self.boa_on.as_ref().is_none_or(|on| on.contains(&p))
    }

    /// Whether act-order may leave a group's columns scattered (g_idx a permutation of groups, desc_act).
    /// Static groups are cut in the natural column order before the sweep, so column c stays in group
    /// c / g whatever order the sweep takes, and per-channel scales have one group: either way g_idx is
    /// c / g, the layout of a checkpoint without act-order ("static activation ordering", which vLLM
    /// loads and desc_act=true does not). An unresolved `auto` counts as grouped.
    pub fn permuted_groups(&self) -> bool {
        self.act_order && !self.static_groups && self.group_size != GroupSize::PerChannel
    }

    /// Checks what can be checked without the model.
    pub fn validate(&self) -> Result<(), String> {
        // Under --gguf-type the types set each linear's width (5 and 6 bits too); wbits is the narrowest.
        if self.gguf_type.is_none() && !SUPPORTED_WBITS.contains(&self.wbits) {
            return Err(format!(
                "--wbits {} is not supported (supported: 2, 3, 4, 8)",
                self.wbits
            ));
        }
        if let Some(b) = &self.bits {
            let mut c = b.choices.clone();
            c.sort_unstable();
            c.dedup();
            if c != b.choices || c.is_empty() || c.iter().any(|w| !SUPPORTED_WBITS.contains(w)) {
                return Err(format!(
                    "--bit-choices {:?} must be distinct widths in ascending order, each 2, 3, 4 or 8",
                    b.choices
                ));
            }
            let (lo, hi) = (c[0] as f64, c[c.len() - 1] as f64);
            if !(b.avg.is_finite() && b.avg >= lo && b.avg <= hi) {
                return Err(format!(
                    "--avg-bits {} must lie between the narrowest and widest --bit-choices ({lo} and {hi})",
                    b.avg
                ));
            }
            if self.wbits != c[0] {
                return Err("--avg-bits sets the base width to the narrowest choice".into());
            }
            if b.scope == AllocScope::Model && b.proxy == Some(AllocProxy::Rtn) {
                return Err(
                    "--alloc-scope model compares blocks by the output proxy's errors: drop --alloc-proxy \
                     rtn, or pass --alloc-scope block"
                        .into(),
                );
            }
        }
        if let Some(g) = self.gpu_mem
            && !(g.is_finite() && g > 0.0)
        {
            return Err(format!("--gpu-mem {g} is not a positive number of GiB"));
        }
        if self.expert_group == Some(0) {
            return Err("--expert-group 0 holds no expert: give at least 1".into());
        }
        if let GroupSize::Columns(g) = self.group_size
            && (g < 16 || g % 16 != 0)
        {
            return Err(format!(
                "--group-size {g} is not supported (use auto, -1 or a multiple of 16: 32, 64, 128, …)"
            ));
        }
        if self.nsamples == 0 || self.seqlen < 2 {
            return Err("--nsamples must be at least 1 and --seqlen at least 2".into());
        }
        if !(self.damp > 0.0 && self.damp < 1.0) {
            return Err(format!("--damp {} must be in (0, 1)", self.damp));
        }
        if self.static_groups && self.group_size == GroupSize::PerChannel {
            return Err("--static-groups needs groups: pass --group-size N (per-channel scales have none; auto picks \
                 per-channel when no 128, 64 or 32 divides every input width)"
                .into());
        }
        if self.act_order && self.method == Method::Rtn {
            return Err(
                "--act-order orders the columns of GPTQ's and BoA's error feedback; --method rtn rounds \
                 every column on its own, so it would only mark the checkpoint desc_act: use --method gptq \
                 or boa, or drop --act-order"
                    .into(),
            );
        }
        if self.boa_on.is_some() && self.method != Method::Boa {
            return Err(format!(
                "--boa-on picks the projections BoA quantizes; --method {} uses none: use --method boa, \
                 or drop --boa-on",
                self.method.name()
            ));
        }
        if self.act_order_row && self.method != Method::Boa {
            return Err(format!(
                "--act-order-row orders the rows of BoA's head-wise sweep; --method {} has none: use \
                 --method boa, or drop --act-order-row",
                self.method.name()
            ));
        }
        if self.format == OutFormat::Gptq && !self.sym {
            return Err(
                "--format gptq (AutoGPTQ v1) stores zero − 1, so an asymmetric grid's zero point 0 cannot \
                 be stored (GPTQModel also refuses asymmetric v1 checkpoints): use --format gptq_v2 (the \
                 default) or --sym"
                    .into(),
            );
        }
        if self.format == OutFormat::CompressedTensors && self.permuted_groups() {
            return Err(
                "--act-order with groups and --format compressed-tensors needs --static-groups: \
                 compressed-tensors' pack-quantized layout has no g_idx, so its groups are contiguous \
                 columns, while act-order's dynamic groups follow the sweep's order: add --static-groups, \
                 drop --act-order, or use --format gptq_v2"
                    .into(),
            );
        }
        if let Some(a) = self.asym_calib {
            let why = if !(a > 0.0 && a <= 1.0) {
                Some(format!("α {a} must be in (0, 1] (GPTAQ's is 0.25)"))
            } else if self.method == Method::Rtn {
                Some(
                    "it moves the target of GPTQ's and BoA's sweeps: use --method gptq or boa"
                        .into(),
                )
            } else {
                None
            };
            if let Some(why) = why {
                return Err(format!("--asym-calib: {why}"));
            }
        }
        if self.refit_scales {
            let why = if self.method == Method::Rtn {
                Some(
                    "it refits the scales a GPTQ sweep chose: use --method gptq or boa".to_string(),
                )
            } else if let Some(t) = self.gguf_type {
                Some(format!(
                    "--gguf-type {} constrains each block's scales to what its type stores: drop one",
                    t.name()
                ))
            } else if self.device == Device::Cuda {
                Some("it runs on the CPU only: pass --device cpu".into())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(format!("--refit-scales: {why}"));
            }
        }
        if let Some(t) = self.gguf_type {
            self.check_gguf_type(t)?;
        } else if self.format == OutFormat::Gguf {
            self.check_gguf()?;
        }
        if self.signed_scales && !matches!(self.format, OutFormat::Gguf | OutFormat::Fake) {
            return Err(format!(
                "--signed-scales: --format {} is not known to load a negative scale; it is for --format gguf \
                 (on by default there) and fake",
                self.format.name()
            ));
        }
        if self.signed_scales && self.gguf_type.is_none() && !self.sym {
            return Err("--signed-scales mirrors symmetric grids: pass --sym".into());
        }
        if self.calib.is_empty() && self.needs_calibration() {
            return Err(format!(
                "--calib is required for --method {}{}",
                self.method.name(),
                if self.bits.is_some() {
                    " with --avg-bits (it allocates from the calibration statistics)"
                } else if self.method == Method::Rtn {
                    " with --scale-search hessian"
                } else {
                    ""
                }
            ));
        }
        Ok(())
    }

    /// What `--format gguf` can store exactly (export/gguf_model.rs): Q4_0 and Q8_0 blocks, i.e. 4 or 8
    /// bits, symmetric, groups of 32 contiguous columns.
    fn check_gguf(&self) -> Result<(), String> {
        use crate::export::gguf_model::{BLOCK, block_type};
        let widths = match &self.bits {
            Some(b) => b.choices.clone(),
            None => vec![self.wbits],
        };
        if let Some(w) = widths.iter().find(|&&w| block_type(w).is_none()) {
            return Err(format!(
                "--format gguf writes 4-bit (Q4_0) and 8-bit (Q8_0) linears by --wbits; for {w}-bit pass \
                 --gguf-type (GGUF's K-quants: q2_k, q3_k, q4_k, q5_k, q6_k, or llama.cpp's presets such as \
                 q4_k_m) instead of --wbits, use --wbits 4 or 8 (--bit-choices 4,8), or --format gptq_v2"
            ));
        }
        match self.group_size {
            GroupSize::Auto => {}
            GroupSize::Columns(g) if g == BLOCK => {}
            other => {
                return Err(format!(
                    "--format gguf stores groups of {BLOCK} columns (Q4_0/Q8_0 blocks), not {}: pass \
                     --group-size {BLOCK} or leave it at auto",
                    other
                        .columns()
                        .map_or("per-channel".into(), |g| g.to_string())
                ));
            }
        }
        if !self.sym {
            return Err(
                "--format gguf stores symmetric grids only (Q4_0 and Q8_0 have no zero point): pass --sym"
                    .into(),
            );
        }
        if self.permuted_groups() {
            return Err(
                "--act-order with --format gguf needs --static-groups: GGUF's blocks are contiguous \
                 columns with no g_idx, while act-order's dynamic groups follow the sweep's order: add \
                 --static-groups or drop --act-order"
                    .into(),
            );
        }
        Ok(())
    }

    /// What `--gguf-type` takes: the types decide widths, groups and symmetry, and their grids are searched
    /// as the sweep goes (GPTQ/BoA) in contiguous blocks.
    fn check_gguf_type(&self, t: gguf_mix::GgufType) -> Result<(), String> {
        let name = t.name();
        if !matches!(self.format, OutFormat::Gguf | OutFormat::Fake) {
            return Err(format!(
                "--gguf-type {name} needs --format gguf (or fake, for the same weights dequantized), not \
                 --format {}",
                self.format.name()
            ));
        }
        if self.bits.is_some() {
            return Err(format!(
                "--gguf-type {name} sets every linear's width: drop --avg-bits"
            ));
        }
        if !matches!(
            self.group_size,
            GroupSize::Auto | GroupSize::Columns(crate::export::gguf_model::BLOCK)
        ) {
            return Err(format!(
                "--gguf-type {name} sets the groups (its blocks): leave --group-size at auto"
            ));
        }
        if self.sym {
            return Err(format!(
                "--gguf-type {name} sets the symmetry of each type's grid: drop --sym"
            ));
        }
        if self.act_order {
            return Err(format!(
                "--act-order with --gguf-type {name} is not supported: GGUF's blocks are contiguous \
                 columns with no g_idx: drop --act-order"
            ));
        }
        if self.device == Device::Cuda && t.types().into_iter().any(gguf_mix::via_codec) {
            return Err(format!(
                "--gguf-type {name}: its grids (GGUF lattices, quant/lattice.rs) are searched on the CPU \
                 only: pass --device cpu"
            ));
        }
        if self.static_groups && self.method != Method::Rtn {
            return Err(format!(
                "--static-groups with --gguf-type {name}: a K-quant super-block's scale is searched when \
                 the sweep reaches it (dynamic groups): drop --static-groups"
            ));
        }
        Ok(())
    }

    /// Whether the run reads calibration text: RTN with min-max or MSE scales never looks at activations.
    pub fn needs_calibration(&self) -> bool {
        self.method != Method::Rtn
            || self.scale_search == ScaleSearchArg::Hessian
            || self.bits.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::GroupSize;

    #[test]
    fn auto_group_is_the_largest_of_128_64_32_dividing_every_width() {
        // Llama-7B, SmolLM2 (576 = 9·64), a width only 32 divides, and one none does.
        assert_eq!(
            GroupSize::Auto.resolve([4096, 11008]),
            GroupSize::Columns(128)
        );
        assert_eq!(GroupSize::Auto.resolve([576, 1536]), GroupSize::Columns(64));
        assert_eq!(GroupSize::Auto.resolve([576, 96]), GroupSize::Columns(32));
        assert_eq!(GroupSize::Auto.resolve([576, 40]), GroupSize::PerChannel);
        // Explicit choices are kept, fitting or not (validate and before_work judge them).
        assert_eq!(GroupSize::PerChannel.resolve([4096]), GroupSize::PerChannel);
        assert_eq!(
            GroupSize::Columns(48).resolve([4096]),
            GroupSize::Columns(48)
        );
    }

    #[test]
    fn group_size_parses_auto_minus_one_and_counts() {
        assert_eq!(GroupSize::parse("auto"), Ok(GroupSize::Auto));
        assert_eq!(GroupSize::parse("-1"), Ok(GroupSize::PerChannel));
        assert_eq!(GroupSize::parse("64"), Ok(GroupSize::Columns(64)));
        for bad in ["0", "-2", "x", ""] {
            assert!(GroupSize::parse(bad).is_err(), "{bad}");
        }
    }
}
