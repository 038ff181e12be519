//! Model files: config.json, safetensors weights, GGUF import, and the Llama block.

pub mod config;
pub mod gguf;
pub mod llama;
pub mod packed;
pub mod synth;
pub mod weights;

pub use config::Config;
pub use llama::{BlockWeights, Linear, Model};
