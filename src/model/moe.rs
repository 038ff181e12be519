//! The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral, Qwen2-MoE): route each token to its top-k experts,
//! run each expert's SwiGLU on the rows routed to it, and add the outputs weighted by the router's
//! probabilities; where the block has a shared expert (Qwen2-MoE), add its SwiGLU on every token, scaled by
//! sigmoid(w_g · x).
//!
//! Routing (a softmax over [m × n_experts] logits and a top-k) and the shared expert's sigmoid run on the
//! host, on the logits alone; everything of size m × d runs on the backend: the router and gate products, the
//! gather of each expert's rows (`embed_t` on the block's input), the experts' linears and activations (on each
//! linear's resident copy where it has one, so the quantized forward reads Ŵ where the quantizer left it) and
//! the weighted scatter-add of their outputs (`scatter_add_rows_t`). On a GPU the host sends O(m · top_k) row
//! indices and weights and reads O(m · n_experts) logits per block, never the activations.
//! The sums follow transformers' order (experts in ascending index, each adding into the output, then the
//! gated shared expert), so the f32 results agree closely.

use super::arch::{LinearDesc, MoeDesc, Role};
use crate::backend::{Backend, Tensor, Weight};
use anyhow::{Context, Result};

/// One expert's share of a block forward, kept for its statistics.
#[derive(Default)]
pub struct ExpertTrace {
    /// The MLP input's rows routed to the expert [n × d].
    pub x: Tensor,
    /// Its activation (down_proj's input) on them [n × d_expert].
    pub act: Tensor,
    /// Each routed row's router probability (after the top-k renormalization).
    pub weights: Vec<f32>,
}

/// For each expert, the (token, probability) pairs routed to it, tokens ascending.
pub fn route(
    logits: &[f32],
    n_experts: usize,
    top_k: usize,
    renormalize: bool,
) -> Vec<Vec<(usize, f32)>> {
    let mut routed = vec![Vec::new(); n_experts];
    let mut p = vec![0f32; n_experts];
    let mut order: Vec<usize> = (0..n_experts).collect();
    for (tok, row) in logits.chunks_exact(n_experts).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (pi, &z) in p.iter_mut().zip(row) {
            *pi = (z - max).exp();
            sum += *pi;
        }
        p.iter_mut().for_each(|v| *v /= sum);
        // Largest first; ties to the lower index (a stable sort from index order).
        order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        let top = &order[..top_k];
        let norm = match renormalize {
            true => top.iter().map(|&e| p[e]).sum::<f32>(),
            false => 1.0,
        };
        for &e in top {
            routed[e].push((tok, p[e] / norm));
        }
    }
    routed
}

/// An MoE MLP's output and, when traced, what its statistics read.
pub struct SparseMlp {
    /// [m × d].
    pub y: Tensor,
    /// Each expert's routed inputs, by expert (empty unless traced).
    pub experts: Vec<ExpertTrace>,
    /// The shared expert's activation (its down_proj's input) on every token [m × d_shared], when traced.
    pub shared_act: Option<Tensor>,
}

/// What an MoE MLP runs besides its linears: the router [n_experts × d] and the shared expert's gate w_g
/// [1 × d] where the block has one (high-precision weights), and what every down_proj's input goes through
/// first (R4's online transform, model/online.rs; the identity without).
#[derive(Clone, Copy)]
pub struct MoeGates<'a> {
    pub router: &'a [f32],
    pub shared: Option<&'a [f32]>,
    pub before_down: &'a dyn Fn(Tensor) -> Result<Tensor>,
}

/// The MLP of an MoE block on its input `xm` [m × d]: Σ_k p_k · down_k(silu(gate_k x) ⊙ up_k x) per token
/// (+ sigmoid(w_g · x) · shared(x) where the block has a shared expert), and, with `trace`, what the
/// statistics read. `linears` is the block's description; `lin(i, x, n)` runs its linear i on n rows (the
/// block forward's own, on the resident copy). With `only`, the experts outside it are skipped (a statistics
/// pass over one group of experts: `BlockTrace::experts_only`), so `y` lacks their share.
#[allow(clippy::too_many_arguments)]
pub fn sparse_mlp(
    be: &dyn Backend,
    linears: &[LinearDesc],
    gates: MoeGates<'_>,
    lin: &dyn Fn(usize, &Tensor, usize) -> Result<Tensor>,
    moe: &MoeDesc,
    xm: &Tensor,
    m: usize,
    trace: bool,
    only: Option<std::ops::Range<usize>>,
) -> Result<SparseMlp> {
    let router = gates.router;
    let d = router.len() / moe.n_experts;
    anyhow::ensure!(xm.len() == m * d, "sparse_mlp: x is not [m={m} × d={d}]");
    // Each expert's gate, up and down in the description, and the shared expert's (no expert).
    let mut idx = vec![[usize::MAX; 3]; moe.n_experts];
    let mut shared_idx = [usize::MAX; 3];
    for (i, ld) in linears.iter().enumerate() {
        let slot = match ld.role {
            Role::Gate => 0,
            Role::Up => 1,
            Role::Down => 2,
            _ => continue,
        };
        match ld.expert {
            Some(e) => idx[e][slot] = i,
            None => shared_idx[slot] = i,
        }
    }
    // The shared expert first, as transformers runs it: (σ(w_g · x) per token, its output, its activation).
    let shared = match (&moe.shared_expert, gates.shared) {
        (None, _) => None,
        (Some(_), None) => anyhow::bail!("the block has no shared_expert_gate weight"),
        (Some(_), Some(w_g)) => {
            anyhow::ensure!(
                shared_idx.iter().all(|&i| i < linears.len()) && w_g.len() == d,
                "the shared expert lacks a gate, up or down linear, or its gate weight is not [1 × {d}]"
            );
            let lin = |slot: usize, x: &Tensor| {
                let i = shared_idx[slot];
                lin(i, x, m).with_context(|| format!("forward of {}", linears[i].name))
            };
            let gate = lin(0, xm)?;
            let up = lin(1, xm)?;
            let act = (gates.before_down)(be.swiglu_t(&gate, &up)?)?;
            drop((gate, up));
            let y = lin(2, &act)?;
            let z = be.linear_t(xm, Weight::host(w_g), None, m, d, 1)?;
            let s: Vec<f32> = be
                .read(&z)?
                .iter()
                .map(|&z| 1.0 / (1.0 + (-z).exp()))
                .collect();
            Some((s, y, act))
        }
    };
    // Only the router's logits [m × n_experts] come to the host; the rows stay where the backend computes.
    let logits = be.linear_t(xm, Weight::host(router), None, m, d, moe.n_experts)?;
    let routed = route(
        &be.read(&logits)?,
        moe.n_experts,
        moe.top_k,
        moe.renormalize,
    );
    let mut out = be.zeros(m * d)?;
    let mut traces = Vec::with_capacity(if trace { moe.n_experts } else { 0 });
    for (e, routes) in routed.iter().enumerate() {
        if routes.is_empty() || only.as_ref().is_some_and(|r| !r.contains(&e)) {
            if trace {
                traces.push(ExpertTrace::default());
            }
            continue;
        }
        anyhow::ensure!(
            idx[e].iter().all(|&i| i < linears.len()),
            "expert {e} lacks a gate, up or down linear"
        );
        let n = routes.len();
        let rows: Vec<u32> = routes.iter().map(|&(tok, _)| tok as u32).collect();
        let weights: Vec<f32> = routes.iter().map(|&(_, p)| p).collect();
        // A gather of xm's rows (the embedding gather's op, unscaled).
        let xe = be.embed_t(xm, &rows, d, 1.0)?;
        let lin = |slot: usize, x: &Tensor| {
            let i = idx[e][slot];
            lin(i, x, n).with_context(|| format!("forward of {}", linears[i].name))
        };
        let gate = lin(0, &xe)?;
        let up = lin(1, &xe)?;
        let act = (gates.before_down)(be.swiglu_t(&gate, &up)?)?;
        drop((gate, up));
        let y = lin(2, &act)?;
        be.scatter_add_rows_t(&mut out, &y, d, &rows, &weights)?;
        if trace {
            traces.push(ExpertTrace {
                x: xe,
                act,
                weights,
            });
        }
    }
    let shared_act = match shared {
        Some((s, y, act)) => {
            let all: Vec<u32> = (0..m as u32).collect();
            be.scatter_add_rows_t(&mut out, &y, d, &all, &s)?;
            trace.then_some(act)
        }
        None => None,
    };
    Ok(SparseMlp {
        y: out,
        experts: traces,
        shared_act,
    })
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routes_each_token_to_its_top_k_with_renormalized_probabilities() {
        // Two tokens over three experts.
        let logits = [0.0, 1.0, 2.0, 3.0, 0.0, 0.0];
        let r = route(&logits, 3, 2, true);
        assert!(r[0].iter().map(|&(t, _)| t).eq([1]));
        assert!(r[1].iter().map(|&(t, _)| t).eq([0, 1]));
        assert!(r[2].iter().map(|&(t, _)| t).eq([0]));
        let (p1, p2) = (r[1][0].1, r[2][0].1);
        assert!((p1 + p2 - 1.0).abs() < 1e-6 && (p2 / p1 - 1f32.exp()).abs() < 1e-5);
        // Without renormalization the kept probabilities are the softmax's own.
        let r = route(&logits, 3, 2, false);
        let z: f32 = [0f32, 1.0, 2.0].iter().map(|v| v.exp()).sum();
        assert!((r[2][0].1 - 2f32.exp() / z).abs() < 1e-6);
    }
}
