//! CUDA backend: the cudarc host layer over the kernels build.rs embedded (one file per cuda/*.cu:
//! `ops.rs` ↔ cuda/ops.cu).
//!
//! Opening it never panics: libcuda is loaded at run time (cudarc `dynamic-loading`), so `CudaBackend::new`
//! first probes for the driver, then checks that kernels were compiled in, then opens the context inside
//! `catch_unwind` (cudarc panics rather than erroring when libcuda or one of its symbols is missing), and
//! returns the reason as a string when any step fails. `select_backend` turns that into a CPU fallback
//! (`--device auto`) or an error (`--device cuda`).
//!
//! Operations without a kernel yet delegate to the CPU backend, each saying so.

pub mod abi;
pub mod kernels;
mod nvtx;
pub mod ops;

pub use nvtx::{Range, range};
pub use ops::RmsNormVariant;

use super::Backend;
use super::cpu::CpuBackend;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
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
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ops: ops::OpsKernels,
    name: String,
    rms_norm_variant: RmsNormVariant,
    poison_outputs: bool,
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
        let fatbin = kernels::fatbin(ops::MODULE).ok_or_else(|| {
            format!(
                "cuda/{}.cu is missing from the embedded kernels",
                ops::MODULE
            )
        })?;
        let module = ctx.load_module(Ptx::from_binary(fatbin.to_vec())).map_err(|e| {
            format!(
                "cannot load the embedded cuda/{}.cu kernels on {gpu} (sm_{}{}): {e}; they were built by \
                 nvcc {}, and the driver cannot load PTX from a newer nvcc",
                ops::MODULE,
                cc.0,
                cc.1,
                kernels::NVCC_VERSION
            )
        })?;
        let ops = ops::OpsKernels::load(&module).map_err(|e| e.to_string())?;
        Ok(CudaBackend {
            stream: ctx.default_stream(),
            ctx,
            ops,
            name: format!("cuda:{ordinal} {gpu}"),
            rms_norm_variant: RmsNormVariant::WarpPerRow,
            poison_outputs: false,
        })
    }

    /// Selects the RMSNorm kernel variant (style.md rule 4: the naive one stays selectable).
    pub fn set_rms_norm_variant(&mut self, v: RmsNormVariant) {
        self.rms_norm_variant = v;
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
