//! What a quantization asks for (design.md §4.1): bits, groups, symmetry, the scale search; one grid; the
//! attention shapes of the statistics. Plain data shared by the algorithms (`quant/`) and the backends, so it
//! lives in the leaf module both import.

/// How a grid's scale and zero are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleSearch {
    /// Shrink grid scored by the Hessian-weighted error Δ H Δᵀ (default for GPTQ and BoA).
    Hessian,
    /// Shrink grid scored by Σ |Δ|^2.4.
    Mse,
    /// No search: the min-max range.
    MinMax,
}

/// What to quantize to (design.md §4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// 2, 3, 4 or 8.
    pub bits: u32,
    /// Input columns per group; None = one grid per output channel (group size −1).
    pub group_size: Option<usize>,
    pub sym: bool,
    pub search: ScaleSearch,
}

impl QuantSpec {
    pub fn new(bits: u32, group_size: Option<usize>, sym: bool, search: ScaleSearch) -> Self {
        Self {
            bits,
            group_size,
            sym,
            search,
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if ![2, 3, 4, 8].contains(&self.bits) {
            return Err(crate::input_err!(
                "unsupported bit width {} (expected 2, 3, 4 or 8)",
                self.bits
            ));
        }
        if self.group_size == Some(0) {
            return Err(crate::input_err!(
                "group size must be positive (or -1 for per channel)"
            ));
        }
        Ok(())
    }

    pub fn maxq(&self) -> u32 {
        (1u32 << self.bits) - 1
    }

    /// Group size in columns for a matrix with `d_in` inputs (d_in for per channel).
    pub fn group_len(&self, d_in: usize) -> usize {
        self.group_size.unwrap_or(d_in).min(d_in).max(1)
    }

    /// Number of groups along d_in (a trailing partial group counts).
    pub fn n_groups(&self, d_in: usize) -> usize {
        d_in.div_ceil(self.group_len(d_in))
    }
}

/// One quantization grid: ŵ = scale·(q − zero); zero is integer-valued.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Grid<T> {
    pub scale: T,
    pub zero: T,
}

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
    /// The sliding window of the layer, if its attention slides (`BlockDesc::window_at`).
    pub window: Option<usize>,
}
