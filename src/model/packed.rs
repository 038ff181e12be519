//! Reading packed GPTQ checkpoints (design.md §9): the quantization config (config.json's
//! `quantization_config`, else quantize_config.json) and one packed linear's tensors, from our runs or from
//! other GPTQ tools that write the same layout (v1 "gptq" and v2 "gptq_v2", with or without act-order g_idx).

use super::weights::WeightStore;
use crate::error::file_err;
use crate::quant::pack::{GptqVersion, PackedLinear, PackedTensors, pack_words};
use half::{bf16, f16};
use safetensors::Dtype;
use std::path::Path;

/// The fields of a GPTQ quantization config we use or report.
#[derive(Clone, Debug, PartialEq)]
pub struct GptqConfig {
    pub bits: u32,
    /// None: one group per output channel (group_size −1).
    pub group_size: Option<usize>,
    pub desc_act: bool,
    pub sym: bool,
    pub version: GptqVersion,
    /// Where it was read from ("config.json" or "quantize_config.json").
    pub source: &'static str,
    /// GPTQModel's `dynamic`: per-module overrides, first match wins (what --avg-bits writes).
    pub dynamic: Vec<DynamicRule>,
}

/// One entry of `dynamic`: a pattern matched at the start of a module's name (Python's `re.match`), "+:"
/// or no prefix overriding bits/group_size, "-:" leaving the module unquantized.
#[derive(Clone, Debug)]
pub struct DynamicRule {
    pattern: regex::Regex,
    skip: bool,
    bits: Option<u32>,
    group_size: Option<Option<usize>>,
}

impl PartialEq for DynamicRule {
    fn eq(&self, o: &Self) -> bool {
        self.pattern.as_str() == o.pattern.as_str()
            && (self.skip, self.bits, self.group_size) == (o.skip, o.bits, o.group_size)
    }
}

fn parse_bits(v: &serde_json::Value, what: &str) -> Result<u32, String> {
    let bits = v
        .as_u64()
        .ok_or_else(|| format!("{what} \"bits\" is not an integer"))? as u32;
    if !matches!(bits, 2 | 3 | 4 | 8) {
        return Err(format!(
            "{what} bits {bits} is not supported (2, 3, 4 or 8)"
        ));
    }
    Ok(bits)
}

fn parse_group(v: &serde_json::Value, what: &str) -> Result<Option<usize>, String> {
    match v.as_i64() {
        Some(-1) => Ok(None),
        Some(g) if g > 0 => Ok(Some(g as usize)),
        _ => Err(format!("{what} group_size {v} is invalid")),
    }
}

fn parse_dynamic(v: Option<&serde_json::Value>) -> Result<Vec<DynamicRule>, String> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let map = v
        .as_object()
        .ok_or("the quantization config's \"dynamic\" is not an object")?;
    map.iter()
        .map(|(key, o)| {
            let (skip, pat) = match key.strip_prefix("-:") {
                Some(p) => (true, p),
                None => (false, key.strip_prefix("+:").unwrap_or(key)),
            };
            let what = format!("dynamic {key:?}:");
            // re.match anchors at the start only.
            let pattern = regex::Regex::new(&format!("^(?:{pat})"))
                .map_err(|e| format!("{what} not a regular expression we can read: {e}"))?;
            let bits = o.get("bits").map(|b| parse_bits(b, &what)).transpose()?;
            let group_size = o
                .get("group_size")
                .map(|g| parse_group(g, &what))
                .transpose()?;
            Ok(DynamicRule {
                pattern,
                skip,
                bits,
                group_size,
            })
        })
        .collect()
}

impl GptqConfig {
    /// The folder's GPTQ config, None for an unquantized folder. Errors on a config we cannot run.
    pub fn load(dir: &Path) -> anyhow::Result<Option<GptqConfig>> {
        let cfg_path = dir.join("config.json");
        let from_config = std::fs::read_to_string(&cfg_path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("quantization_config").cloned());
        let (value, source, path) = match from_config {
            Some(v) => (v, "config.json", cfg_path),
            None => {
                let p = dir.join("quantize_config.json");
                if !p.is_file() {
                    return Ok(None);
                }
                let text = std::fs::read_to_string(&p)
                    .map_err(|e| file_err(&p, format!("cannot read: {e}")))?;
                let v = serde_json::from_str(&text)
                    .map_err(|e| file_err(&p, format!("invalid JSON: {e}")))?;
                (v, "quantize_config.json", p)
            }
        };
        Self::parse(&value, source).map_err(|m| file_err(&path, m))
    }

    /// From a `quantization_config` / quantize_config.json object.
    pub fn parse(
        v: &serde_json::Value,
        source: &'static str,
    ) -> Result<Option<GptqConfig>, String> {
        match v.get("quant_method").and_then(|m| m.as_str()) {
            // Read by model::compressed.
            Some("compressed-tensors") => return Ok(None),
            Some(m) if m != "gptq" => {
                return Err(format!(
                    "quantization_config.quant_method {m:?} is not supported (\"gptq\" and \
                     \"compressed-tensors\" are)"
                ));
            }
            _ => {}
        }
        let bits = parse_bits(
            v.get("bits")
                .ok_or("the quantization config has no integer \"bits\"")?,
            "quantization config",
        )?;
        let group_size = match v.get("group_size") {
            Some(g) => parse_group(g, "quantization config")?,
            None => None,
        };
        let format = v
            .get("checkpoint_format")
            .and_then(|f| f.as_str())
            .unwrap_or("gptq");
        let version = GptqVersion::parse(format).ok_or_else(|| {
            format!(
                "unknown checkpoint_format {format:?} in the quantization config (supported: \"gptq\", \"gptq_v2\")"
            )
        })?;
        let flag = |k: &str| v.get(k).and_then(|b| b.as_bool()).unwrap_or(false);
        Ok(Some(GptqConfig {
            bits,
            group_size,
            desc_act: flag("desc_act"),
            sym: flag("sym"),
            version,
            source,
            dynamic: parse_dynamic(v.get("dynamic"))?,
        }))
    }

    /// The config module `name` (e.g. "model.layers.3.mlp.up_proj") is stored with: `dynamic`'s first
    /// matching rule applied, None when that rule leaves it unquantized.
    pub fn for_module(&self, name: &str) -> Option<GptqConfig> {
        let Some(r) = self.dynamic.iter().find(|r| r.pattern.is_match(name)) else {
            return Some(self.clone());
        };
        if r.skip {
            return None;
        }
        let mut c = self.clone();
        c.bits = r.bits.unwrap_or(c.bits);
        c.group_size = r.group_size.unwrap_or(c.group_size);
        Some(c)
    }

    /// Number of groups of a linear with `d_in` inputs.
    pub fn n_groups(&self, d_in: usize) -> usize {
        d_in.div_ceil(self.group_size.unwrap_or(d_in).clamp(1, d_in.max(1)))
    }

    /// Expected (name suffix, shape) of the tensors of a packed [d_out × d_in] linear (g_idx may be absent).
    pub fn tensor_shapes(&self, d_out: usize, d_in: usize) -> [(&'static str, Vec<usize>); 4] {
        let ng = self.n_groups(d_in);
        [
            ("qweight", vec![pack_words(d_in, self.bits), d_out]),
            ("qzeros", vec![ng, pack_words(d_out, self.bits)]),
            ("scales", vec![ng, d_out]),
            ("g_idx", vec![d_in]),
        ]
    }
}

/// A tensor of int32 words (packed codes, zeros, g_idx), whose presence the caller checked.
pub(super) fn words(store: &WeightStore, dir: &Path, name: &str) -> anyhow::Result<Vec<u32>> {
    let e = store.entry(name).expect("checked by the caller");
    if !matches!(e.dtype, Dtype::I32 | Dtype::U32) {
        return Err(file_err(
            dir,
            format!("tensor {name} has dtype {:?}, expected I32", e.dtype),
        ));
    }
    Ok(store
        .bytes(name)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Loads the packed linear `prefix` (e.g. "model.layers.3.mlp.up_proj") of a [d_out × d_in] layer, checking
/// every shape, dtype and g_idx value, so a malformed checkpoint gives a one-line error, not a crash.
pub fn load_packed_linear(
    store: &WeightStore,
    dir: &Path,
    cfg: &GptqConfig,
    prefix: &str,
    d_out: usize,
    d_in: usize,
) -> anyhow::Result<PackedLinear> {
    let ng = cfg.n_groups(d_in);
    for (suffix, shape) in cfg.tensor_shapes(d_out, d_in) {
        let name = format!("{prefix}.{suffix}");
        match store.entry(&name) {
            None if suffix == "g_idx" => {}
            None => return Err(file_err(dir, format!("tensor {name} is missing"))),
            Some(e) if e.shape != shape => {
                return Err(file_err(
                    dir,
                    format!(
                        "tensor {name} has shape {:?}, expected {shape:?} for {} bits, d_in {d_in}, d_out {d_out}, \
                         group size {}",
                        e.shape,
                        cfg.bits,
                        cfg.group_size.map(|g| g as i64).unwrap_or(-1)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    let qweight = words(store, dir, &format!("{prefix}.qweight"))?;
    let qzeros = words(store, dir, &format!("{prefix}.qzeros"))?;
    let sname = format!("{prefix}.scales");
    let sbytes = store.bytes(&sname)?;
    let scales: Vec<f16> = match store.entry(&sname).expect("checked").dtype {
        Dtype::F16 => sbytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]))
            .collect(),
        Dtype::BF16 => sbytes
            .chunks_exact(2)
            .map(|c| f16::from_f32(bf16::from_le_bytes([c[0], c[1]]).to_f32()))
            .collect(),
        d => {
            return Err(file_err(
                dir,
                format!("tensor {sname} has dtype {d:?}, expected F16"),
            ));
        }
    };
    let gname = format!("{prefix}.g_idx");
    let g_idx = if store.contains(&gname) {
        words(store, dir, &gname)?
    } else {
        // Old checkpoints without g_idx: contiguous groups.
        let g = cfg.group_size.unwrap_or(d_in).max(1);
        (0..d_in).map(|i| (i / g) as u32).collect()
    };
    let p = PackedTensors {
        d_out,
        d_in,
        bits: cfg.bits,
        n_groups: ng,
        qweight,
        qzeros,
        scales,
        g_idx,
    }
    .into_linear(cfg.version);
    p.validate()
        .map_err(|m| file_err(dir, format!("{prefix}: {m}")))?;
    Ok(p)
}

/// What `boa-cuda inspect` reports about a model folder.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckpointSummary {
    pub architecture: String,
    pub n_layers: usize,
    /// Blocks with at least one packed linear.
    pub quantized_layers: Vec<usize>,
    pub packed_linears: usize,
    pub bits: Option<u32>,
    /// −1: per output channel.
    pub group_size: Option<i64>,
    /// "fake/unquantized" folders have none.
    pub checkpoint_format: Option<&'static str>,
    pub desc_act: Option<bool>,
    pub sym: Option<bool>,
    /// Some g_idx is not the contiguous i / group_size (act-order).
    pub act_order_g_idx: bool,
    pub size_bytes: u64,
    pub files: usize,
}

/// Summarizes a model folder after validating it as `Model::open` does (so a broken checkpoint errors here).
pub fn inspect(dir: &Path) -> anyhow::Result<CheckpointSummary> {
    let model = super::Model::open(dir)?;
    let c = &model.cfg;
    let mut quantized_layers = Vec::new();
    let mut packed_linears = 0;
    let mut act_order = false;
    for l in 0..c.n_layers {
        let mut any = false;
        for ld in &c.block.linears {
            let (name, d_in) = (ld.name.as_str(), ld.d_in);
            let prefix = format!("model.layers.{l}.{name}");
            if model.is_packed(&prefix) {
                any = true;
                packed_linears += 1;
                let gname = format!("{prefix}.g_idx");
                if let (Some(q), true) = (&model.gptq, model.store.contains(&gname)) {
                    let g = q.group_size.unwrap_or(d_in).max(1);
                    let words = words(&model.store, dir, &gname)?;
                    act_order |= words.iter().enumerate().any(|(i, &v)| v as usize != i / g);
                }
            }
        }
        if any {
            quantized_layers.push(l);
        }
    }
    let mut size_bytes = 0;
    let mut files = 0;
    for e in std::fs::read_dir(dir).map_err(|e| file_err(dir, format!("cannot list: {e}")))? {
        let md = e
            .and_then(|e| e.metadata())
            .map_err(|e| file_err(dir, format!("cannot list: {e}")))?;
        if md.is_file() {
            size_bytes += md.len();
            files += 1;
        }
    }
    let q = model.gptq.as_ref();
    // A compressed-tensors checkpoint: its first config group's scheme (--avg-bits writes one per width).
    let ct = model.compressed.as_ref().and_then(|c| c.first());
    Ok(CheckpointSummary {
        architecture: c.architecture.clone(),
        n_layers: c.n_layers,
        quantized_layers,
        packed_linears,
        bits: q.map(|q| q.bits).or(ct.map(|s| s.bits)),
        group_size: q
            .map(|q| q.group_size)
            .or(ct.map(|s| s.group_size))
            .map(|g| g.map_or(-1, |g| g as i64)),
        checkpoint_format: q
            .map(|q| q.version.name())
            .or(ct.map(|_| "compressed-tensors pack-quantized")),
        desc_act: q.map(|q| q.desc_act).or(ct.map(|_| false)),
        sym: q.map(|q| q.sym).or(ct.map(|s| s.sym)),
        act_order_g_idx: act_order,
        size_bytes,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::GptqConfig;

    #[test]
    fn dynamic_overrides_apply_first_match_from_the_start_of_the_name() {
        let v = serde_json::json!({
            "bits": 2, "group_size": 64, "checkpoint_format": "gptq_v2",
            "dynamic": {
                "+:^model\\.layers\\.0\\.mlp\\.down_proj$": {"bits": 4},
                "-:model\\.layers\\.1\\.": {},
                "model\\.layers\\.[23]\\.self_attn": {"bits": 3, "group_size": -1},
            }
        });
        let c = GptqConfig::parse(&v, "config.json").unwrap().unwrap();
        let at = |n: &str| c.for_module(n).map(|c| (c.bits, c.group_size));
        assert_eq!(at("model.layers.0.mlp.down_proj"), Some((4, Some(64))));
        // Anchored at both ends: not a prefix rule.
        assert_eq!(at("model.layers.0.mlp.down_proj2"), Some((2, Some(64))));
        assert_eq!(at("model.layers.1.mlp.up_proj"), None);
        assert_eq!(at("model.layers.3.self_attn.q_proj"), Some((3, None)));
        // re.match anchors only the start.
        assert_eq!(at("xmodel.layers.3.self_attn.q_proj"), Some((2, Some(64))));
        // What `run` writes for --layers 0-1 of a 12-block model, one linear at another width.
        let dynamic = crate::export::gptq_packed::dynamic_bits(
            2,
            [("model\\.layers\\.0\\.mlp\\.down_proj".to_string(), 4)],
            (2..12).map(|l| format!("model\\.layers\\.{l}\\.")),
        );
        let v = serde_json::json!({"bits": 2, "group_size": 64, "dynamic": dynamic});
        let c = GptqConfig::parse(&v, "config.json").unwrap().unwrap();
        let at = |n: &str| c.for_module(n).map(|c| c.bits);
        assert_eq!(at("model.layers.0.mlp.down_proj"), Some(4));
        assert_eq!(at("model.layers.1.mlp.down_proj"), Some(2));
        assert_eq!(at("model.layers.2.mlp.down_proj"), None);
        assert_eq!(at("model.layers.11.self_attn.q_proj"), None);
        for bad in [
            serde_json::json!({"bits": 2, "dynamic": {"(": {}}}),
            serde_json::json!({"bits": 2, "dynamic": {"a": {"bits": 5}}}),
            serde_json::json!({"bits": 2, "dynamic": []}),
        ] {
            assert!(GptqConfig::parse(&bad, "config.json").is_err(), "{bad}");
        }
    }
}
