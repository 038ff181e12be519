//! Reads the text of one file, a folder (its .txt files in name order), or a list of those, joined by blank
//! lines. Non-UTF-8 bytes are an error naming the file (a silently lossy decode would change the tokens).

use crate::error::file_err;
use std::path::{Path, PathBuf};

/// The files a list of paths names: files as given, folders expanded to their `*.txt` files sorted by name.
pub fn expand(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut inner: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| file_err(p, format!("cannot list: {e}")))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "txt"))
                .collect();
            inner.sort();
            if inner.is_empty() {
                return Err(file_err(p, "folder holds no .txt files"));
            }
            files.extend(inner);
        } else if p.is_file() {
            files.push(p.clone());
        } else {
            return Err(file_err(p, "no such file or folder"));
        }
    }
    if files.is_empty() {
        return Err(crate::input_err!("no text files given"));
    }
    Ok(files)
}

pub fn read_file(path: &Path) -> anyhow::Result<String> {
    let bytes = std::fs::read(path).map_err(|e| file_err(path, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        file_err(
            path,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The concatenated text of `paths` (see `expand`), documents separated by "\n\n".
pub fn read_all(paths: &[PathBuf]) -> anyhow::Result<String> {
    let files = expand(paths)?;
    let mut out = String::new();
    for (i, f) in files.iter().enumerate() {
        if i > 0 {
            out.push_str("\n\n");
        }
        out.push_str(&read_file(f)?);
    }
    Ok(out)
}
