//! The Llama decoder block (Llama 1/2/3, Mistral, Qwen2, SmolLM): RMSNorm → q/k/v → RoPE → causal GQA
//! attention → o (+ residual), RMSNorm → SwiGLU MLP (+ residual). Weights are held in f32 one block at a
//! time; the forward runs on any `Backend` and can record the intermediates the quantizer needs.

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

/// The seven linear layers of a block, in the order the pipeline quantizes them.
pub const LINEAR_NAMES: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

#[derive(Clone, Debug)]
pub struct BlockWeights {
    pub attn_norm: Vec<f32>,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub mlp_norm: Vec<f32>,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl BlockWeights {
    pub fn linear(&self, name: &str) -> &Linear {
        match name {
            "self_attn.q_proj" => &self.q,
            "self_attn.k_proj" => &self.k,
            "self_attn.v_proj" => &self.v,
            "self_attn.o_proj" => &self.o,
            "mlp.gate_proj" => &self.gate,
            "mlp.up_proj" => &self.up,
            "mlp.down_proj" => &self.down,
            _ => panic!("unknown linear layer {name}"),
        }
    }

    pub fn linear_mut(&mut self, name: &str) -> &mut Linear {
        match name {
            "self_attn.q_proj" => &mut self.q,
            "self_attn.k_proj" => &mut self.k,
            "self_attn.v_proj" => &mut self.v,
            "self_attn.o_proj" => &mut self.o,
            "mlp.gate_proj" => &mut self.gate,
            "mlp.up_proj" => &mut self.up,
            "mlp.down_proj" => &mut self.down,
            _ => panic!("unknown linear layer {name}"),
        }
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

/// A linear's weight in a backend's own memory: dense (`Backend::upload_weight`) or packed
/// (`Backend::upload_packed`).
pub enum Resident {
    Dense(Tensor),
    Packed(PackedResident),
}

/// The weights of a block copied into a backend's own memory, in LINEAR_NAMES order, so the forward of many
/// chunks copies each weight once. Empty on host backends.
#[derive(Default)]
pub struct ResidentWeights {
    w: Vec<Option<Resident>>,
}

impl ResidentWeights {
    /// For a forward that comes later (a prefetch): the copies may overlap other work.
    pub fn upload(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Self::upload_with(w, |x| be.upload_weight(x))
    }

    /// For a forward that comes next (`Backend::upload_weight_now`).
    pub fn upload_now(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Self::upload_with(w, |x| be.upload_weight_now(x))
    }

    /// For a forward of many chunks of a loaded block (eval): packed linears too.
    pub fn upload_all(be: &dyn Backend, w: &BlockWeights) -> anyhow::Result<ResidentWeights> {
        Ok(ResidentWeights {
            w: LINEAR_NAMES
                .iter()
                .map(|n| {
                    let l = w.linear(n);
                    Ok(match &l.packed {
                        Some(p) => be.upload_packed(p)?.map(Resident::Packed),
                        None => be.upload_weight(&l.w)?.map(Resident::Dense),
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    fn upload_with(
        w: &BlockWeights,
        up: impl Fn(&[f32]) -> anyhow::Result<Option<Tensor>>,
    ) -> anyhow::Result<ResidentWeights> {
        Ok(ResidentWeights {
            w: LINEAR_NAMES
                .iter()
                .map(|n| {
                    let l = w.linear(n);
                    Ok(match l.packed {
                        Some(_) => None,
                        None => up(&l.w)?.map(Resident::Dense),
                    })
                })
                .collect::<anyhow::Result<_>>()?,
        })
    }

    /// Weights already in the backend's memory (LINEAR_NAMES order; None where the forward reads the host
    /// values): the quantized block's Ŵ, which the quantizer left there.
    pub fn from_tensors(w: Vec<Option<Tensor>>) -> ResidentWeights {
        ResidentWeights {
            w: w.into_iter().map(|t| t.map(Resident::Dense)).collect(),
        }
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

    fn get(&self, i: usize) -> Option<&Resident> {
        self.w.get(i).and_then(Option::as_ref)
    }
}

/// Intermediates of one block forward that the quantizer's statistics need, where the backend keeps them.
#[derive(Default)]
pub struct BlockTrace {
    /// Input of q/k/v (after the attention RMSNorm) [n_seq·t × d].
    pub x_attn: Tensor,
    /// Post-RoPE queries [n_seq·t × H·d_h] and keys [n_seq·t × H_kv·d_h].
    pub q: Tensor,
    pub k: Tensor,
    /// Input of o_proj (attention output) [n_seq·t × H·d_h].
    pub attn_out: Tensor,
    /// Input of gate/up (after the MLP RMSNorm) [n_seq·t × d].
    pub x_mlp: Tensor,
    /// Input of down_proj (SwiGLU output) [n_seq·t × d_ff].
    pub act: Tensor,
}

/// One block forward on X [n_seq·t × d], in place, wherever the backend keeps X. `resident` holds copies of
/// the weights in the backend's memory (else each linear reads `w`'s host values). With `trace`, the
/// intermediates are moved into it.
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
    let r = |i: usize| resident.and_then(|r| r.get(i));

    // Each step names the module it runs (an error then says where in the block the device failed).
    use anyhow::Context as _;
    let of = |what: &'static str| move || format!("forward of {what}");
    let xa = be
        .rms_norm_t(x, &w.attn_norm, cfg.d, cfg.eps)
        .with_context(of("input_layernorm"))?;
    let mut q =
        w.q.forward_t(be, &xa, m, r(0))
            .with_context(of(LINEAR_NAMES[0]))?;
    let mut k =
        w.k.forward_t(be, &xa, m, r(1))
            .with_context(of(LINEAR_NAMES[1]))?;
    let v =
        w.v.forward_t(be, &xa, m, r(2))
            .with_context(of(LINEAR_NAMES[2]))?;
    be.rope_t(&mut q, t, h, d_h, &rope.cos, &rope.sin)
        .with_context(of("RoPE of self_attn.q_proj's output"))?;
    be.rope_t(&mut k, t, h_kv, d_h, &rope.cos, &rope.sin)
        .with_context(of("RoPE of self_attn.k_proj's output"))?;
    let attn = be
        .causal_attention_t(&q, &k, &v, n_seq, t, h, h_kv, d_h)
        .with_context(of("the attention (self_attn.o_proj's input)"))?;
    drop(v);
    let o =
        w.o.forward_t(be, &attn, m, r(3))
            .with_context(of(LINEAR_NAMES[3]))?;
    be.add_t(x, &o)
        .with_context(of("the residual add after self_attn.o_proj"))?;
    drop(o);

    let xm = be
        .rms_norm_t(x, &w.mlp_norm, cfg.d, cfg.eps)
        .with_context(of("post_attention_layernorm"))?;
    let gate = w
        .gate
        .forward_t(be, &xm, m, r(4))
        .with_context(of(LINEAR_NAMES[4]))?;
    let up =
        w.up.forward_t(be, &xm, m, r(5))
            .with_context(of(LINEAR_NAMES[5]))?;
    let act = be
        .swiglu_t(&gate, &up)
        .with_context(of("SwiGLU (mlp.down_proj's input)"))?;
    drop((gate, up));
    let down = w
        .down
        .forward_t(be, &act, m, r(6))
        .with_context(of(LINEAR_NAMES[6]))?;
    be.add_t(x, &down)
        .with_context(of("the residual add after mlp.down_proj"))?;

    if let Some(tr) = trace {
        *tr = BlockTrace {
            x_attn: xa,
            q,
            k,
            attn_out: attn,
            x_mlp: xm,
            act,
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

/// A model folder: config, weights (memory-mapped) and the path, with loaders for one block at a time.
pub struct Model {
    pub dir: PathBuf,
    pub cfg: Config,
    pub store: WeightStore,
    /// Set for a packed GPTQ checkpoint: linears with a `qweight` tensor are loaded packed.
    pub gptq: Option<GptqConfig>,
}

impl Model {
    pub fn open(dir: &Path) -> anyhow::Result<Model> {
        if !dir.is_dir() {
            return Err(file_err(dir, "model folder not found"));
        }
        let cfg = Config::load(dir)?;
        let store = WeightStore::open(dir)?;
        let gptq = GptqConfig::load(dir)?;
        let model = Model {
            dir: dir.to_path_buf(),
            cfg,
            store,
            gptq,
        };
        model.check_globals()?;
        Ok(model)
    }

    /// Checks the tensors outside the blocks now, so a broken checkpoint fails before any long work.
    fn check_globals(&self) -> anyhow::Result<()> {
        let c = &self.cfg;
        let check = |name: &str, shape: &[usize]| -> anyhow::Result<()> {
            match self.store.entry(name) {
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

    /// Whether the linear `prefix` (e.g. "model.layers.3.mlp.up_proj") is stored packed.
    pub fn is_packed(&self, prefix: &str) -> bool {
        self.gptq.is_some() && self.store.contains(&format!("{prefix}.qweight"))
    }

    /// Every tensor of block l with its expected shape (a packed linear's g_idx only when stored).
    pub fn block_shapes(&self, l: usize) -> Vec<(String, Vec<usize>)> {
        let c = &self.cfg;
        let p = format!("model.layers.{l}.");
        let (qd, kvd) = (c.n_heads * c.d_h, c.n_kv_heads * c.d_h);
        let mut v = vec![
            (format!("{p}input_layernorm.weight"), vec![c.d]),
            (format!("{p}post_attention_layernorm.weight"), vec![c.d]),
        ];
        for (name, d_out, d_in) in self.linear_shapes() {
            match &self.gptq {
                Some(q) if self.is_packed(&format!("{p}{name}")) => {
                    for (suffix, shape) in q.tensor_shapes(d_out, d_in) {
                        let n = format!("{p}{name}.{suffix}");
                        if suffix != "g_idx" || self.store.contains(&n) {
                            v.push((n, shape));
                        }
                    }
                }
                _ => v.push((format!("{p}{name}.weight"), vec![d_out, d_in])),
            }
            if c.qkv_bias
                && matches!(
                    name,
                    "self_attn.q_proj" | "self_attn.k_proj" | "self_attn.v_proj"
                )
            {
                v.push((
                    format!("{p}{name}.bias"),
                    vec![if name == "self_attn.q_proj" { qd } else { kvd }],
                ));
            }
        }
        v
    }

    /// (name, d_out, d_in) of the seven linear layers of a block.
    pub fn linear_shapes(&self) -> [(&'static str, usize, usize); 7] {
        let c = &self.cfg;
        let (qd, kvd) = (c.n_heads * c.d_h, c.n_kv_heads * c.d_h);
        [
            (LINEAR_NAMES[0], qd, c.d),
            (LINEAR_NAMES[1], kvd, c.d),
            (LINEAR_NAMES[2], kvd, c.d),
            (LINEAR_NAMES[3], c.d, qd),
            (LINEAR_NAMES[4], c.d_ff, c.d),
            (LINEAR_NAMES[5], c.d_ff, c.d),
            (LINEAR_NAMES[6], c.d, c.d_ff),
        ]
    }

    pub fn load_block(&self, l: usize) -> anyhow::Result<BlockWeights> {
        let c = &self.cfg;
        let p = format!("model.layers.{l}.");
        let lin = |name: &str, d_out: usize, d_in: usize| -> anyhow::Result<Linear> {
            let prefix = format!("{p}{name}");
            let (w, packed) = match &self.gptq {
                Some(q) if self.is_packed(&prefix) => {
                    let pl = load_packed_linear(&self.store, &self.dir, q, &prefix, d_out, d_in)?;
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
        let [q, k, v, o, gate, up, down] = self
            .linear_shapes()
            .map(|(n, d_out, d_in)| lin(n, d_out, d_in));
        Ok(BlockWeights {
            attn_norm: self
                .store
                .f32(&format!("{p}input_layernorm.weight"), &[c.d])?,
            q: q?,
            k: k?,
            v: v?,
            o: o?,
            mlp_norm: self
                .store
                .f32(&format!("{p}post_attention_layernorm.weight"), &[c.d])?,
            gate: gate?,
            up: up?,
            down: down?,
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

    pub fn final_norm(&self) -> anyhow::Result<Vec<f32>> {
        self.store.f32("model.norm.weight", &[self.cfg.d])
    }

    /// The output projection [vocab × d] (the embedding matrix when tied).
    pub fn lm_head(&self) -> anyhow::Result<Vec<f32>> {
        if self.cfg.tie_word_embeddings {
            return self.embed_table();
        }
        self.store
            .f32("lm_head.weight", &[self.cfg.vocab, self.cfg.d])
    }

    pub fn rope_table(&self, t: usize) -> RopeTable {
        RopeTable::new(&self.cfg.inv_freq(), t)
    }
}
