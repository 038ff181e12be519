//! `boa-cuda run` end to end on a tiny synthetic model: every method writes a folder that `eval` loads, with
//! report.json; unselected blocks are copied through byte for byte; bad input is refused before anything is
//! written to --out.

mod common;
use common::*;
use std::fs;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn calib_text(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("calib.txt");
    let speeches = texts_dir().join("sotu/1946_harry_s_truman_d.txt");
    fs::write(&p, fs::read_to_string(speeches).unwrap()).unwrap();
    p
}

fn tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    for f in fs::read_dir(dir).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            let bytes = fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (n, v) in st.tensors() {
                out.insert(n, v.data().to_vec());
            }
        }
    }
    out
}

/// A BoA 3-bit gptq_v2 run of `m` (4 × 64 calibration tokens) into `out` with `extra` arguments: its tensors
/// and report.json.
fn boa3(
    m: &Path,
    calib: &Path,
    out: &Path,
    extra: &[&str],
) -> (
    std::collections::BTreeMap<String, Vec<u8>>,
    serde_json::Value,
) {
    let mut a = vec![
        "run",
        "--model",
        s(m),
        "--calib",
        s(calib),
        "--method",
        "boa",
        "--wbits",
        "3",
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--format",
        "gptq_v2",
        "--out",
        s(out),
        "--quiet",
    ];
    a.extend_from_slice(extra);
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "{}: {err}", out.display());
    let report = serde_json::from_slice(&fs::read(out.join("report.json")).unwrap()).unwrap();
    (tensors(out), report)
}

#[test]
fn every_method_writes_a_loadable_folder_with_report() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    for method in ["rtn", "gptq", "boa"] {
        let out = tmp.path().join(format!("q-{method}"));
        let (code, stdout, err) = run(&[
            "run",
            "--model",
            s(&m),
            "--calib",
            s(&calib),
            "--method",
            method,
            "--wbits",
            "3",
            "--group-size",
            "32",
            "--nsamples",
            "4",
            "--seqlen",
            "64",
            "--layers",
            "1",
            "--out",
            s(&out),
            "--quiet",
            "--format",
            "fake",
        ]);
        assert_eq!(code, 0, "{method}: {err}");
        assert!(stdout.contains("wrote"), "{stdout}");
        for f in [
            "config.json",
            "tokenizer.json",
            "report.json",
            "model.safetensors.index.json",
        ] {
            assert!(out.join(f).is_file(), "{method}: {f} missing");
        }
        let report: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
        let layers = report["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "only layer 1 was selected");
        assert_eq!(layers[0]["linears"].as_array().unwrap().len(), 7);
        assert!(report["peak_rss_bytes"].as_u64().unwrap() > 0);
        assert!(report["seconds"]["total"].as_f64().unwrap() > 0.0);
        if method != "rtn" {
            for lin in layers[0]["linears"].as_array().unwrap() {
                let (before, after) = (
                    lin["rtn_error"].as_f64().unwrap(),
                    lin["error"].as_f64().unwrap(),
                );
                assert!(
                    after < before,
                    "{method} {}: error {after} not below RTN's {before}",
                    lin["name"]
                );
            }
        }
        // Layer 0 was not selected: copied through byte for byte; layer 1's weights changed.
        let (a, b) = (tensors(&m), tensors(&out));
        assert_eq!(
            a["model.layers.0.self_attn.q_proj.weight"],
            b["model.layers.0.self_attn.q_proj.weight"]
        );
        assert_ne!(
            a["model.layers.1.self_attn.q_proj.weight"],
            b["model.layers.1.self_attn.q_proj.weight"]
        );
        assert_eq!(
            a["model.embed_tokens.weight"],
            b["model.embed_tokens.weight"]
        );
        let (code, _, err) = run(&[
            "eval",
            "--model",
            s(&out),
            "--data",
            s(&calib),
            "--seqlen",
            "64",
            "--max-windows",
            "2",
            "--json",
        ]);
        assert_eq!(code, 0, "{method}: eval of the output failed: {err}");
    }
}

/// Each bad input: exit 2, one line naming the problem, and no --out (nor partial folder) left behind.
#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    let out = tmp.path().join("out");
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "run",
            "--model",
            s(&m),
            "--calib",
            s(&calib),
            "--out",
            s(&out),
            "--seqlen",
            "64",
        ]
        .iter()
        .map(|x| x.to_string())
        .collect();
        v.extend(extra.iter().map(|x| x.to_string()));
        v
    };
    let check = |extra: &[&str], needles: &[&str]| {
        let args = base(extra);
        let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
        assert_user_error(&refs, needles);
        assert!(!out.exists(), "--out was written for {extra:?}");
        assert!(
            !tmp.path().join(".out.partial").exists(),
            "partial folder left for {extra:?}"
        );
    };
    check(
        &["--nsamples", "50000"],
        &["calibration text has", "fewer than --nsamples 50000"],
    );
    check(&["--layers", "0-5"], &["layer 2", "layers 0-1"]);
    check(&["--layers", "1-x"], &["invalid layer range"]);
    check(&["--wbits", "5"], &["--wbits 5", "2, 3, 4, 8"]);
    check(&["--group-size", "7"], &["--group-size 7"]);
    check(&["--group-size", "0"], &["--group-size 0"]);
    check(&["--group-size", "256"], &["larger than"]);
    check(&["--damp", "0"], &["--damp"]);
    check(
        &["--signed-scales", "--format", "gptq_v2", "--sym"],
        &["--signed-scales", "--format gptq_v2", "negative scale"],
    );
    check(
        &["--signed-scales", "--format", "fake"],
        &["--signed-scales", "symmetric", "--sym"],
    );

    // NaN in a weight: the tensor is named. A norm weight of 1e30 makes X Xᵀ overflow: the Hessian stays
    // singular through every damping retry, and the layer is named.
    for (tensor, value, needles) in [
        (
            "model.layers.1.mlp.up_proj.weight",
            f32::NAN,
            ["model.layers.1.mlp.up_proj.weight", "non-finite"],
        ),
        (
            "model.layers.0.input_layernorm.weight",
            1e30,
            ["layer 0 self_attn.q_proj", "singular"],
        ),
    ] {
        let bad = tmp.path().join(tensor);
        boa_cuda::model::synth::write_model(&bad, &boa_cuda::model::synth::SynthSpec::tiny())
            .unwrap();
        poke(&bad, tensor, value);
        let args = [
            "run",
            "--model",
            s(&bad),
            "--calib",
            s(&calib),
            "--out",
            s(&out),
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--method",
            "gptq",
        ];
        assert_user_error(&args, &needles);
        assert!(!out.exists());
    }
}

/// Sets element 3 of tensor `name` (f32) in the model's safetensors to `v`.
fn poke(model: &Path, name: &str, v: f32) {
    let path = model.join("model.safetensors");
    let mut bytes = fs::read(&path).unwrap();
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let info = meta.tensors()[name].clone();
    let off = 8 + n + info.data_offsets.0 + 3 * 4;
    bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
    fs::write(&path, bytes).unwrap();
}

#[test]
fn profile_prints_every_phase_and_the_memory_plan_comes_first() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    let out = tmp.path().join("q");
    let (code, stdout, err) = run(&[
        "run",
        "--model",
        s(&m),
        "--calib",
        s(&calib),
        "--method",
        "boa",
        "--wbits",
        "4",
        "--nsamples",
        "4",
        "--seqlen",
        "64",
        "--out",
        s(&out),
        "--format",
        "fake",
        "--device",
        "cpu",
        "--profile",
    ]);
    assert_eq!(code, 0, "{err}");
    // The plan is stated before the work starts, with the activations of 4 × 64 tokens on the host.
    let plan = err
        .find("memory plan:")
        .unwrap_or_else(|| panic!("no plan in {err}"));
    assert!(err[plan..].contains("calibration activations X"), "{err}");
    let shares: Vec<f64> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && l.ends_with("% |") && !l.starts_with("| total"))
        .map(|l| {
            let cell = l.rsplit('|').nth(1).unwrap().trim().trim_end_matches('%');
            cell.parse().unwrap()
        })
        .collect();
    for phase in [
        "weights load",
        "forward",
        "statistics",
        "factorization",
        "scale search",
        "sweep",
        "write",
    ] {
        assert!(
            stdout.contains(&format!("| {phase}")),
            "{phase} missing: {stdout}"
        );
    }
    let sum: f64 = shares.iter().sum();
    assert!((sum - 100.0).abs() < 0.5, "shares sum to {sum}: {stdout}");
}

/// `--refit-scales` on one block (later blocks would see its new Ŵ): the same codes and zero points, new scales
/// for the linears GPTQ swept (BoA's q/k/v keep theirs), and no such linear's reported error
/// tr(ΔW H ΔWᵀ)/tr(W H Wᵀ) above the plain run's.
#[test]
fn refit_scales_keeps_the_codes_and_lowers_the_gptq_linears_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    let quantize = |name: &str, extra: &[&str]| {
        let mut a = vec!["--group-size", "32", "--layers", "0"];
        a.extend_from_slice(extra);
        boa3(&m, &calib, &tmp.path().join(name), &a)
    };
    let (plain, plain_report) = quantize("plain", &[]);
    let (refit, refit_report) = quantize("refit", &["--refit-scales"]);
    assert_eq!(
        plain.keys().collect::<Vec<_>>(),
        refit.keys().collect::<Vec<_>>()
    );
    let mut changed = 0;
    for (name, bytes) in &plain {
        let attention_boa = ["q_proj", "k_proj", "v_proj"]
            .iter()
            .any(|p| name.contains(p));
        if name.ends_with(".scales") && !attention_boa {
            changed += usize::from(refit[name] != *bytes);
        } else {
            assert!(refit[name] == *bytes, "{name} changed");
        }
    }
    assert!(changed > 0, "no scales changed");
    let mut lower = 0;
    let layers = |r: &serde_json::Value| r["layers"].as_array().unwrap().clone();
    for (a, b) in layers(&plain_report).iter().zip(&layers(&refit_report)) {
        for (x, y) in a["linears"]
            .as_array()
            .unwrap()
            .iter()
            .zip(b["linears"].as_array().unwrap())
        {
            let (e0, e1) = (x["error"].as_f64().unwrap(), y["error"].as_f64().unwrap());
            let name = x["name"].as_str().unwrap();
            if x["method"] == "gptq" {
                // The plain run's figure is the sweep's loss (damped H), the refit's the undamped trace.
                assert!(e1 <= e0 * (1.0 + 1e-3), "{name}: {e1} > {e0}");
                lower += usize::from(e1 < e0);
            } else {
                assert_eq!(e0, e1, "{name}");
            }
        }
    }
    assert!(lower > 0, "no error fell");
    for (extra, needle) in [
        (&["--method", "rtn"][..], "--method gptq or boa"),
        (&["--device", "cuda"][..], "CPU only"),
    ] {
        let args = [&["--refit-scales"][..], extra].concat();
        assert_refused(
            &m,
            &calib,
            &tmp.path().join("refused"),
            &args,
            &["--refit-scales", needle],
        );
    }
}

/// `--asym-calib`: block 0 reads the same input in both streams, so its target is W and its tensors are the
/// plain run's byte for byte; block 1's FP stream differs from its quantized one, so its target moves and its
/// tensors differ. Refused where it cannot run (exit 2, nothing written).
#[test]
fn asym_calib_leaves_block_0_and_moves_later_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    let quantize = |name: &str, extra: &[&str]| boa3(&m, &calib, &tmp.path().join(name), extra).0;
    let plain = quantize("plain", &[]);
    let asym = quantize("asym", &["--asym-calib"]);
    let (mut block0, mut moved) = (0, 0);
    for (name, bytes) in &plain {
        if name.starts_with("model.layers.0.") {
            assert!(asym[name] == *bytes, "{name} changed in block 0");
            block0 += 1;
        } else if name.starts_with("model.layers.1.") && name.ends_with(".qweight") {
            // Every linear of block 1 gets a moved target, BoA's V included.
            assert!(asym[name] != *bytes, "{name} did not move");
            moved += 1;
        }
    }
    assert!(
        block0 > 0 && moved == 7,
        "block 0: {block0} tensors, moved: {moved}"
    );
    for (extra, needle) in [
        (&["--method", "rtn"][..], "--method gptq or boa"),
        (&["0"][..], "(0, 1]"),
        (&["1.5"][..], "(0, 1]"),
    ] {
        let args = [&["--asym-calib"][..], extra].concat();
        assert_refused(
            &m,
            &calib,
            &tmp.path().join("refused"),
            &args,
            &["--asym-calib", needle],
        );
    }
}

/// `run` of `m` into `out` with `args` exits 2 naming `needles`, and writes nothing.
fn assert_refused(m: &Path, calib: &Path, out: &Path, args: &[&str], needles: &[&str]) {
    let mut a = vec!["run", "--model", s(m), "--calib", s(calib), "--out", s(out)];
    a.extend_from_slice(args);
    assert_user_error(&a, needles);
    assert!(!out.exists());
}

/// `run` says when vLLM 0.32 would refuse the GPTQ checkpoint it writes, and what to pass instead
/// (README "vLLM", measured with tests/vllm_load.rs): asymmetric grids, act-order with dynamic groups. A
/// checkpoint vLLM serves gets no such note.
#[test]
fn run_notes_what_vllm_refuses() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny_model(tmp.path());
    let calib = calib_text(tmp.path());
    let asym = "vLLM 0.32 refuses asymmetric GPTQ";
    let desc_act = "vLLM 0.32 refuses act-order with groups";
    for (i, (extra, want, not)) in [
        (&["--format", "gptq_v2"][..], asym, desc_act),
        (&["--sym", "--act-order"][..], desc_act, asym),
        (
            &[
                "--sym",
                "--act-order",
                "--static-groups",
                "--format",
                "gptq",
            ][..],
            "",
            "vLLM",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let out = tmp.path().join(format!("q{i}"));
        let mut args = vec![
            "run",
            "--model",
            s(&m),
            "--calib",
            s(&calib),
            "--method",
            "gptq",
            "--wbits",
            "4",
            "--group-size",
            "32",
            "--nsamples",
            "2",
            "--seqlen",
            "64",
            "--layers",
            "1",
            "--out",
            s(&out),
        ];
        args.extend_from_slice(extra);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{extra:?}: {err}");
        assert!(err.contains(want) && !err.contains(not), "{extra:?}: {err}");
    }
}
