//! Our packed GPTQ checkpoints as users load them: GPTQModel 7.7.0 (`GPTQModel.load`) and transformers 5.24
//! with optimum 2.3.0 (`from_pretrained`), in the venv of scripts/install_loaders.sh, through
//! scripts/check_loaders.py. Each must give `boa-cuda eval`'s perplexity on the same window. A missing venv
//! fails the test (scripts/test.sh installs it), never skips it.
//!
//! The demo model, RTN with the default layout (auto: groups of 64, the largest of 128/64/32 dividing
//! SmolLM2's d_in 576 and 1536, which GPTQModel's 4-bit CPU kernel takes; see `loader_warning`), at every
//! bit width in the default format and asymmetric grid, plus the symmetric 4-bit grid in the v1 format, plus
//! a rotated GPTQ 4-bit checkpoint (`run --rotate`: norms folded, Hadamard rotations fused into the weights,
//! lm_head untied; the loaders run it unchanged), plus two that quantize only blocks 0-2 (RTN 4-bit, and
//! GPTQ --avg-bits 2.5, whose widths GPTQModel reads from `dynamic` and transformers cannot: optimum 2.3 has
//! no `dynamic`, so it is loaded in GPTQModel only): eight checkpoints, fifteen loads.

mod common;

use common::{check_loader_ppl, check_loaders, demo_model, loaders_python, run, texts_dir};
use std::path::Path;

const SEQLEN: &str = "128";
const WINDOWS: &str = "1";
/// |Δppl| / ppl. transformers computes in the config's float32 but GPTQModel's TorchLinear dequantizes
/// through the f16 scales' dtype (measured ≤ 9e-4, README loader matrix); GPTQModel in float16 runs the
/// whole forward in f16 (measured ≤ 4e-3).
const TOL_F32: f64 = 2e-3;
const TOL_F16: f64 = 1e-2;
/// RTN at 2 bits is a broken model (ppl ~5e5), whose perplexity amplifies every rounding: measured 2.8e-3
/// (f32) and 9.5e-2 (f16) on 2026-12-02, where 3–8 bits agree to ≤ 7e-4.
const TOL_2BIT_F32: f64 = 5e-3;
const TOL_2BIT_F16: f64 = 1.5e-1;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ours(dir: &Path, text: &Path) -> f64 {
    common::eval_ppl(dir, text, SEQLEN, WINDOWS)
}

#[test]
fn gptq_checkpoints_load_in_gptqmodel_and_transformers() {
    let py = loaders_python("gptqmodel, optimum, transformers");
    let tmp = tempfile::tempdir().unwrap();
    let text = texts_dir().join("moby-dick.txt");
    // Min-max scales for the rotated GPTQ run: the Hessian-weighted search over 30 blocks triples its time,
    // and the loaders see the same layout either way.
    let mut rotated = vec![
        "--method",
        "gptq",
        "--wbits",
        "4",
        "--rotate",
        "--scale-search",
        "minmax",
        "--nsamples",
        "2",
        "--seqlen",
        "128",
        "--calib",
    ];
    let calib = common::sotu_speeches(|y| y < 1830);
    rotated.extend(calib.iter().map(String::as_str));
    let rtn = |extra: &'static [&'static str]| {
        let mut a = vec!["--method", "rtn"];
        a.extend_from_slice(extra);
        a
    };
    // --avg-bits over the first blocks: the other blocks stay unquantized, which `dynamic` says with a
    // "-:" rule per block (GPTQModel) and `modules_in_block_to_quantize` with full names (transformers).
    let mut avg = vec![
        "--method",
        "gptq",
        "--avg-bits",
        "2.5",
        "--layers",
        "0-2",
        "--nsamples",
        "2",
        "--seqlen",
        "128",
        "--calib",
    ];
    avg.extend(calib.iter().map(String::as_str));
    let variants: [(&str, Vec<&str>); 8] = [
        ("w4-layers-0-2", rtn(&["--wbits", "4", "--layers", "0-2"])),
        ("avg2.5-layers-0-2", avg),
        ("w2", rtn(&["--wbits", "2"])),
        ("w3", rtn(&["--wbits", "3"])),
        ("w4", rtn(&["--wbits", "4"])),
        ("w8", rtn(&["--wbits", "8"])),
        (
            "w4-sym-v1",
            rtn(&["--wbits", "4", "--sym", "--format", "gptq"]),
        ),
        ("rotated-gptq-w4", rotated),
    ];
    let model = demo_model();
    let mut dirs = Vec::new();
    for (name, extra) in &variants {
        let out = tmp.path().join(name);
        let mut a = vec!["run", "--model", s(&model), "--out", s(&out), "--quiet"];
        a.extend_from_slice(extra);
        let (code, _, err) = run(&a);
        assert_eq!(code, 0, "run {name}: {err}");
        assert!(!err.contains("warning:"), "{name}: {err}");
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["quantization_config"]["group_size"], 64, "{name}");
        if name.starts_with("rotated") {
            let rot = &cfg["boa_cuda"]["rotation"];
            assert_eq!(rot["kind"], "hadamard", "{name}: {cfg}");
            assert_eq!(cfg["tie_word_embeddings"], false, "{name}");
        }
        dirs.push(out);
    }
    // optimum 2.3 has no `dynamic`: transformers cannot load several widths (`run` says so).
    let (mixed, uniform): (Vec<_>, Vec<_>) = dirs
        .iter()
        .partition(|d| d.file_name().unwrap().to_str().unwrap().starts_with("avg"));
    let mut rows: Vec<serde_json::Value> = Vec::new();
    for (dirs, loaders) in [
        (&uniform, &["gptqmodel-f16", "transformers"][..]),
        (&mixed, &["gptqmodel-f16"][..]),
    ] {
        let args = [
            "--data",
            s(&text),
            "--seqlen",
            SEQLEN,
            "--max-windows",
            WINDOWS,
        ];
        let dirs: Vec<&Path> = dirs.iter().map(|d| d.as_path()).collect();
        rows.extend(check_loaders(&py, &args, loaders, &dirs));
    }
    let mut failures = Vec::new();
    for d in &dirs {
        let want = ours(d, &text);
        for r in rows.iter().filter(|r| r["dir"] == s(d)) {
            let loader = r["loader"].as_str().unwrap();
            let tol = match (loader == "transformers", d.ends_with("w2")) {
                (true, false) => TOL_F32,
                (false, false) => TOL_F16,
                (true, true) => TOL_2BIT_F32,
                (false, true) => TOL_2BIT_F16,
            };
            check_loader_ppl(&mut failures, d, r, "boa-cuda eval", want, tol);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Per-channel at 4 bits on the demo model (a group of 576 columns) is a layout GPTQModel's 4-bit CPU
/// kernel cannot run: the run says so before any work, in one line.
#[test]
fn per_channel_4bit_warns_about_cpu_loaders() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let (code, _, err) = run(&[
        "run",
        "--model",
        s(&demo_model()),
        "--out",
        s(&out),
        "--method",
        "rtn",
        "--group-size",
        "-1",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let w: Vec<&str> = err.lines().filter(|l| l.starts_with("warning:")).collect();
    assert_eq!(w.len(), 1, "{err}");
    assert!(
        w[0].contains("_weight_int4pack_mm_cpu") && w[0].contains("576"),
        "{err}"
    );
    // The input folder's other files travel with the checkpoint.
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f} not copied");
    }
}
