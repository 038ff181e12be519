//! Packed GPTQ checkpoints end to end, through the binary: `run --format gptq|gptq_v2` writes a checkpoint whose
//! perplexity (evaluated with the packed GEMM, weights never dequantized whole) equals the fake-quant folder's
//! from the same options; `inspect` describes it; malformed checkpoints and unstorable v1 zeros are one-line
//! errors with exit code 2.

mod common;

use boa_cuda::export::safetensors_out::{TensorEntry, write_safetensors};
use common::{assert_user_error, demo_model, run, texts_dir, tiny_model};
use std::collections::HashMap;
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn ok(args: &[&str]) -> String {
    let (code, out, err) = run(args);
    assert_eq!(code, 0, "{args:?} failed: {err}");
    out
}

fn ppl(model: &Path, seqlen: &str) -> f64 {
    let data = texts_dir().join("sotu");
    let out = ok(&[
        "eval",
        "--model",
        s(model),
        "--data",
        s(&data),
        "--seqlen",
        seqlen,
        "--max-windows",
        "3",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["perplexity"].as_f64().unwrap()
}

/// Quantizes `model` with `args` once per format; returns the output folders.
fn run_formats(
    model: &Path,
    tmp: &Path,
    args: &[&str],
    formats: &[&str],
) -> Vec<std::path::PathBuf> {
    formats
        .iter()
        .map(|f| {
            let out = tmp.join(f);
            let mut a = vec![
                "run",
                "--model",
                s(model),
                "--out",
                s(&out),
                "--format",
                f,
                "--quiet",
            ];
            a.extend_from_slice(args);
            ok(&a);
            out
        })
        .collect()
}

fn assert_close(a: f64, b: f64, what: &str) {
    let rel = (a - b).abs() / b;
    assert!(
        rel < 1e-3,
        "{what}: perplexity {a} vs fake-quant {b} (rel {rel:.2e})"
    );
}

#[test]
fn packed_demo_rtn_perplexity_matches_fake() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs = run_formats(
        &demo_model(),
        tmp.path(),
        // v1 ("gptq") stores zero − 1, so it takes symmetric grids only.
        &[
            "--method",
            "rtn",
            "--wbits",
            "4",
            "--group-size",
            "128",
            "--sym",
        ],
        &["fake", "gptq"],
    );
    let (fake, packed) = (ppl(&dirs[0], "128"), ppl(&dirs[1], "128"));
    assert_close(packed, fake, "rtn 4-bit g128 gptq");

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dirs[1].join("config.json")).unwrap())
            .unwrap();
    let q = &cfg["quantization_config"];
    assert_eq!(q["quant_method"], "gptq");
    assert_eq!(q["bits"], 4);
    assert_eq!(q["group_size"], 128);
    assert_eq!(q["checkpoint_format"], "gptq");
    for k in [
        "desc_act",
        "sym",
        "damp_percent",
        "static_groups",
        "true_sequential",
    ] {
        assert!(q.get(k).is_some(), "quantization_config lacks {k}");
    }
    let qc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dirs[1].join("quantize_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(&qc, q);

    let info = ok(&["inspect", s(&dirs[1])]);
    assert!(
        info.contains("30 of 30 layers (210 packed linears)")
            && info.contains("gptq, 4-bit, group size 128"),
        "{info}"
    );
}

#[test]
fn packed_demo_gptq_act_order_v2_perplexity_matches_fake() {
    let tmp = tempfile::tempdir().unwrap();
    let calib = texts_dir().join("sotu");
    let dirs = run_formats(
        &demo_model(),
        tmp.path(),
        &[
            "--method",
            "gptq",
            "--wbits",
            "3",
            "--group-size",
            "64",
            "--act-order",
            "--layers",
            "0",
            "--nsamples",
            "4",
            "--seqlen",
            "128",
            "--calib",
            s(&calib),
        ],
        &["fake", "gptq_v2"],
    );
    let (fake, packed) = (ppl(&dirs[0], "128"), ppl(&dirs[1], "128"));
    assert_close(packed, fake, "gptq 3-bit g64 act-order gptq_v2");
    let info = ok(&["inspect", s(&dirs[1])]);
    assert!(
        info.contains("1 of 30 layers (7 packed linears)")
            && info.contains("gptq_v2, 3-bit, group size 64, desc_act true")
            && info.contains("act-order g_idx yes"),
        "{info}"
    );
}

/// --act-order with --static-groups: the groups are cut in natural column order before the sweep, so g_idx
/// is the plain c / g and the checkpoint says desc_act false ("static activation ordering", which vLLM 0.32
/// loads while it refuses desc_act true); the formats without g_idx (compressed-tensors, GGUF) take it too.
/// Each folder's perplexity equals the fake-quant one's.
#[test]
fn packed_demo_static_act_order_is_plain_groups() {
    let tmp = tempfile::tempdir().unwrap();
    let calib = texts_dir().join("sotu");
    // Positive scales: GGUF's default mirrors a symmetric grid where it helps (--signed-scales), the other
    // formats do not, and the gguf folder's fake twin must hold the same codes.
    let run_with = |group: &str, formats: &[&str]| {
        let sub = tmp.path().join(format!("g{group}"));
        run_formats(
            &demo_model(),
            &sub,
            &[
                "--no-signed-scales",
                "--method",
                "gptq",
                "--act-order",
                "--static-groups",
                "--sym",
                "--group-size",
                group,
                "--layers",
                "0",
                "--nsamples",
                "4",
                "--seqlen",
                "128",
                "--calib",
                s(&calib),
            ],
            formats,
        )
    };
    let dirs = run_with("64", &["fake", "gptq", "compressed-tensors"]);
    let fake = ppl(&dirs[0], "128");
    for (dir, what, fmt) in [
        (
            &dirs[1],
            "gptq",
            "gptq, 4-bit, group size 64, desc_act false",
        ),
        (
            &dirs[2],
            "compressed-tensors",
            "pack-quantized, 4-bit, group size 64, desc_act false",
        ),
    ] {
        assert_close(ppl(dir, "128"), fake, &format!("static act-order {what}"));
        let info = ok(&["inspect", s(dir)]);
        assert!(
            info.contains(fmt) && info.contains("act-order g_idx no"),
            "{info}"
        );
    }
    // GGUF: Q4_0's 32-column blocks.
    let dirs = run_with("32", &["fake", "gguf"]);
    let gguf = dirs[1].join("model.gguf");
    assert!(gguf.is_file(), "no {}", gguf.display());
    // The same codes as the fake twin: the GGUF importer gives back the fake folder's model.
    let imported = tmp.path().join("imported");
    ok(&["import-gguf", s(&gguf), "--out", s(&imported)]);
    assert_close(
        ppl(&imported, "128"),
        ppl(&dirs[0], "128"),
        "static act-order gguf",
    );
}

/// BoA with --act-order and groups: V's heads would order the columns each their own way, so V keeps its
/// natural order (one g_idx per matrix) and `run` says so; q/k and the MLP follow act-order. Before, the run
/// failed at block 0's v_proj after the calibration forward.
#[test]
fn packed_demo_boa_act_order_with_groups_matches_fake() {
    let tmp = tempfile::tempdir().unwrap();
    let calib = texts_dir().join("sotu");
    let args = [
        "--method",
        "boa",
        "--act-order",
        "--group-size",
        "64",
        "--layers",
        "0",
        "--nsamples",
        "4",
        "--seqlen",
        "128",
        "--calib",
        s(&calib),
    ];
    let fake = run_formats(&demo_model(), tmp.path(), &args, &["fake"]).remove(0);
    let packed = tmp.path().join("gptq_v2");
    let model = demo_model();
    let mut a = vec!["run", "--model", s(&model), "--out", s(&packed)];
    a.extend_from_slice(&args);
    let (code, _, err) = run(&a);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(
            "note: with --act-order and groups, BoA quantizes v_proj in its natural column order"
        ),
        "{err}"
    );
    assert_close(
        ppl(&packed, "128"),
        ppl(&fake, "128"),
        "boa 4-bit g64 act-order",
    );
    let info = ok(&["inspect", s(&packed)]);
    assert!(
        info.contains("desc_act true") && info.contains("act-order g_idx yes"),
        "{info}"
    );
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(packed.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let g_idx = |linear: &str| -> Vec<i32> {
        let name = format!("model.layers.0.self_attn.{linear}.g_idx");
        let file = packed.join(index["weight_map"][&name].as_str().unwrap());
        let bytes = std::fs::read(file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(&name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let natural: Vec<i32> = (0..576).map(|j| j / 64).collect();
    assert_eq!(g_idx("v_proj"), natural);
    assert_ne!(g_idx("q_proj"), natural, "q_proj follows act-order");
}

/// Rewrites every tensor of `file` through `f` (None drops it).
fn rewrite(
    file: &Path,
    f: impl Fn(&str, safetensors::Dtype, &[usize], &[u8]) -> Option<(Vec<usize>, Vec<u8>)>,
) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let entries: Vec<TensorEntry> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, v)| {
            f(&name, v.dtype(), v.shape(), v.data())
                .map(|(shape, data)| TensorEntry::new(name, v.dtype(), shape, data))
        })
        .collect();
    write_safetensors(file, &entries, HashMap::new()).unwrap();
}

/// A tiny model quantized to gptq_v2 (4-bit, groups of 32), evaluated once to show it loads.
fn tiny_packed(tmp: &Path) -> std::path::PathBuf {
    let model = tiny_model(tmp);
    let out = tmp.join("q");
    ok(&[
        "run",
        "--model",
        s(&model),
        "--method",
        "rtn",
        "--wbits",
        "3",
        "--group-size",
        "32",
        "--out",
        s(&out),
        "--format",
        "gptq_v2",
        "--quiet",
    ]);
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The shard holding block 0 of a run's output.
fn shard0(dir: &Path) -> std::path::PathBuf {
    let idx: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    dir.join(
        idx["weight_map"]["model.layers.0.mlp.up_proj.qweight"]
            .as_str()
            .unwrap(),
    )
}

#[test]
fn packed_bad_checkpoints_are_user_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tiny_packed(tmp.path());
    let data = tmp.path().join("text.txt");
    std::fs::write(
        &data,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let eval = |dir: &Path| {
        vec![
            "eval".to_string(),
            "--model".into(),
            s(dir).into(),
            "--data".into(),
            s(&data).into(),
            "--seqlen".into(),
            "32".into(),
        ]
    };
    let (code, _, err) = run(&eval(&good).iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert_eq!(code, 0, "the tiny packed checkpoint should evaluate: {err}");

    // qweight with a row too few for 3 bits × d_in 160.
    let d = tmp.path().join("bad_shape");
    copy_dir(&good, &d);
    rewrite(&shard0(&d), |name, _, shape, data| {
        if name == "model.layers.0.mlp.down_proj.qweight" {
            let row = shape[1] * 4;
            Some((vec![shape[0] - 1, shape[1]], data[row..].to_vec()))
        } else {
            Some((shape.to_vec(), data.to_vec()))
        }
    });
    let a = eval(&d);
    assert_user_error(
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        &[
            "model.layers.0.mlp.down_proj.qweight",
            "shape [14, 64]",
            "[15, 64]",
        ],
    );
    assert_user_error(&["inspect", s(&d)], &["down_proj.qweight", "shape"]);

    // Missing scales.
    let d = tmp.path().join("no_scales");
    copy_dir(&good, &d);
    rewrite(&shard0(&d), |name, _, shape, data| {
        (name != "model.layers.0.self_attn.k_proj.scales").then(|| (shape.to_vec(), data.to_vec()))
    });
    let a = eval(&d);
    assert_user_error(
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        &["model.layers.0.self_attn.k_proj.scales is missing"],
    );

    // Unknown checkpoint_format.
    let d = tmp.path().join("bad_format");
    copy_dir(&good, &d);
    let p = d.join("config.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"gptq_v2\"", "\"gptq_v9\"");
    std::fs::write(&p, text).unwrap();
    let a = eval(&d);
    assert_user_error(
        &a.iter().map(|s| s.as_str()).collect::<Vec<_>>(),
        &["unknown checkpoint_format \"gptq_v9\""],
    );
    assert_user_error(&["inspect", s(&d)], &["checkpoint_format"]);
}

/// v1 stores zero − 1, so an asymmetric grid's zero point 0 cannot be stored. It used to fail at the first
/// layer that had one (block 11 of the demo model at RTN 3-bit g128), after the work; now an asymmetric v1
/// run is refused before block 0, whatever the weights, and v1 with --sym and v2 both store the layer.
#[test]
fn packed_v1_refuses_asymmetric_grids_before_block_0() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    // Make one layer's weights nonnegative: its asymmetric min-max zero point is 0.
    rewrite(&model.join("model.safetensors"), |name, _, shape, data| {
        let data = if name == "model.layers.1.self_attn.o_proj.weight" {
            data.chunks_exact(4)
                .flat_map(|c| {
                    f32::from_le_bytes([c[0], c[1], c[2], c[3]])
                        .abs()
                        .to_le_bytes()
                })
                .collect()
        } else {
            data.to_vec()
        };
        Some((shape.to_vec(), data))
    });
    let out = tmp.path().join("q");
    let args = [
        "run",
        "--model",
        s(&model),
        "--method",
        "rtn",
        "--out",
        s(&out),
        "--format",
        "gptq",
        "--quiet",
    ];
    assert_user_error(
        &args,
        &["--format gptq", "zero point 0", "gptq_v2", "--sym"],
    );
    assert!(!out.exists(), "nothing may be written at --out");
    assert!(
        !tmp.path().join(".q.partial").exists(),
        "refused after the work had started"
    );
    // gptq_v2 stores it, and so does v1 with a symmetric grid.
    let mut a = args.to_vec();
    a[8] = "gptq_v2";
    ok(&a);
    let sym = tmp.path().join("qs");
    let mut a = args.to_vec();
    a[6] = s(&sym);
    a.push("--sym");
    ok(&a);
    let info = ok(&["inspect", s(&sym)]);
    assert!(
        info.contains("gptq, 4-bit") && info.contains("sym true"),
        "{info}"
    );
}

/// The body of the packed_checkpoint fuzz target on stable Rust: seeded mutations of a tiny gptq_v2
/// checkpoint's first shard (biased to its header) and of its quantize_config.json, through
/// `Model::open`, every block loader and `inspect`. Never a panic, every error a user error. Run by
/// scripts/fuzz.sh (BOA_FUZZ_ITERS, BOA_FUZZ_SECS, BOA_FUZZ_SEED).
#[test]
#[ignore]
fn fuzz_packed_checkpoint_mutations() {
    use rand::{RngExt, SeedableRng};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_packed(tmp.path());
    // quantize_config.json is read only when config.json has no quantization_config.
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
    let shard = shard0(&dir);
    let qc = dir.join("quantize_config.json");
    let (good_shard, good_qc) = (std::fs::read(&shard).unwrap(), std::fs::read(&qc).unwrap());
    let hot = 8 + u64::from_le_bytes(good_shard[..8].try_into().unwrap()) as usize;
    let seed: u64 = std::env::var("BOA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    common::limit_address_space(16 << 30);
    let (iters, secs) = common::fuzz_budget();
    let t0 = std::time::Instant::now();
    let (mut n, mut opened) = (0u64, 0u64);
    while n < iters && t0.elapsed() < secs {
        let (s, q) = if rng.random_bool(0.8) {
            (common::mutate(&good_shard, &mut rng, hot), good_qc.clone())
        } else {
            (
                good_shard.clone(),
                common::mutate(&good_qc, &mut rng, good_qc.len()),
            )
        };
        std::fs::write(&shard, &s).unwrap();
        std::fs::write(&qc, &q).unwrap();
        let r = std::panic::catch_unwind(|| {
            let model = boa_cuda::model::Model::open(&dir)?;
            for l in 0..model.cfg.n_layers {
                model.load_block(l)?;
            }
            boa_cuda::model::packed::inspect(&dir)?;
            anyhow::Ok(())
        });
        match r {
            Ok(Ok(())) => opened += 1,
            Ok(Err(e)) => assert!(
                e.downcast_ref::<boa_cuda::error::BoaError>().is_some(),
                "iteration {n} (seed {seed}): not a user error: {e:#}"
            ),
            Err(_) => {
                let p = std::env::temp_dir().join(format!("boa-fuzz-crash-packed-{seed}-{n}"));
                std::fs::create_dir_all(&p).unwrap();
                std::fs::write(p.join("shard.safetensors"), &s).unwrap();
                std::fs::write(p.join("quantize_config.json"), &q).unwrap();
                panic!(
                    "iteration {n} (seed {seed}) panicked; inputs saved to {}",
                    p.display()
                );
            }
        }
        n += 1;
    }
    eprintln!(
        "fuzz_packed_checkpoint_mutations: {n} inputs ({opened} still valid) in {:.1?}",
        t0.elapsed()
    );
}

/// Writes the tiny checkpoint's first shard and its quantize_config.json into
/// $BOA_FUZZ_SEED_DIR/packed_checkpoint (scripts/fuzz.sh).
#[test]
#[ignore]
fn write_fuzz_seed() {
    let Some(seeds) = std::env::var_os("BOA_FUZZ_SEED_DIR") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny_packed(tmp.path());
    let d = Path::new(&seeds).join("packed_checkpoint");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::copy(shard0(&dir), d.join("shard0.safetensors")).unwrap();
    std::fs::copy(
        dir.join("quantize_config.json"),
        d.join("quantize_config.json"),
    )
    .unwrap();
}
