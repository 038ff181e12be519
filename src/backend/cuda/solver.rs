//! Host side of U = chol(H⁻¹)ᵀ for n > CHOLESKY_MAX_N (the d_in-sized H_col of every layer): cuSOLVER's
//! potrf and trtri on J H J, with cuda/cholesky.cu's `reverse_kernel` moving the matrix in and out (its
//! header has the algebra). cuSOLVER is loaded at run time like libcuda; when it is missing the caller
//! factorizes on the host and says so. A batch of matrices (V's per-head H_col) is queued back to back with
//! one status array, so the caller synchronizes once per batch, not three times per matrix.

use super::cholesky::CholeskyKernels;
use super::gemm::Blas;
use super::{CudaError, driver};
use crate::nvtx::range;
use cudarc::cusolver::safe::DnHandle;
use cudarc::cusolver::{result as sr, sys};
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

/// How the large factors invert their Cholesky factor R (U = J R⁻¹ J, cuda/cholesky.cu's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FactorVariant {
    /// v1: cuSOLVER's trtri in place; the baseline: potrf + trtri 12.7 ms at n = 4096, 86.9 ms at 11008 (H200,
    /// bench factor (H_col), 2026-12-04), 3.6 and 10.2 TFLOP/s.
    Trtri = 1,
    /// v2: cuBLAS's strsm of R X = I (n³ flop against trtri's n³/3, through cuBLAS's tuned TRSM); falls back
    /// to v1 when cuBLAS cannot be opened. Needs a second n × n scratch matrix (485 MB at n = 11008) that the
    /// memory plan does not count. Not yet measured on a GPU.
    Trsm = 2,
}

impl FactorVariant {
    pub const ALL: [FactorVariant; 2] = [FactorVariant::Trtri, FactorVariant::Trsm];
}

/// A cuSOLVER dense handle and the params object its 64-bit API takes.
pub struct Solver {
    handle: DnHandle,
    params: sys::cusolverDnParams_t,
}

// SAFETY: cuSOLVER handles and params are thread safe (cuSOLVER docs, "Thread Safety"); calls are serialized
// on the one stream the handle is bound to.
unsafe impl Send for Solver {}
unsafe impl Sync for Solver {}

impl Drop for Solver {
    fn drop(&mut self) {
        // SAFETY: created by dn_create_params in `new` and destroyed once.
        let _ = unsafe { sr::dn_destroy_params(self.params) };
    }
}

fn solver_err(what: &'static str) -> impl FnOnce(sr::CusolverError) -> CudaError {
    move |source| CudaError::Solver { what, source }
}

impl Solver {
    /// Opens cuSOLVER on `stream`, or says why it cannot (library missing, or a symbol of it).
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        // SAFETY: only tries to dlopen libcusolver (and drops the handle); no call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcusolver not found".into());
        }
        // cudarc panics, rather than erroring, when a symbol is missing from the library it found.
        catch_unwind(AssertUnwindSafe(|| -> Result<Self, String> {
            // cusolverDnCreate acts on the calling thread's current context; cudarc does not bind it here.
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| format!("bind context: {e}"))?;
            let handle =
                DnHandle::new(stream.clone()).map_err(|e| format!("cusolverDnCreate: {e}"))?;
            let params =
                sr::dn_create_params().map_err(|e| format!("cusolverDnCreateParams: {e}"))?;
            Ok(Solver { handle, params })
        }))
        .unwrap_or_else(|_| Err("libcusolver could not be used (missing symbol)".into()))
    }

    /// U_b = chol(H_b⁻¹)ᵀ [n × n] of the SPD matrices H_b, b ∈ `which`, of `h` [batch × n × n], into
    /// `u` (same shape), all queued on the handle's stream with no host synchronization: per matrix, the
    /// reversal J H_b J into one scratch matrix (reused: the stream orders the matrices), potrf, trtri, and
    /// the reversal out into u_b. Returns the status [which.len() × 3] (potrf info, trtri info, non-finite flag),
    /// zero for a matrix that factored; the caller downloads it with U and synchronizes once.
    /// (A damping retry refactors only the ones that failed.)
    ///
    /// With `trsm` (FactorVariant::Trsm), the triangular inverse is cuBLAS's strsm against the identity (the
    /// trtri slot of the status stays 0; a zero pivot shows as a non-finite entry) instead of cuSOLVER's trtri.
    pub fn upper_inverse_subset(
        &self,
        k: &CholeskyKernels,
        h: &CudaSlice<f32>,
        u: &mut CudaSlice<f32>,
        n: usize,
        which: &[usize],
        trsm: Option<&Blas>,
    ) -> Result<CudaSlice<i32>, CudaError> {
        let nn = n * n;
        let count = which.len();
        let batch = h.len() / nn.max(1);
        if n == 0
            || h.len() != batch * nn
            || u.len() != h.len()
            || which.iter().any(|&b| b >= batch)
        {
            return Err(CudaError::Shape {
                op: "cholesky_upper_inverse (cuSOLVER)",
                msg: format!(
                    "h.len={} u.len={} for count={count}, n={n} (≥ 1)",
                    h.len(),
                    u.len()
                ),
            });
        }
        let stream = self.handle.stream();
        let mut status = stream
            .alloc_zeros::<i32>(3 * count.max(1))
            .map_err(driver("alloc status"))?;
        if count == 0 {
            return Ok(status);
        }
        let _r = range(c"cholesky_cusolver");
        // cuSOLVER calls act on the calling thread's current context; cudarc binds it for its own calls only.
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        // SAFETY: reverse_kernel writes all n² elements of `a` before potrf reads them, for every matrix.
        let mut a = unsafe { stream.alloc::<f32>(nn) }.map_err(driver("alloc J H J"))?;
        let (cu, params) = (self.handle.cu(), self.params);
        let fill = sys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER;
        let diag = sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT;
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let ni = n as i64;
        // The workspaces depend on n only: sized once, reused by every matrix.
        let (mut potrf_ws, mut trtri_ws) = {
            let (pa, _sa) = a.device_ptr_mut(stream);
            let pa = pa as *mut c_void;
            // SAFETY (both queries): a is [n × n] f32 on this handle's stream; the out-pointers are valid.
            let potrf = Workspace::new(stream, "potrf workspace size", |dev, host| unsafe {
                sys::cusolverDnXpotrf_bufferSize(
                    cu, params, fill, ni, f32t, pa, ni, f32t, dev, host,
                )
            })?;
            let trtri = Workspace::new(stream, "trtri workspace size", |dev, host| unsafe {
                sys::cusolverDnXtrtri_bufferSize(cu, fill, diag, ni, f32t, pa, ni, dev, host)
            })?;
            (potrf, trtri)
        };
        // The trsm route's right-hand side and result: X = I, then R⁻¹ (one buffer, reused like `a`).
        let mut x = match trsm {
            // SAFETY: eye_kernel writes all n² elements before strsm reads them, for every matrix.
            Some(_) => Some(unsafe { stream.alloc::<f32>(nn) }.map_err(driver("alloc X"))?),
            None => None,
        };
        for (i, &b) in which.iter().enumerate() {
            let mut st = status.slice_mut(3 * i..3 * i + 3);
            launch_reverse(
                stream,
                k,
                &mut a.slice_mut(..),
                &mut st.slice_mut(2..3),
                &h.slice(b * nn..(b + 1) * nn),
                n,
                false,
            )?;
            {
                let (pa, _sa) = a.device_ptr_mut(stream);
                let pa = pa as *mut c_void;
                // This matrix's status: [potrf info, trtri info, non-finite flag].
                let (ps, _ss) = st.device_ptr_mut(stream);
                let (potrf_info, trtri_info) = (ps as *mut i32, (ps + 4) as *mut i32);
                // SAFETY: a and the workspace as sized above; info is one i32 of this matrix's status.
                potrf_ws.call(stream, "potrf", |dev, dev_bytes, host, host_bytes| unsafe {
                    sys::cusolverDnXpotrf(
                        cu, params, fill, ni, f32t, pa, ni, f32t, dev, dev_bytes, host, host_bytes,
                        potrf_info,
                    )
                })?;
                if trsm.is_none() {
                    // SAFETY: as for potrf. After a failed potrf (info > 0) trtri runs on a partial factor:
                    // it may produce non-finite values or its own info, never an out-of-bounds access; the
                    // status discards that matrix.
                    trtri_ws.call(stream, "trtri", |dev, dev_bytes, host, host_bytes| unsafe {
                        sys::cusolverDnXtrtri(
                            cu, fill, diag, ni, f32t, pa, ni, dev, dev_bytes, host, host_bytes,
                            trtri_info,
                        )
                    })?;
                }
            }
            // The inverse: in place in `a` (trtri), or X = R⁻¹ I (trsm; after a failed potrf the same
            // caveat as trtri's holds, and the status discards the matrix).
            let inv = match (trsm, x.as_mut()) {
                (Some(blas), Some(x)) => {
                    launch_eye(stream, k, &mut x.slice_mut(..), n)?;
                    blas.upper_solve(&a.slice(..), &mut x.slice_mut(..), n)?;
                    x.slice(..)
                }
                _ => a.slice(..),
            };
            launch_reverse(
                stream,
                k,
                &mut u.slice_mut(b * nn..(b + 1) * nn),
                &mut st.slice_mut(2..3),
                &inv,
                n,
                true,
            )?;
        }
        if potrf_ws.host_bytes > 0 || trtri_ws.host_bytes > 0 {
            // The host workspaces are dropped here; see `Workspace::call`.
            stream
                .synchronize()
                .map_err(driver("cuSOLVER host workspace"))?;
        }
        Ok(status)
    }
}

/// A cuSOLVER workspace (device and host bytes) of the size its `*_bufferSize` query asked for: the "size →
/// alloc → call" sequence of potrf and trtri, written once.
struct Workspace {
    dev: CudaSlice<u8>,
    dev_bytes: usize,
    host: Vec<u8>,
    host_bytes: usize,
}

impl Workspace {
    /// Runs the size query `size(&mut device_bytes, &mut host_bytes)` (`what` names it in errors) and
    /// allocates both buffers.
    fn new(
        stream: &Arc<CudaStream>,
        what: &'static str,
        size: impl FnOnce(&mut usize, &mut usize) -> sys::cusolverStatus_t,
    ) -> Result<Self, CudaError> {
        let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
        size(&mut dev_bytes, &mut host_bytes)
            .result()
            .map_err(solver_err(what))?;
        let dev = stream
            .alloc_zeros::<u8>(dev_bytes.max(1))
            .map_err(driver("alloc cuSOLVER workspace"))?;
        Ok(Workspace {
            dev,
            dev_bytes,
            host: vec![0u8; host_bytes.max(1)],
            host_bytes,
        })
    }

    /// Runs `call(device ptr, device bytes, host ptr, host bytes)` with this workspace. The next call reuses
    /// the buffers: the stream orders the device side; a host workspace (none asked for by potrf/trtri as far
    /// as we know, but the API allows one) could still be read by queued work, so then the stream is drained
    /// first.
    fn call(
        &mut self,
        stream: &Arc<CudaStream>,
        what: &'static str,
        call: impl FnOnce(*mut c_void, usize, *mut c_void, usize) -> sys::cusolverStatus_t,
    ) -> Result<(), CudaError> {
        if self.host_bytes > 0 {
            stream
                .synchronize()
                .map_err(driver("cuSOLVER host workspace"))?;
        }
        let (pw, _sw) = self.dev.device_ptr_mut(stream);
        call(
            pw as *mut c_void,
            self.dev_bytes,
            self.host.as_mut_ptr() as *mut c_void,
            self.host_bytes,
        )
        .result()
        .map_err(solver_err(what))
    }
}

/// out = I [n × n].
fn launch_eye(
    stream: &Arc<CudaStream>,
    k: &CholeskyKernels,
    out: &mut CudaViewMut<f32>,
    n: usize,
) -> Result<(), CudaError> {
    if out.len() != n * n {
        return Err(CudaError::Shape {
            op: "eye",
            msg: format!("out.len={} for n={n}", out.len()),
        });
    }
    let blocks = ((n * n) as u64).div_ceil(256).clamp(1, 65535 * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let n64 = n as u64;
    let mut b = stream.launch_builder(&k.eye);
    b.arg(out).arg(&n64);
    // SAFETY: matches eye_kernel(float* out, uint64 n); out holds n² f32 (checked).
    unsafe { b.launch(cfg) }.map_err(|source| CudaError::Driver {
        what: "launch eye",
        source,
    })?;
    Ok(())
}

/// out = J in J (row-major [n × n]); with `upper`, zeros below the diagonal and `bad[0]` = 1 on a non-finite
/// entry.
pub fn launch_reverse(
    stream: &Arc<CudaStream>,
    k: &CholeskyKernels,
    out: &mut CudaViewMut<f32>,
    bad: &mut CudaViewMut<i32>,
    input: &CudaView<f32>,
    n: usize,
    upper: bool,
) -> Result<(), CudaError> {
    if out.len() != n * n || input.len() != n * n || bad.is_empty() {
        return Err(CudaError::Shape {
            op: "reverse",
            msg: format!("out.len={} in.len={} for n={n}", out.len(), input.len()),
        });
    }
    let total = (n * n) as u64;
    let blocks = total.div_ceil(256).clamp(1, 65535 * 4) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n64, up) = (n as u64, upper as u32);
    let mut b = stream.launch_builder(&k.reverse);
    b.arg(out).arg(bad).arg(input).arg(&n64).arg(&up);
    // SAFETY: matches reverse_kernel(float* out, int32* bad, const float* in, uint64 n, uint32 upper); out and
    // in hold n² f32 and bad ≥ 1 i32 (checked).
    unsafe { b.launch(cfg) }.map_err(|source| CudaError::Driver {
        what: "launch reverse",
        source,
    })?;
    Ok(())
}
