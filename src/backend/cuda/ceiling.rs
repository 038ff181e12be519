//! Host side of cuda/ceiling.cu: the device's copy bandwidth and mma.sync bf16 rate, measured as found
//! (METHOD.md "Two numbers first"), for the benchmark tables. Loaded on demand: nothing else needs it.

use super::{CudaBackend, CudaError, driver, load_module};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Stem of the .cu file (cuda/ceiling.cu).
pub const MODULE: &str = "ceiling";

/// The two ceilings of one device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCeilings {
    /// Device-to-device copy, bytes read + written per second (GB/s).
    pub copy_gbs: f64,
    /// bf16 mma.sync with f32 accumulation, dense TFLOP/s.
    pub mma_tflops: f64,
}

impl CudaBackend {
    /// Times a 1 GiB float4 copy and a register-only bf16 mma loop with device events (median of 5 after a
    /// warm-up), each over enough blocks to fill the chip.
    pub fn measure_ceilings(&self) -> Result<DeviceCeilings, CudaError> {
        let (gpu, cc) = (
            self.name.clone(),
            self.ctx.compute_capability().unwrap_or((0, 0)),
        );
        let module = load_module(&self.ctx, MODULE, &gpu, cc).map_err(|msg| CudaError::Shape {
            op: "measure_ceilings",
            msg,
        })?;
        let get = |name: &'static str| super::load_kernel(&module, MODULE, name);
        let copy = get("ceiling_copy_kernel")?;
        let mma = get("ceiling_mma_kernel")?;
        let sms = self
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(driver("multiprocessor count"))? as u32;

        // Copy: 1 GiB each way, far beyond L2.
        let n4: usize = 1 << 26; // float4 elements
        // Non-zero data: zeros can run faster than real data (METHOD.md "Correct first").
        let x = self
            .stream
            .clone_htod(&vec![1.2345f32; 4 * n4])
            .map_err(driver("upload copy src"))?;
        let mut y = self
            .stream
            .alloc_zeros::<f32>(4 * n4)
            .map_err(driver("alloc copy dst"))?;
        let n4_u64 = n4 as u64;
        let copy_cfg = LaunchConfig {
            grid_dim: (sms * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let copy_ms = self.median_ms(|| {
            let mut b = self.stream.launch_builder(&copy);
            b.arg(&mut y).arg(&x).arg(&n4_u64);
            // SAFETY: ceiling_copy_kernel(float4* y, const float4* x, uint64 n4): both buffers hold 4·n4 f32
            // (16-byte aligned allocations); the grid-stride loop stays below n4.
            unsafe { b.launch(copy_cfg) }
                .map(|_| ())
                .map_err(driver("launch ceiling_copy"))
        })?;
        let copy_gbs = 2.0 * 16.0 * n4 as f64 / (copy_ms * 1e-3) / 1e9;

        // mma: 8 warps × 8 blocks per SM × iters × 4 chains of 16×16×16.
        let blocks = sms * 8;
        let iters: u32 = 1 << 14;
        let mut out = self
            .stream
            .alloc_zeros::<f32>(blocks as usize * 8)
            .map_err(driver("alloc mma out"))?;
        let mma_cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mma_ms = self.median_ms(|| {
            let mut b = self.stream.launch_builder(&mma);
            b.arg(&mut out).arg(&iters);
            // SAFETY: ceiling_mma_kernel(float* out, uint32 iters) writes out[block·8 + warp] < blocks·8.
            unsafe { b.launch(mma_cfg) }
                .map(|_| ())
                .map_err(driver("launch ceiling_mma"))
        })?;
        let flop = blocks as f64 * 8.0 * iters as f64 * 4.0 * 2.0 * 16.0 * 16.0 * 16.0;
        Ok(DeviceCeilings {
            copy_gbs,
            mma_tflops: flop / (mma_ms * 1e-3) / 1e12,
        })
    }

    /// Median device time of `launch` over 5 runs after one warm-up, by events.
    fn median_ms(
        &self,
        mut launch: impl FnMut() -> Result<(), CudaError>,
    ) -> Result<f64, CudaError> {
        launch()?;
        let mut t = Vec::new();
        for _ in 0..5 {
            self.timed(&mut launch)?;
            t.push(self.last_kernel_ms() as f64);
        }
        t.sort_by(f64::total_cmp);
        Ok(t[t.len() / 2])
    }
}
