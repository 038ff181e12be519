//! GGUF reader and importer on arbitrary bytes: errors are fine, panics and huge allocations are not.
//! The readers take paths (they mmap), so each input goes through a per-process scratch file.
#![no_main]

use boa_cuda::model::gguf::{GgufFile, OutDType, import_gguf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("boa-fuzz-gguf-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let file = dir.join("in.gguf");
    std::fs::write(&file, data).unwrap();
    if GgufFile::open(&file).is_ok() {
        let out = dir.join("out");
        let _ = std::fs::remove_dir_all(&out);
        let _ = import_gguf(&file, &out, OutDType::F32);
    }
});
