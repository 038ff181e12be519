//! Host side of cuda/cholesky.cu: the batched U = chol(H⁻¹)ᵀ, one CTA per matrix, n ≤ CHOLESKY_MAX_N.

use super::CudaError;
use crate::nvtx::range;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file (cuda/cholesky.cu).
pub const MODULE: &str = "cholesky";

/// Largest n the one-CTA kernel takes (its packed triangle must fit the 48 KB default shared memory);
/// must match kCholMaxN in cuda/cholesky.cu. Larger matrices go through cuSOLVER (solver.rs).
pub const CHOLESKY_MAX_N: usize = 128;
/// Must match kCholThreads.
const CHOL_THREADS: u32 = 256;

pub struct CholeskyKernels {
    cholesky: CudaFunction,
    /// reverse_kernel, the data movement of the cuSOLVER route (solver.rs).
    pub(super) reverse: CudaFunction,
    /// eye_kernel, the identity the trsm route solves against (solver.rs).
    pub(super) eye: CudaFunction,
}

impl CholeskyKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let load = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(CholeskyKernels {
            cholesky: load("cholesky_upper_inverse_kernel")?,
            reverse: load("reverse_kernel")?,
            eye: load("eye_kernel")?,
        })
    }
}

/// U [count × n × n] and status [count] (0 = ok, else the failed pivot + 1) of H [count × n × n].
pub fn launch_cholesky(
    stream: &Arc<CudaStream>,
    k: &CholeskyKernels,
    u: &mut CudaSlice<f32>,
    status: &mut CudaSlice<i32>,
    h: &CudaSlice<f32>,
    n: usize,
    count: usize,
) -> Result<(), CudaError> {
    if n == 0
        || n > CHOLESKY_MAX_N
        || h.len() != count * n * n
        || u.len() != h.len()
        || status.len() != count
    {
        return Err(CudaError::Shape {
            op: "cholesky_upper_inverse",
            msg: format!(
                "n={n} (1..={CHOLESKY_MAX_N}), count={count}, h.len={}, u.len={}, status.len={}",
                h.len(),
                u.len(),
                status.len()
            ),
        });
    }
    if count == 0 {
        return Ok(());
    }
    let grid = u32::try_from(count).map_err(|_| CudaError::Shape {
        op: "cholesky_upper_inverse",
        msg: format!("count={count} does not fit in u32"),
    })?;
    let n32 = n as u32;
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (CHOL_THREADS, 1, 1),
        shared_mem_bytes: ((n * (n + 1) / 2 + n) * 4) as u32,
    };
    let _r = range(c"cholesky_upper_inverse");
    let mut b = stream.launch_builder(&k.cholesky);
    b.arg(u).arg(status).arg(h).arg(&n32);
    // SAFETY: arguments match cholesky_upper_inverse_kernel(float* u, int32* status, const float* h, uint32 n);
    // u and h hold count·n² f32 and status count i32 (checked); the dynamic smem is the (n(n+1)/2 + n) floats
    // the kernel indexes, ≤ 33.5 KB for n ≤ 128.
    unsafe { b.launch(cfg) }.map_err(|source| CudaError::Driver {
        what: "launch cholesky_upper_inverse",
        source,
    })?;
    Ok(())
}
