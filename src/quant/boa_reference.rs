//! BoA's sweep the way the reference implementation does it: one column at a time (no lazy batching) and,
//! after each row, the cross-row update through the explicit product E_h U_col (a d_in × d_in GEMV per row)
//! instead of the rank-1 identity of design.md §4.3. Same result (Prop. 3.1); kept as the baseline that
//! `bench-quant` times `boa_sweep` against, and as a second oracle in the tests. Static grids only.

use super::Real;
use super::quantizer::{Grid, dequantize, quantize};

/// Row-by-row, column-at-a-time BoA sweep of W [n_heads·d_h × n] with one shared U_col [n × n] and per-head
/// U_row [n_heads × d_h × d_h] (both upper), per-row static grids [n_heads·d_h]. Returns the codes.
#[allow(clippy::too_many_arguments)]
pub fn boa_sweep_reference<T: Real>(
    w: &mut [T],
    u_col: &[T],
    u_row: &[T],
    n_heads: usize,
    d_h: usize,
    n: usize,
    grids: &[Grid<T>],
    maxq: u32,
) -> Vec<u8> {
    let maxq_t = T::from_f64(maxq as f64);
    let mut codes = vec![0u8; w.len()];
    let mut e = vec![T::ZERO; n];
    let mut eu = vec![T::ZERO; n];
    for h in 0..n_heads {
        let wh = &mut w[h * d_h * n..(h + 1) * d_h * n];
        let ur = &u_row[h * d_h * d_h..(h + 1) * d_h * d_h];
        for j in 0..d_h {
            let gr = grids[h * d_h + j];
            // GPTQ on row j, one column at a time (Alg. 2 with B = 1).
            for c in 0..n {
                let x = wh[j * n + c];
                let qc = quantize(x, gr.scale, gr.zero, maxq_t);
                codes[(h * d_h + j) * n + c] = qc.to_f64() as u8;
                e[c] = (x - dequantize(qc, gr.scale, gr.zero)) / u_col[c * n + c];
                for c2 in c + 1..n {
                    let v = e[c] * u_col[c * n + c2];
                    wh[j * n + c2] -= v;
                }
            }
            // E_h U_col as the reference computes it: a GEMV over the whole U_col.
            for (c2, o) in eu.iter_mut().enumerate() {
                let mut acc = T::ZERO;
                for (c, &ec) in e.iter().enumerate().take(c2 + 1) {
                    acc += ec * u_col[c * n + c2];
                }
                *o = acc;
            }
            for i in j + 1..d_h {
                let f = ur[j * d_h + i] / ur[j * d_h + j];
                for (x, &d) in wh[i * n..(i + 1) * n].iter_mut().zip(&eu) {
                    *x -= f * d;
                }
            }
        }
    }
    codes
}
