//! The decoder block of the Llama family (Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM), driven by
//! its description (`model/arch`): RMSNorm → q/k/v (→ per-head q/k RMSNorm) → RoPE → causal GQA attention →
//! o (→ RMSNorm) (+ residual), RMSNorm → SwiGLU or GeGLU MLP (→ RMSNorm) (+ residual). Weights are held in f32 one block at a time; the forward
//! runs on any `Backend` and can record the intermediates the quantizer needs.

use super::arch::{Activation, BlockDesc, NormRole, Role};
use super::config::Config;
use super::packed::{GptqConfig, load_packed_linear};
use super::weights::WeightStore;
use crate::backend::{Backend, PackedResident, Tensor, Weight};
use crate::error::file_err;
use crate::quant::pack::PackedLinear;
use safetensors::Dtype;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A linear layer y = W x (+ b), W [d_out × d_in]: row-major f32 in `w`, or, loaded from a packed GPTQ
/// checkpoint, held packed in `packed` (then `w` is empty and the forward dequantizes tile by tile).
#[derive(Clone, Debug)]
pub struct Linear {
    pub w: Vec<f32>,
    pub b: Option<Vec<f32>>,
    pub d_out: usize,
    pub d_in: usize,
    pub packed: Option<Arc<PackedLinear>>,
}

impl Linear {
    pub fn forward(&self, be: &dyn Backend, x: &[f32], m: usize) -> anyhow::Result<Vec<f32>> {
        match &self.packed {
            Some(p) => be.packed_linear(x, p, self.b.as_deref(), m),
            None => be.linear(x, &self.w, self.b.as_deref(), m, self.d_in, self.d_out),
        }
    }

    /// `forward` on a tensor; `resident` is this weight's copy in the backend's memory, if one was made.
    pub fn forward_t(
        &self,
        be: &dyn Backend,
        x: &Tensor,
        m: usize,
        resident: Option<&Resident>,
    ) -> anyhow::Result<Tensor> {
        let (dense, packed) = match resident {
            Some(Resident::Dense(t)) => (Some(t), None),
            Some(Resident::Packed(p)) => (None, Some(p)),
            None => (None, None),
        };
        let resident = dense;
        match &self.packed {
            Some(p) => be.packed_linear_t(x, p, packed, self.b.as_deref(), m),
            None => be.linear_t(
                x,
                Weight {
                    host: &self.w,
                    resident,
                },
                self.b.as_deref(),
                m,
                self.d_in,
                self.d_out,
            ),
        }
    }
}

/// A block's weights as its description (`Config::block`) lists them: linears and norms in that order.
#[derive(Clone, Debug)]
pub struct BlockWeights {
    /// The layer these are the weights of (its attention window and RoPE may be its own).
    pub layer: usize,
    pub desc: BlockDesc,
    pub linears: Vec<Linear>,
    pub norms: Vec<Vec<f32>>,
    /// An MoE block's router weight [n_experts × d] (never quantized).
    pub router: Option<Vec<f32>>,
    /// An MoE block's shared-expert gate w_g [1 × d] (never quantized).
    pub shared_gate: Option<Vec<f32>>,
    /// The online transform of down_proj's input, I ⊗ Q_b: one block's H_b and Q_b as a linear's weight
    /// [b × b] (`model/online.rs`), one copy shared by every block.
    pub online: Option<Arc<super::online::OnlineQ>>,
}

impl BlockWeights {
    /// The linear with `role`; an error (not a panic) for a block that has none, e.g. a forward of one
    /// architecture handed another's weights.
    pub fn get(&self, role: Role) -> anyhow::Result<&Linear> {
        self.desc
            .linear(role)
            .map(|(i, _)| &self.linears[i])
            .ok_or_else(|| anyhow::anyhow!("the block has no {role:?} linear"))
    }

    pub fn norm(&self, role: NormRole) -> Option<&[f32]> {
        self.desc.norm(role).map(|(i, _)| self.norms[i].as_slice())
    }

    fn required_norm(&self, role: NormRole) -> anyhow::Result<&[f32]> {
        self.norm(role)
            .ok_or_else(|| anyhow::anyhow!("the block has no {role:?} norm"))
    }

    /// (name, linear) in description order.
    pub fn named(&self) -> impl Iterator<Item = (&str, &Linear)> {
        self.desc
            .linears
            .iter()
            .map(|d| d.name.as_str())
            .zip(&self.linears)
    }
}

/// cos/sin of p·θ_i for positions p < t, [t × d_h/2] each (f64 angles, stored f32).
pub struct RopeTable {
    pub t: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(inv_freq: &[f64], t: usize) -> RopeTable {
        let mut cos = Vec::with_capacity(t * inv_freq.len());
        let mut sin = Vec::with_capacity(t * inv_freq.len());
        for p in 0..t {
            for &f in inv_freq {
                // HF computes the angle in f32; do the same so positions far out round identically.
                let a = (p as f32) * (f as f32);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { t, cos, sin }
    }
}

/// The RoPE tables of a model's layers (`Model::rope_tables`).
pub struct RopeTables {
    tables: Vec<RopeTable>,
    of_layer: Vec<usize>,
}

impl RopeTables {
    pub fn layer(&self, l: usize) -> &RopeTable {
        &self.tables[self.of_layer[l.min(self.of_layer.len() - 1)]]
    }
}

/// A linear's weight in a backend's own memory: dense (`Backend::upload_weight`) or packed
/// (`Backend::upload_packed`).
pub enum Resident {
    Dense(Tensor),
    Packed(PackedResident),
}

/// The weights of a block copied into a backend's own memory, in the description's order, so the forward of many
/// chunks copies each weight once. Empty on host backends.
#[derive(Default)]
pub struct ResidentWeights {
    w: Vec<Option<Resident>>,
    /// The online transform's copy (`BlockWeights::online`): once per block, not once per chunk.
    online: Option<Tensor>,
}

impl ResidentWeights {
    /// For a forward that comes later (a prefetch): the copies may overlap other work.
    pub fn upload(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Self::upload_with(be, w, &|_| true, |x| be.upload_weight(x))
    }

    /// `upload` of the linears `keep` marks (description order) and the online transform; the others'
    /// forward reads their host values (an MoE block's experts outside the group a pass holds).
    pub fn upload_some(
        be: &dyn Backend,
        w: &BlockWeights,
        keep: &dyn Fn(usize) -> bool,
    ) -> anyhow::Result<ResidentWeights> {
        Self::upload_with(be, w, keep, |x| be.upload_weight(x))
    }

    /// Uploads the linears `keep` marks that have no copy yet (the next group of experts), for a forward
    /// that comes next.
    pub fn upload_more(
        &mut self,
        be: &dyn Backend,
        w: &BlockWeights,
        keep: &dyn Fn(usize) -> bool,
    ) -> anyhow::Result<()> {
        for (i, l) in w.linears.iter().enumerate() {
            if keep(i)
                && l.packed.is_none()
                && self.get(i).is_none()
                && let Some(t) = be.upload_weight_now(&l.w)?
            {
                self.put(i, t);
            }
        }
        Ok(())
    }

    /// For a forward that comes next (`Backend::upload_weight_now`).
    pub fn upload_now(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Self::upload_with(be, w, &|_| true, |x| be.upload_weight_now(x))
    }

    /// For a forward of many chunks of a loaded block (eval): packed linears too.
    pub fn upload_all(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Ok(ResidentWeights {
            online: match &w.online {
                Some(q) if be.block_hadamard_reads_dense(q.h.n) => be.upload_weight(&q.dense)?,
                _ => None,
            },
            w: w.linears
                .iter()
                .map(|l| {
                    Ok(match &l.packed {
                        Some(p) => be.upload_packed(p)?.map(Resident::Packed),
                        None => be.upload_weight(&l.w)?.map(Resident::Dense),
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    fn upload_with(
        be: &dyn Backend,
        w: &BlockWeights,
        keep: &dyn Fn(usize) -> bool,
        up: impl Fn(&[f32]) -> anyhow::Result<Option<Tensor>>,
    ) -> anyhow::Result<ResidentWeights> {
        Ok(ResidentWeights {
            online: match &w.online {
                Some(q) if be.block_hadamard_reads_dense(q.h.n) => up(&q.dense)?,
                _ => None,
            },
            w: w.linears
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    Ok(match l.packed {
                        Some(_) => None,
                        None if !keep(i) => None,
                        None => up(&l.w)?.map(Resident::Dense),
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    /// Weights already in the backend's memory (description order; None where the forward reads the host
    /// values): the quantized block's Ŵ, which the quantizer left there.
    pub fn from_tensors(w: Vec<Option<Tensor>>, online: Option<Tensor>) -> ResidentWeights {
        ResidentWeights {
            w: w.into_iter().map(|t| t.map(Resident::Dense)).collect(),
            online,
        }
    }

    /// Takes the online transform's copy out (for the quantized block's `from_tensors`).
    pub fn take_online(&mut self) -> Option<Tensor> {
        self.online.take()
    }

    /// Bytes of the online transform's copy (a weight the block uploads besides its linears).
    pub fn online_bytes(&self) -> u64 {
        self.online.as_ref().map_or(0, |t| 4 * t.len() as u64)
    }

    /// Takes linear i's dense copy out (the quantizer reads W where the forward did).
    pub fn take(&mut self, i: usize) -> Option<Tensor> {
        match self.w.get_mut(i).and_then(Option::take) {
            Some(Resident::Dense(t)) => Some(t),
            Some(p) => {
                self.w[i] = Some(p);
                None
            }
            None => None,
        }
    }

    /// Makes `t` linear i's dense copy (the output proxy's Ŵ for one forward, then W again).
    pub fn put(&mut self, i: usize, t: Tensor) {
        if let Some(slot) = self.w.get_mut(i) {
            *slot = Some(Resident::Dense(t));
        }
    }

    fn get(&self, i: usize) -> Option<&Resident> {
        self.w.get(i).and_then(Option::as_ref)
    }
}

/// Intermediates of one block forward that the quantizer's statistics need, where the backend keeps them.
#[derive(Default)]
pub struct BlockTrace {
    /// Input of q/k/v (after the attention RMSNorm) [n_seq·t × d].
    pub x_attn: Tensor,
    /// The queries [n_seq·t × H·d_h] and keys [n_seq·t × H_kv·d_h] the scores read: after RoPE (and before
    /// it, the q/k norm where the block has one).
    pub q: Tensor,
    pub k: Tensor,
    /// Input of o_proj (attention output) [n_seq·t × H·d_h].
    pub attn_out: Tensor,
    /// Input of gate/up (after the MLP RMSNorm) [n_seq·t × d].
    pub x_mlp: Tensor,
    /// Input of down_proj (SwiGLU output) [n_seq·t × d_ff]: the dense MLP's, or an MoE block's shared
    /// expert's; empty in an MoE block without one.
    pub act: Tensor,
    /// An MoE block's experts' inputs on the tokens routed to each, by expert.
    pub experts: Vec<super::moe::ExpertTrace>,
    /// Set before the forward by a statistics pass over one group of an MoE block's experts (the others'
    /// weights are not in the backend's memory): only these experts run, the others' traces stay empty and
    /// the block's output misses their share, which no statistic reads.
    pub experts_only: Option<std::ops::Range<usize>>,
    /// Compute the block's output too, which a statistics pass otherwise skips (no statistic reads it): the
    /// FP stream of `--asym-calib` goes on to the next block.
    pub full: bool,
}

/// Linear `role` of the block on x [m × d_in], its own resident copy when there is one; an error names the
/// module.
fn linear_of(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    role: Role,
    x: &Tensor,
    m: usize,
) -> anyhow::Result<Tensor> {
    use anyhow::Context as _;
    let (i, desc) = w
        .desc
        .linear(role)
        .ok_or_else(|| anyhow::anyhow!("the block has no {role:?} linear"))?;
    let r = resident.and_then(|r| r.get(i));
    w.linears[i]
        .forward_t(be, x, m, r)
        .with_context(|| format!("forward of {}", desc.name))
}

/// The attention's normed input on X [m × d] and W_Q's and W_K's outputs on it, before the q/k norm and
/// RoPE: the start of `block_forward`, and all that BoA's exact row Hessians recompute (pipeline/stats.rs:
/// q and k are the vectors whose norm Jacobian they read).
pub fn attn_projections(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    x: &Tensor,
    m: usize,
) -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    use anyhow::Context as _;
    let xa = be
        .rms_norm_t(x, w.required_norm(NormRole::Attn)?, cfg.d, cfg.eps)
        .context("forward of input_layernorm")?;
    let q = linear_of(be, w, resident, Role::Q, &xa, m)?;
    let k = linear_of(be, w, resident, Role::K, &xa, m)?;
    Ok((xa, q, k))
}

/// One block forward on X [n_seq·t × d], in place, wherever the backend keeps X. `resident` holds copies of
/// the weights in the backend's memory (else each linear reads `w`'s host values). With `trace` (the
/// statistics pass), the intermediates are moved into it and a dense block's MLP output, which no statistic
/// reads, is not computed: x is left after the attention's residual add.
#[allow(clippy::too_many_arguments)]
pub fn block_forward(
    be: &dyn Backend,
    w: &BlockWeights,
    resident: Option<&ResidentWeights>,
    cfg: &Config,
    rope: &RopeTable,
    x: &mut Tensor,
    n_seq: usize,
    trace: Option<&mut BlockTrace>,
) -> anyhow::Result<()> {
    let t = rope.t;
    let m = n_seq * t;
    anyhow::ensure!(
        x.len() == m * cfg.d,
        "block_forward: x is not [n_seq·t={m} × d={}]",
        cfg.d
    );
    let (h, h_kv, d_h) = (cfg.n_heads, cfg.n_kv_heads, cfg.d_h);
    let lin = |role: Role, x: &Tensor| linear_of(be, w, resident, role, x, m);

    // Each step names the module it runs (an error then says where in the block the device failed).
    use anyhow::Context as _;
    let of = |what: &'static str| move || format!("forward of {what}");
    let (xa, mut q, mut k) = attn_projections(be, w, resident, cfg, x, m)?;
    let v = lin(Role::V, &xa)?;
    // Qwen3's per-head norms: rows of d_h, one weight for every head.
    if let Some(g) = w.norm(NormRole::Q) {
        q = be
            .rms_norm_t(&q, g, d_h, cfg.eps)
            .with_context(of("self_attn.q_norm"))?;
    }
    if let Some(g) = w.norm(NormRole::K) {
        k = be
            .rms_norm_t(&k, g, d_h, cfg.eps)
            .with_context(of("self_attn.k_norm"))?;
    }
    be.rope_t(&mut q, t, h, d_h, &rope.cos, &rope.sin)
        .with_context(of("RoPE of the queries"))?;
    be.rope_t(&mut k, t, h_kv, d_h, &rope.cos, &rope.sin)
        .with_context(of("RoPE of the keys"))?;
    let attn = be
        .causal_attention_t(
            &q,
            &k,
            &v,
            n_seq,
            t,
            h,
            h_kv,
            d_h,
            w.desc.window_at(w.layer),
        )
        .with_context(of("the attention (self_attn.o_proj's input)"))?;
    drop(v);
    let mut o = lin(Role::O, &attn)?;
    if let Some(g) = w.norm(NormRole::AttnOut) {
        o = be
            .rms_norm_t(&o, g, cfg.d, cfg.eps)
            .with_context(of("post_attention_layernorm"))?;
    }
    be.add_t(x, &o)
        .with_context(of("the residual add after self_attn.o_proj"))?;
    drop(o);

    let xm = be
        .rms_norm_t(x, w.required_norm(NormRole::Mlp)?, cfg.d, cfg.eps)
        .with_context(of("the MLP's input norm"))?;
    // down_proj was folded with the online transform's inverse: its input (and so its statistics) must be
    // the transformed one, in a dense MLP and in every expert.
    let before_down = |act: Tensor| -> anyhow::Result<Tensor> {
        match &w.online {
            // Q = I ⊗ Q_b: act [n × width] read as [n·width/b × b] rows, each times Q_b.
            Some(q) => be
                .block_hadamard_t(
                    &act,
                    &q.h,
                    Weight {
                        host: &q.dense,
                        resident: resident.and_then(|r| r.online.as_ref()),
                    },
                )
                .with_context(of("the online Hadamard before mlp.down_proj")),
            None => Ok(act),
        }
    };
    let (down, act, experts) = match &w.desc.moe {
        Some(moe) => {
            let router = w
                .router
                .as_deref()
                .context("the MoE block has no router weight")?;
            let expert_lin = |i: usize, x: &Tensor, n: usize| {
                w.linears[i].forward_t(be, x, n, resident.and_then(|r| r.get(i)))
            };
            let gates = super::moe::MoeGates {
                router,
                shared: w.shared_gate.as_deref(),
                before_down: &before_down,
            };
            let out = super::moe::sparse_mlp(
                be,
                &w.desc.linears,
                gates,
                &expert_lin,
                moe,
                &xm,
                m,
                trace.is_some(),
                trace.as_ref().and_then(|t| t.experts_only.clone()),
            )
            .with_context(of("the experts (mlp)"))?;
            (Some(out.y), out.shared_act.unwrap_or_default(), out.experts)
        }
        None => {
            let gate = lin(Role::Gate, &xm)?;
            let up = lin(Role::Up, &xm)?;
            let act = match w.desc.act {
                Activation::Silu => be
                    .swiglu_t(&gate, &up)
                    .with_context(of("SwiGLU (mlp.down_proj's input)"))?,
                Activation::GeluTanh => be
                    .geglu_t(&gate, &up)
                    .with_context(of("GeGLU (mlp.down_proj's input)"))?,
            };
            drop((gate, up));
            let act = before_down(act)?;
            let down = match trace.as_ref().is_some_and(|t| !t.full) {
                true => None,
                false => Some(lin(Role::Down, &act)?),
            };
            (down, act, Vec::new())
        }
    };
    if let Some(mut down) = down {
        if let Some(g) = w.norm(NormRole::MlpOut) {
            down = be
                .rms_norm_t(&down, g, cfg.d, cfg.eps)
                .with_context(of("post_feedforward_layernorm"))?;
        }
        be.add_t(x, &down)
            .with_context(of("the residual add after mlp.down_proj"))?;
    }

    if let Some(tr) = trace {
        *tr = BlockTrace {
            x_attn: xa,
            q,
            k,
            attn_out: attn,
            x_mlp: xm,
            act,
            experts,
            experts_only: tr.experts_only.take(),
            full: tr.full,
        };
    }
    Ok(())
}

/// `block_forward` on host values, for callers that hold X in a plain vector (eval, tests).
pub fn block_forward_host(
    be: &dyn Backend,
    w: &BlockWeights,
    cfg: &Config,
    rope: &RopeTable,
    x: &mut Vec<f32>,
    n_seq: usize,
) -> anyhow::Result<()> {
    let mut xt = be.to_device(Tensor::Host(std::mem::take(x)))?;
    block_forward(be, w, None, cfg, rope, &mut xt, n_seq, None)?;
    *x = match be.to_host(xt, false)? {
        Tensor::Host(v) => v,
        t => be.read(&t)?.into_owned(),
    };
    Ok(())
}

/// The GGUF file a user passed where a folder was expected: `path` itself, or the one `.gguf` beside no
/// config.json in it (a `run --format gguf` output folder).
fn gguf_instead_of_folder(path: &Path) -> Option<PathBuf> {
    let is_gguf = |p: &Path| {
        p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    };
    if path.is_file() {
        return is_gguf(path).then(|| path.to_path_buf());
    }
    if !path.is_dir() || path.join("config.json").exists() {
        return None;
    }
    let mut found = std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && is_gguf(p));
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// A model folder: config, weights (memory-mapped) and the path, with loaders for one block at a time.
pub struct Model {
    pub dir: PathBuf,
    pub cfg: Config,
    pub store: WeightStore,
    /// Set for a packed GPTQ checkpoint: linears with a `qweight` tensor are loaded packed.
    pub gptq: Option<GptqConfig>,
    /// Set for a compressed-tensors pack-quantized checkpoint: linears with a `weight_packed` tensor are
    /// loaded packed.
    pub compressed: Option<super::compressed::CompressedConfig>,
    /// `BlockWeights::online`, built by the first block that needs it (not by `inspect` or `eval`'s setup:
    /// at d_ff 11008 it is 0.48 GB and a second of work).
    online: std::sync::OnceLock<Arc<super::online::OnlineQ>>,
}

impl Model {
    pub fn open(dir: &Path) -> anyhow::Result<Model> {
        if let Some(gguf) = gguf_instead_of_folder(dir) {
            let what = if gguf == dir {
                "a GGUF file, not a Hugging Face model folder"
            } else {
                "holds a GGUF file and no config.json"
            };
            return Err(file_err(
                dir,
                format!(
                    "{what}: convert it first with `boa-cuda import-gguf {} --out DIR` and pass DIR",
                    gguf.display()
                ),
            ));
        }
        if !dir.is_dir() {
            return Err(file_err(dir, "model folder not found"));
        }
        let store = WeightStore::open(dir)?;
        let cfg = Config::load_stored(dir, &|n| store.entry(n).is_some())?;
        let gptq = GptqConfig::load(dir)?;
        let compressed = super::compressed::CompressedConfig::load(dir)?;
        let model = Model {
            dir: dir.to_path_buf(),
            cfg,
            store,
            gptq,
            compressed,
            online: std::sync::OnceLock::new(),
        };
        model.check_globals()?;
        Ok(model)
    }

    /// The online transform's weight (`BlockWeights::online`), made on first use and shared after.
    fn online_weight(&self) -> anyhow::Result<Option<Arc<super::online::OnlineQ>>> {
        let Some(b) = self.cfg.block.online_down else {
            return Ok(None);
        };
        if let Some(w) = self.online.get() {
            return Ok(Some(w.clone()));
        }
        // config.json's parse refused an order with no construction, so this fails only on a bug.
        let w = super::online::OnlineQ::new(b)
            .map_err(|m| file_err(self.dir.join("config.json"), m))?;
        Ok(Some(self.online.get_or_init(|| Arc::new(w)).clone()))
    }

    /// Checks the tensors outside the blocks now, so a broken checkpoint fails before any long work.
    fn check_globals(&self) -> anyhow::Result<()> {
        let c = &self.cfg;
        let check = |name: &str, shape: &[usize]| -> anyhow::Result<()> {
            match self.store.entry(name) {
                // transformers ≥ 5 holds experts fused in memory ([n_experts × 2·d_e × d] gate_up_proj); its
                // save_pretrained writes them per expert, but other tools may store the fused form.
                None if self.cfg.block.moe.is_some()
                    && self
                        .store
                        .names()
                        .any(|n| n.ends_with(".experts.gate_up_proj")) =>
                {
                    Err(file_err(
                        &self.dir,
                        format!(
                            "tensor {name} is missing: the experts are stored fused \
                             (mlp.experts.gate_up_proj / down_proj), which is not supported; save the \
                             model with transformers' save_pretrained, which writes one tensor per expert"
                        ),
                    ))
                }
                None => Err(file_err(&self.dir, format!("tensor {name} is missing"))),
                Some(e) if e.shape != shape => Err(file_err(
                    &self.dir,
                    format!("tensor {name} has shape {:?}, expected {shape:?}", e.shape),
                )),
                // Checked here, not when the block is loaded: a copied-through block would otherwise carry
                // an integer tensor into the output, and a quantized one would fail hours into a run.
                // (Packed GPTQ tensors — qweight, qzeros, g_idx — are integers by design; their loader
                // checks them.)
                Some(e)
                    if (name.ends_with(".weight") || name.ends_with(".bias"))
                        && !matches!(e.dtype, Dtype::F32 | Dtype::F16 | Dtype::BF16) =>
                {
                    Err(file_err(
                        &self.dir,
                        format!(
                            "tensor {name} has dtype {:?}; weights must be F32, F16 or BF16",
                            e.dtype
                        ),
                    ))
                }
                Some(_) => Ok(()),
            }
        };
        check("model.embed_tokens.weight", &[c.vocab, c.d])?;
        check("model.norm.weight", &[c.d])?;
        if !c.tie_word_embeddings {
            check("lm_head.weight", &[c.vocab, c.d])?;
        }
        if self.gptq.is_none()
            && let Some(n) = self.store.names().find(|n| n.ends_with(".qweight"))
        {
            return Err(file_err(
                &self.dir,
                format!(
                    "tensor {n} is packed but the folder has no quantization config \
                     (config.json quantization_config or quantize_config.json)"
                ),
            ));
        }
        for l in 0..c.n_layers {
            for (name, shape) in self.block_shapes(l) {
                check(&name, &shape)?;
            }
        }
        Ok(())
    }

    /// Whether the linear `prefix` (e.g. "model.layers.3.mlp.up_proj") is stored packed (GPTQ or
    /// compressed-tensors).
    pub fn is_packed(&self, prefix: &str) -> bool {
        (self.gptq.is_some() && self.store.contains(&format!("{prefix}.qweight")))
            || self.compressed_scheme(prefix).is_some()
    }

    /// Whether the folder holds a quantized checkpoint (GPTQ or compressed-tensors), which `run` and
    /// `rotate` do not take as input.
    pub fn is_quantized(&self) -> bool {
        self.gptq.is_some() || self.compressed.is_some()
    }

    /// The compressed-tensors scheme the linear `prefix` is stored with; None when it is not stored
    /// compressed.
    fn compressed_scheme(&self, prefix: &str) -> Option<&super::compressed::Scheme> {
        let c = self.compressed.as_ref()?;
        if !self.store.contains(&format!("{prefix}.weight_packed")) {
            return None;
        }
        c.scheme(prefix)
    }

    /// The GPTQ config the packed linear `prefix` is stored with (its `dynamic` override applied); None
    /// when it is not packed.
    fn packed_config(&self, prefix: &str) -> Option<GptqConfig> {
        match &self.gptq {
            Some(q) if self.is_packed(prefix) => q.for_module(prefix),
            _ => None,
        }
    }

    /// Every tensor of block l with its expected shape (a packed linear's g_idx only when stored).
    pub fn block_shapes(&self, l: usize) -> Vec<(String, Vec<usize>)> {
        let desc = &self.cfg.block;
        let p = format!("model.layers.{l}.");
        let mut v: Vec<(String, Vec<usize>)> = desc
            .norms
            .iter()
            .map(|n| (format!("{p}{}.weight", n.name), vec![n.len]))
            .collect();
        if let Some(m) = &desc.moe {
            v.push((
                format!("{p}{}.weight", m.router),
                vec![m.n_experts, self.cfg.d],
            ));
            if let Some(s) = &m.shared_expert {
                v.push((format!("{p}{}.weight", s.gate), vec![1, self.cfg.d]));
            }
        }
        for ld in &desc.linears {
            let prefix = format!("{p}{}", ld.name);
            match (self.compressed_scheme(&prefix), self.packed_config(&prefix)) {
                (Some(sc), _) => {
                    for (suffix, shape) in sc.tensor_shapes(ld.d_out, ld.d_in) {
                        v.push((format!("{prefix}.{suffix}"), shape));
                    }
                }
                (None, Some(q)) => {
                    for (suffix, shape) in q.tensor_shapes(ld.d_out, ld.d_in) {
                        let n = format!("{prefix}.{suffix}");
                        if suffix != "g_idx" || self.store.contains(&n) {
                            v.push((n, shape));
                        }
                    }
                }
                (None, None) => v.push((format!("{prefix}.weight"), vec![ld.d_out, ld.d_in])),
            }
            if ld.bias {
                v.push((format!("{prefix}.bias"), vec![ld.d_out]));
            }
        }
        v
    }

    pub fn load_block(&self, l: usize) -> anyhow::Result<BlockWeights> {
        let desc = &self.cfg.block;
        let p = format!("model.layers.{l}.");
        let lin = |name: &str, d_out: usize, d_in: usize| -> anyhow::Result<Linear> {
            let prefix = format!("{p}{name}");
            let (w, packed) = match (self.compressed_scheme(&prefix), self.packed_config(&prefix)) {
                (Some(sc), _) => {
                    let pl = super::compressed::load_linear(
                        &self.store,
                        &self.dir,
                        sc,
                        &prefix,
                        d_out,
                        d_in,
                    )?;
                    (Vec::new(), Some(Arc::new(pl)))
                }
                (None, Some(q)) => {
                    let pl = load_packed_linear(&self.store, &self.dir, &q, &prefix, d_out, d_in)?;
                    (Vec::new(), Some(Arc::new(pl)))
                }
                _ => (
                    self.store
                        .f32(&format!("{prefix}.weight"), &[d_out, d_in])?,
                    None,
                ),
            };
            let bname = format!("{prefix}.bias");
            let b = if self.store.contains(&bname) {
                Some(self.store.f32(&bname, &[d_out])?)
            } else {
                None
            };
            Ok(Linear {
                w,
                b,
                d_out,
                d_in,
                packed,
            })
        };
        Ok(BlockWeights {
            layer: l,
            desc: desc.clone(),
            linears: desc
                .linears
                .iter()
                .map(|d| lin(&d.name, d.d_out, d.d_in))
                .collect::<anyhow::Result<_>>()?,
            router: match &desc.moe {
                Some(m) => Some(self.store.f32(
                    &format!("{p}{}.weight", m.router),
                    &[m.n_experts, self.cfg.d],
                )?),
                None => None,
            },
            shared_gate: match desc.moe.as_ref().and_then(|m| m.shared_expert.as_ref()) {
                Some(s) => Some(
                    self.store
                        .f32(&format!("{p}{}.weight", s.gate), &[1, self.cfg.d])?,
                ),
                None => None,
            },
            online: self.online_weight()?,
            norms: desc
                .norms
                .iter()
                .map(|n| {
                    let mut g = self.store.f32(&format!("{p}{}.weight", n.name), &[n.len])?;
                    // (offset + w), and the query scale folded into the q norm (both exact in the
                    // forward's f32, as transformers computes them).
                    let scale = if n.role == NormRole::Q {
                        desc.q_scale
                    } else {
                        1.0
                    };
                    if desc.norm_offset != 0.0 || scale != 1.0 {
                        g.iter_mut()
                            .for_each(|v| *v = (*v + desc.norm_offset) * scale);
                    }
                    Ok(g)
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    /// Embedding rows for token ids → [ids.len() × d], read straight from the checkpoint.
    pub fn embed(&self, ids: &[u32]) -> anyhow::Result<Vec<f32>> {
        let c = &self.cfg;
        self.check_ids(ids)?;
        let e = self
            .store
            .entry("model.embed_tokens.weight")
            .expect("checked at open");
        let bytes = self.store.bytes("model.embed_tokens.weight")?;
        let elt = bytes.len() / (c.vocab * c.d);
        let mut out = Vec::with_capacity(ids.len() * c.d);
        for &id in ids {
            let id = id as usize;
            let row = &bytes[id * c.d * elt..(id + 1) * c.d * elt];
            out.extend(super::weights::to_f32(e.dtype, row).map_err(|m| file_err(&self.dir, m))?);
        }
        if let Some(s) = c.block.embed_scale {
            out.iter_mut().for_each(|v| *v *= s);
        }
        Ok(out)
    }

    /// A clear error for a token id the embedding table has no row for (a tokenizer larger than the model).
    pub fn check_ids(&self, ids: &[u32]) -> anyhow::Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.cfg.vocab) {
            Some(id) => Err(crate::input_err!(
                "token id {id} is outside the vocabulary of {}",
                self.cfg.vocab
            )),
            None => Ok(()),
        }
    }

    /// The whole embedding table [vocab × d] in f32, for a backend that gathers rows itself (`embed_t`).
    pub fn embed_table(&self) -> anyhow::Result<Vec<f32>> {
        self.store
            .f32("model.embed_tokens.weight", &[self.cfg.vocab, self.cfg.d])
    }

    /// The final norm's weight as the forward applies it (with the description's offset).
    pub fn final_norm(&self) -> anyhow::Result<Vec<f32>> {
        let mut g = self.store.f32("model.norm.weight", &[self.cfg.d])?;
        let off = self.cfg.block.norm_offset;
        if off != 0.0 {
            g.iter_mut().for_each(|v| *v += off);
        }
        Ok(g)
    }

    /// The output projection [vocab × d] (the embedding matrix when tied).
    pub fn lm_head(&self) -> anyhow::Result<Vec<f32>> {
        if self.cfg.tie_word_embeddings {
            return self.embed_table();
        }
        self.store
            .f32("lm_head.weight", &[self.cfg.vocab, self.cfg.d])
    }

    /// The config's one RoPE table (layer 0's where layers differ).
    pub fn rope_table(&self, t: usize) -> RopeTable {
        RopeTable::new(&self.cfg.inv_freq_for(0), t)
    }

    /// Each layer's RoPE table for windows of t tokens (one table per distinct RoPE).
    pub fn rope_tables(&self, t: usize) -> RopeTables {
        let (mut freqs, mut tables, mut of_layer) = (Vec::new(), Vec::new(), Vec::new());
        for l in 0..self.cfg.n_layers {
            let f = self.cfg.inv_freq_for(l);
            let i = match freqs.iter().position(|g: &Vec<f64>| *g == f) {
                Some(i) => i,
                None => {
                    tables.push(RopeTable::new(&f, t));
                    freqs.push(f);
                    freqs.len() - 1
                }
            };
            of_layer.push(i);
        }
        RopeTables { tables, of_layer }
    }
}
