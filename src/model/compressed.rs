//! Reading compressed-tensors `pack-quantized` checkpoints: what llm-compressor writes for W{2,3,4,8}A16 and
//! `run --format compressed-tensors` writes (src/export/compressed_tensors.rs has the layout). Each quantized
//! linear becomes the same `PackedLinear` a GPTQ checkpoint gives, so `eval` runs it through the packed GEMM:
//! `weight_packed` [d_out × words] is GPTQ's qweight transposed (the same LSB-first code streams), the
//! stored codes and zero points are compressed-tensors' signed values plus 2^(b−1), i.e. unsigned codes
//! and zeros as ours, and a symmetric scheme's zero is 2^(b−1). Anything else the config may say (another
//! format, activation quantization, a group order kept in `weight_g_idx`) is refused in one line.

use super::packed::words;
use super::weights::WeightStore;
use crate::error::file_err;
use crate::quant::pack::{PackedLinear, pack_words, unpack_stream};
use std::path::Path;

/// How a config group's `targets` or the `ignore` list names a module.
#[derive(Clone, Debug)]
enum Target {
    /// A module's full name.
    Name(String),
    /// "re:…": matched at the start of the name (Python's `re.match`, as compressed-tensors does).
    Regex(regex::Regex),
    /// A module class: only "Linear" (every quantizable linear) is one we can see.
    Linear,
}

impl Target {
    fn parse(s: &str) -> Result<Target, String> {
        if let Some(p) = s.strip_prefix("re:") {
            return regex::Regex::new(&format!("^(?:{p})"))
                .map(Target::Regex)
                .map_err(|e| format!("target {s:?} is not a valid regex: {e}"));
        }
        Ok(match s {
            "Linear" => Target::Linear,
            _ => Target::Name(s.to_string()),
        })
    }

    fn by_name(&self, name: &str) -> bool {
        match self {
            Target::Name(n) => n == name,
            Target::Regex(r) => r.is_match(name),
            Target::Linear => false,
        }
    }
}

/// One config group's weight scheme.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheme {
    pub bits: u32,
    /// None: one group per output channel (strategy "channel").
    pub group_size: Option<usize>,
    pub sym: bool,
}

/// config.json's `quantization_config` of a compressed-tensors checkpoint.
#[derive(Clone, Debug)]
pub struct CompressedConfig {
    groups: Vec<(Vec<Target>, Scheme)>,
    ignore: Vec<Target>,
}

impl CompressedConfig {
    /// The folder's compressed-tensors config; None when config.json has none (or another method's).
    pub fn load(dir: &Path) -> anyhow::Result<Option<CompressedConfig>> {
        let path = dir.join("config.json");
        let Some(v) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("quantization_config").cloned())
        else {
            return Ok(None);
        };
        Self::parse(&v).map_err(|m| file_err(&path, m))
    }

    pub fn parse(v: &serde_json::Value) -> Result<Option<CompressedConfig>, String> {
        if v.get("quant_method").and_then(|m| m.as_str()) != Some("compressed-tensors") {
            return Ok(None);
        }
        let top_format = v.get("format").and_then(|f| f.as_str());
        let groups = v
            .get("config_groups")
            .and_then(|g| g.as_object())
            .ok_or("quantization_config has no config_groups object")?;
        let mut out = Vec::new();
        for (name, g) in groups {
            let what = format!("quantization_config.config_groups.{name}");
            let format = g.get("format").and_then(|f| f.as_str()).or(top_format);
            if format != Some("pack-quantized") {
                return Err(format!(
                    "{what}: format {format:?} is not supported (only \"pack-quantized\", llm-compressor's \
                     W{{2,3,4,8}}A16)"
                ));
            }
            if g.get("input_activations").is_some_and(|a| !a.is_null())
                || g.get("output_activations").is_some_and(|a| !a.is_null())
            {
                return Err(format!(
                    "{what} quantizes activations too; only weight-only schemes (W·A16) are supported"
                ));
            }
            let w = g
                .get("weights")
                .filter(|w| !w.is_null())
                .ok_or(format!("{what} has no weights scheme"))?;
            let field = |k: &str| w.get(k).filter(|x| !x.is_null());
            let bits = field("num_bits")
                .and_then(|b| b.as_u64())
                .ok_or(format!("{what}.weights has no integer num_bits"))?;
            if !matches!(bits, 2 | 3 | 4 | 8) {
                return Err(format!(
                    "{what}.weights.num_bits {bits} is not supported (2, 3, 4 or 8)"
                ));
            }
            if field("type").and_then(|t| t.as_str()) != Some("int") {
                return Err(format!(
                    "{what}.weights.type {:?} is not supported (only \"int\")",
                    field("type")
                ));
            }
            if field("dynamic").is_some_and(|d| d != &serde_json::Value::Bool(false)) {
                return Err(format!(
                    "{what}.weights.dynamic must be false (scales stored in the checkpoint)"
                ));
            }
            if let Some(a) = field("actorder").and_then(|a| a.as_str())
                && a != "weight"
            {
                return Err(format!(
                    "{what}.weights.actorder {a:?} keeps a group order in weight_g_idx, which is not \
                     supported (\"weight\" and none are: contiguous groups)"
                ));
            }
            let group_size = match field("strategy").and_then(|s| s.as_str()) {
                Some("channel") => None,
                Some("group") => {
                    let g = field("group_size")
                        .and_then(|g| g.as_u64())
                        .filter(|&g| g > 0)
                        .ok_or(format!(
                            "{what}.weights: strategy \"group\" needs a positive group_size"
                        ))?;
                    Some(g as usize)
                }
                s => {
                    return Err(format!(
                        "{what}.weights.strategy {s:?} is not supported (\"group\" or \"channel\")"
                    ));
                }
            };
            let sym = field("symmetric").and_then(|s| s.as_bool()).unwrap_or(true);
            let targets = g
                .get("targets")
                .and_then(|t| t.as_array())
                .ok_or(format!("{what} has no targets list"))?
                .iter()
                .map(|t| {
                    t.as_str()
                        .ok_or(format!("{what}: a target is not a string"))
                        .and_then(Target::parse)
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.push((
                targets,
                Scheme {
                    bits: bits as u32,
                    group_size,
                    sym,
                },
            ));
        }
        let ignore = match v.get("ignore").filter(|i| !i.is_null()) {
            None => Vec::new(),
            Some(i) => i
                .as_array()
                .ok_or("quantization_config.ignore is not a list")?
                .iter()
                .map(|t| {
                    t.as_str()
                        .ok_or_else(|| "quantization_config.ignore holds a non-string".to_string())
                        .and_then(Target::parse)
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        Ok(Some(CompressedConfig {
            groups: out,
            ignore,
        }))
    }

    /// The scheme the linear `name` is stored with, None when it is ignored or no group targets it. A
    /// group naming the module (by name or regex) wins over a class target, as compressed-tensors matches.
    pub fn scheme(&self, name: &str) -> Option<&Scheme> {
        if self.ignore.iter().any(|t| t.by_name(name)) {
            return None;
        }
        let named = self
            .groups
            .iter()
            .find(|(ts, _)| ts.iter().any(|t| t.by_name(name)));
        let class = || {
            self.groups
                .iter()
                .find(|(ts, _)| ts.iter().any(|t| matches!(t, Target::Linear)))
        };
        named.or_else(class).map(|(_, s)| s)
    }

    /// The first group's scheme, for `inspect`'s one-line summary.
    pub fn first(&self) -> Option<&Scheme> {
        self.groups.first().map(|(_, s)| s)
    }
}

impl Scheme {
    pub fn n_groups(&self, d_in: usize) -> usize {
        self.group_size.map_or(1, |g| d_in.div_ceil(g))
    }

    /// The tensors of one linear `prefix` and their shapes.
    pub fn tensor_shapes(&self, d_out: usize, d_in: usize) -> Vec<(&'static str, Vec<usize>)> {
        let ng = self.n_groups(d_in);
        let mut v = vec![
            ("weight_packed", vec![d_out, pack_words(d_in, self.bits)]),
            ("weight_scale", vec![d_out, ng]),
            ("weight_shape", vec![2]),
        ];
        if !self.sym {
            v.push(("weight_zero_point", vec![pack_words(d_out, self.bits), ng]));
        }
        v
    }
}

/// Loads the compressed linear `prefix` of a [d_out × d_in] layer as a packed linear, checking every shape
/// and dtype so a malformed checkpoint gives a one-line error.
pub fn load_linear(
    store: &WeightStore,
    dir: &Path,
    s: &Scheme,
    prefix: &str,
    d_out: usize,
    d_in: usize,
) -> anyhow::Result<PackedLinear> {
    for (suffix, shape) in s.tensor_shapes(d_out, d_in) {
        let name = format!("{prefix}.{suffix}");
        match store.entry(&name) {
            None => return Err(file_err(dir, format!("tensor {name} is missing"))),
            Some(e) if e.shape != shape => {
                return Err(file_err(
                    dir,
                    format!(
                        "tensor {name} has shape {:?}, expected {shape:?} for {} bits, d_in {d_in}, d_out \
                         {d_out}, group size {}",
                        e.shape,
                        s.bits,
                        s.group_size.map_or(-1, |g| g as i64)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    let (bits, ng) = (s.bits, s.n_groups(d_in));
    let kw = pack_words(d_in, bits);
    let packed = words(store, dir, &format!("{prefix}.weight_packed"))?;
    let mut qweight = vec![0u32; kw * d_out];
    for j in 0..d_out {
        for w in 0..kw {
            qweight[w * d_out + j] = packed[j * kw + w];
        }
    }
    let scales = store.f32(&format!("{prefix}.weight_scale"), &[d_out, ng])?;
    // [d_out × groups] → [groups × d_out], kept in f32: the packed GEMM dequantizes in f32, as
    // compressed-tensors does in the scale's dtype (an f32 model's scales are not f16 values, unlike GPTQ's).
    let scales: Vec<f32> = (0..ng * d_out)
        .map(|k| scales[(k % d_out) * ng + k / d_out])
        .collect();
    let zeros: Vec<f32> = if s.sym {
        vec![(1u32 << (bits - 1)) as f32; ng * d_out]
    } else {
        let zp = words(store, dir, &format!("{prefix}.weight_zero_point"))?;
        (0..ng)
            .flat_map(|g| unpack_stream(&zp[g..], ng, bits, 0, d_out))
            .map(f32::from)
            .collect()
    };
    let g = s.group_size.unwrap_or(d_in).max(1);
    let l = PackedLinear {
        d_out,
        d_in,
        bits,
        n_groups: ng,
        qweight,
        scales,
        zeros,
        g_idx: (0..d_in).map(|c| (c / g) as u32).collect(),
    };
    l.validate()
        .map_err(|m| file_err(dir, format!("{prefix}: {m}")))?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::{CompressedConfig, Scheme};

    #[test]
    fn schemes_follow_names_before_the_linear_class_and_ignore_wins() {
        let v = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                    "symmetric": true, "strategy": "group", "group_size": 128, "dynamic": false}},
                "group_1": {"targets": ["model.layers.0.mlp.down_proj", "re:.*self_attn\\.v_proj$"],
                    "weights": {"num_bits": 8, "type": "int", "symmetric": false, "strategy": "channel",
                    "dynamic": false}}
            },
            "ignore": ["lm_head", "re:.*mlp\\.gate$"]
        });
        let c = CompressedConfig::parse(&v).unwrap().unwrap();
        let four = Scheme {
            bits: 4,
            group_size: Some(128),
            sym: true,
        };
        let eight = Scheme {
            bits: 8,
            group_size: None,
            sym: false,
        };
        assert_eq!(c.scheme("model.layers.1.mlp.down_proj"), Some(&four));
        assert_eq!(c.scheme("model.layers.0.mlp.down_proj"), Some(&eight));
        assert_eq!(c.scheme("model.layers.5.self_attn.v_proj"), Some(&eight));
        assert_eq!(c.scheme("lm_head"), None);
        assert_eq!(c.scheme("model.layers.2.mlp.gate"), None);
        for bad in [
            serde_json::json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                "strategy": "channel"}}}}),
            serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                "strategy": "group", "group_size": 128, "actorder": "group"}}}}),
            serde_json::json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "input_activations": {"num_bits": 8},
                "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}}}}),
        ] {
            assert!(CompressedConfig::parse(&bad).is_err(), "{bad}");
        }
        let gptq = serde_json::json!({"quant_method": "gptq", "bits": 4});
        assert!(CompressedConfig::parse(&gptq).unwrap().is_none());
    }
}
