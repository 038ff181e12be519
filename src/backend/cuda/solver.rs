//! Host side of U = chol(H⁻¹)ᵀ for n > CHOLESKY_MAX_N (the d_in-sized H_col of every layer): cuSOLVER's
//! potrf and trtri on J H J, with cuda/cholesky.cu's `reverse_kernel` moving the matrix in and out (its
//! header has the algebra). cuSOLVER is loaded at run time like libcuda; when it is missing the caller
//! factorizes on the host and says so.

use super::cholesky::CholeskyKernels;
use super::{CudaError, driver};
use crate::nvtx::range;
use cudarc::cusolver::safe::DnHandle;
use cudarc::cusolver::{result as sr, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

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
            let handle =
                DnHandle::new(stream.clone()).map_err(|e| format!("cusolverDnCreate: {e}"))?;
            let params =
                sr::dn_create_params().map_err(|e| format!("cusolverDnCreateParams: {e}"))?;
            Ok(Solver { handle, params })
        }))
        .unwrap_or_else(|_| Err("libcusolver could not be used (missing symbol)".into()))
    }

    /// U = chol(H⁻¹)ᵀ [n × n] of one SPD H on the device, or None when H is not numerically positive definite.
    pub fn upper_inverse(
        &self,
        k: &CholeskyKernels,
        h: &CudaSlice<f32>,
        n: usize,
    ) -> Result<Option<CudaSlice<f32>>, CudaError> {
        let stream = self.handle.stream();
        let _r = range(c"cholesky_cusolver");
        // SAFETY: reverse_kernel writes all n² elements of `a` before potrf reads them.
        let mut a = unsafe { stream.alloc::<f32>(n * n) }.map_err(driver("alloc J H J"))?;
        let mut bad = stream.alloc_zeros::<i32>(1).map_err(driver("alloc flag"))?;
        launch_reverse(stream, k, &mut a, &mut bad, h, n, false)?;
        let mut info = stream.alloc_zeros::<i32>(1).map_err(driver("alloc info"))?;
        let fill = sys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER;
        let f32t = sys::cudaDataType::CUDA_R_32F;
        let ni = n as i64;
        {
            let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
            let (pa, _sa) = a.device_ptr_mut(stream);
            // SAFETY: a is [n × n] f32 on this handle's stream; the out-pointers are valid.
            unsafe {
                sys::cusolverDnXpotrf_bufferSize(
                    self.handle.cu(),
                    self.params,
                    fill,
                    ni,
                    f32t,
                    pa as *const c_void,
                    ni,
                    f32t,
                    &mut dev_bytes,
                    &mut host_bytes,
                )
            }
            .result()
            .map_err(solver_err("potrf workspace size"))?;
            let mut work = stream
                .alloc_zeros::<u8>(dev_bytes.max(1))
                .map_err(driver("alloc potrf workspace"))?;
            let mut host = vec![0u8; host_bytes.max(1)];
            let (pw, _sw) = work.device_ptr_mut(stream);
            let (pi, _si) = info.device_ptr_mut(stream);
            // SAFETY: workspaces of the sizes cuSOLVER asked for; a and info as above.
            unsafe {
                sys::cusolverDnXpotrf(
                    self.handle.cu(),
                    self.params,
                    fill,
                    ni,
                    f32t,
                    pa as *mut c_void,
                    ni,
                    f32t,
                    pw as *mut c_void,
                    dev_bytes,
                    host.as_mut_ptr() as *mut c_void,
                    host_bytes,
                    pi as *mut i32,
                )
            }
            .result()
            .map_err(solver_err("potrf"))?;
        }
        if read_flag(stream, &info)? != 0 {
            return Ok(None);
        }
        {
            let diag = sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT;
            let (mut dev_bytes, mut host_bytes) = (0usize, 0usize);
            let (pa, _sa) = a.device_ptr_mut(stream);
            // SAFETY: as for potrf.
            unsafe {
                sys::cusolverDnXtrtri_bufferSize(
                    self.handle.cu(),
                    fill,
                    diag,
                    ni,
                    f32t,
                    pa as *mut c_void,
                    ni,
                    &mut dev_bytes,
                    &mut host_bytes,
                )
            }
            .result()
            .map_err(solver_err("trtri workspace size"))?;
            let mut work = stream
                .alloc_zeros::<u8>(dev_bytes.max(1))
                .map_err(driver("alloc trtri workspace"))?;
            let mut host = vec![0u8; host_bytes.max(1)];
            let (pw, _sw) = work.device_ptr_mut(stream);
            let (pi, _si) = info.device_ptr_mut(stream);
            // SAFETY: as for potrf.
            unsafe {
                sys::cusolverDnXtrtri(
                    self.handle.cu(),
                    fill,
                    diag,
                    ni,
                    f32t,
                    pa as *mut c_void,
                    ni,
                    pw as *mut c_void,
                    dev_bytes,
                    host.as_mut_ptr() as *mut c_void,
                    host_bytes,
                    pi as *mut i32,
                )
            }
            .result()
            .map_err(solver_err("trtri"))?;
        }
        if read_flag(stream, &info)? != 0 {
            return Ok(None);
        }
        // SAFETY: reverse_kernel writes all n² elements of u.
        let mut u = unsafe { stream.alloc::<f32>(n * n) }.map_err(driver("alloc U"))?;
        launch_reverse(stream, k, &mut u, &mut bad, &a, n, true)?;
        Ok((read_flag(stream, &bad)? == 0).then_some(u))
    }
}

fn read_flag(stream: &Arc<CudaStream>, flag: &CudaSlice<i32>) -> Result<i32, CudaError> {
    let v = stream.clone_dtoh(flag).map_err(driver("download status"))?;
    stream.synchronize().map_err(driver("solver status"))?;
    Ok(v[0])
}

/// out = J in J (row-major [n × n]); with `upper`, zeros below the diagonal and `bad` = 1 on a non-finite entry.
pub fn launch_reverse(
    stream: &Arc<CudaStream>,
    k: &CholeskyKernels,
    out: &mut CudaSlice<f32>,
    bad: &mut CudaSlice<i32>,
    input: &CudaSlice<f32>,
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
