//! The quality ordering on the demo model, in a setting small enough for CI: 3-bit per-channel, calibrated
//! on 8 windows × 256 tokens of the speeches before 2000; perplexity on the 2001–2016 speeches and on
//! Moby-Dick (4 windows × 512 each) must order BoA < GPTQ < RTN. The README's table does the full setting.

mod common;
use common::*;

fn ppl(model: &str, data: &[String]) -> f64 {
    let mut args = vec![
        "eval",
        "--model",
        model,
        "--seqlen",
        "512",
        "--max-windows",
        "4",
        "--json",
        "--data",
    ];
    args.extend(data.iter().map(|s| s.as_str()));
    let (code, out, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str::<serde_json::Value>(out.trim()).unwrap()["perplexity"]
        .as_f64()
        .unwrap()
}

#[test]
fn boa_beats_gptq_beats_rtn_on_the_demo_model() {
    let model = demo_model();
    let tmp = tempfile::tempdir().unwrap();
    let calib = sotu_speeches(|y| y < 2000);
    let speeches = sotu_speeches(|y| (2001..=2016).contains(&y));
    let moby = vec![
        texts_dir()
            .join("moby-dick.txt")
            .to_str()
            .unwrap()
            .to_string(),
    ];
    let mut results = Vec::new();
    for method in ["rtn", "gptq", "boa"] {
        let out = tmp.path().join(method);
        let mut args = vec![
            "run",
            "--model",
            model.to_str().unwrap(),
            "--method",
            method,
            "--wbits",
            "3",
            "--group-size",
            "-1",
            "--nsamples",
            "8",
            "--seqlen",
            "256",
            "--seed",
            "0",
            "--out",
            out.to_str().unwrap(),
            "--quiet",
            "--calib",
        ];
        args.extend(calib.iter().map(|s| s.as_str()));
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{method}: {err}");
        let o = out.to_str().unwrap();
        results.push((method, ppl(o, &speeches), ppl(o, &moby)));
    }
    eprintln!("(method, 2001-2016 speeches, Moby-Dick): {results:?}");
    let [rtn, gptq, boa] = [results[0], results[1], results[2]];
    assert!(boa.1 < gptq.1 && gptq.1 < rtn.1, "speeches: {results:?}");
    assert!(boa.2 < gptq.2 && gptq.2 < rtn.2, "Moby-Dick: {results:?}");
}
