//! The tensor path of `run` (design.md §3: X and the statistics stay where the backend computes).
//!
//! On the CPU: the tensor forward is the host forward, and `stats::collect` over chunks of unequal size
//! equals the statistics of the whole input at once. On a GPU (skipped with the reason elsewhere): a block
//! forward with resident weights, the statistics (summed in f32 on the device), and parking X in pinned
//! memory, against the CPU.

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::cuda::CudaBackend;
use boa_cuda::backend::{Backend, Tensor};
use boa_cuda::model::Model;
use boa_cuda::model::llama::{ResidentWeights, block_forward, block_forward_host};
use boa_cuda::model::synth::{SynthSpec, write_model};
use boa_cuda::ops::QuantOps;
use boa_cuda::pipeline::stats::{BlockStats, MoeStats, collect};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

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

/// Every statistic as f64 vectors, named, read through the backend that holds them.
fn all_stats(ops: &dyn QuantOps, s: &BlockStats) -> Vec<(&'static str, Vec<f64>)> {
    let a = s.attn.as_ref().expect("attention-aware");
    let r = |m| ops.read_f64(m).unwrap();
    vec![
        ("h_attn", r(&s.h_attn)),
        ("h_o", r(&s.h_o)),
        ("h_mlp", r(&s.h_mlp)),
        ("h_down", r(s.h_down.as_ref().unwrap())),
        ("c_k", r(&a.c_k)),
        ("c_q", r(&a.c_q)),
        ("v_col", r(&a.v_col)),
    ]
}

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "different sizes");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn compare_stats(
    (g_ops, got): (&dyn QuantOps, &BlockStats),
    (w_ops, want): (&dyn QuantOps, &BlockStats),
    tol: f64,
    what: &str,
) {
    let (g, w) = (all_stats(g_ops, got), all_stats(w_ops, want));
    for ((name, g), (_, w)) in g.iter().zip(w.iter()) {
        assert!(g.iter().all(|v| v.is_finite()), "{what}: {name} not finite");
        let e = rel_err(g, w);
        println!("{what}: {name} rel. error {e:.2e} (bound {tol:.0e})");
        assert!(e <= tol, "{what}: {name} rel. error {e:.3e} > {tol:.0e}");
    }
}

fn host_tensors(chunks: &[Vec<f32>]) -> Vec<Tensor> {
    chunks.iter().map(|c| Tensor::Host(c.clone())).collect()
}

/// Statistics over chunks of unequal size (5 sequences in chunks of 2) equal those of one chunk of all:
/// token counts add up across sizes, and the statistics forward does not modify its inputs.
#[test]
fn statistics_over_chunks_match_one_chunk() {
    let tmp = tempfile::tempdir().unwrap();
    let (model, chunks) = setup(tmp.path(), 5, 24, 2);
    let w = model.load_block(0).unwrap();
    let rope = model.rope_table(24);
    let x = host_tensors(&chunks);
    let whole = vec![Tensor::Host(chunks.concat())];
    let cpu = CpuBackend;
    let got = collect(
        &cpu,
        &w,
        None,
        &model.cfg,
        &rope,
        &x,
        true,
        false,
        MoeStats::default(),
    )
    .unwrap();
    let want = collect(
        &cpu,
        &w,
        None,
        &model.cfg,
        &rope,
        &whole,
        true,
        false,
        MoeStats::default(),
    )
    .unwrap();
    // The same f64 sums in other 512-token chunks: rounding only.
    compare_stats((&cpu, &got), (&cpu, &want), 1e-6, "chunks of 2");
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
    let resident = ResidentWeights::upload(&CpuBackend, &w).unwrap();
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
    )
    .unwrap();
    let mut xh = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, &model.cfg, &rope, &mut xh, 2).unwrap();
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
    let x = CpuBackend.embed_t(&table, &ids, model.cfg.d, 1.0).unwrap();
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
    let parked = be
        .to_host(be.to_device(Tensor::Host(chunks[0].clone())).unwrap(), true)
        .unwrap();
    assert!(
        matches!(parked, Tensor::Pinned(_)),
        "not parked: {parked:?}"
    );
    let mut parked = parked;
    let back = be.to_device(be.duplicate(&parked).unwrap()).unwrap();
    assert!(back.on_device());
    assert_eq!(be.read(&back).unwrap().as_ref(), chunks[0].as_slice());
    // A forwarded chunk goes back into its pinned buffer (the pipeline's parked X).
    let reversed: Vec<f32> = chunks[0].iter().rev().copied().collect();
    let other = be.to_device(Tensor::Host(reversed.clone())).unwrap();
    be.write_back(&other, &mut parked).unwrap();
    assert!(matches!(parked, Tensor::Pinned(_)));
    assert_eq!(parked.host().unwrap(), reversed.as_slice());

    // Weight uploads: a length's first upload is pageable, later ones pass through its two page-locked
    // staging buffers in turn, and an upload may only overwrite a buffer once the copy before it from that
    // buffer has read it, whichever stream each copy is on (upload_weight: the copy stream;
    // upload_weight_now: the main one). Six uploads reuse each buffer twice.
    let uploads: Vec<Vec<f32>> = (0..6)
        .map(|k| (0..300_000).map(|i| (i * 6 + k) as f32).collect())
        .collect();
    let on_device: Vec<Tensor> = uploads
        .iter()
        .enumerate()
        .map(|(k, u)| {
            if k % 2 == 0 {
                be.upload_weight(u).unwrap()
            } else {
                be.upload_weight_now(u).unwrap()
            }
            .expect("a device copy")
        })
        .collect();
    for (u, d) in uploads.iter().zip(&on_device) {
        assert!(d.on_device());
        assert_eq!(
            be.read(d).unwrap().as_ref(),
            u.as_slice(),
            "a staged upload was overwritten"
        );
    }

    // One block forward with resident weights against the CPU (f32 SGEMM and f32 kernels), uploaded as the
    // pipeline does for the forward right after a block's quantization.
    let resident = ResidentWeights::upload_now(&be, &w).unwrap();
    let mut xd = be.to_device(Tensor::Host(chunks[0].clone())).unwrap();
    block_forward(&be, &w, Some(&resident), cfg, &rope, &mut xd, 2, None).unwrap();
    assert!(xd.on_device(), "the forward left the device");
    let mut xc = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, cfg, &rope, &mut xc, 2).unwrap();
    let got: Vec<f64> = be.read(&xd).unwrap().iter().map(|&v| v as f64).collect();
    let want: Vec<f64> = xc.iter().map(|&v| v as f64).collect();
    let e = rel_err(&got, &want);
    println!("{}: resident block forward rel. error {e:.2e}", be.name());
    assert!(e <= 1e-4, "resident block forward rel. error {e:.3e}");

    // The pipeline's prefetch: block 1's weights uploaded from another thread (copy stream, staging) while
    // this thread runs block 0 on the main stream; then block 1 runs on them.
    let w1 = model.load_block(1).unwrap();
    let (resident1, mut xd) = std::thread::scope(|s| {
        let h = s.spawn(|| ResidentWeights::upload(&be, &w1).unwrap());
        let mut xd = be.to_device(Tensor::Host(chunks[0].clone())).unwrap();
        block_forward(&be, &w, Some(&resident), cfg, &rope, &mut xd, 2, None).unwrap();
        (h.join().expect("prefetch thread"), xd)
    });
    block_forward(&be, &w1, Some(&resident1), cfg, &rope, &mut xd, 2, None).unwrap();
    let mut xc = chunks[0].clone();
    block_forward_host(&CpuBackend, &w, cfg, &rope, &mut xc, 2).unwrap();
    block_forward_host(&CpuBackend, &w1, cfg, &rope, &mut xc, 2).unwrap();
    let got: Vec<f64> = be.read(&xd).unwrap().iter().map(|&v| v as f64).collect();
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
        .map(|c| be.to_device(Tensor::Host(c.clone())).unwrap())
        .collect();
    let got = collect(
        &be,
        &w,
        Some(&resident),
        cfg,
        &rope,
        &xs,
        true,
        false,
        MoeStats::default(),
    )
    .unwrap();
    let want = collect(
        &CpuBackend,
        &w,
        None,
        cfg,
        &rope,
        &host_tensors(&chunks),
        true,
        false,
        MoeStats::default(),
    )
    .unwrap();
    compare_stats((&be, &got), (&CpuBackend, &want), 1e-2, "cuda device sums");

    // The same statistics from parked chunks (pinned host memory, each staged on the copy stream while the
    // one before computes): the same kernels on the same values, so equal to the resident route.
    let parked: Vec<Tensor> = xs
        .iter()
        .map(|c| be.to_host(be.duplicate(c).unwrap(), true).unwrap())
        .collect();
    assert!(parked.iter().all(|c| matches!(c, Tensor::Pinned(_))));
    let from_parked = collect(
        &be,
        &w,
        Some(&resident),
        cfg,
        &rope,
        &parked,
        true,
        false,
        MoeStats::default(),
    )
    .unwrap();
    compare_stats(
        (&be, &from_parked),
        (&be, &got),
        1e-6,
        "parked vs resident chunks",
    );
}
