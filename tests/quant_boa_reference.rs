//! BoA's fast sweep (2-D blocked: column blocks of 128, one trailing GEMM per block) gives the same integer
//! codes as the reference-style sweep (one column at a time, explicit E·U_col per row), in f64.

use boa_cuda::quant::boa::{ColFactor, boa_sweep};
use boa_cuda::quant::boa_reference::boa_sweep_reference;
use boa_cuda::quant::linalg::damped_upper_inverse;
use boa_cuda::quant::quantizer::{Grid, minmax_grid};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn spd(n: usize, rng: &mut ChaCha8Rng) -> Vec<f64> {
    let m = 3 * n;
    let x: Vec<f64> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut h = vec![0.0; n * n];
    for r in 0..m {
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] += x[r * n + i] * x[r * n + j] / m as f64;
            }
        }
    }
    h
}

#[test]
fn fast_sweep_equals_reference_sweep() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (n_heads, d_h, n, bits) in [(2, 4, 8, 3), (3, 8, 200, 2), (2, 16, 300, 4)] {
        let d_out = n_heads * d_h;
        let maxq = (1u32 << bits) - 1;
        let w: Vec<f64> = (0..d_out * n)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let u_col = damped_upper_inverse(&mut spd(n, &mut rng), n, 0.01, 4).unwrap();
        let mut u_row = Vec::new();
        for _ in 0..n_heads {
            u_row.extend(damped_upper_inverse(&mut spd(d_h, &mut rng), d_h, 0.01, 4).unwrap());
        }
        let grids: Vec<Grid<f64>> = w.chunks(n).map(|r| minmax_grid(r, maxq, false)).collect();
        let col_group = vec![0u32; n];
        let cols = [ColFactor {
            u: &u_col,
            col_group: &col_group,
            dynamic: None,
        }];
        let (mut wf, mut q, mut codes, mut g) = (
            w.clone(),
            vec![0.0; w.len()],
            vec![0u8; w.len()],
            grids.clone(),
        );
        boa_sweep(
            &mut wf,
            &mut q,
            &mut codes,
            &cols,
            &vec![0; n_heads],
            &u_row,
            n_heads,
            d_h,
            n,
            128,
            &mut g,
            1,
            maxq,
        );
        let mut wr = w.clone();
        let reference = boa_sweep_reference(&mut wr, &u_col, &u_row, n_heads, d_h, n, &grids, maxq);
        assert_eq!(codes, reference, "shape {n_heads}×{d_h}×{n}, {bits} bits");
    }
}
