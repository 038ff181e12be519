//! Device-agnostic quantization algorithms (design.md §4): the quantizer and its scale search (§4.1), GPTQ
//! (§4.2, the paper's Algorithm 2), BoA (§4.3, Algorithm 1 and Proposition 3.1), RTN, and the Hessian
//! statistics they consume.
//!
//! Every algorithm runs on any backend through `crate::ops::QuantOps` (design.md §12: one fallible interface,
//! device buffers on a GPU); the inner loops themselves are also here as free functions on host slices, named by
//! stem (`hessian_xxt`, `cholesky_upper_inverse`, `gptq_block_sweep`, `boa_sweep`): the CPU backend runs them and
//! every device kernel is checked against them.
//!
//! Conventions: row-major; a weight is W [d_out × d_in] (y = W x); on the CPU, Hessians are symmetric [n × n]
//! f64 (accumulation and factorization in f64). The sweeps are generic over [`Real`] (f32 for speed, f64 for
//! the bit-exactness tests of §4.4).

pub mod allocate;
pub mod asym;
pub mod boa;
pub mod boa_reference;
pub mod gptq;
pub mod hessian;
pub mod lattice;
pub mod linalg;
pub mod pack;
pub mod plan;
pub mod profile;
pub mod quantizer;
pub mod refit;
pub mod rtn;

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub, SubAssign};

pub use quantizer::{Grid, QuantSpec, ScaleSearch};

/// The float type of a sweep: f32 (production) or f64 (exactness tests).
pub trait Real:
    Copy
    + Send
    + Sync
    + Debug
    + PartialOrd
    + Default
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// Round half to even, as `torch.round` does (GPTQ's reference quantizer uses torch.round).
    fn round_ties_even(self) -> Self;
    /// round_ties_even(self) as i32 (saturating), without a detour through f64 (so it vectorizes for f32).
    fn round_to_i32(self) -> i32;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    fn abs(self) -> Self;
    fn max(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    /// C [m × n] −= A [m × k] · B [k × n]; row-major with row strides ldc, lda, ldb; sequential.
    #[allow(clippy::too_many_arguments)]
    fn gemm_sub(
        c: &mut [Self],
        ldc: usize,
        a: &[Self],
        lda: usize,
        b: &[Self],
        ldb: usize,
        m: usize,
        k: usize,
        n: usize,
    );
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn round_ties_even(self) -> Self {
                <$t>::round_ties_even(self)
            }
            #[inline]
            fn round_to_i32(self) -> i32 {
                <$t>::round_ties_even(self) as i32
            }
            #[inline]
            fn floor(self) -> Self {
                <$t>::floor(self)
            }
            #[inline]
            fn ceil(self) -> Self {
                <$t>::ceil(self)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn max(self, o: Self) -> Self {
                <$t>::max(self, o)
            }
            #[inline]
            fn min(self, o: Self) -> Self {
                <$t>::min(self, o)
            }
            fn gemm_sub(
                c: &mut [Self],
                ldc: usize,
                a: &[Self],
                lda: usize,
                b: &[Self],
                ldb: usize,
                m: usize,
                k: usize,
                n: usize,
            ) {
                use faer::{Accum, MatMut, MatRef, Par, linalg::matmul::matmul};
                if m == 0 || n == 0 || k == 0 {
                    return;
                }
                let a =
                    MatRef::from_row_major_slice_with_stride(&a[..(m - 1) * lda + k], m, k, lda);
                let b =
                    MatRef::from_row_major_slice_with_stride(&b[..(k - 1) * ldb + n], k, n, ldb);
                // Not `MatMut::from_row_major_slice_with_stride_mut`: in faer 0.24.4 it builds a
                // column-major view (row stride 1, column stride `row_stride`) and writes out of bounds.
                let c = MatMut::from_column_major_slice_with_stride_mut(
                    &mut c[..(m - 1) * ldc + n],
                    n,
                    m,
                    ldc,
                )
                .transpose_mut();
                matmul(c, Accum::Add, a, b, -1.0 as $t, Par::Seq);
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);
