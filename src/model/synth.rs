//! Synthetic Llama (and Gemma 3) models with seeded random weights: tiny ones for tests (a byte-level tokenizer
//! of 256 tokens, so any text tokenizes) and real-shaped ones for benchmarks.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::{Dtype, tensor::TensorView};
use std::path::Path;

/// The architecture a synthetic model's config.json declares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    /// LlamaForCausalLM (Qwen2ForCausalLM with `qkv_bias`), d_h = d / n_heads.
    Llama,
    /// Gemma3ForCausalLM: head_dim of its own, per-head q/k norms, sandwich norms stored as (1 + w)'s w,
    /// GeGLU, √d-scaled embeddings, and local layers with a sliding window (every layer l with
    /// (l + 1) % global_every ≠ 0; the others global, each kind with its own RoPE base).
    Gemma3 {
        head_dim: usize,
        sliding_window: usize,
        global_every: usize,
    },
}

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub arch: SynthArch,
    pub d: usize,
    pub d_ff: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub vocab: usize,
    pub tie_word_embeddings: bool,
    pub qkv_bias: bool,
    pub seed: u64,
}

impl SynthSpec {
    /// A model small enough for a test to quantize in seconds: d 64, 4 heads over 2 KV heads (GQA), d_h 16.
    pub fn tiny() -> SynthSpec {
        SynthSpec {
            arch: SynthArch::Llama,
            d: 64,
            d_ff: 160,
            n_layers: 2,
            n_heads: 4,
            n_kv_heads: 2,
            vocab: 256,
            tie_word_embeddings: false,
            qkv_bias: false,
            seed: 0,
        }
    }

    /// The head dimension: Gemma 3's own, else d / n_heads.
    pub fn d_h(&self) -> usize {
        match self.arch {
            SynthArch::Llama => self.d / self.n_heads.max(1),
            SynthArch::Gemma3 { head_dim, .. } => head_dim,
        }
    }
}

/// `write_model` for a user: checks the shape, refuses an existing `dir`, and writes into a sibling folder
/// renamed into place at the end, so a failure leaves nothing at `dir`.
pub fn write_model_new(dir: &Path, s: &SynthSpec) -> anyhow::Result<()> {
    if s.d == 0 || s.d_ff == 0 || s.n_layers == 0 || s.n_heads == 0 || s.n_kv_heads == 0 {
        return Err(crate::input_err!(
            "every size of a synthetic model must be positive"
        ));
    }
    if (s.arch == SynthArch::Llama && !s.d.is_multiple_of(s.n_heads))
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
    {
        return Err(crate::input_err!(
            "--d {} must be a multiple of --heads {}, and --heads of --kv-heads {}",
            s.d,
            s.n_heads,
            s.n_kv_heads
        ));
    }
    // The config `run` will read, checked as `run` checks it: no model it would refuse is written.
    super::config::Config::parse(&config_json(s).to_string())
        .map_err(|m| crate::input_err!("synth-model would write a model that run refuses: {m}"))?;
    // write_model holds every tensor in memory about three times over (values, bytes, the file's buffer).
    let d_h = s.d_h();
    let per_layer = [
        (s.n_heads * d_h, s.d),
        (s.n_kv_heads * d_h, s.d),
        (s.n_kv_heads * d_h, s.d),
        (s.d, s.n_heads * d_h),
        (s.d_ff, s.d),
        (s.d_ff, s.d),
        (s.d, s.d_ff),
    ]
    .iter()
    .map(|&(r, c)| r as u128 * c as u128)
    .sum::<u128>();
    let params = per_layer * s.n_layers as u128 + 2 * (s.vocab as u128 * s.d as u128);
    let need = params * 4 * 3;
    let avail = crate::pipeline::memory_plan::host_available_bytes().unwrap_or(u64::MAX);
    if need > avail as u128 {
        return Err(crate::input_err!(
            "the synthetic model is too large: {:.1} GiB of f32 weights, and writing it needs about {:.1} GiB \
             of memory, {:.1} GiB are available",
            (params * 4) as f64 / (1u64 << 30) as f64,
            need as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        ));
    }
    if dir.exists() {
        return Err(crate::input_err!("{} already exists", dir.display()));
    }
    let mut tmp = dir.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = std::path::PathBuf::from(tmp);
    let _ = std::fs::remove_dir_all(&tmp);
    let r = write_model(&tmp, s).and_then(|()| Ok(std::fs::rename(&tmp, dir)?));
    if r.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    r
}

/// The config.json of a synthetic model.
fn config_json(s: &SynthSpec) -> serde_json::Value {
    let d_h = s.d_h();
    if let SynthArch::Gemma3 {
        sliding_window,
        global_every,
        ..
    } = s.arch
    {
        let layer_types: Vec<&str> = (0..s.n_layers)
            .map(|l| match (l + 1) % global_every.max(1) {
                0 => "full_attention",
                _ => "sliding_attention",
            })
            .collect();
        return serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": s.d, "intermediate_size": s.d_ff, "num_hidden_layers": s.n_layers,
            "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads, "head_dim": d_h,
            "query_pre_attn_scalar": d_h, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10000.0, "sliding_window": sliding_window, "layer_types": layer_types,
            "vocab_size": s.vocab, "tie_word_embeddings": s.tie_word_embeddings,
            "max_position_embeddings": 4096, "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": false, "torch_dtype": "float32",
        });
    }
    serde_json::json!({
        "architectures": [if s.qkv_bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" }],
        "model_type": if s.qkv_bias { "qwen2" } else { "llama" },
        "hidden_size": s.d, "intermediate_size": s.d_ff, "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads, "num_key_value_heads": s.n_kv_heads, "head_dim": d_h,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": s.vocab,
        "tie_word_embeddings": s.tie_word_embeddings, "max_position_embeddings": 4096,
        "hidden_act": "silu", "torch_dtype": "float32",
    })
}

/// Writes config.json, model.safetensors (f32) and a byte-level tokenizer.json into `dir`.
pub fn write_model(dir: &Path, s: &SynthSpec) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let d_h = s.d_h();
    let config = config_json(s);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(dir.join("tokenizer.json"), byte_tokenizer_json(s.vocab))?;

    let mut rng = ChaCha8Rng::seed_from_u64(s.seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut mat = |name: String, rows: usize, cols: usize, rng: &mut ChaCha8Rng| {
        // Uniform with the variance of N(0, 1/cols): activations keep their scale through the blocks.
        let a = (3.0 / cols as f32).sqrt();
        tensors.push((
            name,
            vec![rows, cols],
            (0..rows * cols).map(|_| rng.random_range(-a..a)).collect(),
        ));
    };
    mat("model.embed_tokens.weight".into(), s.vocab, s.d, &mut rng);
    let (qd, kvd) = (s.n_heads * d_h, s.n_kv_heads * d_h);
    for l in 0..s.n_layers {
        let p = format!("model.layers.{l}.");
        for (n, r, c) in [
            ("self_attn.q_proj", qd, s.d),
            ("self_attn.k_proj", kvd, s.d),
            ("self_attn.v_proj", kvd, s.d),
            ("self_attn.o_proj", s.d, qd),
            ("mlp.gate_proj", s.d_ff, s.d),
            ("mlp.up_proj", s.d_ff, s.d),
            ("mlp.down_proj", s.d, s.d_ff),
        ] {
            mat(format!("{p}{n}.weight"), r, c, &mut rng);
        }
        if s.qkv_bias {
            for (n, r) in [("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)] {
                mat(format!("{p}self_attn.{n}.bias"), 1, r, &mut rng);
            }
        }
    }
    if !s.tie_word_embeddings {
        mat("lm_head.weight".into(), s.vocab, s.d, &mut rng);
    }
    let gemma = matches!(s.arch, SynthArch::Gemma3 { .. });
    // Gemma scales by (1 + w): its weights are drawn around 0 for the same gains.
    let (gain, offset) = match gemma {
        true => (-0.2..0.2, 1.0),
        false => (0.8..1.2, 0.0),
    };
    let norms: &[(&str, usize)] = match gemma {
        true => &[
            ("input_layernorm", s.d),
            ("post_attention_layernorm", s.d),
            ("pre_feedforward_layernorm", s.d),
            ("post_feedforward_layernorm", s.d),
            ("self_attn.q_norm", d_h),
            ("self_attn.k_norm", d_h),
        ],
        false => &[("input_layernorm", s.d), ("post_attention_layernorm", s.d)],
    };
    for l in 0..s.n_layers {
        for &(n, len) in norms {
            let v = (0..len).map(|_| rng.random_range(gain.clone())).collect();
            tensors.push((format!("model.layers.{l}.{n}.weight"), vec![len], v));
        }
    }
    tensors.push((
        "model.norm.weight".into(),
        vec![s.d],
        vec![1.0 - offset; s.d],
    ));
    // Biases were drawn as [1 × r] matrices; store them as vectors.
    for t in tensors.iter_mut().filter(|t| t.0.ends_with(".bias")) {
        t.1 = vec![t.1[1]];
    }
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, shape, v)| (n, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, shape, b)| Ok((n.clone(), TensorView::new(Dtype::F32, shape.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))?;
    Ok(())
}

/// A byte-level BPE tokenizer.json with one token per byte (ids 0..255) and no merges.
pub fn byte_tokenizer_json(vocab: usize) -> String {
    assert!(
        vocab >= 256,
        "a byte-level tokenizer needs a vocabulary of at least 256"
    );
    let mut chars: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    chars.sort();
    let vocab_map: serde_json::Map<String, serde_json::Value> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), serde_json::json!(i)))
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": byte_level, "post_processor": null, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab_map, "merges": []}
    })
    .to_string()
}
