//! `QuantOps`: the quantization core's one interface (design.md §5, §12 "Device residency"). The algorithms of
//! `quant/` (GPTQ, BoA, RTN, the Hessians) are written once against it; a backend implements it on the buffers
//! it keeps: the CPU on host vectors with the f64 oracle code of `quant/` (bit for bit the engine's reference),
//! CUDA on device memory. Between a block's upload and its packed output nothing of size O(d_in²) or O(weights)
//! crosses to the host: the algorithms move only what is small (a diagonal, permutations, a few sums per
//! linear; BoA's per-head row Hessians are made where the statistics are, `rope_row_hessians`) and the packed
//! result.
//!
//! A leaf: this module imports nothing from `quant/` or `backend/`, so both can import it without a cycle.
//! Every method is fallible; an error names the op and the shapes, and the caller adds the layer, the linear
//! and the phase.
//!
//! Conventions: row-major; a weight is W [d_out × d_in] (y = W x); a batch of tokens X [m × d] holds one token
//! per row. A `Mat` may hold a batch of equal-shaped matrices (V's per-head H_col, every head's H_row). Rows
//! of a weight may be split into equal consecutive *parts* (BoA's heads), part p using matrix `h_of_part[p]`
//! of a batch of Hessians or factors.

pub mod hadamard;
pub mod mat;
pub mod rope;
pub mod spec;
pub mod tensor;

pub use mat::{Codes, Grids, Mat, MatData, Packed, QuadSums, QuantizedLinear, SweepError, Swept};
pub use rope::RopeAverage;
pub use spec::{AttnShape, Grid, Lattice, QuantSpec, ScaleSearch};
pub use tensor::Tensor;

pub type Result<T> = anyhow::Result<T>;

/// How a sweep gets its grids.
pub enum GridMode<'a> {
    /// Fixed before the sweep: `grids` [rows × n_groups] in sweep row order; `col_group[f][c]` is the group of
    /// sweep column c for the rows whose column factor is f.
    Static {
        grids: Grids,
        col_group: &'a [Vec<u32>],
    },
    /// Searched when the sweep reaches each group's first column (sweep columns [k·g, min((k+1)·g, n))), from
    /// the current weights, scored with the diagonal block of `h[f]` (damped, sweep order) of the row's column
    /// factor f (`h` is read only for `ScaleSearch::Hessian`).
    Dynamic {
        g: usize,
        h: Option<&'a Mat>,
        spec: &'a QuantSpec,
    },
}

impl GridMode<'_> {
    /// What every backend refuses before a sweep of `n` columns: a static column map of another length or
    /// naming a group past the grids (a kernel would read that grid from the next row's), a dynamic group
    /// size of 0, or the Hessian search without its H.
    pub fn check(&self, op: &str, n: usize) -> Result<()> {
        match self {
            GridMode::Static { grids, col_group } => {
                for (f, cg) in col_group.iter().enumerate() {
                    check_col_group(op, f, cg, n, grids.n_groups())?;
                }
            }
            GridMode::Dynamic { g, h, spec } => {
                if *g == 0 {
                    anyhow::bail!("{op}: dynamic groups of 0 columns");
                }
                if matches!(spec.search, ScaleSearch::Hessian) && h.is_none() {
                    anyhow::bail!(
                        "{op}: the Hessian scale search of dynamic groups needs H (h is None)"
                    );
                }
            }
        }
        Ok(())
    }
}

/// What every backend refuses in `rope_row_hessians`: covariances that are not [batch × d_h × d_h] for the
/// average's d_h, a norm weight of another length, or n_out and batch neither a multiple of the other.
pub fn check_rope_row_hessians(
    c: &Mat,
    n_out: usize,
    rope: &RopeAverage,
    norm: Option<&[f32]>,
) -> Result<()> {
    let d_h = rope.d_h();
    let fits = c.rows == d_h
        && c.cols == d_h
        && c.batch > 0
        && n_out > 0
        && (n_out.is_multiple_of(c.batch) || c.batch.is_multiple_of(n_out))
        && norm.is_none_or(|g| g.len() == d_h);
    anyhow::ensure!(
        fits,
        "rope_row_hessians: covariances {} for {n_out} outputs of d_h {d_h} (norm weight of {:?})",
        c.describe(),
        norm.map(<[f32]>::len)
    );
    Ok(())
}

/// `QuantOps::ridge_shift`'s operands: at least one W, each one matrix [rows_i × n], and D and H [n × n].
pub fn check_ridge_shift(ws: &[&Mat], d: &Mat, h: &Mat) -> Result<()> {
    let Some(first) = ws.first() else {
        anyhow::bail!("ridge_shift: no W");
    };
    let n = first.cols;
    for w in ws {
        if w.batch != 1 || w.cols != n {
            anyhow::bail!(
                "ridge_shift: W {} beside W {}",
                w.describe(),
                first.describe()
            );
        }
    }
    for (m, what) in [(d, "D"), (h, "H")] {
        if (m.batch, m.rows, m.cols) != (1, n, n) {
            anyhow::bail!(
                "ridge_shift: {what} {} for W {}",
                m.describe(),
                first.describe()
            );
        }
    }
    Ok(())
}

/// Matrices `stack` can join: at least one, all of one shape.
pub fn check_stack(mats: &[&Mat]) -> Result<()> {
    let Some(first) = mats.first() else {
        anyhow::bail!("stack: no matrices");
    };
    if let Some(m) = mats
        .iter()
        .find(|m| (m.rows, m.cols) != (first.rows, first.cols))
    {
        anyhow::bail!("stack: {} beside {}", m.describe(), first.describe());
    }
    Ok(())
}

/// A column map `col_group` (number `f` of its kind) for `n` columns and `n_groups` grids per row: one entry
/// per column, each naming an existing group (a kernel would read a grid past the row's from the next row).
pub fn check_col_group(op: &str, f: usize, cg: &[u32], n: usize, n_groups: usize) -> Result<()> {
    if cg.len() != n {
        anyhow::bail!("{op}: col_group[{f}] maps {} columns of {n}", cg.len());
    }
    if let Some(c) = cg.iter().position(|&k| k as usize >= n_groups) {
        anyhow::bail!(
            "{op}: col_group[{f}] puts column {c} in group {} of {n_groups}",
            cg[c]
        );
    }
    Ok(())
}

/// What `QuantOps::refit_scales` did to one linear.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RefitStats {
    /// Σ over rows of tr((W − Ŵ) H (W − Ŵ)ᵀ) with the sweep's scales and with the refitted ones.
    pub before: f64,
    pub after: f64,
    /// Rows whose scales changed.
    pub rows: usize,
}

/// Bytes and calls that crossed between host and device, for `run --profile` (zero on a host backend).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Traffic {
    pub htod_bytes: u64,
    pub dtoh_bytes: u64,
    /// Host synchronizations: calls after which the host has waited for the device.
    pub syncs: u64,
    /// Kernel launches and library calls (0 where the source does not count them).
    pub launches: u64,
    /// Who counted: "emulator" (the CPU emulator's own driver), "host layer", or "" (nothing to count).
    pub source: &'static str,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;
    fn sub(self, o: Traffic) -> Traffic {
        Traffic {
            htod_bytes: self.htod_bytes.saturating_sub(o.htod_bytes),
            dtoh_bytes: self.dtoh_bytes.saturating_sub(o.dtoh_bytes),
            syncs: self.syncs.saturating_sub(o.syncs),
            launches: self.launches.saturating_sub(o.launches),
            source: self.source,
        }
    }
}

impl std::ops::Add for Traffic {
    type Output = Traffic;
    fn add(self, o: Traffic) -> Traffic {
        Traffic {
            htod_bytes: self.htod_bytes + o.htod_bytes,
            dtoh_bytes: self.dtoh_bytes + o.dtoh_bytes,
            syncs: self.syncs + o.syncs,
            launches: self.launches + o.launches,
            source: if self.source.is_empty() {
                o.source
            } else {
                self.source
            },
        }
    }
}

/// One Gram of `QuantOps::stat_xxt_rows`: acc [n × n] += Σ_r (s_r x_r)(s_r x_r)ᵀ over the m rows x_r of
/// X [m × n], s the row scales (None: every s_r = 1).
pub struct RowGram<'a> {
    pub acc: &'a mut Mat,
    pub x: &'a Tensor,
    pub m: usize,
    pub scales: Option<&'a [f32]>,
}

pub trait QuantOps: Send + Sync {
    /// Whether the searches take `QuantSpec::signed` (a symmetric grid's scale of either sign). A backend
    /// without them is given the same spec with positive scales (a valid grid of every format).
    fn signed_scales(&self) -> bool {
        true
    }

    // ---- Statistics (design.md §4.2–4.3): raw sums in accumulators the backend keeps, then finished once.

    /// A zero accumulator of `batch` symmetric [n × n] sums.
    fn stat_acc(&self, batch: usize, n: usize) -> Result<Mat>;

    /// acc [n × n] += Xᵀ X over the m tokens of X [m × n].
    fn stat_xxt(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()>;

    /// `stat_xxt` of each item, its rows scaled first where it has scales (each product rounded once to f32):
    /// the Grams of many small inputs at once, an MoE block's experts on their routed rows. The default runs
    /// them one at a time, scaling on the host (a scaled item must be in host memory); a GPU batches them.
    fn stat_xxt_rows(&self, items: &mut [RowGram<'_>]) -> Result<()> {
        for it in items.iter_mut() {
            match it.scales {
                None => self.stat_xxt(it.acc, it.x, it.m)?,
                Some(s) => {
                    let n = it.acc.rows;
                    let Tensor::Host(x) = it.x else {
                        anyhow::bail!("stat_xxt_rows: scaled rows must be in host memory here");
                    };
                    anyhow::ensure!(
                        x.len() == it.m * n && s.len() == it.m,
                        "stat_xxt_rows: X of {} values and {} scales for {} rows of {n}",
                        x.len(),
                        s.len(),
                        it.m
                    );
                    let scaled = x
                        .chunks_exact(n.max(1))
                        .zip(s)
                        .flat_map(|(row, &p)| row.iter().map(move |&v| v * p))
                        .collect();
                    self.stat_xxt(it.acc, &Tensor::Host(scaled), it.m)?
                }
            }
        }
        Ok(())
    }

    /// acc [heads × d_h × d_h] += Σ_t x_{t,h} x_{t,h}ᵀ per head of X [m × heads·d_h] (post-RoPE queries or
    /// keys; heads = acc.batch, d_h = acc.rows).
    fn stat_head_cov(&self, acc: &mut Mat, x: &Tensor, m: usize) -> Result<()>;

    /// acc [heads × d_h × d_h] += Σ_t J_tᵀ A_h J_t per head of X [m × heads·d_h] (W_Q's or W_K's outputs
    /// before a per-head RMSNorm with epsilon `eps`; J_t that norm's Jacobian without its weight, which `a`
    /// [heads × d_h × d_h] carries): the exact row Hessian behind a q/k norm
    /// (`quant::hessian::add_norm_jacobian_f64`).
    fn stat_norm_jacobian(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        m: usize,
        a: &Mat,
        eps: f32,
    ) -> Result<()>;

    /// acc [h_kv × d × d] += Σ over the `n_seq` sequences and over each KV head's query heads h of
    /// (A_h X)ᵀ (A_h X), A_h = causal softmax(Q_h K_hᵀ / √d_h): W_V's column statistics. X [n_seq·t × d],
    /// Q [n_seq·t × h·d_h], K [n_seq·t × h_kv·d_h] (post-RoPE).
    fn stat_v_col(
        &self,
        acc: &mut Mat,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<()>;

    /// The Hessians of an accumulator of `tokens` tokens: (2 / (tokens · div)) Σ, exactly symmetric.
    fn stat_finish(&self, acc: Mat, tokens: usize, div: f64) -> Result<Mat>;

    /// `acc` [n × n] (from `stat_acc(1, n)`) += (A − B)ᵀ B for A and B [m × n], one token per row: a cross
    /// Gram formed from the difference, so that two large sums never cancel. Not symmetric; read it raw
    /// (no `stat_finish`).
    fn stat_diff_cross(&self, acc: &mut Mat, a: &Tensor, b: &Tensor, m: usize) -> Result<()>;

    /// W + α·W·(s·D)·(H + μI)⁻¹ for each W [rows_i × n] of `ws` (linears that read one input, so one factor
    /// of H + μI serves them all) and D, H [n × n] (one matrix each), μ = `damp`·mean(diag H); an input with
    /// H_ii = 0 gets max(mean, 1) + μ on its diagonal instead. D is `stat_diff_cross`'s raw sum and s its
    /// scale. None when H + μI does not factor (or, on the host, a result is not finite).
    fn ridge_shift(
        &self,
        ws: &[&Mat],
        d: &Mat,
        s: f64,
        h: &Mat,
        damp: f64,
        alpha: f64,
    ) -> Result<Option<Vec<Mat>>>;

    /// W_V's row Hessians from the paper's Table 1: per KV head, W_out,hᵀ W_out,h [d_h × d_h] averaged over the
    /// query heads h sharing it; `w_o` is o_proj [d × n_heads·d_h].
    fn wout_row_hessians(&self, w_o: &Mat, n_heads: usize, n_kv: usize, d_h: usize) -> Result<Mat>;

    /// BoA's row Hessians of W_Q or W_K (design.md §4.3), [n_out × d_h × d_h] from the finished per-head
    /// covariances `c` [batch × d_h × d_h] of the other side's post-RoPE vectors: output o is
    /// diag(g) (mean_p R_pᵀ C̄_o R_p) diag(g) with the position average `rope` and g = `norm` (a per-head
    /// q/k RMSNorm's weight, [d_h]; none: 1). C̄_o is c[o / (n_out / batch)] when n_out ≥ batch (W_Q: each
    /// query head takes its KV head's key covariance) and the mean of c[o·r .. (o+1)·r], r = batch / n_out,
    /// otherwise (W_K: its query heads' covariances averaged).
    fn rope_row_hessians(
        &self,
        c: &Mat,
        n_out: usize,
        rope: &RopeAverage,
        norm: Option<&[f32]>,
    ) -> Result<Mat>;

    /// `batch` identity matrices [n × n], as a Hessian of this backend (W_V's default row Hessians).
    fn identity_hessians(&self, batch: usize, n: usize) -> Result<Mat> {
        let mut h = self.stat_acc(batch, n)?;
        let ones: Vec<(usize, usize, f64)> = (0..batch)
            .flat_map(|b| (0..n).map(move |i| (b, i, 1.0)))
            .collect();
        self.set_diag(&mut h, &ones)?;
        Ok(h)
    }

    // ---- What the algorithms read back or hand in (small: O(n), O(heads·d_h²)).

    /// The values of `m`, as f64.
    fn read_f64(&self, m: &Mat) -> Result<Vec<f64>>;

    /// The values of `m`, as f32.
    fn read_f32(&self, m: &Mat) -> Result<Vec<f32>>;

    fn read_codes(&self, c: &Codes) -> Result<Vec<u8>>;

    /// Host values made into a Hessian of this backend (its precision, its memory).
    fn hessian(&self, v: Vec<f64>, batch: usize, n: usize) -> Result<Mat>;

    // ---- Planning a sweep (design.md §4.2): dead inputs, act-order, damping, U = chol(H⁻¹)ᵀ.

    /// The diagonals of every matrix of `h`, [batch × n].
    fn diag(&self, h: &Mat) -> Result<Vec<f64>>;

    /// H_b[perm_b, perm_b] for every matrix b (`perms.len() == h.batch`).
    fn permute_sym(&self, h: &Mat, perms: &[Vec<usize>]) -> Result<Mat>;

    /// H_b[i, i] = v for every (b, i, v).
    fn set_diag(&self, h: &mut Mat, entries: &[(usize, usize, f64)]) -> Result<()>;

    /// H_b += a·I for every (b, a).
    fn add_diag(&self, h: &mut Mat, amounts: &[(usize, f64)]) -> Result<()>;

    /// U_b = chol(H_b⁻¹)ᵀ, upper triangular, for each b of `which`, written into `u` (a buffer of h's shape from
    /// an earlier call, or None for a new one whose other matrices are unspecified); `ok[i]` is false when
    /// H_{which[i]} is not numerically positive definite (the caller damps and retries).
    fn factor(&self, h: &Mat, u: Option<Mat>, which: &[usize]) -> Result<(Mat, Vec<bool>)>;

    // ---- Weights, grids, sweeps.

    /// A copy of W with columns `cols[p]` of every row of part p zeroed (dead inputs).
    fn zero_cols(&self, w: &Mat, cols: &[Vec<usize>]) -> Result<Mat>;

    /// The static grid search of design.md §4.1 for every row of W [rows × n] and every group of g columns
    /// (columns [k·g, min((k+1)·g, n)); g = n per channel): the candidate (scale, zero) of the shrink search
    /// with the smallest score, Δ H Δᵀ for `ScaleSearch::Hessian` with H the group's diagonal block read as
    /// `h[f][idx[f][a], idx[f][b]]` for the group's columns a, b (f = h_of_part[p] for the rows of part p).
    /// `h`, `idx` are read only for the Hessian search.
    #[allow(clippy::too_many_arguments)]
    fn search_grids(
        &self,
        w: &Mat,
        h: Option<&Mat>,
        idx: &[Vec<usize>],
        h_of_part: &[usize],
        g: usize,
        spec: &QuantSpec,
    ) -> Result<Grids>;

    /// W and its grids in sweep order: row i of the result is row `row_perm[i]`, and the columns of part p are
    /// gathered by `col_perms[p]` (out[:, k] = in[:, perm[k]]).
    fn reorder(
        &self,
        w: &Mat,
        grids: Option<&Grids>,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Option<Grids>)>;

    /// The inverse of `reorder` for a sweep's results: Ŵ, codes and grids back in the original order.
    fn unorder(
        &self,
        s: Swept,
        row_perm: &[usize],
        col_perms: &[Vec<usize>],
    ) -> Result<(Mat, Codes, Grids)>;

    /// Round to nearest on fixed grids (no error feedback): Q and codes of W, column c on group col_group[c],
    /// with `spec`'s width and grid form (zero point or offset, `QuantSpec::offset`).
    fn rtn(
        &self,
        w: &Mat,
        grids: &Grids,
        col_group: &[u32],
        spec: &QuantSpec,
    ) -> Result<(Mat, Codes)>;

    /// The GPTQ sweep (Alg. 2 with lazy batches of `block` columns) of W [rows × n] in sweep order with
    /// U [n × n] (upper, sweep order).
    fn gptq_sweep(
        &self,
        w: Mat,
        u: &Mat,
        grids: GridMode,
        block: usize,
        maxq: u32,
    ) -> Result<Swept>;

    /// The head-wise BoA sweep (design.md §4.3; Alg. 1 with Eq. (12)) of W [n_heads·d_h × n] in sweep order
    /// (rows grouped by head): U_col [1 or n_heads × n × n] (shared or per head), U_row [n_heads × d_h × d_h].
    #[allow(clippy::too_many_arguments)]
    fn boa_sweep(
        &self,
        w: Mat,
        u_col: &Mat,
        u_row: &Mat,
        d_h: usize,
        block: usize,
        grids: GridMode,
        maxq: u32,
    ) -> Result<Swept>;

    // ---- The report and the output.

    /// tr(A H Aᵀ) for every A [rows × n] of `a`, with H [n × n]: queued and read at once.
    fn quad_forms(&self, h: &Mat, a: &[&Mat]) -> Result<Vec<f64>> {
        let mut sums = self.quad_sums(a.len())?;
        self.quad_forms_into(&mut sums, 0, h, a)?;
        self.read_quad_sums(&sums)
    }

    /// `slots` zeroed quadratic forms, for `quad_forms_into`.
    fn quad_sums(&self, slots: usize) -> Result<QuadSums>;

    /// tr(A H Aᵀ) of the i-th A of `a` into slot `first + i` of `sums`, without reading anything back: the
    /// A may be dropped as soon as this returns.
    fn quad_forms_into(&self, sums: &mut QuadSums, first: usize, h: &Mat, a: &[&Mat])
    -> Result<()>;

    /// The matrices of `mats` (each one matrix or a batch, all of one shape) as one batch, in order: copies,
    /// where the backend keeps them. A plan of several Hessians made as one batch reads its diagonals and
    /// factor statuses once for all (quant/plan.rs `FactorCache::plan_batch`).
    fn stack(&self, mats: &[&Mat]) -> Result<Mat>;

    /// Each matrix of the batch `m` on its own (copies; `m` is dropped).
    fn unstack(&self, m: Mat) -> Result<Vec<Mat>>;

    /// Every slot's value (one host synchronization on a device).
    fn read_quad_sums(&self, sums: &QuadSums) -> Result<Vec<f64>>;

    /// Every slot of `from` (a sweep's loss sums) into `into` from slot `first` on, without reading anything
    /// back: a block's report reads its GPTQ linears' losses with its other forms.
    fn queue_sums(&self, into: &mut QuadSums, first: usize, from: &QuadSums) -> Result<()>;

    /// a − b, elementwise.
    fn sub(&self, a: &Mat, b: &Mat) -> Result<Mat>;

    /// The checkpoint tensors of a quantized linear (the one O(weights) transfer to the host, b/32 of f32).
    fn pack(&self, q: &QuantizedLinear) -> Result<Packed>;

    /// `pack` of each of `qs`, each its own result (the caller names the linear a bad grid belongs to); a
    /// device reads them back together (one synchronization for a block's linears). The outer error is the
    /// device's, for all of them.
    fn pack_all(&self, qs: &[&QuantizedLinear]) -> Result<Vec<Result<Packed>>> {
        Ok(qs.iter().map(|q| self.pack(q)).collect())
    }

    /// `q` (a quantization of W) with each row's scales refitted by least squares to its codes
    /// (`quant::refit`, `run --refit-scales`), H the undamped input covariance: codes and zero points kept, Ŵ
    /// from the new scales, the error left for the report. Only the CPU backend implements it.
    fn refit_scales(
        &self,
        w: &Mat,
        h: &Mat,
        q: QuantizedLinear,
    ) -> Result<(QuantizedLinear, RefitStats)> {
        let _ = (w, h, q);
        anyhow::bail!("refit_scales (--refit-scales) runs on the CPU backend only")
    }

    /// Host↔device traffic so far (a host backend moves nothing).
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }

    /// Waits until every operation queued so far has finished (a host backend finishes each call before it
    /// returns). `run --profile` fences at its phase boundaries, so each phase's time holds its own device
    /// work rather than whatever the next synchronizing call waited for; quantize_block fences after each
    /// linear, so a kernel fault is reported with the linear whose work raised it.
    fn fence(&self) -> Result<()> {
        Ok(())
    }
}
