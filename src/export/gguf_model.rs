//! `--format gguf`: a finished run's shards rewritten as one llama.cpp GGUF file (`model.gguf`).
//!
//! The run itself writes packed GPTQ shards (gptq_v2, so a killed run resumes as any packed one does);
//! at the end they become GGUF tensors with no re-rounding, because the grids were the format's from the
//! start: symmetric, 32-column groups, f16 scales, zero 2^(b−1).
//!   Q4_0  { f16 d; u8 qs[16] }   x[i] = (q[i] − 8)·d, low nibbles elements 0..15, high nibbles 16..31;
//!   Q8_0  { f16 d; i8 qs[32] }   x[i] = qs[i]·d, qs = q − 128;
//! so ggml decodes f16(s)·(q − z), exactly what `--format fake` writes. The other types (`--gguf-type`:
//! Q5_0, Q4_1, Q5_1, the K-quants) have grids GPTQ's layout cannot hold (f16 offsets, K-quant sub-block
//! scales on a super-block's f16 d): their grids were constrained before the sweep (model/gguf/codec.rs,
//! quant/lattice.rs), and the run keeps them as GGUF blocks (`CodecLinear`), copied into the file as they are.
//!
//! Everything else is stored as convert_hf_to_gguf.py stores it for llama.cpp's "llama" (Llama, Mistral,
//! Mixtral), "qwen2", "qwen3", "gemma3" (norms as w + 1; `gemma3_rope` checks what llama.cpp assumes),
//! "qwen2moe" or "qwen3moe" architecture (`Arch::of_hf`; experts stacked per layer
//! and part, `MoePlace`): q/k rows permuted for the llama architecture's
//! interleaved RoPE (`qk_row_order`; the Qwens run NEOX RoPE on HF's rows), norms and Qwen2's q/k/v biases in
//! F32, embeddings, lm_head and linears outside `--layers` in the checkpoint's own float type,
//! hyper-parameters under `{arch}.*`, the tokenizer under `tokenizer.ggml.*` (gguf_vocab.rs), and Llama
//! 3.1's rope scaling as the `rope_freqs` tensor (`rope_freqs`).

use super::gguf_out::{GgufTensor, Kv, write_gguf};
use crate::error::file_err;
use crate::model::arch::{Activation, NormRole, Role};
use crate::model::config::Config;
use crate::model::gguf::GgmlType;
use crate::model::gguf::arch::{Arch, gemma3_implied, gguf_name};
use crate::model::weights::{WeightStore, to_f32};
use crate::quant::pack::{GptqVersion, PackedTensors};
use half::f16;
use rayon::prelude::*;
use safetensors::Dtype;
use std::path::Path;

/// The file a `--format gguf` run publishes in --out.
pub const FILE_NAME: &str = "model.gguf";

/// Columns per GGUF block of the 32-value types.
pub const BLOCK: usize = 32;

/// llama.cpp `LLAMA_FTYPE_MOSTLY_*` of a Q4_0/Q8_0 file whose linears are mostly `bits` wide (a
/// `--gguf-type` file: `GgufType::file_type`).
pub fn file_type_of_bits(bits: u32) -> u32 {
    match block_type(bits) {
        Some(GgmlType::Q8_0) => 7,
        _ => 2, // Q4_0
    }
}

/// The GGUF type storing a linear quantized at `bits` (symmetric, 32-column groups).
pub fn block_type(bits: u32) -> Option<GgmlType> {
    match bits {
        4 => Some(GgmlType::Q4_0),
        8 => Some(GgmlType::Q8_0),
        _ => None,
    }
}

/// The llama.cpp architecture a model of this config is written as, or why it cannot be (one line), checked
/// before any work. The options (bits, groups, symmetry, act-order) are checked by `RunOptions::validate`.
pub fn check_model(cfg: &Config, dir: &Path) -> Result<Arch, String> {
    let arch = model_arch(cfg)?;
    super::gguf_vocab::tokenizer_kvs(dir, cfg.vocab)?;
    Ok(arch)
}

/// `check_model` without the tokenizer: the architecture, or why llama.cpp would run the block differently.
fn model_arch(cfg: &Config) -> Result<Arch, String> {
    let refuse = |what: String| Err(format!("--format gguf: {what}"));
    let Some(arch) = Arch::of_hf(&cfg.architecture) else {
        return refuse(format!(
            "{} is not written yet (Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma 3, Qwen2-MoE and Qwen3-MoE \
             are): use --format gptq_v2 or compressed-tensors",
            cfg.architecture
        ));
    };
    let b = &cfg.block;
    let gemma = arch == Arch::Gemma3;
    // Gemma's own parts (sandwich norms, GeGLU, the score scalar, local layers) are llama.cpp's "gemma3"
    // when gemma3_rope says so.
    if gemma && let Err(m) = gemma3_rope(cfg) {
        return refuse(m);
    }
    let plain = gemma
        || (b.act == Activation::Silu
            && b.norm(NormRole::AttnOut).is_none()
            && b.norm(NormRole::MlpOut).is_none()
            && b.q_scale == 1.0
            && b.norm_offset == 0.0);
    if !plain {
        return refuse(format!(
            "the {} block has parts llama.cpp's \"{}\" architecture does not read",
            cfg.architecture,
            arch.key()
        ));
    }
    if let Some(m) = &b.moe {
        // How llama.cpp weighs the top-k experts is fixed per architecture, not read from the file.
        let renormalizes = llama_cpp_renormalizes(arch);
        if m.renormalize != renormalizes {
            return refuse(format!(
                "the router's top-{} weights are {} here, and llama.cpp's \"{}\" {} them",
                m.top_k,
                if m.renormalize {
                    "renormalized to sum 1"
                } else {
                    "used as the softmax gives them"
                },
                arch.key(),
                if renormalizes {
                    "always renormalizes"
                } else {
                    "never renormalizes"
                }
            ));
        }
    }
    if let Some(l) = cfg
        .block
        .linears
        .iter()
        .find(|l| l.bias && !arch.bias_parts().contains(&l.name.as_str()))
    {
        return refuse(format!(
            "{}.bias has no place in llama.cpp's \"{}\" architecture",
            l.name,
            arch.key()
        ));
    }
    if cfg.block.qk_norm() != arch.qk_norm() {
        return refuse(format!(
            "the q/k norms do not match llama.cpp's \"{}\" architecture",
            arch.key()
        ));
    }
    // convert_hf_to_gguf.py writes no window for these architectures, so llama.cpp would attend to every
    // earlier position where the model masks the far ones.
    if let Some(w) = cfg.block.sliding_window
        && cfg.block.sliding_layers.iter().any(|&s| s)
        && !gemma
    {
        return refuse(format!(
            "the attention slides over {w} positions, and llama.cpp's \"{}\" architecture reads no sliding \
             window",
            arch.key()
        ));
    }
    // Llama 3.1's rope scaling travels as the llama architecture's rope_freqs tensor; the others read none.
    if cfg.rope_scaling.is_some() && arch != Arch::Llama {
        return refuse(format!(
            "rope_scaling is set, and llama.cpp's \"{}\" architecture reads no rope_freqs tensor",
            arch.key()
        ));
    }
    if let Some(l) = cfg.block.linears.iter().find(|l| l.d_in % BLOCK != 0) {
        return refuse(format!(
            "{} has {} inputs, not a multiple of GGUF's {BLOCK}-value blocks",
            l.name, l.d_in
        ));
    }
    Ok(arch)
}

/// A Gemma 3 config as llama.cpp's gemma3 runs it, or why not: its global layers' (RoPE base, linear
/// scaling factor). llama.cpp makes every 6th layer global, gives the local ones base 10000, and scales the
/// scores by a query_pre_attn_scalar of its own choosing (`gemma3_implied`); the file says none of these.
fn gemma3_rope(cfg: &Config) -> Result<(f64, f64), String> {
    let b = &cfg.block;
    let implied = gemma3_implied(cfg.n_layers, cfg.d, cfg.n_heads, cfg.d_h);
    let parts = b.act == Activation::GeluTanh
        && b.norm(NormRole::AttnOut).is_some()
        && b.norm(NormRole::MlpOut).is_some()
        && b.norm_offset == 1.0
        && b.moe.is_none();
    if !parts {
        return Err("the Gemma3ForCausalLM block differs from llama.cpp's \"gemma3\"".into());
    }
    if b.sliding_window.is_none() || b.sliding_layers != implied.sliding {
        return Err(format!(
            "the local (sliding-window) layers are {:?}; llama.cpp's \"gemma3\" makes every 6th layer global \
             and the others local, with a sliding_window",
            b.sliding_layers
        ));
    }
    let scale = (cfg.d_h as f64 / implied.query_pre_attn_scalar).sqrt() as f32;
    if b.q_scale != scale {
        return Err(format!(
            "query_pre_attn_scalar {} differs from the {} llama.cpp's \"gemma3\" scales the scores by",
            cfg.json["query_pre_attn_scalar"], implied.query_pre_attn_scalar
        ));
    }
    let ropes = b
        .layer_rope
        .as_ref()
        .ok_or("the Gemma 3 config has no per-layer RoPE")?;
    let mut global = None;
    for (l, r) in ropes.iter().enumerate() {
        let (theta, factor) = (r.theta, r.linear_factor);
        if implied.sliding[l] {
            if theta != implied.local_rope_base || factor != 1.0 {
                return Err(format!(
                    "the local layers' RoPE (base {theta}, factor {factor}) differs from llama.cpp's \
                     \"gemma3\" (base {}, unscaled)",
                    implied.local_rope_base
                ));
            }
        } else if *global.get_or_insert((theta, factor)) != (theta, factor) {
            return Err("the global layers' RoPE differs from layer to layer".into());
        }
    }
    Ok(global.unwrap_or((cfg.rope_theta, 1.0)))
}

/// llama.cpp's rope_freqs of a Llama 3.1-scaled config (`RopeScaling::llama3_divisors` in f32); None
/// without rope scaling.
pub fn rope_freqs(cfg: &Config) -> Option<Vec<f32>> {
    let s = cfg.rope_scaling.as_ref()?;
    Some(
        s.llama3_divisors(cfg.rope_theta, cfg.d_h)
            .into_iter()
            .map(|f| f as f32)
            .collect(),
    )
}

/// Whether llama.cpp renormalizes the top-k router weights of a mixture-of-experts block of `arch` (its
/// graph builders fix it per architecture).
fn llama_cpp_renormalizes(arch: Arch) -> bool {
    !matches!(arch, Arch::Qwen2Moe)
}

/// Where a mixture-of-experts tensor goes in llama.cpp's layout: one tensor per layer and part holding every
/// expert (`ffn_gate_exps` [n_expert × d_out × d_in]), the router, the shared expert and its gate.
enum MoePlace {
    Expert { part: &'static str, expert: usize },
    Tensor(&'static str),
}

fn moe_place(cfg: &Config, short: &str) -> Option<MoePlace> {
    let moe = cfg.block.moe.as_ref()?;
    if short == moe.router {
        return Some(MoePlace::Tensor("ffn_gate_inp"));
    }
    if moe.shared_expert.as_ref().is_some_and(|s| s.gate == short) {
        return Some(MoePlace::Tensor("ffn_gate_inp_shexp"));
    }
    let ld = cfg.block.linears.iter().find(|l| l.name == short)?;
    let (exps, shexp) = match ld.role {
        Role::Gate => ("ffn_gate_exps", "ffn_gate_shexp"),
        Role::Up => ("ffn_up_exps", "ffn_up_shexp"),
        Role::Down => ("ffn_down_exps", "ffn_down_shexp"),
        _ => return None,
    };
    Some(match ld.expert {
        Some(expert) => MoePlace::Expert { part: exps, expert },
        None => MoePlace::Tensor(shexp),
    })
}

/// GGUF row r of a q/k projection holds HF row `order[r]`: convert_hf_to_gguf.py's
/// `w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2)`, i.e. GGUF row h·hd + 2i + s is HF row h·hd + s·hd/2 + i
/// (`model::gguf::import::unpermute_qk` undoes it).
pub fn qk_row_order(rows: usize, n_head: usize) -> Vec<usize> {
    let hd = rows / n_head;
    let half = hd / 2;
    (0..rows)
        .map(|r| {
            let (h, j) = (r / hd, r % hd);
            h * hd + (j % 2) * half + j / 2
        })
        .collect()
}

/// One GGUF block of `codes` (32 codes of one row and group) with scale `d`.
fn encode_block(ty: GgmlType, d: f16, codes: &[u8], out: &mut Vec<u8>) {
    out.extend(d.to_le_bytes());
    match ty {
        GgmlType::Q8_0 => out.extend(codes.iter().map(|&q| (q as i16 - 128) as i8 as u8)),
        _ => out.extend((0..16).map(|i| codes[i] | (codes[i + 16] << 4))),
    }
}

/// A packed linear's GGUF bytes, rows in `order`. Errors (a damaged shard, or codes the format cannot hold)
/// name the tensor.
fn packed_bytes(
    p: &PackedTensors,
    ty: GgmlType,
    order: &[usize],
    name: &str,
) -> anyhow::Result<Vec<u8>> {
    let (d_out, d_in) = (p.d_out, p.d_in);
    let mid = 1u8 << (p.bits - 1);
    let ng = d_in / BLOCK;
    let bad = |m: String| crate::input_err!("{name}: {m}, which GGUF's {ty} cannot store");
    if p.n_groups != ng || (0..d_in).any(|c| p.g_idx[c] as usize != c / BLOCK) {
        return Err(bad(format!(
            "{} groups over {d_in} inputs are not contiguous {BLOCK}-column groups",
            p.n_groups
        )));
    }
    let zeros = p.unpack_zeros(GptqVersion::V2);
    if let Some(k) = zeros.iter().position(|&z| z != mid as f32) {
        return Err(bad(format!(
            "output {}, group {} has zero point {} (a symmetric grid's is {mid})",
            k % d_out,
            k / d_out,
            zeros[k]
        )));
    }
    let codes = p.unpack_codes();
    let row_bytes = ng * ty.type_size() as usize;
    let mut out = vec![0u8; d_out * row_bytes];
    out.par_chunks_mut(row_bytes)
        .zip(order)
        .for_each(|(dst, &j)| {
            let mut row = Vec::with_capacity(row_bytes);
            for g in 0..ng {
                let c = &codes[j * d_in + g * BLOCK..j * d_in + (g + 1) * BLOCK];
                encode_block(ty, p.scales[g * d_out + j], c, &mut row);
            }
            dst.copy_from_slice(&row);
        });
    Ok(out)
}

/// A linear of a codec type (`gguf_mix::via_codec`) as the run keeps it: its GGUF blocks, rows in HF order,
/// in the shard as `{prefix}.ggml_{type}` (U8 [d_out × row bytes]; `blocks_suffix`), since its grids are
/// not GPTQ's. `--format fake` writes their decode instead.
pub struct CodecLinear {
    pub ty: GgmlType,
    pub d_out: usize,
    pub d_in: usize,
    pub bytes: Vec<u8>,
}

/// The shard suffix of a linear stored as `ty` blocks: "ggml_q4_k".
pub fn blocks_suffix(ty: GgmlType) -> String {
    format!("ggml_{}", ty.to_string().to_ascii_lowercase())
}

/// The type of a shard tensor kind written by `blocks_suffix`.
fn blocks_type(kind: &str) -> Option<GgmlType> {
    let t = kind.strip_prefix("ggml_")?;
    crate::model::gguf::codec::WRITTEN
        .into_iter()
        .find(|ty| ty.to_string().eq_ignore_ascii_case(t))
}

impl CodecLinear {
    /// Encodes a quantized linear's codes [d_out × d_in] and grids [d_out × n_groups] (scales; zero points
    /// or offsets) row by row; an error (a grid off the type's lattice) names the tensor and row.
    pub fn encode(
        name: &str,
        ty: GgmlType,
        codes: &[u8],
        scales: &[f64],
        zeros: &[f64],
        d_out: usize,
        d_in: usize,
    ) -> anyhow::Result<CodecLinear> {
        let c = crate::model::gguf::codec::codec(ty)
            .ok_or_else(|| anyhow::anyhow!("{name}: GGUF type {ty} is not written"))?;
        let ng = d_in / c.group;
        if codes.len() != d_out * d_in || scales.len() != d_out * ng || zeros.len() != scales.len()
        {
            anyhow::bail!(
                "{name}: codes or grids do not fit [{d_out} × {d_in}] in groups of {}",
                c.group
            );
        }
        let rows: Vec<Vec<u8>> = (0..d_out)
            .into_par_iter()
            .map(|r| {
                c.encode_row(
                    &codes[r * d_in..(r + 1) * d_in],
                    &scales[r * ng..(r + 1) * ng],
                    &zeros[r * ng..(r + 1) * ng],
                )
                .map_err(|m| anyhow::anyhow!("{name} as {ty}, row {r}: {m}"))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(CodecLinear {
            ty,
            d_out,
            d_in,
            bytes: rows.concat(),
        })
    }

    /// Ŵ [d_out × d_in] as ggml decodes it.
    pub fn decode(&self) -> anyhow::Result<Vec<f32>> {
        crate::model::gguf::dequant::dequantize(
            "linear",
            self.ty,
            &self.bytes,
            self.d_out * self.d_in,
        )
    }

    /// The shard entries of `prefix`: the blocks, or (`fake`) their decode in `dtype`.
    pub fn entries(
        &self,
        prefix: &str,
        fake: bool,
        dtype: Dtype,
    ) -> anyhow::Result<Vec<crate::export::safetensors_out::TensorEntry<'static>>> {
        use crate::export::safetensors_out::TensorEntry;
        Ok(vec![if fake {
            TensorEntry::new(
                format!("{prefix}.weight"),
                dtype,
                vec![self.d_out, self.d_in],
                crate::export::hf_folder::f32_to_bytes(dtype, &self.decode()?),
            )
        } else {
            TensorEntry::new(
                format!("{prefix}.{}", blocks_suffix(self.ty)),
                Dtype::U8,
                vec![self.d_out, self.bytes.len() / self.d_out.max(1)],
                self.bytes.clone(),
            )
        }])
    }
}

/// How one GGUF tensor is made from the run's shards.
enum Source {
    /// A float tensor as stored (its rows in `order` when given).
    Float {
        hf: String,
        order: Option<Vec<usize>>,
    },
    /// A norm (or other vector), converted to f32, `plus` added (Gemma's norms are stored as w + 1).
    Vector { hf: String, plus: f32 },
    /// A packed linear (`hf` is its prefix).
    Packed { hf: String, order: Vec<usize> },
    /// A linear's GGUF blocks (`CodecLinear`), rows in `order`.
    Blocks { hf: String, order: Vec<usize> },
    /// Every expert's tensor of one layer and part, one after another.
    Stack(Vec<Source>),
    /// An f32 vector computed from the config (rope_freqs).
    Values(Vec<f32>),
}

fn float_type(dtype: Dtype) -> Option<GgmlType> {
    match dtype {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}

fn read_packed(store: &WeightStore, prefix: &str, bits: u32) -> anyhow::Result<PackedTensors> {
    let t = |s: &str| format!("{prefix}.{s}");
    let words = |s: &str| -> anyhow::Result<Vec<u32>> {
        Ok(store
            .bytes(&t(s))?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    };
    let shape = store
        .entry(&t("qweight"))
        .map(|e| e.shape.clone())
        .unwrap_or_default();
    let g_idx = words("g_idx")?;
    let scales: Vec<f16> = store
        .bytes(&t("scales"))?
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]))
        .collect();
    let d_out = shape.get(1).copied().unwrap_or(0);
    let p = PackedTensors {
        d_out,
        d_in: g_idx.len(),
        bits,
        n_groups: scales.len().checked_div(d_out).unwrap_or(0),
        qweight: words("qweight")?,
        qzeros: words("qzeros")?,
        scales,
        g_idx,
    };
    p.clone()
        .into_linear(GptqVersion::V2)
        .validate()
        .map_err(|m| anyhow::anyhow!("{prefix}: {m}"))?;
    Ok(p)
}

/// The GGUF data of one tensor (`ty`: its type) from the run's shards.
fn source_bytes(
    store: &WeightStore,
    source: &Source,
    ty: GgmlType,
    bits_of: &dyn Fn(&str) -> u32,
) -> anyhow::Result<Vec<u8>> {
    let rows_in = |raw: &[u8], order: &[usize]| -> Vec<u8> {
        let row = raw.len() / order.len().max(1);
        order
            .iter()
            .flat_map(|&r| &raw[r * row..(r + 1) * row])
            .copied()
            .collect()
    };
    Ok(match source {
        Source::Packed { hf, order } => {
            let p = read_packed(store, hf, bits_of(hf))?;
            packed_bytes(&p, ty, order, hf)?
        }
        Source::Blocks { hf, order } => rows_in(store.bytes(hf)?, order),
        Source::Vector { hf, plus } => {
            let e = store
                .entry(hf)
                .ok_or_else(|| anyhow::anyhow!("{hf}: not in the shards"))?;
            let v = to_f32(e.dtype, store.bytes(hf)?).map_err(|m| anyhow::anyhow!("{hf}: {m}"))?;
            v.iter().flat_map(|x| (x + plus).to_le_bytes()).collect()
        }
        Source::Float { hf, order } => {
            let raw = store.bytes(hf)?;
            match order {
                None => raw.to_vec(),
                Some(order) => rows_in(raw, order),
            }
        }
        Source::Stack(members) => {
            let mut out = Vec::new();
            for m in members {
                out.extend(source_bytes(store, m, ty, bits_of)?);
            }
            out
        }
        Source::Values(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}

/// What `write_model_gguf` wrote.
pub struct Written {
    pub path: std::path::PathBuf,
    pub bytes: u64,
    pub tensors: usize,
}

/// Writes `out` (a GGUF file) from the run's finished folder `store` (every shard of --out's partial folder):
/// `cfg` and `dir` are the model's (hyper-parameters, tokenizer), `bits_of` the width of each packed linear
/// (by prefix, e.g. "model.layers.3.mlp.up_proj"), `name` the model's name for general.name.
pub fn write_model_gguf(
    store: &WeightStore,
    cfg: &Config,
    dir: &Path,
    bits_of: &dyn Fn(&str) -> u32,
    file_type: u32,
    name: &str,
    out: &Path,
) -> anyhow::Result<Written> {
    let arch = model_arch(cfg).map_err(|m| crate::input_err!("{m}"))?;
    let vocab =
        super::gguf_vocab::tokenizer_kvs(dir, cfg.vocab).map_err(|m| crate::input_err!("{m}"))?;
    let n_head = |role: Role| match role {
        _ if !arch.permutes_qk() => None,
        Role::Q => Some(cfg.n_heads),
        Role::K => Some(cfg.n_kv_heads),
        _ => None,
    };
    let mut tensors = Vec::new();
    let mut sources = Vec::new();
    let mut experts: std::collections::BTreeMap<String, Vec<(usize, GgufTensor, Source)>> =
        Default::default();
    let mut names: Vec<&String> = store.names().collect();
    // Blocks in layer order, then the globals (llama.cpp does not care; people reading a dump do).
    names.sort_by_key(|n| {
        let layer = n
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        (layer.unwrap_or(usize::MAX), (*n).clone())
    });
    for hf in names {
        let e = store.entry(hf).expect("listed");
        let (base, kind) = match hf.rsplit_once('.') {
            Some((b, k)) => (b, k),
            None => (hf.as_str(), ""),
        };
        if matches!(kind, "qzeros" | "scales" | "g_idx") {
            continue;
        }
        let blocks = blocks_type(kind);
        let short = base
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .map(|(_, s)| s);
        let role = short
            .and_then(|s| cfg.block.linears.iter().find(|l| l.name == s))
            .map(|l| l.role);
        let order = |rows: usize| role.and_then(n_head).map(|h| qk_row_order(rows, h));
        // A linear's packed or block tensors are named after its weight.
        let as_weight = if kind == "qweight" || blocks.is_some() {
            format!("{base}.weight")
        } else {
            hf.clone()
        };
        let layer = base
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next())
            .unwrap_or("");
        let place = short
            .filter(|_| as_weight.ends_with(".weight"))
            .and_then(|s| moe_place(cfg, s));
        let gguf = match &place {
            Some(MoePlace::Expert { part, .. } | MoePlace::Tensor(part)) => {
                Some(format!("blk.{layer}.{part}.weight"))
            }
            None => gguf_name(&as_weight, arch),
        };
        let gguf = gguf.ok_or_else(|| {
            file_err(
                dir,
                format!(
                    "tensor {hf} has no place in llama.cpp's \"{}\" architecture",
                    arch.key()
                ),
            )
        })?;
        let (tensor, source) = if let Some(ty) = blocks {
            // [d_out, row bytes] of `ty` blocks.
            let (d_out, row) = match e.shape.as_slice() {
                [r, c] => (*r, *c),
                _ => (0, 0),
            };
            let per = ty.type_size() as usize;
            if e.dtype != Dtype::U8 || d_out == 0 || row % per != 0 {
                return Err(file_err(
                    dir,
                    format!(
                        "tensor {hf} ({:?} {:?}) is not rows of {ty} blocks",
                        e.dtype, e.shape
                    ),
                ));
            }
            (
                GgufTensor {
                    name: gguf,
                    dims: vec![(row / per) as u64 * ty.block_size(), d_out as u64],
                    ty,
                },
                Source::Blocks {
                    hf: hf.clone(),
                    order: order(d_out).unwrap_or_else(|| (0..d_out).collect()),
                },
            )
        } else if kind == "qweight" {
            let bits = bits_of(base);
            let ty = block_type(bits).ok_or_else(|| {
                crate::input_err!(
                    "{base}: {bits}-bit linears have no exact GGUF type (4 and 8 have)"
                )
            })?;
            // qweight is [words, d_out], g_idx [d_in]; the rest is read when the tensor is written.
            let d_out = e.shape.get(1).copied().unwrap_or(0);
            let d_in = store
                .entry(&format!("{base}.g_idx"))
                .and_then(|g| g.shape.first().copied())
                .unwrap_or(0);
            (
                GgufTensor {
                    name: gguf,
                    dims: vec![d_in as u64, d_out as u64],
                    ty,
                },
                Source::Packed {
                    hf: base.to_string(),
                    order: order(d_out).unwrap_or_else(|| (0..d_out).collect()),
                },
            )
        } else if e.shape.len() == 1
            || matches!(
                place,
                Some(MoePlace::Tensor("ffn_gate_inp" | "ffn_gate_inp_shexp"))
            )
        {
            // Norms, biases, and the router and shared-expert gate (llama.cpp wants them F32; the gate's
            // [1 × d] is a vector there).
            let dims = match (e.shape.as_slice(), &place) {
                ([1, d], Some(MoePlace::Tensor("ffn_gate_inp_shexp"))) | ([d], _) => {
                    vec![*d as u64]
                }
                ([r, c], _) => vec![*c as u64, *r as u64],
                _ => vec![e.shape.iter().product::<usize>() as u64],
            };
            (
                GgufTensor {
                    name: gguf,
                    dims,
                    ty: GgmlType::F32,
                },
                Source::Vector {
                    hf: hf.clone(),
                    // convert_hf_to_gguf.py stores Gemma's (1 + w) norms as w + 1.
                    plus: match hf.ends_with("norm.weight") {
                        true => cfg.block.norm_offset,
                        false => 0.0,
                    },
                },
            )
        } else if let (Some(ty), [rows, cols]) = (float_type(e.dtype), e.shape.as_slice()) {
            (
                GgufTensor {
                    name: gguf,
                    dims: vec![*cols as u64, *rows as u64],
                    ty,
                },
                Source::Float {
                    hf: hf.clone(),
                    order: order(*rows),
                },
            )
        } else {
            return Err(file_err(
                dir,
                format!(
                    "tensor {hf} ({:?} {:?}) cannot be written to GGUF",
                    e.dtype, e.shape
                ),
            ));
        };
        if let Some(MoePlace::Expert { expert, .. }) = place {
            experts
                .entry(tensor.name.clone())
                .or_default()
                .push((expert, tensor, source));
            continue;
        }
        tensors.push(tensor);
        sources.push(source);
    }
    // Each layer's experts of one part as one [n_expert × d_out × d_in] tensor of one type.
    for (name, mut members) in experts {
        members.sort_by_key(|m| m.0);
        let n = cfg.block.moe.as_ref().map_or(0, |m| m.n_experts);
        let first = &members[0].1;
        let (ty, dims) = (first.ty, first.dims.clone());
        let complete = members.len() == n && members.iter().enumerate().all(|(i, m)| m.0 == i);
        if !complete || members.iter().any(|m| m.1.ty != ty || m.1.dims != dims) {
            return Err(file_err(
                dir,
                format!(
                    "{name}: the {} experts' tensors are not {n} of one type and shape",
                    members.len()
                ),
            ));
        }
        tensors.push(GgufTensor {
            name,
            dims: vec![dims[0], dims[1], n as u64],
            ty,
        });
        sources.push(Source::Stack(members.into_iter().map(|m| m.2).collect()));
    }
    if let Some(factors) = rope_freqs(cfg) {
        tensors.push(GgufTensor {
            name: "rope_freqs.weight".into(),
            dims: vec![factors.len() as u64],
            ty: GgmlType::F32,
        });
        sources.push(Source::Values(factors));
    }

    let a = |k: &str| format!("{}.{k}", arch.key());
    let ctx = cfg.json["max_position_embeddings"].as_u64().unwrap_or(2048);
    // Gemma 3: the global layers' RoPE (the local ones' is llama.cpp's fixed one, checked by model_arch).
    let (rope_base, rope_linear) = match arch {
        Arch::Gemma3 => gemma3_rope(cfg).map_err(|m| crate::input_err!("{m}"))?,
        _ => (cfg.rope_theta, 1.0),
    };
    let mut kvs = vec![
        (
            "general.architecture".to_string(),
            Kv::Str(arch.key().into()),
        ),
        ("general.name".to_string(), Kv::Str(name.into())),
        (
            "general.quantized_by".to_string(),
            Kv::Str(format!("boa-cuda {}", env!("CARGO_PKG_VERSION"))),
        ),
        ("general.file_type".to_string(), Kv::U32(file_type)),
        ("general.quantization_version".to_string(), Kv::U32(2)),
        (
            a("context_length"),
            Kv::U32(ctx.min(u32::MAX as u64) as u32),
        ),
        (a("embedding_length"), Kv::U32(cfg.d as u32)),
        (a("block_count"), Kv::U32(cfg.n_layers as u32)),
        (a("feed_forward_length"), Kv::U32(cfg.d_ff as u32)),
        (a("attention.head_count"), Kv::U32(cfg.n_heads as u32)),
        (a("attention.head_count_kv"), Kv::U32(cfg.n_kv_heads as u32)),
        (a("attention.key_length"), Kv::U32(cfg.d_h as u32)),
        (a("attention.value_length"), Kv::U32(cfg.d_h as u32)),
        (a("rope.dimension_count"), Kv::U32(cfg.d_h as u32)),
        (a("rope.freq_base"), Kv::F32(rope_base as f32)),
        (a("attention.layer_norm_rms_epsilon"), Kv::F32(cfg.eps)),
        (a("vocab_size"), Kv::U32(cfg.vocab as u32)),
    ];
    if let Some(w) = cfg.block.sliding_window.filter(|_| arch == Arch::Gemma3) {
        kvs.push((a("attention.sliding_window"), Kv::U32(w as u32)));
    }
    if rope_linear != 1.0 {
        kvs.push((a("rope.scaling.type"), Kv::Str("linear".into())));
        kvs.push((a("rope.scaling.factor"), Kv::F32(rope_linear as f32)));
    }
    if let Some(m) = &cfg.block.moe {
        kvs.push((a("expert_count"), Kv::U32(m.n_experts as u32)));
        kvs.push((a("expert_used_count"), Kv::U32(m.top_k as u32)));
        // llama.cpp's llama architecture (Mixtral) takes the experts' width from feed_forward_length.
        if arch != Arch::Llama {
            kvs.push((a("expert_feed_forward_length"), Kv::U32(m.d_expert as u32)));
        }
        if let Some(sh) = &m.shared_expert {
            kvs.push((
                a("expert_shared_feed_forward_length"),
                Kv::U32(sh.d_ff as u32),
            ));
        }
    }
    kvs.extend(vocab);

    let bytes = write_gguf(out, &kvs, &tensors, |i| {
        source_bytes(store, &sources[i], tensors[i].ty, bits_of)
    })?;
    Ok(Written {
        path: out.to_path_buf(),
        bytes,
        tensors: tensors.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_row_order_is_the_inverse_of_the_importers_unpermute() {
        let (rows, cols, heads) = (16, 3, 2);
        let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let order = qk_row_order(rows, heads);
        let gguf: Vec<f32> = order
            .iter()
            .flat_map(|&r| hf[r * cols..(r + 1) * cols].to_vec())
            .collect();
        let back = crate::model::gguf::import::unpermute_qk(&gguf, rows, cols, heads).unwrap();
        assert_eq!(back, hf);
        assert_ne!(gguf, hf);
    }

    #[test]
    fn blocks_decode_to_scale_times_code_minus_mid() {
        use crate::model::gguf::dequant::dequantize;
        let codes4: Vec<u8> = (0..32).map(|i| (i * 7 % 16) as u8).collect();
        let codes8: Vec<u8> = (0..32).map(|i| (i * 37 % 256) as u8).collect();
        let d = f16::from_f32(0.0123);
        for (ty, codes, mid) in [(GgmlType::Q4_0, &codes4, 8), (GgmlType::Q8_0, &codes8, 128)] {
            let mut b = Vec::new();
            encode_block(ty, d, codes, &mut b);
            assert_eq!(b.len() as u64, ty.type_size());
            let x = dequantize("t", ty, &b, 32).unwrap();
            for (v, &q) in x.iter().zip(codes.iter()) {
                assert_eq!(*v, d.to_f32() * (q as f32 - mid as f32));
            }
        }
    }
}
