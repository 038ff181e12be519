//! The `Backend` trait: every operation the model forward and the quantization algorithms need, with no
//! knowledge of which algorithm calls it. `cpu` is the reference (and the oracle of every CUDA kernel);
//! `cuda` runs the same operations through kernels embedded at build time.
//!
//! Matrices are row-major f32. A linear layer's weight is W [d_out × d_in] (y = W x); a batch of tokens is
//! X [m × d_in] with one token per row. Each op comes twice: on host slices (the reference, used by tests and
//! tools), and on `Tensor`s (`*_t`), which a device backend keeps in its own memory between ops so a block
//! forward costs no PCIe traffic. The tensor methods default to the slice methods, which is all a host backend
//! needs. Every method is fallible: a device's failure (out of memory, a kernel fault, a missing library) comes
//! back as an error naming the op and its shapes, never a panic.

pub mod cpu;
mod cpu_quant;
pub mod cuda;
mod select;
mod weight;

pub use crate::ops::{AttnShape, QuantOps, Tensor};
pub use select::{Device, GemmPrecision, select_backend, select_backend_with};
pub use weight::{PackedResident, Weight};

use crate::ops::Result;
use anyhow::ensure;
use std::borrow::Cow;

/// Every backend also provides the quantization core (`QuantOps`, crate::ops).
pub trait Backend: QuantOps + Send + Sync {
    /// Short name for reports ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    /// Y [m × n] = X [m × k] · W[n × k]ᵀ (+ bias [n]).
    fn linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Vec<f32>>;

    /// Y [m × n] = X [m × k] · Ŵᵀ (+ bias [n]) with Ŵ [n × k] held packed (`quant::pack::PackedLinear`,
    /// n = d_out, k = d_in): dequantized a tile at a time, never whole.
    fn packed_linear(
        &self,
        x: &[f32],
        w: &crate::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Result<Vec<f32>>;

    /// Row-wise RMSNorm of X [rows × d]: y = x / sqrt(mean(x²) + eps) · w.
    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> Result<Vec<f32>>;

    /// Rotate-half RoPE in place on X [n_seq·t × n_heads·d_h]; token i of each sequence is at position i.
    /// `cos`/`sin` are [t × d_h/2] tables (see `model::llama::RopeTable`).
    #[allow(clippy::too_many_arguments)]
    fn rope(
        &self,
        x: &mut [f32],
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<()>;

    /// Causal softmax attention with GQA: Q [n_seq·t × h·d_h], K, V [n_seq·t × h_kv·d_h] → [n_seq·t × h·d_h].
    /// Query head i reads KV head i / (h / h_kv).
    #[allow(clippy::too_many_arguments)]
    fn causal_attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>>;

    /// The causal softmax probabilities A_h = softmax(Q_h K_hᵀ / √d_h) of every query head of ONE sequence:
    /// Q [t × h·d_h], K [t × h_kv·d_h] → [h × t × t] (zeros above the diagonal). V's statistics need them.
    fn attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Result<Vec<f32>>;

    /// SwiGLU: silu(gate) ⊙ up, elementwise.
    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>>;

    /// GeGLU: gelu_tanh(gate) ⊙ up, elementwise (Gemma's MLP). On the host unless a backend has its own (the
    /// CUDA backend has a kernel).
    fn geglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        cpu::geglu(gate, up)
    }

    /// (free, total) bytes of the device's own memory; None when the device is the host.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }

    // ---- Tensors: where activations live between ops (ops/tensor.rs). The defaults serve host backends, and
    // ---- (through `read` / `to_device`) any op a device backend does not override.

    /// Moves `x` to where this backend computes (a device backend uploads host and pinned tensors).
    fn to_device(&self, x: Tensor) -> Result<Tensor> {
        Ok(x)
    }

    /// Moves `x` out of device memory: into page-locked host memory when `pinned` (activations parked while
    /// the device works on other chunks), else into a plain vector.
    fn to_host(&self, x: Tensor, _pinned: bool) -> Result<Tensor> {
        Ok(x)
    }

    /// The values of `x` on the host: borrowed when they already are, copied out of a device.
    fn read<'a>(&self, x: &'a Tensor) -> Result<Cow<'a, [f32]>> {
        Ok(Cow::Borrowed(x.host().ok_or_else(|| {
            anyhow::anyhow!("read: a device tensor reached a host backend")
        })?))
    }

    /// dst ← src (equal lengths), each staying where it is (a chunk parked in pinned memory takes back its
    /// forwarded values without a new allocation).
    fn write_back(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        ensure!(src.len() == dst.len(), "write_back: lengths differ");
        let v = self.read(src)?;
        dst.host_mut()
            .ok_or_else(|| anyhow::anyhow!("write_back: a device tensor reached a host backend"))?
            .copy_from_slice(&v);
        Ok(())
    }

    /// A copy of `x`, in the same place.
    fn duplicate(&self, x: &Tensor) -> Result<Tensor> {
        self.to_device(Tensor::Host(self.read(x)?.into_owned()))
    }

    /// A copy of `x` where this backend computes, started now: a device backend uploads a parked (pinned)
    /// chunk on its copy stream, so a caller that stages chunk c+1 before computing chunk c overlaps the copy
    /// with the compute. Elsewhere the same as `duplicate`.
    fn stage(&self, x: &Tensor) -> Result<Tensor> {
        self.duplicate(x)
    }

    /// `n` zeros where this backend computes.
    fn zeros(&self, n: usize) -> Result<Tensor> {
        self.to_device(Tensor::Host(vec![0.0; n]))
    }

    /// A copy of a weight in this backend's memory, for a forward that reads it many times; None when the
    /// host values serve as they are (host backends).
    fn upload_weight(&self, _w: &[f32]) -> Result<Option<Tensor>> {
        Ok(None)
    }

    /// As `upload_weight`, for a weight that the next work reads at once: nothing is left to overlap the copy
    /// with, so it goes in the compute queue rather than behind prefetched copies.
    fn upload_weight_now(&self, w: &[f32]) -> Result<Option<Tensor>> {
        self.upload_weight(w)
    }

    /// Rows `ids` of an embedding table [vocab × d] (this backend's copy, from `upload_weight`, or a host
    /// tensor) → [ids.len() × d], each value times `scale` in f32 (Gemma's √d, as `Model::embed` applies it;
    /// 1 leaves the rows as they are), where this backend computes. The caller checks every id < vocab.
    fn embed_t(&self, table: &Tensor, ids: &[u32], d: usize, scale: f32) -> Result<Tensor> {
        let table = self.read(table)?;
        let mut x = Vec::with_capacity(ids.len() * d);
        for &id in ids {
            x.extend_from_slice(&table[id as usize * d..(id as usize + 1) * d]);
        }
        if scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        self.to_device(Tensor::Host(x))
    }

    /// `linear` on tensors.
    #[allow(clippy::too_many_arguments)]
    fn linear_t(
        &self,
        x: &Tensor,
        w: Weight<'_>,
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Tensor> {
        let y = self.linear(&self.read(x)?, w.host, bias, m, k, n)?;
        self.to_device(Tensor::Host(y))
    }

    /// x · (I ⊗ H_b/√b): each run of b = `h.n` values of x times the normalized Hadamard matrix (QuaRot's
    /// online R4 before down_proj). `dense` is the same transform as a linear's weight [b × b] (H_b/√b is
    /// symmetric only for Sylvester orders, so it is stored transposed). The default runs the fast transform
    /// on the host (b log b per run); a device backend may use the GEMM on `dense` instead where it has no
    /// fast transform (`block_hadamard_reads_dense`).
    fn block_hadamard_t(
        &self,
        x: &Tensor,
        h: &crate::ops::hadamard::Hadamard,
        _dense: Weight<'_>,
    ) -> Result<Tensor> {
        let mut v = self.read(x)?.into_owned();
        crate::ops::hadamard::block_transform_f32(h, &mut v).map_err(anyhow::Error::msg)?;
        self.to_device(Tensor::Host(v))
    }

    /// Whether `block_hadamard_t` with blocks of b reads its `dense` weight (so a resident copy of it pays).
    fn block_hadamard_reads_dense(&self, _b: usize) -> bool {
        false
    }

    /// A copy of a packed linear in this backend's memory, for a forward that reads it many times; None when
    /// the host form serves as it is (host backends).
    fn upload_packed(
        &self,
        _w: &crate::quant::pack::PackedLinear,
    ) -> Result<Option<PackedResident>> {
        Ok(None)
    }

    /// `packed_linear` on tensors; `resident` is this linear's copy from `upload_packed`, if one was made.
    fn packed_linear_t(
        &self,
        x: &Tensor,
        w: &crate::quant::pack::PackedLinear,
        _resident: Option<&PackedResident>,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Result<Tensor> {
        let y = self.packed_linear(&self.read(x)?, w, bias, m)?;
        self.to_device(Tensor::Host(y))
    }

    /// `rms_norm` on tensors.
    fn rms_norm_t(&self, x: &Tensor, w: &[f32], d: usize, eps: f32) -> Result<Tensor> {
        let y = self.rms_norm(&self.read(x)?, w, d, eps)?;
        self.to_device(Tensor::Host(y))
    }

    /// `rope` on a tensor, in place.
    #[allow(clippy::too_many_arguments)]
    fn rope_t(
        &self,
        x: &mut Tensor,
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<()> {
        update_on_host(self, x, |v| self.rope(v, t, n_heads, d_h, cos, sin))
    }

    /// `causal_attention` on tensors, each query attending to at most `window` keys (itself included) when
    /// the layer's attention slides.
    #[allow(clippy::too_many_arguments)]
    fn causal_attention_t(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
        window: Option<usize>,
    ) -> Result<Tensor> {
        if let Some(w) = window.filter(|&w| w < t) {
            return windowed_attention_on_host(self, (q, k, v), n_seq, (t, h, h_kv, d_h), w);
        }
        let o = self.causal_attention(
            &self.read(q)?,
            &self.read(k)?,
            &self.read(v)?,
            n_seq,
            t,
            h,
            h_kv,
            d_h,
        )?;
        self.to_device(Tensor::Host(o))
    }

    /// `swiglu` on tensors.
    fn swiglu_t(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.swiglu(&self.read(gate)?, &self.read(up)?)?;
        self.to_device(Tensor::Host(y))
    }

    /// `geglu` on tensors.
    fn geglu_t(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let y = self.geglu(&self.read(gate)?, &self.read(up)?)?;
        self.to_device(Tensor::Host(y))
    }

    /// x += y, elementwise (the residual connections).
    fn add_t(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        ensure!(x.len() == y.len(), "add_t: lengths differ");
        let y = self.read(y)?;
        update_on_host(self, x, |v| {
            v.iter_mut().zip(y.iter()).for_each(|(a, b)| *a += b);
            Ok(())
        })
    }

    /// out[rows[r]] += y[r] · weights[r] for each row r of y [rows.len() × d], out [m × d]: an MoE MLP adding
    /// each expert's output rows into the tokens routed to it. `rows` are distinct (an expert sees a token
    /// once), so a device may add them in parallel; each element is one f32 product then one f32 sum.
    fn scatter_add_rows_t(
        &self,
        out: &mut Tensor,
        y: &Tensor,
        d: usize,
        rows: &[u32],
        weights: &[f32],
    ) -> Result<()> {
        check_scatter(out.len(), y.len(), d, rows, weights)?;
        let y = self.read(y)?;
        update_on_host(self, out, |o| {
            for ((&row, &w), src) in rows.iter().zip(weights).zip(y.chunks_exact(d)) {
                let dst = &mut o[row as usize * d..(row as usize + 1) * d];
                dst.iter_mut().zip(src).for_each(|(a, &v)| *a += v * w);
            }
            Ok(())
        })
    }
}

/// The contract of `scatter_add_rows_t`, checked on the host before any work: y is [rows.len() × d], every
/// row is one of out's [m × d] rows, and no row repeats (a device adds the rows in parallel).
pub fn check_scatter(
    out_len: usize,
    y_len: usize,
    d: usize,
    rows: &[u32],
    weights: &[f32],
) -> Result<()> {
    ensure!(
        d > 0
            && out_len.is_multiple_of(d)
            && rows.len() == weights.len()
            && Some(y_len) == rows.len().checked_mul(d),
        "scatter_add_rows: y.len={y_len} is not rows={}·d={d}, {} weights, or out.len={out_len} is not rows of d",
        rows.len(),
        weights.len()
    );
    let m = out_len / d;
    let mut seen = vec![false; m];
    for &r in rows {
        let slot = seen.get_mut(r as usize).ok_or_else(|| {
            anyhow::anyhow!("scatter_add_rows: row {r} is outside out's {m} rows")
        })?;
        ensure!(!*slot, "scatter_add_rows: row {r} appears twice");
        *slot = true;
    }
    Ok(())
}

/// Applies `f` to x's values in place: directly when they are in host memory, else on a host copy that goes
/// back where x was (the tensor defaults' in-place ops).
fn update_on_host<B: Backend + ?Sized>(
    be: &B,
    x: &mut Tensor,
    f: impl FnOnce(&mut [f32]) -> Result<()>,
) -> Result<()> {
    match x.host_mut() {
        Some(v) => f(v),
        None => {
            let mut v = be.read(x)?.into_owned();
            f(&mut v)?;
            *x = be.to_device(Tensor::Host(v))?;
            Ok(())
        }
    }
}

/// Sliding-window attention on the host: the CPU backend's own (the CUDA backend masks windows in its
/// kernels).
fn windowed_attention_on_host<B: Backend + ?Sized>(
    be: &B,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    n_seq: usize,
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
    window: usize,
) -> Result<Tensor> {
    let o = cpu::attention(
        &be.read(q)?,
        &be.read(k)?,
        &be.read(v)?,
        n_seq,
        (t, h, h_kv, d_h),
        Some(window),
    )?;
    be.to_device(Tensor::Host(o))
}
