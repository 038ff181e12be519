//! The model's tokenizer.json through the `tokenizers` crate, so token ids equal HF tokenizers' ids.

use crate::error::file_err;
use std::path::Path;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn load(model_dir: &Path) -> anyhow::Result<Tokenizer> {
        let path = model_dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(file_err(&path, "tokenizer.json is missing"));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| file_err(&path, format!("cannot parse tokenizer: {e}")))?;
        Ok(Tokenizer { inner })
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds (as HF's
    /// `tokenizer(text)` does).
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| crate::input_err!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}
