//! `QuantOps::stat_xxt_rows` on CUDA: many Grams of small inputs at once (an MoE block's experts, each on
//! its routed rows, two Grams per expert per chunk). With cuBLAS, every item's rows are scaled, converted
//! to bf16 and zero-padded to a size class k in one launch (ops.cu pad_rows_bf16), then one
//! cublasGemmBatchedEx per (width, k) adds each item's XᵀX into its accumulator: a chunk of a 128-expert
//! block takes one table upload, one launch and a few library calls instead of 256 conversions, 256 GEMMs
//! and, router-weighted, 256 scatter launches with their uploads. Zero rows add nothing to XᵀX, and the
//! operands are the bf16 values one `stat_xxt` per item would take, so the sums are the same products
//! (their order inside cuBLAS aside). The Gram kernel variants (v1, v2) take f32 X: they run one item at a
//! time, scaling on the device.

use super::{CudaBackend, CudaError, XxtVariant, driver, ops};
use crate::ops::{MatData, Result, RowGram, Tensor};
use anyhow::bail;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

/// Fields per item of pad_rows_bf16's table: X's address, its scales' address (0: none), n, k, offset, d.
const FIELDS: usize = 6;

/// The rows an input of m ≥ 1 rows is padded to: m rounded up to a multiple of max(16, 2^(⌊log₂ m⌋ − 3)),
/// at most 1/8 (or 15 rows) more, so a chunk's items fall into few classes (8 per octave) and few calls.
pub(super) fn padded_rows(m: usize) -> usize {
    let log2 = (usize::BITS - 1 - m.max(1).leading_zeros()) as usize;
    let granule = (1usize << log2.saturating_sub(3)).max(16);
    m.div_ceil(granule) * granule
}

impl CudaBackend {
    pub(super) fn try_xxt_rows(&self, items: &mut [RowGram<'_>]) -> Result<()> {
        for (i, it) in items.iter().enumerate() {
            let d = it.acc.rows;
            if it.acc.batch != 1 || it.acc.cols != d || it.x.len() != it.m * d {
                bail!(
                    "stat_xxt_rows item {i}: X of {} values for {} rows into {}",
                    it.x.len(),
                    it.m,
                    it.acc.describe()
                );
            }
            if it.scales.is_some_and(|s| s.len() != it.m) {
                bail!(
                    "stat_xxt_rows item {i}: {} scales for {} rows",
                    it.scales.map_or(0, |s| s.len()),
                    it.m
                );
            }
            if !matches!(&it.acc.data, MatData::F32(Tensor::Device(_))) {
                bail!(
                    "cuda: accumulator {} is not in device memory",
                    it.acc.describe()
                );
            }
        }
        if self.xxt_variant_in_use() != XxtVariant::Cublas {
            return self.xxt_rows_each(items);
        }
        Ok(self.xxt_rows_batched(items)?)
    }

    /// One `stat_xxt` per item, scaled rows made on the device (0 + s·x, the scatter's rounding).
    fn xxt_rows_each(&self, items: &mut [RowGram<'_>]) -> Result<()> {
        use crate::ops::QuantOps;
        for it in items.iter_mut().filter(|it| it.m > 0) {
            let d = it.acc.rows;
            match it.scales {
                None => self.stat_xxt(it.acc, it.x, it.m)?,
                Some(s) => {
                    let zeros = self.stream.alloc_zeros::<f32>(it.m * d);
                    let mut v = Tensor::Device(zeros.map_err(driver("alloc scaled rows"))?);
                    let rows: Vec<u32> = (0..it.m as u32).collect();
                    self.try_scatter_add_rows_t(&mut v, it.x, d, &rows, s)?;
                    self.stat_xxt(it.acc, &v, it.m)?;
                }
            }
        }
        Ok(())
    }

    fn xxt_rows_batched(&self, items: &mut [RowGram<'_>]) -> std::result::Result<(), CudaError> {
        let stream = &self.stream;
        // Items with rows, ordered by (width, padded rows) so each call's items are consecutive.
        let key_of = |it: &RowGram<'_>| (it.acc.rows, padded_rows(it.m));
        let mut order: Vec<usize> = (0..items.len()).filter(|&i| items[i].m > 0).collect();
        order.sort_by_key(|&i| key_of(&items[i]));
        let keys: Vec<(usize, usize)> = order.iter().map(|&i| key_of(&items[i])).collect();
        let n = order.len();
        if n == 0 {
            return Ok(());
        }
        let mut offsets = Vec::with_capacity(n);
        let mut total = 0usize;
        for &(d, k) in &keys {
            offsets.push(total);
            total += k * d;
        }
        // Every scale vector in one upload.
        let mut scales = Vec::new();
        let mut scale_at = vec![None; n];
        for (j, &i) in order.iter().enumerate() {
            if let Some(s) = items[i].scales {
                scale_at[j] = Some(scales.len());
                scales.extend_from_slice(s);
            }
        }
        let scales_d = match scales.is_empty() {
            true => None,
            false => Some(self.upload(&scales, "upload row scales")?),
        };
        // SAFETY: pad_rows_bf16 writes every element of every item's block, and the blocks tile [0, total).
        let mut out =
            unsafe { stream.alloc::<u16>(total.max(1)) }.map_err(driver("alloc bf16 rows"))?;
        let xs = order
            .iter()
            .map(|&i| self.dev(items[i].x))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // The table: pad_rows_bf16's FIELDS per item, then the Grams' operand and accumulator addresses.
        // The guards keep each buffer's stream order until the calls are queued.
        let mut table = vec![0u64; (FIELDS + 2) * n];
        let (out_ptr, out_guard) = out.device_ptr(stream);
        let mut guards = Vec::with_capacity(2 * n);
        let scales_ptr = scales_d.as_ref().map(|s| s.device_ptr(stream));
        let mut widest = 0u64;
        for (j, &i) in order.iter().enumerate() {
            let ((d, k), m) = (keys[j], items[i].m);
            let (xp, g) = xs[j].device_ptr(stream);
            guards.push(g);
            let sp = match (scale_at[j], &scales_ptr) {
                (Some(at), Some((p, _))) => p + 4 * at as u64,
                _ => 0,
            };
            table[FIELDS * j..FIELDS * (j + 1)].copy_from_slice(&[
                xp,
                sp,
                m as u64,
                k as u64,
                offsets[j] as u64,
                d as u64,
            ]);
            table[FIELDS * n + j] = out_ptr + 2 * offsets[j] as u64;
            widest = widest.max((k * d) as u64);
        }
        let mut accs: Vec<_> = items
            .iter_mut()
            .filter(|it| it.m > 0)
            .map(|it| (key_of(it), &mut it.acc.data))
            .collect();
        // The same order as `order`: a stable sort of the same keys over the same filtered sequence.
        accs.sort_by_key(|&(key, _)| key);
        for (j, (_, data)) in accs.into_iter().enumerate() {
            let MatData::F32(Tensor::Device(acc)) = data else {
                unreachable!("checked by try_xxt_rows");
            };
            let (cp, g) = acc.device_ptr_mut(stream);
            guards.push(g);
            table[(FIELDS + 1) * n + j] = cp;
        }
        drop(out_guard);
        let table_d: CudaSlice<u64> = self.upload(&table, "upload Gram table")?;
        // SAFETY: the table holds, per item, the address of its X (n_i·d_i f32, `xs` alive to the end of this
        // function, frees stream-ordered), of its scales (n_i f32 in `scales_d`) or 0, and its block of
        // `out` (the offsets tile `out`, k_i·d_i each).
        unsafe {
            ops::launch_pad_rows_bf16(
                stream,
                &self.ops,
                &mut out,
                &table_d.slice(..FIELDS * n),
                widest,
            )?
        };
        let blas = self.blas().map_err(|why| CudaError::Shape {
            op: "stat_xxt_rows",
            msg: why.to_string(),
        })?;
        let out_read = out.device_ptr(stream);
        let mut start = 0;
        while start < n {
            let (d, k) = keys[start];
            let end = (start..n).find(|&j| keys[j] != (d, k)).unwrap_or(n);
            let a = table_d.slice(FIELDS * n + start..FIELDS * n + end);
            let c = table_d.slice((FIELDS + 1) * n + start..(FIELDS + 1) * n + end);
            // SAFETY: a[z] is item z's block of `out` (k·d bf16, written by the launch above), c[z] its own
            // accumulator (d² f32; distinct items hold distinct `&mut Mat`s); all stay allocated until the
            // stream has run the call (frees are stream-ordered).
            unsafe { blas.gram_bf16_ptrs(&a, &c, d, k)? };
            start = end;
        }
        drop((guards, out_read, scales_ptr));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::padded_rows;

    #[test]
    fn padding_adds_at_most_an_eighth_or_15_rows_in_few_sizes() {
        assert_eq!(
            [1, 16, 17, 128, 129, 1000].map(padded_rows),
            [16, 16, 32, 128, 144, 1024]
        );
        let mut sizes = std::collections::BTreeSet::new();
        for m in 1..=8192 {
            let k = padded_rows(m);
            assert!(k >= m && k - m <= (m / 8).max(15), "m={m}: k={k}");
            sizes.insert(k);
        }
        // 16 sizes up to 256, then 8 per octave (5 octaves to 8192).
        assert_eq!(sizes.len(), 16 + 8 * 5, "{sizes:?}");
    }
}
