//! Writers for what a run produces: fake-quant HF folders, packed GPTQ checkpoints, reports.

pub mod gptq_packed;
pub mod hf_folder;
pub mod safetensors_out;
