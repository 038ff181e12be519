//! Host side of cuda/sweep.cu: the GPTQ and BoA sweeps as a host loop over column blocks, each block one
//! sweep kernel and one trailing GEMM on the same stream (no host synchronization between them).
//!
//! The trailing GEMM (the lazy batch, W[:, i2:] −= E · U[i1:i2, i2:], design.md §4.2) has two variants
//! (`TrailingVariant`, style.md rules 4 and 17): v1 `sweep_trailing_gemm_kernel`, our f32 FFMA tile GEMM
//! (the naive baseline, and the fallback when cuBLAS cannot be opened), and v2 cuBLAS SGEMM (strided-batched
//! for BoA's per-head U_col; f32 operands and accumulation, CUBLAS_DEFAULT_MATH: no TF32). Both compute the
//! same `TrailingGemm`; `trailing_cublas_config` maps it onto column-major cuBLAS.
//!
//! The BoA block kernel has two variants too (`BoaBlockVariant`): v1 `boa_block_kernel`, 32 columns per block
//! in static shared memory, and v2 `boa_block_kernel_v2`, 128 columns per block in 210 KB of dynamic shared
//! memory (4× fewer block launches and wavefront fills; the trailing GEMMs get k = 128). v2 needs the
//! opt-in above 48 KB at load; where the device cannot give it, the sweep runs v1 and says which ran. Heads of
//! 129–256 rows (Gemma 3) run `boa_block_kernel_d256`, v1's code with 256 threads and 16-column blocks,
//! whichever variant is selected.

use super::CudaError;
use super::gemm::Blas;
use crate::nvtx::range;
use cudarc::cublas::{GemmConfig, StridedBatchedConfig, sys as blas_sys};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DriverError,
    LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file (cuda/sweep.cu).
pub const MODULE: &str = "sweep";

/// Widest GPTQ column block (kGptqMaxBw); rows per CTA (kGptqRows).
pub const GPTQ_MAX_BLOCK: usize = 128;
const GPTQ_ROWS: u32 = 32;
/// gptq_block_kernel_v2: threads per CTA (kG2Threads: 32 rows × 4 parts) and its dynamic shared memory
/// (kG2SmemBytes): U's block [128][128] f32, W and E [128][33] f32, col_group [128] u32, codes [128][36] u8.
const GPTQ_V2_THREADS: u32 = 128;
pub const GPTQ_V2_SMEM_BYTES: u32 = (GPTQ_MAX_BLOCK * GPTQ_MAX_BLOCK * 4
    + 2 * GPTQ_MAX_BLOCK * (GPTQ_ROWS as usize + 1) * 4
    + GPTQ_MAX_BLOCK * 4
    + GPTQ_MAX_BLOCK * (GPTQ_ROWS as usize + 4)) as u32;
const _: () = assert!(GPTQ_V2_SMEM_BYTES == 104_448);
/// BoA: largest head dimension (kBoaWideDh), the largest of v1 and v2 (kBoaMaxDh), and the column block widths
/// of v1 (kBoaBw), v2 (kBoa2Bw) and the wide-head kernel (kBoaWideBw). The BoA block is the kernel's width
/// whatever the caller's block size: v1's δ and W tiles of 128 rows × 32 columns already take 41 KB of static
/// shared memory, the wide kernel's of 256 × 16 37 KB, v2's of 128 × 128 plus U_col's block 210 KB of dynamic.
/// The block width changes only the rounding order of the trailing updates, not the algorithm.
pub const BOA_MAX_DH: usize = 256;
pub const BOA_NARROW_DH: usize = 128;
pub const BOA_BLOCK: usize = 32;
pub const BOA_BLOCK_V2: usize = 128;
pub const BOA_BLOCK_WIDE: usize = 16;
/// kBoa2SmemBytes: w_sh [128][130] + δ_sh [128][129] + U_col [128][128] f32, col_group [128] u32, codes
/// [128][128] u8.
pub const BOA_V2_SMEM_BYTES: u32 = (BOA_BLOCK_V2 * (BOA_NARROW_DH + 2) * 4
    + BOA_BLOCK_V2 * (BOA_NARROW_DH + 1) * 4
    + BOA_BLOCK_V2 * BOA_BLOCK_V2 * 4
    + BOA_BLOCK_V2 * 4
    + BOA_BLOCK_V2 * BOA_NARROW_DH) as u32;
const _: () = assert!(BOA_V2_SMEM_BYTES == 215_040);
const GEMM_TILE: u32 = 64;
const GEMM_THREADS: u32 = 256;

pub struct SweepKernels {
    gptq_block: CudaFunction,
    /// gptq_block_kernel_v2 opted into its dynamic shared memory, or why it could not be (v1 runs instead).
    gptq_block_v2: Result<CudaFunction, String>,
    gemm: CudaFunction,
    boa_block: CudaFunction,
    /// v1's code for heads of 129–256 rows.
    boa_block_wide: CudaFunction,
    /// boa_block_kernel_v2 opted into its dynamic shared memory, or why it could not be (v1 runs instead).
    boa_block_v2: Result<CudaFunction, String>,
    gather_cols: CudaFunction,
}

impl SweepKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(SweepKernels {
            gptq_block: get("gptq_block_kernel")?,
            gptq_block_v2: opt_in_smem(get, "gptq_block_kernel_v2", GPTQ_V2_SMEM_BYTES)?,
            gemm: get("sweep_trailing_gemm_kernel")?,
            boa_block: get("boa_block_kernel")?,
            boa_block_wide: get("boa_block_kernel_d256")?,
            // sm_90 allows 227 KB per block; a device with less (sm_80: 163 KB) keeps v1.
            boa_block_v2: opt_in_smem(get, "boa_block_kernel_v2", BOA_V2_SMEM_BYTES)?,
            gather_cols: get("gather_cols_kernel")?,
        })
    }

    /// The GPTQ block variant a sweep asked for `v` runs: v2 falls back to v1 when it could not be opted into
    /// its shared memory.
    pub fn gptq_block_in_use(&self, v: GptqBlockVariant) -> GptqBlockVariant {
        match v {
            GptqBlockVariant::Split if self.gptq_block_v2.is_ok() => GptqBlockVariant::Split,
            _ => GptqBlockVariant::Lane,
        }
    }

    /// The BoA block variant a sweep asked for `v` runs: v2 falls back to v1 when it could not be opted into
    /// its shared memory.
    pub fn boa_block_in_use(&self, v: BoaBlockVariant) -> BoaBlockVariant {
        match v {
            BoaBlockVariant::W128 if self.boa_block_v2.is_ok() => BoaBlockVariant::W128,
            _ => BoaBlockVariant::W32,
        }
    }
}

/// A kernel that asks for more than the 48 KB of dynamic shared memory a launch gets by default: the limit is
/// raised once per function (HOPPER.md), or the reason it cannot be (the caller keeps the v1 kernel).
/// (Loading the kernel itself is an error.)
fn opt_in_smem(
    get: impl Fn(&'static str) -> Result<CudaFunction, CudaError>,
    name: &'static str,
    bytes: u32,
) -> Result<Result<CudaFunction, String>, CudaError> {
    let f = get(name)?;
    Ok(f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map(|()| f)
    .map_err(|e| format!("{name} cannot have {bytes} B of shared memory: {e}")))
}

/// GPTQ block-kernel variants (one column block of the lazy-batched sweep; cuda/sweep.cu header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GptqBlockVariant {
    /// v1: gptq_block_kernel, one thread per row, one warp per CTA, U read from global memory; the naive
    /// baseline: 37.7 ms for 4096 × 4096 (H200, bench gptq_sweep, 2026-12-04).
    Lane = 1,
    /// v2: gptq_block_kernel_v2, each row's columns split over 4 warps, U's block in 102 KB of dynamic shared
    /// memory; the default (bit-identical codes, predicted ~10× faster; not yet measured on a GPU).
    Split = 2,
}

impl GptqBlockVariant {
    pub const ALL: [GptqBlockVariant; 2] = [GptqBlockVariant::Lane, GptqBlockVariant::Split];
}

/// BoA block-kernel variants (the column block of the wavefront sweep; cuda/sweep.cu header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoaBlockVariant {
    /// v1: boa_block_kernel, 32-column blocks, static shared memory; the naive baseline.
    W32 = 1,
    /// v2: boa_block_kernel_v2, 128-column blocks, 210 KB dynamic shared memory (sm_90); the default since it
    /// was measured faster: 72.5 against 96.3 ms for 32×128×4096 (H200, bench boa_sweep, 2026-12-04).
    W128 = 2,
}

impl BoaBlockVariant {
    pub const ALL: [BoaBlockVariant; 2] = [BoaBlockVariant::W32, BoaBlockVariant::W128];

    /// Columns per block launch (kBoaBw, kBoa2Bw) for heads of ≤ 128 rows.
    pub fn block(self) -> usize {
        match self {
            BoaBlockVariant::W32 => BOA_BLOCK,
            BoaBlockVariant::W128 => BOA_BLOCK_V2,
        }
    }

    /// Columns per block launch for heads of d_h rows: the variant's, or the wide-head kernel's past 128.
    pub fn block_for(self, d_h: usize) -> usize {
        if d_h > BOA_NARROW_DH {
            BOA_BLOCK_WIDE
        } else {
            self.block()
        }
    }
}

fn launch_err(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// Trailing-update variants (the lazy batch W[:, i2:] −= E · U[i1:i2, i2:]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrailingVariant {
    /// v1: sweep_trailing_gemm_kernel (cuda/sweep.cu), f32 FFMA 64×64 tiles; the naive baseline and the
    /// fallback when cuBLAS cannot be opened.
    Ffma = 1,
    /// v2: cuBLAS SGEMM (strided-batched over heads for a per-head U_col), f32, no TF32; the default.
    Cublas = 2,
}

impl TrailingVariant {
    pub const ALL: [TrailingVariant; 2] = [TrailingVariant::Ffma, TrailingVariant::Cublas];
}

/// The engine a sweep's trailing updates run on: the FFMA kernel, or cuBLAS through an open handle.
#[derive(Clone, Copy)]
pub enum Trailing<'a> {
    Ffma,
    Cublas(&'a Blas),
}

/// One trailing update, all row-major f32 with element offsets into the sweep's buffers:
/// for z < batch, C_z [rows × ncol] (row stride ldc) −= E_z · B_z, where E_z [rows × k] is stored transposed
/// as Eᵀ [k × rows] (row stride lda: the sweep kernels write E column by column) and B_z [k × ncol] (row
/// stride ldb); C_z starts at W + c_off + z·c_bs, E_zᵀ at E + z·a_bs, B_z at U + b_off + z·b_bs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrailingGemm {
    pub c_off: usize,
    pub b_off: usize,
    pub rows: usize,
    pub ncol: usize,
    pub k: usize,
    /// (ldc, lda, ldb)
    pub ld: (usize, usize, usize),
    pub batch: usize,
    /// (c_bs, a_bs, b_bs)
    pub bs: (usize, usize, usize),
}

/// GPTQ, block [i1, i2) of W [rows × n] with E [(i2 − i1) × rows]: W[:, i2:] −= E · U[i1:i2, i2:].
pub fn gptq_trailing(rows: usize, n: usize, i1: usize, i2: usize) -> TrailingGemm {
    TrailingGemm {
        c_off: i2,
        b_off: i1 * n + i2,
        rows,
        ncol: n - i2,
        k: i2 - i1,
        ld: (n, rows, n),
        batch: 1,
        bs: (0, 0, 0),
    }
}

/// BoA, block [i1, i2) of W [n_heads·d_h × n] with E [(i2 − i1) × n_heads·d_h]: every row's own GPTQ
/// trailing update with its head's U_col, one GEMM over all rows when U_col is shared, one per head
/// (batched: C, Eᵀ and U_col advance by d_h rows, d_h columns and n² per head) otherwise.
pub fn boa_trailing(
    n_heads: usize,
    d_h: usize,
    n: usize,
    i1: usize,
    i2: usize,
    per_head_u: bool,
) -> TrailingGemm {
    let rows = n_heads * d_h;
    let (gemm_rows, batch, bs) = if per_head_u {
        (d_h, n_heads, (d_h * n, d_h, n * n))
    } else {
        (rows, 1, (0, 0, 0))
    };
    TrailingGemm {
        c_off: i2,
        b_off: i1 * n + i2,
        rows: gemm_rows,
        ncol: n - i2,
        k: i2 - i1,
        ld: (n, rows, n),
        batch,
        bs,
    }
}

/// `TrailingGemm` as column-major cuBLAS sees it. A row-major [r × c] buffer with row stride ld is the
/// column-major [c × r] matrix (ld ld) of its transpose, so C_zᵀ [ncol × rows] (ld ldc) −= B_zᵀ · E_zᵀ:
///
/// ```text
///   A' = B_zᵀ [ncol × k]: B_z row-major [k × ncol], ld ldb       → op N, lda' = ldb
///   B' = E_zᵀ [k × rows]: Eᵀ row-major [k × rows] is column-major E_z [rows × k], ld lda → op T, ldb' = lda
///   C' = C_zᵀ [ncol × rows], ld ldc;  alpha = −1, beta = 1;  strides (A', B', C') = (b_bs, a_bs, c_bs)
/// ```
///
/// cuBLAS wants lda' ≥ ncol, ldb' ≥ rows (op T), ldc ≥ ncol; `launch_trailing_gemm` has checked them.
pub fn trailing_cublas_config(t: &TrailingGemm) -> Result<StridedBatchedConfig<f32>, String> {
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| format!("{what}={v} over cuBLAS's 32-bit int ({t:?})"))
    };
    let long = |v: usize| v as i64;
    let (ldc, lda, ldb) = t.ld;
    let (c_bs, a_bs, b_bs) = t.bs;
    Ok(StridedBatchedConfig {
        gemm: GemmConfig {
            transa: blas_sys::cublasOperation_t::CUBLAS_OP_N,
            transb: blas_sys::cublasOperation_t::CUBLAS_OP_T,
            m: int(t.ncol, "ncol")?,
            n: int(t.rows, "rows")?,
            k: int(t.k, "k")?,
            alpha: -1.0f32,
            lda: int(ldb, "ldb")?,
            ldb: int(lda, "lda")?,
            beta: 1.0f32,
            ldc: int(ldc, "ldc")?,
        },
        batch_size: int(t.batch, "batch")?,
        stride_a: long(b_bs),
        stride_b: long(a_bs),
        stride_c: long(c_bs),
    })
}

/// One trailing update `t` on the engine `eng`: W (the whole sweep buffer) −= E · U per `t` (offsets,
/// leading dimensions and batch strides into w, e and u).
fn launch_trailing_gemm(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    eng: Trailing,
    w: &mut CudaSlice<f32>,
    e: &CudaSlice<f32>,
    u: &CudaSlice<f32>,
    t: &TrailingGemm,
) -> Result<(), CudaError> {
    let TrailingGemm {
        c_off,
        b_off,
        rows,
        ncol,
        k: kdim,
        ld,
        batch,
        bs,
    } = *t;
    let (ldc, lda, ldb) = ld;
    let (c_bs, a_bs, b_bs) = bs;
    if rows == 0 || ncol == 0 || kdim == 0 || batch == 0 {
        return Ok(());
    }
    let last = batch - 1;
    // Every element either engine touches lies inside the buffers, and the leading dimensions are the ones
    // cuBLAS accepts (ldb ≥ ncol, lda ≥ rows, ldc ≥ ncol).
    if c_off + last * c_bs + (rows - 1) * ldc + ncol > w.len()
        || last * a_bs + (kdim - 1) * lda + rows > e.len()
        || b_off + last * b_bs + (kdim - 1) * ldb + ncol > u.len()
        || ldc < ncol
        || ldb < ncol
        || lda < rows
    {
        return Err(CudaError::Shape {
            op: "sweep_trailing_gemm",
            msg: format!(
                "{t:?} against buffers w.len={} e.len={} u.len={}",
                w.len(),
                e.len(),
                u.len()
            ),
        });
    }
    let mut c = w.slice_mut(c_off..);
    let et = e.slice(..);
    let b = u.slice(b_off..);
    match eng {
        Trailing::Cublas(blas) => {
            let cfg = trailing_cublas_config(t).map_err(|msg| CudaError::Shape {
                op: "sweep_trailing_gemm (cuBLAS)",
                msg,
            })?;
            // SAFETY: cuBLAS reads A' = B_z (ncol × k, ld ldb), B' = E_zᵀ (rows × k, ld lda) and reads/writes
            // C' = C_z (ncol × rows, ld ldc) for z < batch at the strides of `t`: exactly the elements bounded
            // by the check above, within the views; the leading dimensions meet cuBLAS's minimums (checked).
            unsafe { blas.sgemm_strided(cfg, &b, &et, &mut c, "sgemm (sweep trailing update)") }
        }
        Trailing::Ffma => launch_trailing_ffma(stream, k, &mut c, &et, &b, t),
    }
}

/// v1: sweep_trailing_gemm_kernel over the views (offsets applied), shapes as checked by the caller.
fn launch_trailing_ffma(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    c: &mut CudaViewMut<f32>,
    et: &CudaView<f32>,
    b: &CudaView<f32>,
    t: &TrailingGemm,
) -> Result<(), CudaError> {
    let v32 = |v: usize| v as u32;
    let (ldc, lda, ldb) = t.ld;
    let (r32, n32, k32, ldc32, lda32, ldb32) = (
        v32(t.rows),
        v32(t.ncol),
        v32(t.k),
        v32(ldc),
        v32(lda),
        v32(ldb),
    );
    let (cb, ab, bb) = (t.bs.0 as u64, t.bs.1 as u64, t.bs.2 as u64);
    let cfg = LaunchConfig {
        grid_dim: (
            n32.div_ceil(GEMM_TILE),
            r32.div_ceil(GEMM_TILE),
            v32(t.batch),
        ),
        block_dim: (GEMM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut lb = stream.launch_builder(&k.gemm);
    lb.arg(c)
        .arg(et)
        .arg(b)
        .arg(&r32)
        .arg(&n32)
        .arg(&k32)
        .arg(&ldc32)
        .arg(&lda32)
        .arg(&ldb32)
        .arg(&cb)
        .arg(&ab)
        .arg(&bb);
    // SAFETY: arguments match sweep_trailing_gemm_kernel(float* c, const float* et, const float* b, uint32 rows,
    // ncol, k, ldc, lda, ldb, uint64 c_bs, a_bs, b_bs); every index the grid touches lies inside the views
    // (checked by launch_trailing_gemm); out-of-range rows/cols are guarded in the kernel. The buffers are
    // < 2³² elements (the sweeps check rows·n), so the u32 casts are exact.
    unsafe { lb.launch(cfg) }.map_err(launch_err("launch sweep_trailing_gemm"))?;
    Ok(())
}

/// Device buffers of a GPTQ sweep: W [rows × n] (modified), Q, codes out; E scratch [block × rows];
/// U [n × n]; scales, zeros [rows × n_groups]; col_group [n]; loss [rows] (+= each row's Σ e², zeroed by the
/// caller).
pub struct GptqBuffers<'a> {
    pub w: &'a mut CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub codes: &'a mut CudaSlice<u8>,
    pub e: &'a mut CudaSlice<f32>,
    pub u: &'a CudaSlice<f32>,
    pub scales: &'a CudaSlice<f32>,
    pub zeros: &'a CudaSlice<f32>,
    pub col_group: &'a CudaSlice<u32>,
    pub loss: &'a mut CudaSlice<f32>,
}

/// The GPTQ sweep (static grids) over `rows` rows, lazy batches of `block_size` ≤ 128 columns.
#[allow(clippy::too_many_arguments)]
pub fn launch_gptq_sweep(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    eng: Trailing,
    variant: GptqBlockVariant,
    mut buf: GptqBuffers,
    rows: usize,
    n: usize,
    n_groups: usize,
    block_size: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    if block_size == 0
        || block_size > GPTQ_MAX_BLOCK
        || buf.w.len() != rows * n
        || buf.q.len() != rows * n
        || buf.codes.len() != rows * n
        || buf.e.len() < block_size.min(n) * rows
        || buf.u.len() != n * n
        || buf.scales.len() != rows * n_groups
        || buf.zeros.len() != rows * n_groups
        || buf.col_group.len() != n
        || buf.loss.len() != rows
        || u32::try_from(rows * n).is_err()
    {
        return Err(CudaError::Shape {
            op: "gptq_sweep",
            msg: format!(
                "rows={rows}, n={n}, n_groups={n_groups}, block_size={block_size} (1..={GPTQ_MAX_BLOCK})"
            ),
        });
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let _r = range(c"gptq_sweep");
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + block_size).min(n);
        launch_gptq_block(
            stream, k, eng, variant, &mut buf, rows, n, n_groups, i1, i2, maxq,
        )?;
        i1 = i2;
    }
    Ok(())
}

/// One column block [i1, i2) of the GPTQ sweep: the block kernel, then W[:, i2:] −= E · U[i1:i2, i2:].
/// Shapes as checked by `launch_gptq_sweep` / `launch_gptq_sweep_dynamic`.
#[allow(clippy::too_many_arguments)]
fn launch_gptq_block(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    eng: Trailing,
    variant: GptqBlockVariant,
    buf: &mut GptqBuffers,
    rows: usize,
    n: usize,
    n_groups: usize,
    i1: usize,
    i2: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    debug_assert!(i1 < i2 && i2 <= n && i2 - i1 <= GPTQ_MAX_BLOCK);
    let (rows32, n32, ng32, maxq_f) = (rows as u32, n as u32, n_groups as u32, maxq as f32);
    let (func, cfg) = match (variant, &k.gptq_block_v2) {
        (GptqBlockVariant::Split, Ok(f)) => (
            f,
            LaunchConfig {
                grid_dim: (rows32.div_ceil(GPTQ_ROWS), 1, 1),
                block_dim: (GPTQ_V2_THREADS, 1, 1),
                shared_mem_bytes: GPTQ_V2_SMEM_BYTES,
            },
        ),
        _ => (
            &k.gptq_block,
            LaunchConfig {
                grid_dim: (rows32.div_ceil(GPTQ_ROWS), 1, 1),
                block_dim: (GPTQ_ROWS, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
    };
    let (i1_32, i2_32) = (i1 as u32, i2 as u32);
    {
        let mut lb = stream.launch_builder(func);
        lb.arg(&mut *buf.w)
            .arg(&mut *buf.q)
            .arg(&mut *buf.codes)
            .arg(&mut *buf.e)
            .arg(buf.u)
            .arg(buf.scales)
            .arg(buf.zeros)
            .arg(buf.col_group)
            .arg(&mut *buf.loss)
            .arg(&rows32)
            .arg(&n32)
            .arg(&ng32)
            .arg(&i1_32)
            .arg(&i2_32)
            .arg(&maxq_f);
        // SAFETY: arguments match gptq_block_kernel and gptq_block_kernel_v2 (the same list: float* w, q, uint8*
        // codes, float* e, const float* u, scales, zeros, const uint32* col_group, float* loss, uint32 rows, n,
        // n_groups, i1, i2, float maxq); all buffers have the shapes the callers check, i2 − i1 ≤ 128 = the
        // kernels' smem block (v2's dynamic smem is the kG2SmemBytes it indexes, opted in at load), e holds
        // (i2 − i1)·rows, and col_group entries are < n_groups (checked by the caller).
        unsafe { lb.launch(cfg) }.map_err(launch_err("launch gptq_block"))?;
    }
    if i2 < n {
        // W[:, i2:] −= E · U[i1:i2, i2:]
        let t = gptq_trailing(rows, n, i1, i2);
        launch_trailing_gemm(stream, k, eng, &mut *buf.w, &*buf.e, buf.u, &t)?;
    }
    Ok(())
}

/// The GPTQ sweep with dynamic group grids, group width `g`: blocks end at every group start, and at a block
/// that starts group k, the group's current weights W[:, k·g : k·g + len] are gathered into `gathered`
/// [rows × len] and `search(k, gathered, len, scales, zeros)` writes column k of the grids [rows × n_groups]
/// on the device, before the block runs. Lazy batching is exact whatever the block bounds, so this is the CPU
/// sweep's arithmetic up to the summation order of the trailing updates.
#[allow(clippy::too_many_arguments)]
pub fn launch_gptq_sweep_dynamic(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    eng: Trailing,
    variant: GptqBlockVariant,
    d: GptqDynamicBuffers,
    rows: usize,
    n: usize,
    g: usize,
    block_size: usize,
    maxq: u32,
    search: &mut GroupSearch,
) -> Result<(), CudaError> {
    let GptqDynamicBuffers {
        w,
        q,
        codes,
        e,
        u,
        scales,
        zeros,
        col_group,
        gathered,
        loss,
    } = d;
    let n_groups = n.div_ceil(g.max(1));
    if g == 0
        || block_size == 0
        || block_size > GPTQ_MAX_BLOCK
        || w.len() != rows * n
        || q.len() != rows * n
        || codes.len() != rows * n
        || e.len() < block_size.min(n) * rows
        || u.len() != n * n
        || scales.len() != rows * n_groups
        || zeros.len() != rows * n_groups
        || col_group.len() != n
        || gathered.len() < rows * g.min(n)
        || loss.len() != rows
        || u32::try_from(rows * n).is_err()
    {
        return Err(CudaError::Shape {
            op: "gptq_sweep_dynamic",
            msg: format!(
                "rows={rows}, n={n}, g={g}, block_size={block_size} (1..={GPTQ_MAX_BLOCK}), gathered.len={}",
                gathered.len()
            ),
        });
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let _r = range(c"gptq_sweep_dynamic");
    let mut i1 = 0;
    while i1 < n {
        let next_group = (i1 / g + 1) * g;
        let i2 = (i1 + block_size).min(n).min(next_group);
        if i1.is_multiple_of(g) {
            let (kg, len) = (i1 / g, g.min(n - i1));
            launch_gather_cols(stream, k, gathered, w, rows, n, i1, len)?;
            search(kg, &*gathered, len, &mut *scales, &mut *zeros)?;
        }
        let mut buf = GptqBuffers {
            w: &mut *w,
            q: &mut *q,
            codes: &mut *codes,
            e: &mut *e,
            u,
            scales: &*scales,
            zeros: &*zeros,
            col_group,
            loss: &mut *loss,
        };
        launch_gptq_block(
            stream, k, eng, variant, &mut buf, rows, n, n_groups, i1, i2, maxq,
        )?;
        i1 = i2;
    }
    Ok(())
}

/// out [rows × len] = W[:, c0 : c0 + len] of W [rows × n].
#[allow(clippy::too_many_arguments)]
pub fn launch_gather_cols(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    out: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    n: usize,
    c0: usize,
    len: usize,
) -> Result<(), CudaError> {
    if out.len() < rows * len
        || w.len() != rows * n
        || c0 + len > n
        || u32::try_from(rows * n).is_err()
    {
        return Err(CudaError::Shape {
            op: "gather_cols",
            msg: format!("columns {c0}+{len} of [{rows} × {n}] into {}", out.len()),
        });
    }
    if rows == 0 || len == 0 {
        return Ok(());
    }
    let (r32, n32, c32, l32) = (rows as u32, n as u32, c0 as u32, len as u32);
    let cfg = LaunchConfig {
        grid_dim: (l32.div_ceil(32), r32.div_ceil(8), 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    let mut lb = stream.launch_builder(&k.gather_cols);
    lb.arg(&mut *out)
        .arg(w)
        .arg(&r32)
        .arg(&n32)
        .arg(&c32)
        .arg(&l32);
    // SAFETY: matches gather_cols_kernel(float* out, const float* w, uint32 rows, n, c0, len); out holds
    // ≥ rows·len floats and w rows·n (checked above); the kernel guards its bounds.
    unsafe { lb.launch(cfg) }.map_err(launch_err("launch gather_cols"))?;
    Ok(())
}

/// The group search of a dynamic-group sweep: (group k, its current weights [rows × len] at the front of the
/// buffer, len, scales, zeros [rows × n_groups]) writes column k of the grids.
pub type GroupSearch<'a> = dyn FnMut(
        usize,
        &CudaSlice<f32>,
        usize,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ) -> Result<(), CudaError>
    + 'a;

/// `GptqBuffers` of a dynamic-group sweep: scales and zeros [rows × n_groups] are rewritten at every group
/// start; `gathered` [≥ rows × min(g, n)] receives the group's current weights.
pub struct GptqDynamicBuffers<'a> {
    pub w: &'a mut CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub codes: &'a mut CudaSlice<u8>,
    pub e: &'a mut CudaSlice<f32>,
    pub u: &'a CudaSlice<f32>,
    pub scales: &'a mut CudaSlice<f32>,
    pub zeros: &'a mut CudaSlice<f32>,
    pub col_group: &'a CudaSlice<u32>,
    pub gathered: &'a mut CudaSlice<f32>,
    pub loss: &'a mut CudaSlice<f32>,
}

/// Device buffers of a BoA sweep (R = n_heads·d_h rows): W [R × n] (modified), W0 [R × n] (the weights before
/// the sweep), Q, codes out; E scratch [block × R] (block: the block variant's width); U_col [n × n] or
/// [n_heads × n × n]; F [n_heads × d_h × d_h] (F[j, i] = U_row[j, i] / U_row[j, j]); scales, zeros
/// [R × n_groups]; col_group [n].
pub struct BoaBuffers<'a> {
    pub w: &'a mut CudaSlice<f32>,
    pub w0: &'a CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub codes: &'a mut CudaSlice<u8>,
    pub e: &'a mut CudaSlice<f32>,
    pub u_col: &'a CudaSlice<f32>,
    pub f_row: &'a CudaSlice<f32>,
    pub scales: &'a CudaSlice<f32>,
    pub zeros: &'a CudaSlice<f32>,
    pub col_group: &'a CudaSlice<u32>,
}

/// The BoA wavefront sweep (static grids), all heads at once, column blocks of the block variant in use
/// (`SweepKernels::boa_block_in_use(variant)`); `per_head_u` selects U_col per head.
#[allow(clippy::too_many_arguments)]
pub fn launch_boa_sweep(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    eng: Trailing,
    variant: BoaBlockVariant,
    buf: BoaBuffers,
    per_head_u: bool,
    n_heads: usize,
    d_h: usize,
    n: usize,
    n_groups: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    let rows = n_heads * d_h;
    let u_len = if per_head_u { n_heads * n * n } else { n * n };
    let variant = k.boa_block_in_use(variant);
    let block = variant.block_for(d_h);
    if d_h == 0
        || d_h > BOA_MAX_DH
        || buf.w.len() != rows * n
        || buf.w0.len() != rows * n
        || buf.q.len() != rows * n
        || buf.codes.len() != rows * n
        || buf.e.len() < block.min(n) * rows
        || buf.u_col.len() != u_len
        || buf.f_row.len() != n_heads * d_h * d_h
        || buf.scales.len() != rows * n_groups
        || buf.zeros.len() != rows * n_groups
        || buf.col_group.len() != n
        || u32::try_from(rows * n).is_err()
    {
        return Err(CudaError::Shape {
            op: "boa_sweep",
            msg: format!(
                "n_heads={n_heads}, d_h={d_h} (1..={BOA_MAX_DH}), n={n}, n_groups={n_groups}, per_head_u={per_head_u}, \
                 e.len={} for block {block} ({variant:?})",
                buf.e.len()
            ),
        });
    }
    if n_heads == 0 || n == 0 {
        return Ok(());
    }
    let _r = range(c"boa_sweep");
    let u_hs: u64 = if per_head_u { (n * n) as u64 } else { 0 };
    let (dh32, n32, ng32, maxq_f) = (d_h as u32, n as u32, n_groups as u32, maxq as f32);
    let (func, smem, threads) = match (variant, &k.boa_block_v2) {
        _ if d_h > BOA_NARROW_DH => (&k.boa_block_wide, 0, BOA_MAX_DH),
        (BoaBlockVariant::W128, Ok(f)) => (f, BOA_V2_SMEM_BYTES, BOA_NARROW_DH),
        _ => (&k.boa_block, 0, BOA_NARROW_DH),
    };
    let cfg = LaunchConfig {
        grid_dim: (n_heads as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + block).min(n);
        let (i1_32, i2_32) = (i1 as u32, i2 as u32);
        {
            let mut lb = stream.launch_builder(func);
            lb.arg(&mut *buf.w)
                .arg(buf.w0)
                .arg(&mut *buf.q)
                .arg(&mut *buf.codes)
                .arg(&mut *buf.e)
                .arg(buf.u_col)
                .arg(&u_hs)
                .arg(buf.f_row)
                .arg(buf.scales)
                .arg(buf.zeros)
                .arg(buf.col_group)
                .arg(&dh32)
                .arg(&n32)
                .arg(&ng32)
                .arg(&i1_32)
                .arg(&i2_32)
                .arg(&maxq_f);
            // SAFETY: arguments match boa_block_kernel{,_v2,_d256}(float* w, const float* w0, float* q, uint8* codes,
            // float* e, const float* u_col, uint64 u_head_stride, const float* f_row, scales, zeros,
            // const uint32* col_group, uint32 d_h, n, n_groups, i1, i2, float maxq); the grid is n_heads, so
            // rows_total = n_heads·d_h matches the buffers checked above; d_h ≤ the kernel's block and smem
            // tiles (128, or 256 for _d256); i2 − i1 ≤ the kernel's block = its smem column block, and e
            // holds block·rows; v2's
            // dynamic shared memory is the size its layout needs (static_assert in sweep.cu) and was opted
            // into at load (only an Ok v2 function is launched).
            unsafe { lb.launch(cfg) }.map_err(launch_err("launch boa_block"))?;
        }
        if i2 < n {
            // Own GPTQ trailing updates: W[:, i2:] −= E · U_col[i1:i2, i2:], all heads in one GEMM when U_col
            // is shared, batched over heads otherwise.
            let t = boa_trailing(n_heads, d_h, n, i1, i2, per_head_u);
            launch_trailing_gemm(stream, k, eng, &mut *buf.w, &*buf.e, buf.u_col, &t)?;
        }
        i1 = i2;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The trailing update's arguments, read the way each engine reads them, against the update written out
    //! with natural indices: without a GPU this is what checks the row-major ↔ column-major mapping, the
    //! offsets, leading dimensions and batch strides of the cuBLAS route (and the FFMA kernel's indexing); on
    //! a GPU, parity_{gptq,boa}_sweep_cuda test the launches themselves.
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// cuBLAS's sgemmStridedBatched as documented (column-major, op(A) m × k, op(B) k × n, C = α·op(A)·op(B)
    /// + β·C per batch), over the views the launcher passes (a = U from b_off, b = E, c = W from c_off).
    fn cublas_reference(cfg: &StridedBatchedConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        use blas_sys::cublasOperation_t::CUBLAS_OP_N;
        let g = &cfg.gemm;
        let (m, n, k) = (g.m as usize, g.n as usize, g.k as usize);
        let (lda, ldb, ldc) = (g.lda as usize, g.ldb as usize, g.ldc as usize);
        for z in 0..cfg.batch_size as usize {
            let (a, b) = (
                &a[z * cfg.stride_a as usize..],
                &b[z * cfg.stride_b as usize..],
            );
            let c = &mut c[z * cfg.stride_c as usize..];
            let op_a = |i: usize, l: usize| {
                if g.transa == CUBLAS_OP_N {
                    a[i + l * lda]
                } else {
                    a[l + i * lda]
                }
            };
            let op_b = |l: usize, j: usize| {
                if g.transb == CUBLAS_OP_N {
                    b[l + j * ldb]
                } else {
                    b[j + l * ldb]
                }
            };
            for j in 0..n {
                for i in 0..m {
                    let acc: f32 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                    c[i + j * ldc] = g.alpha * acc + g.beta * c[i + j * ldc];
                }
            }
        }
    }

    /// sweep_trailing_gemm_kernel's indexing, element by element.
    fn ffma_reference(t: &TrailingGemm, et: &[f32], b: &[f32], c: &mut [f32]) {
        let (ldc, lda, ldb) = t.ld;
        let (c_bs, a_bs, b_bs) = t.bs;
        for z in 0..t.batch {
            for r in 0..t.rows {
                for col in 0..t.ncol {
                    let acc: f32 = (0..t.k)
                        .map(|kk| et[z * a_bs + kk * lda + r] * b[z * b_bs + kk * ldb + col])
                        .sum();
                    c[z * c_bs + r * ldc + col] -= acc;
                }
            }
        }
    }

    fn small_ints(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
        // Integers: every sum is exact in f32, so the engines' summation orders cannot differ.
        (0..n).map(|_| rng.random_range(-3i32..4) as f32).collect()
    }

    /// Both engines' reading of `t` over (w, e, u) gives `want`.
    fn check(t: &TrailingGemm, w: &[f32], e: &[f32], u: &[f32], want: &[f32], what: &str) {
        let cfg = trailing_cublas_config(t).unwrap();
        let mut got = w.to_vec();
        cublas_reference(&cfg, &u[t.b_off..], e, &mut got[t.c_off..]);
        assert_eq!(got, want, "{what}: cuBLAS config");
        let mut got = w.to_vec();
        ffma_reference(t, e, &u[t.b_off..], &mut got[t.c_off..]);
        assert_eq!(got, want, "{what}: FFMA kernel indexing");
    }

    #[test]
    fn gptq_trailing_update_maps_onto_both_engines() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for (rows, n, i1, i2) in [(5, 13, 4, 9), (1, 7, 0, 3), (9, 40, 32, 39), (3, 6, 0, 5)] {
            let (w, u) = (small_ints(&mut rng, rows * n), small_ints(&mut rng, n * n));
            let bw = i2 - i1;
            let e = small_ints(&mut rng, bw * rows); // E [bw × rows], column c of the block at c·rows
            let mut want = w.clone();
            for r in 0..rows {
                for c in i2..n {
                    let s: f32 = (0..bw).map(|k| e[k * rows + r] * u[(i1 + k) * n + c]).sum();
                    want[r * n + c] -= s;
                }
            }
            let t = gptq_trailing(rows, n, i1, i2);
            check(
                &t,
                &w,
                &e,
                &u,
                &want,
                &format!("gptq rows={rows} n={n} [{i1}, {i2})"),
            );
        }
    }

    #[test]
    fn boa_trailing_update_maps_onto_both_engines() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for (n_heads, d_h, n, i1, i2) in [(3, 4, 11, 2, 6), (2, 5, 9, 0, 8), (1, 3, 5, 1, 2)] {
            for per_head in [false, true] {
                let rows = n_heads * d_h;
                let w = small_ints(&mut rng, rows * n);
                let u = small_ints(&mut rng, if per_head { n_heads } else { 1 } * n * n);
                let bw = i2 - i1;
                let e = small_ints(&mut rng, bw * rows);
                let mut want = w.clone();
                for r in 0..rows {
                    let uh = if per_head { (r / d_h) * n * n } else { 0 };
                    for c in i2..n {
                        let s: f32 = (0..bw)
                            .map(|k| e[k * rows + r] * u[uh + (i1 + k) * n + c])
                            .sum();
                        want[r * n + c] -= s;
                    }
                }
                let t = boa_trailing(n_heads, d_h, n, i1, i2, per_head);
                let what =
                    format!("boa heads={n_heads} d_h={d_h} n={n} [{i1}, {i2}) per_head={per_head}");
                check(&t, &w, &e, &u, &want, &what);
            }
        }
    }

    #[test]
    fn cublas_config_refuses_shapes_over_i32() {
        let mut t = gptq_trailing(4, 10, 0, 5);
        t.ncol = 1 << 31;
        assert!(trailing_cublas_config(&t).is_err());
    }
}
