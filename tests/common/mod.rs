//! Helpers shared by the integration tests: running the real binary, tiny synthetic models, the demo model.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The binary cargo built, or `BOA_CUDA_BIN` (profiling/gpu_check.sh runs staged test executables on a
/// machine where cargo's build path does not exist).
pub fn bin() -> Command {
    match std::env::var_os("BOA_CUDA_BIN") {
        Some(p) => Command::new(p),
        None => Command::new(env!("CARGO_BIN_EXE_boa-cuda")),
    }
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

/// `run` with `dir` as the working directory.
pub fn run_in(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out: Output = bin()
        .args(args)
        .current_dir(dir)
        .output()
        .expect("spawn boa-cuda");
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

/// The texts the tests read (State of the Union speeches in `sotu/`, `moby-dick.txt`), unpacked from the
/// repository's data/texts.tar.xz by scripts/texts.py (scripts/test.sh runs it). A missing folder fails the
/// test: it never passes for want of its data.
pub fn texts_dir() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/texts");
    assert!(
        p.join("moby-dick.txt").is_file() && p.join("sotu").is_dir(),
        "the test texts are missing at {}: run `python3 scripts/texts.py` (scripts/test.sh does)",
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

/// Gemma 3 270M Q4_K_M, scripts/fetch_gemma3.sh's output: $BOA_GEMMA3_GGUF, default
/// ~/.cache/boa-cuda/gemma3/gemma-3-270m-q4_k_m.gguf. A missing file fails the test (CI fetches it).
pub fn gemma3_gguf() -> PathBuf {
    let p = std::env::var_os("BOA_GEMMA3_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
            Path::new(&home).join(".cache/boa-cuda/gemma3/gemma-3-270m-q4_k_m.gguf")
        });
    assert!(
        p.is_file(),
        "Gemma 3 270M GGUF not found at {}: run scripts/fetch_gemma3.sh (or set BOA_GEMMA3_GGUF)",
        p.display()
    );
    p
}

/// A cached venv's python ($ENV, default ~/.cache/boa-cuda/DIR/bin/python), checked to import `modules`. A
/// missing venv fails the test: scripts/test.sh installs both, so a test never passes for want of one.
fn venv_python(env: &str, dir: &str, installer: &str, modules: &str) -> PathBuf {
    let py = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(format!(".cache/boa-cuda/{dir}/bin/python"))
    });
    let ok = Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import {modules}: run scripts/{installer} (scripts/test.sh does), or set {env} to a \
         python that has them",
        py.display()
    );
    py
}

/// The reference venv's python (scripts/install_pyref.sh: transformers, torch, the gguf package), checked to
/// import `modules` (e.g. "gguf, numpy"). $BOA_PYREF_PYTHON, default ~/.cache/boa-cuda/pyref/bin/python.
pub fn pyref_python(modules: &str) -> PathBuf {
    venv_python("BOA_PYREF_PYTHON", "pyref", "install_pyref.sh", modules)
}

/// The third-party loaders (scripts/install_loaders.sh: GPTQModel, transformers + optimum,
/// compressed-tensors, installed into the reference venv), checked to import `modules`.
/// $BOA_LOADERS_PYTHON, default ~/.cache/boa-cuda/pyref/bin/python.
pub fn loaders_python(modules: &str) -> PathBuf {
    venv_python("BOA_LOADERS_PYTHON", "pyref", "install_loaders.sh", modules)
}

/// llama.cpp's venv (scripts/install_llamacpp.sh: llama-cpp-python built from source), checked to import
/// `modules`. $BOA_LLAMACPP_PYTHON, default ~/.cache/boa-cuda/llamacpp/bin/python.
pub fn llamacpp_python(modules: &str) -> PathBuf {
    venv_python(
        "BOA_LLAMACPP_PYTHON",
        "llamacpp",
        "install_llamacpp.sh",
        modules,
    )
}

/// vLLM's CPU build (scripts/install_vllm.sh), checked to import `modules`. $BOA_VLLM_PYTHON, default
/// ~/.cache/boa-cuda/vllm/bin/python.
pub fn vllm_python(modules: &str) -> PathBuf {
    venv_python("BOA_VLLM_PYTHON", "vllm", "install_vllm.sh", modules)
}

/// The State of the Union speeches whose year passes `pred`, in year order.
pub fn sotu_speeches(pred: impl Fn(u32) -> bool) -> Vec<String> {
    let dir = texts_dir().join("sotu");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name().unwrap().to_str().unwrap()[..4]
                .parse::<u32>()
                .is_ok_and(&pred)
        })
        .collect();
    v.sort();
    v.into_iter()
        .map(|p| p.to_str().unwrap().to_string())
        .collect()
}

/// `boa-cuda eval --json`'s perplexity of the folder `dir` on `text`: `windows` windows of `seqlen` tokens.
pub fn eval_ppl(dir: &Path, text: &Path, seqlen: &str, windows: &str) -> f64 {
    let (code, out, err) = run(&[
        "eval",
        "--model",
        dir.to_str().unwrap(),
        "--data",
        text.to_str().unwrap(),
        "--seqlen",
        seqlen,
        "--max-windows",
        windows,
        "--json",
    ]);
    assert_eq!(code, 0, "eval {}: {err}", dir.display());
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["perplexity"].as_f64().unwrap()
}

/// scripts/check_loaders.py in the loaders' venv `py`: each of `loaders` on each of `dirs`, with `args`
/// (`--data`, `--seqlen`, `--max-windows`, `--weights-like=…`). Its JSON rows, one per folder and loader (a
/// refusal is a row with "error"); the script failing fails the test. torch.compile is off: on 2 cores it
/// compiles every quantized linear for minutes and changes no number.
pub fn check_loaders(
    py: &Path,
    args: &[&str],
    loaders: &[&str],
    dirs: &[&Path],
) -> Vec<serde_json::Value> {
    let out = Command::new(py)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/check_loaders.py"))
        .args(args)
        .args(loaders.iter().flat_map(|l| ["--loader", l]))
        .args(dirs)
        .env("TORCHDYNAMO_DISABLE", "1")
        .output()
        .expect("spawn the loaders python");
    assert!(
        out.status.success(),
        "check_loaders.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), loaders.len() * dirs.len(), "{rows:?}");
    rows
}

/// One row of scripts/check_loaders.py against `boa-cuda eval`'s perplexity `want` (`against` names it):
/// printed, and a failure pushed when the loader erred or |Δppl| / ppl exceeds `tol`.
pub fn check_loader_ppl(
    failures: &mut Vec<String>,
    dir: &Path,
    row: &serde_json::Value,
    against: &str,
    want: f64,
    tol: f64,
) {
    let loader = row["loader"].as_str().unwrap_or("?");
    match row["perplexity"].as_f64() {
        Some(p) => {
            let rel = (p - want).abs() / want;
            println!(
                "{}: {loader} {p:.4} vs {against} {want:.4} (rel {rel:.1e})",
                dir.display()
            );
            if rel > tol {
                failures.push(format!(
                    "{} {loader}: {p} vs {want} (rel {rel:.1e} > {tol:.0e})",
                    dir.display()
                ));
            }
        }
        None => failures.push(format!("{} {loader}: {}", dir.display(), row["error"])),
    }
}

// ---------------------------------------------------------------------------------------------------------
// Seeded mutation fuzzing on stable Rust (the cargo-fuzz targets in fuzz/ need nightly). Used by the
// #[ignore]d `fuzz_*` tests; scripts/fuzz.sh runs them for a bounded time.

/// Iterations and wall-clock budget: BOA_FUZZ_ITERS (default 300) and BOA_FUZZ_SECS (default 20).
pub fn fuzz_budget() -> (u64, std::time::Duration) {
    let get = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    (
        get("BOA_FUZZ_ITERS", 300),
        std::time::Duration::from_secs(get("BOA_FUZZ_SECS", 20)),
    )
}

/// Caps this process's address space, so an allocation sized by a hostile file's claims aborts the test
/// instead of going unnoticed on a big machine. Mappings count too: keep it above the model files' size.
pub fn limit_address_space(bytes: u64) {
    let lim = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct; lowering a soft limit has no other effect on this process.
    unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
}

/// One to four random edits of `good`, biased to its first `hot` bytes (the header, where the lengths,
/// counts and offsets are).
pub fn mutate(good: &[u8], rng: &mut rand_chacha::ChaCha8Rng, hot: usize) -> Vec<u8> {
    use rand::RngExt;
    let mut b = good.to_vec();
    let n_edits = rng.random_range(1..=4);
    for _ in 0..n_edits {
        if b.is_empty() {
            b.push(0);
        }
        let span = if rng.random_bool(0.8) {
            hot.clamp(1, b.len())
        } else {
            b.len()
        };
        let at = rng.random_range(0..span);
        match rng.random_range(0..7) {
            0 => b[at] ^= 1 << rng.random_range(0..8),
            1 => b[at] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'['][rng.random_range(0..7)],
            2 => {
                let v: u64 = [
                    0,
                    1,
                    u32::MAX as u64,
                    u64::MAX,
                    1 << 40,
                    good.len() as u64,
                    good.len() as u64 + 1,
                    rng.random(),
                ][rng.random_range(0..8)];
                let end = (at + 8).min(b.len());
                let n = end - at;
                b[at..end].copy_from_slice(&v.to_le_bytes()[..n]);
            }
            3 => b.truncate(at),
            4 => {
                let len = rng.random_range(1..=64).min(b.len() - at);
                let chunk = b[at..at + len].to_vec();
                let to = rng.random_range(0..b.len());
                b.splice(to..to, chunk);
            }
            5 => {
                let len = rng.random_range(1..=16).min(b.len() - at);
                b.drain(at..at + len);
            }
            _ => {
                // A decimal digit changed inside JSON text (safetensors headers): offsets and shapes.
                if b[at].is_ascii_digit() {
                    b[at] = b'0' + rng.random_range(0..10u8);
                } else {
                    b.insert(at, b'9');
                }
            }
        }
    }
    b
}
