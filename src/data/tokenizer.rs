//! The model's tokenizer.json through the `tokenizers` crate, so token ids equal HF tokenizers' ids.
//!
//! A long text (the whole calibration corpus: 11 MB, ~2 M tokens, for data/texts/sotu) is tokenized in pieces
//! on every thread. The `tokenizers` pipeline (added tokens, normalizer, pre-tokenizer, model) only ever joins
//! characters inside a pre-tokenizer piece, so cutting the text where no piece spans the cut gives the same
//! ids. Where that holds is the tokenizer's business (a regex's lookahead, a prepended "▁"), so each cut is
//! checked rather than assumed: a window of `SEAM` bytes either side of it must give the same ids whole and
//! cut. A cut that fails is moved to the next line break; a text with no cut that passes is tokenized whole.
//! The special tokens (BOS) are added once, by the tokenizer's own post-processor, around the joined pieces.

use crate::error::file_err;
use rayon::prelude::*;
use std::path::Path;

/// Texts shorter than twice this are tokenized whole; longer ones in pieces of about this size.
const PIECE: usize = 1 << 19;
/// Bytes of context either side of a cut that its check tokenizes.
const SEAM: usize = 1024;
/// Line breaks tried per cut before that cut is dropped (its two pieces stay one).
const TRIES: usize = 16;

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
        let pieces = self.pieces(text)?;
        if pieces.len() == 1 {
            return self.encode_whole(text);
        }
        let encs = pieces
            .par_iter()
            .map(|p| self.raw(p, false))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let joined = tokenizers::Encoding::merge(encs, false);
        let enc = self
            .inner
            .post_process(joined, None, true)
            .map_err(|e| crate::input_err!("tokenization failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The same ids as [`Tokenizer::encode`], from one sequential pass over the whole text (the reference
    /// the pieces are tested against).
    pub fn encode_whole(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(self.raw(text, true)?.get_ids().to_vec())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn raw(&self, text: &str, special: bool) -> anyhow::Result<tokenizers::Encoding> {
        self.inner
            .encode_fast(text, special)
            .map_err(|e| crate::input_err!("tokenization failed: {e}"))
    }

    fn ids(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(self.raw(text, false)?.get_ids().to_vec())
    }

    /// `text` cut into pieces of about `PIECE` bytes at checked cuts (module comment); one piece when the
    /// text is short, or when truncation or padding (which would act on each piece) is configured.
    fn pieces<'t>(&self, text: &'t str) -> anyhow::Result<Vec<&'t str>> {
        if text.len() < 2 * PIECE
            || self.inner.get_truncation().is_some()
            || self.inner.get_padding().is_some()
        {
            return Ok(vec![text]);
        }
        let targets: Vec<usize> = (1..text.len() / PIECE).map(|k| k * PIECE).collect();
        let cuts = targets
            .par_iter()
            .map(|&t| self.cut_near(text, t))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(cuts.len() + 1);
        let mut prev = 0;
        for c in cuts.into_iter().flatten() {
            if c > prev {
                out.push(&text[prev..c]);
                prev = c;
            }
        }
        out.push(&text[prev..]);
        Ok(out)
    }

    /// The first position at or after `target`, just after a '\n', where cutting leaves the ids unchanged
    /// within `SEAM` bytes either side; None after `TRIES` line breaks.
    fn cut_near(&self, text: &str, target: usize) -> anyhow::Result<Option<usize>> {
        // Bytes, not `str` slicing: `target` may fall inside a multi-byte character, and the byte after a
        // '\n' (ASCII) is always a character boundary.
        let mut from = target;
        for _ in 0..TRIES {
            let Some(nl) = text.as_bytes()[from..].iter().position(|&b| b == b'\n') else {
                return Ok(None);
            };
            let c = from + nl + 1;
            if c + SEAM >= text.len() {
                return Ok(None);
            }
            if self.seam_holds(text, c)? {
                return Ok(Some(c));
            }
            from = c;
        }
        Ok(None)
    }

    fn seam_holds(&self, text: &str, c: usize) -> anyhow::Result<bool> {
        let mut a = c.saturating_sub(SEAM);
        while !text.is_char_boundary(a) {
            a -= 1;
        }
        let mut b = (c + SEAM).min(text.len());
        while !text.is_char_boundary(b) {
            b += 1;
        }
        let whole = self.ids(&text[a..b])?;
        let mut cut = self.ids(&text[a..c])?;
        cut.extend(self.ids(&text[c..b])?);
        Ok(whole == cut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level BPE tokenizer whose pre-tokenizer looks ahead ("\n\n" at the end of a piece is one
    /// token, two before a word), as GPT-2's does: the kind of seam a cut must not change.
    fn byte_level() -> Tokenizer {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let mut vocab: Vec<String> = ByteLevel::alphabet()
            .iter()
            .map(|c| c.to_string())
            .collect();
        vocab.sort();
        vocab.push("ĊĊ".into());
        let vocab: serde_json::Map<String, serde_json::Value> = vocab
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i.into()))
            .collect();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "post_processor": null, "decoder": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                              "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
                      "byte_fallback": false, "vocab": vocab, "merges": ["Ċ Ċ"]},
        });
        let inner: tokenizers::Tokenizer = json.to_string().parse().expect("tokenizer json");
        Tokenizer { inner }
    }

    #[test]
    fn pieces_give_the_whole_texts_ids() {
        let tok = byte_level();
        // Paragraphs ending in one, two or three line breaks, so many candidate cuts fall on a seam that
        // the lookahead would change; "ö" is two bytes, so the pieces' targets can fall inside a character.
        let mut text = String::from("a");
        let mut k = 0u64;
        while text.len() < 5 * PIECE {
            k = k
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            text.push_str("wörd ");
            text.push_str(&"ö".repeat((k >> 60) as usize));
            if k >> 62 == 0 {
                text.push_str(&"\n".repeat(1 + (k >> 33) as usize % 3));
            }
        }
        assert!(
            (1..text.len() / PIECE).any(|k| !text.is_char_boundary(k * PIECE)),
            "no piece target falls inside a character"
        );
        let pieces = tok.pieces(&text).unwrap();
        assert!(pieces.len() >= 4, "{} pieces", pieces.len());
        assert_eq!(pieces.concat(), text);
        assert_eq!(tok.encode(&text).unwrap(), tok.encode_whole(&text).unwrap());
        // Cutting after two line breaks before a word makes them one piece ("\n\n" at the end of the text):
        // the check sees it.
        let (p, _) = text
            .match_indices("\n\nwörd")
            .find(|&(p, _)| text.as_bytes()[p - 1] != b'\n')
            .unwrap();
        let c = p + 2;
        assert!(!tok.seam_holds(&text, c).unwrap());
    }
}
