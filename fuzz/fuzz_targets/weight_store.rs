//! The safetensors opener (WeightStore via Model::open) and the block/global loaders on arbitrary
//! `model.safetensors` bytes next to a valid config.json of the tiny synthetic model.
#![no_main]

use boa_cuda::model::Model;
use boa_cuda::model::synth::{SynthSpec, write_model};
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn model_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("boa-fuzz-st-{}", std::process::id()));
        write_model(&d, &SynthSpec::tiny()).unwrap();
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = model_dir();
    std::fs::write(dir.join("model.safetensors"), data).unwrap();
    if let Ok(model) = Model::open(dir) {
        for l in 0..model.cfg.n_layers {
            let _ = model.load_block(l);
        }
        let _ = model.embed(&[0, 1, 255]);
        let _ = model.lm_head();
    }
});
