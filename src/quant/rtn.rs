//! Round-to-nearest: every weight rounded on its (row, group) grid, no error feedback. The grid comes from
//! `spec.search` (min-max by default for RTN; the Hessian search needs H).

use super::Real;
use super::gptq::Quantized;
use super::quantizer::{
    Grid, QuantSpec, ScaleSearch, dequantize, h_block_f32, quantize, search_grids_rows,
};

/// RTN-quantizes W [d_out × d_in]; `h` [d_in × d_in] is used only by the Hessian search.
pub fn rtn_quantize<T: Real>(
    w: &[T],
    d_out: usize,
    d_in: usize,
    h: Option<&[f64]>,
    spec: &QuantSpec,
) -> anyhow::Result<Quantized<T>> {
    spec.validate()?;
    assert_eq!(w.len(), d_out * d_in, "W is not [{d_out} × {d_in}]");
    if spec.search == ScaleSearch::Hessian && h.is_none() {
        return Err(crate::input_err!(
            "RTN with the Hessian scale search needs H"
        ));
    }
    let g = spec.group_len(d_in);
    let n_groups = spec.n_groups(d_in);
    let maxq = T::from_f64(spec.maxq() as f64);
    let mut grids = vec![Grid::default(); d_out * n_groups];
    for k in 0..n_groups {
        let len = g.min(d_in - k * g);
        let hb = match (spec.search, h) {
            (ScaleSearch::Hessian, Some(h)) => Some(h_block_f32(h, d_in, k * g, len)),
            _ => None,
        };
        for (r, gr) in search_grids_rows(w, d_out, d_in, k * g, len, hb.as_deref(), spec)
            .into_iter()
            .enumerate()
        {
            grids[r * n_groups + k] = gr;
        }
    }
    let g_idx: Vec<u32> = (0..d_in).map(|c| (c / g) as u32).collect();
    let mut codes = vec![0u8; d_out * d_in];
    let mut w_hat = vec![T::ZERO; d_out * d_in];
    for r in 0..d_out {
        for c in 0..d_in {
            let gr = grids[r * n_groups + g_idx[c] as usize];
            let q = quantize(w[r * d_in + c], gr.scale, gr.zero, maxq);
            codes[r * d_in + c] = q.to_f64() as u8;
            w_hat[r * d_in + c] = dequantize(q, gr.scale, gr.zero);
        }
    }
    Ok(Quantized {
        d_out,
        d_in,
        bits: spec.bits,
        w_hat,
        codes,
        scales: grids.iter().map(|g| g.scale).collect(),
        zeros: grids.iter().map(|g| g.zero).collect(),
        g_idx,
        n_groups,
    })
}
