//! Parity of the model ops on every backend (style.md rule 11: one test body per op, instantiated for the CPU
//! always and for CUDA when a GPU, a driver and embedded kernels are present, otherwise printing why not).
//!
//! References are computed here in f64 from fresh random inputs on every run (METHOD.md "Correct first");
//! the seed is printed, and BOA_TEST_SEED=<u64> replays a run. CUDA outputs are poisoned with NaN before each
//! launch, so an element a kernel forgets to write fails the test.

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::cuda::{CudaBackend, RmsNormVariant, abi, kernels};
use boa_cuda::backend::{Backend, Device, select_backend};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 RMSNorm vs the f64 reference, normwise: ‖y − ref‖ / ‖ref‖. With f32 unit roundoff u = 6e-8, the sum of
/// d ≤ 4096 squares (all positive, so no cancellation) is off by ≤ d·u ≈ 2.4e-4 in the worst case and by
/// ~√d·u ≈ 4e-6 in practice (a tree or sequential sum alike); the reciprocal square root (rsqrtf: 2 ulp) and
/// the two products add a few u per element. 2e-5 leaves 5× headroom over the practical error and is 50×
/// under METHOD.md's "far under 1e-3" for f32; a kernel bug (wrong row, wrong mean, missed element) is O(1).
const RMS_NORM_TOL: f64 = 2e-5;

/// Row lengths: Llama hidden sizes (576 SmolLM-135M, 4096 7B), a small one, d % 4 == 0 without being a power
/// of two (1000), and lengths that force the scalar path of the vectorized variant (1001, 1).
const RMS_NORM_D: [usize; 6] = [576, 64, 4096, 1000, 1001, 1];
/// Row counts: one row, a partial block of every variant (7), many blocks (512).
const RMS_NORM_ROWS: [usize; 3] = [1, 7, 512];

fn rng() -> ChaCha8Rng {
    let seed = std::env::var("BOA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    println!("seed {seed} (BOA_TEST_SEED={seed} replays)");
    ChaCha8Rng::seed_from_u64(seed)
}

fn rel_err(y: &[f32], reference: &[f64]) -> f64 {
    assert_eq!(y.len(), reference.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &r) in y.iter().zip(reference) {
        // NaN (unwritten poisoned output, or a real NaN) must never pass: propagate it.
        num += (a as f64 - r).powi(2);
        den += r * r;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn rms_norm_ref(x: &[f32], w: &[f32], d: usize, eps: f32) -> Vec<f64> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        y.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * r * g as f64));
    }
    y
}

fn parity_rms_norm(b: &dyn Backend) {
    let mut rng = rng();
    let eps = 1e-5f32;
    let mut worst = 0f64;
    for d in RMS_NORM_D {
        for rows in RMS_NORM_ROWS {
            // Rows of very different magnitudes (10^±2), so a mean taken over the wrong row shows.
            let mut x = Vec::with_capacity(rows * d);
            for _ in 0..rows {
                let scale = 10f32.powf(rng.random_range(-2.0..2.0));
                x.extend((0..d).map(|_| scale * rng.random_range(-1.0f32..1.0)));
            }
            let w: Vec<f32> = (0..d).map(|_| rng.random_range(0.5f32..1.5)).collect();
            let y = b.rms_norm(&x, &w, d, eps);
            assert_eq!(y.len(), rows * d, "{}: rms_norm output length", b.name());
            let err = rel_err(&y, &rms_norm_ref(&x, &w, d, eps));
            assert!(
                err <= RMS_NORM_TOL,
                "{}: rms_norm rows={rows} d={d}: rel. error {err:.3e} > {RMS_NORM_TOL:.0e} (NaN = unwritten output)",
                b.name()
            );
            worst = worst.max(err);
        }
    }
    println!(
        "{}: rms_norm max rel. error {worst:.3e} (bound {RMS_NORM_TOL:.0e})",
        b.name()
    );
}

/// Runs `f` on a CUDA backend (device 0, outputs poisoned) or prints why it is skipped.
fn with_cuda(f: impl FnOnce(&mut CudaBackend)) {
    match CudaBackend::new(0) {
        Ok(mut b) => {
            b.set_poison_outputs(true);
            f(&mut b)
        }
        Err(why) => println!("skipped: {why}"),
    }
}

#[test]
fn parity_rms_norm_cpu() {
    parity_rms_norm(&CpuBackend);
}

#[test]
fn parity_rms_norm_cuda() {
    with_cuda(|b| {
        // Every variant, the naive one included (style.md rules 4 and 12).
        for v in RmsNormVariant::ALL {
            println!("rms_norm variant {v:?}");
            b.set_rms_norm_variant(v);
            parity_rms_norm(b);
        }
    });
}

/// The #[repr(C)] mirror and the host C++ compiler agree on BoaRmsNormParams (include/boa_ops.h).
#[test]
fn abi_rms_norm_params() {
    assert_eq!(
        abi::rust_layout_rms_norm_params(),
        abi::c_layout_rms_norm_params()
    );
}

/// `--device cuda` errors (never panics) when CUDA is unusable, with the same reason `auto` prints when it
/// falls back to the CPU; when CUDA is usable both pick it.
#[test]
fn select_backend_reports_why() {
    match CudaBackend::new(0) {
        Err(why) => {
            println!("no CUDA here: {why}");
            let err = select_backend(Device::Cuda)
                .err()
                .expect("--device cuda must fail without CUDA");
            assert!(
                err.to_string().contains(&why),
                "error {err} does not carry the reason {why}"
            );
            let (b, note) =
                select_backend(Device::Auto).expect("--device auto must fall back to the CPU");
            assert_eq!(b.name(), "cpu");
            let note = note.expect("auto falling back must say why");
            assert!(
                note.contains(&why),
                "note {note} does not carry the reason {why}"
            );
        }
        Ok(_) => {
            let (b, note) = select_backend(Device::Cuda).expect("--device cuda");
            assert!(b.name().starts_with("cuda"), "{}", b.name());
            assert!(note.is_none());
            let (b, _) = select_backend(Device::Auto).expect("--device auto");
            assert!(b.name().starts_with("cuda"), "{}", b.name());
        }
    }
    let (b, note) = select_backend(Device::Cpu).unwrap();
    assert_eq!((b.name().as_str(), note), ("cpu", None));
}

/// Prints what build.rs embedded (CI shows this with --nocapture); a build made with BOA_REQUIRE_KERNELS=1
/// must carry the kernels.
#[test]
fn embedded_kernels() {
    println!(
        "kernels present: {} ({}); fatbins: {:?}",
        kernels::PRESENT,
        kernels::NVCC_VERSION,
        kernels::FATBINS
            .iter()
            .map(|(s, b)| (*s, b.len()))
            .collect::<Vec<_>>()
    );
    println!("{}", kernels::PTXAS_REPORT);
    if option_env!("BOA_REQUIRE_KERNELS") == Some("1") {
        assert!(kernels::PRESENT && kernels::fatbin("ops").is_some());
    }
}
