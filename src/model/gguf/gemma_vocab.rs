//! Gemma's SentencePiece vocabulary (`tokenizer.ggml.model` = "llama" in a gemma3 GGUF) as the BPE tokenizer
//! transformers 5.24 builds from the same file (integrations/gguf/gguf_tokenizer_mapping.py: `gemma_tokenizer`
//! handing the vocabulary to `GemmaTokenizer`), so that token ids agree with it:
//!
//! * a token of two or more spaces is stored as spaces but looked up as "▁…" (the normalizer writes spaces as
//!   ▁), so it is respelled, one ▁ per character;
//! * the file has no merges. Every split of a token into two vocabulary pieces is one, ranked by the token's
//!   position in the file (Gemma's scores do not follow its merge order; the file order does), and within
//!   one token the longer left piece first (`generate_merges`' sort);
//! * normalizer ' ' → ▁, no prefix ▁, characters outside the vocabulary as <0xNN> byte tokens (byte
//!   fallback), unknown pieces fused;
//! * control tokens are special, user-defined ones (runs of newlines and tabs, `[multimodal]`…) are matched
//!   whole but are not special; neither is normalized.

use anyhow::Result;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// llama.cpp `LLAMA_TOKEN_TYPE_*`.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Python's `str.isspace`, which decides what transformers respells: Unicode White_Space plus the
/// information separators U+001C–U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// "  " → "▁▁": a token holding a space and nothing but whitespace becomes one ▁ per character.
fn respell(t: &str) -> String {
    if t.contains(' ') && t.chars().all(py_space) {
        "\u{2581}".repeat(t.chars().count())
    } else {
        t.to_owned()
    }
}

/// The merges the vocabulary implies, best first. `vocab` maps each token to its last position, as
/// transformers' dict does for a repeated token.
fn merges(tokens: &[String], vocab: &Vocab) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        if vocab.get(t) != Some(&(id as u32)) {
            continue;
        }
        let bounds: Vec<usize> = t.char_indices().skip(1).map(|(i, _)| i).collect();
        for &b in bounds.iter().rev() {
            let (l, r) = t.split_at(b);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                out.push((l.to_owned(), r.to_owned()));
            }
        }
    }
    out
}

/// The Gemma tokenizer of `tokens` (with their llama.cpp types); `unk` is the unknown token's spelling.
/// Warnings (repeated tokens) are pushed to `warnings`.
pub fn gemma_tokenizer(
    tokens: &[String],
    token_types: &[i64],
    unk: Option<&str>,
    warnings: &mut Vec<String>,
) -> Result<Tokenizer> {
    let respelled: Vec<String> = tokens.iter().map(|t| respell(t)).collect();
    let mut vocab = Vocab::with_capacity(respelled.len());
    for (id, t) in respelled.iter().enumerate() {
        vocab.insert(t.clone(), id as u32);
    }
    let n_dup = respelled.len() - vocab.len();
    if n_dup > 0 {
        warnings.push(format!(
            "{n_dup} repeated token strings in the vocabulary (after respelling spaces as ▁); the last \
             copy of each is the reachable one, as in transformers"
        ));
    }
    let merges = merges(&respelled, &vocab);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .unk_token(unk.unwrap_or("<unk>").to_owned())
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| anyhow::anyhow!("the Gemma vocabulary does not form a BPE model: {e}"))?;
    let mut tk = Tokenizer::new(bpe);
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| anyhow::anyhow!("Gemma normalizer: {e}"))
    };
    tk.with_normalizer(Some(NormalizerWrapper::Replace(replace(" ", "\u{2581}")?)))
        .map_err(|e| anyhow::anyhow!("Gemma normalizer: {e}"))?;
    // transformers' GemmaTokenizer splits on " " after the normalizer has replaced every space, so this never
    // splits; it is kept so the tokenizer.json is the one transformers writes.
    let split = Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false)
        .map_err(|e| anyhow::anyhow!("Gemma pre-tokenizer: {e}"))?;
    tk.with_pre_tokenizer(Some(PreTokenizerWrapper::Split(split)));
    tk.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        DecoderWrapper::Replace(replace("\u{2581}", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ]))));

    let of_type = |ty: i64| {
        tokens
            .iter()
            .zip(token_types)
            .filter(move |(_, t)| **t == ty)
            .map(|(s, _)| s)
    };
    let control: Vec<AddedToken> = of_type(TOKEN_TYPE_CONTROL)
        .map(|t| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    tk.add_special_tokens(control)
        .map_err(|e| anyhow::anyhow!("adding control tokens: {e}"))?;
    // As stored, not respelled: transformers looks the stored spelling up in the respelled vocabulary, so the
    // all-space user-defined tokens are not added (they are reached through the normalizer instead).
    let user: Vec<AddedToken> = of_type(TOKEN_TYPE_USER_DEFINED)
        .filter(|t| vocab.contains_key(t.as_str()))
        .map(|t| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tk.add_tokens(user)
        .map_err(|e| anyhow::anyhow!("adding user-defined tokens: {e}"))?;
    Ok(tk)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn spaces_are_respelled_and_merges_follow_file_order() {
        assert_eq!(respell("   "), "▁▁▁");
        assert_eq!(respell(" \n"), "▁▁");
        assert_eq!(respell("\n\n"), "\n\n");
        assert_eq!(respell("▁a b"), "▁a b");
        let toks = s(&["a", "b", "c", "abc", "ab", "bc"]);
        let vocab: Vocab = toks
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let m = merges(&toks, &vocab);
        let pair = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            m,
            vec![
                pair("ab", "c"),
                pair("a", "bc"),
                pair("a", "b"),
                pair("b", "c")
            ]
        );
    }
}
