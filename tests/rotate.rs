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

/// BoA on the demo model, `wbits` bits with groups of `group` (-1 per-channel), 4 × 256 calibration tokens of
/// the speeches before 2000, `--format fake`, plus `extra`; the output folder `tmp/name` (asserted written)
/// and its config.json.
fn demo_boa(
    tmp: &Path,
    name: &str,
    wbits: &str,
    group: &str,
    extra: &[&str],
) -> (std::path::PathBuf, serde_json::Value) {
    let demo = demo_model();
    let calib = sotu_speeches(|y| y < 2000);
    let out = tmp.join(name);
    let mut a = vec![
        "run",
        "--model",
        s(&demo),
        "--method",
        "boa",
        "--wbits",
        wbits,
        "--group-size",
        group,
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
    a.extend_from_slice(extra);
    a.push("--calib");
    a.extend(calib.iter().map(|c| c.as_str()));
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "{name} {extra:?}: {err}");
    let cfg = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    (out, cfg)
}

/// The tiny model with its config.json changed by `edit` (what the refusals read before any work).
fn tiny_model_edited(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> std::path::PathBuf {
    let m = tiny_model(dir);
    let cfg_path = m.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    m
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
    let mut results = Vec::new();
    for (name, extra) in [("boa", &[][..]), ("boa-rotated", &["--rotate"][..])] {
        let (out, _) = demo_boa(tmp.path(), name, "3", "-1", extra);
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
    let m = tiny_model_edited(tmp.path(), |cfg| {
        cfg["architectures"] = serde_json::json!(["Gemma3ForCausalLM"])
    });
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
        assert_user_error(&args, &["--rotate", "Gemma3ForCausalLM"]);
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
}

/// `rotate --online` (QuaRot's R4, src/model/online.rs): the FP model with the online Hadamard before
/// down_proj is the same function in our eval; config.json's model_type makes transformers refuse the
/// folder, and GPTQModel a packed checkpoint quantized from it, instead of running either without the
/// transform; a second rotation and a GGUF output are refused.
#[test]
fn online_rotation_keeps_the_fp_model_and_other_loaders_refuse_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("r4");
    let demo = demo_model();
    let (code, stdout, err) = run(&["rotate", "--model", s(&demo), "--out", s(&out), "--online"]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("R4 1 of 1536 × 1536 online"), "{stdout}");
    assert!(err.contains("only boa-cuda runs this checkpoint"), "{err}");
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"], boa_cuda::model::online::MODEL_TYPE);
    assert_eq!(cfg["boa_cuda"]["online_hadamard"]["size"], 1536);
    assert_eq!(cfg["boa_cuda"]["online_hadamard"]["model_type"], "llama");
    let (before, after) = (ppl(&demo), ppl(&out));
    let rel = (after - before).abs() / before;
    eprintln!("FP {before} rotated with R4 {after} (rel {rel:.1e})");
    assert!(
        rel < 1e-4,
        "R4-rotated FP {after} vs {before} (rel {rel:.1e})"
    );
    // In blocks of 512 (I_3 ⊗ H_512): the fold and the forward read the same blocks.
    let blocks = tmp.path().join("r4-512");
    let (code, stdout, err) = run(&[
        "rotate",
        "--model",
        s(&demo),
        "--out",
        s(&blocks),
        "--online",
        "--online-block",
        "512",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("R4 3 of 512 × 512 online"), "{stdout}");
    let bcfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(blocks.join("config.json")).unwrap()).unwrap();
    assert_eq!(bcfg["boa_cuda"]["online_hadamard"]["block"], 512);
    let in_blocks = ppl(&blocks);
    let rel = (in_blocks - before).abs() / before;
    eprintln!("FP {before} rotated with R4 in blocks of 512 {in_blocks} (rel {rel:.1e})");
    assert!(
        rel < 1e-4,
        "R4-rotated (blocks of 512) FP {in_blocks} vs {before} (rel {rel:.1e})"
    );
    std::fs::remove_dir_all(&blocks).unwrap();

    // One block packed (RTN, seconds): the packed output keeps the mark, and our eval applies the transform.
    let packed = tmp.path().join("packed");
    let (code, _, err) = run(&[
        "run",
        "--model",
        s(&out),
        "--method",
        "rtn",
        "--wbits",
        "4",
        "--group-size",
        "64",
        "--layers",
        "0",
        "--format",
        "gptq_v2",
        "--out",
        s(&packed),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let packed_ppl = ppl(&packed);
    assert!(
        (packed_ppl - after).abs() / after < 0.05,
        "one RTN 4-bit block moved the R4 model's perplexity from {after} to {packed_ppl}"
    );
    let py = loaders_python("gptqmodel, transformers");
    for (dir, load) in [
        (
            &out,
            "import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])",
        ),
        (
            &packed,
            "import sys; from gptqmodel import GPTQModel; GPTQModel.load(sys.argv[1], device='cpu')",
        ),
    ] {
        let r = std::process::Command::new(&py)
            .args(["-c", load, s(dir)])
            .output()
            .unwrap();
        let load_err = String::from_utf8_lossy(&r.stderr);
        assert!(
            !r.status.success() && load_err.contains(boa_cuda::model::online::MODEL_TYPE),
            "{load}: should refuse {} by its model_type: {load_err}",
            dir.display()
        );
    }

    let again = tmp.path().join("again");
    assert_user_error(
        &["rotate", "--model", s(&out), "--out", s(&again)],
        &["already carries an online Hadamard"],
    );
    assert!(!again.exists());
    let q = tmp.path().join("q");
    for args in [
        vec![
            "run",
            "--model",
            s(&out),
            "--method",
            "rtn",
            "--format",
            "gguf",
        ],
        vec![
            "run",
            "--model",
            s(&demo),
            "--method",
            "rtn",
            "--rotate",
            "--rotate-online",
            "--format",
            "gguf",
        ],
    ] {
        let mut args = args.clone();
        args.extend(["--out", s(&q)]);
        assert_user_error(&args, &["cannot be written as GGUF"]);
        assert!(!q.exists(), "{args:?} wrote {}", q.display());
    }
}

/// BoA 2-bit g64, 4 × 256 calibration tokens of the speeches before 2000, both rotated: with R4 added
/// (`--rotate-online`) the perplexity on Moby-Dick must be lower than with R1 and R2 alone. The output
/// keeps the online marker, so our eval applies the transform.
#[test]
fn online_rotation_helps_boa_at_2_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let mut results = Vec::new();
    for (online, extra) in [
        (false, &["--rotate"][..]),
        (true, &["--rotate", "--rotate-online"][..]),
    ] {
        let (out, cfg) = demo_boa(tmp.path(), &format!("boa-{online}"), "2", "64", extra);
        assert_eq!(
            cfg["model_type"] == boa_cuda::model::online::MODEL_TYPE,
            online,
            "{cfg}"
        );
        results.push(ppl(&out));
    }
    eprintln!(
        "BoA 2-bit g64 rotated: without R4 {}, with R4 {}",
        results[0], results[1]
    );
    assert!(results[1] < results[0], "{results:?}");
}

/// An intermediate size with no block of 64 or more with a Hadamard construction here, a block that does not
/// divide it, and --rotate-online without --rotate, are refused before any work.
#[test]
fn online_rotation_refuses_what_it_cannot_build() {
    let tmp = tempfile::tempdir().unwrap();
    // 52 = 4 · 13: no Sylvester, Paley (prime q) or Kronecker construction.
    let m = tiny_model_edited(tmp.path(), |cfg| cfg["intermediate_size"] = 52.into());
    let out = tmp.path().join("out");
    assert_user_error(
        &["rotate", "--model", s(&m), "--out", s(&out), "--online"],
        &["--rotate-online", "the MLP width 52", "the largest is 4"],
    );
    assert_user_error(
        &[
            "run",
            "--model",
            s(&m),
            "--method",
            "rtn",
            "--rotate",
            "--rotate-online",
            "--out",
            s(&out),
        ],
        &["--rotate-online", "the MLP width 52", "the largest is 4"],
    );
    assert_user_error(
        &[
            "rotate",
            "--model",
            s(&m),
            "--out",
            s(&out),
            "--online",
            "--online-block",
            "8",
        ],
        &[
            "--rotate-online-block 8",
            "does not divide the MLP width 52",
        ],
    );
    assert!(!out.exists());
    let (code, _, err) = run(&[
        "run",
        "--model",
        s(&m),
        "--method",
        "rtn",
        "--rotate-online",
        "--out",
        s(&out),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--rotate"), "{err}");
}
