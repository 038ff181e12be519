//! The fatbins build.rs compiled from cuda/*.cu and embedded in this binary (OUT_DIR/kernels.rs): `FATBINS`
//! (stem, bytes), `PTXAS_REPORT`, `NVCC_VERSION`. `FATBINS` is empty and `cfg(boa_kernels)` unset when nvcc
//! was not found at build time.

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Whether this binary carries CUDA kernels.
pub const PRESENT: bool = cfg!(boa_kernels);

/// The embedded fatbin compiled from cuda/`stem`.cu.
pub fn fatbin(stem: &str) -> Option<&'static [u8]> {
    FATBINS.iter().find(|(s, _)| *s == stem).map(|(_, b)| *b)
}
