//! The ggml tensor decoders (`dequant`, `kquant`) against the `gguf` Python package's
//! `gguf.quants.dequantize`, bit for bit: random blocks of every decodable type, and every tensor of the real
//! Gemma 3 270M Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0, F32; scripts/fetch_gemma3.sh). Plus `import-gguf` on a
//! llama GGUF of K-quant and Q5 tensors, and the K-quant row-length rule.
//!
//! Python: $BOA_PYREF_PYTHON, default ~/.cache/boa-cuda/pyref/bin/python (scripts/install_pyref.sh), running
//! scripts/gguf_reference.py. A missing interpreter or model file fails the test with the command that fixes
//! it; nothing is skipped.

mod common;
use common::gemma3_gguf;
#[path = "common/gguf_writer.rs"]
mod gguf_writer;
use gguf_writer::{Kv, Tensor};

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use boa_cuda::model::gguf::dequant::dequantize;
use boa_cuda::model::gguf::import::unpermute_qk;
use boa_cuda::model::gguf::{GgmlType, GgufFile, OutDType, import_gguf};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The pyref venv's python with `gguf` importable, or a failure that says how to make it.
fn pyref_python() -> PathBuf {
    common::pyref_python("gguf, numpy")
}

/// Byte offsets of the f16 scale fields in one block of `ty` (every other byte is free).
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::F16 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::F32 | GgmlType::BF16 => &[],
        t => panic!("no block recipe for {t}"),
    }
}

/// A random finite f16 (subnormals, ±0 and negatives included), as its bits.
fn finite_f16(rng: &mut ChaCha8Rng) -> u16 {
    loop {
        let b: u16 = rng.random();
        if (b >> 10) & 0x1f != 0x1f {
            return b;
        }
    }
}

/// `n_blocks` blocks of `ty`: the first all-zero payload, the second all-ones (every q at its maximum, every
/// Q3_K hmask bit set), the rest random; scales always finite. F32/BF16 values are finite too.
fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let size = ty.type_size() as usize;
    let mut b = vec![0u8; n_blocks * size];
    for (k, blk) in b.chunks_exact_mut(size).enumerate() {
        match k {
            0 => {}
            1 => blk.fill(0xff),
            _ => rng.fill(blk),
        }
        for &f in f16_fields(ty) {
            blk[f..f + 2].copy_from_slice(&finite_f16(rng).to_le_bytes());
        }
        match ty {
            GgmlType::BF16 if (u16::from_le_bytes([blk[0], blk[1]]) >> 7) & 0xff == 0xff => {
                blk[1] &= 0xbf
            }
            GgmlType::F32
                if (u32::from_le_bytes(blk[..4].try_into().unwrap()) >> 23) & 0xff == 0xff =>
            {
                blk[3] &= 0xbf
            }
            _ => {}
        }
    }
    b
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Per-type comparison result: (tensors, elements, values whose bits differ, max |ours − theirs|).
#[derive(Default)]
struct Diff {
    tensors: usize,
    elements: usize,
    mismatched: usize,
    max_abs: f64,
}

impl Diff {
    fn add(&mut self, ours: &[f32], theirs: &[f32]) {
        assert_eq!(ours.len(), theirs.len());
        self.elements += ours.len();
        for (a, b) in ours.iter().zip(theirs) {
            if a.to_bits() != b.to_bits() {
                self.mismatched += 1;
                self.max_abs = self.max_abs.max((f64::from(*a) - f64::from(*b)).abs());
            }
        }
    }
}

fn print_table(title: &str, rows: &[(GgmlType, Diff)]) {
    eprintln!("{title}");
    eprintln!(
        "{:<6} {:>8} {:>12} {:>10} {:>12}",
        "type", "tensors", "elements", "bits diff", "max |diff|"
    );
    for (ty, d) in rows {
        eprintln!(
            "{:<6} {:>8} {:>12} {:>10} {:>12}",
            ty.to_string(),
            d.tensors,
            d.elements,
            d.mismatched,
            d.max_abs
        );
    }
}

// ---------------------------------------------------------------------------------------------------------

const BLOCK_TYPES: [GgmlType; 13] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

/// 3000 random blocks of each decodable type (more than one rayon task of 1024 blocks, a partial last one),
/// decoded by us and by gguf-py: every value identical to the bit.
#[test]
fn random_blocks_match_gguf_py() {
    let py = pyref_python();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(20);
    let n_blocks = 3000;
    let mut args = vec!["blocks".to_owned()];
    let mut inputs = Vec::new();
    for ty in BLOCK_TYPES {
        let bytes = random_blocks(ty, n_blocks, &mut rng);
        let (src, dst) = (
            dir.path().join(format!("{ty}.bin")),
            dir.path().join(format!("{ty}.f32")),
        );
        std::fs::write(&src, &bytes).unwrap();
        args.extend([
            ty.to_string(),
            src.display().to_string(),
            dst.display().to_string(),
        ]);
        inputs.push((ty, bytes, dst));
    }
    let st = Command::new(&py)
        .arg(repo().join("scripts/gguf_reference.py"))
        .args(&args)
        .status()
        .unwrap();
    assert!(st.success(), "gguf_reference.py blocks failed: {st}");
    let mut rows = Vec::new();
    for (ty, bytes, dst) in inputs {
        let n = n_blocks * ty.block_size() as usize;
        let ours = dequantize("random", ty, &bytes, n).unwrap();
        let theirs = f32s(&std::fs::read(&dst).unwrap());
        let mut d = Diff {
            tensors: 1,
            ..Diff::default()
        };
        d.add(&ours, &theirs);
        rows.push((ty, d));
    }
    print_table(
        &format!("{n_blocks} random blocks per type, ours vs gguf.quants.dequantize:"),
        &rows,
    );
    for (ty, d) in &rows {
        assert_eq!(
            d.mismatched, 0,
            "{ty}: {} of {} values differ from gguf-py (max {})",
            d.mismatched, d.elements, d.max_abs
        );
    }
}

/// Every tensor of Gemma 3 270M Q4_K_M, decoded by us and by gguf-py (streamed through a pipe, one tensor
/// at a time): identical to the bit.
#[test]
fn gemma3_270m_every_tensor_matches_gguf_py() {
    let py = pyref_python();
    let path = gemma3_gguf();
    let g = GgufFile::open(&path).unwrap();
    let mut child = Command::new(&py)
        .arg(repo().join("scripts/gguf_reference.py"))
        .arg("tensors")
        .arg(&path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut r = BufReader::with_capacity(1 << 22, child.stdout.take().unwrap());
    let mut read = |n: usize| -> Vec<u8> {
        let mut b = vec![0u8; n];
        r.read_exact(&mut b)
            .unwrap_or_else(|e| panic!("gguf_reference.py output ended early: {e}"));
        b
    };
    let mut by_type: Vec<(GgmlType, Diff)> = Vec::new();
    for t in &g.tensors {
        let name_len = u32::from_le_bytes(read(4).try_into().unwrap()) as usize;
        let name = String::from_utf8(read(name_len)).unwrap();
        let id = u32::from_le_bytes(read(4).try_into().unwrap());
        let n = u64::from_le_bytes(read(8).try_into().unwrap());
        assert_eq!(
            (name.as_str(), id, n),
            (t.name.as_str(), t.ggml_type.id(), t.n_elements),
            "gguf-py and our reader disagree on a tensor"
        );
        let ours = dequantize(&t.name, t.ggml_type, g.tensor_data(t), n as usize).unwrap();
        let i = match by_type.iter().position(|(ty, _)| *ty == t.ggml_type) {
            Some(i) => i,
            None => {
                by_type.push((t.ggml_type, Diff::default()));
                by_type.len() - 1
            }
        };
        let d = &mut by_type[i].1;
        d.tensors += 1;
        let before = d.mismatched;
        for chunk in ours.chunks(1 << 20) {
            d.add(chunk, &f32s(&read(chunk.len() * 4)));
        }
        assert_eq!(
            d.mismatched - before,
            0,
            "tensor {} ({}): values differ from gguf-py",
            t.name,
            t.ggml_type
        );
    }
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "gguf_reference.py wrote {} bytes past the last tensor",
        rest.len()
    );
    assert!(child.wait().unwrap().success(), "gguf_reference.py failed");
    print_table(
        &format!(
            "{}: every tensor, ours vs gguf.quants.dequantize:",
            path.display()
        ),
        &by_type,
    );
    let types: Vec<GgmlType> = by_type.iter().map(|(t, _)| *t).collect();
    for want in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0] {
        assert!(
            types.contains(&want),
            "{want} missing from the file's types {types:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------------------
// A tiny llama GGUF whose matrices are K-quants and Q5s (d = d_ff = 256, 2 heads of 128, 1 KV head).

/// GGUF bytes from (name, ggml dims fastest first, type, data) through the shared test writer.
fn gguf_bytes(kvs: &[(&str, Kv)], tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)]) -> Vec<u8> {
    let tensors: Vec<Tensor> = tensors
        .iter()
        .map(|(name, dims, ty, data)| Tensor {
            name: name.clone(),
            dims: dims.clone(),
            ty: ty.id(),
            data: data.clone(),
        })
        .collect();
    gguf_writer::gguf_bytes(kvs, &tensors)
}

fn llama_kvs() -> Vec<(&'static str, Kv)> {
    vec![
        ("general.architecture", Kv::Str("llama".into())),
        ("llama.block_count", Kv::U32(1)),
        ("llama.context_length", Kv::U32(256)),
        ("llama.embedding_length", Kv::U32(256)),
        ("llama.feed_forward_length", Kv::U32(256)),
        ("llama.attention.head_count", Kv::U32(2)),
        ("llama.attention.head_count_kv", Kv::U32(1)),
        ("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5)),
        ("tokenizer.ggml.model", Kv::Str("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            Kv::StrArr(["a", "b", "c", "d"].map(String::from).to_vec()),
        ),
        ("tokenizer.ggml.merges", Kv::StrArr(vec![])),
    ]
}

/// import-gguf takes every K-quant and Q5 type: each HF tensor is exactly `dequantize` of its GGUF bytes
/// (q/k un-permuted), the values gguf-py gives (random_blocks_match_gguf_py).
#[test]
fn import_gguf_reads_k_quants() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    // (gguf name, hf name, type, rows, heads to un-permute with); every row has 256 values
    let specs = [
        ("token_embd", "model.embed_tokens", GgmlType::Q4_K, 4, 0),
        ("output_norm", "model.norm", GgmlType::F32, 1, 0),
        (
            "blk.0.attn_q",
            "model.layers.0.self_attn.q_proj",
            GgmlType::Q2_K,
            256,
            2,
        ),
        (
            "blk.0.attn_k",
            "model.layers.0.self_attn.k_proj",
            GgmlType::Q3_K,
            128,
            1,
        ),
        (
            "blk.0.attn_v",
            "model.layers.0.self_attn.v_proj",
            GgmlType::Q5_K,
            128,
            0,
        ),
        (
            "blk.0.attn_output",
            "model.layers.0.self_attn.o_proj",
            GgmlType::Q6_K,
            256,
            0,
        ),
        (
            "blk.0.ffn_gate",
            "model.layers.0.mlp.gate_proj",
            GgmlType::Q5_0,
            256,
            0,
        ),
        (
            "blk.0.ffn_up",
            "model.layers.0.mlp.up_proj",
            GgmlType::Q5_1,
            256,
            0,
        ),
        (
            "blk.0.ffn_down",
            "model.layers.0.mlp.down_proj",
            GgmlType::Q4_K,
            256,
            0,
        ),
        (
            "blk.0.attn_norm",
            "model.layers.0.input_layernorm",
            GgmlType::F32,
            1,
            0,
        ),
        (
            "blk.0.ffn_norm",
            "model.layers.0.post_attention_layernorm",
            GgmlType::F32,
            1,
            0,
        ),
    ];
    let cols = 256;
    let mut tensors = Vec::new();
    let mut expected = Vec::new();
    for (gname, hname, ty, rows, heads) in specs {
        let n = rows * cols;
        let data = random_blocks(ty, n / ty.block_size() as usize, &mut rng);
        let w = dequantize(gname, ty, &data, n).unwrap();
        let w = if heads > 0 {
            unpermute_qk(&w, rows, cols, heads).unwrap()
        } else {
            w
        };
        let dims = if rows == 1 {
            vec![cols as u64]
        } else {
            vec![cols as u64, rows as u64]
        };
        tensors.push((format!("{gname}.weight"), dims, ty, data));
        expected.push((format!("{hname}.weight"), w));
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("kquant.gguf");
    std::fs::write(&src, gguf_bytes(&llama_kvs(), &tensors)).unwrap();
    let out = dir.path().join("hf");
    let s = import_gguf(&src, &out, OutDType::F32).unwrap();
    for ty in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"] {
        assert!(s.source_types.contains_key(ty), "{:?}", s.source_types);
    }
    let st_bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
    assert_eq!(st.len(), expected.len());
    for (name, want) in &expected {
        let got = f32s(st.tensor(name).unwrap().data());
        assert!(
            got.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && got.len() == want.len(),
            "{name}: imported values differ from dequantize"
        );
    }
}

/// A K-quant row must be a whole number of 256-value blocks: Gemma 3's 640-wide rows cannot be Q4_K (its
/// converter falls back to Q5_0 for them), and the reader says so.
#[test]
fn k_quant_row_length_must_be_a_multiple_of_256() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        // 640 × 2 values = 5 whole blocks, so only the row rule refuses it.
        let data = vec![0u8; 5 * ty.type_size() as usize];
        let p = dir.path().join(format!("{ty}.gguf"));
        let t = [("w.weight".to_owned(), vec![640, 2], ty, data)];
        std::fs::write(&p, gguf_bytes(&llama_kvs(), &t)).unwrap();
        let msg = format!("{:#}", GgufFile::open(&p).unwrap_err());
        assert!(
            msg.contains("row length 640")
                && msg.contains(&format!("{ty} block size 256"))
                && !msg.contains('\n'),
            "{msg}"
        );
    }
    // A flat count that is not a whole number of blocks is refused by the decoder itself.
    let e = dequantize("t", GgmlType::Q6_K, &[0; 210], 255).unwrap_err();
    assert!(e.to_string().contains("255 Q6_K values"), "{e}");
}
