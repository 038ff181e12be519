//! Host side of the GPU linear Y [m × n] = X [m × k] · W [n × k]ᵀ (+ b [n]): cuBLAS, loaded at run time like
//! libcuda (cudarc `dynamic-loading`); when libcublas is missing the caller computes on the host and says so
//! once. The bias add and the bf16 operand conversion are small kernels of cuda/ops.cu (ops.rs launchers).
//!
//! Row-major through a column-major library: a row-major [r × c] buffer is the column-major [c × r] matrix
//! of its transpose. So Y (row-major [m × n]) is Yᵀ column-major [n × m], and
//!
//! ```text
//!   Yᵀ [n × m] = W [n × k] · Xᵀ [k × m]
//!   W  row-major [n × k] = column-major Wᵀ [k × n], ld k  → op(A) = T
//!   X  row-major [m × k] = column-major Xᵀ [k × m], ld k  → op(B) = N
//!   gemm(T, N, M = n, N = m, K = k, A = W, lda = k, B = X, ldb = k, C = Y, ldc = n)
//! ```
//!
//! Variants (style.md rule 17; `LinearVariant`): f32 (cublasSgemm, the default: exact-ish parity with the CPU
//! twin; the handle keeps CUBLAS_DEFAULT_MATH, which never drops f32 to TF32 unless NVIDIA_TF32_OVERRIDE
//! says so) and bf16 operands (cublasGemmEx, CUDA_R_16BF A and B, f32 accumulation and output: the tensor-core
//! rate, ≈ 2–4e-3 relative error on random data).
//!
//! The same handle runs the sweeps' trailing update W[:, i2:] −= E · U[i1:i2, i2:] (`sgemm_strided`; the
//! row-major ↔ column-major mapping is sweep.rs `trailing_cublas_config`).
//!
//! Roofline (H200): 2·m·n·k flop; f32 SIMT ≈ 60 TFLOP/s, bf16 tensor cores ≈ 990 TFLOP/s dense. A 7B
//! projection on 512 tokens (4096 × 4096): 17 GFLOP → ≈ 0.3 ms f32, ≈ 20 µs bf16 (then bound by W's 64 MB f32
//! read + conversion ≈ 25 µs). The linear is correct on an H200 (parity tests, 2026-12-04: max rel. error
//! vs f64: f32 2.3e-7, bf16 2.5e-3, inside the ≈ 2–4e-3 expected above); its speed is not measured yet. Other
//! calls of this handle were timed (H200, 2026-12-04, `boa-cuda bench --device cuda --shapes 7b --reps 3`):
//! gram_bf16 (stat_xxt, m = 2048) 427.6 TFLOP/s at d = 4096, 568.4 at d = 11008, against the ≈ 990 above;
//! rows_times_h plus dot_partials (quad_forms (report), 3 × 4096 × 11008) 61.288 ms, 48.6 TFLOP/s, against the
//! f32 ≈ 60 above; the sweeps' trailing update: cuda/sweep.cu's header.

use super::ops::{self, OpsKernels};
use super::{CudaError, driver};
use crate::nvtx::range;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig, result as br, sys};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

/// GEMM variants of the GPU linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearVariant {
    /// v1: cublasSgemm, f32 operands and accumulation; the default and the parity baseline.
    F32 = 1,
    /// v2: cublasGemmEx with bf16 operands (converted on the device), f32 accumulation and output.
    Bf16 = 2,
}

impl LinearVariant {
    pub const ALL: [LinearVariant; 2] = [LinearVariant::F32, LinearVariant::Bf16];
}

/// A cuBLAS handle bound to the backend's stream.
pub struct Blas {
    blas: CudaBlas,
    stream: Arc<CudaStream>,
}

/// The operands of `Blas::rows_times_h_batched`: A [batch × m × n] and H [batch × n × n], f32 or bf16.
pub(super) enum BatchedOperands<'a, 'b> {
    F32 {
        a: &'a CudaView<'b, f32>,
        h: &'a CudaView<'b, f32>,
    },
    Bf16 {
        a: &'a CudaView<'b, u16>,
        h: &'a CudaView<'b, u16>,
    },
}

/// What a bf16 cross product is called in shape errors, in cuBLAS errors, and in the profile.
struct Names {
    op: &'static str,
    call: &'static str,
    range: &'static std::ffi::CStr,
}

const GRAM: Names = Names {
    op: "gram (cuBLAS bf16)",
    call: "gemm_strided_batched_ex bf16 (gram)",
    range: c"gram_bf16",
};

const CROSS: Names = Names {
    op: "cross (cuBLAS bf16)",
    call: "gemm_strided_batched_ex bf16 (cross)",
    range: c"cross_bf16",
};

fn blas_err(what: &'static str) -> impl FnOnce(br::CublasError) -> CudaError {
    move |source| CudaError::Blas { what, source }
}

impl Blas {
    /// Opens cuBLAS on `stream`, or says why it cannot (library missing, or a symbol of it).
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, String> {
        // SAFETY: only tries to dlopen libcublas (and drops the handle); no call is made.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcublas not found".into());
        }
        // cudarc panics, rather than erroring, when a symbol is missing from the library it found.
        catch_unwind(AssertUnwindSafe(|| -> Result<Self, String> {
            let blas = CudaBlas::new(stream.clone()).map_err(|e| format!("cublasCreate: {e}"))?;
            // SAFETY: a live handle; CUBLAS_DEFAULT_MATH keeps f32 GEMMs in f32 (no TF32 down-conversion).
            unsafe {
                sys::cublasSetMathMode(*blas.handle(), sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
            }
            .result()
            .map_err(|e| format!("cublasSetMathMode: {e}"))?;
            Ok(Blas {
                blas,
                stream: stream.clone(),
            })
        }))
        .unwrap_or_else(|_| Err("libcublas could not be used (missing symbol)".into()))
    }

    /// C [m × n] = A [m × n] · H [n × n], all row-major f32, H symmetric or not. Column-major cuBLAS sees the
    /// row-major buffers transposed: Cᵀ (n × m, ld n) = Hᵀ (n × n, ld n) · Aᵀ (n × m, ld n), i.e.
    /// sgemm(N, N, m' = n, n' = m, k' = n, A' = H, B' = A, C' = C).
    pub(super) fn rows_times_h(
        &self,
        c: &mut impl DevicePtrMut<f32>,
        a: &impl DevicePtr<f32>,
        h: &CudaSlice<f32>,
        m: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let bad = |msg: String| CudaError::Shape {
            op: "search_grids sgemm",
            msg,
        };
        if h.len() != n * n || a.len() < m * n || c.len() < m * n {
            return Err(bad(format!(
                "a.len={} c.len={} h.len={} for m={m}, n={n}",
                a.len(),
                c.len(),
                h.len()
            )));
        }
        let cfg = rows_times_h_config(m, n).map_err(bad)?;
        // cuBLAS calls act on the calling thread's current context; cudarc binds it for its own calls only.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        // SAFETY: H holds n·n, A and C at least m·n f32 (checked); the leading dimensions are n.
        unsafe { self.blas.gemm(cfg, h, a, c) }.map_err(|source| CudaError::Blas {
            what: "sgemm (search_grids)",
            source,
        })
    }

    /// X := R⁻¹ X for R [n × n] upper triangular and X [n × n], both column-major as cuSOLVER's potrf (fill
    /// upper) leaves R: its strict lower part is not read. With X = I this is the triangular inverse that
    /// solver.rs's trsm route uses in place of cuSOLVER's trtri (f32, on the handle's stream).
    pub(super) fn upper_solve(
        &self,
        r: &CudaView<f32>,
        x: &mut CudaViewMut<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        if r.len() != n * n || x.len() != n * n || n == 0 {
            return Err(CudaError::Shape {
                op: "strsm (factor)",
                msg: format!("r.len={} x.len={} for n={n} (≥ 1)", r.len(), x.len()),
            });
        }
        let ni = i32::try_from(n).map_err(|_| CudaError::Shape {
            op: "strsm (factor)",
            msg: format!("n={n} does not fit cuBLAS's 32-bit sizes"),
        })?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        let (pr, _sr) = r.device_ptr(&self.stream);
        let (px, _sx) = x.device_ptr_mut(&self.stream);
        let alpha = 1.0f32;
        // SAFETY: R and X hold n² f32 (checked) on this handle's stream; lda = ldb = n; alpha is a host scalar
        // (the handle's default pointer mode).
        unsafe {
            sys::cublasStrsm_v2(
                *self.blas.handle(),
                sys::cublasSideMode_t::CUBLAS_SIDE_LEFT,
                sys::cublasFillMode_t::CUBLAS_FILL_MODE_UPPER,
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasDiagType_t::CUBLAS_DIAG_NON_UNIT,
                ni,
                ni,
                &alpha,
                pr as *const f32,
                ni,
                px as *mut f32,
                ni,
            )
        }
        .result()
        .map_err(blas_err("strsm (factor)"))
    }

    /// A strided-batched f32 GEMM as `cfg` describes it (column-major, cuBLAS's own semantics), on the handle's
    /// stream: the sweeps' trailing update (sweep.rs `trailing_cublas_config`) and V's attention scores
    /// (`attn_scores`); `what` names it in errors. One plain SGEMM when the batch is 1.
    ///
    /// # Safety
    /// Every element `cfg` addresses through a, b and c (leading dimensions, batch strides) must lie inside
    /// them, and the leading dimensions must meet cuBLAS's minimums; the caller checks both.
    pub(super) unsafe fn sgemm_strided(
        &self,
        cfg: StridedBatchedConfig<f32>,
        a: &impl DevicePtr<f32>,
        b: &impl DevicePtr<f32>,
        c: &mut impl DevicePtrMut<f32>,
        what: &'static str,
    ) -> Result<(), CudaError> {
        // cuBLAS calls act on the calling thread's current context; cudarc binds it for its own calls only.
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        // SAFETY: the caller's contract above.
        let r = unsafe {
            if cfg.batch_size == 1 {
                self.blas.gemm(cfg.gemm, a, b, c)
            } else {
                self.blas.gemm_strided_batched(cfg, a, b, c)
            }
        };
        r.map_err(blas_err(what))
    }

    /// C_b [m × n] = A_b [m × n] · H_b [n × n] for every b < batch (the scale search's problems, search.rs):
    /// A and C strided by m·n, H by n·n, all row-major, the mapping of `rows_times_h` per matrix, in one
    /// strided-batched call. `Bf16` operands (u16 bit patterns) run cublasGemmStridedBatchedEx with f32
    /// accumulation and output (tensor cores); `F32` cublasSgemmStridedBatched (CUBLAS_DEFAULT_MATH: no TF32).
    pub(super) fn rows_times_h_batched(
        &self,
        c: &mut impl DevicePtrMut<f32>,
        operands: BatchedOperands<'_, '_>,
        m: usize,
        n: usize,
        batch: usize,
    ) -> Result<(), CudaError> {
        let bad = |msg: String| CudaError::Shape {
            op: "search_grids batched gemm",
            msg,
        };
        let (a_len, h_len) = match &operands {
            BatchedOperands::F32 { a, h } => (a.len(), h.len()),
            BatchedOperands::Bf16 { a, h } => (a.len(), h.len()),
        };
        if batch == 0
            || h_len < batch * n * n
            || a_len < batch * m * n
            || c.len() < batch * m * n
            || c_int::try_from(batch).is_err()
        {
            return Err(bad(format!(
                "a.len={a_len} c.len={} h.len={h_len} for {batch} × m={m}, n={n}",
                c.len()
            )));
        }
        let cfg = rows_times_h_config(m, n).map_err(bad)?;
        let (stride_h, stride_ac) = ((n * n) as i64, (m * n) as i64);
        let stream = &self.stream;
        // cuBLAS calls act on the calling thread's current context; cudarc binds it for its own calls only.
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        match operands {
            BatchedOperands::F32 { a, h } => {
                let sb = StridedBatchedConfig {
                    gemm: cfg,
                    batch_size: batch as c_int,
                    stride_a: stride_h,
                    stride_b: stride_ac,
                    stride_c: stride_ac,
                };
                // SAFETY: H holds batch·n·n, A and C batch·m·n f32 (checked); per matrix the leading dimensions
                // are n as in rows_times_h; H is cuBLAS's first operand there, A the second.
                unsafe { self.blas.gemm_strided_batched(sb, h, a, c) }
                    .map_err(blas_err("sgemm strided batched (search_grids)"))
            }
            BatchedOperands::Bf16 { a, h } => {
                let (ph, _sh) = h.device_ptr(stream);
                let (pa, _sa) = a.device_ptr(stream);
                let (pc, _sc) = c.device_ptr_mut(stream);
                let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
                // SAFETY: H holds batch·n·n, A and C batch·m·n elements (checked); per matrix the mapping and
                // leading dimensions are rows_times_h's; compute type 32F takes the f32 alpha and beta.
                unsafe {
                    br::gemm_strided_batched_ex(
                        *self.blas.handle(),
                        cfg.transa,
                        cfg.transb,
                        cfg.m,
                        cfg.n,
                        cfg.k,
                        &cfg.alpha as *const f32 as *const c_void,
                        ph as *const c_void,
                        bf16,
                        cfg.lda,
                        stride_h,
                        pa as *const c_void,
                        bf16,
                        cfg.ldb,
                        stride_ac,
                        &cfg.beta as *const f32 as *const c_void,
                        pc as *mut c_void,
                        sys::cudaDataType_t::CUDA_R_32F,
                        cfg.ldc,
                        stride_ac,
                        batch as c_int,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(blas_err("gemm_strided_batched_ex bf16 (search_grids)"))
            }
        }
    }

    /// H_z [d × d] += X_zᵀ X_z for z < batch: X [m × ld] row-major bf16 (u16 bit patterns), X_z its columns
    /// x_bs·z .. x_bs·z + d, H_z the f32 [d × d] at h_bs·z of `h` — the Grams of the statistics (XᵀX of a
    /// linear's input, the per-head covariances with x_bs = d_h, V's (A_h X)ᵀ(A_h X)) on the tensor cores, f32
    /// accumulation: `cross_strided_bf16` with both operands X. H is symmetric, so its row- and column-major
    /// forms are the same buffer; cuBLAS writes both triangles.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gram_bf16(
        &self,
        h: &mut CudaViewMut<f32>,
        x: &CudaView<u16>,
        m: usize,
        d: usize,
        ld: usize,
        batch: usize,
        x_bs: usize,
        h_bs: usize,
    ) -> Result<(), CudaError> {
        self.cross_strided_bf16(h, x, x, m, d, ld, batch, x_bs, h_bs, &GRAM)
    }

    /// C [d × d] += Pᵀ Q for P and Q [m × d] row-major bf16 (u16 bit patterns), C f32 and not symmetric:
    /// `run --asym-calib`'s D = Σ (a − ã) ãᵀ (ridge.rs), one matrix of `cross_strided_bf16`.
    pub(super) fn cross_bf16(
        &self,
        c: &mut CudaSlice<f32>,
        p: &CudaSlice<u16>,
        q: &CudaSlice<u16>,
        m: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        let (mut c, p, q) = (c.slice_mut(..), p.slice(..), q.slice(..));
        self.cross_strided_bf16(&mut c, &p, &q, m, d, d, 1, 0, 0, &CROSS)
    }

    /// H_z [d × d] += P_zᵀ Q_z for z < batch: P and Q [m × ld] row-major bf16, P_z and Q_z their columns
    /// x_bs·z .. x_bs·z + d, H_z the f32 [d × d] at h_bs·z of `h`; f32 accumulation on the tensor cores.
    /// Column-major cuBLAS sees H_z as H_zᵀ, and H_zᵀ (i, j) = Σ_t Q_z[t, i] P_z[t, j]; it sees P and Q as their
    /// transposes [ld × m] (ld ld), so H_zᵀ = Q′_z P′_zᵀ with P′_z, Q′_z the d × m blocks of rows x_bs·z of
    /// those: gemm(N, T, d, d, m, Q′_z, ld, P′_z, ld, β = 1, H_z, d), strided over z.
    #[allow(clippy::too_many_arguments)]
    fn cross_strided_bf16(
        &self,
        h: &mut CudaViewMut<f32>,
        p: &CudaView<u16>,
        q: &CudaView<u16>,
        m: usize,
        d: usize,
        ld: usize,
        batch: usize,
        x_bs: usize,
        h_bs: usize,
        names: &Names,
    ) -> Result<(), CudaError> {
        let bad = |msg: String| CudaError::Shape { op: names.op, msg };
        let fits = |v: usize| c_int::try_from(v).is_ok();
        if batch == 0 || m == 0 || d == 0 {
            return Ok(());
        }
        let x_len = (m - 1) * ld + (batch - 1) * x_bs + d;
        if !(fits(m) && fits(d) && fits(ld))
            || d > ld
            || p.len() < x_len
            || q.len() < x_len
            || h.len() < (batch - 1) * h_bs + d * d
            || (batch > 1 && h_bs < d * d)
        {
            return Err(bad(format!(
                "p.len={}, q.len={}, h.len={} for m={m}, d={d}, ld={ld}, batch={batch}, x_bs={x_bs}, \
                 h_bs={h_bs}",
                p.len(),
                q.len(),
                h.len()
            )));
        }
        let stream = &self.stream;
        // cuBLAS calls act on the calling thread's current context; cudarc binds it for its own calls only.
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        let (pp, _sp) = p.device_ptr(stream);
        let (pq, _sq) = q.device_ptr(stream);
        let (ph, _sh) = h.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 1.0f32);
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let (d_i, m_i, ld_i) = (d as c_int, m as c_int, ld as c_int);
        let _r = range(names.range);
        // SAFETY: every operand element read, (r + x_bs·z) + ld·t for r < d, t < m, z < batch, is inside p and
        // q, and every H_z element written, h_bs·z + i + d·j, inside h (all checked above); ldc = d ≥ M; lda =
        // ldb = ld ≥ d; compute type 32F takes the f32 alpha and beta; distinct z write disjoint H_z (h_bs ≥
        // d² when batch > 1, checked).
        unsafe {
            br::gemm_strided_batched_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_T,
                d_i,
                d_i,
                m_i,
                &alpha as *const f32 as *const c_void,
                pq as *const c_void,
                bf16,
                ld_i,
                x_bs as i64,
                pp as *const c_void,
                bf16,
                ld_i,
                x_bs as i64,
                &beta as *const f32 as *const c_void,
                ph as *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                d_i,
                h_bs as i64,
                batch as c_int,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err(names.call))
    }

    /// H_z [d × d] += X_zᵀ X_z for z < count: X_z [k × d] row-major bf16 at the device address `a[z]`, H_z the
    /// f32 [d × d] at `c[z]` (`a`, `c`: device arrays of device addresses): one cublasGemmBatchedEx, so many
    /// Grams of one shape (an MoE block's experts, their rows padded with zeros to a common k by
    /// ops::launch_pad_rows_bf16) cost one library call. The same column-major reading as `gram_bf16`.
    ///
    /// # Safety
    /// Every `a[z]` must address k·d bf16 values and every `c[z]` d² f32 values of live device memory that
    /// stays allocated until the stream has run the call, and no two `c[z]` may overlap.
    pub(super) unsafe fn gram_bf16_ptrs(
        &self,
        a: &CudaView<u64>,
        c: &CudaView<u64>,
        d: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        let count = a.len();
        if count == 0 || d == 0 || k == 0 {
            return Ok(());
        }
        let (Ok(d_i), Ok(k_i), Ok(n_i)) = (
            c_int::try_from(d),
            c_int::try_from(k),
            c_int::try_from(count),
        ) else {
            return Err(CudaError::Shape {
                op: "gram (cuBLAS bf16, batched)",
                msg: format!("d={d}, k={k}, count={count} overflow a C int"),
            });
        };
        if c.len() != count {
            return Err(CudaError::Shape {
                op: "gram (cuBLAS bf16, batched)",
                msg: format!("{count} operands for {} accumulators", c.len()),
            });
        }
        let stream = &self.stream;
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        let (pa, _sa) = a.device_ptr(stream);
        let (pc, _sc) = c.device_ptr(stream);
        let (alpha, beta) = (1.0f32, 1.0f32);
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let _r = range(c"gram_bf16_ptrs");
        // SAFETY: the caller's contract covers the addresses the arrays hold; the arrays themselves hold
        // `count` addresses each (checked above); lda = ldb = ldc = d ≥ M; compute type 32F takes f32 scalars.
        unsafe {
            sys::cublasGemmBatchedEx(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_T,
                d_i,
                d_i,
                k_i,
                &alpha as *const f32 as *const c_void,
                pa as *const *const c_void,
                bf16,
                d_i,
                pa as *const *const c_void,
                bf16,
                d_i,
                &beta as *const f32 as *const c_void,
                pc as *const *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                d_i,
                n_i,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(blas_err("gemm_batched_ex bf16 (gram)"))
    }

    /// V's statistics, v3 (hessian.cu attn_probs_bf16): the unscaled scores S_z [t × t] = Q_z K_zᵀ of one head
    /// for z < batch sequences, f32. Q_z is rows z·q_bs/ldq.. of the view `q` (which starts at the head's
    /// first column), t rows of d_h with row stride ldq; K_z likewise with k_bs and ldk; S_z at z·t².
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attn_scores(
        &self,
        s: &mut CudaViewMut<f32>,
        q: &CudaView<f32>,
        k: &CudaView<f32>,
        (t, d_h, batch): (usize, usize, usize),
        (ldq, q_bs): (usize, usize),
        (ldk, k_bs): (usize, usize),
    ) -> Result<(), CudaError> {
        let bad = |msg: String| CudaError::Shape {
            op: "attn_scores (cuBLAS)",
            msg,
        };
        if t == 0 || d_h == 0 || batch == 0 {
            return Ok(());
        }
        let (Ok(t_i), Ok(dh_i), Ok(ldq_i), Ok(ldk_i), Ok(b_i)) = (
            c_int::try_from(t),
            c_int::try_from(d_h),
            c_int::try_from(ldq),
            c_int::try_from(ldk),
            c_int::try_from(batch),
        ) else {
            return Err(bad(format!(
                "t={t}, d_h={d_h}, ldq={ldq}, ldk={ldk}, batch={batch} overflow a C int"
            )));
        };
        let last = |ld: usize, bs: usize| (batch - 1) * bs + (t - 1) * ld + d_h;
        if d_h > ldq.min(ldk)
            || q.len() < last(ldq, q_bs)
            || k.len() < last(ldk, k_bs)
            || s.len() < batch * t * t
        {
            return Err(bad(format!(
                "q.len={}, k.len={}, s.len={} for t={t}, d_h={d_h}, batch={batch}, ldq={ldq}, q_bs={q_bs}, \
                 ldk={ldk}, k_bs={k_bs}",
                q.len(),
                k.len(),
                s.len()
            )));
        }
        // Row-major S [t_q × t_k] is column-major Sᵀ = K Qᵀ: A = K (column-major [d_h × t], ld ldk) transposed,
        // B = Q (column-major [d_h × t], ld ldq) as is.
        let cfg = StridedBatchedConfig {
            gemm: GemmConfig {
                transa: sys::cublasOperation_t::CUBLAS_OP_T,
                transb: sys::cublasOperation_t::CUBLAS_OP_N,
                m: t_i,
                n: t_i,
                k: dh_i,
                alpha: 1.0f32,
                lda: ldk_i,
                ldb: ldq_i,
                beta: 0.0f32,
                ldc: t_i,
            },
            batch_size: b_i,
            stride_a: k_bs as i64,
            stride_b: q_bs as i64,
            stride_c: (t * t) as i64,
        };
        let _r = range(c"attn_scores");
        // SAFETY: every element addressed is inside q, k and s (checked above: the last sequence's last row
        // ends at `last`), lda = ldk ≥ d_h = K, ldb = ldq ≥ K, ldc = t = M; beta = 0, so s is only written.
        unsafe { self.sgemm_strided(cfg, k, q, s, "sgemm (attention scores)") }
    }

    /// V's statistics, v3: Y_z [t × d] = A_z [t × t] · X_z [t × d] for z < batch, bf16 operands and output, f32
    /// accumulation; A_z at z·t², X_z and Y_z at z·t·d, all row-major and dense.
    pub(super) fn attn_times_x_bf16(
        &self,
        y: &mut CudaViewMut<u16>,
        a: &CudaView<u16>,
        x: &CudaView<u16>,
        (t, d, batch): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let bad = |msg: String| CudaError::Shape {
            op: "attn_times_x (cuBLAS bf16)",
            msg,
        };
        if t == 0 || d == 0 || batch == 0 {
            return Ok(());
        }
        let (Ok(t_i), Ok(d_i), Ok(b_i)) = (
            c_int::try_from(t),
            c_int::try_from(d),
            c_int::try_from(batch),
        ) else {
            return Err(bad(format!("t={t}, d={d}, batch={batch} overflow a C int")));
        };
        if a.len() < batch * t * t || x.len() < batch * t * d || y.len() < batch * t * d {
            return Err(bad(format!(
                "a.len={}, x.len={}, y.len={} for t={t}, d={d}, batch={batch}",
                a.len(),
                x.len(),
                y.len()
            )));
        }
        let stream = &self.stream;
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        let (pa, _sa) = a.device_ptr(stream);
        let (px, _sx) = x.device_ptr(stream);
        let (py, _sy) = y.device_ptr_mut(stream);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let _r = range(c"attn_times_x");
        // Row-major Y = A X is column-major Yᵀ [d × t] = Xᵀ [d × t] · Aᵀ [t × t]: A_gemm = X (ld d), B_gemm =
        // the probabilities (ld t), both as stored (N, N).
        // SAFETY: every element addressed (z < batch sequences of t·d and t² elements) is inside x, a and y
        // (checked above); lda = ldc = d = M, ldb = t = K; compute type 32F takes the f32 alpha and beta; beta
        // = 0, so y is only written; distinct z write disjoint Y_z.
        unsafe {
            br::gemm_strided_batched_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_N,
                d_i,
                t_i,
                t_i,
                &alpha as *const f32 as *const c_void,
                px as *const c_void,
                bf16,
                d_i,
                (t * d) as i64,
                pa as *const c_void,
                bf16,
                t_i,
                (t * t) as i64,
                &beta as *const f32 as *const c_void,
                py as *mut c_void,
                bf16,
                d_i,
                (t * d) as i64,
                b_i,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("gemm_strided_batched_ex bf16 (A X)"))
    }

    /// Y [m × n] = X [m × k] · W [n × k]ᵀ (+ bias [n]) on the handle's stream (asynchronous). Every element
    /// of Y is written (beta = 0: cuBLAS does not read C, so a poisoned Y stays a valid test).
    #[allow(clippy::too_many_arguments)]
    pub fn linear(
        &self,
        k_ops: &OpsKernels,
        variant: LinearVariant,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        let shape_err = |msg: &str| CudaError::Shape {
            op: "linear",
            msg: format!(
                "{msg} (m={m}, k={k}, n={n}, x.len={}, w.len={}, y.len={}, bias.len={:?})",
                x.len(),
                w.len(),
                y.len(),
                bias.map(|b| b.len())
            ),
        };
        let (Ok(m_i), Ok(k_i), Ok(n_i)) =
            (c_int::try_from(m), c_int::try_from(k), c_int::try_from(n))
        else {
            return Err(shape_err(
                "m, k and n must fit in a C int (cuBLAS's 32-bit API)",
            ));
        };
        if m == 0 || k == 0 || n == 0 {
            return Err(shape_err("m, k and n must be ≥ 1"));
        }
        if x.len() != m * k || w.len() != n * k || y.len() != m * n {
            return Err(shape_err(
                "buffers do not match X [m × k], W [n × k], Y [m × n]",
            ));
        }
        if bias.is_some_and(|b| b.len() != n) {
            return Err(shape_err("bias is not [n]"));
        }
        let stream = &self.stream;
        // cuBLAS calls act on the calling thread's current context; cudarc binds it for its own calls only.
        stream
            .context()
            .bind_to_thread()
            .map_err(driver("bind context"))?;
        let handle = *self.blas.handle();
        let op_t = sys::cublasOperation_t::CUBLAS_OP_T;
        let op_n = sys::cublasOperation_t::CUBLAS_OP_N;
        let (alpha, beta) = (1.0f32, 0.0f32);
        match variant {
            LinearVariant::F32 => {
                let _r = range(c"linear_sgemm");
                let (pw, _sw) = w.device_ptr(stream);
                let (px, _sx) = x.device_ptr(stream);
                let (py, _sy) = y.device_ptr_mut(stream);
                // SAFETY: see the module header for the row-major mapping: A = W is k × n column-major with
                // lda = k (n·k f32), B = X is k × m with ldb = k (m·k f32), C = Y is n × m with ldc = n (m·n
                // f32), all checked above; alpha and beta are host scalars (the default pointer mode).
                unsafe {
                    br::sgemm(
                        handle,
                        op_t,
                        op_n,
                        n_i,
                        m_i,
                        k_i,
                        &alpha,
                        pw as *const f32,
                        k_i,
                        px as *const f32,
                        k_i,
                        &beta,
                        py as *mut f32,
                        n_i,
                    )
                }
                .map_err(blas_err("sgemm"))?;
            }
            LinearVariant::Bf16 => {
                // SAFETY: launch_f32_to_bf16 writes every element before the GEMM reads it.
                let mut xb =
                    unsafe { stream.alloc::<u16>(m * k) }.map_err(driver("alloc bf16 X"))?;
                let mut wb =
                    unsafe { stream.alloc::<u16>(n * k) }.map_err(driver("alloc bf16 W"))?;
                ops::launch_f32_to_bf16(stream, k_ops, &mut xb, x)?;
                ops::launch_f32_to_bf16(stream, k_ops, &mut wb, w)?;
                let _r = range(c"linear_gemm_bf16");
                let (pw, _sw) = wb.device_ptr(stream);
                let (px, _sx) = xb.device_ptr(stream);
                let (py, _sy) = y.device_ptr_mut(stream);
                let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
                // SAFETY: as for sgemm, with A and B the bf16 copies (u16 bit patterns, same element counts)
                // and C f32; compute type 32F takes f32 alpha and beta.
                unsafe {
                    br::gemm_ex(
                        handle,
                        op_t,
                        op_n,
                        n_i,
                        m_i,
                        k_i,
                        &alpha as *const f32 as *const c_void,
                        pw as *const c_void,
                        bf16,
                        k_i,
                        px as *const c_void,
                        bf16,
                        k_i,
                        &beta as *const f32 as *const c_void,
                        py as *mut c_void,
                        sys::cudaDataType_t::CUDA_R_32F,
                        n_i,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(blas_err("gemm_ex bf16"))?;
                // xb and wb are freed stream-ordered (cudarc frees asynchronously on their stream), after
                // the GEMM has read them.
            }
        }
        if let Some(b) = bias {
            ops::launch_bias_add(stream, k_ops, y, b, n)?;
        }
        Ok(())
    }
}

/// The SGEMM of `Blas::rows_times_h`: C [m × n] = A [m × n] · H [n × n], row-major, as column-major
/// cuBLAS sees it: Cᵀ (n × m, ld n) = Hᵀ (n × n, ld n) · Aᵀ (n × m, ld n), no transposes, H passed as the
/// first operand and A as the second.
pub(super) fn rows_times_h_config(m: usize, n: usize) -> Result<GemmConfig<f32>, String> {
    let (mi, ni) = match (i32::try_from(m), i32::try_from(n)) {
        (Ok(mi), Ok(ni)) => (mi, ni),
        _ => return Err(format!("m={m} or n={n} over i32")),
    };
    let op_n = sys::cublasOperation_t::CUBLAS_OP_N;
    Ok(GemmConfig {
        transa: op_n,
        transb: op_n,
        m: ni,
        n: mi,
        k: ni,
        alpha: 1.0f32,
        lda: ni,
        ldb: ni,
        beta: 0.0f32,
        ldc: ni,
    })
}
