//! Reliability of `boa-cuda run` (issue "Reliability"): resume after SIGKILL gives the bytes of an
//! uninterrupted run, output is bit-identical whatever the thread count, a killed run never leaves a folder
//! at --out, --resume refuses a changed run, and an unwritable or full output disk fails before the work.
//!
//! Compared files: every file of the output folder byte for byte, except report.json, which is compared
//! after removing its measurements — every "seconds" field (per-phase and per-linear timings) and
//! "peak_rss_bytes". Everything else in report.json (options, per-layer errors as f64) must match exactly.

mod common;
use boa_cuda::model::synth::{SynthSpec, write_model};
use common::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A synthetic model big enough for faer's parallel GEMMs and the blocked Cholesky (d_ff ≥ 512) to engage.
fn model(dir: &Path, n_layers: usize) -> PathBuf {
    let m = dir.join("model");
    let spec = SynthSpec {
        arch: boa_cuda::model::synth::SynthArch::Llama,
        d: 128,
        d_ff: 576,
        n_layers,
        n_heads: 4,
        n_kv_heads: 2,
        vocab: 256,
        tie_word_embeddings: false,
        qkv_bias: false,
        seed: 7,
    };
    write_model(&m, &spec).unwrap();
    m
}

fn run_args<'a>(m: &'a Path, out: &'a Path, calib: &'a Path) -> Vec<&'a str> {
    vec![
        "run",
        "--model",
        s(m),
        "--calib",
        s(calib),
        "--out",
        s(out),
        "--method",
        "boa",
        "--wbits",
        "3",
        "--nsamples",
        "4",
        "--seqlen",
        "128",
        "--device",
        "cpu",
        "--quiet",
    ]
}

fn set<'a>(args: &mut [&'a str], flag: &str, value: &'a str) {
    let i = args.iter().position(|a| *a == flag).unwrap();
    args[i + 1] = value;
}

fn strip_measurements(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("seconds");
            m.remove("peak_rss_bytes");
            // Host↔device traffic is measured per process: a resumed run counts only its own blocks.
            m.remove("traffic");
            m.values_mut().for_each(strip_measurements);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_measurements),
        _ => {}
    }
}

/// Every file of an output folder (report.json without its measurements).
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        assert!(
            p.is_file(),
            "unexpected non-file {} in the output",
            p.display()
        );
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let mut bytes = std::fs::read(&p).unwrap();
        if name == "report.json" {
            let mut v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            strip_measurements(&mut v);
            // The output path is an option; the compared runs write to different folders.
            v["options"]["out"] = serde_json::Value::Null;
            bytes = serde_json::to_vec_pretty(&v).unwrap();
        }
        out.insert(name, bytes);
    }
    out
}

fn assert_same(a: &Path, b: &Path) {
    let (ca, cb) = (contents(a), contents(b));
    assert_eq!(
        ca.keys().collect::<Vec<_>>(),
        cb.keys().collect::<Vec<_>>(),
        "different file lists"
    );
    for (name, bytes) in &ca {
        if bytes == &cb[name] {
            continue;
        }
        // A text file names its first differing line, so a failure says what changed.
        let first_diff = match (std::str::from_utf8(bytes), std::str::from_utf8(&cb[name])) {
            (Ok(x), Ok(y)) => x
                .lines()
                .zip(y.lines())
                .find(|(l, r)| l != r)
                .map(|(l, r)| format!(": `{}` vs `{}`", l.trim(), r.trim()))
                .unwrap_or_default(),
            _ => String::new(),
        };
        panic!(
            "{name} differs between {} and {}{first_diff}",
            a.display(),
            b.display()
        );
    }
}

fn run_ok(args: &[&str], threads: Option<&str>) {
    let mut c = bin();
    c.args(args);
    if let Some(t) = threads {
        c.env("RAYON_NUM_THREADS", t);
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "run failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn next_block(partial: &Path) -> usize {
    std::fs::read(partial.join("resume/state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["next_block"].as_u64())
        .unwrap_or(0) as usize
}

/// Starts `args`, slowed after each block, and SIGKILLs it once `partial` records a finished block: the kill
/// lands between blocks 1 and `n_layers`. Returns the blocks it finished.
fn kill_after_a_block(args: &[&str], partial: &Path, n_layers: usize) -> usize {
    let mut child = bin()
        .args(args)
        .env("BOA_TEST_SLOW_BLOCK_MS", "3000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_a_block(&mut child, partial);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = next_block(partial);
    assert!((1..n_layers).contains(&done), "killed after {done} blocks");
    done
}

#[test]
fn kill_then_resume_matches_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), 4);
    let calib = texts_dir().join("moby-dick.txt");
    let reference = tmp.path().join("reference");
    run_ok(&run_args(&m, &reference, &calib), None);

    let out = tmp.path().join("out");
    let partial = tmp.path().join(".out.partial");
    let done = kill_after_a_block(&run_args(&m, &out, &calib), &partial, 4);
    assert!(!out.exists(), "a killed run left a folder at --out");
    // Its lock file stays behind (naming a dead pid): the resume below must take it over.
    assert!(tmp.path().join(".out.lock").is_file());

    // A changed option is refused and the partial folder stays.
    let mut args = run_args(&m, &out, &calib);
    set(&mut args, "--wbits", "4");
    args.push("--resume");
    assert_user_error(
        &args,
        &[
            "cannot --resume",
            "--wbits (3 then, 4 now)",
            "without --resume",
        ],
    );
    assert_eq!(
        next_block(&partial),
        done,
        "a refused resume touched the state"
    );

    let mut args = run_args(&m, &out, &calib);
    args.push("--resume");
    let o = bin().args(&args).output().unwrap();
    assert!(
        o.status.success(),
        "resume failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!partial.exists(), "the partial folder outlived the publish");
    assert!(
        !out.join("resume").exists(),
        "resume files leaked into the output"
    );
    assert_same(&reference, &out);
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(
        report["layers"].as_array().unwrap().len(),
        4,
        "per-layer reports of the blocks done before the kill are lost"
    );
}

/// `run --rotate` killed after a block and continued with --resume: the rotated model is written again
/// inside the partial folder (the rotation is deterministic), and the output is the uninterrupted run's.
#[test]
fn kill_then_resume_under_rotate_matches_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), 3);
    let calib = texts_dir().join("moby-dick.txt");
    let with_rotate = |out| {
        let mut a = run_args(&m, out, &calib);
        a.extend(["--rotate", "--format", "gptq_v2"]);
        a
    };
    let reference = tmp.path().join("reference");
    run_ok(&with_rotate(&reference), None);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(reference.join("config.json")).unwrap()).unwrap();
    assert!(
        cfg["boa_cuda"]["rotation"].is_object(),
        "the reference is not rotated: {cfg}"
    );

    let out = tmp.path().join("out");
    let partial = tmp.path().join(".out.partial");
    kill_after_a_block(&with_rotate(&out), &partial, 3);
    assert!(
        partial.join("rotated").join("config.json").is_file(),
        "the killed run's rotated model is not in its partial folder"
    );
    let mut args = with_rotate(&out);
    args.retain(|a| *a != "--quiet");
    args.push("--resume");
    let o = bin().args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "resume failed: {err}");
    assert!(err.contains("resuming from block"), "{err}");
    assert!(!partial.exists(), "the partial folder outlived the publish");
    assert!(
        !out.join("rotated").exists(),
        "the rotated copy leaked into the output"
    );
    assert_same(&reference, &out);
}

#[test]
fn output_is_identical_for_1_2_and_3_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let m = model(tmp.path(), 2);
    let calib = texts_dir().join("moby-dick.txt");
    let outs: Vec<PathBuf> = ["1", "2", "3"]
        .iter()
        .map(|t| {
            let out = tmp.path().join(format!("t{t}"));
            run_ok(&run_args(&m, &out, &calib), Some(t));
            out
        })
        .collect();
    assert_same(&outs[0], &outs[1]);
    assert_same(&outs[0], &outs[2]);
}

#[test]
fn partial_folder_replaced_without_resume_and_force_keeps_old_output_on_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    let out = tmp.path().join("out");
    let partial = tmp.path().join(".out.partial");
    std::fs::create_dir_all(partial.join("resume")).unwrap();
    std::fs::write(partial.join("junk"), b"x").unwrap();
    let mut args = run_args(&m, &out, &calib);
    args.retain(|a| *a != "--quiet");
    let o = bin().args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("replaced the partial folder"), "{err}");
    assert!(!out.join("junk").exists() && !partial.exists());

    // --resume with nothing to resume starts from block 0.
    let out2 = tmp.path().join("out2");
    let mut args = run_args(&m, &out2, &calib);
    args.retain(|a| *a != "--quiet");
    args.push("--resume");
    let o = bin().args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("nothing to resume"), "{err}");
    assert_same(&out, &out2);

    // --force over an existing output that then fails: the old output is untouched, nothing partial stays.
    let before = contents(&out);
    let mut args = run_args(&m, &out, &calib);
    set(&mut args, "--nsamples", "100000");
    args.push("--force");
    assert_user_error(&args, &["fewer than"]);
    assert_eq!(before, contents(&out));
    assert!(!partial.exists(), "an input error left the partial folder");
}

#[test]
fn unwritable_out_and_full_disk_fail_before_the_work() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    // A file where the parent folder should be: the same answer as a read-only parent, also under root.
    let blocker = tmp.path().join("file");
    std::fs::write(&blocker, b"").unwrap();
    let out = blocker.join("out");
    eprintln!(
        "HOSTILE | unwritable | {}",
        run(&run_args(&m, &out, &calib)).2
    );
    assert_user_error(
        &run_args(&m, &out, &calib),
        &["cannot create the output folder"],
    );

    let out = tmp.path().join("out");
    let args = run_args(&m, &out, &calib);
    let o = Command::new(env!("CARGO_BIN_EXE_boa-cuda"))
        .args(&args)
        .env("BOA_TEST_FREE_BYTES", "1000")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    eprintln!("HOSTILE | full disk | {err}");
    assert!(err.contains("not enough free space"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out.exists() && !tmp.path().join(".out.partial").exists());
}

/// The parallel kernels the pipeline relies on, at shapes larger than the whole-run test reaches (a long
/// reduction for XᵀX, a 7B-wide GEMM, a 1024-wide Cholesky inverse), in pools of 1, 2, 3 and 8 threads.
#[test]
fn parallel_kernels_are_thread_count_independent() {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut rand_vec =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() - 0.5).collect() };
    let (m, d) = (4096, 96);
    let x = rand_vec(m * d);
    let (mm, k, n) = (64, 1024, 704);
    let a = rand_vec(mm * k);
    let w = rand_vec(n * k);
    let nh = 1024;
    let xs = rand_vec(2 * nh * nh);
    // A well-conditioned SPD matrix: XᵀX/N + I.
    let mut h = vec![0f64; nh * nh];
    for i in 0..nh {
        for j in 0..nh {
            h[i * nh + j] = (0..2)
                .map(|r| xs[r * nh + i] as f64 * xs[r * nh + j] as f64)
                .sum::<f64>()
                + if i == j { 1.0 } else { 0.0 };
        }
    }
    let compute = || {
        let mut hx = vec![0f32; d * d];
        boa_cuda::quant::hessian::hessian_xxt(&mut hx, &x, m, d, d);
        let y = boa_cuda::backend::cpu::linear_f32(&a, &w, mm, k, n);
        let u = boa_cuda::quant::linalg::cholesky_upper_inverse(&h, nh).unwrap();
        (hx, y, u)
    };
    let results: Vec<_> = [1, 2, 3, 8]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
                .install(compute)
        })
        .collect();
    for (i, r) in results.iter().enumerate().skip(1) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&r.0) == bits(&results[0].0),
            "hessian_xxt differs (pool {i})"
        );
        assert!(
            bits(&r.1) == bits(&results[0].1),
            "linear_f32 differs (pool {i})"
        );
        let bits64 = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits64(&r.2) == bits64(&results[0].2),
            "cholesky_upper_inverse differs (pool {i})"
        );
    }
}

/// A failure after a finished block keeps the partial folder, and --resume finishes the run with the bytes
/// of an uninterrupted one. Every input the engine can check is checked before block 0 now (a NaN in block
/// 1 no longer gets this far), so the failure is injected: `BOA_TEST_FAIL_AFTER_BLOCK=0` fails the run
/// right after block 0's checkpoint, as a full disk or a CUDA error would.
#[test]
fn error_after_a_block_keeps_the_partial_folder_for_resume() {
    for format in ["fake", "gptq_v2"] {
        error_then_resume(format, false, &[]);
    }
    // The save a host short of memory makes: X streamed from the backend on the main thread, not copied out
    // and written on a thread.
    error_then_resume("gptq_v2", true, &[]);
    // The model-wide bit allocation: the resumed run makes its FP pass again and gets the same widths.
    error_then_resume("gptq_v2", false, &["--avg-bits", "2.5"]);
    // --asym-calib saves the FP stream after X; the resumed block 1 reads both back.
    error_then_resume("gptq_v2", false, &["--asym-calib"]);
    error_then_resume("gptq_v2", true, &["--asym-calib"]);
}

/// `extra`: more `run` arguments (with --avg-bits, in place of --wbits).
fn error_then_resume(format: &str, streamed: bool, extra: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    let reference = tmp.path().join("reference");
    let with_format = |out| {
        let mut a = run_args(&m, out, &calib);
        if extra.contains(&"--avg-bits") {
            let i = a.iter().position(|x| *x == "--wbits").unwrap();
            a.drain(i..i + 2);
        }
        a.extend(["--format", format]);
        a.extend_from_slice(extra);
        a
    };
    run_ok(&with_format(&reference), None);

    let out = tmp.path().join("out");
    let partial = tmp.path().join(".out.partial");
    let mut args = with_format(&out);
    args.retain(|a| *a != "--quiet");
    let streamed = |c: &mut std::process::Command| {
        if streamed {
            c.env("BOA_TEST_STREAMED_SAVES", "1");
        }
    };
    let mut c = bin();
    streamed(&mut c);
    let o = c
        .args(&args)
        .env("BOA_TEST_FAIL_AFTER_BLOCK", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("after block 0"), "{err}");
    assert!(err.contains("rerun with --resume"), "{err}");
    assert_eq!(next_block(&partial), 1);
    assert!(!out.exists());

    args.push("--resume");
    let mut c = bin();
    streamed(&mut c);
    let o = c.args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resuming from block 1 of 2"), "{err}");
    assert_same(&reference, &out);
}

/// Waits until the partial folder records at least one finished block (the run holds its lock by then).
fn wait_for_a_block(child: &mut std::process::Child, partial: &Path) {
    let t0 = Instant::now();
    while next_block(partial) < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "no block recorded in 300 s"
        );
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Two runs on one --out: the second replaced the first's partial folder while the first was writing, and
/// the one that finished published a mix of both. Now the second is refused at once, naming the first.
#[test]
fn a_second_run_on_the_same_out_is_refused_while_the_first_works() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    let reference = tmp.path().join("reference");
    run_ok(&run_args(&m, &reference, &calib), None);

    let out = tmp.path().join("out");
    let partial = tmp.path().join(".out.partial");
    let mut first = bin()
        .args(run_args(&m, &out, &calib))
        .env("BOA_TEST_SLOW_BLOCK_MS", "3000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_a_block(&mut first, &partial);
    let pid = format!("pid {}", first.id());
    for extra in [&[][..], &["--resume"], &["--force"]] {
        let mut args = run_args(&m, &out, &calib);
        set(&mut args, "--wbits", "4");
        args.extend(extra);
        let t0 = Instant::now();
        assert_user_error(&args, &["another boa-cuda run", &pid, "out"]);
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the refusal took {:.1?}",
            t0.elapsed()
        );
        assert!(
            next_block(&partial) >= 1,
            "the refused run touched the partial folder"
        );
    }
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_same(&reference, &out);
    assert!(
        !tmp.path().join(".out.lock").exists(),
        "the lock file outlived the run"
    );
}

/// The lock is the kernel's (flock), so a lock file left by a killed run, naming a dead process or a live
/// one that holds no lock (pid 1), stops nobody.
#[test]
fn a_stale_lock_file_is_taken_over() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    let mut dead = Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    for (i, pid) in [dead_pid, 1].into_iter().enumerate() {
        let out = tmp.path().join(format!("out{i}"));
        std::fs::write(tmp.path().join(format!(".out{i}.lock")), format!("{pid}\n")).unwrap();
        run_ok(&run_args(&m, &out, &calib), None);
        assert!(out.join("report.json").is_file());
        assert!(!tmp.path().join(format!(".out{i}.lock")).exists());
    }
}

/// `--force` removed the model when --out was the model folder or one of its parents, and onto a regular
/// file or `.` it failed only at publish, after the work. Each is refused up front, touching nothing.
#[test]
fn force_never_removes_an_input_and_never_a_non_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let m = tiny_model(&work);
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let calib = data.join("calib.txt");
    std::fs::copy(texts_dir().join("moby-dick.txt"), &calib).unwrap();
    let model_files = || -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(&m)
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect()
    };
    let before = model_files();
    let file = tmp.path().join("notes.txt");
    std::fs::write(&file, b"keep me").unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&m, &link).unwrap();
    let cases: [(&Path, &str); 7] = [
        (&m, "is the model folder"),
        (&work, "holds the model folder"),
        (tmp.path(), "holds the model folder"),
        (&data, "holds the calibration text"),
        (&file, "not a folder"),
        (&link, "symbolic link"),
        (Path::new("."), "--out ."),
    ];
    for (out, needle) in cases {
        let mut args = run_args(&m, out, &calib);
        args.push("--force");
        let t0 = Instant::now();
        let (code, _, err) = common::run_in(&work, &args);
        eprintln!(
            "HOSTILE | --force onto {} | {code} | {}",
            out.display(),
            err.trim()
        );
        assert_eq!(code, 2, "{}: {err}", out.display());
        assert!(err.contains(needle), "{}: {err}", out.display());
        assert!(!err.contains("panicked"));
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{}: refused only after {:.1?}",
            out.display(),
            t0.elapsed()
        );
        assert_eq!(
            model_files(),
            before,
            "--force onto {} changed the model",
            out.display()
        );
        assert!(calib.is_file() && std::fs::read(&file).unwrap() == b"keep me");
    }
    // A model folder that a run would use as its partial folder (`.NAME.partial` of --out) is refused too.
    let sneaky = work.join(".q.partial");
    std::fs::rename(&m, &sneaky).unwrap();
    let out = work.join("q");
    let args = run_args(&sneaky, &out, &calib);
    assert_user_error(&args, &["partial folder", "is the model folder"]);
    assert!(sneaky.join("model.safetensors").is_file());
}

/// After a failure past block 0, `--resume` with another `--format` converts the finished blocks' shards
/// (gptq ↔ gptq_v2 by the zero-point offset, packed → fake by dequantizing with the f16 scales) and gives
/// the bytes of an uninterrupted run in the new format; fake → packed is refused (the codes are gone).
#[test]
fn resume_with_another_format_converts_the_finished_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = texts_dir().join("moby-dick.txt");
    let args_for = |out: &Path, format: &str, extra: &[&'static str]| -> Vec<String> {
        let mut a: Vec<String> = run_args(&m, out, &calib)
            .into_iter()
            .filter(|a| *a != "--quiet")
            .map(String::from)
            .collect();
        a.extend(["--format".into(), format.into()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let cases: [(&str, &str, &[&'static str]); 5] = [
        ("gptq_v2", "fake", &[]),
        ("gptq_v2", "gptq", &["--sym"]),
        ("gptq", "gptq_v2", &["--sym"]),
        ("fake", "gptq_v2", &["--layers", "1"]),
        ("gptq_v2", "fake", &["--layers", "1"]),
    ];
    for (i, (from, to, extra)) in cases.into_iter().enumerate() {
        let what = format!("{from} → {to} {extra:?}");
        let reference = tmp.path().join(format!("ref{i}"));
        let a = args_for(&reference, to, extra);
        run_ok(&a.iter().map(String::as_str).collect::<Vec<_>>(), None);

        let out = tmp.path().join(format!("out{i}"));
        let partial = tmp.path().join(format!(".out{i}.partial"));
        let a = args_for(&out, from, extra);
        let o = bin()
            .args(&a)
            .env("BOA_TEST_FAIL_AFTER_BLOCK", "0")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{what}: {err}");
        assert!(err.contains("rerun with --resume"), "{what}: {err}");
        assert_eq!(next_block(&partial), 1, "{what}");

        let mut a = args_for(&out, to, extra);
        a.push("--resume".into());
        let o = bin().args(&a).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{what}: {err}");
        assert!(err.contains("resuming from block 1 of 2"), "{what}: {err}");
        assert_same(&reference, &out);
    }

    // fake → packed with a quantized block finished: refused with the reason, the partial folder kept.
    let out = tmp.path().join("outf");
    let partial = tmp.path().join(".outf.partial");
    let a = args_for(&out, "fake", &[]);
    let o = bin()
        .args(&a)
        .env("BOA_TEST_FAIL_AFTER_BLOCK", "0")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let mut a = args_for(&out, "gptq_v2", &[]);
    a.push("--resume".into());
    assert_user_error(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &["--format fake", "gptq_v2", "cannot be recovered"],
    );
    assert_eq!(
        next_block(&partial),
        1,
        "a refused conversion touched the state"
    );
}
