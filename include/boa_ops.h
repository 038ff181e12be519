/* boa_ops.h — launch-parameter structs of the model-op kernels (cuda/ops.cu), plain C so that Rust mirrors
 * them with #[repr(C)] (src/backend/cuda/abi.rs pins size and offsets, and a test compares them with what the
 * host C++ compiler lays out: cuda/boa_host.cpp).
 *
 * Keep every field 4 bytes wide (int32/uint32/float) unless a wider one is needed, and put wider fields first:
 * the struct is passed by value as a kernel parameter, and the layout must not depend on the compiler.
 */
#ifndef BOA_OPS_H
#define BOA_OPS_H

#include "boa_common.h"

BOA_EXTERN_C_BEGIN

/* rms_norm_kernel_v*: Y [rows × d] = X [rows × d] / sqrt(mean_j X[r,j]² + eps) · w [d], all row-major f32,
 * rows contiguous (row stride = d). */
typedef struct BoaRmsNormParams {
    uint32_t rows; /* number of rows of X and Y */
    uint32_t d;    /* row length (hidden size), >= 1 */
    float eps;     /* added to the mean square before the reciprocal square root */
} BoaRmsNormParams;

BOA_EXTERN_C_END

#endif /* BOA_OPS_H */
