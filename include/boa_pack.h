/* boa_pack.h — GPTQ bit packing (design.md §9), shared by the kernels and the host (style.md rule 5).
 *
 * A packed vector of n b-bit codes is a bit stream laid out LSB-first over consecutive 32-bit words: code i
 * occupies stream bits [i·b, i·b + b), and word w holds stream bits [32w, 32w + 32). For b = 2, 4, 8 a word
 * holds 32/b whole codes; for b = 3, 32 codes fill 3 words and codes 10 and 21 straddle a word boundary
 * (bits 30-32 and 63-65). n·b need not be a multiple of 32: the last word is zero-padded, so a vector takes
 * ceil(n·b/32) words (exactly n·b/32 in every shape GPTQ tools write).
 *
 * "Consecutive words" are `stride` uint32 apart, so one function serves both tensors of a checkpoint:
 *   qweight int32 [ceil(d_in·b/32) × d_out]: output j's codes along the input dimension, stride d_out;
 *   qzeros  int32 [n_groups × ceil(d_out·b/32)]: group g's zeros along the output dimension, stride 1.
 *
 * Assumptions are checked by the callers (src/quant/pack.rs): b ∈ {2, 3, 4, 8}, codes < 2^b.
 */
#ifndef BOA_PACK_H
#define BOA_PACK_H

#include <stddef.h>
#include <stdint.h>

#include "boa_common.h"
#include "boa_quant.h"

/* Words of a packed vector of n b-bit codes. */
BOA_HD static inline size_t boa_pack_words(size_t n, uint32_t bits) {
    return (n * bits + 31) / 32;
}

/* Code i of the stream at words[0], words[stride], … */
BOA_HD static inline uint32_t boa_unpack_code(const uint32_t* words, size_t stride, uint32_t bits, size_t i) {
    const size_t bit = i * bits;
    const size_t w = bit / 32;
    const uint32_t off = (uint32_t)(bit % 32);
    uint32_t v = words[w * stride] >> off;
    if (off + bits > 32) v |= words[(w + 1) * stride] << (32 - off); /* straddles (3-bit only) */
    return v & ((1u << bits) - 1u);
}

/* ORs code q into position i of the stream (the words start zeroed). */
BOA_HD static inline void boa_pack_code(uint32_t* words, size_t stride, uint32_t bits, size_t i, uint32_t q) {
    const size_t bit = i * bits;
    const size_t w = bit / 32;
    const uint32_t off = (uint32_t)(bit % 32);
    words[w * stride] |= q << off;
    if (off + bits > 32) words[(w + 1) * stride] |= q >> (32 - off);
}

/* The dequantized tile Ŵᵀ[i0 .. i0+ni, j0 .. j0+nj] of a packed linear, the unit of the packed GEMM (the CPU
 * backend's qgemm; the CUDA kernel's shared-memory tile later):
 *   out [ni × nj] row-major, out[r·nj + c] = s[g, j]·(q[i, j] − z[g, j]),  i = i0 + r, j = j0 + c, g = g_idx[i].
 *   qweight [ceil(d_in·b/32) × d_out] packed as above; scales, zeros float [n_groups × d_out] (zeros are the
 *   true zero points, already unpacked: the v1/v2 offset is a load-time concern); g_idx [d_in].
 * The inner loop runs along j, where qweight, scales and zeros are contiguous and the shift is uniform, so it
 * vectorizes. */
BOA_HD static inline void boa_dequant_tile(const uint32_t* qweight, size_t d_out, uint32_t bits,
                                           const float* scales, const float* zeros, const uint32_t* g_idx,
                                           size_t i0, size_t ni, size_t j0, size_t nj, float* out) {
    const uint32_t mask = (1u << bits) - 1u;
    for (size_t r = 0; r < ni; ++r) {
        const size_t i = i0 + r;
        const size_t bit = i * bits;
        const uint32_t off = (uint32_t)(bit % 32);
        const uint32_t* w_lo = qweight + (bit / 32) * d_out + j0;
        const float* s = scales + (size_t)g_idx[i] * d_out + j0;
        const float* z = zeros + (size_t)g_idx[i] * d_out + j0;
        float* o = out + r * nj;
        if (off + bits <= 32) {
            for (size_t c = 0; c < nj; ++c)
                o[c] = boa_dequantize((float)((w_lo[c] >> off) & mask), s[c], z[c]);
        } else {
            const uint32_t* w_hi = w_lo + d_out;
            for (size_t c = 0; c < nj; ++c) {
                const uint32_t q = ((w_lo[c] >> off) | (w_hi[c] << (32 - off))) & mask;
                o[c] = boa_dequantize((float)q, s[c], z[c]);
            }
        }
    }
}

/* Columns of one register block of boa_qdot_group_tile (8 AVX2 registers; a warp's 2 columns per lane later). */
#define BOA_QDOT_COLS 64

/* The packed GEMM for few tokens, fused: y[t·ldy + c] += Σ_r x[t·ldx + i0 + r] · ŵ(i0 + r, j0 + c) for t < m,
 * c < nj (a multiple of BOA_QDOT_COLS), where every row i0 .. i0+ni lies in the ONE group g (contiguous groups,
 * no act-order). Per group the sum factors as
 *     Σ_r x_r · s·(q_r − z) = s·(Σ_r q_r·x_r − z·Σ_r x_r),
 * so the inner loop is unpack, convert, multiply-add, with the partial sums in registers: no dequantized tile
 * is stored. The rounding differs from dequantize-then-multiply by a few ulp of Σ|q·x|. */
BOA_HD static inline void boa_qdot_group_tile(const uint32_t* qweight, size_t d_out, uint32_t bits,
                                              const float* scales, const float* zeros, size_t g, size_t i0,
                                              size_t ni, size_t j0, size_t nj, const float* x, size_t ldx,
                                              size_t m, float* y, size_t ldy) {
    const uint32_t mask = (1u << bits) - 1u;
    for (size_t t = 0; t < m; ++t) {
        const float* xt = x + t * ldx + i0;
        float xs = 0.0f;
        for (size_t r = 0; r < ni; ++r) xs += xt[r];
        for (size_t c0 = 0; c0 < nj; c0 += BOA_QDOT_COLS) {
            float acc[BOA_QDOT_COLS] = {0.0f};
            for (size_t r = 0; r < ni; ++r) {
                const size_t bit = (i0 + r) * bits;
                const uint32_t off = (uint32_t)(bit % 32);
                const uint32_t* w_lo = qweight + (bit / 32) * d_out + j0 + c0;
                const float xv = xt[r];
                if (off + bits <= 32) {
                    for (size_t c = 0; c < BOA_QDOT_COLS; ++c) acc[c] += xv * (float)((w_lo[c] >> off) & mask);
                } else {
                    const uint32_t* w_hi = w_lo + d_out;
                    for (size_t c = 0; c < BOA_QDOT_COLS; ++c)
                        acc[c] += xv * (float)(((w_lo[c] >> off) | (w_hi[c] << (32 - off))) & mask);
                }
            }
            const float* s = scales + g * d_out + j0 + c0;
            const float* z = zeros + g * d_out + j0 + c0;
            float* yt = y + t * ldy + c0;
            for (size_t c = 0; c < BOA_QDOT_COLS; ++c) yt[c] += s[c] * (acc[c] - z[c] * xs);
        }
    }
}

#endif /* BOA_PACK_H */
