//! The `Backend` trait: every operation the model forward and the quantization algorithms need, with no
//! knowledge of which algorithm calls it. `cpu` is the reference (and the oracle of every CUDA kernel);
//! `cuda` runs the same operations through kernels embedded at build time.
//!
//! Matrices are row-major f32 host slices. A linear layer's weight is W [d_out × d_in] (y = W x); a batch of
//! tokens is X [m × d_in] with one token per row.

pub mod cpu;
mod cpu_quant;
pub mod cuda;
pub mod quant_ops;
mod select;

pub use quant_ops::QuantOps;
pub use select::{Device, select_backend};

/// Every backend also provides the quantization core (`QuantOps`, quant_ops.rs).
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
    ) -> Vec<f32>;

    /// Y [m × n] = X [m × k] · Ŵᵀ (+ bias [n]) with Ŵ [n × k] held packed (`quant::pack::PackedLinear`,
    /// n = d_out, k = d_in): dequantized a tile at a time, never whole.
    fn packed_linear(
        &self,
        x: &[f32],
        w: &crate::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Vec<f32>;

    /// Row-wise RMSNorm of X [rows × d]: y = x / sqrt(mean(x²) + eps) · w.
    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> Vec<f32>;

    /// Rotate-half RoPE in place on X [n_seq·t × n_heads·d_h]; token i of each sequence is at position i.
    /// `cos`/`sin` are [t × d_h/2] tables (see `model::llama::RopeTable`).
    fn rope(&self, x: &mut [f32], t: usize, n_heads: usize, d_h: usize, cos: &[f32], sin: &[f32]);

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
    ) -> Vec<f32>;

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
    ) -> Vec<f32>;

    /// SwiGLU: silu(gate) ⊙ up, elementwise.
    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Vec<f32>;

    /// (free, total) bytes of the device's own memory; None when the device is the host.
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }
}
