//! Host side of cuda/search.cu: the static scale search of `QuantOps::search_grids` and the dynamic-group
//! searches of the GPTQ sweep, entirely on the device (the .cu header has the algebra, the problem layout,
//! launch shapes and roofline). Per call the host uploads only the column indices of the H blocks (O(n)
//! u32) and queues kernels and cuBLAS calls: the candidate table is built from W on the device, bit for bit
//! the CPU's `quant::quantizer::search_candidates`, the best slots become grids on the device, and nothing is
//! downloaded or waited for. A dynamic-group sweep builds its `DynamicSearch` once (the H blocks of every group
//! gathered, scratch allocated) and then searches each group with launches alone: no transfer, no
//! synchronization, no allocation per group.
//!
//! Variants of the Hessian search (style.md rules 4 and 17; `SearchVariant`, `CudaBackend::set_search_variant`):
//! * v1 `F32`: score = s²·vᵀHv − 2s·vᵀHw with P = V·H in f32 SGEMM (the naive port of the CPU's score);
//! * v2 `Bf16Rescore` (default): Δ = ŵ − w of every candidate in bf16, P = Δ·H on the tensor cores
//!   (cublasGemmStridedBatchedEx, f32 accumulation), approx = Σ P·Δ keeps each row's SEARCH_TOP best slots;
//!   those are re-scored exactly (f32 Δ, SGEMM, f64 dot) and the least (score, slot) wins. Scoring Δ H Δᵀ
//!   itself rather than dropping wᵀHw keeps the bf16 error relative to Δ H Δᵀ (~2⁻⁸), not to wᵀHw (100–1000×
//!   larger).
//!
//! MinMax and Mse are one kernel each (search_minmax_kernel, search_mse_kernel). The Hessian search needs
//! cuBLAS; without it the call fails with an error that says so (no host route).
//!
//! Problems (`Batch`): the groups of every part are searched together, B = parts·gc problems of R rows × L
//! columns in one set of launches, the GEMMs strided-batched over the problems' H blocks. Parts sharing one
//! H (GPTQ, RTN, BoA's shared H_col) are one part of all rows; a call's groups are taken in chunks that keep
//! the candidate table under TABLE_ELEMS entries, and a trailing partial group is a batch of its own.

use super::gemm::BatchedOperands;
use super::ops;
use super::{CudaBackend, CudaError, driver};
use crate::nvtx::range;
use crate::quant::quantizer::{
    Grid, MSE_NORM, QuantSpec, SHRINK_STEPS, ScaleSearch, candidate_slots, search_candidates,
};

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file (cuda/search.cu).
pub const MODULE: &str = "search";

/// Threads per CTA of every search kernel; must match kThreads in cuda/search.cu.
const SEARCH_THREADS: u32 = 256;
/// Warps per CTA (one row or (slot, row) pair each).
const WARPS_PER_CTA: usize = SEARCH_THREADS as usize / 32;
/// Grid cap of the grid-stride kernels.
const MAX_CTAS: usize = 1 << 20;
/// f32 elements of one of the batch buffers (V or D, and P): K·rows·L ≤ this, K ≥ 1: 2²⁷ = 512 MB each, so a
/// batch holds 8 candidate slots of a 4096 × 4096 matrix per channel, 2 of an 11008 × 4096 one.
const BATCH_ELEMS: usize = 1 << 27;
/// Candidate-table entries (rows of a chunk × slots) of one chunk of groups: 2²⁵ (3 × 128 MB). A 4096-row
/// weight's 200 slots fit 40 groups per chunk; 8192 rows (70B) 20.
const TABLE_ELEMS: usize = 1 << 25;
/// v2: approximate best slots per row that are re-scored exactly; must match kTop in cuda/search.cu. The
/// emulation (profiling/emulate_search_bf16.py) never saw the exact optimum below rank 1 of the approximate
/// order (280 rows; rank 1 twice); 4 leaves margin at ~2% of the SGEMM work of v1. Not a guarantee: a random
/// parity case (2 bits, 16 columns; tests/parity_search.rs, BF16_SCREEN) ranked it lower, and the pick was
/// 6e-4 above it, within the bf16 scores' rounding.
pub const SEARCH_TOP: usize = 4;

/// Device variants of the Hessian scale search (module comment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SearchVariant {
    /// v1: s²·vᵀHv − 2s·vᵀHw, f32 SGEMM over every candidate.
    F32 = 1,
    /// v2: bf16 Δ·H on the tensor cores for every candidate, the SEARCH_TOP best re-scored exactly.
    Bf16Rescore = 2,
}

impl SearchVariant {
    pub const ALL: [SearchVariant; 2] = [SearchVariant::F32, SearchVariant::Bf16Rescore];
}

pub struct SearchKernels {
    gather_w: CudaFunction,
    gather_h: CudaFunction,
    candidates: CudaFunction,
    v: CudaFunction,
    score: CudaFunction,
    delta_bf16: CudaFunction,
    delta_f32: CudaFunction,
    approx: CudaFunction,
    rescore: CudaFunction,
    write_grids: CudaFunction,
    minmax: CudaFunction,
    mse: CudaFunction,
}

impl SearchKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |name: &'static str| super::load_kernel(module, MODULE, name);
        Ok(SearchKernels {
            gather_w: get("search_gather_w_kernel")?,
            gather_h: get("search_gather_h_kernel")?,
            candidates: get("search_candidates_kernel")?,
            v: get("search_v_kernel")?,
            score: get("search_score_kernel")?,
            delta_bf16: get("search_delta_bf16_kernel")?,
            delta_f32: get("search_delta_f32_kernel")?,
            approx: get("search_approx_kernel")?,
            rescore: get("search_rescore_kernel")?,
            write_grids: get("search_write_grids_kernel")?,
            minmax: get("search_minmax_kernel")?,
            mse: get("search_mse_kernel")?,
        })
    }
}

/// The candidate table of every row in slot order (`search_candidates`): scale, 1/scale (as the CPU search
/// rounds it) and zero, NaN zero (scale and 1/scale 1) for an absent slot; [rows × n_slots] each. The host
/// twin of search_candidates_kernel (the unit tests' emulation of the device algorithm uses it).
pub struct CandidateTable {
    pub n_slots: usize,
    pub scale: Vec<f32>,
    pub inv: Vec<f32>,
    pub zero: Vec<f32>,
}

pub fn candidate_table(w: &[f32], rows: usize, n: usize, spec: &QuantSpec) -> CandidateTable {
    let mut t = CandidateTable {
        n_slots: SHRINK_STEPS * candidate_slots(spec),
        scale: Vec::new(),
        inv: Vec::new(),
        zero: Vec::new(),
    };
    for r in 0..rows {
        for g in search_candidates(&w[r * n..(r + 1) * n], spec) {
            let g = g.unwrap_or(Grid {
                scale: 1.0,
                zero: f32::NAN,
            });
            t.scale.push(g.scale);
            t.inv.push(1.0 / g.scale);
            t.zero.push(g.zero);
        }
    }
    t
}

/// Candidate slots per batch for `rows` rows of `l` columns: as many as fit BATCH_ELEMS, at least 1, at most
/// all.
pub fn batch_slots(rows: usize, l: usize, n_slots: usize) -> usize {
    (BATCH_ELEMS / (rows * l).max(1)).clamp(1, n_slots.max(1))
}

/// The batches (c0, k_batch) of slot order, k_max slots each (the last one shorter).
pub fn batches(n_slots: usize, k_max: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n_slots)
        .step_by(k_max.max(1))
        .map(move |c0| (c0, k_max.max(1).min(n_slots - c0)))
}

/// The grids of the best slots; a row without one (no finite score: NaN weights) gets Grid::default(), as the
/// CPU search leaves it (search_write_grids_kernel's host twin).
pub fn grids_from_slots(table: &CandidateTable, slots: &[i32]) -> Vec<Grid<f32>> {
    let ns = table.n_slots;
    slots
        .iter()
        .enumerate()
        .map(|(r, &c)| match usize::try_from(c) {
            Ok(c) if c < ns => Grid {
                scale: table.scale[r * ns + c],
                zero: table.zero[r * ns + c],
            },
            _ => Grid::default(),
        })
        .collect()
}

/// A batch of search problems (cuda/search.cu "Problem layout"): `parts` parts of `r` rows each, groups
/// k0..k0 + gc of width g (columns [k·g, k·g + l)), so B = parts·gc problems of r rows × l columns; their
/// grids go to columns k0..k0 + gc of grids [parts·r × ng].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batch {
    pub parts: usize,
    pub gc: usize,
    pub r: usize,
    pub l: usize,
    pub k0: usize,
    pub ng: usize,
}

impl Batch {
    /// B = parts·gc.
    pub fn problems(&self) -> usize {
        self.parts * self.gc
    }

    /// B·R: the rows of the batch's gathered W and of its candidate table.
    pub fn rows(&self) -> usize {
        self.problems() * self.r
    }

    fn check(&self, op: &'static str) -> Result<(), CudaError> {
        let ok = self.parts > 0
            && self.gc > 0
            && self.r > 0
            && self.l > 0
            && self.k0 + self.gc <= self.ng
            && self.rows() <= u32::MAX as usize
            && self.rows() * self.l <= u32::MAX as usize
            && self.ng <= u32::MAX as usize;
        if ok {
            Ok(())
        } else {
            Err(shape(op, format!("batch {self:?}")))
        }
    }

    fn u32s(&self) -> (u32, u32, u32, u32, u32, u32) {
        (
            self.rows() as u32,
            self.r as u32,
            self.l as u32,
            self.gc as u32,
            self.k0 as u32,
            self.ng as u32,
        )
    }
}

fn shape(op: &'static str, msg: String) -> CudaError {
    CudaError::Shape { op, msg }
}

/// One warp per unit, grid-stride (capped at MAX_CTAS).
fn warp_stride_cfg(units: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            units.div_ceil(WARPS_PER_CTA).clamp(1, MAX_CTAS) as u32,
            1,
            1,
        ),
        block_dim: (SEARCH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, every row its own warp (the score kernels; rows ≤ u32::MAX checked by `Batch::check`).
fn warp_per_row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(WARPS_PER_CTA).max(1) as u32, 1, 1),
        block_dim: (SEARCH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The candidate table and running bests of a batch (device, written by search_candidates_kernel), sized for
/// up to `rows` rows.
pub struct Table {
    rows: usize,
    n_slots: usize,
    scale: CudaSlice<f32>,
    inv: CudaSlice<f32>,
    zero: CudaSlice<f32>,
    best_score: CudaSlice<f64>,
    best_slot: CudaSlice<i32>,
    top_score: CudaSlice<f32>,
    top_slot: CudaSlice<i32>,
}

/// Scratch of the Hessian search for batches of up to `rows` rows of `l` columns: the table and the per-batch
/// candidate buffers of the variant, allocated once (a dynamic sweep reuses it for every group).
pub struct SearchScratch {
    variant: SearchVariant,
    rows: usize,
    l: usize,
    k_max: usize,
    k_re: usize,
    table: Table,
    /// v1: HW [rows × l], V [k_max × rows × l]; v2: D bf16 [k_max × rows × l] and f32 D [k_re × rows × l].
    hw: CudaSlice<f32>,
    v: CudaSlice<f32>,
    d_bf: CudaSlice<u16>,
    /// P [max(k_max, k_re) × rows × l].
    p: CudaSlice<f32>,
}

/// The H blocks of a batch's problems: block b at b·l² (f32, and its bf16 copy for v2).
pub struct HBlocks<'a> {
    pub f32: CudaView<'a, f32>,
    pub bf16: Option<CudaView<'a, u16>>,
}

// ---- launchers ---------------------------------------------------------------------------------------------

/// out [B·R × L] = the rows of the batch's problems, gathered from W [parts·R × n] (columns
/// [(k0 + kk)·g, … + L) of part p's rows for problem p·gc + kk).
pub fn launch_search_gather_w(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    out: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    n: usize,
    g: usize,
    b: Batch,
) -> Result<(), CudaError> {
    b.check("search_gather_w")?;
    let last_col = (b.k0 + b.gc - 1) * g + b.l;
    if b.l > g
        || last_col > n
        || w.len() < b.parts * b.r * n
        || out.len() < b.rows() * b.l
        || n > u32::MAX as usize
        || g > u32::MAX as usize
    {
        return Err(shape(
            "search_gather_w",
            format!(
                "w.len={} out.len={} for n={n}, g={g}, {b:?}",
                w.len(),
                out.len()
            ),
        ));
    }
    let _r = range(c"search_gather_w");
    let (rows, r32, l32, gc32, k032, _) = b.u32s();
    let (n32, g32) = (n as u32, g as u32);
    let mut lb = stream.launch_builder(&k.gather_w);
    lb.arg(out)
        .arg(w)
        .arg(&n32)
        .arg(&g32)
        .arg(&r32)
        .arg(&l32)
        .arg(&gc32)
        .arg(&k032)
        .arg(&rows);
    // SAFETY: matches search_gather_w_kernel(float* out, const float* w, u32 n, g, R, L, gc, k0, rows_out);
    // out holds ≥ B·R·L, w parts·R·n f32, and every column read, (k0 + kk)·g + j < (k0 + gc − 1)·g + L ≤ n
    // (checked above).
    unsafe { lb.launch(warp_stride_cfg(b.rows())) }.map_err(driver("launch search_gather_w"))?;
    Ok(())
}

/// out [parts·gc × L × L] = the problems' H blocks: H_f[idx_x[a], idx_x[c]] for the group's columns a, c,
/// f = f_of[p] (the part's matrix of the batch `h` [h_batch × n × n]) and x = x_of[p] (its row of `idx`
/// [n_idx × n]). `f_of_host` / `x_of_host` are the values uploaded in `f_of_dev` / `x_of_dev` (checked here);
/// every idx entry must be < n (the caller checks it before uploading).
#[allow(clippy::too_many_arguments)]
pub fn launch_search_gather_h(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    out: &mut CudaSlice<f32>,
    h: &CudaSlice<f32>,
    h_batch: usize,
    idx: &CudaSlice<u32>,
    n_idx: usize,
    of_host: (&[u32], &[u32]),
    of_dev: (&CudaSlice<u32>, &CudaSlice<u32>),
    n: usize,
    g: usize,
    b: Batch,
) -> Result<(), CudaError> {
    b.check("search_gather_h")?;
    let (f_host, x_host) = of_host;
    let (f_dev, x_dev) = of_dev;
    let rows_out = b.problems() * b.l;
    if b.l > g
        || (b.k0 + b.gc - 1) * g + b.l > n
        || h.len() != h_batch * n * n
        || idx.len() != n_idx * n
        || f_host.len() != b.parts
        || x_host.len() != b.parts
        || f_dev.len() != b.parts
        || x_dev.len() != b.parts
        || f_host.iter().any(|&f| f as usize >= h_batch)
        || x_host.iter().any(|&x| x as usize >= n_idx)
        || out.len() < rows_out * b.l
        || rows_out > u32::MAX as usize
        || n > u32::MAX as usize
    {
        return Err(shape(
            "search_gather_h",
            format!(
                "h.len={} ({h_batch} matrices) idx.len={} ({n_idx} rows) parts' matrices {f_host:?} and \
                 indices {x_host:?}, out.len={} for n={n}, g={g}, {b:?}",
                h.len(),
                idx.len(),
                out.len()
            ),
        ));
    }
    let _r = range(c"search_gather_h");
    let (_, _, l32, gc32, k032, _) = b.u32s();
    let (n32, g32, rows32) = (n as u32, g as u32, rows_out as u32);
    let mut lb = stream.launch_builder(&k.gather_h);
    lb.arg(out)
        .arg(h)
        .arg(idx)
        .arg(f_dev)
        .arg(x_dev)
        .arg(&n32)
        .arg(&g32)
        .arg(&l32)
        .arg(&gc32)
        .arg(&k032)
        .arg(&rows32);
    // SAFETY: matches search_gather_h_kernel(float* out, const float* h, const u32* idx, const u32* f_of,
    // const u32* x_of, u32 n, g, L, gc, k0, rows_out); out holds ≥ parts·gc·L² f32; f_of and x_of hold the
    // checked values (each < h_batch, < n_idx), so matrix f lies inside h and row x inside idx; the caller
    // checked every idx entry < n; the columns read, (k0 + kk)·g + a < n (checked).
    unsafe { lb.launch(warp_stride_cfg(rows_out)) }.map_err(driver("launch search_gather_h"))?;
    Ok(())
}

/// The candidate table of the first `rows` rows of W [rows × l] (and the running bests reset).
pub fn launch_search_candidates(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    t: &mut Table,
    w: &CudaSlice<f32>,
    rows: usize,
    l: usize,
    spec: &QuantSpec,
) -> Result<(), CudaError> {
    let n_slots = SHRINK_STEPS * candidate_slots(spec);
    if rows > t.rows
        || t.n_slots != n_slots
        || w.len() < rows * l
        || rows > u32::MAX as usize
        || l > u32::MAX as usize
    {
        return Err(shape(
            "search_candidates",
            format!(
                "table of {} rows × {} slots, w.len={} for rows={rows}, l={l} ({n_slots} slots)",
                t.rows,
                t.n_slots,
                w.len()
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let _r = range(c"search_candidates");
    let (rows32, l32, sym) = (rows as u32, l as u32, spec.sym as u32);
    let maxq = spec.maxq() as f32;
    let mut lb = stream.launch_builder(&k.candidates);
    lb.arg(&mut t.scale)
        .arg(&mut t.inv)
        .arg(&mut t.zero)
        .arg(&mut t.best_score)
        .arg(&mut t.best_slot)
        .arg(&mut t.top_score)
        .arg(&mut t.top_slot)
        .arg(w)
        .arg(&rows32)
        .arg(&l32)
        .arg(&maxq)
        .arg(&sym);
    // SAFETY: matches search_candidates_kernel(float* scale, float* inv, float* zero, double* best_score,
    // int32* best_slot, float* top_score, int32* top_slot, const float* w, u32 rows, u32 L, float maxq,
    // u32 sym); the table holds ≥ rows·n_slots per array (n_slots = 100·(sym ? 1 : 2), the kernel's), the
    // bests ≥ rows, the lists ≥ rows·kTop (Table::new), w ≥ rows·L (checked).
    unsafe { lb.launch(warp_stride_cfg(rows)) }.map_err(driver("launch search_candidates"))?;
    Ok(())
}

/// The shape checks shared by the per-batch candidate kernels: `elems` is what the per-slot buffers must
/// hold (k_batch·B·R·L), `limit` what c0 + k_batch may reach (n_slots, or SEARCH_TOP for ranks).
#[allow(clippy::too_many_arguments)]
fn check_slots(
    op: &'static str,
    b: Batch,
    t: &Table,
    w_len: usize,
    buf_lens: &[usize],
    c0: usize,
    k_batch: usize,
    limit: usize,
) -> Result<(), CudaError> {
    b.check(op)?;
    let elems = k_batch * b.rows() * b.l;
    if t.rows < b.rows()
        || w_len < b.rows() * b.l
        || buf_lens.iter().any(|&l| l < elems)
        || c0 + k_batch > limit
        || k_batch * b.rows() > u32::MAX as usize
        || t.n_slots > i32::MAX as usize
    {
        return Err(shape(
            op,
            format!(
                "table rows {}, w.len={w_len}, buffers {buf_lens:?} (need {elems}) for {b:?}, \
                 {c0}+{k_batch} of {limit}",
                t.rows
            ),
        ));
    }
    Ok(())
}

/// v1: V = the integer vectors of slots c0..c0 + k_batch of every row of the batch (problem-major).
#[allow(clippy::too_many_arguments)]
pub fn launch_search_v(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    v: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    t: &Table,
    b: Batch,
    c0: usize,
    k_batch: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    check_slots(
        "search_v",
        b,
        t,
        w.len(),
        &[v.len()],
        c0,
        k_batch,
        t.n_slots,
    )?;
    let pairs = k_batch * b.rows();
    if pairs == 0 {
        return Ok(());
    }
    let _r = range(c"search_v");
    let (_, r32, l32, _, _, _) = b.u32s();
    let (ns, c032, kb32, p32, maxq_f) = (
        t.n_slots as u32,
        c0 as u32,
        k_batch as u32,
        pairs as u32,
        maxq as f32,
    );
    let mut lb = stream.launch_builder(&k.v);
    lb.arg(v)
        .arg(w)
        .arg(&t.inv)
        .arg(&t.zero)
        .arg(&r32)
        .arg(&l32)
        .arg(&ns)
        .arg(&c032)
        .arg(&kb32)
        .arg(&p32)
        .arg(&maxq_f);
    // SAFETY: matches search_v_kernel(float* v, const float* w, const float* cand_inv, const float* cand_zero,
    // u32 R, L, n_slots, c0, k_batch, pairs, float maxq); v holds ≥ k_batch·B·R·L, w ≥ B·R·L, the table
    // ≥ B·R·n_slots, c0 + k_batch ≤ n_slots, pairs fits u32 (check_slots).
    unsafe { lb.launch(warp_stride_cfg(pairs)) }.map_err(driver("launch search_v"))?;
    Ok(())
}

/// v1: folds the scores of slots c0..c0 + k_batch into the running best (score, slot) of every row.
#[allow(clippy::too_many_arguments)]
pub fn launch_search_score(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    t: &mut Table,
    p: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    hw: &CudaSlice<f32>,
    b: Batch,
    c0: usize,
    k_batch: usize,
) -> Result<(), CudaError> {
    check_slots(
        "search_score",
        b,
        t,
        hw.len(),
        &[p.len(), v.len()],
        c0,
        k_batch,
        t.n_slots,
    )?;
    if k_batch == 0 {
        return Ok(());
    }
    let _r = range(c"search_score");
    let (rows, r32, l32, _, _, _) = b.u32s();
    let (ns, c032, kb32) = (t.n_slots as u32, c0 as u32, k_batch as u32);
    let mut lb = stream.launch_builder(&k.score);
    lb.arg(&mut t.best_score)
        .arg(&mut t.best_slot)
        .arg(p)
        .arg(v)
        .arg(hw)
        .arg(&t.scale)
        .arg(&t.zero)
        .arg(&rows)
        .arg(&r32)
        .arg(&l32)
        .arg(&ns)
        .arg(&c032)
        .arg(&kb32);
    // SAFETY: matches search_score_kernel(double* best_score, int32* best_slot, const float* p, const float* v,
    // const float* hw, const float* cand_scale, const float* cand_zero, u32 rows, R, L, n_slots, c0, k_batch);
    // every buffer holds what the kernel indexes (check_slots; hw ≥ B·R·L); the grid covers every row.
    unsafe { lb.launch(warp_per_row_cfg(b.rows())) }.map_err(driver("launch search_score"))?;
    Ok(())
}

/// Where the Δ rows of a v2 batch go: slots c0..c0 + k of every row (bf16, the approximate pass) or ranks
/// c0..c0 + k of every row's approximate best list (f32, the re-score).
pub enum DeltaOut<'a> {
    Bf16(&'a mut CudaSlice<u16>),
    F32Ranks(&'a mut CudaSlice<f32>),
}

/// v2: D = ŵ − w of slots (or list ranks) c0..c0 + k_batch of every row of the batch (problem-major).
#[allow(clippy::too_many_arguments)]
pub fn launch_search_delta(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    out: DeltaOut,
    w: &CudaSlice<f32>,
    t: &Table,
    b: Batch,
    c0: usize,
    k_batch: usize,
    maxq: u32,
) -> Result<(), CudaError> {
    let (d_len, limit) = match &out {
        DeltaOut::Bf16(d) => (d.len(), t.n_slots),
        DeltaOut::F32Ranks(d) => (d.len(), SEARCH_TOP),
    };
    check_slots("search_delta", b, t, w.len(), &[d_len], c0, k_batch, limit)?;
    let pairs = k_batch * b.rows();
    if pairs == 0 {
        return Ok(());
    }
    let _r = range(c"search_delta");
    let (_, r32, l32, _, _, _) = b.u32s();
    let (ns, c032, kb32, p32, maxq_f) = (
        t.n_slots as u32,
        c0 as u32,
        k_batch as u32,
        pairs as u32,
        maxq as f32,
    );
    let cfg = warp_stride_cfg(pairs);
    match out {
        DeltaOut::Bf16(d) => {
            let mut lb = stream.launch_builder(&k.delta_bf16);
            lb.arg(d)
                .arg(w)
                .arg(&t.scale)
                .arg(&t.inv)
                .arg(&t.zero)
                .arg(&r32)
                .arg(&l32)
                .arg(&ns)
                .arg(&c032)
                .arg(&kb32)
                .arg(&p32)
                .arg(&maxq_f);
            // SAFETY: matches search_delta_bf16_kernel(__nv_bfloat16* d, const float* w, const float* cand_scale,
            // cand_inv, cand_zero, u32 R, L, n_slots, c0, k_batch, pairs, float maxq); u16 has the size and
            // alignment of __nv_bfloat16; d holds ≥ k_batch·B·R·L, w ≥ B·R·L, the table ≥ B·R·n_slots,
            // c0 + k_batch ≤ n_slots, pairs fits u32 (check_slots).
            unsafe { lb.launch(cfg) }.map_err(driver("launch search_delta_bf16"))?;
        }
        DeltaOut::F32Ranks(d) => {
            let mut lb = stream.launch_builder(&k.delta_f32);
            lb.arg(d)
                .arg(w)
                .arg(&t.scale)
                .arg(&t.inv)
                .arg(&t.zero)
                .arg(&t.top_slot)
                .arg(&r32)
                .arg(&l32)
                .arg(&ns)
                .arg(&c032)
                .arg(&kb32)
                .arg(&p32)
                .arg(&maxq_f);
            // SAFETY: matches search_delta_f32_kernel(float* d, const float* w, const float* cand_scale,
            // cand_inv, cand_zero, const int32* top_slot, u32 R, L, n_slots, c0, k_batch, pairs, float maxq); d
            // holds ≥ k_batch·B·R·L, the lists ≥ B·R·kTop (Table::new), c0 + k_batch ≤ kTop (check_slots); the
            // kernel range-checks every listed slot against n_slots.
            unsafe { lb.launch(cfg) }.map_err(driver("launch search_delta_f32"))?;
        }
    }
    Ok(())
}

/// v2: folds the approximate scores Σ P·D of slots c0..c0 + k_batch into every row's list of SEARCH_TOP best.
#[allow(clippy::too_many_arguments)]
pub fn launch_search_approx(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    t: &mut Table,
    p: &CudaSlice<f32>,
    d: &CudaSlice<u16>,
    b: Batch,
    c0: usize,
    k_batch: usize,
) -> Result<(), CudaError> {
    let elems = b.rows() * b.l;
    check_slots(
        "search_approx",
        b,
        t,
        elems,
        &[p.len(), d.len()],
        c0,
        k_batch,
        t.n_slots,
    )?;
    if k_batch == 0 {
        return Ok(());
    }
    let _r = range(c"search_approx");
    let (rows, r32, l32, _, _, _) = b.u32s();
    let (ns, c032, kb32) = (t.n_slots as u32, c0 as u32, k_batch as u32);
    let mut lb = stream.launch_builder(&k.approx);
    lb.arg(&mut t.top_score)
        .arg(&mut t.top_slot)
        .arg(p)
        .arg(d)
        .arg(&t.zero)
        .arg(&rows)
        .arg(&r32)
        .arg(&l32)
        .arg(&ns)
        .arg(&c032)
        .arg(&kb32);
    // SAFETY: matches search_approx_kernel(float* top_score, int32* top_slot, const float* p, const
    // __nv_bfloat16* d, const float* cand_zero, u32 rows, R, L, n_slots, c0, k_batch); the lists hold
    // ≥ B·R·kTop, p and d ≥ k_batch·B·R·L, the table ≥ B·R·n_slots (check_slots); the grid covers every row.
    unsafe { lb.launch(warp_per_row_cfg(b.rows())) }.map_err(driver("launch search_approx"))?;
    Ok(())
}

/// v2: folds the exact scores Σ P·D of list ranks c0..c0 + k_batch into every row's best (score, slot).
#[allow(clippy::too_many_arguments)]
pub fn launch_search_rescore(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    t: &mut Table,
    p: &CudaSlice<f32>,
    d: &CudaSlice<f32>,
    b: Batch,
    c0: usize,
    k_batch: usize,
) -> Result<(), CudaError> {
    let elems = b.rows() * b.l;
    check_slots(
        "search_rescore",
        b,
        t,
        elems,
        &[p.len(), d.len()],
        c0,
        k_batch,
        SEARCH_TOP,
    )?;
    if k_batch == 0 {
        return Ok(());
    }
    let _r = range(c"search_rescore");
    let (rows, r32, l32, _, _, _) = b.u32s();
    let (c032, kb32) = (c0 as u32, k_batch as u32);
    let mut lb = stream.launch_builder(&k.rescore);
    lb.arg(&mut t.best_score)
        .arg(&mut t.best_slot)
        .arg(p)
        .arg(d)
        .arg(&t.top_slot)
        .arg(&rows)
        .arg(&r32)
        .arg(&l32)
        .arg(&c032)
        .arg(&kb32);
    // SAFETY: matches search_rescore_kernel(double* best_score, int32* best_slot, const float* p, const float*
    // d, const int32* top_slot, u32 rows, R, L, c0, k_batch); every buffer holds what the kernel indexes
    // (check_slots); the grid covers every row.
    unsafe { lb.launch(warp_per_row_cfg(b.rows())) }.map_err(driver("launch search_rescore"))?;
    Ok(())
}

/// Checks the grids [parts·R × ng] a batch writes into.
fn check_grids(
    op: &'static str,
    b: Batch,
    scale: &CudaSlice<f32>,
    zero: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    b.check(op)?;
    let need = b.parts * b.r * b.ng;
    if scale.len() < need || zero.len() < need {
        return Err(shape(
            op,
            format!(
                "grids scale.len={} zero.len={} < {need} for {b:?}",
                scale.len(),
                zero.len()
            ),
        ));
    }
    Ok(())
}

/// The best slot of every row of the batch → its (scale, zero) in the grids (columns k0..k0 + gc).
pub fn launch_search_write_grids(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    scale: &mut CudaSlice<f32>,
    zero: &mut CudaSlice<f32>,
    t: &Table,
    b: Batch,
) -> Result<(), CudaError> {
    check_grids("search_write_grids", b, scale, zero)?;
    if t.rows < b.rows() || t.n_slots > i32::MAX as usize {
        return Err(shape(
            "search_write_grids",
            format!("table of {} rows for {b:?}", t.rows),
        ));
    }
    let _r = range(c"search_write_grids");
    let (rows, r32, _, gc32, k032, ng32) = b.u32s();
    let ns = t.n_slots as u32;
    let cfg = LaunchConfig {
        grid_dim: (
            b.rows()
                .div_ceil(SEARCH_THREADS as usize)
                .clamp(1, MAX_CTAS) as u32,
            1,
            1,
        ),
        block_dim: (SEARCH_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut lb = stream.launch_builder(&k.write_grids);
    lb.arg(scale)
        .arg(zero)
        .arg(&t.scale)
        .arg(&t.zero)
        .arg(&t.best_slot)
        .arg(&rows)
        .arg(&r32)
        .arg(&ns)
        .arg(&gc32)
        .arg(&k032)
        .arg(&ng32);
    // SAFETY: matches search_write_grids_kernel(float* scale_out, float* zero_out, const float* cand_scale,
    // const float* cand_zero, const int32* best_slot, u32 rows, R, n_slots, gc, k0, ng); the grids hold
    // ≥ parts·R·ng and every row t writes (p·R + r)·ng + k0 + kk < parts·R·ng (k0 + gc ≤ ng), the table
    // ≥ B·R rows; the kernel range-checks each slot.
    unsafe { lb.launch(cfg) }.map_err(driver("launch search_write_grids"))?;
    Ok(())
}

/// MinMax or Mse: the grids of every row of the batch's gathered W [B·R × L], written straight into the grids.
pub fn launch_search_plain(
    stream: &Arc<CudaStream>,
    k: &SearchKernels,
    scale: &mut CudaSlice<f32>,
    zero: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    b: Batch,
    spec: &QuantSpec,
) -> Result<(), CudaError> {
    let op = match spec.search {
        ScaleSearch::MinMax => "search_minmax",
        ScaleSearch::Mse => "search_mse",
        ScaleSearch::Hessian => {
            return Err(shape(
                "search_plain",
                "the Hessian search is search_batch's".into(),
            ));
        }
    };
    check_grids(op, b, scale, zero)?;
    if w.len() < b.rows() * b.l {
        return Err(shape(op, format!("w.len={} for {b:?}", w.len())));
    }
    let (rows, r32, l32, gc32, k032, ng32) = b.u32s();
    let (maxq, sym) = (spec.maxq() as f32, spec.sym as u32);
    let cfg = warp_stride_cfg(b.rows());
    if spec.search == ScaleSearch::MinMax {
        let _r = range(c"search_minmax");
        let mut lb = stream.launch_builder(&k.minmax);
        lb.arg(scale)
            .arg(zero)
            .arg(w)
            .arg(&rows)
            .arg(&r32)
            .arg(&l32)
            .arg(&gc32)
            .arg(&k032)
            .arg(&ng32)
            .arg(&maxq)
            .arg(&sym);
        // SAFETY: matches search_minmax_kernel(float* scale_out, float* zero_out, const float* w, u32 rows, R,
        // L, gc, k0, ng, float maxq, u32 sym); w holds ≥ B·R·L, the grids ≥ parts·R·ng with k0 + gc ≤ ng
        // (check_grids).
        unsafe { lb.launch(cfg) }.map_err(driver("launch search_minmax"))?;
    } else {
        let _r = range(c"search_mse");
        let norm = MSE_NORM;
        let mut lb = stream.launch_builder(&k.mse);
        lb.arg(scale)
            .arg(zero)
            .arg(w)
            .arg(&rows)
            .arg(&r32)
            .arg(&l32)
            .arg(&gc32)
            .arg(&k032)
            .arg(&ng32)
            .arg(&maxq)
            .arg(&sym)
            .arg(&norm);
        // SAFETY: matches search_mse_kernel(float* scale_out, float* zero_out, const float* w, u32 rows, R, L,
        // gc, k0, ng, float maxq, u32 sym, double norm); as search_minmax.
        unsafe { lb.launch(cfg) }.map_err(driver("launch search_mse"))?;
    }
    Ok(())
}

// ---- orchestration -----------------------------------------------------------------------------------------

/// Checks that `idx[x]` indexes n columns (every entry < n), for the matrices `xs` a call reads.
fn check_idx(idx: &[Vec<usize>], xs: &[usize], n: usize) -> Result<(), CudaError> {
    for &x in xs {
        match idx.get(x) {
            Some(ix) if ix.len() == n && ix.iter().all(|&i| i < n) => {}
            Some(ix) => {
                return Err(shape(
                    "search_grids",
                    format!(
                        "index {x} has {} entries (max {:?}) for {n} columns",
                        ix.len(),
                        ix.iter().max()
                    ),
                ));
            }
            None => {
                return Err(shape(
                    "search_grids",
                    format!("no index for matrix {x} ({} given)", idx.len()),
                ));
            }
        }
    }
    Ok(())
}

/// Groups per chunk of a call: as many as keep rows·gcc·n_slots ≤ TABLE_ELEMS, at least 1.
fn chunk_groups(rows: usize, n_slots: usize, gc: usize) -> usize {
    (TABLE_ELEMS / (rows * n_slots).max(1)).clamp(1, gc.max(1))
}

impl CudaBackend {
    /// Device scratch of the Hessian search for batches of up to `rows` rows of `l` columns.
    pub(super) fn search_scratch(
        &self,
        variant: SearchVariant,
        rows: usize,
        l: usize,
        spec: &QuantSpec,
    ) -> Result<SearchScratch, CudaError> {
        let n_slots = SHRINK_STEPS * candidate_slots(spec);
        let k_max = batch_slots(rows, l, n_slots);
        let k_re = batch_slots(rows, l, SEARCH_TOP);
        let elems = rows * l;
        // SAFETY (every `alloc` here): search_candidates_kernel writes the bests and lists of every row it
        // reads later, and the batch kernels write each D, V, P element before a kernel or GEMM reads it;
        // the f32 buffers are poisoned (NaN) when the backend poisons outputs.
        let alloc = |n: usize, what: &'static str| -> Result<CudaSlice<f64>, CudaError> {
            unsafe { self.stream.alloc::<f64>(n.max(1)) }.map_err(driver(what))
        };
        let alloc_i = |n: usize, what: &'static str| -> Result<CudaSlice<i32>, CudaError> {
            unsafe { self.stream.alloc::<i32>(n.max(1)) }.map_err(driver(what))
        };
        let table = Table {
            rows,
            n_slots,
            scale: self.output((rows * n_slots).max(1))?,
            inv: self.output((rows * n_slots).max(1))?,
            zero: self.output((rows * n_slots).max(1))?,
            best_score: alloc(rows, "alloc best scores")?,
            best_slot: alloc_i(rows, "alloc best slots")?,
            top_score: self.output((rows * SEARCH_TOP).max(1))?,
            top_slot: alloc_i(rows * SEARCH_TOP, "alloc approximate best slots")?,
        };
        let (hw, v, d_bf, p) = match variant {
            SearchVariant::F32 => (
                self.output(elems.max(1))?,
                self.output((k_max * elems).max(1))?,
                // SAFETY: unused by v1 (a 1-element placeholder).
                unsafe { self.stream.alloc::<u16>(1) }.map_err(driver("alloc placeholder"))?,
                self.output((k_max * elems).max(1))?,
            ),
            SearchVariant::Bf16Rescore => (
                self.output(1)?,
                // v2's f32 D of the re-scored ranks.
                self.output((k_re * elems).max(1))?,
                unsafe { self.stream.alloc::<u16>((k_max * elems).max(1)) }
                    .map_err(driver("alloc bf16 D"))?,
                self.output((k_max.max(k_re) * elems).max(1))?,
            ),
        };
        Ok(SearchScratch {
            variant,
            rows,
            l,
            k_max,
            k_re,
            table,
            hw,
            v,
            d_bf,
            p,
        })
    }

    /// Searches one batch of problems: W [B·R × L] gathered, H blocks [B × L × L] (Hessian search), grids
    /// written into columns k0..k0 + gc of `scale` / `zero` [parts·R × ng]. Only launches: nothing is copied
    /// to or from the host, nothing waited for.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn search_batch(
        &self,
        spec: &QuantSpec,
        w: &CudaSlice<f32>,
        h: Option<&HBlocks>,
        b: Batch,
        scratch: Option<&mut SearchScratch>,
        scale: &mut CudaSlice<f32>,
        zero: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let k = &self.quant.search;
        if spec.search != ScaleSearch::Hessian {
            return launch_search_plain(&self.stream, k, scale, zero, w, b, spec);
        }
        let (Some(h), Some(s)) = (h, scratch) else {
            return Err(shape(
                "search_grids",
                "the Hessian search needs H blocks and scratch".into(),
            ));
        };
        b.check("search_grids")?;
        if b.rows() > s.rows || b.l > s.l || s.rows * s.l < b.rows() * b.l {
            return Err(shape(
                "search_grids",
                format!("scratch for {} rows × {} columns, {b:?}", s.rows, s.l),
            ));
        }
        let blas = self.blas().map_err(|why| {
            shape(
                "search_grids",
                format!("the Hessian search needs cuBLAS: {why}"),
            )
        })?;
        let maxq = spec.maxq();
        launch_search_candidates(&self.stream, k, &mut s.table, w, b.rows(), b.l, spec)?;
        let (problems, r, l) = (b.problems(), b.r, b.l);
        let n_slots = s.table.n_slots;
        match s.variant {
            SearchVariant::F32 => {
                blas.rows_times_h_batched(
                    &mut s.hw,
                    BatchedOperands::F32 {
                        a: &w.slice(..),
                        h: &h.f32,
                    },
                    r,
                    l,
                    problems,
                )?;
                for (c0, kb) in batches(n_slots, s.k_max) {
                    launch_search_v(&self.stream, k, &mut s.v, w, &s.table, b, c0, kb, maxq)?;
                    blas.rows_times_h_batched(
                        &mut s.p,
                        BatchedOperands::F32 {
                            a: &s.v.slice(..),
                            h: &h.f32,
                        },
                        kb * r,
                        l,
                        problems,
                    )?;
                    launch_search_score(
                        &self.stream,
                        k,
                        &mut s.table,
                        &s.p,
                        &s.v,
                        &s.hw,
                        b,
                        c0,
                        kb,
                    )?;
                }
            }
            SearchVariant::Bf16Rescore => {
                let h_bf = h
                    .bf16
                    .as_ref()
                    .ok_or_else(|| shape("search_grids", "v2 needs the bf16 H blocks".into()))?;
                for (c0, kb) in batches(n_slots, s.k_max) {
                    launch_search_delta(
                        &self.stream,
                        k,
                        DeltaOut::Bf16(&mut s.d_bf),
                        w,
                        &s.table,
                        b,
                        c0,
                        kb,
                        maxq,
                    )?;
                    blas.rows_times_h_batched(
                        &mut s.p,
                        BatchedOperands::Bf16 {
                            a: &s.d_bf.slice(..),
                            h: h_bf,
                        },
                        kb * r,
                        l,
                        problems,
                    )?;
                    launch_search_approx(&self.stream, k, &mut s.table, &s.p, &s.d_bf, b, c0, kb)?;
                }
                for (c0, kb) in batches(SEARCH_TOP, s.k_re) {
                    launch_search_delta(
                        &self.stream,
                        k,
                        DeltaOut::F32Ranks(&mut s.v),
                        w,
                        &s.table,
                        b,
                        c0,
                        kb,
                        maxq,
                    )?;
                    blas.rows_times_h_batched(
                        &mut s.p,
                        BatchedOperands::F32 {
                            a: &s.v.slice(..),
                            h: &h.f32,
                        },
                        kb * r,
                        l,
                        problems,
                    )?;
                    launch_search_rescore(&self.stream, k, &mut s.table, &s.p, &s.v, b, c0, kb)?;
                }
            }
        }
        launch_search_write_grids(&self.stream, k, scale, zero, &s.table, b)
    }

    /// `QuantOps::search_grids` on device buffers: W [rows × n], H [h_batch × n × n] (Hessian search), groups
    /// of g columns, part p's rows scored with H_{h_of_part[p]} read through idx[h_of_part[p]]; returns the
    /// grids (scale, zero) [rows × n_groups], in device memory. Uploads idx (O(n) per matrix used) and the
    /// parts' matrix numbers; downloads nothing, never synchronizes.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn search_grids_device(
        &self,
        variant: SearchVariant,
        w: &CudaSlice<f32>,
        rows: usize,
        n: usize,
        h: Option<(&CudaSlice<f32>, usize)>,
        idx: &[Vec<usize>],
        h_of_part: &[usize],
        g: usize,
        spec: &QuantSpec,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), CudaError> {
        let parts = h_of_part.len();
        if g == 0
            || rows == 0
            || n == 0
            || parts == 0
            || !rows.is_multiple_of(parts)
            || w.len() != rows * n
            || spec.validate().is_err()
        {
            return Err(shape(
                "search_grids",
                format!(
                    "W [{rows} × {n}] (w.len={}) in {parts} parts, groups of {g}, {spec:?}",
                    w.len()
                ),
            ));
        }
        let _r = range(c"search_grids");
        let ng = n.div_ceil(g);
        let n_full = n / g;
        let last = n - n_full * g;
        let mut scale = self.output(rows * ng)?;
        let mut zero = self.output(rows * ng)?;
        let hessian = spec.search == ScaleSearch::Hessian;
        // Parts that share one H are one part of all rows (the search of a row reads only its own H block).
        let shared = h_of_part.iter().all(|&f| f == h_of_part[0]);
        let parts_eff = if shared || !hessian { 1 } else { parts };
        let r = rows / parts_eff;
        // The Hessian inputs: H, the distinct matrices' indices uploaded once, each part's (matrix, index row).
        let hin = match (hessian, h) {
            (false, _) => None,
            (true, None) => {
                return Err(shape("search_grids", "the Hessian search needs H".into()));
            }
            (true, Some((hd, h_batch))) => {
                let f_of: Vec<usize> = h_of_part[..parts_eff].to_vec();
                let mut distinct: Vec<usize> = f_of.clone();
                distinct.sort_unstable();
                distinct.dedup();
                if hd.len() != h_batch * n * n || distinct.iter().any(|&f| f >= h_batch) {
                    return Err(shape(
                        "search_grids",
                        format!(
                            "H h.len={} ({h_batch} matrices) for n={n}, parts' matrices {h_of_part:?}",
                            hd.len()
                        ),
                    ));
                }
                check_idx(idx, &distinct, n)?;
                let x_of: Vec<u32> = f_of
                    .iter()
                    .map(|f| distinct.iter().position(|d| d == f).unwrap_or(0) as u32)
                    .collect();
                let f32_of: Vec<u32> = f_of.iter().map(|&f| f as u32).collect();
                let ix: Vec<u32> = distinct
                    .iter()
                    .flat_map(|&f| idx[f].iter().map(|&i| i as u32))
                    .collect();
                let identity = distinct.len() == 1
                    && idx[distinct[0]].iter().enumerate().all(|(a, &i)| a == i);
                Some(HInputs {
                    h: hd,
                    h_batch,
                    idx: self.upload(&ix, "upload search indices")?,
                    n_idx: distinct.len(),
                    f_dev: self.upload(&f32_of, "upload search matrices")?,
                    x_dev: self.upload(&x_of, "upload search index rows")?,
                    f_of: f32_of,
                    x_of,
                    identity,
                })
            }
        };
        let n_slots = SHRINK_STEPS * candidate_slots(spec);
        let gcc = chunk_groups(rows, n_slots, n_full);
        // The chunks (k0, gc, L): full groups gcc at a time, then the partial group.
        let mut chunks: Vec<(usize, usize, usize)> = (0..n_full)
            .step_by(gcc.max(1))
            .map(|k0| (k0, gcc.min(n_full - k0), g))
            .collect();
        if last > 0 {
            chunks.push((n_full, 1, last));
        }
        let mut scratch = match hessian {
            true => {
                Some(self.search_scratch(variant, rows * gcc.min(n_full.max(1)), g.min(n), spec)?)
            }
            false => None,
        };
        for (k0, gc, l) in chunks {
            let b = Batch {
                parts: parts_eff,
                gc,
                r,
                l,
                k0,
                ng,
            };
            // One group of all columns (per channel) in one part needs no gather.
            let whole = gc == 1 && l == n && parts_eff == 1;
            let gathered = match whole {
                true => None,
                false => {
                    let mut out = self.output(b.rows() * l)?;
                    launch_search_gather_w(&self.stream, &self.quant.search, &mut out, w, n, g, b)?;
                    Some(out)
                }
            };
            let wb = gathered.as_ref().unwrap_or(w);
            let hb = match &hin {
                None => None,
                Some(hi) if whole && hi.identity && hi.h_batch == 1 => {
                    Some(self.h_blocks(HOwned::Borrowed(hi.h), variant)?)
                }
                Some(hi) => {
                    let mut out = self.output(b.problems() * l * l)?;
                    launch_search_gather_h(
                        &self.stream,
                        &self.quant.search,
                        &mut out,
                        hi.h,
                        hi.h_batch,
                        &hi.idx,
                        hi.n_idx,
                        (&hi.f_of, &hi.x_of),
                        (&hi.f_dev, &hi.x_dev),
                        n,
                        g,
                        b,
                    )?;
                    Some(self.h_blocks(HOwned::Owned(out), variant)?)
                }
            };
            let views = hb.as_ref().map(|o| o.views());
            self.search_batch(
                spec,
                wb,
                views.as_ref(),
                b,
                scratch.as_mut(),
                &mut scale,
                &mut zero,
            )?;
        }
        Ok((scale, zero))
    }

    /// H blocks with their bf16 copy when the variant scores in bf16.
    fn h_blocks<'a>(
        &self,
        h: HOwned<'a>,
        variant: SearchVariant,
    ) -> Result<OwnedBlocks<'a>, CudaError> {
        let bf16 = match variant {
            SearchVariant::F32 => None,
            SearchVariant::Bf16Rescore => {
                let src = h.slice();
                // SAFETY: launch_f32_to_bf16 writes all of it before any GEMM reads it.
                let mut out = unsafe { self.stream.alloc::<u16>(src.len()) }
                    .map_err(driver("alloc bf16 H"))?;
                ops::launch_f32_to_bf16(&self.stream, &self.ops, &mut out, src)?;
                Some(out)
            }
        };
        Ok(OwnedBlocks { f32: h, bf16 })
    }
}

/// The Hessian inputs of one `search_grids_device` call.
struct HInputs<'a> {
    h: &'a CudaSlice<f32>,
    h_batch: usize,
    idx: CudaSlice<u32>,
    n_idx: usize,
    f_dev: CudaSlice<u32>,
    x_dev: CudaSlice<u32>,
    f_of: Vec<u32>,
    x_of: Vec<u32>,
    /// One matrix, read in its own order: per channel it is its own H block.
    identity: bool,
}

/// H blocks a call owns (gathered) or borrows (the caller's H when it is the block itself).
enum HOwned<'a> {
    Owned(CudaSlice<f32>),
    Borrowed(&'a CudaSlice<f32>),
}

impl HOwned<'_> {
    fn slice(&self) -> &CudaSlice<f32> {
        match self {
            HOwned::Owned(s) => s,
            HOwned::Borrowed(s) => s,
        }
    }
}

struct OwnedBlocks<'a> {
    f32: HOwned<'a>,
    bf16: Option<CudaSlice<u16>>,
}

impl OwnedBlocks<'_> {
    fn views(&self) -> HBlocks<'_> {
        HBlocks {
            f32: self.f32.slice().slice(..),
            bf16: self.bf16.as_ref().map(|b| b.slice(..)),
        }
    }
}

/// The dynamic-group searches of one GPTQ sweep (`GridMode::Dynamic`): built once before the sweep (the
/// diagonal H blocks of every group gathered from the sweep-order H, with their bf16 copy; the scratch of
/// one group), then `group` searches each group's current weights with launches alone.
pub struct DynamicSearch<'a> {
    backend: &'a CudaBackend,
    spec: &'a QuantSpec,
    rows: usize,
    n: usize,
    g: usize,
    /// The full groups' blocks [n_full × g × g] and the partial group's [1 × last × last].
    full: Option<OwnedBlocks<'static>>,
    partial: Option<OwnedBlocks<'static>>,
    scratch: Option<SearchScratch>,
}

impl CudaBackend {
    /// The dynamic searches of a sweep of W [rows × n] in groups of g, scored with the diagonal blocks of `h`
    /// [n × n] (sweep order; read only for the Hessian search). Uploads the identity index once (n u32).
    pub(super) fn group_search<'a>(
        &'a self,
        variant: SearchVariant,
        h: Option<&CudaSlice<f32>>,
        rows: usize,
        n: usize,
        g: usize,
        spec: &'a QuantSpec,
    ) -> Result<DynamicSearch<'a>, CudaError> {
        if g == 0 || rows == 0 || n == 0 || spec.validate().is_err() {
            return Err(shape(
                "gptq_sweep_dynamic search",
                format!("W [{rows} × {n}], groups of {g}, {spec:?}"),
            ));
        }
        let g = g.min(n);
        let (ng, n_full) = (n.div_ceil(g), n / g);
        let last = n - n_full * g;
        let mut gs = DynamicSearch {
            backend: self,
            spec,
            rows,
            n,
            g,
            full: None,
            partial: None,
            scratch: None,
        };
        if spec.search != ScaleSearch::Hessian {
            return Ok(gs);
        }
        let h = h.ok_or_else(|| {
            shape(
                "gptq_sweep_dynamic search",
                "the Hessian search needs H".into(),
            )
        })?;
        if h.len() != n * n {
            return Err(shape(
                "gptq_sweep_dynamic search",
                format!("H h.len={} for n={n}", h.len()),
            ));
        }
        let id: Vec<u32> = (0..n as u32).collect();
        let idx = self.upload(&id, "upload search indices")?;
        let zero_u32 = self.upload(&[0u32], "upload search matrix")?;
        let gather = |k0: usize, gc: usize, l: usize| -> Result<OwnedBlocks<'static>, CudaError> {
            let b = Batch {
                parts: 1,
                gc,
                r: rows,
                l,
                k0,
                ng,
            };
            let mut out = self.output(gc * l * l)?;
            launch_search_gather_h(
                &self.stream,
                &self.quant.search,
                &mut out,
                h,
                1,
                &idx,
                1,
                (&[0u32][..], &[0u32][..]),
                (&zero_u32, &zero_u32),
                n,
                g,
                b,
            )?;
            self.h_blocks(HOwned::Owned(out), variant)
        };
        if n_full > 0 {
            gs.full = Some(gather(0, n_full, g)?);
        }
        if last > 0 {
            gs.partial = Some(gather(n_full, 1, last)?);
        }
        gs.scratch = Some(self.search_scratch(variant, rows, g, spec)?);
        Ok(gs)
    }
}

impl DynamicSearch<'_> {
    /// Writes column k of the grids [rows × n_groups] from the group's current weights `cols` [rows × len]
    /// (at the front of the buffer). Launches only: no transfer, no synchronization, no allocation.
    pub fn group(
        &mut self,
        k: usize,
        cols: &CudaSlice<f32>,
        len: usize,
        scale: &mut CudaSlice<f32>,
        zero: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (g, n) = (self.g, self.n);
        let ng = n.div_ceil(g);
        let n_full = n / g;
        if k >= ng || len != g.min(n - k * g) {
            return Err(shape(
                "gptq_sweep_dynamic search",
                format!("group {k} of {len} columns for n={n}, g={g}"),
            ));
        }
        let b = Batch {
            parts: 1,
            gc: 1,
            r: self.rows,
            l: len,
            k0: k,
            ng,
        };
        let views = match (k < n_full, &self.full, &self.partial) {
            _ if self.spec.search != ScaleSearch::Hessian => None,
            (true, Some(f), _) => {
                let (o, gg) = (k * g * g, g * g);
                Some(HBlocks {
                    f32: f.f32.slice().slice(o..o + gg),
                    bf16: f.bf16.as_ref().map(|b| b.slice(o..o + gg)),
                })
            }
            (false, _, Some(p)) => Some(p.views()),
            _ => {
                return Err(shape(
                    "gptq_sweep_dynamic search",
                    format!("no H blocks for group {k}"),
                ));
            }
        };
        self.backend.search_batch(
            self.spec,
            cols,
            views.as_ref(),
            b,
            self.scratch.as_mut(),
            scale,
            zero,
        )
    }
}

impl CudaBackend {
    /// The search of `QuantOps::search_grids` from host slices (one group of all n columns per row, H
    /// [n × n]) with an explicit variant, timed (`last_kernel_ms`): the benchmarks time both variants side by
    /// side with it. Uploads W and H, downloads the grids.
    pub fn try_search_grids_with(
        &self,
        variant: SearchVariant,
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Result<Vec<Grid<f32>>, CudaError> {
        let hessian = spec.search == ScaleSearch::Hessian;
        if w.len() != rows * n || (hessian && h.len() != n * n) {
            return Err(shape(
                "search_grids",
                format!(
                    "w.len={} h.len={} for rows={rows}, n={n} ({spec:?})",
                    w.len(),
                    h.len()
                ),
            ));
        }
        if rows == 0 {
            return Ok(Vec::new());
        }
        let w_d = self.upload(w, "upload W")?;
        let h_d = match hessian {
            true => Some(self.upload(h, "upload H")?),
            false => None,
        };
        let idx = [(0..n).collect::<Vec<usize>>()];
        let (scale, zero) = self.timed(|| {
            self.search_grids_device(
                variant,
                &w_d,
                rows,
                n,
                h_d.as_ref().map(|h| (h, 1)),
                &idx,
                &[0],
                n,
                spec,
            )
        })?;
        let s = self
            .stream
            .clone_dtoh(&scale)
            .map_err(driver("download scales"))?;
        let z = self
            .stream
            .clone_dtoh(&zero)
            .map_err(driver("download zeros"))?;
        self.stream.synchronize().map_err(driver("search_grids"))?;
        Ok(s.into_iter()
            .zip(z)
            .take(rows)
            .map(|(scale, zero)| Grid { scale, zero })
            .collect())
    }

    /// `try_search_grids_with` with the backend's search variant.
    pub fn try_search_grids(
        &self,
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Result<Vec<Grid<f32>>, CudaError> {
        self.try_search_grids_with(self.search_variant, w, rows, n, h, spec)
    }

    /// The device candidate table (search_candidates_kernel) of the rows of W [rows × n] from host slices: the
    /// parity tests compare it with `search_candidates` bit for bit.
    pub fn try_search_candidates(
        &self,
        w: &[f32],
        rows: usize,
        n: usize,
        spec: &QuantSpec,
    ) -> Result<CandidateTable, CudaError> {
        if w.len() != rows * n || rows == 0 || n == 0 || spec.validate().is_err() {
            return Err(shape(
                "search_candidates",
                format!("w.len={} for rows={rows}, n={n} ({spec:?})", w.len()),
            ));
        }
        let w_d = self.upload(w, "upload W")?;
        // The table alone: the smallest scratch (one column) holds it.
        let mut s = self.search_scratch(SearchVariant::F32, rows, 1, spec)?;
        launch_search_candidates(
            &self.stream,
            &self.quant.search,
            &mut s.table,
            &w_d,
            rows,
            n,
            spec,
        )?;
        let t = &s.table;
        let n_slots = t.n_slots;
        let get = |d: &CudaSlice<f32>, what: &'static str| -> Result<Vec<f32>, CudaError> {
            let mut v = self.stream.clone_dtoh(d).map_err(driver(what))?;
            v.truncate(rows * n_slots);
            Ok(v)
        };
        let (scale, inv, zero) = (
            get(&t.scale, "download candidate scales")?,
            get(&t.inv, "download candidate 1/scales")?,
            get(&t.zero, "download candidate zeros")?,
        );
        self.stream
            .synchronize()
            .map_err(driver("search_candidates"))?;
        Ok(CandidateTable {
            n_slots,
            scale,
            inv,
            zero,
        })
    }
}

#[cfg(test)]
mod tests {
    //! The device algorithm emulated on the host, step by step as the kernels and SGEMMs compute it (candidate
    //! table, batches, V, P = V·H in f32, f64 scores, strict-less running best in slot order), against the
    //! CPU search: without a GPU or the emulator this is what checks the GEMM formulation and the batching the
    //! launches use (one problem, B = 1); tests/parity_search.rs tests the kernels themselves.
    use super::super::gemm::rows_times_h_config;
    use super::*;
    use crate::quant::quantizer::search_grids_rows;
    use cudarc::cublas::{GemmConfig, sys as blas_sys};
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// C [m × n] = A [m × n] · H [n × n] in f32 (an SGEMM; its summation order is not part of the contract).
    fn rows_times_h(a: &[f32], h: &[f32], m: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0f32; m * n];
        for r in 0..m {
            for l in 0..n {
                let x = a[r * n + l];
                for j in 0..n {
                    c[r * n + j] += x * h[l * n + j];
                }
            }
        }
        c
    }

    fn emulate(
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
        k_max: usize,
    ) -> Vec<Grid<f32>> {
        let t = candidate_table(w, rows, n, spec);
        let ns = t.n_slots;
        let maxq = spec.maxq() as f32;
        let hw = rows_times_h(w, h, rows, n);
        let mut best = vec![f64::INFINITY; rows];
        let mut slot = vec![-1i32; rows];
        for (c0, kb) in batches(ns, k_max) {
            // search_v_kernel
            let mut v = vec![0f32; kb * rows * n];
            for (e, ve) in v.iter_mut().enumerate() {
                let (j, r, k) = (e % n, (e / n) % rows, e / n / rows);
                let c = r * ns + c0 + k;
                let z = t.zero[c];
                if !z.is_nan() {
                    let mut rho = (w[r * n + j] * t.inv[c]).round_ties_even();
                    if rho.is_nan() {
                        rho = 0.0;
                    }
                    *ve = rho.max(-z).min(maxq - z);
                }
            }
            let p = rows_times_h(&v, h, kb * rows, n);
            // search_score_kernel
            for r in 0..rows {
                for k in 0..kb {
                    let c = r * ns + c0 + k;
                    if t.zero[c].is_nan() {
                        continue;
                    }
                    let row = (k * rows + r) * n;
                    let (mut a, mut b) = (0f64, 0f64);
                    for j in 0..n {
                        a += p[row + j] as f64 * v[row + j] as f64;
                        b += hw[r * n + j] as f64 * v[row + j] as f64;
                    }
                    let s = t.scale[c] as f64;
                    let score = s * s * a - 2.0 * s * b;
                    if score < best[r] {
                        best[r] = score;
                        slot[r] = (c0 + k) as i32;
                    }
                }
            }
        }
        grids_from_slots(&t, &slot)
    }

    /// f32 → bf16 → f32, round to nearest even (__float2bfloat16_rn; no NaN in these inputs).
    fn bf16(x: f32) -> f32 {
        let b = x.to_bits();
        f32::from_bits(((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16)
    }

    /// v2 as the kernels compute it: search_delta (bf16), P = D·H over bf16 operands with f32 accumulation,
    /// search_approx's list of SEARCH_TOP (strict-less bubble insert), then search_delta (f32, by rank), the
    /// SGEMM and search_rescore's (score, slot) minimum.
    fn emulate_v2(
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
        k_max: usize,
    ) -> Vec<Grid<f32>> {
        let t = candidate_table(w, rows, n, spec);
        let ns = t.n_slots;
        let maxq = spec.maxq() as f32;
        let delta = |r: usize, c: usize, j: usize| {
            let z = t.zero[r * ns + c];
            if z.is_nan() {
                return 0.0;
            }
            let x = w[r * n + j];
            let mut rho = (x * t.inv[r * ns + c]).round_ties_even();
            if rho.is_nan() {
                rho = 0.0;
            }
            t.scale[r * ns + c] * rho.max(-z).min(maxq - z) - x
        };
        let hb: Vec<f32> = h.iter().map(|&x| bf16(x)).collect();
        let mut ts = vec![f32::INFINITY; rows * SEARCH_TOP];
        let mut tc = vec![-1i32; rows * SEARCH_TOP];
        for (c0, kb) in batches(ns, k_max) {
            let mut d = vec![0f32; kb * rows * n];
            for (e, de) in d.iter_mut().enumerate() {
                let (j, r, k) = (e % n, (e / n) % rows, e / n / rows);
                *de = bf16(delta(r, c0 + k, j));
            }
            let p = rows_times_h(&d, &hb, kb * rows, n);
            for r in 0..rows {
                let (ts, tc) = (
                    &mut ts[r * SEARCH_TOP..(r + 1) * SEARCH_TOP],
                    &mut tc[r * SEARCH_TOP..(r + 1) * SEARCH_TOP],
                );
                for k in 0..kb {
                    if t.zero[r * ns + c0 + k].is_nan() {
                        continue;
                    }
                    let row = (k * rows + r) * n;
                    let mut sc: f32 = (0..n).map(|j| p[row + j] * d[row + j]).sum();
                    let mut cs = (c0 + k) as i32;
                    if sc < ts[SEARCH_TOP - 1] {
                        for i in 0..SEARCH_TOP {
                            if sc < ts[i] {
                                std::mem::swap(&mut sc, &mut ts[i]);
                                std::mem::swap(&mut cs, &mut tc[i]);
                            }
                        }
                    }
                }
            }
        }
        let mut best = vec![f64::INFINITY; rows];
        let mut slot = vec![-1i32; rows];
        for (c0, kb) in batches(SEARCH_TOP, 3) {
            let mut d = vec![0f32; kb * rows * n];
            for (e, de) in d.iter_mut().enumerate() {
                let (j, r, k) = (e % n, (e / n) % rows, e / n / rows);
                let c = tc[r * SEARCH_TOP + c0 + k];
                *de = if c >= 0 { delta(r, c as usize, j) } else { 0.0 };
            }
            let p = rows_times_h(&d, h, kb * rows, n);
            for r in 0..rows {
                for k in 0..kb {
                    let c = tc[r * SEARCH_TOP + c0 + k];
                    if c < 0 {
                        continue;
                    }
                    let row = (k * rows + r) * n;
                    let e: f64 = (0..n).map(|j| p[row + j] as f64 * d[row + j] as f64).sum();
                    if e < best[r] || (e == best[r] && c < slot[r]) {
                        best[r] = e;
                        slot[r] = c;
                    }
                }
            }
        }
        grids_from_slots(&t, &slot)
    }

    /// cuBLAS's sgemm as documented (column-major, op(A) m × k, op(B) k × n), interpreting a GemmConfig.
    fn sgemm_reference(cfg: &GemmConfig<f32>, a: &[f32], b: &[f32], c: &mut [f32]) {
        use blas_sys::cublasOperation_t::CUBLAS_OP_N;
        let (m, n, k) = (cfg.m as usize, cfg.n as usize, cfg.k as usize);
        let (lda, ldb, ldc) = (cfg.lda as usize, cfg.ldb as usize, cfg.ldc as usize);
        let op_a = |i: usize, l: usize| {
            if cfg.transa == CUBLAS_OP_N {
                a[i + l * lda]
            } else {
                a[l + i * lda]
            }
        };
        let op_b = |l: usize, j: usize| {
            if cfg.transb == CUBLAS_OP_N {
                b[l + j * ldb]
            } else {
                b[j + l * ldb]
            }
        };
        for j in 0..n {
            for i in 0..m {
                let acc: f32 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                // beta = 0: C is not read (cuBLAS docs), so a poisoned C stays harmless.
                c[i + j * ldc] = if cfg.beta == 0.0 {
                    cfg.alpha * acc
                } else {
                    cfg.alpha * acc + cfg.beta * c[i + j * ldc]
                };
            }
        }
    }

    /// The GemmConfig of rows_times_h, read the way cuBLAS reads it, computes the row-major A·H (H not
    /// symmetric, so a transposed operand would show).
    #[test]
    fn rows_times_h_config_is_the_row_major_product() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for (m, n) in [(5usize, 3usize), (1, 7), (12, 1), (9, 16)] {
            let a: Vec<f32> = (0..m * n)
                .map(|_| rng.random_range(-2i32..3) as f32)
                .collect();
            let h: Vec<f32> = (0..n * n)
                .map(|_| rng.random_range(-2i32..3) as f32)
                .collect();
            let cfg = rows_times_h_config(m, n).unwrap();
            let mut c = vec![f32::NAN; m * n];
            // rows_times_h passes H first, A second.
            sgemm_reference(&cfg, &h, &a, &mut c);
            assert_eq!(c, rows_times_h(&a, &h, m, n), "m={m} n={n}");
        }
    }

    #[test]
    fn batches_cover_every_slot_once_in_order() {
        for (ns, k) in [(100, 1), (200, 7), (200, 200), (100, 300), (1, 1)] {
            let all: Vec<usize> = batches(ns, k).flat_map(|(c0, kb)| c0..c0 + kb).collect();
            assert_eq!(all, (0..ns).collect::<Vec<_>>(), "n_slots={ns} k={k}");
        }
        assert_eq!(batch_slots(4096, 4096, 200), 8);
        assert_eq!(batch_slots(4096, 11008, 200), 2);
        assert_eq!(batch_slots(8192, 28672, 200), 1);
        assert_eq!(batch_slots(3, 5, 200), 200);
    }

    #[test]
    fn gemm_formulation_matches_the_cpu_search() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (mut differ, mut total) = (0, 0);
        for &(rows, n, bits, sym, k_max) in &[
            (40usize, 33usize, 3u32, false, 1usize),
            (25, 64, 4, true, 7),
            (30, 20, 2, false, 200),
            (3, 1, 3, false, 13),
        ] {
            // H = XᵀX/m + 0.1·I (SPD).
            let m = 2 * n;
            let x: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let mut h = vec![0f32; n * n];
            for i in 0..n {
                for j in 0..n {
                    h[i * n + j] =
                        (0..m).map(|t| x[t * n + i] * x[t * n + j]).sum::<f32>() / m as f32;
                }
                h[i * n + i] += 0.1;
            }
            let mut w: Vec<f32> = (0..rows * n)
                .map(|i| rng.random_range(-1.0f32..1.0) * (1.0 + (i / n % 5) as f32) + 0.2)
                .collect();
            w[..n].fill(0.0); // the ±1 range of an all-zero row
            let spec = QuantSpec::new(bits, None, sym, ScaleSearch::Hessian);
            let cpu = search_grids_rows(&w, rows, n, 0, n, Some(&h), &spec);
            for (v, dev) in [
                ("v1", emulate(&w, rows, n, &h, &spec, k_max)),
                ("v2", emulate_v2(&w, rows, n, &h, &spec, k_max)),
            ] {
                for (r, (a, b)) in cpu.iter().zip(&dev).enumerate() {
                    total += 1;
                    if a != b {
                        differ += 1;
                        eprintln!(
                            "{v} rows={rows} n={n} b={bits} sym={sym} row {r}: cpu {a:?} emulated {b:?}"
                        );
                    }
                }
            }
        }
        // Same candidates, same strict-less order; only f32 summation order (v1) or the exact re-score's
        // direct Δ H Δᵀ (v2) differs from the CPU's score (near-ties).
        assert!(differ * 50 <= total, "{differ} of {total} grids differ");
    }
}
