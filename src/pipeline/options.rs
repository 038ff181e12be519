//! Options of `boa-cuda run`, validated before any long work starts.

use crate::backend::Device;
use std::collections::BTreeSet;
use std::path::PathBuf;

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

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleSearchArg {
    /// Shrink the range over 100 steps, keep the smallest Hessian-weighted error (default).
    Hessian,
    /// Shrink the range over 100 steps, keep the smallest Σ|Δ|^2.4.
    Mse,
    /// The full min/max range, no search.
    Minmax,
}

/// The layers to quantize, from "0-3,8,10-12".
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayerSet(pub BTreeSet<usize>);

impl LayerSet {
    pub fn parse(s: &str) -> Result<LayerSet, String> {
        let mut set = BTreeSet::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad =
                || format!("invalid layer range {part:?} in --layers (expected e.g. 0-3,8,10-12)");
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (usize, usize) = (
                        a.trim().parse().map_err(|_| bad())?,
                        b.trim().parse().map_err(|_| bad())?,
                    );
                    if a > b {
                        return Err(bad());
                    }
                    set.extend(a..=b);
                }
                None => {
                    set.insert(part.parse().map_err(|_| bad())?);
                }
            }
        }
        if set.is_empty() {
            return Err("--layers names no layer".into());
        }
        Ok(LayerSet(set))
    }

    pub fn all(n: usize) -> LayerSet {
        LayerSet((0..n).collect())
    }

    pub fn contains(&self, l: usize) -> bool {
        self.0.contains(&l)
    }

    /// Errors when a layer is outside a model of `n_layers`.
    pub fn check(&self, n_layers: usize) -> Result<(), String> {
        match self.0.iter().find(|&&l| l >= n_layers) {
            Some(l) => Err(format!(
                "--layers names layer {l}, but the model has layers 0-{}",
                n_layers - 1
            )),
            None => Ok(()),
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RunOptions {
    pub model: PathBuf,
    pub calib: Vec<PathBuf>,
    pub out: PathBuf,
    pub method: Method,
    pub wbits: u32,
    /// None: one scale per output channel.
    pub group_size: Option<usize>,
    pub sym: bool,
    pub act_order: bool,
    pub act_order_row: bool,
    pub static_groups: bool,
    pub scale_search: ScaleSearchArg,
    pub v_row_hessian: VRowHessian,
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
    /// Replace --out if it exists.
    pub force: bool,
    /// Continue the partial run of the same --out from its last finished block. Not in report.json: a
    /// resumed run's report equals an uninterrupted one's (timings aside).
    #[serde(skip_serializing)]
    pub resume: bool,
    /// What the linears are written as (fake-quant or packed GPTQ).
    pub format: crate::export::gptq_packed::OutFormat,
}

pub const SUPPORTED_WBITS: [u32; 4] = [2, 3, 4, 8];

impl RunOptions {
    /// Checks what can be checked without the model.
    pub fn validate(&self) -> Result<(), String> {
        if !SUPPORTED_WBITS.contains(&self.wbits) {
            return Err(format!(
                "--wbits {} is not supported (supported: 2, 3, 4, 8)",
                self.wbits
            ));
        }
        if let Some(g) = self.gpu_mem
            && !(g.is_finite() && g > 0.0)
        {
            return Err(format!("--gpu-mem {g} is not a positive number of GiB"));
        }
        if let Some(g) = self.group_size
            && (g < 16 || g % 16 != 0)
        {
            return Err(format!(
                "--group-size {g} is not supported (use -1 or a multiple of 16: 32, 64, 128, …)"
            ));
        }
        if self.nsamples == 0 || self.seqlen < 2 {
            return Err("--nsamples must be at least 1 and --seqlen at least 2".into());
        }
        if !(self.damp > 0.0 && self.damp < 1.0) {
            return Err(format!("--damp {} must be in (0, 1)", self.damp));
        }
        if self.static_groups && self.group_size.is_none() {
            return Err("--static-groups needs --group-size".into());
        }
        Ok(())
    }
}
