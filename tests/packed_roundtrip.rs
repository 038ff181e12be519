//! Packed GPTQ tensors (design.md §9) through the shared C code of include/boa_pack.h and boa_quant.h:
//! the C quantizer formulas agree with the Rust ones bit for bit; pack → unpack gives back exactly the codes,
//! the f16 scales, the zeros and g_idx (2/3/4/8 bits, group sizes −1/64/128 with partial last groups, with and
//! without act-order, random shapes); the packed GEMM matches the dense GEMM on the dequantized weights and
//! does not depend on the thread count.

#[path = "quant_common/mod.rs"]
mod common;

use boa_cuda::backend::cpu::{linear_f32, packed_linear_f32};
use boa_cuda::quant::gptq::{GptqOptions, Quantized};
use boa_cuda::quant::pack::{
    GptqVersion, PackedTensors, dequantize_c, dequantize_f16_scales, pack_stream, pack_words,
    quantize_c, unpack_stream,
};
use boa_cuda::quant::quantizer::{QuantSpec, ScaleSearch, dequantize, quantize};
use common::{gptq_host, rtn_host};
use half::f16;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn randn(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    // Sum of uniforms: roughly normal, enough spread for grids.
    (0..n)
        .map(|_| (0..4).map(|_| rng.random::<f32>() - 0.5).sum::<f32>())
        .collect()
}

#[test]
fn packed_c_quantizer_matches_rust_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for bits in [2u32, 3, 4, 8] {
        let maxq = ((1u32 << bits) - 1) as f32;
        let n = 20_000;
        let s: Vec<f32> = (0..n).map(|_| 1e-3 + rng.random::<f32>() * 0.1).collect();
        let z: Vec<f32> = (0..n)
            .map(|_| rng.random_range(0..=(1u32 << bits) - 1) as f32)
            .collect();
        let mut w = randn(&mut rng, n);
        // Exact ties w/s = k + ½ (round half to even decides), far outside the grid, and zero.
        for i in 0..n / 4 {
            w[i] = (rng.random_range(-20i32..20) as f32 + 0.5) * s[i];
        }
        w[n / 4] = 1e6;
        w[n / 4 + 1] = -1e6;
        w[n / 4 + 2] = 0.0;
        // The min-max zero of an all-positive group is −0 (−min/s with min = 0); w/s in (−½, 0] rounds to −0.
        let mut z = z;
        for i in n / 4 + 3..n / 4 + 200 {
            z[i] = -0.0;
            w[i] = -0.3 * s[i] * rng.random::<f32>();
        }
        let qc = quantize_c(&w, &s, &z, maxq);
        for i in 0..n {
            let qr = quantize(w[i], s[i], z[i], maxq);
            assert_eq!(
                qc[i].to_bits(),
                qr.to_bits(),
                "quantize({}, {}, {})",
                w[i],
                s[i],
                z[i]
            );
        }
        let dc = dequantize_c(&qc, &s, &z);
        for i in 0..n {
            let dr = dequantize(qc[i], s[i], z[i]);
            assert_eq!(
                dc[i].to_bits(),
                dr.to_bits(),
                "dequantize({}, {}, {})",
                qc[i],
                s[i],
                z[i]
            );
        }
    }
}

#[test]
fn packed_stream_round_trip_and_layout() {
    // The published layout, by hand: 4-bit codes 0..8 in one word, LSB first.
    let mut w = vec![0u32; 1];
    pack_stream(&[1, 2, 3, 4, 5, 6, 7, 8], 4, &mut w, 1);
    assert_eq!(w[0], 0x8765_4321);
    // 3-bit: code 10 occupies bits 30, 31 of word 0 and bit 0 of word 1.
    let mut codes = vec![0u8; 32];
    codes[10] = 0b101;
    let mut w = vec![0u32; 3];
    pack_stream(&codes, 3, &mut w, 1);
    assert_eq!(w, vec![0b01 << 30, 0b1, 0]);
    // Random streams at a stride, any length.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for bits in [2u32, 3, 4, 8] {
        for n in [1usize, 5, 31, 32, 33, 64, 100, 200, 576] {
            let stride = rng.random_range(1..5usize);
            let codes: Vec<u8> = (0..n)
                .map(|_| rng.random_range(0..(1u32 << bits)) as u8)
                .collect();
            let mut words = vec![0u32; pack_words(n, bits) * stride];
            pack_stream(&codes, bits, &mut words, stride);
            assert_eq!(
                unpack_stream(&words, stride, bits, 0, n),
                codes,
                "bits {bits} n {n}"
            );
            let i0 = n / 3;
            assert_eq!(unpack_stream(&words, stride, bits, i0, n - i0), codes[i0..]);
        }
    }
}

/// Every checkpoint tensor survives pack → unpack, and the packed linear dequantizes to f16(s)·(q − z).
fn check_round_trip(q: &Quantized<f32>, what: &str) {
    for version in [GptqVersion::V1, GptqVersion::V2] {
        let p = match PackedTensors::pack(q, version) {
            Ok(p) => p,
            Err(m) => {
                assert!(
                    version == GptqVersion::V1 && m.contains("gptq_v2"),
                    "{what}: {m}"
                );
                continue;
            }
        };
        assert_eq!(p.qweight.len(), pack_words(q.d_in, q.bits) * q.d_out);
        assert_eq!(p.unpack_codes(), q.codes, "{what}: codes");
        assert_eq!(p.g_idx, q.g_idx, "{what}: g_idx");
        let zeros = p.unpack_zeros(version);
        for j in 0..q.d_out {
            for g in 0..q.n_groups {
                let k = j * q.n_groups + g;
                assert_eq!(
                    zeros[g * q.d_out + j],
                    q.zeros[k],
                    "{what}: zero ({j}, {g})"
                );
                assert_eq!(
                    p.scales[g * q.d_out + j],
                    f16::from_f32(q.scales[k]),
                    "{what}: scale ({j}, {g})"
                );
            }
        }
        let lin = p.into_linear(version);
        lin.validate().unwrap();
        let a = lin.dequantize();
        let b = dequantize_f16_scales(q);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}: dequantized weights differ"
        );
    }
}

#[test]
fn packed_round_trip_rtn_and_gptq_act_order() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for bits in [2u32, 3, 4, 8] {
        for group in [None, Some(64), Some(128)] {
            for (d_out, d_in) in [(24usize, 200usize), (16, 576), (40, 256)] {
                let w = randn(&mut rng, d_out * d_in);
                let spec = QuantSpec::new(bits, group, bits % 2 == 1, ScaleSearch::MinMax);
                let q = rtn_host(&w, d_out, d_in, None, &spec).unwrap();
                check_round_trip(&q, &format!("rtn {bits}-bit g{group:?} {d_out}×{d_in}"));
                // GPTQ with act-order: g_idx is a permuted group map.
                // H = XᵀX/m + a varying diagonal (positive definite; distinct diag(H) for act-order).
                let m = 16;
                let x = randn(&mut rng, m * d_in);
                let mut h = vec![0f64; d_in * d_in];
                for r in 0..m {
                    let xr = &x[r * d_in..(r + 1) * d_in];
                    for i in 0..d_in {
                        for j in 0..d_in {
                            h[i * d_in + j] += (xr[i] * xr[j]) as f64 / m as f64;
                        }
                    }
                }
                for i in 0..d_in {
                    h[i * d_in + i] += 1.0 + rng.random::<f64>();
                }
                let mut o = GptqOptions::new(QuantSpec::new(bits, group, false, ScaleSearch::Mse));
                o.act_order = true;
                o.static_groups = group.is_some() && d_in == 200;
                let q = gptq_host(&w, d_out, d_in, &h, &o).unwrap();
                // Static groups keep the original-order groups (gptq.py); dynamic ones follow the sweep.
                if let (Some(g), false) = (group, o.static_groups) {
                    assert!(
                        q.g_idx
                            .iter()
                            .enumerate()
                            .any(|(i, &v)| v as usize != i / g),
                        "act-order should permute the groups"
                    );
                }
                check_round_trip(
                    &q,
                    &format!("gptq act-order {bits}-bit g{group:?} {d_out}×{d_in}"),
                );
            }
        }
    }
}

#[test]
fn packed_round_trip_random_shapes() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for case in 0..40 {
        let bits = [2u32, 3, 4, 8][case % 4];
        let d_out = rng.random_range(1..70usize);
        let d_in = rng.random_range(1..300usize);
        let group = match rng.random_range(0..3) {
            0 => None,
            _ => Some(16 * rng.random_range(1..9usize)),
        };
        let w = randn(&mut rng, d_out * d_in);
        let spec = QuantSpec::new(bits, group, rng.random::<bool>(), ScaleSearch::Mse);
        let q = rtn_host(&w, d_out, d_in, None, &spec).unwrap();
        check_round_trip(
            &q,
            &format!("case {case}: {bits}-bit g{group:?} {d_out}×{d_in}"),
        );
    }
}

#[test]
fn packed_v1_refuses_zero_zero_point() {
    // All weights ≥ 0: the asymmetric min-max grid has zero point 0, which v1 (zero − 1) cannot store.
    let w: Vec<f32> = (0..8 * 64).map(|i| (i % 13) as f32 * 0.1).collect();
    let q = rtn_host(
        &w,
        8,
        64,
        None,
        &QuantSpec::new(4, None, false, ScaleSearch::MinMax),
    )
    .unwrap();
    assert!(q.zeros.contains(&0.0));
    let err = PackedTensors::pack(&q, GptqVersion::V1).unwrap_err();
    assert!(err.contains("gptq_v2") && err.contains("--sym"), "{err}");
    check_round_trip(&q, "zero 0 under v2");
}

#[test]
fn packed_gemm_matches_dense_and_is_thread_count_independent() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    // Without act-order and m ≤ 2 the CPU GEMM takes the fused path (boa_qdot_group_tile) on column blocks that
    // are multiples of 64 wide; with act-order or more tokens, the dequantized-tile path.
    let cases = [
        (70, 200, 1),
        (300, 576, 3),
        (257, 96, 17),
        (64, 128, 40),
        (513, 160, 2),
        (320, 576, 1),
    ];
    for (case, &(d_out, d_in, m)) in cases.iter().chain(&cases).enumerate() {
        let bits = [3u32, 4, 2, 8, 3, 4][case % 6];
        let w = randn(&mut rng, d_out * d_in);
        let mut o = GptqOptions::new(QuantSpec::new(bits, Some(64), false, ScaleSearch::MinMax));
        o.act_order = case < 6;
        let h: Vec<f64> = (0..d_in * d_in)
            .map(|k| {
                if k / d_in == k % d_in {
                    1.0 + (k % 11) as f64
                } else {
                    0.0
                }
            })
            .collect();
        let q = gptq_host(&w, d_out, d_in, &h, &o).unwrap();
        let lin = PackedTensors::pack(&q, GptqVersion::V2)
            .unwrap()
            .into_linear(GptqVersion::V2);
        assert_eq!(
            lin.contiguous_group(),
            (!o.act_order).then_some(64),
            "case {case}"
        );
        let x = randn(&mut rng, m * d_in);
        let y_ref = linear_f32(&x, &dequantize_f16_scales(&q), m, d_in, d_out);
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| packed_linear_f32(&x, &lin, m))
        };
        let y1 = run(1);
        let y3 = run(3);
        assert!(
            y1.iter().zip(&y3).all(|(a, b)| a.to_bits() == b.to_bits()),
            "case {case}: result depends on the thread count"
        );
        // f32 sums of d_in ≤ 576 products in a different order: relative to the output scale, a few ulp · √d_in.
        let scale = y_ref.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = y1
            .iter()
            .zip(&y_ref)
            .fold(0f32, |a, (p, r)| a.max((p - r).abs()));
        assert!(
            err <= 1e-5 * scale,
            "case {case}: max error {err} vs scale {scale}"
        );
    }
}
