//! CUDA backend: the cudarc host layer over the kernels build.rs embedded (one file per cuda/*.cu:
//! `ops.rs` ↔ cuda/ops.cu, `qgemm.rs` ↔ cuda/qgemm.cu, `hessian.rs`, `cholesky.rs`, `sweep.rs`, `search.rs`,
//! `boa_dynamic.rs` ↔ their .cu; `quant.rs` implements `QuantOps` over the last five).
//!
//! Opening it never panics: libcuda is loaded at run time (cudarc `dynamic-loading`), so `CudaBackend::new`
//! first probes for the driver, then checks that kernels were compiled in, then opens the context inside
//! `catch_unwind` (cudarc panics rather than erroring when libcuda or one of its symbols is missing), and
//! returns the reason as a string when any step fails. `select_backend` turns that into a CPU fallback
//! (`--device auto`) or an error (`--device cuda`).
//!
//! On the GPU: rms_norm, rope, swiglu, geglu, causal_attention (flash d_h ≤ 256, naive any; sliding windows too), attention_probs (ops.rs ↔ cuda/ops.cu),
//! linear (cuBLAS, gemm.rs), packed_linear (qgemm.rs ↔ cuda/qgemm.cu: fused dequant + dot for m ≤ 16,
//! dequantize + cuBLAS above), plus the QuantOps of quant.rs. Still on the CPU, each saying why at its
//! method: flash causal_attention with d_h > 256, linear and packed_linear with m > 16 when libcublas is
//! missing (noted once on stderr), and degenerate shapes (k = 0).

pub mod abi;
pub mod boa_dynamic;
pub mod ceiling;
pub mod cholesky;
pub mod core;
pub mod gemm;
pub mod hessian;
pub mod kernels;
pub mod ops;
pub mod qgemm;
mod quant;
mod resident;
mod ridge;
mod row_grams;
pub mod search;
mod solver;
pub mod sweep;
mod traffic;

pub use crate::nvtx::{Range, range};
pub use boa_dynamic::BoaDynamicVariant;
pub use gemm::LinearVariant;
pub use hessian::{AttnXVariant, XxtVariant};
pub use ops::{AttentionVariant, RmsNormVariant};
pub use qgemm::QgemmVariant;
pub use search::SearchVariant;
pub use solver::FactorVariant;
pub use sweep::{BoaBlockVariant, GptqBlockVariant, TrailingVariant};

use super::cpu::CpuBackend;
use super::{Backend, Tensor, Weight};
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use std::borrow::Cow;
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
    #[error("cuBLAS {what}: {source}")]
    Blas {
        what: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    /// A step done on the host inside a device op (a CPU fallback), failed.
    #[error("{op}: {msg}")]
    Host { op: &'static str, msg: String },
    #[error("cuSOLVER {what}: {source}")]
    Solver {
        what: &'static str,
        #[source]
        source: cudarc::cusolver::result::CusolverError,
    },
}

/// Kernel `kernel` of `module` (compiled from cuda/`stem`.cu), or the error naming both: what every kernel
/// family's `load` asks of its module.
pub(crate) fn load_kernel(
    module: &Arc<CudaModule>,
    stem: &'static str,
    kernel: &'static str,
) -> Result<cudarc::driver::CudaFunction, CudaError> {
    module
        .load_function(kernel)
        .map_err(|e| CudaError::MissingKernel {
            module: stem,
            kernel,
            source: e,
        })
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// Function handles of the quantization-core modules (cuda/hessian.cu, cholesky.cu, sweep.cu, search.cu,
/// core.cu).
struct QuantKernels {
    core: core::CoreKernels,
    hessian: hessian::HessianKernels,
    cholesky: cholesky::CholeskyKernels,
    sweep: sweep::SweepKernels,
    search: search::SearchKernels,
    boa_dynamic: boa_dynamic::BoaDynamicKernels,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Weight uploads (`upload_weight`), issued from the prefetch thread while `stream` computes, and the
    /// parked chunks' trips (`stage`, `write_back`). Its existence also keeps cudarc in multi-stream mode,
    /// the mode in which it records copies on pinned buffers' events: the parked paths rely on that.
    copy_stream: Arc<CudaStream>,
    /// Page-locked buffers the weight uploads pass through (resident.rs).
    staging: std::sync::Mutex<resident::WeightStaging>,
    ops: ops::OpsKernels,
    quant: QuantKernels,
    name: String,
    rms_norm_variant: RmsNormVariant,
    linear_variant: LinearVariant,
    search_variant: SearchVariant,
    attention_variant: AttentionVariant,
    xxt_variant: XxtVariant,
    /// The sweeps' trailing update (cuBLAS unless set otherwise; the FFMA kernel when cuBLAS cannot be opened).
    trailing_variant: TrailingVariant,
    /// How the large factors invert R (trtri unless set otherwise; trtri when cuBLAS cannot be opened).
    factor_variant: FactorVariant,
    /// The GPTQ sweep's block kernel (v2 unless set otherwise; v1 when v2 cannot be loaded).
    gptq_block_variant: GptqBlockVariant,
    /// The BoA sweep's column block (v2, 128 columns, unless set otherwise; v1 when v2 cannot be loaded).
    boa_block_variant: BoaBlockVariant,
    attn_x_variant: AttnXVariant,
    poison_outputs: bool,
    /// Device time of the kernels of the last QuantOps call (events around the launches, transfers excluded).
    last_kernel_ms: std::sync::Mutex<f32>,
    /// cuSOLVER for the large Cholesky factors, opened on first use; the reason when it cannot be.
    solver: std::sync::OnceLock<Result<solver::Solver, String>>,
    /// cuBLAS for `linear` and the scale search, opened on first use; the reason when it cannot be.
    blas: std::sync::OnceLock<Result<gemm::Blas, String>>,
    /// cuda/qgemm.cu's kernels, loaded on first packed_linear; the reason when they cannot be.
    qgemm: std::sync::OnceLock<Result<qgemm::QgemmKernels, String>>,
    /// The host layer's transfer counts (traffic.rs), for a GPU; the emulator counts for itself.
    counters: traffic::HostCounters,
    /// RoPE cos/sin tables already uploaded (resident.rs `rope_tables`): a run's layers share one or two.
    rope_tables: std::sync::Mutex<Vec<resident::RopeTablesOnDevice>>,
    /// R4's H_m already uploaded (resident.rs `try_block_hadamard_t`).
    hadamard_small: std::sync::Mutex<Vec<resident::HadamardSmallOnDevice>>,
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

/// The stream-ordered allocator's default pool hands its free memory back to the driver at every
/// synchronize (release threshold 0), so the large per-call buffers (a layer's W and Q, the scale search's
/// candidates) would be mapped again after each QuantOps call, which synchronizes. Keeping up to a quarter of
/// the card cached removes that cost (NVIDIA did the same for cuda-python's default pool,
/// NVIDIA/cuda-python#771) and bounds what a full card can lose to the cache. Best effort: a driver without
/// pools keeps its behaviour.
fn keep_pool_memory(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    let Ok(total) = ctx.total_mem() else { return };
    if !ctx.has_async_alloc() {
        return;
    }
    let mut keep = total as u64 / 4;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: plain driver queries on a valid device handle; `keep` outlives the call that reads it.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == sys::CUresult::CUDA_SUCCESS
        {
            let _ = sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            );
        }
    }
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
            core: core::CoreKernels::load(&load_module(&ctx, core::MODULE, &gpu, cc)?)
                .map_err(|e| e.to_string())?,
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
            boa_dynamic: boa_dynamic::BoaDynamicKernels::load(&load_module(
                &ctx,
                boa_dynamic::MODULE,
                &gpu,
                cc,
            )?)
            .map_err(|e| e.to_string())?,
        };
        keep_pool_memory(&ctx);
        let copy_stream = ctx
            .new_stream()
            .map_err(|e| format!("cannot create a copy stream on {gpu}: {e}"))?;
        Ok(CudaBackend {
            stream: ctx.default_stream(),
            copy_stream,
            staging: Default::default(),
            ctx,
            ops,
            quant,
            name: format!("cuda:{ordinal} {gpu}"),
            rms_norm_variant: RmsNormVariant::WarpPerRow,
            linear_variant: LinearVariant::F32,
            search_variant: SearchVariant::Bf16Rescore,
            attention_variant: AttentionVariant::Flash,
            xxt_variant: XxtVariant::Cublas,
            trailing_variant: TrailingVariant::Cublas,
            factor_variant: FactorVariant::Trtri,
            gptq_block_variant: GptqBlockVariant::Split,
            boa_block_variant: BoaBlockVariant::W128,
            attn_x_variant: AttnXVariant::Gemm,
            poison_outputs: false,
            last_kernel_ms: std::sync::Mutex::new(0.0),
            solver: std::sync::OnceLock::new(),
            blas: std::sync::OnceLock::new(),
            qgemm: std::sync::OnceLock::new(),
            counters: Default::default(),
            rope_tables: Default::default(),
            hadamard_small: Default::default(),
        })
    }

    /// Selects the RMSNorm kernel variant (style.md rule 4: the naive one stays selectable).
    pub fn set_rms_norm_variant(&mut self, v: RmsNormVariant) {
        self.rms_norm_variant = v;
    }

    /// Selects the GEMM of `linear`: f32 (cublasSgemm, the default) or bf16 operands (cublasGemmEx).
    pub fn set_linear_variant(&mut self, v: LinearVariant) {
        self.linear_variant = v;
    }

    /// Selects the Hessian scale search: bf16 tensor cores with an exact re-score (the default) or the f32
    /// SGEMM port of the CPU score (search.rs).
    pub fn set_search_variant(&mut self, v: SearchVariant) {
        self.search_variant = v;
    }

    /// Selects the causal_attention kernel: flash (the default) or the naive port of the CPU twin.
    pub fn set_attention_variant(&mut self, v: AttentionVariant) {
        self.attention_variant = v;
    }

    /// Selects the XᵀX kernel variant used by xxt_accumulate, head_covariance and v_col_covariance.
    pub fn set_xxt_variant(&mut self, v: XxtVariant) {
        self.xxt_variant = v;
    }

    /// Selects the sweeps' trailing update: cuBLAS SGEMM (the default) or the FFMA kernel (v1).
    pub fn set_trailing_variant(&mut self, v: TrailingVariant) {
        self.trailing_variant = v;
    }

    /// Selects how the large factors (n > 128) invert their Cholesky factor: cuSOLVER's trtri (the default) or
    /// cuBLAS's strsm against the identity.
    pub fn set_factor_variant(&mut self, v: FactorVariant) {
        self.factor_variant = v;
    }

    /// Selects the GPTQ sweep's block kernel: one warp per 32 rows (v1) or four (v2, the default).
    pub fn set_gptq_block_variant(&mut self, v: GptqBlockVariant) {
        self.gptq_block_variant = v;
    }

    /// Selects the BoA sweep's block kernel: 32-column blocks (v1) or 128 (v2, the default: 72.5 against
    /// 96.3 ms for 32×128×4096 on an H200, bench boa_sweep, 2026-12-04).
    pub fn set_boa_block_variant(&mut self, v: BoaBlockVariant) {
        self.boa_block_variant = v;
    }

    /// Selects how v_col_covariance forms Y = A_h X: cuBLAS GEMMs around a softmax kernel (the default), the
    /// tensor-core attn_x kernel, or the f32 baseline.
    pub fn set_attn_x_variant(&mut self, v: AttnXVariant) {
        self.attn_x_variant = v;
    }

    /// Forgets the last kernel time (NaN), so a call that ends up on the host (a CPU fallback) does not
    /// report the time of the call before it.
    pub fn reset_kernel_ms(&self) {
        *self
            .last_kernel_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = f32::NAN;
    }

    /// Device milliseconds of the kernels of the last QuantOps call (uploads and downloads excluded); NaN
    /// after `reset_kernel_ms` until a call launches kernels.
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

    /// RMSNorm through the selected kernel variant; see `Backend::rms_norm`. The host-slice form of
    /// `try_rms_norm_t` (resident.rs), so the parity tests check the kernels the pipeline runs.
    pub fn try_rms_norm(
        &self,
        x: &[f32],
        w: &[f32],
        d: usize,
        eps: f32,
    ) -> Result<Vec<f32>, CudaError> {
        let y = self.try_rms_norm_t(&Tensor::Host(x.to_vec()), w, d, eps)?;
        self.finish(y, "rms_norm")
    }

    /// cuBLAS, opened on first use; the reason (printed once) when it cannot be.
    pub(super) fn blas(&self) -> Result<&gemm::Blas, &str> {
        self.blas
            .get_or_init(|| {
                let b = gemm::Blas::new(&self.stream);
                if let Err(why) = &b {
                    eprintln!(
                        "{}: {why}; linear, packed_linear with m > 16 and the scale search run on the \
                         CPU, the sweeps' trailing updates on the FFMA kernel",
                        self.name
                    );
                }
                b
            })
            .as_ref()
            .map_err(String::as_str)
    }

    /// Whether `linear` runs on the GPU (cuBLAS loaded); opens cuBLAS if it was not yet.
    pub fn linear_on_gpu(&self) -> bool {
        self.blas().is_ok()
    }

    /// Y [m × n] = X [m × k] · W [n × k]ᵀ (+ bias) through cuBLAS with the selected variant; see
    /// `Backend::linear`. Errors when cuBLAS cannot be opened (the `Backend` method falls back instead).
    #[allow(clippy::too_many_arguments)]
    pub fn try_linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let y = self.try_linear_t(&Tensor::Host(x.to_vec()), Weight::host(w), bias, m, k, n)?;
        self.finish(y, "linear")
    }

    /// Rotate-half RoPE in place on the GPU; see `Backend::rope`.
    pub fn try_rope(
        &self,
        x: &mut [f32],
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<(), CudaError> {
        let mut xt = Tensor::Host(x.to_vec());
        self.try_rope_t(&mut xt, t, n_heads, d_h, cos, sin)?;
        x.copy_from_slice(&self.finish(xt, "rope")?);
        Ok(())
    }

    /// silu(gate) ⊙ up on the GPU; see `Backend::swiglu`.
    pub fn try_swiglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>, CudaError> {
        let o = self.try_swiglu_t(&Tensor::Host(gate.to_vec()), &Tensor::Host(up.to_vec()))?;
        self.finish(o, "swiglu")
    }

    /// gelu_tanh(gate) ⊙ up on the GPU; see `Backend::geglu`.
    pub fn try_geglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>, CudaError> {
        let o = self.try_geglu_t(&Tensor::Host(gate.to_vec()), &Tensor::Host(up.to_vec()))?;
        self.finish(o, "geglu")
    }

    /// Causal GQA attention on the GPU (the flash variant takes d_h ≤ ops::ATTN_MAX_D_H = 256); see
    /// `Backend::causal_attention`.
    #[allow(clippy::too_many_arguments)]
    pub fn try_causal_attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let host = |x: &[f32]| Tensor::Host(x.to_vec());
        let o = self.try_causal_attention_t(
            &host(q),
            &host(k),
            &host(v),
            n_seq,
            t,
            h,
            h_kv,
            d_h,
            None,
        )?;
        self.finish(o, "causal_attention")
    }

    /// The causal softmax probabilities [h × t × t] of one sequence on the GPU; see `Backend::attention_probs`.
    pub fn try_attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>, CudaError> {
        if q.len() != t * h * d_h || k.len() != t * h_kv * d_h {
            return Err(CudaError::Shape {
                op: "attention_probs",
                msg: format!(
                    "q.len={}, k.len={} do not match t={t}, h={h}, h_kv={h_kv}, d_h={d_h}",
                    q.len(),
                    k.len()
                ),
            });
        }
        if t == 0 || h == 0 {
            return Ok(Vec::new());
        }
        let q_d = self.stream.clone_htod(q).map_err(driver("upload q"))?;
        let k_d = self.stream.clone_htod(k).map_err(driver("upload k"))?;
        let mut p_d = self.output(h * t * t)?;
        ops::launch_attention_probs(
            &self.stream,
            &self.ops,
            &mut p_d,
            &q_d,
            &k_d,
            t,
            h,
            h_kv,
            d_h,
        )?;
        let p = self.stream.clone_dtoh(&p_d).map_err(driver("download p"))?;
        self.stream
            .synchronize()
            .map_err(driver("attention_probs"))?;
        Ok(p)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// cuBLAS; the CPU computes it when libcublas cannot be opened (said once on stderr) and for k = 0
    /// (Y = bias: nothing to multiply, and BLAS's k = 0 semantics are not worth a device round trip).
    fn linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> crate::ops::Result<Vec<f32>> {
        if k == 0 || self.blas().is_err() {
            return CpuBackend.linear(x, w, bias, m, k, n);
        }
        self.try_linear(x, w, bias, m, k, n)
            .map_err(|e| anyhow::anyhow!("{} linear (m={m}, k={k}, n={n}): {e}", self.name))
    }

    /// cuda/qgemm.cu; the CPU computes it for k = 0 and, when libcublas cannot be opened (said once on
    /// stderr), for m > 16 (the dequantize + GEMM path).
    fn packed_linear(
        &self,
        x: &[f32],
        w: &crate::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> crate::ops::Result<Vec<f32>> {
        if w.d_in == 0 || (qgemm::auto_variant(m) == QgemmVariant::Dequant && self.blas().is_err())
        {
            return CpuBackend.packed_linear(x, w, bias, m);
        }
        self.try_packed_linear(x, w, bias, m).map_err(|e| {
            anyhow::anyhow!(
                "{} packed_linear (m={m}, k={}, n={}, {}-bit): {e}",
                self.name,
                w.d_in,
                w.d_out,
                w.bits
            )
        })
    }

    /// A CUDA failure comes back as an error naming the op and its shapes.
    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> crate::ops::Result<Vec<f32>> {
        self.try_rms_norm(x, w, d, eps).map_err(|e| {
            anyhow::anyhow!(
                "{} rms_norm (d={d}, rows={}): {e}",
                self.name,
                x.len() / d.max(1)
            )
        })
    }

    fn rope(
        &self,
        x: &mut [f32],
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> crate::ops::Result<()> {
        self.try_rope(x, t, n_heads, d_h, cos, sin).map_err(|e| {
            anyhow::anyhow!(
                "{} rope (t={t}, n_heads={n_heads}, d_h={d_h}, x.len={}): {e}",
                self.name,
                x.len()
            )
        })
    }

    /// With the flash variant, d_h > 256 (no model we target) runs on the CPU: those kernels keep a query
    /// row's slice of q and of the output in registers, sized by the padded head dim kD ∈ {64, 128, 256}.
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
    ) -> crate::ops::Result<Vec<f32>> {
        self.try_causal_attention(q, k, v, n_seq, t, h, h_kv, d_h)
            .map_err(|e| {
 anyhow::anyhow!(
                    "{} causal_attention (n_seq={n_seq}, t={t}, h={h}, h_kv={h_kv}, d_h={d_h}): {e}",
                    self.name
                )
            })
    }

    /// The plain probabilities kernel; the V statistics may later fuse it away (design.md §6).
    fn attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> crate::ops::Result<Vec<f32>> {
        self.try_attention_probs(q, k, t, h, h_kv, d_h)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} attention_probs (t={t}, h={h}, h_kv={h_kv}, d_h={d_h}): {e}",
                    self.name
                )
            })
    }

    fn swiglu(&self, gate: &[f32], up: &[f32]) -> crate::ops::Result<Vec<f32>> {
        self.try_swiglu(gate, up)
            .map_err(|e| anyhow::anyhow!("{} swiglu (n={}): {e}", self.name, gate.len()))
    }

    fn geglu(&self, gate: &[f32], up: &[f32]) -> crate::ops::Result<Vec<f32>> {
        self.try_geglu(gate, up)
            .map_err(|e| anyhow::anyhow!("{} geglu (n={}): {e}", self.name, gate.len()))
    }

    fn device_memory(&self) -> Option<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    // ---- Tensors (resident.rs): activations and statistic sums stay in device memory.

    fn to_device(&self, x: Tensor) -> crate::ops::Result<Tensor> {
        resident::to_device(self, x)
    }

    fn to_host(&self, x: Tensor, pinned: bool) -> crate::ops::Result<Tensor> {
        let n = x.len();
        self.try_to_host(x, pinned)
            .map_err(|e| anyhow::anyhow!("{} to_host ({n} f32): {e}", self.name))
    }

    fn read<'a>(&self, x: &'a Tensor) -> crate::ops::Result<Cow<'a, [f32]>> {
        resident::read(self, x)
    }

    fn write_back(&self, src: &Tensor, dst: &mut Tensor) -> crate::ops::Result<()> {
        self.try_write_back(src, dst)
            .map_err(|e| anyhow::anyhow!("{} write_back ({src:?} → {dst:?}): {e}", self.name))
    }

    fn duplicate(&self, x: &Tensor) -> crate::ops::Result<Tensor> {
        resident::duplicate(self, x)
    }

    fn stage(&self, x: &Tensor) -> crate::ops::Result<Tensor> {
        resident::stage(self, x)
    }

    fn zeros(&self, n: usize) -> crate::ops::Result<Tensor> {
        resident::zeros(self, n)
    }

    fn upload_weight(&self, w: &[f32]) -> crate::ops::Result<Option<Tensor>> {
        let t = self
            .try_upload_weight(w, &self.copy_stream)
            .map_err(|e| anyhow::anyhow!("{} upload_weight ({} f32): {e}", self.name, w.len()))?;
        Ok(Some(t))
    }

    fn upload_weight_now(&self, w: &[f32]) -> crate::ops::Result<Option<Tensor>> {
        let t = self.try_upload_weight(w, &self.stream).map_err(|e| {
            anyhow::anyhow!("{} upload_weight_now ({} f32): {e}", self.name, w.len())
        })?;
        Ok(Some(t))
    }

    fn embed_t(
        &self,
        table: &Tensor,
        ids: &[u32],
        d: usize,
        scale: f32,
    ) -> crate::ops::Result<Tensor> {
        self.try_embed_t(table, ids, d, scale)
            .map_err(|e| anyhow::anyhow!("{} embed ({} ids, d={d}): {e}", self.name, ids.len()))
    }

    fn linear_t(
        &self,
        x: &Tensor,
        w: Weight<'_>,
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> crate::ops::Result<Tensor> {
        resident::linear_t(self, x, w, bias, (m, k, n))
    }

    /// The fast transform on the device (ops.cu block_hadamard) for blocks up to ops::HADAMARD_MAX_B; a longer
    /// block (only by `--rotate-online-block`) runs the GEMM on the dense transform (its resident copy when
    /// there is one).
    fn block_hadamard_t(
        &self,
        x: &Tensor,
        h: &crate::ops::hadamard::Hadamard,
        dense: Weight<'_>,
    ) -> crate::ops::Result<Tensor> {
        let b = h.n;
        anyhow::ensure!(
            b > 0 && x.len().is_multiple_of(b) && dense.host.len() == b * b,
            "block_hadamard: x of {} values, blocks of {b}, a dense transform of {}",
            x.len(),
            dense.host.len()
        );
        if b <= ops::HADAMARD_MAX_B {
            return self
                .try_block_hadamard_t(x, h)
                .map_err(|e| anyhow::anyhow!("{} block_hadamard (blocks of {b}): {e}", self.name));
        }
        self.linear_t(x, dense, None, x.len() / b, b, b)
    }

    fn block_hadamard_reads_dense(&self, b: usize) -> bool {
        b > ops::HADAMARD_MAX_B
    }

    fn upload_packed(
        &self,
        w: &crate::quant::pack::PackedLinear,
    ) -> crate::ops::Result<Option<super::PackedResident>> {
        let d = self.upload_packed(w).map_err(|e| {
            anyhow::anyhow!(
                "{} upload_packed ({} × {}): {e}",
                self.name,
                w.d_out,
                w.d_in
            )
        })?;
        Ok(Some(super::PackedResident(Box::new(d))))
    }

    fn packed_linear_t(
        &self,
        x: &Tensor,
        w: &crate::quant::pack::PackedLinear,
        resident: Option<&super::PackedResident>,
        bias: Option<&[f32]>,
        m: usize,
    ) -> crate::ops::Result<Tensor> {
        if w.d_in == 0 || (qgemm::auto_variant(m) == QgemmVariant::Dequant && self.blas().is_err())
        {
            let y = CpuBackend.packed_linear(&self.read(x)?, w, bias, m)?;
            return self.to_device(Tensor::Host(y));
        }
        let resident = resident.and_then(|r| r.0.downcast_ref::<qgemm::DevicePacked>());
        self.try_packed_linear_t(x, w, resident, bias, m)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} packed_linear (m={m}, k={}, n={}, {}-bit): {e}",
                    self.name,
                    w.d_in,
                    w.d_out,
                    w.bits
                )
            })
    }

    fn rms_norm_t(&self, x: &Tensor, w: &[f32], d: usize, eps: f32) -> crate::ops::Result<Tensor> {
        self.try_rms_norm_t(x, w, d, eps).map_err(|e| {
            anyhow::anyhow!(
                "{} rms_norm (d={d}, rows={}): {e}",
                self.name,
                x.len() / d.max(1)
            )
        })
    }

    fn rope_t(
        &self,
        x: &mut Tensor,
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> crate::ops::Result<()> {
        self.try_rope_t(x, t, n_heads, d_h, cos, sin).map_err(|e| {
            anyhow::anyhow!(
                "{} rope (t={t}, n_heads={n_heads}, d_h={d_h}, x.len={}): {e}",
                self.name,
                x.len()
            )
        })
    }

    fn causal_attention_t(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
        window: Option<usize>,
    ) -> crate::ops::Result<Tensor> {
        self.try_causal_attention_t(q, k, v, n_seq, t, h, h_kv, d_h, window)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} causal_attention (n_seq={n_seq}, t={t}, h={h}, h_kv={h_kv}, d_h={d_h}, \
                     window={window:?}): {e}",
                    self.name
                )
            })
    }

    fn swiglu_t(&self, gate: &Tensor, up: &Tensor) -> crate::ops::Result<Tensor> {
        self.try_swiglu_t(gate, up)
            .map_err(|e| anyhow::anyhow!("{} swiglu (n={}): {e}", self.name, gate.len()))
    }

    fn geglu_t(&self, gate: &Tensor, up: &Tensor) -> crate::ops::Result<Tensor> {
        self.try_geglu_t(gate, up)
            .map_err(|e| anyhow::anyhow!("{} geglu (n={}): {e}", self.name, gate.len()))
    }

    fn add_t(&self, x: &mut Tensor, y: &Tensor) -> crate::ops::Result<()> {
        self.try_add_t(x, y)
            .map_err(|e| anyhow::anyhow!("{} add (n={}): {e}", self.name, y.len()))
    }

    fn scatter_add_rows_t(
        &self,
        out: &mut Tensor,
        y: &Tensor,
        d: usize,
        rows: &[u32],
        weights: &[f32],
    ) -> crate::ops::Result<()> {
        self.try_scatter_add_rows_t(out, y, d, rows, weights)
            .map_err(|e| {
                anyhow::anyhow!(
                    "{} scatter_add_rows ({} rows, d={d}): {e}",
                    self.name,
                    rows.len()
                )
            })
    }
}
