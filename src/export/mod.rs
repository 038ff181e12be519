//! Writing checkpoints: safetensors files, the fake-quant HF folder.

pub mod hf_folder;
pub mod safetensors_out;
