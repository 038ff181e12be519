//! Picks the backend for `--device`: `auto` takes CUDA when a driver, a device and embedded kernels are all
//! present and says why not otherwise; `cuda` fails with that reason; `cpu` never touches CUDA.

use super::Backend;
use super::cpu::CpuBackend;
use super::cuda;
use crate::error::BoaError;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    /// CUDA if available, otherwise the CPU (with a note saying why).
    Auto,
    Cpu,
    Cuda,
}

/// Operand precision of the forward's GEMMs on a GPU (the CPU always computes in f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GemmPrecision {
    /// bf16 operands on the tensor cores, f32 accumulation and output.
    #[default]
    Bf16,
    /// f32 operands (SGEMM): the CPU's results to rounding, an order of magnitude slower.
    F32,
}

/// Returns the backend and, for `auto` falling back to the CPU, the reason. GEMMs in f32.
pub fn select_backend(device: Device) -> anyhow::Result<(Arc<dyn Backend>, Option<String>)> {
    select_backend_with(device, GemmPrecision::F32)
}

/// `select_backend` with the forward's GEMMs in `gemm` on a GPU.
pub fn select_backend_with(
    device: Device,
    gemm: GemmPrecision,
) -> anyhow::Result<(Arc<dyn Backend>, Option<String>)> {
    let open = || {
        cuda::CudaBackend::new(0).map(|mut b| {
            b.set_linear_variant(match gemm {
                GemmPrecision::Bf16 => cuda::LinearVariant::Bf16,
                GemmPrecision::F32 => cuda::LinearVariant::F32,
            });
            b
        })
    };
    match device {
        Device::Cpu => Ok((Arc::new(CpuBackend), None)),
        Device::Cuda => match open() {
            Ok(b) => Ok((Arc::new(b), None)),
            Err(why) => Err(anyhow::Error::new(BoaError::NoCuda(why))),
        },
        Device::Auto => match open() {
            Ok(b) => Ok((Arc::new(b), None)),
            Err(why) => Ok((Arc::new(CpuBackend), Some(format!("using the CPU: {why}")))),
        },
    }
}
