//! Host side of cuda/ops.cu (same section order: kernel handles, then launchers). Launchers are thin
//! (style.md rule 15): check preconditions, compute grid/block, push arguments in kernel-signature order,
//! open an NVTX range, launch.

use super::CudaError;
use super::abi::RmsNormParams;
use crate::nvtx::range;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
    PushKernelArg,
};
use std::sync::Arc;

/// Stem of the .cu file these kernels come from (cuda/ops.cu).
pub const MODULE: &str = "ops";

/// RMSNorm kernel variants (cuda/ops.cu header has the launch shapes and measurements). All instantiated
/// variants are listed here, with the reason they exist (style.md rule 17).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RmsNormVariant {
    /// v1: one thread per row, a direct port of `cpu::rms_norm_row`; the baseline when v2 drifts.
    Naive = 1,
    /// v2: one warp per row, float4 loads when d % 4 == 0; the default.
    WarpPerRow = 2,
}

impl RmsNormVariant {
    pub const ALL: [RmsNormVariant; 2] = [RmsNormVariant::Naive, RmsNormVariant::WarpPerRow];

    fn kernel_name(self) -> &'static str {
        match self {
            RmsNormVariant::Naive => "rms_norm_kernel_v1",
            RmsNormVariant::WarpPerRow => "rms_norm_kernel_v2",
        }
    }
}

/// causal_attention kernel variants (cuda/ops.cu headers have the launch shapes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionVariant {
    /// v1: one thread per query row, a direct port of the CPU twin (two-pass softmax, P·V accumulated in
    /// global memory), any d_h; the baseline when v2 drifts.
    Naive = 1,
    /// v2: flash-style, one CTA per 64 queries (32 at d_h > 128), online softmax over smem key tiles,
    /// d_h ≤ 256; the default.
    Flash = 2,
}

impl AttentionVariant {
    pub const ALL: [AttentionVariant; 2] = [AttentionVariant::Naive, AttentionVariant::Flash];
}

/// v1: threads (= rows) per block. Must match kRmsNormV1Threads in cuda/ops.cu (its __launch_bounds__).
const RMS_NORM_V1_THREADS: u32 = 128;
/// v2: warps (= rows) per block. Must match kRmsNormV2Warps in cuda/ops.cu (its __launch_bounds__).
const RMS_NORM_V2_WARPS: u32 = 4;

/// Threads per block of the elementwise kernels (rope, swiglu, geglu, bias_add, f32_to_bf16, embed). Must match
/// kElementwiseThreads in cuda/ops.cu (their __launch_bounds__).
const ELEMENTWISE_THREADS: u32 = 256;
/// Most blocks an elementwise launch uses; the kernels grid-stride over the rest.
const ELEMENTWISE_MAX_BLOCKS: u64 = 65535 * 8;
/// attention_probs: warps (= query rows) per block. Must match kAttnProbsWarps in cuda/ops.cu.
const ATTN_PROBS_WARPS: u32 = 4;
/// causal_attention (flash): threads per CTA, and query rows per CTA for kD ≤ 128 and kD = 256. Must match
/// kAttnThreads / kAttnTpqNarrow and kAttnThreads / kAttnTpqWide in cuda/ops.cu.
const ATTN_THREADS: u32 = 256;
const ATTN_QUERIES: u32 = 64;
const ATTN_QUERIES_WIDE: u32 = 32;
/// causal_attention v1: threads (= query rows) per block. Must match kAttnV1Threads in cuda/ops.cu.
const ATTN_V1_THREADS: u32 = 128;
/// Largest head dim the flash causal_attention kernels take (their widest padded kD); v1 takes any.
pub const ATTN_MAX_D_H: usize = 256;

/// Function handles of cuda/ops.cu, loaded once per context.
pub struct OpsKernels {
    rms_norm_v1: CudaFunction,
    rms_norm_v2: CudaFunction,
    rope: CudaFunction,
    swiglu: CudaFunction,
    geglu: CudaFunction,
    bias_add: CudaFunction,
    f32_to_bf16: CudaFunction,
    pad_rows_bf16: CudaFunction,
    block_hadamard: CudaFunction,
    embed: CudaFunction,
    scatter_add_rows: CudaFunction,
    attention_probs: CudaFunction,
    causal_attention_v1: CudaFunction,
    causal_attention_d64: CudaFunction,
    causal_attention_d128: CudaFunction,
    causal_attention_d256: CudaFunction,
}

impl OpsKernels {
    pub fn load(module: &Arc<CudaModule>) -> Result<Self, CudaError> {
        let get = |v: RmsNormVariant| super::load_kernel(module, MODULE, v.kernel_name());
        let get_named = |kernel: &'static str| super::load_kernel(module, MODULE, kernel);
        Ok(OpsKernels {
            rms_norm_v1: get(RmsNormVariant::Naive)?,
            rms_norm_v2: get(RmsNormVariant::WarpPerRow)?,
            rope: get_named("rope_kernel")?,
            swiglu: get_named("swiglu_kernel")?,
            geglu: get_named("geglu_kernel")?,
            bias_add: get_named("bias_add_kernel")?,
            f32_to_bf16: get_named("f32_to_bf16_kernel")?,
            pad_rows_bf16: get_named("pad_rows_bf16_kernel")?,
            block_hadamard: get_named("block_hadamard_kernel")?,
            embed: get_named("embed_kernel")?,
            scatter_add_rows: get_named("scatter_add_rows_kernel")?,
            attention_probs: get_named("attention_probs_kernel")?,
            causal_attention_v1: get_named("causal_attention_kernel_v1")?,
            causal_attention_d64: get_named("causal_attention_kernel_d64")?,
            causal_attention_d128: get_named("causal_attention_kernel_d128")?,
            causal_attention_d256: get_named("causal_attention_kernel_d256")?,
        })
    }

    fn rms_norm(&self, v: RmsNormVariant) -> &CudaFunction {
        match v {
            RmsNormVariant::Naive => &self.rms_norm_v1,
            RmsNormVariant::WarpPerRow => &self.rms_norm_v2,
        }
    }
}

/// Y [rows × d] = X [rows × d] / sqrt(mean(X²) + eps) ⊙ w [d], row-major f32, on `stream` (asynchronous).
#[allow(clippy::too_many_arguments)]
pub fn launch_rms_norm(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    variant: RmsNormVariant,
    y: &mut CudaSlice<f32>,
    x: &CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    d: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let shape_err = |msg: &str| CudaError::Shape {
        op: "rms_norm",
        msg: format!(
            "{msg} (rows={rows}, d={d}, x.len={}, y.len={}, w.len={})",
            x.len(),
            y.len(),
            w.len()
        ),
    };
    if d == 0 {
        return Err(shape_err("d must be ≥ 1"));
    }
    let n = rows
        .checked_mul(d)
        .ok_or_else(|| shape_err("rows·d overflows"))?;
    if x.len() != n || y.len() != n || w.len() != d {
        return Err(shape_err("buffers do not match [rows × d] and [d]"));
    }
    let (Ok(rows32), Ok(d32)) = (u32::try_from(rows), u32::try_from(d)) else {
        return Err(shape_err("rows and d must fit in u32"));
    };
    if rows == 0 {
        return Ok(());
    }
    let (grid, block) = match variant {
        RmsNormVariant::Naive => (rows32.div_ceil(RMS_NORM_V1_THREADS), RMS_NORM_V1_THREADS),
        RmsNormVariant::WarpPerRow => (rows32.div_ceil(RMS_NORM_V2_WARPS), RMS_NORM_V2_WARPS * 32),
    };
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let p = RmsNormParams {
        rows: rows32,
        d: d32,
        eps,
    };
    let _r = range(c"rms_norm");
    let mut b = stream.launch_builder(k.rms_norm(variant));
    b.arg(y).arg(x).arg(w).arg(&p);
    // SAFETY: argument order and types match rms_norm_kernel_v{1,2}(float* y, const float* x, const float* w,
    // BoaRmsNormParams p); y and x hold rows·d f32 and w holds d f32 (checked above), and the grid covers
    // exactly ceil(rows/rows-per-block) blocks whose out-of-range threads return before touching memory.
    unsafe { b.launch(cfg) }.map_err(|e| CudaError::Driver {
        what: "launch rms_norm",
        source: e,
    })?;
    Ok(())
}

/// Grid of an elementwise launch over `n` items: one per thread, capped (the kernels grid-stride).
fn elementwise_cfg(n: u64) -> LaunchConfig {
    let blocks = n
        .div_ceil(ELEMENTWISE_THREADS as u64)
        .clamp(1, ELEMENTWISE_MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn launch_err(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { what, source }
}

/// Rotate-half RoPE in place on X [n_seq·t × n_heads·d_h] (token row r at position r % t) with cos/sin
/// [t × d_h/2] tables; see `Backend::rope`. Asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn launch_rope(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    x: &mut CudaSlice<f32>,
    cos: &CudaSlice<f32>,
    sin: &CudaSlice<f32>,
    t: usize,
    n_heads: usize,
    d_h: usize,
) -> Result<(), CudaError> {
    let shape_err = |msg: &str| CudaError::Shape {
        op: "rope",
        msg: format!(
            "{msg} (x.len={}, t={t}, n_heads={n_heads}, d_h={d_h}, cos.len={}, sin.len={})",
            x.len(),
            cos.len(),
            sin.len()
        ),
    };
    let width = n_heads
        .checked_mul(d_h)
        .ok_or_else(|| shape_err("n_heads·d_h overflows"))?;
    if t == 0 || width == 0 {
        return Err(shape_err("t, n_heads and d_h must be ≥ 1"));
    }
    if !x.len().is_multiple_of(t * width) {
        return Err(shape_err("x is not [n_seq·t × n_heads·d_h]"));
    }
    let half = d_h / 2;
    if cos.len() < t * half || sin.len() < t * half {
        return Err(shape_err("tables shorter than [t × d_h/2]"));
    }
    let rows = x.len() / width;
    let (Ok(rows32), Ok(t32), Ok(nh32), Ok(dh32)) = (
        u32::try_from(rows),
        u32::try_from(t),
        u32::try_from(n_heads),
        u32::try_from(d_h),
    ) else {
        return Err(shape_err("rows, t, n_heads and d_h must fit in u32"));
    };
    let pairs = (rows * n_heads * half) as u64;
    if pairs == 0 {
        return Ok(());
    }
    let _r = range(c"rope");
    let mut b = stream.launch_builder(&k.rope);
    b.arg(x)
        .arg(cos)
        .arg(sin)
        .arg(&rows32)
        .arg(&t32)
        .arg(&nh32)
        .arg(&dh32);
    // SAFETY: matches rope_kernel(float* x, const float* cos_tab, const float* sin_tab, uint32 rows, uint32 t,
    // uint32 n_heads, uint32 d_h); x holds rows·n_heads·d_h f32 and the tables ≥ t·(d_h/2) (checked above); the
    // kernel grid-strides over exactly rows·n_heads·(d_h/2) pairs.
    unsafe { b.launch(elementwise_cfg(pairs)) }.map_err(launch_err("launch rope"))?;
    Ok(())
}

/// Which gated activation `launch_gated` runs: silu (SwiGLU) or gelu_tanh (GeGLU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gated {
    Silu,
    GeluTanh,
}

impl Gated {
    fn name(self) -> &'static str {
        match self {
            Gated::Silu => "swiglu",
            Gated::GeluTanh => "geglu",
        }
    }
}

/// out [n] = act(gate) ⊙ up with act silu (`Backend::swiglu`) or gelu_tanh (`Backend::geglu`). Asynchronous
/// on `stream`.
pub fn launch_gated(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    act: Gated,
    out: &mut CudaSlice<f32>,
    gate: &CudaSlice<f32>,
    up: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    let n = gate.len();
    if up.len() != n || out.len() != n {
        return Err(CudaError::Shape {
            op: act.name(),
            msg: format!(
                "gate.len={n}, up.len={}, out.len={} must be equal",
                up.len(),
                out.len()
            ),
        });
    }
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let (f, _r) = match act {
        Gated::Silu => (&k.swiglu, range(c"swiglu")),
        Gated::GeluTanh => (&k.geglu, range(c"geglu")),
    };
    let mut b = stream.launch_builder(f);
    b.arg(out).arg(gate).arg(up).arg(&n64);
    // SAFETY: matches swiglu_kernel / geglu_kernel(float* out, const float* gate, const float* up, uint64 n);
    // all three hold n f32 (checked above).
    unsafe { b.launch(elementwise_cfg(n64)) }.map_err(launch_err("launch gated activation"))?;
    Ok(())
}

/// X [ids.len() × d] = rows `ids` of table [vocab × d], times `scale` (Gemma's √d; 1 is exact). Asynchronous
/// on `stream`. Every id must be < vocab (the caller checks: the kernel reads table[id] unguarded).
pub fn launch_embed(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    x: &mut CudaSlice<f32>,
    table: &CudaSlice<f32>,
    ids: &CudaSlice<u32>,
    d: usize,
    scale: f32,
) -> Result<(), CudaError> {
    let rows = ids.len();
    let (Ok(d32), Some(total)) = (u32::try_from(d), rows.checked_mul(d)) else {
        return Err(CudaError::Shape {
            op: "embed",
            msg: format!("d={d} does not fit in u32 or rows={rows}·d overflows"),
        });
    };
    if d == 0 || x.len() != total || !table.len().is_multiple_of(d) {
        return Err(CudaError::Shape {
            op: "embed",
            msg: format!(
                "x.len={} ≠ rows={rows}·d={d}, or table.len={} is not a multiple of d",
                x.len(),
                table.len()
            ),
        });
    }
    if total == 0 {
        return Ok(());
    }
    let n = total as u64;
    let _r = range(c"embed");
    let mut b = stream.launch_builder(&k.embed);
    b.arg(x).arg(table).arg(ids).arg(&n).arg(&d32).arg(&scale);
    // SAFETY: matches embed_kernel(float* x, const float* table, const uint32* ids, uint64 total, uint32 d,
    // float scale);
    // x holds rows·d f32 (checked above) and every ids[r] < table.len()/d (the caller's contract), so each
    // read table[ids[r]·d + c], c < d, is in bounds.
    unsafe { b.launch(elementwise_cfg(n)) }.map_err(launch_err("launch embed"))?;
    Ok(())
}

/// out[rows[r]] += y[r] · w[r] for each row r of y [rows.len() × d]; the caller has checked (check_scatter)
/// that rows are distinct and inside out. Asynchronous on `stream`.
pub fn launch_scatter_add_rows(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    out: &mut CudaSlice<f32>,
    y: &CudaSlice<f32>,
    rows: &CudaSlice<u32>,
    w: &CudaSlice<f32>,
    d: usize,
) -> Result<(), CudaError> {
    let n = rows.len();
    let (Ok(d32), Some(total)) = (u32::try_from(d), n.checked_mul(d)) else {
        return Err(CudaError::Shape {
            op: "scatter_add_rows",
            msg: format!("d={d} does not fit in u32 or rows={n}·d overflows"),
        });
    };
    if d == 0 || y.len() != total || w.len() != n || !out.len().is_multiple_of(d) {
        return Err(CudaError::Shape {
            op: "scatter_add_rows",
            msg: format!(
                "y.len={} ≠ rows={n}·d={d}, w.len={} ≠ rows, or out.len={} is not a multiple of d",
                y.len(),
                w.len(),
                out.len()
            ),
        });
    }
    if total == 0 {
        return Ok(());
    }
    let total = total as u64;
    let _r = range(c"scatter_add_rows");
    let mut b = stream.launch_builder(&k.scatter_add_rows);
    b.arg(out).arg(y).arg(rows).arg(w).arg(&total).arg(&d32);
    // SAFETY: matches scatter_add_rows_kernel(float* out, const float* y, const uint32* rows, const float* w,
    // uint64 total, uint32 d); y holds rows·d f32 and w rows f32 (checked above), and every rows[r] < out.len()/d
    // and distinct (the caller's contract, check_scatter), so each out[rows[r]·d + c] is in bounds and written by
    // one thread.
    unsafe { b.launch(elementwise_cfg(total)) }.map_err(launch_err("launch scatter_add_rows"))?;
    Ok(())
}

/// Y [m × n] += b [n] on every row. Asynchronous on `stream`.
pub fn launch_bias_add(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    y: &mut CudaSlice<f32>,
    bias: &CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    if n == 0 || bias.len() != n || !y.len().is_multiple_of(n) {
        return Err(CudaError::Shape {
            op: "bias_add",
            msg: format!(
                "y.len={} is not a multiple of n={n}, or bias.len={} ≠ n",
                y.len(),
                bias.len()
            ),
        });
    }
    let Ok(n32) = u32::try_from(n) else {
        return Err(CudaError::Shape {
            op: "bias_add",
            msg: format!("n={n} must fit in u32"),
        });
    };
    let total = y.len() as u64;
    if total == 0 {
        return Ok(());
    }
    let _r = range(c"bias_add");
    let mut b = stream.launch_builder(&k.bias_add);
    b.arg(y).arg(bias).arg(&total).arg(&n32);
    // SAFETY: matches bias_add_kernel(float* y, const float* b, uint64 total, uint32 n); y holds total f32, a
    // multiple of n, and b holds n f32 (checked above).
    unsafe { b.launch(elementwise_cfg(total)) }.map_err(launch_err("launch bias_add"))?;
    Ok(())
}

/// out [n] = bf16(in [n]) (round to nearest even), stored as raw u16 bit patterns. Asynchronous on `stream`.
pub fn launch_f32_to_bf16(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    out: &mut CudaSlice<u16>,
    input: &CudaSlice<f32>,
) -> Result<(), CudaError> {
    launch_f32_to_bf16_view(stream, k, &mut out.slice_mut(..), &input.slice(..))
}

/// `launch_f32_to_bf16` on views (a part of a buffer).
pub fn launch_f32_to_bf16_view(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    out: &mut CudaViewMut<u16>,
    input: &CudaView<f32>,
) -> Result<(), CudaError> {
    if out.len() != input.len() {
        return Err(CudaError::Shape {
            op: "f32_to_bf16",
            msg: format!("out.len={} ≠ in.len={}", out.len(), input.len()),
        });
    }
    let n = input.len() as u64;
    if n == 0 {
        return Ok(());
    }
    let _r = range(c"f32_to_bf16");
    let mut b = stream.launch_builder(&k.f32_to_bf16);
    b.arg(out).arg(input).arg(&n);
    // SAFETY: matches f32_to_bf16_kernel(__nv_bfloat16* out, const float* in, uint64 n); u16 has the size and
    // alignment of __nv_bfloat16; both buffers hold n elements (checked above).
    unsafe { b.launch(elementwise_cfg(n)) }.map_err(launch_err("launch f32_to_bf16"))?;
    Ok(())
}

/// The longest run `launch_block_hadamard` takes (its shared memory). Must match kHadamardMaxB in cuda/ops.cu.
pub const HADAMARD_MAX_B: usize = 8192;

/// Y = X · (I ⊗ (H_m ⊗ H_p)/√(m·p)) on every run of b = m·p values of X (cuda/ops.cu block_hadamard_kernel):
/// `hm` is H_m [m × m] (±1, row-major), p a power of two, b ≤ HADAMARD_MAX_B.
pub fn launch_block_hadamard(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    y: &mut CudaSlice<f32>,
    x: &CudaSlice<f32>,
    hm: &CudaSlice<f32>,
    m: usize,
    p: usize,
) -> Result<(), CudaError> {
    let b = m * p;
    let bad = |msg: String| CudaError::Shape {
        op: "block_hadamard",
        msg,
    };
    if b == 0 || b > HADAMARD_MAX_B || !p.is_power_of_two() || hm.len() != m * m {
        return Err(bad(format!(
            "blocks of {m} · {p} (at most {HADAMARD_MAX_B}, p a power of two), H_m of {} values",
            hm.len()
        )));
    }
    if x.len() != y.len() || !x.len().is_multiple_of(b) {
        return Err(bad(format!(
            "x.len={} y.len={} for runs of {b}",
            x.len(),
            y.len()
        )));
    }
    let runs = x.len() / b;
    if runs == 0 {
        return Ok(());
    }
    let Ok(runs) = u32::try_from(runs) else {
        return Err(bad(format!("{runs} runs overflow the grid")));
    };
    let _r = range(c"block_hadamard");
    let cfg = LaunchConfig {
        grid_dim: (runs, 1, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: (4 * b) as u32,
    };
    let (m32, p32, scale) = (m as u32, p as u32, 1.0 / (b as f32).sqrt());
    let mut l = stream.launch_builder(&k.block_hadamard);
    l.arg(y).arg(x).arg(hm).arg(&m32).arg(&p32).arg(&scale);
    // SAFETY: matches block_hadamard_kernel(float* y, const float* x, const float* hm, uint32 m, uint32 p,
    // float scale); x and y hold runs·b values, hm m² (checked above); 4·b ≤ 32 KB of shared memory.
    unsafe { l.launch(cfg) }.map_err(launch_err("launch block_hadamard"))?;
    Ok(())
}

/// Blocks per item of a `launch_pad_rows_bf16` grid at most; they grid-stride over the rest of the item.
const PAD_ROWS_MAX_BLOCKS: u64 = 4096;

/// The padded bf16 operands of many Grams (cuda/ops.cu pad_rows_bf16_kernel): item i of `table` (6 u64 each:
/// X_i's address, its row scales' address or 0, n_i, k_i, the offset of its block in `out` in elements, d_i)
/// becomes bf16(s_i[r] · X_i[r, c]) for r < n_i and zeros up to k_i rows. `widest` is the largest k_i·d_i.
///
/// # Safety
/// Every X_i must address n_i·d_i f32 values and every s_i n_i f32 values of live device memory, and the
/// blocks [off_i, off_i + k_i·d_i) must lie inside `out` and not overlap.
pub unsafe fn launch_pad_rows_bf16(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    out: &mut CudaSlice<u16>,
    table: &CudaView<u64>,
    widest: u64,
) -> Result<(), CudaError> {
    const FIELDS: usize = 6;
    let items = table.len() / FIELDS;
    if items == 0 || widest == 0 {
        return Ok(());
    }
    let Ok(items_u32) = u32::try_from(items) else {
        return Err(CudaError::Shape {
            op: "pad_rows_bf16",
            msg: format!("{items} items overflow the grid"),
        });
    };
    let _r = range(c"pad_rows_bf16");
    let blocks = widest
        .div_ceil(ELEMENTWISE_THREADS as u64)
        .clamp(1, PAD_ROWS_MAX_BLOCKS) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, items_u32, 1),
        block_dim: (ELEMENTWISE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&k.pad_rows_bf16);
    b.arg(out).arg(table);
    // SAFETY: matches pad_rows_bf16_kernel(__nv_bfloat16* out, const uint64* table); u16 has the size and
    // alignment of __nv_bfloat16; the addresses and blocks the table holds are the caller's contract.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch pad_rows_bf16"))?;
    Ok(())
}

/// Checks the attention shapes shared by both attention launchers; returns (t, h, h_kv, d_h) as u32.
fn attention_dims(
    op: &'static str,
    t: usize,
    h: usize,
    h_kv: usize,
    d_h: usize,
) -> Result<(u32, u32, u32, u32), CudaError> {
    let err = |msg: &str| CudaError::Shape {
        op,
        msg: format!("{msg} (t={t}, h={h}, h_kv={h_kv}, d_h={d_h})"),
    };
    if t == 0 || h == 0 || d_h == 0 || h_kv == 0 || !h.is_multiple_of(h_kv) {
        return Err(err("t, h, d_h must be ≥ 1 and h a multiple of h_kv ≥ 1"));
    }
    match (
        u32::try_from(t),
        u32::try_from(h),
        u32::try_from(h_kv),
        u32::try_from(d_h),
    ) {
        (Ok(a), Ok(b), Ok(c), Ok(d)) => Ok((a, b, c, d)),
        _ => Err(err("sizes must fit in u32")),
    }
}

/// P [h × t × t] = causal softmax(Q_h K_hᵀ / √d_h) of one sequence, Q [t × h·d_h], K [t × h_kv·d_h]; see
/// `Backend::attention_probs`. Asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn launch_attention_probs(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    p: &mut CudaSlice<f32>,
    q: &CudaSlice<f32>,
    key: &CudaSlice<f32>,
    t: usize,
    h: usize,
    h_kv: usize,
    d_h: usize,
) -> Result<(), CudaError> {
    let (t32, h32, h_kv32, d_h32) = attention_dims("attention_probs", t, h, h_kv, d_h)?;
    if q.len() != t * h * d_h || key.len() != t * h_kv * d_h || p.len() != h * t * t {
        return Err(CudaError::Shape {
            op: "attention_probs",
            msg: format!(
                "q.len={}, k.len={}, p.len={} do not match [t × h·d_h], [t × h_kv·d_h], [h × t × t] \
                 (t={t}, h={h}, h_kv={h_kv}, d_h={d_h})",
                q.len(),
                key.len(),
                p.len()
            ),
        });
    }
    if h32 > 65535 {
        return Err(CudaError::Shape {
            op: "attention_probs",
            msg: format!("h={h} exceeds the grid's y limit 65535"),
        });
    }
    let cfg = LaunchConfig {
        grid_dim: (t32.div_ceil(ATTN_PROBS_WARPS), h32, 1),
        block_dim: (ATTN_PROBS_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    };
    let scale = 1.0 / (d_h as f32).sqrt();
    let _r = range(c"attention_probs");
    let mut b = stream.launch_builder(&k.attention_probs);
    b.arg(p)
        .arg(q)
        .arg(key)
        .arg(&t32)
        .arg(&h32)
        .arg(&h_kv32)
        .arg(&d_h32)
        .arg(&scale);
    // SAFETY: matches attention_probs_kernel(float* p, const float* q, const float* k, uint32 t, uint32 h,
    // uint32 h_kv, uint32 d_h, float scale); buffer lengths checked above, h_kv divides h; warps with a query
    // row ≥ t return before touching memory, and every other warp writes its whole row of P.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch attention_probs"))?;
    Ok(())
}

/// O [n_seq·t × h·d_h] = causal GQA attention of Q [n_seq·t × h·d_h], K, V [n_seq·t × h_kv·d_h] (d_h ≤ 256
/// for the flash variant), each query seeing at most `window` keys, itself included (`window` ≥ t: no
/// window); see `Backend::causal_attention_t`. Asynchronous on `stream`.
#[allow(clippy::too_many_arguments)]
pub fn launch_causal_attention(
    stream: &Arc<CudaStream>,
    k: &OpsKernels,
    variant: AttentionVariant,
    o: &mut CudaSlice<f32>,
    q: &CudaSlice<f32>,
    key: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    n_seq: usize,
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
    window: usize,
) -> Result<(), CudaError> {
    let (t32, h32, h_kv32, d_h32) = attention_dims("causal_attention", t, h, h_kv, d_h)?;
    let err = |msg: String| CudaError::Shape {
        op: "causal_attention",
        msg: format!(
            "{msg} (n_seq={n_seq}, t={t}, h={h}, h_kv={h_kv}, d_h={d_h}, window={window})"
        ),
    };
    // v1 walks any head dim; only the flash kernels pad it to a fixed kD.
    if variant == AttentionVariant::Flash && d_h > ATTN_MAX_D_H {
        return Err(err(format!(
            "d_h > {ATTN_MAX_D_H} (the flash kernels' widest padded head dim)"
        )));
    }
    if window == 0 {
        return Err(err("a window must keep at least the query's own key".into()));
    }
    // Past t the window hides nothing: the kernels take t for "no window".
    let window32 = window.min(t) as u32;
    let (q_len, kv_len) = (n_seq * t * h * d_h, n_seq * t * h_kv * d_h);
    if q.len() != q_len || o.len() != q_len || key.len() != kv_len || v.len() != kv_len {
        return Err(err(format!(
            "q.len={}, o.len={}, k.len={}, v.len={} do not match [n_seq·t × h·d_h] and [n_seq·t × h_kv·d_h]",
            q.len(),
            o.len(),
            key.len(),
            v.len()
        )));
    }
    if n_seq == 0 {
        return Ok(());
    }
    let n_seq32 = match u32::try_from(n_seq) {
        Ok(n) if n <= 65535 && h32 <= 65535 => n,
        _ => {
            return Err(err(
                "n_seq and h must be ≤ 65535 (grid z and y limits)".into()
            ));
        }
    };
    let (f, rows_per_block, threads) = match variant {
        AttentionVariant::Naive => (&k.causal_attention_v1, ATTN_V1_THREADS, ATTN_V1_THREADS),
        AttentionVariant::Flash if d_h <= 64 => {
            (&k.causal_attention_d64, ATTN_QUERIES, ATTN_THREADS)
        }
        AttentionVariant::Flash if d_h <= 128 => {
            (&k.causal_attention_d128, ATTN_QUERIES, ATTN_THREADS)
        }
        AttentionVariant::Flash => (&k.causal_attention_d256, ATTN_QUERIES_WIDE, ATTN_THREADS),
    };
    let cfg = LaunchConfig {
        grid_dim: (t32.div_ceil(rows_per_block), h32, n_seq32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0, // flash: static smem, K and V tiles (16 / 32 / 32 KB); v1: none
    };
    let scale = 1.0 / (d_h as f32).sqrt();
    let _r = range(c"causal_attention");
    let mut b = stream.launch_builder(f);
    b.arg(o)
        .arg(q)
        .arg(key)
        .arg(v)
        .arg(&t32)
        .arg(&h32)
        .arg(&h_kv32)
        .arg(&d_h32)
        .arg(&window32)
        .arg(&scale);
    // SAFETY: matches causal_attention_kernel_{v1,d64,d128,d256}(float* o, const float* q, const float* k,
    // const float* v, uint32 t, uint32 h, uint32 h_kv, uint32 d_h, uint32 window, float scale); buffer lengths
    // checked above, d_h ≤ the flash kernel's kD, h_kv divides h, 1 ≤ window ≤ t; the grid covers every
    // (query rows, head, sequence) with the kernel's rows per CTA, and rows ≥ t store nothing.
    unsafe { b.launch(cfg) }.map_err(launch_err("launch causal_attention"))?;
    Ok(())
}
