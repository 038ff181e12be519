//! Host side of cuda/boa_dynamic.cu: the head-wise BoA sweep with dynamic group grids (design.md §4.3) on the
//! device, as a host loop over the super-steps of the group-lagged wavefront (the .cu header has the schedule,
//! the estimates and the choice): per super-step S, one launch of every job (row i of each head on group
//! S − i: its cross-row terms, its group's grid search, GPTQ inside the group) and one launch of those rows'
//! trailing updates, all on the backend's stream with no host synchronization in between.
//!
//! Variants (`BoaDynamicVariant`, style.md rules 4 and 17): v1 `boa_dyn_step_kernel`, one thread per job (the
//! direct port of the CPU twin, quant::boa::sweep_heads + quant::quantizer::search_grid), and v2
//! `boa_dyn_step_kernel_v2`, one warp per job (g ≤ 256; a wider group runs v1). Both share the trailing kernel
//! and compute the same values bit for bit (the same operations in the same order; parity_boa_dynamic checks
//! both against the CPU).
//!
//! Every super-step's launches are queued on the stream: no transfer, no host synchronization and no
//! allocation between them (the buffers are allocated once per sweep, before the first). Any d_h.
//!
//! Launch shapes, the estimates and the measured ptxas registers: cuda/boa_dynamic.cu's header.

use super::core::launch_u_row_f;
use super::{CudaBackend, CudaError, driver};
use crate::nvtx::range;
use crate::ops::{
    Codes, Grids, Mat, MatData, QuadSums, QuantSpec, Result, ScaleSearch, Swept, Tensor,
};
use anyhow::bail;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file (cuda/boa_dynamic.cu).
pub const MODULE: &str = "boa_dynamic";
/// kStepThreads: v1 jobs (threads) per CTA.
const STEP_V1_JOBS: u32 = 32;
/// kV2Jobs: v2 jobs (warps) per CTA.
const STEP_V2_JOBS: u32 = 4;
/// 32·kV2Slots: the widest group v2 holds in registers.
pub const V2_MAX_G: usize = 256;
/// kTrCols, kTrHeads: the trailing kernel's columns per CTA and heads per shared-U_col CTA.
const TRAILING_COLS: u32 = 64;
const TRAILING_HEADS: usize = 16;

/// The step kernel of the dynamic-group BoA sweep (cuda/boa_dynamic.cu header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoaDynamicVariant {
    /// v1: boa_dyn_step_kernel, one thread per (row, group) job; the naive port and the baseline.
    ThreadPerJob = 1,
    /// v2: boa_dyn_step_kernel_v2, one warp per job, the group's entries over the lanes (g ≤ 256).
    WarpPerJob = 2,
}

impl BoaDynamicVariant {
    pub const ALL: [BoaDynamicVariant; 2] = [
        BoaDynamicVariant::ThreadPerJob,
        BoaDynamicVariant::WarpPerJob,
    ];

    /// The variant that runs for groups of g columns: v2 holds a group in registers only up to V2_MAX_G.
    pub fn for_group(self, g: usize) -> BoaDynamicVariant {
        match self {
            BoaDynamicVariant::WarpPerJob if g <= V2_MAX_G => BoaDynamicVariant::WarpPerJob,
            _ => BoaDynamicVariant::ThreadPerJob,
        }
    }
}

pub struct BoaDynamicKernels {
    step_v1: CudaFunction,
    step_v2: CudaFunction,
    trailing: CudaFunction,
    /// The step kernel the sweeps run (`CudaBackend::set_boa_dynamic_variant`).
    variant: BoaDynamicVariant,
}

impl BoaDynamicKernels {
    pub fn load(module: &Arc<CudaModule>) -> std::result::Result<Self, CudaError> {
        let get = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(BoaDynamicKernels {
            step_v1: get("boa_dyn_step_kernel")?,
            step_v2: get("boa_dyn_step_kernel_v2")?,
            trailing: get("boa_dyn_trailing_kernel")?,
            variant: BoaDynamicVariant::WarpPerJob,
        })
    }
}

/// kSearchMinMax, kSearchMse, kSearchHessian.
fn search_kind(s: ScaleSearch) -> u32 {
    match s {
        ScaleSearch::MinMax => 0,
        ScaleSearch::Mse => 1,
        ScaleSearch::Hessian => 2,
    }
}

fn launch_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// Device buffers of a dynamic-group BoA sweep (R = n_heads·d_h rows, n columns, groups of g):
/// W0 [R × n] (the weights in sweep order, read only); A [R × n] (zeroed: −the own trailing updates);
/// δ [R × n]; Q, codes [R × n] out; scales, zeros [R × n_groups] out; E [R × g]; the v1 scratch scr_f
/// [3 × g × R], scr_i [2 × g × R], scr_d [g × R] (any length ≥ 1 for v2); U_col [n × n] or [n_heads × n × n];
/// H (damped, sweep order, shaped like U_col; read by the Hessian search only); F [n_heads × d_h × d_h].
pub struct BoaDynamicBuffers<'a> {
    pub w0: &'a CudaSlice<f32>,
    pub acc: &'a mut CudaSlice<f32>,
    pub delta: &'a mut CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub codes: &'a mut CudaSlice<u8>,
    pub scales: &'a mut CudaSlice<f32>,
    pub zeros: &'a mut CudaSlice<f32>,
    pub e: &'a mut CudaSlice<f32>,
    pub scr_f: &'a mut CudaSlice<f32>,
    pub scr_i: &'a mut CudaSlice<i32>,
    pub scr_d: &'a mut CudaSlice<f64>,
    pub u_col: &'a CudaSlice<f32>,
    pub h: &'a CudaSlice<f32>,
    pub f_row: &'a CudaSlice<f32>,
}

/// The shape of a dynamic-group BoA sweep.
#[derive(Clone, Copy, Debug)]
pub struct BoaDynamicShape {
    pub n_heads: usize,
    pub d_h: usize,
    pub n: usize,
    /// Columns per group (the last may be partial).
    pub g: usize,
    /// U_col (and H) per head rather than shared.
    pub per_head: bool,
}

/// Scratch lengths of the v1 step kernel: (f32, i32, f64).
pub fn v1_scratch(s: &BoaDynamicShape) -> (usize, usize, usize) {
    let gr = s.g.min(s.n) * s.n_heads * s.d_h;
    (3 * gr, 2 * gr, gr)
}

/// The active rows of super-step `step`: the first and how many (row i runs group step − i).
fn active(step: usize, d_h: usize, n_groups: usize) -> (usize, usize) {
    let lo = (step + 1).saturating_sub(n_groups);
    let hi = step.min(d_h - 1);
    (lo, hi + 1 - lo)
}

/// The dynamic-group BoA sweep: n_groups + d_h − 1 super-steps, each a step launch of `variant` (v2 falls back
/// to v1 for groups over V2_MAX_G) and a trailing launch. `spec` is the grid search's (its bits give the
/// search's maxq), `maxq` the quantizer's, as the CPU twin takes them.
pub fn launch_boa_sweep_dynamic(
    stream: &Arc<CudaStream>,
    k: &BoaDynamicKernels,
    variant: BoaDynamicVariant,
    buf: BoaDynamicBuffers,
    s: BoaDynamicShape,
    spec: &QuantSpec,
    maxq: u32,
) -> std::result::Result<(), CudaError> {
    let BoaDynamicShape {
        n_heads,
        d_h,
        n,
        g,
        per_head,
    } = s;
    let rows = n_heads * d_h;
    let n_groups = n.div_ceil(g.max(1));
    let variant = variant.for_group(g.min(n));
    let u_len = if per_head { n_heads * n * n } else { n * n };
    let hessian = spec.search == ScaleSearch::Hessian;
    let (sf, si, sd) = v1_scratch(&s);
    let v1 = variant == BoaDynamicVariant::ThreadPerJob;
    if d_h == 0
        || g == 0
        || buf.w0.len() != rows * n
        || buf.acc.len() != rows * n
        || buf.delta.len() != rows * n
        || buf.q.len() != rows * n
        || buf.codes.len() != rows * n
        || buf.scales.len() != rows * n_groups
        || buf.zeros.len() != rows * n_groups
        || buf.e.len() < rows * g.min(n)
        || (v1 && (buf.scr_f.len() < sf || buf.scr_i.len() < si || buf.scr_d.len() < sd))
        || buf.u_col.len() != u_len
        || (hessian && buf.h.len() != u_len)
        || buf.f_row.len() != n_heads * d_h * d_h
        || u32::try_from(rows * n).is_err()
        || u32::try_from(n_groups + d_h).is_err()
        || n_heads > u16::MAX as usize
    {
        return Err(CudaError::Shape {
            op: "boa_sweep_dynamic",
            msg: format!(
                "n_heads={n_heads}, d_h={d_h}, n={n}, g={g}, per_head={per_head}, {variant:?}: w0.len={}, \
                 e.len={}, scratch {}/{}/{} (v1 needs {sf}/{si}/{sd}), u_col.len={} (want {u_len}), h.len={}, \
                 f_row.len={}",
                buf.w0.len(),
                buf.e.len(),
                buf.scr_f.len(),
                buf.scr_i.len(),
                buf.scr_d.len(),
                buf.u_col.len(),
                buf.h.len(),
                buf.f_row.len()
            ),
        });
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let _r = range(c"boa_sweep_dynamic");
    let u_hs: u64 = if per_head { (n * n) as u64 } else { 0 };
    let h_hs = u_hs;
    let (dh32, n32, g32, ng32) = (d_h as u32, n as u32, g.min(n) as u32, n_groups as u32);
    let (search, sym) = (search_kind(spec.search), spec.sym as u32);
    let (smaxq, qmaxq) = (spec.maxq() as f32, maxq as f32);
    let (func, jobs_per_cta, threads) = match variant {
        BoaDynamicVariant::ThreadPerJob => (&k.step_v1, STEP_V1_JOBS, STEP_V1_JOBS),
        BoaDynamicVariant::WarpPerJob => (&k.step_v2, STEP_V2_JOBS, STEP_V2_JOBS * 32),
    };
    let heads_per_tr = if per_head { 1 } else { TRAILING_HEADS };
    let tr_z = n_heads.div_ceil(heads_per_tr) as u32;
    let n_h32 = n_heads as u32;
    for step in 0..n_groups + d_h - 1 {
        let (i_lo, n_active) = active(step, d_h, n_groups);
        let (step32, lo32, na32) = (step as u32, i_lo as u32, n_active as u32);
        {
            let cfg = LaunchConfig {
                grid_dim: (na32.div_ceil(jobs_per_cta), n_h32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut lb = stream.launch_builder(func);
            lb.arg(buf.w0)
                .arg(&*buf.acc)
                .arg(&mut *buf.delta)
                .arg(&mut *buf.q)
                .arg(&mut *buf.codes)
                .arg(&mut *buf.scales)
                .arg(&mut *buf.zeros)
                .arg(&mut *buf.e)
                .arg(&mut *buf.scr_f)
                .arg(&mut *buf.scr_i)
                .arg(&mut *buf.scr_d)
                .arg(buf.u_col)
                .arg(&u_hs)
                .arg(buf.h)
                .arg(&h_hs)
                .arg(buf.f_row)
                .arg(&dh32)
                .arg(&n32)
                .arg(&g32)
                .arg(&ng32)
                .arg(&step32)
                .arg(&lo32)
                .arg(&na32)
                .arg(&search)
                .arg(&sym)
                .arg(&smaxq)
                .arg(&qmaxq);
            // SAFETY: arguments match boa_dyn_step_kernel{,_v2}(BOA_DYN_STEP_ARGS): const float* w0, acc;
            // float* delta, q; uint8* codes; float* scales, zeros, e, scr_f; int32* scr_i; double* scr_d;
            // const float* u_col; uint64; const float* h; uint64; const float* f_row; uint32 d_h, n, g,
            // n_groups, step, i_lo, n_active, search, sym; float search_maxq, maxq. Grid (⌈n_active/jobs⌉,
            // n_heads): a job is row i_lo + a < d_h of a head < n_heads, group step − i < n_groups (active()),
            // so rows·n, rows·n_groups, rows·g and (v1) the scratch bound every index, as checked above; h is
            // read only by the Hessian search, for which its length was checked; v2 touches no scratch.
            unsafe { lb.launch(cfg) }.map_err(launch_err("launch boa_dyn_step"))?;
        }
        {
            let cfg = LaunchConfig {
                grid_dim: (n32.div_ceil(TRAILING_COLS), na32, tr_z),
                block_dim: (TRAILING_COLS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut lb = stream.launch_builder(&k.trailing);
            lb.arg(&mut *buf.acc)
                .arg(&*buf.e)
                .arg(buf.u_col)
                .arg(&u_hs)
                .arg(&n_h32)
                .arg(&dh32)
                .arg(&n32)
                .arg(&g32)
                .arg(&step32)
                .arg(&lo32);
            // SAFETY: arguments match boa_dyn_trailing_kernel(float* acc, const float* e, const float* u_col,
            // uint64 u_head_stride, uint32 n_heads, d_h, n, g, step, i_lo); grid.y spans the active rows and
            // grid.z the head tiles (16 heads shared, 1 per head), so every row index is < rows, every E index
            // < rows·g and every U_col index < u_len (checked above); columns ≥ n are guarded in the kernel.
            unsafe { lb.launch(cfg) }.map_err(launch_err("launch boa_dyn_trailing"))?;
        }
    }
    Ok(())
}

fn dev<'a>(m: &'a Mat, what: &str) -> Result<&'a CudaSlice<f32>> {
    match &m.data {
        MatData::F32(Tensor::Device(d)) => Ok(d),
        _ => bail!(
            "cuda: {what} {} is not in device memory (upload it with upload_mat)",
            m.describe()
        ),
    }
}

fn dmat(d: CudaSlice<f32>, batch: usize, rows: usize, cols: usize) -> Mat {
    Mat::tensor(Tensor::Device(d), batch, rows, cols)
}

impl CudaBackend {
    /// Selects the dynamic-group BoA sweep's step kernel: one warp per job (v2, the default) or one thread
    /// (v1, the direct port).
    pub fn set_boa_dynamic_variant(&mut self, v: BoaDynamicVariant) {
        self.quant.boa_dynamic.variant = v;
    }

    /// The step kernel a dynamic-group sweep with groups of g columns runs.
    pub fn boa_dynamic_variant_in_use(&self, g: usize) -> BoaDynamicVariant {
        self.quant.boa_dynamic.variant.for_group(g)
    }

    /// `QuantOps::boa_sweep` with `GridMode::Dynamic` (quant.rs): W [n_heads·d_h × n] in sweep order, U_col
    /// [1 or n_heads × n × n], U_row [n_heads × d_h × d_h], H (the damped H_col in sweep order, like U_col;
    /// required for the Hessian search), groups of g columns. The grids come back [rows × n_groups]; loss and
    /// delta_sq are NaN (BoA's report comes from `quad_forms`), as on the CPU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn boa_sweep_dynamic(
        &self,
        w: Mat,
        u_col: &Mat,
        u_row: &Mat,
        d_h: usize,
        g: usize,
        h: Option<&Mat>,
        spec: &QuantSpec,
        maxq: u32,
    ) -> Result<Swept> {
        let (rows, n) = (w.rows, w.cols);
        let n_heads = rows / d_h.max(1);
        let per_head = u_col.batch == n_heads && n_heads > 1;
        if d_h == 0
            || g == 0
            || w.batch != 1
            || n_heads * d_h != rows
            || u_col.rows != n
            || u_col.cols != n
            || !(u_col.batch == 1 || per_head)
            || u_row.batch != n_heads
            || u_row.rows != d_h
            || u_row.cols != d_h
        {
            bail!(
                "boa_sweep (dynamic groups of {g}): U_col {} and U_row {} for W {} in heads of {d_h}",
                u_col.describe(),
                u_row.describe(),
                w.describe()
            );
        }
        let hessian = spec.search == ScaleSearch::Hessian;
        let h_d = match (hessian, h) {
            (true, Some(h)) => {
                if h.batch != u_col.batch || h.rows != n || h.cols != n {
                    bail!(
                        "boa_sweep: H_col {} does not match U_col {}",
                        h.describe(),
                        u_col.describe()
                    );
                }
                Some(dev(h, "H_col")?)
            }
            (true, None) => bail!("boa_sweep: the Hessian search needs H_col"),
            (false, _) => None,
        };
        let w0 = match &w.data {
            MatData::F32(Tensor::Device(d)) => d,
            _ => bail!("cuda: W {} is not in device memory", w.describe()),
        };
        let u_d = dev(u_col, "U_col")?;
        let n_groups = n.div_ceil(g);
        let gl = g.min(n);
        let shape = BoaDynamicShape {
            n_heads,
            d_h,
            n,
            g,
            per_head,
        };
        let stream = &self.stream;
        let zeros_f32 = |len: usize, what: &'static str| {
            stream.alloc_zeros::<f32>(len.max(1)).map_err(driver(what))
        };
        let mut f = self.output((n_heads * d_h * d_h).max(1))?;
        launch_u_row_f(
            stream,
            &self.quant.core,
            &mut f,
            dev(u_row, "U_row")?,
            d_h,
            n_heads,
        )?;
        let variant = self.boa_dynamic_variant_in_use(gl);
        let (sf, si, sd) = match variant {
            BoaDynamicVariant::ThreadPerJob => v1_scratch(&shape),
            BoaDynamicVariant::WarpPerJob => (1, 1, 1),
        };
        let mut acc = zeros_f32(rows * n, "alloc A")?;
        let mut delta = self.output(rows * n)?;
        let mut q = self.output(rows * n)?;
        let mut codes = self.codes_output(rows * n)?;
        let mut scales = self.output(rows * n_groups)?;
        let mut zeros = self.output(rows * n_groups)?;
        let mut e = self.output(rows * gl)?;
        let mut scr_f = zeros_f32(sf, "alloc scratch")?;
        let mut scr_i = stream
            .alloc_zeros::<i32>(si.max(1))
            .map_err(driver("alloc scratch"))?;
        let mut scr_d = stream
            .alloc_zeros::<f64>(sd.max(1))
            .map_err(driver("alloc scratch"))?;
        // The search reads H only for the Hessian search; another passes U_col in its place (never read).
        launch_boa_sweep_dynamic(
            stream,
            &self.quant.boa_dynamic,
            variant,
            BoaDynamicBuffers {
                w0,
                acc: &mut acc,
                delta: &mut delta,
                q: &mut q,
                codes: &mut codes,
                scales: &mut scales,
                zeros: &mut zeros,
                e: &mut e,
                scr_f: &mut scr_f,
                scr_i: &mut scr_i,
                scr_d: &mut scr_d,
                u_col: u_d,
                h: h_d.unwrap_or(u_d),
                f_row: &f,
            },
            shape,
            spec,
            maxq,
        )?;
        Ok(Swept {
            q: dmat(q, 1, rows, n),
            codes: Codes::Device(codes),
            grids: Grids {
                scale: dmat(scales, 1, rows, n_groups),
                zero: dmat(zeros, 1, rows, n_groups),
            },
            loss: QuadSums::Host(vec![f64::NAN; 2]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (row, group) job runs in exactly one super-step, row i on group step − i, and the rows of a
    /// super-step are consecutive.
    #[test]
    fn super_steps_cover_every_job_once() {
        for (d_h, n_groups) in [
            (1, 1),
            (1, 5),
            (4, 1),
            (4, 3),
            (3, 7),
            (128, 32),
            (128, 64),
            (64, 200),
        ] {
            let mut seen = vec![0u32; d_h * n_groups];
            for step in 0..n_groups + d_h - 1 {
                let (lo, na) = active(step, d_h, n_groups);
                assert!(
                    na >= 1 && lo + na <= d_h,
                    "d_h {d_h}, {n_groups} groups, step {step}"
                );
                for i in lo..lo + na {
                    let k = step - i;
                    assert!(k < n_groups);
                    seen[i * n_groups + k] += 1;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "d_h {d_h}, {n_groups} groups");
        }
    }
}
