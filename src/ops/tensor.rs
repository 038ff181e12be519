//! `Tensor`: a row-major f32 buffer held where a backend wants it, so a block forward, its statistics and its
//! quantization can run on a device without a PCIe round trip per operation (design.md §3: "calibration
//! activations stay on the GPU"; §12 "device residency").
//!
//! The CPU backend only ever makes `Host` tensors, and the `Backend` tensor methods default to the host-slice
//! methods, so the CPU runs the very code path the GPU runs (tests/resident_forward.rs checks the two agree).
//! A device backend keeps `Device` tensors and parks activations that do not fit in `Pinned` host memory.

use cudarc::driver::{CudaSlice, PinnedHostSlice};
use std::borrow::Cow;

pub enum Tensor {
    /// Ordinary host memory.
    Host(Vec<f32>),
    /// Page-locked host memory (a device backend's staging for activations that do not fit on the device).
    Pinned(PinnedHostSlice<f32>),
    /// Device memory of the CUDA backend.
    Device(CudaSlice<f32>),
}

impl Tensor {
    pub fn len(&self) -> usize {
        match self {
            Tensor::Host(v) => v.len(),
            Tensor::Pinned(p) => p.len(),
            Tensor::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn on_device(&self) -> bool {
        matches!(self, Tensor::Device(_))
    }

    /// The values when they are in host memory (no copy); None for a device tensor.
    pub fn host(&self) -> Option<&[f32]> {
        match self {
            Tensor::Host(v) => Some(v),
            // as_slice only fails when the pinned buffer's event cannot be synchronized: a dead context.
            Tensor::Pinned(p) => p.as_slice().ok(),
            Tensor::Device(_) => None,
        }
    }

    pub fn host_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Tensor::Host(v) => Some(v),
            Tensor::Pinned(p) => p.as_mut_slice().ok(),
            Tensor::Device(_) => None,
        }
    }

    /// Host values borrowed when possible; `fetch` copies a device tensor out.
    pub(crate) fn read_with<'a, E>(
        &'a self,
        fetch: impl FnOnce(&CudaSlice<f32>) -> Result<Vec<f32>, E>,
    ) -> Result<Cow<'a, [f32]>, E> {
        match self {
            Tensor::Device(d) => fetch(d).map(Cow::Owned),
            t => Ok(Cow::Borrowed(t.host().unwrap_or(&[]))),
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = match self {
            Tensor::Host(_) => "host",
            Tensor::Pinned(_) => "pinned",
            Tensor::Device(_) => "device",
        };
        write!(f, "Tensor({place}, {} f32)", self.len())
    }
}

impl Default for Tensor {
    fn default() -> Self {
        Tensor::Host(Vec::new())
    }
}
