//! Timings of the CPU quantization path on the demo model's shapes (d 576, 9 heads / 3 KV heads, d_h 64,
//! d_ff 1536). Ignored by default; run with
//!   cargo test --release --test quant_bench -- --ignored --nocapture
//! Method: one warm-up run, then the median of 3 runs, wall clock, default rayon pool.

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::quant::boa::BoaOptions;
use boa_cuda::quant::gptq::GptqOptions;
use boa_cuda::quant::linalg::cholesky_upper_inverse;
use boa_cuda::quant::quantizer::{h_block_f32, search_grids_rows};
use boa_cuda::quant::{QuantSpec, ScaleSearch};
use common::*;
use std::time::Instant;

fn median_ms(mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..3)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[1]
}

#[test]
#[ignore]
fn bench_quant_shapes() {
    eprintln!("threads: {}", rayon::current_num_threads());
    for &(d_out, d_in) in &[(576usize, 576usize), (192, 576), (576, 1536)] {
        let mut r = rng(7);
        let n_tok = 2 * d_in;
        let x = correlated_inputs(&mut r, n_tok, d_in);
        let h = damped(&xtx(&x, n_tok, d_in), d_in, 0.01);
        let w = to_f32(
            &randn_vec(&mut r, d_out * d_in)
                .iter()
                .map(|v| v * 0.02)
                .collect::<Vec<_>>(),
        );
        let (nh, dh) = (d_out / 64, 64);
        let hr: Vec<f64> = (0..nh).flat_map(|_| random_spd(&mut r, dh)).collect();
        let t_u = median_ms(|| {
            cholesky_upper_inverse(&h, d_in).unwrap();
        });
        let hb = h_block_f32(&h, d_in, 0, d_in);
        for spec in [
            QuantSpec::new(3, None, false, ScaleSearch::Hessian),
            QuantSpec::new(2, Some(64), false, ScaleSearch::Hessian),
        ] {
            let g = spec.group_len(d_in);
            let t_search = median_ms(|| {
                for k in 0..spec.n_groups(d_in) {
                    let len = g.min(d_in - k * g);
                    let hbk = if len == d_in {
                        hb.clone()
                    } else {
                        h_block_f32(&h, d_in, k * g, len)
                    };
                    search_grids_rows(&w, d_out, d_in, k * g, len, Some(&hbk), &spec);
                }
            });
            let o = GptqOptions::new(spec);
            let t_gptq = median_ms(|| {
                gptq_host(&w, d_out, d_in, &h, &o).unwrap();
            });
            let bo = BoaOptions::new(o.clone());
            let t_boa = median_ms(|| {
                boa_host(&w, nh, dh, d_in, HostCol::Shared(&h), &hr, &bo).unwrap();
            });
            let label = match spec.group_size {
                None => "3-bit per-channel".to_string(),
                Some(g) => format!("{}-bit g{g}", spec.bits),
            };
            eprintln!(
                "{d_out:>4}x{d_in:<5} {label:<18} U {t_u:7.1} ms | search {t_search:7.1} ms | GPTQ total {t_gptq:7.1} ms | BoA total {t_boa:7.1} ms"
            );
        }
    }
}

/// The per-channel Hessian search alone (576 × 576, 3-bit), for profiling: run with RAYON_NUM_THREADS=1.
#[test]
#[ignore]
fn bench_search_576() {
    let (d_out, d_in) = (576, 576);
    let mut r = rng(7);
    let x = correlated_inputs(&mut r, 2 * d_in, d_in);
    let h = damped(&xtx(&x, 2 * d_in, d_in), d_in, 0.01);
    let w = to_f32(&randn_vec(&mut r, d_out * d_in));
    let hb = h_block_f32(&h, d_in, 0, d_in);
    let spec = QuantSpec::new(3, None, false, ScaleSearch::Hessian);
    let t = median_ms(|| {
        search_grids_rows(&w, d_out, d_in, 0, d_in, Some(&hb), &spec);
    });
    eprintln!(
        "search 576x576 3-bit per-channel: {t:.1} ms on {} threads",
        rayon::current_num_threads()
    );
}

/// GPTQ on 576 × 1536 (3-bit per channel) alone, for profiling.
#[test]
#[ignore]
fn bench_gptq_576x1536() {
    let (d_out, d_in) = (576, 1536);
    let mut r = rng(7);
    let x = correlated_inputs(&mut r, 2 * d_in, d_in);
    let h = xtx(&x, 2 * d_in, d_in);
    let w = to_f32(&randn_vec(&mut r, d_out * d_in));
    let o = GptqOptions::new(QuantSpec::new(3, None, false, ScaleSearch::Hessian));
    let t = median_ms(|| {
        gptq_host(&w, d_out, d_in, &h, &o).unwrap();
    });
    eprintln!(
        "GPTQ 576x1536 3-bit per-channel: {t:.1} ms on {} threads",
        rayon::current_num_threads()
    );
}
