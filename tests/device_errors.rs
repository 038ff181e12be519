//! Errors on the device (issue 19, "Must show"): an out-of-memory, a factor that fails after every damping
//! retry, and a kernel fault each end `run --device cuda` with exit code 2 and one error line that names the
//! layer, the linear and the phase; nothing appears at --out, the partial folder keeps block 0, and a
//! `--resume` without the fault finishes the run with the files of an uninterrupted one.
//!
//! The faults are injected by the CPU emulator of the CUDA stack (profiling/emu/README.md, "Fault
//! injection"), set on the child process only: `EMU_FAIL_ALLOC_AFTER`, `EMU_FAIL_POTRF`, `EMU_FAIL_KERNEL`.
//! Each is placed in block 1 from the emulator's counters of the uninterrupted run (`EMU_COUNTERS`): both
//! blocks have the same shapes, so block 1's first potrf call and first sweep launch come right after block
//! 0's. Without a CUDA device the tests print "skipped: <why>"; on a real GPU "skipped: fault injection needs
//! the emulator". CI runs them on the emulator (profiling/emu/check.sh, in both schedules).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use boa_cuda::backend::Backend;
use boa_cuda::model::synth::{SynthSpec, write_model};

/// The model, calibration text, the uninterrupted run's output and the emulator's counters of that run.
struct Reference {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    model: PathBuf,
    calib: PathBuf,
    out: PathBuf,
    counters: serde_json::Value,
}

/// None (after printing why) without a CUDA device or on a real one.
fn reference() -> Option<&'static Reference> {
    static R: OnceLock<Option<Reference>> = OnceLock::new();
    let r = R.get_or_init(|| {
        let be = match boa_cuda::backend::cuda::CudaBackend::new(0) {
            Ok(be) => be,
            Err(why) => {
                println!("skipped: {why}");
                return None;
            }
        };
        if !be.name().contains("CPU emulator") {
            println!(
                "skipped: fault injection needs the emulator (device {})",
                be.name()
            );
            return None;
        }
        drop(be);
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let model = dir.join("synth");
        // d 256 > 128: the H_col factors go through cuSOLVER (d_h-sized ones through the batched kernel).
        let spec = SynthSpec {
            d: 256,
            d_ff: 688,
            n_heads: 4,
            n_kv_heads: 2,
            ..SynthSpec::tiny()
        };
        write_model(&model, &spec).unwrap();
        let calib = dir.join("calib.txt");
        std::fs::write(&calib, include_str!("../README.md")).unwrap();
        let out = dir.join("reference");
        let counts = dir.join("counters.json");
        let t = std::time::Instant::now();
        let o = common::bin()
            .args(args(&model, &calib, &out))
            .env("EMU_COUNTERS", &counts)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "the uninterrupted run failed: {err}");
        println!("uninterrupted run: {:.1} s", t.elapsed().as_secs_f64());
        let counters = serde_json::from_slice(&std::fs::read(&counts).expect("EMU_COUNTERS file"))
            .expect("counters JSON");
        Some(Reference {
            _tmp: tmp,
            dir,
            model,
            calib,
            out,
            counters,
        })
    });
    r.as_ref()
}

fn args(model: &Path, calib: &Path, out: &Path) -> Vec<String> {
    [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--calib",
        calib.to_str().unwrap(),
        "--nsamples",
        "4",
        "--seqlen",
        "128",
        "--method",
        "gptq",
        "--wbits",
        "4",
        "--format",
        "fake",
        "--device",
        "cuda",
        "--out",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

/// A count from the reference run's counters: `table` ("kernels", "library_calls" or "counters"), `name`.
fn count(r: &Reference, table: &str, name: &str) -> u64 {
    r.counters[table][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {table}.{name} in the emulator's counters"))
}

/// report.json without its measurements and its --out (tests/reliability.rs compares the same way).
fn strip(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("seconds");
            m.remove("peak_rss_bytes");
            m.remove("traffic");
            m.values_mut().for_each(strip);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        assert!(p.is_file(), "unexpected non-file {}", p.display());
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let mut bytes = std::fs::read(&p).unwrap();
        if name == "report.json" {
            let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            strip(&mut v);
            v["options"]["out"] = serde_json::Value::Null;
            bytes = serde_json::to_vec_pretty(&v).unwrap();
        }
        out.insert(name, bytes);
    }
    out
}

fn next_block(partial: &Path) -> Option<u64> {
    let b = std::fs::read(partial.join("resume/state.json")).ok()?;
    serde_json::from_slice::<serde_json::Value>(&b).ok()?["next_block"].as_u64()
}

/// Runs with the fault `(var, value)` on the child only, checks the error and the partial folder, resumes
/// without it and compares with the reference; returns the error line.
fn fault_then_resume(name: &str, var: &str, value: &str, phases: &[&str]) -> Option<String> {
    let r = reference()?;
    let out = r.dir.join(name);
    let partial = r.dir.join(format!(".{name}.partial"));
    let a = args(&r.model, &r.calib, &out);
    let t = std::time::Instant::now();
    let o = common::bin().args(&a).env(var, value).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let failed_s = t.elapsed().as_secs_f64();
    assert_eq!(o.status.code(), Some(2), "{var}={value}: {err}");
    assert!(!err.contains("panicked"), "{var}={value}: a panic: {err}");
    assert!(
        err.contains("emu: injected fault"),
        "{var}={value}: the emulator injected nothing: {err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(lines.len(), 1, "{var}={value}: not one error line: {err}");
    let line = lines[0].to_string();
    assert!(
        line.contains("layer 1"),
        "{var}={value}: no layer 1 in: {line}"
    );
    assert!(
        ["_proj"].iter().any(|n| line.contains(n)),
        "{var}={value}: no linear in: {line}"
    );
    assert!(
        phases.iter().any(|p| line.contains(p)),
        "{var}={value}: none of the phases {phases:?} in: {line}"
    );
    assert!(!out.exists(), "{var}={value}: a folder at --out");
    assert_eq!(
        next_block(&partial),
        Some(1),
        "{var}={value}: the partial folder does not hold block 0"
    );

    let t = std::time::Instant::now();
    let o = common::bin().args(&a).arg("--resume").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success(),
        "{var}={value}: the resume failed: {err}"
    );
    assert!(
        !partial.exists(),
        "{var}={value}: the partial folder outlived the publish"
    );
    let (want, got) = (contents(&r.out), contents(&out));
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{var}={value}: different files after the resume"
    );
    for (f, bytes) in &want {
        assert!(
            bytes == &got[f],
            "{var}={value}: {f} differs from the uninterrupted run's after the resume"
        );
    }
    println!(
        "{var}={value}: failed in {failed_s:.1} s, resumed in {:.1} s: {line}",
        t.elapsed().as_secs_f64()
    );
    Some(line)
}

/// The first device allocation past three quarters of the run's: block 1 (the two blocks make nearly all of
/// them; the setup and the writer few).
#[test]
fn out_of_memory_in_block_1() {
    let Some(r) = reference() else {
        return;
    };
    let n = count(r, "counters", "device_allocs") * 3 / 4;
    let line = fault_then_resume(
        "oom",
        "EMU_FAIL_ALLOC_AFTER",
        &n.to_string(),
        &[
            "statistics",
            "factor",
            "scale search",
            "sweep",
            "error report",
            "packing",
            "forward",
        ],
    );
    if let Some(line) = line {
        assert!(
            line.contains("OUT_OF_MEMORY") || line.contains("out of memory"),
            "{line}"
        );
    }
}

/// Every potrf from block 1's first on says "not positive definite": the damping retries all fail.
#[test]
fn factor_fails_after_every_damping_retry_in_block_1() {
    let Some(r) = reference() else {
        return;
    };
    let k = count(r, "library_calls", "cusolverDnXpotrf") / 2 + 1;
    if let Some(line) = fault_then_resume("potrf", "EMU_FAIL_POTRF", &k.to_string(), &["factor"]) {
        assert!(line.contains("self_attn.q_proj"), "{line}");
        assert!(line.contains("stays singular"), "{line}");
    }
}

/// Block 1's first GPTQ sweep launch faults (a sticky illegal address).
#[test]
fn kernel_fault_in_block_1() {
    let Some(r) = reference() else {
        return;
    };
    // The default GPTQ block kernel (v2; v1 where the device refuses v2's shared memory, never here).
    let kernel = "gptq_block_kernel_v2";
    let k = count(r, "kernels", kernel) / 2 + 1;
    if let Some(line) = fault_then_resume(
        "kernel",
        "EMU_FAIL_KERNEL",
        &format!("{kernel}:{k}"),
        &["sweep"],
    ) {
        assert!(line.contains("self_attn.q_proj"), "{line}");
        assert!(
            line.contains("ILLEGAL_ADDRESS") || line.contains("illegal"),
            "{line}"
        );
    }
}
