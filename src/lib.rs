//! boa-cuda: post-training quantization of Llama-family LLMs (BoA, GPTQ, RTN) with hand-written CUDA kernels
//! and a CPU reference backend. See design.md for the architecture and the math.

pub mod alloc;
pub mod backend;
pub mod bench;
pub mod data;
pub mod error;
pub mod eval;
pub mod export;
pub mod model;
pub mod nvtx;
pub mod ops;
pub mod pipeline;
pub mod progress;
pub mod quant;
