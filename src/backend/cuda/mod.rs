//! CUDA backend: the cudarc host layer over the kernels build.rs embedded (one file per cuda/*.cu:
//! `ops.rs` ↔ cuda/ops.cu, `hessian.rs`, `cholesky.rs`, `sweep.rs`, `search.rs` ↔ their .cu; `quant.rs`
//! implements `QuantOps` over the last four).
//!
//! Opening it never panics: libcuda is loaded at run time (cudarc `dynamic-loading`), so `CudaBackend::new`
//! first probes for the driver, then checks that kernels were compiled in, then opens the context inside
//! `catch_unwind` (cudarc panics rather than erroring when libcuda or one of its symbols is missing), and
//! returns the reason as a string when any step fails. `select_backend` turns that into a CPU fallback
//! (`--device auto`) or an error (`--device cuda`).
//!
//! Operations without a kernel yet delegate to the CPU backend, each saying so.

pub mod abi;
pub mod ceiling;
pub mod cholesky;
pub mod hessian;
pub mod kernels;
pub mod ops;
mod quant;
pub mod search;
mod solver;
pub mod sweep;

pub use crate::nvtx::{Range, range};
pub use hessian::XxtVariant;
pub use ops::RmsNormVariant;

use super::Backend;
use super::cpu::CpuBackend;
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

/// Lowest compute capability the embedded code runs on (SASS sm_80 and sm_90a, PTX compute_80).
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// Why a CUDA operation failed (style.md rule 16: errors name the module, kernel and shape).
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("{what}: {source}")]
    Driver {
        what: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("kernel {kernel} missing from the embedded cuda/{module}.cu fatbin: {source}")]
    MissingKernel {
        module: &'static str,
        kernel: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("{op}: unsupported shape: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("cuSOLVER {what}: {source}")]
    Solver {
        what: &'static str,
        #[source]
        source: cudarc::cusolver::result::CusolverError,
    },
    #[error("cuBLAS {what}: {source}")]
    Blas {
        what: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// Function handles of the quantization-core modules (cuda/hessian.cu, cholesky.cu, sweep.cu, search.cu).
struct QuantKernels {
    hessian: hessian::HessianKernels,
    cholesky: cholesky::CholeskyKernels,
    sweep: sweep::SweepKernels,
    search: search::SearchKernels,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ops: ops::OpsKernels,
    quant: QuantKernels,
    name: String,
    rms_norm_variant: RmsNormVariant,
    xxt_variant: XxtVariant,
    poison_outputs: bool,
    /// Device time of the kernels of the last QuantOps call (events around the launches, transfers excluded).
    last_kernel_ms: std::sync::Mutex<f32>,
    /// cuSOLVER for the large Cholesky factors, opened on first use; the reason when it cannot be.
    solver: std::sync::OnceLock<Result<solver::Solver, String>>,
    /// cuBLAS for the scale search (search.rs), opened on first use; the reason when it cannot be.
    search_blas: std::sync::OnceLock<Result<search::SearchBlas, String>>,
}

/// Loads the embedded fatbin of cuda/`stem`.cu, or says why it cannot.
fn load_module(
    ctx: &Arc<CudaContext>,
    stem: &'static str,
    gpu: &str,
    cc: (i32, i32),
) -> Result<Arc<CudaModule>, String> {
    let fatbin = kernels::fatbin(stem)
        .ok_or_else(|| format!("cuda/{stem}.cu is missing from the embedded kernels"))?;
    ctx.load_module(Ptx::from_binary(fatbin.to_vec()))
        .map_err(|e| {
            format!(
                "cannot load the embedded cuda/{stem}.cu kernels on {gpu} (sm_{}{}): {e}; they were built by \
                 nvcc {}, and the driver cannot load PTX from a newer nvcc",
                cc.0,
                cc.1,
                kernels::NVCC_VERSION
            )
        })
}

impl CudaBackend {
    /// Opens device `ordinal`, or says why it cannot (no driver, kernels not compiled in, no such device,
    /// device too old, fatbin not loadable by this driver).
    pub fn new(ordinal: usize) -> Result<Self, String> {
        // SAFETY: only tries to dlopen libcuda.so (and drops the handle); no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no NVIDIA driver (libcuda.so not found)".into());
        }
        if !kernels::PRESENT {
            return Err(
                "this binary was built without CUDA kernels (nvcc was not found at build time; \
                 rebuild with NVCC=<path to nvcc>, see scripts/install_nvcc.sh)"
                    .into(),
            );
        }
        match catch_unwind(AssertUnwindSafe(|| Self::open(ordinal))) {
            Ok(r) => r,
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown panic");
                Err(format!("the CUDA driver library could not be used: {msg}"))
            }
        }
    }

    fn open(ordinal: usize) -> Result<Self, String> {
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            format!("cannot open CUDA device {ordinal}: {e} (driver present, but no usable GPU?)")
        })?;
        let gpu = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let cc = ctx
            .compute_capability()
            .map_err(|e| format!("cannot query CUDA device {ordinal} ({gpu}): {e}"))?;
        if cc < MIN_COMPUTE_CAPABILITY {
            return Err(format!(
                "{gpu} has compute capability {}.{}; the embedded kernels need ≥ {}.{}",
                cc.0, cc.1, MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
            ));
        }
        let module = load_module(&ctx, ops::MODULE, &gpu, cc)?;
        let ops = ops::OpsKernels::load(&module).map_err(|e| e.to_string())?;
        let quant = QuantKernels {
            hessian: hessian::HessianKernels::load(&load_module(&ctx, hessian::MODULE, &gpu, cc)?)
                .map_err(|e| e.to_string())?,
            cholesky: cholesky::CholeskyKernels::load(&load_module(
                &ctx,
                cholesky::MODULE,
                &gpu,
                cc,
            )?)
            .map_err(|e| e.to_string())?,
            sweep: sweep::SweepKernels::load(&load_module(&ctx, sweep::MODULE, &gpu, cc)?)
                .map_err(|e| e.to_string())?,
            search: search::SearchKernels::load(&load_module(&ctx, search::MODULE, &gpu, cc)?)
                .map_err(|e| e.to_string())?,
        };
        Ok(CudaBackend {
            stream: ctx.default_stream(),
            ctx,
            ops,
            quant,
            name: format!("cuda:{ordinal} {gpu}"),
            rms_norm_variant: RmsNormVariant::WarpPerRow,
            xxt_variant: XxtVariant::Bf16Wmma,
            poison_outputs: false,
            last_kernel_ms: std::sync::Mutex::new(0.0),
            solver: std::sync::OnceLock::new(),
            search_blas: std::sync::OnceLock::new(),
        })
    }

    /// Selects the RMSNorm kernel variant (style.md rule 4: the naive one stays selectable).
    pub fn set_rms_norm_variant(&mut self, v: RmsNormVariant) {
        self.rms_norm_variant = v;
    }

    /// Selects the XᵀX kernel variant used by xxt_accumulate, head_covariance and v_col_covariance.
    pub fn set_xxt_variant(&mut self, v: XxtVariant) {
        self.xxt_variant = v;
    }

    /// Device milliseconds of the kernels of the last QuantOps call (uploads and downloads excluded).
    pub fn last_kernel_ms(&self) -> f32 {
        *self
            .last_kernel_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `launches` between two timing events on the stream and records the elapsed device time.
    fn timed<R>(&self, launches: impl FnOnce() -> Result<R, CudaError>) -> Result<R, CudaError> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self
            .stream
            .record_event(flags)
            .map_err(driver("record start event"))?;
        let r = launches()?;
        let end = self
            .stream
            .record_event(flags)
            .map_err(driver("record end event"))?;
        let ms = start.elapsed_ms(&end).map_err(driver("kernel time"))?;
        *self
            .last_kernel_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = ms;
        Ok(r)
    }

    /// Synchronizes the stream (benchmarks: the QuantOps methods already synchronize before returning).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// Fills every output buffer with NaN before the kernel runs, so an element the kernel forgets to write
    /// fails the parity tests (METHOD.md "Correct first"). Costs one extra upload per call: tests only.
    pub fn set_poison_outputs(&mut self, on: bool) {
        self.poison_outputs = on;
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// An output buffer of `n` f32: NaN-filled when poisoning, uninitialised otherwise.
    fn output(&self, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        if self.poison_outputs {
            self.stream
                .clone_htod(&vec![f32::NAN; n])
                .map_err(driver("upload poison"))
        } else {
            // SAFETY: every caller launches a kernel that writes all n elements before anything reads them
            // (the parity tests check this with poisoned outputs).
            unsafe { self.stream.alloc::<f32>(n) }.map_err(driver("alloc output"))
        }
    }

    /// An output buffer of `n` codes: 0xFF-filled when poisoning (no code of a ≤ 4-bit grid), else uninitialised.
    fn codes_output(&self, n: usize) -> Result<CudaSlice<u8>, CudaError> {
        if self.poison_outputs {
            self.stream
                .clone_htod(&vec![0xFFu8; n])
                .map_err(driver("upload poison"))
        } else {
            // SAFETY: as `output`: the sweep kernels write every code before it is read.
            unsafe { self.stream.alloc::<u8>(n) }.map_err(driver("alloc codes"))
        }
    }

    /// RMSNorm through the selected kernel variant; see `Backend::rms_norm`.
    pub fn try_rms_norm(
        &self,
        x: &[f32],
        w: &[f32],
        d: usize,
        eps: f32,
    ) -> Result<Vec<f32>, CudaError> {
        if d == 0 || w.len() != d || !x.len().is_multiple_of(d) {
            return Err(CudaError::Shape {
                op: "rms_norm",
                msg: format!(
                    "x.len={} is not a multiple of d={d}, or w.len={} ≠ d",
                    x.len(),
                    w.len()
                ),
            });
        }
        if x.is_empty() {
            return Ok(Vec::new());
        }
        let rows = x.len() / d;
        let x_d = self.stream.clone_htod(x).map_err(driver("upload x"))?;
        let w_d = self.stream.clone_htod(w).map_err(driver("upload w"))?;
        let mut y_d = self.output(x.len())?;
        ops::launch_rms_norm(
            &self.stream,
            &self.ops,
            self.rms_norm_variant,
            &mut y_d,
            &x_d,
            &w_d,
            rows,
            d,
            eps,
        )?;
        let y = self.stream.clone_dtoh(&y_d).map_err(driver("download y"))?;
        // Surfaces asynchronous kernel faults here, naming the op, rather than at some later call.
        self.stream.synchronize().map_err(driver("rms_norm"))?;
        Ok(y)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    // GPU linear (cuBLAS) lands with the block-forward issue; until then the CPU backend computes it.
    fn linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<f32> {
        CpuBackend.linear(x, w, bias, m, k, n)
    }

    // The packed GEMM kernel (cuda/qgemm.cu) lands with its own issue; until then the CPU backend computes it.
    fn packed_linear(
        &self,
        x: &[f32],
        w: &crate::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Vec<f32> {
        CpuBackend.packed_linear(x, w, bias, m)
    }

    /// The `Backend` trait returns plain vectors, so a CUDA failure here panics with the op and shape named.
    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> Vec<f32> {
        self.try_rms_norm(x, w, d, eps).unwrap_or_else(|e| {
            panic!(
                "{} rms_norm (d={d}, rows={}): {e}",
                self.name,
                x.len() / d.max(1)
            )
        })
    }

    // GPU RoPE lands with the block-forward issue; until then the CPU backend computes it.
    fn rope(&self, x: &mut [f32], t: usize, n_heads: usize, d_h: usize, cos: &[f32], sin: &[f32]) {
        CpuBackend.rope(x, t, n_heads, d_h, cos, sin)
    }

    // GPU attention lands with the block-forward issue; until then the CPU backend computes it.
    fn causal_attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Vec<f32> {
        CpuBackend.causal_attention(q, k, v, n_seq, t, h, h_kv, d_h)
    }

    // The V statistics' probabilities move to a fused kernel with the quantization-core issue.
    fn attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Vec<f32> {
        CpuBackend.attention_probs(q, k, t, h, h_kv, d_h)
    }

    // GPU SwiGLU lands with the block-forward issue; until then the CPU backend computes it.
    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        CpuBackend.swiglu(gate, up)
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }
}
