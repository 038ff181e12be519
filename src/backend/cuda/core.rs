//! Host side of cuda/core.cu: the gathers, diagonal updates and small elementwise passes of the quantization
//! core, so that a block's Hessians, factors and weights never leave the device (design.md §12). Each
//! launcher checks the shapes it is given and names them in its error.

use super::CudaError;
use crate::nvtx::range;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file (cuda/core.cu).
pub const MODULE: &str = "core";
/// Must match kThreads, kTileX, kTileY.
const THREADS: u32 = 256;
const TILE_X: u32 = 32;
const TILE_Y: u32 = 8;
/// CTAs of a dot product's partial sums (fixed, so the sum's order does not depend on the device).
pub const DOT_CTAS: usize = 256;

pub struct CoreKernels {
    diag: CudaFunction,
    permute_sym: CudaFunction,
    set_diag: CudaFunction,
    add_diag: CudaFunction,
    finish_sym: CudaFunction,
    zero_cols: CudaFunction,
    gather_f32: CudaFunction,
    gather_u8: CudaFunction,
    rtn: CudaFunction,
    sub: CudaFunction,
    dot_partials: CudaFunction,
    pack: CudaFunction,
    u_row_f: CudaFunction,
}

impl CoreKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let load = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(CoreKernels {
            diag: load("diag_kernel")?,
            permute_sym: load("permute_sym_kernel")?,
            set_diag: load("set_diag_kernel")?,
            add_diag: load("add_diag_kernel")?,
            finish_sym: load("finish_sym_kernel")?,
            zero_cols: load("zero_cols_kernel")?,
            gather_f32: load("gather_f32_kernel")?,
            gather_u8: load("gather_u8_kernel")?,
            rtn: load("rtn_kernel")?,
            sub: load("sub_kernel")?,
            dot_partials: load("dot_partials_kernel")?,
            pack: load("pack_kernel")?,
            u_row_f: load("u_row_f_kernel")?,
        })
    }
}

fn shape(op: &'static str, msg: String) -> CudaError {
    CudaError::Shape { op, msg }
}

fn launch_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

fn u32_of(op: &'static str, v: usize) -> Result<u32, CudaError> {
    u32::try_from(v).map_err(|_| shape(op, format!("{v} does not fit in u32")))
}

/// 32 × 8 tiles over [rows × cols] (x along cols), `batch` deep.
fn tiles(
    op: &'static str,
    rows: usize,
    cols: usize,
    batch: usize,
) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            u32_of(op, cols.div_ceil(TILE_X as usize).max(1))?,
            u32_of(op, rows.div_ceil(TILE_Y as usize).max(1))?,
            u32_of(op, batch.max(1))?,
        ),
        block_dim: (TILE_X, TILE_Y, 1),
        shared_mem_bytes: 0,
    })
}

fn line(op: &'static str, n: usize, y: usize) -> Result<LaunchConfig, CudaError> {
    Ok(LaunchConfig {
        grid_dim: (
            u32_of(op, n.div_ceil(THREADS as usize).max(1))?,
            u32_of(op, y.max(1))?,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// d [batch × n] = the diagonals of H [batch × n × n].
pub fn launch_diag(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    d: &mut CudaSlice<f32>,
    h: &CudaSlice<f32>,
    n: usize,
    batch: usize,
) -> Result<(), CudaError> {
    if h.len() != batch * n * n || d.len() != batch * n {
        return Err(shape(
            "diag",
            format!(
                "h.len={}, d.len={} for [{batch} × {n} × {n}]",
                h.len(),
                d.len()
            ),
        ));
    }
    if n == 0 || batch == 0 {
        return Ok(());
    }
    let n32 = u32_of("diag", n)?;
    let mut b = s.launch_builder(&k.diag);
    b.arg(d).arg(h).arg(&n32);
    // SAFETY: diag_kernel(float* d, const float* h, uint32 n); d holds batch·n, h batch·n² (checked); the grid's
    // y is the batch and the kernel guards i < n.
    unsafe { b.launch(line("diag", n, batch)?) }.map_err(launch_err("launch diag"))?;
    Ok(())
}

/// out_b = H_b[perm_b, perm_b], perm [batch × n].
pub fn launch_permute_sym(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    out: &mut CudaSlice<f32>,
    h: &CudaSlice<f32>,
    perm: &CudaSlice<u32>,
    n: usize,
    batch: usize,
) -> Result<(), CudaError> {
    if h.len() != batch * n * n || out.len() != h.len() || perm.len() != batch * n {
        return Err(shape(
            "permute_sym",
            format!(
                "h.len={}, perm.len={} for [{batch} × {n} × {n}]",
                h.len(),
                perm.len()
            ),
        ));
    }
    if n == 0 || batch == 0 {
        return Ok(());
    }
    let n32 = u32_of("permute_sym", n)?;
    let mut b = s.launch_builder(&k.permute_sym);
    b.arg(out).arg(h).arg(perm).arg(&n32);
    // SAFETY: permute_sym_kernel(float* out, const float* h, const uint32* perm, uint32 n); sizes checked, every
    // perm entry < n (the caller's permutations are checked on the host), the kernel guards i, j < n.
    unsafe { b.launch(tiles("permute_sym", n, n, batch)?) }
        .map_err(launch_err("launch permute_sym"))?;
    Ok(())
}

/// H_{mat[e]}[idx[e], idx[e]] = val[e].
#[allow(clippy::too_many_arguments)]
pub fn launch_set_diag(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    h: &mut CudaSlice<f32>,
    mat: &CudaSlice<u32>,
    idx: &CudaSlice<u32>,
    val: &CudaSlice<f32>,
    n: usize,
    count: usize,
) -> Result<(), CudaError> {
    if mat.len() != count
        || idx.len() != count
        || val.len() != count
        || !h.len().is_multiple_of((n * n).max(1))
    {
        return Err(shape(
            "set_diag",
            format!("{count} entries, h.len={}, n={n}", h.len()),
        ));
    }
    if count == 0 {
        return Ok(());
    }
    let (n32, c32) = (u32_of("set_diag", n)?, u32_of("set_diag", count)?);
    let mut b = s.launch_builder(&k.set_diag);
    b.arg(h).arg(mat).arg(idx).arg(val).arg(&n32).arg(&c32);
    // SAFETY: set_diag_kernel(float* h, const uint32* mat, idx, const float* val, uint32 n, count); the entries
    // were checked on the host (matrix < batch, index < n) and the kernel guards e < count.
    unsafe { b.launch(line("set_diag", count, 1)?) }.map_err(launch_err("launch set_diag"))?;
    Ok(())
}

/// H_{mat[e]} += amount[e]·I.
pub fn launch_add_diag(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    h: &mut CudaSlice<f32>,
    mat: &CudaSlice<u32>,
    amount: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let count = mat.len();
    if amount.len() != count || !h.len().is_multiple_of((n * n).max(1)) {
        return Err(shape(
            "add_diag",
            format!("{count} matrices, h.len={}, n={n}", h.len()),
        ));
    }
    if count == 0 || n == 0 {
        return Ok(());
    }
    let n32 = u32_of("add_diag", n)?;
    let mut b = s.launch_builder(&k.add_diag);
    b.arg(h).arg(mat).arg(amount).arg(&n32);
    // SAFETY: add_diag_kernel(float* h, const uint32* mat, const float* amount, uint32 n); each mat entry was
    // checked < batch on the host; the grid's y is the entry and the kernel guards i < n.
    unsafe { b.launch(line("add_diag", n, count)?) }.map_err(launch_err("launch add_diag"))?;
    Ok(())
}

/// H_b = f·Σ_b, exactly symmetric, for every matrix of h [batch × n × n].
pub fn launch_finish_sym(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    h: &mut CudaSlice<f32>,
    n: usize,
    batch: usize,
    f: f32,
) -> Result<(), CudaError> {
    if h.len() != batch * n * n {
        return Err(shape(
            "finish_sym",
            format!("h.len={} for [{batch} × {n} × {n}]", h.len()),
        ));
    }
    if n == 0 || batch == 0 {
        return Ok(());
    }
    let n32 = u32_of("finish_sym", n)?;
    let mut b = s.launch_builder(&k.finish_sym);
    b.arg(h).arg(&n32).arg(&f);
    // SAFETY: finish_sym_kernel(float* h, uint32 n, float f); h holds batch·n²; each (i, j ≤ i) pair is
    // written by one thread only, which reads (i, j) and (j, i) before writing them.
    unsafe { b.launch(tiles("finish_sym", n, n, batch)?) }
        .map_err(launch_err("launch finish_sym"))?;
    Ok(())
}

/// W [rows × n]: W[r, c] = 0 where mask[r / rows_per_part, c] ≠ 0.
pub fn launch_zero_cols(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    w: &mut CudaSlice<f32>,
    mask: &CudaSlice<u8>,
    rows: usize,
    n: usize,
    rows_per_part: usize,
) -> Result<(), CudaError> {
    if w.len() != rows * n || rows_per_part == 0 || mask.len() != rows.div_ceil(rows_per_part) * n {
        return Err(shape(
            "zero_cols",
            format!(
                "w.len={}, mask.len={} for [{rows} × {n}], parts of {rows_per_part}",
                w.len(),
                mask.len()
            ),
        ));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (r32, n32, p32) = (
        u32_of("zero_cols", rows)?,
        u32_of("zero_cols", n)?,
        u32_of("zero_cols", rows_per_part)?,
    );
    let mut b = s.launch_builder(&k.zero_cols);
    b.arg(w).arg(mask).arg(&r32).arg(&n32).arg(&p32);
    // SAFETY: zero_cols_kernel(float* w, const uint8* mask, uint32 rows, n, rows_per_part); sizes checked.
    unsafe { b.launch(tiles("zero_cols", rows, n, 1)?) }.map_err(launch_err("launch zero_cols"))?;
    Ok(())
}

/// Elements a gather kernel moves: f32 weights or u8 codes.
pub trait Gathered: DeviceRepr {
    fn kernel(k: &CoreKernels) -> &CudaFunction;
}
impl Gathered for f32 {
    fn kernel(k: &CoreKernels) -> &CudaFunction {
        &k.gather_f32
    }
}
impl Gathered for u8 {
    fn kernel(k: &CoreKernels) -> &CudaFunction {
        &k.gather_u8
    }
}

/// out[i, k] = in[row_perm[i], cp[k]] (or, `scatter`, out[row_perm[i], cp[k]] = in[i, k]), cp = col_perm of
/// row i's part ([parts × n], parts = rows / rows_per_part).
#[allow(clippy::too_many_arguments)]
pub fn launch_gather<T: Gathered>(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    out: &mut CudaSlice<T>,
    input: &CudaSlice<T>,
    row_perm: &CudaSlice<u32>,
    col_perm: &CudaSlice<u32>,
    rows: usize,
    n: usize,
    rows_per_part: usize,
    scatter: bool,
) -> Result<(), CudaError> {
    if input.len() != rows * n
        || out.len() != input.len()
        || row_perm.len() != rows
        || rows_per_part == 0
        || col_perm.len() != rows.div_ceil(rows_per_part) * n
    {
        return Err(shape(
            "gather",
            format!(
                "in.len={}, row_perm.len={}, col_perm.len={} for [{rows} × {n}], parts of {rows_per_part}",
                input.len(),
                row_perm.len(),
                col_perm.len()
            ),
        ));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (r32, n32, p32, sc) = (
        u32_of("gather", rows)?,
        u32_of("gather", n)?,
        u32_of("gather", rows_per_part)?,
        scatter as u32,
    );
    let _r = range(c"gather");
    let mut b = s.launch_builder(T::kernel(k));
    b.arg(out)
        .arg(input)
        .arg(row_perm)
        .arg(col_perm)
        .arg(&r32)
        .arg(&n32)
        .arg(&p32)
        .arg(&sc);
    // SAFETY: gather_*_kernel(T* out, const T* in, const uint32* row_perm, col_perm, uint32 rows, n,
    // rows_per_part, scatter); sizes checked; the permutations were checked on the host (each a permutation of
    // 0..rows or 0..n), so a scatter writes every element once.
    unsafe { b.launch(tiles("gather", rows, n, 1)?) }.map_err(launch_err("launch gather"))?;
    Ok(())
}

/// Q and codes of W [rows × n] on fixed grids [rows × n_groups], column c on group col_group[c].
#[allow(clippy::too_many_arguments)]
pub fn launch_rtn(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    q: &mut CudaSlice<f32>,
    codes: &mut CudaSlice<u8>,
    w: &CudaSlice<f32>,
    scales: &CudaSlice<f32>,
    zeros: &CudaSlice<f32>,
    col_group: &CudaSlice<u32>,
    rows: usize,
    n: usize,
    n_groups: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    if w.len() != rows * n
        || q.len() != w.len()
        || codes.len() != w.len()
        || scales.len() != rows * n_groups
        || zeros.len() != scales.len()
        || col_group.len() != n
    {
        return Err(shape(
            "rtn",
            format!(
                "w.len={}, scales.len={}, col_group.len={} for [{rows} × {n}], {n_groups} groups",
                w.len(),
                scales.len(),
                col_group.len()
            ),
        ));
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let (r32, n32, g32, mq) = (
        u32_of("rtn", rows)?,
        u32_of("rtn", n)?,
        u32_of("rtn", n_groups)?,
        maxq as f32,
    );
    let mut b = s.launch_builder(&k.rtn);
    b.arg(q)
        .arg(codes)
        .arg(w)
        .arg(scales)
        .arg(zeros)
        .arg(col_group)
        .arg(&r32)
        .arg(&n32)
        .arg(&g32)
        .arg(&mq);
    // SAFETY: rtn_kernel(float* q, uint8* codes, const float* w, scales, zeros, const uint32* col_group, uint32
    // rows, n, n_groups, float maxq); sizes checked; col_group entries < n_groups (checked on the host).
    unsafe { b.launch(tiles("rtn", rows, n, 1)?) }.map_err(launch_err("launch rtn"))?;
    Ok(())
}

/// out = a − b.
pub fn launch_sub(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    out: &mut CudaSlice<f32>,
    a: &CudaSlice<f32>,
    b_: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    let len = a.len();
    if b_.len() != len || out.len() != len {
        return Err(shape(
            "sub",
            format!("{} − {} into {}", a.len(), b_.len(), out.len()),
        ));
    }
    if len == 0 {
        return Ok(());
    }
    let l64 = len as u64;
    let mut b = s.launch_builder(&k.sub);
    b.arg(out).arg(a).arg(b_).arg(&l64);
    // SAFETY: sub_kernel(float* out, const float* a, const float* b, uint64 len); all three hold len f32.
    unsafe { b.launch(line("sub", len, 1)?) }.map_err(launch_err("launch sub"))?;
    Ok(())
}

/// partial [DOT_CTAS] f64 = the CTAs' sums of a·b over views of equal length.
pub fn launch_dot_partials(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    partial: &mut CudaViewMut<f64>,
    a: &CudaView<f32>,
    b_: &CudaView<f32>,
) -> Result<(), CudaError> {
    if a.len() != b_.len() || partial.len() != DOT_CTAS {
        return Err(shape(
            "dot_partials",
            format!(
                "a.len={}, b.len={}, partial.len={}",
                a.len(),
                b_.len(),
                partial.len()
            ),
        ));
    }
    let l64 = a.len() as u64;
    let cfg = LaunchConfig {
        grid_dim: (DOT_CTAS as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = s.launch_builder(&k.dot_partials);
    b.arg(partial).arg(a).arg(b_).arg(&l64);
    // SAFETY: dot_partials_kernel(double* partial, const float* a, const float* b, uint64 len); partial holds
    // DOT_CTAS = the grid size, a and b len each (checked); the loops stay below len.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch dot_partials"))?;
    Ok(())
}

/// qweight [ceil(d_in·b/32) × d_out] of codes [d_out × d_in].
pub fn launch_pack(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    qweight: &mut CudaViewMut<u32>,
    codes: &CudaSlice<u8>,
    d_out: usize,
    d_in: usize,
    bits: u32,
) -> Result<(), CudaError> {
    let kw = (d_in * bits as usize).div_ceil(32);
    if !matches!(bits, 2 | 3 | 4 | 8) || codes.len() != d_out * d_in || qweight.len() != kw * d_out
    {
        return Err(shape(
            "pack",
            format!(
                "{bits}-bit [{d_out} × {d_in}], codes.len={}, qweight.len={}",
                codes.len(),
                qweight.len()
            ),
        ));
    }
    if d_out == 0 || kw == 0 {
        return Ok(());
    }
    let (o32, i32_, b32) = (u32_of("pack", d_out)?, u32_of("pack", d_in)?, bits);
    let mut b = s.launch_builder(&k.pack);
    b.arg(qweight).arg(codes).arg(&o32).arg(&i32_).arg(&b32);
    // SAFETY: pack_kernel(uint32* qweight, const uint8* codes, uint32 d_out, d_in, bits); sizes checked, the
    // kernel guards j < d_out, word < kw and i < d_in.
    unsafe { b.launch(tiles("pack", kw, d_out, 1)?) }.map_err(launch_err("launch pack"))?;
    Ok(())
}

/// F [n_heads × d_h × d_h] of U_row (same shape): F[j, i] = U[j, i] / U[j, j] for i > j, else 0.
pub fn launch_u_row_f(
    s: &Arc<CudaStream>,
    k: &CoreKernels,
    f: &mut CudaSlice<f32>,
    u_row: &CudaSlice<f32>,
    d_h: usize,
    n_heads: usize,
) -> Result<(), CudaError> {
    if u_row.len() != n_heads * d_h * d_h || f.len() != u_row.len() {
        return Err(shape(
            "u_row_f",
            format!("u_row.len={} for [{n_heads} × {d_h} × {d_h}]", u_row.len()),
        ));
    }
    if d_h == 0 || n_heads == 0 {
        return Ok(());
    }
    let d32 = u32_of("u_row_f", d_h)?;
    let mut b = s.launch_builder(&k.u_row_f);
    b.arg(f).arg(u_row).arg(&d32);
    // SAFETY: u_row_f_kernel(float* f, const float* u_row, uint32 d_h); both hold n_heads·d_h² (checked).
    unsafe { b.launch(tiles("u_row_f", d_h, d_h, n_heads)?) }
        .map_err(launch_err("launch u_row_f"))?;
    Ok(())
}
