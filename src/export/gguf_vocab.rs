//! The `tokenizer.ggml.*` keys of a GGUF we write, from the model folder's tokenizer.json,
//! tokenizer_config.json and config.json — what convert_hf_to_gguf.py writes for a byte-level BPE vocabulary
//! (`tokenizer.ggml.model` = "gpt2"): tokens in id order (ids the vocabulary lacks up to the model's
//! vocab_size as `[PAD{id}]`, type unused), token types (added special tokens control, other added tokens
//! user-defined), merges as "left right", the pre-tokenizer's llama.cpp name, BOS/EOS/UNK/PAD ids, whether
//! BOS is added, and the chat template. `model::gguf::tokenizer` is the reverse, and what it recognizes is
//! what is written: a pre-tokenizer llama.cpp would split differently is refused, never guessed. A
//! SentencePiece vocabulary in Gemma's tokenizer.json form is written as llama.cpp's "llama" tokenizer with
//! scores (`spm_vocab`).

use super::gguf_out::Kv;
use crate::model::gguf::tokenizer::{LLAMA3_REGEX, QWEN2_REGEX};
use serde_json::Value;
use std::path::Path;

/// The tokens in id order and the `tokenizer.ggml.*` keys that describe their model.
type VocabKeys = (Vec<String>, Vec<(String, Kv)>);

/// llama.cpp `LLAMA_TOKEN_TYPE_*`.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

fn read_json(path: &Path) -> Result<Option<Value>, String> {
    match std::fs::read_to_string(path) {
        Ok(t) => serde_json::from_str(&t)
            .map(Some)
            .map_err(|e| format!("{}: not valid JSON: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: cannot read: {e}", path.display())),
    }
}

/// llama.cpp's name of a tokenizer.json pre-tokenizer, or None for one it has no equivalent of.
fn pre_name(pre: &Value) -> Option<&'static str> {
    let ty = |v: &Value| v["type"].as_str().unwrap_or("").to_string();
    let byte_level = |v: &Value, regex: bool| {
        ty(v) == "ByteLevel"
            && v["use_regex"].as_bool().unwrap_or(true) == regex
            && !v["add_prefix_space"].as_bool().unwrap_or(false)
    };
    match ty(pre).as_str() {
        "ByteLevel" if byte_level(pre, true) => Some("gpt2"),
        "Sequence" => {
            let parts = pre["pretokenizers"].as_array()?;
            match parts.as_slice() {
                [d, b]
                    if ty(d) == "Digits"
                        && d["individual_digits"] == true
                        && byte_level(b, true) =>
                {
                    Some("smollm")
                }
                [s, b]
                    if ty(s) == "Split"
                        && s["behavior"] == "Isolated"
                        && s["invert"] == false
                        && byte_level(b, false) =>
                {
                    match s["pattern"]["Regex"].as_str()? {
                        LLAMA3_REGEX => Some("llama-bpe"),
                        QWEN2_REGEX => Some("qwen2"),
                        _ => None,
                    }
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// A special token's id: tokenizer_config.json's string (or {"content": …}) looked up in the vocabulary,
/// else config.json's `{key}_id`.
fn special_id(
    tcfg: Option<&Value>,
    cfg: &Value,
    key: &str,
    id_of: &dyn Fn(&str) -> Option<u32>,
) -> Option<u32> {
    let named = tcfg.and_then(|t| match &t[key] {
        Value::String(s) => Some(s.as_str()),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    });
    named
        .and_then(id_of)
        .or_else(|| cfg[format!("{key}_id")].as_u64().map(|v| v as u32))
}

/// The tokenizer keys for the model in `dir` with `vocab_size` embedding rows. Errors (one line, for the
/// before-work checks) say what llama.cpp could not tokenize as the model does.
pub fn tokenizer_kvs(dir: &Path, vocab_size: usize) -> Result<Vec<(String, Kv)>, String> {
    let tj = dir.join("tokenizer.json");
    let t = read_json(&tj)?.ok_or_else(|| {
        format!(
            "{}: missing; --format gguf embeds the tokenizer, so the model folder needs its tokenizer.json",
            tj.display()
        )
    })?;
    let bad = |m: String| format!("{}: {m}; --format gguf cannot embed it", tj.display());
    let (tokens, mut kvs) = match sentencepiece_like(&t) {
        true => spm_vocab(&t, vocab_size, &bad)?,
        false => bpe_vocab(&t, vocab_size, &bad)?,
    };
    let tcfg = read_json(&dir.join("tokenizer_config.json"))?;
    let cfg = read_json(&dir.join("config.json"))?.unwrap_or(Value::Null);
    let index: std::collections::HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .rev() // the first id of a duplicated string wins, as in the importer
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    let id_of = |s: &str| index.get(s).copied();
    for (key, gguf) in [
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ] {
        if let Some(id) = special_id(tcfg.as_ref(), &cfg, key, &id_of)
            && (id as usize) < vocab_size
        {
            kvs.push((format!("tokenizer.ggml.{gguf}"), Kv::U32(id)));
        }
    }
    if let Some(tc) = &tcfg {
        for (key, gguf) in [
            ("add_bos_token", "add_bos_token"),
            ("add_eos_token", "add_eos_token"),
        ] {
            if let Some(b) = tc[key].as_bool() {
                kvs.push((format!("tokenizer.ggml.{gguf}"), Kv::Bool(b)));
            }
        }
        if let Some(ct) = tc["chat_template"].as_str() {
            kvs.push(("tokenizer.chat_template".into(), Kv::Str(ct.into())));
        }
    }
    Ok(kvs)
}

/// The vocabulary of tokenizer.json `t` in id order with llama.cpp token types: each `model.vocab` entry as
/// `piece` writes and types it, then the added tokens (special ones control, the others user-defined) over
/// their ids; ids neither names up to `vocab_size` are `[PAD{id}]`, unused.
fn id_table(
    t: &Value,
    vocab_size: usize,
    bad: &dyn Fn(String) -> String,
    piece: &dyn Fn(&str) -> (String, i32),
) -> Result<(Vec<String>, Vec<i32>), String> {
    let vocab = t["model"]["vocab"]
        .as_object()
        .ok_or_else(|| bad("model.vocab is not an object".into()))?;
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![UNUSED; vocab_size];
    let mut place = |tok: String, id: u64, ty: i32| -> Result<(), String> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            bad(format!(
                "token {tok:?} has id {id}, beyond vocab_size {vocab_size}"
            ))
        })?;
        *slot = Some(tok);
        types[id as usize] = ty;
        Ok(())
    };
    for (tok, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("the id of {tok:?} is not an integer")))?;
        let (text, ty) = piece(tok);
        place(text, id, ty)?;
    }
    for a in t["added_tokens"].as_array().into_iter().flatten() {
        let (Some(tok), Some(id)) = (a["content"].as_str(), a["id"].as_u64()) else {
            return Err(bad(format!("added token {a} has no content or id")));
        };
        let ty = if a["special"] == true {
            CONTROL
        } else {
            USER_DEFINED
        };
        place(tok.to_string(), id, ty)?;
    }
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]")))
        .collect();
    Ok((tokens, types))
}

/// Whether tokenizer.json is a SentencePiece vocabulary as transformers writes Gemma's: BPE over pieces with
/// spaces written as ▁ by the normalizer (no ▁ prepended), characters outside the vocabulary as <0xNN>
/// bytes. llama.cpp runs such a vocabulary as "llama" (its SentencePiece tokenizer).
fn sentencepiece_like(t: &Value) -> bool {
    t["model"]["type"] == "BPE"
        && t["model"]["byte_fallback"] == true
        && t["normalizer"]["type"] == "Replace"
        && t["normalizer"]["pattern"]["String"] == " "
        && t["normalizer"]["content"] == "\u{2581}"
}

/// llama.cpp's SentencePiece keys of a Gemma-style tokenizer.json (what convert_hf_to_gguf.py writes from
/// tokenizer.model): the pieces in id order; llama.cpp merges the adjacent pair whose piece scores highest,
/// and SentencePiece orders a BPE vocabulary's pieces by score, so a normal piece's score is −id (the same
/// order; Gemma's own scores are one per id, descending too); byte pieces 0, control and user-defined
/// −1000, as the converter writes them. A run of two or more ▁ was stored as spaces (a user-defined
/// token that transformers respells, as `import-gguf` does): it is written back as spaces.
fn spm_vocab(
    t: &Value,
    vocab_size: usize,
    bad: &dyn Fn(String) -> String,
) -> Result<VocabKeys, String> {
    let is_byte = |s: &str| {
        s.len() == 6
            && s.starts_with("<0x")
            && s.ends_with('>')
            && s[3..5].chars().all(|c| c.is_ascii_hexdigit())
    };
    let (tokens, types) = id_table(t, vocab_size, bad, &|tok| {
        let n = tok.chars().count();
        if n >= 2 && tok.chars().all(|c| c == '\u{2581}') {
            (" ".repeat(n), USER_DEFINED)
        } else {
            (tok.to_string(), if is_byte(tok) { BYTE } else { NORMAL })
        }
    })?;
    let scores = types
        .iter()
        .enumerate()
        .map(|(i, &ty)| match ty {
            NORMAL => -(i as f32),
            BYTE => 0.0,
            _ => -1000.0,
        })
        .collect();
    let kvs = vec![
        ("tokenizer.ggml.model".to_string(), Kv::Str("llama".into())),
        ("tokenizer.ggml.pre".to_string(), Kv::Str("default".into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            Kv::StrArr(tokens.clone()),
        ),
        ("tokenizer.ggml.scores".to_string(), Kv::F32Arr(scores)),
        ("tokenizer.ggml.token_type".to_string(), Kv::I32Arr(types)),
        // llama.cpp's SentencePiece default is to prepend ▁; this vocabulary's normalizer does not.
        (
            "tokenizer.ggml.add_space_prefix".to_string(),
            Kv::Bool(false),
        ),
    ];
    Ok((tokens, kvs))
}

/// llama.cpp's byte-level BPE keys ("gpt2") of tokenizer.json `t`.
fn bpe_vocab(
    t: &Value,
    vocab_size: usize,
    bad: &dyn Fn(String) -> String,
) -> Result<VocabKeys, String> {
    let model = &t["model"];
    if model["type"] != "BPE" || t["decoder"]["type"] != "ByteLevel" {
        return Err(bad(format!(
            "the tokenizer is a {} model with a {} decoder, neither byte-level BPE nor a SentencePiece \
             vocabulary written as Gemma's (spaces as ▁ without one prepended, byte fallback)",
            model["type"], t["decoder"]["type"]
        )));
    }
    let pre = pre_name(&t["pre_tokenizer"]).ok_or_else(|| {
        bad(format!(
            "its pre-tokenizer {} has no llama.cpp equivalent this writer knows (GPT-2 byte-level, \
             SmolLM's digits + byte-level, Llama 3's regex)",
            t["pre_tokenizer"]
        ))
    })?;
    let (tokens, types) = id_table(t, vocab_size, bad, &|tok| (tok.to_string(), NORMAL))?;
    // Older tokenizer.json files hold "left right" strings, newer ones [left, right] pairs.
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| bad("model.merges is missing".into()))?
        .iter()
        .map(|m| match m {
            Value::String(s) if s.contains(' ') => Ok(s.clone()),
            Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) if !a.contains(' ') && !b.contains(' ') => {
                    Ok(format!("{a} {b}"))
                }
                _ => Err(bad(format!(
                    "merge {m} cannot be written as \"left right\""
                ))),
            },
            _ => Err(bad(format!("merge {m} is not \"left right\""))),
        })
        .collect::<Result<Vec<_>, _>>()?;

    let kvs = vec![
        ("tokenizer.ggml.model".to_string(), Kv::Str("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Kv::Str(pre.into())),
        (
            "tokenizer.ggml.tokens".to_string(),
            Kv::StrArr(tokens.clone()),
        ),
        ("tokenizer.ggml.token_type".to_string(), Kv::I32Arr(types)),
        ("tokenizer.ggml.merges".to_string(), Kv::StrArr(merges)),
    ];
    Ok((tokens, kvs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pre_tokenizer block of a Llama 3 or Qwen2 tokenizer.json with this split regex.
    fn split_then_bytes(regex: &str) -> Value {
        serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        ]})
    }

    #[test]
    fn a_gemma_style_vocabulary_is_written_as_sentencepiece() {
        let t = serde_json::json!({
            "model": {"type": "BPE", "byte_fallback": true, "vocab": {
                "<pad>": 0, "<bos>": 1, "<0x0A>": 2, "\n\n": 3, "\u{2581}\u{2581}": 4, "\u{2581}": 5,
                "a": 6, "\u{2581}a": 7}},
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
            "added_tokens": [
                {"id": 0, "content": "<pad>", "special": true},
                {"id": 1, "content": "<bos>", "special": true},
                {"id": 3, "content": "\n\n", "special": false},
            ],
        });
        assert!(sentencepiece_like(&t));
        let (tokens, kvs) = spm_vocab(&t, 9, &|m| m).unwrap();
        // Two ▁ were two spaces (user-defined); the id the vocabulary lacks is padding.
        assert_eq!(tokens[4], "  ");
        assert_eq!(tokens[8], "[PAD8]");
        let get = |k: &str| kvs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert!(matches!(get("tokenizer.ggml.model"), Some(Kv::Str(m)) if m == "llama"));
        let Some(Kv::I32Arr(types)) = get("tokenizer.ggml.token_type") else {
            panic!("no token types")
        };
        assert_eq!(
            types,
            [
                CONTROL,
                CONTROL,
                BYTE,
                USER_DEFINED,
                USER_DEFINED,
                NORMAL,
                NORMAL,
                NORMAL,
                UNUSED
            ]
        );
        let Some(Kv::F32Arr(scores)) = get("tokenizer.ggml.scores") else {
            panic!("no scores")
        };
        // Normal pieces score −id (descending along the ids, as SentencePiece orders them).
        assert_eq!(scores[2..8], [0.0, -1000.0, -1000.0, -5.0, -6.0, -7.0]);
        assert!(matches!(
            get("tokenizer.ggml.add_space_prefix"),
            Some(Kv::Bool(false))
        ));
        // Llama 2's normalizer prepends ▁: not this writer's SentencePiece form.
        let mut llama2 = t.clone();
        llama2["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        assert!(!sentencepiece_like(&llama2));
    }

    #[test]
    fn split_regexes_name_llama_cpps_pre_tokenizers() {
        assert_eq!(pre_name(&split_then_bytes(LLAMA3_REGEX)), Some("llama-bpe"));
        assert_eq!(pre_name(&split_then_bytes(QWEN2_REGEX)), Some("qwen2"));
        // A regex llama.cpp would split differently is refused, never guessed.
        assert_eq!(pre_name(&split_then_bytes(r"\p{N}+|\s+")), None);
    }
}
