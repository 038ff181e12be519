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

/// Which grids the output format can store (design.md §12 "Formats as codecs"). The scale search proposes
/// only these, so the sweep's error feedback works on the values the format decodes and nothing is
/// re-rounded at export. A leaf description: the formats (export/, model/gguf/codec.rs) name theirs, the
/// searches (quant/lattice.rs) honour it, neither knows the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lattice {
    /// Any (f32) scale and an integer zero point in 0..=maxq: ŵ = s·(q − z). The GPTQ family (the formats
    /// round the scale to f16 when they write it).
    Free,
    /// An f16 scale; an asymmetric grid has an f16 offset m instead of a zero point: ŵ = s·q − m (GGUF's
    /// Q5_0 symmetric, Q4_1 and Q5_1 asymmetric).
    F16,
    /// GGUF's K-quant super-blocks: per row, every `len` columns (a multiple of the group size) share an
    /// f16 d and, asymmetric, an f16 dmin; group j's scale is d·sc_j with an integer sc_j in 1..=sc_max, its
    /// offset dmin·m_j with an integer m_j in 0..=m_max: ŵ = (d·sc_j)·q − dmin·m_j, or (d·sc_j)·(q − z) with
    /// the symmetric zero z = 2^(b−1) and sc_j in ±1..=sc_max (the sign mirrors the levels).
    Super { len: usize, sc_max: u32, m_max: u32 },
}

/// What to quantize to (design.md §4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// 2, 3, 4 or 8 (5 and 6 too on a GGUF lattice).
    pub bits: u32,
    /// Input columns per group; None = one grid per output channel (group size −1).
    pub group_size: Option<usize>,
    pub sym: bool,
    pub search: ScaleSearch,
    /// The grids the output format can store.
    pub lattice: Lattice,
    /// A symmetric grid's scale may be negative: ŵ = s·(q − z) with s < 0 mirrors the levels −z..maxq − z,
    /// so the extra level of an even count (−8..7 at 4 bits) falls on the side the weights need. GGUF
    /// stores d signed (llama.cpp's own Q4_0 takes d = max/−8 for the value of largest magnitude); the
    /// GPTQ family's loaders are not known to accept it, so it is off there.
    pub signed: bool,
}

impl QuantSpec {
    pub fn new(bits: u32, group_size: Option<usize>, sym: bool, search: ScaleSearch) -> Self {
        Self {
            bits,
            group_size,
            sym,
            search,
            lattice: Lattice::Free,
            signed: false,
        }
    }

    /// The same quantization, its symmetric grids' scales free in sign (`signed`) when `on`.
    pub fn signed_if(self, on: bool) -> Self {
        Self {
            // A K-quant's symmetric sub-block scales are signed already (Lattice::Super).
            signed: on && self.sym && matches!(self.lattice, Lattice::Free | Lattice::F16),
            ..self
        }
    }

    /// The same quantization on the grids of `lattice`.
    pub fn on(self, lattice: Lattice) -> Self {
        Self { lattice, ..self }
    }

    /// Whether grids carry an offset m (ŵ = s·q − m, held in `Grid::zero`) instead of an integer zero
    /// point: asymmetric grids on a GGUF lattice.
    pub fn offset(&self) -> bool {
        !self.sym && self.lattice != Lattice::Free
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        let widths: &[u32] = match self.lattice {
            Lattice::Free => &[2, 3, 4, 8],
            _ => &[2, 3, 4, 5, 6, 8],
        };
        if !widths.contains(&self.bits) {
            return Err(crate::input_err!(
                "unsupported bit width {} (expected one of {widths:?})",
                self.bits
            ));
        }
        if self.group_size == Some(0) {
            return Err(crate::input_err!(
                "group size must be positive (or -1 for per channel)"
            ));
        }
        if self.signed && (!self.sym || matches!(self.lattice, Lattice::Super { .. })) {
            return Err(crate::input_err!(
                "signed scales mirror a symmetric grid with a zero point (not {} on {:?})",
                if self.sym { "symmetric" } else { "asymmetric" },
                self.lattice
            ));
        }
        if let Lattice::Super { len, sc_max, .. } = self.lattice
            && (sc_max == 0 || self.group_size.is_none_or(|g| len == 0 || len % g != 0))
        {
            return Err(crate::input_err!(
                "super-blocks of {len} columns do not hold whole groups of {:?}",
                self.group_size
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

/// One quantization grid: ŵ = scale·(q − zero); zero is integer-valued. On an offset grid
/// (`QuantSpec::offset`) `zero` holds the offset m instead: ŵ = scale·q − m.
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
