//! Wall time of the quantization phases (factorization, scale search, sweep), summed over every call since
//! the last `take()`: the run report and `bench-quant` split "quantize" with it. Counters are global, so
//! concurrent quantizations in one process would share them; the pipeline quantizes one layer at a time.

use crate::ops::QuantOps;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

#[derive(Clone, Copy)]
pub enum Phase {
    /// Damping, dead inputs, permutations and U = chol(H⁻¹)ᵀ of every H_col / H_row.
    Factor = 0,
    /// Static scale/zero search before the sweep (dynamic group searches count in the sweep).
    Search = 1,
    /// The GPTQ / BoA sweep itself.
    Sweep = 2,
}

static NANOS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static FENCING: AtomicBool = AtomicBool::new(false);

/// Whether phase boundaries wait for the device (`run --profile`): a phase's time then holds its own device
/// work, at the cost of the overlap between phases.
pub fn set_fencing(on: bool) {
    FENCING.store(on, Ordering::Relaxed);
}

/// Waits for `ops`' queued work when fencing. A failed wait is left to the next real call to report: a device
/// error is sticky, and the phase's own result carries it.
pub fn fence<O: QuantOps + ?Sized>(ops: &O) {
    if FENCING.load(Ordering::Relaxed) {
        let _ = ops.fence();
    }
}

pub fn timed<O: QuantOps + ?Sized, R>(ops: &O, phase: Phase, f: impl FnOnce() -> R) -> R {
    let _r = crate::nvtx::range(match phase {
        Phase::Factor => c"factor",
        Phase::Search => c"scale search",
        Phase::Sweep => c"sweep",
    });
    fence(ops);
    let t = Instant::now();
    let r = f();
    fence(ops);
    add(phase, t);
    r
}

/// Adds the time since `start` to `phase` (for regions that return early with `?`).
pub fn add(phase: Phase, start: Instant) {
    NANOS[phase as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Seconds per phase (factor, search, sweep) since the last call; resets the counters.
pub fn take() -> [f64; 3] {
    [0, 1, 2].map(|i| NANOS[i].swap(0, Ordering::Relaxed) as f64 * 1e-9)
}
