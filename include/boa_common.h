/* boa_common.h — macros shared by every header in include/.
 *
 * The headers in include/ are compiled twice: by nvcc into the kernels (the .cu files in cuda/) and by a plain C/C++ host
 * compiler (the `cc` crate, cuda/boa_host.cpp) so that Rust can call the very same inline functions through a
 * C ABI and the CPU tests check the code the kernels run (design.md §8, style.md rule 5).
 */
#ifndef BOA_COMMON_H
#define BOA_COMMON_H

#include <stdint.h>

/* BOA_HD marks a function callable from host and device code. Under nvcc it is __host__ __device__; under a
 * plain C/C++ compiler it expands to nothing. Use it as `static inline BOA_HD float f(float x)`. */
#if defined(__CUDACC__)
#define BOA_HD __host__ __device__
#else
#define BOA_HD
#endif

/* C++ headers (nvcc, the host .cpp) get C linkage for the ABI-level declarations; a C compiler sees them as is. */
#ifdef __cplusplus
#define BOA_EXTERN_C_BEGIN extern "C" {
#define BOA_EXTERN_C_END }
#else
#define BOA_EXTERN_C_BEGIN
#define BOA_EXTERN_C_END
#endif

#endif /* BOA_COMMON_H */
