//! NVTX ranges for Nsight Systems (style.md rule 15: every CUDA launcher opens one, and so does every phase of
//! `run`: forward, statistics, factor, search, sweep, write). With the `nvtx` cargo feature a range is pushed
//! on this thread until the guard drops; without it `range` compiles to nothing. Building the feature needs
//! libclang (bindgen): see profiling/README.md.
//!
//! The `nvtx` crate is used rather than cudarc's own `nvtx` feature, which loads the old libnvToolsExt at run
//! time and panics without it (design.md §7).

use std::ffi::CStr;

/// Guard of one NVTX range: pushed by [`range`], popped on drop.
#[must_use = "the range ends when this guard is dropped"]
pub struct Range {
    #[cfg(feature = "nvtx")]
    _inner: nvtx::LocalRange,
}

/// Opens an NVTX range named `name` on this thread (a no-op without the `nvtx` feature).
/// `let _r = range(c"rms_norm");` keeps it open to the end of the scope.
#[inline]
pub fn range(name: &'static CStr) -> Range {
    #[cfg(feature = "nvtx")]
    {
        Range {
            _inner: nvtx::LocalRange::new(name),
        }
    }
    #[cfg(not(feature = "nvtx"))]
    {
        let _ = name;
        Range {}
    }
}

/// Runs `f` inside an NVTX range named `name`.
#[inline]
pub fn ranged<R>(name: &'static CStr, f: impl FnOnce() -> R) -> R {
    let _r = range(name);
    f()
}
