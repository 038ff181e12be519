//! `run --format gguf` as its users load it. transformers 5.24 (`from_pretrained(DIR, gguf_file=…)`, in the
//! pyref venv of scripts/install_pyref.sh with the `gguf` package, whose dequantizer transformers uses, and
//! transformers' own undoing of llama.cpp's q/k row permutation) must give back, bit for bit, the weights of
//! the same run written as `--format fake`, and `boa-cuda eval`'s perplexity of that folder; our own
//! import-gguf must too; and llama.cpp itself (llama-cpp-python, scripts/install_llamacpp.sh, through
//! scripts/llamacpp_ppl.py: its tokenizer, its kernels) the same perplexity up to its Q8_0 activations. A
//! missing venv fails the test (scripts/test.sh installs them), never skips it.
//!
//! Three runs of the demo model, each written in both formats:
//!   mixed    GPTQ with --avg-bits 6 over 4 and 8 bits (Q4_0 and Q8_0 tensors in one file) on layers 0-3,
//!            the other layers' linears copied through as F32 tensors;
//!   q8       RTN at 8 bits (Q8_0) on every layer;
//!   rotated  `run --rotate` (norms folded, Hadamard rotations fused into the weights, lm_head untied into
//!            its own `output.weight`), BoA at 4 bits (Q4_0) on layers 0-1, the rest rotated F32.

mod common;

use boa_cuda::model::gguf::{GgmlType, GgufFile};
use common::{
    assert_user_error, check_loader_ppl, demo_model, llamacpp_python, pyref_python, run, texts_dir,
};
use std::path::{Path, PathBuf};
use std::process::Command;

const SEQLEN: &str = "128";
const WINDOWS: &str = "2";
/// |Δppl| / ppl between transformers' float32 forward and ours on identical weights (the forwards'
/// summation orders differ; tests/transformers_parity.rs measures ~1e-5 on the demo model).
const TOL: f64 = 1e-4;
/// llama.cpp's CPU kernels round the activations to Q8_0 before every Q4_0/Q8_0 product, so its
/// perplexity is not an f32 forward's (scripts/llamacpp_ppl.py keeps the KV cache in f32: llama.cpp's default
/// f16 cache alone added 8.6e-3 on `q8`). Measured 2026-12-03 (llama-cpp-python 0.3.36, 2 cores): 1.4e-3
/// relative for `mixed` (28 quantized linears), 4.0e-3 for `q8` (210), on these 2 × 128 tokens; 8.8e-4 for
/// RTN 8-bit on layer 0 alone (7 Q8_0 linears, the rest F32). A wrong tokenizer or q/k permutation moves it
/// by orders of magnitude.
const TOL_LLAMA_CPP: f64 = 1e-2;
/// llama.cpp's F32 forward of a Gemma 3 file against ours: ggml's CPU GELU reads a table indexed by the
/// input rounded to f16 (GGML_GELU_FP16), so even all-F32 weights leave ~1e-4 (measured 6.0e-5 on the random
/// gemma3_gguf here; on the real Gemma 3 270M 1.7e-4 for our file and 3.2e-4 for the original file,
/// tests/gemma3_gguf.rs).
const TOL_GELU_F16: f64 = 1e-3;
/// The same on the random mixture-of-experts models, whose near-tied router logits let the Q8_0 activations
/// flip a token's experts: measured 2.0e-3 to 7.8e-3 at Q4_0 and up to 1.6e-2 at Q8_0 (Mixtral, GPTQ 8-bit),
/// while the same files dequantized to F32 give eval's perplexity to 2e-7.
const TOL_LLAMA_CPP_MOE: f64 = 5e-2;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Removes a variant's folders and files once it is checked: each holds a float32-sized copy of its model
/// (0.5 GB for the demo model), and all of them at once (8.5 GB) overfill a CI machine's disk.
fn remove_all(paths: &[&Path]) {
    for p in paths {
        if p.is_dir() {
            std::fs::remove_dir_all(p).unwrap();
        } else if p.exists() {
            std::fs::remove_file(p).unwrap();
        }
    }
}

/// Held by each test that writes float32-sized copies of the demo model for its whole run: 1.8 and 1.7 GB of
/// temporary files at their peaks, side by side 3.5 GB.
static DEMO_MODEL_COPIES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn ours(dir: &Path, text: &Path) -> f64 {
    common::eval_ppl(dir, text, SEQLEN, WINDOWS)
}

/// The last stdout line of a script that succeeded, as JSON (its result row).
fn last_json(o: &std::process::Output, script: &str) -> serde_json::Value {
    assert!(
        o.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

fn quantize(out: &Path, format: &str, extra: &[&str]) {
    quantize_model(&demo_model(), out, format, extra);
}

fn quantize_model(model: &Path, out: &Path, format: &str, extra: &[&str]) {
    let mut a = vec![
        "run",
        "--model",
        s(model),
        "--out",
        s(out),
        "--format",
        format,
        "--quiet",
    ];
    a.extend_from_slice(extra);
    if format == "fake" {
        // What --format gguf implies.
        a.extend_from_slice(&["--sym", "--group-size", "32", "--signed-scales"]);
    }
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "run {}: {err}", out.display());
}

#[test]
fn gguf_checkpoints_load_in_transformers_with_the_fake_formats_weights() {
    let _one = DEMO_MODEL_COPIES.lock().unwrap_or_else(|e| e.into_inner());
    let py = pyref_python("gguf, transformers");
    let llama = llamacpp_python("llama_cpp, numpy");
    let tmp = tempfile::tempdir().unwrap();
    let text = texts_dir().join("moby-dick.txt");
    let calib = common::sotu_speeches(|y| y < 1830);
    let mut mixed: Vec<&str> = vec![
        "--method",
        "gptq",
        "--avg-bits",
        "6",
        "--bit-choices",
        "4,8",
        "--layers",
        "0-3",
        "--nsamples",
        "4",
        "--seqlen",
        "128",
        "--calib",
    ];
    mixed.extend(calib.iter().map(String::as_str));
    let mut rotated: Vec<&str> = vec![
        "--method",
        "boa",
        "--wbits",
        "4",
        "--rotate",
        "--layers",
        "0-1",
        "--nsamples",
        "2",
        "--seqlen",
        "128",
        "--calib",
    ];
    rotated.extend(calib.iter().map(String::as_str));
    let variants: [(&str, &[&str]); 3] = [
        ("mixed", &mixed),
        ("q8", &["--method", "rtn", "--wbits", "8"]),
        ("rotated", &rotated),
    ];
    let mut failures = Vec::new();
    for (name, extra) in variants {
        let out = tmp.path().join(name);
        let fake = tmp.path().join(format!("{name}-fake"));
        quantize(&out, "gguf", extra);
        quantize(&fake, "fake", extra);
        // The folder holds the file and the report, nothing a loader could mistake for a checkpoint.
        let mut files: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(files, ["model.gguf", "report.json"], "{name}");
        // eval (and run, inspect: all open a folder the same way) names the conversion instead.
        for m in [out.clone(), out.join("model.gguf")] {
            assert_user_error(
                &["eval", "--model", s(&m), "--data", s(&text)],
                &["GGUF", "import-gguf"],
            );
        }

        let g = GgufFile::open(&out.join("model.gguf")).unwrap();
        let ty = |t: &str| {
            g.tensor(t)
                .unwrap_or_else(|| panic!("{name}: no {t}"))
                .ggml_type
        };
        assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
        assert_eq!(ty("token_embd.weight"), GgmlType::F32); // the demo model is f32
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for l in report["layers"].as_array().unwrap() {
            for lin in l["linears"].as_array().unwrap() {
                let bits = lin["bits"].as_u64().unwrap();
                let part = match lin["name"].as_str().unwrap() {
                    "self_attn.q_proj" => "attn_q",
                    "self_attn.k_proj" => "attn_k",
                    "self_attn.v_proj" => "attn_v",
                    "self_attn.o_proj" => "attn_output",
                    "mlp.gate_proj" => "ffn_gate",
                    "mlp.up_proj" => "ffn_up",
                    "mlp.down_proj" => "ffn_down",
                    other => panic!("{other}"),
                };
                let want = if bits == 4 {
                    GgmlType::Q4_0
                } else {
                    GgmlType::Q8_0
                };
                assert_eq!(ty(&format!("blk.{}.{part}.weight", l["layer"])), want);
                seen.insert(bits);
            }
        }
        if name == "rotated" {
            // SmolLM2 ties its head; the folded final norm made it differ from the embedding.
            assert_eq!(ty("output.weight"), GgmlType::F32, "untied lm_head");
            assert_eq!(ty("blk.1.attn_q.weight"), GgmlType::Q4_0);
            assert_eq!(ty("blk.2.attn_q.weight"), GgmlType::F32);
        }
        if name == "mixed" {
            assert_eq!(seen, [4, 8].into(), "the allocation should use both widths");
            assert_eq!(
                ty("blk.4.attn_q.weight"),
                GgmlType::F32,
                "unquantized layer"
            );
        }

        let want = ours(&fake, &text);
        // Our own reader: import-gguf, then eval.
        let imported = tmp.path().join(format!("{name}-imported"));
        let (code, _, err) = run(&[
            "import-gguf",
            s(&out.join("model.gguf")),
            "--out",
            s(&imported),
        ]);
        assert_eq!(code, 0, "import-gguf {name}: {err}");
        let back = ours(&imported, &text);
        remove_all(&[&imported]);
        assert!(
            (back - want).abs() <= 1e-9 * want,
            "{name}: import-gguf + eval {back} vs the fake folder's {want}"
        );

        let tokenizer = demo_model();
        let args = [
            "--data",
            s(&text),
            "--seqlen",
            SEQLEN,
            "--max-windows",
            WINDOWS,
            "--tokenizer",
            s(&tokenizer),
            "--weights-like=-fake",
        ];
        let row = common::check_loaders(&py, &args, &["transformers-gguf"], &[&out]).remove(0);
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            TOL,
        );
        // 30 layers × 7 linears, every one equal to the fake format's to the bit.
        assert_eq!(row["compared"], 210, "{name}: {row}");
        assert_eq!(row["max_abs_diff"], 0.0, "{name}: {row}");

        // llama.cpp itself: its own tokenizer from the file's vocabulary, its own Q4_0/Q8_0 kernels.
        let row = llamacpp_ppl(&llama, &out.join("model.gguf"), &text, SEQLEN, WINDOWS);
        assert_eq!(
            row["windows"],
            WINDOWS.parse::<u64>().unwrap(),
            "{name}: {row}"
        );
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            TOL_LLAMA_CPP,
        );
        remove_all(&[&out, &fake]);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `--gguf-type`: every GGUF type we write, in five small runs that together hold all ten (llama.cpp's
/// fallbacks on the demo model's 576-wide inputs included). For each: the `gguf` package's dequantizer
/// (scripts/check_gguf_weights.py) gives the `--format fake` twin's weights to the bit, i.e. the file holds the
/// very values the sweep's error feedback worked on; llama.cpp's own quantizer, given our file with the same
/// choice (scripts/llamacpp_quantize.py --requantize), picks the same type for every linear; and one file
/// through llama.cpp's forward and our import-gguf gives the twin's perplexity.
#[test]
fn gguf_type_files_hold_the_sweeps_weights_in_llama_cpps_types() {
    let _one = DEMO_MODEL_COPIES.lock().unwrap_or_else(|e| e.into_inner());
    let py = pyref_python("gguf, numpy, safetensors");
    let llama = llamacpp_python("llama_cpp, numpy");
    let tmp = tempfile::tempdir().unwrap();
    let text = texts_dir().join("moby-dick.txt");
    let calib = common::sotu_speeches(|y| y < 1830);
    let mut with_calib: Vec<&str> = vec!["--nsamples", "4", "--seqlen", "128", "--calib"];
    with_calib.extend(calib.iter().map(String::as_str));
    // (choice, method, layers, the types its quantized linears must hold between them)
    let variants: [(&str, &str, &str, &[&str]); 5] = [
        ("q4_k_m", "gptq", "0-0", &["Q5_0", "Q8_0", "Q6_K"]),
        (
            "q3_k_m",
            "boa",
            "0-1",
            &["Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K"],
        ),
        // Pure Q2_K: llama.cpp makes its Q2_K_S preset only with an importance matrix.
        ("q2_k", "rtn", "0-0", &["Q4_0", "Q2_K"]),
        ("q3_k_s", "rtn", "0-0", &["Q4_0", "Q3_K"]),
        ("q4_1", "rtn", "0-0", &["Q4_1"]),
    ];
    let model = demo_model();
    let mut failures = Vec::new();
    for (choice, method, layers, types) in variants {
        let out = tmp.path().join(choice);
        let fake = tmp.path().join(format!("{choice}-fake"));
        for (dir, format) in [(&out, "gguf"), (&fake, "fake")] {
            let mut a = vec![
                "run",
                "--model",
                s(&model),
                "--out",
                s(dir),
                "--format",
                format,
                "--gguf-type",
                choice,
                "--method",
                method,
                "--layers",
                layers,
                "--quiet",
            ];
            if method != "rtn" {
                a.extend_from_slice(&with_calib);
            }
            let (code, _, err) = run(&a);
            assert_eq!(code, 0, "run {choice} {format}: {err}");
        }
        let file = out.join("model.gguf");
        let row = gguf_weights(&py, &file, &fake);
        let n_layers = layers
            .split_once('-')
            .map(|(a, b)| b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap() + 1)
            .unwrap();
        assert_eq!(
            row["compared"],
            7 * n_layers,
            "{choice}: {}",
            row["compared"]
        );
        assert_eq!(row["mismatched"], serde_json::json!([]), "{choice}");
        assert_eq!(row["max_abs_diff"], 0.0, "{choice}");
        let our_types = row["types"].as_object().unwrap();
        let mut held: Vec<&str> = our_types
            .values()
            .filter_map(|v| v.as_str())
            .filter(|t| !t.starts_with('F'))
            .collect();
        held.sort();
        held.dedup();
        let mut want = types.to_vec();
        want.sort();
        assert_eq!(held, want, "{choice}: the types of its quantized linears");

        // llama.cpp's choice of type for every linear of the quantized layers.
        let theirs = tmp.path().join(format!("{choice}-llama.gguf"));
        llamacpp_requantize(&llama, &file, &theirs, choice);
        let g = GgufFile::open(&theirs).unwrap();
        for (name, ty) in our_types {
            let ty = ty.as_str().unwrap();
            if ty.starts_with('F') {
                continue; // a layer outside --layers
            }
            let t = g.tensor(name).unwrap().ggml_type.to_string();
            if t != ty {
                failures.push(format!("{choice}: {name} is {ty} here, {t} in llama.cpp's"));
            }
        }

        if choice == "q3_k_m" {
            let want = ours(&fake, &text);
            let imported = tmp.path().join(format!("{choice}-imported"));
            let (code, _, err) = run(&["import-gguf", s(&file), "--out", s(&imported)]);
            assert_eq!(code, 0, "import-gguf {choice}: {err}");
            let back = ours(&imported, &text);
            remove_all(&[&imported]);
            assert!(
                (back - want).abs() <= 1e-9 * want,
                "{choice}: import-gguf + eval {back} vs the fake folder's {want}"
            );
            let row = llamacpp_ppl(&llama, &file, &text, SEQLEN, WINDOWS);
            check_loader_ppl(
                &mut failures,
                &out,
                &row,
                "eval of the fake folder",
                want,
                TOL_LLAMA_CPP,
            );
        }
        remove_all(&[&out, &fake, &theirs]);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn gguf_refusals_come_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo_model();
    let out = tmp.path().join("q");
    let calib = texts_dir().join("moby-dick.txt");
    let base = [
        "run",
        "--model",
        s(&model),
        "--out",
        s(&out),
        "--format",
        "gguf",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|a| a.to_string()).collect()
    };
    let check = |extra: &[&str], needles: &[&str]| {
        let a = with(extra);
        assert_user_error(&a.iter().map(String::as_str).collect::<Vec<_>>(), needles);
    };
    check(
        &["--method", "rtn", "--wbits", "3"],
        &["gguf", "3-bit", "K-quants"],
    );
    check(
        &["--method", "rtn", "--group-size", "64"],
        &["gguf", "32", "64"],
    );
    check(
        &["--method", "rtn", "--group-size", "-1"],
        &["gguf", "per-channel"],
    );
    check(
        &["--method", "gptq", "--act-order", "--calib", s(&calib)],
        &["--act-order", "gguf"],
    );
    check(
        &[
            "--method",
            "rtn",
            "--avg-bits",
            "3",
            "--bit-choices",
            "2,4",
            "--calib",
            s(&calib),
        ],
        &["gguf", "2-bit"],
    );
    // --gguf-type: the type decides widths, groups and symmetry; its grids are the CPU's.
    check(
        &["--gguf-type", "q4_k", "--method", "rtn", "--sym"],
        &["--gguf-type q4_k", "--sym"],
    );
    check(
        &["--gguf-type", "q4_k", "--method", "rtn", "--device", "cuda"],
        &["--gguf-type q4_k", "--device cpu"],
    );
    check(
        &[
            "--gguf-type",
            "q4_k",
            "--method",
            "gptq",
            "--static-groups",
            "--calib",
            s(&calib),
        ],
        &["--static-groups", "--gguf-type"],
    );
    check(&["--gguf-type", "q9_k"], &["--gguf-type q9_k", "q4_k_m"]);
    assert_user_error(
        &[
            "run",
            "--model",
            s(&model),
            "--out",
            s(&out),
            "--gguf-type",
            "q4_k",
            "--method",
            "rtn",
        ],
        &["--gguf-type q4_k", "--format gguf"],
    );
    // A sliding window llama.cpp's llama architecture would not apply, and a folder without its tokenizer.
    let mistral = tmp.path().join("mistral");
    copy_dir(&model, &mistral);
    let cfg_path = mistral.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    cfg["model_type"] = serde_json::json!("mistral");
    cfg["sliding_window"] = serde_json::json!(256);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_user_error(
        &[
            "run",
            "--model",
            s(&mistral),
            "--out",
            s(&out),
            "--format",
            "gguf",
            "--method",
            "rtn",
        ],
        &["gguf", "slides over 256", "\"llama\""],
    );
    let untokenized = tmp.path().join("untokenized");
    copy_dir(&model, &untokenized);
    std::fs::remove_file(untokenized.join("tokenizer.json")).unwrap();
    assert_user_error(
        &[
            "run",
            "--model",
            s(&untokenized),
            "--out",
            s(&out),
            "--format",
            "gguf",
            "--method",
            "rtn",
        ],
        &["tokenizer.json", "gguf"],
    );
    assert!(!out.exists(), "a refused run wrote {}", out.display());
}

/// Qwen2 (q/k/v biases; NEOX RoPE, so no q/k row permutation) and Qwen3 (per-head q/k norms, head_dim 32 ≠
/// hidden / heads) as llama.cpp's "qwen2" and "qwen3": small random models of each, built by transformers'
/// `from_config` (scripts/hf_reference.py, as tests/transformers_parity.rs builds them), BoA at 4 bits (Q4_0)
/// and RTN at 8 bits (Q8_0), each also written as `--format fake`. The `gguf` package's dequantizer must give
/// the fake twin's linears to the bit, import-gguf + eval its perplexity, transformers' GGUF loading both (on
/// the Qwen3 whose head_dim is 128: transformers 5.24 ignores the file's key_length for qwen3), llama.cpp the
/// same perplexity up to its Q8_0 activations, and to f32 rounding on the file dequantized to F32
/// (scripts/gguf_to_f32.py). Llama 3.1-style rope scaling (hf_reference.py's llama3, BoA Q4_0) goes as the
/// rope_freqs tensor: llama.cpp and import-gguf (which recovers rope_scaling from it) must agree with the fake
/// twin too. Gemma 3 as llama.cpp's "gemma3" (hf_reference.py's gemma3_gguf: five local layers with a 24-token
/// window, then a global one with linear RoPE scaling; norms stored as w + 1): the same checks, the F32 twin to
/// TOL_GELU_F16. Mistral's sliding window and a Gemma 3 whose local/global layers are not llama.cpp's every-6th
/// pattern are refused before work.
#[test]
fn gguf_qwen2_and_qwen3_load_in_transformers_and_llama_cpp() {
    let (py, llama, tmp, text) = random_model_setup(&[
        "qwen2",
        "qwen3",
        "qwen3_hd128",
        "llama3",
        "mistral",
        "gemma3",
        "gemma3_gguf",
    ]);
    let (seqlen, windows) = ("64", "2");
    let boa: Vec<&str> = vec![
        "--method",
        "boa",
        "--wbits",
        "4",
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--calib",
        s(&text),
    ];
    let rtn8: &[&str] = &["--method", "rtn", "--wbits", "8"];
    // (model, its llama.cpp architecture, run, whether transformers can load it: its GGUF loader takes
    // Qwen3's head_dim from Qwen3Config's default, 128, not from the file, so the 32-wide heads fail there).
    // Llama 3.1's rope scaling travels as rope_freqs, which transformers' GGUF loader does not read.
    let cases: [(&str, &str, &str, &[&str], bool); 7] = [
        ("qwen2", "qwen2", "q4", &boa, true),
        ("qwen2", "qwen2", "q8", rtn8, true),
        ("qwen3", "qwen3", "q4", &boa, false),
        ("qwen3", "qwen3", "q8", rtn8, false),
        ("qwen3_hd128", "qwen3", "q4", &boa, true),
        ("llama3", "llama", "q4", &boa, false),
        ("gemma3_gguf", "gemma3", "q4", &boa, false),
    ];
    let mut failures = Vec::new();
    for (name, arch, tag, extra, transformers) in cases {
        let model = tmp.path().join(name);
        let ty = if tag == "q4" {
            GgmlType::Q4_0
        } else {
            GgmlType::Q8_0
        };
        let out = tmp.path().join(format!("{name}-{tag}"));
        let fake = tmp.path().join(format!("{name}-{tag}-fake"));
        quantize_model(&model, &out, "gguf", extra);
        quantize_model(&model, &fake, "fake", extra);
        let file = out.join("model.gguf");
        let g = GgufFile::open(&file).unwrap();
        assert_eq!(
            g.get_str("general.architecture").unwrap(),
            Some(arch),
            "{name}"
        );
        let ty_of = |t: &str| {
            g.tensor(t)
                .unwrap_or_else(|| panic!("{name}: no {t}"))
                .ggml_type
        };
        assert_eq!(ty_of("blk.1.attn_q.weight"), ty, "{name}");
        assert_eq!(ty_of("blk.1.ffn_down.weight"), ty, "{name}");
        let own: &[&str] = match arch {
            "qwen2" => &["attn_q.bias", "attn_k.bias", "attn_v.bias"],
            "qwen3" => &["attn_q_norm.weight", "attn_k_norm.weight"],
            "gemma3" => &[
                "attn_q_norm.weight",
                "attn_k_norm.weight",
                "post_attention_norm.weight",
                "ffn_norm.weight",
                "post_ffw_norm.weight",
            ],
            _ => &[],
        };
        for t in own {
            assert_eq!(ty_of(&format!("blk.0.{t}")), GgmlType::F32, "{name}");
        }
        if name == "llama3" {
            // factor 8 for the long wavelengths, 1 for the short ones (head_dim 16: 8 divisors).
            assert_eq!(ty_of("rope_freqs.weight"), GgmlType::F32);
            let t = g.tensor("rope_freqs.weight").unwrap();
            let f: Vec<f32> = g
                .tensor_data(t)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!((f.len(), f[0], f[7]), (8, 1.0, 8.0), "{f:?}");
        }
        if name == "qwen3" {
            assert_eq!(g.get_u64("qwen3.attention.key_length").unwrap(), Some(32));
        }

        // The `gguf` package's dequantizer: every linear equal to the fake twin's, no rows permuted.
        let row = gguf_weights(&py, &file, &fake);
        let linears = if arch == "gemma3" { 6 * 7 } else { 2 * 7 };
        assert_eq!(row["compared"], linears, "{name} {tag}: {row}");
        assert_eq!(row["mismatched"], serde_json::json!([]), "{name} {tag}");

        let want = common::eval_ppl(&fake, &text, seqlen, windows);
        let imported = tmp.path().join(format!("{name}-{tag}-imported"));
        let (code, _, err) = run(&["import-gguf", s(&file), "--out", s(&imported)]);
        assert_eq!(code, 0, "import-gguf {name} {tag}: {err}");
        let back = common::eval_ppl(&imported, &text, seqlen, windows);
        assert!(
            (back - want).abs() <= 1e-9 * want,
            "{name} {tag}: import-gguf + eval {back} vs the fake folder's {want}"
        );

        if transformers {
            let args = [
                "--data",
                s(&text),
                "--seqlen",
                seqlen,
                "--max-windows",
                windows,
                "--tokenizer",
                s(&model),
                "--weights-like=-fake",
            ];
            let row = common::check_loaders(&py, &args, &["transformers-gguf"], &[&out]).remove(0);
            check_loader_ppl(
                &mut failures,
                &out,
                &row,
                "eval of the fake folder",
                want,
                TOL,
            );
            assert_eq!(row["compared"], 14, "{name} {tag}: {row}");
            assert_eq!(row["max_abs_diff"], 0.0, "{name} {tag}: {row}");
        }

        let row = llamacpp_ppl(&llama, &file, &text, seqlen, windows);
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            TOL_LLAMA_CPP,
        );
        // Without llama.cpp's Q8_0 activations (every tensor dequantized to F32): f32 rounding only.
        let f32_file = f32_twin(
            &py,
            &file,
            tmp.path().join(format!("{name}-{tag}-f32.gguf")),
        );
        let row = llamacpp_f32_ppl(&llama, &f32_file, &text, seqlen, windows);
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            if arch == "gemma3" { TOL_GELU_F16 } else { TOL },
        );
    }
    let out = tmp.path().join("refused");
    // Llama 3.1's rope scaling on a Qwen2: llama.cpp's qwen2 reads no rope_freqs.
    let scaled = tmp.path().join("qwen2_scaled");
    copy_dir(&tmp.path().join("qwen2"), &scaled);
    let cfg_path = scaled.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 1000000.0,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32});
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    for (arch, needles) in [
        ("mistral", ["gguf", "slides over 40"]),
        ("gemma3", ["gguf", "every 6th layer global"]),
        (
            "qwen2_scaled",
            ["rope_scaling", "\"qwen2\" architecture reads no rope_freqs"],
        ),
    ] {
        let model = tmp.path().join(arch);
        assert_gguf_refused(&model, &out, &needles);
    }
    assert!(!out.exists(), "a refused run wrote {}", out.display());
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Mixture-of-experts models as llama.cpp stores them: each layer's experts of one part in one
/// `ffn_{gate,up,down}_exps` tensor [n_expert × d_out × d_in], the router `ffn_gate_inp` in F32, Qwen2-MoE's
/// shared expert (`ffn_*_shexp`) and its gate (`ffn_gate_inp_shexp`, a [d] vector). Random Qwen3-MoE, Qwen2-MoE
/// and Mixtral models (scripts/hf_reference.py: the first two with the top-k weighting llama.cpp hard-codes for
/// their architectures), GPTQ at 4 bits (Q4_0), each also as `--format fake`: the `gguf` package's dequantizer
/// gives every expert's weights bit for bit; llama.cpp on the same file dequantized to F32
/// (scripts/gguf_to_f32.py) gives the fake twin's perplexity to f32 rounding, and on the file itself the same
/// up to its Q8_0 activations, which on these random routers also flip some tokens' top-2 experts.
/// import-gguf reads each file back (experts unstacked, the router's weighting llama.cpp applies written as
/// norm_topk_prob) to the fake twin's perplexity. A weighting llama.cpp would not apply is refused before work.
#[test]
fn gguf_moe_models_run_in_llama_cpp() {
    let (py, llama, tmp, text) = random_model_setup(&[
        "qwen3_moe_gguf",
        "qwen2_moe_gguf",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
    ]);
    let (seqlen, windows) = ("64", "2");
    let gptq = [
        "--method",
        "gptq",
        "--wbits",
        "4",
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--calib",
        s(&text),
    ];
    let mut failures = Vec::new();
    // (model, llama.cpp architecture, experts, expert width, layers quantized, linears the gguf package
    // compares); with `--layers 1`, layer 0's experts are stacked in the checkpoint's float type.
    for (name, arch, n_exp, d_exp, layers, linears) in [
        ("qwen3_moe_gguf", "qwen3moe", 4u64, 64u64, "0-1", 32),
        ("qwen2_moe_gguf", "qwen2moe", 4, 32, "0-1", 38),
        ("qwen2_moe_gguf", "qwen2moe", 4, 32, "1", 19),
        ("mixtral", "llama", 4, 96, "0-1", 32),
    ] {
        let model = tmp.path().join(name);
        let out = tmp.path().join(format!("{name}-q4-{layers}"));
        let fake = tmp.path().join(format!("{name}-q4-{layers}-fake"));
        let mut run_args = gptq.to_vec();
        run_args.extend(["--layers", layers]);
        quantize_model(&model, &out, "gguf", &run_args);
        quantize_model(&model, &fake, "fake", &run_args);
        let file = out.join("model.gguf");
        let g = GgufFile::open(&file).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), Some(arch));
        assert_eq!(
            g.get_u64(&format!("{arch}.expert_count")).unwrap(),
            Some(n_exp)
        );
        assert_eq!(
            g.get_u64(&format!("{arch}.expert_used_count")).unwrap(),
            Some(2)
        );
        let t = |n: &str| g.tensor(n).unwrap_or_else(|| panic!("{name}: no {n}"));
        for part in ["gate", "up", "down"] {
            let e = t(&format!("blk.1.ffn_{part}_exps.weight"));
            assert_eq!(e.ggml_type, GgmlType::Q4_0, "{name} {part}");
            let want = if part == "down" {
                [d_exp, 64, n_exp]
            } else {
                [64, d_exp, n_exp]
            };
            assert_eq!(e.dims, want, "{name} {part}");
        }
        let router = t("blk.0.ffn_gate_inp.weight");
        assert_eq!(
            (router.ggml_type, router.dims.clone()),
            (GgmlType::F32, vec![64, n_exp])
        );
        if arch == "qwen2moe" {
            assert_eq!(t("blk.1.ffn_up_shexp.weight").ggml_type, GgmlType::Q4_0);
            assert_eq!(t("blk.0.ffn_gate_inp_shexp.weight").dims, vec![64]);
        }
        if layers == "1" {
            // The random models are f32.
            assert_eq!(t("blk.0.ffn_gate_exps.weight").ggml_type, GgmlType::F32);
            assert_eq!(t("blk.0.ffn_up_shexp.weight").ggml_type, GgmlType::F32);
        }

        let row = gguf_weights(&py, &file, &fake);
        assert_eq!(row["compared"], linears, "{name}: {row}");
        assert_eq!(row["mismatched"], serde_json::json!([]), "{name}");

        let want = common::eval_ppl(&fake, &text, seqlen, windows);
        let row = llamacpp_ppl(&llama, &file, &text, seqlen, windows);
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            TOL_LLAMA_CPP_MOE,
        );
        // The same file with every tensor dequantized to F32: llama.cpp's forward without its Q8_0
        // activations, so the layout, the router's weighting and the shared expert are checked to f32.
        let f32_file = f32_twin(
            &py,
            &file,
            tmp.path().join(format!("{name}-{layers}-f32.gguf")),
        );
        let row = llamacpp_f32_ppl(&llama, &f32_file, &text, seqlen, windows);
        check_loader_ppl(
            &mut failures,
            &out,
            &row,
            "eval of the fake folder",
            want,
            TOL,
        );
        // import-gguf unstacks the experts again: the fake twin's perplexity.
        let imported = tmp.path().join(format!("{name}-{layers}-imported"));
        let (code, _, err) = run(&["import-gguf", s(&file), "--out", s(&imported)]);
        assert_eq!(code, 0, "import-gguf {name} {layers}: {err}");
        let back = common::eval_ppl(&imported, &text, seqlen, windows);
        assert!(
            (back - want).abs() <= 1e-9 * want,
            "{name} {layers}: import-gguf + eval {back} vs the fake folder's {want}"
        );
    }
    let out = tmp.path().join("refused");
    for (name, needle) in [
        ("qwen3_moe", "always renormalizes"),
        ("qwen2_moe", "never renormalizes"),
    ] {
        assert_gguf_refused(&tmp.path().join(name), &out, &["gguf", needle]);
    }
    assert!(!out.exists(), "a refused run wrote {}", out.display());
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `--gguf-type` on mixtures of experts: every preset llama.cpp makes without an importance matrix, on random
/// K-quant-sized Mixtral and Qwen2-MoE with 8 experts (llama.cpp's Mixtral rules: attn_k and attn_v Q8_0,
/// attn_output Q5_K but in Q3_K_L) and a Qwen3-MoE with 4 (its dense rules), RTN, and Q4_K_M also with GPTQ.
/// llama.cpp's quantizer, given our file (`--requantize`), picks the type we wrote for every tensor of every
/// block; the `gguf` package's dequantizer gives the GPTQ file's linears as the fake twin has them, and
/// llama.cpp on its F32 twin the fake twin's perplexity to f32 rounding.
#[test]
fn gguf_type_presets_on_mixtures_of_experts_match_llama_cpp() {
    let (py, llama, tmp, text) =
        random_model_setup(&["mixtral_kq", "qwen2_moe_kq", "qwen3_moe_kq"]);
    let (seqlen, windows) = ("64", "2");
    let presets = [
        "q2_k_mix", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
    ];
    let mut failures = Vec::new();
    // (model, linears the gguf package compares: 4 layers × (4 attention + 3 per expert + 3 shared), GGUF
    // tensors of the blocks: 4 × (2 norms, 4 attention, router, 3 stacked experts; Qwen2-MoE's biases, shared
    // expert and its gate; Qwen3-MoE's q/k norms))
    for (name, linears, blk_tensors) in [
        ("mixtral_kq", 112, 40),
        ("qwen2_moe_kq", 124, 68),
        ("qwen3_moe_kq", 64, 48),
    ] {
        let model = tmp.path().join(name);
        let gptq = [
            "--method",
            "gptq",
            "--gguf-type",
            "q4_k_m",
            "--nsamples",
            "4",
            "--seqlen",
            "64",
            "--calib",
            s(&text),
        ];
        let mut runs: Vec<(String, Vec<&str>)> = presets
            .iter()
            .map(|&p| {
                (
                    format!("{p}-rtn"),
                    vec!["--method", "rtn", "--gguf-type", p],
                )
            })
            .collect();
        runs.push(("q4_k_m-gptq".into(), gptq.to_vec()));
        for (tag, args) in &runs {
            let choice = args[3];
            let out = tmp.path().join(format!("{name}-{tag}"));
            quantize_model(&model, &out, "gguf", args);
            let file = out.join("model.gguf");
            let theirs = tmp.path().join(format!("{name}-{tag}-llama.gguf"));
            llamacpp_requantize(&llama, &file, &theirs, choice);
            let (ours_g, theirs_g) = (
                GgufFile::open(&file).unwrap(),
                GgufFile::open(&theirs).unwrap(),
            );
            let mut blk = 0;
            for t in ours_g.tensors.iter().filter(|t| t.name.starts_with("blk.")) {
                blk += 1;
                let their = theirs_g.tensor(&t.name).map(|x| x.ggml_type);
                if their != Some(t.ggml_type) {
                    failures.push(format!(
                        "{name} {tag}: {} is {} here, {their:?} in llama.cpp's",
                        t.name, t.ggml_type
                    ));
                }
            }
            assert_eq!(blk, blk_tensors, "{name} {tag}: block tensors");
            if tag.ends_with("gptq") {
                // --gguf-type decides the grids of the fake twin too (no --sym or groups to add).
                let fake = tmp.path().join(format!("{name}-{tag}-fake"));
                let mut a = vec!["run", "--model", s(&model), "--out", s(&fake)];
                a.extend(["--format", "fake", "--quiet"]);
                a.extend_from_slice(args);
                let (code, _, err) = run(&a);
                assert_eq!(code, 0, "run {name} {tag} fake: {err}");
                let row = gguf_weights(&py, &file, &fake);
                assert_eq!(row["compared"], linears, "{name}: {row}");
                assert_eq!(row["mismatched"], serde_json::json!([]), "{name}");
                let want = common::eval_ppl(&fake, &text, seqlen, windows);
                let f32_file = f32_twin(&py, &file, tmp.path().join(format!("{name}-f32.gguf")));
                let row = llamacpp_f32_ppl(&llama, &f32_file, &text, seqlen, windows);
                check_loader_ppl(
                    &mut failures,
                    &out,
                    &row,
                    "eval of the fake folder",
                    want,
                    TOL,
                );
                remove_all(&[&fake, &f32_file]);
            }
            // 27 runs' files together came to 6.6 GB.
            remove_all(&[&out, &theirs]);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The tools, a scratch folder and the text of the random-model tests, with the models `names` built there
/// (`random_models`).
fn random_model_setup(names: &[&str]) -> (PathBuf, PathBuf, tempfile::TempDir, PathBuf) {
    let py = pyref_python("gguf, numpy, safetensors, transformers");
    let llama = llamacpp_python("llama_cpp, numpy");
    let tmp = tempfile::tempdir().unwrap();
    let text = texts_dir().join("moby-dick.txt");
    random_models(&py, tmp.path(), &text, names);
    (py, llama, tmp, text)
}

/// Small random models of `scripts/hf_reference.py`'s configs `names` in `dir`, with the demo tokenizer
/// (as tests/transformers_parity.rs builds them).
fn random_models(py: &Path, dir: &Path, text: &Path, names: &[&str]) {
    let o = Command::new(py)
        .arg("scripts/hf_reference.py")
        .args(["--out", s(dir)])
        .args(["--tokenizer", s(&demo_model().join("tokenizer.json"))])
        .args(["--text", s(text), "--seqlen", "64", "--windows", "2"])
        .arg("--only")
        .args(names)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "hf_reference.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// llama.cpp's perplexity of `file` on `text` (scripts/llamacpp_ppl.py: its tokenizer, its kernels), as a
/// loader row for `check_loader_ppl`.
fn llamacpp_ppl(
    llama: &Path,
    file: &Path,
    text: &Path,
    seqlen: &str,
    windows: &str,
) -> serde_json::Value {
    let o = Command::new(llama)
        .arg("scripts/llamacpp_ppl.py")
        .args([s(file), s(text)])
        .args(["--seqlen", seqlen, "--max-windows", windows])
        .output()
        .unwrap();
    let mut row = last_json(&o, "llamacpp_ppl.py");
    row["loader"] = "llama.cpp".into();
    row
}

/// scripts/check_gguf_weights.py's row for GGUF `file` against the `--format fake` folder `fake` (every
/// linear dequantized by the `gguf` package and compared bit for bit).
fn gguf_weights(py: &Path, file: &Path, fake: &Path) -> serde_json::Value {
    let o = Command::new(py)
        .arg("scripts/check_gguf_weights.py")
        .args([s(file), s(fake)])
        .output()
        .unwrap();
    last_json(&o, "check_gguf_weights.py")
}

/// llama.cpp's quantizer on our `file` with our `--gguf-type` `choice` (scripts/llamacpp_quantize.py
/// --requantize), written to `theirs`: the type it picks for each tensor.
fn llamacpp_requantize(llama: &Path, file: &Path, theirs: &Path, choice: &str) {
    let o = Command::new(llama)
        .arg("scripts/llamacpp_quantize.py")
        .args([s(file), s(theirs), choice, "--requantize"])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "llamacpp_quantize.py {} {choice}: {}",
        file.display(),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `llamacpp_ppl` of an F32 twin (`f32_twin`), labelled as such.
fn llamacpp_f32_ppl(
    llama: &Path,
    f32_file: &Path,
    text: &Path,
    seqlen: &str,
    windows: &str,
) -> serde_json::Value {
    let mut row = llamacpp_ppl(llama, f32_file, text, seqlen, windows);
    row["loader"] = "llama.cpp (F32 twin)".into();
    row
}

/// `file` with every tensor dequantized to F32 (scripts/gguf_to_f32.py), written to `dst`.
fn f32_twin(py: &Path, file: &Path, dst: PathBuf) -> PathBuf {
    let o = Command::new(py)
        .arg("scripts/gguf_to_f32.py")
        .args([s(file), s(&dst)])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "gguf_to_f32.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dst
}

/// `run --format gguf --method rtn` of `model` is refused before work with a line holding every needle.
fn assert_gguf_refused(model: &Path, out: &Path, needles: &[&str]) {
    assert_user_error(
        &[
            "run",
            "--model",
            s(model),
            "--out",
            s(out),
            "--format",
            "gguf",
            "--method",
            "rtn",
        ],
        needles,
    );
}

/// A copy of a model folder whose weights are links to the original's.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::os::unix::fs::symlink(std::fs::canonicalize(&p).unwrap(), dst).unwrap();
        } else {
            std::fs::copy(&p, dst).unwrap();
        }
    }
}
