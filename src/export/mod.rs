//! Writers for what a run produces: fake-quant HF folders, packed GPTQ and compressed-tensors checkpoints,
//! llama.cpp GGUF files, reports.

pub mod compressed_tensors;
pub mod convert;
pub mod gguf_mix;
pub mod gguf_model;
pub mod gguf_out;
mod gguf_vocab;
pub mod gptq_packed;
pub mod hf_folder;
pub mod out_guard;
pub mod out_lock;
pub mod safetensors_out;
