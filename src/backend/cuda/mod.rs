//! CUDA backend (cudarc host layer, one file per cuda/*.cu). Placeholder until the build chain lands:
//! every constructor returns the reason it cannot run.

use super::Backend;

pub struct CudaBackend {
    _private: (),
}

impl CudaBackend {
    /// Opens device `ordinal`, or says why it cannot (no driver, no device, kernels not compiled in).
    pub fn new(_ordinal: usize) -> Result<Self, String> {
        Err("this build has no CUDA backend yet".into())
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        unreachable!("CudaBackend cannot be constructed")
    }
    fn linear(
        &self,
        _: &[f32],
        _: &[f32],
        _: Option<&[f32]>,
        _: usize,
        _: usize,
        _: usize,
    ) -> Vec<f32> {
        unreachable!()
    }
    fn rms_norm(&self, _: &[f32], _: &[f32], _: usize, _: f32) -> Vec<f32> {
        unreachable!()
    }
    fn rope(&self, _: &mut [f32], _: usize, _: usize, _: usize, _: &[f32], _: &[f32]) {
        unreachable!()
    }
    fn causal_attention(
        &self,
        _: &[f32],
        _: &[f32],
        _: &[f32],
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
    ) -> Vec<f32> {
        unreachable!()
    }
    fn swiglu(&self, _: &[f32], _: &[f32]) -> Vec<f32> {
        unreachable!()
    }
}
