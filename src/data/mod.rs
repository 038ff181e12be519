//! Text and tokens: reading text files or folders, tokenizing with the model's tokenizer.json, cutting
//! evaluation windows and sampling calibration windows.

pub mod text;
pub mod tokenizer;
pub mod windows;
