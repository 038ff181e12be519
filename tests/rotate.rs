//! Rotations fused into the weights (`boa-cuda rotate`, `run --rotate`; src/model/rotate.rs) on the demo
//! model: the rotated FP model is the same function (our eval and transformers' from_pretrained of the
//! rotated folder), rotated BoA at 3 bits per-channel beats unrotated BoA in a small setting, and an
//! architecture the fold does not know is refused before any work.

mod common;
use common::*;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ppl(model: &Path) -> f64 {
    let text = texts_dir().join("moby-dick.txt");
    let (code, out, err) = run(&[
        "eval",
        "--model",
        s(model),
        "--data",
        s(&text),
        "--seqlen",
        "512",
        "--max-windows",
        "4",
        "--json",
    ]);
    assert_eq!(code, 0, "eval {}: {err}", model.display());
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["perplexity"].as_f64().unwrap()
}

/// Measured 2026-12-02 (2-core Xeon): 53.25249595 → 53.25248537 (rel 2e-7), f32 rotated weights.
#[test]
fn rotation_keeps_the_fp_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("rotated");
    let demo = demo_model();
    let (code, _, err) = run(&["rotate", "--model", s(&demo), "--out", s(&out)]);
    assert_eq!(code, 0, "{err}");
    // SmolLM2's final norm is not all ones and its head is tied: the fold must untie it, and say so.
    assert!(err.contains("tie_word_embeddings: false"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert!(out.join("tokenizer.json").is_file());
    let (before, after) = (ppl(&demo), ppl(&out));
    let rel = (after - before).abs() / before;
    eprintln!("FP {before} rotated {after} (rel {rel:.1e})");
    assert!(rel < 1e-4, "rotated FP {after} vs {before} (rel {rel:.1e})");

    // transformers runs the rotated folder unchanged (no online transform) and agrees with our eval.
    let py = loaders_python("transformers");
    let text = texts_dir().join("moby-dick.txt");
    let args = ["--data", s(&text), "--seqlen", "512", "--max-windows", "4"];
    let row = common::check_loaders(&py, &args, &["transformers"], &[out.as_path()]).remove(0);
    let theirs = row["perplexity"]
        .as_f64()
        .unwrap_or_else(|| panic!("{row}"));
    let rel = (theirs - after).abs() / after;
    eprintln!("transformers on the rotated folder: {theirs} (rel {rel:.1e})");
    assert!(rel < 1e-3, "transformers {theirs} vs ours {after}");
}

/// BoA 3-bit per-channel, 4 × 256 calibration tokens of the speeches before 2000: with `--rotate` the
/// perplexity on Moby-Dick must be lower than without.
#[test]
fn rotated_boa_3bit_beats_unrotated() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = demo_model();
    let calib = sotu_speeches(|y| y < 2000);
    let mut results = Vec::new();
    for rotate in [false, true] {
        let out = tmp.path().join(format!("boa-{rotate}"));
        let mut a = vec![
            "run",
            "--model",
            s(&demo),
            "--method",
            "boa",
            "--wbits",
            "3",
            "--group-size",
            "-1",
            "--format",
            "fake",
            "--nsamples",
            "4",
            "--seqlen",
            "256",
            "--out",
            s(&out),
            "--quiet",
        ];
        if rotate {
            a.push("--rotate");
        }
        a.push("--calib");
        a.extend(calib.iter().map(|c| c.as_str()));
        let (code, _, err) = run(&a);
        assert_eq!(code, 0, "rotate {rotate}: {err}");
        // The rotated copy the run calibrated on is not part of the output.
        assert!(!out.join("rotated").exists());
        results.push(ppl(&out));
    }
    eprintln!(
        "BoA 3-bit: unrotated {}, rotated {}",
        results[0], results[1]
    );
    assert!(results[1] < results[0], "{results:?}");
}

#[test]
fn rotate_refuses_blocks_it_cannot_fold() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let cfg_path = m.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let out = tmp.path().join("out");
    for args in [
        vec!["rotate", "--model", s(&m), "--out", s(&out)],
        vec![
            "run",
            "--model",
            s(&m),
            "--method",
            "rtn",
            "--rotate",
            "--out",
            s(&out),
        ],
    ] {
        assert_user_error(&args, &["--rotate", "Qwen3ForCausalLM"]);
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
}
