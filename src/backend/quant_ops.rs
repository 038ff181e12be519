//! `QuantOps`: the quantization core a backend provides (design.md §5): Hessian statistics, the batched
//! U = chol(H⁻¹)ᵀ, and the GPTQ / BoA sweeps. Split from the forward ops of `Backend` so the two grow apart;
//! every `Backend` is also `QuantOps`.
//!
//! Like the rest of the backend layer: f32 row-major host slices in, plain values out; the CPU implementation
//! (`cpu_quant.rs`) calls the algorithm free functions of `quant::` and is the oracle of the CUDA kernels.
//! Statistics are raw sums (no 2/N): the accumulators in `quant::hessian` own the scaling and the f64 totals.

use crate::quant::gptq::DynamicGroups;
use crate::quant::quantizer::{Grid, QuantSpec, ScaleSearch, search_grids_rows};

/// Shapes of the attention statistics of one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Tokens of the sequence.
    pub t: usize,
    /// Query heads.
    pub h: usize,
    /// Key/value heads (h is a multiple; query head i reads KV head i / (h / h_kv)).
    pub h_kv: usize,
    /// Head dimension.
    pub d_h: usize,
    /// Block input width (hidden size).
    pub d: usize,
}

/// Static quantization grids of a sweep: (scale, zero) of (row, group), fixed before the sweep.
#[derive(Clone, Copy, Debug)]
pub struct StaticGrids<'a> {
    /// [rows × n_groups].
    pub grids: &'a [Grid<f32>],
    pub n_groups: usize,
    /// [n]: the group of each sweep column.
    pub col_group: &'a [u32],
}

/// U_col of a BoA sweep.
#[derive(Clone, Copy, Debug)]
pub enum UCol<'a> {
    /// One [n × n] for every head (W_Q, W_K).
    Shared(&'a [f32]),
    /// [n_heads × n × n] (W_V).
    PerHead(&'a [f32]),
}

/// What a sweep returns: Q (dequantized) and the integer codes, both [rows × n] in sweep order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SweepResult {
    pub q: Vec<f32>,
    pub codes: Vec<u8>,
}

pub trait QuantOps {
    /// Whether the pipeline should compute the calibration statistics through this trait (device backends)
    /// instead of the accumulators' own f64-chunked CPU path, which the CPU backend keeps bit for bit.
    fn accelerates_statistics(&self) -> bool {
        false
    }

    /// Whether the quantizer should factor U and run static-grid sweeps through this trait (device backends)
    /// instead of `quant::`'s own generic code, the oracle, which the CPU backend keeps (f64 factors).
    fn accelerates_quantization(&self) -> bool {
        false
    }

    /// H [d × d] += Xᵀ X over the m tokens of X [m × d] (one token per row); H stays symmetric.
    fn xxt_accumulate(&self, h: &mut [f32], x: &[f32], m: usize, d: usize);

    /// Per-head Σ_t x_{t,h} x_{t,h}ᵀ of post-RoPE queries or keys X [m × n_heads·d_h] →
    /// [n_heads × d_h × d_h].
    fn head_covariance(&self, x: &[f32], m: usize, n_heads: usize, d_h: usize) -> Vec<f32>;

    /// W_V's column statistics of one sequence, per QUERY head h: (A_h X)ᵀ (A_h X) [h × d × d], with
    /// A_h = causal softmax(Q_h K_hᵀ / √d_h). X [t × d], Q [t × h·d_h], K [t × h_kv·d_h] (post-RoPE).
    /// (The GQA average over query heads is the caller's: `quant::hessian::VColAccumulator` semantics.)
    fn v_col_covariance(&self, x: &[f32], q: &[f32], k: &[f32], s: AttnShape) -> Vec<f32>;

    /// For each of `count` SPD matrices H_b [n × n] (stacked in `h`), U_b = chol(H_b⁻¹)ᵀ upper triangular
    /// [n × n], or None when H_b is not numerically positive definite (the caller damps and retries).
    fn cholesky_upper_inverse_batched(
        &self,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Vec<Option<Vec<f32>>>;

    /// The static grid search of design.md §4.1 for `rows` rows (or row groups) W [rows × n] (row-major,
    /// contiguous) scored with the matching diagonal block H [n × n] (f32, row-major, symmetric): per row, the
    /// candidate (scale, zero) of `quant::quantizer::search_candidates` with the smallest Δ H Δᵀ, ties to the
    /// first candidate in that order. `h` is read only for `ScaleSearch::Hessian` (it may be empty otherwise).
    ///
    /// The default is the exact CPU search, `quant::quantizer::search_grids_rows` (the oracle); a device
    /// backend may score the candidates in another summation order, so near-ties (within f32 rounding of the
    /// score) may pick a different grid of (almost) equal error.
    fn search_grids(
        &self,
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Vec<Grid<f32>> {
        assert_eq!(w.len(), rows * n, "W is not [{rows} × {n}]");
        let h = (spec.search == ScaleSearch::Hessian).then_some(h);
        search_grids_rows(w, rows, n, 0, n, h, spec)
    }

    /// The GPTQ sweep of `quant::gptq::gptq_block_sweep` with static grids: W [rows × n] and U [n × n]
    /// (upper) in sweep order, lazy batches of `block_size` columns.
    #[allow(clippy::too_many_arguments)]
    fn gptq_sweep(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult;

    /// The GPTQ sweep with dynamic group grids (`quant::gptq::gptq_block_sweep` with `groups`): the grids of
    /// group k (sweep columns [k·g, min((k+1)·g, n))) are searched from the current weights when the sweep
    /// reaches column k·g, by `quant::quantizer::search_grid` row by row. Returns the sweep and the grids
    /// [rows × n_groups].
    #[allow(clippy::too_many_arguments)]
    fn gptq_sweep_dynamic(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        groups: &DynamicGroups,
        maxq: u32,
    ) -> (SweepResult, Vec<Grid<f32>>);

    /// The head-wise BoA sweep of `quant::boa::boa_sweep` (design.md §4.3) with static per-row grids:
    /// W [n_heads × d_h × n] (sweep order), U_col shared or per head, U_row [n_heads × d_h × d_h] (upper),
    /// grids [n_heads·d_h × n_groups].
    #[allow(clippy::too_many_arguments)]
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
    ) -> SweepResult;
}
