//! Model files: config.json, safetensors, GGUF import, the Llama block definition.

pub mod gguf;
