//! Build script (design.md §7, style.md rule 18).
//!
//! 1. Kernels: find nvcc (NVCC, CUDA_HOME/bin, PATH, /usr/local/cuda/bin) and compile every cuda/*.cu, in one
//!    loop, to a fatbin with SASS for sm_80 and sm_90a plus PTX of compute_80 (the driver JIT-compiles that
//!    for any newer arch). ptxas's resource report (registers, stack, spills per kernel and arch) is written to
//!    OUT_DIR/ptxas_report.txt, embedded as `kernels::PTXAS_REPORT`, and summarised as cargo warnings, so
//!    every build that compiles kernels shows it. The fatbins are embedded with include_bytes! through
//!    OUT_DIR/kernels.rs, and `cfg(boa_kernels)` tells Rust they are there.
//!    No nvcc: a CPU-only build with a cargo warning. BOA_REQUIRE_KERNELS=1 makes that, and any nvcc error,
//!    a build failure.
//! 2. Host code: cuda/boa_host.cpp (the include/ headers compiled by a plain C++ compiler through `cc`), so
//!    Rust can call the shared __host__ __device__ functions and check the launch-parameter struct layouts.
//!
//! No CUDA library is linked: cudarc loads libcuda at run time.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Real architectures we ship SASS for (A100 and H100/H200; sm_90a enables wgmma/setmaxnreg), written as
/// -gencode pairs: `-arch=sm_90a` would also run a plain sm_90 pass (HOPPER.md). PTX of the lowest arch
/// comes last so newer GPUs can JIT it.
const GENCODE: &[&str] = &[
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",
];

/// Flags for every .cu: device-only fatbin, optimised, line info for Nsight Compute source views (no
/// run-time cost), ptxas's resource report.
const NVCC_FLAGS: &[&str] = &[
    "-fatbin",
    "-O3",
    "-std=c++17",
    "-lineinfo",
    "-Xptxas",
    "-v",
    "--Werror",
    "all-warnings",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(boa_kernels)");
    println!("cargo::rerun-if-changed=build.rs");
    for var in ["NVCC", "CUDA_HOME", "BOA_REQUIRE_KERNELS"] {
        println!("cargo::rerun-if-env-changed={var}");
    }

    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let require = env::var("BOA_REQUIRE_KERNELS").is_ok_and(|v| v == "1");

    // Every input, named: each file in cuda/ and include/ (the directories too, which also catches files
    // added later).
    let cu_files: Vec<PathBuf> = list(&root.join("cuda"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-changed=include");
    for f in list(&root.join("cuda"))
        .iter()
        .chain(&list(&root.join("include")))
    {
        println!("cargo::rerun-if-changed={}", f.display());
    }

    build_host(&root);

    let kernels = match find_nvcc() {
        Some(nvcc) => {
            // A new nvcc at the same path (an upgrade) rebuilds the kernels. nvcc found on PATH is not
            // re-searched when PATH changes (that would rebuild on every venv activation): set NVCC instead.
            println!("cargo::rerun-if-changed={}", nvcc.display());
            compile_kernels(&nvcc, &root, &out_dir, &cu_files, require)
        }
        None => {
            let looked = "nvcc not found (looked at NVCC, CUDA_HOME/bin, PATH, /usr/local/cuda/bin; \
                          scripts/install_nvcc.sh installs one, then set NVCC=<path>)";
            if require {
                fail(&format!("BOA_REQUIRE_KERNELS=1 but {looked}"));
            }
            println!(
                "cargo::warning={looked}: building without CUDA kernels, the CUDA backend will be unavailable"
            );
            None
        }
    };
    write_kernels_rs(&out_dir, kernels.as_ref());
    if kernels.is_some() {
        println!("cargo::rustc-cfg=boa_kernels");
    }
}

/// Files in `dir`, sorted (so the build is reproducible).
fn list(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.is_file());
    v.sort();
    v
}

/// Stops the build with `msg` (cargo prints a failed build script's stderr).
fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}

/// NVCC (a path to the binary), then CUDA_HOME/bin/nvcc, then nvcc on PATH, then /usr/local/cuda/bin/nvcc.
fn find_nvcc() -> Option<PathBuf> {
    if let Some(p) = env::var_os("NVCC").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
        // An explicit NVCC that does not exist is a mistake, not a reason to fall back silently.
        fail(&format!("NVCC={} does not exist", p.display()));
    }
    let mut candidates = Vec::new();
    if let Some(home) = env::var_os("CUDA_HOME").filter(|p| !p.is_empty()) {
        candidates.push(PathBuf::from(home).join("bin").join("nvcc"));
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    candidates.into_iter().find(|p| p.is_file())
}

/// What was compiled: (stem, fatbin path) per .cu, the ptxas report, the nvcc version line.
struct Kernels {
    fatbins: Vec<(String, PathBuf)>,
    report_path: PathBuf,
    nvcc_version: String,
}

fn compile_kernels(
    nvcc: &Path,
    root: &Path,
    out_dir: &Path,
    cu_files: &[PathBuf],
    require: bool,
) -> Option<Kernels> {
    let nvcc_version = Command::new(nvcc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| l.contains("release"))
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    // The fatbins are embedded in the binary and in every test executable, and gpu_check.sh carries four of
    // those in 64 MiB: nvcc ≥ 12.8 compresses them harder on request. The driver inflates them at load; `size`
    // mode needs driver 550.54+ for CUDA 12 and 580+ for CUDA 13 (which nvcc 13's code needs anyway).
    let compress = release_of(&nvcc_version).is_some_and(|v| v >= (12, 8));
    let include = root.join("include");
    let mut fatbins = Vec::new();
    let mut report = format!("# ptxas resource report ({nvcc_version})\n");
    let fatbin_of = |cu: &Path| {
        let stem = cu.file_stem().unwrap().to_string_lossy().into_owned();
        (out_dir.join(format!("{stem}.fatbin")), stem)
    };
    // All files at once: one nvcc runs its passes one after another, so alone it fills one core (the nine
    // files with these flags: 21 s against 35 s one at a time, idle 2-core Xeon, 2026-12-07).
    let outputs: Vec<std::io::Result<std::process::Output>> = std::thread::scope(|s| {
        let running: Vec<_> = cu_files
            .iter()
            .map(|cu| {
                let mut cmd = Command::new(nvcc);
                cmd.args(NVCC_FLAGS).args(GENCODE);
                if compress {
                    cmd.arg("--compress-mode=size");
                }
                cmd.arg("-I")
                    .arg(&include)
                    .arg("-o")
                    .arg(fatbin_of(cu).0)
                    .arg(cu);
                s.spawn(move || cmd.output())
            })
            .collect();
        running.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (cu, out) in cu_files.iter().zip(outputs) {
        let (fatbin, stem) = fatbin_of(cu);
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                let msg = format!("cannot run {}: {e}", nvcc.display());
                if require {
                    fail(&msg);
                }
                println!("cargo::warning={msg}; building without CUDA kernels");
                return None;
            }
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            let msg = format!("nvcc failed on {}:\n{stderr}", cu.display());
            if require {
                fail(&msg);
            }
            for line in msg.lines() {
                println!("cargo::warning={line}");
            }
            println!(
                "cargo::warning=building without CUDA kernels (BOA_REQUIRE_KERNELS=1 makes this fatal)"
            );
            return None;
        }
        writeln!(report, "## cuda/{stem}.cu\n{stderr}").unwrap();
        for line in summarize_ptxas(&stderr) {
            println!("cargo::warning=ptxas {stem}.cu: {line}");
        }
        fatbins.push((stem, fatbin));
    }
    let report_path = out_dir.join("ptxas_report.txt");
    fs::write(&report_path, report).unwrap();
    println!(
        "cargo::warning=compiled {} CUDA file(s) with {nvcc_version}; full ptxas report: {}",
        fatbins.len(),
        report_path.display()
    );
    Some(Kernels {
        fatbins,
        report_path,
        nvcc_version,
    })
}

/// One line per (kernel, arch) from `ptxas -v` output:
/// "rms_norm_kernel_v2 sm_90a: 32 registers, 0 B stack, 0 B spill stores, 0 B spill loads".
fn summarize_ptxas(stderr: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let (mut func, mut arch, mut frame) = (String::new(), String::new(), String::new());
    for l in stderr.lines() {
        if let Some(rest) = l.split("Compiling entry function '").nth(1) {
            // "rms_norm_kernel_v2' for 'sm_80'" -> ["rms_norm_kernel_v2", " for ", "sm_80", ""]
            let parts: Vec<&str> = rest.split('\'').collect();
            func = parts[0].to_string();
            arch = parts.get(2).unwrap_or(&"").to_string();
        } else if l.contains("bytes stack frame") {
            // "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
            frame = l.trim().replace(" bytes", " B").replace(" frame", "");
        } else if let Some(rest) = l.split("Used ").nth(1) {
            let regs = rest.split(',').next().unwrap_or("").trim();
            lines.push(format!("{func} {arch}: {regs}, {frame}"));
        }
    }
    lines
}

/// OUT_DIR/kernels.rs, included by src/backend/cuda/kernels.rs: the embedded fatbins (empty without nvcc).
fn write_kernels_rs(out_dir: &Path, k: Option<&Kernels>) {
    let mut s = String::from("// Generated by build.rs. Do not edit.\n");
    s += "/// (stem of cuda/<stem>.cu, fatbin) for every compiled .cu file; empty when nvcc was not found.\n";
    s += "pub const FATBINS: &[(&str, &[u8])] = &[\n";
    for (stem, path) in k.map(|k| k.fatbins.as_slice()).unwrap_or_default() {
        writeln!(
            s,
            "    ({stem:?}, include_bytes!({:?})),",
            path.display().to_string()
        )
        .unwrap();
    }
    s += "];\n";
    s += "/// ptxas -v output for every kernel and arch (empty without nvcc).\n";
    match k {
        Some(k) => writeln!(
            s,
            "pub const PTXAS_REPORT: &str = include_str!({:?});",
            k.report_path.display().to_string()
        )
        .unwrap(),
        None => s += "pub const PTXAS_REPORT: &str = \"\";\n",
    }
    let version = k.map(|k| k.nvcc_version.as_str()).unwrap_or("");
    writeln!(
        s,
        "/// `nvcc --version` release line of the compiler that built FATBINS.\npub const NVCC_VERSION: &str = {version:?};"
    )
    .unwrap();
    fs::write(out_dir.join("kernels.rs"), s).unwrap();
}

/// Compiles cuda/boa_host.cpp (the include/ headers seen by a plain C++ compiler) into a static library.
///
/// The host code is built for the same x86-64 level as the Rust code (.cargo/config.toml): the packed GEMM's
/// tile dequantization (include/boa_pack.h) runs here and needs AVX2 to keep up with memory.
/// -ffp-contract=off keeps the compiler from contracting a·b + c into FMAs, so the host rounds exactly as written.
fn build_host(root: &Path) {
    let features = env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    let mut build = cc::Build::new();
    for (feature, flag) in [
        ("avx2", "-mavx2"),
        ("fma", "-mfma"),
        ("bmi2", "-mbmi2"),
        ("f16c", "-mf16c"),
    ] {
        if has(feature) {
            build.flag_if_supported(flag);
        }
    }
    build.flag_if_supported("-ffp-contract=off");
    build
        .cpp(true)
        .std("c++17")
        .include(root.join("include"))
        .file(root.join("cuda").join("boa_host.cpp"))
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .compile("boa_host");
}

/// (major, minor) of nvcc's "Cuda compilation tools, release 13.0, V13.0.88" line.
fn release_of(version_line: &str) -> Option<(u32, u32)> {
    let rest = version_line.split("release ").nth(1)?;
    let (major, rest) = rest.split_once('.')?;
    let minor: String = rest.chars().take_while(char::is_ascii_digit).collect();
    Some((major.trim().parse().ok()?, minor.parse().ok()?))
}
