//! Rotations fused into the weights (QuaRot / SpinQuant style, issue 23): `boa-cuda rotate` and
//! `run --rotate`. The output is an ordinary checkpoint of the same architecture that computes the same
//! function (to rounding) and that any loader runs unchanged: no online transform. `--rotate-online` adds
//! QuaRot's R4 (model/online.rs), which does need one: that checkpoint runs in boa-cuda only.
//!
//! Row-vector convention (x is a row of the residual stream, a linear computes y = x Wᵀ):
//! 1. Fold every RMSNorm's weight γ into the linears it feeds: W ← W diag(γ) for q/k/v (attention norm),
//!    gate/up (MLP norm) and lm_head (final norm); the norms are written as ones. RMSNorm(x) = x / rms(x)
//!    then commutes with any orthogonal R (rms(x R) = rms(x)); with a γ left in, it would not.
//! 2. R1 (d × d) rotates the residual stream, x' = x R1: embedding rows E ← E R1; every reader of the
//!    stream W ← W R1 (q, k, v, gate, up, lm_head); every writer W ← R1ᵀ W (o, down, and their biases).
//!    Then x' W'ᵀ = x R1 R1ᵀ Wᵀ = x Wᵀ for readers, and writers add R1ᵀ-rotated outputs to x'.
//! 3. R2 (d_h × d_h) per layer and KV head g rotates that head's values: V's rows of head g (and its
//!    bias) ← R2ᵀ · rows, and o_proj's column slice of every query head that reads g ← slice · R2. The
//!    attention output of each query head is a convex mix of its KV head's values, so it is rotated by the
//!    same R2, which o_proj's slice undoes (GQA: one R2 per KV head, shared by its query heads).
//! 4. Qwen3's per-head q/k norms act on W_Q's and W_K's outputs, untouched by R1 (their inputs) and R2 (V
//!    and O only): copied through. A mixture of experts reads the MLP norm's output in every expert's
//!    gate/up, the router and Qwen2-MoE's shared-expert gate (all W ← W diag(γ) R1) and writes the stream
//!    from every expert's down_proj (R1ᵀ W); routing sees the same logits. R4 (`--rotate-online`) folds
//!    into every down_proj, each expert's and the shared expert's, with one block order for all.
//!
//! When the embedding was tied to lm_head and the final norm's weight is not all ones, the two differ after
//! step 1: lm_head is written separately and config.json says `tie_word_embeddings: false`.
//! Everything is computed in f64 from the stored weights and written in f32 (a rotated weight is not on the
//! source's bf16/f16 grid, and rounding it there would change the FP model), so the rotated folder of a
//! bf16 model is twice its size. Tensors the Llama block does not use are not copied.

use super::Model;
use super::arch::{NormRole, Role};
use super::config::Config;
use super::orthogonal::{Orthogonal, RotationKind};
use crate::error::file_err;
use crate::export::hf_folder::{OutFolder, f32_to_bytes};
use crate::export::safetensors_out::{Dtype, TensorEntry};
use crate::progress::Progress;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::time::Instant;

/// The refusal of rotating a model that already carries R4, whether read from its config.json
/// (`check_foldable`) or from the opened model (`rotate`).
const ALREADY_R4: &str =
    "already carries an online Hadamard (R4); rotate the original model instead";

/// Architectures whose block this module knows how to fold (pre-norm RMSNorm with a plain weight, RoPE,
/// GQA attention, SwiGLU MLPs or experts): every architecture the engine runs but Gemma 3, whose 1 + γ norms
/// and norms on the residual branches no linear absorbs. A new block must be added here deliberately, with
/// its own fold and a row in transformers_parity's rotation test.
pub const FOLDABLE_ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
];

/// What `--rotate` asks for.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RotateSpec {
    pub kind: RotationKind,
    /// Seeds the Hadamard signs and the random orthogonal matrices.
    pub seed: u64,
    /// R4: the online Hadamard of down_proj's input (model/online.rs). Absent from the fingerprint when
    /// off, so fingerprints of earlier rotated runs are unchanged.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub online: bool,
    /// R4's block order asked for (`--rotate-online-block`); None: `online::block` picks it. Absent from
    /// the fingerprint when None.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub online_block: Option<usize>,
}

impl RotateSpec {
    /// R4's block order for down_projs reading `widths` (`Config::down_widths`), or why there is none;
    /// None without R4.
    pub fn r4_block(&self, widths: &[usize]) -> anyhow::Result<Option<usize>> {
        match self.online {
            true => Ok(Some(
                super::online::block(widths, self.online_block)
                    .map_err(|m| crate::input_err!("{m}"))?,
            )),
            false => Ok(None),
        }
    }
}

/// One family of rotations as built (for report.json and stderr).
#[derive(Clone, Debug, serde::Serialize)]
pub struct MatrixInfo {
    pub size: usize,
    pub count: usize,
    pub construction: String,
    /// Why the Hadamard that was asked for could not be used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

/// What a rotation did, written into report.json and config.json.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RotationInfo {
    pub kind: RotationKind,
    pub seed: u64,
    pub r1: MatrixInfo,
    pub r2: MatrixInfo,
    /// R4, the online transform of down_proj's input (`--rotate-online`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub r4: Option<MatrixInfo>,
    /// RMSNorm weights folded into the linears after them (2 per layer + the final norm).
    pub norms_folded: usize,
    /// lm_head written apart from the embedding (it was tied; the final norm's weight made them differ).
    pub untied_lm_head: bool,
    pub seconds: f64,
}

impl RotationInfo {
    /// What config.json records: everything but the time taken, so that the same rotation writes the same
    /// bytes (a resumed or repeated run is byte-identical; the time goes to report.json).
    pub fn config_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("plain data serializes");
        if let Some(m) = v.as_object_mut() {
            m.remove("seconds");
        }
        v
    }

    /// The lines printed on stderr: which matrices were used, and any fallback with its reason.
    pub fn lines(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (name, m) in [("R1", &self.r1), ("R2", &self.r2)]
            .into_iter()
            .chain(self.r4.as_ref().map(|m| ("R4", m)))
        {
            let what = if m.count == 1 {
                format!("{} × {}", m.size, m.size)
            } else {
                format!("{} of {} × {}", m.count, m.size, m.size)
            };
            v.push(match name {
                // A fixed Hadamard: the forward rebuilds it from its order.
                "R4" => format!("rotation {name} ({what}): {}, online", m.construction),
                _ => format!(
                    "rotation {name} ({what}): {}, seed {}",
                    m.construction, self.seed
                ),
            });
            if let Some(why) = &m.fallback {
                v.push(format!(
                    "note: {name} falls back to a random orthogonal matrix: {why}"
                ));
            }
        }
        if self.r4.is_some() {
            v.push(format!(
                "note: R4 is applied online before {} (config.json's model_type {}): only boa-cuda runs \
                 this checkpoint; other loaders refuse it",
                super::online::BEFORE,
                super::online::MODEL_TYPE
            ));
        }
        if self.untied_lm_head {
            v.push(
                "note: lm_head is written apart from the embedding (tie_word_embeddings: false): the final \
                 norm's weight, folded into it, made them differ"
                    .into(),
            );
        }
        v
    }
}

/// Refuses, before any work, a model whose architecture this module cannot fold, or with R4 one whose
/// down_projs' widths have no common block order with a Hadamard matrix here (read from config.json before
/// the model is opened, so the message is about the rotation).
pub fn check_foldable(model_dir: &Path, spec: &RotateSpec) -> anyhow::Result<()> {
    let path = model_dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_err(&path, format!("invalid JSON: {e}")))?;
    let arch = json["architectures"]
        .get(0)
        .and_then(|a| a.as_str())
        .unwrap_or("(none)");
    check_architecture(arch)?;
    if json["model_type"].as_str() == Some(super::online::MODEL_TYPE) {
        return Err(file_err(&path, ALREADY_R4));
    }
    // A config the engine cannot read is refused with its own message when the model is opened.
    if spec.online
        && let Ok(cfg) = Config::parse(&text)
    {
        spec.r4_block(&cfg.down_widths())?;
    }
    Ok(())
}

fn check_architecture(arch: &str) -> anyhow::Result<()> {
    if FOLDABLE_ARCHITECTURES.contains(&arch) {
        Ok(())
    } else {
        Err(crate::input_err!(
            "--rotate does not know how to fold the norms and rotations of architecture {arch} (it folds {})",
            FOLDABLE_ARCHITECTURES.join(", ")
        ))
    }
}

/// The rotations of one model: R1 from stream 0 of the seed, R2 of (layer l, KV head g) from stream
/// 1 + l·H_kv + g, so each matrix depends only on the seed and its place.
struct Rotations {
    r1: Orthogonal,
    r2: Vec<Orthogonal>,
    /// R4's block Q_b (`--rotate-online`): I ⊗ Q_b folded into down_proj's columns, applied online to its
    /// input.
    r4: Option<Orthogonal>,
}

impl Rotations {
    fn new(cfg: &Config, spec: &RotateSpec) -> anyhow::Result<Rotations> {
        let rng = |stream: u64| {
            let mut r = ChaCha8Rng::seed_from_u64(spec.seed);
            r.set_stream(stream);
            r
        };
        let r1 = Orthogonal::new(cfg.d, spec.kind, &mut rng(0));
        let r2 = (0..cfg.n_layers * cfg.n_kv_heads)
            .map(|i| Orthogonal::new(cfg.d_h, spec.kind, &mut rng(1 + i as u64)))
            .collect();
        let r4 = match spec.r4_block(&cfg.down_widths())? {
            Some(b) => Some(super::online::transform(b).map_err(|m| crate::input_err!("{m}"))?),
            None => None,
        };
        Ok(Rotations { r1, r2, r4 })
    }

    fn r2(&self, cfg: &Config, l: usize, g: usize) -> &Orthogonal {
        &self.r2[l * cfg.n_kv_heads + g]
    }
}

/// Writes the rotated model of `src` into `out` (an ordinary HF folder, f32 safetensors, one shard per
/// block, published by one rename like every output of this engine).
pub fn rotate_model(
    src: &Model,
    out: &Path,
    spec: &RotateSpec,
    force: bool,
    progress: &Progress,
) -> anyhow::Result<RotationInfo> {
    let t0 = Instant::now();
    let cfg = &src.cfg;
    check_architecture(&cfg.architecture)?;
    if src.is_quantized() {
        return Err(file_err(
            &src.dir,
            "is a quantized checkpoint; rotate the original model instead",
        ));
    }
    if cfg.block.online_down.is_some() {
        return Err(file_err(&src.dir, ALREADY_R4));
    }
    let rot = Rotations::new(cfg, spec)?;
    let (mut folder, _) = OutFolder::prepare(out, force, false, cfg.n_layers + 1)?;
    let result = (|| -> anyhow::Result<bool> {
        let mut bar = progress.bar("rotate", cfg.n_layers as u64, "blocks");
        for l in 0..cfg.n_layers {
            folder.write_shard(l, &block_entries(src, &rot, l)?)?;
            bar.inc(1);
        }
        bar.finish();
        let (globals, untied) = global_entries(src, &rot)?;
        folder.write_shard(cfg.n_layers, &globals)?;
        Ok(untied)
    })();
    let untied = match result {
        Ok(u) => u,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&folder.tmp);
            return Err(e);
        }
    };
    let info = RotationInfo {
        kind: spec.kind,
        seed: spec.seed,
        r1: MatrixInfo {
            size: cfg.d,
            count: 1,
            construction: rot.r1.construction.clone(),
            fallback: rot.r1.fallback.clone(),
        },
        r2: MatrixInfo {
            size: cfg.d_h,
            count: rot.r2.len(),
            construction: rot.r2[0].construction.clone(),
            fallback: rot.r2[0].fallback.clone(),
        },
        r4: rot.r4.as_ref().map(|q| MatrixInfo {
            size: q.n,
            count: cfg.down_widths()[0] / q.n,
            construction: q.construction.clone(),
            fallback: None,
        }),
        norms_folded: 2 * cfg.n_layers + 1,
        untied_lm_head: untied,
        seconds: t0.elapsed().as_secs_f64(),
    };
    let mut config = cfg.json.clone();
    if untied {
        config["tie_word_embeddings"] = false.into();
    }
    // The weights are f32 now, whatever the source's dtype; loaders that honour the config's dtype should
    // not round them back.
    for key in ["torch_dtype", "dtype"] {
        if config.get(key).is_some() {
            config[key] = "float32".into();
        }
    }
    config["boa_cuda"] = serde_json::json!({ "rotation": info.config_json() });
    if let Some(q) = &rot.r4 {
        super::online::mark(&mut config, cfg.down_widths()[0], q);
    }
    folder.write_json("config.json", &config)?;
    folder.copy_model_files(&src.dir)?;
    folder.publish()?;
    Ok(info)
}

/// The folder of `run --rotate`'s rotated model inside the run's partial folder.
pub const RUN_DIR: &str = "rotated";

/// Bytes the rotated copy of `model` takes (every tensor in f32).
pub fn rotated_bytes(model: &Model) -> u64 {
    model
        .store
        .names()
        .filter_map(|n| model.store.entry(n))
        .map(|e| 4 * e.shape.iter().product::<usize>() as u64)
        .sum()
}

/// `run --rotate`: the rotated model of `src` in `partial/rotated` (rewritten on a resume: the rotation is
/// deterministic, so the bytes are the same), opened, with what was done; prints which matrices were used
/// (a fallback even under --quiet).
pub fn rotate_for_run(
    src: &Model,
    partial: &Path,
    spec: &RotateSpec,
    progress: &Progress,
) -> anyhow::Result<(Model, RotationInfo)> {
    let dir = partial.join(RUN_DIR);
    let info = rotate_model(src, &dir, spec, true, progress)?;
    print_info(&info, progress);
    Ok((Model::open(&dir)?, info))
}

/// `info.lines()` on stderr: notes (a fallback, an untied head) always, the rest unless quiet.
pub fn print_info(info: &RotationInfo, progress: &Progress) {
    for line in info.lines() {
        if line.starts_with("note:") {
            eprintln!("{line}");
        } else {
            progress.line(&line);
        }
    }
}

/// Removes `run --rotate`'s rotated model from the partial folder before it is published.
pub fn remove_for_run(partial: &Path) -> anyhow::Result<()> {
    let dir = partial.join(RUN_DIR);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| file_err(&dir, format!("cannot remove: {e}")))?;
    }
    Ok(())
}

/// W [rows × cols] f32 → f64 with column j scaled by γ_j (a folded norm), checking every value is finite
/// (a NaN would spread through the rotation into every weight and hide which tensor held it).
fn to_f64_folded(
    w: &[f32],
    cols: usize,
    gamma: Option<&[f32]>,
    name: &str,
) -> anyhow::Result<Vec<f64>> {
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(crate::input_err!(
            "tensor {name} has a non-finite value ({}) at index {i}",
            w[i]
        ));
    }
    Ok(match gamma {
        Some(g) => w
            .iter()
            .enumerate()
            .map(|(i, &v)| v as f64 * g[i % cols] as f64)
            .collect(),
        None => w.iter().map(|&v| v as f64).collect(),
    })
}

fn entry(name: String, shape: Vec<usize>, v: &[f64]) -> TensorEntry<'static> {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    TensorEntry::new(name, Dtype::F32, shape, f32_to_bytes(Dtype::F32, &f))
}

fn check_norm(g: &[f32], name: &str) -> anyhow::Result<()> {
    match g.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(crate::input_err!(
            "tensor {name} has a non-finite value ({}) at index {i}",
            g[i]
        )),
        None => Ok(()),
    }
}

/// Block l's tensors, folded and rotated.
fn block_entries(
    src: &Model,
    rot: &Rotations,
    l: usize,
) -> anyhow::Result<Vec<TensorEntry<'static>>> {
    let cfg = &src.cfg;
    let (d, d_h) = (cfg.d, cfg.d_h);
    let group = cfg.n_heads / cfg.n_kv_heads;
    let w = src.load_block(l)?;
    let p = format!("model.layers.{l}.");
    let norm = |role: NormRole, name: &str| -> anyhow::Result<&[f32]> {
        let g = w
            .norm(role)
            .ok_or_else(|| anyhow::anyhow!("block {l} has no {name}"))?;
        check_norm(g, &format!("{p}{name}.weight"))?;
        Ok(g)
    };
    let attn_norm = norm(NormRole::Attn, "input_layernorm")?;
    let mlp_norm = norm(NormRole::Mlp, "post_attention_layernorm")?;
    let mut out = Vec::new();
    let ones = vec![1.0f64; d];
    out.push(entry(format!("{p}input_layernorm.weight"), vec![d], &ones));
    out.push(entry(
        format!("{p}post_attention_layernorm.weight"),
        vec![d],
        &ones,
    ));
    // Qwen3's per-head q/k norms act on W_Q's and W_K's outputs, which R1 (on their inputs) and R2 (on V and
    // O only) leave as they were: copied through.
    for (nd, g) in w.desc.norms.iter().zip(&w.norms) {
        if matches!(nd.role, NormRole::Q | NormRole::K) {
            let name = format!("{p}{}.weight", nd.name);
            check_norm(g, &name)?;
            let g: Vec<f64> = g.iter().map(|&v| v as f64).collect();
            out.push(entry(name, vec![g.len()], &g));
        }
    }
    for ((name, lin), ld) in w.named().zip(&w.desc.linears) {
        let full = format!("{p}{name}");
        // Every expert's and the shared expert's gate/up read the MLP's normed input as a dense MLP's do,
        // and their down_proj write the residual stream.
        let gamma = match ld.role {
            Role::Q | Role::K | Role::V => Some(attn_norm),
            Role::Gate | Role::Up => Some(mlp_norm),
            Role::O | Role::Down => None,
        };
        let mut m = to_f64_folded(&lin.w, lin.d_in, gamma, &format!("{full}.weight"))?;
        let mut b = match &lin.b {
            Some(b) => Some(to_f64_folded(b, b.len(), None, &format!("{full}.bias"))?),
            None => None,
        };
        match ld.role {
            Role::O => {
                // Input side first: each query head's column slice · R2 of the KV head it reads.
                let qd = lin.d_in;
                let mut slice = vec![0.0; d * d_h];
                for h in 0..cfg.n_heads {
                    for r in 0..d {
                        slice[r * d_h..(r + 1) * d_h]
                            .copy_from_slice(&m[r * qd + h * d_h..r * qd + (h + 1) * d_h]);
                    }
                    rot.r2(cfg, l, h / group).right(&mut slice);
                    for r in 0..d {
                        m[r * qd + h * d_h..r * qd + (h + 1) * d_h]
                            .copy_from_slice(&slice[r * d_h..(r + 1) * d_h]);
                    }
                }
                rot.r1.left_t(&mut m, qd);
                if let Some(b) = &mut b {
                    rot.r1.left_t(b, 1);
                }
            }
            Role::Down => {
                rot.r1.left_t(&mut m, lin.d_in);
                if let Some(b) = &mut b {
                    rot.r1.left_t(b, 1);
                }
                // R4: the input arrives as a · Q, so W ← W · Q undoes it (a Q (W Q)ᵀ = a Wᵀ). Q = I ⊗ Q_b:
                // W's rows read as rows of b are its column blocks, each times Q_b. Every expert's
                // down_proj and the shared expert's alike (b divides all their widths).
                if let Some(q) = &rot.r4 {
                    q.right(&mut m);
                }
            }
            _ => {
                rot.r1.right(&mut m);
                if ld.role == Role::V {
                    // Output side: KV head g's rows (and bias) ← R2ᵀ · rows.
                    for g in 0..cfg.n_kv_heads {
                        let r2 = rot.r2(cfg, l, g);
                        r2.left_t(&mut m[g * d_h * d..(g + 1) * d_h * d], d);
                        if let Some(b) = &mut b {
                            r2.left_t(&mut b[g * d_h..(g + 1) * d_h], 1);
                        }
                    }
                }
            }
        }
        out.push(entry(
            format!("{full}.weight"),
            vec![lin.d_out, lin.d_in],
            &m,
        ));
        if let Some(b) = b {
            out.push(entry(format!("{full}.bias"), vec![lin.d_out], &b));
        }
    }
    // An MoE block's router and Qwen2-MoE's shared-expert gate are linear maps of the MLP's normed input,
    // like gate_proj: γ and R1 fold into them the same way (they stay in full precision).
    if let Some(moe) = &w.desc.moe {
        let gates = [
            (moe.router, w.router.as_deref()),
            (
                moe.shared_expert.as_ref().map_or("", |s| s.gate),
                w.shared_gate.as_deref(),
            ),
        ];
        for (name, g) in gates {
            let Some(g) = g else { continue };
            let full = format!("{p}{name}.weight");
            let mut m = to_f64_folded(g, d, Some(mlp_norm), &full)?;
            rot.r1.right(&mut m);
            out.push(entry(full, vec![g.len() / d, d], &m));
        }
    }
    Ok(out)
}

/// Embedding · R1, the final norm as ones, and lm_head = (head · diag(γ_final)) · R1 when it is (or must
/// become) a tensor of its own. Returns whether a tied head was untied.
fn global_entries(
    src: &Model,
    rot: &Rotations,
) -> anyhow::Result<(Vec<TensorEntry<'static>>, bool)> {
    let cfg = &src.cfg;
    let d = cfg.d;
    let gamma = src.final_norm()?;
    check_norm(&gamma, "model.norm.weight")?;
    let table = src.embed_table()?;
    let mut e = to_f64_folded(&table, d, None, "model.embed_tokens.weight")?;
    // A tied head equals the embedding only while γ_final is exactly one everywhere.
    let untie = cfg.tie_word_embeddings && gamma.iter().any(|&g| g != 1.0);
    let head = if !cfg.tie_word_embeddings {
        Some(to_f64_folded(
            &src.lm_head()?,
            d,
            Some(&gamma),
            "lm_head.weight",
        )?)
    } else if untie {
        Some(to_f64_folded(
            &table,
            d,
            Some(&gamma),
            "model.embed_tokens.weight",
        )?)
    } else {
        None
    };
    drop(table);
    rot.r1.right(&mut e);
    let mut out = vec![
        entry("model.embed_tokens.weight".into(), vec![cfg.vocab, d], &e),
        entry("model.norm.weight".into(), vec![d], &vec![1.0; d]),
    ];
    drop(e);
    if let Some(mut h) = head {
        rot.r1.right(&mut h);
        out.push(entry("lm_head.weight".into(), vec![cfg.vocab, d], &h));
    }
    Ok((out, untie))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_blocks_are_folded() {
        for a in FOLDABLE_ARCHITECTURES {
            check_architecture(a).unwrap();
        }
        let e = check_architecture("Gemma3ForCausalLM")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--rotate does not know how to fold") && e.contains("Gemma3ForCausalLM"),
            "{e}"
        );
    }
}
