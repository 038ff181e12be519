//! Benchmarks behind `boa-cuda bench-*` subcommands: they synthesize or run what they time and return
//! numbers; main.rs prints them.

pub mod gpu;
mod gpu_batched;
pub mod qgemm;
pub mod quant;
