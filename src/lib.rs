//! boa-cuda: post-training quantization of Llama-family LLMs (BoA, GPTQ, RTN) with hand-written CUDA kernels
//! and a CPU reference backend. See design.md for the architecture and the math.

pub mod backend;
pub mod error;
pub mod quant;
