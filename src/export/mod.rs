//! Writers for what a run produces: fake-quant HF folders, packed GPTQ checkpoints, reports.

pub mod safetensors_out;
