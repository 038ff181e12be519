//! Host side of cuda/qgemm.cu, the packed low-bit GEMM Y [m × n] = X [m × k] · Ŵᵀ (+ bias) with Ŵ in the GPTQ
//! layout (`quant::pack::PackedLinear`): kernel handles, the launch plan of the fused kernel, the launchers,
//! and `CudaBackend::try_packed_linear` (same section order as the .cu: handles, then launchers).
//!
//! Two paths (`QgemmVariant`; the .cu header has shapes and rooflines):
//!   - m ≤ 16: the fused dequant + dot kernel (v2), split-K with its deterministic in-kernel reduction;
//!   - m > 16: dequantize Ŵ to an f32 device buffer (v1), then cublasSgemm through `gemm::Blas::linear`.
//!     Without libcublas the `Backend` method computes these on the CPU (the reason is printed once, by
//!     `CudaBackend::blas`).
//!
//! The packed tensors are uploaded on every call (a few MiB per projection; the forward holds host tensors
//! today). Keeping them resident belongs to the tensor-residency layer, not to this file.

use super::gemm::LinearVariant;
use super::ops;
use super::{CudaBackend, CudaError, driver};
use crate::nvtx::range;
use crate::quant::pack::{PackedLinear, pack_words};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file these kernels come from (cuda/qgemm.cu).
pub const MODULE: &str = "qgemm";

/// Threads (= output columns) per CTA of both kernels. Must match kQgemmThreads and kDequantThreads in
/// cuda/qgemm.cu (their __launch_bounds__).
const THREADS: u32 = 128;
/// Codes per super-row (kSuperRow): b words hold exactly 32 b-bit codes, and splits start on super-rows.
const SUPER_ROW: usize = 32;
/// Token tiles the fused kernel is instantiated for (the smallest ≥ m runs).
const TOKEN_TILES: [usize; 5] = [1, 2, 4, 8, 16];
/// Bit widths instantiated (GPTQ's).
const BITS: [u32; 4] = [2, 3, 4, 8];
/// Largest m the fused kernel takes; larger batches dequantize and use cuBLAS.
pub const FUSED_MAX_M: usize = 16;
/// Dynamic shared memory a fused CTA may use without raising its limit (the staged X slice and g_idx).
const SMEM_LIMIT: usize = 48 * 1024;
/// CTAs per SM the split-K heuristic aims for with token tiles ≤ 4 (memory-bound: 8 × 128 threads per SM keep
/// ~32 KiB of loads in flight); larger tiles are issue-bound and get half, which halves the partials' traffic.
/// Untuned: no GPU run yet.
const CTAS_PER_SM: usize = 8;
/// Largest grid y (splits) and, for the dequantize kernel, the largest number of super-rows.
const GRID_Y_MAX: usize = 65535;

/// Packed GEMM variants (style.md rule 4: the plain one stays selectable). `Auto` in `try_packed_linear`
/// means Fused for m ≤ FUSED_MAX_M, Dequant above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QgemmVariant {
    /// v1: dequantize Ŵ to f32 on the device, then cublasSgemm; any m.
    Dequant = 1,
    /// v2: fused dequant + dot in registers, split-K; m ≤ FUSED_MAX_M.
    Fused = 2,
}

impl QgemmVariant {
    pub const ALL: [QgemmVariant; 2] = [QgemmVariant::Dequant, QgemmVariant::Fused];
}

/// Function handles of cuda/qgemm.cu, loaded on first use, and the SM count the split heuristic needs.
pub struct QgemmKernels {
    /// [bits index × token tile index], contiguous groups.
    fused: Vec<CudaFunction>,
    /// [bits index × token tile index], any g_idx.
    fused_gidx: Vec<CudaFunction>,
    /// [bits index].
    dequant: Vec<CudaFunction>,
    sms: usize,
}

fn bits_index(bits: u32) -> Option<usize> {
    BITS.iter().position(|&b| b == bits)
}

impl QgemmKernels {
    pub fn load(module: &Arc<CudaModule>, sms: usize) -> Result<Self, CudaError> {
        let get = |name: String| {
            module
                .load_function(&name)
                .map_err(|e| CudaError::MissingKernel {
                    module: MODULE,
                    // Leaked once per kernel name when one is missing: the error outlives this frame.
                    kernel: Box::leak(name.into_boxed_str()),
                    source: e,
                })
        };
        let (mut fused, mut fused_gidx, mut dequant) = (Vec::new(), Vec::new(), Vec::new());
        for b in BITS {
            for t in TOKEN_TILES {
                fused.push(get(format!("qgemm_fused_kernel_b{b}_m{t}"))?);
                fused_gidx.push(get(format!("qgemm_fused_gidx_kernel_b{b}_m{t}"))?);
            }
            dequant.push(get(format!("qgemm_dequant_kernel_b{b}"))?);
        }
        Ok(QgemmKernels {
            fused,
            fused_gidx,
            dequant,
            sms: sms.max(1),
        })
    }
}

/// How the fused kernel splits one problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedPlan {
    /// Token tile MT (the kernel instance), ≥ m.
    pub tile: usize,
    /// Super-rows (32 input rows) per split.
    pub sr_per_split: usize,
    /// Splits of the input dimension (grid y); none of them is empty.
    pub splits: usize,
    /// Column blocks of THREADS outputs (grid x).
    pub col_blocks: usize,
    /// Dynamic shared memory per CTA, bytes.
    pub smem_bytes: usize,
}

/// The fused kernel's launch plan for m tokens, k inputs, n outputs on `sms` SMs (a pure function, so the
/// tests check its invariants without a GPU): enough splits of k to give the chip about CTAS_PER_SM CTAs per SM,
/// each split's X slice within SMEM_LIMIT, no empty split, at most GRID_Y_MAX splits.
pub fn fused_plan(
    m: usize,
    k: usize,
    n: usize,
    gidx: bool,
    sms: usize,
) -> Result<FusedPlan, String> {
    let tile = TOKEN_TILES
        .into_iter()
        .find(|&t| t >= m)
        .filter(|_| m >= 1)
        .ok_or_else(|| format!("the fused kernel takes 1 ≤ m ≤ {FUSED_MAX_M}, got m={m}"))?;
    if k == 0 || n == 0 {
        return Err(format!("k={k} and n={n} must be ≥ 1"));
    }
    let nsr = k.div_ceil(SUPER_ROW);
    let col_blocks = n.div_ceil(THREADS as usize);
    let per_sr_bytes = SUPER_ROW * 4 * (tile + gidx as usize);
    let max_spb = SMEM_LIMIT / per_sr_bytes; // ≥ 22 for tile 16 with g_idx
    let per_sm = if tile <= 4 {
        CTAS_PER_SM
    } else {
        CTAS_PER_SM / 2
    };
    let want_splits = (sms.max(1) * per_sm).div_ceil(col_blocks).max(1);
    let spb = nsr
        .div_ceil(want_splits)
        .clamp(1, max_spb)
        .max(nsr.div_ceil(GRID_Y_MAX));
    if spb > max_spb {
        return Err(format!(
            "k={k} needs more than {GRID_Y_MAX} splits of {max_spb} super-rows (shared memory)"
        ));
    }
    let splits = nsr.div_ceil(spb);
    Ok(FusedPlan {
        tile,
        sr_per_split: spb,
        splits,
        col_blocks,
        smem_bytes: spb * per_sr_bytes,
    })
}

/// A packed linear's tensors on the device.
pub struct DevicePacked {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    pub n_groups: usize,
    /// Super-rows per group when the groups are contiguous and start on super-rows (group size a multiple of
    /// 32, or one group): the fused kernel's fast case. None: g_idx is looked up per code.
    pub group_sr: Option<usize>,
    /// [ceil(d_in·b/32) × d_out].
    pub qweight: CudaSlice<u32>,
    /// [n_groups × d_out].
    pub scales: CudaSlice<f32>,
    /// [n_groups × d_out], true zero points.
    pub zeros: CudaSlice<f32>,
    /// [d_in].
    pub g_idx: CudaSlice<u32>,
}

/// The fused kernel's fast case for `p`, if any (see `DevicePacked::group_sr`).
pub fn contiguous_group_sr(p: &PackedLinear) -> Option<usize> {
    let nsr = p.d_in.div_ceil(SUPER_ROW).max(1);
    let g = p.contiguous_group()?;
    if p.n_groups == 1 {
        Some(nsr)
    } else {
        g.is_multiple_of(SUPER_ROW).then_some(g / SUPER_ROW)
    }
}

/// Device buffers the launches reuse between calls (the bench keeps one; `try_packed_linear` makes one per
/// call). The split counters must be zero between launches: they are allocated zeroed and every fused launch
/// leaves them zero.
#[derive(Default)]
pub struct QgemmScratch {
    part: Option<CudaSlice<f32>>,
    counters: Option<CudaSlice<u32>>,
    w_hat: Option<CudaSlice<f32>>,
}

impl QgemmScratch {
    fn ensure_fused(
        &mut self,
        stream: &Arc<CudaStream>,
        part_len: usize,
        blocks: usize,
    ) -> Result<(), CudaError> {
        if self.part.as_ref().is_none_or(|p| p.len() < part_len.max(1)) {
            // SAFETY: every partial the kernel reads back was written by a CTA of the same launch first.
            self.part = Some(
                unsafe { stream.alloc::<f32>(part_len.max(1)) }
                    .map_err(driver("alloc qgemm partials"))?,
            );
        }
        if self.counters.as_ref().is_none_or(|c| c.len() < blocks) {
            self.counters = Some(
                stream
                    .alloc_zeros::<u32>(blocks)
                    .map_err(driver("alloc qgemm counters"))?,
            );
        }
        Ok(())
    }
}

/// Y [m × n] = X [m × k] · Ŵᵀ by the fused kernel (no bias), asynchronous on `stream`.
pub fn launch_qgemm_fused(
    stream: &Arc<CudaStream>,
    kern: &QgemmKernels,
    y: &mut CudaSlice<f32>,
    x: &CudaSlice<f32>,
    w: &DevicePacked,
    m: usize,
    scratch: &mut QgemmScratch,
) -> Result<(), CudaError> {
    let (k, n) = (w.d_in, w.d_out);
    let shape_err = |msg: String| CudaError::Shape {
        op: "packed_linear (fused)",
        msg: format!("{msg} (m={m}, k={k}, n={n}, bits={})", w.bits),
    };
    let bi = bits_index(w.bits).ok_or_else(|| shape_err("unsupported bit width".into()))?;
    check_device_packed(w).map_err(shape_err)?;
    if x.len() != m * k || y.len() != m * n {
        return Err(shape_err(format!(
            "x.len={} or y.len={} do not match [m × k], [m × n]",
            x.len(),
            y.len()
        )));
    }
    let gidx = w.group_sr.is_none();
    let plan = fused_plan(m, k, n, gidx, kern.sms).map_err(shape_err)?;
    let (Ok(m32), Ok(k32), Ok(n32), Ok(spb32), Ok(blocks32), Ok(splits32)) = (
        u32::try_from(m),
        u32::try_from(k),
        u32::try_from(n),
        u32::try_from(plan.sr_per_split),
        u32::try_from(plan.col_blocks),
        u32::try_from(plan.splits),
    ) else {
        return Err(shape_err("sizes must fit in u32".into()));
    };
    let group_sr32 = u32::try_from(w.group_sr.unwrap_or(1).max(1)).unwrap_or(u32::MAX);
    scratch.ensure_fused(stream, plan.splits * m * n, plan.col_blocks)?;
    let (Some(part), Some(counters)) = (scratch.part.as_mut(), scratch.counters.as_mut()) else {
        unreachable!("ensure_fused allocated both")
    };
    let ti = TOKEN_TILES
        .iter()
        .position(|&t| t == plan.tile)
        .expect("plan tiles are instantiated");
    let f = if gidx { &kern.fused_gidx } else { &kern.fused }[bi * TOKEN_TILES.len() + ti].clone();
    let cfg = LaunchConfig {
        grid_dim: (blocks32, splits32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: plan.smem_bytes as u32,
    };
    let _r = range(c"qgemm_fused");
    let mut b = stream.launch_builder(&f);
    b.arg(y)
        .arg(part)
        .arg(counters)
        .arg(x)
        .arg(&w.qweight)
        .arg(&w.scales)
        .arg(&w.zeros)
        .arg(&w.g_idx)
        .arg(&m32)
        .arg(&k32)
        .arg(&n32)
        .arg(&spb32)
        .arg(&group_sr32);
    // SAFETY: matches qgemm_fused[_gidx]_kernel_b{b}_m{MT}(float* y, float* part, uint32* counters,
    // const float* x, const uint32* qweight, const float* scales, const float* zeros, const uint32* g_idx,
    // uint32 m, uint32 k, uint32 n, uint32 sr_per_split, uint32 group_sr) with MT = plan.tile ≥ m; y holds m·n
    // and x m·k f32 (checked), the packed tensors their sizes (check_device_packed), part ≥ splits·m·n f32 and
    // counters ≥ col_blocks zeroed u32 (ensure_fused; every launch leaves them zero); the grid has
    // ceil(nsr/spb) splits, none empty, and dynamic smem spb·32·(MT + gidx)·4 B ≤ 48 KiB (fused_plan); group_sr
    // ≥ 1 and, in the contiguous case, g = sr / group_sr < n_groups for every super-row.
    unsafe { b.launch(cfg) }.map_err(driver("launch qgemm_fused"))?;
    Ok(())
}

/// Ŵ [n × k] f32 row-major from the packed tensors, asynchronous on `stream`.
pub fn launch_qgemm_dequant(
    stream: &Arc<CudaStream>,
    kern: &QgemmKernels,
    w_hat: &mut CudaSlice<f32>,
    w: &DevicePacked,
) -> Result<(), CudaError> {
    let (k, n) = (w.d_in, w.d_out);
    let shape_err = |msg: String| CudaError::Shape {
        op: "packed_linear (dequantize)",
        msg: format!("{msg} (k={k}, n={n}, bits={})", w.bits),
    };
    let bi = bits_index(w.bits).ok_or_else(|| shape_err("unsupported bit width".into()))?;
    check_device_packed(w).map_err(shape_err)?;
    if w_hat.len() != n * k {
        return Err(shape_err(format!("w_hat.len={} is not n·k", w_hat.len())));
    }
    let nsr = k.div_ceil(SUPER_ROW);
    if k == 0 || n == 0 {
        return Ok(());
    }
    if nsr > GRID_Y_MAX {
        return Err(shape_err(format!(
            "k over {} (grid y limit)",
            GRID_Y_MAX * SUPER_ROW
        )));
    }
    let (Ok(k32), Ok(n32)) = (u32::try_from(k), u32::try_from(n)) else {
        return Err(shape_err("sizes must fit in u32".into()));
    };
    let cfg = LaunchConfig {
        grid_dim: (n32.div_ceil(THREADS), nsr as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let _r = range(c"qgemm_dequant");
    let mut b = stream.launch_builder(&kern.dequant[bi]);
    b.arg(w_hat)
        .arg(&w.qweight)
        .arg(&w.scales)
        .arg(&w.zeros)
        .arg(&w.g_idx)
        .arg(&k32)
        .arg(&n32);
    // SAFETY: matches qgemm_dequant_kernel_b{b}(float* w_hat, const uint32* qweight, const float* scales,
    // const float* zeros, const uint32* g_idx, uint32 k, uint32 n); w_hat holds n·k f32 (checked), the packed
    // tensors their sizes and every g_idx < n_groups (check_device_packed, validated on upload); threads with
    // j ≥ n return, and codes i ≥ k are neither read from g_idx nor written.
    unsafe { b.launch(cfg) }.map_err(driver("launch qgemm_dequant"))?;
    Ok(())
}

/// The sizes every launcher relies on (g_idx values were checked by `PackedLinear::validate` on upload).
fn check_device_packed(w: &DevicePacked) -> Result<(), String> {
    let gs = w.n_groups * w.d_out;
    if w.qweight.len() != pack_words(w.d_in, w.bits) * w.d_out
        || w.scales.len() != gs
        || w.zeros.len() != gs
        || w.g_idx.len() != w.d_in
        || w.n_groups == 0
    {
        return Err("device tensors have inconsistent sizes".into());
    }
    if let Some(gsr) = w.group_sr
        && (gsr == 0 || w.d_in.div_ceil(SUPER_ROW).div_ceil(gsr) > w.n_groups)
    {
        return Err(format!("group_sr={gsr} does not fit {} groups", w.n_groups));
    }
    Ok(())
}

impl CudaBackend {
    /// The qgemm kernels, loaded on first use (a broken qgemm module must not keep the other ops from running).
    fn qgemm_kernels(&self) -> Result<&QgemmKernels, CudaError> {
        self.qgemm
            .get_or_init(|| {
                let cc = self.ctx.compute_capability().unwrap_or((0, 0));
                let module = super::load_module(&self.ctx, MODULE, &self.name, cc)?;
                let sms = self
                    .ctx
                    .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                    .map_err(|e| format!("multiprocessor count: {e}"))?;
                QgemmKernels::load(&module, sms.max(1) as usize).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|msg| CudaError::Shape {
                op: "packed_linear",
                msg: msg.clone(),
            })
    }

    /// Uploads a packed linear (checked by `PackedLinear::validate` first).
    pub fn upload_packed(&self, p: &PackedLinear) -> Result<DevicePacked, CudaError> {
        p.validate().map_err(|msg| CudaError::Shape {
            op: "packed_linear",
            msg,
        })?;
        let s = &self.stream;
        self.counters.htod(p.bytes());
        Ok(DevicePacked {
            d_out: p.d_out,
            d_in: p.d_in,
            bits: p.bits,
            n_groups: p.n_groups,
            group_sr: contiguous_group_sr(p),
            qweight: s.clone_htod(&p.qweight).map_err(driver("upload qweight"))?,
            scales: s.clone_htod(&p.scales).map_err(driver("upload scales"))?,
            zeros: s.clone_htod(&p.zeros).map_err(driver("upload zeros"))?,
            g_idx: s.clone_htod(&p.g_idx).map_err(driver("upload g_idx"))?,
        })
    }

    /// Y [m × n] = X [m × k] · Ŵᵀ (+ bias) on device buffers with `variant`, asynchronous. Dequant needs cuBLAS.
    #[allow(clippy::too_many_arguments)]
    pub fn packed_linear_device(
        &self,
        variant: QgemmVariant,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &DevicePacked,
        bias: Option<&CudaSlice<f32>>,
        m: usize,
        scratch: &mut QgemmScratch,
    ) -> Result<(), CudaError> {
        let kern = self.qgemm_kernels()?;
        let (k, n) = (w.d_in, w.d_out);
        match variant {
            QgemmVariant::Fused => {
                launch_qgemm_fused(&self.stream, kern, y, x, w, m, scratch)?;
                if let Some(b) = bias {
                    ops::launch_bias_add(&self.stream, &self.ops, y, b, n)?;
                }
            }
            QgemmVariant::Dequant => {
                let blas = self.blas().map_err(|why| CudaError::Shape {
                    op: "packed_linear",
                    msg: format!("cuBLAS unavailable: {why}"),
                })?;
                if scratch.w_hat.as_ref().is_none_or(|w| w.len() != n * k) {
                    // SAFETY: launch_qgemm_dequant writes all n·k elements before the GEMM reads them.
                    scratch.w_hat = Some(
                        unsafe { self.stream.alloc::<f32>(n * k) }.map_err(driver("alloc Ŵ"))?,
                    );
                }
                let w_hat = scratch.w_hat.as_mut().expect("allocated above");
                launch_qgemm_dequant(&self.stream, kern, w_hat, w)?;
                blas.linear(&self.ops, LinearVariant::F32, y, x, w_hat, bias, m, k, n)?;
            }
        }
        Ok(())
    }

    /// `try_packed_linear` with the variant chosen by the caller (tests run both on every shape they can).
    pub fn try_packed_linear_variant(
        &self,
        x: &[f32],
        w: &PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
        variant: QgemmVariant,
    ) -> Result<Vec<f32>, CudaError> {
        let (k, n) = (w.d_in, w.d_out);
        if x.len() != m * k || bias.is_some_and(|b| b.len() != n) {
            return Err(CudaError::Shape {
                op: "packed_linear",
                msg: format!(
                    "x.len={}, bias.len={:?} do not match [m={m} × k={k}], [n={n}]",
                    x.len(),
                    bias.map(<[f32]>::len)
                ),
            });
        }
        if m == 0 || n == 0 {
            return Ok(Vec::new());
        }
        if k == 0 {
            return Err(CudaError::Shape {
                op: "packed_linear",
                msg: "k = 0 (nothing to multiply)".into(),
            });
        }
        let wd = self.upload_packed(w)?;
        let x_d = self.stream.clone_htod(x).map_err(driver("upload x"))?;
        let b_d = match bias {
            Some(b) => Some(self.stream.clone_htod(b).map_err(driver("upload bias"))?),
            None => None,
        };
        let mut y_d = self.output(m * n)?;
        let mut scratch = QgemmScratch::default();
        self.timed(|| {
            self.packed_linear_device(variant, &mut y_d, &x_d, &wd, b_d.as_ref(), m, &mut scratch)
        })?;
        let y = self.stream.clone_dtoh(&y_d).map_err(driver("download y"))?;
        // Surfaces asynchronous kernel faults here, naming the op, rather than at some later call.
        self.stream.synchronize().map_err(driver("packed_linear"))?;
        Ok(y)
    }

    /// Y [m × n] = X [m × k] · Ŵᵀ (+ bias) on the GPU; see `Backend::packed_linear`: the fused kernel for
    /// m ≤ FUSED_MAX_M, dequantize + cuBLAS above (an error when cuBLAS cannot be opened).
    pub fn try_packed_linear(
        &self,
        x: &[f32],
        w: &PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Result<Vec<f32>, CudaError> {
        self.try_packed_linear_variant(x, w, bias, m, auto_variant(m))
    }
}

/// The variant `try_packed_linear` picks for m tokens.
pub fn auto_variant(m: usize) -> QgemmVariant {
    if m <= FUSED_MAX_M {
        QgemmVariant::Fused
    } else {
        QgemmVariant::Dequant
    }
}

impl CudaBackend {
    /// Benchmarks (src/bench/gpu.rs): device milliseconds per launch of `variant` with the packed copies `ws`
    /// taken in turn (`launches` back-to-back launches between two events, after one warm-up launch per copy),
    /// and Y of the first copy, computed before any timing so the caller can validate it.
    pub fn time_packed_linear(
        &self,
        variant: QgemmVariant,
        ws: &[DevicePacked],
        x: &[f32],
        m: usize,
        launches: usize,
    ) -> Result<(f64, Vec<f32>), CudaError> {
        let Some(w0) = ws.first() else {
            return Err(CudaError::Shape {
                op: "time_packed_linear",
                msg: "no packed copies".into(),
            });
        };
        let n = w0.d_out;
        let x_d = self.stream.clone_htod(x).map_err(driver("upload x"))?;
        let mut y_d = self.output(m * n)?;
        let mut scratch = QgemmScratch::default();
        self.packed_linear_device(variant, &mut y_d, &x_d, w0, None, m, &mut scratch)?;
        let y = self.stream.clone_dtoh(&y_d).map_err(driver("download y"))?;
        self.stream.synchronize().map_err(driver("packed_linear"))?;
        for w in ws {
            self.packed_linear_device(variant, &mut y_d, &x_d, w, None, m, &mut scratch)?;
        }
        self.timed(|| {
            for i in 0..launches.max(1) {
                self.packed_linear_device(
                    variant,
                    &mut y_d,
                    &x_d,
                    &ws[i % ws.len()],
                    None,
                    m,
                    &mut scratch,
                )?;
            }
            Ok(())
        })?;
        Ok((self.last_kernel_ms() as f64 / launches.max(1) as f64, y))
    }
}
