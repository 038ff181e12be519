//! The packed GPTQ checkpoint loader (`model::packed`: the quantization config, qweight/qzeros/scales/g_idx
//! shapes, dtypes and g_idx values) through `Model::open`, every block loader and `inspect`, on arbitrary
//! bytes: the first block's shard of a tiny 3-bit gptq_v2 checkpoint, or (input starting with `{`) its
//! quantize_config.json. Errors are fine, panics and huge allocations are not.
#![no_main]

use boa_cuda::backend::{Device, GemmPrecision};
use boa_cuda::export::gptq_packed::OutFormat;
use boa_cuda::model::Model;
use boa_cuda::model::synth::{SynthSpec, write_model};
use boa_cuda::pipeline::options::{
    GroupSize, Method, MoeHessian, QkNormHessian, RunOptions, ScaleSearchArg, VRowHessian,
};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A tiny model quantized once per process (RTN, 3 bits, groups of 32, gptq_v2).
fn checkpoint() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("boa-fuzz-packed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let m = root.join("model");
        write_model(&m, &SynthSpec::tiny()).unwrap();
        let out = root.join("q");
        let opts = RunOptions {
            model: m,
            calib: Vec::new(),
            out: out.clone(),
            method: Method::Rtn,
            wbits: 3,
            bits: None,
            group_size: GroupSize::Columns(32),
            sym: false,
            act_order: false,
            act_order_row: false,
            static_groups: false,
            scale_search: ScaleSearchArg::Minmax,
            v_row_hessian: VRowHessian::Identity,
            qk_norm_hessian: QkNormHessian::Diag,
            boa_on: None,
            moe_hessian: MoeHessian::Tokens,
            moe_min_tokens: 64,
            nsamples: 1,
            seqlen: 2,
            seed: 0,
            damp: 0.01,
            layers: None,
            device: Device::Cpu,
            gemm: GemmPrecision::F32,
            gpu_mem: None,
            expert_group: None,
            force: false,
            resume: false,
            format: OutFormat::GptqV2,
            rotate: None,
            gguf_type: None,
            signed_scales: false,
            refit_scales: false,
            asym_calib: None,
            profile: false,
        };
        boa_cuda::pipeline::run(&opts, &boa_cuda::progress::Progress::Quiet).unwrap();
        // quantize_config.json is read only when config.json has no quantization_config.
        let cfg = out.join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
        v.as_object_mut().unwrap().remove("quantization_config");
        std::fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
        out
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = checkpoint();
    let shard = dir.join("model-00001-of-00003.safetensors");
    let qc = dir.join("quantize_config.json");
    static GOOD: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    let (good_shard, good_qc) =
        GOOD.get_or_init(|| (std::fs::read(&shard).unwrap(), std::fs::read(&qc).unwrap()));
    let (s, q) = if data.first() == Some(&b'{') {
        (&good_shard[..], data)
    } else {
        (data, &good_qc[..])
    };
    std::fs::write(&shard, s).unwrap();
    std::fs::write(&qc, q).unwrap();
    if let Ok(model) = Model::open(dir) {
        for l in 0..model.cfg.n_layers {
            let _ = model.load_block(l);
        }
        let _ = boa_cuda::model::packed::inspect(dir);
    }
});
