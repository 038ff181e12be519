// boa_host.cpp — host-side compilation of the include/ headers (built by build.rs through the `cc` crate,
// with a plain C++ compiler, no nvcc needed). Rust calls these through a C ABI (src/backend/cuda/abi.rs):
//   - ABI checks: the layout the C++ compiler gives each launch-parameter struct, compared with the
//     #[repr(C)] mirrors in a test;
//   - (next) the quantizer / bit-packing BOA_HD inline functions, so CPU tests run the code the kernels run.

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
