//! Host side of cuda/ops.cu (same section order: kernel handles, then launchers). Launchers are thin
//! (style.md rule 15): check preconditions, compute grid/block, push arguments in kernel-signature order,
//! open an NVTX range, launch.

use super::CudaError;
use super::abi::RmsNormParams;
use crate::nvtx::range;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file these kernels come from (cuda/ops.cu).
pub const MODULE: &str = "ops";

/// RMSNorm kernel variants (cuda/ops.cu header has the launch shapes and measurements). All instantiated
/// variants are listed here, with the reason they exist (style.md rule 17).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsNormVariant {
    /// v1: one thread per row, a direct port of `cpu::rms_norm_row`; the baseline when v2 drifts.
    Naive = 1,
    /// v2: one warp per row, float4 loads when d % 4 == 0; the default.
    WarpPerRow = 2,
}

impl RmsNormVariant {
    pub const ALL: [RmsNormVariant; 2] = [RmsNormVariant::Naive, RmsNormVariant::WarpPerRow];

    fn kernel_name(self) -> &'static str {
        match self {
            RmsNormVariant::Naive => "rms_norm_kernel_v1",
            RmsNormVariant::WarpPerRow => "rms_norm_kernel_v2",
        }
    }
}

/// v1: threads (= rows) per block. Must match kRmsNormV1Threads in cuda/ops.cu (its __launch_bounds__).
const RMS_NORM_V1_THREADS: u32 = 128;
/// v2: warps (= rows) per block. Must match kRmsNormV2Warps in cuda/ops.cu (its __launch_bounds__).
const RMS_NORM_V2_WARPS: u32 = 4;

/// Function handles of cuda/ops.cu, loaded once per context.
pub struct OpsKernels {
    rms_norm_v1: CudaFunction,
    rms_norm_v2: CudaFunction,
}

impl OpsKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |v: RmsNormVariant| {
            module
                .load_function(v.kernel_name())
                .map_err(|e| CudaError::MissingKernel {
                    module: MODULE,
                    kernel: v.kernel_name(),
                    source: e,
                })
        };
        Ok(OpsKernels {
            rms_norm_v1: get(RmsNormVariant::Naive)?,
            rms_norm_v2: get(RmsNormVariant::WarpPerRow)?,
        })
    }

    fn rms_norm(&self, v: RmsNormVariant) -> &CudaFunction {
        match v {
            RmsNormVariant::Naive => &self.rms_norm_v1,
            RmsNormVariant::WarpPerRow => &self.rms_norm_v2,
        }
    }
}

/// Y [rows × d] = X [rows × d] / sqrt(mean(X²) + eps) ⊙ w [d], row-major f32, on `stream` (asynchronous).
#[allow(clippy::too_many_arguments)]
pub fn launch_rms_norm(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    variant: RmsNormVariant,
    y: &mut CudaSlice<f32>,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let shape_err = |msg: &str| CudaError::Shape {
        op: "rms_norm",
        msg: format!(
            "{msg} (rows={rows}, d={d}, x.len={}, y.len={}, w.len={})",
            x.len(),
            y.len(),
            w.len()
        ),
    };
    if d == 0 {
        return Err(shape_err("d must be ≥ 1"));
    }
    let n = rows
        .checked_mul(d)
        .ok_or_else(|| shape_err("rows·d overflows"))?;
    if x.len() != n || y.len() != n || w.len() != d {
        return Err(shape_err("buffers do not match [rows × d] and [d]"));
    }
    let (Ok(rows32), Ok(d32)) = (u32::try_from(rows), u32::try_from(d)) else {
        return Err(shape_err("rows and d must fit in u32"));
    };
    if rows == 0 {
        return Ok(());
    }
    let (grid, block) = match variant {
        RmsNormVariant::Naive => (rows32.div_ceil(RMS_NORM_V1_THREADS), RMS_NORM_V1_THREADS),
        RmsNormVariant::WarpPerRow => (rows32.div_ceil(RMS_NORM_V2_WARPS), RMS_NORM_V2_WARPS * 32),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let p = RmsNormParams {
        rows: rows32,
        d: d32,
        eps,
    };
    let _r = range(c"rms_norm");
    let mut b = stream.launch_builder(k.rms_norm(variant));
    b.arg(y).arg(x).arg(w).arg(&p);
    // SAFETY: argument order and types match rms_norm_kernel_v{1,2}(float* y, const float* x, const float* w,
    // BoaRmsNormParams p); y and x hold rows·d f32 and w holds d f32 (checked above), and the grid covers
    // exactly ceil(rows/rows-per-block) blocks whose out-of-range threads return before touching memory.
    unsafe { b.launch(cfg) }.map_err(|e| CudaError::Driver {
        what: "launch rms_norm",
        source: e,
    })?;
    Ok(())
}
