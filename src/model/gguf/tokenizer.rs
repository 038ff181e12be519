//! Rebuild a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) from a GGUF's `tokenizer.ggml.*` keys.
//!
//! Two kinds are supported: Gemma's SentencePiece vocabulary (`tokenizer.ggml.model` = "llama" in a gemma3
//! file; `gemma_vocab`) and byte-level BPE (`tokenizer.ggml.model` = "gpt2": GPT-2, Llama 3, SmolLM, Qwen…).
//! The BPE pre-tokenizer is chosen from `tokenizer.ggml.pre`, mirroring llama.cpp's `llm_tokenizer_bpe` regex
//! sets (llama-vocab.cpp) with the equivalent HF pre-tokenizers:
//!
//! | pre                                      | HF pre_tokenizer                                                    |
//! |------------------------------------------|---------------------------------------------------------------------|
//! | smollm, starcoder, refact, codeshell     | Sequence[Digits(individual), ByteLevel(use_regex)] (SmolLM2's own)   |
//! | llama-bpe (Llama 3)                      | Sequence[Split(Llama-3 regex, isolated), ByteLevel(no regex)]       |
//! | qwen2 (Qwen2, Qwen2.5, Qwen3)            | Sequence[Split(Qwen2 regex, isolated), ByteLevel(no regex)]         |
//! | default, gpt2; anything else (warning)   | ByteLevel(use_regex) — the GPT-2 regex                               |

use anyhow::Result;
use serde_json::json;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::arch::Arch;
use super::gemma_vocab::gemma_tokenizer;
use super::reader::{GgufFile, Value};
use crate::error::file_err;

/// llama.cpp `LLAMA_TOKEN_TYPE_*`.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's pre-tokenizer regex, as in Meta-Llama-3's tokenizer.json.
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's (and Qwen2.5's, Qwen3's) pre-tokenizer regex: Llama 3's with single digits.
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What `build_tokenizer` produces.
pub struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    /// Contents of tokenizer_config.json.
    pub config: serde_json::Value,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub vocab_size: usize,
    /// Things the caller should show the user (unknown pre-tokenizer, duplicate tokens…).
    pub warnings: Vec<String>,
}

fn string_array(g: &GgufFile, key: &str) -> Result<Vec<String>> {
    g.require_array(key)?
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().map(str::to_owned).ok_or_else(|| {
                file_err(
                    &g.path,
                    format!("{key}[{i}] is a {}, expected a string", v.type_name()),
                )
            })
        })
        .collect()
}

fn token_id(g: &GgufFile, key: &str, n_vocab: usize) -> Result<Option<u32>> {
    match g.get_u64(key)? {
        None => Ok(None),
        Some(id) if id < n_vocab as u64 => Ok(Some(id as u32)),
        Some(id) => Err(file_err(
            &g.path,
            format!("{key} = {id} is outside the vocabulary of {n_vocab} tokens"),
        )),
    }
}

/// A regex split (matches isolated), then byte-level mapping without GPT-2's own regex.
fn split_then_bytes(regex: &str) -> Result<PreTokenizerWrapper> {
    Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(
            Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| anyhow::anyhow!("pre-tokenizer regex {regex:?}: {e}"))?,
        ),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ])))
}

fn pre_tokenizer(pre: &str, warnings: &mut Vec<String>) -> Result<PreTokenizerWrapper> {
    let gpt2 = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                gpt2(),
            ]))
        }
        "llama-bpe" | "llama3" => split_then_bytes(LLAMA3_REGEX)?,
        // llama.cpp does not apply Qwen's NFC normalizer either.
        "qwen2" => split_then_bytes(QWEN2_REGEX)?,
        "default" | "gpt2" => gpt2(),
        other => {
            warnings.push(format!(
                "tokenizer.ggml.pre = {other:?} is not known to this importer; using the GPT-2 byte-level \
                 pre-tokenizer, so token ids may differ from llama.cpp's on some text"
            ));
            gpt2()
        }
    })
}

/// Which tokenizer a file's `tokenizer.ggml.model` describes.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    ByteLevel,
    Gemma,
}

fn kind(g: &GgufFile, arch: Arch) -> Result<Kind> {
    match (g.require_str("tokenizer.ggml.model")?, arch) {
        ("gpt2", _) => Ok(Kind::ByteLevel),
        ("llama", Arch::Gemma3) => Ok(Kind::Gemma),
        ("llama", _) => Err(file_err(
            &g.path,
            format!(
                "tokenizer.ggml.model is \"llama\" (SentencePiece), supported only for Gemma 3; a {} file \
                 needs a BPE vocabulary (\"gpt2\")",
                arch.key()
            ),
        )),
        (other, _) => Err(file_err(
            &g.path,
            format!(
                "tokenizer.ggml.model is {other:?}; only BPE vocabularies (\"gpt2\") and Gemma's \
                 SentencePiece one (\"llama\") are supported"
            ),
        )),
    }
}

/// Build the tokenizer of `g`, a file of architecture `arch` with context length `ctx`. Errors name the key
/// that is missing or wrong.
pub fn build_tokenizer(g: &GgufFile, arch: Arch, ctx: u64) -> Result<GgufTokenizer> {
    let kind = kind(g, arch)?;
    let mut warnings = Vec::new();
    let tokens = string_array(g, "tokenizer.ggml.tokens")?;
    let n_vocab = tokens.len();
    if n_vocab == 0 || n_vocab > u32::MAX as usize {
        return Err(file_err(
            &g.path,
            format!("tokenizer.ggml.tokens has {n_vocab} entries"),
        ));
    }
    let token_types: Vec<i64> = match g.get_array("tokenizer.ggml.token_type")? {
        None => vec![1; n_vocab],
        Some(a) => {
            if a.len() != n_vocab {
                return Err(file_err(
                    &g.path,
                    format!(
                        "tokenizer.ggml.token_type has {} entries for {n_vocab} tokens",
                        a.len()
                    ),
                ));
            }
            a.iter()
                .map(|v| {
                    v.as_i64().ok_or_else(|| {
                        file_err(&g.path, "tokenizer.ggml.token_type holds non-integers")
                    })
                })
                .collect::<Result<_>>()?
        }
    };
    let unk_id = token_id(g, "tokenizer.ggml.unknown_token_id", n_vocab)?;
    let mut tk = match kind {
        Kind::ByteLevel => byte_level_tokenizer(g, &tokens, &token_types, &mut warnings)?,
        Kind::Gemma => gemma_tokenizer(
            &tokens,
            &token_types,
            unk_id.map(|i| tokens[i as usize].as_str()),
            &mut warnings,
        )?,
    };
    let bos_id = token_id(g, "tokenizer.ggml.bos_token_id", n_vocab)?;
    let eos_id = token_id(g, "tokenizer.ggml.eos_token_id", n_vocab)?;
    let pad_id = token_id(g, "tokenizer.ggml.padding_token_id", n_vocab)?;
    // Without the key, llama.cpp adds no BOS for BPE vocabularies and one for SentencePiece ones (and
    // transformers follows it).
    let add_bos = g
        .get_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(kind == Kind::Gemma)
        && bos_id.is_some();
    let add_eos = g.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos_id.is_some();
    let name = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());
    let post: PostProcessorWrapper = if add_bos || add_eos || kind == Kind::Gemma {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut special = Vec::new();
        if add_bos {
            let b = tokens[bos_id.unwrap() as usize].clone();
            single.push(format!("{b}:0"));
            special.push((b, bos_id.unwrap()));
        }
        single.push("$A:0".to_owned());
        if add_eos {
            let e = tokens[eos_id.unwrap() as usize].clone();
            single.push(format!("{e}:0"));
            special.push((e, eos_id.unwrap()));
        }
        pair.extend(single.iter().cloned());
        pair.extend(
            single
                .iter()
                .map(|s| s.replace(":0", ":1").replace("$A", "$B")),
        );
        let tmpl_err = |e: String| anyhow::anyhow!("post-processor template: {e}");
        let mut b = TemplateProcessing::builder();
        b.try_single(single).map_err(tmpl_err)?;
        b.try_pair(pair).map_err(tmpl_err)?;
        b.special_tokens(special);
        b.build().map_err(|e| tmpl_err(e.to_string()))?.into()
    } else {
        // What SmolLM2's own tokenizer.json has: only fixes offsets, adds nothing.
        ByteLevel::new(true, false, true).into()
    };
    tk.with_post_processor(Some(post));

    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": false,
        "model_max_length": ctx,
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "unk_token": name(unk_id),
        "pad_token": name(pad_id),
    });
    if let Some(Value::Str(t)) = g.get("tokenizer.chat_template") {
        config["chat_template"] = json!(t);
    }
    Ok(GgufTokenizer {
        tokenizer: tk,
        config,
        bos_id,
        eos_id,
        pad_id,
        vocab_size: n_vocab,
        warnings,
    })
}

/// A byte-level BPE tokenizer from the file's vocabulary and merges; control and user-defined tokens become
/// special tokens.
fn byte_level_tokenizer(
    g: &GgufFile,
    tokens: &[String],
    token_types: &[i64],
    warnings: &mut Vec<String>,
) -> Result<Tokenizer> {
    let n_vocab = tokens.len();
    let merges: Vec<(String, String)> = string_array(g, "tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_owned(), b.to_owned())),
            None => Err(file_err(
                &g.path,
                format!("tokenizer.ggml.merges[{i}] = {m:?} is not \"left right\""),
            )),
        })
        .collect::<Result<_>>()?;

    let mut vocab = Vocab::with_capacity(n_vocab);
    let mut n_dup = 0;
    for (id, t) in tokens.iter().enumerate() {
        if vocab.contains_key(t) {
            n_dup += 1; // keep the first id, as HF's converters do
        } else {
            vocab.insert(t.clone(), id as u32);
        }
    }
    if n_dup > 0 {
        warnings.push(format!(
            "{n_dup} duplicate token strings in the vocabulary; later copies are unreachable"
        ));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| {
            file_err(
                &g.path,
                format!("vocabulary and merges do not form a BPE model: {e}"),
            )
        })?;

    let pre = g.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(pre_tokenizer(pre, warnings)?));
    tk.with_decoder(Some(ByteLevelDecoder::default()));

    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(token_types)
        .filter(|(_, ty)| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
        .map(|(t, _)| AddedToken::from(t.clone(), true))
        .collect();
    tk.add_special_tokens(specials)
        .map_err(|e| anyhow::anyhow!("adding special tokens: {e}"))?;

    Ok(tk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let p = pre_tokenizer(pre, &mut Vec::new()).unwrap();
        let mut s = PreTokenizedString::from(text);
        p.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    #[test]
    fn qwen2_splits_digits_one_by_one_where_llama3_takes_three() {
        assert_eq!(pieces("qwen2", "in 2024"), ["in", "Ġ", "2", "0", "2", "4"]);
        assert_eq!(pieces("llama-bpe", "in 2024"), ["in", "Ġ", "202", "4"]);
    }
}
