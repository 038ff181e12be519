//! Process-wide allocator settings.
//!
//! glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) straight from the kernel and
//! returns it on free, and trims the heap's free top; the next block of that size then faults in fresh zeroed
//! pages. A quantization run frees and reallocates the same block-sized buffers (activations, Grams, GEMM
//! outputs) thousands of times, so on the demo model's CPU run (README, "Speed") that churn cost 2–7 s of
//! kernel time and most of the run-to-run spread. Fixing the threshold at its maximum and never trimming keeps
//! those pages in the process. Freed blocks are reused, not added to: that run's peak RSS stayed at 1.02–1.11
//! GiB with it against 1.10 GiB without (the drop from 1.76 GiB came with the tokenizer's pieces, which
//! build no 2 M-token offset tables).

/// Keeps freed memory in the process (module comment). A no-op outside glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is called before any thread starts.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        }
    }
}
