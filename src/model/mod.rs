//! Model files: config.json, the block description of each architecture, safetensors weights, GGUF import,
//! and the Llama-family block.

pub mod arch;
pub mod compressed;
pub mod config;
pub mod gguf;
/// Hadamard matrices: pure math, in `ops` so a backend's op can apply one.
pub use crate::ops::hadamard;
pub mod llama;
pub mod moe;
pub mod online;
pub mod orthogonal;
pub mod packed;
pub mod raw_config;
pub mod rotate;
pub mod synth;
pub mod weights;

pub use config::Config;
pub use llama::{BlockWeights, Linear, Model};
