//! `QuantOps` on CUDA: the quantization core on device buffers (design.md §12 "Device residency"). A
//! block's accumulators, Hessians, factors, weights, grids and codes are `Mat`s in device memory from the
//! statistics to the packed output; the host receives diagonals (O(n)), a few sums per linear and the packed
//! tensors (BoA's per-head row Hessians are made on the device too: `rope_row_hessians`).
//!
//! Kernels: statistics hessian.rs, factors cholesky.rs / solver.rs (cuSOLVER for n > 128), data movement and
//! small passes core.rs, sweeps sweep.rs, the scale search search.rs, the report's products gemm.rs (cuBLAS).
//! Every input must already be on the device (`CudaBackend::upload_mat`): a host `Mat` here is an error,
//! never a silent copy.
//!
//! Still through the host, each saying so at its method: the static-grid BoA sweep and V's statistics with
//! d_h > 256 (no model we target; Gemma 3's 256 and sliding windows run on the device). The scale search
//! (static and the GPTQ sweep's dynamic groups) is on the device (search.rs); the BoA sweep's dynamic groups
//! are searched inside its own kernel (boa_dynamic.rs, any d_h).

use super::cholesky::{CHOLESKY_MAX_N, launch_cholesky};
use super::core::{
    DOT_CTAS, launch_add_diag, launch_diag, launch_dot_partials, launch_finish_sym, launch_gather,
    launch_pack, launch_permute_sym, launch_rtn, launch_set_diag, launch_sub, launch_u_row_f,
    launch_zero_cols,
};
use super::hessian::{ATTN_MAX_DH, launch_rope_moments, launch_rope_row_hessians};
use super::solver::FactorVariant;
use super::sweep::{
    BOA_MAX_DH, BoaBlockVariant, BoaBuffers, GPTQ_MAX_BLOCK, GptqBlockVariant, GptqBuffers,
    GptqDynamicBuffers, Trailing, TrailingVariant, launch_boa_sweep, launch_gptq_sweep,
    launch_gptq_sweep_dynamic,
};
use super::{CudaBackend, CudaError, driver};
use crate::backend::cpu::CpuBackend;
use crate::ops::{
    AttnShape, Codes, GridMode, Grids, Mat, MatData, Packed, QuadSums, QuantOps, QuantSpec,
    QuantizedLinear, Result, RopeAverage, RowGram, Swept, Tensor, check_ridge_shift,
    check_rope_row_hessians,
};
use anyhow::{anyhow, bail};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};

/// The device buffer of a `Mat` (f32 in device memory), or an error naming what is elsewhere.
fn dev<'a>(m: &'a Mat, what: &str) -> Result<&'a CudaSlice<f32>> {
    match &m.data {
        MatData::F32(Tensor::Device(d)) => Ok(d),
        _ => bail!(
            "cuda: {what} {} is not in device memory (upload it with upload_mat)",
            m.describe()
        ),
    }
}

fn dev_mut<'a>(m: &'a mut Mat, what: &str) -> Result<&'a mut CudaSlice<f32>> {
    let desc = m.describe();
    match &mut m.data {
        MatData::F32(Tensor::Device(d)) => Ok(d),
        _ => bail!("cuda: {what} {desc} is not in device memory"),
    }
}

/// Runs a tensor-form statistic on an accumulator's device tensor (which must already be on the device: the
/// tensor methods would otherwise upload it).
fn with_acc(
    acc: &mut Mat,
    f: impl FnOnce(&mut Tensor) -> std::result::Result<(), CudaError>,
) -> Result<()> {
    dev(acc, "accumulator")?;
    let MatData::F32(t) = &mut acc.data else {
        unreachable!("checked by dev")
    };
    Ok(f(t)?)
}

fn into_dev(m: Mat, what: &str) -> Result<CudaSlice<f32>> {
    let desc = m.describe();
    match m.data {
        MatData::F32(Tensor::Device(d)) => Ok(d),
        _ => bail!("cuda: {what} {desc} is not in device memory"),
    }
}

fn dmat(d: CudaSlice<f32>, batch: usize, rows: usize, cols: usize) -> Mat {
    Mat::tensor(Tensor::Device(d), batch, rows, cols)
}

fn codes_dev<'a>(c: &'a Codes, what: &str) -> Result<&'a CudaSlice<u8>> {
    match c {
        Codes::Device(d) => Ok(d),
        Codes::Host(_) => bail!("cuda: {what} are not in device memory"),
    }
}

fn check_perm(p: &[usize], n: usize, what: &str) -> Result<()> {
    let mut seen = vec![false; n];
    if p.len() != n
        || p.iter()
            .any(|&i| i >= n || std::mem::replace(&mut seen[i], true))
    {
        bail!("cuda: {what} is not a permutation of 0..{n}");
    }
    Ok(())
}

impl CudaBackend {
    /// `QuantOps::stat_v_col` (d_h ≤ 256) through the given way of forming A_h X: the backend's own, or the
    /// bench's side-by-side rows.
    #[allow(clippy::too_many_arguments)]
    pub fn stat_v_col_with(
        &self,
        variant: super::AttnXVariant,
        acc: &mut Mat,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<()> {
        with_acc(acc, |t| {
            self.try_v_col_covariance_with(variant, t, x, q, k, s, n_seq)
        })
    }

    pub(super) fn upload<T: DeviceRepr>(
        &self,
        v: &[T],
        what: &'static str,
    ) -> std::result::Result<CudaSlice<T>, CudaError> {
        self.counters.htod(std::mem::size_of_val(v));
        self.stream.clone_htod(v).map_err(driver(what))
    }

    fn download<T: DeviceRepr + Default + Clone, D: DevicePtr<T>>(
        &self,
        d: &D,
        what: &'static str,
    ) -> std::result::Result<Vec<T>, CudaError> {
        self.counters.dtoh(d.len() * size_of::<T>());
        self.counters.sync();
        // Into pageable memory the copy returns only when it is done (CUDA's rule), and it reports a fault of
        // the work queued before it: no synchronization of its own.
        self.stream.clone_dtoh(d).map_err(driver(what))
    }

    fn zeros_of<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
        what: &'static str,
    ) -> std::result::Result<CudaSlice<T>, CudaError> {
        self.stream.alloc_zeros::<T>(n.max(1)).map_err(driver(what))
    }

    /// An output every element of which the next kernel writes: NaN-filled (u8: 0xFF) when poisoning, so
    /// the parity tests see an element a kernel forgets, else uninitialised.
    fn out_f32(&self, n: usize) -> std::result::Result<CudaSlice<f32>, CudaError> {
        self.output(n.max(1))
    }

    fn out_u8(&self, n: usize) -> std::result::Result<CudaSlice<u8>, CudaError> {
        self.codes_output(n.max(1))
    }

    fn copy_of(&self, d: &CudaSlice<f32>) -> std::result::Result<CudaSlice<f32>, CudaError> {
        self.stream.clone_dtod(d).map_err(driver("copy matrix"))
    }

    /// A host `Mat` copied into device memory (f32), the form every method here takes; a device one is
    /// moved. Tests and tools use it; the pipeline's buffers are born on the device.
    pub fn upload_mat(&self, m: Mat) -> Result<Mat> {
        let (b, r, c) = (m.batch, m.rows, m.cols);
        let d = match m.data {
            MatData::F32(Tensor::Device(d)) => d,
            MatData::F32(t) => self.upload(
                t.host().ok_or_else(|| anyhow!("tensor unreadable"))?,
                "upload matrix",
            )?,
            MatData::F64(v) => self.upload(
                &v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                "upload matrix",
            )?,
        };
        Ok(dmat(d, b, r, c))
    }

    /// A device `Mat` read back as a host one: f32, or f64 when `as_f64` (for the CPU's oracle methods).
    fn host_mat(&self, m: &Mat, as_f64: bool) -> Result<Mat> {
        let v = self.download(dev(m, "matrix")?, "download matrix")?;
        Ok(match as_f64 {
            true => Mat::f64(
                v.iter().map(|&x| x as f64).collect(),
                m.batch,
                m.rows,
                m.cols,
            ),
            false => Mat::f32(v, m.batch, m.rows, m.cols),
        })
    }

    fn host_grids(&self, g: &Grids) -> Result<Grids> {
        Ok(Grids {
            scale: self.host_mat(&g.scale, false)?,
            zero: self.host_mat(&g.zero, false)?,
        })
    }

    fn device_grids(&self, g: Grids) -> Result<Grids> {
        Ok(Grids {
            scale: self.upload_mat(g.scale)?,
            zero: self.upload_mat(g.zero)?,
        })
    }

    /// The trailing-update variant the sweeps run with: the selected one, or the FFMA kernel when cuBLAS is
    /// selected but cannot be opened (said once on stderr by `blas`).
    pub fn trailing_variant_in_use(&self) -> TrailingVariant {
        match self.trailing_variant {
            TrailingVariant::Cublas if self.blas().is_ok() => TrailingVariant::Cublas,
            _ => TrailingVariant::Ffma,
        }
    }

    /// The factor variant the large factors run with: the selected one, or trtri when cuBLAS cannot be opened.
    pub fn factor_variant_in_use(&self) -> FactorVariant {
        match self.factor_variant {
            FactorVariant::Trsm if self.blas().is_ok() => FactorVariant::Trsm,
            _ => FactorVariant::Trtri,
        }
    }

    /// The GPTQ block variant the sweeps run with: the selected one, or v1 when v2 could not be opted into its
    /// shared memory at load.
    pub fn gptq_block_variant_in_use(&self) -> GptqBlockVariant {
        self.quant.sweep.gptq_block_in_use(self.gptq_block_variant)
    }

    /// The BoA block variant the sweeps run with: the selected one, or v1 when v2 could not be opted into its
    /// shared memory at load (a device with less than 210 KB per block).
    pub fn boa_block_variant_in_use(&self) -> BoaBlockVariant {
        self.quant.sweep.boa_block_in_use(self.boa_block_variant)
    }

    fn trailing(&self) -> Trailing<'_> {
        match self.trailing_variant {
            TrailingVariant::Cublas => self.blas().map_or(Trailing::Ffma, Trailing::Cublas),
            TrailingVariant::Ffma => Trailing::Ffma,
        }
    }

    /// cuSOLVER, opened on first use; the reason (printed once) when it cannot be.
    pub(super) fn solver(&self) -> std::result::Result<&super::solver::Solver, &str> {
        self.solver
            .get_or_init(|| {
                let s = super::solver::Solver::new(&self.stream);
                if let Err(why) = &s {
                    eprintln!(
                        "{}: {why}; Cholesky factors with n > {CHOLESKY_MAX_N} cannot run",
                        self.name
                    );
                }
                s
            })
            .as_ref()
            .map_err(String::as_str)
    }

    /// Factors H_b (n ≤ 128: the batched kernel; else cuSOLVER) of each b in `which` into u; true where H_b
    /// factored. The status comes back in one download.
    fn factor_subset(
        &self,
        h: &CudaSlice<f32>,
        u: &mut CudaSlice<f32>,
        n: usize,
        which: &[usize],
    ) -> Result<Vec<bool>> {
        let nn = n * n;
        let all = which.len() * nn == h.len() && which.iter().enumerate().all(|(i, &b)| i == b);
        if n <= CHOLESKY_MAX_N {
            let mut st = self.zeros_of::<i32>(which.len(), "alloc status")?;
            if all {
                launch_cholesky(
                    &self.stream,
                    &self.quant.cholesky,
                    u,
                    &mut st,
                    h,
                    n,
                    which.len(),
                )?;
            } else {
                // A damping retry of a few matrices: each through a one-matrix scratch pair.
                let mut hb = self.zeros_of::<f32>(nn, "alloc H")?;
                let mut ub = self.zeros_of::<f32>(nn, "alloc U")?;
                let mut s1 = self.zeros_of::<i32>(1, "alloc status")?;
                for (i, &b) in which.iter().enumerate() {
                    self.stream
                        .memcpy_dtod(&h.slice(b * nn..(b + 1) * nn), &mut hb)
                        .map_err(driver("stage H"))?;
                    launch_cholesky(
                        &self.stream,
                        &self.quant.cholesky,
                        &mut ub,
                        &mut s1,
                        &hb,
                        n,
                        1,
                    )?;
                    self.stream
                        .memcpy_dtod(&ub, &mut u.slice_mut(b * nn..(b + 1) * nn))
                        .map_err(driver("place U"))?;
                    self.stream
                        .memcpy_dtod(&s1, &mut st.slice_mut(i..i + 1))
                        .map_err(driver("place status"))?;
                }
            }
            let st = self.download(&st, "download factor status")?;
            return Ok(st[..which.len()].iter().map(|&s| s == 0).collect());
        }
        let solver = self.solver().map_err(|why| {
            anyhow!("cuSOLVER is needed for factors of n = {n} > {CHOLESKY_MAX_N}: {why}")
        })?;
        let trsm = match self.factor_variant {
            FactorVariant::Trsm => self.blas().ok(),
            FactorVariant::Trtri => None,
        };
        let st = solver.upper_inverse_subset(&self.quant.cholesky, h, u, n, which, trsm)?;
        let st = self.download(&st, "download factor status")?;
        // Per matrix: potrf info, trtri info, non-finite flag; all zero when it factored.
        Ok(st
            .chunks(3)
            .take(which.len())
            .map(|s| s.iter().all(|&x| x == 0))
            .collect())
    }

    /// Σ a∘b over each (a, b, range) of `dots`, f64, one slot each: every product's partial sums queued into
    /// one buffer, nothing read back (`read_quad_sums` reads them, one host synchronization for all).
    fn dots(
        &self,
        dots: &[(&CudaSlice<f32>, &CudaSlice<f32>, std::ops::Range<usize>)],
    ) -> Result<QuadSums> {
        let mut partials = self.zeros_of::<f64>(dots.len() * DOT_CTAS, "alloc partial sums")?;
        for (i, (a, b, range)) in dots.iter().enumerate() {
            launch_dot_partials(
                &self.stream,
                &self.quant.core,
                &mut partials.slice_mut(i * DOT_CTAS..(i + 1) * DOT_CTAS),
                &a.slice(range.clone()),
                &b.slice(range.clone()),
            )?;
        }
        Ok(QuadSums::Device {
            partials,
            slots: dots.len(),
            used: dots.len(),
        })
    }

    /// [rows × n] (grids: [rows × n_groups]) gathered or scattered by rows and per-part column permutations.
    fn permute_dev<T: super::core::Gathered + ValidAsZeroBits>(
        &self,
        src: &CudaSlice<T>,
        rows: usize,
        n: usize,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
        scatter: bool,
    ) -> Result<CudaSlice<T>> {
        let rp: Vec<u32> = row_perm.iter().map(|&r| r as u32).collect();
        let cp: Vec<u32> = col_perms.iter().flatten().map(|&c| c as u32).collect();
        let (rp_d, cp_d) = (
            self.upload(&rp, "upload row permutation")?,
            self.upload(&cp, "upload column permutation")?,
        );
        let mut out = self.zeros_of::<T>(rows * n, "alloc permuted")?;
        let per_part = rows / col_perms.len().max(1);
        launch_gather(
            &self.stream,
            &self.quant.core,
            &mut out,
            src,
            &rp_d,
            &cp_d,
            rows,
            n,
            per_part.max(1),
            scatter,
        )?;
        Ok(out)
    }

    fn permute_grids(&self, g: &Grids, row_perm: &[usize], scatter: bool) -> Result<Grids> {
        let (rows, ng) = (g.rows(), g.n_groups());
        let id = vec![(0..ng).collect::<Vec<usize>>()];
        let one = |m: &Mat| -> Result<Mat> {
            Ok(dmat(
                self.permute_dev(dev(m, "grids")?, rows, ng, row_perm, &id, scatter)?,
                1,
                rows,
                ng,
            ))
        };
        Ok(Grids {
            scale: one(&g.scale)?,
            zero: one(&g.zero)?,
        })
    }

    fn check_perms(
        &self,
        rows: usize,
        n: usize,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<()> {
        check_perm(row_perm, rows, "row permutation")?;
        if col_perms.is_empty() || !rows.is_multiple_of(col_perms.len()) {
            bail!(
                "cuda: {} column permutations for {rows} rows",
                col_perms.len()
            );
        }
        col_perms
            .iter()
            .try_for_each(|p| check_perm(p, n, "column permutation"))
    }
}

/// The statistics computed on the host (wide heads, `--qk-norm-hessian exact`).
impl CudaBackend {
    /// A host copy of `t`.
    fn to_host(&self, t: &Tensor) -> Result<Tensor> {
        Ok(Tensor::Host(
            crate::backend::Backend::read(self, t)?.into_owned(),
        ))
    }

    /// acc (f32 on the device) += the CPU's f64 sums `cpu` of the same shape.
    fn add_host_sums(&self, acc: &mut Mat, cpu: &Mat, what: &str) -> Result<()> {
        let mut sum = self.read_f32(acc)?;
        let cpu_sum = cpu
            .host_f64()
            .ok_or_else(|| anyhow!("{what}: the CPU's sums are not f64"))?;
        sum.iter_mut()
            .zip(cpu_sum)
            .for_each(|(x, &y)| *x += y as f32);
        *dev_mut(acc, "accumulator")? = self.upload(&sum, "upload accumulator")?;
        Ok(())
    }
}

impl QuantOps for CudaBackend {
    fn signed_scales(&self) -> bool {
        false
    }

    fn stat_acc(&self, batch: usize, n: usize) -> Result<Mat> {
        Ok(dmat(
            self.zeros_of::<f32>(batch * n * n, "alloc accumulator")?,
            batch,
            n,
            n,
        ))
    }

    fn stat_xxt(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()> {
        let d = acc.rows;
        with_acc(acc, |t| self.try_xxt_accumulate_t(t, x, m, d))
    }

    /// Batched: row_grams.rs.
    fn stat_xxt_rows(&self, items: &mut [RowGram<'_>]) -> Result<()> {
        self.try_xxt_rows(items)
    }

    fn stat_head_cov(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()> {
        let (nh, dh) = (acc.batch, acc.rows);
        with_acc(acc, |t| self.try_head_covariance_t(t, x, m, nh, dh))
    }

    /// On the host (a round trip of X and A per call): only `run --qk-norm-hessian exact` asks for it, an
    /// experiment whose gain is measured on the CPU first (docs/architectures.md, "BoA behind a q/k norm");
    /// a device version would be one batched GEMM for the quadratic forms and two Grams of scaled rows.
    fn stat_norm_jacobian(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        m: usize,
        a: &Mat,
        eps: f32,
    ) -> Result<()> {
        let x = self.to_host(x)?;
        let a = Mat::f64(self.read_f64(a)?, a.batch, a.rows, a.cols);
        let mut cpu = CpuBackend.stat_acc(acc.batch, acc.rows)?;
        CpuBackend.stat_norm_jacobian(&mut cpu, &x, m, &a, eps)?;
        self.add_host_sums(acc, &cpu, "stat_norm_jacobian")
    }

    /// On the device for d_h ≤ 256, sliding windows included (the Llama family, Mistral, Gemma 3). Wider heads
    /// (no model we target) do not fit the attention tiles: the CPU's sums of the same sequences are added in
    /// (a host round trip of X, Q and K).
    fn stat_v_col(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<()> {
        // Wider heads than the kernels take: on the host.
        if s.d_h > ATTN_MAX_DH {
            let mut a = CpuBackend.stat_acc(acc.batch, acc.rows)?;
            let (x, q, k) = (self.to_host(x)?, self.to_host(q)?, self.to_host(k)?);
            CpuBackend.stat_v_col(&mut a, &x, &q, &k, s, n_seq)?;
            return self.add_host_sums(acc, &a, "stat_v_col");
        }
        self.stat_v_col_with(self.attn_x_variant, acc, x, q, k, s, n_seq)
    }

    fn stat_finish(&self, acc: Mat, tokens: usize, div: f64) -> Result<Mat> {
        let (b, n) = (acc.batch, acc.rows);
        let f = if tokens == 0 {
            0.0
        } else {
            2.0 / (tokens as f64 * div)
        };
        let mut d = into_dev(acc, "accumulator")?;
        launch_finish_sym(&self.stream, &self.quant.core, &mut d, n, b, f as f32)?;
        Ok(dmat(d, b, n, n))
    }

    /// cuBLAS in bf16 (ridge.rs); without cuBLAS, the CPU's sums of host copies.
    fn stat_diff_cross(&self, acc: &mut Mat, a: &Tensor, b: &Tensor, m: usize) -> Result<()> {
        let n = acc.rows;
        if acc.batch != 1 || acc.cols != n {
            bail!("stat_diff_cross: into {}", acc.describe());
        }
        match self.blas() {
            Ok(blas) => Ok(self.try_diff_cross(blas, dev_mut(acc, "accumulator")?, a, b, m, n)?),
            Err(_) => {
                let mut cpu = CpuBackend.stat_acc(1, n)?;
                CpuBackend.stat_diff_cross(&mut cpu, &self.to_host(a)?, &self.to_host(b)?, m)?;
                self.add_host_sums(acc, &cpu, "stat_diff_cross")
            }
        }
    }

    /// μ and the dead inputs from H's diagonal (one download), H + μI's factor U (`factor`: (H + μI)⁻¹ = UᵀU)
    /// once for every W, then ridge.rs's three products per W; a failed factor is None. Only the factor's
    /// status is checked for non-finite values, not the products. Without cuBLAS, the CPU's f64 targets of
    /// host copies.
    fn ridge_shift(
        &self,
        ws: &[&Mat],
        d: &Mat,
        s: f64,
        h: &Mat,
        damp: f64,
        alpha: f64,
    ) -> Result<Option<Vec<Mat>>> {
        check_ridge_shift(ws, d, h)?;
        let n = h.rows;
        let Ok(blas) = self.blas() else {
            let host = |m: &Mat| -> Result<Mat> {
                Ok(Mat::f32(self.read_f32(m)?, m.batch, m.rows, m.cols))
            };
            let hosted = ws.iter().map(|w| host(w)).collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Mat> = hosted.iter().collect();
            return CpuBackend
                .ridge_shift(&refs, &host(d)?, s, &host(h)?, damp, alpha)?
                .map(|ts| ts.into_iter().map(|t| self.upload_mat(t)).collect())
                .transpose();
        };
        let diag = self.diag(h)?;
        let mean = diag.iter().sum::<f64>() / n.max(1) as f64;
        let mu = damp * mean;
        let entries: Vec<_> = diag
            .iter()
            .enumerate()
            .map(|(i, &v)| match v {
                0.0 => (0, i, mean.max(1.0) + mu),
                v => (0, i, v + mu),
            })
            .collect();
        let mut hd = dmat(self.copy_of(dev(h, "H")?)?, 1, n, n);
        self.set_diag(&mut hd, &entries)?;
        let (u, ok) = self.factor(&hd, None, &[0])?;
        drop(hd);
        if ok.first() != Some(&true) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(ws.len());
        for w in ws {
            let t = self.try_ridge_products(
                blas,
                dev(w, "W")?,
                dev(d, "D")?,
                dev(&u, "U")?,
                w.rows,
                n,
                (alpha * s) as f32,
            )?;
            out.push(dmat(t, 1, w.rows, n));
        }
        Ok(Some(out))
    }

    /// W_outᵀ W_out per query head on the device (the head-covariance kernel over o_proj's rows), folded into
    /// the KV heads on the host: [n_heads × d_h × d_h] is small.
    fn wout_row_hessians(&self, w_o: &Mat, n_heads: usize, n_kv: usize, d_h: usize) -> Result<Mat> {
        if w_o.cols != n_heads * d_h || n_kv == 0 || !n_heads.is_multiple_of(n_kv) {
            bail!(
                "wout_row_hessians: W_o {} for {n_heads} heads of {d_h}",
                w_o.describe()
            );
        }
        let mut acc = self.stat_acc(n_heads, d_h)?;
        self.stat_head_cov(
            &mut acc,
            &Tensor::Device(self.copy_of(dev(w_o, "W_o")?)?),
            w_o.rows,
        )?;
        let per_head = self.read_f64(&acc)?;
        let gs = n_heads / n_kv;
        let dd = d_h * d_h;
        let mut out = vec![0.0; n_kv * dd];
        for h in 0..n_heads {
            for (o, &v) in out[(h / gs) * dd..(h / gs + 1) * dd]
                .iter_mut()
                .zip(&per_head[h * dd..(h + 1) * dd])
            {
                *o += v / gs as f64;
            }
        }
        self.hessian(out, n_kv, d_h)
    }

    /// On the device for d_h ≤ 256: the position moments from θ (≤ 1 KB up), then every output element from
    /// the covariances where they are; only θ and the norm weight [d_h] cross.
    fn rope_row_hessians(
        &self,
        c: &Mat,
        n_out: usize,
        rope: &RopeAverage,
        norm: Option<&[f32]>,
    ) -> Result<Mat> {
        check_rope_row_hessians(c, n_out, rope, norm)?;
        let d_h = rope.d_h();
        if d_h > ATTN_MAX_DH {
            // Wider than the moments kernel's block (no model we target): the CPU's, on a host copy.
            let host = Mat::f64(self.read_f64(c)?, c.batch, d_h, d_h);
            let h = CpuBackend.rope_row_hessians(&host, n_out, rope, norm)?;
            return self.upload_mat(h);
        }
        let half = d_h / 2;
        let (inv_freq, positions) = rope.source();
        let f_d = self.upload(inv_freq, "upload inv_freq")?;
        let mut mom = self.zeros_of::<f64>(3 * half * half, "alloc moments")?;
        launch_rope_moments(&self.stream, &self.quant.hessian, &mut mom, &f_d, positions)?;
        let ones;
        let g = match norm {
            Some(g) => g,
            None => {
                ones = vec![1f32; d_h];
                &ones
            }
        };
        let g_d = self.upload(g, "upload norm weight")?;
        let mut out = self.out_f32(n_out * d_h * d_h)?;
        launch_rope_row_hessians(
            &self.stream,
            &self.quant.hessian,
            &mut out,
            dev(c, "covariances")?,
            &mom,
            &g_d,
            n_out,
            c.batch,
            d_h,
        )?;
        Ok(dmat(out, n_out, d_h, d_h))
    }

    fn read_f64(&self, m: &Mat) -> Result<Vec<f64>> {
        Ok(self.read_f32(m)?.into_iter().map(|x| x as f64).collect())
    }

    fn read_f32(&self, m: &Mat) -> Result<Vec<f32>> {
        Ok(self.download(dev(m, "matrix")?, "download matrix")?)
    }

    fn read_codes(&self, c: &Codes) -> Result<Vec<u8>> {
        Ok(self.download(codes_dev(c, "codes")?, "download codes")?)
    }

    fn hessian(&self, v: Vec<f64>, batch: usize, n: usize) -> Result<Mat> {
        if v.len() != batch * n * n {
            bail!("hessian: {} values are not [{batch} × {n} × {n}]", v.len());
        }
        self.upload_mat(Mat::f64(v, batch, n, n))
    }

    fn diag(&self, h: &Mat) -> Result<Vec<f64>> {
        let (b, n) = (h.batch, h.rows);
        let mut d = self.out_f32(b * n)?;
        launch_diag(&self.stream, &self.quant.core, &mut d, dev(h, "H")?, n, b)?;
        Ok(self.download(&d, "download diagonal")?[..b * n]
            .iter()
            .map(|&x| x as f64)
            .collect())
    }

    fn permute_sym(&self, h: &Mat, perms: &[Vec<usize>]) -> Result<Mat> {
        let (b, n) = (h.batch, h.rows);
        if perms.len() != b {
            bail!(
                "permute_sym: {} permutations for {}",
                perms.len(),
                h.describe()
            );
        }
        perms
            .iter()
            .try_for_each(|p| check_perm(p, n, "permutation"))?;
        let p: Vec<u32> = perms.iter().flatten().map(|&i| i as u32).collect();
        let p_d = self.upload(&p, "upload permutation")?;
        let mut out = self.out_f32(b * n * n)?;
        launch_permute_sym(
            &self.stream,
            &self.quant.core,
            &mut out,
            dev(h, "H")?,
            &p_d,
            n,
            b,
        )?;
        Ok(dmat(out, b, n, n))
    }

    fn set_diag(&self, h: &mut Mat, entries: &[(usize, usize, f64)]) -> Result<()> {
        let (b, n) = (h.batch, h.rows);
        if entries.is_empty() {
            return Ok(());
        }
        if entries.iter().any(|&(m, i, _)| m >= b || i >= n) {
            bail!("set_diag: an entry outside {}", h.describe());
        }
        let mat: Vec<u32> = entries.iter().map(|e| e.0 as u32).collect();
        let idx: Vec<u32> = entries.iter().map(|e| e.1 as u32).collect();
        let val: Vec<f32> = entries.iter().map(|e| e.2 as f32).collect();
        let (m_d, i_d, v_d) = (
            self.upload(&mat, "upload entries")?,
            self.upload(&idx, "upload entries")?,
            self.upload(&val, "upload entries")?,
        );
        launch_set_diag(
            &self.stream,
            &self.quant.core,
            dev_mut(h, "H")?,
            &m_d,
            &i_d,
            &v_d,
            n,
            entries.len(),
        )?;
        Ok(())
    }

    fn add_diag(&self, h: &mut Mat, amounts: &[(usize, f64)]) -> Result<()> {
        let (b, n) = (h.batch, h.rows);
        if amounts.is_empty() {
            return Ok(());
        }
        if amounts.iter().any(|&(m, _)| m >= b) {
            bail!("add_diag: a matrix outside {}", h.describe());
        }
        let mat: Vec<u32> = amounts.iter().map(|e| e.0 as u32).collect();
        let val: Vec<f32> = amounts.iter().map(|e| e.1 as f32).collect();
        let (m_d, v_d) = (
            self.upload(&mat, "upload amounts")?,
            self.upload(&val, "upload amounts")?,
        );
        launch_add_diag(
            &self.stream,
            &self.quant.core,
            dev_mut(h, "H")?,
            &m_d,
            &v_d,
            n,
        )?;
        Ok(())
    }

    fn factor(&self, h: &Mat, u: Option<Mat>, which: &[usize]) -> Result<(Mat, Vec<bool>)> {
        let (b, n) = (h.batch, h.rows);
        if which.iter().any(|&i| i >= b) {
            bail!("factor: a matrix index ≥ {b}");
        }
        let mut ud = match u {
            Some(u) if u.batch == b && u.rows == n && u.cols == n => into_dev(u, "U")?,
            Some(u) => bail!("factor: U {} for H {}", u.describe(), h.describe()),
            None => self.zeros_of::<f32>(b * n * n, "alloc U")?,
        };
        let ok = if which.is_empty() || n == 0 {
            vec![true; which.len()]
        } else {
            self.factor_subset(dev(h, "H")?, &mut ud, n, which)?
        };
        Ok((dmat(ud, b, n, n), ok))
    }

    fn zero_cols(&self, w: &Mat, cols: &[Vec<usize>]) -> Result<Mat> {
        let (rows, n) = (w.rows, w.cols);
        if cols.is_empty()
            || !rows.is_multiple_of(cols.len())
            || cols.iter().flatten().any(|&c| c >= n)
        {
            bail!(
                "zero_cols: {} parts of columns for {}",
                cols.len(),
                w.describe()
            );
        }
        let mut out = self.copy_of(dev(w, "W")?)?;
        if cols.iter().any(|c| !c.is_empty()) {
            let mut mask = vec![0u8; cols.len() * n];
            for (p, cs) in cols.iter().enumerate() {
                for &c in cs {
                    mask[p * n + c] = 1;
                }
            }
            let m_d = self.upload(&mask, "upload dead-column mask")?;
            launch_zero_cols(
                &self.stream,
                &self.quant.core,
                &mut out,
                &m_d,
                rows,
                n,
                rows / cols.len(),
            )?;
        }
        Ok(dmat(out, 1, rows, n))
    }

    /// On the device (search.rs): the candidate table from W, the groups of every part searched as one batch
    /// of problems, the grids written in place. Uploads the H blocks' column indices (O(n) per matrix);
    /// downloads nothing and does not synchronize.
    fn search_grids(
        &self,
        w: &Mat,
        h: Option<&Mat>,
        idx: &[Vec<usize>],
        h_of_part: &[usize],
        g: usize,
        spec: &QuantSpec,
    ) -> Result<Grids> {
        let (rows, n) = (w.rows, w.cols);
        if g == 0 {
            bail!("search_grids: group width 0");
        }
        free_lattice("search_grids", spec)?;
        let hd = match h {
            Some(h) if spec.search == crate::ops::ScaleSearch::Hessian => {
                if h.rows != n || h.cols != n || h_of_part.iter().any(|&f| f >= h.batch) {
                    bail!("search_grids: H {} for W [{rows} × {n}]", h.describe());
                }
                Some((dev(h, "H")?, h.batch))
            }
            _ => None,
        };
        let (scale, zero) = self.search_grids_device(
            self.search_variant,
            dev(w, "W")?,
            rows,
            n,
            hd,
            idx,
            h_of_part,
            g,
            spec,
        )?;
        let ng = n.div_ceil(g);
        Ok(Grids {
            scale: dmat(scale, 1, rows, ng),
            zero: dmat(zero, 1, rows, ng),
        })
    }

    fn reorder(
        &self,
        w: &Mat,
        grids: Option<&Grids>,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Option<Grids>)> {
        let (rows, n) = (w.rows, w.cols);
        self.check_perms(rows, n, row_perm, col_perms)?;
        let wp = dmat(
            self.permute_dev(dev(w, "W")?, rows, n, row_perm, col_perms, false)?,
            1,
            rows,
            n,
        );
        let gp = grids
            .map(|g| self.permute_grids(g, row_perm, false))
            .transpose()?;
        Ok((wp, gp))
    }

    fn unorder(
        &self,
        s: Swept,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Codes, Grids)> {
        let (rows, n) = (s.q.rows, s.q.cols);
        self.check_perms(rows, n, row_perm, col_perms)?;
        let w_hat = dmat(
            self.permute_dev(dev(&s.q, "Q")?, rows, n, row_perm, col_perms, true)?,
            1,
            rows,
            n,
        );
        let codes = self.permute_dev(
            codes_dev(&s.codes, "codes")?,
            rows,
            n,
            row_perm,
            col_perms,
            true,
        )?;
        let grids = self.permute_grids(&s.grids, row_perm, true)?;
        Ok((w_hat, Codes::Device(codes), grids))
    }

    fn rtn(
        &self,
        w: &Mat,
        grids: &Grids,
        col_group: &[u32],
        spec: &QuantSpec,
    ) -> Result<(Mat, Codes)> {
        free_lattice("rtn", spec)?;
        let maxq = spec.maxq();
        let (rows, n, ng) = (w.rows, w.cols, grids.n_groups());
        crate::ops::check_col_group("rtn", 0, col_group, n, ng)?;
        if grids.rows() != rows {
            bail!(
                "rtn: grids [{} × {ng}] do not fit {}",
                grids.rows(),
                w.describe()
            );
        }
        let cg = self.upload(col_group, "upload col_group")?;
        let mut q = self.out_f32(rows * n)?;
        let mut codes = self.out_u8(rows * n)?;
        launch_rtn(
            &self.stream,
            &self.quant.core,
            &mut q,
            &mut codes,
            dev(w, "W")?,
            dev(&grids.scale, "scales")?,
            dev(&grids.zero, "zeros")?,
            &cg,
            rows,
            n,
            ng,
            maxq,
        )?;
        Ok((dmat(q, 1, rows, n), Codes::Device(codes)))
    }

    /// Static grids, or dynamic groups searched on the device at each group start (search.rs `DynamicSearch`,
    /// built once before the sweep: no transfer and no synchronization per group).
    fn gptq_sweep(
        &self,
        w: Mat,
        u: &Mat,
        grids: GridMode,
        block: usize,
        maxq: u32,
    ) -> Result<Swept> {
        let (rows, n) = (w.rows, w.cols);
        if block == 0 || u.rows != n || u.cols != n || u.batch != 1 {
            bail!(
                "gptq_sweep: U {} for W [{rows} × {n}], block {block}",
                u.describe()
            );
        }
        grids.check("gptq_sweep", n)?;
        if let GridMode::Dynamic { spec, .. } = &grids {
            free_lattice("gptq_sweep", spec)?;
        }
        let bs = block.min(GPTQ_MAX_BLOCK);
        let mut w_d = into_dev(w, "W")?;
        let w0 = self.copy_of(&w_d)?;
        let mut q_d = self.out_f32(rows * n)?;
        let mut c_d = self.out_u8(rows * n)?;
        let mut e_d = self.zeros_of::<f32>(bs.min(n) * rows, "alloc E")?;
        let mut loss = self.zeros_of::<f32>(rows, "alloc loss")?;
        let u_d = dev(u, "U")?;
        let trailing = self.trailing();
        let grids = match grids {
            GridMode::Static { grids, col_group } => {
                let cg = col_group
                    .first()
                    .ok_or_else(|| anyhow!("gptq_sweep: no col_group"))?;
                if cg.len() != n
                    || cg.iter().any(|&k| k as usize >= grids.n_groups())
                    || grids.rows() != rows
                {
                    bail!("gptq_sweep: grids or col_group do not fit [{rows} × {n}]");
                }
                let cg_d = self.upload(cg, "upload col_group")?;
                launch_gptq_sweep(
                    &self.stream,
                    &self.quant.sweep,
                    trailing,
                    self.gptq_block_variant,
                    GptqBuffers {
                        w: &mut w_d,
                        q: &mut q_d,
                        codes: &mut c_d,
                        e: &mut e_d,
                        u: u_d,
                        scales: dev(&grids.scale, "scales")?,
                        zeros: dev(&grids.zero, "zeros")?,
                        col_group: &cg_d,
                        loss: &mut loss,
                    },
                    rows,
                    n,
                    grids.n_groups(),
                    bs,
                    maxq,
                )?;
                grids
            }
            GridMode::Dynamic { g, h, spec } => {
                let ng = n.div_ceil(g.max(1));
                let cg: Vec<u32> = (0..n).map(|c| (c / g.max(1)) as u32).collect();
                let cg_d = self.upload(&cg, "upload col_group")?;
                let mut s_d = self.zeros_of::<f32>(rows * ng, "alloc scales")?;
                let mut z_d = self.zeros_of::<f32>(rows * ng, "alloc zeros")?;
                let mut gathered = self.zeros_of::<f32>(rows * g.min(n), "alloc group columns")?;
                let hd = match (spec.search, h) {
                    (crate::ops::ScaleSearch::Hessian, Some(h)) => {
                        if h.batch != 1 || h.rows != n || h.cols != n {
                            bail!("gptq_sweep: H {} for W [{rows} × {n}]", h.describe());
                        }
                        Some(dev(h, "H")?)
                    }
                    _ => None,
                };
                let mut groups = self.group_search(self.search_variant, hd, rows, n, g, spec)?;
                let mut search = |k: usize,
                                  cols: &CudaSlice<f32>,
                                  len: usize,
                                  sc: &mut CudaSlice<f32>,
                                  ze: &mut CudaSlice<f32>|
                 -> std::result::Result<(), CudaError> {
                    groups.group(k, cols, len, sc, ze)
                };
                launch_gptq_sweep_dynamic(
                    &self.stream,
                    &self.quant.sweep,
                    trailing,
                    self.gptq_block_variant,
                    GptqDynamicBuffers {
                        w: &mut w_d,
                        q: &mut q_d,
                        codes: &mut c_d,
                        e: &mut e_d,
                        u: u_d,
                        scales: &mut s_d,
                        zeros: &mut z_d,
                        col_group: &cg_d,
                        gathered: &mut gathered,
                        loss: &mut loss,
                    },
                    rows,
                    n,
                    g,
                    bs,
                    maxq,
                    &mut search,
                )?;
                Grids {
                    scale: dmat(s_d, 1, rows, ng),
                    zero: dmat(z_d, 1, rows, ng),
                }
            }
        };
        // Σ e² (each row's loss summed against ones) and ‖Q − W‖², queued for the block's report.
        let ones = self.upload(&vec![1f32; rows], "upload ones")?;
        let mut delta = self.out_f32(rows * n)?;
        launch_sub(&self.stream, &self.quant.core, &mut delta, &q_d, &w0)?;
        let loss = self.dots(&[(&loss, &ones, 0..rows), (&delta, &delta, 0..rows * n)])?;
        Ok(Swept {
            q: dmat(q_d, 1, rows, n),
            codes: Codes::Device(c_d),
            grids,
            loss,
        })
    }

    /// Static grids: the wavefront kernels (sweep.rs; heads of up to 256 rows); heads wider than 256 with
    /// static grids (no model we target): the CPU's sweep on the downloaded buffers. Dynamic groups: the
    /// group-lagged wavefront of boa_dynamic.rs, on the device for any d_h.
    fn boa_sweep(
        &self,
        w: Mat,
        u_col: &Mat,
        u_row: &Mat,
        d_h: usize,
        block: usize,
        grids: GridMode,
        maxq: u32,
    ) -> Result<Swept> {
        let (rows, n) = (w.rows, w.cols);
        grids.check("boa_sweep", n)?;
        if let GridMode::Dynamic { spec, .. } = &grids {
            free_lattice("boa_sweep", spec)?;
        }
        let n_heads = rows / d_h.max(1);
        let (grids, col_group) = match grids {
            GridMode::Dynamic { g, h, spec } => {
                return self.boa_sweep_dynamic(w, u_col, u_row, d_h, g, h, spec, maxq);
            }
            GridMode::Static { grids, col_group } => (grids, col_group),
        };
        if d_h > BOA_MAX_DH {
            let wh = self.host_mat(&w, false)?;
            let (uc, ur) = (self.host_mat(u_col, true)?, self.host_mat(u_row, true)?);
            let grids = GridMode::Static {
                grids: self.host_grids(&grids)?,
                col_group,
            };
            let s = CpuBackend.boa_sweep(wh, &uc, &ur, d_h, block, grids, maxq)?;
            return self.device_swept(s);
        }
        if d_h == 0
            || n_heads * d_h != rows
            || u_row.batch != n_heads
            || !(u_col.batch == 1 || u_col.batch == n_heads)
        {
            bail!(
                "boa_sweep: U_col {} and U_row {} for W [{rows} × {n}] in heads of {d_h}",
                u_col.describe(),
                u_row.describe()
            );
        }
        // One col_group serves every head: with groups, the heads' column orders agree (boa_quantize refuses
        // per-head act-order with groups); per channel every column is in group 0.
        let cg = col_group
            .first()
            .ok_or_else(|| anyhow!("boa_sweep: no col_group"))?;
        if col_group.iter().any(|c| c != cg) || cg.len() != n {
            bail!("boa_sweep: the heads' column groups differ");
        }
        let cg_d = self.upload(cg, "upload col_group")?;
        let mut f = self.out_f32(n_heads * d_h * d_h)?;
        launch_u_row_f(
            &self.stream,
            &self.quant.core,
            &mut f,
            dev(u_row, "U_row")?,
            d_h,
            n_heads,
        )?;
        let mut w_d = into_dev(w, "W")?;
        let w0 = self.copy_of(&w_d)?;
        let mut q_d = self.out_f32(rows * n)?;
        let mut c_d = self.out_u8(rows * n)?;
        let variant = self.boa_block_variant_in_use();
        let mut e_d = self.zeros_of::<f32>(variant.block_for(d_h).min(n) * rows, "alloc E")?;
        launch_boa_sweep(
            &self.stream,
            &self.quant.sweep,
            self.trailing(),
            variant,
            BoaBuffers {
                w: &mut w_d,
                w0: &w0,
                q: &mut q_d,
                codes: &mut c_d,
                e: &mut e_d,
                u_col: dev(u_col, "U_col")?,
                f_row: &f,
                scales: dev(&grids.scale, "scales")?,
                zeros: dev(&grids.zero, "zeros")?,
                col_group: &cg_d,
            },
            u_col.batch == n_heads && n_heads > 1,
            n_heads,
            d_h,
            n,
            grids.n_groups(),
            maxq,
        )?;
        Ok(Swept {
            q: dmat(q_d, 1, rows, n),
            codes: Codes::Device(c_d),
            grids,
            loss: QuadSums::Host(vec![f64::NAN; 2]),
        })
    }

    fn quad_sums(&self, slots: usize) -> Result<QuadSums> {
        Ok(QuadSums::Device {
            partials: self.zeros_of::<f64>(slots * DOT_CTAS, "alloc partial sums")?,
            slots,
            used: 0,
        })
    }

    /// One cuBLAS SGEMM per A (times H), then A∘(AH) summed into its slot's partials on the device; nothing
    /// is read back.
    fn quad_forms_into(
        &self,
        sums: &mut QuadSums,
        first: usize,
        h: &Mat,
        a: &[&Mat],
    ) -> Result<()> {
        let n = h.rows;
        if h.batch != 1 || h.cols != n || a.iter().any(|m| m.cols != n || m.batch != 1) {
            bail!("quad_forms: a matrix does not fit H {}", h.describe());
        }
        sums.check_room(first, a.len())?;
        let QuadSums::Device { partials, used, .. } = sums else {
            bail!("quad_forms_into: the sums are in host memory");
        };
        let blas = self
            .blas()
            .map_err(|why| anyhow!("the error report needs cuBLAS: {why}"))?;
        // One product buffer for all of them, reused in stream order (each GEMM writes it after the previous
        // dot has read it): the report holds one extra copy of W, not two per matrix.
        let rows = a.iter().map(|m| m.rows).max().unwrap_or(0);
        let mut ah = self.out_f32(rows * n)?;
        for (i, m) in a.iter().enumerate() {
            let (am, len) = (dev(m, "A")?, m.rows * n);
            let slot = first + i;
            blas.rows_times_h(&mut ah, am, dev(h, "H")?, m.rows, n)?;
            launch_dot_partials(
                &self.stream,
                &self.quant.core,
                &mut partials.slice_mut(slot * DOT_CTAS..(slot + 1) * DOT_CTAS),
                &am.slice(..len),
                &ah.slice(..len),
            )?;
        }
        *used = (*used).max(first + a.len());
        Ok(())
    }

    fn read_quad_sums(&self, sums: &QuadSums) -> Result<Vec<f64>> {
        let (partials, slots, used) = match sums {
            QuadSums::Device {
                partials,
                slots,
                used,
            } => (partials, *slots, *used),
            // Values no kernel computed (a BoA sweep's NaN loss, a sweep that ran on the host).
            QuadSums::Host(v) => return Ok(v.clone()),
        };
        // The slots no form was queued into are zeros: not downloaded.
        let mut out = vec![0.0; slots];
        if used > 0 {
            let v = self.download(&partials.slice(..used * DOT_CTAS), "download partial sums")?;
            for (i, o) in out.iter_mut().enumerate().take(used) {
                *o = v[i * DOT_CTAS..(i + 1) * DOT_CTAS].iter().sum();
            }
        }
        Ok(out)
    }

    /// Device-to-device copies into one buffer (host matrices are uploaded first).
    fn stack(&self, mats: &[&Mat]) -> Result<Mat> {
        crate::ops::check_stack(mats)?;
        let (rows, cols) = (mats[0].rows, mats[0].cols);
        let total: usize = mats.iter().map(|m| m.len()).sum();
        let mut out = self.out_f32(total)?;
        let mut at = 0;
        for m in mats {
            let len = m.len();
            let up = if m.on_device() {
                None
            } else {
                Some(self.upload_mat(Mat::stack_host(&[m]).ok_or_else(|| {
                    anyhow!(
                        "stack: {} is neither on the device nor readable",
                        m.describe()
                    )
                })?)?)
            };
            let src = dev(up.as_ref().unwrap_or(m), "stacked matrix")?;
            self.stream
                .memcpy_dtod(&src.slice(..len), &mut out.slice_mut(at..at + len))
                .map_err(driver("stack"))?;
            at += len;
        }
        Ok(dmat(out, total / (rows * cols).max(1), rows, cols))
    }

    fn unstack(&self, m: Mat) -> Result<Vec<Mat>> {
        let m = match m.unstack_host() {
            Ok(host) => return host.into_iter().map(|h| self.upload_mat(h)).collect(),
            Err(m) => m,
        };
        let (s, d) = (m.stride(), dev(&m, "batch")?);
        (0..m.batch)
            .map(|b| {
                let mut one = self.out_f32(s)?;
                self.stream
                    .memcpy_dtod(&d.slice(b * s..(b + 1) * s), &mut one.slice_mut(..s))
                    .map_err(driver("unstack"))?;
                Ok(dmat(one, 1, m.rows, m.cols))
            })
            .collect()
    }

    /// A device-to-device copy of the partials (host values are uploaded as one partial per slot).
    fn queue_sums(&self, into: &mut QuadSums, first: usize, from: &QuadSums) -> Result<()> {
        into.check_room(first, from.slots())?;
        let QuadSums::Device { partials, used, .. } = into else {
            bail!("queue_sums: the sums are in host memory");
        };
        let k = from.slots();
        let mut dst = partials.slice_mut(first * DOT_CTAS..(first + k) * DOT_CTAS);
        match from {
            QuadSums::Device { partials: src, .. } => self
                .stream
                .memcpy_dtod(&src.slice(..k * DOT_CTAS), &mut dst)
                .map_err(driver("queue sums"))?,
            QuadSums::Host(v) => {
                let mut p = vec![0f64; k * DOT_CTAS];
                for (i, &x) in v.iter().enumerate() {
                    p[i * DOT_CTAS] = x;
                }
                let src = self.upload(&p, "upload sums")?;
                self.stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(driver("queue sums"))?
            }
        }
        *used = (*used).max(first + k);
        Ok(())
    }

    fn sub(&self, a: &Mat, b: &Mat) -> Result<Mat> {
        if a.len() != b.len() {
            bail!("sub: {} − {}", a.describe(), b.describe());
        }
        let mut out = self.out_f32(a.len())?;
        launch_sub(
            &self.stream,
            &self.quant.core,
            &mut out,
            dev(a, "a")?,
            dev(b, "b")?,
        )?;
        Ok(dmat(out, a.batch, a.rows, a.cols))
    }

    /// qweight packed on the device (b/32 of W's f32 bytes come back); the grids [d_out × n_groups] come back
    /// as they are and take their f16 / integer form here.
    fn traffic(&self) -> crate::ops::Traffic {
        super::traffic::traffic(&self.counters)
    }

    fn fence(&self) -> Result<()> {
        self.counters.sync();
        Ok(self.synchronize()?)
    }

    fn pack(&self, q: &QuantizedLinear) -> Result<Packed> {
        self.pack_all(&[q])?.remove(0)
    }

    /// Every linear's qweight packed on the device into one buffer and its scales and zeros gathered into
    /// another: two downloads for all of them.
    fn pack_all(&self, qs: &[&QuantizedLinear]) -> Result<Vec<Result<Packed>>> {
        // Each linear's qweight words and (scales then zeros) entries in the two buffers.
        let mut spans = Vec::with_capacity(qs.len());
        let (mut words, mut entries) = (0, 0);
        for q in qs {
            let nw = (q.d_in * q.bits as usize).div_ceil(32) * q.d_out;
            let ng = q.d_out * q.n_groups();
            spans.push((words..words + nw, entries..entries + 2 * ng));
            (words, entries) = (words + nw, entries + 2 * ng);
        }
        let mut qw = self.zeros_of::<u32>(words, "alloc qweight")?;
        let mut grids = self.out_f32(entries)?;
        for (q, (w, g)) in qs.iter().zip(&spans) {
            launch_pack(
                &self.stream,
                &self.quant.core,
                &mut qw.slice_mut(w.clone()),
                codes_dev(&q.codes, "codes")?,
                q.d_out,
                q.d_in,
                q.bits,
            )?;
            let mid = g.start + g.len() / 2;
            self.stream
                .memcpy_dtod(
                    dev(&q.grids.scale, "scales")?,
                    &mut grids.slice_mut(g.start..mid),
                )
                .map_err(driver("gather scales"))?;
            self.stream
                .memcpy_dtod(
                    dev(&q.grids.zero, "zeros")?,
                    &mut grids.slice_mut(mid..g.end),
                )
                .map_err(driver("gather zeros"))?;
        }
        let qw = self.download(&qw, "download qweight")?;
        let grids = self.download(&grids, "download grids")?;
        Ok(qs
            .iter()
            .zip(spans)
            .map(|(q, (w, g))| {
                let (scales, zeros) = grids[g].split_at(q.d_out * q.n_groups());
                packed_from(q, qw[w].to_vec(), scales, zeros)
            })
            .collect())
    }
}

/// The checkpoint form of `q` from its packed words and its grids [d_out × n_groups] as the device held them
/// (f32): f16 scales and integer zero points, group-major.
fn packed_from(
    q: &QuantizedLinear,
    qweight: Vec<u32>,
    scales: &[f32],
    zeros: &[f32],
) -> Result<Packed> {
    let (d_out, ng) = (q.d_out, q.n_groups());
    let maxq = (1u32 << q.bits) - 1;
    let mut z = vec![0u8; ng * d_out];
    let mut s = vec![half::f16::ZERO; ng * d_out];
    for j in 0..d_out {
        for g in 0..ng {
            let v = zeros[j * ng + g];
            if v.fract() != 0.0 || !(0.0..=maxq as f32).contains(&v) {
                bail!(
                    "pack: zero point {v} (output {j}, group {g}) is not a {}-bit code",
                    q.bits
                );
            }
            z[g * d_out + j] = v as u8;
            s[g * d_out + j] = half::f16::from_f32(scales[j * ng + g]);
        }
    }
    Ok(Packed {
        d_out,
        d_in: q.d_in,
        bits: q.bits,
        n_groups: ng,
        qweight,
        scales: s,
        zeros: z,
        g_idx: q.g_idx.clone(),
    })
}

impl CudaBackend {
    /// A host sweep's results moved to the device (the temporary host routes above).
    fn device_swept(&self, s: Swept) -> Result<Swept> {
        let codes = match s.codes {
            Codes::Host(v) => Codes::Device(self.upload(&v, "upload codes")?),
            c => c,
        };
        Ok(Swept {
            q: self.upload_mat(s.q)?,
            codes,
            grids: self.device_grids(s.grids)?,
            loss: s.loss,
        })
    }
}

/// The device searches and sweeps implement the free grids (scale, integer zero) with positive scales only:
/// a GGUF lattice (ops::Lattice, quant/lattice.rs) is the CPU's, and `run` refuses the combination before
/// any work; signed scales (`QuantSpec::signed`) are the CPU's too, and `run` leaves them off on a device
/// (`QuantOps::signed_scales`).
fn free_lattice(op: &str, spec: &QuantSpec) -> Result<()> {
    if spec.lattice != crate::ops::Lattice::Free {
        bail!(
            "{op}: grids on the {:?} lattice are searched on the CPU only (--device cpu)",
            spec.lattice
        );
    }
    if spec.signed {
        bail!("{op}: signed scales are searched on the CPU only (--device cpu)");
    }
    Ok(())
}
