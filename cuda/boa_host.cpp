// boa_host.cpp — host-side compilation of the include/ headers (built by build.rs through the `cc` crate,
// with a plain C++ compiler, no nvcc needed). Rust calls these through a C ABI (src/backend/cuda/abi.rs):
//   - ABI checks: the layout the C++ compiler gives each launch-parameter struct, compared with the
//     #[repr(C)] mirrors in a test;
//   - the quantizer and bit-packing BOA_HD inline functions (src/quant/pack.rs), so CPU tests run the code
//     the kernels run.

#include <stddef.h>

#include "boa_common.h"
#include "boa_ops.h"

// Layout of one C struct as the host compiler sees it: size, alignment, and the offsets of up to 8 fields in
// declaration order (unused slots are SIZE_MAX).
struct BoaLayout {
    size_t size;
    size_t align;
    size_t offsets[8];
};

extern "C" BoaLayout boa_layout_rms_norm_params(void) {
    BoaLayout l = {sizeof(BoaRmsNormParams), alignof(BoaRmsNormParams), {}};
    for (size_t& o : l.offsets) o = (size_t)-1;
    l.offsets[0] = offsetof(BoaRmsNormParams, rows);
    l.offsets[1] = offsetof(BoaRmsNormParams, d);
    l.offsets[2] = offsetof(BoaRmsNormParams, eps);
    return l;
}

// ---------------------------------------------------------------------------------------------------------
// The quantizer and bit-packing formulas of include/boa_quant.h and include/boa_pack.h, for Rust
// (src/quant/pack.rs). Thin loops over the BOA_HD inline functions, so the host runs the kernels' code.

#include "boa_pack.h"
#include "boa_quant.h"

// out[i] = boa_quantize(w[i], s[i], z[i], maxq), i < n.
extern "C" void boa_quantize_f32(const float* w, const float* s, const float* z, float maxq, size_t n,
                                 float* out) {
    for (size_t i = 0; i < n; ++i) out[i] = boa_quantize(w[i], s[i], z[i], maxq);
}

// out[i] = boa_dequantize(q[i], s[i], z[i]), i < n.
extern "C" void boa_dequantize_f32(const float* q, const float* s, const float* z, size_t n, float* out) {
    for (size_t i = 0; i < n; ++i) out[i] = boa_dequantize(q[i], s[i], z[i]);
}

// Packs n codes (each < 2^bits) into the zeroed stream words[0], words[stride], …
extern "C" void boa_pack_stream(const uint8_t* codes, size_t n, uint32_t bits, uint32_t* words, size_t stride) {
    for (size_t i = 0; i < n; ++i) boa_pack_code(words, stride, bits, i, codes[i]);
}

// codes[r] = code i0 + r of the stream words[0], words[stride], …, r < n.
extern "C" void boa_unpack_stream(const uint32_t* words, size_t stride, uint32_t bits, size_t i0, size_t n,
                                  uint8_t* codes) {
    for (size_t r = 0; r < n; ++r) codes[r] = (uint8_t)boa_unpack_code(words, stride, bits, i0 + r);
}

// See boa_dequant_tile in include/boa_pack.h.
extern "C" void boa_dequant_tile_f32(const uint32_t* qweight, size_t d_out, uint32_t bits, const float* scales,
                                     const float* zeros, const uint32_t* g_idx, size_t i0, size_t ni, size_t j0,
                                     size_t nj, float* out) {
    boa_dequant_tile(qweight, d_out, bits, scales, zeros, g_idx, i0, ni, j0, nj, out);
}

// See boa_qdot_group_tile in include/boa_pack.h.
extern "C" void boa_qdot_group_tile_f32(const uint32_t* qweight, size_t d_out, uint32_t bits, const float* scales,
                                        const float* zeros, size_t g, size_t i0, size_t ni, size_t j0, size_t nj,
                                        const float* x, size_t ldx, size_t m, float* y, size_t ldy) {
    boa_qdot_group_tile(qweight, d_out, bits, scales, zeros, g, i0, ni, j0, nj, x, ldx, m, y, ldy);
}
