//! The quantizer's route through a backend's `QuantOps` (what `run --device cuda` takes): with the CPU backend
//! standing in for the device, `gptq_quantize_with` / `boa_quantize_with` must call the backend's factor and
//! sweep (GPTQ with dynamic groups too; BoA keeps its own sweep for them), and its scale search for static
//! Hessian grids (dynamic groups search inside the sweep), and give the codes of the native path
//! (which factors in f64; the route rounds H to f32 first, so rare rounding ties may flip — counted, bounded).
//! The block's factor cache (`FactorCache`) must factor each shared H_col once and change no bit.

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::quant_ops::{AttnShape, QuantOps, StaticGrids, SweepResult, UCol};
use boa_cuda::quant::boa::{
    BoaOptions, ColHessian, boa_quantize, boa_quantize_cached, boa_quantize_with,
};
use boa_cuda::quant::gptq::{
    DynamicGroups, FactorCache, GptqOptions, Quantized, gptq_quantize, gptq_quantize_cached,
    gptq_quantize_with,
};
use boa_cuda::quant::quantizer::Grid;
use boa_cuda::quant::{QuantSpec, ScaleSearch};
use common::*;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The CPU backend, counting the calls the quantizer makes.
#[derive(Default)]
struct Counting {
    cholesky_matrices: AtomicUsize,
    /// cholesky_upper_inverse_batched calls, and the matrices factored with n = DIN (the H_col).
    cholesky_calls: AtomicUsize,
    col_factors: AtomicUsize,
    gptq_sweeps: AtomicUsize,
    gptq_dynamic_sweeps: AtomicUsize,
    boa_sweeps: AtomicUsize,
    /// search_grids calls, and the rows they searched.
    searches: AtomicUsize,
    searched_rows: AtomicUsize,
}

impl QuantOps for Counting {
    fn xxt_accumulate(&self, h: &mut [f32], x: &[f32], m: usize, d: usize) {
        CpuBackend.xxt_accumulate(h, x, m, d)
    }
    fn head_covariance(&self, x: &[f32], m: usize, n_heads: usize, d_h: usize) -> Vec<f32> {
        CpuBackend.head_covariance(x, m, n_heads, d_h)
    }
    fn v_col_covariance(&self, x: &[f32], q: &[f32], k: &[f32], s: AttnShape) -> Vec<f32> {
        CpuBackend.v_col_covariance(x, q, k, s)
    }
    fn cholesky_upper_inverse_batched(
        &self,
        h: &[f32],
        n: usize,
        count: usize,
    ) -> Vec<Option<Vec<f32>>> {
        self.cholesky_matrices.fetch_add(count, Relaxed);
        self.cholesky_calls.fetch_add(1, Relaxed);
        if n == DIN {
            self.col_factors.fetch_add(count, Relaxed);
        }
        CpuBackend.cholesky_upper_inverse_batched(h, n, count)
    }
    fn search_grids(
        &self,
        w: &[f32],
        rows: usize,
        n: usize,
        h: &[f32],
        spec: &QuantSpec,
    ) -> Vec<Grid<f32>> {
        self.searches.fetch_add(1, Relaxed);
        self.searched_rows.fetch_add(rows, Relaxed);
        CpuBackend.search_grids(w, rows, n, h, spec)
    }
    fn gptq_sweep(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        self.gptq_sweeps.fetch_add(1, Relaxed);
        CpuBackend.gptq_sweep(w, u, rows, n, block_size, grids, maxq)
    }
    fn gptq_sweep_dynamic(
        &self,
        w: &[f32],
        u: &[f32],
        rows: usize,
        n: usize,
        block_size: usize,
        groups: &DynamicGroups,
        maxq: u32,
    ) -> (SweepResult, Vec<Grid<f32>>) {
        self.gptq_dynamic_sweeps.fetch_add(1, Relaxed);
        CpuBackend.gptq_sweep_dynamic(w, u, rows, n, block_size, groups, maxq)
    }
    fn boa_sweep(
        &self,
        w: &[f32],
        u_col: UCol,
        u_row: &[f32],
        n_heads: usize,
        d_h: usize,
        n: usize,
        block_size: usize,
        grids: StaticGrids,
        maxq: u32,
    ) -> SweepResult {
        self.boa_sweeps.fetch_add(1, Relaxed);
        CpuBackend.boa_sweep(w, u_col, u_row, n_heads, d_h, n, block_size, grids, maxq)
    }
}

const NH: usize = 4;
const DH: usize = 16;
const DIN: usize = 96;

fn layer(seed: u64) -> (Vec<f32>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut r = rng(seed);
    let w = to_f32(&randn_vec(&mut r, NH * DH * DIN));
    let x = correlated_inputs(&mut r, 4 * DIN, DIN);
    let h_col = xtx(&x, 4 * DIN, DIN);
    let per_head: Vec<f64> = (0..NH).flat_map(|_| random_spd(&mut r, DIN)).collect();
    let h_row: Vec<f64> = (0..NH).flat_map(|_| random_spd(&mut r, DH)).collect();
    (w, h_col, per_head, h_row)
}

/// Codes equal, and Ŵ equal where the codes are (same grids, same U up to f32 rounding of H).
fn assert_close(native: &Quantized<f32>, routed: &Quantized<f32>, what: &str) {
    let total = native.codes.len();
    let diff = native
        .codes
        .iter()
        .zip(&routed.codes)
        .filter(|(a, b)| a != b)
        .count();
    // A flipped code moves the rest of its row by a different error; at this size ties are rare.
    assert!(
        diff * 100 <= total,
        "{what}: {diff} of {total} codes differ between the native and the QuantOps route"
    );
    assert_eq!(native.scales.len(), routed.scales.len(), "{what}: grids");
}

/// Static grids: the counting backend searches with the CPU search itself, so the very same grids.
fn assert_same_grids(native: &Quantized<f32>, routed: &Quantized<f32>, what: &str) {
    assert_eq!(native.scales, routed.scales, "{what}: scales");
    assert_eq!(native.zeros, routed.zeros, "{what}: zeros");
}

fn specs() -> Vec<(QuantSpec, bool)> {
    vec![
        (QuantSpec::new(3, None, false, ScaleSearch::Hessian), false),
        (QuantSpec::new(4, Some(32), true, ScaleSearch::MinMax), true),
        // Static Hessian groups with a trailing partial group (96 = 40 + 40 + 16).
        (
            QuantSpec::new(4, Some(40), false, ScaleSearch::Hessian),
            true,
        ),
    ]
}

#[test]
fn gptq_static_grids_factor_and_sweep_through_the_backend() {
    let (w, h, _, _) = layer(1);
    for (spec, static_groups) in specs() {
        for act_order in [false, true] {
            let mut g = GptqOptions::new(spec);
            g.static_groups = static_groups;
            g.act_order = act_order;
            let ops = Counting::default();
            let native = gptq_quantize(&w, NH * DH, DIN, &h, &g).unwrap();
            let routed = gptq_quantize_with(&w, NH * DH, DIN, &h, &g, Some(&ops)).unwrap();
            assert_eq!(ops.cholesky_matrices.load(Relaxed), 1);
            assert_eq!(ops.gptq_sweeps.load(Relaxed), 1);
            // Static Hessian grids: one search per group over all rows; MinMax stays in quant::.
            let hessian = spec.search == ScaleSearch::Hessian;
            let groups = spec.n_groups(DIN);
            assert_eq!(ops.searches.load(Relaxed), if hessian { groups } else { 0 });
            assert_eq!(
                ops.searched_rows.load(Relaxed),
                if hessian { groups * NH * DH } else { 0 }
            );
            let what = format!("gptq {spec:?} act_order={act_order}");
            assert_same_grids(&native, &routed, &what);
            assert_close(&native, &routed, &what);
        }
    }
}

#[test]
fn gptq_dynamic_groups_sweep_through_the_backend() {
    let (w, h, _, _) = layer(2);
    let g = GptqOptions::new(QuantSpec::new(3, Some(32), false, ScaleSearch::Hessian));
    let ops = Counting::default();
    let native = gptq_quantize(&w, NH * DH, DIN, &h, &g).unwrap();
    let routed = gptq_quantize_with(&w, NH * DH, DIN, &h, &g, Some(&ops)).unwrap();
    assert_eq!(ops.gptq_sweeps.load(Relaxed), 0);
    assert_eq!(ops.gptq_dynamic_sweeps.load(Relaxed), 1);
    assert_eq!(
        ops.searches.load(Relaxed),
        0,
        "dynamic groups search in the sweep"
    );
    assert_eq!(ops.cholesky_matrices.load(Relaxed), 1);
    assert_close(&native, &routed, "gptq dynamic g32");
    // The grids the backend searched are the ones reported: the same up to the last bits of the range the
    // f32 factor leaves in the updated weights.
    assert_eq!(native.scales.len(), routed.scales.len());
    let same = native
        .scales
        .iter()
        .zip(&routed.scales)
        .filter(|&(a, b)| (a - b).abs() <= 1e-4 * a.abs())
        .count();
    assert!(
        same * 100 >= 99 * native.scales.len(),
        "{same} of {} scales equal",
        native.scales.len()
    );
}

#[test]
fn boa_dynamic_groups_keep_the_native_sweep() {
    let (w, h, _, h_row) = layer(5);
    let b = BoaOptions::new(GptqOptions::new(QuantSpec::new(
        3,
        Some(32),
        false,
        ScaleSearch::Hessian,
    )));
    let ops = Counting::default();
    let native = boa_quantize(&w, NH, DH, DIN, ColHessian::Shared(&h), &h_row, &b).unwrap();
    let routed = boa_quantize_with(
        &w,
        NH,
        DH,
        DIN,
        ColHessian::Shared(&h),
        &h_row,
        &b,
        Some(&ops),
    )
    .unwrap();
    assert_eq!(ops.boa_sweeps.load(Relaxed), 0);
    assert_eq!(ops.gptq_dynamic_sweeps.load(Relaxed), 0);
    assert_close(&native, &routed, "boa dynamic g32");
}

#[test]
fn boa_static_grids_factor_and_sweep_through_the_backend() {
    let (w, h, per_head, h_row) = layer(3);
    for (spec, static_groups) in specs() {
        for shared in [true, false] {
            let mut g = GptqOptions::new(spec);
            g.static_groups = static_groups;
            let b = BoaOptions::new(g);
            let h_col = if shared {
                ColHessian::Shared(&h)
            } else {
                ColHessian::PerHead(&per_head)
            };
            let ops = Counting::default();
            let native = boa_quantize(&w, NH, DH, DIN, h_col, &h_row, &b).unwrap();
            let routed = boa_quantize_with(&w, NH, DH, DIN, h_col, &h_row, &b, Some(&ops)).unwrap();
            // All heads' H_row in one batch, plus one H_col (shared) or one per head, also in one batch.
            let col = if shared { 1 } else { NH };
            assert_eq!(ops.cholesky_matrices.load(Relaxed), NH + col);
            assert_eq!(
                ops.cholesky_calls.load(Relaxed),
                2,
                "H_col batch + H_row batch"
            );
            assert_eq!(ops.boa_sweeps.load(Relaxed), 1);
            // Static Hessian grids: a shared H_col searches all heads' rows at once, per-head H_col one head
            // at a time; every row once.
            let hessian = spec.search == ScaleSearch::Hessian;
            let searches = if shared { 1 } else { NH } * spec.n_groups(DIN);
            assert_eq!(
                ops.searches.load(Relaxed),
                if hessian { searches } else { 0 }
            );
            assert_eq!(
                ops.searched_rows.load(Relaxed),
                if hessian {
                    spec.n_groups(DIN) * NH * DH
                } else {
                    0
                }
            );
            let what = format!("boa {spec:?} shared={shared}");
            assert_same_grids(&native, &routed, &what);
            assert_close(&native, &routed, &what);
        }
    }
}

#[test]
fn boa_names_the_head_whose_row_hessian_stays_singular() {
    let (w, h, _, mut h_row) = layer(4);
    // Head 2's H_row: NaN on the diagonal survives any damping.
    h_row[2 * DH * DH] = f64::NAN;
    let b = BoaOptions::new(GptqOptions::new(QuantSpec::new(
        3,
        None,
        false,
        ScaleSearch::MinMax,
    )));
    let ops = Counting::default();
    let e = boa_quantize_with(
        &w,
        NH,
        DH,
        DIN,
        ColHessian::Shared(&h),
        &h_row,
        &b,
        Some(&ops),
    )
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("H_row of head 2"), "{msg}");
    assert!(msg.contains("stays singular"), "{msg}");
    assert_eq!(
        ops.boa_sweeps.load(Relaxed),
        0,
        "no sweep after a failed factor"
    );
}

/// Every output of a quantization, bit for bit.
fn assert_identical(a: &Quantized<f32>, b: &Quantized<f32>, what: &str) {
    assert_eq!(a.codes, b.codes, "{what}: codes");
    assert_eq!(a.w_hat, b.w_hat, "{what}: Ŵ");
    assert_eq!(a.scales, b.scales, "{what}: scales");
    assert_eq!(a.zeros, b.zeros, "{what}: zeros");
    assert_eq!(a.g_idx, b.g_idx, "{what}: g_idx");
}

/// One block's worth of layers in the pipeline's order (quantize_block): W_Q and W_K by BoA on the attention
/// input's H, then gate/up by GPTQ on the MLP input's H, through one `FactorCache`. Each H_col is factored
/// once, and every result is the uncached one bit for bit — through a backend's QuantOps and through quant::'s
/// own f64 route, with dead inputs (whose columns a cached plan must still zero in each layer's W), static and
/// dynamic groups. A different act-order flag is a different plan (miss), and so is a different H.
#[test]
fn block_factor_cache_factors_each_shared_h_once_and_changes_nothing() {
    let (w_q, mut h_attn, _, h_row_q) = layer(6);
    let (w_k, _, _, h_row_k) = layer(7);
    let (w_gate, mut h_mlp, _, _) = layer(8);
    let (w_up, _, _, _) = layer(9);
    // A dead input in each H (never fires): its column must be zeroed in every layer that reads the H.
    for (h, dead) in [(&mut h_attn, 5), (&mut h_mlp, 17)] {
        for j in 0..DIN {
            h[dead * DIN + j] = 0.0;
            h[j * DIN + dead] = 0.0;
        }
    }
    let (h_attn, h_mlp) = (h_attn, h_mlp);
    let specs = [
        QuantSpec::new(3, None, false, ScaleSearch::Hessian),
        QuantSpec::new(3, Some(32), false, ScaleSearch::Hessian), // dynamic groups
    ];
    for spec in specs {
        for act_order in [false, true] {
            for routed in [true, false] {
                let what = format!("{spec:?} act_order={act_order} routed={routed}");
                let mut g = GptqOptions::new(spec);
                g.act_order = act_order;
                let mut b = BoaOptions::new(g.clone());
                b.act_order_col = act_order;
                let quantize_all = |cache, ops: &Counting| {
                    let ops = routed.then_some(ops as &dyn boa_cuda::backend::QuantOps);
                    let boa = |w: &[f32], h_row: &[f64]| {
                        let h_col = ColHessian::Shared(&h_attn);
                        boa_quantize_cached(w, NH, DH, DIN, h_col, h_row, &b, ops, cache).unwrap()
                    };
                    let gptq = |w: &[f32]| {
                        gptq_quantize_cached(w, NH * DH, DIN, &h_mlp, &g, ops, cache).unwrap()
                    };
                    [
                        boa(&w_q, &h_row_q),
                        boa(&w_k, &h_row_k),
                        gptq(&w_gate),
                        gptq(&w_up),
                    ]
                };
                let plain_ops = Counting::default();
                let plain = quantize_all(None, &plain_ops);
                let cached_ops = Counting::default();
                let cache = FactorCache::new();
                let cached = quantize_all(Some(&cache), &cached_ops);
                for (i, (a, c)) in plain.iter().zip(&cached).enumerate() {
                    assert_identical(a, c, &format!("{what} layer {i}"));
                    // The dead input's column is quantized to exactly 0 (W zeroed before the sweep).
                    let dead = if i < 2 { 5 } else { 17 };
                    for r in 0..NH * DH {
                        assert_eq!(c.w_hat[r * DIN + dead], 0.0, "{what} layer {i} dead column");
                    }
                }
                assert_eq!(
                    cache.hits(),
                    2,
                    "{what}: k reuses q's plan, up reuses gate's"
                );
                if routed {
                    assert_eq!(plain_ops.col_factors.load(Relaxed), 4, "{what}");
                    assert_eq!(
                        cached_ops.col_factors.load(Relaxed),
                        2,
                        "{what}: one H_col factor per distinct H"
                    );
                }
                // Same H, other act-order flag: another permutation, so another factor.
                let mut g2 = g.clone();
                g2.act_order = !act_order;
                let ops = routed.then_some(&cached_ops as &dyn boa_cuda::backend::QuantOps);
                let other =
                    gptq_quantize_cached(&w_up, NH * DH, DIN, &h_mlp, &g2, ops, Some(&cache))
                        .unwrap();
                let fresh =
                    gptq_quantize_cached(&w_up, NH * DH, DIN, &h_mlp, &g2, ops, None).unwrap();
                assert_identical(&other, &fresh, &format!("{what} flipped act_order"));
                assert_eq!(cache.hits(), 2, "{what}: a flipped act_order is a miss");
                if routed {
                    assert_eq!(cached_ops.col_factors.load(Relaxed), 4, "{what}");
                }
            }
        }
    }
}
