//! Bit allocation (issue 23 part 2): the bit width of each linear of a block that minimises the block's
//! predicted output error Σ_ℓ e_ℓ(b_ℓ) under an average, Σ_ℓ n_ℓ b_ℓ ≤ avg · Σ_ℓ n_ℓ (n_ℓ the linear's
//! weights). e_ℓ(b) is what the caller predicts, e.g. tr(ΔW_b H ΔW_bᵀ) of min-max RTN at b bits on the
//! linear's input covariance: rate follows the Hessian where the error falls fastest per stored bit.
//!
//! A block has few allocation units (a dense block's 7 linears; an MoE block's attention, shared expert and
//! routed experts by part, at most 10), so the optimum is found exactly by enumerating every assignment
//! (|choices|^L ≤ `MAX_ASSIGNMENTS`); more are refused by the caller's check.

/// The most assignments `allocate` enumerates (4 widths over 8 linears).
pub const MAX_ASSIGNMENTS: usize = 1 << 16;

/// How many assignments of `widths` widths to `linears` linears `allocate` enumerates; None above
/// `MAX_ASSIGNMENTS`.
pub fn assignments(widths: usize, linears: usize) -> Option<usize> {
    (0..linears).try_fold(1usize, |a, _| {
        a.checked_mul(widths).filter(|&n| n <= MAX_ASSIGNMENTS)
    })
}

/// Per linear: its weight count and its predicted error at each of `choices` (ascending bit widths).
#[derive(Clone, Debug)]
pub struct Candidate {
    pub weights: usize,
    pub errors: Vec<f64>,
}

/// The candidates of linears that must share one width merged into one each: `unit[i]` is linear i's unit
/// (units numbered 0.. with none skipped); a unit's weights and errors are its linears' sums (each error was
/// predicted with the other linears unquantized, so the sum takes them as adding up).
pub fn merge_units(cands: &[Candidate], unit: &[usize]) -> Vec<Candidate> {
    let n = unit.iter().map(|&u| u + 1).max().unwrap_or(0);
    let k = cands.first().map_or(0, |c| c.errors.len());
    let mut out = vec![
        Candidate {
            weights: 0,
            errors: vec![0.0; k],
        };
        n
    ];
    for (c, &u) in cands.iter().zip(unit) {
        out[u].weights += c.weights;
        for (e, &x) in out[u].errors.iter_mut().zip(&c.errors) {
            *e += x;
        }
    }
    out
}

/// The index into `choices` of each candidate's width, minimising the summed error under the average
/// (ties: fewer bits). Err when even the narrowest widths exceed the budget or the search is too large.
pub fn allocate(choices: &[u32], cands: &[Candidate], avg_bits: f64) -> Result<Vec<usize>, String> {
    let k = choices.len();
    if k == 0 || cands.iter().any(|c| c.errors.len() != k) {
        return Err("bit allocation: every linear needs one predicted error per width".into());
    }
    let Some(total) = assignments(k, cands.len()) else {
        return Err(format!(
            "bit allocation over {} linears × {k} widths is more than {MAX_ASSIGNMENTS} assignments",
            cands.len()
        ));
    };
    let n: usize = cands.iter().map(|c| c.weights).sum();
    // Integer budget in weight-bits, so an average met exactly (3.0 over widths 2..4) is never lost to
    // rounding.
    let budget = (avg_bits * n as f64 + 1e-9 * n as f64).floor() as u128;
    let mut best: Option<(f64, u128, Vec<usize>)> = None;
    let mut pick = vec![0usize; cands.len()];
    for mut code in 0..total {
        for p in pick.iter_mut() {
            *p = code % k;
            code /= k;
        }
        let cost: u128 = cands
            .iter()
            .zip(&pick)
            .map(|(c, &i)| c.weights as u128 * choices[i] as u128)
            .sum();
        if cost > budget {
            continue;
        }
        let err: f64 = cands.iter().zip(&pick).map(|(c, &i)| c.errors[i]).sum();
        let better = match &best {
            None => true,
            Some((e, c, _)) => err < *e || (err == *e && cost < *c),
        };
        if better {
            best = Some((err, cost, pick.clone()));
        }
    }
    best.map(|(_, _, p)| p).ok_or_else(|| {
        format!(
            "an average of {avg_bits} bits is below the narrowest width {} bits",
            choices[0]
        )
    })
}

/// Each linear's pick from its unit's (`merge_units`' `unit`).
pub fn spread_units(picks: &[usize], unit: &[usize]) -> Vec<usize> {
    unit.iter().map(|&u| picks[u]).collect()
}

/// The widths of every block's linears under one average over all of them (`run --alloc-scope model`).
/// Each block's predicted errors are divided by their sum at the middle width: the units of a block's output
/// grow with depth (the residual stream's norm), and in absolute units the last blocks would take every
/// bit; so normalized, blocks trade bits by how fast their errors fall, each counting as much as the others
/// at the middle width. Then the Lagrangian relaxation min Σ e_ℓ(b_ℓ) + λ n_ℓ b_ℓ, λ bisected to the
/// budget, and moves of one width step (one linear up into budget left, or one up and another down) while
/// one lowers the error. Not exact, but polynomial in the linears, which a model has hundreds of (an
/// exhaustive search is |choices|^hundreds). Err as `allocate`.
pub fn allocate_model(
    choices: &[u32],
    blocks: &[Vec<Candidate>],
    avg_bits: f64,
) -> Result<Vec<Vec<usize>>, String> {
    let k = choices.len();
    if k == 0 || blocks.iter().flatten().any(|c| c.errors.len() != k) {
        return Err("bit allocation: every linear needs one predicted error per width".into());
    }
    let mid = k / 2;
    let mut items: Vec<(u128, Vec<f64>)> = Vec::new();
    for b in blocks {
        let scale: f64 = b.iter().map(|c| c.errors[mid]).sum();
        let scale = if scale.is_finite() && scale > 0.0 {
            scale
        } else {
            1.0
        };
        items.extend(b.iter().map(|c| {
            (
                c.weights as u128,
                c.errors.iter().map(|e| e / scale).collect(),
            )
        }));
    }
    let n: u128 = items.iter().map(|(w, _)| w).sum();
    let budget = (avg_bits * n as f64 + 1e-9 * n as f64).floor() as u128;
    let cost = |p: &[usize]| -> u128 {
        items
            .iter()
            .zip(p)
            .map(|((w, _), &i)| w * choices[i] as u128)
            .sum()
    };
    let pick = |lambda: f64| -> Vec<usize> {
        items
            .iter()
            .map(|(w, e)| {
                let price = |i: usize| e[i] + lambda * *w as f64 * choices[i] as f64;
                // Ties to the narrower width.
                (1..k).fold(0, |best, i| if price(i) < price(best) { i } else { best })
            })
            .collect()
    };
    let narrowest = vec![0; items.len()];
    if cost(&narrowest) > budget {
        return Err(format!(
            "an average of {avg_bits} bits is below the narrowest width {} bits",
            choices[0]
        ));
    }
    // The smallest λ (on a log scale) whose widths fit: λ → ∞ gives the narrowest, which fit.
    let (mut lo, mut hi) = (1e-30f64, 1e30f64);
    let mut p = if cost(&pick(hi)) <= budget {
        pick(hi)
    } else {
        narrowest
    };
    for _ in 0..200 {
        let mid = (lo * hi).sqrt();
        let q = pick(mid);
        if cost(&q) <= budget {
            hi = mid;
            p = q;
        } else {
            lo = mid;
        }
    }
    // A width step of linear j: its weight-bits and its error change.
    let up = |j: usize, i: usize| {
        let (w, e) = &items[j];
        (w * (choices[i + 1] - choices[i]) as u128, e[i + 1] - e[i])
    };
    let mut spent = cost(&p);
    // Then, while one exists, the best move of one step: one linear up where the budget allows, or one up and
    // another down (the relaxation's gaps), the error falling most.
    for _ in 0..10 * items.len() + 10 {
        let mut best: Option<(f64, usize, Option<usize>)> = None;
        for j in (0..items.len()).filter(|&j| p[j] + 1 < k) {
            let (extra, de) = up(j, p[j]);
            if spent + extra <= budget && de < 0.0 && best.is_none_or(|(b, ..)| de < b) {
                best = Some((de, j, None));
            }
            for i in (0..items.len()).filter(|&i| i != j && p[i] > 0) {
                // Down one step: the error rises by what the step up from there lowers it.
                let (freed, fall) = up(i, p[i] - 1);
                let delta = de - fall;
                if spent + extra <= budget + freed
                    && delta < 0.0
                    && best.is_none_or(|(b, ..)| delta < b)
                {
                    best = Some((delta, j, Some(i)));
                }
            }
        }
        let Some((_, j, down)) = best else { break };
        spent += up(j, p[j]).0;
        p[j] += 1;
        if let Some(i) = down {
            p[i] -= 1;
            spent -= up(i, p[i]).0;
        }
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut rest = &p[..];
    for b in blocks {
        let (head, tail) = rest.split_at(b.len());
        out.push(head.to_vec());
        rest = tail;
    }
    Ok(out)
}

/// The average bit width of an allocation, weighted by weight counts.
pub fn average_bits(choices: &[u32], cands: &[Candidate], pick: &[usize]) -> f64 {
    let n: usize = cands.iter().map(|c| c.weights).sum();
    let bits: f64 = cands
        .iter()
        .zip(pick)
        .map(|(c, &i)| c.weights as f64 * choices[i] as f64)
        .sum();
    bits / n.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(weights: usize, errors: &[f64]) -> Candidate {
        Candidate {
            weights,
            errors: errors.to_vec(),
        }
    }

    #[test]
    fn the_sensitive_linear_gets_the_bits() {
        let choices = [2, 3, 4];
        // Same size; the second loses far more per bit removed.
        let c = [
            cand(100, &[4.0, 2.0, 1.0]),
            cand(100, &[400.0, 100.0, 25.0]),
        ];
        assert_eq!(allocate(&choices, &c, 3.0).unwrap(), vec![0, 2]);
        assert_eq!(allocate(&choices, &c, 2.5).unwrap(), vec![0, 1]);
        assert_eq!(allocate(&choices, &c, 2.0).unwrap(), vec![0, 0]);
        assert!(allocate(&choices, &c, 1.9).is_err());
    }

    #[test]
    fn weights_price_the_bits_and_the_budget_holds() {
        let choices = [2, 3, 4];
        // The big linear would gain more in total, but a bit on it costs 9× the budget; two small ones at
        // 3 bits (2 + 2) beat one at 4 (0.5 + 8) for the same 200 weight-bits.
        let c = [
            cand(900, &[10.0, 5.0, 2.5]),
            cand(100, &[8.0, 2.0, 0.5]),
            cand(100, &[8.0, 2.0, 0.5]),
        ];
        let p = allocate(&choices, &c, 2.2).unwrap();
        assert_eq!(p, vec![0, 1, 1]);
        assert!(average_bits(&choices, &c, &p) <= 2.2);
    }

    #[test]
    fn model_scope_trades_bits_between_blocks_by_their_curves() {
        let choices = [2, 3, 4];
        // Block 0's errors are 1000× block 1's in absolute units, but block 1's fall 16× per bit and block
        // 0's 1.5×: normalized, the bits go to block 1.
        let blocks = vec![
            vec![cand(100, &[2250.0, 1500.0, 1000.0]); 2],
            vec![cand(100, &[16.0, 1.0, 0.0625]); 2],
        ];
        let p = allocate_model(&choices, &blocks, 3.0).unwrap();
        assert_eq!(p, vec![vec![0, 0], vec![2, 2]]);
        let flat: Vec<Candidate> = blocks.into_iter().flatten().collect();
        let pf: Vec<usize> = p.concat();
        assert_eq!(average_bits(&choices, &flat, &pf), 3.0);
        assert!(allocate_model(&choices, &[flat], 1.9).is_err());
    }

    #[test]
    fn model_scope_on_one_block_is_near_the_exhaustive_optimum() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let choices = [2, 3, 4];
        let (mut worst, mut over) = (1f64, 0);
        for _ in 0..200 {
            let c: Vec<Candidate> = (0..7)
                .map(|_| {
                    let base: f64 = rng.random_range(0.1..10.0);
                    let slope: f64 = rng.random_range(2.0..6.0);
                    let w = rng.random_range(100..1000);
                    cand(w, &[base * slope * slope, base * slope, base])
                })
                .collect();
            let avg = rng.random_range(2.0..4.0);
            let exact = allocate(&choices, &c, avg).unwrap();
            let p = allocate_model(&choices, std::slice::from_ref(&c), avg).unwrap();
            assert!(average_bits(&choices, &c, &p[0]) <= avg + 1e-12);
            let err = |p: &[usize]| -> f64 { c.iter().zip(p).map(|(c, &i)| c.errors[i]).sum() };
            let ratio = err(&p[0]) / err(&exact);
            assert!(
                ratio >= 1.0 - 1e-12,
                "better than the exhaustive optimum: {ratio}"
            );
            worst = worst.max(ratio);
            over += usize::from(ratio > 1.0 + 1e-12);
        }
        // The relaxation and its one-step moves miss the optimum at times (seen: 8 of 200, by at most 9.8%).
        println!("model scope vs exhaustive on one block: {over} of 200 above, worst {worst:.3}");
        assert!(worst < 1.15, "worst {worst}");
    }

    #[test]
    fn exhaustive_matches_a_brute_force_on_random_blocks() {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let choices = [2, 3, 4, 8];
        for _ in 0..50 {
            let c: Vec<Candidate> = (0..5)
                .map(|_| {
                    let base: f64 = rng.random_range(0.1..10.0);
                    let w = rng.random_range(1..1000);
                    cand(w, &[base * 16.0, base * 4.0, base, base / 256.0])
                })
                .collect();
            let avg = rng.random_range(2.0..5.0);
            let p = allocate(&choices, &c, avg).unwrap();
            let err = |p: &[usize]| -> f64 { c.iter().zip(p).map(|(c, &i)| c.errors[i]).sum() };
            // Every single-linear change that stays in budget is no better.
            for l in 0..c.len() {
                for i in 0..choices.len() {
                    let mut q = p.clone();
                    q[l] = i;
                    if average_bits(&choices, &c, &q) <= avg {
                        assert!(err(&q) >= err(&p));
                    }
                }
            }
            assert!(average_bits(&choices, &c, &p) <= avg + 1e-12);
        }
    }

    #[test]
    fn merged_units_give_the_best_assignment_with_shared_widths() {
        let choices = [2, 3, 4];
        // q/k/v (units 0), o (1), gate/up (2), down (3): alone, k would take 4 bits and q 2.
        let c = [
            cand(576 * 576, &[9.0, 3.0, 1.0]),
            cand(192 * 576, &[80.0, 20.0, 5.0]),
            cand(192 * 576, &[40.0, 10.0, 2.0]),
            cand(576 * 576, &[6.0, 2.0, 1.0]),
            cand(1536 * 576, &[12.0, 4.0, 2.0]),
            cand(1536 * 576, &[12.0, 4.0, 2.0]),
            cand(1536 * 576, &[30.0, 8.0, 2.0]),
        ];
        let unit = [0, 0, 0, 1, 2, 2, 3];
        let alone = allocate(&choices, &c, 2.5).unwrap();
        assert_ne!(
            alone[0], alone[1],
            "the example must split q from k when untied"
        );
        let merged = merge_units(&c, &unit);
        assert_eq!(merged[0].weights, 576 * 576 + 2 * 192 * 576);
        assert_eq!(merged[2].errors, vec![24.0, 8.0, 4.0]);
        let p = spread_units(&allocate(&choices, &merged, 2.5).unwrap(), &unit);
        assert!(average_bits(&choices, &c, &p) <= 2.5);
        // Brute force over the assignments whose tied linears share a width.
        let err = |p: &[usize]| -> f64 { c.iter().zip(p).map(|(c, &i)| c.errors[i]).sum() };
        let mut best = f64::INFINITY;
        for code in 0..81usize {
            let u: Vec<usize> = (0..4).map(|j| code / 3usize.pow(j) % 3).collect();
            let q = spread_units(&u, &unit);
            if average_bits(&choices, &c, &q) <= 2.5 {
                best = best.min(err(&q));
            }
        }
        assert_eq!(err(&p), best);
        assert!(err(&alone) <= best);
        for (i, &u) in unit.iter().enumerate() {
            assert_eq!(p[i], p[unit.iter().position(|&v| v == u).unwrap()]);
        }
    }

    #[test]
    fn too_many_linears_is_refused() {
        let c: Vec<Candidate> = (0..20).map(|_| cand(1, &[1.0, 0.5, 0.2])).collect();
        assert!(allocate(&[2, 3, 4], &c, 3.0).is_err());
    }
}
