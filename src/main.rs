//! The `boa-cuda` command line: parse, call the library, print. Every error is one line on stderr and exit
//! code 2.

use boa_cuda::backend::{Device, select_backend};
use boa_cuda::eval::{EvalOptions, perplexity};
use boa_cuda::model::Model;
use boa_cuda::progress::Progress;
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "boa-cuda",
    version,
    about = "Post-training quantization of Llama-family LLMs (BoA, GPTQ, RTN)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Perplexity of a model on a text: mean next-token NLL over non-overlapping windows, exponentiated.
    Eval {
        /// Model folder (config.json, *.safetensors, tokenizer.json).
        #[arg(long)]
        model: PathBuf,
        /// Text file(s) or folder(s) (a folder's .txt files in name order, joined by blank lines).
        #[arg(long, required = true, num_args = 1..)]
        data: Vec<PathBuf>,
        /// Tokens per window.
        #[arg(long, default_value_t = 512)]
        seqlen: usize,
        /// Evaluate at most this many windows (from the start of the text).
        #[arg(long)]
        max_windows: Option<usize>,
        /// Windows forwarded together through each block.
        #[arg(long, default_value_t = 8)]
        chunk: usize,
        #[arg(long, value_enum, default_value_t = Device::Auto)]
        device: Device,
        /// Print one JSON object {perplexity, tokens, windows, seconds, tokens_per_second} instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Eval {
            model,
            data,
            seqlen,
            max_windows,
            chunk,
            device,
            json,
        } => {
            let progress = Progress::auto(json);
            let (be, note) = select_backend(device)?;
            if let Some(n) = note {
                progress.line(&n);
            }
            let model = Model::open(&model)?;
            let r = perplexity(
                be.as_ref(),
                &model,
                &EvalOptions {
                    data,
                    seqlen,
                    max_windows,
                    chunk,
                },
                &progress,
            )?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "perplexity {:.4} over {} windows × {seqlen} tokens ({:.1} s, {:.0} tokens/s, {})",
                    r.perplexity,
                    r.windows,
                    r.seconds,
                    r.tokens_per_second,
                    be.name()
                );
            }
        }
    }
    Ok(())
}
