//! Bad input gets a one-line error and exit code 2, never a panic (issue: foundation, "Must show").

mod common;
use common::*;
use std::fs;

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn missing_model_folder() {
    assert_user_error(
        &[
            "eval",
            "--model",
            "/nonexistent/model",
            "--data",
            "/dev/null",
        ],
        &["model folder not found"],
    );
}

#[test]
fn missing_config_and_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let text = tmp.path().join("t.txt");
    fs::write(&text, "hello ".repeat(500)).unwrap();
    fs::rename(
        m.join("model.safetensors"),
        tmp.path().join("w.safetensors"),
    )
    .unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", s(&text)],
        &["no model.safetensors"],
    );
    fs::rename(
        tmp.path().join("w.safetensors"),
        m.join("model.safetensors"),
    )
    .unwrap();
    fs::remove_file(m.join("config.json")).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", s(&text)],
        &["config.json", "cannot read"],
    );
}

#[test]
fn unsupported_architecture_lists_supported() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let cfg = fs::read_to_string(m.join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "BertModel");
    fs::write(m.join("config.json"), cfg).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &[
            "unsupported architecture BertModel",
            "LlamaForCausalLM",
            "Qwen2ForCausalLM",
        ],
    );
}

#[test]
fn inconsistent_heads() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let cfg = fs::read_to_string(m.join("config.json")).unwrap();
    let cfg = cfg.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
    fs::write(m.join("config.json"), cfg).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &["num_key_value_heads=3"],
    );
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let w = m.join("model.safetensors");
    let bytes = fs::read(&w).unwrap();
    fs::write(&w, &bytes[..bytes.len() - 100]).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &["model.safetensors", "not a valid safetensors"],
    );
    let mut bad = bytes.clone();
    bad[8..16].copy_from_slice(b"garbage!");
    fs::write(&w, &bad).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &["not a valid safetensors"],
    );
    fs::write(&w, &bytes[..5]).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &["not a valid safetensors"],
    );
}

/// Rewrites the tiny model's safetensors with one tensor dropped or reshaped.
fn rewrite_tensors(m: &std::path::Path, f: impl Fn(&str, Vec<usize>) -> Option<Vec<usize>>) {
    let w = m.join("model.safetensors");
    let bytes = fs::read(&w).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| {
            let shape = f(&n, v.shape().to_vec())?;
            let data = v.data().to_vec();
            let numel: usize = shape.iter().product();
            Some((n, v.dtype(), shape, data[..numel * 4].to_vec()))
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &w).unwrap();
}

#[test]
fn missing_tensor_and_wrong_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    rewrite_tensors(&m, |n, s| {
        (n != "model.layers.1.mlp.up_proj.weight").then_some(s)
    });
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &["model.layers.1.mlp.up_proj.weight", "missing"],
    );
    let m = tmp.path().join("tiny2");
    boa_cuda::model::synth::write_model(&m, &boa_cuda::model::synth::SynthSpec::tiny()).unwrap();
    rewrite_tensors(&m, |n, s| {
        Some(if n == "model.layers.0.self_attn.k_proj.weight" {
            vec![16, 64]
        } else {
            s
        })
    });
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/dev/null"],
        &[
            "model.layers.0.self_attn.k_proj.weight",
            "[16, 64]",
            "expected [32, 64]",
        ],
    );
}

#[test]
fn text_too_short_for_one_window() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let text = tmp.path().join("short.txt");
    fs::write(&text, "only a few words").unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", s(&text)],
        &["16 tokens", "--seqlen 512"],
    );
}

#[test]
fn missing_and_non_utf8_text() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    assert_user_error(
        &["eval", "--model", s(&m), "--data", "/nonexistent.txt"],
        &["no such file"],
    );
    let text = tmp.path().join("bin.txt");
    fs::write(&text, [0x66, 0x6f, 0xff, 0xfe, 0x00]).unwrap();
    assert_user_error(
        &["eval", "--model", s(&m), "--data", s(&text)],
        &["not UTF-8"],
    );
}

#[test]
fn invalid_flags() {
    let (code, _, err) = run(&["eval", "--model"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["eval", "--model", "x", "--data", "y", "--seqlen", "abc"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--seqlen"), "{err}");
    let (code, _, err) = run(&["frobnicate"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(&["eval", "--model", "x", "--data", "y", "--device", "tpu"]);
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("panicked"));
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let out = tmp.path().join("q");
    for bad in ["0", "-1", "nan", "inf"] {
        assert_user_error(
            &[
                "run",
                "--model",
                s(&m),
                "--out",
                s(&out),
                "--method",
                "rtn",
                "--gpu-mem",
                bad,
            ],
            &["--gpu-mem"],
        );
    }
    assert!(!out.exists(), "a refused run left {out:?}");
}

#[test]
fn device_cuda_without_gpu_is_an_error_and_auto_falls_back() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let text = tmp.path().join("t.txt");
    fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    if boa_cuda::backend::cuda::CudaBackend::new(0).is_ok() {
        eprintln!("skipped the no-GPU half: a CUDA device is present");
        return;
    }
    assert_user_error(
        &[
            "eval",
            "--model",
            s(&m),
            "--data",
            s(&text),
            "--seqlen",
            "64",
            "--device",
            "cuda",
        ],
        &["CUDA"],
    );
    let (code, out, err) = run(&[
        "eval",
        "--model",
        s(&m),
        "--data",
        s(&text),
        "--seqlen",
        "64",
        "--device",
        "auto",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(v["perplexity"].as_f64().unwrap() > 1.0);
}

#[test]
fn synth_model_writes_a_loadable_model_and_refuses_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = dir.join("m");
    let (code, _, err) = run(&["synth-model", "--out", s(&out), "--d", "64", "--d-ff", "96"]);
    assert_eq!(code, 0, "{err}");
    let (code, info, err) = run(&["inspect", s(&out)]);
    assert_eq!(code, 0, "{err}");
    assert!(info.contains("LlamaForCausalLM"), "{info}");
    // An existing folder is never overwritten; a shape the heads do not divide writes nothing.
    assert_user_error(&["synth-model", "--out", s(&out)], &["already exists"]);
    let bad = dir.join("bad");
    assert_user_error(
        &[
            "synth-model",
            "--out",
            s(&bad),
            "--d",
            "100",
            "--heads",
            "8",
        ],
        &["multiple of --heads"],
    );
    assert!(!bad.exists());
}

/// `eval --max-windows 0` panicked (index out of bounds): now a user error naming the option.
#[test]
fn eval_max_windows_zero_is_a_user_error() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let text = tmp.path().join("t.txt");
    fs::write(&text, "hello ".repeat(500)).unwrap();
    assert_user_error(
        &[
            "eval",
            "--model",
            s(&m),
            "--data",
            s(&text),
            "--seqlen",
            "64",
            "--max-windows",
            "0",
        ],
        &["--max-windows 0"],
    );
}

/// synth-model wrote models that `run` then refused (an odd head dimension): it checks the config the
/// way `run` reads it before writing anything.
#[test]
fn synth_model_refuses_what_run_would_refuse() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("odd");
    assert_user_error(
        &[
            "synth-model",
            "--out",
            s(&out),
            "--d",
            "96",
            "--heads",
            "32",
            "--kv-heads",
            "4",
        ],
        &["head dimension 3"],
    );
    assert!(!out.exists(), "a refused synth-model left {out:?}");
    assert_user_error(
        &[
            "synth-model",
            "--out",
            s(&out),
            "--d",
            "1000000",
            "--d-ff",
            "1000000",
        ],
        &["too large"],
    );
    assert!(!out.exists());
}

/// An I/O error inside the safetensors writer was printed twice ("No space left on device (os error 28):
/// No space left on device (os error 28)", from the error and its source). Reproduced with a file-size
/// limit (EFBIG, the same path as ENOSPC) on an RTN run, whose first write is a shard.
#[test]
fn an_io_error_is_printed_once() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let out = tmp.path().join("q");
    let mut c = bin();
    c.args([
        "run",
        "--model",
        s(&m),
        "--out",
        s(&out),
        "--method",
        "rtn",
        "--format",
        "fake",
        "--device",
        "cpu",
        "--quiet",
    ]);
    // SAFETY: between fork and exec only async-signal-safe calls: setrlimit and signal.
    unsafe {
        c.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 32 << 10,
                rlim_max: 32 << 10,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
            // Without this the kernel kills the process at the limit instead of failing the write.
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let line = err.lines().find(|l| l.starts_with("error")).unwrap();
    let cause = "File too large (os error 27)";
    assert_eq!(line.matches(cause).count(), 1, "{line}");
    assert!(!out.exists());
}
