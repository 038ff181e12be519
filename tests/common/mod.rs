//! Helpers shared by the integration tests: running the real binary, tiny synthetic models, the demo model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_boa-cuda"))
}

/// Runs the binary with `args`; returns (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (i32, String, String) {
    let out: Output = bin().args(args).output().expect("spawn boa-cuda");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a clean user error: exit code 2, a one-line "error: …" containing every `needle`, no panic.
pub fn assert_user_error(args: &[&str], needles: &[&str]) {
    let (code, _out, err) = run(args);
    assert_eq!(code, 2, "expected exit code 2 for {args:?}; stderr: {err}");
    assert!(!err.contains("panicked"), "panic for {args:?}: {err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("error"))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    for n in needles {
        assert!(
            line.contains(n),
            "error for {args:?} should mention {n:?}: {line}"
        );
    }
}

pub fn tiny_model(dir: &Path) -> PathBuf {
    let m = dir.join("tiny");
    boa_cuda::model::synth::write_model(&m, &boa_cuda::model::synth::SynthSpec::tiny())
        .expect("write tiny model");
    m
}

pub fn shared_data() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data");
    assert!(
        p.is_dir(),
        "the test data folder {} is missing (it holds the State of the Union speeches)",
        p.display()
    );
    p
}

/// The imported demo model (SmolLM2-135M-Instruct), made by scripts/fetch_demo.sh. A missing model fails the
/// test: CI fetches it, so a test never passes for want of its data.
pub fn demo_model() -> PathBuf {
    let p = std::env::var_os("BOA_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/smollm2-135m"));
    assert!(
        p.join("model.safetensors").is_file(),
        "demo model not found at {}: run scripts/fetch_demo.sh first (or set BOA_DEMO_MODEL)",
        p.display()
    );
    p
}
