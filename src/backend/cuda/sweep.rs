//! Host side of cuda/sweep.cu: the GPTQ and BoA sweeps as a host loop over column blocks, each block one
//! sweep kernel and one trailing GEMM on the same stream (no host synchronization between them).

use super::CudaError;
use crate::nvtx::range;
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
/// BoA: largest head dimension (kBoaMaxDh) and the column block width (kBoaBw). The BoA block is 32 columns
/// whatever the caller's block size: the δ and W tiles of 128 rows × 32 columns already take 41 KB of shared
/// memory. The block width changes only the rounding order of the trailing updates, not the algorithm.
pub const BOA_MAX_DH: usize = 128;
pub const BOA_BLOCK: usize = 32;
const GEMM_TILE: u32 = 64;
const GEMM_THREADS: u32 = 256;

pub struct SweepKernels {
    gptq_block: CudaFunction,
    gemm: CudaFunction,
    boa_block: CudaFunction,
    gather_cols: CudaFunction,
}

impl SweepKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |name: &'static str| {
            module
                .load_function(name)
                .map_err(|e| CudaError::MissingKernel {
                    module: MODULE,
                    kernel: name,
                    source: e,
                })
        };
        Ok(SweepKernels {
            gptq_block: get("gptq_block_kernel")?,
            gemm: get("sweep_trailing_gemm_kernel")?,
            boa_block: get("boa_block_kernel")?,
            gather_cols: get("gather_cols_kernel")?,
        })
    }
}

fn launch_err(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// C_z [rows × ncol] (ldc) −= E_zᵀ [k × rows] (lda)ᵀ · B_z [k × ncol] (ldb), z < batch, with element offsets
/// c_bs, a_bs, b_bs per z.
#[allow(clippy::too_many_arguments)]
fn launch_trailing_gemm(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
    c: &mut CudaViewMut<f32>,
    et: &CudaView<f32>,
    b: &CudaView<f32>,
    rows: usize,
    ncol: usize,
    kdim: usize,
    ld: (usize, usize, usize),
    batch: usize,
    bs: (usize, usize, usize),
) -> Result<(), CudaError> {
    let (ldc, lda, ldb) = ld;
    let (c_bs, a_bs, b_bs) = bs;
    if rows == 0 || ncol == 0 || kdim == 0 || batch == 0 {
        return Ok(());
    }
    let last = batch - 1;
    if c.len() < last * c_bs + (rows - 1) * ldc + ncol
        || et.len() < last * a_bs + (kdim - 1) * lda + rows
        || b.len() < last * b_bs + (kdim - 1) * ldb + ncol
    {
        return Err(CudaError::Shape {
            op: "sweep_trailing_gemm",
            msg: format!(
                "rows={rows}, ncol={ncol}, k={kdim}, ld={ld:?}, batch={batch}, bs={bs:?}, lens c={} a={} b={}",
                c.len(),
                et.len(),
                b.len()
            ),
        });
    }
    let v32 = |v: usize| v as u32;
    let (r32, n32, k32, ldc32, lda32, ldb32) = (
        v32(rows),
        v32(ncol),
        v32(kdim),
        v32(ldc),
        v32(lda),
        v32(ldb),
    );
    let (cb, ab, bb) = (c_bs as u64, a_bs as u64, b_bs as u64);
    let cfg = LaunchConfig {
        grid_dim: (n32.div_ceil(GEMM_TILE), r32.div_ceil(GEMM_TILE), v32(batch)),
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
    // (checked above); out-of-range rows/cols are guarded in the kernel.
    unsafe { lb.launch(cfg) }.map_err(launch_err("launch sweep_trailing_gemm"))?;
    Ok(())
}

/// Device buffers of a GPTQ sweep: W [rows × n] (modified), Q, codes out; E scratch [block × rows];
/// U [n × n]; scales, zeros [rows × n_groups]; col_group [n].
pub struct GptqBuffers<'a> {
    pub w: &'a mut CudaSlice<f32>,
    pub q: &'a mut CudaSlice<f32>,
    pub codes: &'a mut CudaSlice<u8>,
    pub e: &'a mut CudaSlice<f32>,
    pub u: &'a CudaSlice<f32>,
    pub scales: &'a CudaSlice<f32>,
    pub zeros: &'a CudaSlice<f32>,
    pub col_group: &'a CudaSlice<u32>,
}

/// The GPTQ sweep (static grids) over `rows` rows, lazy batches of `block_size` ≤ 128 columns.
#[allow(clippy::too_many_arguments)]
pub fn launch_gptq_sweep(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
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
        launch_gptq_block(stream, k, &mut buf, rows, n, n_groups, i1, i2, maxq)?;
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
    let cfg = LaunchConfig {
        grid_dim: (rows32.div_ceil(GPTQ_ROWS), 1, 1),
        block_dim: (GPTQ_ROWS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (i1_32, i2_32) = (i1 as u32, i2 as u32);
    {
        let mut lb = stream.launch_builder(&k.gptq_block);
        lb.arg(&mut *buf.w)
            .arg(&mut *buf.q)
            .arg(&mut *buf.codes)
            .arg(&mut *buf.e)
            .arg(buf.u)
            .arg(buf.scales)
            .arg(buf.zeros)
            .arg(buf.col_group)
            .arg(&rows32)
            .arg(&n32)
            .arg(&ng32)
            .arg(&i1_32)
            .arg(&i2_32)
            .arg(&maxq_f);
        // SAFETY: arguments match gptq_block_kernel(float* w, q, uint8* codes, float* e, const float* u,
        // scales, zeros, const uint32* col_group, uint32 rows, n, n_groups, i1, i2, float maxq); all
        // buffers have the shapes the callers check, i2 − i1 ≤ 128 = the kernel's smem block, e holds
        // (i2 − i1)·rows, and col_group entries are < n_groups (checked by the caller).
        unsafe { lb.launch(cfg) }.map_err(launch_err("launch gptq_block"))?;
    }
    if i2 < n {
        // W[:, i2:] −= E · U[i1:i2, i2:]
        launch_trailing_gemm(
            stream,
            k,
            &mut buf.w.slice_mut(i2..),
            &buf.e.slice(..),
            &buf.u.slice(i1 * n + i2..),
            rows,
            n - i2,
            i2 - i1,
            (n, rows, n),
            1,
            (0, 0, 0),
        )?;
    }
    Ok(())
}

/// The GPTQ sweep with dynamic group grids, group width `g`: blocks end at every group start, and at a block
/// that starts group k, `search(k, W[:, k·g : k·g + len])` (the current weights, [rows × len]) returns the
/// group's grids [rows], which go into the host `scales` / `zeros` [rows × n_groups] and are uploaded before
/// the block runs. Lazy batching is exact whatever the block bounds, so this is the CPU sweep's arithmetic up
/// to the summation order of the trailing updates.
#[allow(clippy::too_many_arguments)]
pub fn launch_gptq_sweep_dynamic(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
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
        scales: scales_d,
        zeros: zeros_d,
        col_group,
        gathered,
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
        || scales_d.len() != rows * n_groups
        || zeros_d.len() != rows * n_groups
        || col_group.len() != n
        || gathered.len() < rows * g.min(n)
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
    let mut scales = vec![0f32; rows * n_groups];
    let mut zeros = vec![0f32; rows * n_groups];
    let mut i1 = 0;
    while i1 < n {
        let next_group = (i1 / g + 1) * g;
        let i2 = (i1 + block_size).min(n).min(next_group);
        if i1.is_multiple_of(g) {
            let (kg, len) = (i1 / g, g.min(n - i1));
            let (r32, n32, c0, l32) = (rows as u32, n as u32, i1 as u32, len as u32);
            let cfg = LaunchConfig {
                grid_dim: (l32.div_ceil(32), r32.div_ceil(8), 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            };
            let mut lb = stream.launch_builder(&k.gather_cols);
            lb.arg(&mut *gathered)
                .arg(&*w)
                .arg(&r32)
                .arg(&n32)
                .arg(&c0)
                .arg(&l32);
            // SAFETY: matches gather_cols_kernel(float* out, const float* w, uint32 rows, n, c0, len);
            // gathered holds ≥ rows·len floats and w rows·n (checked above); the kernel guards its bounds.
            unsafe { lb.launch(cfg) }.map_err(launch_err("launch gather_cols"))?;
            let mut host = vec![0f32; rows * len];
            stream
                .memcpy_dtoh(&gathered.slice(..rows * len), &mut host)
                .map_err(launch_err("download group weights"))?;
            stream
                .synchronize()
                .map_err(launch_err("gptq_sweep_dynamic group"))?;
            let grids = search(kg, &host);
            if grids.len() != rows {
                return Err(CudaError::Shape {
                    op: "gptq_sweep_dynamic",
                    msg: format!("search returned {} grids for {rows} rows", grids.len()),
                });
            }
            for (r, (s, z)) in grids.into_iter().enumerate() {
                scales[r * n_groups + kg] = s;
                zeros[r * n_groups + kg] = z;
            }
            stream
                .memcpy_htod(&scales, scales_d)
                .map_err(launch_err("upload group scales"))?;
            stream
                .memcpy_htod(&zeros, zeros_d)
                .map_err(launch_err("upload group zeros"))?;
        }
        let mut buf = GptqBuffers {
            w: &mut *w,
            q: &mut *q,
            codes: &mut *codes,
            e: &mut *e,
            u,
            scales: &*scales_d,
            zeros: &*zeros_d,
            col_group,
        };
        launch_gptq_block(stream, k, &mut buf, rows, n, n_groups, i1, i2, maxq)?;
        i1 = i2;
    }
    Ok(())
}

/// The host search of a dynamic-group sweep: (group k, its current weights [rows × len]) → (scale, zero) per row.
pub type GroupSearch<'a> = dyn FnMut(usize, &[f32]) -> Vec<(f32, f32)> + 'a;

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
}

/// Device buffers of a BoA sweep (R = n_heads·d_h rows): W [R × n] (modified), W0 [R × n] (the weights before
/// the sweep), Q, codes out; E scratch [BOA_BLOCK × R]; U_col [n × n] or [n_heads × n × n]; F
/// [n_heads × d_h × d_h] (F[j, i] = U_row[j, i] / U_row[j, j]); scales, zeros [R × n_groups]; col_group [n].
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

/// The BoA wavefront sweep (static grids), all heads at once; `per_head_u` selects U_col per head.
#[allow(clippy::too_many_arguments)]
pub fn launch_boa_sweep(
    stream: &Arc<CudaStream>,
    k: &SweepKernels,
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
    if d_h == 0
        || d_h > BOA_MAX_DH
        || buf.w.len() != rows * n
        || buf.w0.len() != rows * n
        || buf.q.len() != rows * n
        || buf.codes.len() != rows * n
        || buf.e.len() < BOA_BLOCK.min(n) * rows
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
                "n_heads={n_heads}, d_h={d_h} (1..={BOA_MAX_DH}), n={n}, n_groups={n_groups}, per_head_u={per_head_u}"
            ),
        });
    }
    if n_heads == 0 || n == 0 {
        return Ok(());
    }
    let _r = range(c"boa_sweep");
    let u_hs: u64 = if per_head_u { (n * n) as u64 } else { 0 };
    let (dh32, n32, ng32, maxq_f) = (d_h as u32, n as u32, n_groups as u32, maxq as f32);
    let cfg = LaunchConfig {
        grid_dim: (n_heads as u32, 1, 1),
        block_dim: (BOA_MAX_DH as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut i1 = 0;
    while i1 < n {
        let i2 = (i1 + BOA_BLOCK).min(n);
        let (i1_32, i2_32) = (i1 as u32, i2 as u32);
        {
            let mut lb = stream.launch_builder(&k.boa_block);
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
            // SAFETY: arguments match boa_block_kernel(float* w, const float* w0, float* q, uint8* codes,
            // float* e, const float* u_col, uint64 u_head_stride, const float* f_row, scales, zeros,
            // const uint32* col_group, uint32 d_h, n, n_groups, i1, i2, float maxq); the grid is n_heads, so
            // rows_total = n_heads·d_h matches the buffers checked above; d_h ≤ 128 = the block and smem
            // tiles; i2 − i1 ≤ 32 = the smem column block.
            unsafe { lb.launch(cfg) }.map_err(launch_err("launch boa_block"))?;
        }
        if i2 < n {
            // Own GPTQ trailing updates: W[:, i2:] −= E · U_col[i1:i2, i2:], all heads in one GEMM when U_col
            // is shared, batched over heads otherwise.
            let (gemm_rows, batch, bs) = if per_head_u {
                (d_h, n_heads, (d_h * n, d_h, n * n))
            } else {
                (rows, 1, (0, 0, 0))
            };
            launch_trailing_gemm(
                stream,
                k,
                &mut buf.w.slice_mut(i2..),
                &buf.e.slice(..),
                &buf.u_col.slice(i1 * n + i2..),
                gemm_rows,
                n - i2,
                i2 - i1,
                (n, rows, n),
                batch,
                bs,
            )?;
        }
        i1 = i2;
    }
    Ok(())
}
