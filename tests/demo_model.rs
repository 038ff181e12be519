//! The imported demo model (SmolLM2-135M-Instruct from its Q4_1 GGUF) evaluates like an independent
//! implementation: 24.842 on the first 512 tokens of the 2016 address (design.md §10; HF transformers'
//! GGUF loader gives 24.838 on the same window).

mod common;
use common::*;

#[test]
fn demo_perplexity_first_window_of_2016_address() {
    let model = demo_model();
    let text = texts_dir().join("sotu/2016_barack_obama_d.txt");
    let (code, out, err) = run(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--seqlen",
        "512",
        "--max-windows",
        "1",
        "--device",
        "cpu",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
    let ppl = v["perplexity"].as_f64().unwrap();
    let reference = 24.842;
    assert!(
        ((ppl - reference) / reference).abs() < 0.003,
        "perplexity {ppl} is not within 0.3% of {reference}"
    );
    assert_eq!(v["tokens"].as_u64(), Some(512));
    assert_eq!(v["windows"].as_u64(), Some(1));
}

/// The whole calibration corpus (data/texts/sotu, 11 MB) tokenized in checked pieces on every thread gives
/// the ids of one pass over the joined text, with the demo model's byte-level BPE (whose pre-tokenizer looks
/// ahead across line breaks, so a careless cut would change them).
#[test]
fn calibration_corpus_in_pieces_tokenizes_as_one_pass() {
    use boa_cuda::data::{text, tokenizer::Tokenizer};
    let tok = Tokenizer::load(&demo_model()).unwrap();
    let corpus = text::read_all(&[texts_dir().join("sotu")]).unwrap();
    assert!(corpus.len() > 10_000_000, "{} bytes", corpus.len());
    let whole = tok.encode_whole(&corpus).unwrap();
    let pieces = tok.encode(&corpus).unwrap();
    assert_eq!(pieces.len(), whole.len());
    if let Some(i) = (0..whole.len()).find(|&i| pieces[i] != whole[i]) {
        panic!("ids differ first at {i}: {} vs {}", pieces[i], whole[i]);
    }
}
