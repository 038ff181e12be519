//! Errors a user can cause (bad files, bad flags, data too short) are `BoaError`s: the CLI prints them on one
//! line and exits with code 2. Anything else bubbles up through `anyhow` with context naming the file or layer.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BoaError {
    #[error("{0}")]
    Input(String),
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("no CUDA device: {0}")]
    NoCuda(String),
}

/// Shorthand for an input error with a formatted message.
#[macro_export]
macro_rules! input_err {
    ($($arg:tt)*) => { anyhow::Error::new($crate::error::BoaError::Input(format!($($arg)*))) };
}

/// Shorthand for an error about one file.
pub fn file_err(path: impl Into<PathBuf>, msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(BoaError::File {
        path: path.into(),
        msg: msg.into(),
    })
}

/// An error and its causes on one line, `outer: inner: …`, each message once. Some errors print their
/// source inside their own message too (safetensors' `IoError` does), which `{:#}` would repeat: a cause
/// already contained in the message before it is left out.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let m = cause.to_string().replace('\n', " ");
        if !parts.last().is_some_and(|p| p.contains(&m)) {
            parts.push(m);
        }
    }
    parts.join(": ")
}
