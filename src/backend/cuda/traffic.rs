//! What crossed between host and device, for `run --profile` and the residency tests (design.md §12: "Host→
//! device bytes, syncs and launches per block are counted and reported").
//!
//! Two sources. On the CPU emulator of the CUDA stack (profiling/emu), its fake driver counts every copy,
//! synchronization and launch itself (profiling/emu/counters.h, read through `boa_emu_counters_get` in the
//! libcuda.so cudarc loaded): exact, and independent of this crate. On a GPU that symbol is absent, and the
//! host layer's own counters serve: the bytes of the uploads and downloads the backend's helpers make
//! (`CudaBackend::upload`/`download`/`read_back`, weight and tensor uploads, tensor reads) and the
//! synchronizations they wait on; kernel launches are not counted there (an nsys capture has them).

use crate::ops::Traffic;
use std::sync::atomic::{AtomicU64, Ordering};

/// The host layer's counters (see the module comment for what they cover).
#[derive(Default)]
pub struct HostCounters {
    htod: AtomicU64,
    dtoh: AtomicU64,
    syncs: AtomicU64,
}

impl HostCounters {
    pub fn htod(&self, bytes: usize) {
        self.htod.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn dtoh(&self, bytes: usize) {
        self.dtoh.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn sync(&self) {
        self.syncs.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> Traffic {
        Traffic {
            htod_bytes: self.htod.load(Ordering::Relaxed),
            dtoh_bytes: self.dtoh.load(Ordering::Relaxed),
            syncs: self.syncs.load(Ordering::Relaxed),
            launches: 0,
            source: "host layer",
        }
    }
}

/// profiling/emu/counters.h's `struct boa_emu_counters`, version 1 (328 bytes): fields only ever appended.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct EmuCounters {
    version: u32,
    size: u32,
    flags: u64,
    h2d_pageable_copies: u64,
    h2d_pageable_bytes: u64,
    h2d_locked_copies: u64,
    h2d_locked_bytes: u64,
    d2h_pageable_copies: u64,
    d2h_pageable_bytes: u64,
    d2h_locked_copies: u64,
    d2h_locked_bytes: u64,
    d2d_copies: u64,
    d2d_bytes: u64,
    h2h_copies: u64,
    h2h_bytes: u64,
    memsets: u64,
    memset_bytes: u64,
    host_syncs: u64,
    stream_syncs: u64,
    context_syncs: u64,
    event_syncs: u64,
    copy_syncs: u64,
    free_syncs: u64,
    queries: u64,
    stream_waits: u64,
    event_records: u64,
    kernel_launches: u64,
    cublas_calls: u64,
    cusolver_calls: u64,
    device_allocs: u64,
    device_alloc_bytes: u64,
    device_frees: u64,
    device_free_bytes: u64,
    device_bytes_live: u64,
    device_bytes_peak: u64,
    host_allocs: u64,
    host_alloc_bytes: u64,
    host_frees: u64,
    host_free_bytes: u64,
    host_registers: u64,
    host_register_bytes: u64,
    copy_ns: u64,
}
const _: () = assert!(size_of::<EmuCounters>() == 328);

/// The emulator's counters now, or None on a real driver.
fn emu_counters() -> Option<EmuCounters> {
    // SAFETY: RTLD_NOLOAD only finds the libcuda.so this process already loaded (cudarc's, by this name) and
    // takes one more reference, dropped right away; the symbol, when present, has the C signature
    // `int boa_emu_counters_get(struct boa_emu_counters*)` of profiling/emu/counters.h, and the struct passed
    // is the version-1 layout with `size` set, so the library writes no more than it.
    unsafe {
        let h = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if h.is_null() {
            return None;
        }
        let f = libc::dlsym(h, c"boa_emu_counters_get".as_ptr());
        libc::dlclose(h);
        if f.is_null() {
            return None;
        }
        let get: unsafe extern "C" fn(*mut EmuCounters) -> i32 = std::mem::transmute(f);
        let mut c = EmuCounters {
            size: size_of::<EmuCounters>() as u32,
            ..Default::default()
        };
        (get(&mut c) == 0 && c.version >= 1).then_some(c)
    }
}

/// The traffic so far: the emulator's count when it is the driver, else the host layer's.
pub fn traffic(host: &HostCounters) -> Traffic {
    match emu_counters() {
        Some(c) => Traffic {
            htod_bytes: c.h2d_pageable_bytes + c.h2d_locked_bytes,
            dtoh_bytes: c.d2h_pageable_bytes + c.d2h_locked_bytes,
            syncs: c.host_syncs,
            launches: c.kernel_launches + c.cublas_calls + c.cusolver_calls,
            source: "emulator",
        },
        None => host.snapshot(),
    }
}
