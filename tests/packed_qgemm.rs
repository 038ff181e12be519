//! The CPU packed GEMM (`cpu::packed_linear_f32`, with its fast path `cpu::qgemm`: AVX-512 where the CPU has
//! AVX-512F, and the AVX2 kernel run explicitly) against dequantize + a naive f64 dot, on random shapes: odd d_out (masked column tails), bits
//! 2/3/4/8 (3-bit codes straddle words), groups 32/64/128/whole row, contiguous and act-order g_idx (the
//! latter takes the tile path), partial last groups, m = 1/3/16 (token runs of 8/4/2/1), d_in both a
//! multiple of 32 and not.

use boa_cuda::backend::cpu::{packed_linear_f32, qgemm};
use boa_cuda::bench::qgemm::random_packed;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[test]
fn packed_gemm_matches_dequantized_naive_dot() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut cases = 0;
    let mut fast_cases = 0;
    for bits in [2u32, 3, 4, 8] {
        for group in [32usize, 64, 128, 0] {
            for act_order in [false, true] {
                for m in [1usize, 3, 16] {
                    let d_out = 2 * rng.random_range(1..200usize) + 1;
                    // d_in: whole groups plus, half the time, a partial last group (a multiple of 32, as the
                    // demo's 576 = 4.5 × 128); for the whole-row group sometimes not a multiple of 32.
                    let d_in = if group == 0 {
                        [96, 200, 352][rng.random_range(0..3usize)]
                    } else {
                        group * rng.random_range(1..5usize) + 32 * rng.random_range(0..group / 32)
                    };
                    let g = if group == 0 { d_in } else { group };
                    let mut p = random_packed(d_out, d_in, bits, g, rng.random());
                    if act_order {
                        p.g_idx.shuffle(&mut rng);
                    }
                    let x: Vec<f32> = (0..m * d_in).map(|_| rng.random::<f32>() - 0.5).collect();
                    let w = p.dequantize();
                    let y = packed_linear_f32(&x, &p, m);
                    let fast = qgemm::packed_linear_fast(&x, &p, m);
                    // A shuffled g_idx of one group is still contiguous.
                    let fast_ok = p.contiguous_group().is_some() && d_in % 32 == 0;
                    if fast_ok {
                        assert!(fast.is_some(), "the fast path refused a contiguous case");
                        fast_cases += 1;
                    }
                    if let Some(f) = fast {
                        assert_eq!(f, y, "the dispatcher did not take the fast path");
                    }
                    // The AVX2 kernel too, where the dispatcher picked AVX-512.
                    let y2 = qgemm::packed_linear_fast_isa(&x, &p, m, qgemm::QgemmIsa::Avx2);
                    assert_eq!(y2.is_some(), fast_ok, "AVX2 coverage");
                    let y_ref: Vec<f64> = (0..m * d_out)
                        .map(|tj| {
                            let (t, j) = (tj / d_out, tj % d_out);
                            (0..d_in)
                                .map(|i| x[t * d_in + i] as f64 * w[j * d_in + i] as f64)
                                .sum()
                        })
                        .collect();
                    // f32 sums of ≤ 512 products, zero point folded per group: a few ulp of Σ|x·q|·s, which is
                    // ≲ 10× the output scale here; 1e-5 of the scale leaves a wide margin.
                    let scale = y_ref.iter().fold(0f64, |a, v| a.max(v.abs()));
                    for (what, y) in [("dispatched", Some(&y)), ("AVX2", y2.as_ref())] {
                        let Some(y) = y else { continue };
                        let err = y
                            .iter()
                            .zip(&y_ref)
                            .fold(0f64, |a, (p, r)| a.max((*p as f64 - r).abs()));
                        assert!(
                            err <= 1e-5 * scale,
                            "{what}: bits {bits} group {g} act_order {act_order} m {m} [{d_out} × {d_in}]: \
                             max error {err:e} vs scale {scale:e}"
                        );
                    }
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 96);
    println!("{fast_cases} of {cases} cases took the fast path (and the AVX2 kernel)");
}
