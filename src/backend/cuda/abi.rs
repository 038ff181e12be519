//! Rust mirrors of the plain-C structs in include/ (style.md rule 6), and the C ABI of cuda/boa_host.cpp (the
//! include/ headers compiled for the host by build.rs through the `cc` crate).
//!
//! Each mirror is pinned by compile-time size/offset asserts, and `tests/parity_ops.rs` compares it with the
//! layout the host C++ compiler reports (`c_layout_*`), so a field added on one side only fails the build or
//! the tests.

use cudarc::driver::DeviceRepr;
use std::mem::{align_of, offset_of, size_of};

/// Mirror of `BoaRmsNormParams` (include/boa_ops.h): launch parameters of rms_norm_kernel_v*.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormParams {
    /// Number of rows of X and Y.
    pub rows: u32,
    /// Row length (hidden size), ≥ 1.
    pub d: u32,
    /// Added to the mean square before the reciprocal square root.
    pub eps: f32,
}

// SAFETY: plain-old-data with the C layout of BoaRmsNormParams (asserted below), passed by value as a kernel
// parameter.
unsafe impl DeviceRepr for RmsNormParams {}

const _: () = {
    assert!(size_of::<RmsNormParams>() == 12);
    assert!(align_of::<RmsNormParams>() == 4);
    assert!(offset_of!(RmsNormParams, rows) == 0);
    assert!(offset_of!(RmsNormParams, d) == 4);
    assert!(offset_of!(RmsNormParams, eps) == 8);
};

/// Layout of a C struct as the host C++ compiler sees it (`BoaLayout` in cuda/boa_host.cpp): size, alignment
/// and the offsets of its first fields in declaration order (unused slots are `usize::MAX`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CLayout {
    pub size: usize,
    pub align: usize,
    pub offsets: [usize; 8],
}

unsafe extern "C" {
    fn boa_layout_rms_norm_params() -> CLayout;
}

/// `BoaRmsNormParams` as laid out by the host C++ compiler.
pub fn c_layout_rms_norm_params() -> CLayout {
    // SAFETY: a pure function of the C++ side taking nothing and returning a POD by value.
    unsafe { boa_layout_rms_norm_params() }
}

/// `RmsNormParams` as laid out by rustc, in the same form.
pub fn rust_layout_rms_norm_params() -> CLayout {
    let mut offsets = [usize::MAX; 8];
    offsets[..3].copy_from_slice(&[
        offset_of!(RmsNormParams, rows),
        offset_of!(RmsNormParams, d),
        offset_of!(RmsNormParams, eps),
    ]);
    CLayout {
        size: size_of::<RmsNormParams>(),
        align: align_of::<RmsNormParams>(),
        offsets,
    }
}
