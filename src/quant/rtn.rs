//! Round-to-nearest: every weight rounded on its (row, group) grid, no error feedback. The grid comes from
//! `spec.search` (min-max by default for RTN; the Hessian search needs H).

use super::gptq::identity;
use crate::ops::{Mat, QuantOps, QuantSpec, QuantizedLinear, Result, ScaleSearch};

/// RTN-quantizes W [d_out × d_in] through `ops`; `h` [d_in × d_in] (undamped) is used only by the Hessian
/// search.
pub fn rtn_quantize(
    ops: &dyn QuantOps,
    w: &Mat,
    h: Option<&Mat>,
    spec: &QuantSpec,
) -> Result<QuantizedLinear> {
    spec.validate()?;
    let (d_out, d_in) = (w.rows, w.cols);
    if spec.search == ScaleSearch::Hessian && h.is_none() {
        return Err(crate::input_err!(
            "RTN with the Hessian scale search needs H"
        ));
    }
    let g = spec.group_len(d_in);
    let grids = ops.search_grids(w, h, &[identity(d_in)], &[0], g, spec)?;
    let g_idx: Vec<u32> = (0..d_in).map(|c| (c / g) as u32).collect();
    let (w_hat, codes) = ops.rtn(w, &grids, &g_idx, spec)?;
    Ok(QuantizedLinear {
        d_out,
        d_in,
        bits: spec.bits,
        w_hat,
        codes,
        grids,
        g_idx,
        error: None,
    })
}
