//! An MoE block whose experts do not fit the device at once (the memory plan's `expert_group`, or
//! `run --expert-group`) is quantized in passes: each pass holds one group of experts' weights and
//! statistics, forwards the calibration chunks through the router and those experts only, quantizes them,
//! packs them, and moves their Ŵ to the host before the next group comes. The last pass also quantizes
//! everything outside the routed experts (attention, the shared expert), so every pass's forward reads
//! their FP weights, as the one pass over all experts does. Each expert's statistics read only its routed
//! rows, which the router decides before any expert runs, so the passes compute the same values as one pass:
//! the output is the same, byte for byte (tests/transformers_parity.rs, `moe_experts_in_groups`).

use crate::model::arch::{BlockDesc, LinearDesc};

/// One pass over a block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pass {
    /// The routed experts [start, end) it holds; None: all of them (one pass, or a block without experts).
    pub experts: Option<(usize, usize)>,
    /// Whether it quantizes the linears outside the routed experts (the last pass).
    pub dense: bool,
}

impl Pass {
    /// Whether this pass quantizes linear `ld`.
    pub fn selects(&self, ld: &LinearDesc) -> bool {
        match (ld.expert, self.experts) {
            (None, _) => self.dense,
            (Some(_), None) => true,
            (Some(e), Some((a, b))) => (a..b).contains(&e),
        }
    }

    /// Which linears of `desc` (description order) it quantizes.
    pub fn selection(&self, desc: &BlockDesc) -> Vec<bool> {
        desc.linears.iter().map(|ld| self.selects(ld)).collect()
    }

    /// Which linears of `desc` its forward reads from the backend's memory: its experts and every linear
    /// outside the routed experts.
    pub fn holds(&self, desc: &BlockDesc) -> Vec<bool> {
        desc.linears
            .iter()
            .map(|ld| ld.expert.is_none() || self.selects(ld))
            .collect()
    }
}

impl std::fmt::Display for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.experts {
            Some((a, b)) => write!(f, "experts {a}–{}", b - 1),
            None => write!(f, "all linears"),
        }
    }
}

/// The passes over a block of `desc` holding at most `group` experts at once (None: all).
pub fn passes(desc: &BlockDesc, group: Option<usize>) -> Vec<Pass> {
    let n = desc.moe.as_ref().map_or(0, |m| m.n_experts);
    match group {
        Some(g) if n > 0 && g < n => {
            let g = g.max(1);
            (0..n)
                .step_by(g)
                .map(|a| Pass {
                    experts: Some((a, (a + g).min(n))),
                    dense: a + g >= n,
                })
                .collect()
        }
        _ => vec![Pass {
            experts: None,
            dense: true,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Config;

    fn moe(extra: &str) -> Config {
        Config::parse(&format!(
            r#"{{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
                "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 5, "num_experts_per_tok": 2,
                "moe_intermediate_size": 32{extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn every_linear_is_quantized_by_exactly_one_pass() {
        let cfg = moe(r#", "shared_expert_intermediate_size": 96"#);
        for group in [None, Some(1), Some(2), Some(4), Some(5), Some(8)] {
            let p = passes(&cfg.block, group);
            let want = match group {
                Some(g) if g < 5 => 5usize.div_ceil(g),
                _ => 1,
            };
            assert_eq!(p.len(), want, "{group:?}: {p:?}");
            // The last pass quantizes attention and the shared expert, after every group's statistics.
            let (last, rest) = p.split_last().unwrap();
            assert!(last.dense && rest.iter().all(|p| !p.dense));
            for ld in &cfg.block.linears {
                let n = p.iter().filter(|p| p.selects(ld)).count();
                assert_eq!(n, 1, "{} under {group:?}", ld.name);
            }
            // Every pass's forward holds the linears outside the experts (attention, shared expert).
            for q in &p {
                let holds = q.holds(&cfg.block);
                for (ld, h) in cfg.block.linears.iter().zip(holds) {
                    assert_eq!(h, ld.expert.is_none() || q.selects(ld), "{}", ld.name);
                }
            }
            // Groups hold at most `group` experts.
            for q in &p {
                if let (Some((a, b)), Some(g)) = (q.experts, group) {
                    assert!(b > a && b - a <= g, "{q:?}");
                }
            }
        }
    }

    #[test]
    fn a_dense_block_is_one_pass() {
        let cfg = crate::pipeline::quantize_block::tests::config(
            r#""architectures": ["LlamaForCausalLM"]"#,
        );
        assert_eq!(
            passes(&cfg.block, Some(1)),
            vec![Pass {
                experts: None,
                dense: true
            }]
        );
    }
}
