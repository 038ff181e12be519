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

/// Returns the backend and, for `auto` falling back to the CPU, the reason.
pub fn select_backend(device: Device) -> anyhow::Result<(Arc<dyn Backend>, Option<String>)> {
    match device {
        Device::Cpu => Ok((Arc::new(CpuBackend), None)),
        Device::Cuda => match cuda::CudaBackend::new(0) {
            Ok(b) => Ok((Arc::new(b), None)),
            Err(why) => Err(anyhow::Error::new(BoaError::NoCuda(why))),
        },
        Device::Auto => match cuda::CudaBackend::new(0) {
            Ok(b) => Ok((Arc::new(b), None)),
            Err(why) => Ok((Arc::new(CpuBackend), Some(format!("using the CPU: {why}")))),
        },
    }
}
