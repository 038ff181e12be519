//! Resume state of `boa-cuda run` (design.md §3 e): after every block, the partial output folder
//! `.NAME.partial/` holds, besides the block's shard,
//!
//! ```text
//! resume/state.json      {"format", "fingerprint", "next_block", "activations", "activations_len",
//!                         "layers" (per-layer reports, f64 as bit patterns), "seconds"}
//! resume/x-LLLLL.f32     X_{next_block}: the next block's input activations, raw little-endian f32
//!                        [n_seq·t × d]; absent when no later block needs them (RTN without calibration,
//!                        or past the last quantized layer)
//! ```
//!
//! Order of a checkpoint: the shard is already in place (written under a temporary name and renamed);
//! `x-(l+1).f32` is written to a `.tmp`, fsynced and renamed; then `state.json` the same way; then the folder
//! is fsynced and only then is the previous `x-l.f32` removed. A kill at any point leaves either the old
//! state with its activation file or the new one with its file, never a state naming a missing file.
//! Shards after `next_block` that a killed run may have written are simply rewritten.
//!
//! `--resume` with another `--format` converts the finished blocks' shards (`export::convert`): they are
//! written under `resume/convert/`, then `state.json` names them as `pending` (with the new fingerprint),
//! then each is renamed over its shard, then `pending` is cleared. A kill before the state names them
//! leaves the old state and shards; after, the next load finishes the renames first.
//!
//! The fingerprint is everything that determines the output bytes: the binary's version, the options that
//! matter (not --out, --force, --quiet, --resume, nor the paths of the model and the calibration text, whose
//! contents are fingerprinted instead), the backend, config.json's bytes, every safetensors shard's size and
//! header bytes, and the calibration windows' token ids. Tensor data is not hashed (reading 140 GB to start
//! a resume would defeat it); a weights file rewritten in place with the same header is not detected.

use super::report::{LayerReport, Timings};
use crate::backend::{Backend, Tensor};
use crate::error::file_err;
use crate::export::convert::{convert_shard, has_packed_linears};
use crate::export::gptq_packed::OutFormat;
use crate::export::hf_folder::shard_name;
use crate::model::Model;
use crate::pipeline::options::RunOptions;
use crate::pipeline::quantize_block::LinearReport;
use crate::progress::Progress;
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};

const FORMAT: u32 = 1;
const DIR: &str = "resume";
const STATE: &str = "state.json";

/// Two 64-bit FNV-1a-style hashes (different offsets and multipliers) for 128 bits: detects accidental
/// change, not tampering.
fn hash128(parts: &[&[u8]]) -> String {
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
    for (i, h) in h.iter_mut().enumerate() {
        for p in parts {
            for &b in p.iter() {
                *h ^= b as u64;
                *h = h.wrapping_mul(0x0000_0100_0000_01b3 + 2 * i as u64);
            }
            // Part boundaries count: ["ab", "c"] and ["a", "bc"] hash differently.
            *h ^= 0xff;
            *h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{:016x}{:016x}", h[0], h[1])
}

/// What determines the result of a run (see the module doc).
pub fn fingerprint(
    opts: &RunOptions,
    model: &Model,
    backend: &str,
    calib_ids: Option<&[u32]>,
) -> anyhow::Result<Value> {
    let mut options = serde_json::to_value(opts)?;
    if let Value::Object(m) = &mut options {
        for k in [
            "model",
            "calib",
            "out",
            "force",
            "resume",
            "device",
            "gpu_mem",
            "expert_group",
        ] {
            m.remove(k);
        }
    }
    let cfg_path = model.dir.join("config.json");
    let cfg =
        std::fs::read(&cfg_path).map_err(|e| file_err(&cfg_path, format!("cannot read: {e}")))?;
    let weights: Vec<Value> = model
        .store
        .shard_files()
        .map(|(p, bytes)| {
            // The header was validated at open: 8-byte length, then that many bytes of JSON.
            let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
            json!({
                "file": p.file_name().map(|f| f.to_string_lossy().into_owned()),
                "size": bytes.len(),
                "header": hash128(&[&bytes[..8 + n]]),
            })
        })
        .collect();
    let calib = calib_ids.map(|ids| {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        json!({"tokens": ids.len(), "hash": hash128(&[&bytes])})
    });
    Ok(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "options": options,
        "backend": backend,
        "config.json": hash128(&[&cfg]),
        "weights": weights,
        "calibration": calib,
    }))
}

/// A per-linear report with its floats as bit patterns, so NaN and every last bit survive the JSON.
#[derive(serde::Serialize, serde::Deserialize)]
struct LinearRecord {
    name: String,
    method: String,
    rtn_error: u64,
    error: u64,
    seconds: f64,
    #[serde(default)]
    tokens: Option<usize>,
    /// Absent in states written before --avg-bits: those runs' --wbits, which the fingerprint pins.
    #[serde(default)]
    bits: Option<u32>,
    /// The allocation's predicted errors (f64 bits), under --avg-bits.
    #[serde(default)]
    predicted: Option<Vec<u64>>,
    /// --asym-calib's target move (f64 bits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target_move: Option<u64>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct LayerRecord {
    layer: usize,
    linears: Vec<LinearRecord>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct State {
    format: u32,
    fingerprint: Value,
    next_block: usize,
    activations: Option<String>,
    activations_len: usize,
    layers: Vec<LayerRecord>,
    seconds: Timings,
    /// Converted shards under `resume/convert/` still to be renamed over the finished ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pending: Vec<String>,
}

/// How the resuming run writes its shards: what a finished block in another format is converted to.
pub struct Export<'a> {
    pub format: OutFormat,
    pub bits: u32,
    /// --avg-bits chose each linear's width, or --gguf-type its GGUF type: conversion, which unpacks at
    /// `bits`, is refused.
    pub mixed_bits: bool,
    /// The model's dtype (what fake-quant weights are written in).
    pub dtype: safetensors::Dtype,
    /// Whether block l is quantized (in --layers); the others are copied through, the same in every format.
    pub quantized: &'a dyn Fn(usize) -> bool,
}

/// What a resumed run starts from.
pub struct Saved {
    pub next_block: usize,
    /// X_{next_block}, when a later block needs it.
    pub x: Option<Vec<f32>>,
    pub reports: Vec<LayerReport>,
    pub timings: Timings,
}

fn to_record(r: &LayerReport) -> LayerRecord {
    LayerRecord {
        layer: r.layer,
        linears: r
            .linears
            .iter()
            .map(|l| LinearRecord {
                name: l.name.clone(),
                method: l.method.into(),
                rtn_error: l.rtn_error.to_bits(),
                error: l.error.to_bits(),
                seconds: l.seconds,
                tokens: l.tokens,
                bits: Some(l.bits),
                predicted: l
                    .predicted
                    .as_ref()
                    .map(|p| p.iter().map(|x| x.to_bits()).collect()),
                target_move: l.target_move.map(f64::to_bits),
            })
            .collect(),
    }
}

fn from_record(r: LayerRecord, path: &Path, wbits: u32) -> anyhow::Result<LayerReport> {
    let linears = r
        .linears
        .into_iter()
        .map(|l| {
            let method = match l.method.as_str() {
                "rtn" => "rtn",
                "gptq" => "gptq",
                "boa" => "boa",
                m => {
                    return Err(file_err(
                        path,
                        format!("unknown method {m:?} in the resume state"),
                    ));
                }
            };
            Ok(LinearReport {
                name: l.name,
                method,
                rtn_error: f64::from_bits(l.rtn_error),
                error: f64::from_bits(l.error),
                bits: l.bits.unwrap_or(wbits),
                seconds: l.seconds,
                tokens: l.tokens,
                predicted: l
                    .predicted
                    .map(|p| p.into_iter().map(f64::from_bits).collect()),
                target_move: l.target_move.map(f64::from_bits),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(LayerReport {
        layer: r.layer,
        linears,
    })
}

fn x_name(block: usize) -> String {
    format!("x-{block:05}.f32")
}

/// Writes `bytes` to `path` durably and atomically: a `.tmp` sibling, fsync, rename.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let res = std::fs::File::create(&tmp).and_then(|mut f| {
        write(&mut f)?;
        f.sync_all()
    });
    res.and_then(|()| std::fs::rename(&tmp, path)).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        file_err(path, format!("cannot write the resume state: {e}"))
    })
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| file_err(dir, format!("cannot sync: {e}")))
}

/// What a checkpoint records: X_{next_block} (None when no later block needs it), the reports and timings
/// so far. Taken on the main thread; with X copied to the host (`Activations::Owned`) the run can go on while
/// `persist` writes it on another thread.
pub struct Snapshot<'a> {
    next_block: usize,
    x: Option<Activations<'a>>,
    layers: Vec<LayerRecord>,
    seconds: Timings,
}

/// X as a snapshot holds it: copied out, or still the backend's chunks (read one at a time while written, so
/// all of X is never on the host at once: for a host too short of memory to hold a copy). The chunks are
/// written one after another; `--asym-calib` gives X's and then the FP stream's, and `load` returns them as
/// one vector.
pub enum Activations<'a> {
    Owned(Vec<Vec<f32>>),
    Backend(&'a dyn Backend, Vec<&'a Tensor>),
}

/// Takes the snapshot of a checkpoint that records blocks < `next_block` as done (`x`: X_{next_block} in the
/// backend's chunks), X copied out when `copy`.
pub fn snapshot<'a>(
    next_block: usize,
    x: Option<(&'a dyn Backend, Vec<&'a Tensor>)>,
    reports: &[LayerReport],
    timings: &Timings,
    copy: bool,
) -> anyhow::Result<Snapshot<'a>> {
    let x = match x {
        Some((be, chunks)) if copy => Some(Activations::Owned(
            chunks
                .iter()
                .map(|c| be.read(c).map(std::borrow::Cow::into_owned))
                .collect::<anyhow::Result<_>>()?,
        )),
        Some((be, chunks)) => Some(Activations::Backend(be, chunks)),
        None => None,
    };
    Ok(Snapshot {
        next_block,
        x,
        layers: reports.iter().map(to_record).collect(),
        seconds: timings.clone(),
    })
}

/// A snapshot split by whether another thread may write it.
pub enum Detached<'a> {
    /// Borrows nothing (X copied out, or none).
    Free(Snapshot<'static>),
    /// Still reads X from the backend.
    Streamed(Snapshot<'a>),
}

impl<'a> Snapshot<'a> {
    /// The snapshot as one that borrows nothing, for another thread, when it can be.
    pub fn detach(self) -> Detached<'a> {
        let x = match self.x {
            None => None,
            Some(Activations::Owned(v)) => Some(Activations::Owned(v)),
            Some(b @ Activations::Backend(..)) => {
                return Detached::Streamed(Snapshot { x: Some(b), ..self });
            }
        };
        Detached::Free(Snapshot {
            next_block: self.next_block,
            x,
            layers: self.layers,
            seconds: self.seconds,
        })
    }
}

/// Makes `snap` durable: the shards written so far synced, X written, then the state that names them; the
/// older activation files removed once the new state is durable. An interrupted `persist` leaves the previous
/// state whole (every file goes through a temporary and a rename).
pub fn persist(tmp: &Path, fingerprint: &Value, snap: Snapshot) -> anyhow::Result<()> {
    let dir = tmp.join(DIR);
    std::fs::create_dir_all(&dir).map_err(|e| file_err(&dir, format!("cannot create: {e}")))?;
    // Shards are renamed into place unsynced; sync them before the state says they are done.
    for entry in std::fs::read_dir(tmp).map_err(|e| file_err(tmp, format!("cannot list: {e}")))? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            std::fs::File::open(&p)
                .and_then(|f| f.sync_all())
                .map_err(|e| file_err(&p, format!("cannot sync: {e}")))?;
        }
    }
    let mut x_len = 0;
    let activations = match &snap.x {
        Some(x) => {
            let name = x_name(snap.next_block);
            write_atomic(&dir.join(&name), |f| {
                let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
                let mut put = |values: &[f32]| -> std::io::Result<()> {
                    x_len += values.len();
                    for c in values.chunks(1 << 16) {
                        let b: Vec<u8> = c.iter().flat_map(|v| v.to_le_bytes()).collect();
                        w.write_all(&b)?;
                    }
                    Ok(())
                };
                match x {
                    Activations::Owned(chunks) => chunks.iter().try_for_each(|c| put(c))?,
                    Activations::Backend(be, chunks) => {
                        for chunk in chunks.iter() {
                            let values = be
                                .read(chunk)
                                .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
                            put(&values)?;
                        }
                    }
                }
                w.flush()
            })?;
            Some(name)
        }
        None => None,
    };
    let state = State {
        format: FORMAT,
        fingerprint: fingerprint.clone(),
        next_block: snap.next_block,
        activations: activations.clone(),
        activations_len: x_len,
        layers: snap.layers,
        seconds: snap.seconds,
        pending: Vec::new(),
    };
    write_state(tmp, &state)?;
    // The new state is durable: older activation files are garbage now.
    for entry in std::fs::read_dir(&dir).map_err(|e| file_err(&dir, format!("cannot list: {e}")))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("x-") && Some(&name) != activations.as_ref() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// Writes `state.json` atomically and durably (with the folders that hold it).
fn write_state(tmp: &Path, state: &State) -> anyhow::Result<()> {
    let dir = tmp.join(DIR);
    let text = serde_json::to_string_pretty(state)? + "\n";
    write_atomic(&dir.join(STATE), |f| f.write_all(text.as_bytes()))?;
    sync_dir(&dir)?;
    sync_dir(tmp)
}

/// Whether `tmp` holds a resume state at all.
pub fn exists(tmp: &Path) -> bool {
    tmp.join(DIR).join(STATE).is_file()
}

/// Loads the state under `tmp` after checking it was made by the same inputs; None when there is none. A
/// state that differs only in `--format` has its finished shards converted to `export.format` first.
pub fn load(
    tmp: &Path,
    fingerprint: &Value,
    n_layers: usize,
    export: &Export<'_>,
    progress: &Progress,
) -> anyhow::Result<Option<Saved>> {
    let path = tmp.join(DIR).join(STATE);
    if !path.is_file() {
        return Ok(None);
    }
    let damaged = |why: String| {
        file_err(
            &path,
            format!("the resume state is damaged ({why}); run without --resume to start over"),
        )
    };
    let text = std::fs::read_to_string(&path).map_err(|e| damaged(e.to_string()))?;
    let mut state: State = serde_json::from_str(&text).map_err(|e| damaged(e.to_string()))?;
    if state.format != FORMAT {
        return Err(damaged(format!("format {} is not {FORMAT}", state.format)));
    }
    if state.next_block > n_layers {
        return Err(damaged(format!(
            "next block {} of {n_layers}",
            state.next_block
        )));
    }
    if !state.pending.is_empty() {
        finish_conversion(tmp, &mut state)?;
    }
    if let Some(what) = first_difference(
        &without_format(&state.fingerprint),
        &without_format(fingerprint),
    ) {
        return Err(crate::input_err!(
            "cannot --resume from {}: it was made with a different {what}; run without --resume to start \
             over",
            tmp.display()
        ));
    }
    if state.fingerprint["options"]["format"] != fingerprint["options"]["format"] {
        convert(tmp, &mut state, fingerprint, n_layers, export, progress)?;
    }
    let x = match &state.activations {
        Some(name) => {
            let p = tmp.join(DIR).join(name);
            let bytes = std::fs::read(&p).map_err(|e| damaged(format!("{name}: {e}")))?;
            if bytes.len() != state.activations_len * 4 {
                return Err(damaged(format!(
                    "{name} has {} bytes, expected {}",
                    bytes.len(),
                    state.activations_len * 4
                )));
            }
            Some(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        }
        None => None,
    };
    let reports = state
        .layers
        .into_iter()
        .map(|r| from_record(r, &path, export.bits))
        .collect::<anyhow::Result<_>>()?;
    Ok(Some(Saved {
        next_block: state.next_block,
        x,
        reports,
        timings: state.seconds,
    }))
}

/// A fingerprint without `--format`, which only shapes the export (a changed one is converted).
fn without_format(f: &Value) -> Value {
    let mut f = f.clone();
    if let Some(m) = f.get_mut("options").and_then(Value::as_object_mut) {
        m.remove("format");
    }
    f
}

/// Rewrites the finished quantized blocks' shards of `state` (made with another --format) in
/// `export.format`; see the module doc for the order that survives a kill.
fn convert(
    tmp: &Path,
    state: &mut State,
    fingerprint: &Value,
    n_layers: usize,
    export: &Export<'_>,
    progress: &Progress,
) -> anyhow::Result<()> {
    let then = state.fingerprint["options"]["format"]
        .as_str()
        .and_then(OutFormat::from_name)
        .ok_or_else(|| {
            file_err(
                tmp.join(DIR).join(STATE),
                "the resume state is damaged (no format); run without --resume to start over",
            )
        })?;
    let to = export.format;
    let blocks: Vec<usize> = (0..state.next_block.min(n_layers))
        .filter(|&l| (export.quantized)(l))
        .collect();
    if then == OutFormat::Fake && !blocks.is_empty() {
        return Err(crate::input_err!(
            "cannot --resume from {} with --format {}: it was made with --format fake, which keeps only the \
             dequantized weights, so the integer codes of its {} finished quantized blocks cannot be \
             recovered; resume with --format fake, or run without --resume to start over",
            tmp.display(),
            to.name(),
            blocks.len()
        ));
    }
    if export.mixed_bits && !blocks.is_empty() {
        return Err(crate::input_err!(
            "cannot --resume from {} with --format {}: it was made with --format {} and --avg-bits or \
             --gguf-type, and conversion of per-linear bit widths or GGUF types is not supported; resume \
             with --format {}, or run without --resume to start over",
            tmp.display(),
            to.name(),
            then.name(),
            then.name()
        ));
    }
    if then != to && [then, to].contains(&OutFormat::CompressedTensors) && !blocks.is_empty() {
        // convert_shard reads and writes GPTQ's tensors; compressed-tensors' layout is written only fresh.
        return Err(crate::input_err!(
            "cannot --resume from {} with --format {}: it was made with --format {}, and conversion to or \
             from compressed-tensors is not supported; resume with --format {}, or run without --resume to \
             start over",
            tmp.display(),
            to.name(),
            then.name(),
            then.name()
        ));
    }
    let staging = tmp.join(DIR).join("convert");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)
        .map_err(|e| file_err(&staging, format!("cannot create: {e}")))?;
    let mut pending = Vec::new();
    for l in blocks {
        let name = shard_name(l, n_layers + 1);
        let src = tmp.join(&name);
        if has_packed_linears(&src)? {
            convert_shard(
                &src,
                &staging.join(&name),
                then,
                to,
                export.bits,
                export.dtype,
            )?;
            pending.push(name);
        }
    }
    sync_dir(&staging)?;
    let n = pending.len();
    state.fingerprint = fingerprint.clone();
    state.pending = pending;
    write_state(tmp, state)?;
    finish_conversion(tmp, state)?;
    progress.line(&format!(
        "converted the {n} finished quantized blocks in {} from --format {} to --format {}",
        tmp.display(),
        then.name(),
        to.name()
    ));
    Ok(())
}

/// Moves the converted shards that `state.pending` names over the old ones, then clears `pending`.
fn finish_conversion(tmp: &Path, state: &mut State) -> anyhow::Result<()> {
    let staging = tmp.join(DIR).join("convert");
    for name in &state.pending {
        let from = staging.join(name);
        // Already moved when an earlier attempt was killed after this rename.
        if from.exists() {
            std::fs::rename(&from, tmp.join(name))
                .map_err(|e| file_err(&from, format!("cannot move into place: {e}")))?;
        }
    }
    sync_dir(tmp)?;
    state.pending.clear();
    write_state(tmp, state)?;
    let _ = std::fs::remove_dir_all(&staging);
    Ok(())
}

/// Names, for the user, the first thing that differs between two fingerprints.
fn first_difference(old: &Value, new: &Value) -> Option<String> {
    let keys = [
        "version",
        "backend",
        "options",
        "config.json",
        "weights",
        "calibration",
    ];
    let key = keys.into_iter().find(|k| old.get(k) != new.get(k))?;
    Some(match key {
        "version" => format!("boa-cuda version ({} then)", old["version"]),
        "backend" => format!("backend ({} then, {} now)", old["backend"], new["backend"]),
        "config.json" => "config.json".into(),
        "weights" => "weights file (size or header)".into(),
        "calibration" => {
            "calibration text, --nsamples, --seqlen or --seed (the token ids differ)".into()
        }
        _ => {
            let (a, b) = (&old["options"], &new["options"]);
            let mut names: Vec<&String> = a
                .as_object()
                .into_iter()
                .chain(b.as_object())
                .flat_map(|m| m.keys())
                .collect();
            names.sort();
            names.dedup();
            match names.into_iter().find(|k| a.get(*k) != b.get(*k)) {
                Some(k) => format!(
                    "--{} ({} then, {} now)",
                    k.replace('_', "-"),
                    a.get(k).unwrap_or(&Value::Null),
                    b.get(k).unwrap_or(&Value::Null)
                ),
                None => "options".into(),
            }
        }
    })
}

/// Removes the resume files (before the folder is published).
pub fn clear(tmp: &Path) -> anyhow::Result<()> {
    let dir: PathBuf = tmp.join(DIR);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| file_err(&dir, format!("cannot remove: {e}")))?;
    }
    Ok(())
}

/// Test hooks, run after block `l` (and its checkpoint, if one was due). Not for users.
/// `BOA_TEST_SLOW_BLOCK_MS=N` sleeps N ms, so a test can kill a run between blocks of a model that would
/// otherwise finish before the kill arrives. `BOA_TEST_FAIL_AFTER_BLOCK=L` fails the run after block L, as
/// a full disk or a device error would, now that every input is checked before block 0.
pub fn test_hooks(l: usize) -> anyhow::Result<()> {
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(ms) = var("BOA_TEST_SLOW_BLOCK_MS") {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    if var("BOA_TEST_FAIL_AFTER_BLOCK") == Some(l as u64) {
        return Err(anyhow::anyhow!(
            "a simulated failure after block {l} (BOA_TEST_FAIL_AFTER_BLOCK)"
        ));
    }
    Ok(())
}

/// Test hook: `BOA_TEST_STREAMED_SAVES` set makes every resume save stream X from the backend on the main
/// thread, as a host without room for a copy of X does (the path no test machine takes by itself).
pub fn test_streamed_saves() -> bool {
    std::env::var_os("BOA_TEST_STREAMED_SAVES").is_some()
}

/// Fails when the file system holding `dir` has less room than `need` bytes minus what `dir` already holds
/// (a resumed run has written part of its output).
pub fn check_free_space(dir: &Path, need: u64) -> anyhow::Result<()> {
    let have = dir_bytes(dir);
    let need = need.saturating_sub(have);
    let Some(free) = free_bytes(dir) else {
        return Ok(());
    };
    if free < need {
        let size = |b: u64| {
            if b >= 1 << 30 {
                format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
            } else {
                format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
            }
        };
        return Err(file_err(
            dir,
            format!(
                "not enough free space: the output and its resume checkpoint need about {}, {} are free",
                size(need),
                size(free)
            ),
        ));
    }
    Ok(())
}

fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Bytes available to an unprivileged user on the file system of `dir` (statvfs); None when unknown.
/// `BOA_TEST_FREE_BYTES` overrides it so tests can simulate a full disk.
fn free_bytes(dir: &Path) -> Option<u64> {
    if let Some(v) = std::env::var("BOA_TEST_FREE_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return Some(v);
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `c` is a NUL-terminated path and `st` points to writable memory of the right type; the
        // struct is read only when statvfs reports success.
        let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
        if rc != 0 {
            return None;
        }
        // SAFETY: initialized by the successful call above.
        let st = unsafe { st.assume_init() };
        // The field widths differ between platforms (u32 on some 32-bit ones).
        #[allow(clippy::unnecessary_cast)]
        Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
    }
    #[cfg(not(unix))]
    {
        None
    }
}
