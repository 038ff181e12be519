//! `run --device cuda` end to end against `--device cpu`, on a synthesized GQA model (d 256, 4 heads over 2 KV
//! heads, d_h 64, 2 blocks). The whole pipeline runs on the device:
//! - device-resident activations and the prefetch thread;
//! - the statistics, the factors and the sweeps: BoA 3-bit with static grids (every sweep on the device),
//!   and GPTQ 4-bit g64 with dynamic groups (the device sweep calls back to the host search at each group);
//! - the quantized forward and the writer;
//! - and, with `--gpu-mem` just too small for the activations, X parked in pinned host memory: each chunk
//!   staged on the copy stream and written back into its pinned buffer (the second stream's paths).
//!
//! Per method, the mean relative output error of report.json must agree with the CPU's within 10%. The GPU's
//! statistics are bf16 and its factors f32, so codes differ a little; a wrong kernel or a wrong buffer is far
//! off. The test prints "skipped: <why>" without a CUDA device. CI runs it on the CPU emulator of the CUDA
//! stack (profiling/emu/check.sh, once with lazy streams), gpu_check.sh on a GPU (with `BOA_CUDA_BIN` naming
//! the staged binary); gpu_check.sh's e2e section is the same check at a larger size.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use boa_cuda::model::config::Config;
use boa_cuda::model::synth::{SynthSpec, write_model};
use boa_cuda::pipeline::CHUNK;
use boa_cuda::pipeline::memory_plan::{Activations, Calibration, ModelShape, Target, plan};

/// Mean `error` of report.json's linears, per `method`.
fn mean_errors(report: &Path) -> BTreeMap<String, f64> {
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(report).expect("report.json")).expect("JSON");
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for layer in r["layers"].as_array().expect("layers") {
        for lin in layer["linears"].as_array().expect("linears") {
            let e = sums
                .entry(lin["method"].as_str().expect("method").to_string())
                .or_default();
            e.0 += lin["error"].as_f64().expect("error");
            e.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(m, (s, n))| (m, s / n as f64))
        .collect()
}

fn synth_model(dir: &Path) -> PathBuf {
    let model = dir.join("synth");
    let spec = SynthSpec {
        d: 256,
        d_ff: 688,
        n_heads: 4,
        n_kv_heads: 2,
        ..SynthSpec::tiny()
    };
    write_model(&model, &spec).unwrap();
    model
}

/// Runs `cfg` on cuda and on the cpu with `calib` windows and asserts the mean errors agree per method;
/// returns the cuda run's stderr.
fn compare_devices(tmp: &Path, model: &Path, calib: (usize, usize), cfg: &[&str]) -> String {
    // The calibration text travels inside the test executable (gpu_check.sh runs it away from the source).
    let readme = tmp.join("calib.txt");
    std::fs::write(&readme, include_str!("../README.md")).unwrap();
    let (nsamples, seqlen) = (calib.0.to_string(), calib.1.to_string());
    let mut errors = Vec::new();
    let mut cuda_stderr = String::new();
    for dev in ["cuda", "cpu"] {
        let out = tmp.join(format!("q-{dev}"));
        let mut args = vec![
            "run",
            "--model",
            model.to_str().unwrap(),
            "--calib",
            readme.to_str().unwrap(),
            "--nsamples",
            &nsamples,
            "--seqlen",
            &seqlen,
            "--format",
            "fake",
            "--device",
            dev,
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(cfg);
        let (code, _, err) = common::run(&args);
        assert_eq!(code, 0, "run {cfg:?} --device {dev} failed: {err}");
        if dev == "cuda" {
            cuda_stderr = err;
        }
        errors.push(mean_errors(&out.join("report.json")));
        std::fs::remove_dir_all(&out).unwrap();
    }
    let (cuda, cpu) = (&errors[0], &errors[1]);
    assert_eq!(
        cuda.keys().collect::<Vec<_>>(),
        cpu.keys().collect::<Vec<_>>(),
        "{cfg:?}: the devices quantized different sets of methods"
    );
    for (method, &c) in cpu {
        let ratio = cuda[method] / c;
        println!(
            "{cfg:?} {method}: mean relative output error cuda {:.5}, cpu {c:.5}, ratio {ratio:.3}",
            cuda[method]
        );
        assert!(
            (0.9..=1.1).contains(&ratio),
            "{cfg:?} {method}: CUDA's mean output error is {ratio:.3}× the CPU's (bound [0.9, 1.1])"
        );
    }
    cuda_stderr
}

/// A temporary folder holding the synthesized model, or None (after printing why) without a CUDA device.
fn cuda_and_model() -> Option<(tempfile::TempDir, PathBuf)> {
    if let Err(why) = boa_cuda::backend::cuda::CudaBackend::new(0) {
        println!("skipped: {why}");
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth_model(tmp.path());
    Some((tmp, model))
}

#[test]
fn run_on_cuda_matches_run_on_the_cpu() {
    let Some((tmp, model)) = cuda_and_model() else {
        return;
    };
    let configs: [&[&str]; 2] = [
        &[
            "--method",
            "boa",
            "--wbits",
            "3",
            "--scale-search",
            "minmax",
            "--quiet",
        ],
        &[
            "--method",
            "gptq",
            "--wbits",
            "4",
            "--group-size",
            "64",
            "--quiet",
        ],
    ];
    for cfg in configs {
        compare_devices(tmp.path(), &model, (8, 128), cfg);
    }
}

/// The GPU budget (GiB) halfway between the least the planner accepts with X parked and the least with X on
/// the device, so the plan parks X whatever the planner's constants are.
fn parking_budget_gib(model: &Path, calib: Calibration) -> f64 {
    let shape = ModelShape::of(&Config::load(model).unwrap());
    let least = |ok: &dyn Fn(u64) -> bool| {
        let (mut lo, mut hi) = (0u64, 1u64 << 40);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if ok(mid) { hi = mid } else { lo = mid }
        }
        hi
    };
    let parked = least(&|b| plan(&shape, calib, Target::Gpu, b, CHUNK).is_ok());
    let resident = least(&|b| {
        plan(&shape, calib, Target::Gpu, b, CHUNK)
            .is_ok_and(|p| p.activations == Activations::Device)
    });
    assert!(
        parked < resident,
        "the planner never parks X for {calib:?} (least budgets: {parked} B, {resident} B on the device)"
    );
    (parked + resident) as f64 / 2.0 / (1u64 << 30) as f64
}

#[test]
fn run_with_parked_activations_matches_the_cpu() {
    let Some((tmp, model)) = cuda_and_model() else {
        return;
    };
    let calib = Calibration {
        nsamples: 16,
        seqlen: 128,
    };
    let gib = format!("{:.6}", parking_budget_gib(&model, calib));
    let cfg: &[&str] = &["--method", "gptq", "--wbits", "4", "--gpu-mem", &gib];
    let err = compare_devices(tmp.path(), &model, (calib.nsamples, calib.seqlen), cfg);
    assert!(
        err.contains("stays in pinned host memory"),
        "--gpu-mem {gib} did not park X: {err}"
    );
}

/// Issue 19's residency bounds, measured by the emulator's own driver (or the host layer's counters on a GPU):
/// a quantized block moves at most 1.2× its floor (its weights as uploaded plus its packed output; the blocks'
/// sum, since each block's window carries the prefetch of the next one's weights) and makes at most 64 host
/// synchronizations, for BoA and for GPTQ, per channel and with dynamic groups (the default when grouped). The
/// resume saves are counted apart and excluded.
#[test]
fn run_on_cuda_is_device_resident() {
    let Some((tmp, model)) = cuda_and_model() else {
        return;
    };
    let readme = tmp.path().join("calib.txt");
    std::fs::write(&readme, include_str!("../README.md")).unwrap();
    for cfg in [
        &["--method", "boa", "--wbits", "3"][..],
        &["--method", "gptq", "--wbits", "4", "--group-size", "64"],
        &["--method", "boa", "--wbits", "4", "--group-size", "64"],
    ] {
        let out = tmp.path().join("q-resident");
        let mut args = vec![
            "run",
            "--model",
            model.to_str().unwrap(),
            "--calib",
            readme.to_str().unwrap(),
            "--nsamples",
            "4",
            "--seqlen",
            "128",
            "--format",
            "gptq_v2",
            "--device",
            "cuda",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(cfg);
        let (code, _, err) = common::run(&args);
        assert_eq!(code, 0, "run {cfg:?} failed: {err}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap())
                .unwrap();
        let t = &r["traffic"];
        assert!(
            ["emulator", "host layer"].contains(&t["source"].as_str().unwrap_or("")),
            "{cfg:?}: no traffic counted: {t}"
        );
        let blocks = t["blocks"].as_array().unwrap();
        assert_eq!(blocks.len(), 2, "{cfg:?}: {t}");
        let (mut moved, mut floor) = (0u64, 0u64);
        for b in blocks {
            let tr = &b["traffic"];
            let bytes = tr["htod_bytes"].as_u64().unwrap() + tr["dtoh_bytes"].as_u64().unwrap();
            let syncs = tr["syncs"].as_u64().unwrap();
            println!(
                "{cfg:?} block {}: {bytes} B moved, floor {} B, {syncs} syncs, {} launches",
                b["layer"], b["floor_bytes"], tr["launches"]
            );
            assert!(
                syncs <= 64,
                "{cfg:?} block {}: {syncs} host syncs > 64",
                b["layer"]
            );
            moved += bytes;
            floor += b["floor_bytes"].as_u64().unwrap();
        }
        let ratio = moved as f64 / floor as f64;
        println!(
            "{cfg:?}: {moved} B moved over the blocks against a floor of {floor} B: {ratio:.3}×"
        );
        assert!(
            ratio <= 1.2,
            "{cfg:?}: the blocks moved {ratio:.3}× their floor (bound 1.2)"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}
