//! `run --device cuda` end to end against `--device cpu`, on a synthesized GQA model (d 256, 4 heads over 2 KV
//! heads, d_h 64, 2 blocks). The whole pipeline runs on the device:
//! - device-resident activations and the prefetch thread;
//! - the statistics, the factors and the sweeps: BoA 3-bit with static grids (every sweep on the device),
//!   and GPTQ 4-bit g64 with dynamic groups (the device sweep calls back to the host search at each group);
//! - the quantized forward and the writer.
//!
//! Per method, the mean relative output error of report.json must agree with the CPU's within 10%. The GPU's
//! statistics are bf16 and its factors f32, so codes differ a little; a wrong kernel or a wrong buffer is far
//! off. The test prints "skipped: <why>" without a CUDA device. CI runs it on the CPU emulator of the CUDA
//! stack (profiling/emu/check.sh); gpu_check.sh's e2e section is the same check at a larger size.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use boa_cuda::model::synth::{SynthSpec, write_model};

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

#[test]
fn run_on_cuda_matches_run_on_the_cpu() {
    if let Err(why) = boa_cuda::backend::cuda::CudaBackend::new(0) {
        println!("skipped: {why}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("synth");
    let spec = SynthSpec {
        d: 256,
        d_ff: 688,
        n_heads: 4,
        n_kv_heads: 2,
        ..SynthSpec::tiny()
    };
    write_model(&model, &spec).unwrap();
    let calib = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let configs: [&[&str]; 2] = [
        &[
            "--method",
            "boa",
            "--wbits",
            "3",
            "--scale-search",
            "minmax",
        ],
        &["--method", "gptq", "--wbits", "4", "--group-size", "64"],
    ];
    for cfg in configs {
        let mut errors = Vec::new();
        for dev in ["cuda", "cpu"] {
            let out = tmp.path().join(format!("q-{dev}"));
            let mut args = vec![
                "run",
                "--model",
                model.to_str().unwrap(),
                "--calib",
                calib.to_str().unwrap(),
                "--nsamples",
                "8",
                "--seqlen",
                "128",
                "--format",
                "fake",
                "--quiet",
                "--device",
                dev,
                "--out",
                out.to_str().unwrap(),
            ];
            args.extend_from_slice(cfg);
            let (code, _, err) = common::run(&args);
            assert_eq!(code, 0, "run {cfg:?} --device {dev} failed: {err}");
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
    }
}
