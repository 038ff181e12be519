//! The `Backend` tensor methods on CUDA: activations, traces and statistic sums stay in device memory between
//! ops, so a block forward and its statistics move nothing over PCIe but the weights (once per block, on the
//! copy stream) and the final sums (once per block).
//!
//! Every method takes any `Tensor`: a host or pinned input is uploaded for the call (`DevRef::Owned`), so an
//! op that only has a host twin, or a caller that mixes places, stays correct; the pipeline keeps everything
//! on the device, and then no op uploads.
//!
//! The kernels are the ones the host-slice methods launch (ops.rs, gemm.rs, hessian.rs); only the buffers
//! differ, so the parity tests of those kernels cover the arithmetic and tests/resident_forward.rs checks the
//! plumbing (a whole block forward and its statistics through tensors against the host path).

use super::hessian::{
    ATTN_MAX_DH, AttnXOut, XxtVariant, launch_attn_probs, launch_attn_x, launch_hessian_xxt,
    launch_softmax_stats,
};
use super::{CudaBackend, CudaError, driver, ops};
use crate::backend::cpu::CpuBackend;
use crate::backend::{AttnShape, Backend, Tensor, Weight};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice};
use std::borrow::Cow;
use std::ops::Deref;
use std::sync::Arc;

/// Per-sequence scratch of V's statistics (`CudaBackend::queue_v_col_sequence`).
pub(super) struct VColScratch {
    stats: CudaSlice<f32>,
    y: CudaSlice<f32>,
}

/// A RoPE table pair on the device with the host values it was uploaded from (the cache key: compared in
/// full, so a table freed and another allocated at its address is never mistaken for it).
pub(super) struct RopeTablesOnDevice {
    cos: Vec<f32>,
    sin: Vec<f32>,
    cos_d: CudaSlice<f32>,
    sin_d: CudaSlice<f32>,
}

/// Most table pairs kept: a run has one (Llama) or two (Gemma 3's local and global layers) per length.
const ROPE_TABLES_KEPT: usize = 4;

/// R4's small dense Hadamard factor H_m on the device with the host values it was uploaded from (the cache
/// key, compared in full).
pub(super) struct HadamardSmallOnDevice {
    small: Vec<f64>,
    small_d: CudaSlice<f32>,
}

/// Most H_m kept: a run has one block order (an MoE block's experts and shared expert share it).
const HADAMARD_SMALL_KEPT: usize = 2;

/// Page-locked buffers that weights pass through on their way to the device, two per weight length, used in
/// turn: the host fills one while the DMA engine reads the other, so weights of one length uploaded one after
/// another (a block's gate/up/down, an MoE block's hundreds of experts) overlap their host copy with the
/// previous one's transfer instead of waiting for it. A block has at most three lengths (q/o, k/v,
/// gate/up/down), so 7B keeps ~0.5 GB page-locked and 70B ~2.5 GB, reused by every block. A length is staged
/// from its second upload on and gets its second buffer at its third, so a one-off upload (an embedding
/// table, an LM head) pins nothing and a length uploaded twice pins one buffer. Write-combined: the host only
/// writes them, the DMA engine only reads them.
#[derive(Default)]
pub(super) struct WeightStaging {
    rings: std::collections::HashMap<usize, StagingRing>,
    seen: std::collections::HashSet<usize>,
    /// Page-locking failed once: no buffer is added after that (those held keep serving; a length without
    /// one uploads from pageable memory).
    refused: bool,
}

/// One weight length's buffers and the one the next upload fills.
struct StagingRing {
    buffers: Vec<PinnedHostSlice<f32>>,
    next: usize,
}

/// Buffers per weight length: two let the host copy of one weight overlap the transfer of the one before.
const STAGING_DEPTH: usize = 2;

/// Page-locked staging stops growing here; larger sets of shapes (an eval's LM head beside a 70B block's
/// weights) keep one buffer per length or upload the rest from pageable memory.
const STAGING_CAP_BYTES: usize = 4 << 30;

impl WeightStaging {
    /// The buffer for the next weight of `len` f32: none on a length's first upload, or when its first
    /// buffer would pass the cap or the driver refuses to page-lock it. A second buffer is added on the
    /// length's third upload where the cap and the driver allow; else the one buffer serves every upload.
    fn buffer(
        &mut self,
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        len: usize,
    ) -> Option<&mut PinnedHostSlice<f32>> {
        if len == 0 || self.seen.insert(len) {
            return None;
        }
        let held: usize = self.rings.iter().map(|(l, r)| l * r.buffers.len()).sum();
        let have = self.rings.get(&len).map_or(0, |r| r.buffers.len());
        if !self.refused
            && have < STAGING_DEPTH
            && (held + len) * size_of::<f32>() <= STAGING_CAP_BYTES
        {
            // SAFETY: try_upload_weight writes all len values before each copy reads the buffer.
            match unsafe { ctx.alloc_pinned::<f32>(len) } {
                Ok(b) => {
                    let ring = self.rings.entry(len).or_insert(StagingRing {
                        buffers: Vec::new(),
                        next: 0,
                    });
                    // The new buffer serves this upload; the ones before it follow in turn.
                    ring.next = ring.buffers.len();
                    ring.buffers.push(b);
                }
                Err(_) => self.refused = true,
            }
        }
        let ring = self.rings.get_mut(&len)?;
        let i = ring.next;
        ring.next = (i + 1) % ring.buffers.len();
        ring.buffers.get_mut(i)
    }
}

/// A device view of a tensor: borrowed when it is on the device, else a temporary upload.
pub(super) enum DevRef<'a> {
    Borrowed(&'a CudaSlice<f32>),
    Owned(CudaSlice<f32>),
}

impl Deref for DevRef<'_> {
    type Target = CudaSlice<f32>;
    fn deref(&self) -> &CudaSlice<f32> {
        match self {
            DevRef::Borrowed(s) => s,
            DevRef::Owned(s) => s,
        }
    }
}

fn shape(op: &'static str, msg: String) -> CudaError {
    CudaError::Shape { op, msg }
}

impl CudaBackend {
    pub(super) fn dev<'a>(&self, x: &'a Tensor) -> Result<DevRef<'a>, CudaError> {
        match x {
            Tensor::Device(s) => Ok(DevRef::Borrowed(s)),
            Tensor::Host(v) => Ok(DevRef::Owned(self.upload(v, "upload tensor")?)),
            Tensor::Pinned(p) => {
                self.counters.htod(p.len() * 4);
                Ok(DevRef::Owned(
                    self.stream
                        .clone_htod(p)
                        .map_err(driver("upload pinned tensor"))?,
                ))
            }
        }
    }

    /// `x` as an owned device buffer (moved when it already is one).
    fn owned_dev(&self, x: Tensor) -> Result<CudaSlice<f32>, CudaError> {
        match x {
            Tensor::Device(s) => Ok(s),
            t => match self.dev(&t)? {
                DevRef::Owned(s) => Ok(s),
                DevRef::Borrowed(_) => unreachable!("only device tensors borrow"),
            },
        }
    }

    /// The values of a tensor an op returned, once the stream has run it: the host-slice methods' last step,
    /// so a kernel fault surfaces here, named by `op`.
    pub(super) fn finish(&self, t: Tensor, op: &'static str) -> Result<Vec<f32>, CudaError> {
        match t {
            Tensor::Device(d) => {
                self.counters.dtoh(d.len() * 4);
                self.counters.sync();
                // Into pageable memory: returns when done, and reports a fault of the work before it.
                self.stream.clone_dtoh(&d).map_err(driver(op))
            }
            Tensor::Host(v) => Ok(v),
            Tensor::Pinned(p) => Ok(p.as_slice().map_err(driver(op))?.to_vec()),
        }
    }

    pub fn try_to_host(&self, x: Tensor, pinned: bool) -> Result<Tensor, CudaError> {
        match x {
            Tensor::Device(d) if !pinned => {
                self.counters.dtoh(d.len() * 4);
                self.counters.sync();
                let v = self
                    .stream
                    .clone_dtoh(&d)
                    .map_err(driver("download tensor"))?;
                Ok(Tensor::Host(v))
            }
            Tensor::Device(d) => {
                // Page-locking can be refused (host memory pressure, container limits); a plain vector
                // serves every use of a parked chunk, only its copies are slower.
                let Ok(mut p) = self.alloc_pinned(d.len()) else {
                    return self.try_to_host(Tensor::Device(d), false);
                };
                self.counters.dtoh(d.len() * 4);
                self.counters.sync();
                self.stream
                    .memcpy_dtoh(&d, &mut p)
                    .map_err(driver("park tensor"))?;
                self.stream.synchronize().map_err(driver("park tensor"))?;
                Ok(Tensor::Pinned(p))
            }
            Tensor::Host(v) if pinned => {
                let Ok(mut p) = self.alloc_pinned(v.len()) else {
                    return Ok(Tensor::Host(v));
                };
                p.as_mut_slice()
                    .map_err(driver("park tensor"))?
                    .copy_from_slice(&v);
                Ok(Tensor::Pinned(p))
            }
            t => Ok(t),
        }
    }

    fn alloc_pinned(&self, n: usize) -> Result<cudarc::driver::PinnedHostSlice<f32>, CudaError> {
        // SAFETY: every caller writes all n elements before anything reads them. Flags 0: plain page-locked
        // memory (write-combined memory would make the host's reads of X, e.g. for the resume state, uncached).
        unsafe { self.ctx.alloc_pinned_with_flags::<f32>(n, 0) }
            .map_err(driver("alloc pinned tensor"))
    }

    /// dst ← src (equal lengths), wherever each lives; a device → pinned copy reuses dst's pinned buffer.
    pub fn try_write_back(&self, src: &Tensor, dst: &mut Tensor) -> Result<(), CudaError> {
        if src.len() != dst.len() {
            return Err(shape(
                "write_back",
                format!("src.len={} ≠ dst.len={}", src.len(), dst.len()),
            ));
        }
        match (src, dst) {
            (Tensor::Device(s), Tensor::Device(d)) => {
                self.stream.memcpy_dtod(s, d).map_err(driver("copy tensor"))
            }
            // On the copy stream and without a sync: the copy waits for s's last write, records itself on
            // p's event (every host access to p waits for that), and s's drop waits for the copy's read.
            // So the next chunk's compute is not held up by this one's trip back.
            (Tensor::Device(s), Tensor::Pinned(p)) => {
                self.counters.dtoh(s.len() * 4);
                self.copy_stream
                    .memcpy_dtoh(s, p)
                    .map_err(driver("park tensor"))
            }
            (Tensor::Device(s), Tensor::Host(v)) => {
                self.counters.dtoh(s.len() * 4);
                self.counters.sync();
                self.stream
                    .memcpy_dtoh(s, v)
                    .map_err(driver("download tensor"))
            }
            // The pinned buffer itself goes to the copy (not a slice of it), so cudarc records the copy on
            // its event and a later host write to it waits for the DMA.
            (Tensor::Pinned(p), Tensor::Device(d)) => {
                self.counters.htod(p.len() * 4);
                self.stream
                    .memcpy_htod(p, d)
                    .map_err(driver("upload tensor"))
            }
            (s, Tensor::Device(d)) => {
                let v = s.host().expect("host memory");
                self.counters.htod(v.len() * 4);
                self.stream
                    .memcpy_htod(v, d)
                    .map_err(driver("upload tensor"))
            }
            (s, d) => {
                let v = s.host().expect("host memory");
                d.host_mut().expect("host memory").copy_from_slice(v);
                Ok(())
            }
        }
    }

    /// A weight copied into device memory on `stream`. On the copy stream, a block's weights are uploaded
    /// from the prefetch thread while the main stream computes the previous block (cudarc's event tracking
    /// makes the main stream wait for the copy before a kernel reads it). On the main stream, a weight needed
    /// at once does not queue behind the prefetch's copies, and its drop does not make them wait for the
    /// main stream. The copy's source is page-locked (`WeightStaging`), so the DMA engine reads it directly
    /// at full PCIe rate.
    pub fn try_upload_weight(
        &self,
        w: &[f32],
        stream: &Arc<CudaStream>,
    ) -> Result<Tensor, CudaError> {
        self.counters.htod(w.len() * 4);
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        let Some(buf) = staging.buffer(&self.ctx, w.len()) else {
            // A first upload of this length, over the cap, or page-locking refused: the driver stages the
            // pageable copy itself.
            let d = stream.clone_htod(w).map_err(driver("upload weight"))?;
            return Ok(Tensor::Device(d));
        };
        // as_mut_slice waits for this buffer's previous copy (the last weight of this length). The host copy
        // is the slow half (one core writes ~5-10 GB/s), so it is spread over the rayon pool.
        use rayon::prelude::*;
        buf.as_mut_slice()
            .map_err(driver("wait for the staging buffer"))?
            .par_chunks_mut(1 << 20)
            .zip(w.par_chunks(1 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
        // SAFETY: the copy below writes all w.len() elements before any kernel reads them (stream order).
        let mut d = unsafe { stream.alloc::<f32>(w.len()) }.map_err(driver("alloc weight"))?;
        stream
            .memcpy_htod(buf, &mut d)
            .map_err(driver("upload weight"))?;
        Ok(Tensor::Device(d))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn try_linear_t(
        &self,
        x: &Tensor,
        w: Weight<'_>,
        bias: Option<&[f32]>,
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<Tensor, CudaError> {
        let blas = self
            .blas()
            .map_err(|why| shape("linear", format!("cuBLAS unavailable: {why}")))?;
        let w_len = w.resident.map_or(w.host.len(), Tensor::len);
        if x.len() != m * k || w_len != n * k || bias.is_some_and(|b| b.len() != n) {
            return Err(shape(
                "linear",
                format!(
                    "x.len={}, w.len={w_len}, bias.len={:?} do not match [m={m} × k={k}], [n={n} × k], [n]",
                    x.len(),
                    bias.map(<[f32]>::len)
                ),
            ));
        }
        if m == 0 || n == 0 {
            return Ok(Tensor::Host(Vec::new()));
        }
        let x_d = self.dev(x)?;
        let w_d = match w.resident {
            Some(r) => self.dev(r)?,
            None => DevRef::Owned(self.upload(w.host, "upload w")?),
        };
        let b_d = bias.map(|b| self.upload(b, "upload bias")).transpose()?;
        let mut y = self.output(m * n)?;
        blas.linear(
            &self.ops,
            self.linear_variant,
            &mut y,
            &x_d,
            &w_d,
            b_d.as_ref(),
            m,
            k,
            n,
        )?;
        Ok(Tensor::Device(y))
    }

    /// `packed_linear` on a device-resident X, with the packed tensors already on the device (`resident`, from
    /// `upload_packed`) or uploaded for this call.
    pub fn try_packed_linear_t(
        &self,
        x: &Tensor,
        w: &crate::quant::pack::PackedLinear,
        resident: Option<&super::qgemm::DevicePacked>,
        bias: Option<&[f32]>,
        m: usize,
    ) -> Result<Tensor, CudaError> {
        let (k, n) = (w.d_in, w.d_out);
        if x.len() != m * k || bias.is_some_and(|b| b.len() != n) || k == 0 {
            return Err(shape(
                "packed_linear",
                format!(
                    "x.len={}, bias.len={:?} do not match [m={m} × k={k}], [n={n}] (k ≥ 1)",
                    x.len(),
                    bias.map(<[f32]>::len)
                ),
            ));
        }
        if m == 0 || n == 0 {
            return Ok(Tensor::Host(Vec::new()));
        }
        let uploaded;
        let wd = match resident {
            Some(r) if r.d_out == n && r.d_in == k && r.bits == w.bits => r,
            Some(_) => {
                return Err(shape(
                    "packed_linear",
                    format!(
                        "the resident copy is not this [{n} × {k}] {}-bit linear",
                        w.bits
                    ),
                ));
            }
            None => {
                uploaded = self.upload_packed(w)?;
                &uploaded
            }
        };
        let x_d = self.dev(x)?;
        let b_d = bias.map(|b| self.upload(b, "upload bias")).transpose()?;
        let mut y = self.output(m * n)?;
        let mut scratch = super::qgemm::QgemmScratch::default();
        self.packed_linear_device(
            super::qgemm::auto_variant(m),
            &mut y,
            &x_d,
            wd,
            b_d.as_ref(),
            m,
            &mut scratch,
        )?;
        Ok(Tensor::Device(y))
    }

    pub fn try_rms_norm_t(
        &self,
        x: &Tensor,
        w: &[f32],
        d: usize,
        eps: f32,
    ) -> Result<Tensor, CudaError> {
        if d == 0 || w.len() != d || !x.len().is_multiple_of(d) {
            return Err(shape(
                "rms_norm",
                format!(
                    "x.len={} is not a multiple of d={d}, or w.len={} ≠ d",
                    x.len(),
                    w.len()
                ),
            ));
        }
        if x.is_empty() {
            return Ok(Tensor::Host(Vec::new()));
        }
        let x_d = self.dev(x)?;
        let w_d = self.upload(w, "upload w")?;
        let mut y = self.output(x.len())?;
        ops::launch_rms_norm(
            &self.stream,
            &self.ops,
            self.rms_norm_variant,
            &mut y,
            &x_d,
            &w_d,
            x.len() / d,
            d,
            eps,
        )?;
        Ok(Tensor::Device(y))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn try_rope_t(
        &self,
        x: &mut Tensor,
        t: usize,
        n_heads: usize,
        d_h: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Result<(), CudaError> {
        let half = d_h / 2;
        let width = n_heads * d_h;
        if t == 0 || width == 0 || !x.len().is_multiple_of(t * width) {
            return Err(shape(
                "rope",
                format!("x.len={} is not [n_seq·{t} × {n_heads}·{d_h}]", x.len()),
            ));
        }
        if cos.len() < t * half || sin.len() < t * half {
            return Err(shape(
                "rope",
                format!(
                    "tables cos.len={}, sin.len={} shorter than t={t} × d_h/2={half}",
                    cos.len(),
                    sin.len()
                ),
            ));
        }
        if x.is_empty() || half == 0 {
            return Ok(());
        }
        // The tables first: a failed upload then leaves x as it was. Each forward calls this twice per block
        // with the same tables: they go up once per run (at Gemma 3's d_h = 256 and 128 tokens, 131 KB a
        // call, a third of a small block's weights, when each call uploaded its own).
        let (cos, sin) = (&cos[..t * half], &sin[..t * half]);
        let mut cache = self.rope_tables.lock().unwrap_or_else(|e| e.into_inner());
        let hit = cache.iter().position(|e| e.cos == cos && e.sin == sin);
        let i = match hit {
            Some(i) => i,
            None => {
                let entry = RopeTablesOnDevice {
                    cos_d: self.upload(cos, "upload cos")?,
                    sin_d: self.upload(sin, "upload sin")?,
                    cos: cos.to_vec(),
                    sin: sin.to_vec(),
                };
                if cache.len() == ROPE_TABLES_KEPT {
                    cache.remove(0);
                }
                cache.push(entry);
                cache.len() - 1
            }
        };
        let mut x_d = self.owned_dev(std::mem::take(x))?;
        let r = ops::launch_rope(
            &self.stream,
            &self.ops,
            &mut x_d,
            &cache[i].cos_d,
            &cache[i].sin_d,
            t,
            n_heads,
            d_h,
        );
        *x = Tensor::Device(x_d);
        r
    }

    /// Causal GQA attention on device tensors; `window`: each query sees at most that many keys, itself
    /// included (a sliding-window layer).
    #[allow(clippy::too_many_arguments)]
    pub fn try_causal_attention_t(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        n_seq: usize,
        t: usize,
        h: usize,
        h_kv: usize,
        d_h: usize,
        window: Option<usize>,
    ) -> Result<Tensor, CudaError> {
        if q.len() != n_seq * t * h * d_h || k.len() != n_seq * t * h_kv * d_h || v.len() != k.len()
        {
            return Err(shape(
                "causal_attention",
                format!(
                    "q.len={}, k.len={}, v.len={} do not match n_seq={n_seq}, t={t}, h={h}, h_kv={h_kv}, \
                     d_h={d_h}",
                    q.len(),
                    k.len(),
                    v.len()
                ),
            ));
        }
        if q.is_empty() {
            return Ok(Tensor::Host(Vec::new()));
        }
        // The flash kernels pad the head dim to at most ATTN_MAX_D_H (256); above it the flash variant runs on
        // the CPU (v1 takes any head dim). Here, so the slice and tensor forms share it.
        if self.attention_variant == ops::AttentionVariant::Flash && d_h > ops::ATTN_MAX_D_H {
            let host = |e: anyhow::Error| CudaError::Host {
                op: "causal_attention (CPU, d_h > 256)",
                msg: format!("{e:#}"),
            };
            let o = crate::backend::cpu::attention(
                &self.read(q).map_err(host)?,
                &self.read(k).map_err(host)?,
                &self.read(v).map_err(host)?,
                n_seq,
                (t, h, h_kv, d_h),
                window,
            )
            .map_err(host)?;
            return Ok(Tensor::Device(self.owned_dev(Tensor::Host(o))?));
        }
        let (q_d, k_d, v_d) = (self.dev(q)?, self.dev(k)?, self.dev(v)?);
        let mut o = self.output(q.len())?;
        ops::launch_causal_attention(
            &self.stream,
            &self.ops,
            self.attention_variant,
            &mut o,
            &q_d,
            &k_d,
            &v_d,
            n_seq,
            (t, h, h_kv, d_h),
            window.unwrap_or(t),
        )?;
        Ok(Tensor::Device(o))
    }

    pub fn try_swiglu_t(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor, CudaError> {
        self.try_gated_t(ops::Gated::Silu, gate, up)
    }

    pub fn try_geglu_t(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor, CudaError> {
        self.try_gated_t(ops::Gated::GeluTanh, gate, up)
    }

    fn try_gated_t(
        &self,
        act: ops::Gated,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<Tensor, CudaError> {
        if gate.len() != up.len() {
            return Err(shape(
                "gated activation",
                format!("{act:?}: gate.len={} ≠ up.len={}", gate.len(), up.len()),
            ));
        }
        if gate.is_empty() {
            return Ok(Tensor::Host(Vec::new()));
        }
        let (g_d, u_d) = (self.dev(gate)?, self.dev(up)?);
        let mut o = self.output(gate.len())?;
        ops::launch_gated(&self.stream, &self.ops, act, &mut o, &g_d, &u_d)?;
        Ok(Tensor::Device(o))
    }

    /// The embedding gather on the device, times `scale` (Gemma's √d; 1: none): `ids` go up (4 bytes a token),
    /// X is made where it stays.
    pub fn try_embed_t(
        &self,
        table: &Tensor,
        ids: &[u32],
        d: usize,
        scale: f32,
    ) -> Result<Tensor, CudaError> {
        if d == 0 || !table.len().is_multiple_of(d) {
            return Err(shape(
                "embed",
                format!("table.len={} is not a multiple of d={d}", table.len()),
            ));
        }
        let vocab = table.len() / d;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(shape(
                "embed",
                format!("token id {bad} is outside the table's {vocab} rows"),
            ));
        }
        if ids.is_empty() {
            return Ok(Tensor::Host(Vec::new()));
        }
        let table_d = self.dev(table)?;
        let ids_d = self
            .stream
            .clone_htod(ids)
            .map_err(driver("upload token ids"))?;
        let mut x = self.output(ids.len() * d)?;
        ops::launch_embed(&self.stream, &self.ops, &mut x, &table_d, &ids_d, d, scale)?;
        Ok(Tensor::Device(x))
    }

    /// x · (I ⊗ H_b/√b) by the fast transform (ops.cu block_hadamard), b = h.n ≤ ops::HADAMARD_MAX_B; H_m
    /// (m² values, ±1) goes up once per run: the forward calls this once per block and chunk, and in a
    /// mixture of experts once per expert too.
    pub fn try_block_hadamard_t(
        &self,
        x: &Tensor,
        h: &crate::ops::hadamard::Hadamard,
    ) -> Result<Tensor, CudaError> {
        if x.is_empty() {
            return Ok(Tensor::Host(Vec::new()));
        }
        let x_d = self.dev(x)?;
        let mut cache = self
            .hadamard_small
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let i = match cache.iter().position(|e| e.small == h.small) {
            Some(i) => i,
            None => {
                let small: Vec<f32> = h.small.iter().map(|&v| v as f32).collect();
                let entry = HadamardSmallOnDevice {
                    small_d: self.upload(&small, "upload H_m")?,
                    small: h.small.clone(),
                };
                if cache.len() == HADAMARD_SMALL_KEPT {
                    cache.remove(0);
                }
                cache.push(entry);
                cache.len() - 1
            }
        };
        let mut y = self.output(x.len())?;
        ops::launch_block_hadamard(
            &self.stream,
            &self.ops,
            &mut y,
            &x_d,
            &cache[i].small_d,
            h.m,
            h.p,
        )?;
        Ok(Tensor::Device(y))
    }

    pub fn try_scatter_add_rows_t(
        &self,
        out: &mut Tensor,
        y: &Tensor,
        d: usize,
        rows: &[u32],
        weights: &[f32],
    ) -> Result<(), CudaError> {
        crate::backend::check_scatter(out.len(), y.len(), d, rows, weights)
            .map_err(|e| shape("scatter_add_rows", e.to_string()))?;
        if rows.is_empty() {
            return Ok(());
        }
        let y_d = self.dev(y)?;
        let rows_d = self
            .stream
            .clone_htod(rows)
            .map_err(driver("upload scatter rows"))?;
        let w_d = self
            .stream
            .clone_htod(weights)
            .map_err(driver("upload scatter weights"))?;
        let mut out_d = self.owned_dev(std::mem::take(out))?;
        let r = ops::launch_scatter_add_rows(
            &self.stream,
            &self.ops,
            &mut out_d,
            &y_d,
            &rows_d,
            &w_d,
            d,
        );
        *out = Tensor::Device(out_d);
        r
    }

    /// x += y through the bias-add kernel with one "row" of length x.len().
    pub fn try_add_t(&self, x: &mut Tensor, y: &Tensor) -> Result<(), CudaError> {
        if x.len() != y.len() {
            return Err(shape(
                "add",
                format!("x.len={} ≠ y.len={}", x.len(), y.len()),
            ));
        }
        if x.is_empty() {
            return Ok(());
        }
        let y_d = self.dev(y)?;
        let mut x_d = self.owned_dev(std::mem::take(x))?;
        let n = x_d.len();
        let r = ops::launch_bias_add(&self.stream, &self.ops, &mut x_d, &y_d, n);
        *x = Tensor::Device(x_d);
        r
    }

    /// A device accumulator from a tensor the caller made with `zeros` (uploaded if it is not on the device).
    fn acc_dev<'a>(&self, acc: &'a mut Tensor) -> Result<&'a mut CudaSlice<f32>, CudaError> {
        if !acc.on_device() {
            *acc = Tensor::Device(self.owned_dev(std::mem::take(acc))?);
        }
        match acc {
            Tensor::Device(s) => Ok(s),
            _ => unreachable!("made a device tensor above"),
        }
    }

    pub fn try_xxt_accumulate_t(
        &self,
        acc: &mut Tensor,
        x: &Tensor,
        m: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        if acc.len() != d * d || x.len() != m * d {
            return Err(shape(
                "xxt_accumulate",
                format!("acc.len={} x.len={} for m={m}, d={d}", acc.len(), x.len()),
            ));
        }
        let x_d = self.dev(x)?;
        let acc = self.acc_dev(acc)?;
        self.gram(&mut acc.slice_mut(..), &x_d, m, d, d, 1, 0, 0)
    }

    /// The Gram variant the statistics run with: the selected one, or v2 when cuBLAS is selected but cannot
    /// be opened (said once on stderr by `blas`).
    pub fn xxt_variant_in_use(&self) -> XxtVariant {
        match self.xxt_variant {
            XxtVariant::Cublas if self.blas().is_err() => XxtVariant::Bf16Wmma,
            v => v,
        }
    }

    /// H_z += X_zᵀ X_z for z < batch (`launch_hessian_xxt`'s semantics: X [m × ld] f32, X_z its columns
    /// x_bs·z .. + d, H_z at h_bs·z) with the Gram variant in use; cuBLAS takes a bf16 copy of X, made here.
    #[allow(clippy::too_many_arguments)]
    fn gram(
        &self,
        acc: &mut CudaViewMut<f32>,
        x: &CudaSlice<f32>,
        m: usize,
        d: usize,
        ld: usize,
        batch: usize,
        x_bs: usize,
        h_bs: usize,
    ) -> Result<(), CudaError> {
        match self.xxt_variant_in_use() {
            XxtVariant::Cublas => {
                let blas = self.blas().map_err(|why| shape("gram", why.to_string()))?;
                // SAFETY: launch_f32_to_bf16 writes every element before the Gram reads it.
                let mut xb =
                    unsafe { self.stream.alloc::<u16>(x.len()) }.map_err(driver("alloc bf16 X"))?;
                ops::launch_f32_to_bf16(&self.stream, &self.ops, &mut xb, x)?;
                blas.gram_bf16(acc, &xb.slice(..), m, d, ld, batch, x_bs, h_bs)
            }
            v => launch_hessian_xxt(
                &self.stream,
                &self.quant.hessian,
                v,
                acc,
                &x.slice(..),
                m,
                d,
                ld,
                batch,
                x_bs,
                h_bs,
            ),
        }
    }

    pub fn try_head_covariance_t(
        &self,
        acc: &mut Tensor,
        x: &Tensor,
        m: usize,
        n_heads: usize,
        d_h: usize,
    ) -> Result<(), CudaError> {
        if acc.len() != n_heads * d_h * d_h || x.len() != m * n_heads * d_h {
            return Err(shape(
                "head_covariance",
                format!(
                    "acc.len={} x.len={} for m={m}, n_heads={n_heads}, d_h={d_h}",
                    acc.len(),
                    x.len()
                ),
            ));
        }
        let x_d = self.dev(x)?;
        let acc = self.acc_dev(acc)?;
        self.gram(
            &mut acc.slice_mut(..),
            &x_d,
            m,
            d_h,
            n_heads * d_h,
            n_heads,
            d_h,
            d_h * d_h,
        )
    }

    /// The softmax stats [h × t] and Y [t × d] buffers `queue_v_col_sequence` reuses across sequences.
    pub(super) fn v_col_scratch(&self, s: AttnShape) -> Result<VColScratch, CudaError> {
        Ok(VColScratch {
            stats: self
                .stream
                .alloc_zeros::<f32>(2 * s.h * s.t)
                .map_err(driver("alloc stats"))?,
            y: self.output(s.t * s.d)?,
        })
    }

    /// Queues V's statistics of one sequence (X [t × d], Q, K of it): per query head, Y = A_h X (A_h formed
    /// tile by tile, never stored) and acc[slot(head)] += Yᵀ Y, [d × d] per slot. The slice form keeps a slot
    /// per query head, the tensor form folds heads into their KV head.
    pub(super) fn queue_v_col_sequence(
        &self,
        variant: super::AttnXVariant,
        acc: &mut CudaSlice<f32>,
        slot: impl Fn(usize) -> usize,
        scratch: &mut VColScratch,
        (x, q, k): (&CudaView<f32>, &CudaView<f32>, &CudaView<f32>),
        s: AttnShape,
    ) -> Result<(), CudaError> {
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let window = s.window.unwrap_or(t);
        let hk = &self.quant.hessian;
        launch_softmax_stats(
            &self.stream,
            hk,
            &mut scratch.stats.slice_mut(..),
            q,
            k,
            t,
            h,
            h_kv,
            d_h,
            window,
        )?;
        for head in 0..h {
            launch_attn_x(
                &self.stream,
                hk,
                match variant {
                    // Without cuBLAS (the only way here with v3 selected), v3's kernel-only twin.
                    super::AttnXVariant::Gemm => super::AttnXVariant::Bf16Wmma,
                    v => v,
                },
                AttnXOut::F32(&mut scratch.y.slice_mut(..)),
                x,
                q,
                k,
                &scratch.stats.slice(..),
                head,
                t,
                h,
                h_kv,
                d_h,
                d,
                window,
            )?;
            let g = slot(head);
            self.gram(
                &mut acc.slice_mut(g * d * d..(g + 1) * d * d),
                &scratch.y,
                t,
                d,
                d,
                1,
                0,
                0,
            )?;
        }
        Ok(())
    }

    /// V's statistics of a chunk of `n_seq` sequences with the cuBLAS Gram: per query head, Y = A_h X of every
    /// sequence written in bf16 into one [n_seq·t × d] buffer, then one Gram over all of it into the head's
    /// KV slot (Σ over sequences of YᵀY = Y_allᵀ Y_all: one GEMM with K = n_seq·t instead of n_seq with K = t).
    fn queue_v_col_chunk(
        &self,
        acc: &mut CudaSlice<f32>,
        (x, q, k): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        s: AttnShape,
        n_seq: usize,
    ) -> Result<(), CudaError> {
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let (xs, qs, ks, st) = (t * d, t * h * d_h, t * h_kv * d_h, 2 * h * t);
        let window = s.window.unwrap_or(t);
        let hk = &self.quant.hessian;
        let blas = self
            .blas()
            .map_err(|why| shape("v_col gram", why.to_string()))?;
        let mut stats = self
            .stream
            .alloc_zeros::<f32>(n_seq * st)
            .map_err(driver("alloc stats"))?;
        for i in 0..n_seq {
            launch_softmax_stats(
                &self.stream,
                hk,
                &mut stats.slice_mut(i * st..(i + 1) * st),
                &q.slice(i * qs..(i + 1) * qs),
                &k.slice(i * ks..(i + 1) * ks),
                t,
                h,
                h_kv,
                d_h,
                window,
            )?;
        }
        // SAFETY: attn_x writes every element of each sequence's [t × d] part before the Gram reads it.
        let mut y =
            unsafe { self.stream.alloc::<u16>(n_seq * xs) }.map_err(driver("alloc bf16 Y"))?;
        let gs = h / h_kv;
        for head in 0..h {
            for i in 0..n_seq {
                launch_attn_x(
                    &self.stream,
                    hk,
                    super::AttnXVariant::Bf16Wmma,
                    AttnXOut::Bf16(&mut y.slice_mut(i * xs..(i + 1) * xs)),
                    &x.slice(i * xs..(i + 1) * xs),
                    &q.slice(i * qs..(i + 1) * qs),
                    &k.slice(i * ks..(i + 1) * ks),
                    &stats.slice(i * st..(i + 1) * st),
                    head,
                    t,
                    h,
                    h_kv,
                    d_h,
                    d,
                    window,
                )?;
            }
            let g = head / gs;
            blas.gram_bf16(
                &mut acc.slice_mut(g * d * d..(g + 1) * d * d),
                &y.slice(..),
                n_seq * t,
                d,
                d,
                1,
                0,
                0,
            )?;
        }
        Ok(())
    }

    /// V's statistics of a chunk of `n_seq` sequences, v3 (cuda/hessian.cu attn_probs_bf16): sequences go in
    /// groups whose scores and probabilities fit ~512 MB; per group, X once to bf16, then per query head the
    /// scores S = Q_h K_hᵀ (SGEMM), A = softmax(S/√d_h) (bf16, masked), Y = A X (bf16 GEMM) and the Gram of Y
    /// into the head's KV slot, all batched over the group's sequences.
    fn queue_v_col_gemm(
        &self,
        acc: &mut CudaSlice<f32>,
        (x, q, k): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        s: AttnShape,
        n_seq: usize,
    ) -> Result<(), CudaError> {
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let (xs, qs, ks) = (t * d, t * h * d_h, t * h_kv * d_h);
        let window = s.window.unwrap_or(t);
        let blas = self
            .blas()
            .map_err(|why| shape("v_col (cuBLAS)", why.to_string()))?;
        // f32 scores + bf16 probabilities: 6 bytes per score.
        let group = ((512usize << 20) / (6 * t * t).max(1)).clamp(1, n_seq);
        // SAFETY (the four allocations): each group's conversion, GEMMs and softmax write every element of
        // the part they use before anything reads it.
        let mut xb =
            unsafe { self.stream.alloc::<u16>(group * xs) }.map_err(driver("alloc bf16 X"))?;
        let mut sc =
            unsafe { self.stream.alloc::<f32>(group * t * t) }.map_err(driver("alloc scores"))?;
        let mut pr =
            unsafe { self.stream.alloc::<u16>(group * t * t) }.map_err(driver("alloc probs"))?;
        let mut y =
            unsafe { self.stream.alloc::<u16>(group * xs) }.map_err(driver("alloc bf16 Y"))?;
        let scale = (d_h as f32).sqrt().recip();
        let gs = h / h_kv;
        for z0 in (0..n_seq).step_by(group) {
            let nb = group.min(n_seq - z0);
            ops::launch_f32_to_bf16_view(
                &self.stream,
                &self.ops,
                &mut xb.slice_mut(..nb * xs),
                &x.slice(z0 * xs..(z0 + nb) * xs),
            )?;
            for head in 0..h {
                let kvh = head / gs;
                blas.attn_scores(
                    &mut sc.slice_mut(..nb * t * t),
                    &q.slice(z0 * qs + head * d_h..(z0 + nb) * qs),
                    &k.slice(z0 * ks + kvh * d_h..(z0 + nb) * ks),
                    (t, d_h, nb),
                    (h * d_h, qs),
                    (h_kv * d_h, ks),
                )?;
                launch_attn_probs(
                    &self.stream,
                    &self.quant.hessian,
                    &mut pr.slice_mut(..nb * t * t),
                    &sc.slice(..nb * t * t),
                    (t, nb, window),
                    scale,
                )?;
                blas.attn_times_x_bf16(
                    &mut y.slice_mut(..nb * xs),
                    &pr.slice(..nb * t * t),
                    &xb.slice(..nb * xs),
                    (t, d, nb),
                )?;
                blas.gram_bf16(
                    &mut acc.slice_mut(kvh * d * d..(kvh + 1) * d * d),
                    &y.slice(..nb * xs),
                    nb * t,
                    d,
                    d,
                    1,
                    0,
                    0,
                )?;
            }
        }
        Ok(())
    }

    /// Per sequence and query head: Y = A_h X by `variant`, then acc[kv(head)] += Yᵀ Y — query heads fold
    /// into their KV head on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn try_v_col_covariance_with(
        &self,
        variant: super::AttnXVariant,
        acc: &mut Tensor,
        x: &Tensor,
        q: &Tensor,
        k: &Tensor,
        s: AttnShape,
        n_seq: usize,
    ) -> Result<(), CudaError> {
        let AttnShape {
            t, h, h_kv, d_h, d, ..
        } = s;
        let (xs, qs, ks) = (t * d, t * h * d_h, t * h_kv * d_h);
        if h_kv == 0
            || !h.is_multiple_of(h_kv)
            || d_h > ATTN_MAX_DH
            || acc.len() != h_kv * d * d
            || x.len() != n_seq * xs
            || q.len() != n_seq * qs
            || k.len() != n_seq * ks
        {
            return Err(shape(
                "v_col_covariance",
                format!(
                    "{s:?}, n_seq={n_seq} (d_h ≤ {ATTN_MAX_DH}) with acc.len={}, x.len={}, q.len={}, \
                     k.len={}",
                    acc.len(),
                    x.len(),
                    q.len(),
                    k.len()
                ),
            ));
        }
        if t == 0 || n_seq == 0 {
            return Ok(());
        }
        let (x_d, q_d, k_d) = (self.dev(x)?, self.dev(q)?, self.dev(k)?);
        let acc = self.acc_dev(acc)?;
        let gs = h / h_kv;
        if self.xxt_variant_in_use() == XxtVariant::Cublas {
            match variant {
                super::AttnXVariant::Gemm => {
                    return self.queue_v_col_gemm(acc, (&x_d, &q_d, &k_d), s, n_seq);
                }
                super::AttnXVariant::Bf16Wmma => {
                    return self.queue_v_col_chunk(acc, (&x_d, &q_d, &k_d), s, n_seq);
                }
                super::AttnXVariant::F32Tiled => {}
            }
        }
        let mut scratch = self.v_col_scratch(s)?;
        for i in 0..n_seq {
            self.queue_v_col_sequence(
                variant,
                acc,
                |head| head / gs,
                &mut scratch,
                (
                    &x_d.slice(i * xs..(i + 1) * xs),
                    &q_d.slice(i * qs..(i + 1) * qs),
                    &k_d.slice(i * ks..(i + 1) * ks),
                ),
                s,
            )?;
        }
        Ok(())
    }
}

/// The `Backend` tensor methods of `CudaBackend` (called from its `impl Backend` in mod.rs). As with the
/// slice methods, a CUDA failure panics with the op and shape named, and what only the CPU does (wide heads
/// in the flash kernels, no cuBLAS) goes through the host twin.
pub(super) fn to_device(be: &CudaBackend, x: Tensor) -> crate::ops::Result<Tensor> {
    if x.on_device() {
        return Ok(x);
    }
    let n = x.len();
    be.owned_dev(x)
        .map(Tensor::Device)
        .map_err(|e| anyhow::anyhow!("{} to_device ({n} f32): {e}", be.name))
}

pub(super) fn read<'a>(be: &CudaBackend, x: &'a Tensor) -> crate::ops::Result<Cow<'a, [f32]>> {
    x.read_with(|d| {
        be.counters.dtoh(d.len() * 4);
        be.counters.sync();
        be.stream
            .clone_dtoh(d)
            .map_err(|e| anyhow::anyhow!("{} read ({} f32): {e}", be.name, d.len()))
    })
}

pub(super) fn duplicate(be: &CudaBackend, x: &Tensor) -> crate::ops::Result<Tensor> {
    let r = be.dev(x).and_then(|d| match d {
        DevRef::Borrowed(s) => be.stream.clone_dtod(s).map_err(driver("copy tensor")),
        DevRef::Owned(s) => Ok(s),
    });
    r.map(Tensor::Device)
        .map_err(|e| anyhow::anyhow!("{} duplicate ({} f32): {e}", be.name, x.len()))
}

/// A parked chunk goes up on the copy stream from its own pinned buffer (cudarc records the copy on the
/// buffer's event and on the new slice's write event, which the compute stream waits for before reading it).
pub(super) fn stage(be: &CudaBackend, x: &Tensor) -> crate::ops::Result<Tensor> {
    match x {
        Tensor::Pinned(p) => {
            be.counters.htod(p.len() * 4);
            be.copy_stream
                .clone_htod(p)
                .map(Tensor::Device)
                .map_err(|e| anyhow::anyhow!("{} stage ({} f32): {e}", be.name, x.len()))
        }
        _ => duplicate(be, x),
    }
}

pub(super) fn zeros(be: &CudaBackend, n: usize) -> crate::ops::Result<Tensor> {
    be.stream
        .alloc_zeros::<f32>(n)
        .map(Tensor::Device)
        .map_err(|e| anyhow::anyhow!("{} zeros ({n} f32): {e}", be.name))
}

pub(super) fn linear_t(
    be: &CudaBackend,
    x: &Tensor,
    w: Weight<'_>,
    bias: Option<&[f32]>,
    (m, k, n): (usize, usize, usize),
) -> crate::ops::Result<Tensor> {
    if k == 0 || be.blas().is_err() {
        let y = CpuBackend.linear(&read(be, x)?, w.host, bias, m, k, n)?;
        return to_device(be, Tensor::Host(y));
    }
    be.try_linear_t(x, w, bias, m, k, n)
        .map_err(|e| anyhow::anyhow!("{} linear (m={m}, k={k}, n={n}): {e}", be.name))
}
