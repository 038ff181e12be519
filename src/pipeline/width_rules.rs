//! Which width each quantized module has, as a checkpoint's config states it: every linear by name, and
//! the rules of GPTQ's `dynamic` (GPTQModel's per-module overrides, which vLLM and `boa-cuda eval` read too).

use super::report::LayerReport;
use crate::model::arch::Input;
use crate::model::config::Config;
use crate::pipeline::options::LayerSet;

/// Each quantized linear's module name ("model.layers.3.mlp.up_proj") and bit width.
pub(super) fn linear_bits(reports: &[LayerReport]) -> impl Iterator<Item = (String, u32)> + '_ {
    reports.iter().flat_map(|r| {
        r.linears
            .iter()
            .map(move |x| (format!("model.layers.{}.{}", r.layer, x.name), x.bits))
    })
}

/// The (regex, width) rules of GPTQ's `dynamic` (`gptq_packed::dynamic_bits` anchors each): one per linear,
/// but one per block and part for routed experts that share a width (`experts\.\d+\.down_proj`: a 128-expert
/// model would otherwise have thousands of rules, each tried against every module), then the fused layers
/// vLLM matches its rules against (`vllm_fused`).
pub(super) fn dynamic_rules(cfg: &Config, reports: &[LayerReport]) -> Vec<(String, u32)> {
    let mut rules = Vec::new();
    for r in reports {
        let layer = format!("model.layers.{}.", r.layer);
        let mut collapsed: Vec<String> = Vec::new();
        for (ld, x) in cfg.block.linears.iter().zip(&r.linears) {
            let exact = || regex::escape(&format!("{layer}{}", x.name));
            let Some((before, after)) = ld.expert.and_then(|e| split_expert(&x.name, e)) else {
                rules.push((exact(), x.bits));
                continue;
            };
            let pattern = format!(
                "{}\\d+{}",
                regex::escape(&format!("{layer}{before}")),
                regex::escape(after)
            );
            let shared = cfg
                .block
                .linears
                .iter()
                .zip(&r.linears)
                .filter(|(l, _)| l.expert.is_some() && l.role == ld.role)
                .all(|(_, y)| y.bits == x.bits);
            if !shared {
                rules.push((exact(), x.bits));
            } else if !collapsed.contains(&pattern) {
                collapsed.push(pattern.clone());
                rules.push((pattern, x.bits));
            }
        }
    }
    rules.extend(vllm_fused(cfg, reports).map(|(name, bits)| (regex::escape(&name), bits)));
    rules
}

/// The prefix of each block left unquantized (outside --layers), a regex: `model\.layers\.5\.`.
pub(super) fn unquantized_blocks(cfg: &Config, layers: &LayerSet) -> Vec<String> {
    (0..cfg.n_layers)
        .filter(|&l| !layers.contains(l))
        .map(|l| regex::escape(&format!("model.layers.{l}.")))
        .collect()
}

/// GPTQ's `modules_in_block_to_quantize`, which transformers (through optimum 2.3) reads to choose the
/// Linears it replaces by quantized ones: without it every Linear of a block is replaced, and one we keep
/// unquantized (Qwen2-MoE's `shared_expert_gate`, a block outside --layers) loads as garbage codes.
/// optimum keeps a module when its full name ends with a listed name: the linears' names within a block
/// when every block is quantized, else each quantized linear's full name. GPTQModel reads `dynamic` instead.
pub(super) fn modules_in_block_to_quantize(cfg: &Config, layers: &LayerSet) -> serde_json::Value {
    let names = |prefix: &str| -> Vec<String> {
        cfg.block
            .linears
            .iter()
            .map(|d| format!("{prefix}{}", d.name))
            .collect()
    };
    if (0..cfg.n_layers).all(|l| layers.contains(l)) {
        serde_json::json!([names("")])
    } else {
        let per_block: Vec<Vec<String>> = (0..cfg.n_layers)
            .filter(|&l| layers.contains(l))
            .map(|l| names(&format!("model.layers.{l}.")))
            .collect();
        serde_json::json!(per_block)
    }
}

/// A routed expert's linear name split around its index: "mlp.experts.3.gate_proj" → ("mlp.experts.",
/// ".gate_proj").
fn split_expert(name: &str, expert: usize) -> Option<(&str, &str)> {
    let mid = format!(".{expert}.");
    let at = name.find(&mid)?;
    Some((&name[..at + 1], &name[at + mid.len() - 1..]))
}

/// vLLM runs the linears that read one input as one fused layer beside them in the module tree (q/k/v as
/// `qkv_proj`, gate/up as `gate_up_proj`, a block's routed experts as one `FusedMoE` named by their parent,
/// e.g. `mlp.experts`) and matches GPTQ's `dynamic` rules against that name only: one more (name, bits) for
/// each such set whose parts share a width (`--alloc-unit fused` makes them share).
pub(super) fn vllm_fused<'a>(
    cfg: &'a Config,
    reports: &'a [LayerReport],
) -> impl Iterator<Item = (String, u32)> + 'a {
    reports.iter().flat_map(move |r| {
        let linears = || cfg.block.linears.iter().zip(&r.linears);
        let sets = [(Input::Attn, "qkv_proj"), (Input::Mlp, "gate_up_proj")]
            .into_iter()
            .filter_map(move |(input, fused)| {
                let parts: Vec<_> = linears()
                    .filter(|(ld, _)| ld.input() == input)
                    .map(|(_, x)| x)
                    .collect();
                let first = parts.first()?;
                let parent = first.name.rsplit_once('.')?.0;
                (parts.len() > 1 && parts.iter().all(|x| x.bits == first.bits)).then(|| {
                    (
                        format!("model.layers.{}.{parent}.{fused}", r.layer),
                        first.bits,
                    )
                })
            });
        let experts: Vec<_> = linears().filter(|(ld, _)| ld.expert.is_some()).collect();
        let moe = experts.first().and_then(|&(ld, x)| {
            let (before, _) = split_expert(&x.name, ld.expert?)?;
            experts.iter().all(|(_, y)| y.bits == x.bits).then(|| {
                (
                    format!("model.layers.{}.{}", r.layer, before.trim_end_matches('.')),
                    x.bits,
                )
            })
        });
        sets.chain(moe)
    })
}

#[cfg(test)]
mod tests {
    use super::split_expert;

    #[test]
    fn an_expert_name_splits_around_its_index_only() {
        assert_eq!(
            split_expert("mlp.experts.3.gate_proj", 3),
            Some(("mlp.experts.", ".gate_proj"))
        );
        assert_eq!(
            split_expert("block_sparse_moe.experts.13.w1", 13),
            Some(("block_sparse_moe.experts.", ".w1"))
        );
        // "13" holds "3", but not ".3.".
        assert_eq!(split_expert("block_sparse_moe.experts.13.w1", 3), None);
    }
}
