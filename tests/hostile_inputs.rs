//! Hostile model folders and files through the real binary: each must give a one-line error and exit code 2,
//! never a panic or an allocation sized by the file's claims. Run with `--nocapture` to print each answer
//! (the table in docs/hostile-inputs.md is made from that output).

mod common;
use common::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::fs;
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `run` on the model and returns the error line after checking exit 2 and no panic.
fn run_err(case: &str, m: &Path, calib: &Path, needles: &[&str]) {
    let out = m.parent().unwrap().join(format!("out-{}", case.len()));
    let args = [
        "run",
        "--model",
        s(m),
        "--calib",
        s(calib),
        "--out",
        s(&out),
        "--nsamples",
        "2",
        "--seqlen",
        "64",
        "--device",
        "cpu",
        "--quiet",
    ];
    report(case, &args, needles);
    assert!(!out.exists(), "{case}: an output folder was left");
}

fn report(case: &str, args: &[&str], needles: &[&str]) {
    let (code, _, err) = run(args);
    let line = err.lines().find(|l| l.starts_with("error")).unwrap_or("");
    eprintln!("HOSTILE | {case} | {code} | {line}");
    assert_user_error(args, needles);
}

fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = tmp.path().join("calib.txt");
    fs::write(&calib, "It was the best of times. ".repeat(200)).unwrap();
    (tmp, m, calib)
}

/// The tiny model's safetensors as (header JSON, data section).
fn split(m: &Path) -> (serde_json::Value, Vec<u8>) {
    let b = fs::read(m.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&b[8..8 + n]).unwrap(),
        b[8 + n..].to_vec(),
    )
}

fn join(m: &Path, len_field: Option<u64>, header: &[u8], data: &[u8]) {
    let mut b = len_field
        .unwrap_or(header.len() as u64)
        .to_le_bytes()
        .to_vec();
    b.extend(header);
    b.extend(data);
    fs::write(m.join("model.safetensors"), b).unwrap();
}

const Q: &str = "model.layers.0.self_attn.q_proj.weight";
const K: &str = "model.layers.0.self_attn.k_proj.weight";

#[test]
fn hostile_safetensors() {
    let (_t, m, calib) = setup();
    let (h, data) = split(&m);
    let hb = serde_json::to_vec(&h).unwrap();

    join(&m, Some(u64::MAX), &hb, &data);
    run_err(
        "header length u64::MAX",
        &m,
        &calib,
        &["not a valid safetensors"],
    );
    join(&m, Some(1 << 40), &hb, &data);
    run_err(
        "header length 1 TiB in a small file",
        &m,
        &calib,
        &["not a valid safetensors"],
    );

    let mut h2 = h.clone();
    let end = data.len() as u64;
    h2[Q]["data_offsets"] = serde_json::json!([end, end + 16384]);
    join(&m, None, &serde_json::to_vec(&h2).unwrap(), &data);
    run_err(
        "tensor offsets past the end of the file",
        &m,
        &calib,
        &["not a valid safetensors"],
    );

    let mut h2 = h.clone();
    h2[K]["data_offsets"] = h2[Q]["data_offsets"].clone();
    h2[K]["shape"] = h2[Q]["shape"].clone();
    join(&m, None, &serde_json::to_vec(&h2).unwrap(), &data);
    run_err(
        "two tensors over the same bytes (overlap)",
        &m,
        &calib,
        &["not a valid safetensors"],
    );

    let mut h2 = h.clone();
    h2[Q]["shape"] = serde_json::json!([64, 1u64 << 62]);
    join(&m, None, &serde_json::to_vec(&h2).unwrap(), &data);
    run_err(
        "shape whose byte size overflows",
        &m,
        &calib,
        &["not a valid safetensors"],
    );

    let mut hb2 = hb.clone();
    hb2[1] = 0xff;
    join(&m, None, &hb2, &data);
    run_err("header not UTF-8", &m, &calib, &["not a valid safetensors"]);

    join(&m, None, b"{\"a\": [1, 2", &data);
    run_err("header not JSON", &m, &calib, &["not a valid safetensors"]);
}

/// Rewrites the tiny model with tensor `name` replaced by `dtype` zeros of the same shape.
fn retype(m: &Path, name: &str, dtype: Dtype, size: usize) {
    let b = fs::read(m.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&b).unwrap();
    let owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            if n == name {
                let numel: usize = v.shape().iter().product();
                (n, dtype, v.shape().to_vec(), vec![0u8; numel * size])
            } else {
                (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())
            }
        })
        .collect();
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, sh, by)| (n.clone(), TensorView::new(*d, sh.clone(), by).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &m.join("model.safetensors")).unwrap();
}

#[test]
fn hostile_dtypes_and_index() {
    let (_t, m, calib) = setup();
    let orig = fs::read(m.join("model.safetensors")).unwrap();
    retype(&m, Q, Dtype::I64, 8);
    run_err(
        "I64 weight",
        &m,
        &calib,
        &[Q, "dtype I64", "F32, F16 or BF16"],
    );
    fs::write(m.join("model.safetensors"), &orig).unwrap();
    retype(&m, "model.layers.1.mlp.down_proj.weight", Dtype::U8, 1);
    run_err(
        "U8 weight in the last block",
        &m,
        &calib,
        &["down_proj", "dtype U8"],
    );

    // A sharded folder whose index is hostile.
    fs::rename(
        m.join("model.safetensors"),
        m.join("model-00001-of-00001.safetensors"),
    )
    .unwrap();
    fs::write(
        m.join("model.safetensors.index.json"),
        "{\"weight_map\": 5}",
    )
    .unwrap();
    run_err(
        "index json with the wrong structure",
        &m,
        &calib,
        &["invalid index"],
    );
    fs::write(
        m.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
    )
    .unwrap();
    run_err(
        "index naming a shard outside the folder",
        &m,
        &calib,
        &["must be a plain file name"],
    );
    fs::write(
        m.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    run_err("index naming a missing shard", &m, &calib, &["is missing"]);
}

fn edit_config(m: &Path, f: impl Fn(&mut serde_json::Value)) {
    let p = m.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    f(&mut v);
    fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[test]
fn hostile_config_and_tokenizer() {
    let (_t, m, calib) = setup();
    let orig = fs::read(m.join("config.json")).unwrap();
    let restore = || fs::write(m.join("config.json"), &orig).unwrap();

    edit_config(&m, |v| v["num_attention_heads"] = 0.into());
    run_err(
        "num_attention_heads 0",
        &m,
        &calib,
        &["num_attention_heads"],
    );
    restore();
    edit_config(&m, |v| v["num_key_value_heads"] = 3.into());
    run_err(
        "num_key_value_heads not dividing num_attention_heads",
        &m,
        &calib,
        &["num_key_value_heads"],
    );
    restore();
    edit_config(&m, |v| {
        v["head_dim"] = serde_json::Value::Null;
        v["hidden_size"] = 66.into();
    });
    run_err(
        "hidden_size not a multiple of the heads",
        &m,
        &calib,
        &["head dimension"],
    );
    restore();
    edit_config(&m, |v| v["hidden_size"] = 1_000_000_000_000u64.into());
    run_err(
        "hidden_size 10^12 (tensors say 64)",
        &m,
        &calib,
        &["model.embed_tokens.weight", "shape"],
    );
    restore();
    edit_config(&m, |v| v["num_hidden_layers"] = (1u64 << 40).into());
    run_err("num_hidden_layers 2^40", &m, &calib, &["is missing"]);
    restore();
    fs::write(m.join("config.json"), b"{\"hidden_size\": \xff}").unwrap();
    run_err("config.json not UTF-8", &m, &calib, &["config.json"]);
    restore();

    fs::write(m.join("tokenizer.json"), "{\"model\": {\"type\": \"BPE\"").unwrap();
    run_err("tokenizer.json truncated", &m, &calib, &["tokenizer.json"]);
    fs::write(m.join("tokenizer.json"), b"\xff\xfe\x00garbage").unwrap();
    run_err("tokenizer.json not UTF-8", &m, &calib, &["tokenizer.json"]);
    fs::write(
        m.join("tokenizer.json"),
        r#"{"version": "1.0", "model": {"type": "Unigram", "vocab": 7}}"#,
    )
    .unwrap();
    run_err(
        "tokenizer.json with a wrong model",
        &m,
        &calib,
        &["tokenizer.json"],
    );
    fs::write(
        m.join("tokenizer.json"),
        boa_cuda::model::synth::byte_tokenizer_json(256),
    )
    .unwrap();

    let bad = m.parent().unwrap().join("bad.txt");
    fs::write(&bad, b"caf\xe9 au lait ".repeat(100)).unwrap();
    run_err("calibration text not UTF-8", &m, &bad, &["UTF-8"]);
}

/// A GGUF header: magic, version 3, tensor count, key-value count, then `rest`.
fn gguf(n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(n_tensors.to_le_bytes());
    b.extend(n_kv.to_le_bytes());
    b.extend(rest);
    b
}

#[test]
fn hostile_gguf_headers() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "GGUF shorter than its header",
            b"GGUF\x03\x00".to_vec(),
            "shorter",
        ),
        ("GGUF bad magic", b"GGML".repeat(10), "not a GGUF file"),
        (
            "GGUF tensor count u64::MAX/3",
            gguf(u64::MAX / 3, 0, &[0; 64]),
            "cannot fit",
        ),
        (
            "GGUF key-value count 2^40",
            gguf(0, 1 << 40, &[0; 64]),
            "cannot fit",
        ),
        (
            "GGUF key length u64::MAX",
            gguf(0, 1, &[&u64::MAX.to_le_bytes()[..], &[0; 64]].concat()),
            "truncated",
        ),
        (
            "GGUF array of 2^50 strings",
            {
                let mut r = 3u64.to_le_bytes().to_vec();
                r.extend(b"abc");
                r.extend(9u32.to_le_bytes()); // array
                r.extend(8u32.to_le_bytes()); // of strings
                r.extend((1u64 << 50).to_le_bytes());
                gguf(0, 1, &r)
            },
            "cannot fit",
        ),
    ];
    for (case, bytes, needle) in cases {
        let p = tmp.path().join("x.gguf");
        fs::write(&p, &bytes).unwrap();
        let out = tmp.path().join("out");
        report(case, &["import-gguf", s(&p), "--out", s(&out)], &[needle]);
        assert!(!out.join("model.safetensors").exists());
    }
}

/// Seeded mutations of the tiny model's model.safetensors, opened and read as `run` would. Never a panic;
/// the address-space cap turns an allocation sized by a hostile header into a failure. Slow-ish: run by
/// scripts/fuzz.sh (BOA_FUZZ_ITERS, BOA_FUZZ_SECS, BOA_FUZZ_SEED).
#[test]
#[ignore]
fn fuzz_safetensors_mutations() {
    use rand::SeedableRng;
    let (_t, m, _calib) = setup();
    let good = fs::read(m.join("model.safetensors")).unwrap();
    let hot = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let seed: u64 = std::env::var("BOA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    limit_address_space(16 << 30);
    let (iters, secs) = fuzz_budget();
    let t0 = std::time::Instant::now();
    let (mut n, mut opened) = (0u64, 0u64);
    while n < iters && t0.elapsed() < secs {
        let bytes = mutate(&good, &mut rng, hot);
        fs::write(m.join("model.safetensors"), &bytes).unwrap();
        let r = std::panic::catch_unwind(|| {
            let model = boa_cuda::model::Model::open(&m)?;
            for l in 0..model.cfg.n_layers {
                model.load_block(l)?;
            }
            model.embed(&[0, 1, 255])?;
            model.lm_head()?;
            anyhow::Ok(())
        });
        match r {
            Ok(Ok(())) => opened += 1,
            Ok(Err(e)) => assert!(
                e.downcast_ref::<boa_cuda::error::BoaError>().is_some(),
                "iteration {n} (seed {seed}): not a user error: {e:#}"
            ),
            Err(_) => {
                let p = std::env::temp_dir().join(format!("boa-fuzz-crash-{seed}-{n}.safetensors"));
                fs::write(&p, &bytes).unwrap();
                panic!(
                    "iteration {n} (seed {seed}) panicked; input saved to {}",
                    p.display()
                );
            }
        }
        n += 1;
    }
    eprintln!(
        "fuzz_safetensors_mutations: {n} inputs ({opened} still valid) in {:.1?}",
        t0.elapsed()
    );
}

/// Writes the tiny model's model.safetensors into $BOA_FUZZ_SEED_DIR/weight_store (scripts/fuzz.sh).
#[test]
#[ignore]
fn write_fuzz_seed() {
    let Some(dir) = std::env::var_os("BOA_FUZZ_SEED_DIR") else {
        return;
    };
    let (_t, m, _) = setup();
    let d = Path::new(&dir).join("weight_store");
    fs::create_dir_all(&d).unwrap();
    fs::copy(m.join("model.safetensors"), d.join("tiny.safetensors")).unwrap();
}
