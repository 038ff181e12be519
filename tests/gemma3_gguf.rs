//! The real Gemma 3 270M Q4_K_M GGUF (scripts/fetch_gemma3.sh) through `import_gguf`, against transformers'
//! own load of the same file (`from_pretrained(..., gguf_file=...)`, scripts/gemma3_gguf_reference.py): the
//! token ids of Moby-Dick and of the 2001–2016 State of the Union speeches must be equal, and the generic
//! CPU forward's logits on a few windows within LOGITS_TOL; `boa-cuda eval` must then load the folder. A
//! missing file or venv fails the test (scripts/test.sh provides both), never skips it.

mod common;

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::data::tokenizer::Tokenizer;
use boa_cuda::model::Model;
use boa_cuda::model::gguf::{OutDType, import_gguf};
use common::{gemma3_gguf, run, texts_dir};
use safetensors::SafeTensors;
use std::path::{Path, PathBuf};
use std::time::Instant;

const SEQLEN: usize = 128;
/// Windows from the start of each of the first WINDOW_TEXTS texts (Moby-Dick, the 2001 speech).
const WINDOWS: usize = 2;
const WINDOW_TEXTS: usize = 2;
/// max |Δlogit| / max |logit|: both sides dequantize the same blocks to f32 and run an f32 forward, with
/// different summation orders (faer vs torch's GEMMs, 18 layers, a 262k-row head).
const LOGITS_TOL: f64 = 1e-4;

/// Moby-Dick, then the 2001–2016 speeches in year order.
fn texts() -> Vec<PathBuf> {
    let dir = texts_dir();
    let mut speeches: Vec<PathBuf> = std::fs::read_dir(dir.join("sotu"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let year: u32 = p.file_name().unwrap().to_str().unwrap()[..4]
                .parse()
                .unwrap_or(0);
            (2001..=2016).contains(&year)
        })
        .collect();
    speeches.sort();
    assert_eq!(speeches.len(), 16, "the 2001–2016 speeches");
    let mut all = vec![dir.join("moby-dick.txt")];
    all.extend(speeches);
    all
}

fn int64s(st: &SafeTensors, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

/// Where two id sequences first differ, with a little context, or None when equal.
fn first_difference(ours: &[u32], theirs: &[u32]) -> Option<String> {
    let i = (0..ours.len().min(theirs.len())).find(|&i| ours[i] != theirs[i]);
    let i = match i {
        Some(i) => i,
        None if ours.len() == theirs.len() => return None,
        None => ours.len().min(theirs.len()),
    };
    let around = |v: &[u32]| v[i.saturating_sub(3)..(i + 4).min(v.len())].to_vec();
    Some(format!(
        "lengths {} vs {}; first difference at {i}: ours {:?}, transformers {:?}",
        ours.len(),
        theirs.len(),
        around(ours),
        around(theirs)
    ))
}

#[test]
fn gemma3_270m_gguf_import_matches_transformers() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let gguf = gemma3_gguf();
    let python = common::pyref_python("torch, transformers, gguf, safetensors");
    let texts = texts();
    let tmp = tempfile::tempdir().unwrap();
    let reference = tmp.path().join("reference.safetensors");
    // transformers' side runs while we import.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gemma3_gguf_reference.py");
    let child = std::process::Command::new(&python)
        .arg(&script)
        .arg("--gguf")
        .arg(&gguf)
        .arg("--out")
        .arg(&reference)
        .arg("--text")
        .args(&texts)
        .args(["--seqlen", &SEQLEN.to_string()])
        .args(["--windows", &WINDOWS.to_string()])
        .args(["--window-texts", &WINDOW_TEXTS.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the reference python");
    let dir = tmp.path().join("gemma3");
    let summary = import_gguf(&gguf, &dir, OutDType::F32).unwrap();
    println!(
        "import: {} tensors, {} layers, vocabulary {}, {:.1} s",
        summary.n_tensors, summary.n_layers, summary.vocab_size, summary.seconds
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(cfg["model_type"], "gemma3_text");

    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "scripts/gemma3_gguf_reference.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("reference: {}", String::from_utf8_lossy(&out.stdout).trim());
    let bytes = std::fs::read(&reference).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();

    let tok = Tokenizer::load(&dir).unwrap();
    let mut n_ids = 0;
    for (k, text) in texts.iter().enumerate() {
        let ours = tok.encode(&std::fs::read_to_string(text).unwrap()).unwrap();
        let theirs = int64s(&st, &format!("ids_{k}"));
        if let Some(d) = first_difference(&ours, &theirs) {
            panic!("token ids of {} differ: {d}", text.display());
        }
        n_ids += ours.len();
    }
    println!("token ids equal on {} texts, {n_ids} ids", texts.len());

    let model = Model::open(&dir).unwrap();
    let windows = int64s(&st, "windows");
    let logits = st.tensor("logits").unwrap();
    let vocab = logits.shape()[2];
    let logits: Vec<f32> = logits
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let (mut max_diff, mut max_ref) = (0f64, 0f64);
    for (w, ids) in windows.chunks(SEQLEN).enumerate() {
        let ours = boa_cuda::eval::logits(&CpuBackend, &model, ids).unwrap();
        let theirs = &logits[w * SEQLEN * vocab..(w + 1) * SEQLEN * vocab];
        assert_eq!(ours.len(), theirs.len());
        for (&a, &b) in ours.iter().zip(theirs) {
            max_diff = max_diff.max((a as f64 - b as f64).abs());
            max_ref = max_ref.max((b as f64).abs());
        }
    }
    let rel = max_diff / max_ref;
    println!(
        "logits on {} windows × {SEQLEN}: max |Δ| {max_diff:.3e}, max |logit| {max_ref:.3}, max rel {rel:.3e}",
        windows.len() / SEQLEN
    );
    assert!(
        rel <= LOGITS_TOL,
        "logits differ from transformers by {rel:e} > {LOGITS_TOL:e}"
    );

    // The folder evaluates through the CLI (the fused CPU eval path's Gemma fallback included).
    let (code, stdout, err) = run(&[
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        texts[0].to_str().unwrap(),
        "--seqlen",
        &SEQLEN.to_string(),
        "--max-windows",
        "2",
        "--json",
    ]);
    assert_eq!(code, 0, "eval: {err}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let ppl = v["perplexity"].as_f64().unwrap();
    assert!(ppl.is_finite() && ppl > 1.0, "ppl {ppl}");
    println!(
        "eval ppl {ppl:.3} (2 × {SEQLEN} of Moby-Dick); test {:.0} s",
        t0.elapsed().as_secs_f64()
    );
}

/// A Python script's stdout; its failure fails the test.
fn script(python: &Path, args: &[&str]) -> String {
    let o = std::process::Command::new(python)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A Python script's last stdout line as JSON (each script prints one object last).
fn script_json(python: &Path, args: &[&str]) -> serde_json::Value {
    let out = script(python, args);
    serde_json::from_str(out.trim().lines().last().unwrap_or("")).unwrap()
}

/// `--format gguf` of the real Gemma 3 270M (imported from its Q4_K_M file) as llama.cpp's "gemma3": the
/// keys llama.cpp reads equal the original file's; llama.cpp tokenizes Moby-Dick and the 2001–2016 speeches
/// with our SentencePiece vocabulary (scores written as −id) exactly as with the original's; and with every
/// tensor dequantized to F32 (no Q8 activations), llama.cpp's perplexity of our file is our eval of its
/// `--format fake` twin to PPL_TOL — as it is for the original file against our eval of its import (both
/// printed). transformers reads the imported folder's config.
#[test]
fn gemma3_270m_gguf_export_runs_in_llama_cpp_as_the_original() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const PPL_TOL: f64 = 1e-3;
    let gguf = gemma3_gguf();
    let py = common::pyref_python("gguf, numpy, transformers");
    let llama = common::llamacpp_python("llama_cpp, numpy");
    let texts = texts();
    let tmp = tempfile::tempdir().unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let dir = tmp.path().join("gemma3");
    import_gguf(&gguf, &dir, OutDType::F32).unwrap();
    let cfg = script_json(
        &py,
        &[
            "-c",
            &format!(
                "import json; from transformers import AutoConfig; c = AutoConfig.from_pretrained({:?}); \
                 print(json.dumps({{'query_pre_attn_scalar': c.query_pre_attn_scalar}}))",
                s(&dir)
            ),
        ],
    );
    assert_eq!(cfg["query_pre_attn_scalar"], 256, "{cfg}");

    let quantize = |out: &Path, format: &str| {
        let (code, _, err) = run(&[
            "run",
            "--model",
            &s(&dir),
            "--out",
            &s(out),
            "--format",
            format,
            "--method",
            "rtn",
            "--wbits",
            "8",
            "--sym",
            "--group-size",
            "32",
            "--signed-scales",
            "--calib",
            &s(&texts[0]),
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--quiet",
        ]);
        assert_eq!(code, 0, "run --format {format}: {err}");
    };
    let (out, fake) = (tmp.path().join("q8"), tmp.path().join("q8-fake"));
    quantize(&out, "gguf");
    quantize(&fake, "fake");
    let file = out.join("model.gguf");

    let keys = script_json(
        &py,
        &[
            "-c",
            &format!(
                "import json, gguf\n\
                 def kv(p):\n    r = gguf.GGUFReader(p)\n    return {{k: str(f.contents()) for k, f in r.fields.items() \
                 if k.startswith('gemma3.') or k in ('tokenizer.ggml.model', 'tokenizer.ggml.pre', \
                 'tokenizer.ggml.add_bos_token', 'tokenizer.ggml.add_space_prefix', \
                 'tokenizer.ggml.bos_token_id', 'tokenizer.ggml.eos_token_id', 'tokenizer.ggml.unknown_token_id', \
                 'tokenizer.ggml.padding_token_id', 'tokenizer.ggml.token_type')}}\n\
                 a, b = kv({:?}), kv({:?})\n\
                 print(json.dumps({{'differ': sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and \
                 k not in ('gemma3.rope.dimension_count', 'gemma3.vocab_size')), 'compared': len(a)}}))",
                s(&gguf),
                s(&file)
            ),
        ],
    );
    println!("keys: {keys}");
    assert_eq!(keys["differ"], serde_json::json!([]), "{keys}");

    let mut args = vec![
        "scripts/llamacpp_tokens_equal.py".to_string(),
        s(&gguf),
        s(&file),
    ];
    args.extend(texts.iter().map(|t| s(t)));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let toks = script_json(&llama, &args);
    println!("llama.cpp tokens: {toks}");
    assert_eq!(toks["first_difference"], serde_json::Value::Null, "{toks}");
    assert!(toks["compared"].as_u64().unwrap() > 800_000, "{toks}");

    let f32_twin = |src: &Path, dst: PathBuf| {
        script(&py, &["scripts/gguf_to_f32.py", &s(src), &s(&dst)]);
        dst
    };
    let llama_ppl = |file: &Path| {
        let row = script_json(
            &llama,
            &[
                "scripts/llamacpp_ppl.py",
                &s(file),
                &s(&texts[0]),
                "--seqlen",
                "128",
                "--max-windows",
                "2",
                "--add-bos",
            ],
        );
        row["perplexity"].as_f64().unwrap()
    };
    let compare = |what: &str, theirs: f64, want: f64| {
        let rel = (theirs - want).abs() / want;
        println!("{what}: llama.cpp (F32) {theirs:.4} vs eval {want:.4} (rel {rel:.1e})");
        assert!(
            rel <= PPL_TOL,
            "{what}: {theirs} vs {want}: {rel:e} > {PPL_TOL:e}"
        );
    };
    // One float32 copy of the model at a time besides the import (each is 1.1 GB).
    let want = common::eval_ppl(&fake, &texts[0], "128", "2");
    std::fs::remove_dir_all(&fake).unwrap();
    let ours_f32 = f32_twin(&file, tmp.path().join("q8-f32.gguf"));
    compare("ours", llama_ppl(&ours_f32), want);
    std::fs::remove_file(&ours_f32).unwrap();
    std::fs::remove_dir_all(&out).unwrap();
    let orig_f32 = f32_twin(&gguf, tmp.path().join("orig-f32.gguf"));
    let want = common::eval_ppl(&dir, &texts[0], "128", "2");
    compare("the original", llama_ppl(&orig_f32), want);
}

/// Held by each test for its whole run: each imports the model as float32 (1.1 GB) and makes more copies,
/// 5 GB of temporary files with the two side by side; one at a time they stay under 2.5 GB.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
