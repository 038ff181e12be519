//! QuaRot's R4 (issue 23): an online Hadamard transform of down_proj's input, a ↦ a · Q with Q = H / √n
//! (n = d_ff, H from `hadamard.rs`, no random signs), whose inverse `rotate --online` folds into
//! down_proj's columns (W_down ← W_down · Q, so a Q · (W_down Q)ᵀ = a W_downᵀ). Unlike R1 and R2 it cannot
//! be folded away: SwiGLU's product sits between up_proj and down_proj. The transform spreads the outliers
//! of the MLP's activations over every column before down_proj reads them, as R1 does for the residual
//! stream.
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

/// The only place the transform is applied.
pub const BEFORE: &str = "mlp.down_proj";

/// `boa_cuda.online_hadamard` in config.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    /// The linear whose input is transformed (always `BEFORE`).
    pub before: String,
    /// n: the transform is n × n (d_ff).
    pub size: usize,
    /// How H was built, e.g. "Hadamard 1536 = 12 (Paley I, q = 11) ⊗ 128 (Sylvester)".
    pub construction: String,
    /// The architecture's own `model_type`, which `MODEL_TYPE` replaces.
    pub model_type: Option<String>,
}

/// Q for order n, or why this code has no Hadamard matrix of that order (an online transform is applied by
/// its order alone, so it cannot fall back to a seeded random matrix the way R1 and R2 do).
pub fn transform(n: usize) -> Result<Orthogonal, String> {
    Orthogonal::plain_hadamard(n).map_err(|why| {
        format!("--rotate-online needs a Hadamard matrix of order d_ff = {n}: {why}")
    })
}

/// Marks `config` (a model's config.json) as needing the transform of order `size`.
pub fn mark(config: &mut serde_json::Value, q: &Orthogonal) {
    let marker = Marker {
        before: BEFORE.into(),
        size: q.n,
        construction: q.construction.clone(),
        model_type: config["model_type"].as_str().map(str::to_string),
    };
    config["model_type"] = MODEL_TYPE.into();
    config["boa_cuda"]["online_hadamard"] =
        serde_json::to_value(&marker).expect("plain data serializes");
}

/// The transform's order when `json` (a config.json) asks for one, checked against the block it applies
/// to: a dense MLP of width `d_ff`.
pub fn parse(json: &serde_json::Value, d_ff: usize, moe: bool) -> Result<Option<usize>, String> {
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
    if moe {
        return Err("an online Hadamard in a mixture-of-experts block is not supported".into());
    }
    if m.size != d_ff {
        return Err(format!(
            "boa_cuda.online_hadamard.size {} is not intermediate_size {d_ff}",
            m.size
        ));
    }
    transform(m.size)?;
    Ok(Some(m.size))
}

/// The transform as a linear's weight W = Qᵀ [n × n] row-major f32, so that `linear` (a Wᵀ) computes a Q.
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
        assert_eq!(parse(&c, 48, false), Ok(None));
        mark(&mut c, &transform(48).unwrap());
        assert_eq!(c["model_type"], MODEL_TYPE);
        assert_eq!(c["boa_cuda"]["online_hadamard"]["model_type"], "llama");
        assert_eq!(parse(&c, 48, false), Ok(Some(48)));
        let e = parse(&c, 64, false).unwrap_err();
        assert!(e.contains("not intermediate_size 64"), "{e}");
        let e = parse(&c, 48, true).unwrap_err();
        assert!(e.contains("mixture-of-experts"), "{e}");
        let mut edited = c.clone();
        edited["model_type"] = "llama".into();
        let e = parse(&edited, 48, false).unwrap_err();
        assert!(e.contains("other loaders would run"), "{e}");
        let mut bare = config(48);
        bare["model_type"] = MODEL_TYPE.into();
        assert!(parse(&bare, 48, false).is_err());
    }

    #[test]
    fn an_order_without_a_hadamard_matrix_is_refused() {
        // 52 = 4 · 13: 13 is not a Paley order here; 36 = Paley II.
        let Err(e) = transform(52) else {
            panic!("order 52 was built")
        };
        assert!(e.contains("order d_ff = 52"), "{e}");
        assert!(transform(36).is_ok());
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
}
