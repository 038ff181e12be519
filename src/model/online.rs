//! QuaRot's R4 (issue 23): an online Hadamard transform of down_proj's input, a ↦ a · Q with
//! Q = I_{n/b} ⊗ H_b / √b (n = d_ff, H_b from `hadamard.rs`, no random signs), whose inverse
//! `rotate --online` folds into down_proj's columns (W_down ← W_down · Q, so a Q · (W_down Q)ᵀ = a W_downᵀ).
//! Unlike R1 and R2 it cannot be folded away: SwiGLU's product sits between up_proj and down_proj. The
//! transform spreads the outliers of the MLP's activations over the columns of each block of b before
//! down_proj reads them, as R1 does for the residual stream. In a mixture of experts every expert's
//! down_proj (and the shared expert's) gets the same I ⊗ Q_b, so b divides all their widths.
//!
//! Why blocks: b = m · 2^k is applied by the fast transform (Walsh–Hadamard on the Sylvester factor, a
//! dense product on H_m: `Backend::block_hadamard_t`, on the CPU and on a GPU, ops.cu block_hadamard), d_ff ·
//! (k + m) per token, so the dense factor m must stay small. With b = n (the whole width, QuaRot's choice)
//! 11008 needs a 5504-order Paley matrix (m = 5504: a dense product 1.3× down_proj's); with b ≤ `MAX_BLOCK`
//! every d_ff with a power of two in it has a transform (11008 = 43 · 256, m = 1; Qwen2.5-7B's 18944 =
//! 16 · 1184, m = 148; Llama-3's 14336 = 7 · 2048, m = 1), and even the dense GEMM a longer block falls
//! back to costs at most half of down_proj at d = 4096. Its matrix is b² instead of n².
//!
//! Such a checkpoint computes the original function only in a forward that applies Q: boa-cuda's (`eval`,
//! and `run` on it). So that no other loader runs it as a plain model of its architecture, config.json's
//! `model_type` becomes `MODEL_TYPE` (transformers, GPTQModel and vLLM pick the model class from it and
//! stop on one they do not know), the original kept in `boa_cuda.online_hadamard`; GGUF, which has no such
//! field that llama.cpp reads, is refused by `run`.

use super::orthogonal::Orthogonal;
use serde::{Deserialize, Serialize};

/// config.json's `model_type` for a checkpoint that needs the online transform.
pub const MODEL_TYPE: &str = "boa_cuda_online_hadamard";

/// The only place the transform is applied: the MLP's down_proj (in a mixture of experts every expert's and
/// the shared expert's).
pub const BEFORE: &str = "mlp.down_proj";

/// `boa_cuda.online_hadamard` in config.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    /// The linear whose input is transformed (always `BEFORE`).
    pub before: String,
    /// n: the transform is n × n (d_ff; in a mixture of experts each expert's width, and b divides the
    /// shared expert's too).
    pub size: usize,
    /// b: the transform is I_{n/b} ⊗ H_b / √b; absent when b = n (checkpoints made before blocks existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<usize>,
    /// How H_b was built, e.g. "Hadamard 1536 = 12 (Paley I, q = 11) ⊗ 128 (Sylvester)".
    pub construction: String,
    /// The architecture's own `model_type`, which `MODEL_TYPE` replaces.
    pub model_type: Option<String>,
}

/// The largest block order `block` picks by itself (see the module's "Why blocks").
pub const MAX_BLOCK: usize = 2048;

/// The smallest it picks: a block of a few columns spreads an outlier over too few to matter.
pub const MIN_BLOCK: usize = 64;

/// One block's Q_b = H_b / √b, or why this code has no Hadamard matrix of order b (an online transform is
/// applied by its order alone, so it cannot fall back to a seeded random matrix the way R1 and R2 do).
pub fn transform(b: usize) -> Result<Orthogonal, String> {
    Orthogonal::plain_hadamard(b)
        .map_err(|why| format!("--rotate-online needs a Hadamard matrix of order {b}: {why}"))
}

/// How `widths` (every down_proj's input width in a block) are named in a message.
fn widths_text(widths: &[usize]) -> String {
    match widths {
        [w] => format!("the MLP width {w}"),
        _ => format!(
            "the MLP widths {}",
            widths
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(" and ")
        ),
    }
}

fn gcd(a: usize, b: usize) -> usize {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// The block order for a block whose down_projs read `widths` (a dense MLP's d_ff; an MoE block's expert
/// width and its shared expert's): one block order serves them all, so it must divide every width.
/// `asked` (`--rotate-online-block`) when it does and has a Hadamard matrix, else the largest common divisor
/// up to `MAX_BLOCK` that has one, if not below `MIN_BLOCK`.
pub fn block(widths: &[usize], asked: Option<usize>) -> Result<usize, String> {
    let g = widths.iter().fold(0, |g, &w| gcd(g, w));
    if let Some(b) = asked {
        if b == 0 || g == 0 || !g.is_multiple_of(b) {
            return Err(format!(
                "--rotate-online-block {b} does not divide {}",
                widths_text(widths)
            ));
        }
        transform(b)?;
        return Ok(b);
    }
    let b = (1..=MAX_BLOCK.min(g))
        .rev()
        .find(|&b| g.is_multiple_of(b) && Orthogonal::plain_hadamard(b).is_ok())
        .unwrap_or(1);
    match b >= MIN_BLOCK {
        true => Ok(b),
        false => Err(format!(
            "--rotate-online: {} {} from {MIN_BLOCK} to {MAX_BLOCK} with a Hadamard matrix \
             here (the largest is {b}); ask for a smaller block with --online-block (rotate) or \
             --rotate-online-block (run)",
            widths_text(widths),
            match widths.len() {
                1 => "has no divisor",
                _ => "have no common divisor",
            }
        )),
    }
}

/// Marks `config` (a model's config.json) as needing the transform I_{size/b} ⊗ Q_b, Q_b = `q`, before
/// every down_proj (`size`: the first of `down_widths`, an MoE block's expert width).
pub fn mark(config: &mut serde_json::Value, size: usize, q: &Orthogonal) {
    let marker = Marker {
        before: BEFORE.into(),
        size,
        block: (q.n != size).then_some(q.n),
        construction: q.construction.clone(),
        model_type: config["model_type"].as_str().map(str::to_string),
    };
    config["model_type"] = MODEL_TYPE.into();
    config["boa_cuda"]["online_hadamard"] =
        serde_json::to_value(&marker).expect("plain data serializes");
}

/// The transform's block order b when `json` (a config.json) asks for one, checked against the block it
/// applies to: down_projs reading `widths` (`BlockDesc::down_widths`: a dense MLP's d_ff, or an MoE
/// block's expert width and its shared expert's).
pub fn parse(json: &serde_json::Value, widths: &[usize]) -> Result<Option<usize>, String> {
    let typed = json["model_type"].as_str() == Some(MODEL_TYPE);
    let marker = &json["boa_cuda"]["online_hadamard"];
    match (typed, marker.is_null()) {
        (false, true) => return Ok(None),
        (true, true) => {
            return Err(format!(
                "model_type {MODEL_TYPE} without boa_cuda.online_hadamard (which transform?)"
            ));
        }
        (false, false) => {
            return Err(format!(
                "boa_cuda.online_hadamard is set but model_type is not {MODEL_TYPE}: the file was edited; \
                 other loaders would run this model without its online transform"
            ));
        }
        (true, false) => {}
    }
    let m: Marker = serde_json::from_value(marker.clone())
        .map_err(|e| format!("invalid boa_cuda.online_hadamard: {e}"))?;
    if m.before != BEFORE {
        return Err(format!(
            "boa_cuda.online_hadamard.before is {:?}; only {BEFORE:?} is supported",
            m.before
        ));
    }
    if widths.first() != Some(&m.size) {
        return Err(format!(
            "boa_cuda.online_hadamard.size {} is not {}",
            m.size,
            widths_text(&widths[..widths.len().min(1)])
        ));
    }
    let b = m.block.unwrap_or(m.size);
    if b == 0 || !widths.iter().all(|w| w.is_multiple_of(b)) {
        return Err(format!(
            "boa_cuda.online_hadamard.block {b} does not divide {}",
            widths_text(widths)
        ));
    }
    transform(b)?;
    Ok(Some(b))
}

/// One block's transform for the forward: H_b for the host's fast transform (`Backend::block_hadamard_t`)
/// and Q_bᵀ as a linear's weight for a device's GEMM.
#[derive(Debug)]
pub struct OnlineQ {
    pub h: crate::ops::hadamard::Hadamard,
    pub dense: Vec<f32>,
}

impl OnlineQ {
    pub fn new(b: usize) -> Result<OnlineQ, String> {
        Ok(OnlineQ {
            h: crate::ops::hadamard::Hadamard::new(b).map_err(|why| {
                format!("--rotate-online needs a Hadamard matrix of order {b}: {why}")
            })?,
            dense: weight(b)?,
        })
    }
}

/// One block's transform as a linear's weight W = Q_bᵀ [b × b] row-major f32, so that `linear` (a Wᵀ) on
/// rows of b computes a Q_b.
pub fn weight(n: usize) -> Result<Vec<f32>, String> {
    let q = transform(n)?.dense();
    let mut w = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            w[j * n + i] = q[i * n + j] as f32;
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(d_ff: usize) -> serde_json::Value {
        serde_json::json!({ "model_type": "llama", "intermediate_size": d_ff })
    }

    #[test]
    fn a_marked_config_parses_back_and_an_edited_one_is_refused() {
        let mut c = config(48);
        assert_eq!(parse(&c, &[48]), Ok(None));
        mark(&mut c, 48, &transform(48).unwrap());
        assert_eq!(c["model_type"], MODEL_TYPE);
        assert_eq!(c["boa_cuda"]["online_hadamard"]["model_type"], "llama");
        assert_eq!(parse(&c, &[48]), Ok(Some(48)));
        let e = parse(&c, &[64]).unwrap_err();
        assert!(e.contains("not the MLP width 64"), "{e}");
        // An MoE block: the experts' width first, the shared expert's after; the block divides both.
        assert_eq!(parse(&c, &[48, 96]), Ok(Some(48)));
        let e = parse(&c, &[48, 72]).unwrap_err();
        assert!(
            e.contains("does not divide the MLP widths 48 and 72"),
            "{e}"
        );
        let mut edited = c.clone();
        edited["model_type"] = "llama".into();
        let e = parse(&edited, &[48]).unwrap_err();
        assert!(e.contains("other loaders would run"), "{e}");
        let mut bare = config(48);
        bare["model_type"] = MODEL_TYPE.into();
        assert!(parse(&bare, &[48]).is_err());
    }

    #[test]
    fn an_order_without_a_hadamard_matrix_is_refused() {
        // 52 = 4 · 13: 13 is not a Paley order here; 36 = Paley II.
        let Err(e) = transform(52) else {
            panic!("order 52 was built")
        };
        assert!(e.contains("order 52"), "{e}");
        assert!(transform(36).is_ok());
    }

    #[test]
    fn blocks_are_the_largest_constructible_divisor_up_to_the_cap() {
        // The demo's 1536 whole; Llama-2-7B, Qwen2.5-7B, Llama-3-8B in blocks.
        for (d_ff, b) in [
            (1536, 1536),
            (11008, 256),
            (18944, 1184),
            (14336, 2048),
            (640, 640),
        ] {
            assert_eq!(block(&[d_ff], None), Ok(b), "{d_ff}");
        }
        assert_eq!(block(&[1536], Some(512)), Ok(512));
        let e = block(&[1536], Some(500)).unwrap_err();
        assert!(e.contains("does not divide"), "{e}");
        let e = block(&[1536], Some(6)).unwrap_err();
        assert!(e.contains("order 6"), "{e}");
        let e = block(&[52], None).unwrap_err();
        assert!(e.contains("the largest is 4"), "{e}");
        assert_eq!(block(&[52], Some(4)), Ok(4));
        // Mixtures of experts: one block for every down_proj. Qwen3-30B-A3B's experts (768); Qwen2-MoE-A2.7B's
        // experts and shared expert (1408 = 44 · 32, 5632 = 4 · 1408); Mixtral's (14336).
        assert_eq!(block(&[768], None), Ok(768));
        assert_eq!(block(&[1408, 5632], None), Ok(1408));
        assert_eq!(block(&[14336], None), Ok(2048));
        let e = block(&[1408, 5632], Some(5632)).unwrap_err();
        assert!(
            e.contains("does not divide the MLP widths 1408 and 5632"),
            "{e}"
        );
        let e = block(&[52, 104], None).unwrap_err();
        assert!(e.contains("have no common divisor"), "{e}");
        // A block marker parses back to its block; a block that does not divide is refused.
        let mut c = config(1536);
        mark(&mut c, 1536, &transform(512).unwrap());
        assert_eq!(c["boa_cuda"]["online_hadamard"]["block"], 512);
        assert_eq!(parse(&c, &[1536]), Ok(Some(512)));
        c["boa_cuda"]["online_hadamard"]["block"] = 500.into();
        assert!(parse(&c, &[1536]).unwrap_err().contains("does not divide"));
    }

    #[test]
    fn the_weight_makes_linear_apply_q() {
        // a Wᵀ with W = Qᵀ is a Q; Q orthogonal, so a Q Qᵀ = a.
        let n = 24;
        let w = weight(n).unwrap();
        let q = transform(n).unwrap().dense();
        let a: Vec<f64> = (0..n).map(|i| (i as f64 * 0.7).cos()).collect();
        let lin: Vec<f64> = (0..n)
            .map(|r| (0..n).map(|c| a[c] * w[r * n + c] as f64).sum())
            .collect();
        let aq: Vec<f64> = (0..n)
            .map(|j| (0..n).map(|i| a[i] * q[i * n + j]).sum())
            .collect();
        for j in 0..n {
            assert!((lin[j] - aq[j]).abs() < 1e-6, "{j}: {} {}", lin[j], aq[j]);
        }
        let back: Vec<f64> = (0..n)
            .map(|i| (0..n).map(|j| aq[j] * q[i * n + j]).sum())
            .collect();
        for i in 0..n {
            assert!((back[i] - a[i]).abs() < 1e-12);
        }
    }

    #[test]
    fn the_fast_transform_is_the_dense_weights_linear() {
        use crate::backend::{Backend, Tensor, Weight, cpu::CpuBackend};
        // Sylvester alone, Paley II ⊗ Sylvester, Paley I ⊗ Sylvester (the demo's 1536), Paley I alone.
        for n in [64, 576, 1536, 44] {
            let q = OnlineQ::new(n).unwrap();
            let x: Vec<f32> = (0..5 * n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let fast = CpuBackend
                .block_hadamard_t(&Tensor::Host(x.clone()), &q.h, Weight::host(&q.dense))
                .unwrap();
            let dense = CpuBackend.linear(&x, &q.dense, None, 5, n, n).unwrap();
            let fast = CpuBackend.read(&fast).unwrap();
            let scale = dense.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = fast
                .iter()
                .zip(&dense)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-5 * scale,
                "{n}: max |fast − dense| {err} of {scale}"
            );
        }
    }
}
