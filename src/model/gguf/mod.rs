//! GGUF (llama.cpp's single-file format, v2/v3) reading and conversion to a Hugging Face folder.
//!
//! `reader` parses and validates the container, `dequant` turns ggml blocks into f32 (`kquant` holds the
//! 256-value K-quant blocks; `codec` the encoders `run --format gguf` writes with, and the grids each type
//! stores), `tokenizer` rebuilds a `tokenizer.json` from the embedded vocabulary
//! (`gemma_vocab` for Gemma's SentencePiece one), `arch` holds what differs per architecture (llama, gemma3),
//! and `import` ties them together (`import_gguf`).

pub mod arch;
pub mod codec;
pub mod dequant;
mod gemma_vocab;
pub mod import;
pub mod kquant;
pub mod reader;
pub mod tokenizer;

pub use import::{ImportSummary, OutDType, import_gguf};
pub use reader::{GgmlType, GgufFile, TensorInfo, Value};
