//! `QuantOps` on CUDA: upload, launch (hessian.rs, cholesky.rs, sweep.rs), download. Each method has a
//! `try_*` twin returning `CudaError`; the trait methods panic with the op and shape named, as `rms_norm` does.
//!
//! Cholesky with n > 128 (the d_in-sized H_col) goes through cuSOLVER (solver.rs), or the CPU when the
//! library is missing (said once on stderr). Attention and BoA with d_h > 128 fall back to the CPU.

use super::cholesky::{CHOLESKY_MAX_N, launch_cholesky};
use super::hessian::{ATTN_MAX_DH, AttnXVariant, launch_attn_x, launch_softmax_stats};
use super::sweep::{
    BOA_MAX_DH, BoaBlockVariant, BoaBuffers, GPTQ_MAX_BLOCK, GptqBuffers, GptqDynamicBuffers,
    Trailing, TrailingVariant, launch_boa_sweep, launch_gptq_sweep, launch_gptq_sweep_dynamic,
};
use super::{CudaBackend, CudaError, driver};
use crate::backend::Tensor;
use crate::backend::cpu::CpuBackend;
use crate::backend::quant_ops::{AttnShape, QuantOps, StaticGrids, SweepResult, UCol};
use crate::quant::ScaleSearch;
use crate::quant::gptq::DynamicGroups;
use crate::quant::quantizer::{Grid, QuantSpec, search_grid};
use cudarc::driver::CudaSlice;
use rayon::prelude::*;

/// Static grids on the device: scales, zeros [rows × n_groups], col_group [n].
type DeviceGrids = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<u32>);

fn shape(op: &'static str, msg: String) -> CudaError {
    CudaError::Shape { op, msg }
}

fn check_grids(op: &'static str, g: &StaticGrids, rows: usize, n: usize) -> Result<(), CudaError> {
    if g.grids.len() != rows * g.n_groups
        || g.col_group.len() != n
        || g.col_group.iter().any(|&k| k as usize >= g.n_groups)
    {
        return Err(shape(
            op,
            format!(
                "grids.len={} ≠ rows·n_groups = {rows}·{}, or col_group.len={} ≠ n={n}, or a group ≥ n_groups",
                g.grids.len(),
                g.n_groups,
                g.col_group.len()
            ),
        ));
    }
    Ok(())
}

impl CudaBackend {
    pub(super) fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        v: &[T],
        what: &'static str,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(v).map_err(driver(what))
    }

    /// The trailing-update variant the sweeps run with: the selected one, or the FFMA kernel when cuBLAS is
    /// selected but cannot be opened (said once on stderr by `blas`).
    pub fn trailing_variant_in_use(&self) -> TrailingVariant {
        match self.trailing_variant {
            TrailingVariant::Cublas if self.blas().is_ok() => TrailingVariant::Cublas,
            _ => TrailingVariant::Ffma,
        }
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

    /// Q and the codes of a finished sweep, after the stream has run everything queued (`what` names the op).
    fn download_sweep(
        &self,
        q_d: &CudaSlice<f32>,
        c_d: &CudaSlice<u8>,
        what: &'static str,
    ) -> Result<SweepResult, CudaError> {
        let q = self.stream.clone_dtoh(q_d).map_err(driver("download Q"))?;
        let codes = self
            .stream
            .clone_dtoh(c_d)
            .map_err(driver("download codes"))?;
        self.stream.synchronize().map_err(driver(what))?;
        Ok(SweepResult { q, codes })
    }

    /// Scales and zeros of static grids as two device arrays, plus col_group.
    fn upload_grids(&self, g: &StaticGrids) -> Result<DeviceGrids, CudaError> {
        let s: Vec<f32> = g.grids.iter().map(|x| x.scale).collect();
        let z: Vec<f32> = g.grids.iter().map(|x| x.zero).collect();
        Ok((
            self.upload(&s, "upload scales")?,
            self.upload(&z, "upload zeros")?,
            self.upload(g.col_group, "upload col_group")?,
        ))
    }

    pub fn try_xxt_accumulate(
        &self,
        h: &mut [f32],
        x: &[f32],
        m: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        if h.len() != d * d || x.len() != m * d {
            return Err(shape(
                "xxt_accumulate",
                format!("h.len={} x.len={} for m={m}, d={d}", h.len(), x.len()),
            ));
        }
        if m == 0 || d == 0 {
            return Ok(());
        }
        // The tensor form's launch, on device copies made before the timed region (kernel time only).
        let x_t = Tensor::Device(self.upload(x, "upload x")?);
        let mut acc = Tensor::Device(self.upload(h, "upload h")?);
        self.timed(|| self.try_xxt_accumulate_t(&mut acc, &x_t, m, d))?;
        let Tensor::Device(h_d) = acc else {
            unreachable!("the accumulator was uploaded above")
        };
        self.stream
            .memcpy_dtoh(&h_d, h)
            .map_err(driver("download h"))?;
        self.stream.synchronize().map_err(driver("xxt_accumulate"))
    }

    pub fn try_head_covariance(
        &self,
        x: &[f32],
        m: usize,
        n_heads: usize,
        d_h: usize,
    ) -> Result<Vec<f32>, CudaError> {
        if x.len() != m * n_heads * d_h {
            return Err(shape(
                "head_covariance",
                format!("x.len={} ≠ {m}·{n_heads}·{d_h}", x.len()),
            ));
        }
        let n_out = n_heads * d_h * d_h;
        if m == 0 || n_out == 0 {
            return Ok(vec![0.0; n_out]);
        }
        // The tensor form's launch, as in try_xxt_accumulate.
        let x_t = Tensor::Device(self.upload(x, "upload x")?);
        let mut acc = Tensor::Device(
            self.stream
                .alloc_zeros::<f32>(n_out)
                .map_err(driver("alloc covariances"))?,
        );
        self.timed(|| self.try_head_covariance_t(&mut acc, &x_t, m, n_heads, d_h))?;
        self.finish(acc, "head_covariance")
    }

    pub fn try_v_col_covariance(
        &self,
        x: &[f32],
        q: &[f32],
        k: &[f32],
        s: AttnShape,
    ) -> Result<Vec<f32>, CudaError> {
        let AttnShape { t, h, h_kv, d_h, d } = s;
        if h_kv == 0
            || !h.is_multiple_of(h_kv)
            || d_h > ATTN_MAX_DH
            || x.len() != t * d
            || q.len() != t * h * d_h
            || k.len() != t * h_kv * d_h
        {
            return Err(shape(
                "v_col_covariance",
                format!(
                    "{s:?} (d_h ≤ {ATTN_MAX_DH}) with x.len={}, q.len={}, k.len={}",
                    x.len(),
                    q.len(),
                    k.len()
                ),
            ));
        }
        let n_out = h * d * d;
        if t == 0 || n_out == 0 {
            return Ok(vec![0.0; n_out]);
        }
        let x_d = self.upload(x, "upload x")?;
        let q_d = self.upload(q, "upload q")?;
        let k_d = self.upload(k, "upload k")?;
        let mut scratch = self.v_col_scratch(s)?;
        let mut g = self
            .stream
            .alloc_zeros::<f32>(n_out)
            .map_err(driver("alloc G"))?;
        self.timed(|| {
            self.queue_v_col_sequence(
                &mut g,
                |head| head,
                &mut scratch,
                (&x_d.slice(..), &q_d.slice(..), &k_d.slice(..)),
                s,
            )
        })?;
        let out = self.stream.clone_dtoh(&g).map_err(driver("download G"))?;
        self.stream
            .synchronize()
            .map_err(driver("v_col_covariance"))?;
        Ok(out)
    }

    /// The bench's side-by-side of the attn_x variants: the stats of one sequence, one untimed launch for head
    /// 0 (its Y is returned, to be checked), then `launches` back-to-back launches cycling over the heads
    /// between events. Returns the mean device ms per launch (one head) and Y of head 0.
    pub fn time_attn_x(
        &self,
        variant: AttnXVariant,
        x: &[f32],
        q: &[f32],
        k: &[f32],
        s: AttnShape,
        launches: usize,
    ) -> Result<(f64, Vec<f32>), CudaError> {
        let AttnShape { t, h, h_kv, d_h, d } = s;
        if h == 0 || t == 0 || d == 0 {
            return Err(shape("time_attn_x", format!("{s:?}: empty")));
        }
        let x_d = self.upload(x, "upload x")?;
        let q_d = self.upload(q, "upload q")?;
        let k_d = self.upload(k, "upload k")?;
        let mut stats = self
            .stream
            .alloc_zeros::<f32>(2 * h * t)
            .map_err(driver("alloc stats"))?;
        let mut y = self.output(t * d)?;
        let hk = &self.quant.hessian;
        launch_softmax_stats(
            &self.stream,
            hk,
            &mut stats.slice_mut(..),
            &q_d.slice(..),
            &k_d.slice(..),
            t,
            h,
            h_kv,
            d_h,
        )?;
        let launch = |y: &mut CudaSlice<f32>, head: usize| {
            launch_attn_x(
                &self.stream,
                hk,
                variant,
                &mut y.slice_mut(..),
                &x_d.slice(..),
                &q_d.slice(..),
                &k_d.slice(..),
                &stats.slice(..),
                head,
                t,
                h,
                h_kv,
                d_h,
                d,
            )
        };
        launch(&mut y, 0)?;
        let y0 = self.stream.clone_dtoh(&y).map_err(driver("download y"))?;
        self.stream.synchronize().map_err(driver("attn_x"))?;
        let n = launches.max(1);
        self.timed(|| (0..n).try_for_each(|i| launch(&mut y, i % h)))?;
        Ok((self.last_kernel_ms() as f64 / n as f64, y0))
    }

    pub fn try_cholesky_upper_inverse_batched(
        &self,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Result<Vec<Option<Vec<f32>>>, CudaError> {
        if h.len() != count * n * n || n > CHOLESKY_MAX_N {
            return Err(shape(
                "cholesky_upper_inverse",
                format!("h.len={} ≠ {count}·{n}², or n > {CHOLESKY_MAX_N}", h.len()),
            ));
        }
        if n == 0 || count == 0 {
            return Ok(vec![Some(Vec::new()); count]);
        }
        let h_d = self.upload(h, "upload H")?;
        let mut u_d = self.output(count * n * n)?;
        let mut st_d = self
            .stream
            .alloc_zeros::<i32>(count)
            .map_err(driver("alloc status"))?;
        self.timed(|| {
            launch_cholesky(
                &self.stream,
                &self.quant.cholesky,
                &mut u_d,
                &mut st_d,
                &h_d,
                n,
                count,
            )
        })?;
        let u = self.stream.clone_dtoh(&u_d).map_err(driver("download U"))?;
        let st = self
            .stream
            .clone_dtoh(&st_d)
            .map_err(driver("download status"))?;
        self.stream
            .synchronize()
            .map_err(driver("cholesky_upper_inverse"))?;
        Ok(u.chunks(n * n)
            .zip(&st)
            .map(|(ub, &s)| (s == 0).then(|| ub.to_vec()))
            .collect())
    }

    /// `cholesky_upper_inverse_batched` for n > CHOLESKY_MAX_N: cuSOLVER, the whole batch uploaded at once and
    /// its factorizations queued back to back (solver.rs), then one download and one synchronization.
    pub fn try_cholesky_upper_inverse_large(
        &self,
        solver: &super::solver::Solver,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Result<Vec<Option<Vec<f32>>>, CudaError> {
        if h.len() != count * n * n {
            return Err(shape(
                "cholesky_upper_inverse",
                format!("h.len={} ≠ {count}·{n}²", h.len()),
            ));
        }
        if n == 0 || count == 0 {
            return Ok(vec![Some(Vec::new()); count]);
        }
        let h_d = self.upload(h, "upload H")?;
        let mut u_d = self.output(count * n * n)?;
        let st_d = self.timed(|| {
            solver.upper_inverse_batched(&self.quant.cholesky, &h_d, &mut u_d, n, count)
        })?;
        let u = self.stream.clone_dtoh(&u_d).map_err(driver("download U"))?;
        let st = self
            .stream
            .clone_dtoh(&st_d)
            .map_err(driver("download status"))?;
        self.stream
            .synchronize()
            .map_err(driver("cholesky_upper_inverse"))?;
        // Status per matrix: potrf info, trtri info, non-finite flag; all zero when it factored.
        Ok(u.chunks(n * n)
            .zip(st.chunks(3))
            .map(|(ub, s)| s.iter().all(|&x| x == 0).then(|| ub.to_vec()))
            .collect())
    }

    /// cuSOLVER, opened on first use; the reason (printed once) when it cannot be.
    fn solver(&self) -> Result<&super::solver::Solver, &str> {
        self.solver
            .get_or_init(|| {
                let s = super::solver::Solver::new(&self.stream);
                if let Err(why) = &s {
                    eprintln!(
                        "{}: {why}; Cholesky factors with n > {CHOLESKY_MAX_N} run on the CPU",
                        self.name
                    );
                }
                s
            })
            .as_ref()
            .map_err(String::as_str)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn try_gptq_sweep(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> Result<SweepResult, CudaError> {
        check_grids("gptq_sweep", &grids, rows, n)?;
        if w.len() != rows * n || u.len() != n * n || block_size == 0 {
            return Err(shape(
                "gptq_sweep",
                format!(
                    "w.len={} u.len={} block_size={block_size} for rows={rows}, n={n}",
                    w.len(),
                    u.len()
                ),
            ));
        }
        if rows == 0 || n == 0 {
            return Ok(SweepResult {
                q: vec![0.0; rows * n],
                codes: vec![0; rows * n],
            });
        }
        let bs = block_size.min(GPTQ_MAX_BLOCK);
        let mut w_d = self.upload(w, "upload W")?;
        let u_d = self.upload(u, "upload U")?;
        let (s_d, z_d, cg_d) = self.upload_grids(&grids)?;
        let mut q_d = self.output(rows * n)?;
        let mut c_d = self.codes_output(rows * n)?;
        let mut e_d = self
            .stream
            .alloc_zeros::<f32>(bs.min(n) * rows)
            .map_err(driver("alloc E"))?;
        let trailing = self.trailing();
        self.timed(|| {
            launch_gptq_sweep(
                &self.stream,
                &self.quant.sweep,
                trailing,
                GptqBuffers {
                    w: &mut w_d,
                    q: &mut q_d,
                    codes: &mut c_d,
                    e: &mut e_d,
                    u: &u_d,
                    scales: &s_d,
                    zeros: &z_d,
                    col_group: &cg_d,
                },
                rows,
                n,
                grids.n_groups,
                bs,
                maxq,
            )
        })?;
        self.download_sweep(&q_d, &c_d, "gptq_sweep")
    }

    /// `gptq_sweep_dynamic`: the sweep on the device, each group's grids searched on the host (the CPU's own
    /// `search_grid`, so the grids are the CPU's for the same weights) from the group's columns as the device
    /// holds them when the sweep reaches the group.
    #[allow(clippy::too_many_arguments)]
    pub fn try_gptq_sweep_dynamic(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        groups: &DynamicGroups,
        maxq: u32,
    ) -> Result<(SweepResult, Vec<Grid<f32>>), CudaError> {
        let g = groups.g;
        if g == 0 || w.len() != rows * n || u.len() != n * n || block_size == 0 {
            return Err(shape(
                "gptq_sweep_dynamic",
                format!(
                    "g={g}, w.len={} u.len={} block_size={block_size} for rows={rows}, n={n}",
                    w.len(),
                    u.len()
                ),
            ));
        }
        let n_groups = n.div_ceil(g);
        if groups.h_blocks.len() != n_groups {
            return Err(shape(
                "gptq_sweep_dynamic",
                format!("{} H blocks for {n_groups} groups", groups.h_blocks.len()),
            ));
        }
        if rows == 0 || n == 0 {
            return Ok((
                SweepResult {
                    q: vec![0.0; rows * n],
                    codes: vec![0; rows * n],
                },
                vec![Grid::default(); rows * n_groups],
            ));
        }
        let bs = block_size.min(GPTQ_MAX_BLOCK);
        let col_group: Vec<u32> = (0..n).map(|c| (c / g) as u32).collect();
        let mut w_d = self.upload(w, "upload W")?;
        let u_d = self.upload(u, "upload U")?;
        let cg_d = self.upload(&col_group, "upload col_group")?;
        let mut s_d = self.output(rows * n_groups)?;
        let mut z_d = self.output(rows * n_groups)?;
        let mut gathered = self.output(rows * g.min(n))?;
        let mut q_d = self.output(rows * n)?;
        let mut c_d = self.codes_output(rows * n)?;
        let mut e_d = self
            .stream
            .alloc_zeros::<f32>(bs.min(n) * rows)
            .map_err(driver("alloc E"))?;
        let mut grids = vec![Grid::default(); rows * n_groups];
        let mut search = |k: usize, cols: &[f32]| -> Vec<(f32, f32)> {
            let len = cols.len() / rows;
            let hb =
                (groups.spec.search == ScaleSearch::Hessian).then(|| groups.h_blocks[k].as_slice());
            let found: Vec<Grid<f32>> = cols
                .par_chunks(len)
                .map(|row| search_grid(row, hb, groups.spec))
                .collect();
            for (r, gr) in found.iter().enumerate() {
                grids[r * n_groups + k] = *gr;
            }
            found.iter().map(|gr| (gr.scale, gr.zero)).collect()
        };
        let trailing = self.trailing();
        self.timed(|| {
            launch_gptq_sweep_dynamic(
                &self.stream,
                &self.quant.sweep,
                trailing,
                GptqDynamicBuffers {
                    w: &mut w_d,
                    q: &mut q_d,
                    codes: &mut c_d,
                    e: &mut e_d,
                    u: &u_d,
                    scales: &mut s_d,
                    zeros: &mut z_d,
                    col_group: &cg_d,
                    gathered: &mut gathered,
                },
                rows,
                n,
                g,
                bs,
                maxq,
                &mut search,
            )
        })?;
        let result = self.download_sweep(&q_d, &c_d, "gptq_sweep_dynamic")?;
        Ok((result, grids))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn try_boa_sweep(
        &self,
        w: &[f32],
        u_col: UCol,
        u_row: &[f32],
        n_heads: usize,
        d_h: usize,
        n: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> Result<SweepResult, CudaError> {
        let rows = n_heads * d_h;
        check_grids("boa_sweep", &grids, rows, n)?;
        let (u, per_head) = match u_col {
            UCol::Shared(u) => (u, false),
            UCol::PerHead(u) => (u, true),
        };
        let u_len = if per_head { n_heads * n * n } else { n * n };
        if w.len() != rows * n
            || u.len() != u_len
            || u_row.len() != n_heads * d_h * d_h
            || d_h > BOA_MAX_DH
        {
            return Err(shape(
                "boa_sweep",
                format!(
                    "w.len={} u_col.len={} u_row.len={} for n_heads={n_heads}, d_h={d_h} (≤ {BOA_MAX_DH}), n={n}",
                    w.len(),
                    u.len(),
                    u_row.len()
                ),
            ));
        }
        if rows == 0 || n == 0 {
            return Ok(SweepResult {
                q: vec![0.0; rows * n],
                codes: vec![0; rows * n],
            });
        }
        // F[j, i] = U_row[j, i] / U_row[j, j], the factor of Eq. (12), divided exactly as the CPU twin does.
        let mut f = vec![0f32; n_heads * d_h * d_h];
        for hd in 0..n_heads {
            let ur = &u_row[hd * d_h * d_h..(hd + 1) * d_h * d_h];
            for j in 0..d_h {
                for i in j + 1..d_h {
                    f[hd * d_h * d_h + j * d_h + i] = ur[j * d_h + i] / ur[j * d_h + j];
                }
            }
        }
        let mut w_d = self.upload(w, "upload W")?;
        let w0_d = self.upload(w, "upload W0")?;
        let u_d = self.upload(u, "upload U_col")?;
        let f_d = self.upload(&f, "upload F")?;
        let (s_d, z_d, cg_d) = self.upload_grids(&grids)?;
        let mut q_d = self.output(rows * n)?;
        let mut c_d = self.codes_output(rows * n)?;
        let variant = self.boa_block_variant_in_use();
        let mut e_d = self
            .stream
            .alloc_zeros::<f32>(variant.block().min(n) * rows)
            .map_err(driver("alloc E"))?;
        let trailing = self.trailing();
        self.timed(|| {
            launch_boa_sweep(
                &self.stream,
                &self.quant.sweep,
                trailing,
                variant,
                BoaBuffers {
                    w: &mut w_d,
                    w0: &w0_d,
                    q: &mut q_d,
                    codes: &mut c_d,
                    e: &mut e_d,
                    u_col: &u_d,
                    f_row: &f_d,
                    scales: &s_d,
                    zeros: &z_d,
                    col_group: &cg_d,
                },
                per_head,
                n_heads,
                d_h,
                n,
                grids.n_groups,
                maxq,
            )
        })?;
        self.download_sweep(&q_d, &c_d, "boa_sweep")
    }
}

impl QuantOps for CudaBackend {
    fn accelerates_statistics(&self) -> bool {
        true
    }

    fn accelerates_quantization(&self) -> bool {
        true
    }

    fn xxt_accumulate(&self, h: &mut [f32], x: &[f32], m: usize, d: usize) {
        self.try_xxt_accumulate(h, x, m, d)
            .unwrap_or_else(|e| panic!("{} xxt_accumulate (m={m}, d={d}): {e}", self.name));
    }

    fn head_covariance(&self, x: &[f32], m: usize, n_heads: usize, d_h: usize) -> Vec<f32> {
        self.try_head_covariance(x, m, n_heads, d_h)
            .unwrap_or_else(|e| {
                panic!(
                    "{} head_covariance (m={m}, n_heads={n_heads}, d_h={d_h}): {e}",
                    self.name
                )
            })
    }

    fn v_col_covariance(&self, x: &[f32], q: &[f32], k: &[f32], s: AttnShape) -> Vec<f32> {
        if s.d_h > ATTN_MAX_DH {
            // The attention tiles hold d_h ≤ 128 columns; wider heads (none in Llama-family models) use the CPU.
            return CpuBackend.v_col_covariance(x, q, k, s);
        }
        self.try_v_col_covariance(x, q, k, s)
            .unwrap_or_else(|e| panic!("{} v_col_covariance ({s:?}): {e}", self.name))
    }

    fn cholesky_upper_inverse_batched(
        &self,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Vec<Option<Vec<f32>>> {
        if n > CHOLESKY_MAX_N {
            // d_in-sized H_col: the one-CTA kernel holds n ≤ 128.
            let Ok(solver) = self.solver() else {
                return CpuBackend.cholesky_upper_inverse_batched(h, n, count);
            };
            return self
                .try_cholesky_upper_inverse_large(solver, h, n, count)
                .unwrap_or_else(|e| {
                    panic!(
                        "{} cholesky_upper_inverse (cuSOLVER, n={n}, count={count}): {e}",
                        self.name
                    )
                });
        }
        self.try_cholesky_upper_inverse_batched(h, n, count)
            .unwrap_or_else(|e| {
                panic!(
                    "{} cholesky_upper_inverse (n={n}, count={count}): {e}",
                    self.name
                )
            })
    }

    /// The Hessian search on the device (search.rs); MinMax / Mse, n = 0, or no cuBLAS: the CPU search.
    fn search_grids(
        &self,
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Vec<Grid<f32>> {
        self.search_grids_routed(w, rows, n, h, spec)
    }

    fn gptq_sweep(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        self.try_gptq_sweep(w, u, rows, n, block_size, grids, maxq)
            .unwrap_or_else(|e| panic!("{} gptq_sweep (rows={rows}, n={n}): {e}", self.name))
    }

    fn gptq_sweep_dynamic(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        groups: &DynamicGroups,
        maxq: u32,
    ) -> (SweepResult, Vec<Grid<f32>>) {
        self.try_gptq_sweep_dynamic(w, u, rows, n, block_size, groups, maxq)
            .unwrap_or_else(|e| {
                panic!(
                    "{} gptq_sweep_dynamic (rows={rows}, n={n}, g={}): {e}",
                    self.name, groups.g
                )
            })
    }

    fn boa_sweep(
        &self,
        w: &[f32],
        u_col: UCol,
        u_row: &[f32],
        n_heads: usize,
        d_h: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        if d_h > BOA_MAX_DH {
            // One CTA per head holds ≤ 128 rows; wider heads use the CPU.
            return CpuBackend.boa_sweep(w, u_col, u_row, n_heads, d_h, n, block_size, grids, maxq);
        }
        // The kernel's column block is the block variant's width whatever `block_size` says (sweep.rs): the
        // block width only changes the rounding order of the trailing updates.
        self.try_boa_sweep(w, u_col, u_row, n_heads, d_h, n, grids, maxq)
            .unwrap_or_else(|e| {
                panic!(
                    "{} boa_sweep (n_heads={n_heads}, d_h={d_h}, n={n}): {e}",
                    self.name
                )
            })
    }
}
