//! `run --asym-calib` on the device (quant/asym.rs has the algebra): D's sums (`QuantOps::stat_diff_cross`)
//! and the products of the target W + α·W·(s·D)·(H + μI)⁻¹ (`QuantOps::ridge_shift`, quant.rs), through
//! cuBLAS. The target reads the factor GPTQ's sweeps use, U = chol((H + μI)⁻¹)ᵀ, so (H + μI)⁻¹ = UᵀU and no
//! solve is needed; the host sees only H's diagonal (n values, for μ and the dead inputs) and U's status.
//!
//! Projected cost for a 7B block with 128 × 2048 calibration tokens (not yet measured on a GPU): D's four
//! crosses, 2·m·n² each, ≈ 90 TFLOP in bf16 (≈ 0.2 s at gram_bf16's measured 430–570 TFLOP/s); per linear
//! three f32 GEMMs of 2·rows·n² (≈ 7 TFLOP a block, ≈ 0.12 s at ≈ 60 TFLOP/s); per input one factor and one
//! read of H's diagonal, shared by the linears that read it (four a block: q/k/v, o, gate/up, down; ≈ 0.13 s,
//! most of it down_proj's n = 11008, by solver.rs's measured potrf + trtri).

use super::core::launch_sub;
use super::gemm::Blas;
use super::ops::launch_f32_to_bf16;
use super::{CudaBackend, CudaError, driver};
use crate::ops::Tensor;
use cudarc::cublas::{GemmConfig, StridedBatchedConfig, sys};
use cudarc::driver::CudaSlice;
use std::ffi::c_int;

fn shape(op: &'static str, msg: String) -> CudaError {
    CudaError::Shape { op, msg }
}

impl CudaBackend {
    /// acc [n × n] += (A − B)ᵀ B for A and B [m × n]: the difference in f32, then both operands in bf16 with
    /// f32 accumulation, as the statistics' Grams (`Blas::gram_bf16`).
    pub(super) fn try_diff_cross(
        &self,
        blas: &Blas,
        acc: &mut CudaSlice<f32>,
        a: &Tensor,
        b: &Tensor,
        m: usize,
        n: usize,
    ) -> Result<(), CudaError> {
        if acc.len() != n * n || a.len() != m * n || b.len() != m * n {
            return Err(shape(
                "diff_cross",
                format!(
                    "acc.len={} a.len={} b.len={} for m={m}, n={n}",
                    acc.len(),
                    a.len(),
                    b.len()
                ),
            ));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (a, b) = (self.dev(a)?, self.dev(b)?);
        // SAFETY (all three): the launch that follows each allocation writes every element before it is read.
        let mut diff = unsafe { self.stream.alloc::<f32>(m * n) }.map_err(driver("alloc A − B"))?;
        launch_sub(&self.stream, &self.quant.core, &mut diff, &a, &b)?;
        let mut p =
            unsafe { self.stream.alloc::<u16>(m * n) }.map_err(driver("alloc bf16 A − B"))?;
        launch_f32_to_bf16(&self.stream, &self.ops, &mut p, &diff)?;
        drop(diff);
        let mut q = unsafe { self.stream.alloc::<u16>(m * n) }.map_err(driver("alloc bf16 B"))?;
        launch_f32_to_bf16(&self.stream, &self.ops, &mut q, &b)?;
        blas.cross_bf16(acc, &p, &q, m, n)
    }

    /// T = W + c·((W D) Uᵀ) U for W [rows × n] and D, U [n × n], all row-major f32: three SGEMMs (f32, as the
    /// sweeps' own products), the last one's β = 1 onto a copy of W. Column-major cuBLAS sees each row-major
    /// buffer transposed (gemm.rs's header): (W D)ᵀ = Dᵀ Wᵀ is gemm(N, N) of the buffers D, W; (B Uᵀ)ᵀ = U Bᵀ
    /// is gemm(T, N) of U, B; (C U)ᵀ = Uᵀ Cᵀ is gemm(N, N) of U, C.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_ridge_products(
        &self,
        blas: &Blas,
        w: &CudaSlice<f32>,
        d: &CudaSlice<f32>,
        u: &CudaSlice<f32>,
        rows: usize,
        n: usize,
        c: f32,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let bad = |msg: String| shape("ridge_shift", msg);
        if w.len() != rows * n || d.len() != n * n || u.len() != n * n || rows == 0 || n == 0 {
            return Err(bad(format!(
                "w.len={} d.len={} u.len={} for rows={rows}, n={n} (≥ 1)",
                w.len(),
                d.len(),
                u.len()
            )));
        }
        let (Ok(n_i), Ok(r_i)) = (c_int::try_from(n), c_int::try_from(rows)) else {
            return Err(bad(format!("rows={rows}, n={n} overflow a C int")));
        };
        let op = |t: bool| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        // Every product is [n × rows] column-major from an [n × n] A and an [n × rows] B, all leading
        // dimensions n.
        let gemm = |transa: bool,
                    a: &CudaSlice<f32>,
                    b: &CudaSlice<f32>,
                    out: &mut CudaSlice<f32>,
                    alpha: f32,
                    beta: f32,
                    what: &'static str| {
            let cfg = StridedBatchedConfig {
                gemm: GemmConfig {
                    transa: op(transa),
                    transb: op(false),
                    m: n_i,
                    n: r_i,
                    k: n_i,
                    alpha,
                    lda: n_i,
                    ldb: n_i,
                    beta,
                    ldc: n_i,
                },
                batch_size: 1,
                stride_a: 0,
                stride_b: 0,
                stride_c: 0,
            };
            // SAFETY: A holds n², B and the output rows·n f32 (checked above; every buffer here is of those
            // sizes); the leading dimensions n meet cuBLAS's minimum M = K = n.
            unsafe { blas.sgemm_strided(cfg, a, b, out, what) }
        };
        // SAFETY (both): the GEMM that follows writes every element with β = 0 before anything reads it.
        let mut wd = unsafe { self.stream.alloc::<f32>(rows * n) }.map_err(driver("alloc W D"))?;
        gemm(false, d, w, &mut wd, 1.0, 0.0, "sgemm W D (ridge_shift)")?;
        let mut wdu =
            unsafe { self.stream.alloc::<f32>(rows * n) }.map_err(driver("alloc W D Uᵀ"))?;
        gemm(
            true,
            u,
            &wd,
            &mut wdu,
            1.0,
            0.0,
            "sgemm W D Uᵀ (ridge_shift)",
        )?;
        drop(wd);
        let mut t = self.stream.clone_dtod(w).map_err(driver("copy W"))?;
        gemm(
            false,
            u,
            &wdu,
            &mut t,
            c,
            1.0,
            "sgemm W + c W D UᵀU (ridge_shift)",
        )?;
        Ok(t)
    }
}
