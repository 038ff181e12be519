//! The tensor path of `run` (design.md §3: X and the statistics stay where the backend computes).
//!
//! On the CPU: a backend with the CPU's arithmetic that declares `accelerates_statistics` takes the device
//! route of `stats::collect` (running f32 sums made by `zeros`, folded once per block, V's sums folded into
//! KV heads as they are made), and must give the Hessians of the CPU's own f64 route; chunks of unequal
//! size and GQA included. On a GPU (skipped with the reason elsewhere): a block forward with resident
//! weights, the statistics, and parking X in pinned memory, against the CPU.

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::cuda::CudaBackend;
use boa_cuda::backend::quant_ops::{AttnShape, QuantOps, StaticGrids, SweepResult, UCol};
use boa_cuda::backend::{Backend, Tensor};
use boa_cuda::model::Model;
use boa_cuda::model::llama::{ResidentWeights, block_forward, block_forward_host};
use boa_cuda::model::synth::{SynthSpec, write_model};
use boa_cuda::pipeline::stats::{BlockStats, collect};
use boa_cuda::quant::gptq::DynamicGroups;
use boa_cuda::quant::quantizer::Grid;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The CPU backend routed like a device: statistics through the tensor methods' defaults.
struct DeviceLike;

impl QuantOps for DeviceLike {
    fn accelerates_statistics(&self) -> bool {
        true
    }
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
        CpuBackend.cholesky_upper_inverse_batched(h, n, count)
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
        CpuBackend.boa_sweep(w, u_col, u_row, n_heads, d_h, n, block_size, grids, maxq)
    }
}

impl Backend for DeviceLike {
    fn name(&self) -> String {
        "device-like cpu".into()
    }
    fn linear(
        &self,
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<f32> {
        CpuBackend.linear(x, w, bias, m, k, n)
    }
    fn packed_linear(
        &self,
        x: &[f32],
        w: &boa_cuda::quant::pack::PackedLinear,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Vec<f32> {
        CpuBackend.packed_linear(x, w, bias, m)
    }
    fn rms_norm(&self, x: &[f32], w: &[f32], d: usize, eps: f32) -> Vec<f32> {
        CpuBackend.rms_norm(x, w, d, eps)
    }
    fn rope(&self, x: &mut [f32], t: usize, n_heads: usize, d_h: usize, cos: &[f32], sin: &[f32]) {
        CpuBackend.rope(x, t, n_heads, d_h, cos, sin)
    }
    fn causal_attention(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Vec<f32> {
        CpuBackend.causal_attention(q, k, v, n_seq, t, h, h_kv, d_h)
    }
    fn attention_probs(
        &self,
        q: &[f32],
        k: &[f32],
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
    ) -> Vec<f32> {
        CpuBackend.attention_probs(q, k, t, h, h_kv, d_h)
    }
    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        CpuBackend.swiglu(gate, up)
    }
}

/// A synthetic GQA model (d 64, 4 query heads over 2 KV heads, d_h 16) and random block inputs of `n_seq`
/// sequences of `t` tokens, in chunks of at most `chunk` sequences (the last one shorter).
fn setup(dir: &std::path::Path, n_seq: usize, t: usize, chunk: usize) -> (Model, Vec<Vec<f32>>) {
    let spec = SynthSpec {
        seed: 11,
        ..SynthSpec::tiny()
    };
    write_model(&dir.join("m"), &spec).expect("write model");
    let model = Model::open(&dir.join("m")).expect("open model");
    let d = model.cfg.d;
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let x: Vec<f32> = (0..n_seq * t * d)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let chunks = x.chunks(chunk * t * d).map(<[f32]>::to_vec).collect();
    (model, chunks)
}

/// Every statistic as f64 vectors, named.
fn all_stats(s: &BlockStats) -> Vec<(&'static str, Vec<f64>)> {
    vec![
        ("h_attn", s.h_attn.hessian()),
        ("h_o", s.h_o.hessian()),
        ("h_mlp", s.h_mlp.hessian()),
        ("h_down", s.h_down.hessian()),
        ("c_k", s.c_k.covariances()),
        ("c_q", s.c_q.covariances()),
        (
            "v_col",
            s.v_col.as_ref().expect("attention-aware").hessians(),
        ),
    ]
}

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "different sizes");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn compare_stats(got: &BlockStats, want: &BlockStats, tol: f64, what: &str) {
    assert_eq!(
        got.h_attn.n_tokens(),
        want.h_attn.n_tokens(),
        "{what}: tokens"
    );
    for ((name, g), (_, w)) in all_stats(got).iter().zip(all_stats(want).iter()) {
        assert!(g.iter().all(|v| v.is_finite()), "{what}: {name} not finite");
        let e = rel_err(g, w);
        println!("{what}: {name} rel. error {e:.2e} (bound {tol:.0e})");
        assert!(e <= tol, "{what}: {name} rel. error {e:.3e} > {tol:.0e}");
    }
}

fn host_tensors(chunks: &[Vec<f32>]) -> Vec<Tensor> {
    chunks.iter().map(|c| Tensor::Host(c.clone())).collect()
}

#[test]
fn device_route_statistics_match_the_host_route() {
    let tmp = tempfile::tempdir().unwrap();
    // 5 sequences in chunks of 2: the last chunk holds one, so token counts must add up across sizes.
    let (model, chunks) = setup(tmp.path(), 5, 24, 2);
    let w = model.load_block(0).unwrap();
    let rope = model.rope_table(24);
    let x = host_tensors(&chunks);
    let want = collect(&CpuBackend, &w, None, &model.cfg, &rope, &x, true);
    let got = collect(&DeviceLike, &w, None, &model.cfg, &rope, &x, true);
    assert_eq!(got.h_attn.n_tokens(), 5 * 24);
    // f32 running sums against f64 ones, over 120 tokens: a few ulp of f32.
    compare_stats(&got, &want, 1e-5, "device-like route");
    // The inputs are not modified by the statistics forward.
    for (c, t) in chunks.iter().zip(&x) {
        assert_eq!(c.as_slice(), t.host().unwrap());
    }
}

#[test]
fn tensor_forward_is_the_host_forward_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, chunks) = setup(tmp.path(), 2, 16, 2);
    let w = model.load_block(1).unwrap();
    let rope = model.rope_table(16);
    let resident = ResidentWeights::upload(&CpuBackend, &w);
    let mut xt = Tensor::Host(chunks[0].clone());
    block_forward(
        &CpuBackend,
        &w,
        Some(&resident),
        &model.cfg,
        &rope,
        &mut xt,
        2,
        None,
    );
    let mut xh = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, &model.cfg, &rope, &mut xh, 2);
    assert_eq!(xt.host().unwrap(), xh.as_slice());
    assert_ne!(xh, chunks[0], "the block changed nothing");
}

/// `run` and `eval` gather X from the f32 table on a device (`embed_t`); the rows must be the ones the host
/// path reads straight from the checkpoint's bytes.
#[test]
fn the_table_gather_is_the_checkpoint_embedding() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, _) = setup(tmp.path(), 1, 4, 1);
    let vocab = model.cfg.vocab as u32;
    let ids: Vec<u32> = (0..40).map(|i| (i * 7919) % vocab).collect();
    let table = Tensor::Host(model.embed_table().unwrap());
    let x = CpuBackend.embed_t(&table, &ids, model.cfg.d);
    assert_eq!(x.host().unwrap(), model.embed(&ids).unwrap().as_slice());
    let e = model.check_ids(&[vocab]).unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
}

#[test]
fn resident_forward_and_statistics_on_cuda() {
    let be = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let (t, n_seq) = (64, 3);
    let (model, chunks) = setup(tmp.path(), n_seq, t, 2);
    let cfg = &model.cfg;
    let w = model.load_block(0).unwrap();
    let rope = model.rope_table(t);

    // Parking a chunk in pinned memory and bringing it back is exact.
    let parked = be.to_host(be.to_device(Tensor::Host(chunks[0].clone())), true);
    assert!(
        matches!(parked, Tensor::Pinned(_)),
        "not parked: {parked:?}"
    );
    let mut parked = parked;
    let back = be.to_device(be.duplicate(&parked));
    assert!(back.on_device());
    assert_eq!(be.read(&back).as_ref(), chunks[0].as_slice());
    // A forwarded chunk goes back into its pinned buffer (the pipeline's parked X).
    let reversed: Vec<f32> = chunks[0].iter().rev().copied().collect();
    let other = be.to_device(Tensor::Host(reversed.clone()));
    be.write_back(&other, &mut parked);
    assert!(matches!(parked, Tensor::Pinned(_)));
    assert_eq!(parked.host().unwrap(), reversed.as_slice());

    // Weight uploads: a length's first upload is pageable, later ones pass through its page-locked staging
    // buffer, which the next upload may only overwrite once the previous copy has read it, whichever stream
    // each copy is on (upload_weight: the copy stream; upload_weight_now: the main one).
    let uploads: Vec<Vec<f32>> = (0..6)
        .map(|k| (0..300_000).map(|i| (i * 6 + k) as f32).collect())
        .collect();
    let on_device: Vec<Tensor> = uploads
        .iter()
        .enumerate()
        .map(|(k, u)| {
            if k % 2 == 0 {
                be.upload_weight(u)
            } else {
                be.upload_weight_now(u)
            }
            .expect("a device copy")
        })
        .collect();
    for (u, d) in uploads.iter().zip(&on_device) {
        assert!(d.on_device());
        assert_eq!(
            be.read(d).as_ref(),
            u.as_slice(),
            "a staged upload was overwritten"
        );
    }

    // One block forward with resident weights against the CPU (f32 SGEMM and f32 kernels), uploaded as the
    // pipeline does for the forward right after a block's quantization.
    let resident = ResidentWeights::upload_now(&be, &w);
    let mut xd = be.to_device(Tensor::Host(chunks[0].clone()));
    block_forward(&be, &w, Some(&resident), cfg, &rope, &mut xd, 2, None);
    assert!(xd.on_device(), "the forward left the device");
    let mut xc = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, cfg, &rope, &mut xc, 2);
    let got: Vec<f64> = be.read(&xd).iter().map(|&v| v as f64).collect();
    let want: Vec<f64> = xc.iter().map(|&v| v as f64).collect();
    let e = rel_err(&got, &want);
    println!("{}: resident block forward rel. error {e:.2e}", be.name());
    assert!(e <= 1e-4, "resident block forward rel. error {e:.3e}");

    // The pipeline's prefetch: block 1's weights uploaded from another thread (copy stream, staging) while
    // this thread runs block 0 on the main stream; then block 1 runs on them.
    let w1 = model.load_block(1).unwrap();
    let (resident1, mut xd) = std::thread::scope(|s| {
        let h = s.spawn(|| ResidentWeights::upload(&be, &w1));
        let mut xd = be.to_device(Tensor::Host(chunks[0].clone()));
        block_forward(&be, &w, Some(&resident), cfg, &rope, &mut xd, 2, None);
        (h.join().expect("prefetch thread"), xd)
    });
    block_forward(&be, &w1, Some(&resident1), cfg, &rope, &mut xd, 2, None);
    let mut xc = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, cfg, &rope, &mut xc, 2);
    block_forward_host(&CpuBackend, &w1, cfg, &rope, &mut xc, 2);
    let got: Vec<f64> = be.read(&xd).iter().map(|&v| v as f64).collect();
    let want: Vec<f64> = xc.iter().map(|&v| v as f64).collect();
    let e = rel_err(&got, &want);
    println!(
        "{}: two blocks with a prefetched upload, rel. error {e:.2e}",
        be.name()
    );
    assert!(e <= 2e-4, "prefetched block forward rel. error {e:.3e}");

    // Statistics through device sums (bf16 tensor-core XᵀX by default: bf16 rounding of the inputs).
    let xs: Vec<Tensor> = chunks
        .iter()
        .map(|c| be.to_device(Tensor::Host(c.clone())))
        .collect();
    let got = collect(&be, &w, Some(&resident), cfg, &rope, &xs, true);
    let want = collect(
        &CpuBackend,
        &w,
        None,
        cfg,
        &rope,
        &host_tensors(&chunks),
        true,
    );
    compare_stats(&got, &want, 1e-2, "cuda device sums");

    // The same statistics from parked chunks (pinned host memory, each staged on the copy stream while the
    // one before computes): the same kernels on the same values, so equal to the resident route.
    let parked: Vec<Tensor> = xs
        .iter()
        .map(|c| be.to_host(be.duplicate(c), true))
        .collect();
    assert!(parked.iter().all(|c| matches!(c, Tensor::Pinned(_))));
    let from_parked = collect(&be, &w, Some(&resident), cfg, &rope, &parked, true);
    compare_stats(&from_parked, &got, 1e-6, "parked vs resident chunks");
}
