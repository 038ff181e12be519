//! Parity of the model ops on every backend (style.md rule 11: one test body per op, instantiated for the CPU
//! always and for CUDA when a GPU, a driver and embedded kernels are present, otherwise printing why not).
//!
//! References are computed here in f64 from fresh random inputs on every run (METHOD.md "Correct first");
//! the seed is printed, and BOA_TEST_SEED=<u64> replays a run. CUDA outputs are poisoned with NaN before each
//! launch, so an element a kernel forgets to write fails the test.

use boa_cuda::backend::cpu::CpuBackend;
use boa_cuda::backend::cuda::{
    AttentionVariant, CudaBackend, LinearVariant, RmsNormVariant, abi, kernels,
};
use boa_cuda::backend::{Backend, Device, select_backend};
use boa_cuda::model::llama::RopeTable;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32 RMSNorm vs the f64 reference, normwise: ‖y − ref‖ / ‖ref‖. With f32 unit roundoff u = 6e-8, the sum of
/// d ≤ 4096 squares (all positive, so no cancellation) is off by ≤ d·u ≈ 2.4e-4 in the worst case and by
/// ~√d·u ≈ 4e-6 in practice (a tree or sequential sum alike); the reciprocal square root (rsqrtf: 2 ulp) and
/// the two products add a few u per element. 2e-5 leaves 5× headroom over the practical error and is 50×
/// under METHOD.md's "far under 1e-3" for f32; a kernel bug (wrong row, wrong mean, missed element) is O(1).
const RMS_NORM_TOL: f64 = 2e-5;

/// Row lengths: Llama hidden sizes (576 SmolLM-135M, 4096 7B), a small one, d % 4 == 0 without being a power
/// of two (1000), and lengths that force the scalar path of the vectorized variant (1001, 1; 1002, even, whose
/// rows past the first start 8 bytes off a 16-byte boundary).
const RMS_NORM_D: [usize; 7] = [576, 64, 4096, 1000, 1001, 1002, 1];
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
            let y = b.rms_norm(&x, &w, d, eps).unwrap();
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

// --- linear ------------------------------------------------------------------------------------------------

/// f32 linear (cublasSgemm or faer) vs the f64 reference, normwise. A dot product of k random-sign terms
/// summed in f32 is off by ~u·√k relative to its size in the worst (sequential) order: 6e-8·64 ≈ 4e-6 at
/// k = 4096, less for blocked or tree orders; the bias add is one more rounding. 2e-5 leaves 5× headroom and
/// is 50× under METHOD.md's "far under 1e-3" for f32 (TF32 would land near 3e-4 and fail, as it should:
/// the handle keeps CUBLAS_DEFAULT_MATH).
const LINEAR_TOL: f64 = 2e-5;
/// bf16 operands (cublasGemmEx): each operand is rounded to 8 significant bits (u = 2^-8 ≈ 3.9e-3,
/// rounding error roughly uniform, std ≈ u/√3), so each product is off by ≈ √2·u/√3 ≈ 3.2e-3 relative with
/// random sign, and so is a sum of many such products: ≈ 3e-3 normwise expected. 1e-2 is METHOD.md's upper
/// end for bf16 operands; a layout bug (transposed W, wrong ld) is O(1).
const LINEAR_BF16_TOL: f64 = 1e-2;

/// (m, k, n): one token with k = 1 (64 outputs, not 1: a lone output plus a bias can cancel to near 0 and make
/// any relative error unbounded; normwise over 64 that cannot dominate); SmolLM2's 576 → 1536 (gate/up) on a partial batch; odd sizes
/// everywhere; a 7B-wide output (4096) with few tokens; a 7B-wide input (k = 4096), m past one 128 tile.
const LINEAR_SHAPES: [(usize, usize, usize); 6] = [
    (1, 1, 64),
    (7, 576, 1536),
    (33, 1001, 17),
    (3, 64, 4096),
    (130, 4096, 96),
    (64, 128, 576),
];

fn linear_ref(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f64> {
    let mut y = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|c| x[i * k + c] as f64 * w[j * k + c] as f64)
                .sum();
            y[i * n + j] = dot + bias.map_or(0.0, |b| b[j] as f64);
        }
    }
    y
}

fn parity_linear(b: &dyn Backend, tol: f64) {
    let mut rng = rng();
    let mut worst = 0f64;
    for (m, k, n) in LINEAR_SHAPES {
        for with_bias in [false, true] {
            // Rows of X at different magnitudes, so a row mixed with another shows.
            let mut x = Vec::with_capacity(m * k);
            for _ in 0..m {
                let scale = 10f32.powf(rng.random_range(-1.0..1.0));
                x.extend((0..k).map(|_| scale * rng.random_range(-1.0f32..1.0)));
            }
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let bias: Option<Vec<f32>> =
                with_bias.then(|| (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect());
            let y = b.linear(&x, &w, bias.as_deref(), m, k, n).unwrap();
            assert_eq!(y.len(), m * n, "{}: linear output length", b.name());
            let err = rel_err(&y, &linear_ref(&x, &w, bias.as_deref(), m, k, n));
            assert!(
                err <= tol,
                "{}: linear m={m} k={k} n={n} bias={with_bias}: rel. error {err:.3e} > {tol:.0e} (NaN = unwritten output)",
                b.name()
            );
            worst = worst.max(err);
        }
    }
    println!(
        "{}: linear max rel. error {worst:.3e} (bound {tol:.0e})",
        b.name()
    );
}

// --- rope --------------------------------------------------------------------------------------------------

/// Each rotated element is x1·cos − x2·sin (two products and a sum: a few u) from f32 tables the reference
/// reads too, so the error is a few u per element: 2e-6 normwise is ~10× that; a wrong position, half or head
/// is O(1).
const ROPE_TOL: f64 = 2e-6;

/// (n_seq, t, n_heads, d_h): one token; SmolLM2 (9 heads of 64) on 3 sequences of 37; 7B-like d_h = 128 with
/// 70 positions; d_h = 2 (one pair); an odd d_h (the last element stays as is, like the CPU twin).
const ROPE_SHAPES: [(usize, usize, usize, usize); 5] = [
    (1, 1, 1, 64),
    (3, 37, 9, 64),
    (2, 70, 4, 128),
    (1, 5, 3, 2),
    (2, 17, 2, 7),
];

fn parity_rope(b: &dyn Backend) {
    let mut rng = rng();
    let mut worst = 0f64;
    for (n_seq, t, n_heads, d_h) in ROPE_SHAPES {
        let half = d_h / 2;
        // Llama's frequencies, θ = 1e4; the table is longer than t (built for a longer context), as in runs.
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| 1e4f64.powf(-((2 * i) as f64) / d_h as f64))
            .collect();
        let table = RopeTable::new(&inv_freq, t + 3);
        let width = n_heads * d_h;
        let x0: Vec<f32> = (0..n_seq * t * width)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut reference: Vec<f64> = x0.iter().map(|&v| v as f64).collect();
        for (r, row) in reference.chunks_mut(width).enumerate() {
            let p = r % t;
            for head in row.chunks_mut(d_h) {
                for i in 0..half {
                    let (c, s) = (
                        table.cos[p * half + i] as f64,
                        table.sin[p * half + i] as f64,
                    );
                    let (x1, x2) = (head[i], head[i + half]);
                    head[i] = x1 * c - x2 * s;
                    head[i + half] = x2 * c + x1 * s;
                }
            }
        }
        let mut x = x0.clone();
        b.rope(&mut x, t, n_heads, d_h, &table.cos, &table.sin)
            .unwrap();
        let err = rel_err(&x, &reference);
        assert!(
            err <= ROPE_TOL,
            "{}: rope n_seq={n_seq} t={t} n_heads={n_heads} d_h={d_h}: rel. error {err:.3e} > {ROPE_TOL:.0e}",
            b.name()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: rope max rel. error {worst:.3e} (bound {ROPE_TOL:.0e})",
        b.name()
    );
}

// --- swiglu ------------------------------------------------------------------------------------------------

/// silu(g)·u = g/(1 + e^−g)·u: e^x within 2–3 ulp (expf, or the CPU's exp_f32), then a sum, a division and a
/// product: under 10 u per element, ~6e-7; 2e-6 normwise leaves 3× over that worst case.
const SWIGLU_TOL: f64 = 2e-6;
/// Lengths: one element, a partial block, one past a power of two, more than one grid-stride step's worth
/// is not needed (the grid covers 65535·8·256 elements), so a large realistic one: 512 tokens × 1536.
const SWIGLU_N: [usize; 4] = [1, 7, 4097, 512 * 1536];

fn parity_swiglu(b: &dyn Backend) {
    let mut rng = rng();
    let mut worst = 0f64;
    for n in SWIGLU_N {
        // Mostly |g| < 8 (where silu bends), a few far out (±100: e^−g overflows or vanishes).
        let gate: Vec<f32> = (0..n)
            .map(|i| {
                if i % 97 == 5 {
                    rng.random_range(-100.0f32..100.0)
                } else {
                    rng.random_range(-8.0f32..8.0)
                }
            })
            .collect();
        let up: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let y = b.swiglu(&gate, &up).unwrap();
        assert_eq!(y.len(), n, "{}: swiglu output length", b.name());
        let reference: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| {
                let g = g as f64;
                g / (1.0 + (-g).exp()) * u as f64
            })
            .collect();
        let err = rel_err(&y, &reference);
        assert!(
            err <= SWIGLU_TOL,
            "{}: swiglu n={n}: rel. error {err:.3e} > {SWIGLU_TOL:.0e} (NaN = unwritten output)",
            b.name()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: swiglu max rel. error {worst:.3e} (bound {SWIGLU_TOL:.0e})",
        b.name()
    );
}

// --- geglu -------------------------------------------------------------------------------------------------

/// gelu_tanh in f32 (the CPU's f32 polynomial and tanh, or CUDA's tanhf within 2 ulp, FMA-contracted) vs the
/// f64 formula. For g < 0, 1 + tanh(z) cancels (at g = −5, tanh(z) = −1 + 1e-8 rounds to −1 and the f32
/// result is 0 against 5e-8·|u| in f64): the formula's own f32 error is absolute, a few u of the terms
/// ½·|g|·|u|·(1 + |tanh z|), not of the result. So the error is taken normwise against the terms' scale,
/// ‖y − ref‖ / ‖g ⊙ u‖ ≲ 3u ≈ 2e-7; 2e-6 leaves 10× headroom. A wrong constant (√(2/π) or 0.044715) moves
/// every unsaturated element by ~1e-4 of g·u.
const GEGLU_TOL: f64 = 2e-6;

fn parity_geglu(b: &dyn Backend) {
    let mut rng = rng();
    let mut worst = 0f64;
    for n in SWIGLU_N {
        // Mostly |g| < 6 (where gelu bends), a few far out (±100: tanh saturates).
        let gate: Vec<f32> = (0..n)
            .map(|i| {
                if i % 97 == 5 {
                    rng.random_range(-100.0f32..100.0)
                } else {
                    rng.random_range(-6.0f32..6.0)
                }
            })
            .collect();
        let up: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let y = b.geglu(&gate, &up).unwrap();
        assert_eq!(y.len(), n, "{}: geglu output length", b.name());
        let beta = (2.0 / std::f64::consts::PI).sqrt();
        let reference: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| {
                let g = g as f64;
                0.5 * g * (1.0 + (beta * (g + 0.044715 * g * g * g)).tanh()) * u as f64
            })
            .collect();
        let (mut num, mut den) = (0f64, 0f64);
        for ((&a, &r), (&g, &u)) in y.iter().zip(&reference).zip(gate.iter().zip(&up)) {
            num += (a as f64 - r).powi(2); // NaN (an unwritten output) propagates and fails
            den += (g as f64 * u as f64).powi(2);
        }
        let err = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        assert!(
            err <= GEGLU_TOL,
            "{}: geglu n={n}: rel. error {err:.3e} > {GEGLU_TOL:.0e} (NaN = unwritten output)",
            b.name()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: geglu max rel. error {worst:.3e} (bound {GEGLU_TOL:.0e})",
        b.name()
    );
}

// --- embedding -------------------------------------------------------------------------------------------

/// (vocab, d, tokens): SmolLM2's width over a small vocabulary, a width that is no multiple of 4 with one
/// token, and more output elements than one elementwise grid covers (the grid-stride loop).
const EMBED_SHAPES: [(usize, usize, usize); 3] = [(50, 576, 37), (7, 1001, 1), (300, 4096, 1100)];

/// The gather moves values and computes at most one f32 product (Gemma's √d scale), so it must match the host
/// row copy times the scale bit for bit, unscaled and scaled, from a table in the backend's own memory
/// (`upload_weight`) and from a host tensor alike; an id past the table is refused (the CUDA kernel would read
/// out of bounds).
fn parity_embed(b: &dyn Backend) {
    use boa_cuda::backend::Tensor;
    let mut rng = rng();
    for (vocab, d, tokens) in EMBED_SHAPES {
        let table: Vec<f32> = (0..vocab * d)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        // The first and last rows, and repeats.
        let mut ids: Vec<u32> = (0..tokens)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect();
        ids[0] = (vocab - 1) as u32;
        if tokens > 2 {
            ids[1] = 0;
            ids[2] = ids[0];
        }
        let resident = b.upload_weight(&table).unwrap();
        let host = Tensor::Host(table.clone());
        for scale in [1.0, (d as f32).sqrt()] {
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| table[i as usize * d..(i as usize + 1) * d].iter())
                .map(|&v| v * scale)
                .collect();
            for t in [resident.as_ref(), Some(&host)].into_iter().flatten() {
                let x = b.embed_t(t, &ids, d, scale).unwrap();
                assert_eq!(
                    b.read(&x).unwrap().as_ref(),
                    want.as_slice(),
                    "{}: embed vocab={vocab} d={d} tokens={tokens} scale={scale} from {t:?}",
                    b.name()
                );
            }
        }
    }
    println!(
        "{}: embed bit-exact at {} shapes",
        b.name(),
        EMBED_SHAPES.len()
    );
}

#[test]
fn embed_refuses_an_id_past_the_table_on_cuda() {
    with_cuda(|b| {
        let table = boa_cuda::backend::Tensor::Host(vec![0.0; 4 * 8]);
        let e = b.try_embed_t(&table, &[1, 4], 8, 1.0).unwrap_err();
        assert!(e.to_string().contains("token id 4"), "{e}");
    });
}

// --- attention ---------------------------------------------------------------------------------------------

/// Scores s = q·k/√d_h in f32 are off by ~u·Σ|q_c k_c|/√d_h ≲ 6e-8 × 30 ≈ 2e-6 absolute for the scores drawn
/// here (|s| up to ~20), which is the relative error it puts on e^(s − max); e^x adds 2–3 ulp, the row sum and
/// the P·V sum (≤ 200 terms) ~u·√t ≈ 1e-6. So ~3e-6 in practice; 2e-5 is ~7× that and still 50× under
/// METHOD.md's f32 bound. A mask off by one, a wrong KV head or a missed rescale is O(1e-2) or more.
const ATTN_TOL: f64 = 2e-5;

/// (n_seq, t, h, h_kv, d_h): one token; GQA 2:1 over two 64-query tiles plus a partial; d_h = 128 with t one
/// past two tiles and GQA 3:1; SmolLM2 (9 heads over 3 KV heads of 64); d_h = 80 (padded into the d128
/// kernel); no GQA (h = h_kv), d_h = 32; four key tiles of 128-wide heads, GQA 2:1; an odd d_h (17); d_h = 192
/// (padded into the d256 kernel); d_h = 256 (Gemma 3) over three 32-row query tiles, GQA 2:1.
const ATTN_SHAPES: [(usize, usize, usize, usize, usize); 10] = [
    (1, 1, 1, 1, 64),
    (2, 70, 4, 2, 64),
    (1, 129, 6, 2, 128),
    (3, 37, 9, 3, 64),
    (1, 65, 2, 1, 80),
    (2, 33, 4, 4, 32),
    (1, 200, 4, 2, 128),
    (1, 20, 3, 1, 17),
    (1, 5, 2, 2, 192),
    (1, 70, 4, 2, 256),
];

/// Q [n·t × h·d_h] or K/V [n·t × h_kv·d_h] with random rows; query rows get a random scale 10^±1, so some
/// softmax rows are nearly flat and others peaked (the max subtraction and the online rescale both matter).
fn attn_input(rng: &mut ChaCha8Rng, rows: usize, width: usize, row_scale: bool) -> Vec<f32> {
    let mut x = Vec::with_capacity(rows * width);
    for _ in 0..rows {
        let scale = if row_scale {
            10f32.powf(rng.random_range(-1.0..1.0))
        } else {
            1.0
        };
        x.extend((0..width).map(|_| scale * rng.random_range(-1.0f32..1.0)));
    }
    x
}

/// Causal softmax probabilities [t × t] of one (sequence, head) in f64: Q rows at q[(i)·q_stride + q_off..],
/// K rows at k[j·k_stride + k_off..]; query i sees keys i − window < j ≤ i (window ≥ t: every earlier key).
#[allow(clippy::too_many_arguments)]
fn probs_ref(
    q: &[f32],
    k: &[f32],
    t: usize,
    d_h: usize,
    (q_stride, q_off): (usize, usize),
    (k_stride, k_off): (usize, usize),
    window: usize,
) -> Vec<f64> {
    let scale = 1.0 / (d_h as f64).sqrt();
    let mut p = vec![0f64; t * t];
    for i in 0..t {
        let lo = (i + 1).saturating_sub(window);
        let row = &mut p[i * t..(i + 1) * t];
        for (j, pj) in row.iter_mut().enumerate().take(i + 1).skip(lo) {
            *pj = (0..d_h)
                .map(|c| q[i * q_stride + q_off + c] as f64 * k[j * k_stride + k_off + c] as f64)
                .sum::<f64>()
                * scale;
        }
        let live = &mut row[lo..=i];
        let max = live.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = live.iter().map(|s| (s - max).exp()).sum();
        for pj in live {
            *pj = (*pj - max).exp() / sum;
        }
    }
    p
}

fn parity_attention_probs(b: &dyn Backend) {
    let mut rng = rng();
    let mut worst = 0f64;
    for (_, t, h, h_kv, d_h) in ATTN_SHAPES {
        let q = attn_input(&mut rng, t, h * d_h, true);
        let k = attn_input(&mut rng, t, h_kv * d_h, false);
        let p = b.attention_probs(&q, &k, t, h, h_kv, d_h).unwrap();
        assert_eq!(
            p.len(),
            h * t * t,
            "{}: attention_probs output length",
            b.name()
        );
        let mut reference = Vec::with_capacity(h * t * t);
        for head in 0..h {
            let kv = head / (h / h_kv);
            reference.extend(probs_ref(
                &q,
                &k,
                t,
                d_h,
                (h * d_h, head * d_h),
                (h_kv * d_h, kv * d_h),
                t,
            ));
        }
        let err = rel_err(&p, &reference);
        assert!(
            err <= ATTN_TOL,
            "{}: attention_probs t={t} h={h} h_kv={h_kv} d_h={d_h}: rel. error {err:.3e} > {ATTN_TOL:.0e} \
             (NaN = unwritten output)",
            b.name()
        );
        // Above the diagonal: exactly 0 (the V statistics sum these).
        for head in 0..h {
            for i in 0..t {
                for j in i + 1..t {
                    let v = p[(head * t + i) * t + j];
                    assert!(
                        v == 0.0,
                        "{}: attention_probs head {head} P[{i}, {j}] = {v} above the diagonal",
                        b.name()
                    );
                }
            }
        }
        worst = worst.max(err);
    }
    println!(
        "{}: attention_probs max rel. error {worst:.3e} (bound {ATTN_TOL:.0e})",
        b.name()
    );
}

/// O of causal GQA attention in f64 from the f64 probabilities (`probs_ref`, `window` as there).
fn attention_ref(
    (q, k, v): (&[f32], &[f32], &[f32]),
    n_seq: usize,
    (t, h, h_kv, d_h): (usize, usize, usize, usize),
    window: usize,
) -> Vec<f64> {
    let (qw, kw) = (h * d_h, h_kv * d_h);
    let mut reference = vec![0f64; n_seq * t * qw];
    for s in 0..n_seq {
        let (qs, ks) = (
            &q[s * t * qw..(s + 1) * t * qw],
            &k[s * t * kw..(s + 1) * t * kw],
        );
        let vs = &v[s * t * kw..(s + 1) * t * kw];
        for head in 0..h {
            let kv = head / (h / h_kv);
            let p = probs_ref(qs, ks, t, d_h, (qw, head * d_h), (kw, kv * d_h), window);
            for i in 0..t {
                for c in 0..d_h {
                    reference[(s * t + i) * qw + head * d_h + c] = (0..=i)
                        .map(|j| p[i * t + j] * vs[j * kw + kv * d_h + c] as f64)
                        .sum();
                }
            }
        }
    }
    reference
}

fn parity_causal_attention(b: &dyn Backend) {
    let mut rng = rng();
    let mut worst = 0f64;
    for (n_seq, t, h, h_kv, d_h) in ATTN_SHAPES {
        let (qw, kw) = (h * d_h, h_kv * d_h);
        let q = attn_input(&mut rng, n_seq * t, qw, true);
        let k = attn_input(&mut rng, n_seq * t, kw, false);
        let v = attn_input(&mut rng, n_seq * t, kw, false);
        let o = b
            .causal_attention(&q, &k, &v, n_seq, t, h, h_kv, d_h)
            .unwrap();
        assert_eq!(
            o.len(),
            n_seq * t * qw,
            "{}: causal_attention output length",
            b.name()
        );
        let reference = attention_ref((&q, &k, &v), n_seq, (t, h, h_kv, d_h), t);
        let err = rel_err(&o, &reference);
        assert!(
            err <= ATTN_TOL,
            "{}: causal_attention n_seq={n_seq} t={t} h={h} h_kv={h_kv} d_h={d_h}: rel. error {err:.3e} > \
             {ATTN_TOL:.0e} (NaN = unwritten output)",
            b.name()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: causal_attention max rel. error {worst:.3e} (bound {ATTN_TOL:.0e})",
        b.name()
    );
}

/// (n_seq, t, h, h_kv, d_h, window) of the sliding-window attention (Mistral; Gemma 3's local layers, d_h 256):
/// a window shorter than one key tile over several tiles and sequences; a 128-wide head with t one past two
/// query tiles; d_h = 256 (the wide flash kernel: 32-row CTAs, 16-key tiles) whose later rows see nothing of
/// the first tiles; a window of 1 (each query sees only itself: O = V); a window one short of t; and one
/// longer than t (no window at all).
const WINDOW_SHAPES: [(usize, usize, usize, usize, usize, usize); 6] = [
    (2, 70, 4, 2, 64, 24),
    (1, 129, 2, 1, 128, 40),
    (1, 75, 2, 1, 256, 20),
    (1, 33, 3, 3, 17, 1),
    (1, 40, 2, 2, 256, 39),
    (1, 20, 2, 1, 80, 64),
];

/// `causal_attention_t` with a window against the f64 reference of the windowed softmax, on tensors as the
/// block forward calls it (the tolerance of the causal one: the window only removes terms).
fn parity_windowed_attention(b: &dyn Backend) {
    use boa_cuda::backend::Tensor;
    let mut rng = rng();
    let mut worst = 0f64;
    for (n_seq, t, h, h_kv, d_h, window) in WINDOW_SHAPES {
        let (qw, kw) = (h * d_h, h_kv * d_h);
        let q = attn_input(&mut rng, n_seq * t, qw, true);
        let k = attn_input(&mut rng, n_seq * t, kw, false);
        let v = attn_input(&mut rng, n_seq * t, kw, false);
        let up = |x: &[f32]| b.to_device(Tensor::Host(x.to_vec())).unwrap();
        let o = b
            .causal_attention_t(
                &up(&q),
                &up(&k),
                &up(&v),
                n_seq,
                t,
                h,
                h_kv,
                d_h,
                Some(window),
            )
            .unwrap();
        let o = b.read(&o).unwrap();
        assert_eq!(o.len(), n_seq * t * qw, "{}: output length", b.name());
        let reference = attention_ref((&q, &k, &v), n_seq, (t, h, h_kv, d_h), window);
        let err = rel_err(&o, &reference);
        assert!(
            err <= ATTN_TOL,
            "{}: windowed attention n_seq={n_seq} t={t} h={h} h_kv={h_kv} d_h={d_h} window={window}: rel. \
             error {err:.3e} > {ATTN_TOL:.0e} (NaN = unwritten output)",
            b.name()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: windowed attention max rel. error {worst:.3e} (bound {ATTN_TOL:.0e})",
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

#[test]
fn parity_linear_cpu() {
    parity_linear(&CpuBackend, LINEAR_TOL);
}

#[test]
fn parity_linear_cuda() {
    with_cuda(|b| {
        if !b.linear_on_gpu() {
            println!("cuBLAS unavailable: linear runs on the CPU (checked anyway)");
        }
        for v in LinearVariant::ALL {
            println!("linear variant {v:?}");
            b.set_linear_variant(v);
            let tol = match v {
                LinearVariant::F32 => LINEAR_TOL,
                LinearVariant::Bf16 => LINEAR_BF16_TOL,
            };
            parity_linear(b, tol);
        }
    });
}

#[test]
fn parity_rope_cpu() {
    parity_rope(&CpuBackend);
}

#[test]
fn parity_rope_cuda() {
    with_cuda(|b| parity_rope(b));
}

#[test]
fn parity_swiglu_cpu() {
    parity_swiglu(&CpuBackend);
}

#[test]
fn parity_swiglu_cuda() {
    with_cuda(|b| parity_swiglu(b));
}

#[test]
fn parity_geglu_cpu() {
    parity_geglu(&CpuBackend);
}

#[test]
fn parity_geglu_cuda() {
    with_cuda(|b| parity_geglu(b));
}

/// (m, d, rows scattered): a whole expert of a 4-token chunk, a few rows of a 7B-wide chunk, a wide row.
const SCATTER_SHAPES: [(usize, usize, usize); 3] = [(4, 576, 4), (700, 4096, 90), (3, 7001, 1)];

// --- block_hadamard (R4's online transform) ----------------------------------------------------------------

/// x · (I ⊗ H_b/√b) vs the f64 product with the dense matrix, normwise. The CPU runs the fast transform in f64
/// and rounds once (~u); the CUDA kernel sums in f32: log₂ p butterfly additions and an m-term dense sum per
/// element, ≲ (log₂ p + m)·u ≈ 1e-6 at these orders (m ≤ 44). 1e-5 leaves 10× headroom; a wrong butterfly,
/// row or sign is O(1).
const HADAMARD_TOL: f64 = 1e-5;

/// Orders: pure dense (12 Paley I, 44), pure Sylvester (64, 2048), and Kronecker products (576 = 36 ⊗ 16,
/// 1536 = 12 ⊗ 128), each over a few runs.
fn parity_block_hadamard(b: &dyn Backend) {
    use boa_cuda::backend::{Tensor, Weight};
    use boa_cuda::model::online::OnlineQ;
    let mut rng = rng();
    let mut worst = 0f64;
    for (n, runs) in [(12, 5), (44, 3), (64, 7), (576, 3), (1536, 2), (2048, 2)] {
        let q = OnlineQ::new(n).unwrap();
        let dense = q.h.dense();
        let x: Vec<f32> = (0..runs * n)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let scale = 1.0 / (n as f64).sqrt();
        let mut reference = vec![0f64; runs * n];
        for r in 0..runs {
            for i in 0..n {
                let xi = x[r * n + i] as f64;
                for j in 0..n {
                    reference[r * n + j] += xi * dense[i * n + j] * scale;
                }
            }
        }
        let x_t = b.to_device(Tensor::Host(x)).unwrap();
        let y = b
            .block_hadamard_t(&x_t, &q.h, Weight::host(&q.dense))
            .unwrap();
        let err = rel_err(&b.read(&y).unwrap(), &reference);
        assert!(
            err <= HADAMARD_TOL,
            "{}: block_hadamard {}: rel. error {err:.3e} > {HADAMARD_TOL:.0e} (NaN = unwritten output)",
            b.name(),
            q.h.describe()
        );
        worst = worst.max(err);
    }
    println!(
        "{}: block_hadamard max rel. error {worst:.3e} (bound {HADAMARD_TOL:.0e})",
        b.name()
    );
}

#[test]
fn parity_block_hadamard_cpu() {
    parity_block_hadamard(&CpuBackend);
}

#[test]
fn parity_block_hadamard_cuda() {
    with_cuda(|b| parity_block_hadamard(b));
}

/// `scatter_add_rows_t` against a plain loop, bit for bit, on a device accumulator and on a host one (the
/// CUDA backend uploads it); and its refusals of a repeated or out-of-range row.
fn parity_scatter_add_rows(b: &dyn Backend) {
    use boa_cuda::backend::Tensor;
    let mut rng = rng();
    for (m, d, n) in SCATTER_SHAPES {
        let base: Vec<f32> = (0..m * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let y: Vec<f32> = (0..n * d).map(|_| rng.random_range(-4.0f32..4.0)).collect();
        let w: Vec<f32> = (0..n).map(|_| rng.random_range(0.0f32..1.0)).collect();
        // n distinct rows in a shuffled order, the last row among them.
        let mut rows: Vec<u32> = (0..m as u32).collect();
        for i in (1..rows.len()).rev() {
            rows.swap(i, rng.random_range(0..=i));
        }
        rows.truncate(n);
        if !rows.contains(&((m - 1) as u32)) {
            rows[0] = (m - 1) as u32;
        }
        let mut want = base.clone();
        for (r, (&row, &wr)) in rows.iter().zip(&w).enumerate() {
            for c in 0..d {
                want[row as usize * d + c] += y[r * d + c] * wr;
            }
        }
        let y_t = b.to_device(Tensor::Host(y.clone())).unwrap();
        for on_device in [true, false] {
            let mut out = Tensor::Host(base.clone());
            if on_device {
                out = b.to_device(out).unwrap();
            }
            b.scatter_add_rows_t(&mut out, &y_t, d, &rows, &w).unwrap();
            assert_eq!(
                b.read(&out).unwrap().as_ref(),
                want.as_slice(),
                "{}: scatter_add_rows m={m} d={d} rows={n} (accumulator on the device: {on_device})",
                b.name()
            );
        }
    }
    let mut out = b.to_device(Tensor::Host(vec![0.0; 4 * 8])).unwrap();
    let y = b.to_device(Tensor::Host(vec![1.0; 2 * 8])).unwrap();
    for (rows, why) in [([1u32, 1], "appears twice"), ([0, 4], "outside")] {
        let err = b
            .scatter_add_rows_t(&mut out, &y, 8, &rows, &[1.0, 1.0])
            .unwrap_err();
        assert!(format!("{err:#}").contains(why), "{}: {err:#}", b.name());
    }
    println!(
        "{}: scatter_add_rows bit-exact at {} shapes",
        b.name(),
        SCATTER_SHAPES.len()
    );
}

#[test]
fn parity_scatter_add_rows_cpu() {
    parity_scatter_add_rows(&CpuBackend);
}

#[test]
fn parity_scatter_add_rows_cuda() {
    with_cuda(|b| parity_scatter_add_rows(b));
}

#[test]
fn parity_embed_cpu() {
    parity_embed(&CpuBackend);
}

#[test]
fn parity_embed_cuda() {
    with_cuda(|b| parity_embed(b));
}

#[test]
fn parity_attention_probs_cpu() {
    parity_attention_probs(&CpuBackend);
}

#[test]
fn parity_attention_probs_cuda() {
    with_cuda(|b| parity_attention_probs(b));
}

#[test]
fn parity_causal_attention_cpu() {
    parity_causal_attention(&CpuBackend);
}

#[test]
fn parity_causal_attention_cuda() {
    with_cuda(|b| {
        // Every variant, the naive one included (style.md rules 4 and 12); d_h = 192 and 256 run the flash
        // variant's widest kernel (kD = 256).
        for v in AttentionVariant::ALL {
            println!("causal_attention variant {v:?}");
            b.set_attention_variant(v);
            parity_causal_attention(b);
        }
    });
}

#[test]
fn parity_windowed_attention_cpu() {
    parity_windowed_attention(&CpuBackend);
}

#[test]
fn parity_windowed_attention_cuda() {
    with_cuda(|b| {
        for v in AttentionVariant::ALL {
            println!("windowed attention variant {v:?}");
            b.set_attention_variant(v);
            parity_windowed_attention(b);
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
