//! Host side of cuda/hessian.cu (same order: kernel handles, then launchers). Launch shapes and rooflines are
//! in the .cu header.

use super::CudaError;
use crate::nvtx::range;
use crate::ops::AttnShape;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file these kernels come from (cuda/hessian.cu).
pub const MODULE: &str = "hessian";

/// Gram (XᵀX) variants of the statistics (style.md rule 17: every instantiated variant, with its reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XxtVariant {
    /// v1: f32 shared-memory tiles, every element: the exact baseline.
    F32Tiled = 1,
    /// v2: bf16 wmma tensor cores with f32 accumulation, upper-triangle tiles mirrored (no cp.async pipeline).
    Bf16Wmma = 2,
    /// v3: cuBLAS GemmStridedBatchedEx, bf16 operands (X converted once per chunk; V's Y written in bf16 by
    /// attn_x), f32 accumulation: Hopper's tensor cores at the library's rate, both triangles (2× the flops of
    /// v2's triangle, at a far higher rate than a hand-written wmma loop without a pipeline); the default.
    /// Needs libcublas: without it, v2.
    Cublas = 3,
}

impl XxtVariant {
    pub const ALL: [XxtVariant; 3] = [
        XxtVariant::F32Tiled,
        XxtVariant::Bf16Wmma,
        XxtVariant::Cublas,
    ];

    fn kernel_name(self) -> &'static str {
        match self {
            XxtVariant::F32Tiled => "hessian_xxt_kernel_v1",
            XxtVariant::Bf16Wmma | XxtVariant::Cublas => "hessian_xxt_kernel_v2",
        }
    }
}

/// Y = A_h X kernel variants of the V column statistics (style.md rule 17).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnXVariant {
    /// v1: f32 FFMA, 32 rows × 64 columns per block: the exact baseline.
    F32Tiled = 1,
    /// v2: tensor cores (fp16 scores, bf16 P·X, f32 accumulation), 64 rows × 256 columns per block, so the
    /// scores are recomputed 4× less often than in v1. 42 TFLOP/s on an H200 (bench attn_x, 2026-12-04).
    Bf16Wmma = 2,
    /// v3: no attn_x kernel: the scores by cuBLAS SGEMM, the probabilities by `attn_probs_bf16_kernel`, A·X
    /// by a cuBLAS bf16 GEMM, batched over sequences (cuda/hessian.cu attn_probs_bf16); the default where
    /// cuBLAS loads (v2 otherwise).
    Gemm = 3,
}

impl AttnXVariant {
    pub const ALL: [AttnXVariant; 3] = [
        AttnXVariant::F32Tiled,
        AttnXVariant::Bf16Wmma,
        AttnXVariant::Gemm,
    ];
    /// The variants that are one attn_x kernel (`launch_attn_x`, the bench's attn_x rows).
    pub const KERNELS: [AttnXVariant; 2] = [AttnXVariant::F32Tiled, AttnXVariant::Bf16Wmma];

    fn kernel_name(self) -> &'static str {
        match self {
            AttnXVariant::F32Tiled => "attn_x_kernel_v1",
            AttnXVariant::Bf16Wmma => "attn_x_kernel_v2",
            AttnXVariant::Gemm => "attn_probs_bf16_kernel",
        }
    }
}

/// Must match kXxtV1Tile / kXxtV2Tile, kXxtV2Threads in cuda/hessian.cu.
const XXT_V1_TILE: u32 = 16;
const XXT_V2_TILE: u32 = 64;
const XXT_V2_THREADS: u32 = 128;
/// Must match kStatsWarps, kMaxDh, kNarrowDh, kAxRows, kAxCols, kAxThreads in cuda/hessian.cu.
const STATS_WARPS: u32 = 4;
pub const ATTN_MAX_DH: usize = 256;
/// Head dims up to this take the attn_x kernels' narrow instantiation, above it (≤ ATTN_MAX_DH) the wide one.
const NARROW_DH: usize = 128;
const AX_ROWS: u32 = 32;
const AX_COLS: u32 = 64;
const AX_THREADS: u32 = 256;
/// attn_x v1's dynamic shared memory, narrow and wide (Ax1Layout<kDh>::kBytes in cuda/hessian.cu).
const AX1_SMEM_BYTES: u32 = 45_312;
const AX1_SMEM_BYTES_WIDE: u32 = 78_080;
/// Must match kAx2Rows, kAx2Cols, kAx2Threads, Ax2Layout<kDh>::kBytes in cuda/hessian.cu.
const AX2_ROWS: u32 = 64;
const AX2_COLS: u32 = 256;
const AX2_THREADS: u32 = 256;
const AX2_SMEM_BYTES: u32 = 95_744;
const AX2_SMEM_BYTES_WIDE: u32 = 128_512;

pub struct HessianKernels {
    xxt_v1: CudaFunction,
    xxt_v2: CudaFunction,
    softmax_stats: CudaFunction,
    /// attn_x by variant, narrow (d_h ≤ 128) and wide (d_h ≤ 256): [narrow, wide].
    attn_x_v1: [CudaFunction; 2],
    attn_x_v2: [CudaFunction; 2],
    /// v2 writing Y in bf16, the operand of the cuBLAS Gram.
    attn_x_v2_bf16: [CudaFunction; 2],
    /// v3's row softmax into bf16 probabilities.
    attn_probs: CudaFunction,
    rope_moments: CudaFunction,
    rope_row_hessians: CudaFunction,
}

impl HessianKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(HessianKernels {
            xxt_v1: get(XxtVariant::F32Tiled.kernel_name())?,
            xxt_v2: get(XxtVariant::Bf16Wmma.kernel_name())?,
            softmax_stats: get("softmax_stats_kernel")?,
            attn_x_v1: [
                get(AttnXVariant::F32Tiled.kernel_name())?,
                opt_in(get("attn_x_kernel_v1_d256")?, AX1_SMEM_BYTES_WIDE)?,
            ],
            attn_x_v2: [
                opt_in(get(AttnXVariant::Bf16Wmma.kernel_name())?, AX2_SMEM_BYTES)?,
                opt_in(get("attn_x_kernel_v2_d256")?, AX2_SMEM_BYTES_WIDE)?,
            ],
            attn_x_v2_bf16: [
                opt_in(get("attn_x_kernel_v2_bf16")?, AX2_SMEM_BYTES)?,
                opt_in(get("attn_x_kernel_v2_bf16_d256")?, AX2_SMEM_BYTES_WIDE)?,
            ],
            attn_probs: get(AttnXVariant::Gemm.kernel_name())?,
            rope_moments: get("rope_moments_kernel")?,
            rope_row_hessians: get("rope_row_hessians_kernel")?,
        })
    }
}

/// Over the 48 KB a launch may ask for by default: an attn_x kernel's dynamic limit must be raised once per
/// function (HOPPER.md), or every launch fails with "invalid argument". Every device the kernels are built for
/// (sm_80: 163 KB per block, sm_90: 227 KB) grants the widest, 125.5 KB.
fn opt_in(f: CudaFunction, bytes: u32) -> Result<CudaFunction, CudaError> {
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(launch_err(
        "opt an attn_x kernel into its dynamic shared memory",
    ))?;
    Ok(f)
}

fn launch_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

fn u32_of(op: &'static str, name: &str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        msg: format!("{name}={v} does not fit in u32"),
    })
}

/// H_z [d × d] += X_zᵀ X_z for z < batch, X_z = columns x_bs·z .. x_bs·z + d of X [m × ld], H_z at h_bs·z.
#[allow(clippy::too_many_arguments)]
pub fn launch_hessian_xxt(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    variant: XxtVariant,
    h: &mut CudaViewMut<f32>,
    x: &CudaView<f32>,
    m: usize,
    d: usize,
    ld: usize,
    batch: usize,
    x_bs: usize,
    h_bs: usize,
) -> Result<(), CudaError> {
    const OP: &str = "hessian_xxt";
    let shape = |msg: &str| CudaError::Shape {
        op: OP,
        msg: format!(
            "{msg} (m={m}, d={d}, ld={ld}, batch={batch}, x.len={}, h.len={})",
            x.len(),
            h.len()
        ),
    };
    if d == 0 || batch == 0 || m == 0 {
        return Ok(());
    }
    if ld < d || x.len() < (m - 1) * ld + (batch - 1) * x_bs + d {
        return Err(shape("X too short for [m × ld] and the batch offsets"));
    }
    if h.len() < (batch - 1) * h_bs + d * d {
        return Err(shape("H too short for the batch"));
    }
    let (m32, d32, ld32, b32) = (
        u32_of(OP, "m", m)?,
        u32_of(OP, "d", d)?,
        u32_of(OP, "ld", ld)?,
        u32_of(OP, "batch", batch)?,
    );
    let (xbs, hbs) = (x_bs as u64, h_bs as u64);
    let cfg = match variant {
        XxtVariant::F32Tiled => {
            let t = d32.div_ceil(XXT_V1_TILE);
            LaunchConfig {
                grid_dim: (t, t, b32),
                block_dim: (XXT_V1_TILE, XXT_V1_TILE, 1),
                shared_mem_bytes: 0,
            }
        }
        XxtVariant::Bf16Wmma => {
            let t = d32.div_ceil(XXT_V2_TILE);
            LaunchConfig {
                grid_dim: (t * (t + 1) / 2, 1, b32),
                block_dim: (XXT_V2_THREADS, 1, 1),
                shared_mem_bytes: 0,
            }
        }
        XxtVariant::Cublas => {
            return Err(CudaError::Shape {
                op: OP,
                msg: "the cuBLAS Gram is not a kernel of hessian.cu (CudaBackend::gram runs it)"
                    .into(),
            });
        }
    };
    let f = match variant {
        XxtVariant::F32Tiled => &k.xxt_v1,
        _ => &k.xxt_v2,
    };
    let _r = range(c"hessian_xxt");
    let mut b = stream.launch_builder(f);
    b.arg(h)
        .arg(x)
        .arg(&m32)
        .arg(&d32)
        .arg(&ld32)
        .arg(&xbs)
        .arg(&hbs);
    // SAFETY: arguments match hessian_xxt_kernel_v{1,2}(float* h, const float* x, uint32 m, d, ld, uint64 x_bs,
    // h_bs); X and H cover every index the grid touches (checked above); out-of-range tiles are guarded.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch hessian_xxt"))?;
    Ok(())
}

/// stats [h × t] (row max, Σ exp) of the causal softmax of every query head, each query seeing at most
/// `window` keys (itself included; ≥ t: no window).
#[allow(clippy::too_many_arguments)]
pub fn launch_softmax_stats(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    stats: &mut CudaViewMut<f32>,
    q: &CudaView<f32>,
    kk: &CudaView<f32>,
    t: usize,
    h: usize,
    h_kv: usize,
    d_h: usize,
    window: usize,
) -> Result<(), CudaError> {
    const OP: &str = "softmax_stats";
    if d_h > ATTN_MAX_DH
        || window == 0
        || h_kv == 0
        || !h.is_multiple_of(h_kv)
        || stats.len() != 2 * h * t
        || q.len() != t * h * d_h
        || kk.len() != t * h_kv * d_h
    {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!(
                "t={t}, h={h}, h_kv={h_kv}, d_h={d_h} (≤ {ATTN_MAX_DH}), window={window} (≥ 1), stats.len={}, \
                 q.len={}, k.len={}",
                stats.len(),
                q.len(),
                kk.len()
            ),
        });
    }
    if t == 0 || h == 0 {
        return Ok(());
    }
    let rows = u32_of(OP, "h·t", h * t)?;
    let (t32, h32, hkv32, dh32) = (t as u32, h as u32, h_kv as u32, d_h as u32);
    let w32 = window.min(t) as u32;
    let cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(STATS_WARPS), 1, 1),
        block_dim: (STATS_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let _r = range(c"softmax_stats");
    let mut b = stream.launch_builder(&k.softmax_stats);
    b.arg(stats)
        .arg(q)
        .arg(kk)
        .arg(&t32)
        .arg(&h32)
        .arg(&hkv32)
        .arg(&dh32)
        .arg(&w32);
    // SAFETY: arguments match softmax_stats_kernel(float2* stats, const float* q, const float* k, uint32 t,
    // n_heads, n_kv, d_h, window); stats holds h·t float2 (= 2·h·t f32, checked), q and k their [t × ·] shapes,
    // d_h ≤ kMaxDh (q_sh's row).
    unsafe { b.launch(cfg) }.map_err(launch_err("launch softmax_stats"))?;
    Ok(())
}

/// Where attn_x writes Y: f32, or bf16 (u16 bit patterns; v2 only) for the cuBLAS Gram.
pub enum AttnXOut<'a, 'b> {
    F32(&'a mut CudaViewMut<'b, f32>),
    Bf16(&'a mut CudaViewMut<'b, u16>),
}

impl AttnXOut<'_, '_> {
    fn len(&self) -> usize {
        match self {
            AttnXOut::F32(y) => y.len(),
            AttnXOut::Bf16(y) => y.len(),
        }
    }
}

/// Y [t × d] = A_head X, A formed tile by tile from Q, K and the stats (made with the same `window`), by the
/// chosen kernel variant.
#[allow(clippy::too_many_arguments)]
pub fn launch_attn_x(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    variant: AttnXVariant,
    y: AttnXOut,
    x: &CudaView<f32>,
    q: &CudaView<f32>,
    kk: &CudaView<f32>,
    stats: &CudaView<f32>,
    head: usize,
    t: usize,
    h: usize,
    h_kv: usize,
    d_h: usize,
    d: usize,
    window: usize,
) -> Result<(), CudaError> {
    const OP: &str = "attn_x";
    if d_h > ATTN_MAX_DH
        || window == 0
        || h_kv == 0
        || !h.is_multiple_of(h_kv)
        || head >= h
        || y.len() != t * d
        || (matches!(y, AttnXOut::Bf16(_)) && variant != AttnXVariant::Bf16Wmma)
        || x.len() != t * d
        || stats.len() != 2 * h * t
        || q.len() != t * h * d_h
        || kk.len() != t * h_kv * d_h
    {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!(
                "head={head}, t={t}, h={h}, h_kv={h_kv}, d_h={d_h}, d={d}, window={window}"
            ),
        });
    }
    if t == 0 || d == 0 {
        return Ok(());
    }
    let (t32, d32) = (u32_of(OP, "t", t)?, u32_of(OP, "d", d)?);
    let (head32, h32, hkv32, dh32) = (head as u32, h as u32, h_kv as u32, d_h as u32);
    let w32 = window.min(t) as u32;
    let wide = usize::from(d_h > NARROW_DH);
    let (cfg, f) = match variant {
        AttnXVariant::F32Tiled => (
            LaunchConfig {
                grid_dim: (d32.div_ceil(AX_COLS), t32.div_ceil(AX_ROWS), 1),
                block_dim: (AX_THREADS, 1, 1),
                shared_mem_bytes: [AX1_SMEM_BYTES, AX1_SMEM_BYTES_WIDE][wide],
            },
            &k.attn_x_v1[wide],
        ),
        AttnXVariant::Gemm => {
            return Err(CudaError::Shape {
                op: OP,
                msg: "the Gemm variant has no attn_x kernel (queue_v_col_gemm)".into(),
            });
        }
        AttnXVariant::Bf16Wmma => (
            LaunchConfig {
                grid_dim: (d32.div_ceil(AX2_COLS), t32.div_ceil(AX2_ROWS), 1),
                block_dim: (AX2_THREADS, 1, 1),
                shared_mem_bytes: [AX2_SMEM_BYTES, AX2_SMEM_BYTES_WIDE][wide],
            },
            match y {
                AttnXOut::F32(_) => &k.attn_x_v2[wide],
                AttnXOut::Bf16(_) => &k.attn_x_v2_bf16[wide],
            },
        ),
    };
    let _r = range(c"attn_x");
    let mut b = stream.launch_builder(f);
    match y {
        AttnXOut::F32(y) => b.arg(y),
        AttnXOut::Bf16(y) => b.arg(y),
    };
    b.arg(x)
        .arg(q)
        .arg(kk)
        .arg(stats)
        .arg(&head32)
        .arg(&t32)
        .arg(&h32)
        .arg(&hkv32)
        .arg(&dh32)
        .arg(&d32)
        .arg(&w32);
    // SAFETY: arguments match attn_x_kernel_v{1,2}[_d256](float* y, const float* x, q, k, const float2* stats,
    // uint32 head, t, n_heads, n_kv, d_h, d, window) (attn_x_kernel_v2_bf16[_d256]: __nv_bfloat16* y, u16's
    // size and alignment); every buffer has the shape checked above, d_h ≤ the instantiation's kDh (narrow up
    // to 128, wide up to 256); out-of-range rows/cols are guarded; the dynamic shared memory is the size its
    // layout needs (static_asserts in hessian.cu) and was opted into at load where it passes 48 KB.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch attn_x"))?;
    Ok(())
}

/// Must match kProbThreads in cuda/hessian.cu.
const PROB_THREADS: u32 = 256;

/// A [batch × t × t] (bf16 bits) = the windowed causal softmax of the rows of S [batch × t × t] · scale
/// (attn_probs_bf16_kernel; every element written, 0 outside each row's window).
pub fn launch_attn_probs(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    a: &mut CudaViewMut<u16>,
    s: &CudaView<f32>,
    (t, batch, window): (usize, usize, usize),
    scale: f32,
) -> Result<(), CudaError> {
    const OP: &str = "attn_probs";
    if window == 0 || a.len() < batch * t * t || s.len() < batch * t * t {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!(
                "t={t}, batch={batch}, window={window}, a.len={}, s.len={}",
                a.len(),
                s.len()
            ),
        });
    }
    if t == 0 || batch == 0 {
        return Ok(());
    }
    let (t32, b32) = (u32_of(OP, "t", t)?, u32_of(OP, "batch", batch)?);
    if b32 > 65_535 {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!("batch {batch} > 65535 (grid y)"),
        });
    }
    let w32 = window.min(t) as u32;
    let cfg = LaunchConfig {
        grid_dim: (t32, b32, 1),
        block_dim: (PROB_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let _r = range(c"attn_probs");
    let mut b = stream.launch_builder(&k.attn_probs);
    b.arg(a).arg(s).arg(&t32).arg(&w32).arg(&scale);
    // SAFETY: arguments match attn_probs_bf16_kernel(__nv_bfloat16* a, const float* s, uint32 t, uint32 window,
    // float scale); u16 has __nv_bfloat16's size and alignment; a and s hold batch·t² elements (checked), and
    // block (i, z) touches only row i of sequence z.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch attn_probs"))?;
    Ok(())
}

/// Must match kRopeMomentThreads and kRopeRowThreads in cuda/hessian.cu.
const ROPE_MOMENT_THREADS: usize = 128;
const ROPE_ROW_THREADS: u32 = 256;

/// mom [3 × half × half] (f64) = the RoPE average's position moments cc, cs, ss of frequencies `inv_freq`
/// [half] over positions 0..positions−1 (ops::RopeAverage::new on the device).
pub fn launch_rope_moments(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    mom: &mut CudaSlice<f64>,
    inv_freq: &CudaSlice<f64>,
    positions: usize,
) -> Result<(), CudaError> {
    const OP: &str = "rope_moments";
    let half = inv_freq.len();
    if half == 0 || half > ROPE_MOMENT_THREADS || mom.len() != 3 * half * half {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!(
                "half={half} (1..={ROPE_MOMENT_THREADS}), mom.len={}",
                mom.len()
            ),
        });
    }
    let (half32, p32) = (half as u32, u32_of(OP, "positions", positions)?);
    let cfg = LaunchConfig {
        grid_dim: (half32, 1, 1),
        block_dim: (ROPE_MOMENT_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let _r = range(c"rope_moments");
    let mut b = stream.launch_builder(&k.rope_moments);
    b.arg(mom).arg(inv_freq).arg(&half32).arg(&p32);
    // SAFETY: arguments match rope_moments_kernel(double* mom, const double* inv_freq, uint32 half, uint32
    // positions); mom holds 3·half² and inv_freq half f64 (checked), threads j ≥ half return at once.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch rope_moments"))?;
    Ok(())
}

/// out [n_out × d_h × d_h] = diag(g) (mean_p R_pᵀ C̄_o R_p) diag(g) from the finished covariances c
/// [batch × d_h × d_h] and the moments of `launch_rope_moments` (QuantOps::rope_row_hessians).
#[allow(clippy::too_many_arguments)]
pub fn launch_rope_row_hessians(
    stream: &Arc<CudaStream>,
    k: &HessianKernels,
    out: &mut CudaSlice<f32>,
    c: &CudaSlice<f32>,
    mom: &CudaSlice<f64>,
    g: &CudaSlice<f32>,
    n_out: usize,
    batch: usize,
    d_h: usize,
) -> Result<(), CudaError> {
    const OP: &str = "rope_row_hessians";
    let half = d_h / 2;
    let dd = d_h * d_h;
    if d_h == 0
        || !d_h.is_multiple_of(2)
        || n_out == 0
        || batch == 0
        || !(n_out.is_multiple_of(batch) || batch.is_multiple_of(n_out))
        || out.len() < n_out * dd
        || c.len() < batch * dd
        || mom.len() != 3 * half * half
        || g.len() != d_h
    {
        return Err(CudaError::Shape {
            op: OP,
            msg: format!(
                "n_out={n_out}, batch={batch}, d_h={d_h}, out.len={}, c.len={}, mom.len={}, g.len={}",
                out.len(),
                c.len(),
                mom.len(),
                g.len()
            ),
        });
    }
    let (n32, b32, d32) = (
        u32_of(OP, "n_out", n_out)?,
        u32_of(OP, "batch", batch)?,
        u32_of(OP, "d_h", d_h)?,
    );
    let cfg = LaunchConfig {
        grid_dim: (u32_of(OP, "d_h²", dd)?.div_ceil(ROPE_ROW_THREADS), n32, 1),
        block_dim: (ROPE_ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let _r = range(c"rope_row_hessians");
    let mut b = stream.launch_builder(&k.rope_row_hessians);
    b.arg(out)
        .arg(c)
        .arg(mom)
        .arg(g)
        .arg(&n32)
        .arg(&b32)
        .arg(&d32);
    // SAFETY: arguments match rope_row_hessians_kernel(float* out, const float* c, const double* mom,
    // const float* g, uint32 n_out, batch, d_h); out holds n_out·d_h², c batch·d_h², mom 3·(d_h/2)², g d_h
    // (checked); one of n_out, batch divides the other, so every source index is < batch; threads past d_h²
    // return at once.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch rope_row_hessians"))?;
    Ok(())
}

impl super::CudaBackend {
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
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let window = s.window.unwrap_or(t);
        if h == 0 || t == 0 || d == 0 {
            return Err(CudaError::Shape {
                op: "time_attn_x",
                msg: format!("{s:?}: empty"),
            });
        }
        let x_d = self.upload(x, "upload x")?;
        let q_d = self.upload(q, "upload q")?;
        let k_d = self.upload(k, "upload k")?;
        let mut stats = self
            .stream
            .alloc_zeros::<f32>(2 * h * t)
            .map_err(super::driver("alloc stats"))?;
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
            window,
        )?;
        let launch = |y: &mut cudarc::driver::CudaSlice<f32>, head: usize| {
            launch_attn_x(
                &self.stream,
                hk,
                variant,
                AttnXOut::F32(&mut y.slice_mut(..)),
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
                window,
            )
        };
        launch(&mut y, 0)?;
        let y0 = self
            .stream
            .clone_dtoh(&y)
            .map_err(super::driver("download y"))?;
        self.stream.synchronize().map_err(super::driver("attn_x"))?;
        let n = launches.max(1);
        self.timed(|| (0..n).try_for_each(|i| launch(&mut y, i % h)))?;
        Ok((self.last_kernel_ms() as f64 / n as f64, y0))
    }
}
