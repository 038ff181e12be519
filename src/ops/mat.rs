//! The buffers the quantization core passes between its steps, held where the backend computes: a CPU keeps
//! them in host vectors (f64 where its oracle is f64: statistics, Hessians, factors, and every buffer of an
//! exactness test), a device in its own memory (f32). The algorithms (`quant/`) only hand them from one
//! `QuantOps` call to the next and read back what is small: a diagonal, a few sums, the packed output.

use super::tensor::Tensor;
use cudarc::driver::CudaSlice;

/// Values of a [`Mat`]: f64 in host memory, or f32 where the backend computes (a host vector or device memory).
pub enum MatData {
    F64(Vec<f64>),
    F32(Tensor),
}

/// A row-major matrix, or a batch of equal-shaped matrices stored one after another.
pub struct Mat {
    pub batch: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: MatData,
}

impl Mat {
    /// `v` [batch × rows × cols] in host memory, f64.
    pub fn f64(v: Vec<f64>, batch: usize, rows: usize, cols: usize) -> Mat {
        debug_assert_eq!(v.len(), batch * rows * cols);
        Mat {
            batch,
            rows,
            cols,
            data: MatData::F64(v),
        }
    }

    /// `v` [batch × rows × cols] in host memory, f32.
    pub fn f32(v: Vec<f32>, batch: usize, rows: usize, cols: usize) -> Mat {
        Self::tensor(Tensor::Host(v), batch, rows, cols)
    }

    /// A tensor (host or device) viewed as [batch × rows × cols].
    pub fn tensor(t: Tensor, batch: usize, rows: usize, cols: usize) -> Mat {
        debug_assert_eq!(t.len(), batch * rows * cols);
        Mat {
            batch,
            rows,
            cols,
            data: MatData::F32(t),
        }
    }

    /// Elements of one matrix of the batch.
    pub fn stride(&self) -> usize {
        self.rows * self.cols
    }

    pub fn len(&self) -> usize {
        self.batch * self.stride()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The f64 host values, if that is how the backend keeps them.
    pub fn host_f64(&self) -> Option<&[f64]> {
        match &self.data {
            MatData::F64(v) => Some(v),
            MatData::F32(_) => None,
        }
    }

    /// The f32 values when they are in host memory.
    pub fn host_f32(&self) -> Option<&[f32]> {
        match &self.data {
            MatData::F32(t) => t.host(),
            MatData::F64(_) => None,
        }
    }

    pub fn on_device(&self) -> bool {
        matches!(&self.data, MatData::F32(t) if t.on_device())
    }

    /// Host matrices (batches) of one kind and shape as one batch, in order; None when one is on a device or
    /// the kinds differ (the shapes are the caller's check: `ops::check_stack`).
    pub fn stack_host(mats: &[&Mat]) -> Option<Mat> {
        let (rows, cols) = (mats.first()?.rows, mats.first()?.cols);
        let batch = mats.iter().map(|m| m.batch).sum();
        if let Some(parts) = mats
            .iter()
            .map(|m| m.host_f64())
            .collect::<Option<Vec<_>>>()
        {
            return Some(Mat::f64(parts.concat(), batch, rows, cols));
        }
        let parts = mats
            .iter()
            .map(|m| m.host_f32())
            .collect::<Option<Vec<_>>>()?;
        Some(Mat::f32(parts.concat(), batch, rows, cols))
    }

    /// Each matrix of a host batch on its own; the batch back when it is on a device.
    pub fn unstack_host(self) -> std::result::Result<Vec<Mat>, Mat> {
        let (batch, rows, cols, s) = (self.batch, self.rows, self.cols, self.stride());
        match &self.data {
            MatData::F64(v) => Ok(v
                .chunks(s.max(1))
                .take(batch)
                .map(|m| Mat::f64(m.to_vec(), 1, rows, cols))
                .collect()),
            MatData::F32(t) => match t.host() {
                Some(v) => Ok(v
                    .chunks(s.max(1))
                    .take(batch)
                    .map(|m| Mat::f32(m.to_vec(), 1, rows, cols))
                    .collect()),
                None => Err(self),
            },
        }
    }

    /// "[b × r × c] f64 on the host" and the like, for error messages.
    pub fn describe(&self) -> String {
        let place = match &self.data {
            MatData::F64(_) => "f64 on the host",
            MatData::F32(t) if t.on_device() => "f32 on the device",
            MatData::F32(_) => "f32 on the host",
        };
        format!("[{} × {} × {}] {place}", self.batch, self.rows, self.cols)
    }
}

/// Integer codes (0..=maxq), row-major, where the backend computes.
pub enum Codes {
    Host(Vec<u8>),
    Device(CudaSlice<u8>),
}

impl Codes {
    pub fn len(&self) -> usize {
        match self {
            Codes::Host(v) => v.len(),
            Codes::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Quadratic forms tr(A H Aᵀ) queued where the backend computes (`QuantOps::quad_forms_into`) and read back
/// together (`QuantOps::read_quad_sums`): a block's error report costs one host synchronization, not one per
/// linear. The CPU holds the values; a device, each slot's partial sums until they are read.
pub enum QuadSums {
    Host(Vec<f64>),
    /// `DOT_CTAS` f64 partials per slot; forms were queued into the first `used` slots.
    Device {
        partials: CudaSlice<f64>,
        slots: usize,
        used: usize,
    },
}

impl QuadSums {
    pub fn slots(&self) -> usize {
        match self {
            QuadSums::Host(v) => v.len(),
            QuadSums::Device { slots, .. } => *slots,
        }
    }

    /// Refuses `count` forms from slot `first` on when they run past the last slot.
    pub fn check_room(&self, first: usize, count: usize) -> anyhow::Result<()> {
        if first + count > self.slots() {
            anyhow::bail!(
                "queued sums: slots {first}..{} of {}",
                first + count,
                self.slots()
            );
        }
        Ok(())
    }
}

/// Quantization grids of a matrix: scale and (integer-valued) zero of every (row, group), [rows × n_groups].
pub struct Grids {
    pub scale: Mat,
    pub zero: Mat,
}

impl Grids {
    pub fn rows(&self) -> usize {
        self.scale.rows
    }

    pub fn n_groups(&self) -> usize {
        self.scale.cols
    }
}

/// What a sweep hands back, in sweep order (rows and columns as the sweep visited them).
pub struct Swept {
    /// Q [rows × n]: the dequantized values.
    pub q: Mat,
    pub codes: Codes,
    pub grids: Grids,
    /// Σ e² over every quantized element (slot 0), e = (w − q) / U_cc (BoA: / (U_row,jj · U_col,cc)) with w
    /// the value the element had when it was quantized, and ‖Q − W‖² (slot 1, the same W): queued where the
    /// backend computes them, so a device sweep reads nothing back (`QuantOps::read_quad_sums` reads them).
    /// For GPTQ, with ΔW = Q − W (W after the dead inputs were zeroed), Σ e² = tr(ΔW H_d ΔWᵀ) in exact
    /// arithmetic, H_d being the damped H the factor U was made from: the sweep applies W ← W − e U and ends at
    /// Q, so ΔW = −E U, and U H_d Uᵀ = I for U = chol(H_d⁻¹)ᵀ. With the damping λ added to H's diagonal,
    /// tr(ΔW H ΔWᵀ) = Σ e² − λ·‖Q − W‖² (`SweepError`). BoA's sweeps leave both NaN (its report comes from
    /// `quad_forms`).
    pub loss: QuadSums,
}

/// A GPTQ linear's tr(ΔW H ΔWᵀ), H undamped, from its sweep's own sums (`Swept::loss`): Σ e² − λ·‖Q − W‖²,
/// known once the sums are read (the block's report queues them with its other forms: `QuantOps::queue_sums`).
pub struct SweepError {
    pub sums: QuadSums,
    /// λ: everything damping added to H's diagonal.
    pub damp: f64,
}

impl SweepError {
    /// The error from the sweep's two sums as read.
    pub fn value(damp: f64, loss: f64, delta_sq: f64) -> f64 {
        loss - damp * delta_sq
    }
}

/// One quantized linear layer, original row and column order.
pub struct QuantizedLinear {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    /// Ŵ [d_out × d_in] = s·(q − z) with the searched (f32) scales: what the next block's forward reads.
    pub w_hat: Mat,
    /// q [d_out × d_in].
    pub codes: Codes,
    /// [d_out × n_groups].
    pub grids: Grids,
    /// [d_in]: the group of each input column.
    pub g_idx: Vec<u32>,
    /// tr((W − Ŵ) H (W − Ŵ)ᵀ) when the algorithm knows it from its own sweep (GPTQ: `Swept::loss`), H the
    /// undamped input covariance; None when it must be computed (`QuantOps::quad_forms`).
    pub error: Option<SweepError>,
}

impl QuantizedLinear {
    pub fn n_groups(&self) -> usize {
        self.grids.n_groups()
    }
}

/// A quantized linear as a GPTQ-family checkpoint stores it, before the format's zero-point convention
/// (design.md §9): the one thing a backend hands back to the host per linear.
#[derive(Clone, Debug, PartialEq)]
pub struct Packed {
    pub d_out: usize,
    pub d_in: usize,
    pub bits: u32,
    pub n_groups: usize,
    /// [ceil(d_in·b/32) × d_out]: output j's codes along the input dimension, LSB-first (include/boa_pack.h).
    pub qweight: Vec<u32>,
    /// f16 scales [n_groups × d_out].
    pub scales: Vec<half::f16>,
    /// The true zero points [n_groups × d_out] (0..=maxq).
    pub zeros: Vec<u8>,
    /// [d_in].
    pub g_idx: Vec<u32>,
}
