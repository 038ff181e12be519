//! The plan of a sweep (design.md §4.2): dead inputs, the act-order permutation, damping with bounded retries
//! and U = chol(H⁻¹)ᵀ, for one Hessian or a batch of them (V's per-head H_col, every head's H_row). The
//! matrices stay where the backend keeps them; only their diagonals come to the host (the act-order sort, the
//! damping amount and the dead inputs are O(n) decisions).

use crate::ops::{Mat, QuantOps, Result};
use std::sync::Arc;

/// How a Hessian is made invertible (design.md §4.2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Damping {
    /// λ of H += λ·mean(diag H)·I, added again for each failed factorization.
    pub damp: f64,
    pub max_tries: usize,
    /// The value given to H_ii for a dead input (H_ii = 0).
    pub dead_diag: f64,
}

/// A planned Hessian (or batch): everything a sweep needs besides W.
pub struct Plan {
    pub n: usize,
    /// Per matrix: the sweep order of the columns (act-order, else the identity) and its inverse.
    pub perm: Vec<Vec<usize>>,
    pub inv: Vec<Vec<usize>>,
    /// Per matrix: the dead inputs (H_ii = 0, original order), whose columns of W are zeroed.
    pub dead: Vec<Vec<usize>>,
    /// Per matrix: everything damping added to the diagonal (λ of tr(ΔW H ΔWᵀ) = loss − λ‖ΔW‖²).
    pub damp: Vec<f64>,
    /// Damped H in sweep order [batch × n × n] (the scale searches score with it), and its U.
    pub h_p: Mat,
    pub u: Mat,
}

impl Plan {
    pub fn batch(&self) -> usize {
        self.perm.len()
    }
}

/// Plans every matrix of `h` [batch × n × n] (undamped, untouched): H_ii = opts.dead_diag for dead inputs,
/// columns by descending diag(H) when `act_order` (gptq.py's argsort of the diagonal, ties in original
/// order), H += λ·mean(diag H)·I until the factor exists, at most `opts.max_tries` rounds. A matrix that
/// stays singular fails the plan with its index named.
pub fn plan(ops: &dyn QuantOps, h: &Mat, opts: &Damping, act_order: bool) -> Result<Plan> {
    let (batch, n) = (h.batch, h.rows);
    let diag = ops.diag(h)?;
    let mut perm = Vec::with_capacity(batch);
    let mut inv = Vec::with_capacity(batch);
    let mut dead = Vec::with_capacity(batch);
    let mut amount = Vec::with_capacity(batch);
    let mut fixes = Vec::new();
    for b in 0..batch {
        let mut d = diag[b * n..(b + 1) * n].to_vec();
        let dead_b: Vec<usize> = (0..n).filter(|&i| d[i] == 0.0).collect();
        for &i in &dead_b {
            d[i] = opts.dead_diag;
        }
        let mut p: Vec<usize> = (0..n).collect();
        if act_order {
            p.sort_by(|&a, &c| d[c].total_cmp(&d[a]));
        }
        let mut q = vec![0; n];
        for (k, &c) in p.iter().enumerate() {
            q[c] = k;
        }
        fixes.extend(dead_b.iter().map(|&i| (b, q[i], opts.dead_diag)));
        // mean(diag H) summed in sweep order, as the damped H holds it.
        let mean = p.iter().map(|&c| d[c]).sum::<f64>() / n.max(1) as f64;
        amount.push(opts.damp * mean);
        perm.push(p);
        inv.push(q);
        dead.push(dead_b);
    }
    let mut h_p = ops.permute_sym(h, &perm)?;
    ops.set_diag(&mut h_p, &fixes)?;
    let mut pending: Vec<usize> = (0..batch).collect();
    let mut damp = vec![0.0; batch];
    let mut u = None;
    for _ in 0..opts.max_tries.max(1) {
        if pending.is_empty() {
            break;
        }
        let adds: Vec<(usize, f64)> = pending.iter().map(|&b| (b, amount[b])).collect();
        ops.add_diag(&mut h_p, &adds)?;
        for &b in &pending {
            damp[b] += amount[b];
        }
        let (uu, ok) = ops.factor(&h_p, u.take(), &pending)?;
        u = Some(uu);
        pending = pending
            .iter()
            .zip(ok)
            .filter(|&(_, ok)| !ok)
            .map(|(&b, _)| b)
            .collect();
    }
    if let Some(&b) = pending.first() {
        let which = if batch > 1 {
            format!(" (matrix {b} of {batch})")
        } else {
            String::new()
        };
        return Err(crate::input_err!(
            "Hessian [{n} × {n}]{which} stays singular after {} damping rounds of {}·mean(diag H) = {:e}",
            opts.max_tries.max(1),
            opts.damp,
            amount[b]
        ));
    }
    Ok(Plan {
        n,
        perm,
        inv,
        dead,
        damp,
        h_p,
        u: u.expect("at least one damping round ran"),
    })
}

/// The elements of damped H and factor (2n² per plan) that one batch of plans made ahead may hold
/// (`FactorCache::plan_batch`): 2^26, 256 MiB in f32 on a device (512 MiB in f64 on the CPU). An MoE block
/// holds at most one such batch per width of its experts' inputs (two) beside its other plans; the memory
/// plan counts them.
pub const BATCH_PLAN_ELEMS: usize = 1 << 26;

/// How many plans of n × n matrices a batch holds: at least one.
pub fn batch_len(n: usize) -> usize {
    (BATCH_PLAN_ELEMS / (2 * n * n).max(1)).max(1)
}

/// The distinct matrices of `hs` (by identity, in order of first appearance) in batches for
/// `FactorCache::plan_batch`: one width each, at most `batch_len(n)` matrices; and how many plans a cache must
/// hold to keep one batch of each width while the others are made (the largest batch of each width, summed).
pub fn batches<'h>(hs: impl IntoIterator<Item = &'h Mat>) -> (Vec<Vec<&'h Mat>>, usize) {
    batches_of(hs, batch_len)
}

/// `batches` with at most `limit(n)` matrices of width n in a batch.
fn batches_of<'h>(
    hs: impl IntoIterator<Item = &'h Mat>,
    limit: impl Fn(usize) -> usize,
) -> (Vec<Vec<&'h Mat>>, usize) {
    let mut out: Vec<Vec<&'h Mat>> = Vec::new();
    // Per width: the batch still filling.
    let mut open: Vec<(usize, usize)> = Vec::new();
    for h in hs {
        if out.iter().flatten().any(|b| std::ptr::eq(*b, h)) {
            continue;
        }
        let n = h.rows;
        match open.iter_mut().find(|(w, _)| *w == n) {
            Some((_, i)) if out[*i].len() < limit(n) => out[*i].push(h),
            Some((_, i)) => {
                out.push(vec![h]);
                *i = out.len() - 1;
            }
            None => {
                out.push(vec![h]);
                open.push((n, out.len() - 1));
            }
        }
    }
    let held = open
        .iter()
        .map(|&(n, _)| {
            out.iter()
                .filter(|b| b[0].rows == n)
                .map(Vec::len)
                .max()
                .unwrap_or(0)
        })
        .sum();
    (out, held)
}

/// What a plan depends on besides H itself.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PlanKey {
    act_order: bool,
    damping: Damping,
}

/// The plans of one block, shared by the layers that read the same H_col: q_proj and k_proj (and v_proj under
/// GPTQ) all read the attention input's covariance, gate_proj and up_proj the MLP input's, and without sharing
/// each factors it again (on a GPU one extra 4096 and one extra 11008 factor per 7B layer).
///
/// An H is recognised by identity (the same `Mat`, which the `'h` borrow keeps alive and unchanged) and the
/// plan by the options it was made with, so a hit returns exactly what planning again would (planning is
/// deterministic, damping retries included). `new` keeps only the last plan: the block's order (q, k, v, o,
/// gate, up, down) puts the sharers next to each other, and a d_ff-sized plan is not held longer than its
/// layers need it. `holding(n)` keeps the n most recently used, for a caller that returns to several H in
/// turn (the output proxy quantizes every expert of a unit at each width: with one entry it would plan each
/// expert's H once per width).
pub struct FactorCache<'h> {
    /// Most recently used last.
    entries: std::sync::Mutex<Vec<Entry<'h>>>,
    capacity: usize,
    hits: std::sync::atomic::AtomicUsize,
}

struct Entry<'h> {
    h: &'h Mat,
    key: PlanKey,
    plan: Arc<Plan>,
    /// Handed to a caller at least once: a plan made ahead (`plan_batch`) is not evicted before one that was
    /// used, or a batch would push out the plans of another batch still waiting for their linears.
    served: bool,
}

impl Entry<'_> {
    fn is(&self, h: &Mat, key: PlanKey) -> bool {
        std::ptr::eq(self.h, h) && self.key == key
    }
}

/// Makes room for one more plan: the least recently used of those served, else the oldest.
fn evict(entries: &mut Vec<Entry<'_>>, capacity: usize) {
    if entries.len() >= capacity {
        let i = entries.iter().position(|e| e.served).unwrap_or(0);
        entries.remove(i);
    }
}

impl Default for FactorCache<'_> {
    fn default() -> Self {
        Self::holding(1)
    }
}

impl<'h> FactorCache<'h> {
    pub fn new() -> Self {
        Self::default()
    }

    /// A cache of the `n` (at least one) most recently used plans.
    pub fn holding(n: usize) -> Self {
        FactorCache {
            entries: std::sync::Mutex::new(Vec::new()),
            capacity: n.max(1),
            hits: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Plans served from the cache so far.
    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `plan` of `h` through the cache.
    pub fn plan(
        &self,
        ops: &dyn QuantOps,
        h: &'h Mat,
        opts: &Damping,
        act_order: bool,
    ) -> Result<Arc<Plan>> {
        let key = PlanKey {
            act_order,
            damping: *opts,
        };
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = entries.iter().position(|e| e.is(h, key)) {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut e = entries.remove(i);
            e.served = true;
            let p = e.plan.clone();
            entries.push(e);
            return Ok(p);
        }
        // Drop the least recently used before making the new one (peak memory: `capacity` plans, not one
        // more).
        evict(&mut entries, self.capacity);
        let p = Arc::new(plan(ops, h, opts, act_order)?);
        entries.push(Entry {
            h,
            key,
            plan: p.clone(),
            served: true,
        });
        Ok(p)
    }

    /// Plans the matrices of `hs` [n × n each] that the cache does not hold as one batch and holds each plan
    /// as `plan` would have made it: one diagonal read and one factor status per damping round for all of
    /// them, where planning each reads its own (a device synchronization each; an MoE block has two distinct
    /// H per expert). Planning is per matrix (the diagonal, the order, the damping rounds, the factor), so
    /// the plans are the same bit for bit. At most `capacity` are made (the cache must hold them until they
    /// are used). A batch that fails to plan (a singular H) leaves the cache as it was: each H is planned
    /// alone when asked for, and the one that fails is named with its linear.
    pub fn plan_batch(
        &self,
        ops: &dyn QuantOps,
        hs: &[&'h Mat],
        opts: &Damping,
        act_order: bool,
    ) -> Result<()> {
        let key = PlanKey {
            act_order,
            damping: *opts,
        };
        let mut todo: Vec<&'h Mat> = Vec::with_capacity(hs.len());
        {
            let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            for &h in hs {
                let held = entries.iter().any(|e| e.is(h, key));
                if !held && !todo.iter().any(|t| std::ptr::eq(*t, h)) {
                    todo.push(h);
                }
            }
        }
        todo.truncate(self.capacity);
        if todo.len() < 2 {
            return Ok(());
        }
        let stacked = ops.stack(&todo)?;
        let Ok(batch) = plan(ops, &stacked, opts, act_order) else {
            return Ok(());
        };
        drop(stacked);
        let Plan {
            n,
            perm,
            inv,
            dead,
            damp,
            h_p,
            u,
        } = batch;
        let (h_p, u) = (ops.unstack(h_p)?, ops.unstack(u)?);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let parts = perm
            .into_iter()
            .zip(inv)
            .zip(dead)
            .zip(damp)
            .zip(h_p.into_iter().zip(u));
        for (&h, ((((perm, inv), dead), damp), (h_p, u))) in todo.iter().zip(parts) {
            evict(&mut entries, self.capacity);
            let p = Plan {
                n,
                perm: vec![perm],
                inv: vec![inv],
                dead: vec![dead],
                damp: vec![damp],
                h_p,
                u,
            };
            entries.push(Entry {
                h,
                key,
                plan: Arc::new(p),
                served: false,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Damping, FactorCache, batches_of};
    use crate::backend::cpu::CpuBackend;
    use crate::ops::{Mat, QuantOps};

    const DAMPING: Damping = Damping {
        damp: 0.01,
        max_tries: 3,
        dead_diag: 1.0,
    };

    fn spd(n: usize, seed: f64) -> Mat {
        let h: Vec<f64> = (0..n * n)
            .map(|k| {
                let (i, j) = (k / n, k % n);
                if i == j {
                    n as f64 + seed
                } else {
                    1.0 / (1.0 + (i + j) as f64 + seed)
                }
            })
            .collect();
        CpuBackend.hessian(h, 1, n).unwrap()
    }

    #[test]
    fn the_cache_serves_the_plans_it_holds_and_plans_the_others_again() {
        let damping = DAMPING;
        let hs: Vec<Mat> = (0..3).map(|s| spd(8, s as f64)).collect();
        // One entry: every change of H plans again.
        let one = FactorCache::new();
        for _ in 0..2 {
            for h in &hs {
                one.plan(&CpuBackend, h, &damping, false).unwrap();
            }
        }
        assert_eq!(one.hits(), 0);
        // Three entries: the second round is all hits, and a hit is the plan itself.
        let three = FactorCache::holding(3);
        let first: Vec<_> = hs
            .iter()
            .map(|h| three.plan(&CpuBackend, h, &damping, false).unwrap())
            .collect();
        for (h, p) in hs.iter().zip(&first) {
            assert!(std::sync::Arc::ptr_eq(
                &three.plan(&CpuBackend, h, &damping, false).unwrap(),
                p
            ));
        }
        assert_eq!(three.hits(), 3);
        // Other options are another plan; it evicts the least recently used (hs[0]), not the others.
        three.plan(&CpuBackend, &hs[2], &damping, true).unwrap();
        assert_eq!(three.hits(), 3);
        three.plan(&CpuBackend, &hs[1], &damping, false).unwrap();
        assert_eq!(three.hits(), 4);
        three.plan(&CpuBackend, &hs[0], &damping, false).unwrap();
        assert_eq!(three.hits(), 4);
    }

    #[test]
    fn batches_hold_distinct_matrices_of_one_width_up_to_the_limit() {
        let (a, b) = (spd(4, 0.0), spd(6, 0.0));
        let more: Vec<Mat> = (1..4).map(|s| spd(4, s as f64)).collect();
        // a, b, a again (gate/up share an H), then three more of width 4: at most two per batch.
        let hs = [&a, &b, &a, &more[0], &more[1], &more[2]];
        let (got, held) = batches_of(hs, |_| 2);
        let ids = |batch: &[&Mat]| -> Vec<*const Mat> {
            batch.iter().map(|m| *m as *const Mat).collect()
        };
        let want: [Vec<&Mat>; 3] = [vec![&a, &more[0]], vec![&b], vec![&more[1], &more[2]]];
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(ids(g), ids(w));
        }
        // One batch of width 4 (two) and one of width 6 (one) held at once.
        assert_eq!(held, 3);
        assert_eq!(super::batch_len(1024), 32);
        assert_eq!(super::batch_len(1 << 20), 1);
    }

    #[test]
    fn plans_made_ahead_outlive_the_plans_already_used() {
        let damping = DAMPING;
        let hs: Vec<Mat> = (0..5).map(|s| spd(8, s as f64)).collect();
        let cache = FactorCache::holding(3);
        cache.plan(&CpuBackend, &hs[0], &damping, false).unwrap();
        cache
            .plan_batch(&CpuBackend, &[&hs[1], &hs[2]], &damping, false)
            .unwrap();
        cache.plan(&CpuBackend, &hs[1], &damping, false).unwrap();
        assert_eq!(cache.hits(), 1);
        // Two more made ahead: the two used ones go (hs[0], then hs[1]), not hs[2], which waits for its use
        // and is older than hs[1] by recency.
        cache
            .plan_batch(&CpuBackend, &[&hs[3], &hs[4]], &damping, false)
            .unwrap();
        for h in &hs[2..] {
            cache.plan(&CpuBackend, h, &damping, false).unwrap();
        }
        assert_eq!(cache.hits(), 4);
        // A batch of one is left to `plan`; what is held already is not made again.
        cache
            .plan_batch(&CpuBackend, &[&hs[4], &hs[0]], &damping, false)
            .unwrap();
        cache.plan(&CpuBackend, &hs[0], &damping, false).unwrap();
        assert_eq!(cache.hits(), 4);
    }
}
