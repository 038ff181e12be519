/* boa_quant.h — the uniform quantizer of design.md §4.1, shared by the kernels and the host (style.md rule 5).
 *
 *   q = clamp(round(w/s) + z, 0, maxq),   ŵ = s·(q − z),   maxq = 2^b − 1.
 *
 * round is half-to-even (torch.round, which GPTQ's reference quantizer uses): rintf under the default
 * rounding mode on the host, and on the device. src/quant/quantizer.rs keeps the same two formulas in Rust for
 * its generic (f32/f64) sweeps; tests/packed_roundtrip.rs checks that the two agree bit for bit on f32.
 * The expressions are written so that no multiply-add can be contracted: ŵ is a product of a difference.
 */
#ifndef BOA_QUANT_H
#define BOA_QUANT_H

#include <math.h>

#include "boa_common.h"

/* q = clamp(rint(w/s) + z, 0, maxq) as a float holding an integer. */
BOA_HD static inline float boa_quantize(float w, float scale, float zero, float maxq) {
    float q = rintf(w / scale) + zero;
    q = q > 0.0f ? q : 0.0f; /* also maps NaN to 0, as Rust's f32::max does */
    return q < maxq ? q : maxq;
}

/* ŵ = s·(q − z). */
BOA_HD static inline float boa_dequantize(float q, float scale, float zero) {
    return scale * (q - zero);
}

#endif /* BOA_QUANT_H */
